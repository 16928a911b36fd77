//! Parsing method lists (`dense,exact,fathom:48,sparq:32,fathom-sweep:24-136/8,…`).

use anyhow::{Context, Result};
use fathom_baselines::{
    Dense, DoubleSparsity, Exact, Landmark, Loki, LokiF16, Quest, SparQ, SparQUnion, Thumbnail,
};
use fathom_bench::calib::Calibration;
use fathom_plan::method::{fmt_budget, FathomVariant, MethodSpec};
use fathom_plan::scanner::{DepthRule, Fathom, ImportanceProxy, Scanner, StoreBasis};

/// The basis Fathom methods use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BasisArg {
    /// Raw channels.
    Raw,
    /// Calibration KLT.
    Klt,
    /// The calibration's basis rule.
    Auto,
}

/// Parses a method list (the grammar of `fathom_plan::method`) into scanners.
pub fn parse_methods(
    list: &str,
    d: usize,
    basis: BasisArg,
    calib: Option<&Calibration>,
) -> Result<Vec<Box<dyn Scanner>>> {
    let chosen = match basis {
        BasisArg::Raw => StoreBasis::Raw,
        BasisArg::Klt => StoreBasis::Klt,
        BasisArg::Auto => calib
            .and_then(|c| c.basis_rule.as_ref())
            .map_or(StoreBasis::Raw, |r| r.choice),
    };
    let specs = MethodSpec::parse_list(list, d)?;
    specs.iter().map(|m| scanner(m, chosen, calib)).collect()
}

/// The scanner of one validated method.
pub fn scanner(
    m: &MethodSpec,
    basis: StoreBasis,
    calib: Option<&Calibration>,
) -> Result<Box<dyn Scanner>> {
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
                    let c = calib.context("fathom-layer needs --calib with per-layer budgets")?;
                    let t = c.budgets_for(budget).with_context(|| {
                        format!(
                            "the calibration has no per-layer budgets for target {budget} (it has: {})",
                            c.budgets.iter().map(|t| fmt_budget(t.target)).collect::<Vec<_>>().join(", ")
                        )
                    })?;
                    f.basis = t.basis;
                    f.layer_budgets = Some(t.per_layer.clone());
                }
            }
            Box::new(f)
        }
    })
}
