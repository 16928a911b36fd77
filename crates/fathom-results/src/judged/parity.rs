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

/// Two parity runs of one setting under different cuBLAS math modes (`cublas_math`), step by
/// step: whether the reduced-precision accumulation that `default` allows and `pedantic`
/// forbids moves the GPU's distance from the f32 model.
#[derive(Debug, Clone, PartialEq)]
pub struct MathModes {
    /// Steps compared in both runs (prompt by prompt, the shorter's count).
    pub steps: usize,
    /// Steps whose GPU distance from f32 differs between the runs at all (bitwise).
    pub differing: usize,
    /// Largest `|a − b| / max(a, b)` over the compared steps (0 when every step is equal).
    pub max_rel: f32,
    /// Whether every prompt's greedy GPU tokens are the same in both runs.
    pub same_tokens: bool,
}

/// [`MathModes`] of `a` against `b`, or `None` when they are not one setting under two modes
/// (another model, device name, prompt set or token count, or the same mode).
pub fn math_modes(a: &GpuParity, b: &GpuParity) -> Option<MathModes> {
    let same_setting = a.model == b.model
        && a.device.name == b.device.name
        && a.prompt_tokens == b.prompt_tokens
        && a.report.new_tokens == b.report.new_tokens
        && a.report.prompts.len() == b.report.prompts.len()
        && a.cublas_math != b.cublas_math;
    if !same_setting {
        return None;
    }
    let mut m = MathModes {
        steps: 0,
        differing: 0,
        max_rel: 0.0,
        same_tokens: true,
    };
    for (p, q) in a.report.prompts.iter().zip(&b.report.prompts) {
        m.same_tokens &= p.gpu_tokens == q.gpu_tokens;
        for (x, y) in p.gpu_noise.iter().zip(&q.gpu_noise) {
            m.steps += 1;
            if x.to_bits() != y.to_bits() {
                m.differing += 1;
                let scale = x.abs().max(y.abs());
                if scale > 0.0 {
                    m.max_rel = m.max_rel.max((x - y).abs() / scale);
                }
            }
        }
    }
    Some(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parity::{ParityReport, PromptParity};

    fn run(math: &str, gpu_noise: Vec<f32>, tokens: Vec<u32>) -> GpuParity {
        let prompt = PromptParity {
            prompt_tokens: 8,
            cpu_tokens: tokens.clone(),
            gpu_tokens: tokens,
            first_divergence: None,
            cpu_margin_at_divergence: None,
            explained_by_tie: false,
            steps_compared: gpu_noise.len(),
            diff: vec![0.1; gpu_noise.len()],
            noise: vec![0.1; gpu_noise.len()],
            gpu_noise,
            worst_ratio: 1.0,
            max_top5_logprob_diff: 0.0,
            max_top5_logprob_noise: 0.0,
            max_abs_logit: 10.0,
        };
        GpuParity {
            version: 2,
            fathom: "0.1.0".into(),
            command: String::new(),
            model: "m".into(),
            device: crate::offload::DeviceInfo {
                name: "gpu".into(),
                compute_capability: (9, 0),
                total_mem_bytes: 1,
                multiprocessors: 1,
                driver_version: 13000,
                arch: "sm_90".into(),
            },
            corpus: "prose".into(),
            split: "eval".into(),
            prompt_tokens: 8,
            prefill_chunk: 4,
            cublas_math: math.into(),
            wall_s: 1.0,
            report: ParityReport {
                new_tokens: 3,
                prompts: vec![prompt],
                identical: 1,
                explained_by_ties: 0,
                max_abs_logit_diff: 0.1,
                noise_factor: 2.0,
                worst_ratio: 1.0,
                pass: true,
            },
        }
    }

    #[test]
    fn math_modes_counts_differing_steps_and_refuses_other_settings() {
        let a = run("default", vec![0.1, 0.2, 0.3], vec![1, 2, 3]);
        let same = math_modes(&a, &run("pedantic", vec![0.1, 0.2, 0.3], vec![1, 2, 3])).unwrap();
        assert_eq!((same.steps, same.differing, same.max_rel), (3, 0, 0.0));
        assert!(same.same_tokens);
        let moved = math_modes(&a, &run("pedantic", vec![0.1, 0.25, 0.3], vec![1, 2, 4])).unwrap();
        assert_eq!(moved.differing, 1);
        assert!((moved.max_rel - 0.2).abs() < 1e-6, "{}", moved.max_rel);
        assert!(!moved.same_tokens);
        assert!(math_modes(&a, &a).is_none(), "one mode is no comparison");
        let mut other = run("pedantic", vec![0.1, 0.2, 0.3], vec![1, 2, 3]);
        other.model = "n".into();
        assert!(math_modes(&a, &other).is_none());
    }
}
