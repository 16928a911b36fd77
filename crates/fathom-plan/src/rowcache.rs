//! The HBM row cache's rule as a plain CPU reference (docs/SPEC.md §6.1, "Row cache"):
//! `fathom-cuda`'s paged cache keeps recently fetched union rows in a direct-mapped cache per
//! (session, layer, KV head); [`RowCacheModel`] counts what it would hold over any sequence
//! of unions ([`crate::select::union_sorted`]), so a CPU decode can say what the GPU cache
//! would hit, and the GPU's counters are tested against it.

use crate::PlanError;

/// The plain CPU reference of the HBM row cache of one (session, layer, KV head)
/// (docs/SPEC.md §6.1, "Row cache"): `C` direct-mapped slots, token `t` in slot `t mod C`.
///
/// One attend with union `U` (distinct tokens):
/// - `t ∈ U` is a hit iff slot `t mod C` holds `t` when the attend begins;
/// - every slot that some missed `t ∈ U` maps to then holds the **largest** such `t` (the
///   fetch's bids, `atomicMax`, and the attention's fill), whether or not it held a hit of this
///   attend;
/// - every other slot keeps what it held.
///
/// A new or forked session starts empty, as `fathom_cuda::PagedCache`'s slots do. The cache's
/// counters (`fathom_cuda::cache::RowCounters`) over a run of attends equal this model's over the same unions,
/// which lets a CPU decode, whose unions are its own, say what the GPU cache would hit.
///
/// ```
/// use fathom_plan::rowcache::RowCacheModel;
/// let mut rc = RowCacheModel::new(4).unwrap();
/// assert_eq!(rc.attend(&[0, 1, 5]), 0); // all miss; slot 1 keeps 5, the larger bid
/// assert_eq!(rc.attend(&[0, 5, 9]), 2); // 0 and 5 hit; 9 misses and takes slot 1
/// assert_eq!(rc.attend(&[5]), 0);       // 5 was evicted by 9
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowCacheModel {
    /// `tags[s] = t + 1` when slot `s` holds token `t`, 0 when empty (the kernel's encoding).
    tags: Vec<u32>,
    /// Scratch: the largest missed `t + 1` bidding for each slot during one attend.
    bids: Vec<u32>,
}

impl RowCacheModel {
    /// An empty cache of `slots` slots (`CacheConfig::row_cache`); 0 slots is refused, since
    /// a cache without a row cache has no policy to model.
    pub fn new(slots: usize) -> Result<Self, PlanError> {
        if slots == 0 || u32::try_from(slots).is_err() {
            return Err(PlanError::InvalidParameter {
                name: "row-cache slots",
                value: slots as f64,
                reason: "a row-cache model needs 1 ≤ slots ≤ 2^32 − 1",
            });
        }
        Ok(RowCacheModel {
            tags: vec![0; slots],
            bids: vec![0; slots],
        })
    }

    /// Slots `C`.
    pub fn slots(&self) -> usize {
        self.tags.len()
    }

    /// One attend over `union` (distinct token indices, in any order): returns its hits and
    /// updates the slots by the rule above. A repeated token would be counted twice, as the
    /// kernel would count a repeated union row; the union lists it builds never repeat one.
    /// Token `u32::MAX`, whose tag `t + 1` does not fit the kernel's `u32` (no session reaches
    /// it: `max_tokens` < 2³²), always misses and never takes a slot.
    pub fn attend(&mut self, union: &[u32]) -> u64 {
        let c = self.tags.len() as u64;
        let mut hits = 0;
        for &t in union {
            let s = (u64::from(t) % c) as usize;
            match t.checked_add(1) {
                Some(tag) if self.tags[s] == tag => hits += 1,
                Some(tag) => self.bids[s] = self.bids[s].max(tag),
                None => {}
            }
        }
        for &t in union {
            let s = (u64::from(t) % c) as usize;
            if self.bids[s] != 0 {
                self.tags[s] = self.bids[s];
                self.bids[s] = 0;
            }
        }
        hits
    }
}

#[cfg(test)]
mod tests {
    use super::RowCacheModel;

    /// Seeded unions at several cache sizes: with no two tokens of the run sharing a slot a
    /// token hits iff an earlier attend had it; attending one union twice hits once per slot it
    /// maps to (each slot keeps one of its tokens); hits never exceed the union.
    #[test]
    fn row_cache_model_keeps_the_largest_bid_and_hits_what_it_kept() {
        use rand::{rngs::StdRng, seq::index::sample, Rng, SeedableRng};
        use std::collections::HashSet;
        for (seed, slots, n) in [
            (1u64, 1usize, 50usize),
            (2, 7, 60),
            (3, 64, 1000),
            (4, 4096, 3000),
        ] {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut rc = RowCacheModel::new(slots).unwrap();
            let mut wide = RowCacheModel::new(n).unwrap(); // no conflicts below n
            let mut seen = HashSet::new();
            for _ in 0..20 {
                let m = rng.gen_range(1..=n.min(200));
                let u: Vec<u32> = sample(&mut rng, n, m).iter().map(|t| t as u32).collect();
                let before = seen.len();
                let want = u.iter().filter(|t| seen.contains(*t)).count() as u64;
                assert_eq!(wide.attend(&u), want, "seed {seed}");
                seen.extend(u.iter().copied());
                assert!(seen.len() >= before);
                let hits = rc.attend(&u);
                assert!(hits <= u.len() as u64);
                let slots_hit: HashSet<u64> = u.iter().map(|&t| t as u64 % slots as u64).collect();
                assert_eq!(
                    rc.attend(&u),
                    slots_hit.len() as u64,
                    "seed {seed}, C {slots}"
                );
            }
        }
        assert!(RowCacheModel::new(0).is_err());
        let mut rc = RowCacheModel::new(1).unwrap();
        assert_eq!((rc.attend(&[u32::MAX]), rc.attend(&[u32::MAX])), (0, 0));
    }
}
