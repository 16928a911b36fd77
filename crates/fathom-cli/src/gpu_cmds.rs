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

/// Refuses, naming them, the methods the GPU path does not run (the CPU runtime's variants and
/// ablations, such as `fathom-klt:B` or `loki-f16:R`; every method of the GPU step grammar,
/// `fathom_cuda::Method`, runs): checked before the model loads.
pub fn check_gpu_methods(methods: &[String]) -> Result<()> {
    let refused: Vec<&String> = methods
        .iter()
        .filter(|m| {
            // A name that does not parse at all is reported later, with the model's D.
            let m = m.trim();
            fathom_plan::method::MethodSpec::parse(m, 256).is_ok_and(|s| s != MethodSpec::Dense)
                && fathom_cuda::Method::parse(m, 256).is_err()
        })
        .collect();
    if !refused.is_empty() {
        bail!(
            "--device cuda: the GPU path does not run {}; remove them from --methods (or run them with --device cpu)",
            refused.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(())
}

/// The PCA index and the block tables that `atts`' methods read (`Method::reads_pca_index`,
/// `Method::reads_block_tables`).
fn serve_methods(dcfg: &mut DecoderConfig, atts: &[Attention]) {
    let scans = || {
        atts.iter().filter_map(|a| match a.method {
            AttendMethod::Scan(m) => Some(m),
            AttendMethod::Dense => None,
        })
    };
    dcfg.pca_index = scans().any(|m| m.reads_pca_index());
    dcfg.block_tables = scans().any(|m| m.reads_block_tables());
}

/// One method's batch of branches: each branch's output, the batch's seconds and the row
/// counters it added.
type MethodBatch = (
    Vec<fathom_gpu::branch::BranchOut>,
    f64,
    fathom_cuda::cache::RowCounters,
);

/// The downstream tasks' branches on the GPU (`fathom ruler|agent-steps --device cuda`): the
/// sample's dense prefill on the GPU forward, then one fork per method (fathom_gpu::branch).
pub struct GpuEval {
    dec: GpuDecoder,
    atts: Vec<Attention>,
    /// Row-cache slots per (session, layer, KV head) (0: none).
    pub row_cache: usize,
    /// Per method, the row counters since [`GpuEval::take_row_counters`].
    rows: Vec<fathom_cuda::cache::RowCounters>,
    /// The device's name, for the results.
    pub device: String,
    _gpu: Gpu,
}

impl GpuEval {
    /// Opens the GPU, uploads the model and loads the calibration of every global layer.
    /// `methods` are the run's method names in order; a method the GPU path does not run is
    /// refused here, before any work. With a Loki method the cache keeps the PCA index, whose
    /// basis the calibration loads before any session; with landmark or Quest, the block
    /// tables. `row_cache` slots per (session, layer, KV head) of HBM row cache (0: none),
    /// which changes no output; its hits are counted per method.
    pub fn new(
        model_path: &std::path::Path,
        head_dim: usize,
        methods: &[String],
        params: SelectParams,
        max_tokens: usize,
        calib: Option<&fathom_eval::decode::LayerCalib>,
        row_cache: usize,
    ) -> Result<GpuEval> {
        check_gpu_methods(methods)?;
        let atts = methods
            .iter()
            .map(|m| {
                Ok(Attention {
                    method: AttendMethod::parse(m, head_dim)?,
                    params,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let gpu = Gpu::open(0).context("--device cuda needs a GPU")?;
        let weights = DenseWeights::load(model_path)?;
        // A group's roots and their forks of one method alive at once.
        let g = Self::GROUP;
        let mut dcfg = DecoderConfig::new(2 * g, max_tokens);
        dcfg.max_batch = g;
        dcfg.max_k = params.k.max(1).min(max_tokens);
        let per = max_tokens.div_ceil(dcfg.page_tokens);
        dcfg.pages = Some(g * (per + 1) + g + 8);
        dcfg.row_cache = row_cache;
        serve_methods(&mut dcfg, &atts);
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
            rows: vec![Default::default(); atts.len()],
            atts,
            row_cache,
            device: gpu.info().name.clone(),
            _gpu: gpu,
        })
    }

    /// Samples whose branches decode in one batch (bounds the pinned pages a group holds).
    pub const GROUP: usize = 20;

    /// Per method, the union rows and row-cache hits of its branches since the last call (the
    /// cache's counters around each method's batch), and zero for the next call.
    fn take_row_counters(&mut self) -> Vec<fathom_cuda::cache::RowCounters> {
        let zero = vec![Default::default(); self.rows.len()];
        std::mem::replace(&mut self.rows, zero)
    }

    /// Adds each method's row counters since the last call to `rows[method]` as one tally at
    /// this cache's size (none for a method that fetched no union, or without a row cache).
    pub fn add_row_counters(&mut self, rows: &mut [Vec<RowCacheTally>]) {
        for (acc, rc) in rows.iter_mut().zip(self.take_row_counters()) {
            if self.row_cache > 0 && rc.rows > 0 {
                acc.push(RowCacheTally::new(self.row_cache, rc.rows, rc.hits));
            }
        }
    }

    /// One method's batch through `run`: its branches, seconds and the row counters it added.
    fn counted(
        dec: &mut GpuDecoder,
        run: impl FnOnce(&mut GpuDecoder) -> Result<Vec<fathom_gpu::branch::BranchOut>>,
    ) -> Result<MethodBatch> {
        let r0 = dec.cache_mut()?.row_counters()?;
        let t = Instant::now();
        let outs = run(dec)?;
        let secs = t.elapsed().as_secs_f64();
        let r1 = dec.cache_mut()?.row_counters()?;
        let rows = fathom_cuda::cache::RowCounters {
            rows: r1.rows - r0.rows,
            hits: r1.hits - r0.hits,
        };
        Ok((outs, secs, rows))
    }

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
                    Self::counted(dec, |dec| {
                        Ok(fathom_gpu::branch::greedy(
                            dec,
                            &r,
                            att,
                            max_new,
                            stop_tokens,
                            stop,
                        )?)
                    })
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
                    Self::counted(dec, |dec| {
                        Ok(fathom_gpu::branch::forced(dec, &ids, att, f)?)
                    })
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
        ) -> Result<Vec<MethodBatch>>,
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
            for (acc, (_, _, rc)) in self.rows.iter_mut().zip(&per_method) {
                acc.rows += rc.rows;
                acc.hits += rc.hits;
            }
            for i in 0..group.len() {
                out.push(
                    per_method
                        .iter()
                        .map(|(outs, secs, _)| {
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
                // The GPU counts rows per method batch, not per branch (GpuEval::take_row_counters).
                ..Default::default()
            },
        }
    }
}

/// The downstream runs' batched backend ([`fathom_eval::ruler::run`],
/// [`fathom_eval::agent::run`]): [`GpuEval`]'s batches.
impl fathom_eval::runner::BatchedBackend for GpuEval {
    fn name(&self) -> &str {
        "GPU"
    }

    fn greedy(
        &mut self,
        prompts: &[&[u32]],
        max_new: usize,
        stop_tokens: &[u32],
        stop: &dyn Fn(&[u32]) -> bool,
    ) -> Result<fathom_eval::runner::Batched, fathom_eval::runner::BoxError> {
        let (prefill_seconds, branches) =
            self.greedy_batches(prompts, max_new, stop_tokens, stop)?;
        Ok(fathom_eval::runner::Batched {
            prefill_seconds,
            branches,
        })
    }

    fn forced(
        &mut self,
        prompts: &[&[u32]],
        forced: &[&[u32]],
    ) -> Result<fathom_eval::runner::Batched, fathom_eval::runner::BoxError> {
        let (prefill_seconds, branches) = self.forced_batches(prompts, forced)?;
        Ok(fathom_eval::runner::Batched {
            prefill_seconds,
            branches,
        })
    }

    fn add_row_counters(&mut self, rows: &mut [Vec<RowCacheTally>]) {
        GpuEval::add_row_counters(self, rows)
    }
}

/// `fathom decode-bench`: end-to-end decode throughput of a real model on the GPU.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Each session is prefilled with real prose (timed apart), then every method decodes `--steps` \
greedy tokens for the first B sessions of each `--batch`, all in one batch per step (forks of the prefilled \
sessions, so every method starts from the same caches). Weights: the pinned GGUF's, or for qwen3-8b and \
llama3.1-8b random bf16 made on the device with synthetic K/V (labelled). Needs a build with `--features cuda` \
and a GPU.\n\nExamples:\n  \
    fathom decode-bench --model qwen3-8b --context 128k,512k --batch 2,8 --methods dense,fathom:48,sparq:32\n  \
    fathom decode-bench --model qwen3-8b --context 128k --batch 4 --residency index-hbm --methods fathom:48,sparq:32\n  \
    fathom decode-bench --model smollm2-135m --context 32k --batch 1,4,16 --json decode-bench-smollm2.json\n  \
    fathom decode-bench --model gemma3-270m --context 32k,128k --batch 2,8 --methods dense,fathom:48,sparq:32"
)]
pub struct DecodeBenchArgs {
    /// Model: smollm2-135m or gemma3-270m (real weights, sessions of real prose), or the
    /// random-weight shapes qwen3-8b and llama3.1-8b (synthetic K/V; labelled in the output).
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
    /// Session contexts, cycled over the sessions (`32k`, `128k,512k`, `1m`).
    #[arg(long, value_delimiter = ',', default_value = "8k")]
    pub context: Vec<String>,
    /// Batch sizes to time.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub batch: Vec<usize>,
    /// Methods (`dense` is every record over the link; the rest go through the cache's scan).
    #[arg(long, default_value = "dense,exact,fathom:48,fathom:92,sparq:32")]
    pub methods: String,
    /// Timed decode steps per method and batch (after one untimed step).
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// Top-k per query head.
    #[arg(long, default_value_t = 256)]
    pub k: usize,
    /// Where the pages live: host (the offloaded cache), hbm (the whole cache in HBM: the
    /// in-GPU reference), or index-hbm (the index, planes and scales, in HBM; the K|V records
    /// on the host: only fetched rows cross the link).
    #[arg(long, default_value = "host", value_parser = ["host", "hbm", "index-hbm"])]
    pub residency: String,
    /// HBM row-cache slots per (session, layer, KV head).
    #[arg(long, default_value_t = 0)]
    pub row_cache: usize,
    /// Also time every method and batch with the whole step (forward, appends, attention,
    /// sampling) captured once as a CUDA graph and replayed (entries with `graph: true`; the
    /// step's host work is then the reserve, two small uploads and one launch). Models with
    /// sliding-window layers are refused.
    #[arg(long)]
    pub graph: bool,
    /// Head groups per attend (`CacheOptions::attend_groups`: the scan of group i+1 overlaps
    /// group i's top-k, row fetch and attention on a second stream; the same outputs), 1 to
    /// the model's KV heads.
    #[arg(long, default_value_t = 1)]
    pub attend_groups: usize,
    /// Plane words per global load of the scan (`CacheOptions::scan_vector_words`): 1 (8
    /// bytes) or 2 (16 bytes).
    #[arg(long = "scan-vec", default_value_t = 1)]
    pub scan_vec: u32,
    /// CPU threads of the host gather (`CacheOptions::host_gather_threads`): they copy the row
    /// fetch's missed K|V records into pinned staging the GPU reads in order; 0 (the default):
    /// the GPU reads each record from host memory itself. Needs one head group.
    #[arg(long = "host-gather", default_value_t = 0)]
    pub host_gather: usize,
    /// Percent of the misses the host gather brings while the fetch reads the rest itself,
    /// at once (`CacheOptions::host_gather_share`; 1 to 100, the default 100: all).
    #[arg(long = "host-share", default_value_t = 100)]
    pub host_share: u32,
    /// Split each attend of the stage-split steps by stage (plan, scan, top-k, union, fetch,
    /// attention; `CacheOptions::stage_timing`): a CUDA event after each stage of every plain
    /// (not graph-replayed) attend, so the timed steps carry them too; off by default.
    #[arg(long = "stage-timing")]
    pub stage_timing: bool,
    /// GPUs of this host (sessions spread over `gpus / tp` groups).
    #[arg(long, default_value_t = 1)]
    pub gpus: usize,
    /// Tensor-parallel GPUs per group (KV heads split, Megatron-style).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Write the results as JSON here (atomically).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also plot aggregate tokens/s against B, one line per method (PNG).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub cache: CacheArgs,
}

/// Checks `--gpus` / `--tp` against the model (`fathom_gpu::shard`) and describes the plan; a
/// plan over several GPUs is refused until the multi-GPU path exists (it needs NCCL and a
/// machine with several GPUs).
fn multi_gpu_plan(
    cfg: &fathom_model::Config,
    gpus: usize,
    tp: usize,
    sessions: &[usize],
) -> Result<()> {
    if gpus == 0 || tp == 0 || gpus % tp != 0 {
        bail!("--gpus {gpus} --tp {tp}: want tp ≥ 1 dividing gpus ≥ 1");
    }
    let shards = fathom_gpu::shard::tensor_parallel(cfg, tp)?;
    let groups = fathom_gpu::shard::data_parallel(sessions, gpus / tp)?;
    if gpus > 1 {
        let heads: Vec<String> = shards
            .iter()
            .map(|s| {
                format!(
                    "GPU {}: KV heads {:?}, FFN rows {:?}",
                    s.rank, s.kv_heads, s.ffn
                )
            })
            .collect();
        bail!(
            "--gpus {gpus}: several GPUs are not run yet (the tensor-parallel all-reduce needs NCCL and a multi-GPU machine); the plan would be: within each of {} groups {}; sessions per group {:?}",
            gpus / tp,
            heads.join("; "),
            groups
        );
    }
    Ok(())
}

/// Run `fathom decode-bench`.
pub fn run_decode_bench(a: DecodeBenchArgs) -> Result<()> {
    let preset = fathom_gpu::presets::preset(&a.model);
    let id: Option<ModelId> = match preset {
        Some(_) => None,
        None => Some(a.model.parse().map_err(|e| {
            anyhow::anyhow!(
                "{e} (or a random-weight shape: {})",
                fathom_gpu::presets::PRESETS.join(", ")
            )
        })?),
    };
    let contexts = a
        .context
        .iter()
        .map(|c| fathom_bench::offload::parse_context(c).map_err(anyhow::Error::from))
        .collect::<Result<Vec<usize>>>()?;
    if contexts.is_empty() || a.batch.is_empty() || a.batch.contains(&0) || a.steps == 0 {
        bail!("--context, --batch (each ≥ 1) and --steps ≥ 1 are needed");
    }
    if a.k == 0 {
        bail!("--k must be at least 1");
    }
    let names: Vec<String> = a.methods.split(',').map(|m| m.trim().to_string()).collect();
    check_gpu_methods(&names)?;
    if let Some(p) = &a.json {
        crate::check_writable(p)?;
    }
    if let Some(p) = &a.plot {
        crate::check_writable(p)?;
    }
    fathom_cuda::cache::check_scan_vector_words(a.scan_vec)
        .map_err(|e| anyhow::anyhow!("--scan-vec: {e}"))?;
    if a.host_gather > fathom_cuda::cache::MAX_GATHER_THREADS {
        bail!(
            "--host-gather {}: at most {} threads",
            a.host_gather,
            fathom_cuda::cache::MAX_GATHER_THREADS
        );
    }
    fathom_cuda::cache::check_host_gather_share(a.host_share)
        .map_err(|e| anyhow::anyhow!("--host-share: {e}"))?;
    if a.host_gather > 0 && a.attend_groups > 1 {
        bail!("--host-gather {} with --attend-groups {}: the host gather serves one fetch at a time (one head group)", a.host_gather, a.attend_groups);
    }
    if a.host_gather > 0 && a.residency == "hbm" {
        bail!("--host-gather {}: --residency hbm keeps the K|V records in HBM, there is nothing to gather on the host (host or index-hbm)", a.host_gather);
    }
    if a.attend_groups == 0 {
        bail!("--attend-groups 0: want 1 to the model's KV heads");
    }
    if let Some(c) = &preset {
        if a.attend_groups > c.n_kv_heads {
            bail!(
                "--attend-groups {}: the model has {} KV heads (a group holds at least one)",
                a.attend_groups,
                c.n_kv_heads
            );
        }
        // The shape is known: the multi-GPU plan is checked before the device is opened.
        let bmax = *a.batch.iter().max().unwrap_or(&1);
        let ctx: Vec<usize> = (0..bmax).map(|i| contexts[i % contexts.len()]).collect();
        multi_gpu_plan(c, a.gpus, a.tp, &ctx)?;
    } else if a.gpus == 0 || a.tp == 0 || a.gpus % a.tp != 0 {
        bail!(
            "--gpus {} --tp {}: want tp ≥ 1 dividing gpus ≥ 1",
            a.gpus,
            a.tp
        );
    }
    let gpu = Gpu::open(0).context("decode-bench needs a GPU")?;
    let h2d_gbps = gpu.h2d_bandwidth(256 << 20)?;
    // Real weights and text, or a preset's random weights and synthetic K/V (labelled).
    let real = match id {
        Some(id) => {
            let path = fetch_model(id, &a.cache.fetch_options())?;
            let cpu = Model::load(&path, &LoadOptions::default())
                .with_context(|| format!("loading {}", path.display()))?;
            Some((cpu, DenseWeights::load(&path)?))
        }
        None => None,
    };
    let cfg = match (&real, &preset) {
        (Some((_, w)), _) => w.config.clone(),
        (None, Some(c)) => c.clone(),
        (None, None) => bail!("no model"),
    };
    if a.attend_groups > cfg.n_kv_heads {
        bail!(
            "--attend-groups {}: the model has {} KV heads (a group holds at least one)",
            a.attend_groups,
            cfg.n_kv_heads
        );
    }
    if a.graph
        && cfg
            .layer_kinds
            .iter()
            .any(|k| *k != fathom_model::LayerKind::Global)
    {
        bail!(
            "--graph: {} has sliding-window layers, whose decode step is not captured as a graph",
            a.model
        );
    }
    let d = cfg.head_dim;
    let atts = names
        .iter()
        .map(|m| {
            Ok(Attention {
                method: AttendMethod::parse(m, d)?,
                params: SelectParams {
                    sink: 4,
                    local: 32,
                    k: a.k,
                },
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let bmax = *a.batch.iter().max().unwrap_or(&1);
    let ctx: Vec<usize> = (0..bmax).map(|i| contexts[i % contexts.len()]).collect();
    multi_gpu_plan(&cfg, a.gpus, a.tp, &ctx)?;
    let max_tokens = ctx.iter().max().copied().unwrap_or(1) + a.steps + 8;
    let mut dcfg = DecoderConfig::new(2 * bmax, max_tokens);
    dcfg.max_batch = bmax;
    dcfg.max_k = a.k.min(max_tokens);
    dcfg.row_cache = a.row_cache;
    dcfg.options = fathom_cuda::cache::CacheOptions {
        attend_groups: a.attend_groups,
        scan_vector_words: a.scan_vec,
        host_gather_threads: a.host_gather,
        host_gather_share: if a.host_gather > 0 { a.host_share } else { 100 },
        stage_timing: a.stage_timing,
        ..fathom_cuda::cache::CacheOptions::default()
    };
    dcfg.residency = fathom_cuda::Residency::parse(&a.residency)?;
    let per: usize = ctx
        .iter()
        .map(|n| (n + a.steps + 8).div_ceil(dcfg.page_tokens))
        .sum();
    dcfg.pages = Some(per + 2 * bmax + 8);
    serve_methods(&mut dcfg, &atts);
    let needs_calib = atts.iter().any(|t| {
        matches!(
            t.method,
            AttendMethod::Scan(
                fathom_cuda::Method::Fathom(_)
                    | fathom_cuda::Method::DoubleSparsity(_)
                    | fathom_cuda::Method::Loki(_)
            )
        )
    });
    let corpus = a.cache.corpus_options();
    let t0;
    let mut roots = Vec::with_capacity(bmax);
    let (mut dec, weights_label) = match &real {
        Some((cpu, weights)) => {
            let mut dec = GpuDecoder::new(&gpu, weights, dcfg)?;
            // σ² and DS channels from one held-out calibration context (as the downstream runs).
            if needs_calib {
                let docs = load_split(CorpusKind::Prose, Split::Calib, &corpus)?;
                let n = ctx.iter().min().copied().unwrap_or(1).min(8192);
                let (ids, _) = context_tokens(&docs, cpu.tokenizer(), n, 0)?;
                let cal = fathom_eval::decode::calibrate(cpu, &ids, 128)?;
                for (l, heads) in cal.heads.iter().enumerate() {
                    if !heads.is_empty() {
                        dec.cache_mut()?.load_calibration(l, heads)?;
                    }
                }
            }
            let docs = load_split(CorpusKind::Prose, Split::Eval, &corpus)?;
            t0 = Instant::now();
            for (i, &n) in ctx.iter().enumerate() {
                let (ids, _) = context_tokens(&docs, cpu.tokenizer(), n, 7 * i)?;
                let s = dec.create()?;
                let logits = dec.prefill(s, &ids)?;
                roots.push((s, fathom_model::argmax(&logits)));
            }
            (
                dec,
                "real (the pinned GGUF's weights; sessions of real prose)".to_string(),
            )
        }
        None => {
            let mut dec = GpuDecoder::random(&gpu, cfg.clone(), 7, dcfg)?;
            // The synthetic keys' exact channel variances as the calibration.
            let heads = fathom_gpu::presets::synthetic_calibration(&cfg);
            for l in 0..cfg.n_layers {
                dec.cache_mut()?.load_calibration(l, &heads)?;
            }
            t0 = Instant::now();
            for (i, &n) in ctx.iter().enumerate() {
                let s = dec.create()?;
                dec.fill_synthetic(s, n, i as u64)?;
                roots.push((s, 0u32));
            }
            let label = format!(
                "{}; K/V synthetic (uniform, keys with channel spreads 0.1 + c/D), no prefill forward",
                fathom_gpu::presets::RANDOM_WEIGHTS
            );
            (dec, label)
        }
    };
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let named: Vec<(String, Attention)> = names.iter().cloned().zip(atts.iter().copied()).collect();
    let m = fathom_gpu::throughput::measure(
        &mut dec,
        &roots,
        &named,
        &a.batch,
        a.steps,
        h2d_gbps,
        dcfg.residency,
        a.graph,
    )?;
    for e in &m.entries {
        let sp = e.split.as_ref();
        println!(
            "B={:<3} {:<12}{} {:>9.1} tok/s ({:.1} per session), step p50 {:.2} ms p99 {:.2} ms, link {:.1} MB/step = floor {:.2} ms; GPU split: weights {:.2}, attention {:.2}, appends {:.2}, sampling {:.2} ms",
            e.batch,
            e.method,
            if e.graph { " graph" } else { "" },
            e.tokens_per_s,
            e.per_session_tokens_per_s,
            e.step_ms_p50,
            e.step_ms_p99,
            e.pcie_bytes_per_step / 1e6,
            e.link_floor_ms,
            sp.map_or(f64::NAN, |x| x.weights_ms),
            sp.map_or(f64::NAN, |x| x.attention_ms),
            sp.map_or(f64::NAN, |x| x.appends_ms),
            sp.map_or(f64::NAN, |x| x.sampling_ms)
        );
        if let Some(x) = sp.filter(|x| !x.attend_ms.is_empty()) {
            let parts: Vec<String> = fathom_cuda::cache::AttendStages::NAMES
                .iter()
                .filter_map(|k| x.attend_ms.get(*k).map(|v| format!("{k} {v:.2}")))
                .collect();
            println!(
                "      attends by stage (ms per step, instrumented plain launches): {}",
                parts.join(", ")
            );
        }
        if let (Some(us), Some(rate)) = (e.host_gather_request_us, e.host_gather_mrows_per_thread_s)
        {
            println!(
                "      host gather: {us:.1} µs per request, {rate:.1} M rows/s per thread ({} threads, {} % of the misses)",
                a.host_gather, a.host_share
            );
        }
    }
    let (entries, host_bytes_per_token) = (m.entries, m.host_bytes_per_token);
    println!(
        "HBM: {:.1} GB in use, {:.1} GB of it the cache's page pools ({})",
        dec.device_bytes_in_use()? as f64 / 1e9,
        dec.cache_mut()?.pool_hbm_bytes() as f64 / 1e9,
        a.residency
    );
    // What bounds B: the memory the pages live in, at this run's bytes per token and contexts.
    let memory = if dcfg.residency == fathom_cuda::Residency::Hbm {
        Some(gpu.info().total_mem_bytes)
    } else {
        fathom_gpu::throughput::host_memory_bytes()
    };
    let capacity = match memory {
        Some(mem) => {
            let c = fathom_gpu::throughput::capacity(mem, host_bytes_per_token, &contexts)?;
            println!(
                "capacity: {:.0} GiB of {} memory × {:.0}% / {:.0} B per resident token = {} tokens: at most {} sessions of {:?} tokens (cycled)",
                mem as f64 / (1u64 << 30) as f64,
                if dcfg.residency == fathom_cuda::Residency::Hbm {
                    "GPU"
                } else {
                    "host"
                },
                100.0 * c.usable_fraction,
                host_bytes_per_token,
                c.max_resident_tokens,
                c.largest_batch,
                contexts
            );
            Some(c)
        }
        None => None,
    };
    let doc = fathom_results::decode_bench::DecodeBench {
        version: fathom_results::VERSION,
        fathom: env!("CARGO_PKG_VERSION").into(),
        command: fathom_results::command_line(),
        model: a.model.clone(),
        weights: weights_label.clone(),
        device: fathom_bench::offload::device_record(gpu.info()),
        residency: a.residency.clone(),
        steps: a.steps,
        h2d_gbps,
        host_bytes_per_token,
        device_bytes_in_use: dec.device_bytes_in_use()?,
        pool_hbm_bytes: Some(dec.cache_mut()?.pool_hbm_bytes()),
        prefill_seconds,
        entries,
        capacity,
        attend_groups: a.attend_groups,
        scan_vector_words: a.scan_vec,
        host_gather: a.host_gather,
        host_gather_share: if a.host_gather > 0 { a.host_share } else { 100 },
        cublas_math: Some(fathom_gpu::cublas_math().into()),
    };
    if let Some(out) = &a.json {
        fathom_results::write(out, doc.clone())
            .with_context(|| format!("writing {}", out.display()))?;
    }
    if let Some(p) = &a.plot {
        let pts: Vec<(String, usize, f64)> = doc
            .entries
            .iter()
            .map(|e| (e.method.clone(), e.batch, e.tokens_per_s))
            .collect();
        let title = format!(
            "{} on {}: decode tokens/s against B (pages in {}; {})",
            doc.model,
            doc.device.name,
            doc.residency,
            if doc.weights.starts_with("real") {
                "real weights"
            } else {
                "random weights"
            }
        );
        // The measurement is written already: a plot that cannot be drawn (an unwritable
        // path, say) is a warning, not a lost run.
        if let Err(e) = fathom_report::plot::tokens_vs_batch(&pts, &title, p) {
            eprintln!("warning: plot {}: {e}", p.display());
        }
    }
    Ok(())
}
