//! The fidelity harness (docs/SPEC.md §5): every method ranks the keys, the shared protocol selects
//! (sink, local, top-k per query head), attends exactly, and measures
//! `‖o_sel − o_dense‖ / ‖o_dense‖`, averaged over positions, query heads and layers.

use rayon::prelude::*;

use fathom_plan::scanner::{rotated_store, HeadCalib, HeadInput, Scanner, ScannerError};
use fathom_plan::{
    attend, attend_dense_tiled, attend_dots, relative_error, select_per_head, KeyTiles, KvView,
    PlanError, SelectParams,
};
use fathom_store::{BasisKind, Dims, KeyStore, StoreError, BLOCK};

use crate::capture::{Capture, CaptureInfo, LayerData, LayerKind};
use crate::tensors::TensorError;

/// Where layers come from: a capture file or an in-memory (synthetic) workload.
pub trait LayerSource: Sync {
    /// Shapes and positions.
    fn info(&self) -> &CaptureInfo;
    /// Decodes one layer.
    fn layer(&self, index: usize) -> Result<LayerData, TensorError>;
}

impl LayerSource for Capture {
    fn info(&self) -> &CaptureInfo {
        Capture::info(self)
    }
    fn layer(&self, index: usize) -> Result<LayerData, TensorError> {
        Capture::layer(self, index)
    }
}

/// Layers held in memory.
#[derive(Debug)]
pub struct InMemory {
    /// Shapes and positions.
    pub info: CaptureInfo,
    /// One entry per `info.layers`.
    pub layers: Vec<LayerData>,
}

impl LayerSource for InMemory {
    fn info(&self) -> &CaptureInfo {
        &self.info
    }
    fn layer(&self, index: usize) -> Result<LayerData, TensorError> {
        let slot = self
            .info
            .layers
            .iter()
            .position(|&l| l == index)
            .ok_or_else(|| TensorError::Invalid {
                path: "<memory>".into(),
                reason: format!("layer {index} is not in the workload"),
            })?;
        Ok(self.layers[slot].clone())
    }
}

/// Errors of a fidelity run.
#[derive(Debug, thiserror::Error)]
pub enum FidelityError {
    /// Reading the capture failed.
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A method failed.
    #[error("method {method}, layer {layer}: {source}")]
    Scanner {
        /// Method.
        method: String,
        /// Layer.
        layer: usize,
        /// Cause.
        #[source]
        source: ScannerError,
    },
    /// Selection or attention failed.
    #[error("layer {layer}: {source}")]
    Protocol {
        /// Layer.
        layer: usize,
        /// Cause.
        #[source]
        source: PlanError,
    },
    /// Building the store failed.
    #[error("layer {layer}: {source}")]
    Store {
        /// Layer.
        layer: usize,
        /// Cause.
        #[source]
        source: StoreError,
    },
    /// Bad parameters.
    #[error("{0}")]
    Invalid(String),
}

/// Calibration lookup: per (layer, KV head).
pub trait CalibSource: Sync {
    /// Calibration of one (layer, KV head), if present.
    fn head(&self, layer: usize, kv_head: usize) -> Option<&HeadCalib>;
}

/// Run parameters.
#[derive(Debug, Clone, Default)]
pub struct FidelityParams {
    /// Sink, local, k.
    pub select: SelectParams,
    /// Layers to evaluate (default: the global layers).
    pub layers: Option<Vec<usize>>,
    /// Attention scale (default `1/√D`).
    pub scale: Option<f32>,
}

/// One method's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MethodResult {
    /// Method name.
    pub name: String,
    /// Mean bits per token per KV head.
    pub bits: f64,
    /// Mean relative error of the attention output.
    pub error: f64,
    /// Mean error per evaluated layer (order of `FidelityReport::layers`).
    pub per_layer: Vec<f64>,
    /// Mean bits per evaluated layer.
    pub per_layer_bits: Vec<f64>,
    /// Mean error per query position (over layers and KV heads), in capture order.
    pub per_position: Vec<f64>,
    /// Standard error of `error` over positions: `sd(per_position) / √P` (0 when P = 1).
    /// Positions of one capture share a context, so this is a within-capture figure.
    pub error_se: f64,
}

