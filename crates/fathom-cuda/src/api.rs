//! The one API both backends implement: the CUDA backend (`cuda` feature) and the stub that
//! every other build gets. Code written against these traits compiles, unchanged, in either
//! build, and `tests/api.rs` holds both backends to them (CI checks the crate with and
//! without the feature), as candle's dummy backends mirror its CUDA one.

use crate::config::Method;
use crate::error::Result;
use crate::types::DeviceInfo;

/// A device that caches run on.
pub trait Device: Sized + std::fmt::Debug {
    /// Opens device `ordinal` ([`crate::CudaError::NotCompiledWithCuda`] in the stub,
    /// [`crate::CudaError::NoDevice`] without a driver or device).
    fn open(ordinal: usize) -> Result<Self>;
    /// The device description.
    fn info(&self) -> &DeviceInfo;
    /// Host-to-device bandwidth of one pinned `memcpy` of `bytes`, GB/s.
    fn h2d_bandwidth(&self, bytes: usize) -> Result<f64>;
    /// Bandwidth of the zero-copy gather kernel over one run of `bytes`, GB/s.
    fn gather_bandwidth(&self, bytes: usize) -> Result<f64>;
}

impl Device for crate::Gpu {
    fn open(ordinal: usize) -> Result<Self> {
        crate::Gpu::open(ordinal)
    }
    fn info(&self) -> &DeviceInfo {
        crate::Gpu::info(self)
    }
    fn h2d_bandwidth(&self, bytes: usize) -> Result<f64> {
        crate::Gpu::h2d_bandwidth(self, bytes)
    }
    fn gather_bandwidth(&self, bytes: usize) -> Result<f64> {
        crate::Gpu::gather_bandwidth(self, bytes)
    }
}

