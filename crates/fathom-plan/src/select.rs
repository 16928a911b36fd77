//! The selection protocol of docs/SPEC.md §5, written once for every scan.
//!
//! For a query at position `pos` (keys `0..=pos`, `n = pos + 1` of them), one query head keeps
//!
//! * the **sink**: tokens `0 .. min(sink, n)`;
//! * the **local window**: the last `local` tokens, `max(n − local, sink) ..= pos`;
//! * from the **middle** in between, the `k` tokens of highest score (ties to the lower token
//!   index). If the middle has at most `k` tokens, all of them.
//!
//! The output is sorted ascending without duplicates. A scan supplies only its scores; the
//! KV head then fetches the union of its `G` heads' sets ([`union_sorted`]).
//!
//! Scores are compared with IEEE order (`±∞` allowed, `−0 = +0`); a NaN score in the middle
//! is an error, never silently ranked. Scores of sink and local tokens are not read.

use crate::PlanError;

/// Sink, local window and top-k sizes (docs/SPEC.md §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelectParams {
    /// Leading tokens always kept (4).
    pub sink: usize,
    /// Trailing tokens always kept (32).
    pub local: usize,
    /// Tokens taken by score from the middle, per query head (128 at 4k context).
    pub k: usize,
}

impl Default for SelectParams {
    fn default() -> Self {
        SelectParams {
            sink: 4,
            local: 32,
            k: 128,
        }
    }
}

impl SelectParams {
    /// The middle range `sink_end .. local_start` for a query at `pos`.
    pub fn middle(&self, pos: usize) -> std::ops::Range<usize> {
        let n = pos + 1;
        let sink_end = self.sink.min(n);
        let local_start = n.saturating_sub(self.local).max(sink_end);
        sink_end..local_start
    }
}

