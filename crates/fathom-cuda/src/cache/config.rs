//! What a cache is made with (docs/SPEC.md §6.1): its shape, pages and limits ([`CacheConfig`]),
//! the element types of the rows a model appends, and the K/V rows themselves.

#[allow(unused_imports)]
use super::*;

/// The page size the measurement on the H200 supports (`results/device/engine/gather-sweep.md`):
/// the zero-copy gather moves 51.4 GB/s, 0.93× a pinned memcpy in the same run, on runs of
/// 256 bytes and more (19.5 GB/s at 64 B, 37.2 at 128 B), and the shortest plane run of a page
/// (one plane, `P/8` bytes) is 256 B at `P = 2048`. Longer pages only waste the partial last
/// page of each session.
pub const DEFAULT_PAGE_TOKENS: usize = 2048;

/// Sink plus local rows an attend may keep (with `G·max_k` it sizes the union lists).
pub const MAX_SINK_LOCAL: usize = 64;

/// Element type of the K/V rows a model appends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// IEEE f32.
    F32,
    /// IEEE f16.
    F16,
    /// bfloat16.
    Bf16,
    /// 32-bit signed integers: the selection [`crate::api::KvCache::select`] writes (logical
    /// positions and lengths); never keys, values or queries.
    I32,
}

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 | KvDtype::I32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    /// The code the kernels take (`0` f32, `1` f16, `2` bf16; `3` for i32, which no kernel
    /// reads as K, V or queries: the checks refuse it there).
    pub fn code(self) -> u32 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
            KvDtype::Bf16 => 2,
            KvDtype::I32 => 3,
        }
    }

    /// Whether K, V and queries may have this dtype (f32, f16, bf16).
    pub fn is_float(self) -> bool {
        !matches!(self, KvDtype::I32)
    }
}

/// One layer's K and V rows in device memory, `[rows][Hkv][D]` each, after RoPE and any
/// QK-norm: both of one dtype ([`KvDtype`]), each holding at least `rows · Hkv · D` elements
/// (checked before any launch: [`crate::cache::check_rows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvRows<'a> {
    /// The keys.
    pub k: crate::memory::DeviceView<'a>,
    /// The values.
    pub v: crate::memory::DeviceView<'a>,
    /// Rows (tokens) of both.
    pub rows: usize,
}

/// Groups per CTA of the block-table scan (`-DTS_G` of kernels/attend/scan.cu's `paged_table_scan`): the
/// most, a power of two and at most 64, whose staged rows (Quest's `2·D` fp16 and one 16-byte
/// pad each) fit the 48 KiB of static shared memory beside the queries `[G][D + 1]` f32 and
/// the histogram `[G][1024]` u32.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the kernels' compile options only
pub(crate) fn table_scan_groups(dim: usize, group: usize) -> usize {
    const STATIC_SMEM: usize = 48 << 10;
    let fixed = group * (dim + 1) * 4 + group * 1024 * 4 + 64;
    let row = (2 * dim / 8 + 1) * 16;
    let mut t = 64;
    while t > 1 && fixed + t * row > STATIC_SMEM {
        t /= 2;
    }
    t
}

/// The shape and capacity of a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// The model's attention shape (`L`, `Hkv`, `G`, `D`).
    pub shape: ModelShape,
    /// Page size, pool size (per layer), session slots and tokens per session.
    pub pages: PageConfig,
    /// Most sessions in one append or attend batch (sizes the launch descriptors).
    pub max_batch: usize,
    /// Largest top-k per query head an attend may ask for (sizes the winner lists).
    pub max_k: usize,
    /// Slots of the HBM row cache per (session, layer, KV head), direct-mapped by token: a
    /// union row found there is not fetched over the link again (0: no row cache). Costs
    /// `max_sessions · L · Hkv · row_cache · (4D + 8)` bytes of HBM. Sizing: on real decode
    /// steps the hit rate follows slots per union row (a union has at most
    /// `sink + local + G·k` rows), about 38–56 % at 0.9×, 77–85 % at 3.6× and 91–95 % at 29×
    /// (SmolLM2 and Gemma 3, `results/downstream/rowcache/README.md`); queries without
    /// step-to-step locality (random weights) hit 5–10 % at 4×.
    pub row_cache: usize,
    /// Where the page pools live: pinned, mapped host memory (the offloaded cache, read over
    /// the link) or HBM (the in-GPU comparison point).
    pub residency: crate::config::Residency,
    /// Whether the cache keeps a second index of every session's keys in the calibration PCA
    /// basis (docs/SPEC.md §6.1, "The PCA index"), which `loki:R` scans (Loki in its own basis,
    /// §4): each page's planes and scales once more, `PagedLayout::split_page_bytes().0` bytes
    /// per page and layer, where the first index lives; the K|V records are shared. A layer's
    /// basis ([`fathom_plan::scanner::HeadCalib::loki`]) is loaded before its first append.
    pub pca_index: bool,
    /// Whether the cache keeps the block tables that `landmark` and `quest` read (docs/SPEC.md
    /// §6.1, "Block tables"): per page and KV head the fp16 mean key of every 8 tokens and the
    /// fp16 channel bounds of every 16, `P·D/4` bytes each, where the index lives.
    pub block_tables: bool,
    /// What backs the pools in pinned host memory ([`crate::HostPages`]; docs/SPEC.md §6.1,
    /// "Host pages"): the driver's pages, or 2 MiB transparent huge pages registered with the
    /// driver, which the union fetch's random record reads translate with one GPU page-table
    /// entry per 4096 records.
    pub host_pages: crate::HostPages,
    /// How attends run: the select path, head groups, scan loads, the host gather and stage
    /// timing ([`CacheOptions`]); fixed when the cache is made.
    pub options: CacheOptions,
}

