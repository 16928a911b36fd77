//! Sparse attention of decode steps over growing per-(layer, KV head) 4-bit stores, for any
//! model: the per-token protocol of docs/SPEC.md §5 that `fathom-eval` runs inside the CPU
//! model runtime and the Python package runs inside Hugging Face generation.
//!
//! For a decode query at position `pos` on a global layer, per KV head `h`: the head's
//! growable [`KeyStore`] is brought up to `pos + 1` tokens by appending the new keys (a store
//! grown by appends equals one built at once, bit for bit); the method is prepared on the
//! current keys and store ([`Scanner::prepare`]) and scores all `pos + 1` keys for the `G`
//! query heads; each query head keeps sink + local + its own top-k ([`select_per_head`]); and
//! attends exactly over that set ([`attend`], scale `1/√D`). Loki keeps a store in its own PCA
//! basis and appends to it instead of re-rotating every key per token ([`loki_r`]).
//!
//! ```
//! use fathom_bench::decode::SparseDecoder;
//! use fathom_bench::methods::{scanners, BasisChoice};
//! use fathom_plan::SelectParams;
//! let (hkv, g, d, n) = (2, 2, 16, 100);
//! let exact = scanners("exact", d, BasisChoice::Raw, None).unwrap().remove(0);
//! let params = SelectParams { sink: 4, local: 8, k: 16 };
//! let mut dec = SparseDecoder::new(exact, params, 1, hkv, d, n, None, None).unwrap();
//! let keys: Vec<f32> = (0..n * hkv * d).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
//! let q = vec![0.5f32; hkv * g * d];
//! let mut out = vec![0f32; hkv * g * d];
//! dec.attend(0, &q, &keys, &keys, n - 1, &mut out).unwrap();
//! assert_eq!(dec.stats.scans, hkv as u64);
//! ```

use fathom_plan::rowcache::RowCacheModel;
use fathom_plan::scan::scan;
use fathom_plan::scanner::{HeadCalib, HeadInput, Scanner};
use fathom_plan::{
    attend, attend_dense, plan_bits, select_per_head, union_sorted, KvView, SelectParams,
};
/// The tally type of [`DecodeStats::row_cache`] (the results documents' own).
pub use fathom_results::downstream::RowCacheTally;
use fathom_store::{Basis, BasisKind, Dims, KeyStore};
use rayon::prelude::*;

use crate::fidelity::FidelityError;

/// If `scanner` is Loki at 4 bits (`loki:R`), its `R`: Loki is prepared incrementally.
pub fn loki_r(scanner: &dyn Scanner) -> Option<usize> {
    match scanner.spec()? {
        fathom_plan::method::MethodSpec::Loki { r } => Some(r),
        _ => None,
    }
}

/// The row-cache sizes (slots per (layer, KV head)) a decode models over its own unions
/// ([`DecodeStats::row_hits`]): from 64 up to 8192, the default of `fathom offload-bench
/// --cache-rows`, so a run at a short context also shows what a cache holding only a few
/// unions' rows would hit.
pub const ROW_CACHE_SLOTS: [usize; 4] = [64, 256, 1024, 8192];

/// The stores of one (layer, KV head).
#[derive(Debug, Clone)]
pub struct HeadStores {
    /// Raw channels.
    pub raw: KeyStore,
    /// The keys in Loki's PCA basis (only when a Loki method runs).
    pub loki: Option<KeyStore>,
    /// The GPU row cache's CPU reference ([`RowCacheModel`]) at each size of
    /// [`ROW_CACHE_SLOTS`], fed every
    /// sparse step's union; empty at creation, as a new or forked GPU session is.
    pub rows: Vec<RowCacheModel>,
}

impl HeadStores {
    /// The stores of one KV head's keys `rows` (`[n][D]`) with room for `capacity` tokens; with
    /// `loki` (a `D × D` PCA basis) also the rotated store.
    pub fn new(
        rows: &[f32],
        d: usize,
        capacity: usize,
        loki: Option<&[f32]>,
    ) -> Result<Self, fathom_store::StoreError> {
        let dims = Dims {
            heads: 1,
            channels: d,
        };
        let mut raw = KeyStore::with_capacity(dims, capacity, None)?;
        raw.append(rows)?;
        let loki = match loki {
            Some(m) if m.len() == d * d => {
                let basis = Basis::new(BasisKind::Custom, 1, d, m.to_vec())?;
                let mut s = KeyStore::with_capacity(dims, capacity, Some(basis))?;
                s.append(rows)?;
                Some(s)
            }
            _ => None,
        };
        let rows = ROW_CACHE_SLOTS
            .iter()
            .map(|&c| RowCacheModel::new(c).expect("ROW_CACHE_SLOTS are positive"))
            .collect();
        Ok(Self { raw, loki, rows })
    }
}

