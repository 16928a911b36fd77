//! The CUDA backend's implementation of [`crate::api::KvCache`]: each method is the stage
//! function of its own file (sessions, append, rows, calib, attend, graph, stats).

#[allow(unused_imports)]
use super::*;
use crate::api::KvCache;
use crate::cache::{AttendMethod, QueryRows};

impl KvCache for PagedCache {
    type Device = Gpu;
    type Graph = DecodeGraph;

    fn synchronize(&self) -> Result<()> {
        self.sync()
    }

    fn new(gpu: &Self::Device, cfg: CacheConfig) -> Result<Self> {
        PagedCache::new(gpu, cfg)
    }
    fn config(&self) -> &CacheConfig {
        PagedCache::config(self)
    }
    fn layout(&self) -> &PagedLayout {
        PagedCache::layout(self)
    }
    fn sessions(&self) -> &CacheSessions {
        PagedCache::sessions(self)
    }
    fn create(&mut self) -> Result<SessionId> {
        PagedCache::create(self)
    }
    fn len(&self, session: SessionId) -> Result<usize> {
        PagedCache::len(self, session)
    }
    fn is_empty(&self, session: SessionId) -> Result<bool> {
        PagedCache::is_empty(self, session)
    }
    fn fork(&mut self, parent: SessionId) -> Result<SessionId> {
        PagedCache::fork(self, parent)
    }
    fn free(&mut self, session: SessionId) -> Result<()> {
        PagedCache::free(self, session)
    }
    fn truncate(&mut self, session: SessionId, len: usize) -> Result<()> {
        PagedCache::truncate(self, session, len)
    }
    fn check_reserve(&self, batch: &[(SessionId, usize)]) -> Result<()> {
        PagedCache::check_reserve(self, batch)
    }
    fn reserve(&mut self, batch: &[(SessionId, usize)]) -> Result<AppendBatch> {
        PagedCache::reserve(self, batch)
    }
    fn append(&mut self, batch: &AppendBatch, layer: usize, kv: &KvRows) -> Result<()> {
        PagedCache::append(self, batch, layer, kv)
    }
    fn append_host(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        PagedCache::append_host(self, batch, layer, k, v)
    }
    unsafe fn follow(&self, external: u64) -> Result<()> {
        // SAFETY: the caller upholds this method's contract, which is the inherent one's.
        unsafe { PagedCache::follow(self, external) }
    }
    unsafe fn signal(&self, external: u64) -> Result<()> {
        // SAFETY: the caller upholds this method's contract, which is the inherent one's.
        unsafe { PagedCache::signal(self, external) }
    }
    fn read_rows(
        &self,
        batch: &AppendBatch,
        layer: usize,
        cap: usize,
        k_out: DeviceViewMut<'_>,
        v_out: DeviceViewMut<'_>,
    ) -> Result<()> {
        PagedCache::read_rows(self, batch, layer, cap, k_out, v_out)
    }
    fn records(&self, session: SessionId, layer: usize) -> Result<Vec<bf16>> {
        PagedCache::records(self, session, layer)
    }
    fn export(&self, session: SessionId, layer: usize) -> Result<PagedExport> {
        PagedCache::export(self, session, layer)
    }
    fn export_pca(&self, session: SessionId, layer: usize) -> Result<PagedExport> {
        PagedCache::export_pca(self, session, layer)
    }
    fn faults(&self) -> Result<Vec<u32>> {
        PagedCache::faults(self)
    }
    fn load_calibration(
        &mut self,
        layer: usize,
        heads: &[fathom_plan::scanner::HeadCalib],
    ) -> Result<()> {
        PagedCache::load_calibration(self, layer, heads)
    }
    fn prepare(&mut self, method: crate::config::Method) -> Result<()> {
        PagedCache::prepare(self, method)
    }
    fn is_prepared(&self, method: crate::config::Method) -> bool {
        PagedCache::is_prepared(self, method)
    }
    fn check_method(&self, method: crate::cache::AttendMethod, layer: usize) -> Result<()> {
        PagedCache::check_method(self, method, layer)
    }
    fn attend(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        method: AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &QueryRows<'_>,
        out: DeviceViewMut<'_>,
    ) -> Result<()> {
        PagedCache::attend(self, batch, layer, method, params, q, out)
    }
    fn select(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        method: AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &QueryRows<'_>,
        out: crate::cache::SelectOut<'_>,
    ) -> Result<()> {
        PagedCache::select(self, batch, layer, method, params, q, out)
    }
    fn attend_host(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        method: crate::cache::AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &[f32],
    ) -> Result<Vec<f32>> {
        PagedCache::attend_host(self, batch, layer, method, params, q)
    }
    fn capture(
        &mut self,
        batch: &AppendBatch,
        step: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<Self::Graph> {
        PagedCache::capture(self, batch, step)
    }
    fn begin_capture(&mut self, batch: &AppendBatch) -> Result<()> {
        PagedCache::begin_capture(self, batch)
    }
    fn begin_caller_capture(&mut self, batch: &AppendBatch) -> Result<()> {
        PagedCache::begin_caller_capture(self, batch)
    }
    fn end_capture(&mut self) -> Result<Self::Graph> {
        PagedCache::end_capture(self)
    }
    fn replay(&mut self, batch: &AppendBatch, graph: &Self::Graph) -> Result<()> {
        PagedCache::replay(self, batch, graph)
    }
    fn check_graph(&self, graph: &Self::Graph) -> Result<()> {
        PagedCache::check_graph(self, graph)
    }
    fn reset_row_cache(&self, session: SessionId) -> Result<()> {
        PagedCache::reset_row_cache(self, session)
    }
    fn row_counters(&self) -> Result<RowCounters> {
        PagedCache::row_counters(self)
    }
    fn select_counters(&self) -> Result<SelectCounters> {
        PagedCache::select_counters(self)
    }
    fn plan_bits(&self) -> Result<(f64, u64)> {
        PagedCache::plan_bits(self)
    }
    fn stage_times(&mut self) -> Result<AttendStages> {
        PagedCache::stage_times(self)
    }
    fn host_gather_stats(&self) -> Result<Option<crate::host_gather::HostGatherReport>> {
        PagedCache::host_gather_stats(self)
    }
    fn pool_hbm_bytes(&self) -> u64 {
        PagedCache::pool_hbm_bytes(self)
    }
    fn debug_readback(&self, batch: &AppendBatch, b: usize) -> Result<AttendDebug> {
        PagedCache::debug_readback(self, batch, b)
    }
}
