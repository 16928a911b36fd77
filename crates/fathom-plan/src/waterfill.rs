//! Reverse water-filling: the per-query plan of docs/SPEC.md §3.
//!
//! Minimise `E(t) = Σ_c w_c · 4^(−t_c)` subject to `bits(t) = Σ_c t_c + 0.25·|{c : t_c > 0}| ≤ B`
//! and `t_c ∈ {0..4}`.
//!
//! # Gains per bit
//!
//! Plane `j ∈ 1..4` of channel `c` lowers `E` by `¾·w_c·4^(−(j−1))` and costs one bit, plus
//! the channel's 0.25-bit scale for `j = 1`. Its gain per bit is therefore
//!
//! ```text
//! ρ_j(w) = w · R_j,   R = [¾/1.25, ¾/4, ¾/16, ¾/64] = [0.6, 0.1875, 0.046875, 0.01171875]
//! ```
//!
//! computed as **one `f64` multiplication** of `w as f64` by the constant [`GAIN_PER_BIT`]`[j−1]`
//! (`R_1 = 0.6` is rounded to `f64`, the others are exact). Because `R` is strictly
//! decreasing, `ρ_1(w) > ρ_2(w) > ρ_3(w) > ρ_4(w)` for every `w > 0`.
//!
//! # The water line
//!
//! For `λ > 0` the depth of channel `c` is the number of its planes worth at least `λ`:
//!
//! ```text
//! t_c(λ) = #{ j ∈ 1..4 : ρ_j(w_c) ≥ λ }
//! ```
//!
//! Since `ρ_j` falls with `j`, these planes are always a prefix `1..t_c`, so a channel never
//! takes a plane without all those before it. `t_c(λ)` is a non-increasing step function of
//! `λ` (and so is `bits(t(λ))`), it is non-decreasing in `w_c` (so `w_a ≥ w_b ⇒ t_a ≥ t_b`),
//! and `w_c = 0` gives `t_c = 0`.
//!
//! The plan is `t(λ*)` with `λ*` the **smallest breakpoint `ρ_j(w_c)` whose plan fits `B`**
//! (the empty plan if none does). Every `λ` between the largest breakpoint that does not fit
//! and `λ*` gives this same plan, so it is docs/SPEC.md's "smallest λ whose bits fit". All planes tied
//! at one gain per bit are taken together or not at all, so budget may be left unused.
//!
//! # Optimality
//!
//! Each channel's cost `w·4^(−t) + λ·(t + 0.25·[t > 0])` is minimised at `t_c(λ)` (its
//! marginal costs change sign once because `ρ_j` falls), so `t(λ)` minimises the Lagrangian
//! `E(t) + λ·bits(t)`. Hence:
//!
//! * the plan is **exactly optimal among plans of at most its own bits**;
//! * against the optimum `E*(B)` at the full budget it is off by at most
//!   `E(t) − E*(B) ≤ λ_next · (B − bits(t))`, where `λ_next` is the gain per bit of the first
//!   plane left out (the integer knapsack effect of the discrete 0.25-bit scale cost and of
//!   ties). Both statements are tested against exhaustive enumeration.
//!
//! # The algorithm, step by step
//!
//! The GPU planner mirrors these steps. The result is decided by the definition above; the
//! bisection (steps 4–5) only shortens the walk of step 6, and any bracket or step count gives
//! the same plan (tested with 0, 3, 32 and the default's steps). Quarter bits are integers:
//! `Q(λ) = Σ_c 4·t_c(λ) + [t_c(λ) > 0]`. Every `ρ` is one multiplication (no fused
//! multiply-add can change it), and for `f32` importances comparing these `f64` values agrees
//! with comparing the exact fractions `3w·4^(−(j−1))/5` and `/4` (tested against an
//! exact-fraction greedy), so the CPU and GPU plans are bit-identical.
//!
//! 1. Check `B` finite and in `[0, 4.25·D]`, every `w_c` finite and `≥ 0`; let `cap = ⌊4B⌋`.
//! 2. If no `w_c > 0`, return the empty plan.
//! 3. `λ_lo = min_{w_c > 0} ρ_4(w_c)` (the smallest breakpoint). If `Q(λ_lo) ≤ cap`, return
//!    `t(λ_lo)` (every positive channel at 4 planes).
//! 4. `λ_hi = 2 · max_c ρ_1(w_c)` (above every breakpoint: the empty plan, which fits).
//!    Invariant from here: `Q(λ_lo) > cap ≥ Q(λ_hi)`.
//! 5. Repeat [`BISECTION_STEPS`] times: `λ_mid = sqrt(λ_lo · λ_hi)` (a bisection of `log λ`;
//!    IEEE `sqrt` is correctly rounded everywhere); if `Q(λ_mid) ≤ cap` then `λ_hi = λ_mid`
//!    else `λ_lo = λ_mid`.
//! 6. Exact finish: let `λ_next = max_{c : 0 < w_c, t_c(λ_hi) < 4} ρ_{t_c(λ_hi)+1}(w_c)`, the
//!    best plane not yet taken. If there is none, or `λ_next ≤ λ_lo`, or `Q(λ_next) > cap`,
//!    stop; otherwise `λ_hi = λ_next` and repeat step 6.
//! 7. Return `t(λ_hi)` and `bits = Q(λ_hi)/4`.
//!
//! Cost: `O(D)` per evaluation of `Q` or of `λ_next`: about 13 such passes per plan at the
//! default [`BISECTION_STEPS`] (9), measured on lognormal importances at D = 128.

