//! Paired bootstrap intervals and the equivalence verdict (docs/SPEC.md §7, "Judging parity").
//!
//! A pooled paired difference is the mean of per-unit differences `Δ_i = s_i(method) −
//! s_i(reference)` over the units of every stratum (a RULER task's samples, an agent run's
//! sessions): `Δ̄ = Σ_t Σ_i Δ_{t,i} / Σ_t n_t`. Its 95 % interval is the percentile interval of
//! [`RESAMPLES`] stratified bootstrap replicates: each replicate draws `n_t` units with
//! replacement from each stratum `t` (a SplitMix64 stream seeded with [`BOOTSTRAP_SEED`]), and
//! the interval is the replicates' 2.5 % and 97.5 % quantiles (linear interpolation between
//! order statistics). The same seed gives the same interval, bit for bit.

/// The declared equivalence margin δ on a RULER score difference (docs/SPEC.md §7): parity
/// with exact top-k means the whole 95 % interval lies in `[−δ, +δ]`.
pub const PARITY_MARGIN: f64 = 0.10;

/// The declared non-inferiority margin on an agent run's step agreement (docs/SPEC.md §7): a
/// Fathom budget *reaches* the best 136-bit scan when the 95 % interval of the paired
/// per-session difference lies above `−AGENT_MARGIN`.
pub const AGENT_MARGIN: f64 = 0.02;

/// Mean dense score below which a RULER task says nothing about sparse methods
/// (docs/SPEC.md §7): only tasks at or above it are pooled.
pub const DENSE_CAN_DO: f64 = 0.5;

/// Bootstrap replicates per interval.
pub const RESAMPLES: usize = 10_000;

/// The bootstrap stream's seed (every interval of a report uses it).
pub const BOOTSTRAP_SEED: u64 = 0x5EED_F47A_0000_0007;

/// Fewest units for any verdict but "undecided": the percentile bootstrap under-covers below
/// this.
pub const MIN_UNITS: usize = 10;

/// Fewest units for "at parity": `⌈3/δ⌉` (the rule of three). With fewer, a run in which no
/// unit differs (a bootstrap interval of `[0, 0]`) still admits a rate of differing units
/// above δ.
pub const MIN_PARITY_UNITS: usize = 30;

/// A mean with its 95 % interval over `n` units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    /// The pooled mean.
    pub mean: f64,
    /// The 2.5 % bootstrap quantile.
    pub lo: f64,
    /// The 97.5 % bootstrap quantile.
    pub hi: f64,
    /// Units.
    pub n: usize,
}

impl Interval {
    /// No units: every field NaN, `n = 0`.
    pub const EMPTY: Interval = Interval {
        mean: f64::NAN,
        lo: f64::NAN,
        hi: f64::NAN,
        n: 0,
    };

    /// `+0.012 [−0.030, +0.050]` (a difference); `—` without units.
    pub fn cell(&self) -> String {
        if self.n == 0 {
            return "—".into();
        }
        format!("{:+.3} [{:+.3}, {:+.3}]", self.mean, self.lo, self.hi)
    }

    /// `0.958 [0.941, 0.975]` (a level); `—` without units.
    pub fn level(&self) -> String {
        if self.n == 0 {
            return "—".into();
        }
        format!("{:.3} [{:.3}, {:.3}]", self.mean, self.lo, self.hi)
    }
}

/// A verdict on a paired difference against a reference (docs/SPEC.md §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// The whole interval lies in `[−δ, +δ]`, over at least [`MIN_PARITY_UNITS`] units.
    AtParity,
    /// Not at parity, and the whole interval lies below 0.
    Below,
    /// Not at parity, and the whole interval lies above 0.
    Above,
    /// None of these (or fewer than [`MIN_UNITS`] units).
    Undecided,
}

impl Verdict {
    /// `at parity`, `below`, `above`, `undecided`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::AtParity => "at parity",
            Verdict::Below => "below",
            Verdict::Above => "above",
            Verdict::Undecided => "undecided",
        }
    }
}

