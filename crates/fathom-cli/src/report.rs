//! Fidelity reports: the Markdown table, the JSON document and the equal-error savings.

use fathom_bench::fidelity::{equal_error_bits, FidelityReport};
use serde_json::{json, Value};

/// Whether a method label is one of the paper's 136-bit scans (sparq, ds or loki at r = 32).
pub fn is_136_bit_scan(label: &str) -> bool {
    // The rule does not depend on D, and every 136-bit scan (r = 32) parses at D = 32.
    fathom_plan::method::MethodSpec::parse(label, 32).is_ok_and(|m| m.is_136_bit_scan())
}

/// Equal-error rows: for each 136-bit baseline in the run, the bits at which the flat
/// Fathom curve meets its error, and the saving `baseline_bits / fathom_bits`.
pub fn equal_error(report: &FidelityReport) -> Vec<Value> {
    let curve: Vec<(f64, f64)> = report
        .methods
        .iter()
        .filter(|m| m.name.starts_with("fathom:"))
        .map(|m| (m.bits, m.error))
        .collect();
    report
        .methods
        .iter()
        .filter(|m| is_136_bit_scan(&m.name))
        .map(|b| {
            let fb = if curve.len() >= 2 {
                equal_error_bits(&curve, b.error)
            } else {
                None
            };
            json!({
                "baseline": b.name,
                "baseline_bits": b.bits,
                "baseline_error": b.error,
                "fathom_bits": fb,
                "saving": fb.map(|f| if f > 0.0 { b.bits / f } else { f64::INFINITY }),
            })
        })
        .collect()
}

/// The Markdown table printed to stdout.
pub fn markdown(report: &FidelityReport, eq: &[Value], label: &str) -> String {
    let mut s = String::new();
    s.push_str(&format!("{label}\n\n"));
    s.push_str("| method | bits/token/KV head | mean rel. error |\n|---|---:|---:|\n");
    for m in &report.methods {
        s.push_str(&format!(
            "| {} | {:.2} | {:.4e} |\n",
            m.name, m.bits, m.error
        ));
    }
    if !eq.is_empty() {
        s.push_str("\n| 136-bit baseline | its error | Fathom bits at equal error | saving |\n|---|---:|---:|---:|\n");
        for e in eq {
            let fb = e["fathom_bits"].as_f64();
            s.push_str(&format!(
                "| {} | {:.4e} | {} | {} |\n",
                e["baseline"].as_str().unwrap_or("?"),
                e["baseline_error"].as_f64().unwrap_or(f64::NAN),
                fb.map_or("not reached in the sweep".into(), |f| format!("{f:.1}")),
                e["saving"]
                    .as_f64()
                    .map_or("—".into(), |x| format!("{x:.2}×")),
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
            "name": m.name, "bits": m.bits, "error": m.error,
            "per_layer": m.per_layer, "per_layer_bits": m.per_layer_bits,
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