use serde::{Deserialize, Serialize};

use crate::bits::{budget_quarters, check_budget, plan_bits, MAX_DEPTH};
use crate::PlanError;

/// The gain per bit of plane `j` (index `j − 1`) per unit importance:
/// `[¾/1.25, ¾·4^(−1), ¾·4^(−2), ¾·4^(−3)]`.
pub const GAIN_PER_BIT: [f64; 4] = [0.75 / 1.25, 0.1875, 0.046875, 0.01171875];

/// Bisection steps on `log λ` before the exact finish (step 6), which makes any count give the
/// same plan, so the count only sets the work: each step and each finish iteration is one
/// `O(D)` pass over the channels (on the GPU, one warp reduction each, done in series). Nine
/// minimises the passes on lognormal importances at D = 128 and 48–92 bits (about 13 per plan,
/// against 35 at 32 steps; `bisection_steps_minimise_the_passes`).
pub const BISECTION_STEPS: u32 = 9;

/// A plan for one query group: the depth of every channel and what it costs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// `t_c ∈ {0..4}`, the number of most significant planes read of channel `c`.
    pub depths: Vec<u8>,
    /// `bits(t) = Σ t_c + 0.25·|active|` (exact; a multiple of 0.25).
    pub bits: f32,
}

impl Plan {
    /// The plan that reads nothing of `d` channels.
    pub fn empty(d: usize) -> Self {
        Plan {
            depths: vec![0; d],
            bits: 0.0,
        }
    }

    /// The active channels `(c, t_c)` with `t_c > 0`, in channel order.
    pub fn active(&self) -> impl Iterator<Item = (usize, u8)> + '_ {
        self.depths
            .iter()
            .copied()
            .enumerate()
            .filter(|&(_, t)| t > 0)
    }

    /// `|{c : t_c > 0}|`.
    pub fn active_count(&self) -> usize {
        self.depths.iter().filter(|&&t| t > 0).count()
    }

    /// `[t_c > 0]` for every channel.
    pub fn active_mask(&self) -> Vec<bool> {
        self.depths.iter().map(|&t| t > 0).collect()
    }

    /// `E(t) = Σ_c w_c · 4^(−t_c)` of this plan (see [`crate::expected_error`]).
    ///
    /// # Panics
    /// If `importance.len()` differs from the number of channels.
    pub fn expected_error(&self, importance: &[f32]) -> f64 {
        crate::bits::expected_error(importance, &self.depths)
    }
}

/// `ρ_j(w)` for plane `j ∈ 1..=4`, as in the module docs.
#[inline]
pub(crate) fn gain_per_bit(w: f32, j: u8) -> f64 {
    f64::from(w) * GAIN_PER_BIT[usize::from(j - 1)]
}

/// `t_c(λ) = #{j : ρ_j(w) ≥ λ}`.
#[inline]
fn depth_at(w: f32, lambda: f64) -> u8 {
    let w = f64::from(w);
    GAIN_PER_BIT
        .iter()
        .map(|&r| u8::from(w * r >= lambda))
        .sum()
}

