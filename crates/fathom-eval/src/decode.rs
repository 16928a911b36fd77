//! Sparse attention on every generated token, and greedy decoding branched per method from one
//! dense prefill (docs/SPEC.md §5, §7).
//!
//! # The per-token protocol
//!
//! For a decode query at position `pos` on a **global** layer, per KV head `h`:
//!
//! 1. the head's growable 4-bit [`fathom_store::KeyStore`] (built once from the prefill, capacity reserved
//!    for the whole generation) is brought up to `pos + 1` tokens by appending the new keys
//!    (a store grown by appends equals one built at once, bit for bit: `fathom-store`);
//! 2. the method is prepared on the current keys and store ([`Scanner::prepare`]) and scores
//!    all `pos + 1` keys for the `G` query heads of the group;
//! 3. each query head keeps sink 4 + local 32 + its own top-k of the middle
//!    ([`fathom_plan::select_per_head`]);
//! 4. exact softmax attention over the kept set ([`fathom_plan::attend`], scale `1/√D`, f64 accumulation).
//!
//! Preparation is redone on every token, so every method sees exactly the keys `0..=pos`. The
//! one exception is Loki, whose `prepare` rotates and re-quantizes all keys (`O(n·D²)` per
//! token); for it the rotated store is kept and appended to instead ([`loki_r`]), which is
//! the same store bit for bit (tested against [`fathom_baselines::Loki`]).
//!
//! **Sliding-window layers** (Gemma 3's local layers, window 512) keep their own window and
//! stay dense: sparsity applies to global layers only. [`Dense`]-like methods
//! ([`Scanner::is_dense`]) run the model's own dense decode kernel on every layer, so dense
//! branched decoding reproduces [`fathom_model::generate_greedy`] token for token.

use fathom_model::attention::KvSlice;
use fathom_model::{
    argmax, AttendError, AttentionHook, DecodeAttention, Dense, KvCache, LayerKind, Model,
};
use fathom_plan::calib::head_calib;
use fathom_plan::scanner::{HeadCalib, Scanner};
use fathom_plan::{KvView, PlanError, SelectParams};
use rayon::prelude::*;

use crate::EvalError;

/// Prefill chunk (tokens per forward), the same as plain greedy generation uses in the tests.
pub const PREFILL_CHUNK: usize = 512;

/// Calibration per layer and KV head (empty for sliding-window layers).
#[derive(Debug, Clone, Default)]
pub struct LayerCalib {
    /// `heads[layer][kv_head]`.
    pub heads: Vec<Vec<HeadCalib>>,
}

/// Collects the queries of the last positions of a prefill, per layer (`[m, Hq, D]`).
#[derive(Debug)]
struct QueryTail {
    from: usize,
    q: Vec<Vec<f32>>,
    hqd: usize,
}

impl AttentionHook for QueryTail {
    fn on_attention(&mut self, layer: usize, pos0: usize, q: &[f32], _o: &[f32]) {
        let t = q.len() / self.hqd;
        for i in 0..t {
            if pos0 + i >= self.from {
                self.q[layer].extend_from_slice(&q[i * self.hqd..(i + 1) * self.hqd]);
            }
        }
    }
}

/// Calibrates every global layer from one calibration document: `σ²`, the KLT, Loki's PCA
/// basis and Double Sparsity's channels from the document's keys (its dense prefill KV cache)
/// and the queries of its last `n_queries` positions (captured through an [`AttentionHook`]),
/// with [`head_calib`]. The document is held out from every evaluated prompt (the corpus's
/// calibration split), so the calibration is offline, as DS and Loki intend.
pub fn calibrate(model: &Model, tokens: &[u32], n_queries: usize) -> Result<LayerCalib, EvalError> {
    let cfg = model.config();
    let (hq, hkv, d, g) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.group());
    let mut cache = model.new_cache(tokens.len());
    let mut hook = QueryTail {
        from: tokens.len().saturating_sub(n_queries),
        q: vec![Vec::new(); cfg.n_layers],
        hqd: hq * d,
    };
    model.prefill(tokens, &mut cache, PREFILL_CHUNK, Some(&mut hook))?;
    let heads = (0..cfg.n_layers)
        .map(|l| -> Result<Vec<HeadCalib>, PlanError> {
            if cfg.layer_kinds[l] != LayerKind::Global {
                return Ok(Vec::new());
            }
            let k = cache.keys(l);
            (0..hkv)
                .into_par_iter()
                .map(|h| {
                    let keys = KvView::head(k.data, hkv, d, h);
                    let mut qs = Vec::new();
                    for row in hook.q[l].chunks_exact(hq * d) {
                        qs.extend_from_slice(&row[h * g * d..(h + 1) * g * d]);
                    }
                    head_calib(&keys, &qs)
                })
                .collect()
        })
        .collect::<Result<_, _>>()?;
    Ok(LayerCalib { heads })
}

