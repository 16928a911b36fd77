//! The offloaded KV cache a model drives (docs/SPEC.md §6.1): its configuration, the K/V rows
//! a model appends from device memory, and the checks every backend runs before a launch.
//!
//! A [`CacheConfig`] fixes one model shape (`L` layers, `Hkv` KV heads, `G`, `D`) and a page
//! pool ([`PageConfig`]). Each layer has its own pool of `pages` pages in pinned, mapped host
//! memory ([`crate::paged_layout::PagedLayout`]); the layers share the sessions' page tables
//! ([`crate::pages::CacheSessions`]), since every layer of a session has the same length.
//!
//! A decode step appends one token per session, a prefill a chunk, for a ragged batch:
//!
//! 1. [`crate::PagedCache::reserve`] grows every session of the batch (all or nothing:
//!    [`crate::pages::CacheSessions::reserve_many`]) and performs the copy-on-write of shared
//!    partial pages in every layer's pool; it returns the [`AppendBatch`] that names where
//!    each new token goes;
//! 2. per layer, [`crate::PagedCache::append`] takes that layer's K and V rows `[rows][Hkv][D]`
//!    from device memory ([`KvRows`]; rows in batch order, `rows = Σ new_tokens`) and, on the
//!    cache's stream, writes each token's bf16 K|V record and re-quantizes every 64-token
//!    block the new tokens touch, the partial last block included, so that each session's
//!    store equals `fathom_store::KeyStore` of the same bf16 keys **bit for bit**.
//!
//! Shapes, sessions, capacities and pointers are checked on the host before anything is
//! launched or written ([`check_rows`]); the keys' values live on the device, so a NaN, an
//! infinity or a key past fp16's range is caught by the kernel, which skips that block's
//! write and counts the fault ([`crate::PagedCache::faults`]).

use crate::config::ModelShape;
use crate::error::{CudaError, Result};
use crate::pages::{AppendPlan, PageConfig, SessionId};

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
}

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    /// The code the kernels take (`0` f32, `1` f16, `2` bf16).
    pub fn code(self) -> u32 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
            KvDtype::Bf16 => 2,
        }
    }
}

/// One layer's K and V rows in device memory: `k` and `v` are device pointers to
/// `[rows][Hkv][D]` elements of `dtype`, after RoPE and any QK-norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvRows {
    /// Device pointer to the keys.
    pub k: u64,
    /// Device pointer to the values.
    pub v: u64,
    /// Element type of both.
    pub dtype: KvDtype,
    /// Rows (tokens) of both.
    pub rows: usize,
}

/// Groups per CTA of the block-table scan (`-DTS_G` of attend.cu's `paged_table_scan`): the
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

    /// Checks the shape, the page settings and the batch limit.
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
        Ok(self)
    }
}

/// How attends take each query head's top-k (docs/SPEC.md §5; [`crate::PagedCache::set_select_path`]).
///
/// The default is [`SelectPath::Scores`]: on the H200 the filtered select passed its device test
/// but was not faster (`results/device/select/README.md`: 12–24% slower in host residency
/// without kept scores, within ±3% with them except 1M in HBM, 5.7% faster);
/// `offload-bench --select scores,8192,8192+scores` times the three in one run.
///
/// ```
/// use fathom_cuda::cache::SelectPath;
/// assert_eq!(SelectPath::parse("scores")?, SelectPath::Scores);
/// let f = SelectPath::parse("8192+scores")?;
/// assert_eq!(f, SelectPath::Filtered { min_middle_tokens: 8192, keep_scores: true });
/// assert_eq!(f.label(), "filtered>=8192+scores");
/// assert!(SelectPath::parse("8k").is_err());
/// # Ok::<(), fathom_cuda::CudaError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum SelectPath {
    /// The scan writes every score; a level-1 histogram, one streaming pass and an exact
    /// boundary select (the measured path).
    #[default]
    Scores,
    /// Rows of at least `min_middle_tokens` middle tokens (and 12·k) that have an estimate
    /// from their previous attend keep only the (key, token) pairs above it and select from
    /// those; a row whose filter passed fewer than k (or more than the pair capacity) falls
    /// back to the score path: its KV head is scanned again with scores, or, with
    /// `keep_scores`, the first scan wrote them too (no rescan, but the score array is
    /// written as on the score path).
    Filtered {
        /// Middle tokens from which a row may filter.
        min_middle_tokens: usize,
        /// Whether the filtered scan also writes every score and the histogram.
        keep_scores: bool,
    },
}

impl SelectPath {
    /// `scores` (or `0`), `N` (filtered from N middle tokens, failed rows rescan) or
    /// `N+scores` (filtered, scores kept for failed rows).
    ///
    /// # Errors
    /// [`crate::CudaError::Invalid`] naming the text.
    pub fn parse(s: &str) -> crate::Result<SelectPath> {
        let t = s.trim();
        if t == "scores" || t == "0" {
            return Ok(SelectPath::Scores);
        }
        let (n, keep) = match t.strip_suffix("+scores") {
            Some(n) => (n, true),
            None => (t, false),
        };
        match n.parse::<usize>() {
            Ok(m) if m > 0 => Ok(SelectPath::Filtered {
                min_middle_tokens: m,
                keep_scores: keep,
            }),
            _ => Err(crate::CudaError::invalid(
                "select path",
                format!("{s:?}: want scores, N (middle tokens) or N+scores"),
            )),
        }
    }

    /// `scores`, `filtered>=N` or `filtered>=N+scores`.
    pub fn label(&self) -> String {
        match *self {
            SelectPath::Scores => "scores".into(),
            SelectPath::Filtered {
                min_middle_tokens,
                keep_scores,
            } => format!(
                "filtered>={min_middle_tokens}{}",
                if keep_scores { "+scores" } else { "" }
            ),
        }
    }
}

/// How attends' query-head rows took their top-k ([`crate::PagedCache::select_counters`]):
/// rows that did not take the filtered select (too short, no estimate yet, or the setting
/// off) are in neither count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SelectCounters {
    /// Rows selected from their filtered pairs alone (no score array written).
    pub filtered: u64,
    /// Rows whose filter passed fewer than k tokens or more than the pair capacity: scanned
    /// again with scores, then selected by the score path.
    pub fallbacks: u64,
}

impl SelectCounters {
    /// Fallbacks over the rows that tried the filtered select (0 when none did).
    pub fn fallback_rate(&self) -> f64 {
        let tried = self.filtered + self.fallbacks;
        if tried == 0 {
            0.0
        } else {
            self.fallbacks as f64 / tried as f64
        }
    }
}

/// Union rows fetched and row-cache hits ([`crate::PagedCache::row_counters`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RowCounters {
    /// Union rows (K|V records) the attends needed.
    pub rows: u64,
    /// Of those, rows the HBM row cache served (the rest crossed the link).
    pub hits: u64,
}

impl RowCounters {
    /// Hits over rows (0 when no row was fetched).
    pub fn hit_rate(&self) -> f64 {
        if self.rows == 0 {
            0.0
        } else {
            self.hits as f64 / self.rows as f64
        }
    }
}

