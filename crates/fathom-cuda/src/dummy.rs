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

/// No value: the stub's types hold one, so none of them can be made (private, so that code
/// outside the crate does not see them as uninhabited and call what follows them unreachable).
#[derive(Debug)]
enum Never {}

/// A CUDA device (stub: none can be opened without the `cuda` feature).
#[derive(Debug)]
pub struct Gpu(Never);

/// The paged KV cache (stub: none can be made without the `cuda` feature).
#[derive(Debug)]
pub struct PagedCache(Never);

/// A captured decode step (stub).
#[derive(Debug)]
pub struct DecodeGraph(Never);

impl Device for Gpu {
    fn open(_ordinal: usize) -> Result<Self> {
        Err(CudaError::NotCompiledWithCuda)
    }
    fn info(&self) -> &DeviceInfo {
        match self.0 {}
    }
    fn h2d_bandwidth(&self, _bytes: usize) -> Result<f64> {
        match self.0 {}
    }
    fn gather_bandwidth(&self, _bytes: usize) -> Result<f64> {
        match self.0 {}
    }
    fn gather_run_bandwidth(&self, _run_bytes: usize, _total_bytes: usize) -> Result<f64> {
        match self.0 {}
    }
    fn row_gather_sweep(
        &self,
        _pages: crate::HostPages,
        _row_bytes: usize,
        _spans: &[usize],
        _rows: &[usize],
        _seed: u64,
    ) -> Result<RowSweep> {
        match self.0 {}
    }
}

impl KvCache for PagedCache {
    type Device = Gpu;
    type Graph = DecodeGraph;

    fn synchronize(&self) -> Result<()> {
        match self.0 {}
    }

    fn new(_gpu: &Self::Device, _cfg: CacheConfig) -> Result<Self> {
        Err(CudaError::NotCompiledWithCuda)
    }
    fn config(&self) -> &CacheConfig {
        match self.0 {}
    }
    fn layout(&self) -> &PagedLayout {
        match self.0 {}
    }
    fn sessions(&self) -> &CacheSessions {
        match self.0 {}
    }
    fn create(&mut self) -> Result<SessionId> {
        match self.0 {}
    }
    fn len(&self, _session: SessionId) -> Result<usize> {
        match self.0 {}
    }
    fn is_empty(&self, _session: SessionId) -> Result<bool> {
        match self.0 {}
    }
    fn fork(&mut self, _parent: SessionId) -> Result<SessionId> {
        match self.0 {}
    }
    fn free(&mut self, _session: SessionId) -> Result<()> {
        match self.0 {}
    }
    fn truncate(&mut self, _session: SessionId, _len: usize) -> Result<()> {
        match self.0 {}
    }
    fn check_reserve(&self, _batch: &[(SessionId, usize)]) -> Result<()> {
        match self.0 {}
    }
    fn reserve(&mut self, _batch: &[(SessionId, usize)]) -> Result<AppendBatch> {
        match self.0 {}
    }
    fn append(&mut self, _batch: &AppendBatch, _layer: usize, _kv: &KvRows) -> Result<()> {
        match self.0 {}
    }
    fn append_host(
        &mut self,
        _batch: &AppendBatch,
        _layer: usize,
        _k: &[f32],
        _v: &[f32],
    ) -> Result<()> {
        match self.0 {}
    }
    unsafe fn follow(&self, _external: u64) -> Result<()> {
        match self.0 {}
    }
    unsafe fn signal(&self, _external: u64) -> Result<()> {
        match self.0 {}
    }
    fn read_rows(
        &self,
        _batch: &AppendBatch,
        _layer: usize,
        _cap: usize,
        _k_out: DeviceViewMut<'_>,
        _v_out: DeviceViewMut<'_>,
    ) -> Result<()> {
        match self.0 {}
    }
    fn records(&self, _session: SessionId, _layer: usize) -> Result<Vec<bf16>> {
        match self.0 {}
    }
    fn export(&self, _session: SessionId, _layer: usize) -> Result<PagedExport> {
        match self.0 {}
    }
    fn export_pca(&self, _session: SessionId, _layer: usize) -> Result<PagedExport> {
        match self.0 {}
    }
    fn faults(&self) -> Result<Vec<u32>> {
        match self.0 {}
    }
    fn load_calibration(
        &mut self,
        _layer: usize,
        _heads: &[fathom_plan::scanner::HeadCalib],
    ) -> Result<()> {
        match self.0 {}
    }
    fn prepare(&mut self, _method: crate::config::Method) -> Result<()> {
        match self.0 {}
    }
    fn is_prepared(&self, _method: crate::config::Method) -> bool {
        match self.0 {}
    }
    fn check_method(&self, _method: crate::cache::AttendMethod, _layer: usize) -> Result<()> {
        match self.0 {}
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
        match self.0 {}
    }
    fn select(
        &mut self,
        _batch: &AppendBatch,
        _layer: usize,
        _method: AttendMethod,
        _params: &fathom_plan::SelectParams,
        _q: &QueryRows<'_>,
        _out: crate::cache::SelectOut<'_>,
    ) -> Result<()> {
        match self.0 {}
    }
    fn attend_host(
        &mut self,
        _batch: &AppendBatch,
        _layer: usize,
        _method: crate::cache::AttendMethod,
        _params: &fathom_plan::SelectParams,
        _q: &[f32],
    ) -> Result<Vec<f32>> {
        match self.0 {}
    }
    fn capture(
        &mut self,
        _batch: &AppendBatch,
        _step: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<Self::Graph> {
        match self.0 {}
    }
    fn begin_capture(&mut self, _batch: &AppendBatch) -> Result<()> {
        match self.0 {}
    }
    fn begin_caller_capture(&mut self, _batch: &AppendBatch) -> Result<()> {
        match self.0 {}
    }
    fn end_capture(&mut self) -> Result<Self::Graph> {
        match self.0 {}
    }
    fn replay(&mut self, _batch: &AppendBatch, _graph: &Self::Graph) -> Result<()> {
        match self.0 {}
    }
    fn check_graph(&self, _graph: &Self::Graph) -> Result<()> {
        match self.0 {}
    }
    fn reset_row_cache(&self, _session: SessionId) -> Result<()> {
        match self.0 {}
    }
    fn row_counters(&self) -> Result<RowCounters> {
        match self.0 {}
    }
    fn select_counters(&self) -> Result<SelectCounters> {
        match self.0 {}
    }
    fn plan_bits(&self) -> Result<(f64, u64)> {
        match self.0 {}
    }
    fn stage_times(&mut self) -> Result<AttendStages> {
        match self.0 {}
    }
    fn host_gather_stats(&self) -> Result<Option<crate::host_gather::HostGatherReport>> {
        match self.0 {}
    }
    fn pool_hbm_bytes(&self) -> u64 {
        match self.0 {}
    }
    fn debug_readback(&self, _batch: &AppendBatch, _b: usize) -> Result<AttendDebug> {
        match self.0 {}
    }
}
