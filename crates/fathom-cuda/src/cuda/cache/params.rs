//! The kernels' parameters: the `#[repr(C)]` structs each launch passes by value (mirrored in
//! `kernels/*.cu`, sizes asserted on this side), and the launch constants the kernels share.

#[allow(unused_imports)]
use super::*;

/// The append kernels' source.
pub(crate) const APPEND_SRC: &str = include_str!("../../../kernels/append.cu");
/// The attend kernels' source: the shared structs and helpers, then one file per stage, in
/// pipeline order (each stage uses the `#define`s and helpers of those before it).
pub(crate) const ATTEND_SRC: &str = concat!(
    include_str!("../../../kernels/attend/shared.cuh"),
    include_str!("../../../kernels/attend/scan.cu"),
    include_str!("../../../kernels/attend/select.cu"),
    include_str!("../../../kernels/attend/fetch.cu"),
    include_str!("../../../kernels/attend/attention.cu"),
);
pub(super) const PLAN_SRC: &str = include_str!("../../../kernels/plan.cu");
/// Threads of the per-row top-k kernels and the union (`TK` in kernels/attend/scan.cu).
pub(super) const TOPK_THREADS: u32 = 1024;
/// Blocks per scan CTA (`BPC` in kernels/attend/scan.cu): 8 threads per 64-token block.
pub(super) const SCAN_BLOCKS: usize = 32;
/// Level-1 bins of the top-k histogram (`HBINS` in kernels/attend/scan.cu).
pub(super) const HIST_BINS: usize = 1024;
/// Middle tokens per CTA of `paged_topk_collect` (`ELEMS` in kernels/attend/select.cu).
pub(super) const COLLECT_ELEMS: usize = 4096;
/// Threads per channel of `append_quant` (`QS` in append.cu).
pub(super) const APPEND_QUARTERS: usize = 4;
/// Union rows per CTA of the fetch (`FR` in kernels/attend/fetch.cu).
pub(super) const FETCH_ROWS: usize = 64;
/// CTAs of `paged_gather_copy`, each looping over chunks: one poller per CTA.
pub(super) const GATHER_COPY_CTAS: usize = 128;
/// Threads of `paged_gather_list`'s CTAs, one union row each (kernels/attend/fetch.cu `GATHER_NT`).
pub(super) const GATHER_LIST_THREADS: usize = 256;
/// Threads of the partial attention (`NT` in kernels/attend/attention.cu); its splits span multiples of
/// `GRAN` rows.
pub(super) const ATTN_THREADS: u32 = 128;
pub(super) const ATTN_GRAN: usize = 16;
/// Splits of the partial attention over one (session, KV head): of the union (at most
/// [`SPARSE_SPLITS`]) or, when dense, of every token ([`DENSE_SPLITS`]). A union of ~1.3k
/// rows (k = 512, G = 4) then gives 42 CTAs per KV head of 32 rows each.
pub(super) const SPARSE_SPLITS: usize = 64;
pub(super) const DENSE_SPLITS: usize = 256;
// `paged_attn_combine` stages at most COMBINE_MAX = 256 splits (kernels/attend/attention.cu).
const _: () = assert!(SPARSE_SPLITS <= DENSE_SPLITS && DENSE_SPLITS <= 256);
/// Rows per CTA of `read_rows` (`READ_ROWS` of append.cu).
pub(super) const READ_ROWS: usize = 8;
/// Filtered-select candidates per row, per winner of `max_k`: 4× the FUSE_TARGET · k = 6·k that
/// the estimate aims at (kernels/attend/shared.cuh), so a row overflows only when four times as many tokens
/// pass its filter as the previous attend predicted. Chosen with FUSE_TARGET on the
/// consecutive decode positions of a real capture (`results/fidelity/filtered-select/README.md`: no
/// overflow at 24·k; 0.3 % at 16·k).
pub(super) const FUSE_CAP_PER_K: usize = 24;

