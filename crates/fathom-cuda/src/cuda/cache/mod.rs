//! The paged cache on the GPU (docs/SPEC.md §6.1): per-layer page pools in pinned, mapped host
//! memory, page tables and launch descriptors in mapped memory, the keys of each session's
//! last partial block per layer in HBM (the tail), and the append kernels of
//! `kernels/append.cu`.
//!
//! Host-side bookkeeping ([`crate::pages::CacheSessions`]) is the single source of truth; the
//! device copies of a session's page table and descriptors are written by [`crate::api::KvCache::reserve`],
//! which first waits for the stream (the one host synchronisation per step: the previous
//! step's kernels may still read the tables it changes). [`crate::api::KvCache::append`] only
//! launches.
//!
//! The folder follows the pipeline: [`params`] (the kernels' `#[repr(C)]` parameters and launch
//! constants), `pool` (the page pools and their geometry), `sessions` (create, fork, free,
//! truncate, reserve), `append` (K/V rows in), `rows` (K|V records and stores out), `calib`
//! (calibrations and static plans), `attend` (plan, scan, select, fetch, attention), `host_gather`,
//! `graph` (capture and replay) and `stats` (counters and stage times).

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaEvent, CudaFunction, CudaStream, PushKernelArg};
use half::bf16;

use crate::cache::{
    check_rows, AppendBatch, AttendDebug, AttendStage, AttendStages, CacheConfig, KvRows,
    RowCounters, SelectCounters, MAX_STAGE_MARKS,
};
use crate::config::Residency;
use crate::cuda::{
    attend_defines, cast_mut, cfg, compile_one, drv, stream_upload, DevBuf, HostBuf, Mem,
};
use crate::error::{CudaError, Result};
use crate::memory::{DeviceView, DeviceViewMut};
use crate::paged_layout::PagedLayout;
use crate::paged_ref::{export_pool, records_pool, PagedExport};
use crate::pages::{CacheSessions, PageCopy, SessionId, BLOCK_TOKENS};
use crate::Gpu;
use fathom_store::Dims;

mod api;
mod append;
mod attend;
mod calib;
mod graph;
mod host_gather;
mod params;
mod pool;
mod rows;
mod sessions;
mod stats;

use attend::Work;
use calib::Calib;
pub use graph::DecodeGraph;
use host_gather::GatherState;
use params::*;
pub(crate) use params::{APPEND_SRC, ATTEND_SRC};
use pool::Pools;

struct AttendKernels {
    queries: CudaFunction,
    scan: CudaFunction,
    scan_v2: CudaFunction,
    topk_select: CudaFunction,
    topk_collect: CudaFunction,
    topk_finish: CudaFunction,
    topk_fused: CudaFunction,
    union: CudaFunction,
    select_out: CudaFunction,
    fetch: CudaFunction,
    gather_list: CudaFunction,
    gather_publish: CudaFunction,
    gather_copy: CudaFunction,
    attn_partial: CudaFunction,
    attn_combine: CudaFunction,
    rotate_queries: CudaFunction,
    table_scan: CudaFunction,
    fathom_plan: CudaFunction,
    sparq_plan: CudaFunction,
}

struct AppendKernels {
    quant: CudaFunction,
    records: CudaFunction,
    read_rows: CudaFunction,
}

