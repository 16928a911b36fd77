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
use crate::paged_layout::PagedLayout;
use crate::paged_ref::{export_pool, records_pool, PagedExport};
use crate::pages::{CacheSessions, PageCopy, SessionId, BLOCK_TOKENS};
use crate::Gpu;
use fathom_store::Dims;

/// The append kernels' source.
pub(crate) const APPEND_SRC: &str = include_str!("../kernels/append.cu");
/// The attend kernels' source.
pub(crate) const ATTEND_SRC: &str = include_str!("../kernels/attend.cu");
const PLAN_SRC: &str = include_str!("../kernels/plan.cu");
/// Threads of the per-row top-k kernels and the union (`TK` in attend.cu).
const TOPK_THREADS: u32 = 1024;
/// Blocks per scan CTA (`BPC` in attend.cu): 8 threads per 64-token block.
const SCAN_BLOCKS: usize = 32;
/// Level-1 bins of the top-k histogram (`HBINS` in attend.cu).
const HIST_BINS: usize = 1024;
/// Middle tokens per CTA of `paged_topk_collect` (`ELEMS` in attend.cu).
const COLLECT_ELEMS: usize = 4096;
/// Threads per channel of `append_quant` (`QS` in append.cu).
const APPEND_QUARTERS: usize = 4;
/// Union rows per CTA of the fetch (`FR` in attend.cu).
const FETCH_ROWS: usize = 64;
/// CTAs of `paged_gather_copy`, each looping over chunks: one poller per CTA.
const GATHER_COPY_CTAS: usize = 128;
/// Threads of `paged_gather_list`'s CTAs, one union row each (kernels/attend.cu `GATHER_NT`).
const GATHER_LIST_THREADS: usize = 256;
/// Threads of the partial attention (`NT` in attend.cu); its splits span multiples of
/// `GRAN` rows.
const ATTN_THREADS: u32 = 128;
const ATTN_GRAN: usize = 16;
/// Splits of the partial attention over one (session, KV head): of the union (at most
/// [`SPARSE_SPLITS`]) or, when dense, of every token ([`DENSE_SPLITS`]). A union of ~1.3k
/// rows (k = 512, G = 4) then gives 42 CTAs per KV head of 32 rows each.
const SPARSE_SPLITS: usize = 64;
const DENSE_SPLITS: usize = 256;
// `paged_attn_combine` stages at most COMBINE_MAX = 256 splits (attend.cu).
const _: () = assert!(SPARSE_SPLITS <= DENSE_SPLITS && DENSE_SPLITS <= 256);
/// Rows per CTA of `read_rows` (`READ_ROWS` of append.cu).
const READ_ROWS: usize = 8;
/// Filtered-select candidates per row, per winner of `max_k`: 4× the FUSE_TARGET · k = 6·k that
/// the estimate aims at (attend.cu), so a row overflows only when four times as many tokens
/// pass its filter as the previous attend predicted. Chosen with FUSE_TARGET on the
/// consecutive decode positions of a real capture (`results/filtered-select/README.md`: no
/// overflow at 24·k; 0.3 % at 16·k).
const FUSE_CAP_PER_K: usize = 24;

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
    run_bytes: u32,
    scale_pad: u32,
    /// Device address of page 0's K|V records: the pool's own record section, or the
    /// records pool of the split residency.
    recs: u64,
    rec_page_bytes: u64,
    page_tokens: u32,
    max_pages: u32,
    heads: u32,
    layers: u32,
}
const _: () = assert!(std::mem::size_of::<PoolGeom>() == 48);

/// [`PoolGeom`]'s 32-bit fields, converted once when the cache is made: each with a check
/// that names the field, before any allocation, so no `as u32` can wrap a page geometry into
/// silently wrong addresses. ([`CacheConfig::validate`] bounds the page's tokens by
/// [`crate::cache::MAX_PAGE_TOKENS`]; this is where every such bound is enforced at once.)
#[derive(Debug, Clone, Copy)]
struct Geom32 {
    run_bytes: u32,
    scale_pad: u32,
    page_tokens: u32,
    max_pages: u32,
    heads: u32,
    layers: u32,
}

impl Geom32 {
    fn new(lay: &PagedLayout, max_pages: usize, shape: crate::config::ModelShape) -> Result<Self> {
        let f = |what: &'static str, v: u64| {
            u32::try_from(v).map_err(|_| {
                CudaError::invalid(
                    what,
                    format!("{v} does not fit the kernels' 32-bit page geometry"),
                )
            })
        };
        Ok(Self {
            run_bytes: f("channel run bytes", lay.channel_run_bytes())?,
            scale_pad: f("scale section bytes", lay.scale_pad_bytes())?,
            page_tokens: f("page_tokens", lay.page_tokens() as u64)?,
            max_pages: f("pages per session", max_pages as u64)?,
            heads: f("kv_heads", shape.kv_heads as u64)?,
            layers: f("layers", shape.layers as u64)?,
        })
    }
}

// SAFETY: plain `#[repr(C)]` data of integers, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for PoolGeom {}

/// `struct TableGeom` of append.cu and attend.cu: the block tables' page stride and the
/// device addresses of page 0's landmark and Quest tables (0: none).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct TableGeom {
    page_bytes: u64,
    landmark: u64,
    quest: u64,
}
const _: () = assert!(std::mem::size_of::<TableGeom>() == 24);

// SAFETY: plain `#[repr(C)]` data of integers, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for TableGeom {}

/// Threads per CTA of `paged_table_scan` (`TS_NT` in attend.cu); its groups per CTA are
/// [`crate::cache::table_scan_groups`] (`-DTS_G`).
const TABLE_SCAN_THREADS: u32 = 128;

/// `struct AttendGeom` of attend.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct AttendGeom {
    sink: u32,
    local: u32,
    k: u32,
    max_k: u32,
    max_tokens: u64,
    depth_stride: u32,
    dense: u32,
    scale: f32,
    umax: u32,
    cache_rows: u32,
    layer: u32,
    nsplit: u32,
    fuse_min: u32,
    fcap: u32,
    keep_scores: u32,
    /// First KV head of the launch's head group ([`PagedCache::set_attend_groups`]).
    h0: u32,
    /// Percent of the fetch's misses the host gather brings ([`PagedCache::set_host_gather`],
    /// [`PagedCache::set_host_gather_share`]); 0: off.
    host_gather: u32,
}
const _: () = assert!(std::mem::size_of::<AttendGeom>() == 72);

// SAFETY: plain `#[repr(C)]` data of integers and one f32, passed by value.
unsafe impl cudarc::driver::DeviceRepr for AttendGeom {}

struct AttendKernels {
    queries: CudaFunction,
    scan: CudaFunction,
    scan_v2: CudaFunction,
    topk_select: CudaFunction,
    topk_collect: CudaFunction,
    topk_finish: CudaFunction,
    topk_fused: CudaFunction,
    union: CudaFunction,
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

/// Attend's working memory, sized once for `max_batch` sessions of `max_tokens` tokens and
/// `max_k` winners per query head.
struct Work {
    /// Queries as f32, `[max_batch][Hq][D]`.
    qf: DevBuf,
    /// The queries in the PCA index's basis, `[max_batch][Hq][D]` f32 (with the PCA index).
    qr: Option<DevBuf>,
    /// Planned depths, `[max_batch][Hkv][D]`.
    depths: DevBuf,
    /// Plan bits, `[max_batch][Hkv]` f32.
    bits: DevBuf,
    /// The plan kernels' run list (unused by the paged scan), `[max_batch][Hkv][2D]` × 16 B.
    runs: DevBuf,
    /// Sum of plan bits over every attend since the last reset (f32) and its count.
    bits_acc: DevBuf,
    /// Scores, `[max_batch][Hkv][G][max_tokens]` f32.
    scores: DevBuf,
    /// Winners, `[max_batch][Hq][max_k]` u32, and their counts `[max_batch][Hq]`.
    winners: DevBuf,
    counts: DevBuf,
    /// The top-k's level-1 histogram `[max_batch][Hq][HIST_BINS]` u32 (built by the scan),
    /// each row's boundary `[max_batch][Hq]` (8 bytes), its candidates (token indices in the
    /// boundary bucket) `[max_batch][Hq][max_tokens]` u32 and their counts.
    hist: DevBuf,
    sel: DevBuf,
    cand: DevBuf,
    ccount: DevBuf,
    /// The filtered select (attend.cu, `paged_topk_fused`): each row's estimate
    /// `[max_sessions][L][Hq]` f32 (0 bits: none), its mode `[max_batch][Hq]` u32 (0 score
    /// path, 1 filtered, 2 fallen back), its passing (key, token) pairs
    /// `[max_batch][Hq][fcap]` and their counts.
    est: DevBuf,
    mode: DevBuf,
    fcand: DevBuf,
    fcount: DevBuf,
    fcap: usize,
    /// Partial attention: max and sum `[max_batch][Hq][DENSE_SPLITS]` f32, weighted V
    /// `[max_batch][Hq][DENSE_SPLITS][D]` f32.
    pm: DevBuf,
    pl: DevBuf,
    pacc: DevBuf,
    /// Union rows, row-cache hits, filtered rows and fallbacks summed over every attend since
    /// the cache was made (u64).
    counters: DevBuf,
    /// The HBM row cache (`cache_rows` slots per (session, layer, KV head); absent at 0):
    /// tags u32 (token + 1, 0 empty), records `[4D]` bytes, and the bids of one attend u32
    /// (zero between attends).
    row_tags: Option<DevBuf>,
    row_data: Option<DevBuf>,
    row_claim: Option<DevBuf>,
    /// The union per (session, KV head): rows `[max_batch][Hkv][umax]` u32, the mask of the
    /// query heads that chose each `u8`, the count `u32`.
    urows: DevBuf,
    umask: DevBuf,
    ucount: DevBuf,
    /// The union's K|V records in HBM, `[max_batch][Hkv][umax][2D]` bf16.
    rows: DevBuf,
    umax: usize,
}

/// The host gather's threads and buffers ([`PagedCache::set_host_gather`]; host_gather.rs
/// and kernels/attend.cu give the protocol).
struct GatherState {
    /// Dropped first (after the stream has drained): the threads stop before the memory they
    /// read is freed.
    threads: crate::host_gather::HostGather,
    /// Pinned, mapped: the mailbox `[MAILBOX_WORDS]` u32, a done mark per chunk, the record
    /// offsets `[cap]` u64 and the staging `[cap][4D]` bytes.
    mailbox: HostBuf,
    done: HostBuf,
    list: HostBuf,
    staging: HostBuf,
    /// HBM: `[count, epoch, faults, timeouts]` u32 and each listed record's row `[cap]` u32.
    gstate: DevBuf,
    gdst: DevBuf,
    /// Records one attend may list: every union row of a full batch.
    cap: usize,
    stream: Arc<CudaStream>,
}

impl Drop for GatherState {
    fn drop(&mut self) {
        // No copy kernel may still wait for marks when the threads stop.
        let _ = self.stream.synchronize();
    }
}

/// Per-layer calibration the planners read.
struct Calib {
    /// σ² tiled for the batch, `[max_batch][Hkv][D]` f32, per layer (`None`: not loaded).
    sigma2: Vec<Option<DevBuf>>,
    /// Double Sparsity channels, best first, per layer and KV head.
    ds_channels: Vec<Option<Vec<Vec<u16>>>>,
    /// Static plans, `[L][Hkv][D]` depths, keyed by method label.
    statics: std::collections::HashMap<String, DevBuf>,
    /// The PCA index's basis per layer, `[Hkv][D][D]` f32 (`HeadCalib::loki`), on the host (to
    /// compare a reload with) and in HBM; `None`: not loaded (the layer's PCA index is not
    /// written, and `loki:R` refuses it).
    pca: Vec<Option<(Vec<f32>, DevBuf)>>,
    /// Whether the layer has had an append: its basis may not change after.
    appended: Vec<bool>,
}

struct AppendKernels {
    quant: CudaFunction,
    records: CudaFunction,
    read_rows: CudaFunction,
}

/// The next [`PagedCache`]'s id.
static NEXT_CACHE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

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
///     max_k: 512,
///     row_cache: 0,
///     residency: fathom_cuda::Residency::Host,
///     pca_index: false,
///     block_tables: false,
///     host_pages: fathom_cuda::HostPages::Driver,
/// };
/// let mut cache = PagedCache::new(&gpu, cfg)?;
/// let (a, b) = (cache.create()?, cache.create()?);
/// let batch = cache.reserve(&[(a, 100), (b, 300)])?; // a prefill of two lengths
/// // K and V of the 400 new rows, [400][Hkv][D] bf16 each, in device memory (a model's
/// // projections; here left to the caller):
/// # let (k, v): (u64, u64) = unimplemented!();
/// cache.append(&batch, 0, &KvRows { k, v, dtype: KvDtype::Bf16, rows: batch.rows })?;
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
    /// stream by every [`PagedCache::reserve`] (which waits for the stream first, so a copy
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
    /// Device staging of [`PagedCache::append_host`] and its capacity in bytes.
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
    /// The current batch and which layers its step has appended
    /// ([`crate::cache::StepLedger`]: the rule, unit-tested on the CPU).
    ledger: crate::cache::StepLedger,
    /// This cache among the process's (a graph replays only on the cache that captured it).
    id: u64,
    /// How attends select ([`PagedCache::set_select_path`]).
    select: crate::cache::SelectPath,
    /// Head groups per attend ([`PagedCache::set_attend_groups`]), the second stream that
    /// runs each group's top-k to attention while the cache's stream scans the next group,
    /// and the events that order the two.
    groups: usize,
    /// Plane words per scan load ([`PagedCache::set_scan_vector_words`]).
    scan_vec: u32,
    side: Arc<CudaStream>,
    /// The host gather ([`PagedCache::set_host_gather`]); `None`: the GPU reads every miss.
    gather: Option<GatherState>,
    /// Percent of the misses the host gather brings ([`PagedCache::set_host_gather_share`]).
    gather_share: u32,
    /// Bumped by every setting a captured step bakes in (select path, head groups, scan
    /// loads, host gather, a static method's depths): a graph of an older value is stale.
    settings: u64,
    scanned: cudarc::driver::CudaEvent,
    joined: cudarc::driver::CudaEvent,
    /// The host gather's fork and join: `paged_gather_copy` runs on the second stream after
    /// the request is published, at once with the fetch of the GPU's own share.
    published: cudarc::driver::CudaEvent,
    copied: cudarc::driver::CudaEvent,
    /// Stage timing ([`PagedCache::set_stage_timing`]): whether it is on, the marks recorded
    /// since the last [`PagedCache::stage_times`], and the attends it could not split.
    stage_timing: bool,
    stage_marks: Vec<(AttendStage, CudaEvent)>,
    stage_untimed: u64,
    // Keep the modules alive.
    _module: Arc<cudarc::driver::CudaModule>,
    _attend_modules: [Arc<cudarc::driver::CudaModule>; 2],
}

