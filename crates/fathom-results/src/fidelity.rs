//! The `fidelity` document: one run of the docs/SPEC.md §5 protocol over a capture (every
//! method's bits and error) and its equal-error savings against each baseline.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Which part of the experiment matrix a fidelity run belongs to; the report tables each
/// study on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum Study {
    /// The main comparison: a Fathom budget sweep beside every baseline (equal-error
    /// savings, Claims 1 and 2).
    #[default]
    Main,
    /// The same methods at another top-k `k` (the k-varied ablation).
    K,
    /// Any other ablation: basis, importance proxy, Loki fp16, cross-context calibration.
    Ablation,
}

impl Study {
    /// Parses `main`, `k` or `ablation`.
    pub fn parse(s: &str) -> Option<Study> {
        match s {
            "main" => Some(Study::Main),
            "k" => Some(Study::K),
            "ablation" => Some(Study::Ablation),
            _ => None,
        }
    }
}

/// One method's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MethodRow {
    /// Method label in the one grammar (`fathom:48`, `ds:32`, …).
    pub name: String,
    /// Mean bits per token per KV head read by the scan.
    pub bits: f64,
    /// Mean relative error of the attention output.
    pub error: f64,
    /// Standard error of `error` over positions (absent in version-1 files before it existed).
    #[serde(default)]
    pub error_se: Option<f64>,
    /// Mean error per evaluated layer.
    #[serde(default)]
    pub per_layer: Vec<f64>,
    /// Mean bits per evaluated layer.
    #[serde(default)]
    pub per_layer_bits: Vec<f64>,
    /// Mean error per query position, in capture order.
    #[serde(default)]
    pub per_position: Vec<f64>,
}

/// Where the Fathom curve meets one baseline's error (docs/SPEC.md §5 equal-error saving).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EqualErrorRow {
    /// The baseline's label.
    pub baseline: String,
    /// Its convention (docs/SPEC.md §4): `r = 32 (136 bits)`, `r = D/4`, or both.
    #[serde(default)]
    pub convention: Option<String>,
    /// The baseline's bits.
    pub baseline_bits: f64,
    /// The baseline's error.
    pub baseline_error: f64,
    /// Its standard error over positions.
    #[serde(default)]
    pub baseline_error_se: Option<f64>,
    /// Fathom's bits at that error (`None`: never reached in the sweep).
    pub fathom_bits: Option<f64>,
    /// `baseline_bits / fathom_bits`.
    pub saving: Option<f64>,
    /// Fathom's lowest budget already beats the baseline: `saving` is a lower bound (`≥`).
    #[serde(default)]
    pub lower_bound: Option<bool>,
    /// 95 % bootstrap interval of `saving` over positions.
    #[serde(default)]
    pub saving_ci95: Option<[f64; 2]>,
    /// How the interval was made.
    #[serde(default)]
    pub bootstrap: Option<String>,
}

/// A fidelity run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FidelityDoc {
    /// Schema version.
    pub version: u32,
    /// The fathom version that wrote it.
    #[serde(default)]
    pub fathom: String,
    /// The command line.
    #[serde(default)]
    pub command: String,
    /// Which study of the experiment matrix.
    #[serde(default)]
    pub study: Study,
    /// The capture evaluated (path, or `embedded:…` / `synthetic`).
    pub capture: String,
    /// Model name from the capture.
    #[serde(default)]
    pub model: String,
    /// The workload is the labelled synthetic generator, not real activations.
    #[serde(default)]
    pub synthetic: bool,
    /// The store basis the calibration's rule chose (`Raw`, `Klt`), if calibrated.
    #[serde(default)]
    pub basis: Option<String>,
    /// Channels per head `D`.
    #[serde(default)]
    pub d: usize,
    /// Tokens `N`.
    #[serde(default)]
    pub n: usize,
    /// KV heads.
    #[serde(default)]
    pub hkv: usize,
    /// Query heads per KV head.
    #[serde(default)]
    pub g: usize,
    /// Top-k per query head.
    pub k: usize,
    /// Query positions per layer.
    pub positions: usize,
    /// Layers evaluated.
    pub layers: Vec<usize>,
    /// Sliding-window layers skipped.
    #[serde(default)]
    pub skipped_local_layers: Vec<usize>,
    /// Largest relative difference between the capture's `o` and recomputed dense attention.
    #[serde(default)]
    pub o_consistency_max: Option<f64>,
    /// Per method.
    pub methods: Vec<MethodRow>,
    /// Equal-error savings against each baseline.
    pub equal_error: Vec<EqualErrorRow>,
}

impl FidelityDoc {
    /// The method labelled `name`.
    pub fn method(&self, name: &str) -> Option<&MethodRow> {
        self.methods.iter().find(|m| m.name == name)
    }

    /// The flat Fathom curve `(bits, error)`, sorted by bits.
    pub fn fathom_curve(&self) -> Vec<(f64, f64)> {
        let mut c: Vec<(f64, f64)> = self
            .methods
            .iter()
            .filter(|m| m.name.starts_with("fathom:"))
            .map(|m| (m.bits, m.error))
            .collect();
        c.sort_by(|a, b| a.0.total_cmp(&b.0));
        c
    }

    /// The equal-error row against `baseline`.
    pub fn equal_error_against(&self, baseline: &str) -> Option<&EqualErrorRow> {
        self.equal_error.iter().find(|e| e.baseline == baseline)
    }

    /// Whether `row`'s saving is only a lower bound: its `lower_bound` field, or, in version-1
    /// files written before that field, Fathom's bits at its lowest budget.
    pub fn is_lower_bound(&self, row: &EqualErrorRow) -> bool {
        if let Some(b) = row.lower_bound {
            return b;
        }
        let lowest = self.fathom_curve().first().map_or(f64::INFINITY, |p| p.0);
        row.fathom_bits.is_some_and(|fb| fb <= lowest + 0.5)
    }
}

/// Version 1 fidelity files said their study only through their file name (the names
/// `cargo xtask repro` gave them), which version 2 records as `study`: `k<digits>.json` is
/// the k-varied study, `fidelity.json` with a Fathom sweep (three or more budgets) the main
/// one, anything else an ablation. `what` is the file's path.
pub(crate) fn upgrade_legacy(what: &str, obj: &mut Map<String, Value>) {
    let name = std::path::Path::new(what)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = name.strip_suffix(".json").unwrap_or(&name);
    let sweep = obj.get("methods").and_then(Value::as_array).map_or(0, |m| {
        m.iter()
            .filter(|x| {
                x.get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| n.starts_with("fathom:"))
            })
            .count()
    });
    let study =
        if stem.len() > 1 && stem.starts_with('k') && stem[1..].chars().all(|c| c.is_ascii_digit())
        {
            "k"
        } else if name == "fidelity.json" && sweep >= 3 {
            "main"
        } else {
            "ablation"
        };
    obj.insert("study".into(), study.into());
}
