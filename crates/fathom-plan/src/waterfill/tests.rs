use proptest::prelude::*;

use super::*;
use crate::bits::{expected_error, max_budget, plan_quarter_bits};
use crate::testutil::{runner, weights_and_budget, SIZES};

/// The reference: greedy by gain per bit under the all-previous-planes constraint. Planes are
/// visited level by level (all planes tied at one gain per bit together), in decreasing gain
/// per bit; a level is taken whole while it fits, and the walk stops at the first that does
/// not. Gains per bit are compared as exact fractions, independently of [`GAIN_PER_BIT`]:
/// plane j of w gains `¾·w·4^(−(j−1))` for `1.25` bits (j = 1) or `1` bit, i.e. the fraction
/// `3·w·4^(−(j−1)) / 5` or `/ 4`; cross-multiplied, both sides are exact in f64 for f32 `w`.
fn greedy(w: &[f32], budget: f32) -> Vec<u8> {
    let ratio = |wc: f32, j: u8| -> (f64, f64) {
        (
            3.0 * f64::from(wc) * 0.25f64.powi(i32::from(j) - 1),
            if j == 1 { 5.0 } else { 4.0 },
        )
    };
    let cmp = |a: (f64, f64), b: (f64, f64)| (a.0 * b.1).total_cmp(&(b.0 * a.1));
    let mut planes: Vec<((f64, f64), usize, u8)> = Vec::new();
    for (c, &wc) in w.iter().enumerate() {
        for j in 1..=4 {
            if wc > 0.0 {
                planes.push((ratio(wc, j), c, j));
            }
        }
    }
    planes.sort_by(|a, b| cmp(b.0, a.0));
    let cap = budget_quarters(budget);
    let mut t = vec![0u8; w.len()];
    let mut used = 0u64;
    let mut i = 0;
    while i < planes.len() {
        let level = planes[i].0;
        let end = i + planes[i..]
            .iter()
            .take_while(|p| cmp(p.0, level).is_eq())
            .count();
        let mut next = t.clone();
        for &(_, c, j) in &planes[i..end] {
            assert_eq!(next[c] + 1, j, "planes of a channel come in order");
            next[c] = j;
        }
        let q = plan_quarter_bits(&next);
        if q > cap {
            break;
        }
        t = next;
        used = q;
        i = end;
    }
    assert!(used <= cap);
    t
}

/// The exact optimum `min E(t)` over all `5^D` plans with at most `cap` quarter bits.
fn brute_force_min(w: &[f32], cap: u64) -> f64 {
    let d = w.len();
    let mut t = vec![0u8; d];
    let mut best = f64::INFINITY;
    loop {
        if plan_quarter_bits(&t) <= cap {
            best = best.min(expected_error(w, &t));
        }
        // Odometer increment over {0..4}^D.
        let mut c = 0;
        loop {
            if c == d {
                return best;
            }
            if t[c] < 4 {
                t[c] += 1;
                break;
            }
            t[c] = 0;
            c += 1;
        }
    }
}

fn check(w: &[f32], budget: f32, expect: &[u8]) {
    let plan = water_fill(w, budget).unwrap();
    assert_eq!(plan.depths, expect, "w = {w:?}, B = {budget}");
    assert_eq!(plan.bits, plan_bits(expect));
}

#[test]
fn hand_built_plans() {
    check(&[], 0.0, &[]);
    check(&[0.0, 0.0], 8.5, &[0, 0]);
    check(&[1.0, 2.0], 0.0, &[0, 0]);
    check(&[1.0, 2.0], 1.2, &[0, 0]); // one plane costs 1.25
    check(&[1.0, 2.0], 1.25, &[0, 1]);
    check(&[1.0, 2.0], 8.5, &[4, 4]);
    check(&[1.0, 0.0, 2.0], 12.75, &[4, 0, 4]);
    // Equal importances tie at every level: both channels move together.
    check(&[3.0, 3.0], 2.5, &[1, 1]);
    check(&[3.0, 3.0], 4.0, &[1, 1]);
    check(&[3.0, 3.0], 4.5, &[2, 2]);
    // ρ_1(1) = 0.6 > ρ_2(3) = 0.5625: a new channel beats a second plane.
    check(&[1.0, 3.0], 2.5, &[1, 1]);
    // ρ_2(4) = 0.75 = ρ_3(16): tie across planes of different channels.
    check(&[16.0, 4.0], 4.5, &[2, 1]);
    check(&[16.0, 4.0], 5.5, &[3, 2]);
    check(&[5.0, 1.25, 0.3125, 0.0], 6.0, &[3, 2, 0, 0]);
}

