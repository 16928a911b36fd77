//! Fidelity reports: the Markdown table, the JSON document and the equal-error savings.

use fathom_bench::fidelity::{self, bootstrap_saving, FidelityReport, MethodResult};
use serde_json::{json, Value};

/// Whether a method label is one of the paper's 136-bit scans (sparq, ds or loki at r = 32).
pub fn is_136_bit_scan(label: &str) -> bool {
    // The rule does not depend on D, and every 136-bit scan (r = 32) parses at D = 32.
    fathom_plan::method::MethodSpec::parse(label, 32).is_ok_and(|m| m.is_136_bit_scan())
}

/// Bootstrap resamples of each equal-error interval.
pub const BOOTSTRAP_RESAMPLES: usize = 1000;

/// Which convention a baseline row uses (docs/SPEC.md §4): the paper's fixed bits (r = 32,
/// 136 bits) or the fixed fraction of the channels (r = D/4). `None` for other methods.
pub fn baseline_convention(label: &str, d: usize) -> Option<&'static str> {
    let m = fathom_plan::method::MethodSpec::parse(label, d).ok()?;
    let r = match m {
        fathom_plan::method::MethodSpec::SparQ { r }
        | fathom_plan::method::MethodSpec::DoubleSparsity { r }
        | fathom_plan::method::MethodSpec::Loki { r } => r,
        _ => return None,
    };
    match (r == 32, r * 4 == d) {
        (true, true) => Some("r = 32 = D/4 (136 bits)"),
        (true, false) => Some("r = 32 (136 bits)"),
        (false, true) => Some("r = D/4"),
        _ => None,
    }
}

/// Equal-error rows: for each baseline in the run at either convention (r = 32, or r = D/4
/// at head dimension `d`), the bits at which the flat Fathom curve meets its error, the saving `baseline_bits / fathom_bits`, whether that saving
/// is only a lower bound (Fathom's lowest budget already beats the baseline), and a 95 %
/// bootstrap interval over positions.
pub fn equal_error(report: &FidelityReport, d: usize) -> Vec<Value> {
    let fathom: Vec<&MethodResult> = report
        .methods
        .iter()
        .filter(|m| m.name.starts_with("fathom:"))
        .collect();
    let curve: Vec<(f64, f64)> = fathom.iter().map(|m| (m.bits, m.error)).collect();
    report
        .methods
        .iter()
        .filter_map(|m| baseline_convention(&m.name, d).map(|c| (m, c)))
        .map(|(b, convention)| {
            let eq = if curve.len() >= 2 {
                fidelity::equal_error(&curve, b.error)
            } else {
                None
            };
            let ci = bootstrap_saving(&fathom, b, BOOTSTRAP_RESAMPLES, 0);
            json!({
                "baseline": b.name,
                "convention": convention,
                "baseline_bits": b.bits,
                "baseline_error": b.error,
                "baseline_error_se": b.error_se,
                "fathom_bits": eq.map(|e| e.bits),
                "saving": eq.map(|e| if e.bits > 0.0 { b.bits / e.bits } else { f64::INFINITY }),
                "lower_bound": eq.map(|e| e.lower_bound),
                "saving_ci95": ci.map(|(lo, hi)| [lo, hi]),
                "bootstrap": format!("{BOOTSTRAP_RESAMPLES} resamples of the query positions, seed 0, percentile"),
            })
        })
        .collect()
}

/// The Markdown table printed to stdout.
pub fn markdown(report: &FidelityReport, eq: &[Value], label: &str) -> String {
    let mut s = String::new();
    s.push_str(&format!("{label}\n\n"));
    s.push_str("| method | bits/token/KV head | mean rel. error | s.e. |\n|---|---:|---:|---:|\n");
    for m in &report.methods {
        s.push_str(&format!(
            "| {} | {:.2} | {:.4e} | {:.1e} |\n",
            m.name, m.bits, m.error, m.error_se
        ));
    }
    if !eq.is_empty() {
        s.push_str("\n| baseline (convention) | its error | Fathom bits at equal error | saving | 95 % bootstrap |\n|---|---:|---:|---:|---:|\n");
        for e in eq {
            let fb = e["fathom_bits"].as_f64();
            // A bound: the equal-error bits are at most the lowest budget, the saving at least.
            let (le, ge) = if e["lower_bound"].as_bool() == Some(true) {
                ("≤ ", "≥ ")
            } else {
                ("", "")
            };
            s.push_str(&format!(
                "| {} ({}) | {:.4e} | {} | {} | {} |\n",
                e["baseline"].as_str().unwrap_or("?"),
                e["convention"].as_str().unwrap_or("?"),
                e["baseline_error"].as_f64().unwrap_or(f64::NAN),
                fb.map_or("not reached in the sweep".into(), |f| format!("{le}{f:.1}")),
                e["saving"]
                    .as_f64()
                    .map_or("—".into(), |x| format!("{ge}{x:.2}×")),
                e["saving_ci95"]
                    .as_array()
                    .and_then(|a| Some(format!(
                        "{:.2}–{:.2}×",
                        a.first()?.as_f64()?,
                        a.get(1)?.as_f64()?
                    )))
                    .unwrap_or_else(|| "—".into()),
            ));
        }
    }
    s
}

/// The JSON document of a fidelity run (the fidelity schema of `fathom-bench`, plus extra fields).
pub fn json_doc(
    report: &FidelityReport,
    capture: &str,
    k: usize,
    eq: Vec<Value>,
    extra: Value,
) -> Value {
    let mut v = json!({
        "capture": capture,
        "k": k,
        "positions": report.positions,
        "layers": report.layers,
        "skipped_local_layers": report.skipped_local_layers,
        "o_consistency_max": report.o_consistency_max,
        "methods": report.methods.iter().map(|m| json!({
            "name": m.name, "bits": m.bits, "error": m.error, "error_se": m.error_se,
            "per_layer": m.per_layer, "per_layer_bits": m.per_layer_bits,
            "per_position": m.per_position,
        })).collect::<Vec<_>>(),
        "equal_error": eq,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "version": env!("CARGO_PKG_VERSION"),
    });
    if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    v
}
