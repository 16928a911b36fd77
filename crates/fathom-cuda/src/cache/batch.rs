//! One reserve step's batch ([`AppendBatch`]) and the page limit of the kernels.

#[allow(unused_imports)]
use super::*;

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
