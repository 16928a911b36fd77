//! Calibration files: per (layer, KV head) channel variances, the KLT basis and its
//! eigenvalues, Loki's PCA basis, Double Sparsity's channels (the math is
//! `fathom_plan::calib`, free of I/O), Fathom's per-layer budgets and the basis rule
//! (docs/SPEC.md §3), computed from a calibration capture and read back.
//!
//! # File format (JSON, versioned)
//!
//! ```text
//! { "format": "fathom-calibration", "version": 1, "model": str, "capture": str,
//!   "n": int, "hkv": int, "g": int, "d": int, "layers": [int],
//!   "heads": [[HeadCalib per KV head] per layer in `layers`],
//!   "budgets": [{"target": float, "basis": "Raw"|"Klt", "per_layer": [float per layer index]}],
//!   "basis_rule": {"choice": "Raw"|"Klt", "raw_error": float, "klt_error": float, "budget": float} }
//! ```
//!
//! `HeadCalib` matrices are row-major `[D][D]` with basis vectors in columns.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use fathom_plan::scanner::{Fathom, HeadCalib, Scanner, StoreBasis};
use fathom_plan::{allocate_layer_budgets, KvView, LayerBudgetParams};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::capture::{CaptureInfo, LayerData, LayerKind};
use crate::fidelity::{self, CalibSource, FidelityError, FidelityParams, LayerCtx, LayerSource};

/// Format tag.
pub const FORMAT: &str = "fathom-calibration";
/// Format version.
pub const VERSION: u32 = 1;

pub use fathom_results::calibration::{BasisRule, TargetBudgets};

/// A calibration file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Calibration {
    /// `fathom-calibration`.
    pub format: String,
    /// 1.
    pub version: u32,
    /// Model name from the capture.
    pub model: String,
    /// Capture path it was computed from.
    pub capture: String,
    /// Tokens of the calibration capture.
    pub n: usize,
    /// KV heads.
    pub hkv: usize,
    /// Query heads per KV head.
    pub g: usize,
    /// Channels.
    pub d: usize,
    /// Layer indices calibrated.
    pub layers: Vec<usize>,
    /// `heads[slot][kv_head]`.
    pub heads: Vec<Vec<HeadCalib>>,
    /// Per-layer budgets per target.
    pub budgets: Vec<TargetBudgets>,
    /// Basis rule.
    pub basis_rule: Option<BasisRule>,
}

impl CalibSource for Calibration {
    fn head(&self, layer: usize, kv_head: usize) -> Option<&HeadCalib> {
        let slot = self.layers.iter().position(|&l| l == layer)?;
        self.heads.get(slot)?.get(kv_head)
    }
}

