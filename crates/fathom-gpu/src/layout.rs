//! The pure-CPU half of the GPU forward, compiled in every build and unit-tested: the weights
//! packed for the device (bf16, fused projections), the decoder's limits and the cache they
//! size, and the checks every call runs before a launch.
//!
//! **Packing.** Each block's projections are fused so that one GEMM computes them: the rows of
//! `Wqkv = [Wq; Wk; Wv]` (`[(Hq + 2 Hkv) D][E]`) and of `Wgu = [Wgate; Wup]` (`[2F][E]`), in
//! that order. Every matmul weight and the embedding table are rounded to bf16 (ties to even),
//! which is [`fathom_model::WeightMode::Bf16`]'s rounding, so the CPU runtime in that mode is
//! the GPU forward's reference; norms stay f32.

use fathom_cuda::cache::CacheConfig;
use fathom_cuda::pages::PageConfig;
use fathom_cuda::{ModelShape, Residency};
use fathom_model::{Config, DenseWeights, LayerKind, Matrix};

use crate::error::{GpuError, Result};

/// bf16 bits of `x` rounded to nearest, ties to even.
fn bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// Rows of `parts` stacked, as bf16 bits; the first non-finite element is an error naming
/// its tensor and index.
fn stack(parts: &[(&Matrix, &str)], layer: usize) -> Result<Vec<u16>> {
    let mut out = Vec::with_capacity(parts.iter().map(|(m, _)| m.data.len()).sum());
    for (m, name) in parts {
        if let Some(i) = m.data.iter().position(|v| !v.is_finite()) {
            return Err(GpuError::invalid(
                "weights",
                format!(
                    "blk.{layer}.{name}[{}][{}] is {}",
                    i / m.cols,
                    i % m.cols,
                    m.data[i]
                ),
            ));
        }
        out.extend(m.data.iter().map(|&v| bf16_bits(v)));
    }
    Ok(out)
}

/// One block's weights as the device holds them.
#[derive(Clone, Debug)]
pub struct PackedLayer {
    /// `[Wq; Wk; Wv]`, bf16 bits, `[(Hq + 2 Hkv) D][E]`.
    pub wqkv: Vec<u16>,
    /// `Wo`, `[E][Hq D]`.
    pub wo: Vec<u16>,
    /// `[Wgate; Wup]`, `[2F][E]`.
    pub wgu: Vec<u16>,
    /// `Wdown`, `[E][F]`.
    pub wd: Vec<u16>,
}

/// Packs one block ([module docs](self)).
///
/// # Errors
/// A weight that is not finite (named by tensor and index).
pub fn pack_layer(w: &fathom_model::LayerWeights, layer: usize) -> Result<PackedLayer> {
    Ok(PackedLayer {
        wqkv: stack(
            &[(&w.wq, "attn_q"), (&w.wk, "attn_k"), (&w.wv, "attn_v")],
            layer,
        )?,
        wo: stack(&[(&w.wo, "attn_output")], layer)?,
        wgu: stack(&[(&w.gate, "ffn_gate"), (&w.up, "ffn_up")], layer)?,
        wd: stack(&[(&w.down, "ffn_down")], layer)?,
    })
}

/// The embedding table (and the LM head when it is not tied) as bf16 bits.
///
/// # Errors
/// A weight that is not finite.
pub fn pack_embeddings(w: &DenseWeights) -> Result<(Vec<u16>, Option<Vec<u16>>)> {
    let e = stack(&[(&w.embedding, "token_embd")], 0)?;
    let h = w
        .lm_head
        .as_ref()
        .map(|m| stack(&[(m, "output")], 0))
        .transpose()?;
    Ok((e, h))
}

