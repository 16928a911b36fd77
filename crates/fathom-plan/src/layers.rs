//! Per-layer budgets (docs/SPEC.md §3, "Per-layer plan").
//!
//! Given a calibration error `e_l(B)` per layer (for example the mean attention error of layer
//! `l` when it is planned at budget `B`), choose budgets `B_l` with mean `B̄` (the target,
//! e.g. 48 or 64 bits) that make the total error small, greedily: every layer starts at
//! `start ≤ B̄`, and a quantum `q` of bits at a time goes to the layer with the largest error
//! drop per bit
//!
//! ```text
//! l* = argmax_l (e_l(B_l) − e_l(B_l + q)) / q      (ties to the lower layer index)
//! ```
//!
//! among the layers that can still take it (`B_l + q ≤ max_budget`), until `Σ_l B_l` reaches
//! `L·B̄`. When `L·(B̄ − start)` is not a whole number of quanta, the remainder `r < q` is
//! handed out last, the same way, as one step of `r` bits, so the mean is hit exactly (up to
//! `f32` rounding of the result) and never exceeded. A step whose gain is negative (a noisy
//! calibration error that rises with bits) is still taken: the target mean is the contract.
//! For convex decreasing errors this greedy is the optimal allocation on the quantum grid.
//!
//! `e_l(B)` is memoised: each `(layer, budget)` pair is evaluated at most once, about
//! `2L + L·(B̄ − start)/q` calls in all.

use std::collections::HashMap;

use crate::PlanError;

/// Parameters of [`allocate_layer_budgets`]; every budget is in bits per token per KV head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerBudgetParams {
    /// The number of layers `L ≥ 1`.
    pub layers: usize,
    /// The target mean `B̄` of the layer budgets.
    pub target_mean: f32,
    /// The bits moved per greedy step, `q > 0`.
    pub quantum: f32,
    /// The floor no layer may sit below (`start` must be at least this).
    pub min_budget: f32,
    /// The ceiling no layer may exceed (at most `4.25·D` for the planner to accept it).
    pub max_budget: f32,
    /// Every layer's budget before the greedy steps, `min_budget ≤ start ≤ target_mean`.
    pub start: f32,
}

/// The most greedy steps [`allocate_layer_budgets`] takes: `L·(B̄ − start)/q` above it is
/// refused (a quantum that small would loop for hours or exhaust memory, not refine anything).
pub const MAX_LAYER_STEPS: f64 = 1e7;

impl LayerBudgetParams {
    /// Checks `L ≥ 1`, `q > 0`, `0 ≤ min ≤ start ≤ target ≤ max`, all finite, and at most
    /// [`MAX_LAYER_STEPS`] greedy steps `L·(B̄ − start)/q`.
    ///
    /// # Errors
    /// [`PlanError::InvalidParameter`] naming the first constraint broken.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |name, value: f32, reason| {
            Err(PlanError::InvalidParameter {
                name,
                value: f64::from(value),
                reason,
            })
        };
        if self.layers == 0 {
            return Err(PlanError::InvalidParameter {
                name: "layers",
                value: 0.0,
                reason: "must be at least 1",
            });
        }
        for (name, v) in [
            ("target_mean", self.target_mean),
            ("quantum", self.quantum),
            ("min_budget", self.min_budget),
            ("max_budget", self.max_budget),
            ("start", self.start),
        ] {
            if !v.is_finite() {
                return bad(name, v, "must be finite");
            }
        }
        if self.quantum <= 0.0 {
            return bad("quantum", self.quantum, "must be positive");
        }
        if self.min_budget < 0.0 {
            return bad("min_budget", self.min_budget, "must be non-negative");
        }
        if self.start < self.min_budget {
            return bad("start", self.start, "must be at least min_budget");
        }
        if self.start > self.target_mean {
            return bad("start", self.start, "must not exceed target_mean");
        }
        if self.target_mean > self.max_budget {
            return bad(
                "target_mean",
                self.target_mean,
                "must not exceed max_budget",
            );
        }
        if self.total_bits() / f64::from(self.quantum) > MAX_LAYER_STEPS {
            return bad(
                "quantum",
                self.quantum,
                "too small: L·(target_mean − start)/quantum exceeds 10^7 greedy steps",
            );
        }
        Ok(())
    }

    /// The bits the greedy steps hand out, `L·(B̄ − start)`, in `f64`.
    fn total_bits(&self) -> f64 {
        (f64::from(self.target_mean) - f64::from(self.start)) * self.layers as f64
    }
}

