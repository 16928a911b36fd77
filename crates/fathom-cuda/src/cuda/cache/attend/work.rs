//! The attend's working memory: every buffer its stages write, sized once when the cache is
//! made for `max_batch` sessions of `max_tokens` tokens and `max_k` winners per query head.

#[allow(unused_imports)]
use super::*;

/// Attend's working memory, sized once for `max_batch` sessions of `max_tokens` tokens and
/// `max_k` winners per query head.
pub(in crate::cuda::cache) struct Work {
    /// Queries as f32, `[max_batch][Hq][D]`.
    pub(in crate::cuda::cache) qf: DevBuf,
    /// The queries in the PCA index's basis, `[max_batch][Hq][D]` f32 (with the PCA index).
    pub(in crate::cuda::cache) qr: Option<DevBuf>,
    /// Planned depths, `[max_batch][Hkv][D]`.
    pub(in crate::cuda::cache) depths: DevBuf,
    /// Plan bits, `[max_batch][Hkv]` f32.
    pub(in crate::cuda::cache) bits: DevBuf,
    /// The plan kernels' run list (unused by the paged scan), `[max_batch][Hkv][2D]` × 16 B.
    pub(in crate::cuda::cache) runs: DevBuf,
    /// Sum of plan bits over every attend since the last reset (f32) and its count.
    pub(in crate::cuda::cache) bits_acc: DevBuf,
    /// Scores, `[max_batch][Hkv][G][max_tokens]` f32.
    pub(in crate::cuda::cache) scores: DevBuf,
    /// Winners, `[max_batch][Hq][max_k]` u32, and their counts `[max_batch][Hq]`.
    pub(in crate::cuda::cache) winners: DevBuf,
    pub(in crate::cuda::cache) counts: DevBuf,
    /// The top-k's level-1 histogram `[max_batch][Hq][HIST_BINS]` u32 (built by the scan),
    /// each row's boundary `[max_batch][Hq]` (8 bytes), its candidates (token indices in the
    /// boundary bucket) `[max_batch][Hq][max_tokens]` u32 and their counts.
    pub(in crate::cuda::cache) hist: DevBuf,
    pub(in crate::cuda::cache) sel: DevBuf,
    pub(in crate::cuda::cache) cand: DevBuf,
    pub(in crate::cuda::cache) ccount: DevBuf,
    /// The filtered select (kernels/attend/select.cu, `paged_topk_fused`): each row's estimate
    /// `[max_sessions][L][Hq]` f32 (0 bits: none), its mode `[max_batch][Hq]` u32 (0 score
    /// path, 1 filtered, 2 fallen back), its passing (key, token) pairs
    /// `[max_batch][Hq][fcap]` and their counts.
    pub(in crate::cuda::cache) est: DevBuf,
    pub(in crate::cuda::cache) mode: DevBuf,
    pub(in crate::cuda::cache) fcand: DevBuf,
    pub(in crate::cuda::cache) fcount: DevBuf,
    pub(in crate::cuda::cache) fcap: usize,
    /// Partial attention: max and sum `[max_batch][Hq][DENSE_SPLITS]` f32, weighted V
    /// `[max_batch][Hq][DENSE_SPLITS][D]` f32.
    pub(in crate::cuda::cache) pm: DevBuf,
    pub(in crate::cuda::cache) pl: DevBuf,
    pub(in crate::cuda::cache) pacc: DevBuf,
    /// Union rows, row-cache hits, filtered rows and fallbacks summed over every attend since
    /// the cache was made (u64).
    pub(in crate::cuda::cache) counters: DevBuf,
    /// The HBM row cache (`cache_rows` slots per (session, layer, KV head); absent at 0):
    /// tags u32 (token + 1, 0 empty), records `[4D]` bytes, and the bids of one attend u32
    /// (zero between attends).
    pub(in crate::cuda::cache) row_tags: Option<DevBuf>,
    pub(in crate::cuda::cache) row_data: Option<DevBuf>,
    pub(in crate::cuda::cache) row_claim: Option<DevBuf>,
    /// The union per (session, KV head): rows `[max_batch][Hkv][umax]` u32, the mask of the
    /// query heads that chose each `u8`, the count `u32`.
    pub(in crate::cuda::cache) urows: DevBuf,
    pub(in crate::cuda::cache) umask: DevBuf,
    pub(in crate::cuda::cache) ucount: DevBuf,
    /// The union's K|V records in HBM, `[max_batch][Hkv][umax][2D]` bf16.
    pub(in crate::cuda::cache) rows: DevBuf,
    pub(in crate::cuda::cache) umax: usize,
}

impl Work {
    /// Allocates the working memory of a cache of `cfg` (validated).
    pub(in crate::cuda::cache) fn new(cfg: &CacheConfig) -> Result<Work> {
        let s = cfg.shape;
        let (mb, hkv, hq, d) = (cfg.max_batch, s.kv_heads, s.kv_heads * s.group, s.dim);
        let umax = crate::cache::MAX_SINK_LOCAL + s.group * cfg.max_k;
        let fcap = FUSE_CAP_PER_K * cfg.max_k;
        Ok(Work {
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
            row_tags: row_cache_buf(cfg, 4, "row-cache tags")?,
            row_data: row_cache_buf(cfg, 4 * d, "row cache")?,
            row_claim: row_cache_buf(cfg, 4, "row-cache bids")?,
            urows: DevBuf::new(mb * hkv * umax * 4, "attend union rows")?,
            umask: DevBuf::new(mb * hkv * umax, "attend union masks")?,
            ucount: DevBuf::zeroed(mb * hkv * 4, "attend union counts")?,
            rows: DevBuf::new(mb * hkv * umax * 4 * d, "attend union records")?,
            umax,
        })
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