/// The row cache's rule as a plain CPU reference (docs/SPEC.md §6.1, "Row cache"): the
/// kernels' counters over a run of attends equal its counts over the same unions. It lives in
/// `fathom-plan`, beside the selection whose unions it takes, so that CPU decodes use it
/// without this crate.
pub use fathom_plan::rowcache::RowCacheModel;

/// How an attend reads the cache: exact attention over every token, or one scan method of the
/// grammar followed by the docs/SPEC.md §5 selection (sink, local and each query head's own
/// top-k) and exact attention over each head's own set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttendMethod {
    /// Every token (the reference a selection is measured against).
    Dense,
    /// A scan method: `fathom:B`, `sparq:r`, `ds:r`, `thumb2` or `exact` (the 4-bit store).
    Scan(crate::config::Method),
}

impl AttendMethod {
    /// Parses `dense` or any method of the grammar at head dimension `dim`.
    pub fn parse(s: &str, dim: usize) -> Result<Self> {
        if s.trim() == "dense" {
            return Ok(AttendMethod::Dense);
        }
        Ok(AttendMethod::Scan(crate::config::Method::parse(s, dim)?))
    }
}

/// One layer's queries in device memory: `q` points to `[batch][Hq][D]` elements of `dtype`,
/// one query per session of the batch (at its last token), after RoPE and any QK-norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryRows {
    /// Device pointer.
    pub q: u64,
    /// Element type.
    pub dtype: KvDtype,
}

/// The check of [`crate::PagedCache::set_scan_vector_words`]: 1 (8-byte plane loads) or 2
/// (16-byte loads of two adjacent words where a page's blocks allow it).
///
/// ```
/// use fathom_cuda::cache::check_scan_vector_words;
/// assert!(check_scan_vector_words(1).is_ok() && check_scan_vector_words(2).is_ok());
/// assert!(check_scan_vector_words(4).is_err());
/// ```
///
/// # Errors
/// Any other value.
pub fn check_scan_vector_words(words: u32) -> Result<()> {
    if words == 1 || words == 2 {
        Ok(())
    } else {
        Err(CudaError::invalid(
            "scan vector words",
            format!("{words} (want 1, 8-byte loads, or 2, 16-byte loads)"),
        ))
    }
}

/// The check of [`crate::PagedCache::set_host_gather_share`]: a percent of the misses, 1 to
/// 100.
///
/// ```
/// use fathom_cuda::cache::check_host_gather_share;
/// assert!(check_host_gather_share(50).is_ok() && check_host_gather_share(100).is_ok());
/// assert!(check_host_gather_share(0).is_err() && check_host_gather_share(101).is_err());
/// ```
///
/// # Errors
/// As above.
pub fn check_host_gather_share(percent: u32) -> Result<()> {
    if (1..=100).contains(&percent) {
        Ok(())
    } else {
        Err(CudaError::invalid(
            "host gather share",
            format!("{percent}% (a percent of the row fetch's misses, 1 to 100; turn the gather off with 0 threads)"),
        ))
    }
}

/// Most threads [`crate::PagedCache::set_host_gather`] takes.
pub const MAX_GATHER_THREADS: usize = 256;

/// The check of [`crate::PagedCache::set_host_gather`] with `groups` head groups per attend:
/// 0 (off) always; otherwise at most [`MAX_GATHER_THREADS`] threads, records in host memory
/// (host or split residency) and one head group (the gather serves one fetch at a time).
///
/// ```
/// use fathom_cuda::cache::{check_host_gather, CacheConfig};
/// use fathom_cuda::{HostPages, ModelShape, PageConfig, Residency};
/// let mut cfg = CacheConfig {
///     shape: ModelShape { layers: 1, kv_heads: 2, group: 4, dim: 128 },
///     pages: PageConfig { page_tokens: 4096, pages: 4, max_sessions: 1, max_tokens: 8192 },
///     max_batch: 1, max_k: 64, row_cache: 0, residency: Residency::Host,
///     pca_index: false, block_tables: false, host_pages: HostPages::Driver,
/// };
/// assert!(check_host_gather(&cfg, 8, 1).is_ok());
/// assert!(check_host_gather(&cfg, 8, 2).is_err(), "head groups");
/// cfg.residency = Residency::Hbm;
/// assert!(check_host_gather(&cfg, 8, 1).is_err() && check_host_gather(&cfg, 0, 2).is_ok());
/// ```
///
/// # Errors
/// As above.
pub fn check_host_gather(cfg: &CacheConfig, threads: usize, groups: usize) -> Result<()> {
    if threads == 0 {
        return Ok(());
    }
    if threads > MAX_GATHER_THREADS {
        return Err(CudaError::invalid(
            "host gather threads",
            format!("{threads} (at most {MAX_GATHER_THREADS})"),
        ));
    }
    if cfg.residency == crate::config::Residency::Hbm {
        return Err(CudaError::invalid(
            "host gather",
            "HBM residency keeps the K|V records in HBM: there is nothing to gather on the host",
        ));
    }
    if groups > 1 {
        return Err(CudaError::invalid(
            "host gather",
            format!("{groups} head groups: the gather serves one fetch at a time (set 1 group)"),
        ));
    }
    Ok(())
}

/// The check of [`crate::PagedCache::set_attend_groups`]: `1 ≤ groups ≤ Hkv`.
pub fn check_attend_groups(cfg: &CacheConfig, groups: usize) -> Result<()> {
    let hkv = cfg.shape.kv_heads;
    if groups == 0 || groups > hkv {
        return Err(CudaError::invalid(
            "attend groups",
            format!("{groups} (want 1..={hkv}, the model's KV heads: a group holds at least one)"),
        ));
    }
    Ok(())
}

/// The checks of an attend before its launch: the layer exists, the batch is the current
/// one, the selection fits the cache's limits and the pointers are not null.
pub fn check_attend(
    cfg: &CacheConfig,
    batch: &AppendBatch,
    current_step: u64,
    layer: usize,
    params: &fathom_plan::SelectParams,
    q: &QueryRows,
    out: u64,
) -> Result<()> {
    check_step(cfg, batch, current_step, layer)?;
    if q.q == 0 || out == 0 {
        return Err(CudaError::invalid("attend", "null query or output pointer"));
    }
    check_select(cfg, params)
}

/// The selection's limits in this cache: `sink + local ≤ MAX_SINK_LOCAL` and
/// `1 ≤ k ≤ max_k`. Part of [`check_attend`]; a caller that reserves and appends before its
/// first attend (a model's decode step) runs it first, so a bad selection changes nothing.
pub fn check_select(cfg: &CacheConfig, params: &fathom_plan::SelectParams) -> Result<()> {
    if params.sink.saturating_add(params.local) > MAX_SINK_LOCAL {
        return Err(CudaError::invalid(
            "select",
            format!(
                "sink {} + local {} (at most {MAX_SINK_LOCAL} rows are kept by position)",
                params.sink, params.local
            ),
        ));
    }
    if params.k == 0 || params.k > cfg.max_k {
        return Err(CudaError::invalid(
            "k",
            format!("{} (want 1..={}, the cache's max_k)", params.k, cfg.max_k),
        ));
    }
    Ok(())
}

