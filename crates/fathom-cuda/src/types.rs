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

/// One point of the row-gather sweep (`Gpu::row_gather_sweep`): the zero-copy gather kernel
/// copying `rows` runs of `row_bytes` from a span of pinned host memory to HBM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RowRate {
    /// `random` (each row at a uniformly drawn row-aligned offset of the span, as the union
    /// fetch's misses) or `sequential` (the rows back to back from a random start).
    pub pattern: String,
    /// Bytes of host memory the rows are drawn from.
    pub span_bytes: u64,
    /// Rows per launch.
    pub rows: u64,
    /// Bytes per row.
    pub row_bytes: u64,
    /// Best of three launches (a fresh draw each), GB/s.
    pub gbps: f64,
}

/// The row-gather sweep of one kind of host pages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RowSweep {
    /// `driver`, `huge` or `vmm` ([`crate::HostPages`]).
    pub pages: String,
    /// Bytes allocated (the largest span).
    pub alloc_bytes: u64,
    /// Growth of the process's `AnonHugePages` over the allocation: the bytes that huge pages
    /// back (`None` where the kernel does not say).
    pub huge_bytes: Option<u64>,
    /// Seconds to allocate, touch and pin the span.
    pub alloc_seconds: f64,
    /// Every (span, rows, pattern) point.
    pub rates: Vec<RowRate>,
}