/// Every norm weight must be finite too.
///
/// # Errors
/// The first norm weight that is not.
pub fn check_norms(w: &DenseWeights) -> Result<()> {
    let mut all: Vec<(String, &[f32])> = vec![("output_norm".into(), &w.out_norm)];
    for (l, b) in w.layers.iter().enumerate() {
        all.push((format!("blk.{l}.attn_norm"), &b.attn_norm));
        all.push((format!("blk.{l}.ffn_norm"), &b.ffn_norm));
        for (n, v) in [
            ("attn_q_norm", &b.q_norm),
            ("attn_k_norm", &b.k_norm),
            ("post_attention_norm", &b.post_attn_norm),
            ("post_ffw_norm", &b.post_ffn_norm),
        ] {
            if let Some(v) = v {
                all.push((format!("blk.{l}.{n}"), v));
            }
        }
    }
    for (name, v) in all {
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(GpuError::invalid(
                "weights",
                format!("{name}[{i}] is {}", v[i]),
            ));
        }
    }
    Ok(())
}

/// The decoder's limits; they size the cache and the working memory once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderConfig {
    /// Sessions alive at once (forks included).
    pub max_sessions: usize,
    /// Tokens one session may hold.
    pub max_tokens: usize,
    /// Sessions in one decode step.
    pub max_batch: usize,
    /// Tokens per prefill forward (chunks).
    pub prefill_chunk: usize,
    /// Largest top-k per query head an attend may ask for.
    pub max_k: usize,
    /// Tokens per page of the cache.
    pub page_tokens: usize,
    /// Pages per layer pool; `None`: every session at `max_tokens`, plus one page per session
    /// for the copy-on-write of a fork.
    pub pages: Option<usize>,
    /// HBM row-cache slots per (session, layer, KV head).
    pub row_cache: usize,
    /// Where the pages live.
    pub residency: Residency,
    /// Whether the cache keeps the PCA index that `loki:R` scans
    /// (`fathom_cuda::cache::CacheConfig::pca_index`).
    pub pca_index: bool,
    /// Whether the cache keeps the block tables that `landmark` and `quest` read
    /// (`fathom_cuda::cache::CacheConfig::block_tables`).
    pub block_tables: bool,
    /// How the cache's attends run (`fathom_cuda::cache::CacheOptions`: select path, head
    /// groups, scan loads, host gather, stage timing), fixed when the decoder is made.
    pub options: fathom_cuda::cache::CacheOptions,
}

impl DecoderConfig {
    /// Defaults for `max_sessions` sessions of up to `max_tokens` tokens: batches of every
    /// session, prefill chunks of 512 tokens and top-k up to 512 (or `max_tokens`, if fewer), 2048-token pages, no row cache,
    /// pages in host memory.
    pub fn new(max_sessions: usize, max_tokens: usize) -> Self {
        DecoderConfig {
            max_sessions,
            max_tokens,
            max_batch: max_sessions,
            prefill_chunk: 512.min(max_tokens.max(1)),
            max_k: 512.min(max_tokens.max(1)),
            page_tokens: fathom_cuda::cache::DEFAULT_PAGE_TOKENS,
            pages: None,
            row_cache: 0,
            residency: Residency::Host,
            pca_index: false,
            block_tables: false,
            options: fathom_cuda::cache::CacheOptions::default(),
        }
    }