/// Running statistics of a decode.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecodeStats {
    /// Σ bits per token read over (step, global layer, KV head).
    pub bits_sum: f64,
    /// Number of (step, global layer, KV head) scans.
    pub scans: u64,
    /// Σ tokens attended per query head (selected set sizes) over scans × G.
    pub selected_sum: f64,
    /// Σ keys visible over scans × G.
    pub visible_sum: f64,
    /// Σ union rows (distinct tokens the G heads of a KV head selected, which a GPU attend
    /// fetches) over scans.
    pub union_rows: u64,
    /// Of those, the rows a GPU row cache of [`ROW_CACHE_SLOTS`]`[i]` slots would have held
    /// ([`RowCacheModel`]; the branch's own unions, its cache empty at the
    /// start as a forked GPU session's is).
    pub row_hits: [u64; ROW_CACHE_SLOTS.len()],
}

impl DecodeStats {
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
    /// One tally per size of [`ROW_CACHE_SLOTS`]: the union rows and the modelled hits; empty
    /// for a dense decode, which fetches no union.
    pub fn row_cache(&self) -> Vec<RowCacheTally> {
        if self.union_rows == 0 {
            return Vec::new();
        }
        ROW_CACHE_SLOTS
            .iter()
            .zip(self.row_hits)
            .map(|(&c, h)| RowCacheTally::new(c, self.union_rows, h))
            .collect()
    }
}

/// One decode step of one global layer for every KV head (module docs): `q` `[Hq][D]`, `keys`
/// and `values` `[≥ pos + 1][Hkv][D]`, `heads` the layer's stores (appended up to `pos + 1`),
/// `calib` the layer's per-head calibration; writes `out` `[Hq][D]` and adds to `stats`.
#[allow(clippy::too_many_arguments)]
pub fn sparse_step(
    scanner: &dyn Scanner,
    params: &SelectParams,
    softcap: Option<f32>,
    layer: usize,
    calib: Option<&[HeadCalib]>,
    heads: &mut [HeadStores],
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    hkv: usize,
    d: usize,
    pos: usize,
    out: &mut [f32],
    stats: &mut DecodeStats,
) -> Result<(), FidelityError> {
    let hq = q.len() / d;
    let g = hq / hkv;
    let n = pos + 1;
    let scale = 1.0 / (d as f32).sqrt();
    let loki = loki_r(scanner);
    let store_err = |source| FidelityError::Store { layer, source };
    let plan_err = |source| FidelityError::Protocol { layer, source };
    let scan_err = |source| FidelityError::Scanner {
        method: scanner.name(),
        layer,
        source,
    };
    type HeadTally = (f32, usize, u64, [u64; ROW_CACHE_SLOTS.len()]);
    let per_head: Vec<HeadTally> = out
        .par_chunks_mut(g * d)
        .zip(heads.par_iter_mut())
        .enumerate()
        .map(|(h, (o, st))| -> Result<HeadTally, FidelityError> {
            let have = st.raw.tokens();
            if have > n {
                // The store runs ahead of the keys: the KV cache was cut back under this
                // attention, and its rows past the cut are not the store's any more.
                return Err(FidelityError::Invalid(format!(
                    "layer {layer}, KV head {h}: the head store holds {have} keys but the cache {n}: the cache was truncated under this attention; make a new one from the cut cache"
                )));
            }
            if have < n {
                let rows: Vec<f32> = (have..n)
                    .flat_map(|i| &keys[(i * hkv + h) * d..(i * hkv + h + 1) * d])
                    .copied()
                    .collect();
                st.raw.append(&rows).map_err(store_err)?;
                if let Some(s) = st.loki.as_mut() {
                    s.append(&rows).map_err(store_err)?;
                }
            }
            let kv = KvView::head(&keys[..n * hkv * d], hkv, d, h);
            let vv = KvView::head(&values[..n * hkv * d], hkv, d, h);
            let qg = &q[h * g * d..(h + 1) * g * d];
            let mut scores = vec![0f32; g * n];
            let bits = match (loki, st.loki.as_ref()) {
                (Some(r), Some(store)) => {
                    loki_scores(store, r, qg, g, &mut scores).map_err(scan_err)?
                }
                _ => {
                    let input = HeadInput {
                        layer,
                        keys: kv,
                        store: st.raw.view(),
                        calib: calib.and_then(|c| c.get(h)),
                        klt_store: None,
                    };
                    let hs = scanner.prepare(&input).map_err(scan_err)?;
                    hs.score(qg, g, &mut scores).map_err(scan_err)?
                }
            };
            let mut sets = vec![Vec::with_capacity(params.sink + params.local + params.k); g];
            let mut selected = 0;
            for (j, idx) in sets.iter_mut().enumerate() {
                select_per_head(pos, &scores[j * n..(j + 1) * n], params, idx).map_err(plan_err)?;
                selected += idx.len();
                attend(
                    &qg[j * d..(j + 1) * d],
                    kv,
                    vv,
                    idx,
                    scale,
                    softcap,
                    &mut o[j * d..(j + 1) * d],
                )
                .map_err(plan_err)?;
            }
            let union = union_sorted(&sets);
            let mut hits = [0u64; ROW_CACHE_SLOTS.len()];
            for (hit, rc) in hits.iter_mut().zip(&mut st.rows) {
                *hit = rc.attend(&union);
            }
            Ok((bits, selected, union.len() as u64, hits))
        })
        .collect::<Result<_, _>>()?;
    for (bits, selected, rows, hits) in per_head {
        stats.bits_sum += bits as f64;
        stats.scans += 1;
        stats.selected_sum += selected as f64;
        stats.visible_sum += (g * n) as f64;
        stats.union_rows += rows;
        for (a, h) in stats.row_hits.iter_mut().zip(hits) {
            *a += h;
        }
    }
    Ok(())
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
) -> Result<f32, fathom_plan::scanner::ScannerError> {
    let view = store.view();
    let d = view.dims().channels;
    let mut q = vec![0f32; g * d];
    for h in 0..g {
        view.rotate_query(0, &queries[h * d..(h + 1) * d], &mut q[h * d..(h + 1) * d]);
    }
    let mut depths = vec![0u8; d];
    depths[..r].fill(4);
    scan(&view, 0, &q, g, &depths, out)?;
    Ok(plan_bits(&depths))
}

