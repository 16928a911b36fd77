//! The downstream claims' statistics: paired differences against exact top-k with Student-t
//! 95 % intervals, with the unit of resampling the unit of independence (a RULER sample, an
//! agent session: steps within a session are not independent).

/// Two-sided 95 % Student-t quantile `t_{0.975, df}` (table to 30, then `1.96 + 2.4/df`,
/// within 0.002 of the exact value there).
pub fn t975(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => T[df - 1],
        _ => 1.96 + 2.4 / df as f64,
    }
}

/// A mean with its 95 % interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    /// Sample mean.
    pub mean: f64,
    /// Lower bound.
    pub lo: f64,
    /// Upper bound.
    pub hi: f64,
    /// Observations.
    pub n: usize,
}

impl Interval {
    /// `mean ± t_{0.975, n−1} · s / √n` (a single observation: an unbounded interval).
    pub fn of(x: &[f64]) -> Interval {
        let n = x.len();
        if n == 0 {
            return Interval {
                mean: f64::NAN,
                lo: f64::NAN,
                hi: f64::NAN,
                n,
            };
        }
        let mean = x.iter().sum::<f64>() / n as f64;
        let half = if n < 2 {
            f64::INFINITY
        } else {
            let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            t975(n - 1) * (var / n as f64).sqrt()
        };
        Interval {
            mean,
            lo: mean - half,
            hi: mean + half,
            n,
        }
    }

    /// `+0.012 [−0.03, +0.05]`.
    pub fn cell(&self) -> String {
        format!("{:+.3} [{:+.3}, {:+.3}]", self.mean, self.lo, self.hi)
    }

    /// `0.958 [0.941, 0.975]` (a level, not a difference).
    pub fn level(&self) -> String {
        format!("{:.3} [{:.3}, {:.3}]", self.mean, self.lo, self.hi)
    }

    /// Below zero with 95 % confidence.
    pub fn below_zero(&self) -> bool {
        self.hi < 0.0
    }

    /// Above zero with 95 % confidence.
    pub fn above_zero(&self) -> bool {
        self.lo > 0.0
    }
}

/// Element-wise `a − b`.
pub fn paired(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x - y).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_is_the_t_interval_and_covers_its_mean() {
        // Mean 2, s = 1.5811, n = 5: half width 2.776 · 1.5811 / √5 = 1.963.
        let i = Interval::of(&[0.0, 1.0, 2.0, 3.0, 4.0]);
        assert!((i.mean - 2.0).abs() < 1e-12);
        assert!((i.hi - i.mean - 1.963).abs() < 1e-3, "{i:?}");
        assert!(Interval::of(&[0.0; 20]).lo == 0.0 && Interval::of(&[0.0; 20]).hi == 0.0);
        assert!(Interval::of(&[1.0]).hi.is_infinite());
        assert!(Interval::of(&[-1.0, -1.1, -0.9, -1.0]).below_zero());
        assert!(!Interval::of(&[-1.0, 1.0, -0.5, 0.6]).below_zero());
        for df in [1, 10, 30, 31, 100] {
            assert!(t975(df) > 1.96 && t975(df) <= 12.71);
        }
        assert!(t975(31) < t975(30) + 1e-3 && t975(31) > 2.0);
    }
}
