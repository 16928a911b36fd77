//! The backend without the `cuda` feature: the same types; every entry point that would touch
//! a device returns [`CudaError::NotCompiledWithCuda`] (a `Gpu` cannot be opened, so no cache
//! exists to call the others on; the host-side checks shared with the real backend
//! live in `cache.rs` and `pages.rs`).

use crate::config::Method;
use crate::error::{CudaError, Result};
use crate::types::DeviceInfo;

/// A CUDA device (stub: cannot be opened without the `cuda` feature).
#[derive(Debug)]
pub struct Gpu {
    info: DeviceInfo,
}

impl Gpu {
    /// Compiles and loads a module of the caller's kernels.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn load_module(
        &self,
        _name: &'static str,
        _src: &str,
        _options: Vec<String>,
    ) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Opens device `ordinal`.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn open(_ordinal: usize) -> Result<Self> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// The device description.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }
    /// Host-to-device bandwidth of one pinned `memcpy` of `bytes`, GB/s.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn h2d_bandwidth(&self, _bytes: usize) -> Result<f64> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Bandwidth of the zero-copy gather kernel over one run of `bytes`, GB/s.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn gather_bandwidth(&self, _bytes: usize) -> Result<f64> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Bandwidth of the zero-copy gather over runs of `run_bytes`, GB/s.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn gather_run_bandwidth(&self, _run_bytes: usize, _total_bytes: usize) -> Result<f64> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// The zero-copy gather over random and back-to-back rows of host memory.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn row_gather_sweep(
        &self,
        _pages: crate::HostPages,
        _row_bytes: usize,
        _spans: &[usize],
        _rows: &[usize],
        _seed: u64,
    ) -> Result<crate::RowSweep> {
        Err(CudaError::NotCompiledWithCuda)
    }
}

/// The paged KV cache (stub: cannot be created without the `cuda` feature).
#[derive(Debug)]
pub struct PagedCache {
    cfg: crate::cache::CacheConfig,
    layout: crate::paged_layout::PagedLayout,
    sessions: crate::pages::CacheSessions,
}

