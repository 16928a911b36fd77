//! Plain result types shared by both backends.

use serde::{Deserialize, Serialize};

pub use fathom_results::offload::{DeviceInfo, SessionLayout};

/// The stages of one decode step, in order (docs/SPEC.md §6).
pub const STAGES: [&str; 6] = ["plan", "gather", "scan", "topk", "row_gather", "attention"];

/// Timings and counters of one decode step over all layers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// GPU time of the step (CUDA events around all layers), ms.
    pub gpu_ms: f64,
    /// Host wall-clock from the first launch to the end of the stream synchronisation, ms.
    pub wall_ms: f64,
    /// Per-stage GPU time summed over layers (only when instrumented), ms; order [`STAGES`].
    pub stage_ms: Option<[f64; 6]>,
    /// Rows in the per-KV-head unions, summed over layers and heads.
    pub union_rows: u64,
    /// Of those, rows served from the HBM row cache.
    pub cache_hits: u64,
    /// Mean plan bits per token per KV head (Fathom: measured; others: nominal).
    pub bits: f64,
}

/// Everything one layer's step computed, read back for the correctness tests.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerDebug {
    /// Depths `[H][D]`.
    pub depths: Vec<u8>,
    /// Plan bits per KV head `[H]`.
    pub bits: Vec<f32>,
    /// Scores `[H][G][n]`.
    pub scores: Vec<f32>,
    /// Winners per query head row `r = h·G + g`, sorted (middle tokens only).
    pub winners: Vec<Vec<u32>>,
    /// Union per KV head (with sink and local), sorted.
    pub unions: Vec<Vec<u32>>,
    /// Attention output `[H][G][D]`.
    pub out: Vec<f32>,
}
