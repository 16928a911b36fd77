//! A fidelity run of a capture file, end to end (what `fathom fidelity` and the Python
//! package's `fathom.fidelity` both call): open the capture (docs/SPEC.md §8), load and check
//! the calibration, parse the method list, run every method under the selection protocol of
//! docs/SPEC.md §5, and build the typed result document.

use std::path::Path;

use fathom_plan::method::MethodError;
use fathom_plan::SelectParams;
use fathom_results::fidelity::{FidelityDoc, Study};

use crate::calib::{CalibError, Calibration};
use crate::capture::Capture;
use crate::document::{document, DocMeta};
use crate::fidelity::{self, FidelityError, FidelityParams, FidelityReport, LayerSource};
use crate::methods::{scanners, BasisChoice};
use crate::tensors::TensorError;

/// What to evaluate.
#[derive(Debug, Clone)]
pub struct EvaluateArgs<'a> {
    /// The capture file.
    pub capture: &'a Path,
    /// A method list of the grammar (`dense,exact,fathom:48,sparq:32`).
    pub methods: &'a str,
    /// The basis of Fathom's stores.
    pub basis: BasisChoice,
    /// A calibration (`fathom calibrate`): σ², the KLT and the basis rule.
    pub calib: Option<&'a Path>,
    /// Top-k (default: [`default_k`] of the capture's tokens).
    pub k: Option<usize>,
    /// Layers (default: the global layers).
    pub layers: Option<Vec<usize>>,
    /// The study the document is recorded under.
    pub study: Study,
    /// The command recorded in the document.
    pub command: String,
}

