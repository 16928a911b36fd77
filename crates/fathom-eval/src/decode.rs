//! Sparse attention on every generated token, and greedy decoding branched per method from one
//! dense prefill (docs/SPEC.md §5, §7).
//!
//! # The per-token protocol
//!
//! For a decode query at position `pos` on a **global** layer, per KV head `h`:
//!
//! 1. the head's growable 4-bit [`KeyStore`] (built once from the prefill, capacity reserved
//!    for the whole generation) is brought up to `pos + 1` tokens by appending the new keys
//!    (a store grown by appends equals one built at once, bit for bit: `fathom-store`);
//! 2. the method is prepared on the current keys and store ([`Scanner::prepare`]) and scores
//!    all `pos + 1` keys for the `G` query heads of the group;
//! 3. each query head keeps sink 4 + local 32 + its own top-k of the middle
//!    ([`select_per_head`]);
//! 4. exact softmax attention over the kept set ([`attend`], scale `1/√D`, f64 accumulation).
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

use fathom_bench::calib::head_calib;
use fathom_model::attention::KvSlice;
use fathom_model::{argmax, AttentionHook, DecodeAttention, Dense, KvCache, LayerKind, Model};
use fathom_plan::scan::scan;
use fathom_plan::scanner::{HeadCalib, HeadInput, Scanner};
use fathom_plan::{attend, plan_bits, select_per_head, KvView, SelectParams};
use fathom_store::{Basis, BasisKind, Dims, KeyStore};
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
        .map(|l| {
            if cfg.layer_kinds[l] != LayerKind::Global {
                return Vec::new();
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
        .collect();
    Ok(LayerCalib { heads })
}

/// If `scanner` is Loki at 4 bits (`loki:R`), its `R`: Loki is prepared incrementally
/// (module docs).
pub fn loki_r(scanner: &dyn Scanner) -> Option<usize> {
    match scanner.spec()? {
        fathom_plan::method::MethodSpec::Loki { r } => Some(r),
        _ => None,
    }
}

/// Rows of KV head `h`, tokens `from..to`, of an `[n, Hkv, D]` slice, packed `[m, D]`.
fn head_rows(k: &KvSlice<'_>, h: usize, from: usize, to: usize) -> Vec<f32> {
    let d = k.head_dim;
    let mut out = Vec::with_capacity((to - from) * d);
    for i in from..to {
        out.extend_from_slice(k.row(i, h));
    }
    out
}

/// Per (global layer, KV head) stores of one sample's prefill, shared by its branches.
#[derive(Debug, Clone)]
struct HeadStores {
    raw: KeyStore,
    /// The keys in Loki's PCA basis (only when a Loki method runs).
    loki: Option<KeyStore>,
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
                        let dims = Dims {
                            heads: 1,
                            channels: d,
                        };
                        let mut raw = KeyStore::with_capacity(dims, cap, None)?;
                        raw.append(&rows)?;
                        let loki = match calib.and_then(|c| c.heads.get(l)).and_then(|hs| hs.get(h))
                        {
                            Some(hc) if with_loki && hc.loki.len() == d * d => {
                                let basis = Basis::new(BasisKind::Custom, 1, d, hc.loki.clone())?;
                                let mut s = KeyStore::with_capacity(dims, cap, Some(basis))?;
                                s.append(&rows)?;
                                Some(s)
                            }
                            _ => None,
                        };
                        Ok(HeadStores { raw, loki })
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

/// Running statistics of one branch.
#[derive(Debug, Clone, Copy, Default)]
pub struct BranchStats {
    /// Σ bits per token read over (step, global layer, KV head).
    pub bits_sum: f64,
    /// Number of (step, global layer, KV head) scans.
    pub scans: u64,
    /// Σ tokens attended per query head (selected set sizes) over scans × G.
    pub selected_sum: f64,
    /// Σ keys visible over scans × G.
    pub visible_sum: f64,
}

impl BranchStats {
    /// Mean scan bits per token per KV head (0 for dense).
    pub fn mean_bits(&self) -> f64 {
        if self.scans == 0 {
            0.0
        } else {
            self.bits_sum / self.scans as f64
        }
    }
    /// Mean fraction of visible keys attended on global layers (1 for dense).
    pub fn density(&self) -> f64 {
        if self.visible_sum == 0.0 {
            1.0
        } else {
            self.selected_sum / self.visible_sum
        }
    }
}

/// A [`DecodeAttention`] that runs a [`Scanner`] through the selection protocol on every
/// decode step of every global layer (module docs).
pub struct SparseAttention<'a> {
    scanner: &'a dyn Scanner,
    loki_r: Option<usize>,
    params: SelectParams,
    kinds: Vec<LayerKind>,
    calib: Option<&'a LayerCalib>,
    stores: Vec<Option<Vec<HeadStores>>>,
    softcap: Option<f32>,
    /// Statistics so far.
    pub stats: BranchStats,
    error: Option<EvalError>,
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
            loki_r: loki,
            params,
            kinds: model.config().layer_kinds.clone(),
            calib,
            stores,
            softcap: model.config().attn_softcap,
            stats: BranchStats::default(),
            error: None,
        })
    }

    /// The first error met inside [`DecodeAttention::attend`] (which cannot return one).
    pub fn take_error(&mut self) -> Option<EvalError> {
        self.error.take()
    }

    #[allow(clippy::too_many_arguments)]
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
        let hq = q.len() / d;
        let g = hq / hkv;
        let n = pos + 1;
        let scale = 1.0 / (d as f32).sqrt();
        let params = self.params;
        let softcap = self.softcap;
        let scanner = self.scanner;
        let loki_r = self.loki_r;
        let calib = self.calib.and_then(|c| c.heads.get(layer));
        let heads = self.stores[layer]
            .as_mut()
            .ok_or_else(|| EvalError::Invalid(format!("layer {layer} has no stores")))?;
        let per_head: Vec<(f32, usize)> = out
            .par_chunks_mut(g * d)
            .zip(heads.par_iter_mut())
            .enumerate()
            .map(|(h, (o, st))| -> Result<(f32, usize), EvalError> {
                let have = st.raw.tokens();
                if have < n {
                    let rows = head_rows(&k, h, have, n);
                    st.raw.append(&rows)?;
                    if let Some(s) = st.loki.as_mut() {
                        s.append(&rows)?;
                    }
                }
                let keys = KvView::head(&k.data[..n * hkv * d], hkv, d, h);
                let values = KvView::head(&v.data[..n * hkv * d], hkv, d, h);
                let qg = &q[h * g * d..(h + 1) * g * d];
                let mut scores = vec![0f32; g * n];
                let bits = match (loki_r, st.loki.as_ref()) {
                    (Some(r), Some(store)) => loki_scores(store, r, qg, g, &mut scores)?,
                    _ => {
                        let input = HeadInput {
                            layer,
                            keys,
                            store: st.raw.view(),
                            calib: calib.and_then(|c| c.get(h)),
                            klt_store: None,
                        };
                        let hs = scanner.prepare(&input)?;
                        hs.score(qg, g, &mut scores)?
                    }
                };
                let mut idx = Vec::with_capacity(params.sink + params.local + params.k);
                let mut selected = 0;
                for j in 0..g {
                    select_per_head(pos, &scores[j * n..(j + 1) * n], &params, &mut idx)?;
                    selected += idx.len();
                    attend(
                        &qg[j * d..(j + 1) * d],
                        keys,
                        values,
                        &idx,
                        scale,
                        softcap,
                        &mut o[j * d..(j + 1) * d],
                    )?;
                }
                Ok((bits, selected))
            })
            .collect::<Result<_, _>>()?;
        for (bits, selected) in per_head {
            self.stats.bits_sum += bits as f64;
            self.stats.scans += 1;
            self.stats.selected_sum += selected as f64;
            self.stats.visible_sum += (g * n) as f64;
        }
        Ok(())
    }
}