/// Greedy per-layer budgets at a target mean (docs/SPEC.md §3); see the [module docs](self).
///
/// `error(l, B)` is the calibration error of layer `l` at budget `B`; it must be finite.
///
/// ```
/// use fathom_plan::{allocate_layer_budgets, LayerBudgetParams};
/// let params = LayerBudgetParams {
///     layers: 2, target_mean: 48.0, quantum: 4.0, min_budget: 0.0, max_budget: 136.0, start: 32.0,
/// };
/// // Layer 1's error is ten times layer 0's: it gets more bits.
/// let b = allocate_layer_budgets(&params, |l, b| [1.0, 10.0][l] * 0.25f64.powf(f64::from(b) / 16.0))?;
/// assert_eq!(b.iter().sum::<f32>(), 96.0);
/// assert!(b[1] > b[0]);
/// # Ok::<(), fathom_plan::PlanError>(())
/// ```
///
/// # Errors
/// [`PlanError::InvalidParameter`] for bad parameters; [`PlanError::NonFinite`] (with the
/// layer as index) if `error` returns NaN or infinity.
pub fn allocate_layer_budgets(
    params: &LayerBudgetParams,
    mut error: impl FnMut(usize, f32) -> f64,
) -> Result<Vec<f32>, PlanError> {
    params.validate()?;
    let l = params.layers;
    let q = f64::from(params.quantum);
    let total = params.total_bits();
    // Whole quanta that fit in the total, corrected for rounding of the division.
    let mut steps = (total / q).floor() as u64;
    while (steps + 1) as f64 * q <= total {
        steps += 1;
    }
    while steps > 0 && steps as f64 * q > total {
        steps -= 1;
    }
    let remainder = total - steps as f64 * q;

    let mut budgets = vec![f64::from(params.start); l];
    let mut memo: HashMap<(usize, u32), f64> = HashMap::new();
    let mut eval = |layer: usize, b: f64| -> Result<f64, PlanError> {
        let b = b as f32;
        if let Some(&e) = memo.get(&(layer, b.to_bits())) {
            return Ok(e);
        }
        let e = error(layer, b);
        if !e.is_finite() {
            return Err(PlanError::NonFinite {
                what: "layer error",
                index: layer,
            });
        }
        memo.insert((layer, b.to_bits()), e);
        Ok(e)
    };
    let max = f64::from(params.max_budget);
    let step_sizes =
        std::iter::repeat_n(q, steps as usize).chain((remainder > 0.0).then_some(remainder));
    for step in step_sizes {
        let mut best: Option<(usize, f64)> = None;
        for (layer, &b) in budgets.iter().enumerate() {
            if b + step > max {
                continue;
            }
            let gain = (eval(layer, b)? - eval(layer, b + step)?) / step;
            if best.is_none_or(|(_, g)| gain > g) {
                best = Some((layer, gain));
            }
        }
        // validate() guarantees target ≤ max, so some layer is below the target and can take
        // the step; the check keeps this panic-free regardless.
        let Some((layer, _)) = best else {
            return Err(PlanError::InvalidParameter {
                name: "max_budget",
                value: max,
                reason: "no layer can take another step below it",
            });
        };
        budgets[layer] += step;
    }
    Ok(budgets.into_iter().map(|b| b as f32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(layers: usize) -> LayerBudgetParams {
        LayerBudgetParams {
            layers,
            target_mean: 48.0,
            quantum: 4.0,
            min_budget: 0.0,
            max_budget: 136.0,
            start: 24.0,
        }
    }

    /// Synthetic convex errors `a_l · 4^(−B/c)`.
    fn convex(a: &[f64], c: f64) -> impl FnMut(usize, f32) -> f64 + '_ {
        move |l, b| a[l] * 0.25f64.powf(f64::from(b) / c)
    }

    /// A quantum so small that the steps would overflow the count (or loop for hours) is an
    /// error from `validate`, before `error` is called once.
    #[test]
    fn a_quantum_too_small_for_the_total_is_refused() {
        for (layers, quantum) in [
            (1, 1e-30f32),
            (32, 1e-6),
            (1, f32::MIN_POSITIVE),
            (1_000_000, 1.0),
        ] {
            let p = LayerBudgetParams {
                layers,
                quantum,
                ..params(1)
            };
            let mut calls = 0;
            let r = allocate_layer_budgets(&p, |_, _| {
                calls += 1;
                0.0
            });
            assert!(
                matches!(
                    r,
                    Err(PlanError::InvalidParameter {
                        name: "quantum",
                        ..
                    })
                ),
                "L {layers} q {quantum}: {r:?}"
            );
            assert_eq!(calls, 0);
        }
    }

    #[test]
    fn prefers_high_error_layers_and_hits_the_mean() {
        let a = [1.0, 100.0, 10.0, 1000.0, 1.0];
        let b = allocate_layer_budgets(&params(5), convex(&a, 16.0)).unwrap();
        assert_eq!(b.iter().sum::<f32>(), 48.0 * 5.0);
        assert!(b[3] > b[1] && b[1] > b[2] && b[2] > b[0], "{b:?}");
        assert_eq!(b[0], b[4], "equal layers get equal budgets: {b:?}");
        // Every layer stays on the quantum grid from `start`, within [start, max].
        for &x in &b {
            assert!(
                (24.0..=136.0).contains(&x) && (x - 24.0) % 4.0 == 0.0,
                "{b:?}"
            );
        }
        // Convex errors: no move of one quantum between two layers lowers the total error.
        let mut e = convex(&a, 16.0);
        let total = |b: &[f32], e: &mut dyn FnMut(usize, f32) -> f64| {
            (0..5).map(|l| e(l, b[l])).sum::<f64>()
        };
        let best = total(&b, &mut e);
        for from in 0..5 {
            for to in 0..5 {
                if from != to && b[from] - 4.0 >= 24.0 {
                    let mut moved = b.clone();
                    moved[from] -= 4.0;
                    moved[to] += 4.0;
                    assert!(
                        total(&moved, &mut e) >= best,
                        "moving 4 bits {from}→{to} helps: {b:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn equal_layers_split_evenly_and_remainders_are_handed_out() {
        let a = [1.0; 4];
        let b = allocate_layer_budgets(&params(4), convex(&a, 16.0)).unwrap();
        assert_eq!(b, vec![48.0; 4]);
        // L·(B̄ − start) = 3·(10 − 0) = 30 = 7 quanta of 4 and a remainder of 2.
        let p = LayerBudgetParams {
            layers: 3,
            target_mean: 10.0,
            start: 0.0,
            ..params(3)
        };
        let b = allocate_layer_budgets(&p, convex(&[1.0, 1.0, 1.0], 8.0)).unwrap();
        assert_eq!(b.iter().sum::<f32>(), 30.0);
        assert!(b.iter().all(|&x| x <= 136.0));
    }

    #[test]
    fn respects_the_ceiling() {
        // One layer wants everything but may not pass max_budget.
        let p = LayerBudgetParams {
            max_budget: 60.0,
            ..params(3)
        };
        let b = allocate_layer_budgets(&p, convex(&[1e6, 1.0, 1.0], 16.0)).unwrap();
        assert_eq!(b[0], 60.0);
        assert_eq!(b.iter().sum::<f32>(), 144.0);
    }

    #[test]
    fn memoises_the_error_function() {
        let mut seen = std::collections::HashSet::new();
        let mut calls = 0;
        let a = [3.0, 1.0, 7.0];
        let b = allocate_layer_budgets(&params(3), |l, b| {
            calls += 1;
            assert!(
                seen.insert((l, b.to_bits())),
                "layer {l} at {b} evaluated twice"
            );
            a[l] * 0.25f64.powf(f64::from(b) / 16.0)
        })
        .unwrap();
        assert_eq!(b.iter().sum::<f32>(), 144.0);
        // 3 layers at start, plus one new budget per step for the moved layer, plus each
        // layer's first look-ahead: at most 2·L + steps.
        assert!(calls <= 2 * 3 + 18, "{calls} calls");
    }

    #[test]
    fn start_at_target_is_flat() {
        let p = LayerBudgetParams {
            start: 48.0,
            ..params(3)
        };
        assert_eq!(
            allocate_layer_budgets(&p, |_, _| 1.0).unwrap(),
            vec![48.0; 3]
        );
    }

    #[test]
    fn bad_parameters_and_errors_are_typed() {
        let bad = |p: LayerBudgetParams, name: &str| match allocate_layer_budgets(&p, |_, _| 0.0) {
            Err(PlanError::InvalidParameter { name: n, .. }) => assert_eq!(n, name),
            other => panic!("expected InvalidParameter({name}), got {other:?}"),
        };
        bad(
            LayerBudgetParams {
                layers: 0,
                ..params(1)
            },
            "layers",
        );
        bad(
            LayerBudgetParams {
                quantum: 0.0,
                ..params(1)
            },
            "quantum",
        );
        bad(
            LayerBudgetParams {
                quantum: f32::NAN,
                ..params(1)
            },
            "quantum",
        );
        bad(
            LayerBudgetParams {
                start: 50.0,
                ..params(1)
            },
            "start",
        );
        bad(
            LayerBudgetParams {
                min_budget: 30.0,
                ..params(1)
            },
            "start",
        );
        bad(
            LayerBudgetParams {
                min_budget: -1.0,
                start: 0.0,
                ..params(1)
            },
            "min_budget",
        );
        bad(
            LayerBudgetParams {
                max_budget: 40.0,
                ..params(1)
            },
            "target_mean",
        );
        assert_eq!(
            allocate_layer_budgets(&params(2), |l, _| if l == 1 { f64::NAN } else { 1.0 }),
            Err(PlanError::NonFinite {
                what: "layer error",
                index: 1
            })
        );
    }
}