/// A whole run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FidelityReport {
    /// Layers evaluated.
    pub layers: Vec<usize>,
    /// Layers skipped (sliding-window layers keep their own window; docs/SPEC.md §5 fidelity is on
    /// global layers).
    pub skipped_local_layers: Vec<usize>,
    /// Query positions per layer.
    pub positions: usize,
    /// Per method.
    pub methods: Vec<MethodResult>,
    /// Largest relative difference between the capture's own `o` and dense attention
    /// recomputed from q, k, v (None when the capture has no `o`).
    pub o_consistency_max: Option<f64>,
}

/// Checks the run parameters against the capture and returns the layers to evaluate and the
/// sliding-window layers skipped.
pub(crate) fn plan_layers(
    info: &CaptureInfo,
    params: &FidelityParams,
) -> Result<(Vec<usize>, Vec<usize>), FidelityError> {
    let (layers, skipped): (Vec<usize>, Vec<usize>) = match &params.layers {
        Some(l) => {
            for x in l {
                if !info.layers.contains(x) {
                    return Err(FidelityError::Invalid(format!(
                        "layer {x} is not in the capture"
                    )));
                }
            }
            (l.clone(), Vec::new())
        }
        None => {
            let (g, l): (Vec<_>, Vec<_>) = info
                .layers
                .iter()
                .zip(&info.kinds)
                .partition(|(_, k)| **k == LayerKind::Global);
            (
                g.into_iter().map(|x| *x.0).collect(),
                l.into_iter().map(|x| *x.0).collect(),
            )
        }
    };
    if layers.is_empty() {
        return Err(FidelityError::Invalid(
            "no global layers to evaluate".into(),
        ));
    }
    let min_ctx = params.select.sink + params.select.local;
    if let Some(&p) = info.positions.iter().find(|&&p| p + 1 < min_ctx) {
        return Err(FidelityError::Invalid(format!(
            "position {p} has a context of {} tokens, shorter than sink + local = {min_ctx}",
            p + 1
        )));
    }
    Ok((layers, skipped))
}

