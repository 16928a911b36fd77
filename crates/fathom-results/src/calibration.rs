//! The `calibration-summary` document: what a calibration decided (the basis rule and the
//! per-layer budgets), without the per-head statistics, which are regenerated, not committed.

use fathom_plan::scanner::StoreBasis;
use serde::{Deserialize, Serialize};

/// The `format` tag version-1 summaries carried instead of a `kind`.
pub const LEGACY_SUMMARY_FORMAT: &str = "fathom-calibration-summary";

/// Per-layer budgets for one target mean.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetBudgets {
    /// Target mean bits.
    pub target: f32,
    /// Store basis the budgets were fitted in.
    pub basis: StoreBasis,
    /// Budget per layer index (`per_layer[l]`; layers not calibrated get the target).
    pub per_layer: Vec<f32>,
}

/// The basis rule's decision and evidence (docs/SPEC.md §3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BasisRule {
    /// The winner.
    pub choice: StoreBasis,
    /// Calibration error of a raw store at `budget`.
    pub raw_error: f64,
    /// Calibration error of a KLT store at `budget`.
    pub klt_error: f64,
    /// Flat budget used for the comparison.
    pub budget: f32,
}

/// A calibration's summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationSummary {
    /// Schema version.
    pub version: u32,
    /// The command that wrote the calibration.
    #[serde(default)]
    pub command: String,
    /// What the summary leaves out.
    #[serde(default)]
    pub note: String,
    /// Model name from the capture.
    pub model: String,
    /// Capture it was computed from.
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
    /// Per-layer budgets per target.
    #[serde(default)]
    pub budgets: Vec<TargetBudgets>,
    /// The basis rule's decision.
    #[serde(default)]
    pub basis_rule: Option<BasisRule>,
}