/// Double Sparsity's channels of one head in a calibration: each below `dim` and none twice
/// (the static plan sets depth 4 at each, so a channel past D would set one of the next head's).
///
/// # Errors
/// The first channel out of range or repeated, naming the head.
pub fn check_ds_channels(head: usize, channels: &[u16], dim: usize) -> Result<()> {
    let mut seen = vec![false; dim];
    for &c in channels {
        let c = c as usize;
        if c >= dim || std::mem::replace(&mut seen[c], true) {
            return Err(CudaError::invalid(
                "calibration",
                format!(
                    "head {head}: Double Sparsity channel {c} {} (D = {dim})",
                    if c >= dim {
                        "is out of range"
                    } else {
                        "is listed twice"
                    }
                ),
            ));
        }
    }
    Ok(())
}

/// The checks of a [`read_rows`](crate::PagedCache::read_rows) before its launch: the layer
/// exists, the batch is the current one, `1 ≤ cap ≤ max_tokens`, the pointers are not null.
pub fn check_read_rows(
    cfg: &CacheConfig,
    batch: &AppendBatch,
    current_step: u64,
    layer: usize,
    cap: usize,
    k_out: u64,
    v_out: u64,
) -> Result<()> {
    check_step(cfg, batch, current_step, layer)?;
    if cap == 0 || cap > cfg.pages.max_tokens {
        return Err(CudaError::invalid(
            "read_rows",
            format!(
                "cap {cap} (want 1..={}, the cache's max_tokens)",
                cfg.pages.max_tokens
            ),
        ));
    }
    if k_out == 0 || v_out == 0 {
        return Err(CudaError::invalid("read_rows", "null output pointer"));
    }
    Ok(())
}

/// CUDA's limit on a grid's y and z extents.
pub const MAX_GRID_YZ: usize = 65_535;

/// The stages of one attend, in launch order (docs/SPEC.md §6.1): where
/// [`crate::PagedCache::set_stage_timing`] records an event on the cache's stream. Each
/// mark but [`AttendStage::Start`] ends its stage, so the time from the mark before it is
/// that stage's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttendStage {
    /// Before the attend's first launch: starts a new attend.
    Start,
    /// The queries to f32 (rotated for Loki) and the per-query plan.
    Plan,
    /// The scan (with the filtered select's fused top-k and its fallback rescan).
    Scan,
    /// The top-k: boundary bucket, collect, finish.
    TopK,
    /// The union of a KV head's selections.
    Union,
    /// The row fetch into HBM (with the host gather's list and the wait for its copy).
    Fetch,
    /// The exact attention: partials and their combine (all of a dense attend after its
    /// queries).
    Attention,
}

/// The most stage marks [`crate::PagedCache`] holds between two calls of
/// [`crate::PagedCache::stage_times`] (seven per attend); attends past it count as untimed.
pub const MAX_STAGE_MARKS: usize = 1 << 16;

/// GPU time of attends by stage ([`crate::PagedCache::stage_times`]), from CUDA events on the
/// cache's stream between the stages of each attend (plain launches only). An event pair
/// times the GPU from one mark to the next, so the stages sum to the attends' GPU time, idle
/// gaps between launches included.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttendStages {
    /// Attends split into stages.
    pub attends: u64,
    /// Attends not split: inside a graph capture (a graph holds no timing events), with more
    /// than one head group (whose stages overlap on two streams), or past
    /// [`MAX_STAGE_MARKS`].
    pub untimed: u64,
    /// [`AttendStage::Plan`], ms.
    pub plan_ms: f64,
    /// [`AttendStage::Scan`], ms.
    pub scan_ms: f64,
    /// [`AttendStage::TopK`], ms.
    pub topk_ms: f64,
    /// [`AttendStage::Union`], ms.
    pub union_ms: f64,
    /// [`AttendStage::Fetch`], ms.
    pub fetch_ms: f64,
    /// [`AttendStage::Attention`], ms.
    pub attention_ms: f64,
}

impl AttendStages {
    /// The stages' names as `offload-bench` records them, in launch order.
    pub const NAMES: [&'static str; 6] = ["plan", "scan", "topk", "union", "fetch", "attention"];

    /// Adds one mark: `ms` is the GPU time from the mark before (ignored for
    /// [`AttendStage::Start`], which counts a new attend).
    pub fn add(&mut self, stage: AttendStage, ms: f64) {
        match stage {
            AttendStage::Start => self.attends += 1,
            AttendStage::Plan => self.plan_ms += ms,
            AttendStage::Scan => self.scan_ms += ms,
            AttendStage::TopK => self.topk_ms += ms,
            AttendStage::Union => self.union_ms += ms,
            AttendStage::Fetch => self.fetch_ms += ms,
            AttendStage::Attention => self.attention_ms += ms,
        }
    }

    /// The stage times in the order of [`AttendStages::NAMES`], ms.
    pub fn values(&self) -> [f64; 6] {
        [
            self.plan_ms,
            self.scan_ms,
            self.topk_ms,
            self.union_ms,
            self.fetch_ms,
            self.attention_ms,
        ]
    }

    /// Every stage's time, ms.
    pub fn total_ms(&self) -> f64 {
        self.values().iter().sum()
    }
}

/// The most tokens per page ([`CacheConfig::validate`]): a page's key runs of one KV head
/// (`D` runs of `P/64` fp16 scales and four `P/64`-word planes, 143 MB at `D` = 256)
/// stay within the 32-bit offsets of the kernels.
pub const MAX_PAGE_TOKENS: usize = 1 << 20;

/// Where one reserve step's new tokens go: one [`AppendPlan`] per session of the batch, in
/// batch order, and each session's first row in the layer's [`KvRows`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendBatch {
    /// Per session, in batch order.
    pub plans: Vec<AppendPlan>,
    /// `row0[i]`: the first row of `plans[i]`'s tokens (a prefix sum of their counts).
    pub row0: Vec<usize>,
    /// `Σ tokens`: the rows every layer's [`KvRows`] must hold.
    pub rows: usize,
    /// A serial number: an append batch is valid until the next reserve.
    pub step: u64,
}

impl AppendBatch {
    /// The plans' row offsets and total.
    pub fn new(plans: Vec<AppendPlan>, step: u64) -> AppendBatch {
        let mut row0 = Vec::with_capacity(plans.len());
        let mut rows = 0;
        for p in &plans {
            row0.push(rows);
            rows += p.tokens;
        }
        AppendBatch {
            plans,
            row0,
            rows,
            step,
        }
    }

    /// The sessions, in batch order.
    pub fn sessions(&self) -> Vec<SessionId> {
        self.plans.iter().map(|p| p.session).collect()
    }
}

