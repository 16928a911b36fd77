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
            device: gpu.info().clone(),
            corpus: kind.name().into(),
            split: split.name().into(),
            prompt_tokens: a.prompt_tokens,
            prefill_chunk: dcfg.prefill_chunk,
            cublas_math: std::env::var("FATHOM_GPU_MATH").unwrap_or_else(|_| "default".into()),
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
        // A group's roots and their forks of one method alive at once.
        let g = Self::GROUP;
        let mut dcfg = DecoderConfig::new(2 * g, max_tokens);
        dcfg.max_batch = g;
        dcfg.max_k = params.k.max(1).min(max_tokens);
        let per = max_tokens.div_ceil(dcfg.page_tokens);
        dcfg.pages = Some(g * (per + 1) + g + 8);
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

    /// Samples whose branches decode in one batch (bounds the pinned pages a group holds).
    pub const GROUP: usize = 20;

    /// Per prompt, its dense prefill on the GPU and each method's greedy branch from it, the
    /// prompts in groups of [`GpuEval::GROUP`] whose branches of one method decode in one batch:
    /// each prefill's seconds and `[prompt][method]` = (branch, seconds: the batch's time
    /// shared equally).
    #[allow(clippy::type_complexity)]
    pub fn greedy_batches(
        &mut self,
        prompts: &[&[u32]],
        max_new: usize,
        stop_tokens: &[u32],
        stop: &dyn Fn(&[u32]) -> bool,
    ) -> Result<(Vec<f64>, Vec<Vec<(fathom_eval::decode::Branch, f64)>>)> {
        self.batches(prompts, |dec, atts, roots| {
            let r: Vec<(fathom_cuda::pages::SessionId, &[f32])> =
                roots.iter().map(|(s, l)| (*s, &l[..])).collect();
            atts.iter()
                .map(|att| {
                    let t = Instant::now();
                    let outs =
                        fathom_gpu::branch::greedy(dec, &r, att, max_new, stop_tokens, stop)?;
                    Ok((outs, t.elapsed().as_secs_f64()))
                })
                .collect()
        })
    }

    /// As [`GpuEval::greedy_batches`], teacher-forced on `forced[i]` after prompt `i`.
    #[allow(clippy::type_complexity)]
    pub fn forced_batches(
        &mut self,
        prompts: &[&[u32]],
        forced: &[&[u32]],
    ) -> Result<(Vec<f64>, Vec<Vec<(fathom_eval::decode::Branch, f64)>>)> {
        if forced.len() != prompts.len() {
            bail!("one forced continuation per prompt");
        }
        let mut next = 0;
        self.batches(prompts, |dec, atts, roots| {
            let f = &forced[next..next + roots.len()];
            next += roots.len();
            let ids: Vec<fathom_cuda::pages::SessionId> = roots.iter().map(|r| r.0).collect();
            atts.iter()
                .map(|att| {
                    let t = Instant::now();
                    let outs = fathom_gpu::branch::forced(dec, &ids, att, f)?;
                    Ok((outs, t.elapsed().as_secs_f64()))
                })
                .collect()
        })
    }

    /// Groups of prompts: prefill each (timed), run `per_group` (one result list and its
    /// seconds per method), free the roots.
    #[allow(clippy::type_complexity)]
    fn batches(
        &mut self,
        prompts: &[&[u32]],
        mut per_group: impl FnMut(
            &mut GpuDecoder,
            &[Attention],
            &[(fathom_cuda::pages::SessionId, Vec<f32>)],
        ) -> Result<Vec<(Vec<fathom_gpu::branch::BranchOut>, f64)>>,
    ) -> Result<(Vec<f64>, Vec<Vec<(fathom_eval::decode::Branch, f64)>>)> {
        let mut pre_s = Vec::with_capacity(prompts.len());
        let mut out = Vec::with_capacity(prompts.len());
        for group in prompts.chunks(Self::GROUP) {
            let mut roots = Vec::with_capacity(group.len());
            for p in group {
                let t = Instant::now();
                let s = self.dec.create()?;
                roots.push((s, self.dec.prefill(s, p)?));
                pre_s.push(t.elapsed().as_secs_f64());
            }
            let r = per_group(&mut self.dec, &self.atts, &roots);
            for (s, _) in &roots {
                self.dec.free(*s)?;
            }
            let per_method = r?;
            for i in 0..group.len() {
                out.push(
                    per_method
                        .iter()
                        .map(|(outs, secs)| {
                            (Self::to_branch(outs[i].clone()), secs / group.len() as f64)
                        })
                        .collect(),
                );
            }
        }
        Ok((pre_s, out))
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
}
