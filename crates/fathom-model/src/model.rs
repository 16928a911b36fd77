//! The layer loop for `llama` (SmolLM2) and `gemma3` GGUFs, over candle's quantized matmuls
//! and plain-slice attention.
//!
//! Per layer (pre-norm residual blocks; `RMSNorm(x) = x / √(mean x² + ε) ⊙ w`):
//!
//! ```text
//! llama : x += Wo · Attn(RoPE(Wq n(x)), RoPE(Wk n(x)), Wv n(x));   x += Wd (silu(Wg n(x)) ⊙ Wu n(x))
//! gemma3: x₀ = √E · embed;  q,k get a per-head RMSNorm (QK-norm) before RoPE;
//!         x += n_post(Wo · Attn(..));   x += n_post(Wd (gelu_tanh(Wg n(x)) ⊙ Wu n(x)))
//! ```
//!
//! **Channel order.** llama GGUFs are written with the q/k weight rows permuted so that RoPE
//! rotates *adjacent* pairs `(2i, 2i+1)` (llama.cpp rope mode 0). This runtime uses that order
//! as stored, so captured q/k channels of SmolLM2 are in the GGUF's interleaved-pair order, not
//! the Hugging Face `rotate_half` order. Gemma 3 uses NEOX rotation: pairs `(i, i + D/2)`, no
//! permutation. Pair `i` rotates by `θ_i = pos · base^{−2i/D}`.
//!
//! Gemma 3 layers `l` with `(l + 1) % 6 == 0` are global (RoPE base from the GGUF, 1e6); the
//! others attend to the last `sliding_window` (512) keys with RoPE base 1e4.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use rayon::prelude::*;

use crate::attention::{dense_attention, DecodeAttention, KvSlice};
use crate::error::{candle_err, io_err, Error, Result};
use crate::tokenizer::Tokenizer;

mod gguf;
mod load;
pub(crate) use gguf::gguf_err;
pub use gguf::read_gguf;
pub(crate) use load::Loader;

/// Supported architectures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `llama` (SmolLM2).
    Llama,
    /// `gemma3`.
    Gemma3,
}

/// How RoPE pairs channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)` (llama GGUF, permuted weights).
    Interleaved,
    /// Half-split pairs `(i, i + D/2)`.
    Neox,
}

/// Whether a layer sees all keys or a sliding window (the capture schema's own type).
pub use fathom_capture::LayerKind;

/// Hyper-parameters read from the GGUF.
#[derive(Clone, Debug)]
pub struct Config {
    /// Architecture.
    pub arch: Arch,
    /// `general.name`.
    pub name: String,
    /// Layers `L`.
    pub n_layers: usize,
    /// Hidden size `E`.
    pub n_embd: usize,
    /// Query heads `Hq`.
    pub n_heads: usize,
    /// KV heads `Hkv`.
    pub n_kv_heads: usize,
    /// Channels per head `D`.
    pub head_dim: usize,
    /// FFN width.
    pub n_ff: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RMSNorm ε.
    pub rms_eps: f32,
    /// RoPE base of global layers.
    pub rope_base: f32,
    /// RoPE base of sliding-window layers.
    pub rope_base_local: f32,
    /// RoPE pairing.
    pub rope_style: RopeStyle,
    /// Per-layer kind.
    pub layer_kinds: Vec<LayerKind>,
    /// Training context length.
    pub context_length: usize,
    /// Whether q and k get a per-head RMSNorm.
    pub qk_norm: bool,
    /// Multiplier of the token embeddings (√E for Gemma).
    pub embed_scale: f32,
    /// Attention-logit softcap, if the model has one (neither supported model does).
    pub attn_softcap: Option<f32>,
}

impl Config {
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}

