//! Channel importance for one query group (docs/SPEC.md §3).

use crate::PlanError;

/// Channel importance `w_c = σ_c² · Σ_h q_{h,c}²` for the `G` query heads sharing a KV head
/// (docs/SPEC.md §3).
///
/// * `sigma2`: `[D]`, the calibration variance of each channel (in the store's basis), `≥ 0`;
/// * `queries`: `[G, D]` row-major, the group's queries (rotated like the store if it is);
/// * returns `[D]`.
///
/// The sum is accumulated in `f64` and rounded once to `f32`, the type the planner takes.
/// `G = 0` is allowed (an empty sum: every `w_c = 0`).
///
/// # Errors
/// [`PlanError::ShapeMismatch`] if `queries.len() ≠ G·D`; [`PlanError::NonFinite`] for a NaN
/// or infinity in either input or an importance that overflows `f32`;
/// [`PlanError::Negative`] for a negative variance.
pub fn importance(sigma2: &[f32], queries: &[f32], g: usize) -> Result<Vec<f32>, PlanError> {
    let mut out = vec![0.0; sigma2.len()];
    importance_into(sigma2, queries, g, &mut out)?;
    Ok(out)
}

/// [`importance`] writing into `out` (`[D]`), without allocating.
///
/// # Errors
/// As [`importance`], plus [`PlanError::ShapeMismatch`] if `out.len() ≠ D`.
pub fn importance_into(
    sigma2: &[f32],
    queries: &[f32],
    g: usize,
    out: &mut [f32],
) -> Result<(), PlanError> {
    let d = sigma2.len();
    let expected = g.checked_mul(d).ok_or(PlanError::ShapeMismatch {
        what: "queries length (G·D overflows)",
        expected: usize::MAX,
        got: queries.len(),
    })?;
    if queries.len() != expected {
        return Err(PlanError::ShapeMismatch {
            what: "queries length (G·D)",
            expected,
            got: queries.len(),
        });
    }
    if out.len() != d {
        return Err(PlanError::ShapeMismatch {
            what: "importance output length (D)",
            expected: d,
            got: out.len(),
        });
    }
    if let Some(index) = queries.iter().position(|q| !q.is_finite()) {
        return Err(PlanError::NonFinite {
            what: "queries",
            index,
        });
    }
    for (c, (&s, o)) in sigma2.iter().zip(out.iter_mut()).enumerate() {
        if !s.is_finite() {
            return Err(PlanError::NonFinite {
                what: "sigma2",
                index: c,
            });
        }
        if s < 0.0 {
            return Err(PlanError::Negative {
                what: "sigma2",
                index: c,
                value: s,
            });
        }
        let sq: f64 = (0..g).map(|h| f64::from(queries[h * d + c]).powi(2)).sum();
        let w = (f64::from(s) * sq) as f32;
        if !w.is_finite() {
            return Err(PlanError::NonFinite {
                what: "importance (f32 overflow)",
                index: c,
            });
        }
        *o = w;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_squares_over_the_group() {
        // G = 2, D = 3.
        let w = importance(&[2.0, 0.5, 0.0], &[1.0, 2.0, 3.0, -1.0, 0.0, 5.0], 2).unwrap();
        assert_eq!(w, vec![4.0, 2.0, 0.0]);
        assert_eq!(importance(&[1.0, 1.0], &[], 0).unwrap(), vec![0.0, 0.0]);
    }

    #[test]
    fn rejects_bad_input_naming_the_element() {
        assert_eq!(
            importance(&[1.0, 1.0], &[1.0, 2.0, 3.0], 2),
            Err(PlanError::ShapeMismatch {
                what: "queries length (G·D)",
                expected: 4,
                got: 3
            })
        );
        assert_eq!(
            importance(&[1.0, 1.0], &[1.0, 2.0, f32::NAN, 0.0], 2),
            Err(PlanError::NonFinite {
                what: "queries",
                index: 2
            })
        );
        assert_eq!(
            importance(&[1.0, f32::INFINITY], &[1.0, 2.0], 1),
            Err(PlanError::NonFinite {
                what: "sigma2",
                index: 1
            })
        );
        assert_eq!(
            importance(&[1.0, -0.5], &[1.0, 2.0], 1),
            Err(PlanError::Negative {
                what: "sigma2",
                index: 1,
                value: -0.5
            })
        );
        assert!(matches!(
            importance(&[f32::MAX], &[1e30], 1),
            Err(PlanError::NonFinite { index: 0, .. })
        ));
    }
}