    /// The cache these limits need for `model` (all `L` layers; sliding-window layers read
    /// their window from it).
    ///
    /// # Errors
    /// A model config with Hkv = 0, Hq not a multiple of Hkv or a layer-kind table of another
    /// length; limits of 0, a chunk past `max_tokens`, a head dimension or group the cache does
    /// not take (its own checks).
    pub fn cache_config(&self, model: &Config) -> Result<CacheConfig> {
        // A caller-built Config (GpuDecoder::random) has not been through the GGUF loader's
        // checks: the group and the per-layer tables below need these.
        if model.n_kv_heads == 0
            || model.n_heads % model.n_kv_heads != 0
            || model.layer_kinds.len() != model.n_layers
        {
            return Err(GpuError::invalid(
                "model config",
                format!(
                    "Hq = {}, Hkv = {}, {} layer kinds for {} layers (want Hkv ≥ 1 dividing Hq, one kind per layer)",
                    model.n_heads,
                    model.n_kv_heads,
                    model.layer_kinds.len(),
                    model.n_layers
                ),
            ));
        }
        if self.max_sessions == 0 || self.max_tokens == 0 || self.max_batch == 0 {
            return Err(GpuError::invalid(
                "decoder config",
                format!("{self:?}: sessions, tokens and batch must be at least 1"),
            ));
        }
        if self.prefill_chunk == 0 || self.prefill_chunk > self.max_tokens {
            return Err(GpuError::invalid(
                "prefill_chunk",
                format!("{} (want 1..={})", self.prefill_chunk, self.max_tokens),
            ));
        }
        let per = self.max_tokens.div_ceil(self.page_tokens.max(1));
        let pages = match self.pages {
            Some(p) => p,
            None => self
                .max_sessions
                .checked_mul(per + 1)
                .ok_or_else(|| GpuError::invalid("max_sessions", "sessions × pages overflow"))?,
        };
        let cfg = CacheConfig {
            shape: ModelShape {
                layers: model.n_layers,
                kv_heads: model.n_kv_heads,
                group: model.group(),
                dim: model.head_dim,
            },
            pages: PageConfig {
                page_tokens: self.page_tokens,
                pages,
                max_sessions: self.max_sessions,
                max_tokens: self.max_tokens,
            },
            max_batch: self.max_batch,
            max_k: self.max_k,
            row_cache: self.row_cache,
            residency: self.residency,
            pca_index: self.pca_index,
            block_tables: self.block_tables,
            host_pages: fathom_cuda::HostPages::Driver,
            options: self.options,
        };
        Ok(cfg.validate()?)
    }

    /// Rows one forward handles at most: a decode batch or a prefill chunk.
    pub fn max_rows(&self) -> usize {
        self.max_batch.max(self.prefill_chunk)
    }
}

/// The widest sliding window of the model's layers (0 when every layer is global).
pub fn max_window(cfg: &Config) -> usize {
    cfg.layer_kinds
        .iter()
        .filter_map(|k| k.window())
        .max()
        .unwrap_or(0)
}

/// RoPE base of layer `l`: the local base on sliding-window layers, else the global one.
pub fn rope_base(cfg: &Config, l: usize) -> f32 {
    match cfg.layer_kinds[l] {
        LayerKind::Local(_) => cfg.rope_base_local,
        _ => cfg.rope_base,
    }
}

/// Checks token ids against the vocabulary.
///
/// # Errors
/// An empty list, or the first id `≥ vocab` (named with its index).
pub fn check_tokens(cfg: &Config, tokens: &[u32]) -> Result<()> {
    if tokens.is_empty() {
        return Err(GpuError::invalid("tokens", "no tokens"));
    }
    if let Some(i) = tokens.iter().position(|&t| t as usize >= cfg.vocab_size) {
        return Err(GpuError::invalid(
            "tokens",
            format!(
                "token {i} is id {} (vocabulary {})",
                tokens[i], cfg.vocab_size
            ),
        ));
    }
    Ok(())
}

