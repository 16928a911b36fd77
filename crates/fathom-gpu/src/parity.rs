//! GPU against CPU: dense greedy decoding of real prompts on a [`Decoder`] and on
//! `fathom-model`'s CPU runtime, compared token by token and logit by logit.
//!
//! **The reference** is the CPU runtime in [`fathom_model::WeightMode::Bf16`], which rounds
//! what the GPU forward rounds (weights, every matmul input, cached K and V). The two differ in
//! the order of f32 sums (cuBLAS's tensor-core tiles against candle's loops, tree reductions
//! against sequential ones) and, through that, in the occasional bf16 rounding of a matmul
//! input that falls on the other side of a rounding boundary, which moves that element by one
//! bf16 ulp (`2⁻⁸` relative) and propagates.
//!
//! **The tolerance is measured, not guessed.** The same CPU runtime with f32 weights and
//! activations ([`fathom_model::WeightMode::Dequantized`]), teacher-forced on the bf16 run's
//! tokens, gives at every step the logit change that bf16 rounding itself causes:
//! `noise_j = max_v |L_bf16[j][v] − L_f32[j][v]|`. The GPU is a second bf16 path with its own
//! rounding events (reordered f32 sums; tensor cores sum a tile's products before rounding),
//! so its own distance from the f32 model, `gpu_noise_j = max_v |L_gpu[j][v] − L_f32[j][v]|`,
//! is of the same kind. Step `j` passes iff `gpu_noise_j ≤ NOISE_FACTOR · noise_j`: the GPU's
//! bf16 forward is at most twice as far from the f32 model as the CPU's bf16 forward is. A
//! real error (a RoPE pairing, a mask, a norm, TF32 in a matmul) moves logits by one to two
//! orders of magnitude more. The GPU–CPU distance `diff_j = max_v |L_gpu − L_bf16|` is
//! reported beside it (it is at most `gpu_noise_j + noise_j`). Logits are compared up to and
//! including the first step whose greedy tokens differ (after it the contexts differ).
//!
//! **A divergence is explained by a near-tie** iff the CPU's top-2 margin at that step is at
//! most `2 · diff_j`: two logits each moved by at most `diff_j` can swap only then. Any other
//! divergence fails.

use fathom_model::{argmax, log_softmax, Dense, Model};

use crate::decoder::{Attention, Decoder};
use crate::error::{GpuError, Result};

/// How much farther from the f32 model than the CPU's bf16 forward the GPU's may be.
pub const NOISE_FACTOR: f32 = 2.0;

pub use fathom_results::parity::{ParityReport, PromptParity};

