//! Tables shared by the report and the CLI: one fidelity run's methods and its equal-error
//! savings, the one way a saving is printed, and a downstream run's row-cache hit rates.

use fathom_results::fidelity::{EqualErrorRow, FidelityDoc};

/// `x` with `prec` decimals, or `—` when absent.
pub fn opt(x: Option<f64>, prec: usize) -> String {
    x.map_or("—".into(), |x| format!("{x:.prec$}"))
}

/// An equal-error saving as the report prints it: `≥` for a lower bound, and the bootstrap
/// interval when the row has one (`2.61× [2.40–2.85]`); `—` when the curve never reached the
/// baseline.
pub fn saving_cell(doc: &FidelityDoc, row: &EqualErrorRow) -> String {
    let Some(x) = row.saving else {
        return "—".into();
    };
    let ge = if doc.is_lower_bound(row) { "≥ " } else { "" };
    match row.saving_ci95 {
        Some([lo, hi]) => format!("{ge}{x:.2}× [{lo:.2}–{hi:.2}]"),
        None => format!("{ge}{x:.2}×"),
    }
}

/// The method / bits / error / standard-error table of one fidelity run.
pub fn method_table(doc: &FidelityDoc) -> String {
    let mut s = String::from(
        "| method | bits | mean rel. error | s.e. (positions) |\n|---|---:|---:|---:|\n",
    );
    for m in &doc.methods {
        s.push_str(&format!(
            "| {} | {:.2} | {:.4e} | {} |\n",
            m.name,
            m.bits,
            m.error,
            m.error_se.map_or("—".into(), |x| format!("{x:.1e}"))
        ));
    }
    s
}

/// The Markdown `fathom fidelity` and `fathom demo` print: the methods, then each baseline's
/// equal-error row (`≤`/`≥` where Fathom's lowest budget already beats it).
pub fn fidelity_markdown(doc: &FidelityDoc, label: &str) -> String {
    let mut s = format!("{label}\n\n");
    s.push_str("| method | bits/token/KV head | mean rel. error | s.e. |\n|---|---:|---:|---:|\n");
    for m in &doc.methods {
        s.push_str(&format!(
            "| {} | {:.2} | {:.4e} | {:.1e} |\n",
            m.name,
            m.bits,
            m.error,
            m.error_se.unwrap_or(f64::NAN)
        ));
    }
    if !doc.equal_error.is_empty() {
        s.push_str("\n| baseline (convention) | its error | Fathom bits at equal error | saving | 95 % bootstrap |\n|---|---:|---:|---:|---:|\n");
        for e in &doc.equal_error {
            let (le, ge) = if doc.is_lower_bound(e) {
                ("≤ ", "≥ ")
            } else {
                ("", "")
            };
            s.push_str(&format!(
                "| {} ({}) | {:.4e} | {} | {} | {} |\n",
                e.baseline,
                e.convention.as_deref().unwrap_or("?"),
                e.baseline_error,
                e.fathom_bits
                    .map_or("not reached in the sweep".into(), |f| format!("{le}{f:.1}")),
                e.saving.map_or("—".into(), |x| format!("{ge}{x:.2}×")),
                e.saving_ci95
                    .map_or("—".into(), |[lo, hi]| format!("{lo:.2}–{hi:.2}×")),
            ));
        }
    }
    s
}

/// A downstream run's row-cache hit rates (docs/SPEC.md §7): one row per method with a union
/// (its union rows and the hit rate at each size), one column per size of the first such
/// method, `—` where a method lacks that size; `source` (how they were counted) heads it.
/// Empty when no method has a tally.
pub fn row_cache_table(
    source: &str,
    per_method: &[(&String, Vec<fathom_results::downstream::RowCacheTally>)],
) -> String {
    let Some((_, first)) = per_method.iter().find(|m| !m.1.is_empty()) else {
        return String::new();
    };
    let sizes: Vec<usize> = first.iter().map(|t| t.slots).collect();
    let mut s = format!(
        "Row-cache hit rate on these decode steps, per slots per (session, layer, KV head) ({source}):\n\n| method | union rows | {} |\n|---|---:|{}\n",
        sizes.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(" | "),
        "---:|".repeat(sizes.len())
    );
    for (m, t) in per_method {
        if let Some(x) = t.first() {
            let cells: Vec<String> = sizes
                .iter()
                .map(|c| {
                    t.iter()
                        .find(|x| x.slots == *c)
                        .map_or("—".into(), |x| format!("{:.3}", x.hit_rate))
                })
                .collect();
            s.push_str(&format!("| {m} | {} | {} |\n", x.rows, cells.join(" | ")));
        }
    }
    s
}