/// `struct AppendDesc` of append.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct AppendDesc {
    pub(super) slot: u32,
    pub(super) n0: u32,
    pub(super) m: u32,
    pub(super) row0: u32,
}
const _: () = assert!(std::mem::size_of::<AppendDesc>() == 16);

/// `struct PoolGeom` of append.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct PoolGeom {
    pub(super) page_bytes: u64,
    pub(super) run_bytes: u32,
    pub(super) scale_pad: u32,
    /// Device address of page 0's K|V records: the pool's own record section, or the
    /// records pool of the split residency.
    pub(super) recs: u64,
    pub(super) rec_page_bytes: u64,
    pub(super) page_tokens: u32,
    pub(super) max_pages: u32,
    pub(super) heads: u32,
    pub(super) layers: u32,
}
const _: () = assert!(std::mem::size_of::<PoolGeom>() == 48);

/// [`PoolGeom`]'s 32-bit fields, converted once when the cache is made: each with a check
/// that names the field, before any allocation, so no `as u32` can wrap a page geometry into
/// silently wrong addresses. ([`CacheConfig::validate`] bounds the page's tokens by
/// [`crate::cache::MAX_PAGE_TOKENS`]; this is where every such bound is enforced at once.)
#[derive(Debug, Clone, Copy)]
pub(super) struct Geom32 {
    pub(super) run_bytes: u32,
    pub(super) scale_pad: u32,
    pub(super) page_tokens: u32,
    pub(super) max_pages: u32,
    pub(super) heads: u32,
    pub(super) layers: u32,
}

impl Geom32 {
    pub(super) fn new(
        lay: &PagedLayout,
        max_pages: usize,
        shape: crate::config::ModelShape,
    ) -> Result<Self> {
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

/// `struct TableGeom` of append.cu and kernels/attend/scan.cu: the block tables' page stride and the
/// device addresses of page 0's landmark and Quest tables (0: none).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct TableGeom {
    pub(super) page_bytes: u64,
    pub(super) landmark: u64,
    pub(super) quest: u64,
}
const _: () = assert!(std::mem::size_of::<TableGeom>() == 24);

// SAFETY: plain `#[repr(C)]` data of integers, passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for TableGeom {}

/// Threads per CTA of `paged_table_scan` (`TS_NT` in kernels/attend/scan.cu); its groups per CTA are
/// [`crate::cache::table_scan_groups`] (`-DTS_G`).
pub(super) const TABLE_SCAN_THREADS: u32 = 128;

/// `struct AttendGeom` of kernels/attend/shared.cuh.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct AttendGeom {
    pub(super) sink: u32,
    pub(super) local: u32,
    pub(super) k: u32,
    pub(super) max_k: u32,
    pub(super) max_tokens: u64,
    pub(super) depth_stride: u32,
    pub(super) dense: u32,
    pub(super) scale: f32,
    pub(super) umax: u32,
    pub(super) cache_rows: u32,
    pub(super) layer: u32,
    pub(super) nsplit: u32,
    pub(super) fuse_min: u32,
    pub(super) fcap: u32,
    pub(super) keep_scores: u32,
    /// First KV head of the launch's head group ([`crate::cache::CacheOptions::attend_groups`]).
    pub(super) h0: u32,
    /// Percent of the fetch's misses the host gather brings ([`crate::cache::CacheOptions::host_gather_threads`],
    /// [`crate::cache::CacheOptions::host_gather_share`]); 0: off.
    pub(super) host_gather: u32,
}
const _: () = assert!(std::mem::size_of::<AttendGeom>() == 72);

// SAFETY: plain `#[repr(C)]` data of integers and one f32, passed by value.
unsafe impl cudarc::driver::DeviceRepr for AttendGeom {}
// SAFETY: `#[repr(C)]` of five u32 (no padding), matching `struct SelectOutParams` of
// kernels/attend/select.cu field for field.
unsafe impl cudarc::driver::DeviceRepr for crate::cache::SelectOutParams {}
