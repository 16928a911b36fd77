//! The fidelity metric of docs/SPEC.md §5.

use serde::{Deserialize, Serialize};

/// Relative error `‖a − d‖₂ / ‖d‖₂` of an approximate attention output `a` against the dense
/// one `d`, in `f64`.
///
/// If `‖d‖ = 0` the ratio is undefined and the absolute error `‖a‖` is returned instead (0 when
/// both are zero), so that a zero reference never yields NaN or infinity. A NaN or an infinity
/// in either input gives `+∞`: the approximation is as wrong as can be, and a `max` or a mean
/// over errors shows it (a NaN would vanish in `f64::max`). The result is never NaN.
///
/// ```
/// assert_eq!(fathom_plan::relative_error(&[3.0, 4.0], &[0.0, 8.0]), 5.0 / 8.0);
/// ```
///
/// # Panics
/// If the lengths differ (a programming error).
pub fn relative_error(approx: &[f32], dense: &[f32]) -> f64 {
    assert_eq!(approx.len(), dense.len(), "relative_error: lengths differ");
    if approx.iter().chain(dense).any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&a, &d) in approx.iter().zip(dense) {
        let (a, d) = (f64::from(a), f64::from(d));
        num += (a - d) * (a - d);
        den += d * d;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// A running mean in `f64` (docs/SPEC.md §5 averages errors over positions, layers and heads).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MeanAccumulator {
    sum: f64,
    count: u64,
}

impl MeanAccumulator {
    /// An empty accumulator.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one sample.
    pub fn push(&mut self, x: f64) {
        self.sum += x;
        self.count += 1;
    }

    /// Adds every sample of another accumulator (for per-thread partial means).
    pub fn merge(&mut self, other: &MeanAccumulator) {
        self.sum += other.sum;
        self.count += other.count;
    }

    /// The number of samples.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The mean, or `None` before the first sample.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }
}

impl Extend<f64> for MeanAccumulator {
    fn extend<I: IntoIterator<Item = f64>>(&mut self, iter: I) {
        iter.into_iter().for_each(|x| self.push(x));
    }
}

impl FromIterator<f64> for MeanAccumulator {
    fn from_iter<I: IntoIterator<Item = f64>>(iter: I) -> Self {
        let mut m = Self::new();
        m.extend(iter);
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_error_cases() {
        assert_eq!(relative_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(relative_error(&[0.0, 0.0], &[0.0, 2.0]), 1.0);
        assert_eq!(relative_error(&[3.0, 4.0], &[0.0, 0.0]), 5.0);
        assert_eq!(relative_error(&[], &[]), 0.0);
    }

    /// The doc's promise: never NaN; a non-finite input is an infinite error.
    #[test]
    fn non_finite_inputs_give_infinity_never_nan() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert_eq!(relative_error(&[bad, 1.0], &[1.0, 1.0]), f64::INFINITY);
            assert_eq!(relative_error(&[1.0, 1.0], &[1.0, bad]), f64::INFINITY);
            assert_eq!(relative_error(&[bad], &[bad]), f64::INFINITY);
        }
        // Finite extremes stay finite.
        let e = relative_error(&[f32::MAX, -f32::MAX], &[-f32::MAX, f32::MAX]);
        assert_eq!(e, 2.0);
    }

    #[test]
    fn mean_accumulator() {
        let mut m = MeanAccumulator::new();
        assert_eq!(m.mean(), None);
        m.push(1.0);
        m.extend([2.0, 3.0]);
        let other: MeanAccumulator = [6.0].into_iter().collect();
        m.merge(&other);
        assert_eq!((m.count(), m.mean()), (4, Some(3.0)));
    }
}
