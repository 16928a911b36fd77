//! A fidelity run as its typed result document ([`fathom_results::fidelity::FidelityDoc`]):
//! the methods' rows and the equal-error rows against every baseline at both conventions of
//! docs/SPEC.md §4, each with a bootstrap interval.

use fathom_plan::method::MethodSpec;
use fathom_results::fidelity::{EqualErrorRow, FidelityDoc, MethodRow, Study};

use crate::fidelity::{bootstrap_saving, equal_error, FidelityReport, MethodResult};

/// Bootstrap resamples of each equal-error interval.
pub const BOOTSTRAP_RESAMPLES: usize = 1000;

/// Which convention a baseline row uses (docs/SPEC.md §4): the paper's fixed bits (r = 32,
/// 136 bits) or the fixed fraction of the channels (r = D/4). `None` for other methods.
///
/// ```
/// use fathom_bench::document::baseline_convention;
/// assert_eq!(baseline_convention("ds:32", 64), Some("r = 32 (136 bits)"));
/// assert_eq!(baseline_convention("ds:16", 64), Some("r = D/4"));
/// assert_eq!(baseline_convention("loki:32", 128), Some("r = 32 = D/4 (136 bits)"));
/// assert_eq!(baseline_convention("fathom:48", 64), None);
/// ```
pub fn baseline_convention(label: &str, d: usize) -> Option<&'static str> {
    let r = match MethodSpec::parse(label, d).ok()? {
        MethodSpec::SparQ { r } | MethodSpec::DoubleSparsity { r } | MethodSpec::Loki { r } => r,
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
/// at head dimension `d`), the bits at which the flat Fathom curve meets its error, the
/// saving `baseline_bits / fathom_bits`, whether that saving is only a lower bound (Fathom's
/// lowest budget already beats the baseline), and a 95 % bootstrap interval over positions.
pub fn equal_error_rows(report: &FidelityReport, d: usize) -> Vec<EqualErrorRow> {
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
                equal_error(&curve, b.error)
            } else {
                None
            };
            let ci = bootstrap_saving(&fathom, b, BOOTSTRAP_RESAMPLES, 0);
            EqualErrorRow {
                baseline: b.name.clone(),
                convention: Some(convention.into()),
                baseline_bits: b.bits,
                baseline_error: b.error,
                baseline_error_se: Some(b.error_se),
                fathom_bits: eq.map(|e| e.bits),
                saving: eq.map(|e| {
                    if e.bits > 0.0 {
                        b.bits / e.bits
                    } else {
                        f64::INFINITY
                    }
                }),
                lower_bound: eq.map(|e| e.lower_bound),
                saving_ci95: ci.map(|(lo, hi)| [lo, hi]),
                bootstrap: Some(format!(
                    "{BOOTSTRAP_RESAMPLES} resamples of the query positions, seed 0, percentile"
                )),
            }
        })
        .collect()
}

/// What a fidelity document records beside the run itself.
#[derive(Debug, Clone, Default)]
pub struct DocMeta {
    /// The command line.
    pub command: String,
    /// Which study of the experiment matrix.
    pub study: Study,
    /// The capture (path, `embedded:…` or `synthetic`).
    pub capture: String,
    /// Model name.
    pub model: String,
    /// The labelled synthetic generator, not real activations.
    pub synthetic: bool,
    /// The basis the calibration's rule chose.
    pub basis: Option<String>,
    /// `D`, `N`, `Hkv`, `G`.
    pub d: usize,
    /// Tokens.
    pub n: usize,
    /// KV heads.
    pub hkv: usize,
    /// Query heads per KV head.
    pub g: usize,
    /// Top-k.
    pub k: usize,
}

/// The typed document of a fidelity run, its equal-error rows included.
pub fn document(report: &FidelityReport, meta: DocMeta) -> FidelityDoc {
    let equal_error = equal_error_rows(report, meta.d);
    FidelityDoc {
        version: fathom_results::VERSION,
        fathom: env!("CARGO_PKG_VERSION").into(),
        command: meta.command,
        study: meta.study,
        capture: meta.capture,
        model: meta.model,
        synthetic: meta.synthetic,
        basis: meta.basis,
        d: meta.d,
        n: meta.n,
        hkv: meta.hkv,
        g: meta.g,
        k: meta.k,
        positions: report.positions,
        layers: report.layers.clone(),
        skipped_local_layers: report.skipped_local_layers.clone(),
        o_consistency_max: report.o_consistency_max,
        methods: report
            .methods
            .iter()
            .map(|m| MethodRow {
                name: m.name.clone(),
                bits: m.bits,
                error: m.error,
                error_se: Some(m.error_se),
                per_layer: m.per_layer.clone(),
                per_layer_bits: m.per_layer_bits.clone(),
                per_position: m.per_position.clone(),
            })
            .collect(),
        equal_error,
    }
}
