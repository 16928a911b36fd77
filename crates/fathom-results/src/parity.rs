//! The `gpu-parity` document: dense greedy decoding of a real model on the GPU against the CPU
//! runtime (written by `fathom gpu-parity`; the rule is `fathom_gpu::parity`'s).

use serde::{Deserialize, Serialize};

/// One prompt's comparison.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Whether that margin is at most twice the step's `max |Δlogit|`.
    pub explained_by_tie: bool,
    /// Steps whose logits were compared.
    pub steps_compared: usize,
    /// Per compared step, `max_v |L_gpu − L_bf16|`.
    pub diff: Vec<f32>,
    /// Per compared step, the CPU's bf16 rounding noise `max_v |L_bf16 − L_f32|`.
    pub noise: Vec<f32>,
    /// Per compared step, the GPU's distance from the f32 model `max_v |L_gpu − L_f32|`.
    pub gpu_noise: Vec<f32>,
    /// Largest `gpu_noise_j / noise_j` over the compared steps.
    pub worst_ratio: f32,
    /// Largest mean over the top-5 tokens of `|Δ log-prob|` (GPU against bf16 CPU).
    pub max_top5_logprob_diff: f32,
    /// The same statistic of bf16 against f32 on the CPU.
    pub max_top5_logprob_noise: f32,
    /// Largest `|logit|` of the CPU over the compared steps (the scale of the differences).
    pub max_abs_logit: f32,
}

/// Every prompt's comparison and the verdict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParityReport {
    /// New tokens per prompt.
    pub new_tokens: usize,
    /// Per prompt.
    pub prompts: Vec<PromptParity>,
    /// Prompts whose greedy tokens agree throughout.
    pub identical: usize,
    /// Prompts that diverge at a near-tie.
    pub explained_by_ties: usize,
    /// Largest `|Δlogit|` over every compared step (GPU against bf16 CPU).
    pub max_abs_logit_diff: f32,
    /// How much farther from the f32 model than the CPU's bf16 forward the GPU's may be.
    pub noise_factor: f32,
    /// Largest `gpu_noise_j / noise_j` over every compared step.
    pub worst_ratio: f32,
    /// Every compared step within the factor and every divergence explained.
    pub pass: bool,
}

/// A `fathom gpu-parity` run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuParity {
    /// Schema version.
    pub version: u32,
    /// The fathom version that wrote it.
    #[serde(default)]
    pub fathom: String,
    /// The command line.
    pub command: String,
    /// Model name.
    pub model: String,
    /// The GPU.
    pub device: crate::offload::DeviceInfo,
    /// Corpus of the prompts.
    pub corpus: String,
    /// Its split.
    pub split: String,
    /// Tokens per prompt.
    pub prompt_tokens: usize,
    /// The GPU's prefill chunk.
    pub prefill_chunk: usize,
    /// cuBLAS math mode (`default`, `pedantic`).
    #[serde(default = "default_math")]
    pub cublas_math: String,
    /// Seconds of the whole run.
    pub wall_s: f64,
    /// The comparison.
    pub report: ParityReport,
}

fn default_math() -> String {
    "default".into()
}