/// Selects the tokens one query head attends to at `pos` (docs/SPEC.md §5); see the
/// [module docs](self).
///
/// `scores[i]` is the head's approximate score of token `i`; `scores` must cover `0..=pos`
/// (entries past `pos` are ignored). `out` is cleared and filled, sorted ascending; pass the
/// same vector again to avoid allocating. `O(n)` time (a sampled threshold, one filtering pass,
/// `select_nth_unstable` among the survivors) plus `O(k log k)` to sort the winners.
///
/// ```
/// use fathom_plan::{select_per_head, SelectParams};
/// let params = SelectParams { sink: 1, local: 2, k: 2 };
/// let scores = [0.0, 5.0, 1.0, 7.0, 5.0, 0.0, 0.0];
/// let mut out = Vec::new();
/// select_per_head(6, &scores, &params, &mut out)?;
/// assert_eq!(out, [0, 1, 3, 5, 6]); // sink 0, top-2 {3, 1} (1 beats 4 on the tie), local 5, 6
/// # Ok::<(), fathom_plan::PlanError>(())
/// ```
///
/// # Errors
/// [`PlanError::ShapeMismatch`] if `scores.len() < pos + 1`; [`PlanError::NonFinite`] for a
/// NaN score in the middle (the index is the token).
pub fn select_per_head(
    pos: usize,
    scores: &[f32],
    params: &SelectParams,
    out: &mut Vec<u32>,
) -> Result<(), PlanError> {
    if u32::try_from(pos).is_err() {
        return Err(PlanError::InvalidParameter {
            name: "pos",
            value: pos as f64,
            reason: "token indices must fit in u32",
        });
    }
    let n = pos + 1;
    if scores.len() < n {
        return Err(PlanError::ShapeMismatch {
            what: "scores length (at least pos + 1)",
            expected: n,
            got: scores.len(),
        });
    }
    let middle = params.middle(pos);
    let mid = &scores[middle.clone()];
    // A branch-free scan first (it vectorises); the position only when there is a NaN.
    if mid.iter().fold(false, |a, s| a | s.is_nan()) {
        let i = mid.iter().position(|s| s.is_nan()).unwrap_or(0);
        return Err(PlanError::NonFinite {
            what: "scores",
            index: middle.start + i,
        });
    }
    out.clear();
    out.extend((0..middle.start).map(|i| i as u32));
    let first = out.len();
    if middle.len() <= params.k {
        out.extend(middle.clone().map(|i| i as u32));
    } else if params.k > 0 {
        // Tokens are ranked by a composite key (score, then lower index), a total order, so
        // the top k is one well-defined set. A strided sample gives a threshold that about
        // 2k tokens clear; one pass keeps those candidates (if fewer than k clear it, every
        // token is a candidate), and a selection among them finds the top k exactly.
        let k = params.k;
        let rank = |i: usize, s: f32| (u64::from(order_key(s)) << 32) | u64::from(!(i as u32));
        let stride = (mid.len() / SAMPLE).max(1);
        let mut sample: Vec<u64> = (0..mid.len())
            .step_by(stride)
            .map(|j| rank(middle.start + j, mid[j]))
            .collect();
        let r = 2 * k * sample.len() / mid.len();
        // Compared on the score alone (as a float, so a block of scores is tested in one
        // vector compare): ties at the threshold all pass, which only adds candidates.
        let floor = if r < sample.len() {
            key_value((*sample.select_nth_unstable_by(r, |a, b| b.cmp(a)).1 >> 32) as u32)
        } else {
            f32::NEG_INFINITY
        };
        let mut cand: Vec<u64> = Vec::with_capacity(4 * k);
        let blocks = mid.chunks_exact(FILTER_BLOCK);
        let tail = middle.start + (mid.len() - blocks.remainder().len());
        let mut keep = |i: usize, s: f32| {
            if s >= floor {
                cand.push(rank(i, s));
            }
        };
        for (b, block) in blocks.clone().enumerate() {
            if block.iter().fold(false, |a, &s| a | (s >= floor)) {
                let base = middle.start + b * FILTER_BLOCK;
                for (j, &s) in block.iter().enumerate() {
                    keep(base + j, s);
                }
            }
        }
        for (j, &s) in blocks.remainder().iter().enumerate() {
            keep(tail + j, s);
        }
        if cand.len() < k {
            cand.clear();
            cand.extend(
                (middle.start..middle.end)
                    .zip(mid)
                    .map(|(i, &s)| rank(i, s)),
            );
        }
        if cand.len() > k {
            cand.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
        }
        out.extend(cand[..k].iter().map(|&x| !(x as u32)));
        out[first..].sort_unstable();
    }
    out.extend((middle.end..n).map(|i| i as u32));
    Ok(())
}

/// Tokens sampled by [`select_per_head`] to find its candidate threshold.
const SAMPLE: usize = 512;

/// Scores tested at once against the candidate threshold.
const FILTER_BLOCK: usize = 16;

/// The score whose [`order_key`] is `key` (`+0` for the key of `±0`).
fn key_value(key: u32) -> f32 {
    f32::from_bits(if key & 0x8000_0000 != 0 {
        key & 0x7fff_ffff
    } else {
        !key
    })
}