/// The paged KV cache a model drives (docs/SPEC.md §6.1) on a [`Device`].
pub trait KvCache: Sized {
    /// The device type.
    type Device: Device;
    /// Allocates the cache.
    fn new(gpu: &Self::Device, cfg: crate::cache::CacheConfig) -> Result<Self>;
    /// The configuration.
    fn config(&self) -> &crate::cache::CacheConfig;
    /// A new, empty session.
    fn create(&mut self) -> Result<crate::pages::SessionId>;
    /// Tokens in a session.
    fn len(&self, session: crate::pages::SessionId) -> Result<usize>;
    /// A session sharing every page of `parent`.
    fn fork(&mut self, parent: crate::pages::SessionId) -> Result<crate::pages::SessionId>;
    /// Frees a session.
    fn free(&mut self, session: crate::pages::SessionId) -> Result<()>;
    /// Shortens a session to `len` tokens in every layer (docs/SPEC.md §6.1, "Truncate").
    fn truncate(&mut self, session: crate::pages::SessionId, len: usize) -> Result<()>;
    /// Grows the sessions of a batch (all or nothing).
    fn reserve(
        &mut self,
        batch: &[(crate::pages::SessionId, usize)],
    ) -> Result<crate::cache::AppendBatch>;
    /// Appends one layer's K/V rows from device memory.
    fn append(
        &mut self,
        batch: &crate::cache::AppendBatch,
        layer: usize,
        kv: &crate::cache::KvRows,
    ) -> Result<()>;
    /// Appends one layer's K/V rows from host slices `[rows][Hkv][D]`.
    fn append_host(
        &mut self,
        batch: &crate::cache::AppendBatch,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()>;
    /// Checks that a method can attend a layer, launching nothing.
    fn check_method(&self, method: crate::cache::AttendMethod, layer: usize) -> Result<()>;
    /// The last `cap` K|V records of every session of a batch, to device memory as f32.
    fn read_rows(
        &self,
        batch: &crate::cache::AppendBatch,
        layer: usize,
        cap: usize,
        k_out: u64,
        v_out: u64,
    ) -> Result<()>;
    /// Faults counted per layer.
    fn faults(&self) -> Result<Vec<u32>>;
    /// Loads one layer's calibration (σ², Double Sparsity's channels) per KV head.
    fn load_calibration(
        &mut self,
        layer: usize,
        heads: &[fathom_plan::scanner::HeadCalib],
    ) -> Result<()>;
    /// Makes a method's static depth tables.
    fn prepare(&mut self, method: Method) -> Result<()>;
    /// One layer's attention for a ragged batch, device queries to device outputs.
    fn attend(
        &mut self,
        batch: &crate::cache::AppendBatch,
        layer: usize,
        method: crate::cache::AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &crate::cache::QueryRows,
        out: u64,
    ) -> Result<()>;
    /// One layer's attention from and to host slices.
    fn attend_host(
        &mut self,
        batch: &crate::cache::AppendBatch,
        layer: usize,
        method: crate::cache::AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &[f32],
    ) -> Result<Vec<f32>>;
    /// One layer's store of a session, in `fathom-store`'s layout.
    fn export(
        &self,
        session: crate::pages::SessionId,
        layer: usize,
    ) -> Result<crate::paged_ref::PagedExport>;
    /// One layer's PCA index of a session ([`crate::cache::CacheConfig::pca_index`]), in
    /// `fathom-store`'s layout.
    fn export_pca(
        &self,
        session: crate::pages::SessionId,
        layer: usize,
    ) -> Result<crate::paged_ref::PagedExport>;
    /// Union rows fetched and row-cache hits since the cache was made.
    fn row_counters(&self) -> Result<crate::cache::RowCounters>;
    /// How attends take each query head's top-k (docs/SPEC.md §5).
    fn set_select_path(&mut self, path: crate::cache::SelectPath) -> Result<()>;
    /// Head groups per attend, pipelined over two streams (docs/SPEC.md §6.1).
    fn set_attend_groups(&mut self, groups: usize) -> Result<()>;
    /// Plane words per global load of the scan, 1 or 2.
    fn set_scan_vector_words(&mut self, words: u32) -> Result<()>;
    /// CPU threads that serve the row fetch's misses (0: off; docs/SPEC.md §6.1).
    fn set_host_gather(&mut self, threads: usize) -> Result<()>;
    /// Percent of the misses the host gather brings while the fetch reads the rest (1 to 100).
    fn set_host_gather_share(&mut self, percent: u32) -> Result<()>;
    /// Rows selected by the filtered select, and its fallbacks, since the cache was made.
    fn select_counters(&self) -> Result<crate::cache::SelectCounters>;
}

impl KvCache for crate::PagedCache {
    type Device = crate::Gpu;
    fn new(gpu: &crate::Gpu, cfg: crate::cache::CacheConfig) -> Result<Self> {
        crate::PagedCache::new(gpu, cfg)
    }
    fn config(&self) -> &crate::cache::CacheConfig {
        crate::PagedCache::config(self)
    }
    fn create(&mut self) -> Result<crate::pages::SessionId> {
        crate::PagedCache::create(self)
    }
    fn len(&self, session: crate::pages::SessionId) -> Result<usize> {
        crate::PagedCache::len(self, session)
    }
    fn fork(&mut self, parent: crate::pages::SessionId) -> Result<crate::pages::SessionId> {
        crate::PagedCache::fork(self, parent)
    }
    fn free(&mut self, session: crate::pages::SessionId) -> Result<()> {
        crate::PagedCache::free(self, session)
    }
    fn truncate(&mut self, session: crate::pages::SessionId, len: usize) -> Result<()> {
        crate::PagedCache::truncate(self, session, len)
    }
    fn reserve(
        &mut self,
        batch: &[(crate::pages::SessionId, usize)],
    ) -> Result<crate::cache::AppendBatch> {
        crate::PagedCache::reserve(self, batch)
    }
    fn append(
        &mut self,
        batch: &crate::cache::AppendBatch,
        layer: usize,
        kv: &crate::cache::KvRows,
    ) -> Result<()> {
        crate::PagedCache::append(self, batch, layer, kv)
    }
    fn append_host(
        &mut self,
        batch: &crate::cache::AppendBatch,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        crate::PagedCache::append_host(self, batch, layer, k, v)
    }
    fn check_method(&self, method: crate::cache::AttendMethod, layer: usize) -> Result<()> {
        crate::PagedCache::check_method(self, method, layer)
    }
    fn read_rows(
        &self,
        batch: &crate::cache::AppendBatch,
        layer: usize,
        cap: usize,
        k_out: u64,
        v_out: u64,
    ) -> Result<()> {
        crate::PagedCache::read_rows(self, batch, layer, cap, k_out, v_out)
    }
    fn faults(&self) -> Result<Vec<u32>> {
        crate::PagedCache::faults(self)
    }
    fn load_calibration(
        &mut self,
        layer: usize,
        heads: &[fathom_plan::scanner::HeadCalib],
    ) -> Result<()> {
        crate::PagedCache::load_calibration(self, layer, heads)
    }
    fn prepare(&mut self, method: Method) -> Result<()> {
        crate::PagedCache::prepare(self, method)
    }
    fn attend(
        &mut self,
        batch: &crate::cache::AppendBatch,
        layer: usize,
        method: crate::cache::AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &crate::cache::QueryRows,
        out: u64,
    ) -> Result<()> {
        crate::PagedCache::attend(self, batch, layer, method, params, q, out)
    }
    fn attend_host(
        &mut self,
        batch: &crate::cache::AppendBatch,
        layer: usize,
        method: crate::cache::AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &[f32],
    ) -> Result<Vec<f32>> {
        crate::PagedCache::attend_host(self, batch, layer, method, params, q)
    }
    fn row_counters(&self) -> Result<crate::cache::RowCounters> {
        crate::PagedCache::row_counters(self)
    }
    fn set_select_path(&mut self, path: crate::cache::SelectPath) -> Result<()> {
        crate::PagedCache::set_select_path(self, path)
    }
    fn set_attend_groups(&mut self, groups: usize) -> Result<()> {
        crate::PagedCache::set_attend_groups(self, groups)
    }
    fn set_scan_vector_words(&mut self, words: u32) -> Result<()> {
        crate::PagedCache::set_scan_vector_words(self, words)
    }
    fn set_host_gather(&mut self, threads: usize) -> Result<()> {
        crate::PagedCache::set_host_gather(self, threads)
    }
    fn set_host_gather_share(&mut self, percent: u32) -> Result<()> {
        crate::PagedCache::set_host_gather_share(self, percent)
    }
    fn select_counters(&self) -> Result<crate::cache::SelectCounters> {
        crate::PagedCache::select_counters(self)
    }
    fn export(
        &self,
        session: crate::pages::SessionId,
        layer: usize,
    ) -> Result<crate::paged_ref::PagedExport> {
        crate::PagedCache::export(self, session, layer)
    }
    fn export_pca(
        &self,
        session: crate::pages::SessionId,
        layer: usize,
    ) -> Result<crate::paged_ref::PagedExport> {
        crate::PagedCache::export_pca(self, session, layer)
    }
}