/// The verdict on `iv` at margin `margin`, mechanically (docs/SPEC.md §7): parity first (an
/// interval inside the margin that excludes 0 is a difference smaller than the margin: at
/// parity), then below (`hi < 0`), then above (`lo > 0`), else undecided.
pub fn judge(iv: &Interval, margin: f64) -> Verdict {
    if iv.n < MIN_UNITS || !(iv.lo.is_finite() && iv.hi.is_finite()) {
        Verdict::Undecided
    } else if iv.n >= MIN_PARITY_UNITS && iv.lo >= -margin && iv.hi <= margin {
        Verdict::AtParity
    } else if iv.hi < 0.0 {
        Verdict::Below
    } else if iv.lo > 0.0 {
        Verdict::Above
    } else {
        Verdict::Undecided
    }
}

/// SplitMix64 (Steele, Lea and Flood 2014): the bootstrap's stream.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A stream from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform index in `0..n` (`n ≥ 1`; Lemire's multiply-shift, bias below `n / 2^64`).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

/// The `p`-quantile of sorted `x` (linear interpolation between order statistics, the
/// "type 7" rule).
fn quantile(x: &[f64], p: f64) -> f64 {
    let h = (x.len() - 1) as f64 * p;
    let (i, f) = (h.floor() as usize, h - h.floor());
    if i + 1 < x.len() {
        x[i] + f * (x[i + 1] - x[i])
    } else {
        x[i]
    }
}

/// The pooled mean of `strata` with its stratified percentile-bootstrap 95 % interval
/// (module docs), from `resamples` replicates of the stream seeded with `seed`. Empty strata
/// add nothing; no units at all give [`Interval::EMPTY`].
pub fn bootstrap_mean(strata: &[&[f64]], resamples: usize, seed: u64) -> Interval {
    let n: usize = strata.iter().map(|s| s.len()).sum();
    if n == 0 || resamples == 0 {
        return Interval::EMPTY;
    }
    let mean = strata.iter().flat_map(|s| s.iter()).sum::<f64>() / n as f64;
    let mut rng = SplitMix64::new(seed);
    let mut reps: Vec<f64> = (0..resamples)
        .map(|_| {
            let mut sum = 0.0;
            for s in strata {
                for _ in 0..s.len() {
                    sum += s[rng.below(s.len())];
                }
            }
            sum / n as f64
        })
        .collect();
    reps.sort_by(f64::total_cmp);
    Interval {
        mean,
        lo: quantile(&reps, 0.025),
        hi: quantile(&reps, 0.975),
        n,
    }
}