/// What a cache knows of its current step on the host: the batch its last reserve returned,
/// per layer whether that step's rows are written, and per session and layer how many of its
/// rows are written. The paged cache's rule, pure CPU so that it is unit-tested without a GPU:
///
/// * a call that launches with the reserve's descriptors gets that batch, unchanged
///   ([`AppendBatch`]'s fields are public; an edited copy would size grids and buffers for
///   other rows);
/// * an attend or a row read of a layer reads the step's new rows, which only that layer's
///   append writes: refused until the append ran (or, inside a capture, was recorded before
///   it); a captured step's appends count for the batch it is replayed for;
/// * a reserve grows a session in every layer at once, so a step that failed between its
///   reserve and its last append leaves rows no append wrote: `written[s][l]`, the rows of
///   session `s` whose layer-`l` slots an append wrote (a prefix: appends write at the end),
///   then stays below the session's length. An append must start at the written prefix and
///   an attend, row read or export must find the whole session written, so such a session
///   is refused by name in that layer (never read), and a reserve refuses to grow it (its
///   batch's other sessions would be left unwritten too), until it is freed. A fork inherits
///   its parent's prefix.
#[derive(Debug, Clone)]
pub struct StepLedger {
    current: Option<AppendBatch>,
    /// Per layer, the step whose rows its last append wrote (0: none; steps start at 1).
    appended_at: Vec<u64>,
    /// Per layer, appended inside the capture under way (recorded, not yet run).
    captured: Option<Vec<bool>>,
    /// Per live session, per layer: the rows written (a prefix of the session).
    written: std::collections::HashMap<SessionId, Vec<usize>>,
}

impl StepLedger {
    /// A cache of `layers` layers, nothing reserved.
    pub fn new(layers: usize) -> StepLedger {
        StepLedger {
            current: None,
            appended_at: vec![0; layers],
            captured: None,
            written: std::collections::HashMap::new(),
        }
    }

    /// `session` was created (empty: nothing written).
    pub fn created(&mut self, session: SessionId) {
        self.written
            .insert(session, vec![0; self.appended_at.len()]);
    }

    /// `child` was forked from `parent` (it holds the parent's rows, written as far as the
    /// parent's were).
    pub fn forked(&mut self, parent: SessionId, child: SessionId) {
        let w = self.written_of(parent);
        self.written.insert(child, w);
    }

    /// `session` was freed.
    pub fn freed(&mut self, session: SessionId) {
        self.written.remove(&session);
    }

    /// `session` was cut to `len` tokens: no layer holds written rows past it.
    pub fn truncated(&mut self, session: SessionId, len: usize) {
        if let Some(w) = self.written.get_mut(&session) {
            w.iter_mut().for_each(|x| *x = (*x).min(len));
        }
    }

    /// The layers some append has written (the ones [`StepLedger::check_grow`] holds
    /// sessions to), in order.
    pub fn appended_layers(&self) -> Vec<usize> {
        (0..self.appended_at.len())
            .filter(|&l| self.appended_at[l] > 0)
            .collect()
    }

    /// Per layer, the rows of `session` its appends wrote (0s for a session this ledger was
    /// not told of).
    pub fn written_of(&self, session: SessionId) -> Vec<usize> {
        self.written
            .get(&session)
            .cloned()
            .unwrap_or_else(|| vec![0; self.appended_at.len()])
    }

    fn written_at(&self, session: SessionId, layer: usize) -> usize {
        self.written
            .get(&session)
            .and_then(|w| w.get(layer).copied())
            .unwrap_or(0)
    }

    /// Every row of `session`'s first `len` in `layer` was written by an append.
    ///
    /// # Errors
    /// Rows no append wrote (a step that failed after its reserve), naming the session, the
    /// layer, the rows and `what`.
    pub fn check_written(
        &self,
        session: SessionId,
        layer: usize,
        len: usize,
        what: &'static str,
    ) -> Result<()> {
        let w = self.written_at(session, layer);
        if w < len {
            return Err(unwritten(what, session, layer, w, len));
        }
        Ok(())
    }

    /// The sessions of a reserve, with their lengths before it, may grow: none holds rows no
    /// append wrote in a layer that appends have written. A reserve grows every session of
    /// its batch in every layer, and the batch's appends would then be refused for such a
    /// session's sake, leaving the others with unwritten rows too. Layers no append ever
    /// wrote are exempt (a caller that keeps some layers elsewhere, as the Python package
    /// does for Gemma 3's sliding-window layers).
    ///
    /// # Errors
    /// The first such session, naming it, the layer, the rows and `what`.
    pub fn check_grow(&self, sessions: &[(SessionId, usize)], what: &'static str) -> Result<()> {
        for &(session, len) in sessions {
            for layer in self.appended_layers() {
                self.check_written(session, layer, len, what)?;
            }
        }
        Ok(())
    }

    /// An append of `layer` for `batch` may launch: the batch is the current one, unchanged,
    /// and each session's rows before its new ones are written in `layer`.
    ///
    /// # Errors
    /// Another batch, or a session with rows no append wrote, naming `what`.
    pub fn check_append(
        &self,
        batch: &AppendBatch,
        layer: usize,
        what: &'static str,
    ) -> Result<()> {
        self.check_current(batch, what)?;
        self.check_prefixes(batch, &[layer], what)
    }

    /// Each session of `batch` has its rows before the new ones written in each of `layers`.
    fn check_prefixes(
        &self,
        batch: &AppendBatch,
        layers: &[usize],
        what: &'static str,
    ) -> Result<()> {
        for p in &batch.plans {
            for &l in layers {
                self.check_written(p.session, l, p.first_token, what)?;
            }
        }
        Ok(())
    }

    /// The rows `batch`'s append of `layer` wrote.
    fn mark_written(&mut self, batch: &AppendBatch, layer: usize) {
        let layers = self.appended_at.len();
        for p in &batch.plans {
            let w = self
                .written
                .entry(p.session)
                .or_insert_with(|| vec![0; layers]);
            if let Some(w) = w.get_mut(layer) {
                if *w >= p.first_token {
                    *w = (*w).max(p.first_token + p.tokens);
                }
            }
        }
    }

    /// The reserve returned `batch`.
    pub fn reserved(&mut self, batch: &AppendBatch) {
        self.current = Some(batch.clone());
    }

    /// `batch` is the last reserve's, unchanged.
    ///
    /// # Errors
    /// Any other batch, naming `what`.
    pub fn check_current(&self, batch: &AppendBatch, what: &'static str) -> Result<()> {
        if self.current.as_ref() != Some(batch) {
            return Err(CudaError::invalid(
                what,
                "the batch is not the one the cache's last reserve returned (its plans, rows or offsets were changed)",
            ));
        }
        Ok(())
    }

    /// `layer`'s append for `batch` was launched (or recorded, inside a capture).
    pub fn appended(&mut self, batch: &AppendBatch, layer: usize) {
        match &mut self.captured {
            Some(c) => c[layer] = true,
            None => {
                self.appended_at[layer] = batch.step;
                self.mark_written(batch, layer);
            }
        }
    }