/// Which weights to dequantize to f32 at load time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightMode {
    /// Dequantize the types that have no SIMD dot product in candle 0.11.1 on x86 (Q4_1,
    /// Q5_0, Q5_1) for prefill chunks, and multiply decode steps' rows by the raw Q4_1 and Q5_0
    /// blocks themselves (the same weights, read at 5–5.5 bits instead of 32); keep the
    /// k-quants and Q8_0 quantized.
    #[default]
    Auto,
    /// Keep every matmul weight quantized.
    Quantized,
    /// Dequantize every matmul weight (fastest prefill, most memory).
    Dequantized,
    /// The numerics of the GPU forward (`fathom-gpu`): every matmul weight and the embedding
    /// dequantized and rounded to bf16, every matmul input rounded to bf16 (products of two
    /// bf16 are exact in f32, sums in f32), and K and V rounded to bf16 when cached (the
    /// paged cache stores bf16 records). Norms, RoPE, activations and attention stay f32.
    Bf16,
}

/// Rounds every element to the nearest bf16 (ties to even), kept as f32.
pub fn round_bf16(x: &mut [f32]) {
    x.iter_mut()
        .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
}

/// Options of [`Model::load`].
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Weight storage policy.
    pub weights: WeightMode,
}

/// Receives q and the attention output of every layer during a forward pass.
///
/// `q` and `o` are `[T, Hq, D]` for the `T` tokens at positions `pos0..pos0+T`; `q` is after RoPE
/// and QK-norm and **unscaled**. K and V of the same tokens are already in the cache.
pub trait AttentionHook {
    /// Called once per layer per forward chunk.
    fn on_attention(&mut self, layer: usize, pos0: usize, q: &[f32], o: &[f32]);
}

/// Up to this many activation rows, a [`Linear`] with raw blocks multiplies them row by row
/// ([`crate::qmatvec`]): each row then reads the 5–5.5-bit blocks rather than the f32 copy, and
/// four rows still read less than one pass over the f32 weights (4 · 5.5 < 32 bits).
const MATVEC_MAX_ROWS: usize = 4;

struct Linear {
    mm: QMatMul,
    /// The raw `Q4_1` / `Q5_0` blocks of a weight that `mm` holds dequantized
    /// ([`WeightMode::Auto`]), for decode steps; see [`MATVEC_MAX_ROWS`].
    blocks: Option<crate::qmatvec::QuantRows>,
    n_in: usize,
    n_out: usize,
    /// Round the input to bf16 first ([`WeightMode::Bf16`]).
    bf16_input: bool,
}

impl Linear {
    fn forward(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        debug_assert_eq!(x.len(), t * self.n_in);
        if let Some(b) = self.blocks.as_ref().filter(|_| t <= MATVEC_MAX_ROWS) {
            let mut y = vec![0f32; t * self.n_out];
            for (xr, yr) in x
                .chunks_exact(self.n_in)
                .zip(y.chunks_exact_mut(self.n_out))
            {
                b.matvec(xr, yr);
            }
            return Ok(y);
        }
        let rounded;
        let x = if self.bf16_input {
            let mut r = x.to_vec();
            round_bf16(&mut r);
            rounded = r;
            &rounded[..]
        } else {
            x
        };
        let xt =
            Tensor::from_slice(x, (t, self.n_in), &Device::Cpu).map_err(candle_err("input"))?;
        let y = self.mm.forward(&xt).map_err(candle_err("matmul"))?;
        let y = y
            .flatten_all()
            .and_then(|y| y.to_vec1::<f32>())
            .map_err(candle_err("output"))?;
        debug_assert_eq!(y.len(), t * self.n_out);
        Ok(y)
    }
}

enum Embedding {
    /// Raw Q8_0 blocks, dequantized row by row (exact).
    Q8_0(Arc<QTensor>),
    F32(Vec<f32>),
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    gate: Linear,
    up: Linear,
    down: Linear,
    post_ffn_norm: Option<Vec<f32>>,
}