/// [`bootstrap_mean`] with the report's [`RESAMPLES`] and [`BOOTSTRAP_SEED`].
pub fn interval(strata: &[&[f64]]) -> Interval {
    bootstrap_mean(strata, RESAMPLES, BOOTSTRAP_SEED)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    fn runner(cases: u32) -> TestRunner {
        let config = Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        };
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha))
    }

    fn iv(mean: f64, lo: f64, hi: f64, n: usize) -> Interval {
        Interval { mean, lo, hi, n }
    }

    /// One case per branch of the rule, and its edges.
    #[test]
    fn verdicts_follow_the_interval() {
        let d = PARITY_MARGIN;
        let check = |i: Interval, v: Verdict| assert_eq!(judge(&i, d), v, "{i:?}");
        check(iv(0.0, -0.05, 0.05, 40), Verdict::AtParity);
        check(iv(0.0, -0.10, 0.10, 40), Verdict::AtParity);
        // Inside the margin but excluding 0: a difference smaller than the margin.
        check(iv(-0.04, -0.08, -0.01, 40), Verdict::AtParity);
        check(iv(0.0, 0.0, 0.0, 40), Verdict::AtParity);
        // Too few units for parity: a clean run of 20 is undecided, a clear loss is not.
        check(iv(0.0, 0.0, 0.0, 20), Verdict::Undecided);
        check(iv(-0.9, -1.0, -0.8, 20), Verdict::Below);
        check(iv(-0.2, -0.3, -0.11, 40), Verdict::Below);
        check(iv(0.2, 0.11, 0.3, 40), Verdict::Above);
        check(iv(-0.1, -0.25, 0.05, 40), Verdict::Undecided);
        check(iv(-0.05, -0.11, 0.0, 40), Verdict::Undecided);
        check(iv(-0.9, -1.0, -0.8, 9), Verdict::Undecided);
        check(Interval::EMPTY, Verdict::Undecided);
    }

    #[test]
    fn hand_built_intervals() {
        // Every unit equal: a degenerate interval at the value.
        let i = bootstrap_mean(&[&[0.5; 12]], 1000, 1);
        assert_eq!((i.mean, i.lo, i.hi, i.n), (0.5, 0.5, 0.5, 12));
        // Two strata of different sizes: the pooled mean weighs units, not strata.
        let i = bootstrap_mean(&[&[1.0, 1.0, 1.0], &[0.0]], 1000, 1);
        assert_eq!(i.mean, 0.75);
        // Each stratum keeps its size: its mean can only move by resampling within it.
        assert_eq!((i.lo, i.hi), (0.75, 0.75));
        assert_eq!(bootstrap_mean(&[&[], &[]], 100, 1).n, 0);
        assert!(bootstrap_mean(&[], 100, 1).mean.is_nan());
        assert_eq!(quantile(&[0.0, 1.0, 2.0], 0.25), 0.5);
    }

    /// Seeded properties at three sizes: the interval holds its mean, lies within the data's
    /// range, is the same for the same seed, and its width shrinks like 1/√n.
    #[test]
    fn bootstrap_properties() {
        for n in [10usize, 40, 160] {
            let mut r = runner(32);
            let strat = proptest::collection::vec(-1.0f64..1.0, n);
            r.run(&(strat, any::<u64>()), |(x, seed)| {
                let i = bootstrap_mean(&[&x], 400, seed);
                let (min, max) = x
                    .iter()
                    .fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                prop_assert!(min <= i.lo && i.lo <= i.mean + 1e-12);
                prop_assert!(i.mean <= i.hi + 1e-12 && i.hi <= max);
                prop_assert_eq!(i, bootstrap_mean(&[&x], 400, seed));
                // Half width ≤ 1.96·σ/√n (σ ≤ 1 here), with room for the bootstrap's noise.
                let sd = (x.iter().map(|v| (v - i.mean).powi(2)).sum::<f64>() / n as f64).sqrt();
                prop_assert!((i.hi - i.lo) / 2.0 <= 1.3 * 1.96 * sd / (n as f64).sqrt() + 1e-9);
                Ok(())
            })
            .unwrap();
        }
    }

    /// Coverage: over seeded draws of a known mean, the interval holds it about 95 % of the
    /// time (the band is ±4 binomial standard deviations of 200 draws, so a fixed seed cannot
    /// fail by chance).
    #[test]
    fn coverage_is_near_95_percent() {
        let mut rng = SplitMix64::new(7);
        let n = 40;
        let mut hits = 0;
        for t in 0..200 {
            // Bernoulli(0.3) differences, the shape of RULER's scores.
            let x: Vec<f64> = (0..n)
                .map(|_| f64::from(u8::from(rng.below(10) < 3)))
                .collect();
            let i = bootstrap_mean(&[&x], 1000, t);
            hits += usize::from(i.lo <= 0.3 && 0.3 <= i.hi);
        }
        let p = hits as f64 / 200.0;
        assert!((0.95 - 4.0 * 0.0154..=1.0).contains(&p), "coverage {p}");
    }

    #[test]
    fn indices_are_uniform_and_in_range() {
        let mut rng = SplitMix64::new(3);
        let mut count = [0usize; 5];
        for _ in 0..50_000 {
            count[rng.below(5)] += 1;
        }
        for c in count {
            assert!((9_000..11_000).contains(&c), "{count:?}");
        }
    }
}