pub use fathom_bench::decode::{loki_r, DecodeStats as BranchStats};
use fathom_bench::decode::{sparse_step, HeadStores};

/// Rows of KV head `h`, tokens `from..to`, of an `[n, Hkv, D]` slice, packed `[m, D]`.
fn head_rows(k: &KvSlice<'_>, h: usize, from: usize, to: usize) -> Vec<f32> {
    let d = k.head_dim;
    let mut out = Vec::with_capacity((to - from) * d);
    for i in from..to {
        out.extend_from_slice(k.row(i, h));
    }
    out
}

/// One sample's dense prefill: the KV cache, the last logits and the key stores that every
/// branch starts from. Branches clone it; it is never modified.
#[derive(Debug, Clone)]
pub struct Prefill {
    /// The KV cache after the prompt (capacity: prompt + the longest branch).
    pub cache: KvCache,
    /// Logits of the last prompt token.
    pub logits: Vec<f32>,
    stores: Vec<Option<Vec<HeadStores>>>,
}

impl Prefill {
    /// Dense prefill of `prompt` with room for `extra` more tokens; builds the 4-bit stores of
    /// every global layer (and Loki-basis stores when `calib` is given and `with_loki`).
    pub fn new(
        model: &Model,
        prompt: &[u32],
        extra: usize,
        calib: Option<&LayerCalib>,
        with_loki: bool,
    ) -> Result<Self, EvalError> {
        let cfg = model.config();
        let cap = prompt.len() + extra;
        let mut cache = model.new_cache(cap);
        let logits = model.prefill(prompt, &mut cache, PREFILL_CHUNK, None)?;
        let (hkv, d) = (cfg.n_kv_heads, cfg.head_dim);
        let n = cache.len();
        let stores = (0..cfg.n_layers)
            .map(|l| {
                if cfg.layer_kinds[l] != LayerKind::Global {
                    return Ok(None);
                }
                let k = cache.keys(l);
                let heads = (0..hkv)
                    .into_par_iter()
                    .map(|h| -> Result<HeadStores, EvalError> {
                        let rows = head_rows(&k, h, 0, n);
                        let loki = match calib.and_then(|c| c.heads.get(l)).and_then(|hs| hs.get(h))
                        {
                            Some(hc) if with_loki && hc.loki.len() == d * d => {
                                Some(hc.loki.as_slice())
                            }
                            _ => None,
                        };
                        Ok(HeadStores::new(&rows, d, cap, loki)?)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Some(heads))
            })
            .collect::<Result<Vec<_>, EvalError>>()?;
        Ok(Prefill {
            cache,
            logits,
            stores,
        })
    }

    /// Prompt tokens.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// True for an empty prompt (never: prefill rejects it).
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }
}

/// A [`DecodeAttention`] that runs a [`Scanner`] through the selection protocol on every
/// decode step of every global layer (module docs).
pub struct SparseAttention<'a> {
    scanner: &'a dyn Scanner,
    params: SelectParams,
    kinds: Vec<LayerKind>,
    calib: Option<&'a LayerCalib>,
    stores: Vec<Option<Vec<HeadStores>>>,
    softcap: Option<f32>,
    /// Statistics so far.
    pub stats: BranchStats,
}

impl std::fmt::Debug for SparseAttention<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SparseAttention")
            .field("method", &self.scanner.name())
            .field("params", &self.params)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<'a> SparseAttention<'a> {
    /// A branch of `pre` for `scanner`: clones the prefill's stores.
    pub fn new(
        model: &Model,
        pre: &Prefill,
        scanner: &'a dyn Scanner,
        calib: Option<&'a LayerCalib>,
        params: SelectParams,
    ) -> Result<Self, EvalError> {
        let loki = loki_r(scanner);
        if let Some(r) = loki {
            let ok = pre
                .stores
                .iter()
                .flatten()
                .all(|hs| hs.iter().all(|s| s.loki.is_some()));
            if !ok || r == 0 || r > model.config().head_dim {
                return Err(EvalError::Invalid(format!(
                    "{}: needs a calibration with Loki bases (and 1 ≤ r ≤ D)",
                    scanner.name()
                )));
            }
        }
        let stores = if scanner.is_dense() {
            Vec::new()
        } else {
            pre.stores.clone()
        };
        Ok(SparseAttention {
            scanner,
            params,
            kinds: model.config().layer_kinds.clone(),
            calib,
            stores,
            softcap: model.config().attn_softcap,
            stats: BranchStats::default(),
        })
    }

    fn sparse(
        &mut self,
        layer: usize,
        q: &[f32],
        k: KvSlice<'_>,
        v: KvSlice<'_>,
        pos: usize,
        out: &mut [f32],
    ) -> Result<(), EvalError> {
        let (hkv, d) = (k.n_kv_heads, k.head_dim);
        let calib = self
            .calib
            .and_then(|c| c.heads.get(layer))
            .map(Vec::as_slice);
        let heads = self.stores[layer]
            .as_mut()
            .ok_or_else(|| EvalError::Invalid(format!("layer {layer} has no stores")))?;
        sparse_step(
            self.scanner,
            &self.params,
            self.softcap,
            layer,
            calib,
            heads,
            q,
            k.data,
            v.data,
            hkv,
            d,
            pos,
            out,
            &mut self.stats,
        )?;
        Ok(())
    }
}