/// A `u32` whose unsigned order is the IEEE order of a non-NaN `f32`, with `−0 = +0`.
#[inline(always)]
fn order_key(s: f32) -> u32 {
    let b = if s == 0.0 { 0 } else { s.to_bits() };
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// [`select_per_head`] for the `G` heads of a group: `scores` is `[G, n]` row-major (row
/// stride `n = scores.len() / G`, with `n ≥ pos + 1`). Returns one sorted set per head.
///
/// # Errors
/// [`PlanError::ShapeMismatch`] if `scores.len()` is not a multiple of `G` or the rows are
/// shorter than `pos + 1`; [`PlanError::NonFinite`] for a NaN middle score (the index is
/// flat in `scores`).
pub fn select_group(
    pos: usize,
    scores: &[f32],
    g: usize,
    params: &SelectParams,
) -> Result<Vec<Vec<u32>>, PlanError> {
    if g == 0 {
        return if scores.is_empty() {
            Ok(Vec::new())
        } else {
            Err(PlanError::ShapeMismatch {
                what: "scores length (G = 0)",
                expected: 0,
                got: scores.len(),
            })
        };
    }
    if scores.len() % g != 0 {
        let expected = scores.len() / g * g;
        return Err(PlanError::ShapeMismatch {
            what: "scores length (a multiple of G)",
            expected,
            got: scores.len(),
        });
    }
    let n = scores.len() / g;
    (0..g)
        .map(|h| {
            // At most pos + 1 tokens are selected: a huge (valid) k must not size the buffer.
            let most = params
                .sink
                .saturating_add(params.local)
                .saturating_add(params.k)
                .min(pos.saturating_add(1));
            let mut out = Vec::with_capacity(most);
            select_per_head(pos, &scores[h * n..(h + 1) * n], params, &mut out).map_err(
                |e| match e {
                    PlanError::NonFinite { what, index } => PlanError::NonFinite {
                        what,
                        index: h * n + index,
                    },
                    e => e,
                },
            )?;
            Ok(out)
        })
        .collect()
}

/// What [`select_filtered`] did with its filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterOutcome {
    /// `passed` middle tokens scored at or above the filter (at least `min(k, middle)`, at
    /// most the cap): the selection is made from them alone and equals [`select_per_head`]'s.
    Selected {
        /// Middle tokens at or above the filter.
        passed: usize,
    },
    /// Fewer than `min(k, middle)` passed: the filter was too high (the caller falls back to
    /// the whole row).
    TooFew {
        /// Middle tokens at or above the filter.
        passed: usize,
    },
    /// More than the cap passed: a bounded pair buffer would have overflowed (the caller falls
    /// back to the whole row).
    Overflow {
        /// Middle tokens at or above the filter.
        passed: usize,
    },
}

