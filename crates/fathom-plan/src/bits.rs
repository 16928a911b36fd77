//! Bit accounting and the cost model of docs/SPEC.md §3.
//!
//! A plan gives every channel `c` a depth `t_c ∈ {0..4}` (the number of most significant bit
//! planes read). Its cost, in bits per token per KV head, is
//!
//! ```text
//! bits(t) = Σ_c t_c + 0.25 · |{c : t_c > 0}|
//! ```
//!
//! (one fp16 scale per 64 tokens is 16/64 = 0.25 bit, paid by every active channel), and the
//! expected squared score error it leaves is proportional to `E(t) = Σ_c w_c · 4^(−t_c)`.
//!
//! Bits are always multiples of 0.25, so they are exact in `f32` up to 2^22 bits; this module
//! counts them in integer *quarter bits* and converts once.

/// The most planes a channel can have (4-bit codes, docs/SPEC.md §2).
pub const MAX_DEPTH: u8 = 4;

/// The cost of one channel's block scale, in bits per token (fp16 per 64 tokens).
pub const SCALE_BITS: f32 = 0.25;

/// The cost of a plan in quarter bits: `4·Σ t_c + |{c : t_c > 0}|`.
///
/// Depths are taken as given (a depth above 4 is counted as is).
pub fn plan_quarter_bits(depths: &[u8]) -> u64 {
    depths
        .iter()
        .map(|&t| 4 * u64::from(t) + u64::from(t > 0))
        .sum()
}

/// `bits(t) = Σ_c t_c + 0.25·|{c : t_c > 0}|` (docs/SPEC.md §3), exact for any realistic `D`.
///
/// ```
/// assert_eq!(fathom_plan::plan_bits(&[4, 0, 1, 2]), 7.75);
/// ```
pub fn plan_bits(depths: &[u8]) -> f32 {
    plan_quarter_bits(depths) as f32 * 0.25
}

/// The largest meaningful budget for `d` channels: every channel at 4 planes, `4.25·d` bits.
pub fn max_budget(d: usize) -> f32 {
    4.25 * d as f32
}

/// The planner's objective `E(t) = Σ_c w_c · 4^(−t_c)` (docs/SPEC.md §3), in `f64`.
///
/// # Panics
/// If `importance` and `depths` differ in length (a programming error, not a data error).
pub fn expected_error(importance: &[f32], depths: &[u8]) -> f64 {
    assert_eq!(
        importance.len(),
        depths.len(),
        "expected_error: importance and depths differ in length"
    );
    importance
        .iter()
        .zip(depths)
        .map(|(&w, &t)| f64::from(w) * 0.25f64.powi(i32::from(t)))
        .sum()
}

/// The budget in quarter bits that a plan may spend: `⌊4·B⌋` (exact: `4·B` only shifts the
/// exponent of an `f32`). The caller has checked `B ≥ 0` and finite.
pub(crate) fn budget_quarters(budget: f32) -> u64 {
    (budget * 4.0).floor() as u64
}

/// Checks `0 ≤ B ≤ 4.25·D` and that `B` is finite.
pub(crate) fn check_budget(budget: f32, d: usize) -> Result<(), crate::PlanError> {
    let max = max_budget(d);
    if budget.is_finite() && (0.0..=max).contains(&budget) {
        Ok(())
    } else {
        Err(crate::PlanError::BudgetOutOfRange { budget, max })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_count_scales_once_per_active_channel() {
        let check =
            |depths: &[u8], expect: f32| assert_eq!(plan_bits(depths), expect, "{depths:?}");
        check(&[], 0.0);
        check(&[0, 0, 0], 0.0);
        check(&[1], 1.25);
        check(&[4; 128], 544.0);
        check(&[2, 0, 3], 5.5);
        assert_eq!(max_budget(128), 544.0);
    }

    #[test]
    fn expected_error_is_weighted_quarter_powers() {
        let e = expected_error(&[1.0, 2.0, 16.0, 0.0], &[0, 1, 2, 4]);
        assert_eq!(e, 1.0 + 0.5 + 1.0 + 0.0);
    }

    #[test]
    fn budget_range_is_checked() {
        assert!(check_budget(0.0, 4).is_ok());
        assert!(check_budget(17.0, 4).is_ok());
        for bad in [-0.25, 17.25, f32::NAN, f32::INFINITY] {
            assert!(matches!(
                check_budget(bad, 4),
                Err(crate::PlanError::BudgetOutOfRange { max, .. }) if max == 17.0
            ));
        }
        assert_eq!(budget_quarters(48.1), 192);
        assert_eq!(budget_quarters(48.25), 193);
    }
}