/// The next [`PagedCache`]'s id.
static NEXT_CACHE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// An offloaded, paged KV cache for one model shape on one GPU: the CUDA backend of
/// [`crate::api::KvCache`], whose methods it implements (bring them into scope with
/// `use fathom_cuda::prelude::*`; the crate docs open with a whole decode).
///
/// ```no_run
/// use fathom_cuda::cache::{CacheConfig, KvRows};
/// use fathom_cuda::memory::DeviceBuffer;
/// use fathom_cuda::pages::PageConfig;
/// use fathom_cuda::prelude::*;
/// use fathom_cuda::{Gpu, ModelShape, PagedCache};
/// let gpu = Gpu::open(0)?;
/// let cfg = CacheConfig {
///     shape: ModelShape { layers: 1, kv_heads: 2, group: 4, dim: 128 },
///     pages: PageConfig { page_tokens: 4096, pages: 64, max_sessions: 8, max_tokens: 32768 },
///     max_batch: 8,
///     max_k: 512,
///     row_cache: 0,
///     residency: fathom_cuda::Residency::Host,
///     pca_index: false,
///     block_tables: false,
///     host_pages: fathom_cuda::HostPages::Driver,
///     options: Default::default(),
/// };
/// let mut cache = PagedCache::new(&gpu, cfg)?;
/// let (a, b) = (cache.create()?, cache.create()?);
/// let batch = cache.reserve(&[(a, 100), (b, 300)])?; // a prefill of two lengths
/// // K and V of the 400 new rows, [400][Hkv][D] bf16 each, in device memory (a model's
/// // projections; zeros here):
/// let k = DeviceBuffer::<half::bf16>::zeros(&gpu, 400 * 2 * 128)?;
/// let v = DeviceBuffer::<half::bf16>::zeros(&gpu, 400 * 2 * 128)?;
/// cache.append(&batch, 0, &KvRows { k: k.view(), v: v.view(), rows: batch.rows })?;
/// # Ok::<(), fathom_cuda::CudaError>(())
/// ```
pub struct PagedCache {
    cfg: CacheConfig,
    layout: PagedLayout,
    sessions: CacheSessions,
    stream: Arc<CudaStream>,
    kernels: AppendKernels,
    /// One pool per layer: pinned, mapped host memory, or HBM ([`CacheConfig::residency`]).
    /// In the split residency it holds only each page's key section (planes and scales; the
    /// page stride is [`PagedLayout::records_at`]) in HBM, and `rec_pools` the record sections.
    pools: Vec<Mem>,
    /// The split residency's K|V records, one pinned, mapped host pool per layer (stride
    /// `page_bytes − records_at`); empty otherwise.
    rec_pools: Vec<Mem>,
    /// The PCA index ([`CacheConfig::pca_index`]), one pool per layer of each page's planes and
    /// scales (stride `split_page_bytes().0`), in HBM except in host residency; empty without.
    pca_pools: Vec<Mem>,
    /// The block tables ([`CacheConfig::block_tables`]): per layer a landmark and a Quest pool
    /// of [`CacheConfig::table_page_bytes`] per page, where the index lives; empty without.
    landmark_pools: Vec<Mem>,
    quest_pools: Vec<Mem>,
    /// Page tables, `u32 [max_sessions][max_pages]`, and the append descriptors of the
    /// current batch, `[max_batch]`: written on the host (pinned), copied to HBM on the
    /// stream by every [`crate::api::KvCache::reserve`] (which waits for the stream first, so a copy
    /// never reads a buffer being rewritten). The kernels read the HBM copies: every kernel
    /// reads its session's descriptor first and the fetch a table entry per row, and a read
    /// across the link would put a PCIe round trip before each.
    tables: HostBuf,
    descs: HostBuf,
    tables_dev: DevBuf,
    descs_dev: DevBuf,
    /// Faults per layer, `u32 [L]` (mapped).
    faults: HostBuf,
    /// Tails, `bf16 [max_sessions][L][Hkv][64][D]` (HBM).
    tails: DevBuf,
    max_pages: usize,
    /// [`PoolGeom`]'s 32-bit fields, checked once ([`Geom32::new`]).
    geom32: Geom32,
    step: u64,
    batch_len: usize,
    batch_max_m: usize,
    batch_max_blocks: usize,
    /// Device staging of [`crate::api::KvCache::append_host`] and its capacity in bytes.
    staging: Option<(DevBuf, usize)>,
    attend_kernels: AttendKernels,
    work: Work,
    calib: Calib,
    /// Plans counted into `work.bits_acc` (host side: launches × heads).
    plans_counted: u64,
    /// While capturing a graph: grids sized for the largest context, decode batches only.
    fixed_grids: bool,
    /// While capturing: the plans counted before the capture began, the batch's sessions and
    /// the settings counter when it began (a change before its end makes the capture stale).
    capturing: Option<(u64, Vec<SessionId>, u64)>,
    /// Whether the capture under way is the caller's own ([`crate::api::KvCache::begin_caller_capture`]):
    /// the cache's stream joins it through `follow`, and holds no graph of its own.
    caller_capture: bool,
    /// The current batch and which layers its step has appended
    /// ([`crate::cache::StepLedger`]: the rule, unit-tested on the CPU).
    ledger: crate::cache::StepLedger,
    /// This cache among the process's (a graph replays only on the cache that captured it).
    id: u64,
    /// How attends select ([`crate::cache::CacheOptions::select`]).
    select: crate::cache::SelectPath,
    /// Head groups per attend ([`crate::cache::CacheOptions::attend_groups`]), the second stream that
    /// runs each group's top-k to attention while the cache's stream scans the next group,
    /// and the events that order the two.
    groups: usize,
    /// Plane words per scan load ([`crate::cache::CacheOptions::scan_vector_words`]).
    scan_vec: u32,
    side: Arc<CudaStream>,
    /// The host gather ([`crate::cache::CacheOptions::host_gather_threads`]); `None`: the GPU reads every miss.
    gather: Option<GatherState>,
    /// Percent of the misses the host gather brings ([`crate::cache::CacheOptions::host_gather_share`]).
    gather_share: u32,
    /// Bumped by every change a captured step would read stale (a calibration, a static
    /// method's depths; the options are fixed at construction): a graph of an older value is
    /// stale.
    settings: u64,
    scanned: cudarc::driver::CudaEvent,
    joined: cudarc::driver::CudaEvent,
    /// Recorded after each upload of the host page tables and descriptors: the next reserve
    /// rewrites those pinned buffers once it has passed (not the whole stream).
    uploaded: cudarc::driver::CudaEvent,
    /// The host gather's fork and join: `paged_gather_copy` runs on the second stream after
    /// the request is published, at once with the fetch of the GPU's own share.
    published: cudarc::driver::CudaEvent,
    copied: cudarc::driver::CudaEvent,
    /// Stage timing ([`crate::cache::CacheOptions::stage_timing`]): whether it is on, the marks recorded
    /// since the last [`crate::api::KvCache::stage_times`], and the attends it could not split.
    stage_timing: bool,
    stage_marks: Vec<(AttendStage, CudaEvent)>,
    stage_untimed: u64,
    // Keep the modules alive.
    _modules: [Arc<cudarc::driver::CudaModule>; 3],
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
    /// [`crate::api::KvCache::new`].
    pub(crate) fn new(gpu: &Gpu, cfg: CacheConfig) -> Result<Self> {
        let cfg = cfg.validate()?;
        let s = cfg.shape;
        let dims = Dims {
            heads: s.kv_heads,
            channels: s.dim,
        };
        let layout = PagedLayout::new(dims, cfg.pages.page_tokens, cfg.pages.pages)?;
        let max_pages = cfg.pages.pages_for(cfg.pages.max_tokens);
        let geom32 = Geom32::new(&layout, max_pages, s)?;
        let sessions = CacheSessions::new(cfg.pages)?;
        let (kernels, attend_kernels, modules) = load_kernels(gpu, s)?;
        let work = Work::new(&cfg)?;
        let calib = Calib {
            sigma2: (0..s.layers).map(|_| None).collect(),
            ds_channels: vec![None; s.layers],
            statics: std::collections::HashMap::new(),
            pca: (0..s.layers).map(|_| None).collect(),
            appended: vec![false; s.layers],
        };
        let Pools {
            pools,
            rec_pools,
            pca_pools,
            landmark_pools,
            quest_pools,
        } = Pools::new(&cfg, &layout)?;
        let mut tables = HostBuf::new(cfg.pages.max_sessions * max_pages * 4, "page tables")?;
        tables.as_mut_bytes().fill(0);
        let descs = HostBuf::new(cfg.max_batch * 16, "append descriptors")?;
        let tables_dev = DevBuf::zeroed(tables.bytes, "page tables (HBM)")?;
        let descs_dev = DevBuf::zeroed(descs.bytes, "append descriptors (HBM)")?;
        let mut faults = HostBuf::new(s.layers * 4, "fault counters")?;
        faults.as_mut_bytes().fill(0);
        let tails = DevBuf::zeroed(cfg.pages.max_sessions * tail_elems(&cfg) * 2, "tails")?;
        let mut cache = PagedCache {
            cfg,
            layout,
            sessions,
            stream: gpu.stream().clone(),
            kernels,
            pools,
            rec_pools,
            pca_pools,
            landmark_pools,
            quest_pools,
            tables,
            descs,
            tables_dev,
            descs_dev,
            faults,
            tails,
            max_pages,
            geom32,
            step: 0,
            batch_len: 0,
            batch_max_m: 0,
            batch_max_blocks: 0,
            staging: None,
            attend_kernels,
            work,
            calib,
            plans_counted: 0,
            fixed_grids: false,
            capturing: None,
            caller_capture: false,
            ledger: crate::cache::StepLedger::new(s.layers),
            id: NEXT_CACHE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            select: cfg.options.select,
            groups: cfg.options.attend_groups,
            scan_vec: cfg.options.scan_vector_words,
            gather: None,
            gather_share: cfg.options.host_gather_share,
            settings: 0,
            side: gpu
                .stream()
                .fork()
                .map_err(drv("create the second stream"))?,
            scanned: gpu.ctx().new_event(None).map_err(drv("create event"))?,
            joined: gpu.ctx().new_event(None).map_err(drv("create event"))?,
            uploaded: gpu.ctx().new_event(None).map_err(drv("create event"))?,
            published: gpu.ctx().new_event(None).map_err(drv("create event"))?,
            copied: gpu.ctx().new_event(None).map_err(drv("create event"))?,
            stage_timing: cfg.options.stage_timing,
            stage_marks: Vec::new(),
            stage_untimed: 0,
            _modules: modules,
        };
        let threads = cfg.options.host_gather_threads;
        if threads > 0 {
            cache.start_host_gather(threads)?;
        }
        Ok(cache)
    }