/// How a cache's attends run, fixed when it is made and checked once by
/// [`CacheConfig::validate`] (docs/SPEC.md §6.1). Every setting gives the same output bits;
/// they trade launches, streams and host threads for time, and are settled by measurement
/// (`offload-bench` times them).
///
/// ```
/// use fathom_cuda::cache::{CacheOptions, SelectPath};
/// let opts = CacheOptions { attend_groups: 2, ..CacheOptions::default() };
/// assert_eq!(opts.select, SelectPath::Scores);
/// assert_eq!((opts.scan_vector_words, opts.host_gather_threads, opts.host_gather_share), (1, 0, 100));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheOptions {
    /// How attends take each query head's top-k ([`SelectPath`], docs/SPEC.md §5 "Selection
    /// without a score array"). With [`SelectPath::Filtered`], a row with enough middle tokens
    /// filters its scan by an estimate left by its previous attend and keeps only the tokens
    /// that pass; the winners are exactly those of the score path (a row whose filter passes
    /// fewer than k tokens, or too many, falls back to it within the same attend).
    pub select: SelectPath,
    /// Head groups per attend: the cache's stream scans group `i + 1` while a second stream
    /// runs group `i`'s top-k, union, row fetch and partial attention, so the scan's plane
    /// reads keep the link busy while the kernels that do not read it run. `1 ≤ groups ≤ Hkv`;
    /// dense attends stay one group.
    pub attend_groups: usize,
    /// Plane words per global load of the scan: 1 (one 8-byte word of a plane run per load)
    /// or 2 (two adjacent words, 16 bytes aligned, where a page holds an even number of
    /// 64-token blocks: half the load instructions for the same bytes).
    pub scan_vector_words: u32,
    /// CPU threads that serve the row fetch's misses (docs/SPEC.md §6.1, "Host gather";
    /// [`crate::host_gather`]); 0: off. The threads spin on a mailbox while attends come (each
    /// uses a core), and poll it every 200 µs after 20 ms without one. Whether it pays is a
    /// property of the host (its IOMMU, cores and memory): on the lent H200's 16-vCPU guest a
    /// split at 50 % takes 5 % off the 1M step, bringing every miss does not
    /// (`results/device/gather/split/README.md`). Not with HBM residency or head groups.
    pub host_gather_threads: usize,
    /// Percent of the misses the host gather brings (1 to 100) while the fetch reads the
    /// others itself, at once. Which misses are the host's is a fixed hash of the union row.
    pub host_gather_share: u32,
    /// Splits each attend's GPU time by stage ([`crate::cache::AttendStage`]) with a CUDA
    /// event after each stage, read by the cache's `stage_times`: a per-stage profile of real
    /// decode steps without a profiler. Each event costs a launch slot, so time whole steps
    /// with it off. Attends inside a graph capture, with more than one head group, or past
    /// [`crate::cache::MAX_STAGE_MARKS`] marks since the last read are counted as untimed.
    pub stage_timing: bool,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            select: SelectPath::Scores,
            attend_groups: 1,
            scan_vector_words: 1,
            host_gather_threads: 0,
            host_gather_share: 100,
            stage_timing: false,
        }
    }
}