impl std::fmt::Debug for PagedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedCache")
            .field("cfg", &self.cfg)
            .field("live_sessions", &self.sessions.live_sessions())
            .finish_non_exhaustive()
    }
}

/// A zeroed row-cache array of `elem` bytes per slot for every (session, layer, KV head), or
/// none when the cache has no row cache.
fn row_cache_buf(cfg: &CacheConfig, elem: usize, what: &'static str) -> Result<Option<DevBuf>> {
    if cfg.row_cache == 0 {
        return Ok(None);
    }
    let s = cfg.shape;
    let slots = cfg.pages.max_sessions * s.layers * s.kv_heads * cfg.row_cache;
    Ok(Some(DevBuf::zeroed(slots * elem, what)?))
}

fn tail_elems(cfg: &CacheConfig) -> usize {
    let s = cfg.shape;
    s.layers * s.kv_heads * BLOCK_TOKENS * s.dim
}

impl PagedCache {
    /// Allocates the pools (`L ×` [`PagedLayout::pool_bytes`] of pinned, mapped host memory, or
    /// of HBM when [`CacheConfig::residency`] says so), the page tables and the tails, and
    /// compiles the kernels.
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
        let max_pages = cfg.pages.pages_for(cfg.pages.max_tokens);
        let geom32 = Geom32::new(&layout, max_pages, s)?;
        let sessions = CacheSessions::new(cfg.pages)?;
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
        let (mb, hkv, hq, d) = (cfg.max_batch, s.kv_heads, s.kv_heads * s.group, s.dim);
        let umax = crate::cache::MAX_SINK_LOCAL + s.group * cfg.max_k;
        let fcap = FUSE_CAP_PER_K * cfg.max_k;
        let work = Work {
            qf: DevBuf::new(mb * hq * d * 4, "attend queries")?,
            qr: if cfg.pca_index {
                Some(DevBuf::new(mb * hq * d * 4, "attend queries (PCA basis)")?)
            } else {
                None
            },
            depths: DevBuf::zeroed(mb * hkv * d, "attend depths")?,
            bits: DevBuf::zeroed(mb * hkv * 4, "attend bits")?,
            runs: DevBuf::new(mb * hkv * 2 * d * 16, "attend runs")?,
            bits_acc: DevBuf::zeroed(8, "attend bit counter")?,
            scores: DevBuf::new(mb * hq * cfg.pages.max_tokens * 4, "attend scores")?,
            winners: DevBuf::new(mb * hq * cfg.max_k * 4, "attend winners")?,
            counts: DevBuf::zeroed(mb * hq * 4, "attend winner counts")?,
            hist: DevBuf::zeroed(mb * hq * HIST_BINS * 4, "top-k histogram")?,
            sel: DevBuf::zeroed(mb * hq * 8, "top-k boundaries")?,
            cand: DevBuf::new(mb * hq * cfg.pages.max_tokens * 4, "top-k candidates")?,
            ccount: DevBuf::zeroed(mb * hq * 4, "top-k candidate counts")?,
            est: DevBuf::zeroed(
                cfg.pages.max_sessions * s.layers * hq * 4,
                "filtered-select estimates",
            )?,
            mode: DevBuf::zeroed(mb * hq * 4, "select modes")?,
            fcand: DevBuf::new(mb * hq * fcap * 8, "filtered candidates")?,
            fcount: DevBuf::zeroed(mb * hq * 4, "filtered candidate counts")?,
            fcap,
            pm: DevBuf::new(mb * hq * DENSE_SPLITS * 4, "attention partial max")?,
            pl: DevBuf::new(mb * hq * DENSE_SPLITS * 4, "attention partial sum")?,
            pacc: DevBuf::new(mb * hq * DENSE_SPLITS * d * 4, "attention partials")?,
            counters: DevBuf::zeroed(32, "attend counters")?,
            row_tags: row_cache_buf(&cfg, 4, "row-cache tags")?,
            row_data: row_cache_buf(&cfg, 4 * d, "row cache")?,
            row_claim: row_cache_buf(&cfg, 4, "row-cache bids")?,
            urows: DevBuf::new(mb * hkv * umax * 4, "attend union rows")?,
            umask: DevBuf::new(mb * hkv * umax, "attend union masks")?,
            ucount: DevBuf::zeroed(mb * hkv * 4, "attend union counts")?,
            rows: DevBuf::new(mb * hkv * umax * 4 * d, "attend union records")?,
            umax,
        };
        let calib = Calib {
            sigma2: (0..s.layers).map(|_| None).collect(),
            ds_channels: vec![None; s.layers],
            statics: std::collections::HashMap::new(),
            pca: (0..s.layers).map(|_| None).collect(),
            appended: vec![false; s.layers],
        };
        let pool_bytes = usize::try_from(layout.pool_bytes()).map_err(|_| {
            CudaError::invalid("pages", "pool larger than the address space".to_string())
        })?;
        let pages = layout.pages();
        let (index_page, record_page) = layout.split_page_bytes();
        let key_pool = pages * index_page as usize;
        let rec_pool = pages * record_page as usize;
        // The pools in host memory, on the pages the configuration names (the driver's pages
        // come zeroed from the OS; huge pages are anonymous memory, zero too).
        let host_pool = |bytes: usize, what: &'static str| {
            HostBuf::with_pages(bytes, what, cfg.host_pages, |_| {}).map(Mem::Host)
        };
        let pools = (0..s.layers)
            .map(|_| match cfg.residency {
                Residency::Host => host_pool(pool_bytes, "page pool"),
                Residency::Hbm => DevBuf::zeroed(pool_bytes, "page pool").map(Mem::Dev),
                Residency::IndexHbm => DevBuf::zeroed(key_pool, "page index pool").map(Mem::Dev),
            })
            .collect::<Result<Vec<_>>>()?;
        // After the HBM (a typed out-of-memory before any host pinning).
        let rec_pools = match cfg.residency {
            Residency::IndexHbm => (0..s.layers)
                .map(|_| host_pool(rec_pool, "page records pool"))
                .collect::<Result<Vec<_>>>()?,
            Residency::Host | Residency::Hbm => Vec::new(),
        };
        let pca_pools = if cfg.pca_index {
            (0..s.layers)
                .map(|_| match cfg.residency {
                    Residency::Host => host_pool(key_pool, "PCA index pool"),
                    Residency::Hbm | Residency::IndexHbm => {
                        DevBuf::zeroed(key_pool, "PCA index pool").map(Mem::Dev)
                    }
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let table_pool = pages * cfg.table_page_bytes() as usize;
        let table_pools = |what: &'static str| -> Result<Vec<Mem>> {
            if !cfg.block_tables {
                return Ok(Vec::new());
            }
            (0..s.layers)
                .map(|_| match cfg.residency {
                    Residency::Host => host_pool(table_pool, what),
                    Residency::Hbm | Residency::IndexHbm => {
                        DevBuf::zeroed(table_pool, what).map(Mem::Dev)
                    }
                })
                .collect()
        };
        let landmark_pools = table_pools("landmark table pool")?;
        let quest_pools = table_pools("Quest table pool")?;
        let mut tables = HostBuf::new(cfg.pages.max_sessions * max_pages * 4, "page tables")?;
        tables.as_mut_bytes().fill(0);
        let descs = HostBuf::new(cfg.max_batch * 16, "append descriptors")?;
        let tables_dev = DevBuf::zeroed(tables.bytes, "page tables (HBM)")?;
        let descs_dev = DevBuf::zeroed(descs.bytes, "append descriptors (HBM)")?;
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
            ledger: crate::cache::StepLedger::new(s.layers),
            id: NEXT_CACHE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            select: crate::cache::SelectPath::Scores,
            groups: 1,
            scan_vec: 1,
            gather: None,
            gather_share: 100,
            settings: 0,
            side: gpu
                .stream()
                .fork()
                .map_err(drv("create the second stream"))?,
            scanned: gpu.ctx().new_event(None).map_err(drv("create event"))?,
            joined: gpu.ctx().new_event(None).map_err(drv("create event"))?,
            published: gpu.ctx().new_event(None).map_err(drv("create event"))?,
            copied: gpu.ctx().new_event(None).map_err(drv("create event"))?,
            stage_timing: false,
            stage_marks: Vec::new(),
            stage_untimed: 0,
            _module: module,
            _attend_modules: [attend_mod, plan_mod],
        })
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// The pool geometry every kernel takes, for `layer` (`layer < L`): the key sections'
    /// page stride, and where the records are (in the page, or in the records pool).
    fn geom(&self, layer: usize) -> PoolGeom {
        let lay = self.layout;
        let (page_bytes, recs, rec_page_bytes) = match self.rec_pools.get(layer) {
            Some(r) => {
                let (index, records) = lay.split_page_bytes();
                (index, r.dptr(), records)
            }
            None => (
                lay.page_bytes(),
                self.pools[layer].dptr() + lay.records_at(),
                lay.page_bytes(),
            ),
        };
        let g = self.geom32;
        PoolGeom {
            page_bytes,
            run_bytes: g.run_bytes,
            scale_pad: g.scale_pad,
            recs,
            rec_page_bytes,
            page_tokens: g.page_tokens,
            max_pages: g.max_pages,
            heads: g.heads,
            layers: g.layers,
        }
    }

    /// The PCA index's geometry at `layer`: its own key sections (stride
    /// `split_page_bytes().0`), the first index's records.
    fn pca_geom(&self, layer: usize) -> PoolGeom {
        PoolGeom {
            page_bytes: self.layout.split_page_bytes().0,
            ..self.geom(layer)
        }
    }

    /// The block tables' geometry at `layer` (every address 0 without them).
    fn table_geom(&self, layer: usize) -> TableGeom {
        match (self.landmark_pools.get(layer), self.quest_pools.get(layer)) {
            (Some(l), Some(q)) => TableGeom {
                page_bytes: self.cfg.table_page_bytes(),
                landmark: l.dptr(),
                quest: q.dptr(),
            },
            _ => TableGeom::default(),
        }
    }

    /// Bytes of HBM the page pools take (every layer's): the whole pools in HBM residency,
    /// the index in the split residency, 0 in host residency; the PCA index's and the block
    /// tables' where they are in HBM.
    pub fn pool_hbm_bytes(&self) -> u64 {
        self.pools
            .iter()
            .chain(&self.rec_pools)
            .chain(&self.pca_pools)
            .chain(&self.landmark_pools)
            .chain(&self.quest_pools)
            .map(|m| match m {
                Mem::Dev(d) => d.bytes as u64,
                Mem::Host(_) => 0,
            })
            .sum()
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

    /// Refuses `what` while a capture is under way: a setting or a session made then would be
    /// recorded into the graph instead of applied (or would free buffers the graph reads).
    fn not_capturing(&self, what: &str) -> Result<()> {
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

    fn sync(&self) -> Result<()> {
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

    /// A new, empty session (its slot's row cache emptied: it sees none of an old session's
    /// rows).
    pub fn create(&mut self) -> Result<SessionId> {
        self.not_capturing("create")?;
        let s = self.sessions.create()?;
        self.ledger.created(s);
        self.reset_row_cache(s)?;
        Ok(s)
    }

    /// Empties the HBM row cache of `session` (on the stream): its next attends fetch every
    /// row over the link again. A no-op without a row cache.
    ///
    /// # Errors
    /// An unknown or freed session.
    pub fn reset_row_cache(&self, session: SessionId) -> Result<()> {
        self.not_capturing("reset_row_cache")?;
        self.sessions.len(session)?;
        // The filtered select's estimates too: a new session (or a fork) starts on the score
        // path.
        let s = self.cfg.shape;
        let est_bytes = s.layers * s.kv_heads * s.group * 4;
        let at = self.work.est.ptr + (session.slot() * est_bytes) as u64;
        // SAFETY: the slot's estimates lie inside the buffer (slot < max_sessions).
        unsafe { result::memset_d8_async(at, 0, est_bytes, self.stream.cu_stream()) }
            .map_err(drv("memset select estimates"))?;
        if let Some(tags) = &self.work.row_tags {
            let s = self.cfg.shape;
            let bytes = s.layers * s.kv_heads * self.cfg.row_cache * 4;
            let at = tags.ptr + (session.slot() * bytes) as u64;
            // SAFETY: the slot's tags lie inside the buffer (slot < max_sessions).
            unsafe { result::memset_d8_async(at, 0, bytes, self.stream.cu_stream()) }
                .map_err(drv("memset row-cache tags"))?;
        }
        Ok(())
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
        self.ledger.forked(parent, child);
        self.reset_row_cache(child)?;
        self.write_table(child)?;
        let bytes = tail_elems(&self.cfg) * 2;
        let src = self.tails.ptr + (parent.slot() * bytes) as u64;
        let dst = self.tails.ptr + (child.slot() * bytes) as u64;
        // SAFETY: both ranges lie inside the tails buffer (slots < max_sessions) and differ.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(drv("memcpy_dtod tails"))?;
        // A batch reserved before the fork would append into the parent's partial page,
        // which the child now shares: it is stale from here on (appends and attends refuse it).
        self.step += 1;
        Ok(child)
    }

    /// Frees `session`; pages it shared stay with the other sessions. A batch reserved before
    /// is stale afterwards (it may name the freed session's pages).
    pub fn free(&mut self, session: SessionId) -> Result<()> {
        self.sync()?;
        self.sessions.free(session)?;
        self.ledger.freed(session);
        self.step += 1;
        Ok(())
    }

    /// Shortens `session` to `len` tokens in every layer (docs/SPEC.md §6.1, "Truncate"): a
    /// rejected speculative draft, a step rolled back, or a session whose step failed after
    /// its reserve cut back to the rows its appends wrote. Pages past the end are released (a
    /// fork keeps what it shares). Where `len` falls inside a 64-token block, the block's
    /// quantization still holds the dropped tokens, so its `len mod 64` kept rows are read
    /// from their records, the session is cut to the block's start and they are appended
    /// again: the store is then the store of the first `len` keys bit for bit, as the CPU
    /// reference's [`crate::paged_ref::PagedStoreRef::truncate`] is. The session's row cache
    /// is emptied (its slots may hold dropped rows). Waits for the stream; a batch reserved
    /// before is stale afterwards.
    ///
    /// A cut to the session's own length does nothing. The kept rows are appended again as
    /// they are stored: a key whose channel block faulted at its first append (past fp16)
    /// faults again and is counted again.
    ///
    /// # Errors
    /// Refused before any change: a capture under way; an unknown or freed session; `len`
    /// past its length; rows below `len` that no append wrote, in a layer appends have
    /// written (truncate to the rows written instead); no free page for the re-append's
    /// copy-on-write of a page a fork shares; a device allocation for the kept rows. A driver
    /// failure while appending the kept rows again leaves the session cut to the block's
    /// start, and the error says so.
    pub fn truncate(&mut self, session: SessionId, len: usize) -> Result<()> {
        self.not_capturing("truncate")?;
        let n = self.sessions.len(session)?;
        if len == n {
            return Ok(());
        }
        let layers = self.ledger.appended_layers();
        let r = len % BLOCK_TOKENS;
        let base = len - r;
        if r == 0 || layers.is_empty() {
            // Nothing to append again (a block edge, or no layer ever appended): a plain cut,
            // which checks the length itself.
            self.sessions.truncate(session, len)?;
            return self.cut_done(session, len);
        }
        self.sessions.check_truncate(session, len)?;
        for &l in &layers {
            self.ledger.check_written(session, l, len, "truncate")?;
        }
        // The kept rows of the partial block, every appended layer's, `[layer][r][Hkv][D]`
        // for K, then the same for V, in the grow-only staging buffer `append_host` uses
        // (it waits for the stream before it writes there).
        let row = self.cfg.shape.kv_heads * self.cfg.shape.dim;
        let bytes = layers.len() * r * row * 4;
        if self
            .staging
            .as_ref()
            .is_none_or(|(_, cap)| *cap < 2 * bytes)
        {
            self.sync()?;
            self.staging = Some((DevBuf::new(2 * bytes, "append staging")?, 2 * bytes));
        }
        let buf = self.staging.as_ref().map_or(0, |(b, _)| b.ptr);
        self.sync()?;
        // Any batch reserved before is stale from here (descriptor 0 is rewritten below).
        self.step += 1;
        let d: &mut [AppendDesc] = cast_mut(self.descs.as_mut_bytes());
        d[0] = AppendDesc {
            slot: session.slot() as u32,
            n0: len as u32,
            m: 0,
            row0: 0,
        };
        self.upload_tables()?;
        for (i, &l) in layers.iter().enumerate() {
            let off = (i * r * row * 4) as u64;
            // Tokens len − r .. len of the one descriptor, which ends at `len`.
            self.launch_read_rows(l, r, 1, buf + off, buf + bytes as u64 + off)?;
        }
        // Checked above: nothing below fails but the driver.
        self.sessions.truncate(session, base)?;
        self.ledger.truncated(session, base);
        let again = (|| {
            let batch = self.reserve(&[(session, r)])?;
            for (i, &l) in layers.iter().enumerate() {
                let off = (i * r * row * 4) as u64;
                let kv = KvRows {
                    k: buf + off,
                    v: buf + bytes as u64 + off,
                    dtype: crate::cache::KvDtype::F32,
                    rows: r,
                };
                self.append(&batch, l, &kv)?;
            }
            Ok::<(), CudaError>(())
        })();
        if let Err(e) = again {
            // Never a session with rows no append wrote: back to the block's start, said so.
            self.sessions.truncate(session, base)?;
            self.ledger.truncated(session, base);
            self.cut_done(session, base)?;
            return Err(CudaError::invalid(
                "truncate",
                format!(
                    "{session} was cut to {base} tokens, but its kept rows {base}..{len} could not be appended again ({e}): it now holds {base} tokens"
                ),
            ));
        }
        self.cut_done(session, len)
    }

    /// After a cut of `session` to `len` tokens: its table on the host, a new step (any batch
    /// reserved before is stale), and its row cache emptied (its slots may hold dropped rows,
    /// whose positions new tokens will take).
    fn cut_done(&mut self, session: SessionId, len: usize) -> Result<()> {
        self.ledger.truncated(session, len);
        // The host table is pinned memory an upload may still be reading.
        self.sync()?;
        self.write_table(session)?;
        self.step += 1;
        self.reset_row_cache(session)
    }

    /// Queues the copies of the host page tables and append descriptors to the device, on
    /// the stream. The caller synchronised the stream before writing either (no copy of an
    /// earlier step still reads them), and whoever writes them next waits for it first.
    fn upload_tables(&self) -> Result<()> {
        // SAFETY: both sources are pinned host buffers of exactly the destinations' sizes, not
        // written again before the stream has run these copies (see above).
        unsafe {
            result::memcpy_htod_async(
                self.tables_dev.ptr,
                self.tables.as_bytes(),
                self.stream.cu_stream(),
            )
            .map_err(drv("memcpy_htod page tables"))?;
            result::memcpy_htod_async(
                self.descs_dev.ptr,
                self.descs.as_bytes(),
                self.stream.cu_stream(),
            )
            .map_err(drv("memcpy_htod append descriptors"))?;
        }
        Ok(())
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

    /// Whether [`PagedCache::reserve`] of `batch` would succeed now (sessions, lengths, free
    /// pages), changing nothing: a prompt reserved in chunks is checked whole first.
    ///
    /// # Errors
    /// What the reserve would return.
    pub fn check_reserve(&self, batch: &[(SessionId, usize)]) -> Result<()> {
        self.sessions.check_reserve(batch)?;
        self.check_grow(batch)
    }

    /// No session of `batch` holds rows no append wrote ([`crate::cache::StepLedger::check_grow`];
    /// unknown sessions are left to the reserve's own checks).
    fn check_grow(&self, batch: &[(SessionId, usize)]) -> Result<()> {
        let lens: Vec<(SessionId, usize)> = batch
            .iter()
            .filter_map(|&(s, _)| self.sessions.len(s).ok().map(|n| (s, n)))
            .collect();
        self.ledger.check_grow(&lens, "reserve")
    }

    /// Grows every session of `batch = [(session, new_tokens)]` (all or nothing, each session
    /// at most once, at most `max_batch` sessions), performs the copy-on-write of shared
    /// partial pages in every layer's pool, and writes the device's tables and descriptors.
    /// Waits for the stream first. The returned batch is valid for this step's
    /// [`PagedCache::append`] calls, one per layer, until the next `reserve`.
    ///
    /// # Errors
    /// A batch of 0 or more than `max_batch` sessions, a session twice, unknown or freed, past
    /// `max_tokens`, not enough free pages; a session holding rows no append wrote (a step
    /// that failed after its reserve; [`crate::cache::StepLedger::check_grow`]). Nothing is
    /// changed.
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
        self.check_grow(batch)?;
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
        self.upload_tables()?;
        self.batch_len = out.plans.len();
        self.batch_max_m = out.plans.iter().map(|p| p.tokens).max().unwrap_or(0);
        self.batch_max_blocks = out
            .plans
            .iter()
            .map(|p| p.end_token().div_ceil(BLOCK_TOKENS) - p.first_token / BLOCK_TOKENS)
            .max()
            .unwrap_or(0);
        self.ledger.reserved(&out);
        Ok(out)
    }

    /// Copies the valid part of a shared partial page into its fresh replacement, in every
    /// layer's pool: the plane and scale sections whole, the first `tokens` records of each
    /// head.
    fn copy_page(&mut self, c: PageCopy) -> Result<()> {
        let lay = self.layout;
        // Validates both page ids.
        lay.page_offset(c.src)?;
        lay.page_offset(c.dst)?;
        let (src, dst) = (c.src.index(), c.dst.index());
        let head_bytes = lay.records_at() as usize;
        let rec = lay.record_bytes() as usize;
        let p = lay.page_tokens();
        let records = |at: usize| {
            (0..self.cfg.shape.kv_heads).map(move |h| (at + h * p * rec, c.tokens * rec))
        };
        let stream = self.stream.clone();
        if self.rec_pools.is_empty() {
            let ranges: Vec<(usize, usize)> = std::iter::once((0, head_bytes))
                .chain(records(head_bytes))
                .collect();
            let stride = lay.page_bytes() as usize;
            for pool in &mut self.pools {
                copy_ranges(pool, &stream, src * stride, dst * stride, &ranges)?;
            }
        } else {
            let rstride = lay.split_page_bytes().1 as usize;
            let ranges: Vec<(usize, usize)> = records(0).collect();
            for (pool, recs) in self.pools.iter_mut().zip(self.rec_pools.iter_mut()) {
                copy_ranges(
                    pool,
                    &stream,
                    src * head_bytes,
                    dst * head_bytes,
                    &[(0, head_bytes)],
                )?;
                copy_ranges(recs, &stream, src * rstride, dst * rstride, &ranges)?;
            }
        }
        // The PCA index's key sections and the block tables, whole.
        let tb = self.cfg.table_page_bytes() as usize;
        for (pools, stride) in [
            (&mut self.pca_pools, head_bytes),
            (&mut self.landmark_pools, tb),
            (&mut self.quest_pools, tb),
        ] {
            for pool in pools.iter_mut() {
                copy_ranges(pool, &stream, src * stride, dst * stride, &[(0, stride)])?;
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
    /// row count that differs from the batch's, a null pointer; a batch other than the last
    /// reserve's, or a session whose earlier rows in `layer` no append wrote (a step that
    /// failed after its reserve: such a session is refused until it is freed;
    /// [`crate::cache::StepLedger`]).
    pub fn append(&mut self, batch: &AppendBatch, layer: usize, kv: &KvRows) -> Result<()> {
        check_rows(&self.cfg, batch, self.step, layer, kv)?;
        self.ledger.check_append(batch, layer, "append")?;
        if self.fixed_grids && self.batch_max_m != 1 {
            return Err(CudaError::invalid(
                "append",
                "a captured step appends one token per session (a decode batch)",
            ));
        }
        let s = self.cfg.shape;
        let geom = self.geom(layer);
        let (descs, tables, pool) = (
            self.descs_dev.ptr,
            self.tables_dev.ptr,
            self.pools[layer].dptr(),
        );
        let (tails, faults) = (self.tails.ptr, self.faults.dptr);
        let dtype = kv.dtype.code();
        let layer_u = layer as u32;
        let nb = self.batch_len as u32;
        // Every session's new tokens in one block (a decode batch): one kernel writes the
        // planes, the records and the tail.
        let fused = u32::from(self.batch_max_blocks <= 1);
        let grid = (self.batch_max_blocks as u32, s.kv_heads as u32, nb);
        let quant =
            |pool: u64, geom: &PoolGeom, fused: u32, rot: u64, tg: TableGeom| -> Result<()> {
                let mut b = self.stream.launch_builder(&self.kernels.quant);
                b.arg(&descs)
                    .arg(&tables)
                    .arg(&pool)
                    .arg(geom)
                    .arg(&tails)
                    .arg(&kv.k)
                    .arg(&kv.v)
                    .arg(&dtype)
                    .arg(&layer_u)
                    .arg(&fused)
                    .arg(&faults)
                    .arg(&rot)
                    .arg(&tg);
                // SAFETY: descriptors, tables, pool, tails and faults are allocated at the sizes
                // the kernel indexes (batch ≤ max_batch, slots < max_sessions, pages < pool pages,
                // layer < L); `kv` holds `batch.rows` rows of [Hkv][D] (checked count; the caller
                // owns the pointers' validity); `rot` is null or the layer's [Hkv][D][D] basis;
                // the tables (when present) hold every pool page.
                unsafe { b.launch(cfg(grid, (s.dim * APPEND_QUARTERS) as u32)) }
                    .map_err(drv("launch append_quant"))?;
                Ok(())
            };
        quant(pool, &geom, fused, 0, self.table_geom(layer))?;
        // The PCA index, where the layer's basis is loaded: the same blocks from the same raw
        // keys (new rows and the tail, which the pass above left as it read it), rotated; no
        // records or tail written.
        if let (Some(pca), Some((_, rot))) = (self.pca_pools.get(layer), &self.calib.pca[layer]) {
            quant(
                pca.dptr(),
                &self.pca_geom(layer),
                0,
                rot.ptr,
                TableGeom::default(),
            )?;
        }
        self.calib.appended[layer] = true;
        if fused == 0 {
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
            let grid = (self.batch_max_m as u32, s.kv_heads as u32, nb);
            // SAFETY: as above.
            unsafe { b.launch(cfg(grid, s.dim as u32)) }.map_err(drv("launch append_records"))?;
        }
        // Written once every launch of the append is queued.
        self.ledger.appended(batch, layer);
        Ok(())
    }

    /// Orders the cache's stream after everything queued so far on the caller's stream
    /// `external` (a raw `CUstream` of this device's context, as `torch.cuda.current_stream()
    /// .cuda_stream` gives; 0 is the legacy default stream): call it before appends and
    /// attends whose inputs the caller's stream produced. With [`PagedCache::signal`] after
    /// them, the cache's work runs as if on the caller's stream. No host synchronisation.
    ///
    /// # Safety
    /// `external` must be a live stream of the cache's CUDA context (or 0).
    ///
    /// # Errors
    /// A driver failure.
    pub unsafe fn follow(&self, external: u64) -> Result<()> {
        let e = crate::cuda::Event::sync_only()?;
        // SAFETY: the caller vouches for `external`; the cache's stream is live.
        unsafe { e.record_raw(external as cudarc::driver::sys::CUstream)? };
        e.wait_on(&self.stream)
    }

    /// Makes the caller's stream `external` wait for everything queued so far on the cache's
    /// stream (the outputs of the appends and attends before it).
    ///
    /// # Safety
    /// As [`PagedCache::follow`].
    ///
    /// # Errors
    /// A driver failure.
    pub unsafe fn signal(&self, external: u64) -> Result<()> {
        let e = crate::cuda::Event::sync_only()?;
        e.record(&self.stream)?;
        // SAFETY: the caller vouches for `external`.
        unsafe { e.wait_on_raw(external as cudarc::driver::sys::CUstream) }
    }

    /// Copies the last `min(len, cap)` K|V records of every session of `batch` (its length
    /// after this step's appends) from the pools to device memory as f32, on the cache's
    /// stream: session `b`'s `i`-th row lands at `[b][i][Hkv][D]` of `k_out` and `v_out`
    /// (each `batch.len() · cap · Hkv · D` f32), rows past its count are not written. This is
    /// how a model's dense prefill attention and its sliding-window layers read the cache
    /// (the values are the stored bf16, exactly).
    ///
    /// # Errors
    /// Checked before the launch: a layer out of range, a stale batch, `cap` of 0 or past the
    /// cache's `max_tokens`, a null pointer.
    pub fn read_rows(
        &self,
        batch: &AppendBatch,
        layer: usize,
        cap: usize,
        k_out: u64,
        v_out: u64,
    ) -> Result<()> {
        crate::cache::check_read_rows(&self.cfg, batch, self.step, layer, cap, k_out, v_out)?;
        self.ledger.check_read(batch, layer, "read_rows")?;
        self.launch_read_rows(layer, cap, self.batch_len, k_out, v_out)
    }

    /// Launches `read_rows` over the first `nb` descriptors on the device (checked by the
    /// caller: `layer` exists, the descriptors and tables are uploaded, the outputs hold
    /// `nb · cap · Hkv · D` f32 each).
    fn launch_read_rows(
        &self,
        layer: usize,
        cap: usize,
        nb: usize,
        k_out: u64,
        v_out: u64,
    ) -> Result<()> {
        let s = self.cfg.shape;
        let geom = self.geom(layer);
        let (descs, tables, pool) = (
            self.descs_dev.ptr,
            self.tables_dev.ptr,
            self.pools[layer].dptr(),
        );
        let cap_u = cap as u32;
        let mut b = self.stream.launch_builder(&self.kernels.read_rows);
        b.arg(&descs)
            .arg(&tables)
            .arg(&pool)
            .arg(&geom)
            .arg(&cap_u)
            .arg(&k_out)
            .arg(&v_out);
        let grid = (cap.div_ceil(READ_ROWS) as u32, s.kv_heads as u32, nb as u32);
        // SAFETY: descriptors, tables and the pool are the cache's own (rows < each session's
        // length, pages < the pool's); the caller's buffers hold batch · cap · Hkv · D f32 (its
        // documented contract; the pointers are checked non-null).
        unsafe { b.launch(cfg(grid, s.dim as u32)) }.map_err(drv("launch read_rows"))?;
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
        // SAFETY: the staging buffer holds 2·bytes, only this stream uses it, and the stream is
        // idle (synchronised above); the copies are ordered before the append's kernels.
        unsafe {
            let st = self.stream.cu_stream();
            stream_upload(base, k, st, "memcpy_htod keys")?;
            stream_upload(base + bytes as u64, v, st, "memcpy_htod values")?;
        }
        let kv = KvRows {
            k: base,
            v: base + bytes as u64,
            dtype: crate::cache::KvDtype::F32,
            rows: batch.rows,
        };
        self.append(batch, layer, &kv)
    }

    /// Loads one layer's calibration: per KV head σ² (Fathom's importance) and Double
    /// Sparsity's channels (`fathom_plan::calib::head_calib`'s `sigma2` and `ds_channels`),
    /// and, in a cache with the PCA index, the basis `loki` of every head (`[D][D]`, column j
    /// the j-th coordinate): from then on the layer's appends write the PCA index too.
    ///
    /// # Errors
    /// A layer out of range, a head count or σ² length that differs from the shape, a σ² that
    /// is negative or not finite; with the PCA index, a basis of the wrong size or not finite,
    /// or one that differs from the loaded one after the layer's first append (the index of the
    /// tokens already there would be in the old basis). Nothing is changed then.
    pub fn load_calibration(
        &mut self,
        layer: usize,
        heads: &[fathom_plan::scanner::HeadCalib],
    ) -> Result<()> {
        self.not_capturing("load_calibration")?;
        let s = self.cfg.shape;
        if layer >= s.layers {
            return Err(CudaError::invalid(
                "layer",
                format!("{layer} (the cache has {} layers)", s.layers),
            ));
        }
        if heads.len() != s.kv_heads {
            return Err(CudaError::invalid(
                "calibration",
                format!("{} heads for Hkv = {}", heads.len(), s.kv_heads),
            ));
        }
        let mut tiled = Vec::with_capacity(self.cfg.max_batch * s.kv_heads * s.dim);
        for (h, hc) in heads.iter().enumerate() {
            if hc.sigma2.len() != s.dim {
                return Err(CudaError::invalid(
                    "calibration",
                    format!("head {h}: {} σ² for D = {}", hc.sigma2.len(), s.dim),
                ));
            }
            if let Some(x) = hc.sigma2.iter().find(|x| !x.is_finite() || **x < 0.0) {
                return Err(CudaError::invalid(
                    "calibration",
                    format!("head {h}: σ² {x} is not a finite non-negative number"),
                ));
            }
            crate::cache::check_ds_channels(h, &hc.ds_channels, s.dim)?;
        }
        let pca = if self.cfg.pca_index {
            let mut u = Vec::with_capacity(s.kv_heads * s.dim * s.dim);
            for (h, hc) in heads.iter().enumerate() {
                if hc.loki.len() != s.dim * s.dim {
                    return Err(CudaError::invalid(
                        "calibration",
                        format!(
                            "head {h}: a PCA basis of {} entries for D = {} (the cache has the PCA index: D² wanted)",
                            hc.loki.len(),
                            s.dim
                        ),
                    ));
                }
                if let Some(x) = hc.loki.iter().find(|x| !x.is_finite()) {
                    return Err(CudaError::invalid(
                        "calibration",
                        format!("head {h}: PCA basis entry {x} is not finite"),
                    ));
                }
                u.extend_from_slice(&hc.loki);
            }
            let same = self.calib.pca[layer]
                .as_ref()
                .is_some_and(|(old, _)| old == &u);
            if same {
                None
            } else if self.calib.appended[layer] {
                return Err(CudaError::invalid(
                    "calibration",
                    format!(
                        "layer {layer} already holds appended tokens: its PCA basis is loaded before the layer's first append (the index of those tokens would be in another basis)"
                    ),
                ));
            } else {
                let dev = DevBuf::from_slice(&u, "PCA basis")?;
                Some((u, dev))
            }
        } else {
            None
        };
        for _ in 0..self.cfg.max_batch {
            for hc in heads {
                tiled.extend_from_slice(&hc.sigma2);
            }
        }
        // Every allocation before any change.
        let sigma2 = DevBuf::from_slice(&tiled, "calibration σ²")?;
        if let Some(p) = pca {
            self.calib.pca[layer] = Some(p);
        }
        self.calib.sigma2[layer] = Some(sigma2);
        self.calib.ds_channels[layer] = Some(heads.iter().map(|h| h.ds_channels.clone()).collect());
        // A static plan made before this calibration is stale, and so is a graph captured
        // before it (it reads the σ² and depth buffers just replaced).
        self.calib.statics.retain(|k, _| !k.starts_with("ds:"));
        self.settings += 1;
        Ok(())
    }

    /// Makes the static depth table of `method` (Double Sparsity, Loki, thumb2, exact) for
    /// every layer; Fathom and SparQ plan on the GPU per query, landmark and Quest read their
    /// block tables, and need nothing.
    ///
    /// # Errors
    /// Double Sparsity before any layer's calibration is loaded; Loki in a cache without the
    /// PCA index, or with `r` of 0 or past D; landmark or Quest in a cache without the block
    /// tables.
    pub fn prepare(&mut self, method: crate::config::Method) -> Result<()> {
        use crate::config::Method as M;
        self.not_capturing("prepare")?;
        method.validate(self.cfg.shape.dim)?;
        self.check_tables(method)?;
        let s = self.cfg.shape;
        let (hkv, d) = (s.kv_heads, s.dim);
        let depths: Vec<u8> = match method {
            M::Fathom(_) | M::SparQ(_) | M::Landmark | M::Quest => return Ok(()),
            M::Thumb2 => vec![2; s.layers * hkv * d],
            M::Exact => vec![4; s.layers * hkv * d],
            M::DoubleSparsity(r) => {
                // Layers without a calibration (a model's sliding-window layers, which never
                // attend through a method) keep zero depths; attend refuses them.
                let mut out = vec![0u8; s.layers * hkv * d];
                if self.calib.ds_channels.iter().all(Option::is_none) {
                    return Err(CudaError::invalid(
                        "method",
                        format!("{} needs a calibration (load_calibration)", method.label()),
                    ));
                }
                for l in 0..s.layers {
                    let Some(ch) = self.calib.ds_channels[l].as_ref() else {
                        continue;
                    };
                    for (h, c) in ch.iter().enumerate() {
                        for &x in c.iter().take(r) {
                            out[(l * hkv + h) * d + x as usize] = 4;
                        }
                    }
                }
                out
            }
            M::Loki(r) => {
                if !self.cfg.pca_index {
                    return Err(CudaError::invalid(
                        "method",
                        format!(
                            "{} scans the PCA index, which this cache does not keep (CacheConfig::pca_index)",
                            method.label()
                        ),
                    ));
                }
                if r == 0 || r > d {
                    return Err(CudaError::invalid(
                        "method",
                        format!("{}: r must be 1..={d}", method.label()),
                    ));
                }
                // The first r coordinates of the PCA basis, at 4 planes (docs/SPEC.md §4).
                (0..s.layers * hkv * d)
                    .map(|i| if i % d < r { 4 } else { 0 })
                    .collect()
            }
        };
        let buf = DevBuf::from_slice(&depths, "static plan")?;
        if self.calib.statics.insert(method.label(), buf).is_some() {
            // The old depths are freed: a graph that read them is stale.
            self.settings += 1;
        }
        Ok(())
    }

    /// Whether `method`'s static depth table is made and current ([`PagedCache::prepare`] has
    /// nothing to do): false for the methods that plan per query (their `prepare` only checks),
    /// and for Double Sparsity after a [`PagedCache::load_calibration`] dropped its table.
    pub fn is_prepared(&self, method: crate::config::Method) -> bool {
        self.calib.statics.contains_key(&method.label())
    }

    /// Checks that `method` can attend layer `layer` (its static plan prepared, its
    /// calibration loaded) without launching anything: what [`PagedCache::attend`] checks
    /// first, for a caller that must refuse a step before it reserves or appends.
    ///
    /// # Errors
    /// A method that was not prepared, or a layer without the calibration it needs.
    pub fn check_method(&self, method: crate::cache::AttendMethod, layer: usize) -> Result<()> {
        if layer >= self.cfg.shape.layers {
            return Err(CudaError::invalid(
                "layer",
                format!("{layer} (the cache has {})", self.cfg.shape.layers),
            ));
        }
        self.method_inputs(method, layer).map(|_| ())
    }

    /// Landmark and Quest read the block tables: refused by name in a cache without them.
    fn check_tables(&self, method: crate::config::Method) -> Result<()> {
        use crate::config::Method as M;
        if matches!(method, M::Landmark | M::Quest) && !self.cfg.block_tables {
            return Err(CudaError::invalid(
                "method",
                format!(
                    "{} reads the block tables, which this cache does not keep (CacheConfig::block_tables)",
                    method.label()
                ),
            ));
        }
        Ok(())
    }

    /// The static depth table and the σ² a method reads at `layer` (device pointers).
    fn method_inputs(
        &self,
        method: crate::cache::AttendMethod,
        layer: usize,
    ) -> Result<(Option<u64>, Option<u64>)> {
        use crate::cache::AttendMethod;
        use crate::config::Method as M;
        let s = self.cfg.shape;
        let (hkv, d) = (s.kv_heads, s.dim);
        if let AttendMethod::Scan(m) = method {
            m.validate(d)?;
        }
        // Where this method's depths come from (checked before any launch).
        if let AttendMethod::Scan(m @ M::DoubleSparsity(_)) = method {
            if self.calib.ds_channels[layer].is_none() {
                return Err(CudaError::invalid(
                    "method",
                    format!(
                        "{} needs layer {layer}'s calibration (load_calibration)",
                        m.label()
                    ),
                ));
            }
        }
        if let AttendMethod::Scan(m @ M::Loki(_)) = method {
            if self.calib.pca[layer].is_none() {
                return Err(CudaError::invalid(
                    "method",
                    format!(
                        "{} needs layer {layer}'s PCA basis, loaded before its first append (load_calibration)",
                        m.label()
                    ),
                ));
            }
        }
        if let AttendMethod::Scan(m) = method {
            self.check_tables(m)?;
        }
        let static_depths = match method {
            AttendMethod::Dense
            | AttendMethod::Scan(M::Fathom(_) | M::SparQ(_) | M::Landmark | M::Quest) => None,
            AttendMethod::Scan(m) => {
                let buf = self.calib.statics.get(&m.label()).ok_or_else(|| {
                    CudaError::invalid(
                        "method",
                        format!("{} was not prepared (PagedCache::prepare)", m.label()),
                    )
                })?;
                Some(buf.ptr + (layer * hkv * d) as u64)
            }
        };
        let sigma = match method {
            AttendMethod::Scan(M::Fathom(_)) => Some(
                self.calib.sigma2[layer]
                    .as_ref()
                    .ok_or_else(|| {
                        CudaError::invalid(
                            "method",
                            format!("fathom needs layer {layer}'s σ² (load_calibration)"),
                        )
                    })?
                    .ptr,
            ),
            _ => None,
        };
        Ok((static_depths, sigma))
    }

    /// One layer's attention for the sessions of `batch` (each at its last token), on the
    /// cache's stream with no host synchronisation: queries `q` `[batch][Hq][D]` give outputs
    /// `out` `[batch][Hq][D]` f32 (device pointers). Each query head attends exactly over its
    /// own sink + local + top-k set (docs/SPEC.md §5), or over every token for
    /// [`AttendMethod::Dense`](crate::cache::AttendMethod::Dense). Launch parameters are fixed-size structs; working memory was
    /// sized when the cache was made.
    ///
    /// # Errors
    /// Checked before any launch ([`crate::cache::check_attend`]): layer, stale batch, k past
    /// `max_k`, null pointers; a method that needs a calibration or a static plan not loaded.
    pub fn attend(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        method: crate::cache::AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &crate::cache::QueryRows,
        out: u64,
    ) -> Result<()> {
        use crate::cache::AttendMethod;
        use crate::config::Method as M;
        crate::cache::check_attend(&self.cfg, batch, self.step, layer, params, q, out)?;
        self.ledger.check_read(batch, layer, "attend")?;
        let s = self.cfg.shape;
        let (hkv, hq, d) = (s.kv_heads, s.kv_heads * s.group, s.dim);
        let nb = self.batch_len;
        let (static_depths, sigma) = self.method_inputs(method, layer)?;
        let lay = self.layout;
        // Loki scans the PCA index (its own key sections, the same records) with the queries
        // rotated into its basis; every other method the first index with the raw queries.
        let loki = matches!(method, AttendMethod::Scan(M::Loki(_)));
        let geom = if loki {
            self.pca_geom(layer)
        } else {
            self.geom(layer)
        };
        let dense = matches!(method, AttendMethod::Dense);
        // Landmark (0) and Quest (1) score from the block tables, and take the score path.
        let table = match method {
            AttendMethod::Scan(M::Landmark) => Some(0u32),
            AttendMethod::Scan(M::Quest) => Some(1u32),
            _ => None,
        };
        let ag = AttendGeom {
            sink: params.sink as u32,
            local: params.local as u32,
            k: params.k as u32,
            max_k: self.cfg.max_k as u32,
            max_tokens: self.cfg.pages.max_tokens as u64,
            depth_stride: if static_depths.is_some() {
                0
            } else {
                (hkv * d) as u32
            },
            dense: u32::from(dense),
            scale: 1.0 / (d as f32).sqrt(),
            umax: self.work.umax as u32,
            cache_rows: self.cfg.row_cache as u32,
            layer: layer as u32,
            nsplit: if dense {
                DENSE_SPLITS
            } else {
                self.work.umax.div_ceil(ATTN_GRAN).min(SPARSE_SPLITS)
            } as u32,
            fuse_min: match self.select {
                _ if table.is_some() => 0,
                crate::cache::SelectPath::Filtered {
                    min_middle_tokens, ..
                } => min_middle_tokens.min(u32::MAX as usize) as u32,
                crate::cache::SelectPath::Scores => 0,
            },
            fcap: self.work.fcap as u32,
            keep_scores: u32::from(matches!(
                self.select,
                crate::cache::SelectPath::Filtered {
                    keep_scores: true,
                    ..
                }
            )),
            h0: 0,
            host_gather: if self.gather.is_some() {
                self.gather_share
            } else {
                0
            },
        };
        // Head groups: `per` KV heads each (the last may hold fewer); one for dense attends.
        let groups = if dense { 1 } else { self.groups.min(hkv) };
        // Stage marks (set_stage_timing): plain launches of one head group only, an event on
        // the stream after each stage (all on the cache's stream then).
        let split = self.stage_timing
            && self.capturing.is_none()
            && groups == 1
            && self.stage_marks.len() + 7 <= MAX_STAGE_MARKS
            // A caller's own capture that took in the cache's stream counts as a capture.
            && matches!(
                self.stream.capture_status(),
                Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
            );
        if self.stage_timing && !split {
            self.stage_untimed += 1;
        }
        let mut marks: Vec<(AttendStage, CudaEvent)> = Vec::new();
        let mut mark = |stage: AttendStage, on: &CudaStream| -> Result<()> {
            if split {
                let e = on
                    .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(drv("record stage event"))?;
                marks.push((stage, e));
            }
            Ok(())
        };
        let per = hkv.div_ceil(groups);
        let k = &self.attend_kernels;
        let w = &self.work;
        let st = &self.stream;
        let (descs, tables, pool) = (
            self.descs_dev.ptr,
            self.tables_dev.ptr,
            if loki {
                self.pca_pools[layer].dptr()
            } else {
                self.pools[layer].dptr()
            },
        );
        // The queries the plan and the scan read (attention reads `qf`).
        let (qs, rot) = match (loki, &w.qr, &self.calib.pca[layer]) {
            (true, Some(qr), Some((_, rot))) => (qr.ptr, Some(rot.ptr)),
            (true, ..) => {
                return Err(CudaError::invalid(
                    "method",
                    format!("loki at layer {layer}: the cache has no PCA index or basis there"),
                ))
            }
            (false, ..) => (w.qf.ptr, None),
        };
        // The row cache (null when absent).
        let ptr = |x: &Option<DevBuf>| x.as_ref().map_or(0, |b| b.ptr);
        let (tags, data, claim) = (ptr(&w.row_tags), ptr(&w.row_data), ptr(&w.row_claim));

        let (nb32, hkv32, hq32) = (nb as u32, hkv as u32, hq as u32);
        // Grids cover the longest session of the batch, or `max_tokens` while capturing (the
        // kernels skip what lies past each session's length).
        let longest = if self.fixed_grids {
            self.cfg.pages.max_tokens
        } else {
            batch.plans.iter().map(|p| p.end_token()).max().unwrap_or(0)
        };
        let dtype = q.dtype.code();
        // 6. Exact attention of each query head over its own set, split (each split fills the
        // row cache from its rows), then combined (after every group).
        let partial = |ps: &CudaStream, ag: &AttendGeom, hn: u32| -> Result<()> {
            let mut b = ps.launch_builder(&k.attn_partial);
            b.arg(&descs)
                .arg(&tables)
                .arg(&pool)
                .arg(&geom)
                .arg(ag)
                .arg(&w.qf.ptr)
                .arg(&w.rows.ptr)
                .arg(&w.urows.ptr)
                .arg(&w.umask.ptr)
                .arg(&w.ucount.ptr)
                .arg(&tags)
                .arg(&data)
                .arg(&claim)
                .arg(&w.pm.ptr)
                .arg(&w.pl.ptr)
                .arg(&w.pacc.ptr);
            // SAFETY: partials hold DENSE_SPLITS ≥ nsplit per row; rows are read through the
            // session's pages only at tokens < its length; the row cache (when present) has
            // cache_rows slots per (slot, layer, head).
            unsafe { b.launch(cfg((ag.nsplit, hn, nb32), ATTN_THREADS)) }
                .map_err(drv("launch paged_attn_partial"))?;
            Ok(())
        };
        mark(AttendStage::Start, st)?;
        // 1. Queries to f32.
        let mut b = st.launch_builder(&k.queries);
        b.arg(&q.q).arg(&dtype).arg(&w.qf.ptr);
        // SAFETY: q holds batch·Hq·D elements (the caller's contract), qf max_batch·Hq·D.
        unsafe { b.launch(cfg(((nb * hq) as u32, 1, 1), d as u32)) }
            .map_err(drv("launch attend_queries"))?;
        if let Some(rot) = rot {
            let hq_u = hq as u32;
            let mut b = st.launch_builder(&k.rotate_queries);
            b.arg(&w.qf.ptr).arg(&rot).arg(&hq_u).arg(&qs);
            // SAFETY: qf and qr hold max_batch·Hq·D f32, rot Hkv·D·D.
            unsafe { b.launch(cfg(((nb * hq) as u32, 1, 1), d as u32)) }
                .map_err(drv("launch attend_rotate_queries"))?;
        }
        if !dense {
            // 2. Plan.
            let heads = (nb * hkv) as i32;
            let one = 1u64;
            match method {
                AttendMethod::Scan(M::Fathom(budget)) => {
                    let steps = fathom_plan::waterfill::BISECTION_STEPS as i32;
                    let sig = sigma.unwrap_or(0);
                    let mut b = st.launch_builder(&k.fathom_plan);
                    b.arg(&w.qf.ptr)
                        .arg(&sig)
                        .arg(&budget)
                        .arg(&steps)
                        .arg(&heads)
                        .arg(&one)
                        .arg(&w.depths.ptr)
                        .arg(&w.bits.ptr)
                        .arg(&w.runs.ptr)
                        .arg(&w.bits_acc.ptr);
                    // SAFETY: qf [B·Hkv][G][D], σ² tiled [max_batch][Hkv][D], depths, bits and
                    // runs sized for max_batch·Hkv heads; one warp per head.
                    unsafe { b.launch(cfg((heads as u32, 1, 1), 32)) }
                        .map_err(drv("launch fathom_plan"))?;
                }
                AttendMethod::Scan(M::SparQ(r)) => {
                    let r = r as i32;
                    let mut b = st.launch_builder(&k.sparq_plan);
                    b.arg(&w.qf.ptr)
                        .arg(&r)
                        .arg(&heads)
                        .arg(&one)
                        .arg(&w.depths.ptr)
                        .arg(&w.bits.ptr)
                        .arg(&w.runs.ptr)
                        .arg(&w.bits_acc.ptr);
                    // SAFETY: as above; one CTA of D threads per head.
                    unsafe { b.launch(cfg((heads as u32, 1, 1), d as u32)) }
                        .map_err(drv("launch sparq_plan"))?;
                }
                _ => {}
            }
            mark(AttendStage::Plan, st)?;
            let depths = static_depths.unwrap_or(w.depths.ptr);
            // 3. Scan each page in place (zero-copy), with the top-k's level-1 histogram.
            // SAFETY: the histogram holds max_batch·Hq rows of HIST_BINS u32.
            unsafe {
                result::memset_d8_async(w.hist.ptr, 0, nb * hq * HIST_BINS * 4, st.cu_stream())
            }
            .map_err(drv("memset top-k histogram"))?;
            let fused = ag.fuse_min > 0;
            if table.is_some() {
                // The table methods take the score path: no scan of theirs writes the rows'
                // select modes, so a filtered attend before must not leave its modes (1:
                // filtered) for the top-k kernels to skip these rows by.
                // SAFETY: the modes hold max_batch·Hq u32.
                unsafe { result::memset_d8_async(w.mode.ptr, 0, nb * hq * 4, st.cu_stream()) }
                    .map_err(drv("memset select modes"))?;
            }
            if fused {
                // SAFETY: the counts hold max_batch·Hq u32.
                unsafe { result::memset_d8_async(w.fcount.ptr, 0, nb * hq * 4, st.cu_stream()) }
                    .map_err(drv("memset filtered counts"))?;
            }
            let per_cta = SCAN_BLOCKS.min(lay.blocks_per_page());
            let ctas = longest.div_ceil(BLOCK_TOKENS).div_ceil(per_cta) as u32;
            let scan_fn = if self.scan_vec == 2 {
                &k.scan_v2
            } else {
                &k.scan
            };
            let scan = |pass: u32, ag: &AttendGeom, hn: u32| -> Result<()> {
                let mut b = st.launch_builder(scan_fn);
                b.arg(&descs)
                    .arg(&tables)
                    .arg(&pool)
                    .arg(&geom)
                    .arg(ag)
                    .arg(&qs)
                    .arg(&depths)
                    .arg(&w.scores.ptr)
                    .arg(&w.hist.ptr)
                    .arg(&pass)
                    .arg(&w.est.ptr)
                    .arg(&w.mode.ptr)
                    .arg(&w.fcand.ptr)
                    .arg(&w.fcount.ptr);
                // SAFETY: only pages < each session's table length are read (the kernel
                // checks its length); scores hold max_batch·Hq rows of max_tokens, the
                // filtered pairs fcap per row (bounded in the kernel), the estimates
                // max_sessions·L·Hq.
                unsafe { b.launch(cfg((ctas.max(1), hn, nb32), 8 * SCAN_BLOCKS as u32)) }
                    .map_err(drv("launch paged_scan"))?;
                Ok(())
            };
            for gi in 0..groups {
                let h0 = gi * per;
                if h0 >= hkv {
                    break;
                }
                let hn = per.min(hkv - h0) as u32;
                let (ag, gq32) = (
                    AttendGeom {
                        h0: h0 as u32,
                        ..ag
                    },
                    hn * s.group as u32,
                );
                let ag = &ag;
                match table {
                    Some(quest) => {
                        let tg = self.table_geom(layer);
                        let gs = if quest == 1 { 16 } else { 8 };
                        let grid = (
                            longest
                                .div_ceil(gs)
                                .div_ceil(crate::cache::table_scan_groups(s.dim, s.group))
                                .max(1) as u32,
                            hn,
                            nb32,
                        );
                        let mut b = st.launch_builder(&k.table_scan);
                        b.arg(&descs)
                            .arg(&tables)
                            .arg(&geom)
                            .arg(ag)
                            .arg(&tg)
                            .arg(&quest)
                            .arg(&qs)
                            .arg(&w.scores.ptr)
                            .arg(&w.hist.ptr);
                        // SAFETY: the tables hold every pool page (checked: the cache keeps
                        // them); groups past each session's length are skipped; scores and the
                        // histogram hold max_batch·Hq rows.
                        unsafe { b.launch(cfg(grid, TABLE_SCAN_THREADS)) }
                            .map_err(drv("launch paged_table_scan"))?;
                    }
                    None => scan(0, ag, hn)?,
                }
                // 4. The filtered rows' selection (or their fallback), then each other row's
                // top-k: the boundary bucket, one streaming pass, the exact boundary among the
                // bucket's candidates (ties to the lower index). With the filtered select off,
                // every row's mode is 0 already (set_select_path cleared them).
                if fused {
                    let mut b = st.launch_builder(&k.topk_fused);
                    b.arg(&descs)
                        .arg(&geom)
                        .arg(ag)
                        .arg(&qs)
                        .arg(&depths)
                        .arg(&w.est.ptr)
                        .arg(&w.mode.ptr)
                        .arg(&w.fcand.ptr)
                        .arg(&w.fcount.ptr)
                        .arg(&w.winners.ptr)
                        .arg(&w.counts.ptr)
                        .arg(&w.counters.ptr);
                    // SAFETY: rows < max_batch·Hq of every per-row array; pairs read
                    // < min(count, fcap).
                    unsafe { b.launch(cfg((gq32, nb32, 1), TOPK_THREADS)) }
                        .map_err(drv("launch paged_topk_fused"))?;
                    if ag.keep_scores == 0 {
                        scan(1, ag, hn)?;
                    }
                }
                mark(AttendStage::Scan, st)?;
                // With head groups, the rest of this group's attend runs on the second stream
                // (after this group's scan), while the cache's stream scans the next group.
                let ps: &CudaStream = if groups > 1 {
                    self.scanned.record(st).map_err(drv("record event"))?;
                    self.side.wait(&self.scanned).map_err(drv("wait event"))?;
                    &self.side
                } else {
                    st
                };
                let mut b = ps.launch_builder(&k.topk_select);
                b.arg(&descs)
                    .arg(&geom)
                    .arg(ag)
                    .arg(&w.hist.ptr)
                    .arg(&w.sel.ptr)
                    .arg(&w.counts.ptr)
                    .arg(&w.ccount.ptr)
                    .arg(&w.mode.ptr);
                // SAFETY: rows < max_batch·Hq of every per-row array.
                unsafe { b.launch(cfg((gq32, nb32, 1), TOPK_THREADS)) }
                    .map_err(drv("launch paged_topk_select"))?;
                let chunks = longest.div_ceil(COLLECT_ELEMS).max(1) as u32;
                let mut b = ps.launch_builder(&k.topk_collect);
                b.arg(&descs)
                    .arg(&geom)
                    .arg(ag)
                    .arg(&w.scores.ptr)
                    .arg(&w.sel.ptr)
                    .arg(&w.winners.ptr)
                    .arg(&w.counts.ptr)
                    .arg(&w.cand.ptr)
                    .arg(&w.ccount.ptr)
                    .arg(&w.mode.ptr);
                // SAFETY: winners hold max_k per row (k ≤ max_k was checked), candidates
                // max_tokens per row; both lists are bounded in the kernel.
                unsafe { b.launch(cfg((chunks, gq32, nb32), 256)) }
                    .map_err(drv("launch paged_topk_collect"))?;
                let mut b = ps.launch_builder(&k.topk_finish);
                b.arg(&descs)
                    .arg(&geom)
                    .arg(ag)
                    .arg(&w.scores.ptr)
                    .arg(&w.sel.ptr)
                    .arg(&w.winners.ptr)
                    .arg(&w.counts.ptr)
                    .arg(&w.cand.ptr)
                    .arg(&w.ccount.ptr)
                    .arg(&w.mode.ptr)
                    .arg(&qs)
                    .arg(&depths)
                    .arg(&w.est.ptr);
                // SAFETY: as above.
                unsafe { b.launch(cfg((gq32, nb32, 1), TOPK_THREADS)) }
                    .map_err(drv("launch paged_topk_finish"))?;
                mark(AttendStage::TopK, ps)?;
                // 5. The union per KV head, then its rows into HBM (row cache first).
                let mut b = ps.launch_builder(&k.union);
                b.arg(&descs)
                    .arg(&geom)
                    .arg(ag)
                    .arg(&w.winners.ptr)
                    .arg(&w.counts.ptr)
                    .arg(&w.urows.ptr)
                    .arg(&w.umask.ptr)
                    .arg(&w.ucount.ptr);
                // SAFETY: union lists hold umax = 64 + G·max_k rows ≥ sink + local + G·k.
                unsafe { b.launch(cfg((nb32, hn, 1), TOPK_THREADS)) }
                    .map_err(drv("launch paged_union"))?;
                mark(AttendStage::Union, ps)?;
                let row_chunks = self.work.umax.div_ceil(FETCH_ROWS) as u32;
                if let Some(g) = &self.gather {
                    // SAFETY: the state holds 4 u32; the count is its first.
                    unsafe { result::memset_d8_async(g.gstate.ptr, 0, 4, ps.cu_stream()) }
                        .map_err(drv("memset host-gather count"))?;
                    let gcap = g.cap as u32;
                    let mut b = ps.launch_builder(&k.gather_list);
                    b.arg(&descs)
                        .arg(&tables)
                        .arg(&geom)
                        .arg(ag)
                        .arg(&w.urows.ptr)
                        .arg(&w.ucount.ptr)
                        .arg(&tags)
                        .arg(&g.gstate.ptr)
                        .arg(&g.list.dptr)
                        .arg(&g.gdst.ptr)
                        .arg(&gcap);
                    let list_chunks = self.work.umax.div_ceil(GATHER_LIST_THREADS) as u32;
                    // SAFETY: as the fetch's (below); the list and rows hold gcap entries
                    // (bounded in the kernel).
                    unsafe { b.launch(cfg((list_chunks, hn, nb32), GATHER_LIST_THREADS as u32)) }
                        .map_err(drv("launch paged_gather_list"))?;
                    let mut b = ps.launch_builder(&k.gather_publish);
                    b.arg(ag).arg(&g.gstate.ptr).arg(&gcap).arg(&g.mailbox.dptr);
                    // SAFETY: one thread; the mailbox holds MAILBOX_WORDS u32.
                    unsafe { b.launch(cfg((1, 1, 1), 1)) }
                        .map_err(drv("launch paged_gather_publish"))?;
                    // The copy of the host's chunks into their rows runs on the second
                    // stream, at once with the fetch below (the rows they write are disjoint:
                    // gather_on_host gives each miss to one of them), so the staging reads
                    // overlap the fetch's translation-bound random reads. With the gather on
                    // there is one head group, so the second stream is free.
                    self.published.record(ps).map_err(drv("record event"))?;
                    self.side.wait(&self.published).map_err(drv("wait event"))?;
                    let chunks = g.cap.div_ceil(crate::host_gather::GATHER_CHUNK);
                    let ctas = chunks.min(GATHER_COPY_CTAS) as u32;
                    let mut b = self.side.launch_builder(&k.gather_copy);
                    b.arg(&g.gstate.ptr)
                        .arg(&gcap)
                        .arg(&g.done.dptr)
                        .arg(&g.staging.dptr)
                        .arg(&g.gdst.ptr)
                        .arg(&w.rows.ptr);
                    // SAFETY: done holds a mark per chunk of gcap, staging gcap records, and
                    // every gdst entry is a row of `rows` that the fetch does not write.
                    unsafe { b.launch(cfg((ctas, 1, 1), 256)) }
                        .map_err(drv("launch paged_gather_copy"))?;
                    self.copied
                        .record(&self.side)
                        .map_err(drv("record event"))?;
                }
                let mut b = ps.launch_builder(&k.fetch);
                b.arg(&descs)
                    .arg(&tables)
                    .arg(&pool)
                    .arg(&geom)
                    .arg(ag)
                    .arg(&w.urows.ptr)
                    .arg(&w.ucount.ptr)
                    .arg(&tags)
                    .arg(&data)
                    .arg(&claim)
                    .arg(&w.rows.ptr)
                    .arg(&w.counters.ptr);
                // SAFETY: every union row is a token < the session's length; rows hold umax
                // records; the row cache (when present) has cache_rows slots per (slot, layer, head).
                unsafe { b.launch(cfg((row_chunks, hn, nb32), 256)) }
                    .map_err(drv("launch paged_fetch"))?;
                if self.gather.is_some() {
                    // The rows the host brought, copied on the second stream, join here.
                    ps.wait(&self.copied).map_err(drv("wait event"))?;
                }
                mark(AttendStage::Fetch, ps)?;
                partial(ps, ag, hn)?;
            }
            if groups > 1 {
                self.joined
                    .record(&self.side)
                    .map_err(drv("record event"))?;
                st.wait(&self.joined).map_err(drv("wait event"))?;
            }
        } else {
            mark(AttendStage::Plan, st)?;
            partial(st, &ag, hkv32)?;
        }
        let mut b = st.launch_builder(&k.attn_combine);
        b.arg(&geom)
            .arg(&ag)
            .arg(&w.pm.ptr)
            .arg(&w.pl.ptr)
            .arg(&w.pacc.ptr)
            .arg(&out);
        // SAFETY: out holds batch·Hq·D f32 (the caller's contract).
        unsafe { b.launch(cfg((hq32, nb32, 1), d as u32)) }
            .map_err(drv("launch paged_attn_combine"))?;
        mark(AttendStage::Attention, st)?;
        self.stage_marks.extend(marks);
        if matches!(method, AttendMethod::Scan(M::Fathom(_) | M::SparQ(_))) {
            self.plans_counted += (nb * hkv) as u64;
        }
        Ok(())
    }

    /// [`PagedCache::attend`] from and to host slices (a convenience for CPU callers and tests):
    /// `q` is `[batch][Hq][D]` f32; returns the outputs `[batch][Hq][D]`. Waits for the stream.
    ///
    /// # Errors
    /// As [`PagedCache::attend`], and a `q` of the wrong length or with a non-finite value.
    pub fn attend_host(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        method: crate::cache::AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &[f32],
    ) -> Result<Vec<f32>> {
        let s = self.cfg.shape;
        let want = batch.plans.len() * s.kv_heads * s.group * s.dim;
        if q.len() != want {
            return Err(CudaError::invalid(
                "queries",
                format!(
                    "{} values (want [{}][Hq][D] = {want})",
                    q.len(),
                    batch.plans.len()
                ),
            ));
        }
        if let Some(x) = q.iter().find(|x| !x.is_finite()) {
            return Err(CudaError::invalid("queries", format!("{x} is not finite")));
        }
        let bytes = want * 4;
        if self
            .staging
            .as_ref()
            .is_none_or(|(_, cap)| *cap < 2 * bytes)
        {
            self.sync()?;
            self.staging = Some((DevBuf::new(2 * bytes, "attend staging")?, 2 * bytes));
        }
        let base = self.staging.as_ref().map_or(0, |(b, _)| b.ptr);
        self.sync()?;
        // SAFETY: the staging buffer holds 2·bytes, only this stream uses it, and the stream is
        // idle (synchronised above); the copy is ordered before the attend's kernels.
        unsafe { stream_upload(base, q, self.stream.cu_stream(), "memcpy_htod queries") }?;
        let qr = crate::cache::QueryRows {
            q: base,
            dtype: crate::cache::KvDtype::F32,
        };
        self.attend(batch, layer, method, params, &qr, base + bytes as u64)?;
        self.sync()?;
        let mut out = vec![0f32; want];
        // SAFETY: `out` has `want` f32 slots; the source holds as many; synchronous copy.
        unsafe { result::memcpy_dtoh_sync(&mut out, base + bytes as u64) }
            .map_err(drv("memcpy_dtoh outputs"))?;
        Ok(out)
    }

    /// After an attend (waits for the stream): session `b`'s depths `[Hkv][D]` (of the last
    /// planned method), scores `[Hkv][G][n]` and each query head's winners, sorted. For tests
    /// and debugging; the step itself never reads back.
    pub fn debug_readback(&self, batch: &AppendBatch, b: usize) -> Result<AttendDebug> {
        self.sync()?;
        let s = self.cfg.shape;
        let (hkv, g, d, hq) = (s.kv_heads, s.group, s.dim, s.kv_heads * s.group);
        let p = batch.plans.get(b).ok_or_else(|| {
            CudaError::invalid("batch index", format!("{b} of {}", batch.plans.len()))
        })?;
        let n = p.end_token();
        // Session b's rows only (the score buffer holds max_batch · Hq · max_tokens).
        let depths: Vec<u8> = self.work.depths.read_at(b * hkv * d, hkv * d)?;
        let mt = self.cfg.pages.max_tokens;
        let scores: Vec<f32> = self.work.scores.read_at(b * hq * mt, hq * mt)?;
        let mk = self.cfg.max_k;
        let winners: Vec<u32> = self.work.winners.read_at(b * hq * mk, hq * mk)?;
        let counts: Vec<u32> = self.work.counts.read_at(b * hq, hq)?;
        let mut sc = Vec::with_capacity(hq * n);
        for r in 0..hq {
            sc.extend_from_slice(&scores[r * mt..r * mt + n]);
        }
        let win = (0..hq)
            .map(|r| {
                let mut v = winners[r * mk..r * mk + counts[r] as usize].to_vec();
                v.sort_unstable();
                v
            })
            .collect();
        let _ = g;
        Ok(AttendDebug {
            depths,
            scores: sc,
            winners: win,
        })
    }

    /// Waits for the stream, then the mean plan bits per (session, KV head) of every
    /// GPU-planned attend (Fathom, SparQ) since the cache was made, and how many plans that is.
    pub fn plan_bits(&self) -> Result<(f64, u64)> {
        self.sync()?;
        let v: Vec<f32> = self.work.bits_acc.read(1)?;
        let n = self.plans_counted;
        Ok((if n > 0 { v[0] as f64 / n as f64 } else { 0.0 }, n))
    }

    /// Waits for the stream, then the union rows fetched and how many of them the HBM row
    /// cache served, summed over every attend since the cache was made.
    pub fn row_counters(&self) -> Result<RowCounters> {
        self.sync()?;
        let v: Vec<u64> = self.work.counters.read(2)?;
        Ok(RowCounters {
            rows: v[0],
            hits: v[1],
        })
    }

    /// Waits for the stream, then how the query-head rows of every attend since the cache was
    /// made took their top-k: by the filtered select, or by falling back to the score path
    /// after their filter failed.
    pub fn select_counters(&self) -> Result<SelectCounters> {
        self.sync()?;
        let v: Vec<u64> = self.work.counters.read(4)?;
        Ok(SelectCounters {
            filtered: v[2],
            fallbacks: v[3],
        })
    }

    /// Sets how attends take each query head's top-k ([`crate::cache::SelectPath`],
    /// docs/SPEC.md §5 "Selection without a score array"). With
    /// [`SelectPath::Filtered`](crate::cache::SelectPath::Filtered), a row with enough middle
    /// tokens filters its scan by an estimate left by its previous attend and keeps only the
    /// tokens that pass; the winners are exactly those of the score path (a row whose filter
    /// passes fewer than k tokens, or too many, falls back to it within the same attend). The
    /// default is [`SelectPath::Scores`](crate::cache::SelectPath::Scores).
    ///
    /// # Errors
    /// A driver failure clearing the rows' modes (when switching to the score path).
    pub fn set_select_path(&mut self, path: crate::cache::SelectPath) -> Result<()> {
        self.not_capturing("set_select_path")?;
        if path == crate::cache::SelectPath::Scores && self.select != path {
            // Every row back on the score path: the kernels that skip filtered rows read
            // these, and nothing writes them while the setting is off.
            let w = &self.work;
            let bytes = self.cfg.max_batch * self.cfg.shape.kv_heads * self.cfg.shape.group * 4;
            // SAFETY: the modes hold max_batch·Hq u32.
            unsafe { result::memset_d8_async(w.mode.ptr, 0, bytes, self.stream.cu_stream()) }
                .map_err(drv("memset select modes"))?;
        }
        if self.select != path {
            self.settings += 1;
        }
        self.select = path;
        Ok(())
    }

    /// The setting of [`PagedCache::set_select_path`].
    pub fn select_path(&self) -> crate::cache::SelectPath {
        self.select
    }

    /// Splits each attend's KV heads into `groups` head groups of `⌈Hkv / groups⌉` heads (the
    /// last may hold fewer): the cache's stream scans group `i + 1` while a second stream runs
    /// group `i`'s top-k, union, row fetch and partial attention, so the scan's plane reads
    /// keep the link busy while the kernels that do not read it run (docs/SPEC.md §6.1). The
    /// outputs are the same bits for every setting: each head's launches are the same, only
    /// their order across heads changes. Dense attends stay one group. `1` is the default.
    ///
    /// # Errors
    /// `groups` of 0 or more than the model's KV heads.
    pub fn set_attend_groups(&mut self, groups: usize) -> Result<()> {
        self.not_capturing("set_attend_groups")?;
        crate::cache::check_attend_groups(&self.cfg, groups)?;
        crate::cache::check_host_gather(&self.cfg, self.host_gather(), groups)?;
        if self.groups != groups {
            self.settings += 1;
        }
        self.groups = groups;
        Ok(())
    }

    /// The setting of [`PagedCache::set_attend_groups`].
    pub fn attend_groups(&self) -> usize {
        self.groups
    }

    /// Plane words per global load of the scan (docs/SPEC.md §6.1; a setting so that it is
    /// settled by measurement): 1 (the default) reads one 8-byte word of a plane run per load,
    /// 2 two adjacent words (16 bytes, aligned) where a page holds an even number of 64-token
    /// blocks, half the load instructions for the same bytes. The scores are the same bits
    /// either way (the same words reach the same shared memory).
    ///
    /// # Errors
    /// Any value but 1 or 2.
    pub fn set_scan_vector_words(&mut self, words: u32) -> Result<()> {
        self.not_capturing("set_scan_vector_words")?;
        crate::cache::check_scan_vector_words(words)?;
        if self.scan_vec != words {
            self.settings += 1;
        }
        self.scan_vec = words;
        Ok(())
    }

    /// The setting of [`PagedCache::set_scan_vector_words`].
    pub fn scan_vector_words(&self) -> u32 {
        self.scan_vec
    }

    /// Splits each attend's GPU time by stage ([`AttendStage`]: plan, scan, top-k, union,
    /// row fetch, attention) with a CUDA event on the cache's stream after each stage, read by
    /// [`PagedCache::stage_times`]: a per-stage profile of real decode steps without a
    /// profiler. Off by default. The events serialize nothing (one stream), but each costs a
    /// launch slot, so time whole steps with it off. Attends inside a graph capture (the
    /// cache's or a caller's that took in its stream), with more than one head group, or past
    /// [`MAX_STAGE_MARKS`] marks since the last read are counted as untimed instead. A change
    /// of the setting drops the marks not yet read. The outputs are the same bits either way.
    pub fn set_stage_timing(&mut self, on: bool) {
        if on != self.stage_timing {
            // A change starts afresh: no marks of the other setting's attends are read.
            self.stage_marks.clear();
            self.stage_untimed = 0;
        }
        self.stage_timing = on;
    }

    /// The setting of [`PagedCache::set_stage_timing`].
    pub fn stage_timing(&self) -> bool {
        self.stage_timing
    }

    /// The stage times of the attends since the last call (or since the cache was made), and
    /// a fresh start for the next: waits for the cache's stream, then reads each pair of
    /// consecutive marks of an attend.
    ///
    /// # Errors
    /// A driver failure waiting for the stream or reading an event.
    pub fn stage_times(&mut self) -> Result<AttendStages> {
        self.sync()?;
        let mut out = AttendStages {
            untimed: self.stage_untimed,
            ..AttendStages::default()
        };
        let mut prev: Option<&CudaEvent> = None;
        for (stage, e) in &self.stage_marks {
            let ms = match (stage, prev) {
                (AttendStage::Start, _) | (_, None) => 0.0,
                (_, Some(p)) => f64::from(p.elapsed_ms(e).map_err(drv("stage elapsed"))?),
            };
            out.add(*stage, ms);
            prev = Some(e);
        }
        self.stage_marks.clear();
        self.stage_untimed = 0;
        Ok(out)
    }

    /// Serves the row fetch's misses with `threads` CPU threads (docs/SPEC.md §6.1, "Host
    /// gather"; [`crate::host_gather`]): the fetch lists each record the row cache does not
    /// hold, the threads copy them into a pinned staging buffer, and the GPU reads it in
    /// order, instead of each record being a random read of mapped host memory. `0` (the
    /// default) turns it off. The outputs are the same bits either way (the same records reach
    /// the same rows). The threads spin on a mailbox while attends come (each uses a core),
    /// and poll it every 200 µs after 20 ms without one. Whether it pays is a property of the
    /// host (its IOMMU, cores and memory): on the lent H200's 16-vCPU guest, bringing every
    /// miss does not, while a split with [`PagedCache::set_host_gather_share`] at 50 % takes 5 %
    /// off the 1M step (`results/device/gather/split/README.md`); measure it with
    /// `offload-bench --host-gather 0,N --host-share 100,P`.
    ///
    /// # Errors
    /// HBM residency (the records are in HBM), head groups above 1, more than
    /// [`crate::cache::MAX_GATHER_THREADS`] threads, a change while a step is being captured,
    /// a pinned allocation or a thread that fails (typed); a driver failure waiting for the
    /// stream.
    pub fn set_host_gather(&mut self, threads: usize) -> Result<()> {
        crate::cache::check_host_gather(&self.cfg, threads, self.groups)?;
        if threads == self.host_gather() {
            return Ok(());
        }
        if self.capturing.is_some() {
            // Changing it drains the stream, which a capture forbids.
            return Err(CudaError::invalid(
                "host gather",
                "set while a decode step is being captured (set it before `capture`)",
            ));
        }
        // Drains the stream, then stops the old threads (a graph captured with them is stale).
        self.settings += 1;
        self.gather = None;
        if threads == 0 {
            return Ok(());
        }
        let s = self.cfg.shape;
        let cap = self.cfg.max_batch * s.kv_heads * self.work.umax;
        let rec_bytes = 4 * s.dim;
        let chunks = cap.div_ceil(crate::host_gather::GATHER_CHUNK);
        let zeroed = |bytes: usize, what: &'static str| -> Result<HostBuf> {
            let mut h = HostBuf::new(bytes, what)?;
            h.as_mut_bytes().fill(0);
            Ok(h)
        };
        let mailbox = zeroed(crate::host_gather::MAILBOX_WORDS * 4, "host-gather mailbox")?;
        let done = zeroed(chunks * 4, "host-gather marks")?;
        let list = zeroed(cap * 8, "host-gather list")?;
        let staging = zeroed(cap * rec_bytes, "host-gather staging")?;
        let gstate = DevBuf::zeroed(16, "host-gather state")?;
        let gdst = DevBuf::zeroed(cap * 4, "host-gather rows")?;
        // Each layer's records: in the page pool after the key sections, or their own pool.
        let records_at = self.layout.records_at() as usize;
        let bases = (0..s.layers)
            .map(|l| match (self.rec_pools.get(l), &self.pools[l]) {
                (Some(Mem::Host(r)), _) => Ok((r.ptr as usize, r.bytes)),
                (None, Mem::Host(p)) => Ok((
                    p.ptr as usize + records_at,
                    p.bytes.saturating_sub(records_at),
                )),
                _ => Err(CudaError::invalid(
                    "host gather",
                    "the K|V records are not in host memory",
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: the buffers have the sizes Shared::new asks for, are pinned (never moved),
        // and outlive the threads (GatherState drops them after joining); the bases are the
        // records pools' host mappings, which live as long as the cache.
        let shared = unsafe {
            crate::host_gather::Shared::new(
                mailbox.ptr as *const u32,
                done.ptr as *mut u32,
                list.ptr as *const u64,
                staging.ptr,
                cap,
                rec_bytes,
                bases,
            )
        };
        self.gather = Some(GatherState {
            threads: crate::host_gather::HostGather::start(shared, threads)?,
            mailbox,
            done,
            list,
            staging,
            gstate,
            gdst,
            cap,
            stream: self.stream.clone(),
        });
        Ok(())
    }

    /// The share of the row fetch's misses the host gather brings, in percent (1 to 100; 100,
    /// the default, is every miss): the others the fetch reads itself while the host threads
    /// copy, so the two reads (one bound by the IOMMU's translations, the other by the host's
    /// cores) run at once (docs/SPEC.md §6.1, "Host gather"). Which misses are the host's is a
    /// fixed hash of the union row's index. It takes effect while the gather is on, and the
    /// outputs are the same bits for every share.
    ///
    /// # Errors
    /// A share of 0 or above 100, or a change while a step is being captured (typed).
    pub fn set_host_gather_share(&mut self, percent: u32) -> Result<()> {
        crate::cache::check_host_gather_share(percent)?;
        if percent == self.gather_share {
            return Ok(());
        }
        if self.capturing.is_some() {
            return Err(CudaError::invalid(
                "host gather share",
                "set while a decode step is being captured (set it before `capture`)",
            ));
        }
        self.settings += 1;
        self.gather_share = percent;
        Ok(())
    }

    /// The setting of [`PagedCache::set_host_gather_share`], in percent.
    pub fn host_gather_share(&self) -> u32 {
        self.gather_share
    }

    /// The setting of [`PagedCache::set_host_gather`]: its threads, 0 when off.
    pub fn host_gather(&self) -> usize {
        self.gather.as_ref().map_or(0, |g| g.threads.threads())
    }

    /// What the host gather served since it was set, with the device's fault counts: listed
    /// records past the list's capacity and chunks whose marks did not come within 2 s (both
    /// 0 in a correct run; a nonzero count means those rows are wrong). `None` when off.
    ///
    /// # Errors
    /// A driver failure reading the device counters (waits for the stream).
    pub fn host_gather_stats(&self) -> Result<Option<crate::host_gather::HostGatherReport>> {
        let Some(g) = &self.gather else {
            return Ok(None);
        };
        self.sync()?;
        let mut st = [0u32; 4];
        // SAFETY: the state holds 4 u32; the stream is idle.
        unsafe { result::memcpy_dtoh_sync(&mut st, g.gstate.ptr) }
            .map_err(drv("read host-gather state"))?;
        Ok(Some(crate::host_gather::HostGatherReport {
            threads: g.threads.threads(),
            served: g.threads.stats(),
            overflows: u64::from(st[2]),
            timeouts: u64::from(st[3]),
        }))
    }

    /// Captures one decode step into a CUDA graph: `step` is called once, on this cache, and
    /// must only [`PagedCache::append`] and [`PagedCache::attend`] (device pointers; the model's
    /// own kernels may run on [`PagedCache::stream`] too) for `batch`, a decode batch (one
    /// token per session). While capturing, the scan's grid covers `max_tokens`, so the graph
    /// stays valid as the sessions grow. Replay it with [`PagedCache::replay`] after each
    /// [`PagedCache::reserve`] of the same sessions, with this step's K, V and queries written
    /// to the same device buffers.
    ///
    /// # Errors
    /// A batch that is not a decode batch; whatever `step` returns; a failed capture.
    pub fn capture(
        &mut self,
        batch: &AppendBatch,
        step: impl FnOnce(&mut PagedCache) -> Result<()>,
    ) -> Result<DecodeGraph> {
        self.begin_capture(batch)?;
        let ran = step(self);
        let graph = self.end_capture();
        ran?;
        graph
    }

    /// [`PagedCache::capture`] in two calls, for a caller whose step is not a closure over
    /// the cache (a model whose forward owns it): from here until [`PagedCache::end_capture`]
    /// everything queued on [`PagedCache::stream`] is recorded, not run, and attends size
    /// their grids for `max_tokens`. Nothing in between may wait for the stream, and the
    /// calls that would change what the graph reads (a setting, a calibration, a `prepare`, a
    /// new session) are refused by name. The graph replays only on this cache, and only while
    /// its settings are those of the capture ([`PagedCache::check_graph`]).
    ///
    /// # Errors
    /// A batch that is not the current decode batch; a capture already under way; a driver
    /// failure (nothing is left capturing).
    pub fn begin_capture(&mut self, batch: &AppendBatch) -> Result<()> {
        if batch.plans.iter().any(|p| p.tokens != 1) || batch.step != self.step {
            return Err(CudaError::invalid(
                "capture",
                "capture needs the current decode batch (one token per session)",
            ));
        }
        if self.capturing.is_some() {
            return Err(CudaError::invalid(
                "capture",
                "a capture is already under way",
            ));
        }
        self.sync()?;
        self.stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(drv("begin_capture"))?;
        self.fixed_grids = true;
        self.capturing = Some((self.plans_counted, batch.sessions(), self.settings));
        self.ledger.begin_capture();
        Ok(())
    }

    /// Ends the capture [`PagedCache::begin_capture`] started and instantiates the graph.
    ///
    /// # Errors
    /// No capture under way; a failed capture (a launch that may not be captured, a wait for
    /// the stream in between) or nothing captured.
    pub fn end_capture(&mut self) -> Result<DecodeGraph> {
        let (plans0, sessions, settings0) = self
            .capturing
            .take()
            .ok_or_else(|| CudaError::invalid("capture", "no capture under way"))?;
        let graph = self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        self.fixed_grids = false;
        // The capture is over whatever follows: the layers it appended go with its graph.
        let appended = self.ledger.end_capture();
        // Nothing ran while capturing: the plans are counted when the graph is replayed.
        let plans = self.plans_counted - plans0;
        self.plans_counted = plans0;
        let graph = graph
            .map_err(drv("end_capture"))?
            .ok_or_else(|| CudaError::invalid("capture", "the step launched nothing"))?;
        if self.settings != settings0 {
            return Err(CudaError::invalid(
                "capture",
                "a setting of the cache changed during the capture: capture the step again",
            ));
        }
        Ok(DecodeGraph {
            graph,
            cache: self.id,
            sessions,
            plans,
            settings: self.settings,
            appended,
        })
    }

    /// Replays a captured decode step for `batch`, the current reserve of the same sessions
    /// (one token each), on the cache's stream.
    ///
    /// # Errors
    /// A stale batch, or one whose sessions or token counts differ from the captured one's; a
    /// graph captured before a setting changed (it would run the old step); a session whose
    /// earlier rows no append wrote in a layer the graph appends.
    pub fn replay(&mut self, batch: &AppendBatch, graph: &DecodeGraph) -> Result<()> {
        self.check_graph(graph)?;
        if batch.step != self.step
            || batch.sessions() != graph.sessions
            || batch.plans.iter().any(|p| p.tokens != 1)
        {
            return Err(CudaError::invalid(
                "replay",
                "the graph replays the decode step of the sessions it was captured for, after their current reserve",
            ));
        }
        self.ledger.check_replay(batch, &graph.appended, "replay")?;
        graph.graph.launch().map_err(drv("graph launch"))?;
        self.ledger.replayed(batch, &graph.appended);
        self.plans_counted += graph.plans;
        Ok(())
    }

    /// Whether `graph` may still be replayed on this cache: refused when a setting changed
    /// since its capture (its kernels were recorded with other settings, and buffers it reads,
    /// such as the host gather's or a replaced calibration's, may be freed). A caller that
    /// reserves before [`PagedCache::replay`] checks this first, so a stale graph changes
    /// nothing.
    ///
    /// # Errors
    /// The stale graph.
    pub fn check_graph(&self, graph: &DecodeGraph) -> Result<()> {
        if graph.cache != self.id {
            return Err(CudaError::invalid(
                "replay",
                "the graph was captured on another cache (its kernels read that cache's buffers)",
            ));
        }
        if graph.settings != self.settings {
            return Err(CudaError::invalid(
                "replay",
                "a setting of the cache changed since the capture (select path, head groups, scan loads, host gather, a calibration, a static method's depths): capture the step again",
            ));
        }
        Ok(())
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

    /// One layer's whole pool as host bytes in [`PagedLayout`]'s page layout (borrowed in host
    /// residency, read back from HBM; the split residency's two pools interleaved page by page).
    fn pool_bytes(&self, layer: usize) -> Result<std::borrow::Cow<'_, [u8]>> {
        let pool = self.pools.get(layer).ok_or_else(|| {
            CudaError::invalid("layer", format!("{layer} of {}", self.pools.len()))
        })?;
        fn read(m: &Mem) -> Result<std::borrow::Cow<'_, [u8]>> {
            Ok(match m {
                Mem::Host(h) => std::borrow::Cow::Borrowed(h.as_bytes()),
                Mem::Dev(d) => std::borrow::Cow::Owned(d.read::<u8>(d.bytes)?),
            })
        }
        let Some(recs) = self.rec_pools.get(layer) else {
            return read(pool);
        };
        let (kb, rb) = (read(pool)?, read(recs)?);
        Ok(std::borrow::Cow::Owned(self.layout.join_split(&kb, &rb)?))
    }

    /// `session`'s length, after checking that `layer` exists and that appends wrote every
    /// row of the session in it ([`crate::cache::StepLedger`]).
    fn check_whole(&self, session: SessionId, layer: usize, what: &'static str) -> Result<usize> {
        let n = self.sessions.len(session)?;
        if layer >= self.cfg.shape.layers {
            return Err(CudaError::invalid(
                "layer",
                format!("{layer} (the cache has {} layers)", self.cfg.shape.layers),
            ));
        }
        self.ledger.check_written(session, layer, n, what)?;
        Ok(n)
    }

    /// Waits for the stream, then one layer's store of `session` in `fathom-store`'s layout
    /// (what the tests compare with `KeyStore` bit for bit).
    pub fn export(&self, session: SessionId, layer: usize) -> Result<PagedExport> {
        let n = self.check_whole(session, layer, "export")?;
        self.sync()?;
        let pool = self.pool_bytes(layer)?;
        export_pool(&self.layout, &pool, self.sessions.page_table(session)?, n)
    }

    /// Waits for the stream, then one layer's PCA index of `session` in `fathom-store`'s
    /// layout (what the tests compare with a `KeyStore` in the basis bit for bit).
    ///
    /// # Errors
    /// A cache without the PCA index, a layer or session that does not exist.
    pub fn export_pca(&self, session: SessionId, layer: usize) -> Result<PagedExport> {
        let pca = self.pca_pools.get(layer).ok_or_else(|| {
            CudaError::invalid(
                "export_pca",
                format!("layer {layer}: the cache keeps no PCA index there"),
            )
        })?;
        if self.calib.pca[layer].is_none() {
            return Err(CudaError::invalid(
                "export_pca",
                format!("layer {layer}: no PCA basis was loaded, so its index was never written"),
            ));
        }
        let n = self.check_whole(session, layer, "export_pca")?;
        self.sync()?;
        let keys: std::borrow::Cow<'_, [u8]> = match pca {
            Mem::Host(h) => std::borrow::Cow::Borrowed(h.as_bytes()),
            Mem::Dev(d) => std::borrow::Cow::Owned(d.read::<u8>(d.bytes)?),
        };
        let records = vec![0u8; self.layout.pages() * self.layout.split_page_bytes().1 as usize];
        let pool = self.layout.join_split(&keys, &records)?;
        export_pool(&self.layout, &pool, self.sessions.page_table(session)?, n)
    }

    /// Waits for the stream, then one layer's K|V records of `session`,
    /// `[head][token][K | V]` bf16.
    pub fn records(&self, session: SessionId, layer: usize) -> Result<Vec<bf16>> {
        let n = self.check_whole(session, layer, "records")?;
        self.sync()?;
        let pool = self.pool_bytes(layer)?;
        records_pool(&self.layout, &pool, self.sessions.page_table(session)?, n)
    }
}

/// Copies `ranges` (offset, length) of one page at byte `src` of `mem` to the page at `dst`:
/// on the host for pinned memory, stream-ordered on the device for HBM.
fn copy_ranges(
    mem: &mut Mem,
    stream: &CudaStream,
    src: usize,
    dst: usize,
    ranges: &[(usize, usize)],
) -> Result<()> {
    match mem {
        Mem::Host(hb) => {
            let b = hb.as_mut_bytes();
            for &(off, len) in ranges {
                b.copy_within(src + off..src + off + len, dst + off);
            }
        }
        Mem::Dev(db) => {
            for &(off, len) in ranges {
                // SAFETY: both ranges lie inside the pool (pages < its page count) and are
                // different pages; stream-ordered before any later append.
                unsafe {
                    result::memcpy_dtod_async(
                        db.ptr + (dst + off) as u64,
                        db.ptr + (src + off) as u64,
                        len,
                        stream.cu_stream(),
                    )
                }
                .map_err(drv("memcpy_dtod page copy"))?;
            }
        }
    }
    Ok(())
}

/// A captured decode step ([`PagedCache::capture`]).
pub struct DecodeGraph {
    graph: cudarc::driver::CudaGraph,
    /// The cache that captured it ([`PagedCache`]'s id).
    cache: u64,
    sessions: Vec<SessionId>,
    plans: u64,
    /// The cache's settings generation at the capture (a change since makes it stale).
    settings: u64,
    /// The layers the step appends (a replay writes their rows for the batch it replays).
    appended: Vec<bool>,
}

impl std::fmt::Debug for DecodeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeGraph")
            .field("sessions", &self.sessions)
            .finish_non_exhaustive()
    }
}