    /// `batch` is the current one and `layer` was appended in its step (inside a capture:
    /// earlier in the capture). `layer` is in range (checked before, with the stale step).
    ///
    /// # Errors
    /// Another batch, or a layer not yet appended, naming `what`.
    pub fn check_read(&self, batch: &AppendBatch, layer: usize, what: &'static str) -> Result<()> {
        self.check_current(batch, what)?;
        let done = match &self.captured {
            Some(c) => c[layer],
            None => self.appended_at[layer] == batch.step,
        };
        if !done {
            return Err(CudaError::invalid(
                what,
                format!(
                    "layer {layer} has not been appended in this step: append the step's K/V rows of the layer first (its new tokens' slots hold nothing yet)"
                ),
            ));
        }
        for p in &batch.plans {
            // Inside a capture the step's own rows are the recorded append's; the rows before
            // them must be written already.
            let len = match &self.captured {
                Some(_) => p.first_token,
                None => p.first_token + p.tokens,
            };
            self.check_written(p.session, layer, len, what)?;
        }
        Ok(())
    }

    /// A capture begins: appends from here are recorded, not run.
    pub fn begin_capture(&mut self) {
        self.captured = Some(vec![false; self.appended_at.len()]);
    }

    /// The capture ends (successfully or not): the layers it appended, for its graph.
    pub fn end_capture(&mut self) -> Vec<bool> {
        self.captured
            .take()
            .unwrap_or_else(|| vec![false; self.appended_at.len()])
    }

    /// A graph whose step appends `layers` may be replayed for `batch`: the batch is the
    /// current one and, in every layer the graph appends, each session's rows before its new
    /// ones are written.
    ///
    /// # Errors
    /// As [`StepLedger::check_append`], naming `what`.
    pub fn check_replay(
        &self,
        batch: &AppendBatch,
        layers: &[bool],
        what: &'static str,
    ) -> Result<()> {
        self.check_current(batch, what)?;
        let appended: Vec<usize> = (0..layers.len()).filter(|&l| layers[l]).collect();
        self.check_prefixes(batch, &appended, what)
    }

    /// A graph whose step appends `layers` was replayed for `batch`.
    pub fn replayed(&mut self, batch: &AppendBatch, layers: &[bool]) {
        for (l, &done) in layers.iter().enumerate().take(self.appended_at.len()) {
            if done {
                self.appended_at[l] = batch.step;
                self.mark_written(batch, l);
            }
        }
    }
}

/// The error for rows `written..len` of `session`'s `layer` that no append wrote.
fn unwritten(
    what: &'static str,
    session: SessionId,
    layer: usize,
    written: usize,
    len: usize,
) -> CudaError {
    CudaError::invalid(
        what,
        format!(
            "{session} has rows {written}..{len} of layer {layer} that no append wrote (a step failed between its reserve and its appends): its layer-{layer} slots hold nothing; truncate the session to its written rows, or free it"
        ),
    )
}

/// The layer exists and `batch` is the cache's current reserve.
fn check_step(
    cfg: &CacheConfig,
    batch: &AppendBatch,
    current_step: u64,
    layer: usize,
) -> Result<()> {
    if layer >= cfg.shape.layers {
        return Err(CudaError::invalid(
            "layer",
            format!("{layer} (the cache has {} layers)", cfg.shape.layers),
        ));
    }
    if batch.step != current_step {
        return Err(CudaError::invalid(
            "append batch",
            format!(
                "batch of step {} is stale: the cache has reserved step {current_step} since",
                batch.step
            ),
        ));
    }
    Ok(())
}

/// The checks of an append before its launch: the layer exists, the batch is the current
/// one, the rows match the batch and neither pointer is null.
pub fn check_rows(
    cfg: &CacheConfig,
    batch: &AppendBatch,
    current_step: u64,
    layer: usize,
    kv: &KvRows,
) -> Result<()> {
    check_step(cfg, batch, current_step, layer)?;
    if kv.rows != batch.rows {
        return Err(CudaError::invalid(
            "kv rows",
            format!(
                "{} rows of K/V for a batch of {} new tokens ([rows][Hkv = {}][D = {}])",
                kv.rows, batch.rows, cfg.shape.kv_heads, cfg.shape.dim
            ),
        ));
    }
    if kv.k == 0 || kv.v == 0 {
        return Err(CudaError::invalid("kv rows", "null device pointer"));
    }
    Ok(())
}

/// The checks of a host-slice append before any copy: `k` and `v` hold `batch.rows` rows of
/// `[Hkv][D]`, every element is finite, every key's bf16 record fits the fp16 block scale
/// (|bf16(k)| ≤ 65280, the largest bf16 below fp16's 65504) and every value's fits bf16.
pub fn check_host_rows(cfg: &CacheConfig, batch: &AppendBatch, k: &[f32], v: &[f32]) -> Result<()> {
    let row = cfg.shape.kv_heads * cfg.shape.dim;
    for (what, x) in [("keys", k), ("values", v)] {
        if x.len() != batch.rows * row {
            return Err(CudaError::invalid(
                "kv rows",
                format!(
                    "{} {what} for a batch of {} new tokens (want [{}][Hkv = {}][D = {}] = {})",
                    x.len(),
                    batch.rows,
                    batch.rows,
                    cfg.shape.kv_heads,
                    cfg.shape.dim,
                    batch.rows * row
                ),
            ));
        }
        if let Some(i) = x.iter().position(|e| !e.is_finite()) {
            return Err(CudaError::invalid(
                "kv rows",
                format!(
                    "{what}: {} at row {}, head {}, channel {} is not finite",
                    x[i],
                    i / row,
                    i % row / cfg.shape.dim,
                    i % cfg.shape.dim
                ),
            ));
        }
        // The records are bf16, and a key block's scale is the fp16 of its largest |bf16 key|:
        // past either range the kernel would store an infinity or skip the block (a fault).
        let stored = |e: f32| half::bf16::from_f32(e).to_f32();
        let (limit, over): (&str, &dyn Fn(f32) -> bool) = if what == "keys" {
            ("fp16 (a key block's scale, ±65504)", &|e| {
                half::f16::from_f32(stored(e)).is_infinite()
            })
        } else {
            ("bf16 (the stored record)", &|e| stored(e).is_infinite())
        };
        if let Some(i) = x.iter().position(|&e| over(e)) {
            return Err(CudaError::invalid(
                "kv rows",
                format!(
                    "{what}: {} at row {}, head {}, channel {} is past the range of {limit}",
                    x[i],
                    i / row,
                    i % row / cfg.shape.dim,
                    i % cfg.shape.dim
                ),
            ));
        }
    }
    Ok(())
}

