//! Parsing method lists (`dense,exact,fathom:48,sparq:32,fathom-sweep:24-136/8,…`).

use anyhow::{bail, Context, Result};
use fathom_baselines::{
    Dense, DoubleSparsity, Exact, Landmark, Loki, LokiF16, Quest, SparQ, SparQUnion, Thumbnail,
};
use fathom_bench::calib::Calibration;
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

fn num<T: std::str::FromStr>(s: &str, what: &str) -> Result<T> {
    s.parse::<T>()
        .ok()
        .with_context(|| format!("{what}: {s:?} is not a number"))
}

/// Parses a method list.
pub fn parse_methods(
    list: &str,
    d: usize,
    basis: BasisArg,
    calib: Option<&Calibration>,
) -> Result<Vec<Box<dyn Scanner>>> {
    let max = 4.25 * d as f32;
    let chosen = match basis {
        BasisArg::Raw => StoreBasis::Raw,
        BasisArg::Klt => StoreBasis::Klt,
        BasisArg::Auto => calib
            .and_then(|c| c.basis_rule.as_ref())
            .map_or(StoreBasis::Raw, |r| r.choice),
    };
    let budget = |s: &str, name: &str| -> Result<f32> {
        let b: f32 = num(s, name)?;
        if !(0.0..=max).contains(&b) || !b.is_finite() {
            bail!("{name}: budget {b} bits is out of range [0, {max}] (4.25 × D = {d} channels)");
        }
        Ok(b)
    };
    let fathom = |b: f32, label: String| {
        let mut f = Fathom::new(b);
        f.basis = chosen;
        f.label = label;
        f
    };
    let mut out: Vec<Box<dyn Scanner>> = Vec::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, arg) = item.split_once(':').unwrap_or((item, ""));
        let need = |what: &str| -> Result<&str> {
            if arg.is_empty() {
                bail!("method {name} needs {what}, e.g. {name}:32")
            }
            Ok(arg)
        };
        let r = |what: &str| -> Result<usize> {
            let r: usize = num(need(what)?, name)?;
            if r == 0 || r > d {
                bail!("{name}: r = {r} is out of range 1..={d}");
            }
            Ok(r)
        };
        match name {
            "dense" => out.push(Box::new(Dense)),
            "exact" => out.push(Box::new(Exact)),
            "thumb2" => out.push(Box::new(Thumbnail)),
            "landmark" => out.push(Box::new(Landmark)),
            "quest" => out.push(Box::new(Quest)),
            "sparq" => out.push(Box::new(SparQ { r: r("r")? })),
            "sparq-union" => out.push(Box::new(SparQUnion { r: r("r")? })),
            "ds" => out.push(Box::new(DoubleSparsity { r: r("r")? })),
            "loki" => out.push(Box::new(Loki { r: r("r")? })),
            "loki-f16" => out.push(Box::new(LokiF16 { r: r("r")? })),
            "fathom" => {
                let b = budget(need("a budget")?, name)?;
                out.push(Box::new(fathom(b, format!("fathom:{}", fmt(b)))));
            }
            "fathom-raw" | "fathom-klt" => {
                let b = budget(need("a budget")?, name)?;
                let mut f = fathom(b, format!("{name}:{}", fmt(b)));
                f.basis = if name == "fathom-raw" { StoreBasis::Raw } else { StoreBasis::Klt };
                out.push(Box::new(f));
            }
            "fathom-uniform" => {
                let b = budget(need("a budget")?, name)?;
                let mut f = fathom(b, format!("fathom-uniform:{}", fmt(b)));
                f.rule = DepthRule::Uniform;
                out.push(Box::new(f));
            }
            "fathom-blockmax" => {
                let b = budget(need("a budget")?, name)?;
                let mut f = fathom(b, format!("fathom-blockmax:{}", fmt(b)));
                f.proxy = ImportanceProxy::BlockMax;
                f.basis = StoreBasis::Raw;
                out.push(Box::new(f));
            }
            "fathom-layer" => {
                let b = budget(need("a target mean")?, name)?;
                let c = calib.context("fathom-layer needs --calib with per-layer budgets")?;
                let t = c.budgets_for(b).with_context(|| {
                    format!(
                        "the calibration has no per-layer budgets for target {b} (it has: {})",
                        c.budgets.iter().map(|t| fmt(t.target)).collect::<Vec<_>>().join(", ")
                    )
                })?;
                let mut f = fathom(b, format!("fathom-layer:{}", fmt(b)));
                f.basis = t.basis;
                f.layer_budgets = Some(t.per_layer.clone());
                out.push(Box::new(f));
            }
            "fathom-sweep" => {
                let spec = need("a range, e.g. fathom-sweep:24-136/8")?;
                let (range, step) = spec.split_once('/').context("fathom-sweep: expected B1-B2/STEP")?;
                let (b1, b2) = range.split_once('-').context("fathom-sweep: expected B1-B2/STEP")?;
                let (b1, b2, step) = (budget(b1, name)?, budget(b2, name)?, num::<f32>(step, name)?);
                if step <= 0.0 || b2 < b1 {
                    bail!("fathom-sweep: need B1 ≤ B2 and STEP > 0");
                }
                let mut b = b1;
                while b <= b2 + 1e-4 {
                    out.push(Box::new(fathom(b, format!("fathom:{}", fmt(b)))));
                    b += step;
                }
            }
            other => bail!(
                "unknown method {other:?}; expected dense, exact, fathom:B, fathom-layer:B, fathom-uniform:B, fathom-sweep:B1-B2/STEP, fathom-raw:B, fathom-klt:B, fathom-blockmax:B, sparq:R, sparq-union:R, ds:R, loki:R, loki-f16:R, thumb2, landmark, quest"
            ),
        }
    }
    if out.is_empty() {
        bail!("the method list is empty");
    }
    Ok(out)
}

/// Formats a budget without trailing zeros.
pub fn fmt(b: f32) -> String {
    if b.fract() == 0.0 {
        format!("{}", b as i64)
    } else {
        format!("{b}")
    }
}