impl DecodeAttention for SparseAttention<'_> {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: KvSlice<'_>,
        v: KvSlice<'_>,
        pos: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) -> Result<(), AttendError> {
        let sparse = !self.scanner.is_dense() && self.kinds.get(layer) == Some(&LayerKind::Global);
        if !sparse {
            return Dense.attend(layer, q, k, v, pos, window, out);
        }
        Ok(self.sparse(layer, q, k, v, pos, out)?)
    }
}

/// A decode step's error with the sparse attention's own [`EvalError`] taken back out of
/// [`fathom_model::Error::Attention`] (where the model runtime boxed it).
fn step_error(e: fathom_model::Error) -> EvalError {
    match e {
        fathom_model::Error::Attention { layer, source } => match source.downcast::<EvalError>() {
            Ok(inner) => *inner,
            Err(source) => EvalError::Model(fathom_model::Error::Attention { layer, source }),
        },
        e => EvalError::Model(e),
    }
}

/// One greedy branch: tokens and statistics.
#[derive(Debug, Clone)]
pub struct Branch {
    /// Generated ids (the first comes from the shared prefill's logits).
    pub tokens: Vec<u32>,
    /// Scan statistics.
    pub stats: BranchStats,
}

/// Greedy decoding of up to `max_new` tokens from a clone of `pre` with `scanner`'s sparse
/// attention on every step; stops after a stop token or when `stop(&generated)` says so.
pub fn decode_branch(
    model: &Model,
    pre: &Prefill,
    scanner: &dyn Scanner,
    calib: Option<&LayerCalib>,
    params: SelectParams,
    max_new: usize,
    stop: &dyn Fn(&[u32]) -> bool,
) -> Result<Branch, EvalError> {
    let mut cache = pre.cache.clone();
    let mut attn = SparseAttention::new(model, pre, scanner, calib, params)?;
    let mut out = Vec::with_capacity(max_new);
    let mut logits = pre.logits.clone();
    for i in 0..max_new {
        let next = argmax(&logits);
        out.push(next);
        if model.tokenizer().stop_tokens().contains(&next) || i + 1 == max_new || stop(&out) {
            break;
        }
        logits = model
            .decode_step(next, &mut cache, &mut attn, None)
            .map_err(step_error)?;
    }
    Ok(Branch {
        tokens: out,
        stats: attn.stats,
    })
}

/// Teacher forcing from a clone of `pre`: feeds `forced` one token per step with `scanner`'s
/// sparse attention and returns the argmax after each (prediction `i` is for `forced[i+1]`).
pub fn forced_branch(
    model: &Model,
    pre: &Prefill,
    scanner: &dyn Scanner,
    calib: Option<&LayerCalib>,
    params: SelectParams,
    forced: &[u32],
) -> Result<Branch, EvalError> {
    let mut cache = pre.cache.clone();
    let mut attn = SparseAttention::new(model, pre, scanner, calib, params)?;
    let mut out = Vec::with_capacity(forced.len());
    for &t in forced {
        let logits = model
            .decode_step(t, &mut cache, &mut attn, None)
            .map_err(step_error)?;
        out.push(argmax(&logits));
    }
    Ok(Branch {
        tokens: out,
        stats: attn.stats,
    })
}

/// Default top-k for a context length: 128 below 16k, 256 below 32k, 512 from 32k (docs/SPEC.md §5:
/// 128 at 4k, 256 at 16k, 512 at 32k).
pub fn default_k(context: usize) -> usize {
    if context < 16 * 1024 {
        128
    } else if context < 32 * 1024 {
        256
    } else {
        512
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sparse attention's own error comes back out of the model's `Error::Attention`
    /// unchanged; any other attention error stays the model's, with its layer.
    #[test]
    fn a_step_error_is_the_scanners_own() {
        let boxed = fathom_model::Error::Attention {
            layer: 3,
            source: Box::new(EvalError::Invalid("layer 3 has no stores".into())),
        };
        assert!(matches!(step_error(boxed), EvalError::Invalid(m) if m.contains("no stores")));
        let foreign = fathom_model::Error::Attention {
            layer: 4,
            source: "not an EvalError".into(),
        };
        assert!(matches!(
            step_error(foreign),
            EvalError::Model(fathom_model::Error::Attention { layer: 4, .. })
        ));
    }
}
