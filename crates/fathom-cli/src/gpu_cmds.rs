//! Real models on the GPU (fathom-gpu): `gpu-parity`.
//!
//! Wiring in `main.rs`:
//!
//! ```text
//! mod gpu_cmds;
//! GpuParity(gpu_cmds::GpuParityArgs)   => gpu_cmds::run_gpu_parity(a)
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use fathom_cuda::cache::AttendMethod;
use fathom_cuda::Gpu;
use fathom_gpu::{parity, Attention, Decoder, DecoderConfig, GpuDecoder};
use fathom_model::corpus::{context_tokens, load_split, CorpusKind, Split};
use fathom_model::fetch::{fetch_model, ModelId};
use fathom_model::{DenseWeights, LoadOptions, Model, WeightMode};
use fathom_plan::SelectParams;
use serde::Serialize;

use crate::model_cmds::CacheArgs;

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

#[derive(Serialize)]
struct ParityFile<'a> {
    command: String,
    model: String,
    device: fathom_cuda::DeviceInfo,
    corpus: &'a str,
    split: &'a str,
    prompt_tokens: usize,
    prefill_chunk: usize,
    /// cuBLAS math mode: `default`, or `pedantic` (FATHOM_GPU_MATH=pedantic).
    cublas_math: String,
    wall_s: f64,
    report: parity::ParityReport,
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
        let file = ParityFile {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            model: id.to_string(),
            device: gpu.info().clone(),
            corpus: kind.name(),
            split: split.name(),
            prompt_tokens: a.prompt_tokens,
            prefill_chunk: dcfg.prefill_chunk,
            cublas_math: std::env::var("FATHOM_GPU_MATH").unwrap_or_else(|_| "default".into()),
            wall_s,
            report,
        };
        let bytes = serde_json::to_vec_pretty(&file)?;
        fathom_store::file::write_atomic(out, &bytes)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    if !pass {
        bail!("GPU and CPU disagree beyond the bf16 rounding noise or diverge away from a near-tie (see above)");
    }
    Ok(())
}

/// Refuses the methods the paged cache does not run yet (Loki, landmark, Quest), naming them:
/// checked before the model loads.
pub fn check_gpu_methods(methods: &[String]) -> Result<()> {
    let refused: Vec<&String> = methods
        .iter()
        .filter(|m| {
            let m = m.trim();
            m.starts_with("loki") || m == "landmark" || m == "quest"
        })
        .collect();
    if !refused.is_empty() {
        bail!(
            "--device cuda: the paged cache does not run {} yet; remove them from --methods (or run them with --device cpu)",
            refused.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(())
}

/// The downstream tasks' branches on the GPU (`fathom ruler|agent-steps --device cuda`): the
/// sample's dense prefill on the GPU forward, then one fork per method (fathom_gpu::branch).
pub struct GpuEval {
    dec: GpuDecoder,
    atts: Vec<Attention>,
    /// The device's name, for the results.
    pub device: String,
    _gpu: Gpu,
}

impl GpuEval {
    /// Opens the GPU, uploads the model and loads the calibration of every global layer.
    /// `methods` are the run's method names in order; a method the paged cache does not run
    /// yet (Loki, landmark, Quest) is refused here, before any work.
    pub fn new(
        model_path: &std::path::Path,
        head_dim: usize,
        methods: &[String],
        params: SelectParams,
        max_tokens: usize,
        calib: Option<&fathom_eval::decode::LayerCalib>,
    ) -> Result<GpuEval> {
        let d = head_dim;
        let mut atts = Vec::with_capacity(methods.len());
        let mut refused = Vec::new();
        for m in methods {
            let method = AttendMethod::parse(m, d)?;
            if let AttendMethod::Scan(
                fathom_cuda::Method::Loki(_)
                | fathom_cuda::Method::Landmark
                | fathom_cuda::Method::Quest,
            ) = method
            {
                refused.push(m.clone());
            }
            atts.push(Attention { method, params });
        }
        if !refused.is_empty() {
            bail!(
                "--device cuda: the paged cache does not run {} yet; remove them from --methods (or run them with --device cpu)",
                refused.join(", ")
            );
        }
        let gpu = Gpu::open(0).context("--device cuda needs a GPU")?;
        let weights = DenseWeights::load(model_path)?;
        let mut dcfg = DecoderConfig::new(4, max_tokens);
        dcfg.max_batch = 1;
        dcfg.max_k = params.k.max(1).min(max_tokens);
        let per = max_tokens.div_ceil(dcfg.page_tokens);
        dcfg.pages = Some(per + 8);
        let mut dec = GpuDecoder::new(&gpu, &weights, dcfg)?;
        if let Some(c) = calib {
            for (l, heads) in c.heads.iter().enumerate() {
                if !heads.is_empty() {
                    dec.cache_mut()?.load_calibration(l, heads)?;
                }
            }
        }
        Ok(GpuEval {
            dec,
            atts,
            device: gpu.info().name.clone(),
            _gpu: gpu,
        })
    }

    /// A new session prefilled with `ids`, and its last logits.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<(fathom_cuda::pages::SessionId, Vec<f32>)> {
        let s = self.dec.create()?;
        let logits = self.dec.prefill(s, ids)?;
        Ok((s, logits))
    }

    /// Frees a prefilled session.
    pub fn free(&mut self, s: fathom_cuda::pages::SessionId) -> Result<()> {
        Ok(self.dec.free(s)?)
    }

    fn to_branch(o: fathom_gpu::branch::BranchOut) -> fathom_eval::decode::Branch {
        fathom_eval::decode::Branch {
            tokens: o.tokens,
            stats: fathom_eval::decode::BranchStats {
                bits_sum: o.bits_sum,
                scans: o.scans,
                selected_sum: o.selected_sum,
                visible_sum: o.visible_sum,
            },
        }
    }

    /// Method `mi`'s greedy branch from `root`.
    pub fn greedy(
        &mut self,
        root: fathom_cuda::pages::SessionId,
        logits: &[f32],
        mi: usize,
        max_new: usize,
        stop_tokens: &[u32],
        stop: &dyn Fn(&[u32]) -> bool,
    ) -> Result<fathom_eval::decode::Branch> {
        let att = self.atts[mi];
        let o = fathom_gpu::branch::greedy(
            &mut self.dec,
            root,
            logits,
            &att,
            max_new,
            stop_tokens,
            stop,
        )?;
        Ok(Self::to_branch(o))
    }

    /// Method `mi`'s teacher-forced branch from `root`.
    pub fn forced(
        &mut self,
        root: fathom_cuda::pages::SessionId,
        mi: usize,
        forced: &[u32],
    ) -> Result<fathom_eval::decode::Branch> {
        let att = self.atts[mi];
        let o = fathom_gpu::branch::forced(&mut self.dec, root, &att, forced)?;
        Ok(Self::to_branch(o))
    }
}