impl PagedCache {
    /// Allocates the cache.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build (after validating `cfg`).
    pub fn new(_gpu: &Gpu, cfg: crate::cache::CacheConfig) -> Result<Self> {
        cfg.validate()?;
        Err(CudaError::NotCompiledWithCuda)
    }
    /// The configuration.
    pub fn config(&self) -> &crate::cache::CacheConfig {
        &self.cfg
    }
    /// The byte layout of each layer's pool.
    pub fn layout(&self) -> &crate::paged_layout::PagedLayout {
        &self.layout
    }
    /// The host-side page tables and sessions.
    pub fn sessions(&self) -> &crate::pages::CacheSessions {
        &self.sessions
    }
    /// A new, empty session.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn create(&mut self) -> Result<crate::pages::SessionId> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Tokens in `session`.
    ///
    /// # Errors
    /// An unknown session.
    pub fn len(&self, session: crate::pages::SessionId) -> Result<usize> {
        Ok(self.sessions.len(session)?)
    }
    /// Whether `session` holds no token.
    ///
    /// # Errors
    /// An unknown session.
    pub fn is_empty(&self, session: crate::pages::SessionId) -> Result<bool> {
        Ok(self.sessions.is_empty(session)?)
    }
    /// Forks `parent`.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn fork(&mut self, _parent: crate::pages::SessionId) -> Result<crate::pages::SessionId> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Frees `session`.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn free(&mut self, _session: crate::pages::SessionId) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Shortens a session.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn truncate(&mut self, _session: crate::pages::SessionId, _len: usize) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Grows the sessions of a batch.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn reserve(
        &mut self,
        _batch: &[(crate::pages::SessionId, usize)],
    ) -> Result<crate::cache::AppendBatch> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Whether a reserve would succeed.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`].
    pub fn check_reserve(&self, _batch: &[(crate::pages::SessionId, usize)]) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Appends one layer's K/V rows.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn append(
        &mut self,
        _batch: &crate::cache::AppendBatch,
        _layer: usize,
        _kv: &crate::cache::KvRows,
    ) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Appends one layer's K/V rows from host slices.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn append_host(
        &mut self,
        _batch: &crate::cache::AppendBatch,
        _layer: usize,
        _k: &[f32],
        _v: &[f32],
    ) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Faults counted per layer.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn faults(&self) -> Result<Vec<u32>> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// One layer's store of `session`.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn export(
        &self,
        _session: crate::pages::SessionId,
        _layer: usize,
    ) -> Result<crate::paged_ref::PagedExport> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// One layer's PCA index of `session`.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn export_pca(
        &self,
        _session: crate::pages::SessionId,
        _layer: usize,
    ) -> Result<crate::paged_ref::PagedExport> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Orders the cache's stream after a caller's stream.
    ///
    /// # Safety
    /// Nothing is dereferenced in this build.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub unsafe fn follow(&self, _external: u64) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Makes a caller's stream wait for the cache's work.
    ///
    /// # Safety
    /// Nothing is dereferenced in this build.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub unsafe fn signal(&self, _external: u64) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Checks that a method can attend a layer.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn check_method(&self, _method: crate::cache::AttendMethod, _layer: usize) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// The last K|V records of every session of a batch, to device memory.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn read_rows(
        &self,
        _batch: &crate::cache::AppendBatch,
        _layer: usize,
        _cap: usize,
        _k_out: u64,
        _v_out: u64,
    ) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }

    /// One layer's K|V records of `session`.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn records(
        &self,
        _session: crate::pages::SessionId,
        _layer: usize,
    ) -> Result<Vec<half::bf16>> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Loads one layer's calibration.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn load_calibration(
        &mut self,
        _layer: usize,
        _heads: &[fathom_plan::scanner::HeadCalib],
    ) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Makes a method's static depth tables.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn prepare(&mut self, _method: Method) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// One layer's attention from device queries to device outputs.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn attend(
        &mut self,
        _batch: &crate::cache::AppendBatch,
        _layer: usize,
        _method: crate::cache::AttendMethod,
        _params: &fathom_plan::SelectParams,
        _q: &crate::cache::QueryRows,
        _out: u64,
    ) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// One layer's attention from and to host slices.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn attend_host(
        &mut self,
        _batch: &crate::cache::AppendBatch,
        _layer: usize,
        _method: crate::cache::AttendMethod,
        _params: &fathom_plan::SelectParams,
        _q: &[f32],
    ) -> Result<Vec<f32>> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Depths, scores and winners of one session after an attend.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn debug_readback(
        &self,
        _batch: &crate::cache::AppendBatch,
        _b: usize,
    ) -> Result<crate::cache::AttendDebug> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Mean plan bits of every GPU-planned attend and how many plans.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn plan_bits(&self) -> Result<(f64, u64)> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Union rows fetched and row-cache hits since the cache was made.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn row_counters(&self) -> Result<crate::cache::RowCounters> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// How attends' rows took their top-k since the cache was made.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn select_counters(&self) -> Result<crate::cache::SelectCounters> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Sets how attends select their top-k.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn set_select_path(&mut self, _path: crate::cache::SelectPath) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// The select setting (the default in this build).
    pub fn select_path(&self) -> crate::cache::SelectPath {
        crate::cache::SelectPath::Scores
    }
    /// Sets the head groups per attend.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn set_attend_groups(&mut self, _groups: usize) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// The head groups per attend (the default in this build).
    pub fn attend_groups(&self) -> usize {
        1
    }
    /// Sets the plane words per scan load.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn set_scan_vector_words(&mut self, _words: u32) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Plane words per scan load (the default in this build).
    pub fn scan_vector_words(&self) -> u32 {
        1
    }
    /// Turns the per-stage timing of attends on or off (no attend runs in this build).
    pub fn set_stage_timing(&mut self, _on: bool) {}
    /// Whether attends are timed by stage (never in this build).
    pub fn stage_timing(&self) -> bool {
        false
    }
    /// The stage times of the attends since the last call.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn stage_times(&mut self) -> Result<crate::cache::AttendStages> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Sets the host gather's threads.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn set_host_gather(&mut self, _threads: usize) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// The host gather's threads (off in this build).
    pub fn host_gather(&self) -> usize {
        0
    }
    /// Sets the host gather's share of the misses, in percent.
    ///
    /// # Errors
    /// A share the CUDA build refuses (typed), else [`CudaError::NotCompiledWithCuda`].
    pub fn set_host_gather_share(&mut self, percent: u32) -> Result<()> {
        crate::cache::check_host_gather_share(percent)?;
        Err(CudaError::NotCompiledWithCuda)
    }
    /// The host gather's share of the misses, in percent (the default, 100, in this build).
    pub fn host_gather_share(&self) -> u32 {
        100
    }
    /// The host gather's counts (off in this build).
    ///
    /// # Errors
    /// Never in this build.
    pub fn host_gather_stats(&self) -> Result<Option<crate::host_gather::HostGatherReport>> {
        Ok(None)
    }
    /// Bytes of HBM the page pools take (none in this build).
    pub fn pool_hbm_bytes(&self) -> u64 {
        0
    }
    /// Empties the HBM row cache of a session.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn reset_row_cache(&self, _session: crate::pages::SessionId) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
}

/// A captured decode step (stub: cannot be made without the `cuda` feature).
#[derive(Debug)]
pub struct DecodeGraph {
    _private: (),
}

impl PagedCache {
    /// Captures one decode step into a CUDA graph.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn capture(
        &mut self,
        _batch: &crate::cache::AppendBatch,
        _step: impl FnOnce(&mut PagedCache) -> Result<()>,
    ) -> Result<DecodeGraph> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Starts capturing a decode step.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`].
    pub fn begin_capture(&mut self, _batch: &crate::cache::AppendBatch) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Ends a capture.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`].
    pub fn end_capture(&mut self) -> Result<DecodeGraph> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Whether a method's static depth table is made (never, in this build).
    pub fn is_prepared(&self, _method: crate::config::Method) -> bool {
        false
    }
    /// Whether a captured step may still be replayed.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn check_graph(&self, _graph: &DecodeGraph) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Replays a captured decode step.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn replay(
        &mut self,
        _batch: &crate::cache::AppendBatch,
        _graph: &DecodeGraph,
    ) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
}
