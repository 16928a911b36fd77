//! The paged cache on the GPU (docs/SPEC.md §6.1): per-layer page pools in pinned, mapped host
//! memory, page tables and launch descriptors in mapped memory, the keys of each session's
//! last partial block per layer in HBM (the tail), and the append kernels of
//! `kernels/append.cu`.
//!
//! Host-side bookkeeping ([`crate::pages::CacheSessions`]) is the single source of truth; the
//! device copies of a session's page table and descriptors are written by [`PagedCache::reserve`],
//! which first waits for the stream (the one host synchronisation per step: the previous
//! step's kernels may still read the tables it changes). [`PagedCache::append`] only
//! launches.

use std::sync::Arc;

use cudarc::driver::{result, CudaFunction, CudaStream, PushKernelArg};
use half::bf16;

use crate::cache::{check_rows, AppendBatch, CacheConfig, KvRows};
use crate::cuda::{cast_mut, cfg, compile_one, drv, DevBuf, HostBuf};
use crate::error::{CudaError, Result};
use crate::paged_layout::PagedLayout;
use crate::paged_ref::{export_pool, records_pool, PagedExport};
use crate::pages::{CacheSessions, PageCopy, SessionId, BLOCK_TOKENS};
use crate::Gpu;
use fathom_store::Dims;

/// The append kernels' source.
pub(crate) const APPEND_SRC: &str = include_str!("../kernels/append.cu");

/// `struct AppendDesc` of append.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct AppendDesc {
    slot: u32,
    n0: u32,
    m: u32,
    row0: u32,
}
const _: () = assert!(std::mem::size_of::<AppendDesc>() == 16);

/// `struct PoolGeom` of append.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PoolGeom {
    page_bytes: u64,
    scales_at: u64,
    records_at: u64,
    page_tokens: u32,
    max_pages: u32,
    heads: u32,
    layers: u32,
}
const _: () = assert!(std::mem::size_of::<PoolGeom>() == 40);

// SAFETY: plain `#[repr(C)]` data of integers, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for PoolGeom {}

struct AppendKernels {
    quant: CudaFunction,
    records: CudaFunction,
}

/// An offloaded, paged KV cache for one model shape on one GPU.
///
/// ```no_run
/// use fathom_cuda::cache::{CacheConfig, KvDtype, KvRows};
/// use fathom_cuda::pages::PageConfig;
/// use fathom_cuda::{Gpu, ModelShape, PagedCache};
/// let gpu = Gpu::open(0)?;
/// let cfg = CacheConfig {
///     shape: ModelShape { layers: 1, kv_heads: 2, group: 4, dim: 128 },
///     pages: PageConfig { page_tokens: 4096, pages: 64, max_sessions: 8, max_tokens: 32768 },
///     max_batch: 8,
/// };
/// let mut cache = PagedCache::new(&gpu, cfg)?;
/// let (a, b) = (cache.create()?, cache.create()?);
/// let batch = cache.reserve(&[(a, 100), (b, 300)])?; // a prefill of two lengths
/// # let (k, v) = (0u64, 0u64);
/// cache.append(&batch, 0, &KvRows { k, v, dtype: KvDtype::Bf16, rows: batch.rows })?;
/// # Ok::<(), fathom_cuda::CudaError>(())
/// ```
pub struct PagedCache {
    cfg: CacheConfig,
    layout: PagedLayout,
    sessions: CacheSessions,
    stream: Arc<CudaStream>,
    kernels: AppendKernels,
    pools: Vec<HostBuf>,
    /// Page tables, `u32 [max_sessions][max_pages]` (mapped).
    tables: HostBuf,
    /// Append descriptors of the current batch, `[max_batch]` (mapped).
    descs: HostBuf,
    /// Faults per layer, `u32 [L]` (mapped).
    faults: HostBuf,
    /// Tails, `bf16 [max_sessions][L][Hkv][64][D]` (HBM).
    tails: DevBuf,
    max_pages: usize,
    step: u64,
    batch_len: usize,
    batch_max_m: usize,
    batch_max_blocks: usize,
    /// Device staging of [`PagedCache::append_host`] and its capacity in bytes.
    staging: Option<(DevBuf, usize)>,
    // Keeps the module alive.
    _module: Arc<cudarc::driver::CudaModule>,
}

impl std::fmt::Debug for PagedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedCache")
            .field("cfg", &self.cfg)
            .field("live_sessions", &self.sessions.live_sessions())
            .finish_non_exhaustive()
    }
}