/// Errors of calibration files.
#[derive(Debug, thiserror::Error)]
pub enum CalibError {
    /// I/O.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Not a calibration file, wrong version or inconsistent.
    #[error("{path}: {reason}")]
    Invalid {
        /// Path.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// Fidelity evaluation inside calibration failed.
    #[error(transparent)]
    Fidelity(#[from] FidelityError),
}

impl Calibration {
    /// Loads and validates a calibration file.
    pub fn load(path: &Path) -> Result<Self, CalibError> {
        let p = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| CalibError::Io {
            path: p.clone(),
            source,
        })?;
        let inv = |reason: String| CalibError::Invalid {
            path: p.clone(),
            reason,
        };
        let c: Calibration = serde_json::from_slice(&bytes)
            .map_err(|e| inv(format!("not a Fathom calibration file: {e}")))?;
        if c.format != FORMAT {
            return Err(inv(format!(
                "format tag {:?}, expected {FORMAT:?}",
                c.format
            )));
        }
        if c.version != VERSION {
            return Err(inv(format!(
                "calibration version {} (this build reads {VERSION})",
                c.version
            )));
        }
        if c.heads.len() != c.layers.len() {
            return Err(inv("`heads` and `layers` differ in length".into()));
        }
        for (slot, hs) in c.heads.iter().enumerate() {
            if hs.len() != c.hkv {
                return Err(inv(format!(
                    "layer {} has {} heads, expected {}",
                    c.layers[slot],
                    hs.len(),
                    c.hkv
                )));
            }
            for h in hs {
                let dd = c.d.checked_mul(c.d);
                let bad = h.sigma2.len() != c.d
                    || (!h.klt.is_empty() && Some(h.klt.len()) != dd)
                    || (!h.loki.is_empty() && Some(h.loki.len()) != dd)
                    || h.sigma2
                        .iter()
                        .chain(&h.klt)
                        .chain(&h.loki)
                        .chain(&h.klt_sigma2)
                        .any(|x| !x.is_finite())
                    || h.ds_channels.iter().any(|&x| x as usize >= c.d);
                if bad {
                    return Err(inv(format!(
                        "layer {}: inconsistent or non-finite head calibration",
                        c.layers[slot]
                    )));
                }
            }
        }
        let max = 4.25 * c.d as f32;
        for b in &c.budgets {
            if let Some(x) = std::iter::once(&b.target)
                .chain(&b.per_layer)
                .find(|x| !(0.0..=max).contains(*x))
            {
                return Err(inv(format!(
                    "budget {x} bits (target {}) is outside [0, {max}] (4.25 × D)",
                    b.target
                )));
            }
        }
        Ok(c)
    }

    /// Checks that this calibration fits a capture's shapes.
    pub fn check_against(&self, info: &CaptureInfo) -> Result<(), String> {
        if (self.hkv, self.g, self.d) != (info.hkv, info.g(), info.d) {
            return Err(format!(
                "calibration is for Hkv={}, G={}, D={} but the capture has Hkv={}, G={}, D={}",
                self.hkv,
                self.g,
                self.d,
                info.hkv,
                info.g(),
                info.d
            ));
        }
        if let Some(l) = info.layers.iter().find(|l| !self.layers.contains(l)) {
            return Err(format!(
                "calibration has no data for layer {l} of the capture"
            ));
        }
        Ok(())
    }

    /// Per-layer budgets for a target, if calibrated.
    pub fn budgets_for(&self, target: f32) -> Option<&TargetBudgets> {
        self.budgets
            .iter()
            .find(|b| (b.target - target).abs() < 1e-3)
    }
}

pub use fathom_plan::calib::{head_calib, jacobi_eigen};

/// [`head_calib`] of KV head `h` of one captured layer: its keys, and the queries of its
/// group at every captured position (a non-finite value is an error naming the layer).
fn layer_head_calib(
    info: &CaptureInfo,
    data: &LayerData,
    h: usize,
) -> Result<HeadCalib, FidelityError> {
    let (hkv, d, g, hq) = (info.hkv, info.d, info.g(), info.hq);
    let keys = KvView::head(&data.k, hkv, d, h);
    let mut qs = Vec::new();
    for p in 0..info.positions.len() {
        qs.extend_from_slice(&data.q[(p * hq + h * g) * d..(p * hq + (h + 1) * g) * d]);
    }
    head_calib(&keys, &qs).map_err(|source| FidelityError::Protocol {
        layer: data.index,
        source,
    })
}

impl Calibration {
    /// Everything but the per-head data (tens of MB, not committed): shape, layers, per-layer
    /// budgets and the basis rule, with the command that made the calibration. `fathom
    /// calibrate` writes it beside its output, and the report reads it for the basis-rule
    /// claim, so a summary never lags its calibration.
    pub fn summary(&self, command: &str) -> fathom_results::calibration::CalibrationSummary {
        fathom_results::calibration::CalibrationSummary {
            version: fathom_results::VERSION,
            command: command.into(),
            note: "Summary of the calibration file (its per-head sigma2, KLT, Loki and DS data are regenerated by the command below and not committed).".into(),
            model: self.model.clone(),
            capture: self.capture.clone(),
            n: self.n,
            hkv: self.hkv,
            g: self.g,
            d: self.d,
            layers: self.layers.clone(),
            budgets: self.budgets.clone(),
            basis_rule: self.basis_rule.clone(),
        }
    }

    /// Where [`Calibration::summary`] goes for a calibration written to `out`:
    /// `<stem>-summary.json` beside it (`calibration.json` → `calibration-summary.json`).
    pub fn summary_path(out: &Path) -> std::path::PathBuf {
        let stem = out.file_stem().map_or_else(
            || "calibration".into(),
            |s| s.to_string_lossy().into_owned(),
        );
        out.with_file_name(format!("{stem}-summary.json"))
    }
}

impl Calibration {
    /// A statistics-only calibration of an in-memory workload (per-head σ², bases and DS
    /// channels from each layer's own keys and the queries of its positions; no per-layer
    /// budgets, no basis rule). `capture` names where the workload came from.
    ///
    /// # Errors
    /// A layer whose keys or queries are not finite, or of a head dimension the statistics do
    /// not take ([`fathom_plan::calib::head_calib`]).
    pub fn statistics_only(
        src: &crate::fidelity::InMemory,
        capture: &str,
    ) -> Result<Calibration, CalibError> {
        let info = &src.info;
        let hkv = info.hkv;
        let heads = src
            .layers
            .iter()
            .map(|data| (0..hkv).map(|h| layer_head_calib(info, data, h)).collect())
            .collect::<Result<_, _>>()?;
        Ok(Calibration::statistics(info, capture, heads))
    }