/// `Q(λ)`, the quarter bits of `t(λ)`.
fn quarters_at(importance: &[f32], lambda: f64) -> u64 {
    importance
        .iter()
        .map(|&w| {
            let t = u64::from(depth_at(w, lambda));
            4 * t + u64::from(t > 0)
        })
        .sum()
}

fn check_importance(importance: &[f32]) -> Result<(), PlanError> {
    for (index, &w) in importance.iter().enumerate() {
        if !w.is_finite() {
            return Err(PlanError::NonFinite {
                what: "importance",
                index,
            });
        }
        if w < 0.0 {
            return Err(PlanError::Negative {
                what: "importance",
                index,
                value: w,
            });
        }
    }
    Ok(())
}

/// Reverse water-filling (docs/SPEC.md §3): minimise `Σ_c w_c 4^(−t_c)` s.t. `bits(t) ≤ B`.
///
/// See the [module docs](self) for the exact definition, the algorithm and its optimality
/// guarantee. The result never exceeds `B`.
///
/// ```
/// // w = [5, 1.25, 0.3125, 0]: plane 3 of channel 0 and plane 2 of channel 1 tie at a gain
/// // per bit of 0.234375, and both fit in 6 bits; the next plane (channel 2's first) does not.
/// let plan = fathom_plan::water_fill(&[5.0, 1.25, 0.3125, 0.0], 6.0)?;
/// assert_eq!(plan.depths, [3, 2, 0, 0]);
/// assert_eq!(plan.bits, 5.5);
/// # Ok::<(), fathom_plan::PlanError>(())
/// ```
///
/// # Errors
/// [`PlanError::BudgetOutOfRange`] unless `0 ≤ B ≤ 4.25·D`; [`PlanError::NonFinite`] or
/// [`PlanError::Negative`] for a bad importance.
pub fn water_fill(importance: &[f32], budget: f32) -> Result<Plan, PlanError> {
    let mut depths = vec![0; importance.len()];
    let bits = water_fill_into(importance, budget, &mut depths)?;
    Ok(Plan { depths, bits })
}

/// [`water_fill`] writing the depths into `depths_out` (`[D]`) and returning the bits, with
/// no allocation: the hot-path form, one call per query group.
///
/// # Errors
/// As [`water_fill`], plus [`PlanError::ShapeMismatch`] if `depths_out.len() ≠ D`.
pub fn water_fill_into(
    importance: &[f32],
    budget: f32,
    depths_out: &mut [u8],
) -> Result<f32, PlanError> {
    water_fill_steps(importance, budget, depths_out, BISECTION_STEPS)
}

/// The algorithm with a chosen number of bisection steps (tests show the plan does not
/// depend on it).
pub(crate) fn water_fill_steps(
    importance: &[f32],
    budget: f32,
    depths_out: &mut [u8],
    steps: u32,
) -> Result<f32, PlanError> {
    water_fill_counted(importance, budget, depths_out, steps).map(|(bits, _)| bits)
}

