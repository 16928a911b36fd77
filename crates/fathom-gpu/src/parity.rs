//! GPU against CPU: dense greedy decoding of real prompts on a [`Decoder`] and on
//! `fathom-model`'s CPU runtime (load it in [`fathom_model::WeightMode::Bf16`], the GPU
//! forward's rounding), compared token by token and logit by logit.
//!
//! **The tolerance.** Both paths compute the same bf16-rounded products and differ only in the
//! order of f32 sums (cuBLAS tiles, tree reductions), a relative `~2⁻²⁴·√n` per sum, and in the
//! rare bf16 rounding of a matmul input that lands on the other side of a rounding boundary
//! (one bf16 ulp, `2⁻⁸` relative, for that element). The logits are compared against
//! [`LOGIT_TOL`], an absolute bound on `max |Δlogit|` per step; greedy tokens may then differ
//! only where the CPU's top-2 margin is at most `2 · LOGIT_TOL` (two logits each off by at most
//! the bound can swap only then): such a divergence is *explained by a near-tie*, any other is
//! a failure. Logits are compared up to and including the first divergent step (after it the
//! two contexts differ).

use fathom_model::{argmax, Dense, Model};
use serde::Serialize;

use crate::decoder::{Attention, Decoder};
use crate::error::Result;

/// Bound on `max |Δlogit|` between the GPU forward and the bf16 CPU runtime at any compared
/// step. One bf16 flip of an LM-head input moves a logit by `2⁻⁸ · |w x|` for one term, a few
/// 1e-3 at these models' weights and hidden states; the bound allows a few dozen such events
/// on top of the f32 reordering.
pub const LOGIT_TOL: f32 = 0.05;

/// One prompt's comparison.
#[derive(Debug, Clone, Serialize)]
pub struct PromptParity {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// The CPU's greedy tokens.
    pub cpu_tokens: Vec<u32>,
    /// The GPU's greedy tokens.
    pub gpu_tokens: Vec<u32>,
    /// First step whose greedy tokens differ.
    pub first_divergence: Option<usize>,
    /// The CPU's top-2 logit margin at that step.
    pub cpu_margin_at_divergence: Option<f32>,
    /// Whether the divergence (if any) is within `2 · LOGIT_TOL` of a tie.
    pub explained_by_tie: bool,
    /// Steps whose logits were compared.
    pub steps_compared: usize,
    /// Largest `|Δlogit|` over the compared steps.
    pub max_abs_logit_diff: f32,
    /// Mean over the compared steps of the step's largest `|Δlogit|`.
    pub mean_step_max_diff: f32,
    /// Largest `|logit|` of the CPU over the compared steps (the scale of the differences).
    pub max_abs_logit: f32,
}

/// Every prompt's comparison and the verdict.
#[derive(Debug, Clone, Serialize)]
pub struct ParityReport {
    /// The tolerance used.
    pub logit_tol: f32,
    /// New tokens per prompt.
    pub new_tokens: usize,
    /// Per prompt.
    pub prompts: Vec<PromptParity>,
    /// Prompts whose greedy tokens agree throughout.
    pub identical: usize,
    /// Prompts that diverge at a near-tie.
    pub explained_by_ties: usize,
    /// Largest `|Δlogit|` over every compared step.
    pub max_abs_logit_diff: f32,
    /// No compared step past the tolerance and every divergence explained.
    pub pass: bool,
}

fn top2_margin(x: &[f32]) -> f32 {
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

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Greedy-decodes `new_tokens` after each prompt on both paths (the GPU decodes every prompt
/// in one batch with `dense`) and compares them ([module docs](self)).
///
/// # Errors
/// Whatever either runtime refuses (a prompt past a limit, a token past the vocabulary).
pub fn run(
    cpu: &Model,
    gpu: &mut dyn Decoder,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    dense: &Attention,
) -> Result<ParityReport> {
    let vocab = cpu.config().vocab_size;
    // CPU: each prompt on its own, its logits at every step.
    let mut cpu_runs = Vec::with_capacity(prompts.len());
    for p in prompts {
        let mut cache = cpu.new_cache(p.len() + new_tokens + 1);
        let mut logits = vec![cpu.prefill(p, &mut cache, 512, None)?];
        let mut toks = Vec::with_capacity(new_tokens);
        for _ in 0..new_tokens {
            let t = argmax(logits.last().unwrap_or(&Vec::new()));
            toks.push(t);
            logits.push(cpu.decode_step(t, &mut cache, &mut Dense, None)?);
        }
        logits.pop();
        cpu_runs.push((toks, logits));
    }
    // GPU: prefill each, then one batch for every step.
    let mut sessions = Vec::with_capacity(prompts.len());
    let mut gpu_logits: Vec<Vec<Vec<f32>>> = Vec::with_capacity(prompts.len());
    for p in prompts {
        let s = gpu.create()?;
        gpu_logits.push(vec![gpu.prefill(s, p)?]);
        sessions.push(s);
    }
    let mut gpu_toks: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    for step in 0..new_tokens {
        let batch: Vec<_> = sessions
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let t = argmax(&gpu_logits[i][step]);
                gpu_toks[i].push(t);
                (s, t)
            })
            .collect();
        if step + 1 == new_tokens {
            break;
        }
        let out = gpu.decode(&batch, dense)?;
        for (i, row) in out.chunks(vocab).enumerate() {
            gpu_logits[i].push(row.to_vec());
        }
    }
    for s in sessions {
        gpu.free(s)?;
    }
    let mut rows = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let (ct, cl) = &cpu_runs[i];
        let gt = &gpu_toks[i];
        let div = (0..new_tokens).find(|&j| ct[j] != gt[j]);
        let last = div.unwrap_or(new_tokens - 1);
        let diffs: Vec<f32> = (0..=last)
            .map(|j| max_abs_diff(&cl[j], &gpu_logits[i][j]))
            .collect();
        let margin = div.map(|j| top2_margin(&cl[j]));
        rows.push(PromptParity {
            prompt_tokens: p.len(),
            cpu_tokens: ct.clone(),
            gpu_tokens: gt.clone(),
            first_divergence: div,
            cpu_margin_at_divergence: margin,
            explained_by_tie: margin.is_some_and(|m| m <= 2.0 * LOGIT_TOL),
            steps_compared: diffs.len(),
            max_abs_logit_diff: diffs.iter().cloned().fold(0.0, f32::max),
            mean_step_max_diff: diffs.iter().sum::<f32>() / diffs.len() as f32,
            max_abs_logit: (0..=last)
                .flat_map(|j| cl[j].iter().map(|v| v.abs()))
                .fold(0.0, f32::max),
        });
    }
    let identical = rows.iter().filter(|r| r.first_divergence.is_none()).count();
    let explained = rows.iter().filter(|r| r.explained_by_tie).count();
    let worst = rows
        .iter()
        .map(|r| r.max_abs_logit_diff)
        .fold(0.0, f32::max);
    Ok(ParityReport {
        logit_tol: LOGIT_TOL,
        new_tokens,
        pass: worst <= LOGIT_TOL && identical + explained == rows.len(),
        prompts: rows,
        identical,
        explained_by_ties: explained,
        max_abs_logit_diff: worst,
    })
}