#[test]
fn bad_input_is_a_typed_error() {
    let max = 8.5;
    for budget in [-1.0, 8.75, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert!(matches!(
            water_fill(&[1.0, 2.0], budget),
            Err(PlanError::BudgetOutOfRange { max: m, .. }) if m == max
        ));
    }
    assert_eq!(
        water_fill(&[1.0, f32::NAN], 1.0),
        Err(PlanError::NonFinite {
            what: "importance",
            index: 1
        })
    );
    assert_eq!(
        water_fill(&[f32::INFINITY], 1.0),
        Err(PlanError::NonFinite {
            what: "importance",
            index: 0
        })
    );
    assert_eq!(
        water_fill(&[1.0, -2.0], 1.0),
        Err(PlanError::Negative {
            what: "importance",
            index: 1,
            value: -2.0
        })
    );
    let mut out = [0u8; 3];
    assert_eq!(
        water_fill_into(&[1.0, 2.0], 1.0, &mut out),
        Err(PlanError::ShapeMismatch {
            what: "depths output length (D)",
            expected: 2,
            got: 3
        })
    );
}

#[test]
fn plan_accessors() {
    let plan = water_fill(&[16.0, 0.0, 4.0], 5.5).unwrap();
    assert_eq!(plan.active().collect::<Vec<_>>(), vec![(0, 3), (2, 2)]);
    assert_eq!(plan.active_count(), 2);
    assert_eq!(plan.active_mask(), vec![true, false, true]);
    assert_eq!(
        plan.expected_error(&[16.0, 0.0, 4.0]),
        16.0 / 64.0 + 4.0 / 16.0
    );
    assert_eq!(
        Plan::empty(2),
        Plan {
            depths: vec![0, 0],
            bits: 0.0
        }
    );
}

/// bits ≤ B, t_c ≤ 4, w_c = 0 ⇒ t_c = 0, the reported bits are the plan's, and the plan does
/// not depend on the number of bisection steps (the exact finish decides it).
#[test]
fn prop_budget_is_never_exceeded() {
    for d in SIZES {
        runner(96)
            .run(&weights_and_budget(d), |(w, b)| {
                let plan = water_fill(&w, b).unwrap();
                prop_assert!(plan.bits <= b, "bits {} > B {}", plan.bits, b);
                prop_assert_eq!(plan.bits, plan_bits(&plan.depths));
                for (&t, &wc) in plan.depths.iter().zip(&w) {
                    prop_assert!(t <= 4);
                    prop_assert!(wc > 0.0 || t == 0);
                }
                for steps in [0, 3, 32] {
                    let mut other = vec![9u8; d];
                    let bits = water_fill_steps(&w, b, &mut other, steps).unwrap();
                    prop_assert_eq!(&other, &plan.depths);
                    prop_assert_eq!(bits, plan.bits);
                }
                Ok(())
            })
            .unwrap();
    }
}

/// Within a group, w_a ≥ w_b ⇒ t_a ≥ t_b.
#[test]
fn prop_depth_is_monotone_in_importance() {
    for d in SIZES {
        runner(64)
            .run(&weights_and_budget(d), |(w, b)| {
                let plan = water_fill(&w, b).unwrap();
                let mut order: Vec<usize> = (0..d).collect();
                order.sort_by(|&x, &y| w[x].total_cmp(&w[y]));
                for pair in order.windows(2) {
                    let (lo, hi) = (pair[0], pair[1]);
                    prop_assert!(
                        plan.depths[hi] >= plan.depths[lo],
                        "w {} → t {}, w {} → t {}",
                        w[lo],
                        plan.depths[lo],
                        w[hi],
                        plan.depths[hi]
                    );
                }
                Ok(())
            })
            .unwrap();
    }
}