/// `(top1 − top2)` of a logit row.
pub fn top2_margin(x: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in x {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// `max_i |a_i − b_i|`.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Mean over `reference`'s top-5 tokens of `|Δ log-prob|`.
pub fn top5_logprob_diff(reference: &[f32], other: &[f32]) -> f32 {
    let (lr, lo) = (log_softmax(reference), log_softmax(other));
    let mut idx: Vec<usize> = (0..lr.len()).collect();
    idx.sort_by(|&a, &b| lr[b].total_cmp(&lr[a]));
    idx.iter()
        .take(5)
        .map(|&i| (lr[i] - lo[i]).abs())
        .sum::<f32>()
        / 5.0
}

/// Greedy decoding on the CPU: the tokens and the logits before each (`[steps][vocab]`).
fn cpu_greedy(cpu: &Model, prompt: &[u32], steps: usize) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut cache = cpu.new_cache(prompt.len() + steps);
    let mut logits = vec![cpu.prefill(prompt, &mut cache, 512, None)?];
    let mut toks = Vec::with_capacity(steps);
    for j in 0..steps {
        let t = argmax(&logits[j]);
        toks.push(t);
        if j + 1 < steps {
            logits.push(cpu.decode_step(t, &mut cache, &mut Dense, None)?);
        }
    }
    Ok((toks, logits))
}

/// The logits before each of `forced` (the first from the prompt's prefill).
fn cpu_forced(cpu: &Model, prompt: &[u32], forced: &[u32]) -> Result<Vec<Vec<f32>>> {
    let mut cache = cpu.new_cache(prompt.len() + forced.len());
    let mut logits = vec![cpu.prefill(prompt, &mut cache, 512, None)?];
    for &t in &forced[..forced.len().saturating_sub(1)] {
        logits.push(cpu.decode_step(t, &mut cache, &mut Dense, None)?);
    }
    Ok(logits)
}

/// Greedy-decodes `new_tokens` after each prompt on the GPU (every prompt in one batch, with
/// `dense`) and on `cpu_bf16`, and measures the rounding noise with `cpu_f32`
/// ([module docs](self)).
///
/// # Errors
/// Whatever either runtime refuses; `new_tokens` of 0; models of different vocabularies.
pub fn run(
    cpu_bf16: &Model,
    cpu_f32: &Model,
    gpu: &mut dyn Decoder,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    dense: &Attention,
) -> Result<ParityReport> {
    let vocab = cpu_bf16.config().vocab_size;
    if new_tokens == 0 || cpu_f32.config().vocab_size != vocab {
        return Err(GpuError::invalid(
            "parity",
            "new_tokens must be at least 1 and both CPU models the same model",
        ));
    }
    let mut sessions = Vec::with_capacity(prompts.len());
    let mut gl: Vec<Vec<Vec<f32>>> = Vec::with_capacity(prompts.len());
    for p in prompts {
        let s = gpu.create()?;
        gl.push(vec![gpu.prefill(s, p)?]);
        sessions.push(s);
    }
    let mut gt: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    for step in 0..new_tokens {
        let batch: Vec<_> = sessions
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let t = argmax(&gl[i][step]);
                gt[i].push(t);
                (s, t)
            })
            .collect();
        if step + 1 == new_tokens {
            break;
        }
        let out = gpu.decode(&batch, dense)?;
        for (i, row) in out.chunks(vocab).enumerate() {
            gl[i].push(row.to_vec());
        }
    }
    for s in sessions {
        gpu.free(s)?;
    }
    let mut rows = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let (ct, cl) = cpu_greedy(cpu_bf16, p, new_tokens)?;
        let fl = cpu_forced(cpu_f32, p, &ct)?;
        let div = (0..new_tokens).find(|&j| ct[j] != gt[i][j]);
        let last = div.unwrap_or(new_tokens - 1);
        let diff: Vec<f32> = (0..=last)
            .map(|j| max_abs_diff(&gl[i][j], &cl[j]))
            .collect();
        let noise: Vec<f32> = (0..=last).map(|j| max_abs_diff(&fl[j], &cl[j])).collect();
        let gpu_noise: Vec<f32> = (0..=last)
            .map(|j| max_abs_diff(&fl[j], &gl[i][j]))
            .collect();
        let margin = div.map(|j| top2_margin(&cl[j]));
        let ratio = gpu_noise
            .iter()
            .zip(&noise)
            .map(|(d, n)| d / n.max(f32::MIN_POSITIVE))
            .fold(0.0, f32::max);
        rows.push(PromptParity {
            prompt_tokens: p.len(),
            cpu_tokens: ct.clone(),
            gpu_tokens: gt[i].clone(),
            first_divergence: div,
            cpu_margin_at_divergence: margin,
            explained_by_tie: matches!((div, margin), (Some(j), Some(m)) if m <= 2.0 * diff[j]),
            steps_compared: diff.len(),
            worst_ratio: ratio,
            max_top5_logprob_diff: (0..=last)
                .map(|j| top5_logprob_diff(&cl[j], &gl[i][j]))
                .fold(0.0, f32::max),
            max_top5_logprob_noise: (0..=last)
                .map(|j| top5_logprob_diff(&cl[j], &fl[j]))
                .fold(0.0, f32::max),
            max_abs_logit: (0..=last)
                .flat_map(|j| cl[j].iter().map(|v| v.abs()))
                .fold(0.0, f32::max),
            diff,
            noise,
            gpu_noise,
        });
    }
    let identical = rows.iter().filter(|r| r.first_divergence.is_none()).count();
    let explained = rows.iter().filter(|r| r.explained_by_tie).count();
    let worst = rows
        .iter()
        .flat_map(|r| r.diff.iter().copied())
        .fold(0.0, f32::max);
    let worst_ratio = rows.iter().map(|r| r.worst_ratio).fold(0.0, f32::max);
    Ok(ParityReport {
        new_tokens,
        pass: worst_ratio <= NOISE_FACTOR && identical + explained == rows.len(),
        noise_factor: NOISE_FACTOR,
        prompts: rows,
        identical,
        explained_by_ties: explained,
        max_abs_logit_diff: worst,
        worst_ratio,
    })
}
