//! The backend without the `cuda` feature: the same types, implementing the same traits
//! ([`crate::api::Device`], [`crate::api::KvCache`]). A [`Gpu`] cannot be opened
//! ([`CudaError::NotCompiledWithCuda`]), so no cache exists to call the others on: the types are
//! uninhabited and every method that takes one is unreachable. The host-side checks shared
//! with the real backend live in `cache/` and `pages/`.

use half::bf16;

use crate::api::{Device, KvCache};
use crate::cache::{
    AppendBatch, AttendDebug, AttendMethod, AttendStages, CacheConfig, KvRows, QueryRows,
    RowCounters, SelectCounters,
};
use crate::error::{CudaError, Result};
use crate::memory::DeviceViewMut;
use crate::paged_layout::PagedLayout;
use crate::paged_ref::PagedExport;
use crate::pages::{CacheSessions, SessionId};
use crate::types::{DeviceInfo, RowSweep};

/// A CUDA device (stub: none can be opened without the `cuda` feature).
#[derive(Debug)]
pub enum Gpu {}

/// The paged KV cache (stub: none can be made without the `cuda` feature).
#[derive(Debug)]
pub enum PagedCache {}

/// A captured decode step (stub).
#[derive(Debug)]
pub enum DecodeGraph {}

impl Device for Gpu {
    fn open(_ordinal: usize) -> Result<Self> {
        Err(CudaError::NotCompiledWithCuda)
    }
    fn info(&self) -> &DeviceInfo {
        match *self {}
    }
    fn h2d_bandwidth(&self, _bytes: usize) -> Result<f64> {
        match *self {}
    }
    fn gather_bandwidth(&self, _bytes: usize) -> Result<f64> {
        match *self {}
    }
    fn gather_run_bandwidth(&self, _run_bytes: usize, _total_bytes: usize) -> Result<f64> {
        match *self {}
    }
    fn row_gather_sweep(
        &self,
        _pages: crate::HostPages,
        _row_bytes: usize,
        _spans: &[usize],
        _rows: &[usize],
        _seed: u64,
    ) -> Result<RowSweep> {
        match *self {}
    }
}

impl KvCache for PagedCache {
    type Device = Gpu;
    type Graph = DecodeGraph;

    fn synchronize(&self) -> Result<()> {
        match *self {}
    }

    fn new(_gpu: &Self::Device, _cfg: CacheConfig) -> Result<Self> {
        Err(CudaError::NotCompiledWithCuda)
    }
    fn config(&self) -> &CacheConfig {
        match *self {}
    }
    fn layout(&self) -> &PagedLayout {
        match *self {}
    }
    fn sessions(&self) -> &CacheSessions {
        match *self {}
    }
    fn create(&mut self) -> Result<SessionId> {
        match *self {}
    }
    fn len(&self, _session: SessionId) -> Result<usize> {
        match *self {}
    }
    fn is_empty(&self, _session: SessionId) -> Result<bool> {
        match *self {}
    }
    fn fork(&mut self, _parent: SessionId) -> Result<SessionId> {
        match *self {}
    }
    fn free(&mut self, _session: SessionId) -> Result<()> {
        match *self {}
    }
    fn truncate(&mut self, _session: SessionId, _len: usize) -> Result<()> {
        match *self {}
    }
    fn check_reserve(&self, _batch: &[(SessionId, usize)]) -> Result<()> {
        match *self {}
    }
    fn reserve(&mut self, _batch: &[(SessionId, usize)]) -> Result<AppendBatch> {
        match *self {}
    }
    fn append(&mut self, _batch: &AppendBatch, _layer: usize, _kv: &KvRows) -> Result<()> {
        match *self {}
    }
    fn append_host(
        &mut self,
        _batch: &AppendBatch,
        _layer: usize,
        _k: &[f32],
        _v: &[f32],
    ) -> Result<()> {
        match *self {}
    }
    unsafe fn follow(&self, _external: u64) -> Result<()> {
        match *self {}
    }
    unsafe fn signal(&self, _external: u64) -> Result<()> {
        match *self {}
    }
    fn read_rows(
        &self,
        _batch: &AppendBatch,
        _layer: usize,
        _cap: usize,
        _k_out: DeviceViewMut<'_>,
        _v_out: DeviceViewMut<'_>,
    ) -> Result<()> {
        match *self {}
    }
    fn records(&self, _session: SessionId, _layer: usize) -> Result<Vec<bf16>> {
        match *self {}
    }
    fn export(&self, _session: SessionId, _layer: usize) -> Result<PagedExport> {
        match *self {}
    }
    fn export_pca(&self, _session: SessionId, _layer: usize) -> Result<PagedExport> {
        match *self {}
    }
    fn faults(&self) -> Result<Vec<u32>> {
        match *self {}
    }
    fn load_calibration(
        &mut self,
        _layer: usize,
        _heads: &[fathom_plan::scanner::HeadCalib],
    ) -> Result<()> {
        match *self {}
    }
    fn prepare(&mut self, _method: crate::config::Method) -> Result<()> {
        match *self {}
    }
    fn is_prepared(&self, _method: crate::config::Method) -> bool {
        match *self {}
    }
    fn check_method(&self, _method: crate::cache::AttendMethod, _layer: usize) -> Result<()> {
        match *self {}
    }
    fn attend(
        &mut self,
        _batch: &AppendBatch,
        _layer: usize,
        _method: AttendMethod,
        _params: &fathom_plan::SelectParams,
        _q: &QueryRows<'_>,
        _out: DeviceViewMut<'_>,
    ) -> Result<()> {
        match *self {}
    }
    fn attend_host(
        &mut self,
        _batch: &AppendBatch,
        _layer: usize,
        _method: crate::cache::AttendMethod,
        _params: &fathom_plan::SelectParams,
        _q: &[f32],
    ) -> Result<Vec<f32>> {
        match *self {}
    }
    fn capture(
        &mut self,
        _batch: &AppendBatch,
        _step: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<Self::Graph> {
        match *self {}
    }
    fn begin_capture(&mut self, _batch: &AppendBatch) -> Result<()> {
        match *self {}
    }
    fn end_capture(&mut self) -> Result<Self::Graph> {
        match *self {}
    }
    fn replay(&mut self, _batch: &AppendBatch, _graph: &Self::Graph) -> Result<()> {
        match *self {}
    }
    fn check_graph(&self, _graph: &Self::Graph) -> Result<()> {
        match *self {}
    }
    fn reset_row_cache(&self, _session: SessionId) -> Result<()> {
        match *self {}
    }
    fn row_counters(&self) -> Result<RowCounters> {
        match *self {}
    }
    fn select_counters(&self) -> Result<SelectCounters> {
        match *self {}
    }
    fn plan_bits(&self) -> Result<(f64, u64)> {
        match *self {}
    }
    fn stage_times(&mut self) -> Result<AttendStages> {
        match *self {}
    }
    fn host_gather_stats(&self) -> Result<Option<crate::host_gather::HostGatherReport>> {
        match *self {}
    }
    fn pool_hbm_bytes(&self) -> u64 {
        match *self {}
    }
    fn debug_readback(&self, _batch: &AppendBatch, _b: usize) -> Result<AttendDebug> {
        match *self {}
    }
}