impl CacheConfig {
    /// This configuration with the PCA index and the block tables that `methods` read, and
    /// without those they do not ([`crate::Method::reads_pca_index`],
    /// [`crate::Method::reads_block_tables`]).
    ///
    /// ```
    /// use fathom_cuda::cache::{CacheConfig, DEFAULT_PAGE_TOKENS};
    /// use fathom_cuda::pages::PageConfig;
    /// use fathom_cuda::{Method, ModelShape, Residency};
    /// let cfg = CacheConfig {
    ///     shape: ModelShape { layers: 2, kv_heads: 2, group: 4, dim: 128 },
    ///     pages: PageConfig { page_tokens: DEFAULT_PAGE_TOKENS, pages: 16, max_sessions: 2, max_tokens: 8192 },
    ///     max_batch: 2,
    ///     max_k: 256,
    ///     row_cache: 0,
    ///     residency: Residency::Host,
    ///     pca_index: false,
    ///     block_tables: false,
    ///     host_pages: fathom_cuda::HostPages::Driver,
    ///     options: Default::default(),
    /// };
    /// let m = [Method::parse("fathom:48", 128)?, Method::parse("loki:32", 128)?];
    /// let served = cfg.serving(&m);
    /// assert!(served.pca_index && !served.block_tables);
    /// assert!(served.layer_pool_bytes()? > cfg.layer_pool_bytes()?);
    /// # Ok::<(), fathom_cuda::CudaError>(())
    /// ```
    pub fn serving<'a>(mut self, methods: impl IntoIterator<Item = &'a crate::Method>) -> Self {
        let (mut pca, mut tables) = (false, false);
        for m in methods {
            pca |= m.reads_pca_index();
            tables |= m.reads_block_tables();
        }
        self.pca_index = pca;
        self.block_tables = tables;
        self
    }

    /// Bytes of one layer's pools: the pages (index and records), the PCA index's key
    /// sections and the two block tables where the configuration keeps them.
    ///
    /// # Errors
    /// A page layout [`crate::paged_layout::PagedLayout::new`] refuses.
    pub fn layer_pool_bytes(&self) -> Result<u64> {
        let s = self.shape;
        let lay = crate::paged_layout::PagedLayout::new(
            fathom_store::Dims {
                heads: s.kv_heads,
                channels: s.dim,
            },
            self.pages.page_tokens,
            self.pages.pages,
        )?;
        let pages = self.pages.pages as u64;
        let pca = if self.pca_index {
            pages * lay.split_page_bytes().0
        } else {
            0
        };
        let tables = if self.block_tables {
            2 * pages * self.table_page_bytes()
        } else {
            0
        };
        Ok(lay.pool_bytes() + pca + tables)
    }

    /// Bytes per page of each block table: `Hkv · P/8 · D` fp16 (landmark), the same as
    /// Quest's `Hkv · P/16 · 2D`.
    pub fn table_page_bytes(&self) -> u64 {
        let s = self.shape;
        (s.kv_heads * self.pages.page_tokens / 8 * s.dim * 2) as u64
    }

    /// Checks the shape, the page settings, the batch limit and the options.
    pub fn validate(self) -> Result<Self> {
        let s = self.shape;
        if s.layers == 0 || s.kv_heads == 0 || s.group == 0 {
            return Err(CudaError::invalid(
                "shape",
                format!("{s:?}: layers, KV heads and G must be at least 1"),
            ));
        }
        if !matches!(s.dim, 64 | 128 | 256) {
            return Err(CudaError::invalid(
                "shape",
                format!("D = {} (the kernels take D ∈ {{64, 128, 256}})", s.dim),
            ));
        }
        self.pages.validate()?;
        // The kernels take the page geometry as 32-bit values and address one KV head's D
        // channel runs of a page with 32-bit offsets.
        if self.pages.page_tokens > MAX_PAGE_TOKENS {
            return Err(CudaError::invalid(
                "page_tokens",
                format!(
                    "{} tokens per page (at most {MAX_PAGE_TOKENS}: the kernels address a page's runs with 32-bit offsets)",
                    self.pages.page_tokens
                ),
            ));
        }
        // The append kernels put the batch on grid z and the KV heads on grid y.
        if self.max_batch > MAX_GRID_YZ || s.kv_heads > MAX_GRID_YZ {
            return Err(CudaError::invalid(
                "max_batch",
                format!(
                    "{} sessions per batch, {} KV heads (each at most {MAX_GRID_YZ}, CUDA's grid y and z limit)",
                    self.max_batch, s.kv_heads
                ),
            ));
        }
        if self.max_batch == 0 || self.max_batch > self.pages.max_sessions {
            return Err(CudaError::invalid(
                "max_batch",
                format!(
                    "{} (want 1..={}, the session slots)",
                    self.max_batch, self.pages.max_sessions
                ),
            ));
        }
        if self.shape.group > 8 || self.shape.group.saturating_mul(self.max_k) > 8192 {
            return Err(CudaError::invalid(
                "max_k",
                format!(
                    "G = {} × max_k = {} (the union of a KV head's selections holds G ≤ 8 and G·max_k ≤ 8192)",
                    self.shape.group, self.max_k
                ),
            ));
        }
        if self.max_k == 0 || self.max_k > self.pages.max_tokens {
            return Err(CudaError::invalid(
                "max_k",
                format!(
                    "{} (want 1..={}, the tokens per session)",
                    self.max_k, self.pages.max_tokens
                ),
            ));
        }
        let o = self.options;
        crate::cache::check_attend_groups(&self, o.attend_groups)?;
        crate::cache::check_scan_vector_words(o.scan_vector_words)?;
        crate::cache::check_host_gather_share(o.host_gather_share)?;
        crate::cache::check_host_gather(&self, o.host_gather_threads, o.attend_groups)?;
        Ok(self)
    }
}
