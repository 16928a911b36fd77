//! The CUDA backend's implementation of [`crate::api::Device`].

use crate::api::Device;
use crate::error::Result;
use crate::types::{DeviceInfo, RowSweep};

use super::Gpu;

impl Device for Gpu {
    fn open(ordinal: usize) -> Result<Self> {
        Gpu::open(ordinal)
    }
    fn info(&self) -> &DeviceInfo {
        Gpu::info(self)
    }
    fn h2d_bandwidth(&self, bytes: usize) -> Result<f64> {
        Gpu::h2d_bandwidth(self, bytes)
    }
    fn gather_bandwidth(&self, bytes: usize) -> Result<f64> {
        Gpu::gather_bandwidth(self, bytes)
    }
    fn gather_run_bandwidth(&self, run_bytes: usize, total_bytes: usize) -> Result<f64> {
        Gpu::gather_run_bandwidth(self, run_bytes, total_bytes)
    }
    fn row_gather_sweep(
        &self,
        pages: crate::HostPages,
        row_bytes: usize,
        spans: &[usize],
        rows: &[usize],
        seed: u64,
    ) -> Result<RowSweep> {
        Gpu::row_gather_sweep(self, pages, row_bytes, spans, rows, seed)
    }
}