/// What `PagedCache::debug_readback` returns for one session.
#[derive(Debug, Clone, PartialEq)]
pub struct AttendDebug {
    /// Depths `[Hkv][D]` of the last GPU-planned method (static plans are not copied here).
    pub depths: Vec<u8>,
    /// Scores `[Hkv][G][n]`.
    pub scores: Vec<f32>,
    /// Winners per query head `h·G + g`, sorted (middle tokens only).
    pub winners: Vec<Vec<u32>>,
}

#[cfg(test)]
mod tests {
    #[test]
    fn stage_marks_add_up_to_each_stage_and_count_attends() {
        use super::{AttendStage as S, AttendStages};
        let mut a = AttendStages::default();
        // A scan attend, then a dense one (queries, then all of its attention).
        for (stage, ms) in [
            (S::Start, 9.0),
            (S::Plan, 0.5),
            (S::Scan, 2.0),
            (S::TopK, 0.25),
            (S::Union, 0.125),
            (S::Fetch, 1.0),
            (S::Attention, 0.5),
            (S::Start, 7.0),
            (S::Plan, 0.25),
            (S::Attention, 4.0),
        ] {
            a.add(stage, ms);
        }
        assert_eq!(a.attends, 2);
        assert_eq!(a.values(), [0.75, 2.0, 0.25, 0.125, 1.0, 4.5]);
        assert_eq!(a.total_ms(), 8.625);
        assert_eq!(AttendStages::NAMES.len(), a.values().len());
    }

    #[test]
    fn table_scan_groups_fit_shared_memory_at_every_shape() {
        for dim in [64, 128, 256] {
            for g in 1..=8 {
                let t = super::table_scan_groups(dim, g);
                assert!(t.is_power_of_two() && t <= 64, "D {dim} G {g}: {t}");
                let bytes = g * (dim + 1) * 4 + g * 1024 * 4 + 64 + t * (2 * dim / 8 + 1) * 16;
                assert!(bytes <= 48 << 10, "D {dim} G {g}: {bytes} bytes");
                // The next power of two would not fit (or the cap holds).
                let more = g * (dim + 1) * 4 + g * 1024 * 4 + 64 + 2 * t * (2 * dim / 8 + 1) * 16;
                assert!(
                    t == 64 || more > 48 << 10,
                    "D {dim} G {g}: {t} is not the most"
                );
            }
        }
        assert_eq!(super::table_scan_groups(128, 4), 32);
        assert_eq!(super::table_scan_groups(256, 8), 4);
    }

    use super::*;

    fn cfg() -> CacheConfig {
        CacheConfig {
            shape: ModelShape {
                layers: 2,
                kv_heads: 2,
                group: 4,
                dim: 128,
            },
            pages: PageConfig {
                page_tokens: 128,
                pages: 8,
                max_sessions: 4,
                max_tokens: 512,
            },
            max_batch: 4,
            max_k: 64,
            row_cache: 0,
            residency: crate::config::Residency::Host,
            pca_index: false,
            block_tables: false,
            host_pages: crate::HostPages::Driver,
        }
    }

    #[test]
    fn attend_groups_are_between_one_and_the_kv_heads() {
        let c = cfg();
        assert!(check_attend_groups(&c, 1).is_ok());
        assert!(check_attend_groups(&c, 2).is_ok());
        for bad in [0, 3, 100] {
            let e = check_attend_groups(&c, bad).unwrap_err().to_string();
            assert!(
                e.contains("attend groups") && e.contains("1..=2"),
                "{bad}: {e}"
            );
        }
    }

