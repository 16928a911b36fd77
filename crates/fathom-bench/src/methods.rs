//! Method lists of the grammar (`fathom_plan::method`, docs/SPEC.md §4) to scanners: the one
//! place a `dense,exact,fathom:48,sparq:32,fathom-sweep:24-136/8,…` list becomes the
//! `Scanner`s the fidelity harness and the downstream tasks run.
//!
//! ```
//! use fathom_bench::methods::{scanners, BasisChoice};
//! let m = scanners("dense,exact,fathom:48,sparq:16", 64, BasisChoice::Raw, None).unwrap();
//! assert_eq!(m.len(), 4);
//! assert!(scanners("fathom-layer:48", 64, BasisChoice::Raw, None).is_err()); // needs a calibration
//! ```

use fathom_baselines::{
    Dense, DoubleSparsity, Exact, Landmark, Loki, LokiF16, Quest, SparQ, SparQUnion, Thumbnail,
};
use fathom_plan::method::{fmt_budget, FathomVariant, MethodError, MethodSpec};
use fathom_plan::scanner::{DepthRule, Fathom, ImportanceProxy, Scanner, StoreBasis};

use crate::calib::Calibration;

/// The basis Fathom methods store their keys in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BasisChoice {
    /// Raw channels.
    #[default]
    Raw,
    /// The calibration's KLT.
    Klt,
    /// The calibration's basis rule (raw channels without one).
    Auto,
}

impl std::str::FromStr for BasisChoice {
    type Err = MethodError;
    fn from_str(s: &str) -> Result<Self, MethodError> {
        match s {
            "raw" => Ok(Self::Raw),
            "klt" => Ok(Self::Klt),
            "auto" => Ok(Self::Auto),
            _ => Err(MethodError {
                item: s.to_string(),
                why: "the basis is raw, klt or auto".into(),
            }),
        }
    }
}

/// Parses a method list into scanners for keys of `d` channels.
///
/// # Errors
/// An item outside the grammar, or `fathom-layer:B` without a calibration that has per-layer
/// budgets for B (the message lists the targets it has).
pub fn scanners(
    list: &str,
    d: usize,
    basis: BasisChoice,
    calib: Option<&Calibration>,
) -> Result<Vec<Box<dyn Scanner>>, MethodError> {
    let chosen = match basis {
        BasisChoice::Raw => StoreBasis::Raw,
        BasisChoice::Klt => StoreBasis::Klt,
        BasisChoice::Auto => calib
            .and_then(|c| c.basis_rule.as_ref())
            .map_or(StoreBasis::Raw, |r| r.choice),
    };
    MethodSpec::parse_list(list, d)?
        .iter()
        .map(|m| scanner(m, chosen, calib))
        .collect()
}

/// The scanner of one validated method.
///
/// # Errors
/// As [`scanners`].
pub fn scanner(
    m: &MethodSpec,
    basis: StoreBasis,
    calib: Option<&Calibration>,
) -> Result<Box<dyn Scanner>, MethodError> {
    Ok(match *m {
        MethodSpec::Dense => Box::new(Dense),
        MethodSpec::Exact => Box::new(Exact),
        MethodSpec::Thumb2 => Box::new(Thumbnail),
        MethodSpec::Landmark => Box::new(Landmark),
        MethodSpec::Quest => Box::new(Quest),
        MethodSpec::SparQ { r } => Box::new(SparQ { r }),
        MethodSpec::SparQUnion { r } => Box::new(SparQUnion { r }),
        MethodSpec::DoubleSparsity { r } => Box::new(DoubleSparsity { r }),
        MethodSpec::Loki { r } => Box::new(Loki { r }),
        MethodSpec::LokiF16 { r } => Box::new(LokiF16 { r }),
        MethodSpec::Fathom { variant, budget } => {
            let mut f = Fathom::new(budget);
            f.basis = basis;
            f.label = m.to_string();
            match variant {
                FathomVariant::Plan => {}
                FathomVariant::Raw => f.basis = StoreBasis::Raw,
                FathomVariant::Klt => f.basis = StoreBasis::Klt,
                FathomVariant::Uniform => f.rule = DepthRule::Uniform,
                FathomVariant::BlockMax => {
                    f.proxy = ImportanceProxy::BlockMax;
                    f.basis = StoreBasis::Raw;
                }
                FathomVariant::Layer => {
                    let err = |why: String| MethodError {
                        item: m.to_string(),
                        why,
                    };
                    let c = calib.ok_or_else(|| {
                        err("fathom-layer needs a calibration with per-layer budgets".into())
                    })?;
                    let t = c.budgets_for(budget).ok_or_else(|| {
                        err(format!(
                            "the calibration has no per-layer budgets for target {budget} (it has: {})",
                            c.budgets.iter().map(|t| fmt_budget(t.target)).collect::<Vec<_>>().join(", ")
                        ))
                    })?;
                    f.basis = t.basis;
                    f.layer_budgets = Some(t.per_layer.clone());
                }
            }
            Box::new(f)
        }
    })
}