/// A loaded model: weights, config and tokenizer.
pub struct Model {
    cfg: Config,
    tokenizer: Tokenizer,
    embd: Embedding,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    lm_head: Linear,
    /// K and V rounded to bf16 when cached ([`WeightMode::Bf16`]).
    bf16_kv: bool,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// Preallocated KV cache: per layer, K and V as contiguous f32 `[capacity, Hkv, D]`.
#[derive(Clone, Debug)]
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    capacity: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl KvCache {
    /// Tokens stored.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Maximum tokens.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Keys of `layer` for tokens `0..len`.
    pub fn keys(&self, layer: usize) -> KvSlice<'_> {
        self.slice(&self.k[layer], self.len)
    }
    /// Values of `layer` for tokens `0..len`.
    pub fn values(&self, layer: usize) -> KvSlice<'_> {
        self.slice(&self.v[layer], self.len)
    }
    /// Forget tokens from `len` on (e.g. to branch several decodes from one prefill, clone the
    /// cache instead; truncating is for re-running a suffix). State a decode attention built
    /// over the cache does not follow the cut: `fathom-eval`'s sparse attention refuses a
    /// cache shorter than its stores, so make a new one after truncating.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    fn slice<'a>(&self, data: &'a [f32], n: usize) -> KvSlice<'a> {
        let w = self.n_kv_heads * self.head_dim;
        KvSlice {
            data: &data[..n * w],
            n,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        }
    }
}

impl Model {
    /// The config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// A preallocated, empty cache for up to `capacity` tokens.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        let w = self.cfg.n_kv_heads * self.cfg.head_dim;
        KvCache {
            k: (0..self.cfg.n_layers)
                .map(|_| vec![0.0; capacity * w])
                .collect(),
            v: (0..self.cfg.n_layers)
                .map(|_| vec![0.0; capacity * w])
                .collect(),
            len: 0,
            capacity,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    /// Dense forward of `tokens` appended to `cache`; returns the logits of the last token.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        hook: Option<&mut dyn AttentionHook>,
    ) -> Result<Vec<f32>> {
        self.forward_impl(tokens, cache, None, hook, false)
    }

    /// Dense forward returning the logits of every token, `[T, vocab]`.
    pub fn forward_all_logits(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        self.forward_impl(tokens, cache, None, None, true)
    }