/// Rows of the cache a prefill chunk's attention reads in layer `l`: every token for a global
/// layer, the window reaching back from the chunk's first query for a sliding one
/// (`min(end, window + chunk − 1)`), where `end` is the session's length after the chunk.
pub fn prefill_rows(kind: LayerKind, end: usize, chunk: usize) -> usize {
    match kind.window() {
        Some(w) if w > 0 => end.min(w + chunk - 1),
        _ => end,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fathom_model::{LayerWeights, Matrix};

    fn m(rows: usize, cols: usize, seed: f32) -> Matrix {
        Matrix {
            rows,
            cols,
            data: (0..rows * cols)
                .map(|i| (i as f32 * 0.37 + seed).sin() * 1.001)
                .collect(),
        }
    }

    fn layer(e: usize, qd: usize, kvd: usize, f: usize) -> LayerWeights {
        LayerWeights {
            attn_norm: vec![1.0; e],
            wq: m(qd, e, 1.0),
            wk: m(kvd, e, 2.0),
            wv: m(kvd, e, 3.0),
            wo: m(e, qd, 4.0),
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            ffn_norm: vec![1.0; e],
            gate: m(f, e, 5.0),
            up: m(f, e, 6.0),
            down: m(e, f, 7.0),
            post_ffn_norm: None,
        }
    }

    #[test]
    fn packing_stacks_rows_in_order_and_rounds_to_bf16() {
        for (e, qd, kvd, f) in [(8, 8, 4, 12), (64, 128, 32, 96), (40, 24, 8, 16)] {
            let w = layer(e, qd, kvd, f);
            let p = pack_layer(&w, 3).unwrap();
            assert_eq!(p.wqkv.len(), (qd + 2 * kvd) * e);
            assert_eq!(p.wgu.len(), 2 * f * e);
            let bf = |x: f32| half::bf16::from_f32(x).to_bits();
            for r in 0..qd + 2 * kvd {
                let (src, rr) = if r < qd {
                    (&w.wq, r)
                } else if r < qd + kvd {
                    (&w.wk, r - qd)
                } else {
                    (&w.wv, r - qd - kvd)
                };
                for c in 0..e {
                    assert_eq!(p.wqkv[r * e + c], bf(src.data[rr * e + c]));
                }
            }
            for r in 0..2 * f {
                let (src, rr) = if r < f { (&w.gate, r) } else { (&w.up, r - f) };
                assert_eq!(
                    p.wgu[r * e..(r + 1) * e].to_vec(),
                    src.data[rr * e..(rr + 1) * e]
                        .iter()
                        .map(|&x| bf(x))
                        .collect::<Vec<_>>()
                );
            }
            assert_eq!(p.wd, w.down.data.iter().map(|&x| bf(x)).collect::<Vec<_>>());
        }
    }

    /// A caller-built model config is checked before its group or layer table is used.
    #[test]
    fn a_model_config_the_cache_cannot_serve_is_refused() {
        let good = crate::presets::preset("qwen3-8b").expect("the Qwen3-8B preset");
        let d = DecoderConfig::new(2, 4096);
        assert!(d.cache_config(&good).is_ok());
        let mut c = good.clone();
        c.n_kv_heads = 0;
        assert!(d
            .cache_config(&c)
            .unwrap_err()
            .to_string()
            .contains("Hkv = 0"));
        let mut c = good.clone();
        c.n_heads = c.n_kv_heads * 4 + 1;
        assert!(d.cache_config(&c).is_err());
        let mut c = good.clone();
        c.layer_kinds.pop();
        assert!(d
            .cache_config(&c)
            .unwrap_err()
            .to_string()
            .contains("layer kinds"));
    }

    #[test]
    fn a_non_finite_weight_is_named() {
        let mut w = layer(8, 8, 4, 12);
        w.up.data[2 * 8 + 5] = f32::NAN;
        let e = pack_layer(&w, 7).unwrap_err().to_string();
        assert!(e.contains("blk.7.ffn_up[2][5]"), "{e}");
    }

    #[test]
    fn prefill_rows_cover_the_first_querys_window() {
        let local = LayerKind::Local(512);
        assert_eq!(prefill_rows(LayerKind::Global, 3000, 512), 3000);
        assert_eq!(prefill_rows(local, 300, 300), 300);
        // The chunk's first query (at end − chunk) sees keys back to end − chunk − 511.
        assert_eq!(prefill_rows(local, 3000, 512), 1023);
        assert_eq!(prefill_rows(local, 3000, 1), 512);
    }
}
