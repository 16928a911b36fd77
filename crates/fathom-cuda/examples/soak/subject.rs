//! What the soak drives: the cache's session operations, appends and attends from host slices,
//! and the read-backs its CPU twin checks. The GPU cache implements it here, through
//! `fathom_cuda::api::KvCache` (every call site of the library is in this file, grouped so
//! that a change of the API is one edit); the unit tests implement it over `PagedStoreRef`
//! (`cpu.rs`).

use fathom_cuda::api::KvCache;
use fathom_cuda::cache::{AppendBatch, AttendDebug, AttendMethod, CacheConfig};
use fathom_cuda::pages::SessionId;
use fathom_cuda::{Method, PagedCache, PagedExport, Result};
use fathom_plan::scanner::HeadCalib;
use fathom_plan::SelectParams;
use half::bf16;

/// A paged KV cache as the soak sees it.
pub trait Subject {
    /// The configuration it was made with.
    fn config(&self) -> CacheConfig;
    /// Loads every layer's calibration, then prepares every method.
    fn setup(&mut self, calib: &[Vec<HeadCalib>], methods: &[Method]) -> Result<()>;
    /// A new, empty session.
    fn create(&mut self) -> Result<SessionId>;
    /// A session sharing every page of `parent`.
    fn fork(&mut self, parent: SessionId) -> Result<SessionId>;
    /// Frees a session.
    fn free(&mut self, s: SessionId) -> Result<()>;
    /// Cuts a session to `len` tokens.
    fn truncate(&mut self, s: SessionId, len: usize) -> Result<()>;
    /// Tokens in a session.
    fn len(&self, s: SessionId) -> Result<usize>;
    /// Grows a ragged batch (all or nothing).
    fn reserve(&mut self, batch: &[(SessionId, usize)]) -> Result<AppendBatch>;
    /// One layer's rows `[rows][Hkv][D]` from host slices.
    fn append(&mut self, b: &AppendBatch, layer: usize, k: &[f32], v: &[f32]) -> Result<()>;
    /// One layer's attention of queries `[batch][Hq][D]`, to `[batch][Hq][D]`.
    fn attend(
        &mut self,
        b: &AppendBatch,
        layer: usize,
        m: AttendMethod,
        p: &SelectParams,
        q: &[f32],
    ) -> Result<Vec<f32>>;
    /// After an attend: batch member `i`'s depths, scores and winners.
    fn readback(&self, b: &AppendBatch, i: usize) -> Result<AttendDebug>;
    /// One layer's store of a session.
    fn export(&self, s: SessionId, layer: usize) -> Result<PagedExport>;
    /// One layer's PCA index of a session.
    fn export_pca(&self, s: SessionId, layer: usize) -> Result<PagedExport>;
    /// One layer's K|V records `[head][token][K | V]`.
    fn records(&self, s: SessionId, layer: usize) -> Result<Vec<bf16>>;
    /// Faults counted per layer.
    fn faults(&self) -> Result<Vec<u32>>;
}

impl Subject for PagedCache {
    fn config(&self) -> CacheConfig {
        *KvCache::config(self)
    }
    fn setup(&mut self, calib: &[Vec<HeadCalib>], methods: &[Method]) -> Result<()> {
        for (l, c) in calib.iter().enumerate() {
            KvCache::load_calibration(self, l, c)?;
        }
        methods.iter().try_for_each(|&m| KvCache::prepare(self, m))
    }
    fn create(&mut self) -> Result<SessionId> {
        KvCache::create(self)
    }
    fn fork(&mut self, parent: SessionId) -> Result<SessionId> {
        KvCache::fork(self, parent)
    }
    fn free(&mut self, s: SessionId) -> Result<()> {
        KvCache::free(self, s)
    }
    fn truncate(&mut self, s: SessionId, len: usize) -> Result<()> {
        KvCache::truncate(self, s, len)
    }
    fn len(&self, s: SessionId) -> Result<usize> {
        KvCache::len(self, s)
    }
    fn reserve(&mut self, batch: &[(SessionId, usize)]) -> Result<AppendBatch> {
        KvCache::reserve(self, batch)
    }
    fn append(&mut self, b: &AppendBatch, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        KvCache::append_host(self, b, layer, k, v)
    }
    fn attend(
        &mut self,
        b: &AppendBatch,
        layer: usize,
        m: AttendMethod,
        p: &SelectParams,
        q: &[f32],
    ) -> Result<Vec<f32>> {
        KvCache::attend_host(self, b, layer, m, p, q)
    }
    fn export(&self, s: SessionId, layer: usize) -> Result<PagedExport> {
        KvCache::export(self, s, layer)
    }
    fn export_pca(&self, s: SessionId, layer: usize) -> Result<PagedExport> {
        KvCache::export_pca(self, s, layer)
    }
    fn faults(&self) -> Result<Vec<u32>> {
        KvCache::faults(self)
    }
    // The two read-backs of the cache's tests and debugging.
    fn readback(&self, b: &AppendBatch, i: usize) -> Result<AttendDebug> {
        KvCache::debug_readback(self, b, i)
    }
    fn records(&self, s: SessionId, layer: usize) -> Result<Vec<bf16>> {
        KvCache::records(self, s, layer)
    }
}