/// Loki's scores from a store already in its PCA basis: the first `r` coordinates at 4 bits,
/// the query rotated into the same basis (what `fathom_baselines::Loki` computes after
/// rotating every key on `prepare`).
fn loki_scores(
    store: &KeyStore,
    r: usize,
    queries: &[f32],
    g: usize,
    out: &mut [f32],
) -> Result<f32, EvalError> {
    let view = store.view();
    let d = view.dims().channels;
    let mut q = vec![0f32; g * d];
    for h in 0..g {
        view.rotate_query(0, &queries[h * d..(h + 1) * d], &mut q[h * d..(h + 1) * d]);
    }
    let mut depths = vec![0u8; d];
    depths[..r].fill(4);
    scan(&view, 0, &q, g, &depths, out).map_err(fathom_plan::scanner::ScannerError::from)?;
    Ok(plan_bits(&depths))
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
    ) {
        let sparse = !self.scanner.is_dense() && self.kinds.get(layer) == Some(&LayerKind::Global);
        if !sparse || self.error.is_some() {
            Dense.attend(layer, q, k, v, pos, window, out);
            return;
        }
        if let Err(e) = self.sparse(layer, q, k, v, pos, out) {
            self.error = Some(e);
            Dense.attend(layer, q, k, v, pos, window, out);
        }
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
        logits = model.decode_step(next, &mut cache, &mut attn, None)?;
        if let Some(e) = attn.take_error() {
            return Err(e);
        }
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
        let logits = model.decode_step(t, &mut cache, &mut attn, None)?;
        if let Some(e) = attn.take_error() {
            return Err(e);
        }
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
    use fathom_baselines::Loki;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// The incrementally grown Loki store scores exactly as `Loki::prepare` on all keys.
    #[test]
    fn incremental_loki_matches_the_baseline() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (n, d, g) in [(70usize, 16usize, 2usize), (300, 64, 3)] {
            let keys: Vec<f32> = (0..n * d)
                .map(|i| rng.gen_range(-1.0..1.0) * (1.0 + (i % d) as f32))
                .collect();
            let qs: Vec<f32> = (0..8 * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let view = KvView::contiguous(&keys, d);
            let hc = head_calib(&view, &qs);
            let dims = Dims {
                heads: 1,
                channels: d,
            };
            let basis = Basis::new(BasisKind::Custom, 1, d, hc.loki.clone()).unwrap();
            let mut inc = KeyStore::with_capacity(dims, n, Some(basis)).unwrap();
            inc.append(&keys[..(n / 2) * d]).unwrap();
            for i in n / 2..n {
                inc.append(&keys[i * d..(i + 1) * d]).unwrap();
            }
            let raw = KeyStore::from_keys(dims, &keys, None).unwrap();
            let loki = Loki { r: d / 2 };
            let input = HeadInput {
                layer: 0,
                keys: view,
                store: raw.view(),
                calib: Some(&hc),
                klt_store: None,
            };
            let hs = loki.prepare(&input).unwrap();
            let q: Vec<f32> = (0..g * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let (mut want, mut got) = (vec![0f32; g * n], vec![0f32; g * n]);
            let wb = hs.score(&q, g, &mut want).unwrap();
            let gb = loki_scores(&inc, d / 2, &q, g, &mut got).unwrap();
            assert_eq!(wb, gb);
            assert_eq!(want, got, "n {n}, d {d}");
        }
    }
}