    /// Chunked dense prefill (`chunk` tokens per forward); returns the last token's logits.
    pub fn prefill(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        chunk: usize,
        mut hook: Option<&mut dyn AttentionHook>,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::Invalid("prefill of zero tokens".into()));
        }
        let chunk = chunk.max(1);
        let mut logits = Vec::new();
        for c in tokens.chunks(chunk) {
            let h: Option<&mut dyn AttentionHook> = match hook.as_mut() {
                Some(h) => Some(&mut **h),
                None => None,
            };
            logits = self.forward_impl(c, cache, None, h, false)?;
        }
        Ok(logits)
    }

    /// One decode step: append `token`, attend with `attn` on every layer, return its logits.
    pub fn decode_step(
        &self,
        token: u32,
        cache: &mut KvCache,
        attn: &mut dyn DecodeAttention,
        hook: Option<&mut dyn AttentionHook>,
    ) -> Result<Vec<f32>> {
        self.forward_impl(&[token], cache, Some(attn), hook, false)
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let e = self.cfg.n_embd;
        let mut x = vec![0f32; tokens.len() * e];
        for (row, &tok) in x.chunks_mut(e).zip(tokens) {
            if tok as usize >= self.cfg.vocab_size {
                return Err(Error::Invalid(format!(
                    "token id {tok} ≥ vocab {}",
                    self.cfg.vocab_size
                )));
            }
            match &self.embd {
                Embedding::F32(w) => row.copy_from_slice(&w[tok as usize * e..][..e]),
                Embedding::Q8_0(q) => {
                    let data = q.data().map_err(candle_err("embedding data"))?;
                    let nb = e / 32;
                    let base = tok as usize * nb * 34;
                    for b in 0..nb {
                        let blk = &data[base + b * 34..][..34];
                        let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                        for i in 0..32 {
                            row[b * 32 + i] = d * (blk[2 + i] as i8) as f32;
                        }
                    }
                }
            }
            if self.cfg.embed_scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= self.cfg.embed_scale);
            }
        }
        Ok(x)
    }

    fn forward_impl(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        mut attn: Option<&mut dyn DecodeAttention>,
        mut hook: Option<&mut dyn AttentionHook>,
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let t = tokens.len();
        let pos0 = cache.len;
        if t == 0 {
            return Err(Error::Invalid("forward of zero tokens".into()));
        }
        if cache.k.len() != cfg.n_layers
            || cache.n_kv_heads != cfg.n_kv_heads
            || cache.head_dim != cfg.head_dim
        {
            return Err(Error::Invalid(format!(
                "the KV cache is for {} layers × {} KV heads × {} channels, this model has \
                 {} × {} × {} (a cache from Model::new_cache of another model?)",
                cache.k.len(),
                cache.n_kv_heads,
                cache.head_dim,
                cfg.n_layers,
                cfg.n_kv_heads,
                cfg.head_dim
            )));
        }
        if pos0 + t > cache.capacity {
            return Err(Error::ContextFull {
                pos: pos0,
                add: t,
                capacity: cache.capacity,
            });
        }
        let (e, hq, hkv, d) = (cfg.n_embd, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let eps = cfg.rms_eps;
        let scale = 1.0 / (d as f32).sqrt();
        let rope_g = RopeTable::new(cfg.rope_base, d, pos0, t);
        let rope_l = if cfg.rope_base_local != cfg.rope_base {
            Some(RopeTable::new(cfg.rope_base_local, d, pos0, t))
        } else {
            None
        };
        let mut x = self.embed(tokens)?;
        let kvw = hkv * d;
        for (l, layer) in self.layers.iter().enumerate() {
            let kind = cfg.layer_kinds[l];
            let xn = rms_norm_rows(&x, &layer.attn_norm, eps);
            let mut q = layer.wq.forward(&xn, t)?;
            let mut k = layer.wk.forward(&xn, t)?;
            let v = layer.wv.forward(&xn, t)?;
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                rms_norm_inplace(&mut q, qn, eps);
                rms_norm_inplace(&mut k, kn, eps);
            }
            let rope = match (kind, &rope_l) {
                (LayerKind::Local(_), Some(r)) => r,
                _ => &rope_g,
            };
            rope.apply(&mut q, hq, cfg.rope_style);
            rope.apply(&mut k, hkv, cfg.rope_style);
            let mut v = v;
            if self.bf16_kv {
                round_bf16(&mut k);
                round_bf16(&mut v);
            }
            cache.k[l][pos0 * kvw..(pos0 + t) * kvw].copy_from_slice(&k);
            cache.v[l][pos0 * kvw..(pos0 + t) * kvw].copy_from_slice(&v);
            let n = pos0 + t;
            let ks = KvSlice {
                data: &cache.k[l][..n * kvw],
                n,
                n_kv_heads: hkv,
                head_dim: d,
            };
            let vs = KvSlice {
                data: &cache.v[l][..n * kvw],
                n,
                n_kv_heads: hkv,
                head_dim: d,
            };
            let mut o = vec![0f32; t * hq * d];
            match attn.as_mut() {
                Some(a) if t == 1 => a
                    .attend(l, &q, ks, vs, pos0, kind.window(), &mut o)
                    .map_err(|source| Error::Attention { layer: l, source })?,
                _ => {
                    let qs: Vec<f32> = q.iter().map(|v| v * scale).collect();
                    dense_attention(&qs, ks, vs, pos0, t, kind.window(), &mut o);
                }
            }
            if let Some(h) = hook.as_mut() {
                h.on_attention(l, pos0, &q, &o);
            }
            let mut a = layer.wo.forward(&o, t)?;
            if let Some(w) = &layer.post_attn_norm {
                rms_norm_inplace(&mut a, w, eps);
            }
            add_assign(&mut x, &a);
            let xn = rms_norm_rows(&x, &layer.ffn_norm, eps);
            let g = layer.gate.forward(&xn, t)?;
            let u = layer.up.forward(&xn, t)?;
            let hmid: Vec<f32> = match cfg.arch {
                Arch::Llama => g.par_iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect(),
                Arch::Gemma3 => g
                    .par_iter()
                    .zip(&u)
                    .map(|(&g, &u)| gelu_tanh(g) * u)
                    .collect(),
            };
            let mut dn = layer.down.forward(&hmid, t)?;
            if let Some(w) = &layer.post_ffn_norm {
                rms_norm_inplace(&mut dn, w, eps);
            }
            add_assign(&mut x, &dn);
        }
        cache.len = pos0 + t;
        let rows: &[f32] = if all_logits { &x } else { &x[(t - 1) * e..] };
        let nrows = rows.len() / e;
        let xn = rms_norm_rows(rows, &self.out_norm, eps);
        self.lm_head.forward(&xn, nrows)
    }
}