/// Runs every method on every evaluated layer; `progress` is called once per layer.
///
/// The method-independent work of a layer (its raw and KLT stores, dense attention at every
/// position) is done once and shared by all methods (`LayerCtx`); positions and KV heads
/// run in parallel, and the next layer is decoded while the current one is evaluated.
pub fn run(
    src: &dyn LayerSource,
    calib: Option<&dyn CalibSource>,
    methods: &[Box<dyn Scanner>],
    params: &FidelityParams,
    progress: &(dyn Fn(usize) + Sync),
) -> Result<FidelityReport, FidelityError> {
    let info = src.info();
    let (layers, skipped) = plan_layers(info, params)?;
    let m = methods.len();
    let mut per_layer = vec![Vec::new(); m];
    let mut per_layer_bits = vec![Vec::new(); m];
    let np = info.positions.len();
    let mut per_position = vec![vec![0f64; np]; m];
    let mut o_max: Option<f64> = None;
    let mut next = Some(src.layer(layers[0]));
    for (i, &l) in layers.iter().enumerate() {
        let data = next.take().expect("decoded ahead")?;
        let (r, decoded) = rayon::join(
            || -> Result<LayerResult, FidelityError> {
                LayerCtx::build(info, &data, calib, params)?.eval(methods)
            },
            || layers.get(i + 1).map(|&nl| src.layer(nl)),
        );
        next = decoded;
        let r = r?;
        for (i, (e, b)) in r.means.into_iter().enumerate() {
            per_layer[i].push(e);
            per_layer_bits[i].push(b);
        }
        for (acc, pp) in per_position.iter_mut().zip(&r.per_position) {
            for (a, x) in acc.iter_mut().zip(pp) {
                *a += x / layers.len() as f64;
            }
        }
        if let Some(o) = r.o_max {
            o_max = Some(o_max.map_or(o, |x: f64| x.max(o)));
        }
        progress(l);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    Ok(FidelityReport {
        positions: info.positions.len(),
        methods: (0..m)
            .map(|i| MethodResult {
                name: methods[i].name(),
                bits: mean(&per_layer_bits[i]),
                error: mean(&per_layer[i]),
                per_layer: per_layer[i].clone(),
                per_layer_bits: per_layer_bits[i].clone(),
                error_se: standard_error(&per_position[i]),
                per_position: per_position[i].clone(),
            })
            .collect(),
        layers,
        skipped_local_layers: skipped,
        o_consistency_max: o_max,
    })
}

/// One layer's result.
pub(crate) struct LayerResult {
    /// Per method `(mean error, mean bits)`.
    pub(crate) means: Vec<(f64, f64)>,
    /// The largest `o` inconsistency.
    pub(crate) o_max: Option<f64>,
    /// Per method, the error at each position (mean over KV heads).
    pub(crate) per_position: Vec<Vec<f64>>,
}

/// `sd(x) / √len` with the `len − 1` denominator; 0 for fewer than two values.
pub fn standard_error(x: &[f64]) -> f64 {
    let n = x.len();
    if n < 2 {
        return 0.0;
    }
    let mean = x.iter().sum::<f64>() / n as f64;
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (var / n as f64).sqrt()
}

/// The method-independent state of one (layer, KV head).
struct HeadCtx<'a> {
    keys: KvView<'a>,
    values: KvView<'a>,
    /// The keys transposed for exact dot products.
    tiles: KeyTiles,
    /// The raw 4-bit store.
    store: KeyStore,
    /// The store in the calibration KLT basis, shared by every KLT method.
    klt: Option<KeyStore>,
    calib: Option<&'a HeadCalib>,
    /// Dense attention outputs, `[P][G][D]`.
    dense: Vec<f32>,
    /// Per position, the largest relative difference of the capture's `o` from `dense`.
    o_err: Vec<f64>,
}

/// One layer prepared for evaluation: everything that does not depend on the method,
/// computed once and reused by every method (and, in calibration, by every candidate budget).
pub(crate) struct LayerCtx<'a> {
    info: &'a CaptureInfo,
    data: &'a LayerData,
    select: SelectParams,
    scale: f32,
    window: Option<usize>,
    heads: Vec<HeadCtx<'a>>,
}

/// The block that holds a query position, quantized causally (docs/SPEC.md §5 causal stores):
/// over its keys up to the position only, as a decoder's growing store holds it. The scan of
/// every key before the block is unchanged (its blocks are complete), so only the block's own
/// scores are recomputed, from stores and method state built over `block_start..=pos`.
struct CausalTail<'a> {
    /// First token of the block.
    start: usize,
    keys: KvView<'a>,
    store: KeyStore,
    klt: Option<KeyStore>,
}

impl<'a> CausalTail<'a> {
    /// `None` when the whole store's block of `pos` already ends at `pos` (the block is
    /// complete there, or `pos` is the last key): nothing after it can leak into its scale.
    fn build(hc: &HeadCtx<'a>, pos: usize, n: usize) -> Result<Option<Self>, StoreError> {
        let start = pos / BLOCK * BLOCK;
        if (pos + 1) % BLOCK == 0 || pos + 1 >= n {
            return Ok(None);
        }
        let Some(keys) = hc.keys.slice_rows(start, pos + 1) else {
            return Ok(None);
        };
        let dims = Dims {
            heads: 1,
            channels: keys.dim,
        };
        let store = KeyStore::from_keys(dims, &fathom_plan::scanner::gather_rows(&keys), None)?;
        let klt = match hc.calib {
            Some(c) if hc.klt.is_some() => rotated_store(&keys, &c.klt, BasisKind::Klt).ok(),
            _ => None,
        };
        Ok(Some(CausalTail {
            start,
            keys,
            store,
            klt,
        }))
    }