/// A method decoding one sequence: its stores per global layer and KV head, created from
/// the keys at a layer's first step and appended to after (capacity grows as needed).
pub struct SparseDecoder {
    scanner: Box<dyn Scanner>,
    params: SelectParams,
    softcap: Option<f32>,
    hkv: usize,
    d: usize,
    capacity: usize,
    /// `calib[layer][kv_head]` (empty rows for layers without one).
    calib: Option<Vec<Vec<HeadCalib>>>,
    stores: Vec<Option<Vec<HeadStores>>>,
    /// Statistics so far.
    pub stats: DecodeStats,
}

impl std::fmt::Debug for SparseDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SparseDecoder")
            .field("method", &self.scanner.name())
            .field("params", &self.params)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl SparseDecoder {
    /// A decoder of `layers` layers of `hkv` KV heads of `d` channels, stores sized for
    /// `capacity` tokens; `calib[layer][kv_head]` supplies σ² (and Loki's bases) for methods
    /// that need them.
    ///
    /// # Errors
    /// Zero sizes, or a Loki method without Loki bases in `calib` or with `r` past `D`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        scanner: Box<dyn Scanner>,
        params: SelectParams,
        layers: usize,
        hkv: usize,
        d: usize,
        capacity: usize,
        calib: Option<Vec<Vec<HeadCalib>>>,
        softcap: Option<f32>,
    ) -> Result<Self, FidelityError> {
        if layers == 0 || hkv == 0 || d == 0 {
            return Err(FidelityError::Invalid(format!(
                "layers ({layers}), KV heads ({hkv}) and channels ({d}) must be positive"
            )));
        }
        if let Some(r) = loki_r(scanner.as_ref()) {
            let ok = calib.as_ref().is_some_and(|c| {
                c.iter().any(|l| !l.is_empty()) && c.iter().flatten().all(|h| h.loki.len() == d * d)
            });
            if !ok || r == 0 || r > d {
                return Err(FidelityError::Invalid(format!(
                    "{}: needs a calibration with Loki bases (and 1 ≤ r ≤ D)",
                    scanner.name()
                )));
            }
        }
        Ok(Self {
            scanner,
            params,
            softcap,
            hkv,
            d,
            capacity,
            calib,
            stores: (0..layers).map(|_| None).collect(),
            stats: DecodeStats::default(),
        })
    }

    /// The method's label.
    pub fn method(&self) -> String {
        self.scanner.name()
    }

    /// Whether the method attends densely (no scan, no selection).
    pub fn is_dense(&self) -> bool {
        self.scanner.is_dense()
    }

    /// One decode step of global layer `layer` (module docs): `q` `[Hq][D]`, `keys` and
    /// `values` `[pos + 1][Hkv][D]` (this sequence's keys so far, after RoPE and any
    /// QK-norm); writes `out` `[Hq][D]`. A dense method attends over every key.
    ///
    /// # Errors
    /// Shapes that do not fit, a layer out of range, a method that needs calibration data the
    /// decoder lacks; nothing is written to `out` on error.
    pub fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        pos: usize,
        out: &mut [f32],
    ) -> Result<(), FidelityError> {
        let (hkv, d) = (self.hkv, self.d);
        let n = pos + 1;
        if layer >= self.stores.len() {
            return Err(FidelityError::Invalid(format!(
                "layer {layer} is out of range (the decoder has {})",
                self.stores.len()
            )));
        }
        if q.is_empty() || q.len() % (hkv * d) != 0 || out.len() != q.len() {
            return Err(FidelityError::Invalid(format!(
                "queries of {} floats and outputs of {} do not fit [Hq][D] with Hkv = {hkv}, D = {d}",
                q.len(),
                out.len()
            )));
        }
        if keys.len() < n * hkv * d || values.len() < n * hkv * d {
            return Err(FidelityError::Invalid(format!(
                "position {pos} needs {} keys and values of [Hkv][D], got {} and {}",
                n,
                keys.len() / (hkv * d),
                values.len() / (hkv * d)
            )));
        }
        let g = q.len() / (hkv * d);
        if self.scanner.is_dense() {
            let scale = 1.0 / (d as f32).sqrt();
            for h in 0..hkv {
                let kv = KvView::head(&keys[..n * hkv * d], hkv, d, h);
                let vv = KvView::head(&values[..n * hkv * d], hkv, d, h);
                for j in 0..g {
                    let r = (h * g + j) * d;
                    attend_dense(
                        &q[r..r + d],
                        kv,
                        vv,
                        pos,
                        None,
                        scale,
                        self.softcap,
                        &mut out[r..r + d],
                    )
                    .map_err(|source| FidelityError::Protocol { layer, source })?;
                }
            }
            return Ok(());
        }
        if self.stores[layer].is_none() {
            let lcal = self.calib.as_ref().and_then(|c| c.get(layer));
            let cap = self.capacity.max(n);
            let heads = (0..hkv)
                .map(|h| {
                    let rows: Vec<f32> = (0..n)
                        .flat_map(|i| &keys[(i * hkv + h) * d..(i * hkv + h + 1) * d])
                        .copied()
                        .collect();
                    let basis = lcal.and_then(|l| l.get(h)).map(|c| c.loki.as_slice());
                    HeadStores::new(&rows, d, cap, basis)
                        .map_err(|source| FidelityError::Store { layer, source })
                })
                .collect::<Result<Vec<_>, _>>()?;
            self.stores[layer] = Some(heads);
        }
        let heads = self.stores[layer].as_mut().expect("created above");
        // Grow the stores geometrically before the append (their words move once).
        for st in heads.iter_mut() {
            let want = n.max(2 * st.raw.capacity());
            if n > st.raw.capacity() {
                st.raw
                    .reserve(want)
                    .map_err(|source| FidelityError::Store { layer, source })?;
                if let Some(s) = st.loki.as_mut() {
                    s.reserve(want)
                        .map_err(|source| FidelityError::Store { layer, source })?;
                }
            }
        }
        let calib = self
            .calib
            .as_ref()
            .and_then(|c| c.get(layer))
            .map(Vec::as_slice);
        let mut tmp = vec![0f32; out.len()];
        sparse_step(
            self.scanner.as_ref(),
            &self.params,
            self.softcap,
            layer,
            calib,
            heads,
            q,
            keys,
            values,
            hkv,
            d,
            pos,
            &mut tmp,
            &mut self.stats,
        )?;
        out.copy_from_slice(&tmp);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use fathom_baselines::Loki;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::calib::head_calib;

    /// A decoder stepped token by token (its stores appended to, and grown past their
    /// capacity) gives the same outputs as a fresh decoder at each position; exact top-k that
    /// keeps every key is dense attention; a small k attends a fraction.
    #[test]
    fn stepping_equals_a_fresh_decoder_and_keeping_every_key_is_dense() {
        use crate::methods::{scanners, BasisChoice};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (hkv, g, d, n0, steps) in [
            (1usize, 1usize, 16usize, 40usize, 30usize),
            (2, 3, 32, 64, 70),
            (3, 2, 64, 100, 5),
        ] {
            let n = n0 + steps;
            let keys: Vec<f32> = (0..n * hkv * d).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let vals: Vec<f32> = (0..n * hkv * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let params = SelectParams {
                sink: 4,
                local: 8,
                k: 12,
            };
            let make = |m: &str, p: SelectParams, cap: usize| {
                let s = scanners(m, d, BasisChoice::Raw, None).unwrap().remove(0);
                SparseDecoder::new(s, p, 2, hkv, d, cap, None, None).unwrap()
            };
            let mut stepped = make("exact", params, n0 + 1); // grows past its capacity
            let all = SelectParams { k: n, ..params };
            let mut every = make("exact", all, n);
            let mut dense = make("dense", params, n);
            let hq = hkv * g;
            for pos in n0..n {
                let q: Vec<f32> = (0..hq * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let (mut a, mut b) = (vec![0f32; hq * d], vec![0f32; hq * d]);
                stepped.attend(1, &q, &keys, &vals, pos, &mut a).unwrap();
                make("exact", params, 0)
                    .attend(1, &q, &keys, &vals, pos, &mut b)
                    .unwrap();
                assert_eq!(a, b, "hkv {hkv} g {g} d {d} pos {pos}");
                let (mut e, mut f) = (vec![0f32; hq * d], vec![0f32; hq * d]);
                every.attend(0, &q, &keys, &vals, pos, &mut e).unwrap();
                dense.attend(0, &q, &keys, &vals, pos, &mut f).unwrap();
                for (x, y) in e.iter().zip(&f) {
                    assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
                }
            }
            assert!(stepped.stats.density() < 1.0 && (every.stats.density() - 1.0).abs() < 1e-12);
            let mut out = vec![0f32; hq * d];
            let q = vec![0f32; hq * d];
            assert!(
                stepped
                    .attend(2, &q, &keys, &vals, n - 1, &mut out)
                    .is_err(),
                "layer out of range"
            );
            assert!(
                stepped
                    .attend(0, &q, &keys[..10], &vals, n - 1, &mut out)
                    .is_err(),
                "short keys"
            );
            // A position behind the stores (the cache cut back under the decoder) is refused,
            // not scored against the stores' keys past the cut.
            let e = stepped
                .attend(1, &q, &keys, &vals, n0 - 5, &mut out)
                .unwrap_err()
                .to_string();
            assert!(e.contains("truncated under this attention"), "{e}");
        }
    }

    /// A decode that keeps every key fetches the whole prefix each step: its union rows are
    /// Σ (pos + 1) per KV head, and a row cache larger than the context (8192 slots) holds all
    /// of the previous step's tokens; smaller ones hold fewer; dense fetches no union.
    #[test]
    fn row_cache_tallies_follow_each_steps_union() {
        use crate::methods::{scanners, BasisChoice};
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        for (hkv, g, d, n0, steps) in [
            (1usize, 2usize, 16usize, 100usize, 20usize),
            (2, 4, 32, 300, 9),
        ] {
            let n = n0 + steps;
            let keys: Vec<f32> = (0..n * hkv * d).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let all = SelectParams {
                sink: 4,
                local: 8,
                k: n,
            };
            let make = |m: &str| {
                let s = scanners(m, d, BasisChoice::Raw, None).unwrap().remove(0);
                SparseDecoder::new(s, all, 1, hkv, d, n, None, None).unwrap()
            };
            let (mut every, mut dense) = (make("exact"), make("dense"));
            let hq = hkv * g;
            let mut out = vec![0f32; hq * d];
            for pos in n0..n {
                let q: Vec<f32> = (0..hq * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
                every.attend(0, &q, &keys, &keys, pos, &mut out).unwrap();
                dense.attend(0, &q, &keys, &keys, pos, &mut out).unwrap();
            }
            let rows: u64 = (n0..n).map(|p| (p + 1) as u64).sum::<u64>() * hkv as u64;
            let held: u64 = (n0 + 1..n).map(|p| p as u64).sum::<u64>() * hkv as u64;
            let t = every.stats.row_cache();
            assert_eq!(t.len(), ROW_CACHE_SLOTS.len());
            assert_eq!(t[3], RowCacheTally::new(8192, rows, held), "hkv {hkv}");
            assert!(t[0].hits < t[3].hits && t.iter().all(|x| x.rows == rows && x.hits <= held));
            assert!(dense.stats.row_cache().is_empty() && dense.stats.union_rows == 0);
        }
    }

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
            let hc = head_calib(&view, &qs).unwrap();
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
