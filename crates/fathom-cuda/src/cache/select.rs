//! How an attend selects (docs/SPEC.md §5): the method, the select path, the queries, and the
//! counters of what the selection did.

#[allow(unused_imports)]
use super::*;

/// How attends take each query head's top-k (docs/SPEC.md §5; [`crate::cache::CacheOptions::select`]).
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

/// How attends' query-head rows took their top-k ([`crate::api::KvCache::select_counters`]):
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

/// Union rows fetched and row-cache hits ([`crate::api::KvCache::row_counters`]).
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

/// One layer's queries in device memory, `[batch][Hq][D]` (one query per session of the
/// batch, at its last token), after RoPE and any QK-norm, of any [`KvDtype`]
/// (`crate::cache::KvDtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryRows<'a> {
    /// The queries.
    pub q: crate::memory::DeviceView<'a>,
}

/// Where [`crate::api::KvCache::select`] writes each query head's selection (docs/SPEC.md §5),
/// the shape SGLang's `SparsityPolicy` and vLLM's sparse indexer consume: `indices`
/// `[batch][Hq][cap]` i32, the logical token positions each query head attends (its sink, its
/// top-k winners, its local window), -1 past the row's length; `lengths` `[batch][Hq]` i32.
#[derive(Debug)]
pub struct SelectOut<'a> {
    /// `[batch][Hq][cap]` i32.
    pub indices: crate::memory::DeviceViewMut<'a>,
    /// `[batch][Hq]` i32.
    pub lengths: crate::memory::DeviceViewMut<'a>,
    /// Slots per row: at least `sink + local + k`, so that every selection fits.
    pub cap: usize,
}

/// `#[repr(C)]` parameters of `paged_select_out` (kernels/attend/select.cu): the selection
/// and the output's row stride.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SelectOutParams {
    /// Sink tokens (docs/SPEC.md §5).
    pub sink: u32,
    /// Local-window tokens.
    pub local: u32,
    /// The winners' row stride (the cache's `max_k`).
    pub max_k: u32,
    /// Slots per output row.
    pub cap: u32,
    /// Query heads per session.
    pub hq: u32,
}
const _: () = assert!(std::mem::size_of::<SelectOutParams>() == 20);

/// One row of the selection as `paged_select_out` writes it (its CPU twin): a session of `n`
/// tokens, the row's top-k `winners` (middle tokens, at most `max_k` of them read), into `cap`
/// slots. Returns the row and its length: `[0, min(sink, n))`, the winners in their order,
/// then the local window `[max(n − local, sink_end), n)`, then -1.
///
/// ```
/// use fathom_cuda::cache::{select_out_row, SelectOutParams};
/// let p = SelectOutParams { sink: 2, local: 2, max_k: 4, cap: 8, hq: 1 };
/// let (row, len) = select_out_row(&p, 10, &[5, 3]);
/// assert_eq!((row, len), (vec![0, 1, 5, 3, 8, 9, -1, -1], 6));
/// ```
pub fn select_out_row(p: &SelectOutParams, n: u32, winners: &[u32]) -> (Vec<i32>, i32) {
    let sink_end = p.sink.min(n);
    let local_start = n.saturating_sub(p.local).max(sink_end);
    let cnt = (winners.len() as u32).min(p.max_k);
    let len = sink_end + cnt + (n - local_start);
    let row = (0..p.cap)
        .map(|i| {
            if i < sink_end {
                i as i32
            } else if i < sink_end + cnt {
                winners[(i - sink_end) as usize] as i32
            } else if i < len {
                (local_start + (i - sink_end - cnt)) as i32
            } else {
                -1
            }
        })
        .collect();
    (row, len as i32)
}
