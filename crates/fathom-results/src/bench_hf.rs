//! The `bench-hf` document: `python -m fathom.bench_hf` (the `fathom` wheel), a transformers
//! model decoding greedily through transformers' own caches (`dynamic`, `offloaded`) and
//! through `FathomCache` with each method, one entry per cache, context and batch, with the
//! ratio to `fathom decode-bench` at the same setting where one was given (docs/SPEC.md §9).
//! Written by the Python package, read here so the report renders it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The decoder's dimensions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelDims {
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub hq: usize,
    /// K/V heads.
    pub hkv: usize,
    /// Head dimension.
    pub d: usize,
}

/// One cache at one context and batch: its timing, or the error that stopped it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchHfEntry {
    /// `dynamic`, `offloaded`, a FathomCache method (`fathom:48`), or one with `+graph` (the
    /// whole step replayed as one CUDA graph).
    pub cache: String,
    /// Tokens per sequence before the timed steps.
    pub context: usize,
    /// Sequences decoding together.
    pub batch: usize,
    /// The same model's eager step with attention replaced by zeros (ms): weights, norms,
    /// sampling and Python.
    pub weights_ms: f64,
    /// Generated tokens per second (`batch / tpot`); absent with `error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Mean ms per step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    /// The host's ms to enqueue a step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_enqueue_ms: Option<f64>,
    /// `tpot_ms − weights_ms` (eager entries only: a replay has no null step to split by).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_ms: Option<f64>,
    /// The step's statistics over rounds (`mean`, `ci95`, `p50`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_ms: Option<Value>,
    /// The cache's attends' GPU ms per step (under `--stage-timing`; 0.0 in runs before it
    /// existed, which did not measure it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attend_gpu_ms_per_step: Option<f64>,
    /// The same by stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_gpu_ms_per_step: Option<BTreeMap<String, f64>>,
    /// Mean plan bits of the GPU-planned methods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_bits: Option<f64>,
    /// `fathom decode-bench`'s tokens/s at the same method, batch and context.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_bench_tokens_per_s: Option<f64>,
    /// `tokens_per_s / decode_bench_tokens_per_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub of_decode_bench: Option<f64>,
    /// Why the entry has no timing (out of memory, refused by the host-memory check, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// A torch.profiler summary of a few more steps (`--profile`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<Value>,
}

/// A `python -m fathom.bench_hf` run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchHf {
    /// Schema version.
    pub version: u32,
    /// The command line (the module's path and its arguments).
    pub command: String,
    /// The 8B shape (`qwen3-8b`) or the GGUF file's name.
    pub shape: String,
    /// `random` (bf16, the dummy-weights convention) or `gguf`.
    pub weights: String,
    /// `synthetic` (K/V written straight into each cache) or the real text prefilled.
    pub prefill: String,
    /// The decoder's dimensions.
    pub model: ModelDims,
    /// The GPU.
    pub device: String,
    /// torch's version.
    pub torch: String,
    /// transformers' version.
    pub transformers: String,
    /// Top-k per query head of the Fathom caches.
    pub k: usize,
    /// Decode steps per timed round.
    pub steps: usize,
    /// Timed rounds.
    pub rounds: usize,
    /// Untimed steps first.
    pub warmup: usize,
    /// Steps per round of `offloaded`.
    pub offloaded_steps: usize,
    /// sdpa's kernels (`flash or memory-efficient …`; absent in runs before they were pinned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sdpa: Option<String>,
    /// Whether the Fathom caches timed their attends by stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_timing: Option<bool>,
    /// How the process ended early, where it did (added afterwards, in words).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub killed: Option<String>,
    /// The `fathom decode-bench` run the ratios are to (`command`, `device`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_bench: Option<Value>,
    /// One entry per cache, context and batch, in run order.
    pub entries: Vec<BenchHfEntry>,
}