/// Greedy decoding: prefill `prompt` (chunked), then up to `max_new` argmax tokens through
/// `attn`, stopping at a stop token. Returns the generated ids.
pub fn generate_greedy(
    model: &Model,
    prompt: &[u32],
    max_new: usize,
    chunk: usize,
    attn: &mut dyn DecodeAttention,
) -> Result<Vec<u32>> {
    let mut cache = model.new_cache(prompt.len() + max_new);
    let mut logits = model.prefill(prompt, &mut cache, chunk, None)?;
    let mut out = Vec::with_capacity(max_new);
    for i in 0..max_new {
        let next = argmax(&logits);
        out.push(next);
        if model.tokenizer().stop_tokens().contains(&next) || i + 1 == max_new {
            break;
        }
        logits = model.decode_step(next, &mut cache, attn, None)?;
    }
    Ok(out)
}

/// Index of the largest value (first on ties).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Log-softmax of logits (f64 accumulation).
pub fn log_softmax(x: &[f32]) -> Vec<f32> {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = x.iter().map(|&v| ((v - m) as f64).exp()).sum();
    let lz = z.ln() as f32 + m;
    x.iter().map(|&v| v - lz).collect()
}

#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // √(2/π)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = x.to_vec();
    rms_norm_inplace(&mut y, w, eps);
    y
}

/// RMSNorm of every `w.len()`-long row of `x`, in place.
fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for row in x.chunks_mut(n) {
        let ss: f32 = row.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let r = 1.0 / (ss + eps).sqrt();
        row.iter_mut().zip(w).for_each(|(v, w)| *v = *v * r * w);
    }
}

/// cos/sin of `θ_i = pos · base^{−2i/D}` for a run of positions (f64 angles).
struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    fn new(base: f32, d: usize, pos0: usize, t: usize) -> RopeTable {
        let half = d / 2;
        let inv: Vec<f64> = (0..half)
            .map(|i| (base as f64).powf(-2.0 * i as f64 / d as f64))
            .collect();
        let mut cos = Vec::with_capacity(t * half);
        let mut sin = Vec::with_capacity(t * half);
        for p in pos0..pos0 + t {
            for &f in &inv {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Rotate `x` = `[t, heads, D]` in place.
    fn apply(&self, x: &mut [f32], heads: usize, style: RopeStyle) {
        let half = self.half;
        let d = 2 * half;
        for (ti, tok) in x.chunks_mut(heads * d).enumerate() {
            let c = &self.cos[ti * half..][..half];
            let s = &self.sin[ti * half..][..half];
            for head in tok.chunks_mut(d) {
                match style {
                    RopeStyle::Interleaved => {
                        for i in 0..half {
                            let (a, b) = (head[2 * i], head[2 * i + 1]);
                            head[2 * i] = a * c[i] - b * s[i];
                            head[2 * i + 1] = a * s[i] + b * c[i];
                        }
                    }
                    RopeStyle::Neox => {
                        for i in 0..half {
                            let (a, b) = (head[i], head[i + half]);
                            head[i] = a * c[i] - b * s[i];
                            head[i + half] = a * s[i] + b * c[i];
                        }
                    }
                }
            }
        }
    }
}
