//! Real models on the GPU (fathom-gpu): `gpu-parity` here, `decode-bench`
//! ([`decode_bench`]), and the GPU backend of `ruler` and `agent-steps` ([`eval`]).
//!
//! Wiring in `main.rs`:
//!
//! ```text
//! mod gpu_cmds;
//! GpuParity(gpu_cmds::GpuParityArgs)       => gpu_cmds::run_gpu_parity(a)
//! DecodeBench(gpu_cmds::DecodeBenchArgs)   => gpu_cmds::run_decode_bench(a)
//! ```

use std::path::PathBuf;
use std::time::Instant;

use fathom_cuda::prelude::*;

use anyhow::{bail, Context, Result};
use fathom_cuda::cache::AttendMethod;
use fathom_cuda::Gpu;
use fathom_gpu::{parity, Attention, Decoder, DecoderConfig, GpuDecoder};
use fathom_model::corpus::{context_tokens, load_split, CorpusKind, Split};
use fathom_model::fetch::{fetch_model, ModelId};
use fathom_model::{DenseWeights, LoadOptions, Model, WeightMode};
use fathom_plan::method::MethodSpec;
use fathom_plan::SelectParams;
use fathom_results::downstream::RowCacheTally;

use crate::model_cmds::CacheArgs;

mod decode_bench;
mod eval;
pub use decode_bench::{run_decode_bench, DecodeBenchArgs};
pub use eval::{check_gpu_methods, GpuEval};

/// `fathom gpu-parity`: dense greedy decoding on the GPU against the CPU runtime.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Compares the GPU forward (bf16 weights, cuBLAS, the offloaded paged cache) with the CPU \
runtime in its bf16 mode on real prompts: greedy tokens and logits at every step (fathom_gpu::parity \
states the tolerance). Needs a build with `--features cuda` and a GPU.\n\nExamples:\n  \
    fathom gpu-parity --model smollm2-135m --prompts 8 --new-tokens 32 --json parity-smollm2.json\n  \
    fathom gpu-parity --model gemma3-270m --prompt-tokens 1024 --corpus code --offline"
)]
pub struct GpuParityArgs {
    /// Model: smollm2-135m or gemma3-270m.
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
    /// Prompts, each from a different document of the split.
    #[arg(long, default_value_t = 8)]
    pub prompts: usize,
    /// Tokens per prompt.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Greedy tokens per prompt.
    #[arg(long, default_value_t = 32)]
    pub new_tokens: usize,
    /// Corpus: prose or code.
    #[arg(long, default_value = "prose")]
    pub corpus: String,
    /// Split: calib or eval.
    #[arg(long, default_value = "eval")]
    pub split: String,
    /// Prefill chunk of the GPU forward (smaller than the prompt exercises chunking).
    #[arg(long, default_value_t = 192)]
    pub chunk: usize,
    /// Write the report as JSON here (atomically).
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub cache: CacheArgs,
}

/// Run `fathom gpu-parity`.
pub fn run_gpu_parity(a: GpuParityArgs) -> Result<()> {
    let kind: CorpusKind = a.corpus.parse()?;
    let split: Split = a.split.parse()?;
    let id: ModelId = a.model.parse()?;
    if a.prompts == 0 || a.new_tokens == 0 || a.prompt_tokens == 0 {
        bail!("--prompts, --prompt-tokens and --new-tokens must be at least 1");
    }
    if let Some(p) = &a.json {
        crate::check_writable(p)?;
    }
    let gpu = Gpu::open(0).context("gpu-parity needs a GPU")?;
    let t0 = Instant::now();
    let path = fetch_model(id, &a.cache.fetch_options())?;
    let cpu = Model::load(
        &path,
        &LoadOptions {
            weights: WeightMode::Bf16,
        },
    )
    .with_context(|| format!("loading {}", path.display()))?;
    let cpu_f32 = Model::load(
        &path,
        &LoadOptions {
            weights: WeightMode::Dequantized,
        },
    )?;
    let weights = DenseWeights::load(&path)?;
    let docs = load_split(kind, split, &a.cache.corpus_options())?;
    let mut prompts = Vec::with_capacity(a.prompts);
    for i in 0..a.prompts {
        // Documents 0, 7, 14, …: different texts.
        prompts.push(context_tokens(&docs, cpu.tokenizer(), a.prompt_tokens, 7 * i)?.0);
    }
    let mut dcfg = DecoderConfig::new(a.prompts, a.prompt_tokens + a.new_tokens + 1);
    dcfg.prefill_chunk = a.chunk.min(dcfg.max_tokens);
    let mut dec = GpuDecoder::new(&gpu, &weights, dcfg)?;
    let dense = Attention {
        method: AttendMethod::Dense,
        params: SelectParams {
            sink: 4,
            local: 32,
            k: 256,
        },
    };
    let report = parity::run(&cpu, &cpu_f32, &mut dec, &prompts, a.new_tokens, &dense)?;
    let wall_s = t0.elapsed().as_secs_f64();
    println!(
        "{} on {}: {} prompts × {} tokens; identical {}, diverged at a near-tie {}; max |Δlogit| {:.2e}, from f32 at most {:.2}× the CPU bf16 forward's distance (limit {}×): {}",
        id,
        gpu.info().name,
        a.prompts,
        a.new_tokens,
        report.identical,
        report.explained_by_ties,
        report.max_abs_logit_diff,
        report.worst_ratio,
        report.noise_factor,
        if report.pass { "PASS" } else { "FAIL" }
    );
    for (i, p) in report.prompts.iter().enumerate() {
        println!(
            "  prompt {i}: {} steps compared, max |Δlogit| {:.2e}, from f32 {:.2}× the CPU's (logits up to {:.1}; top-5 |Δlogprob| {:.3}, noise {:.3}), {}",
            p.steps_compared,
            p.diff.iter().copied().fold(0.0, f32::max),
            p.worst_ratio,
            p.max_abs_logit,
            p.max_top5_logprob_diff,
            p.max_top5_logprob_noise,
            match (p.first_divergence, p.cpu_margin_at_divergence) {
                (Some(j), Some(m)) => format!("diverges at step {j} (CPU top-2 margin {m:.3})"),
                _ => "identical".into(),
            }
        );
    }
    let pass = report.pass;
    if let Some(out) = &a.json {
        let file = fathom_results::parity::GpuParity {
            version: fathom_results::VERSION,
            fathom: env!("CARGO_PKG_VERSION").into(),
            command: fathom_results::command_line(),
            model: id.to_string(),
            device: fathom_bench::offload::device_record(gpu.info()),
            corpus: kind.name().into(),
            split: split.name().into(),
            prompt_tokens: a.prompt_tokens,
            prefill_chunk: dcfg.prefill_chunk,
            cublas_math: fathom_gpu::cublas_math().into(),
            wall_s,
            report,
        };
        fathom_results::write(out, file).with_context(|| format!("writing {}", out.display()))?;
    }
    if !pass {
        bail!("GPU and CPU disagree beyond the bf16 rounding noise or diverge away from a near-tie (see above)");
    }
    Ok(())
}

/// The PCA index and the block tables that `atts`' methods read (`Method::reads_pca_index`,
/// `Method::reads_block_tables`).
pub(super) fn serve_methods(dcfg: &mut DecoderConfig, atts: &[Attention]) {
    let scans = || {
        atts.iter().filter_map(|a| match a.method {
            AttendMethod::Scan(m) => Some(m),
            AttendMethod::Dense => None,
        })
    };
    dcfg.pca_index = scans().any(|m| m.reads_pca_index());
    dcfg.block_tables = scans().any(|m| m.reads_block_tables());
}