/// Errors of [`evaluate`], each naming the file or the item at fault.
#[derive(Debug, thiserror::Error)]
pub enum EvaluateError {
    /// The capture could not be read or is not a valid capture.
    #[error("{path}: {source}")]
    Capture {
        /// The capture file.
        path: String,
        /// Cause.
        #[source]
        source: TensorError,
    },
    /// The calibration could not be read or does not fit the capture.
    #[error(transparent)]
    Calib(#[from] CalibError),
    /// A method list item outside the grammar.
    #[error(transparent)]
    Method(#[from] MethodError),
    /// A calibration target outside `[0, 4.25·D]`.
    #[error("target {target} bits is out of range [0, {most}] (4.25 × D = {d} channels)")]
    Target {
        /// The target asked for.
        target: f32,
        /// 4.25·D.
        most: f32,
        /// Channels.
        d: usize,
    },
    /// Top-k outside `1..=N`.
    #[error("k = {k} is out of range 1..={n} (the capture's N)")]
    K {
        /// The k asked for.
        k: usize,
        /// The capture's tokens.
        n: usize,
    },
    /// The run failed or its parameters are out of range.
    #[error(transparent)]
    Fidelity(#[from] FidelityError),
}

/// Default top-k for a capture of `n` tokens (docs/SPEC.md §5: 128 up to 4k, 256 up to 16k,
/// 512 beyond).
pub fn default_k(n: usize) -> usize {
    if n <= 4096 {
        128
    } else if n <= 16384 {
        256
    } else {
        512
    }
}

/// Runs the fidelity evaluation; `progress` is called once per evaluated layer. Returns the
/// document (as `fathom fidelity --json` writes it) and the run it was built from.
///
/// # Errors
/// [`EvaluateError`]: a missing or malformed capture or calibration, a calibration of another
/// shape, a bad method item, k outside `1..=N`, a layer not in the capture. All are checked
/// before the run.
pub fn evaluate(
    args: &EvaluateArgs<'_>,
    progress: &(dyn Fn(usize) + Sync),
) -> Result<(FidelityDoc, FidelityReport), EvaluateError> {
    let cap = Capture::open(args.capture).map_err(|source| EvaluateError::Capture {
        path: args.capture.display().to_string(),
        source,
    })?;
    let info = cap.info().clone();
    let calib = match args.calib {
        Some(p) => {
            let c = Calibration::load(p)?;
            c.check_against(&info)
                .map_err(|reason| CalibError::Invalid {
                    path: p.display().to_string(),
                    reason,
                })?;
            Some(c)
        }
        None => None,
    };
    let methods = scanners(args.methods, info.d, args.basis, calib.as_ref())?;
    let k = args.k.unwrap_or_else(|| default_k(info.n));
    if k == 0 || k > info.n {
        return Err(EvaluateError::K { k, n: info.n });
    }
    let fp = FidelityParams {
        select: SelectParams {
            k,
            ..Default::default()
        },
        layers: args.layers.clone(),
        ..Default::default()
    };
    let calib_src = calib.as_ref().map(|c| c as &dyn fidelity::CalibSource);
    let rep = fidelity::run(&cap as &dyn LayerSource, calib_src, &methods, &fp, progress)?;
    let doc = document(
        &rep,
        DocMeta {
            command: args.command.clone(),
            study: args.study,
            capture: args.capture.display().to_string(),
            model: info.model.clone(),
            synthetic: info.model.contains("synthetic"),
            basis: calib
                .as_ref()
                .and_then(|c| c.basis_rule.as_ref())
                .map(|r| format!("{:?}", r.choice)),
            d: info.d,
            n: info.n,
            hkv: info.hkv,
            g: info.g(),
            k,
        },
    );
    Ok((doc, rep))
}

/// What to calibrate (`fathom calibrate`).
#[derive(Debug, Clone)]
pub struct CalibrateArgs<'a> {
    /// The calibration capture.
    pub capture: &'a Path,
    /// The calibration file to write (JSON, atomically), with its `-summary.json` beside it.
    pub out: &'a Path,
    /// Target mean budgets of the per-layer plans (each in `[0, 4.25·D]`).
    pub targets: Vec<f32>,
    /// Top-k of the calibration error (default: [`default_k`] of the capture's tokens).
    pub k: Option<usize>,
    /// Bits moved per greedy step of the per-layer allocator.
    pub quantum: f32,
    /// The command recorded in the summary.
    pub command: String,
}

/// Calibrates on a capture (σ², the KLT and the basis rule per (layer, KV head), per-layer
/// budgets for each target; docs/SPEC.md §3) and writes the calibration and its summary.
/// `progress(stage, done, total)`.
///
/// # Errors
/// A missing or malformed capture, a target outside `[0, 4.25·D]`, k outside `1..=N` (all
/// checked before the run), or a file that cannot be written.
pub fn calibrate_file(
    args: &CalibrateArgs<'_>,
    progress: &(dyn Fn(&str, usize, usize) + Sync),
) -> Result<crate::calib::Calibration, EvaluateError> {
    let cap = Capture::open(args.capture).map_err(|source| EvaluateError::Capture {
        path: args.capture.display().to_string(),
        source,
    })?;
    let (n, d) = (cap.info().n, cap.info().d);
    let most = 4.25 * d as f32;
    if let Some(&target) = args.targets.iter().find(|t| !(0.0..=most).contains(*t)) {
        return Err(EvaluateError::Target { target, most, d });
    }
    if !(args.quantum > 0.0 && args.quantum.is_finite()) {
        return Err(FidelityError::Invalid(format!(
            "quantum {} bits must be positive",
            args.quantum
        ))
        .into());
    }
    let k = args.k.unwrap_or_else(|| default_k(n).min(n));
    if k == 0 || k > n {
        return Err(EvaluateError::K { k, n });
    }
    let params = crate::calib::CalibParams {
        targets: args.targets.clone(),
        fidelity: FidelityParams {
            select: SelectParams {
                k,
                ..Default::default()
            },
            ..Default::default()
        },
        quantum: args.quantum,
        rule_budget: 64.0f32.min(most),
    };
    let cal =
        crate::calib::calibrate(&cap, &args.capture.display().to_string(), &params, progress)?;
    let io = |e: std::io::Error| CalibError::Io {
        path: args.out.display().to_string(),
        source: e,
    };
    let bytes = serde_json::to_vec(&cal).map_err(|e| io(std::io::Error::other(e)))?;
    fathom_store::write_atomic(args.out, &bytes).map_err(io)?;
    let summary = Calibration::summary_path(args.out);
    fathom_results::write(&summary, cal.summary(&args.command)).map_err(|e| CalibError::Io {
        path: summary.display().to_string(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(cal)
}