/// B₁ ≤ B₂ ⇒ t(B₁) ≤ t(B₂) channel by channel, so bits grow and E(t) never increases.
#[test]
fn prop_more_budget_never_hurts() {
    for d in SIZES {
        let strategy = (weights_and_budget(d), 0.0f32..=1.0);
        runner(64)
            .run(&strategy, |((w, b1), f)| {
                let max = max_budget(d);
                let b2 = (b1 + f * (max - b1)).min(max);
                let (p1, p2) = (water_fill(&w, b1).unwrap(), water_fill(&w, b2).unwrap());
                prop_assert!(p1.depths.iter().zip(&p2.depths).all(|(a, b)| a <= b));
                prop_assert!(p1.bits <= p2.bits);
                prop_assert!(expected_error(&w, &p2.depths) <= expected_error(&w, &p1.depths));
                Ok(())
            })
            .unwrap();
    }
}

/// On small D the plan equals the greedy reference exactly, is the exhaustive optimum among
/// plans of at most its own bits, and is within `λ_next·(B − bits)` of the optimum at B.
#[test]
fn prop_small_d_matches_greedy_and_brute_force() {
    for d in 1..=6 {
        let cases = if d <= 4 { 256 } else { 64 };
        runner(cases)
            .run(&weights_and_budget(d), |(w, b)| {
                let plan = water_fill(&w, b).unwrap();
                prop_assert_eq!(&plan.depths, &greedy(&w, b));

                let e = expected_error(&w, &plan.depths);
                let scale = w
                    .iter()
                    .map(|&x| f64::from(x))
                    .sum::<f64>()
                    .max(f64::MIN_POSITIVE);
                let tol = 1e-12 * scale;
                let own = brute_force_min(&w, plan_quarter_bits(&plan.depths));
                prop_assert!(e <= own + tol, "E {e} > optimum {own} at its own bits");

                let at_b = brute_force_min(&w, budget_quarters(b));
                let lambda_next = w
                    .iter()
                    .zip(&plan.depths)
                    .filter(|&(&wc, &t)| wc > 0.0 && t < 4)
                    .map(|(&wc, &t)| gain_per_bit(wc, t + 1))
                    .fold(0.0, f64::max);
                let bound = lambda_next * f64::from(b - plan.bits);
                prop_assert!(at_b <= e + tol);
                prop_assert!(e - at_b <= bound + tol, "E {e} − E* {at_b} > bound {bound}");
                Ok(())
            })
            .unwrap();
    }
}

#[test]
fn uniform_depth_ablation() {
    let check = |w: &[f32], b: f32, expect: &[u8]| {
        let fathom = water_fill(w, b).unwrap();
        let plan = uniform_depth_plan(&fathom, w, b).unwrap();
        assert_eq!(plan.depths, expect, "w {w:?}, B {b}");
        assert_eq!(plan.bits, plan_bits(expect));
        assert!(plan.bits <= b);
    };
    let w = [1.0, 9.0, 3.0, 2.0];
    // Enough budget for every channel at 4 planes: 17 bits exactly.
    check(&w, 17.0, &[4, 4, 4, 4]);
    // 12 bits: Fathom's mean depth rounds to 3 (4 × 3.25 = 13 > 12), so depth 3 takes the
    // three most important channels (9.75 bits, 81 %); depth 2 takes all four for 9 (75 %);
    // neither fills 98 %, so the one that spends most wins.
    check(&w, 12.0, &[0, 3, 3, 3]);
    // 5 bits: depth 1 fills exactly with four channels.
    check(&w, 5.0, &[1, 1, 1, 1]);
    // 2.5 bits: two channels at depth 1, the most important ones.
    check(&w, 2.5, &[0, 1, 1, 0]);
    check(&w, 1.0, &[0, 0, 0, 0]);
    check(&[2.0, 2.0, 2.0], 2.5, &[1, 1, 0]); // ties to the lower index
    check(&[0.0, 0.0, 0.0], 5.0, &[0; 3]); // zero importance is never read
    let fathom = water_fill(&[1.0], 1.0).unwrap();
    assert!(matches!(
        uniform_depth_plan(&fathom, &[1.0, 2.0], 1.0),
        Err(PlanError::ShapeMismatch {
            expected: 1,
            got: 2,
            ..
        })
    ));
    assert!(matches!(
        uniform_depth_plan(&fathom, &[1.0], 5.0),
        Err(PlanError::BudgetOutOfRange { .. })
    ));
}

