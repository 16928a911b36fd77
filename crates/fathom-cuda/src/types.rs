//! Plain result types shared by both backends.

use serde::{Deserialize, Serialize};

/// What [`crate::api::Device::info`] reports of a device (a harness converts it into its report's
/// record).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
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
