//! The checks every backend runs before a launch (docs/SPEC.md §6.1): each names the argument
//! it refuses, and none touches a device.

#[allow(unused_imports)]
use super::*;
use crate::memory::check_view;

/// The check of [`crate::cache::CacheOptions::scan_vector_words`]: 1 (8-byte plane loads) or 2
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

/// The check of [`crate::cache::CacheOptions::host_gather_share`]: a percent of the misses, 1 to
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

/// Most threads [`crate::cache::CacheOptions::host_gather_threads`] takes.
pub const MAX_GATHER_THREADS: usize = 256;

/// The check of [`crate::cache::CacheOptions::host_gather_threads`] with `groups` head groups per attend:
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
///     pca_index: false, block_tables: false, host_pages: HostPages::Driver, options: Default::default(),
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

/// The check of [`crate::cache::CacheOptions::attend_groups`]: `1 ≤ groups ≤ Hkv`.
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
/// one, the selection fits the cache's limits, the queries hold `[batch][Hq][D]` elements and
/// the output as many f32.
pub fn check_attend(
    cfg: &CacheConfig,
    batch: &AppendBatch,
    current_step: u64,
    layer: usize,
    params: &fathom_plan::SelectParams,
    q: &QueryRows,
    out: &crate::memory::DeviceViewMut<'_>,
) -> Result<()> {
    check_step(cfg, batch, current_step, layer)?;
    let s = cfg.shape;
    let want = batch.plans.len() * s.kv_heads * s.group * s.dim;
    check_view("queries", q.q.len(), q.q.dtype(), want, None)?;
    check_view(
        "attend output",
        out.len(),
        out.dtype(),
        want,
        Some(KvDtype::F32),
    )?;
    check_select(cfg, params)
}

/// The checks of a [`crate::api::KvCache::select`] of `method` before its launch: those of
/// [`check_attend`] for the queries, a method that selects (not dense), and outputs of i32
/// holding `[batch][Hq][cap]` and `[batch][Hq]` with `cap ≥ sink + local + k`.
pub fn check_select_out(
    cfg: &CacheConfig,
    batch: &AppendBatch,
    (current_step, layer): (u64, usize),
    method: AttendMethod,
    params: &fathom_plan::SelectParams,
    q: &QueryRows,
    out: &SelectOut<'_>,
) -> Result<()> {
    check_step(cfg, batch, current_step, layer)?;
    if matches!(method, AttendMethod::Dense) {
        return Err(CudaError::invalid(
            "method",
            "dense attends every token: it has no selection to write (use exact with k ≥ the context)",
        ));
    }
    let s = cfg.shape;
    let rows = batch.plans.len() * s.kv_heads * s.group;
    check_view("queries", q.q.len(), q.q.dtype(), rows * s.dim, None)?;
    check_select(cfg, params)?;
    let need = params.sink + params.local + params.k;
    if out.cap < need || out.cap > u32::MAX as usize {
        return Err(CudaError::invalid(
            "indices",
            format!(
                "capacity {} per row (want at least sink {} + local {} + k {} = {need})",
                out.cap, params.sink, params.local, params.k
            ),
        ));
    }
    check_view(
        "indices",
        out.indices.len(),
        out.indices.dtype(),
        rows * out.cap,
        Some(KvDtype::I32),
    )?;
    check_view(
        "lengths",
        out.lengths.len(),
        out.lengths.dtype(),
        rows,
        Some(KvDtype::I32),
    )
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

/// The checks of a row read before its launch: the layer exists, the batch is the current one,
/// `1 ≤ cap ≤ max_tokens`, and each output holds `[batch][cap][Hkv][D]` f32.
pub fn check_read_rows(
    cfg: &CacheConfig,
    batch: &AppendBatch,
    current_step: u64,
    layer: usize,
    cap: usize,
    k_out: &crate::memory::DeviceViewMut<'_>,
    v_out: &crate::memory::DeviceViewMut<'_>,
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
    let want = batch.plans.len() * cap * cfg.shape.kv_heads * cfg.shape.dim;
    check_view(
        "read_rows keys",
        k_out.len(),
        k_out.dtype(),
        want,
        Some(KvDtype::F32),
    )?;
    check_view(
        "read_rows values",
        v_out.len(),
        v_out.dtype(),
        want,
        Some(KvDtype::F32),
    )
}

/// The checks of an append before its launch: the layer exists, the batch is the current
/// one, the rows match the batch, K and V are of one dtype and each holds
/// `rows · Hkv · D` elements.
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
    if kv.k.dtype() != kv.v.dtype() {
        return Err(CudaError::invalid(
            "kv rows",
            format!(
                "keys of {:?} and values of {:?} (want one dtype)",
                kv.k.dtype(),
                kv.v.dtype()
            ),
        ));
    }
    let want = kv.rows * cfg.shape.kv_heads * cfg.shape.dim;
    check_view("keys", kv.k.len(), kv.k.dtype(), want, None)?;
    check_view("values", kv.v.len(), kv.v.dtype(), want, None)
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
