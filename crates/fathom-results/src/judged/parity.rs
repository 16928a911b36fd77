//! What a `gpu-parity` run's per-step rule measures (docs/SPEC.md §7, "On the GPU"): the
//! ratio `r_j = gpu_noise_j / noise_j` of the GPU's distance from the f32 model to the CPU
//! bf16 forward's, at every compared step `j`. If the GPU's roundings were just another bf16
//! forward of the same size, `ln r_j` would be symmetric about 0: steps where the CPU is more
//! than the factor farther (`1/r_j > f`) would be as many as steps where the GPU is.

use super::stats::{interval, Interval};
use crate::parity::GpuParity;

/// The spread of the per-step ratios of one parity run.
#[derive(Debug, Clone, PartialEq)]
pub struct RatioSpread {
    /// Compared steps over every prompt.
    pub steps: usize,
    /// Steps with `r_j > f` (the GPU more than the factor farther from f32).
    pub gpu_over: usize,
    /// Steps with `1/r_j > f` (the CPU's bf16 forward more than the factor farther).
    pub cpu_over: usize,
    /// `exp` of the mean of `ln r_j` per prompt, with its interval over prompts (the prompt
    /// is the unit): the geometric-mean ratio.
    pub geo_mean_ratio: Interval,
    /// Largest `1/r_j`.
    pub worst_inverse: f32,
}

/// [`RatioSpread`] of a run at its own `noise_factor`.
pub fn ratio_spread(p: &GpuParity) -> RatioSpread {
    let f = p.report.noise_factor;
    let mut s = RatioSpread {
        steps: 0,
        gpu_over: 0,
        cpu_over: 0,
        geo_mean_ratio: Interval::EMPTY,
        worst_inverse: 0.0,
    };
    let mut per_prompt = Vec::new();
    for q in &p.report.prompts {
        let logs: Vec<f64> = q
            .gpu_noise
            .iter()
            .zip(&q.noise)
            .filter(|(g, n)| **g > 0.0 && **n > 0.0)
            .map(|(g, n)| {
                let r = g / n;
                s.gpu_over += usize::from(r > f);
                s.cpu_over += usize::from(1.0 / r > f);
                s.worst_inverse = s.worst_inverse.max(1.0 / r);
                f64::from(r).ln()
            })
            .collect();
        s.steps += logs.len();
        if !logs.is_empty() {
            per_prompt.push(logs.iter().sum::<f64>() / logs.len() as f64);
        }
    }
    let iv = interval(&[&per_prompt]);
    s.geo_mean_ratio = Interval {
        mean: iv.mean.exp(),
        lo: iv.lo.exp(),
        hi: iv.hi.exp(),
        n: iv.n,
    };
    s
}