    /// [`crate::api::KvCache::config`].
    pub(crate) fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// [`crate::api::KvCache::layout`].
    pub(crate) fn layout(&self) -> &PagedLayout {
        &self.layout
    }

    /// [`crate::api::KvCache::sessions`].
    pub(crate) fn sessions(&self) -> &CacheSessions {
        &self.sessions
    }

    /// The stream appends run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Refuses `what` while a capture is under way: a setting or a session made then would be
    /// recorded into the graph instead of applied (or would free buffers the graph reads).
    pub(super) fn not_capturing(&self, what: &str) -> Result<()> {
        if self.capturing.is_some() {
            return Err(CudaError::invalid(
                "capture",
                format!(
                    "{what} during a capture: call it before begin_capture or after end_capture"
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn sync(&self) -> Result<()> {
        // A wait for a stream being captured would end the capture with a driver error: a
        // call that waits (reserve, fork, free, the readbacks) is refused by name instead.
        if self.capturing.is_some() {
            return Err(CudaError::invalid(
                "capture",
                "a capture is under way: nothing may wait for the stream until end_capture",
            ));
        }
        self.stream.synchronize().map_err(drv("stream synchronize"))
    }
}

/// Compiles (NVRTC, cached per shape) and loads the append, attend and plan kernels of a
/// model shape.
fn load_kernels(
    gpu: &Gpu,
    s: crate::config::ModelShape,
) -> Result<(
    AppendKernels,
    AttendKernels,
    [Arc<cudarc::driver::CudaModule>; 3],
)> {
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
        read_rows: f("read_rows")?,
    };
    let gd = vec![format!("-DGQ={}", s.group), format!("-DDIM={}", s.dim)];
    let ad = attend_defines(s.group, s.dim);
    let attend_mod = gpu
        .ctx()
        .load_module(compile_one(gpu.arch(), "attend.cu", ATTEND_SRC, ad)?)
        .map_err(drv("load_module"))?;
    let plan_mod = gpu
        .ctx()
        .load_module(compile_one(gpu.arch(), "plan.cu", PLAN_SRC, gd)?)
        .map_err(drv("load_module"))?;
    let fa = |n: &str| attend_mod.load_function(n).map_err(drv("load_function"));
    let fp = |n: &str| plan_mod.load_function(n).map_err(drv("load_function"));
    let attend_kernels = AttendKernels {
        queries: fa("attend_queries")?,
        scan: fa("paged_scan")?,
        scan_v2: fa("paged_scan_v2")?,
        topk_select: fa("paged_topk_select")?,
        topk_collect: fa("paged_topk_collect")?,
        topk_finish: fa("paged_topk_finish")?,
        topk_fused: fa("paged_topk_fused")?,
        union: fa("paged_union")?,
        select_out: fa("paged_select_out")?,
        fetch: fa("paged_fetch")?,
        gather_list: fa("paged_gather_list")?,
        gather_publish: fa("paged_gather_publish")?,
        gather_copy: fa("paged_gather_copy")?,
        attn_partial: fa("paged_attn_partial")?,
        attn_combine: fa("paged_attn_combine")?,
        rotate_queries: fa("attend_rotate_queries")?,
        table_scan: fa("paged_table_scan")?,
        fathom_plan: fp("fathom_plan")?,
        sparq_plan: fp("sparq_plan")?,
    };
    Ok((kernels, attend_kernels, [module, attend_mod, plan_mod]))
}
