//! The fidelity harness (SPEC §5): every method ranks the keys, the shared protocol selects
//! (sink, local, top-k per query head), attends exactly, and measures
//! `‖o_sel − o_dense‖ / ‖o_dense‖`, averaged over positions, query heads and layers.

use rayon::prelude::*;

use fathom_plan::scanner::{HeadCalib, HeadInput, Scanner, ScannerError};
use fathom_plan::{
    attend, attend_dense, relative_error, select_per_head, KvView, PlanError, SelectParams,
};
use fathom_store::{Dims, KeyStore, StoreError};

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
#[derive(Debug, Clone)]
pub struct FidelityParams {
    /// Sink, local, k.
    pub select: SelectParams,
    /// Layers to evaluate (default: the global layers).
    pub layers: Option<Vec<usize>>,
    /// Attention scale (default `1/√D`).
    pub scale: Option<f32>,
}

impl Default for FidelityParams {
    fn default() -> Self {
        Self {
            select: SelectParams::default(),
            layers: None,
            scale: None,
        }
    }
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
}

/// A whole run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FidelityReport {
    /// Layers evaluated.
    pub layers: Vec<usize>,
    /// Layers skipped (sliding-window layers keep their own window; SPEC §5 fidelity is on
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

/// Runs every method on every evaluated layer; `progress` is called once per layer.
pub fn run(
    src: &dyn LayerSource,
    calib: Option<&dyn CalibSource>,
    methods: &[Box<dyn Scanner>],
    params: &FidelityParams,
    progress: &(dyn Fn(usize) + Sync),
) -> Result<FidelityReport, FidelityError> {
    let info = src.info();
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
    let m = methods.len();
    let mut per_layer = vec![Vec::new(); m];
    let mut per_layer_bits = vec![Vec::new(); m];
    let mut o_max: Option<f64> = None;
    for &l in &layers {
        let data = src.layer(l)?;
        let r = run_layer(info, &data, calib, methods, params)?;
        for (i, (e, b)) in r.0.into_iter().enumerate() {
            per_layer[i].push(e);
            per_layer_bits[i].push(b);
        }
        if let Some(o) = r.1 {
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
            })
            .collect(),
        layers,
        skipped_local_layers: skipped,
        o_consistency_max: o_max,
    })
}

type LayerResult = (Vec<(f64, f64)>, Option<f64>);

fn run_layer(
    info: &CaptureInfo,
    data: &LayerData,
    calib: Option<&dyn CalibSource>,
    methods: &[Box<dyn Scanner>],
    params: &FidelityParams,
) -> Result<LayerResult, FidelityError> {
    let (hkv, d, g, n) = (info.hkv, info.d, info.g(), info.n);
    let hq = info.hq;
    let l = data.index;
    let scale = params.scale.unwrap_or(1.0 / (d as f32).sqrt());
    let window = match data.kind {
        LayerKind::Global => None,
        LayerKind::Local(w) => Some(w),
    };
    let m = methods.len();
    // Per KV head: (sum err, sum bits, count) per method, and the o check.
    let heads: Vec<(Vec<(f64, f64)>, Option<f64>)> = (0..hkv)
        .into_par_iter()
        .map(|h| -> Result<_, FidelityError> {
            let keys = KvView::head(&data.k, hkv, d, h);
            let values = KvView::head(&data.v, hkv, d, h);
            let rows = fathom_plan::scanner::gather_rows(&keys);
            let store = KeyStore::from_keys(
                Dims {
                    heads: 1,
                    channels: d,
                },
                &rows,
                None,
            )
            .map_err(|source| FidelityError::Store { layer: l, source })?;
            let input = HeadInput {
                layer: l,
                keys,
                store: store.view(),
                calib: calib.and_then(|c| c.head(l, h)),
            };
            let prepared = methods
                .iter()
                .map(|meth| {
                    meth.prepare(&input)
                        .map_err(|source| FidelityError::Scanner {
                            method: meth.name(),
                            layer: l,
                            source,
                        })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let per_pos: Vec<(Vec<(f64, f64)>, f64)> = info
                .positions
                .par_iter()
                .enumerate()
                .map(|(pi, &pos)| -> Result<_, FidelityError> {
                    let proto = |source| FidelityError::Protocol { layer: l, source };
                    let q = &data.q[(pi * hq + h * g) * d..(pi * hq + (h + 1) * g) * d];
                    let mut dense = vec![0f32; g * d];
                    let mut o_err = 0f64;
                    for gi in 0..g {
                        attend_dense(
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
                    let mut scores = vec![0f32; g * n];
                    let mut idx = Vec::new();
                    let mut out = vec![0f32; d];
                    let mut res = Vec::with_capacity(m);
                    for (mi, head) in prepared.iter().enumerate() {
                        let bits = head.score(q, g, &mut scores).map_err(|source| {
                            FidelityError::Scanner {
                                method: methods[mi].name(),
                                layer: l,
                                source,
                            }
                        })? as f64;
                        let mut err = 0f64;
                        if !methods[mi].is_dense() {
                            for gi in 0..g {
                                select_per_head(
                                    pos,
                                    &scores[gi * n..(gi + 1) * n],
                                    &params.select,
                                    &mut idx,
                                )
                                .map_err(proto)?;
                                if let Some(w) = window {
                                    idx.retain(|&i| i as usize + w > pos);
                                }
                                attend(
                                    &q[gi * d..(gi + 1) * d],
                                    keys,
                                    values,
                                    &idx,
                                    scale,
                                    info.softcap,
                                    &mut out,
                                )
                                .map_err(proto)?;
                                err += relative_error(&out, &dense[gi * d..(gi + 1) * d]);
                            }
                        }
                        res.push((err / g as f64, bits));
                    }
                    Ok((res, o_err))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let np = per_pos.len() as f64;
            let mut acc = vec![(0f64, 0f64); m];
            let mut o_max = 0f64;
            for (r, o) in per_pos {
                for (a, x) in acc.iter_mut().zip(r) {
                    a.0 += x.0 / np;
                    a.1 += x.1 / np;
                }
                o_max = o_max.max(o);
            }
            Ok((acc, data.o.as_ref().map(|_| o_max)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = vec![(0f64, 0f64); m];
    let mut o_max: Option<f64> = None;
    for (acc, o) in heads {
        for (a, x) in out.iter_mut().zip(acc) {
            a.0 += x.0 / hkv as f64;
            a.1 += x.1 / hkv as f64;
        }
        if let Some(o) = o {
            o_max = Some(o_max.map_or(o, |x: f64| x.max(o)));
        }
    }
    Ok((out, o_max))
}

/// The bits at which the Fathom curve `(bits, error)` meets `target_error`, interpolating
/// log-error linearly in bits between neighbouring points (SPEC §5 equal-error saving).
/// `None` if the curve never reaches the target within its range.
pub fn equal_error_bits(curve: &[(f64, f64)], target_error: f64) -> Option<f64> {
    let mut pts: Vec<(f64, f64)> = curve.iter().copied().filter(|p| p.1 > 0.0).collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    if pts.is_empty() || target_error <= 0.0 {
        return None;
    }
    if pts[0].1 <= target_error {
        return Some(pts[0].0);
    }
    let t = target_error.ln();
    for w in pts.windows(2) {
        let ((b0, e0), (b1, e1)) = (w[0], w[1]);
        if e1 <= target_error {
            let (l0, l1) = (e0.ln(), e1.ln());
            let f = if l0 == l1 { 0.0 } else { (l0 - t) / (l0 - l1) };
            return Some(b0 + f * (b1 - b0));
        }
    }
    None
}