    /// A calibration of `info`'s shape holding `heads` and no budgets or basis rule yet.
    fn statistics(info: &CaptureInfo, capture: &str, heads: Vec<Vec<HeadCalib>>) -> Calibration {
        Calibration {
            format: FORMAT.into(),
            version: VERSION,
            model: info.model.clone(),
            capture: capture.into(),
            n: info.n,
            hkv: info.hkv,
            g: info.g(),
            d: info.d,
            layers: info.layers.clone(),
            heads,
            budgets: Vec::new(),
            basis_rule: None,
        }
    }
}

/// Calibration parameters.
#[derive(Debug, Clone)]
pub struct CalibParams {
    /// Target mean budgets for per-layer plans.
    pub targets: Vec<f32>,
    /// Fidelity parameters (k, sink, local) used for the calibration error.
    pub fidelity: FidelityParams,
    /// Bits moved per greedy step.
    pub quantum: f32,
    /// Flat budget at which the basis rule compares raw and KLT.
    pub rule_budget: f32,
}

/// Computes a calibration from a capture. `progress(stage, done, total)`.
pub fn calibrate(
    src: &dyn LayerSource,
    capture_name: &str,
    params: &CalibParams,
    progress: &(dyn Fn(&str, usize, usize) + Sync),
) -> Result<Calibration, CalibError> {
    let info = src.info().clone();
    let (hkv, d) = (info.hkv, info.d);
    // Decode every layer and compute its statistics, (layer, head) pairs in parallel.
    let done = AtomicUsize::new(0);
    let nl = info.layers.len();
    let per_layer = info
        .layers
        .par_iter()
        .map(|&l| -> Result<(LayerData, Vec<HeadCalib>), CalibError> {
            let data = src.layer(l).map_err(FidelityError::from)?;
            let hs: Vec<HeadCalib> = (0..hkv)
                .into_par_iter()
                .map(|h| layer_head_calib(&info, &data, h))
                .collect::<Result<_, _>>()?;
            progress("statistics", done.fetch_add(1, Ordering::Relaxed) + 1, nl);
            Ok((data, hs))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (layers_data, heads): (Vec<LayerData>, Vec<Vec<HeadCalib>>) = per_layer.into_iter().unzip();
    let mut cal = Calibration::statistics(&info, capture_name, heads);
    let global: Vec<usize> = info
        .layers
        .iter()
        .zip(&info.kinds)
        .filter(|(_, k)| **k == LayerKind::Global)
        .map(|(l, _)| *l)
        .collect();
    let fp = FidelityParams {
        layers: Some(global.clone()),
        ..params.fidelity.clone()
    };
    fidelity::plan_layers(&info, &fp)?;
    // Every candidate budget reuses each layer's stores and dense reference.
    let (raw_error, klt_error, choice, budgets) = {
        let calib_src: &dyn CalibSource = &cal;
        let ctxs = global
            .iter()
            .map(|&l| {
                let slot = info
                    .layers
                    .iter()
                    .position(|&x| x == l)
                    .expect("global layer");
                LayerCtx::build(&info, &layers_data[slot], Some(calib_src), &fp)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // The mean over `slots` of each layer's error (as `fidelity::run` averages layers).
        let eval = |m: Fathom, slots: &[usize]| -> Result<f64, FidelityError> {
            let methods: Vec<Box<dyn Scanner>> = vec![Box::new(m)];
            let errs = slots
                .iter()
                .map(|&s| Ok(ctxs[s].eval(&methods)?.means[0].0))
                .collect::<Result<Vec<f64>, FidelityError>>()?;
            Ok(errs.iter().sum::<f64>() / errs.len() as f64)
        };
        let all: Vec<usize> = (0..global.len()).collect();
        // Basis rule: raw against KLT at one flat budget.
        let mut raw = Fathom::new(params.rule_budget);
        raw.basis = StoreBasis::Raw;
        let mut klt = Fathom::new(params.rule_budget);
        klt.basis = StoreBasis::Klt;
        let raw_error = eval(raw, &all)?;
        progress("basis rule", 1, 2);
        let klt_error = eval(klt, &all)?;
        progress("basis rule", 2, 2);
        let choice = if klt_error < raw_error {
            StoreBasis::Klt
        } else {
            StoreBasis::Raw
        };
        // Per-layer budgets with the greedy allocator on this capture's attention error.
        let max_b = 4.25 * d as f32;
        let nlayers = info.layers.iter().max().map_or(0, |m| m + 1);
        let mut budgets = Vec::new();
        for (ti, &target) in params.targets.iter().enumerate() {
            let lp = LayerBudgetParams {
                layers: global.len(),
                target_mean: target,
                quantum: params.quantum,
                min_budget: 0.0,
                max_budget: max_b,
                start: (target / 3.0).floor().max(0.0),
            };
            let mut failure: Option<FidelityError> = None;
            let alloc = allocate_layer_budgets(&lp, |slot, b| {
                let mut f = Fathom::new(b);
                f.basis = choice;
                match eval(f, &[slot]) {
                    Ok(e) => e,
                    Err(e) => {
                        failure.get_or_insert(e);
                        f64::INFINITY
                    }
                }
            })
            .map_err(|e| CalibError::Invalid {
                path: capture_name.into(),
                reason: e.to_string(),
            })?;
            if let Some(e) = failure {
                return Err(e.into());
            }
            let mut per_layer = vec![target; nlayers];
            for (slot, &l) in global.iter().enumerate() {
                per_layer[l] = alloc[slot];
            }
            budgets.push(TargetBudgets {
                target,
                basis: choice,
                per_layer,
            });
            progress("per-layer budgets", ti + 1, params.targets.len());
        }
        (raw_error, klt_error, choice, budgets)
    };
    cal.budgets = budgets;
    cal.basis_rule = Some(BasisRule {
        choice,
        raw_error,
        klt_error,
        budget: params.rule_budget,
    });
    Ok(cal)
}
