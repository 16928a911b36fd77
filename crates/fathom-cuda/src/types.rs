//! Plain result types shared by both backends.

use serde::{Deserialize, Serialize};

/// What the device is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// The driver's device name.
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_mem_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: i32,
    /// Driver version (e.g. 13000).
    pub driver_version: i32,
    /// The NVRTC target the kernels were compiled for.
    pub arch: String,
}

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

/// Where the session's data lives and what is reused (reported with every result).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionLayout {
    /// Distinct synthetic source layers (tiled over the model's layers cyclically).
    pub source_layers: usize,
    /// Base tokens of each source layer (tiled to the context).
    pub source_tokens: usize,
    /// Layers with their own K/V row buffers; layer `l` uses rows of `l mod row_layers`.
    pub row_layers: usize,
    /// Bytes of scan store (planes + scales) over all layers.
    pub store_bytes: u64,
    /// Bytes of landmark + Quest tables over all layers.
    pub table_bytes: u64,
    /// Bytes of K/V records allocated.
    pub row_bytes: u64,
    /// Bytes of the HBM row cache.
    pub cache_bytes: u64,
    /// Seconds spent allocating and filling.
    pub setup_s: f64,
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