fn tail_elems(cfg: &CacheConfig) -> usize {
    let s = cfg.shape;
    s.layers * s.kv_heads * BLOCK_TOKENS * s.dim
}

impl PagedCache {
    /// Allocates the pools (pinned, mapped host memory: `L ×`
    /// [`PagedLayout::pool_bytes`]), the page tables and the tails, and compiles the append
    /// kernels.
    ///
    /// # Errors
    /// A configuration [`CacheConfig::validate`] refuses; a failed allocation (typed, with its
    /// size); an NVRTC or driver failure.
    pub fn new(gpu: &Gpu, cfg: CacheConfig) -> Result<Self> {
        let cfg = cfg.validate()?;
        let s = cfg.shape;
        let dims = Dims {
            heads: s.kv_heads,
            channels: s.dim,
        };
        let layout = PagedLayout::new(dims, cfg.pages.page_tokens, cfg.pages.pages)?;
        let sessions = CacheSessions::new(cfg.pages)?;
        let max_pages = cfg.pages.pages_for(cfg.pages.max_tokens);
        let ptx = compile_one(
            gpu.arch(),
            "append.cu",
            APPEND_SRC,
            vec![format!("-DDIM={}", s.dim)],
        )?;
        let module = gpu.ctx().load_module(ptx).map_err(drv("load_module"))?;
        let f = |n: &str| module.load_function(n).map_err(drv("load_function"));
        let kernels = AppendKernels {
            quant: f("append_quant")?,
            records: f("append_records")?,
        };
        let pool_bytes = usize::try_from(layout.pool_bytes()).map_err(|_| {
            CudaError::invalid("pages", "pool larger than the address space".to_string())
        })?;
        let pools = (0..s.layers)
            .map(|_| HostBuf::new(pool_bytes, "page pool"))
            .collect::<Result<Vec<_>>>()?;
        let mut tables = HostBuf::new(cfg.pages.max_sessions * max_pages * 4, "page tables")?;
        tables.as_mut_bytes().fill(0);
        let descs = HostBuf::new(cfg.max_batch * 16, "append descriptors")?;
        let mut faults = HostBuf::new(s.layers * 4, "fault counters")?;
        faults.as_mut_bytes().fill(0);
        let tails = DevBuf::zeroed(cfg.pages.max_sessions * tail_elems(&cfg) * 2, "tails")?;
        Ok(PagedCache {
            cfg,
            layout,
            sessions,
            stream: gpu.stream().clone(),
            kernels,
            pools,
            tables,
            descs,
            faults,
            tails,
            max_pages,
            step: 0,
            batch_len: 0,
            batch_max_m: 0,
            batch_max_blocks: 0,
            staging: None,
            _module: module,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// The byte layout of each layer's pool.
    pub fn layout(&self) -> &PagedLayout {
        &self.layout
    }

    /// The host-side page tables and sessions.
    pub fn sessions(&self) -> &CacheSessions {
        &self.sessions
    }

    /// The stream appends run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("stream synchronize"))
    }

    /// A new, empty session.
    pub fn create(&mut self) -> Result<SessionId> {
        Ok(self.sessions.create()?)
    }

    /// Tokens in `session`.
    pub fn len(&self, session: SessionId) -> Result<usize> {
        Ok(self.sessions.len(session)?)
    }

    /// Whether `session` holds no token.
    pub fn is_empty(&self, session: SessionId) -> Result<bool> {
        Ok(self.sessions.is_empty(session)?)
    }

    /// A session that shares every page of `parent` (docs/SPEC.md §6.1: full pages read-only,
    /// the partial last page copied by whichever side appends to it first) and a copy of its
    /// partial block's keys. Appends to either never change what the other reads.
    pub fn fork(&mut self, parent: SessionId) -> Result<SessionId> {
        self.sync()?;
        let child = self.sessions.fork(parent)?;
        self.write_table(child)?;
        let bytes = tail_elems(&self.cfg) * 2;
        let src = self.tails.ptr + (parent.slot() * bytes) as u64;
        let dst = self.tails.ptr + (child.slot() * bytes) as u64;
        // SAFETY: both ranges lie inside the tails buffer (slots < max_sessions) and differ.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(drv("memcpy_dtod tails"))?;
        Ok(child)
    }

    /// Frees `session`; pages it shared stay with the other sessions.
    pub fn free(&mut self, session: SessionId) -> Result<()> {
        self.sync()?;
        Ok(self.sessions.free(session)?)
    }

    fn write_table(&mut self, session: SessionId) -> Result<()> {
        let table: Vec<u32> = self
            .sessions
            .page_table(session)?
            .iter()
            .map(|p| p.0)
            .collect();
        let row = session.slot() * self.max_pages;
        let t: &mut [u32] = cast_mut(self.tables.as_mut_bytes());
        t[row..row + table.len()].copy_from_slice(&table);
        Ok(())
    }

    /// Grows every session of `batch = [(session, new_tokens)]` (all or nothing, each session
    /// at most once, at most `max_batch` sessions), performs the copy-on-write of shared
    /// partial pages in every layer's pool, and writes the device's tables and descriptors.
    /// Waits for the stream first. The returned batch is valid for this step's
    /// [`PagedCache::append`] calls, one per layer, until the next `reserve`.
    pub fn reserve(&mut self, batch: &[(SessionId, usize)]) -> Result<AppendBatch> {
        if batch.is_empty() || batch.len() > self.cfg.max_batch {
            return Err(CudaError::invalid(
                "batch",
                format!(
                    "{} sessions (want 1..={}, the cache's max_batch)",
                    batch.len(),
                    self.cfg.max_batch
                ),
            ));
        }
        if let Some(&(s, m)) = batch.iter().find(|(_, m)| *m > u32::MAX as usize / 2) {
            return Err(CudaError::invalid(
                "batch",
                format!("{m} new tokens for {s}"),
            ));
        }
        self.sync()?;
        let plans = self.sessions.reserve_many(batch)?;
        // Checks are done; the rest writes host memory the GPU is not reading (synchronised).
        for p in &plans {
            if let Some(c) = p.copy {
                self.copy_page(c)?;
            }
            self.write_table(p.session)?;
        }
        self.step += 1;
        let out = AppendBatch::new(plans, self.step);
        let d: &mut [AppendDesc] = cast_mut(self.descs.as_mut_bytes());
        for (i, p) in out.plans.iter().enumerate() {
            d[i] = AppendDesc {
                slot: p.session.slot() as u32,
                n0: p.first_token as u32,
                m: p.tokens as u32,
                row0: out.row0[i] as u32,
            };
        }
        self.batch_len = out.plans.len();
        self.batch_max_m = out.plans.iter().map(|p| p.tokens).max().unwrap_or(0);
        self.batch_max_blocks = out
            .plans
            .iter()
            .map(|p| p.end_token().div_ceil(BLOCK_TOKENS) - p.first_token / BLOCK_TOKENS)
            .max()
            .unwrap_or(0);
        Ok(out)
    }

    /// Copies the valid part of a shared partial page into its fresh replacement, in every
    /// layer's pool: the plane and scale sections whole, the first `tokens` records of each
    /// head.
    fn copy_page(&mut self, c: PageCopy) -> Result<()> {
        let lay = self.layout;
        let (src, dst) = (
            lay.page_offset(c.src)? as usize,
            lay.page_offset(c.dst)? as usize,
        );
        let head_bytes = lay.records_at() as usize;
        let rec = lay.record_bytes() as usize;
        let p = lay.page_tokens();
        for pool in &mut self.pools {
            let b = pool.as_mut_bytes();
            b.copy_within(src..src + head_bytes, dst);
            for h in 0..self.cfg.shape.kv_heads {
                let off = head_bytes + h * p * rec;
                b.copy_within(src + off..src + off + c.tokens * rec, dst + off);
            }
        }
        Ok(())
    }

    /// Appends one layer's K and V rows (device memory, `[rows][Hkv][D]`, batch order) to the
    /// sessions of `batch`, on the cache's stream, with no host synchronisation: the records
    /// of the new tokens, and every 64-token block they touch re-quantized.
    ///
    /// # Errors
    /// Checked before the launch ([`check_rows`]): a layer out of range, a stale batch, a
    /// row count that differs from the batch's, a null pointer.
    pub fn append(&mut self, batch: &AppendBatch, layer: usize, kv: &KvRows) -> Result<()> {
        check_rows(&self.cfg, batch, self.step, layer, kv)?;
        let s = self.cfg.shape;
        let lay = self.layout;
        let geom = PoolGeom {
            page_bytes: lay.page_bytes(),
            scales_at: lay.scales_at(),
            records_at: lay.records_at(),
            page_tokens: lay.page_tokens() as u32,
            max_pages: self.max_pages as u32,
            heads: s.kv_heads as u32,
            layers: s.layers as u32,
        };
        let (descs, tables, pool) = (self.descs.dptr, self.tables.dptr, self.pools[layer].dptr);
        let (tails, faults) = (self.tails.ptr, self.faults.dptr);
        let dtype = kv.dtype.code();
        let layer_u = layer as u32;
        let nb = self.batch_len as u32;
        let mut b = self.stream.launch_builder(&self.kernels.quant);
        b.arg(&descs)
            .arg(&tables)
            .arg(&pool)
            .arg(&geom)
            .arg(&tails)
            .arg(&kv.k)
            .arg(&dtype)
            .arg(&layer_u)
            .arg(&faults);
        let grid = (nb, s.kv_heads as u32, self.batch_max_blocks as u32);
        // SAFETY: descriptors, tables, pool, tails and faults are allocated at the sizes the
        // kernel indexes (batch ≤ max_batch, slots < max_sessions, pages < pool pages, layer <
        // L); `kv` holds `batch.rows` rows of [Hkv][D] (checked count; the caller owns the
        // pointers' validity).
        unsafe { b.launch(cfg(grid, s.dim as u32)) }.map_err(drv("launch append_quant"))?;
        let mut b = self.stream.launch_builder(&self.kernels.records);
        b.arg(&descs)
            .arg(&tables)
            .arg(&pool)
            .arg(&geom)
            .arg(&tails)
            .arg(&kv.k)
            .arg(&kv.v)
            .arg(&dtype)
            .arg(&layer_u);
        let grid = (nb, s.kv_heads as u32, self.batch_max_m as u32);
        // SAFETY: as above.
        unsafe { b.launch(cfg(grid, s.dim as u32)) }.map_err(drv("launch append_records"))?;
        Ok(())
    }

    /// [`PagedCache::append`] from host slices `[rows][Hkv][D]` f32 (a convenience for CPU
    /// callers and tests: the rows are checked, copied to a device staging buffer, then
    /// appended; the copy waits for the stream).
    ///
    /// # Errors
    /// As [`PagedCache::append`], and, before any copy, slices of the wrong length or a key
    /// or value that is not finite (named by token, head and channel).
    pub fn append_host(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        crate::cache::check_host_rows(&self.cfg, batch, k, v)?;
        let bytes = k.len() * 4;
        if self
            .staging
            .as_ref()
            .is_none_or(|(_, cap)| *cap < 2 * bytes)
        {
            self.staging = Some((DevBuf::new(2 * bytes, "append staging")?, 2 * bytes));
        }
        let base = self.staging.as_ref().map_or(0, |(b, _)| b.ptr);
        self.sync()?;
        // SAFETY: the staging buffer holds 2·bytes; the copies are synchronous.
        unsafe {
            result::memcpy_htod_sync(base, k).map_err(drv("memcpy_htod keys"))?;
            result::memcpy_htod_sync(base + bytes as u64, v).map_err(drv("memcpy_htod values"))?;
        }
        let kv = KvRows {
            k: base,
            v: base + bytes as u64,
            dtype: crate::cache::KvDtype::F32,
            rows: batch.rows,
        };
        self.append(batch, layer, &kv)
    }

    /// Waits for the stream, then the faults counted per layer since the cache was made
    /// (a channel block whose keys were not finite or whose maximum overflowed fp16 was not
    /// written).
    pub fn faults(&self) -> Result<Vec<u32>> {
        self.sync()?;
        let f: &[u8] = self.faults.as_bytes();
        Ok(f.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Waits for the stream, then one layer's store of `session` in `fathom-store`'s layout
    /// (what the tests compare with `KeyStore` bit for bit).
    pub fn export(&self, session: SessionId, layer: usize) -> Result<PagedExport> {
        self.sync()?;
        let pool = self.pools.get(layer).ok_or_else(|| {
            CudaError::invalid("layer", format!("{layer} of {}", self.pools.len()))
        })?;
        let n = self.sessions.len(session)?;
        export_pool(
            &self.layout,
            pool.as_bytes(),
            self.sessions.page_table(session)?,
            n,
        )
    }

    /// Waits for the stream, then one layer's K|V records of `session`,
    /// `[head][token][K | V]` bf16.
    pub fn records(&self, session: SessionId, layer: usize) -> Result<Vec<bf16>> {
        self.sync()?;
        let pool = self.pools.get(layer).ok_or_else(|| {
            CudaError::invalid("layer", format!("{layer} of {}", self.pools.len()))
        })?;
        let n = self.sessions.len(session)?;
        records_pool(
            &self.layout,
            pool.as_bytes(),
            self.sessions.page_table(session)?,
            n,
        )
    }
}
