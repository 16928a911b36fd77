//! Real captures shipped inside the crate (small enough to embed).

/// A real docs/SPEC.md §8 capture: SmolLM2-135M-Instruct (Q4_1), layers 4, 14 and 24, N = 2048 tokens
/// of the Python 3.11 documentation (eval split), 16 query positions, f16, with the model's own
/// attention output `o`. Provenance: `tests/data/PROVENANCE.md`.
pub const SMOLLM2_PROSE_EVAL_2K: &[u8] =
    include_bytes!("../tests/data/smollm2-prose-eval-2k.safetensors");