/// The filtered select of docs/SPEC.md §5 ("Selection without a score array"), the CPU
/// reference of `fathom-cuda`'s `paged_topk_fused`: only the middle tokens with a score
/// `≥ filter` are kept (as a scan that writes no score array keeps its passing (score, token)
/// pairs, at most `cap` of them), and when at least `kk = min(k, middle)` pass, the top-kk of
/// those (ties to the lower index) is the selection. Then `out` holds exactly what
/// [`select_per_head`] gives for the same row: every token at or above the kk-th score
/// passed the filter. Otherwise `out` is left empty and the outcome says why.
///
/// ```
/// use fathom_plan::select::{select_filtered, FilterOutcome};
/// use fathom_plan::{select_per_head, SelectParams};
/// let p = SelectParams { sink: 1, local: 1, k: 2 };
/// let scores = [0.0, 5.0, 1.0, 7.0, 5.0, 3.0, 0.0];
/// let (mut a, mut b) = (Vec::new(), Vec::new());
/// assert_eq!(select_filtered(6, &scores, &p, 2.0, 8, &mut a)?, FilterOutcome::Selected { passed: 4 });
/// select_per_head(6, &scores, &p, &mut b)?;
/// assert_eq!(a, b); // [0, 1, 3, 6]
/// assert_eq!(select_filtered(6, &scores, &p, 6.0, 8, &mut a)?, FilterOutcome::TooFew { passed: 1 });
/// assert_eq!(select_filtered(6, &scores, &p, 0.0, 3, &mut a)?, FilterOutcome::Overflow { passed: 5 });
/// # Ok::<(), fathom_plan::PlanError>(())
/// ```
///
/// # Errors
/// As [`select_per_head`]; a NaN filter is [`PlanError::InvalidParameter`].
pub fn select_filtered(
    pos: usize,
    scores: &[f32],
    params: &SelectParams,
    filter: f32,
    cap: usize,
    out: &mut Vec<u32>,
) -> Result<FilterOutcome, PlanError> {
    if filter.is_nan() {
        return Err(PlanError::InvalidParameter {
            name: "filter",
            value: f64::NAN,
            reason: "a filter score must be a number",
        });
    }
    // The row's checks (length, NaN in the middle) are select_per_head's.
    let mut full = Vec::new();
    select_per_head(pos, scores, params, &mut full)?;
    let middle = params.middle(pos);
    let kk = params.k.min(middle.len());
    let passing: Vec<usize> = middle.clone().filter(|&i| scores[i] >= filter).collect();
    out.clear();
    if passing.len() < kk {
        return Ok(FilterOutcome::TooFew {
            passed: passing.len(),
        });
    }
    if passing.len() > cap {
        return Ok(FilterOutcome::Overflow {
            passed: passing.len(),
        });
    }
    // The top kk of the passing pairs by (score, then lower index), as the device's radix
    // select over their keys and then over ~index.
    let mut ranked = passing.clone();
    ranked.sort_by(|&a, &b| {
        scores[b]
            .partial_cmp(&scores[a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    out.extend((0..middle.start).map(|i| i as u32));
    let first = out.len();
    out.extend(ranked[..kk].iter().map(|&i| i as u32));
    out[first..].sort_unstable();
    out.extend((middle.end..=pos).map(|i| i as u32));
    Ok(FilterOutcome::Selected {
        passed: passing.len(),
    })
}

/// The union of token sets (the rows a KV head fetches for its `G` query heads), sorted
/// ascending without duplicates. The inputs need not be sorted.
pub fn union_sorted(sets: &[Vec<u32>]) -> Vec<u32> {
    let mut all: Vec<u32> = sets.iter().flatten().copied().collect();
    all.sort_unstable();
    all.dedup();
    all
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::testutil::runner;

    fn check(pos: usize, scores: &[f32], (sink, local, k): (usize, usize, usize), expect: &[u32]) {
        let mut out = vec![99];
        select_per_head(pos, scores, &SelectParams { sink, local, k }, &mut out).unwrap();
        assert_eq!(out, expect, "pos {pos}, sink {sink}, local {local}, k {k}");
    }

    #[test]
    fn hand_built_cases() {
        let s: Vec<f32> = vec![9.0, 0.0, 3.0, 8.0, 1.0, 8.0, 2.0, 7.0, 0.0, 0.0];
        // Sink 2, local 3, top-2 of the middle 2..7 = {3, 5} (8.0 each).
        check(9, &s, (2, 3, 2), &[0, 1, 3, 5, 7, 8, 9]);
        // Ties at the cut go to the lower index: top-1 of {8.0 @3, 8.0 @5} is 3.
        check(9, &s, (2, 3, 1), &[0, 1, 3, 7, 8, 9]);
        // k = 0: sink and local only.
        check(9, &s, (2, 3, 0), &[0, 1, 7, 8, 9]);
        // The middle (5 tokens) fits in k: everything.
        check(9, &s, (2, 3, 5), &(0..10).collect::<Vec<_>>());
        // pos < sink + local: sink and local overlap, no middle, no duplicates.
        check(3, &s, (2, 3, 2), &[0, 1, 2, 3]);
        check(0, &s, (4, 32, 128), &[0]);
        check(5, &s, (4, 32, 128), &[0, 1, 2, 3, 4, 5]);
        // No sink, no local: pure top-k. Entries past pos are ignored.
        check(4, &s, (0, 0, 2), &[0, 3]);
        // Infinities are ordinary scores.
        check(
            4,
            &[0.0, f32::NEG_INFINITY, f32::INFINITY, 1.0, 0.0],
            (0, 0, 2),
            &[2, 3],
        );
        // −0 and +0 tie; the lower index wins.
        check(2, &[0.0, -0.0, 0.0], (0, 0, 1), &[0]);
        check(2, &[-0.0, 0.0, 0.0], (0, 0, 1), &[0]);
        assert_eq!(
            SelectParams::default(),
            SelectParams {
                sink: 4,
                local: 32,
                k: 128
            }
        );
        assert_eq!(SelectParams::default().middle(99), 4..68);
    }

    #[test]
    fn errors_name_the_problem() {
        let mut out = Vec::new();
        let p = SelectParams {
            sink: 1,
            local: 1,
            k: 1,
        };
        assert_eq!(
            select_per_head(4, &[0.0; 4], &p, &mut out),
            Err(PlanError::ShapeMismatch {
                what: "scores length (at least pos + 1)",
                expected: 5,
                got: 4
            })
        );
        assert_eq!(
            select_per_head(4, &[0.0, 0.0, f32::NAN, 0.0, 0.0], &p, &mut out),
            Err(PlanError::NonFinite {
                what: "scores",
                index: 2
            })
        );
        // NaN in the sink or local window is never read.
        select_per_head(4, &[f32::NAN, 0.0, 1.0, 0.0, f32::NAN], &p, &mut out).unwrap();
        assert_eq!(out, [0, 2, 4]);
        assert_eq!(
            select_group(
                4,
                &[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, f32::NAN, 0.0],
                2,
                &p
            ),
            Err(PlanError::NonFinite {
                what: "scores",
                index: 8
            })
        );
        assert!(matches!(
            select_group(1, &[0.0; 5], 2, &p),
            Err(PlanError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            select_group(4, &[0.0; 8], 2, &p),
            Err(PlanError::ShapeMismatch {
                expected: 5,
                got: 4,
                ..
            })
        ));
        assert_eq!(select_group(4, &[], 0, &p), Ok(vec![]));
    }

    #[test]
    fn group_and_union() {
        let p = SelectParams {
            sink: 1,
            local: 1,
            k: 1,
        };
        // G = 2, n = 5 (pos = 3, the last column is ignored).
        let scores = [0.0, 5.0, 1.0, 0.0, 0.0, 0.0, 1.0, 5.0, 0.0, 0.0];
        let sets = select_group(3, &scores, 2, &p).unwrap();
        assert_eq!(sets, vec![vec![0, 1, 3], vec![0, 2, 3]]);
        assert_eq!(union_sorted(&sets), vec![0, 1, 2, 3]);
        assert_eq!(
            union_sorted(&[vec![5, 1], vec![], vec![1, 3, 9]]),
            vec![1, 3, 5, 9]
        );
        assert_eq!(union_sorted(&[]), Vec::<u32>::new());
    }

    /// Against a full sort: the same set, sorted, of size min(n, sink + local + k) when the
    /// windows do not overlap.
    #[test]
    fn prop_matches_a_full_sort() {
        let strategy = (1usize..300, 0usize..6, 0usize..40, 0usize..50).prop_flat_map(
            |(n, sink, local, k)| {
                (
                    prop::collection::vec(
                        prop_oneof![(0i8..4).prop_map(f32::from), -1e3f32..1e3],
                        n,
                    ),
                    Just((sink, local, k)),
                )
            },
        );
        runner(256)
            .run(&strategy, |(scores, (sink, local, k))| {
                let pos = scores.len() - 1;
                let p = SelectParams { sink, local, k };
                let mut out = Vec::new();
                select_per_head(pos, &scores, &p, &mut out).unwrap();
                let mid = p.middle(pos);
                let mut ranked: Vec<usize> = mid.clone().collect();
                ranked.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap().then(a.cmp(&b)));
                let mut expect: Vec<u32> = (0..mid.start)
                    .chain(ranked.into_iter().take(k))
                    .chain(mid.end..=pos)
                    .map(|i| i as u32)
                    .collect();
                expect.sort_unstable();
                prop_assert_eq!(out, expect);
                Ok(())
            })
            .unwrap();
    }

    /// The filtered select equals the whole-row select whenever at least kk tokens pass its
    /// filter (ties at the filter and at the kk-th score included: scores are drawn from a
    /// few values half the time), and reports TooFew exactly when fewer pass, at sizes from
    /// 1 to 600 tokens and filters below, inside and above the row's range.
    #[test]
    fn prop_filtered_select_is_the_whole_row_select() {
        let strategy = (1usize..600, 0usize..6, 0usize..40, 0usize..80).prop_flat_map(
            |(n, sink, local, k)| {
                (
                    prop::collection::vec(
                        prop_oneof![(0i8..4).prop_map(f32::from), -1e3f32..1e3],
                        n,
                    ),
                    Just((sink, local, k)),
                    prop_oneof![(0i8..4).prop_map(f32::from), -1.2e3f32..1.2e3],
                    1usize..700,
                )
            },
        );
        runner(512)
            .run(&strategy, |(scores, (sink, local, k), filter, cap)| {
                let pos = scores.len() - 1;
                let p = SelectParams { sink, local, k };
                let (mut a, mut b) = (Vec::new(), Vec::new());
                let outcome = select_filtered(pos, &scores, &p, filter, cap, &mut a).unwrap();
                select_per_head(pos, &scores, &p, &mut b).unwrap();
                let mid = p.middle(pos);
                let passed = mid.clone().filter(|&i| scores[i] >= filter).count();
                let kk = k.min(mid.len());
                match outcome {
                    FilterOutcome::Selected { passed: n } => {
                        prop_assert_eq!(n, passed);
                        prop_assert!(passed >= kk && passed <= cap);
                        prop_assert_eq!(a, b);
                    }
                    FilterOutcome::TooFew { passed: n } => {
                        prop_assert_eq!(n, passed);
                        prop_assert!(passed < kk);
                        prop_assert!(a.is_empty());
                    }
                    FilterOutcome::Overflow { passed: n } => {
                        prop_assert_eq!(n, passed);
                        prop_assert!(passed >= kk && passed > cap);
                    }
                }
                Ok(())
            })
            .unwrap();
        let mut out = Vec::new();
        assert!(matches!(
            select_filtered(
                3,
                &[0.0; 4],
                &SelectParams::default(),
                f32::NAN,
                8,
                &mut out
            ),
            Err(PlanError::InvalidParameter { name: "filter", .. })
        ));
    }

    /// Long contexts (the sampled threshold, strided sample) against a full sort, with
    /// ascending, descending, tied and random scores.
    #[test]
    fn long_contexts_match_a_full_sort() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for n in [700usize, 4096, 9000] {
            let shapes: Vec<Vec<f32>> = vec![
                (0..n).map(|_| rng.gen_range(-50.0f32..50.0)).collect(),
                (0..n).map(|i| i as f32).collect(),
                (0..n).map(|i| -(i as f32)).collect(),
                (0..n).map(|i| (i / 16) as f32 % 7.0).collect(),
                (0..n).map(|_| f32::from(rng.gen_range(0u8..3))).collect(),
                vec![1.0; n],
            ];
            for scores in shapes {
                for k in [1usize, 128, 1000] {
                    let p = SelectParams {
                        sink: 4,
                        local: 32,
                        k,
                    };
                    let pos = n - 1;
                    let mut out = Vec::new();
                    select_per_head(pos, &scores, &p, &mut out).unwrap();
                    let mid = p.middle(pos);
                    let mut ranked: Vec<usize> = mid.clone().collect();
                    ranked.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
                    let mut expect: Vec<u32> = (0..mid.start)
                        .chain(ranked.into_iter().take(k))
                        .chain(mid.end..=pos)
                        .map(|i| i as u32)
                        .collect();
                    expect.sort_unstable();
                    assert_eq!(out, expect, "n {n} k {k}");
                }
            }
        }
    }

    /// Huge (valid) sink, local and k: no buffer is sized by them (it would overflow the
    /// capacity or abort the allocation); the set is every token, as `k ≥ middle` says.
    #[test]
    fn huge_params_select_everything_without_sizing_a_buffer_by_them() {
        let scores = [3.0f32, 1.0, 2.0, 0.0, 5.0, 4.0];
        for p in [
            SelectParams {
                sink: 0,
                local: 0,
                k: usize::MAX,
            },
            SelectParams {
                sink: usize::MAX,
                local: usize::MAX,
                k: usize::MAX,
            },
            SelectParams {
                sink: 1,
                local: 1,
                k: usize::MAX / 2,
            },
        ] {
            let sets = select_group(4, &scores[..5], 1, &p).unwrap();
            assert_eq!(sets, [vec![0, 1, 2, 3, 4]], "{p:?}");
            assert!(sets[0].capacity() <= 5, "{p:?}");
        }
        // pos past u32 is a typed error (not an overflow of pos + 1).
        let mut out = Vec::new();
        assert!(matches!(
            select_per_head(usize::MAX, &scores, &SelectParams::default(), &mut out),
            Err(PlanError::InvalidParameter { name: "pos", .. })
        ));
    }
}