/// The ablation reads one depth on a prefix of the importance order, never exceeds its
/// budget, and spends at least 98 % of it whenever some depth can (docs/SPEC.md §4).
#[test]
fn prop_uniform_depth_fills_its_budget_at_one_depth() {
    for d in SIZES {
        runner(48)
            .run(&weights_and_budget(d), |(w, b)| {
                let fathom = water_fill(&w, b).unwrap();
                let uni = uniform_depth_plan(&fathom, &w, b).unwrap();
                prop_assert!(uni.bits <= b);
                let depths: std::collections::BTreeSet<u8> = uni.active().map(|(_, t)| t).collect();
                prop_assert!(depths.len() <= 1);
                // The chosen channels are the most important: none left out beats one taken.
                let taken_min = uni
                    .active()
                    .map(|(c, _)| w[c])
                    .fold(f32::INFINITY, f32::min);
                let left_max = (0..d)
                    .filter(|&c| uni.depths[c] == 0)
                    .map(|c| w[c])
                    .fold(0f32, f32::max);
                prop_assert!(uni.bits == 0.0 || left_max <= taken_min);
                // Some depth fills 98 % ⇒ the plan does.
                let m = w.iter().filter(|&&x| x > 0.0).count() as f32;
                let best = (1..=4u8)
                    .map(|t| (m.min((b / (t as f32 + 0.25)).floor())) * (t as f32 + 0.25))
                    .fold(0f32, f32::max);
                if best >= 0.98 * b {
                    prop_assert!(uni.bits >= 0.98 * b - 1e-3, "B {}, spent {}", b, uni.bits);
                } else {
                    prop_assert!(
                        (uni.bits - best).abs() < 1e-3,
                        "B {}: {} vs best {}",
                        b,
                        uni.bits,
                        best
                    );
                }
                Ok(())
            })
            .unwrap();
    }
}

/// The default bisection count is where the passes over the channels (evaluations of `Q` and
/// of the exact finish's `λ_next`) are fewest, within 10 %, on importances like a decode
/// step's: `σ_c²·Σ_g q_gc²` with lognormal `σ_c` (log-sd 0.8 and 2.0, four channels ×6), four
/// N(0, 1) query heads, D = 128, budgets 48, 64 and 92 bits, 64 draws each (seeded). It must
/// also beat the old 32 steps by a wide margin, or the choice buys nothing.
#[test]
fn bisection_steps_minimise_the_passes() {
    use rand::{Rng, SeedableRng};
    use rand_distr::StandardNormal;
    let d = 128;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut draws: Vec<(Vec<f32>, f32)> = Vec::new();
    for log_sd in [0.8f64, 2.0] {
        for budget in [48.0f32, 64.0, 92.0] {
            for _ in 0..64 {
                let mut sigma: Vec<f64> = (0..d)
                    .map(|_| (log_sd * rng.sample::<f64, _>(StandardNormal)).exp())
                    .collect();
                for _ in 0..4 {
                    let c = rng.gen_range(0..d);
                    sigma[c] *= 6.0;
                }
                let w = sigma
                    .iter()
                    .map(|s| {
                        let q2: f64 = (0..4)
                            .map(|_| rng.sample::<f64, _>(StandardNormal).powi(2))
                            .sum();
                        (s * s * q2) as f32
                    })
                    .collect();
                draws.push((w, budget));
            }
        }
    }
    let mean_passes = |steps: u32| -> f64 {
        let mut out = vec![0u8; d];
        let total: u64 = draws
            .iter()
            .map(|(w, b)| u64::from(water_fill_counted(w, *b, &mut out, steps).unwrap().1))
            .sum();
        total as f64 / draws.len() as f64
    };
    let at_default = mean_passes(BISECTION_STEPS);
    let best = (0..=32).map(mean_passes).fold(f64::INFINITY, f64::min);
    let at_32 = mean_passes(32);
    let curve: Vec<String> = [0, 4, 6, 8, 9, 10, 12, 16, 32]
        .iter()
        .map(|&s| format!("{s}: {:.1}", mean_passes(s)))
        .collect();
    eprintln!("passes per plan by bisection steps: {}", curve.join(", "));
    assert!(
        at_default <= 1.1 * best,
        "{BISECTION_STEPS} steps: {at_default:.1} passes per plan, the best count {best:.1}"
    );
    assert!(
        at_default <= 0.5 * at_32,
        "{BISECTION_STEPS} steps: {at_default:.1} passes, 32 steps: {at_32:.1}"
    );
}