/// [`water_fill_steps`], also returning the passes over the channels it made (evaluations of
/// `Q` and of step 6's `λ_next`, each one `O(D)` pass; step 7 not counted).
pub(crate) fn water_fill_counted(
    importance: &[f32],
    budget: f32,
    depths_out: &mut [u8],
    steps: u32,
) -> Result<(f32, u32), PlanError> {
    let d = importance.len();
    if depths_out.len() != d {
        return Err(PlanError::ShapeMismatch {
            what: "depths output length (D)",
            expected: d,
            got: depths_out.len(),
        });
    }
    // Step 1.
    check_budget(budget, d)?;
    check_importance(importance)?;
    let cap = budget_quarters(budget);

    // Step 2: the smallest and largest breakpoints.
    let mut lo = f64::INFINITY;
    let mut max_rho1 = 0.0f64;
    for &w in importance.iter().filter(|&&w| w > 0.0) {
        lo = lo.min(gain_per_bit(w, 4));
        max_rho1 = max_rho1.max(gain_per_bit(w, 1));
    }
    let mut passes = 0u32;
    let mut q_at = |lambda: f64| {
        passes += 1;
        quarters_at(importance, lambda)
    };
    let lambda = if lo == f64::INFINITY {
        f64::INFINITY // no positive importance: the empty plan
    } else if q_at(lo) <= cap {
        lo // step 3: everything fits
    } else {
        // Step 4.
        let mut hi = 2.0 * max_rho1;
        // Step 5.
        for _ in 0..steps {
            let mid = (lo * hi).sqrt();
            if q_at(mid) <= cap {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        // Step 6.
        let mut finish_passes = 0u32;
        loop {
            finish_passes += 1;
            let next = importance
                .iter()
                .filter(|&&w| w > 0.0)
                .filter_map(|&w| {
                    let t = depth_at(w, hi);
                    (t < MAX_DEPTH).then(|| gain_per_bit(w, t + 1))
                })
                .fold(f64::NEG_INFINITY, f64::max);
            if next <= lo || q_at(next) > cap {
                break;
            }
            hi = next;
        }
        passes += finish_passes;
        hi
    };
    // Step 7.
    let mut quarters = 0u64;
    for (o, &w) in depths_out.iter_mut().zip(importance) {
        let t = depth_at(w, lambda);
        quarters += 4 * u64::from(t) + u64::from(t > 0);
        *o = t;
    }
    debug_assert!(quarters <= cap);
    Ok((quarters as f32 * 0.25, passes))
}

/// How close to its budget the uniform-depth ablation must spend (docs/SPEC.md §4: "= Fathom's
/// B, measured (within 2%)").
pub const UNIFORM_FILL: f64 = 0.98;

/// The uniform-depth ablation (A4, docs/SPEC.md §4) at equal bits: the most important
/// channels, every one at one depth `t`, as many as fill the budget.
///
/// With `m` channels of positive importance (zero-importance channels are never read, as in
/// water-filling), depth `t` takes `n_t = min(m, ⌊B / (t + 0.25)⌋)` channels and spends
/// `n_t·(t + 0.25)` bits. The depth is the one nearest the Fathom plan's own mean active depth
/// `t̄ = round((bits − 0.25·a) / a)` (clamped to `1..=4`; ties to the shallower) among those
/// that spend at least [`UNIFORM_FILL`]·B; if none does (too few channels), the one that
/// spends most. The channels are the `n_t` most important (ties to the lower index). The
/// result never exceeds `B`.
///
/// # Errors
/// [`PlanError::ShapeMismatch`] if `fathom` and `importance` differ in length; the budget and
/// importance errors of [`water_fill`].
pub fn uniform_depth_plan(
    fathom: &Plan,
    importance: &[f32],
    budget: f32,
) -> Result<Plan, PlanError> {
    let d = fathom.depths.len();
    if importance.len() != d {
        return Err(PlanError::ShapeMismatch {
            what: "importance length (D)",
            expected: d,
            got: importance.len(),
        });
    }
    check_budget(budget, d)?;
    check_importance(importance)?;
    let cap = budget_quarters(budget);
    let mut order: Vec<usize> = (0..d).filter(|&c| importance[c] > 0.0).collect();
    order.sort_by(|&x, &y| importance[y].total_cmp(&importance[x]).then(x.cmp(&y)));
    let m = order.len() as u64;
    // n_t and the quarters it spends, for t = 1..=4.
    let take = |t: u8| {
        let per = 4 * u64::from(t) + 1;
        let n = m.min(cap / per);
        (n, n * per)
    };
    let active = fathom.depths.iter().filter(|&&t| t > 0).count();
    let mean_depth = if active == 0 {
        1.0
    } else {
        (f64::from(fathom.bits) - 0.25 * active as f64) / active as f64
    };
    let target = mean_depth.round().clamp(1.0, f64::from(MAX_DEPTH)) as u8;
    let fill = (UNIFORM_FILL * 4.0 * f64::from(budget)).ceil() as u64;
    let mut ts: Vec<u8> = (1..=MAX_DEPTH).collect();
    ts.sort_by_key(|&t| (t.abs_diff(target), t));
    let t = ts
        .iter()
        .copied()
        .find(|&t| take(t).1 >= fill.min(cap))
        .unwrap_or_else(|| {
            (1..=MAX_DEPTH)
                .max_by_key(|&t| (take(t).1, std::cmp::Reverse(t)))
                .unwrap_or(1)
        });
    let (n, _) = take(t);
    let mut depths = vec![0u8; d];
    for &c in order.iter().take(n as usize) {
        depths[c] = t;
    }
    let bits = plan_bits(&depths);
    Ok(Plan { depths, bits })
}

#[cfg(test)]
mod tests;