    /// The selection's limits, Double Sparsity's channels and a hand-built method are checked
    /// on the host, so a model's decode step can run them before its reserve.
    #[test]
    fn selections_channels_and_methods_are_checked_on_the_host() {
        let c = cfg();
        let p = |sink, local, k| fathom_plan::SelectParams { sink, local, k };
        assert!(check_select(&c, &p(4, 32, 64)).is_ok());
        for (bad, what) in [
            (p(4, 32, 0), "k"),
            (p(4, 32, 65), "max_k"),
            (p(40, 40, 8), "sink 40"),
            (p(usize::MAX - 10, 20, 8), "sink"),
        ] {
            let e = check_select(&c, &bad).unwrap_err().to_string();
            assert!(e.contains(what), "{bad:?}: {e}");
        }
        assert!(check_ds_channels(0, &[0, 5, 127], 128).is_ok());
        let e = check_ds_channels(1, &[3, 128], 128)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("head 1") && e.contains("128 is out of range"),
            "{e}"
        );
        let e = check_ds_channels(0, &[3, 3], 128).unwrap_err().to_string();
        assert!(e.contains("listed twice"), "{e}");
        use crate::config::Method;
        for ok in [Method::Fathom(48.0), Method::SparQ(16), Method::Exact] {
            assert!(ok.validate(128).is_ok(), "{ok:?}");
        }
        for bad in [
            Method::Fathom(f32::NAN),
            Method::Fathom(-1.0),
            Method::Fathom(1e9),
            Method::SparQ(0),
            Method::DoubleSparsity(129),
            Method::Loki(0),
        ] {
            assert!(bad.validate(128).is_err(), "{bad:?}");
        }
    }

    /// The ledger's rule: the current batch only, unchanged; a layer read only after its
    /// append in the same step; captured appends count inside the capture and, at replay,
    /// for the replayed batch; a new reserve starts over.
    #[test]
    fn the_step_ledger_refuses_reads_before_appends_and_edited_batches() {
        let c = cfg();
        let mut s = crate::pages::CacheSessions::new(c.pages).unwrap();
        let a = s.create().unwrap();
        let mut led = StepLedger::new(2);
        let b1 = AppendBatch::new(s.reserve_many(&[(a, 1)]).unwrap(), 1);
        assert!(
            led.check_current(&b1, "append").is_err(),
            "nothing reserved yet"
        );
        led.reserved(&b1);
        led.check_current(&b1, "append").unwrap();
        let e = led.check_read(&b1, 0, "attend").unwrap_err().to_string();
        assert!(e.contains("layer 0 has not been appended"), "{e}");
        led.appended(&b1, 0);
        led.check_read(&b1, 0, "attend").unwrap();
        assert!(led.check_read(&b1, 1, "read_rows").is_err());
        led.appended(&b1, 1);
        let mut edited = b1.clone();
        edited.rows += 1;
        let e = led
            .check_read(&edited, 0, "attend")
            .unwrap_err()
            .to_string();
        assert!(e.contains("last reserve returned"), "{e}");
        // The next step: layer 0's append of step 1 does not count for step 2.
        let b2 = AppendBatch::new(s.reserve_many(&[(a, 1)]).unwrap(), 2);
        led.reserved(&b2);
        assert!(led.check_read(&b2, 0, "attend").is_err());
        assert!(led.check_current(&b1, "append").is_err(), "the old batch");
        // A capture: its appends count for its own reads, not for the live cache.
        led.begin_capture();
        assert!(led.check_read(&b2, 1, "attend").is_err());
        led.appended(&b2, 1);
        led.check_read(&b2, 1, "attend").unwrap();
        let captured = led.end_capture();
        assert_eq!(captured, vec![false, true]);
        assert!(
            led.check_read(&b2, 1, "attend").is_err(),
            "recorded, not run"
        );
        led.replayed(&b2, &captured);
        led.check_read(&b2, 1, "attend").unwrap();
        assert!(led.check_read(&b2, 0, "attend").is_err());
    }

    /// A step that failed between its reserve and its appends leaves rows no append wrote:
    /// that session is refused by name in that layer from then on (append, read, replay,
    /// export), its other layers and other sessions go on, a fork inherits the hole, a free
    /// forgets it; captured appends write their rows only when replayed.
    #[test]
    fn rows_no_append_wrote_are_never_read() {
        let c = cfg();
        let mut s = crate::pages::CacheSessions::new(c.pages).unwrap();
        let mut led = StepLedger::new(2);
        let (a, b) = (s.create().unwrap(), s.create().unwrap());
        led.created(a);
        led.created(b);
        let mut step = 0;
        let mut reserve = |s: &mut crate::pages::CacheSessions,
                           led: &mut StepLedger,
                           batch: &[(SessionId, usize)]| {
            step += 1;
            let ab = AppendBatch::new(s.reserve_many(batch).unwrap(), step);
            led.reserved(&ab);
            ab
        };
        // Step 1: a prompt of 3 tokens for a, 2 for b; layer 1 fails for both.
        let b1 = reserve(&mut s, &mut led, &[(a, 3), (b, 2)]);
        led.check_append(&b1, 0, "append").unwrap();
        led.appended(&b1, 0);
        led.check_read(&b1, 0, "attend").unwrap();
        assert_eq!(led.written_of(a), vec![3, 0]);
        // Step 2: layer 0 goes on; layer 1 is refused for a by name, before any launch.
        let b2 = reserve(&mut s, &mut led, &[(a, 1)]);
        led.check_append(&b2, 0, "append").unwrap();
        led.appended(&b2, 0);
        led.check_read(&b2, 0, "attend").unwrap();
        let e = led.check_append(&b2, 1, "append").unwrap_err().to_string();
        assert!(
            e.contains("session 0") && e.contains("rows 0..3 of layer 1 that no append wrote"),
            "{e}"
        );
        // Appended anyway (a caller that ignored the error): the hole stays, reads refuse.
        led.appended(&b2, 1);
        assert_eq!(led.written_of(a), vec![4, 0]);
        let e = led.check_read(&b2, 1, "attend").unwrap_err().to_string();
        assert!(e.contains("rows 0..4 of layer 1"), "{e}");
        assert!(led.check_written(a, 1, 4, "export").is_err());
        led.check_written(a, 0, 4, "export").unwrap();
        // A reserve refuses to grow it (its batch's appends would be refused, leaving a new
        // session's rows unwritten too); the new session alone grows.
        let c2 = s.create().unwrap();
        led.created(c2);
        let e = led
            .check_grow(&[(c2, 0), (a, s.len(a).unwrap())], "reserve")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("session 0") && e.contains("rows 0..4 of layer 1"),
            "{e}"
        );
        led.check_grow(&[(c2, 0)], "reserve").unwrap();
        // A fork inherits the hole; a free forgets the session; a new one starts whole.
        let f = s.fork(a).unwrap();
        led.forked(a, f);
        assert_eq!(led.written_of(f), vec![4, 0]);
        s.free(a).unwrap();
        led.freed(a);
        let n = s.create().unwrap();
        led.created(n);
        assert_eq!(led.written_of(n), vec![0, 0]);
        // Captured appends write nothing until replayed; a replay over a hole is refused.
        let b3 = reserve(&mut s, &mut led, &[(n, 1)]);
        led.begin_capture();
        led.check_append(&b3, 0, "append").unwrap();
        led.appended(&b3, 0);
        led.check_read(&b3, 0, "attend").unwrap();
        let g = led.end_capture();
        assert_eq!(led.written_of(n), vec![0, 0], "recorded, not run");
        led.check_replay(&b3, &g, "replay").unwrap();
        led.replayed(&b3, &g);
        assert_eq!(led.written_of(n), vec![1, 0]);
        let b4 = reserve(&mut s, &mut led, &[(b, 1)]);
        let e = led
            .check_replay(&b4, &[true, true], "replay")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("session 1") && e.contains("rows 0..2 of layer 1"),
            "{e}"
        );
        led.check_replay(&b4, &[true, false], "replay").unwrap();
    }

    /// The written-prefix rule against the ground truth, at several sizes: random creates,
    /// forks, frees, reserves, appends of some layers only (failed steps), truncations and
    /// reads, with a bitmap of the rows each append really wrote beside the ledger. Sound: a
    /// read, append or reserve the ledger allows never touches a row no append wrote (a read
    /// of a layer needs all its rows; an append the rows before its new ones; a reserve every
    /// written layer's rows). Complete on healthy sessions: a read of a layer appended in the
    /// step, whose rows are all written, is allowed. (Checked by mutation: dropping the
    /// truncation's clamp, the append's prefix check or the reserve's check fails this test;
    /// the read's own prefix check is defence in depth behind the other two.)
    #[test]
    // `l` indexes the ground truth's inner vectors and names the layer checked.
    #[allow(clippy::needless_range_loop)]
    fn the_written_prefix_never_lets_an_unwritten_row_be_read() {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        use std::collections::BTreeMap;
        for (seed, layers, sessions, pages) in
            [(1u64, 1usize, 2usize, 8usize), (2, 2, 4, 8), (3, 4, 4, 32)]
        {
            let mut c = cfg();
            c.shape.layers = layers;
            c.pages.max_sessions = sessions;
            c.pages.pages = pages;
            let mut rng = StdRng::seed_from_u64(0x1ED6 + seed);
            let mut s = crate::pages::CacheSessions::new(c.pages).unwrap();
            let mut led = StepLedger::new(layers);
            // Ground truth: per live session, per layer, which rows an append wrote.
            let mut rows: BTreeMap<SessionId, Vec<Vec<bool>>> = BTreeMap::new();
            let mut batch: Option<AppendBatch> = None;
            let mut step = 0u64;
            let (mut refused, mut allowed_reads) = (0, 0);
            for _ in 0..3000 {
                let live: Vec<SessionId> = rows.keys().copied().collect();
                let pick = |rng: &mut StdRng| live[rng.gen_range(0..live.len())];
                match rng.gen_range(0..12) {
                    0 => {
                        if let Ok(id) = s.create() {
                            led.created(id);
                            rows.insert(id, vec![Vec::new(); layers]);
                        }
                    }
                    1 if !live.is_empty() => {
                        let p = pick(&mut rng);
                        if let Ok(id) = s.fork(p) {
                            led.forked(p, id);
                            let r = rows[&p].clone();
                            rows.insert(id, r);
                        }
                    }
                    2 if !live.is_empty() && rng.gen_bool(0.3) => {
                        let id = pick(&mut rng);
                        s.free(id).unwrap();
                        led.freed(id);
                        rows.remove(&id);
                        batch = None;
                    }
                    3 if !live.is_empty() => {
                        // A truncation (the plain cut; a backend's re-append is appends).
                        let id = pick(&mut rng);
                        let n = s.len(id).unwrap();
                        let to = n.saturating_sub(rng.gen_range(0..=70));
                        s.truncate(id, to).unwrap();
                        led.truncated(id, to);
                        rows.get_mut(&id)
                            .unwrap()
                            .iter_mut()
                            .for_each(|r| r.truncate(to));
                        batch = None;
                    }
                    4..=6 if !live.is_empty() => {
                        let mut want: Vec<(SessionId, usize)> = Vec::new();
                        for _ in 0..rng.gen_range(1..=live.len()) {
                            let id = pick(&mut rng);
                            if want.iter().all(|(x, _)| *x != id) {
                                want.push((id, [1, 1, 3, 64, 65][rng.gen_range(0..5)]));
                            }
                        }
                        let lens: Vec<(SessionId, usize)> = want
                            .iter()
                            .map(|&(id, _)| (id, s.len(id).unwrap()))
                            .collect();
                        let ok = led.check_grow(&lens, "reserve").is_ok();
                        if ok {
                            // Sound: every written layer holds all of each session's rows.
                            for &(id, _) in &lens {
                                for l in led.appended_layers() {
                                    assert!(rows[&id][l].iter().all(|&w| w), "reserve over a hole");
                                }
                            }
                            if let Ok(plans) = s.reserve_many(&want) {
                                step += 1;
                                let b = AppendBatch::new(plans, step);
                                led.reserved(&b);
                                for p in &b.plans {
                                    for r in rows.get_mut(&p.session).unwrap() {
                                        r.resize(p.first_token + p.tokens, false);
                                    }
                                }
                                batch = Some(b);
                            }
                        } else {
                            refused += 1;
                        }
                    }
                    7..=9 => {
                        // An append of one layer (a failed step skips some).
                        let Some(b) = &batch else { continue };
                        let l = rng.gen_range(0..layers);
                        if led.check_append(b, l, "append").is_ok() {
                            for p in &b.plans {
                                let r = &mut rows.get_mut(&p.session).unwrap()[l];
                                assert!(
                                    r[..p.first_token].iter().all(|&w| w),
                                    "append over a hole"
                                );
                                r[p.first_token..p.first_token + p.tokens].fill(true);
                            }
                            led.appended(b, l);
                        } else {
                            refused += 1;
                        }
                    }
                    _ => {
                        let Some(b) = &batch else { continue };
                        for l in 0..layers {
                            let whole = b
                                .plans
                                .iter()
                                .all(|p| rows[&p.session][l].iter().all(|&w| w));
                            let fresh = led.appended_at[l] == b.step;
                            match led.check_read(b, l, "attend") {
                                Ok(()) => {
                                    assert!(whole, "a read of rows no append wrote");
                                    allowed_reads += 1;
                                }
                                Err(_) => assert!(!(whole && fresh), "a healthy read refused"),
                            }
                        }
                    }
                }
                s.check().unwrap();
            }
            assert!(
                refused > 20 && allowed_reads > 20,
                "seed {seed}: {refused} refused, {allowed_reads} reads"
            );
        }
    }

    #[test]
    fn host_rows_past_the_stored_ranges_are_refused() {
        let c = cfg();
        let mut s = crate::pages::CacheSessions::new(c.pages).unwrap();
        let a = s.create().unwrap();
        let batch = AppendBatch::new(s.reserve_many(&[(a, 1)]).unwrap(), 1);
        let n = c.shape.kv_heads * c.shape.dim;
        let (k, v) = (vec![0.5f32; n], vec![0.5f32; n]);
        assert!(check_host_rows(&c, &batch, &k, &v).is_ok());
        let mut big = k.clone();
        // The largest bf16 below fp16's limit; 65504 itself rounds to the bf16 65536.
        big[130] = 65_280.0;
        assert!(check_host_rows(&c, &batch, &big, &v).is_ok());
        big[130] = 65_504.0;
        let e = check_host_rows(&c, &batch, &big, &v)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("keys") && e.contains("head 1, channel 2") && e.contains("fp16"),
            "{e}"
        );
        let mut vbig = v.clone();
        vbig[3] = 70_000.0;
        assert!(
            check_host_rows(&c, &batch, &k, &vbig).is_ok(),
            "values are bf16 records"
        );
        vbig[3] = f32::MAX;
        let e = check_host_rows(&c, &batch, &k, &vbig)
            .unwrap_err()
            .to_string();
        assert!(e.contains("values") && e.contains("bf16"), "{e}");
    }

    #[test]
    fn configs_are_validated() {
        assert!(cfg().validate().is_ok());
        let mut c = cfg();
        c.shape.dim = 96;
        assert!(c.validate().unwrap_err().to_string().contains("D = 96"));
        let mut c = cfg();
        c.max_batch = 5;
        assert!(c.validate().unwrap_err().to_string().contains("max_batch"));
        let mut c = cfg();
        c.pages.page_tokens = 96;
        assert!(c.validate().is_err());
        let mut c = cfg();
        c.pages.page_tokens = MAX_PAGE_TOKENS * 2;
        c.pages.max_tokens = MAX_PAGE_TOKENS * 2;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("page_tokens"));
        // At the limit, one KV head's runs at D = 256 fit a 32-bit offset.
        let lay = crate::paged_layout::PagedLayout::new(
            fathom_store::Dims {
                heads: 1,
                channels: 256,
            },
            MAX_PAGE_TOKENS,
            1,
        )
        .unwrap();
        assert!(256 * lay.channel_run_bytes() < 1 << 32);
    }

    #[test]
    fn rows_are_checked_against_the_batch() {
        let c = cfg();
        let mut s = crate::pages::CacheSessions::new(c.pages).unwrap();
        let (a, b) = (s.create().unwrap(), s.create().unwrap());
        let batch = AppendBatch::new(s.reserve_many(&[(a, 3), (b, 70)]).unwrap(), 1);
        assert_eq!(batch.row0, vec![0, 3]);
        assert_eq!(batch.rows, 73);
        let kv = KvRows {
            k: 16,
            v: 32,
            dtype: KvDtype::Bf16,
            rows: 73,
        };
        assert!(check_rows(&c, &batch, 1, 1, &kv).is_ok());
        let e = check_rows(&c, &batch, 1, 2, &kv).unwrap_err().to_string();
        assert!(e.contains("2 layers"), "{e}");
        let e = check_rows(&c, &batch, 2, 0, &kv).unwrap_err().to_string();
        assert!(e.contains("stale"), "{e}");
        let e = check_rows(&c, &batch, 1, 0, &KvRows { rows: 72, ..kv })
            .unwrap_err()
            .to_string();
        assert!(e.contains("72 rows"), "{e}");
        let e = check_rows(&c, &batch, 1, 0, &KvRows { k: 0, ..kv })
            .unwrap_err()
            .to_string();
        assert!(e.contains("null"), "{e}");
    }
}