    /// Overwrites the block's scores in `scr.scores` (`[G][n]`) with the method's scores over
    /// the causal block.
    #[allow(clippy::too_many_arguments)]
    fn rescore(
        &self,
        layer: usize,
        calib: Option<&HeadCalib>,
        method: &dyn Scanner,
        q: &[f32],
        g: usize,
        n: usize,
        scr: &mut Scratch,
    ) -> Result<(), ScannerError> {
        let len = self.keys.rows();
        let input = HeadInput {
            layer,
            keys: self.keys,
            store: self.store.view(),
            calib,
            klt_store: self.klt.as_ref().map(KeyStore::view),
        };
        let head = method.prepare(&input)?;
        scr.tail.resize(g * len, 0.0);
        head.score(q, g, &mut scr.tail)?;
        for gi in 0..g {
            scr.scores[gi * n + self.start..gi * n + self.start + len]
                .copy_from_slice(&scr.tail[gi * len..(gi + 1) * len]);
        }
        Ok(())
    }
}

/// A precomputed exact dot product costs about a quarter of one computed from a key row.
const SHARE_FACTOR: usize = 4;

/// Working buffers of one rayon worker (scores, selection, one attention output).
struct Scratch {
    scores: Vec<f32>,
    /// `[G][len]` scores of the causal tail block.
    tail: Vec<f32>,
    idx: Vec<u32>,
    out: Vec<f32>,
    /// `[G][pos + 1]` exact dot products, when the selections share them.
    dots: Vec<f64>,
}

