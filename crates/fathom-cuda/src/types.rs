//! Plain result types shared by both backends.

use serde::{Deserialize, Serialize};

pub use fathom_results::offload::{DeviceInfo, SessionLayout};

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