impl<'a> LayerCtx<'a> {
    /// Builds the stores and the dense reference of every KV head of a layer.
    pub(crate) fn build(
        info: &'a CaptureInfo,
        data: &'a LayerData,
        calib: Option<&'a dyn CalibSource>,
        params: &FidelityParams,
    ) -> Result<Self, FidelityError> {
        let (hkv, d, g, hq) = (info.hkv, info.d, info.g(), info.hq);
        let l = data.index;
        let scale = params.scale.unwrap_or(1.0 / (d as f32).sqrt());
        let window = match data.kind {
            LayerKind::Global => None,
            LayerKind::Local(w) => Some(w),
        };
        let np = info.positions.len();
        let store_err = |source| FidelityError::Store { layer: l, source };
        let proto = |source| FidelityError::Protocol { layer: l, source };
        // Stores per head (raw and, with a KLT calibration, KLT) in parallel.
        let stores = (0..2 * hkv)
            .into_par_iter()
            .map(|j| -> Result<Option<KeyStore>, FidelityError> {
                let (h, klt) = (j / 2, j % 2 == 1);
                let keys = KvView::head(&data.k, hkv, d, h);
                let dims = Dims {
                    heads: 1,
                    channels: d,
                };
                if !klt {
                    let rows = fathom_plan::scanner::gather_rows(&keys);
                    return KeyStore::from_keys(dims, &rows, None)
                        .map(Some)
                        .map_err(store_err);
                }
                match calib.and_then(|c| c.head(l, h)) {
                    Some(c) if c.klt.len() == d * d => {
                        match rotated_store(&keys, &c.klt, BasisKind::Klt) {
                            Ok(s) => Ok(Some(s)),
                            // Left to the method, which reports it in its own words.
                            Err(_) => Ok(None),
                        }
                    }
                    _ => Ok(None),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let tiles: Vec<KeyTiles> = (0..hkv)
            .into_par_iter()
            .map(|h| KeyTiles::new(KvView::head(&data.k, hkv, d, h)))
            .collect();
        // Dense attention (and the `o` check) at every (head, position).
        let dense = (0..hkv * np)
            .into_par_iter()
            .map(|j| -> Result<(Vec<f32>, f64), FidelityError> {
                let (h, pi) = (j / np, j % np);
                let pos = info.positions[pi];
                let keys = &tiles[h];
                let values = KvView::head(&data.v, hkv, d, h);
                let q = &data.q[(pi * hq + h * g) * d..(pi * hq + (h + 1) * g) * d];
                let mut dense = vec![0f32; g * d];
                let mut o_err = 0f64;
                for gi in 0..g {
                    attend_dense_tiled(
                        &q[gi * d..(gi + 1) * d],
                        keys,
                        values,
                        pos,
                        window,
                        scale,
                        info.softcap,
                        &mut dense[gi * d..(gi + 1) * d],
                    )
                    .map_err(proto)?;
                    if let Some(o) = &data.o {
                        let off = (pi * hq + h * g + gi) * d;
                        o_err = o_err.max(relative_error(
                            &o[off..off + d],
                            &dense[gi * d..(gi + 1) * d],
                        ));
                    }
                }
                Ok((dense, o_err))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut stores = stores.into_iter();
        let mut dense = dense.into_iter();
        let mut tiles = tiles.into_iter();
        let heads = (0..hkv)
            .map(|h| {
                let store = stores.next().flatten().expect("raw store built");
                let klt = stores.next().flatten();
                let (mut dn, mut o_err) = (Vec::with_capacity(np * g * d), Vec::with_capacity(np));
                for (x, e) in dense.by_ref().take(np) {
                    dn.extend_from_slice(&x);
                    o_err.push(e);
                }
                HeadCtx {
                    keys: KvView::head(&data.k, hkv, d, h),
                    values: KvView::head(&data.v, hkv, d, h),
                    tiles: tiles.next().expect("one per head"),
                    store,
                    klt,
                    calib: calib.and_then(|c| c.head(l, h)),
                    dense: dn,
                    o_err,
                }
            })
            .collect();
        Ok(Self {
            info,
            data,
            select: params.select,
            scale,
            window,
            heads,
        })
    }

    /// Evaluates `methods` on this layer: per method, the error and bits averaged over
    /// positions, then over KV heads (the same order of summation for any thread count).
    pub(crate) fn eval(&self, methods: &[Box<dyn Scanner>]) -> Result<LayerResult, FidelityError> {
        let info = self.info;
        let (hkv, d, g, n, hq) = (info.hkv, info.d, info.g(), info.n, info.hq);
        let l = self.data.index;
        let m = methods.len();
        let np = info.positions.len();
        let scanner_err = |mi: usize| {
            move |source| FidelityError::Scanner {
                method: methods[mi].name(),
                layer: l,
                source,
            }
        };
        let proto = |source| FidelityError::Protocol { layer: l, source };
        // Per (head, method) state, in parallel.
        let mut prepared = (0..hkv * m)
            .into_par_iter()
            .map(|j| {
                let (h, mi) = (j / m, j % m);
                let hc = &self.heads[h];
                let input = HeadInput {
                    layer: l,
                    keys: hc.keys,
                    store: hc.store.view(),
                    calib: hc.calib,
                    klt_store: hc.klt.as_ref().map(KeyStore::view),
                };
                methods[mi].prepare(&input).map_err(scanner_err(mi))
            })
            .collect::<Result<Vec<_>, _>>()?
            .into_iter();
        let prepared: Vec<Vec<_>> = (0..hkv)
            .map(|_| prepared.by_ref().take(m).collect())
            .collect();
        // With many selecting methods, each query's exact dot products are computed once from
        // the tiles (several times cheaper per product) and every selection reads them;
        // with few, each selection computes its own (the same values either way).
        let selecting = methods.iter().filter(|m| !m.is_dense()).count();
        let per_set = self.select.sink + self.select.local + self.select.k;
        let share = selecting * per_set * SHARE_FACTOR > n;
        // Every (head, position) in parallel, each worker reusing its buffers.
        let per_pos = (0..hkv * np)
            .into_par_iter()
            .map_init(
                || Scratch {
                    scores: vec![0f32; g * n],
                    tail: Vec::new(),
                    idx: Vec::new(),
                    out: vec![0f32; d],
                    dots: Vec::new(),
                },
                |scr, j| -> Result<Vec<(f64, f64)>, FidelityError> {
                    let (h, pi) = (j / np, j % np);
                    let pos = info.positions[pi];
                    let hc = &self.heads[h];
                    let q = &self.data.q[(pi * hq + h * g) * d..(pi * hq + (h + 1) * g) * d];
                    let dense = &hc.dense[pi * g * d..(pi + 1) * g * d];
                    let mut res = Vec::with_capacity(m);
                    let tail = CausalTail::build(hc, pos, n)
                        .map_err(|source| FidelityError::Store { layer: l, source })?;
                    if share {
                        scr.dots.resize(g * (pos + 1), 0.0);
                        for (gi, dots) in scr.dots.chunks_exact_mut(pos + 1).enumerate() {
                            hc.tiles
                                .dots(&q[gi * d..(gi + 1) * d], dots)
                                .map_err(proto)?;
                        }
                    }
                    for (mi, head) in prepared[h].iter().enumerate() {
                        let bits =
                            head.score(q, g, &mut scr.scores).map_err(scanner_err(mi))? as f64;
                        let mut err = 0f64;
                        if !methods[mi].is_dense() {
                            if let Some(t) = &tail {
                                t.rescore(l, hc.calib, &*methods[mi], q, g, n, scr)
                                    .map_err(scanner_err(mi))?;
                            }
                            for gi in 0..g {
                                select_per_head(
                                    pos,
                                    &scr.scores[gi * n..(gi + 1) * n],
                                    &self.select,
                                    &mut scr.idx,
                                )
                                .map_err(proto)?;
                                if let Some(w) = self.window {
                                    scr.idx.retain(|&i| i as usize + w > pos);
                                }
                                if share {
                                    attend_dots(
                                        &scr.dots[gi * (pos + 1)..(gi + 1) * (pos + 1)],
                                        hc.values,
                                        &scr.idx,
                                        self.scale,
                                        info.softcap,
                                        &mut scr.out,
                                    )
                                } else {
                                    attend(
                                        &q[gi * d..(gi + 1) * d],
                                        hc.keys,
                                        hc.values,
                                        &scr.idx,
                                        self.scale,
                                        info.softcap,
                                        &mut scr.out,
                                    )
                                }
                                .map_err(proto)?;
                                err += relative_error(&scr.out, &dense[gi * d..(gi + 1) * d]);
                            }
                        }
                        res.push((err / g as f64, bits));
                    }
                    Ok(res)
                },
            )
            .collect::<Result<Vec<_>, _>>()?;
        let mut out = vec![(0f64, 0f64); m];
        let mut o_max: Option<f64> = None;
        let npf = np as f64;
        let mut per_position = vec![vec![0f64; np]; m];
        for rows in per_pos.chunks(np) {
            for (pi, r) in rows.iter().enumerate() {
                for (mi, x) in r.iter().enumerate() {
                    per_position[mi][pi] += x.0 / hkv as f64;
                }
            }
        }
        for (h, rows) in per_pos.chunks(np).enumerate() {
            let mut acc = vec![(0f64, 0f64); m];
            for r in rows {
                for (a, x) in acc.iter_mut().zip(r) {
                    a.0 += x.0 / npf;
                    a.1 += x.1 / npf;
                }
            }
            for (a, x) in out.iter_mut().zip(acc) {
                a.0 += x.0 / hkv as f64;
                a.1 += x.1 / hkv as f64;
            }
            if self.data.o.is_some() {
                let o = self.heads[h].o_err.iter().fold(0f64, |a, &b| a.max(b));
                o_max = Some(o_max.map_or(o, |x: f64| x.max(o)));
            }
        }
        Ok(LayerResult {
            means: out,
            o_max,
            per_position,
        })
    }
}

/// Where the Fathom curve meets a baseline's error (docs/SPEC.md §5 equal-error saving).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EqualError {
    /// Fathom's bits at the baseline's error.
    pub bits: f64,
    /// Fathom's lowest budget already beats the baseline, so `bits` is that budget and the
    /// true equal-error bits are at most `bits`: the saving is a lower bound (`≥`).
    pub lower_bound: bool,
}

/// The bits at which the Fathom curve `(bits, error)` meets `target_error`, interpolating
/// log-error linearly in bits between neighbouring points (docs/SPEC.md §5 equal-error saving).
/// `None` if the curve never reaches the target within its range. The one implementation of
/// this rule: the CLI, the report and the bootstrap all call it.
pub fn equal_error(curve: &[(f64, f64)], target_error: f64) -> Option<EqualError> {
    let mut pts: Vec<(f64, f64)> = curve.iter().copied().filter(|p| p.1 > 0.0).collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    if pts.is_empty() || target_error <= 0.0 {
        return None;
    }
    if pts[0].1 <= target_error {
        return Some(EqualError {
            bits: pts[0].0,
            lower_bound: true,
        });
    }
    let t = target_error.ln();
    for w in pts.windows(2) {
        let ((b0, e0), (b1, e1)) = (w[0], w[1]);
        if e1 <= target_error {
            let (l0, l1) = (e0.ln(), e1.ln());
            let f = if l0 == l1 { 0.0 } else { (l0 - t) / (l0 - l1) };
            return Some(EqualError {
                bits: b0 + f * (b1 - b0),
                lower_bound: false,
            });
        }
    }
    None
}

/// Fathom's error at `bits` on the curve `(bits, error)` sorted by bits, interpolating
/// log-error linearly in bits (the inverse reading of [`equal_error`]); `None` outside the
/// curve's range.
pub fn error_at_bits(curve: &[(f64, f64)], bits: f64) -> Option<f64> {
    curve
        .windows(2)
        .find(|w| w[0].0 <= bits && bits <= w[1].0)
        .map(|w| {
            let f = if w[1].0 == w[0].0 {
                0.0
            } else {
                (bits - w[0].0) / (w[1].0 - w[0].0)
            };
            (w[0].1.ln() + f * (w[1].1.ln() - w[0].1.ln())).exp()
        })
}

/// [`equal_error`]'s bits alone.
pub fn equal_error_bits(curve: &[(f64, f64)], target_error: f64) -> Option<f64> {
    equal_error(curve, target_error).map(|e| e.bits)
}

/// A 95 % percentile-bootstrap interval, over query positions, of the equal-error saving
/// `baseline.bits / fathom_bits` of the Fathom curve `fathom` against `baseline`.
///
/// Each of `resamples` resamples draws `P` positions with replacement (SplitMix64 from
/// `seed`), recomputes every method's mean error over them from `per_position` (bits stay at
/// their means) and re-reads [`equal_error`]. A resample whose curve does not reach the
/// baseline counts as a saving of 0 and a bounded one at its bound, so the interval is
/// conservative. `None` with fewer than two curve points or two positions.
pub fn bootstrap_saving(
    fathom: &[&MethodResult],
    baseline: &MethodResult,
    resamples: usize,
    seed: u64,
) -> Option<(f64, f64)> {
    let np = baseline.per_position.len();
    if fathom.len() < 2 || np < 2 || resamples == 0 {
        return None;
    }
    if fathom.iter().any(|m| m.per_position.len() != np) {
        return None;
    }
    let mut state = seed;
    let mut next = move || {
        // SplitMix64.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut draw = vec![0usize; np];
    let mut savings = Vec::with_capacity(resamples);
    for _ in 0..resamples {
        for d in draw.iter_mut() {
            *d = (next() % np as u64) as usize;
        }
        let mean =
            |m: &MethodResult| draw.iter().map(|&i| m.per_position[i]).sum::<f64>() / np as f64;
        let curve: Vec<(f64, f64)> = fathom.iter().map(|m| (m.bits, mean(m))).collect();
        let s = match equal_error(&curve, mean(baseline)) {
            Some(e) if e.bits > 0.0 => baseline.bits / e.bits,
            Some(_) => f64::INFINITY,
            None => 0.0,
        };
        savings.push(s);
    }
    savings.sort_by(f64::total_cmp);
    let at = |q: f64| savings[((q * (resamples - 1) as f64).round() as usize).min(resamples - 1)];
    Some((at(0.025), at(0.975)))
}
