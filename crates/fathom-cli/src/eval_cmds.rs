//! Downstream evaluation subcommands (fathom-eval, docs/SPEC.md §7): `ruler` and `agent-steps`.
//!
//! Wiring in `main.rs`:
//!
//! ```text
//! mod eval_cmds;
//! Ruler(eval_cmds::RulerArgs)           => eval_cmds::run_ruler(a)
//! AgentSteps(eval_cmds::AgentStepsArgs) => eval_cmds::run_agent_steps(a)
//! ```

use std::path::PathBuf;
use std::time::Instant;

use fathom_cuda::prelude::*;

use anyhow::{bail, Context, Result};
use fathom_eval::agent::{AgentPlan, SessionRun};
use fathom_eval::decode::{calibrate, default_k, LayerCalib};
use fathom_eval::ruler::{
    ChatTurn, Haystack, PromptFormat, RulerPlan, SampleRun, Task, TaskParams,
};
use fathom_eval::runner::{BatchedBackend, BoxError, Branching, Progress};
use fathom_eval::words::WordList;
use fathom_model::corpus::{
    context_tokens, documents_from_file, fetch_corpus, load_split, CorpusKind, CorpusOptions,
    Document, Split,
};
use fathom_model::fetch::{fetch_model, FetchOptions, ModelId};
use fathom_model::{LoadOptions, Model};
use fathom_plan::scanner::Scanner;
use fathom_plan::SelectParams;
use fathom_results::downstream::{
    AgentDoc, AgentRecord, AgentSummary, CalibrationInfo, RowCacheTally, RulerDoc, RulerRecord,
    RunHeader, SelectRecord, TaskScore, TaskSummary, ROW_CACHE_MEASURED, ROW_CACHE_MODELLED,
};
use fathom_store::write_atomic;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::collections::BTreeMap;

use crate::methods::{parse_methods, BasisArg};

const DEFAULT_METHODS: &str =
    "dense,exact,fathom:48,fathom:64,fathom:92,sparq:16,sparq:32,ds:32,loki:32,thumb2,landmark";

/// Options shared by both subcommands.
#[derive(clap::Args, Debug, Clone)]
pub struct EvalCommon {
    /// Model: smollm2-135m or gemma3-270m.
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
    /// Context length in tokens.
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    /// Methods (as `fathom fidelity`); `dense` and `exact` are added when absent. A Fathom
    /// budget may be given per channel, `fathom:0.375c` = 0.375·D bits (24 at D = 64, 96 at
    /// D = 256). The budget rule (docs/SPEC.md §4, §7): at least 0.36 bits per channel, the
    /// smallest at parity with exact top-k on every judged setting; `fathom:0.375c` meets it.
    #[arg(long, default_value = DEFAULT_METHODS)]
    pub methods: String,
    /// Top-k per query head (default: 128 below 16k, 256 below 32k, else 512).
    #[arg(long)]
    pub k: Option<usize>,
    /// Store basis of the Fathom methods.
    #[arg(long, value_enum, default_value_t = BasisArg::Raw)]
    pub basis: BasisArg,
    /// Calibration queries: the last this many positions of the calibration document.
    #[arg(long, default_value_t = 128)]
    pub calib_queries: usize,
    /// Base seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write every per-sample result here (atomically).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Cache directory (default: `$FATHOM_CACHE`, else `~/.cache/fathom`; on Windows
    /// `%LOCALAPPDATA%\fathom`).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Never download; use only what is cached.
    #[arg(long)]
    pub offline: bool,
    /// Where the model decodes: `cpu` (fathom-model's runtime and the CPU scanners) or `cuda`
    /// (fathom-gpu: bf16 weights on the GPU, every method through the offloaded paged cache;
    /// needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// With `--device cuda`: HBM row-cache slots per (session, layer, KV head), whose hits on
    /// every method's decode steps the summary reports (0, the default: no row cache; it never
    /// changes an output, and it takes 40 sessions × layers × KV heads × slots × (4·D + 8)
    /// bytes of HBM, 8 GB for SmolLM2-135M at 8192). On the CPU the hits are modelled at 64,
    /// 256, 1024 and 8192 slots instead.
    #[arg(long, default_value_t = 0)]
    pub row_cache: usize,
    /// Weights of the CPU runtime: `auto` (llama.cpp-like: k-quants kept, 8-bit activations),
    /// `f32` (every weight dequantized) or `bf16` (the GPU forward's roundings, for comparing
    /// `--device cpu` with `--device cuda` on the same numerics). Calibration always uses it.
    #[arg(long, default_value = "auto", value_parser = ["auto", "f32", "bf16"])]
    pub cpu_weights: String,
    /// Your own text instead of the pinned corpus's eval split: the haystack for `ruler`, the
    /// code for `agent-steps`. Plain text, or JSONL with a string field `text` per line
    /// (`.jsonl`). Calibration still uses the pinned corpus's calib split.
    #[arg(long)]
    pub text: Option<PathBuf>,
}

/// `fathom ruler`: RULER-style tasks with branched sparse decoding.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom ruler --model smollm2-135m --context 4096 --samples 5 --json ruler.json\n  \
    fathom ruler --model gemma3-270m --context 8192 --k 256 --prompt chat --shape small --samples 20 --tasks niah_single,niah_multikey --methods dense,exact,fathom:48,sparq:32 --json ruler.json\n  \
    fathom ruler --model gemma3-270m --context 32768 --k 512 --prompt chat --shape small,needle=passkey --samples 20 --device cuda --json ruler.json   # a cuda build")]
pub struct RulerArgs {
    #[command(flatten)]
    pub common: EvalCommon,
    /// Tasks.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,fwe"
    )]
    pub tasks: Vec<String>,
    /// Samples per task.
    #[arg(long, default_value_t = 20)]
    pub samples: usize,
    /// Tokens to generate (and to reserve when sizing); default RULER's per task (128, vt 30, fwe 50).
    #[arg(long)]
    pub max_new: Option<usize>,
    /// Keep generating past the end of the answer, to a stop token or `--max-new` (RULER's
    /// rule). By default a branch stops at the answer's end: the first newline after
    /// alphanumeric output for a task of one value, the first blank line after it for a task
    /// of several (a list, one value per line).
    #[arg(long)]
    pub no_line_stop: bool,
    /// Prompt wording around RULER's structure: `ruler` (its templates verbatim) or `chat`
    /// (the task inside the model's chat turn, the answer prefix opening the reply, and the
    /// singular "number … is" when one value is asked for).
    #[arg(long, default_value = "ruler", value_parser = ["ruler", "chat"])]
    pub prompt: String,
    /// How much each task plants: `ruler` (4 keys, 4 values, a chain of 5, 7-digit values) or
    /// `small` (2 keys, 2 values, a chain of 2, for 100M-parameter models), optionally followed
    /// by overrides: `keys=K`, `values=V`, `chain=C`, `digits=D`, `needle=magic|passkey` (the
    /// needle worded as a numeric pass key stated twice) and `answer=ruler|lines` (a task of
    /// several values: the answer prefix opens a list of lines worded as the needle); the
    /// templates and scoring stay RULER's. Example:
    /// `fathom ruler --model smollm2-135m --context 8192 --prompt chat --shape small --samples 20`.
    #[arg(long, default_value = "ruler")]
    pub shape: String,
    /// The haystack's words: `docs` (the prose corpus as written: documentation with its
    /// markup and code names), `prose` (only the words that read as running prose, closer
    /// to RULER's essays; small models otherwise answer with a code name they read) or
    /// `noise` (the NIAH tasks read RULER's line of noise repeated, the haystack of RULER's
    /// `niah_single_1`, instead of real text; `vt` has its own `--vt-haystack`). Example:
    /// `fathom ruler --model smollm2-135m --context 8192 --prompt chat --haystack noise`.
    #[arg(long, default_value = "docs", value_parser = ["docs", "prose", "noise"])]
    pub haystack: String,
    /// Leave out `vt`'s in-context example (RULER prepends one by default: the same task over
    /// a few hundred tokens with its answer), as runs before it was added did.
    #[arg(long)]
    pub no_vt_example: bool,
    /// `vt`'s haystack: `noise` (RULER's, its one line of noise repeated: RULER's variable
    /// tracking has no other) or `text` (the run's real-text haystack, as the NIAH tasks read
    /// and as runs before this option did). Example: `fathom ruler --model smollm2-135m
    /// --context 8192 --tasks vt --vt-haystack text`.
    #[arg(long, default_value = "noise", value_parser = ["noise", "text"])]
    pub vt_haystack: String,
    /// The base seed of the probes that chose `--shape` and `--haystack` (recorded in the JSON
    /// as `tuning`; docs/SPEC.md §7). Refused when any of its samples' seeds is one of this
    /// run's: the evaluation must be on fresh seeds. Example: `fathom ruler … --seed 2
    /// --tuning-seed 1 --tuning-samples 5`.
    #[arg(long)]
    pub tuning_seed: Option<u64>,
    /// Samples per task of those probes.
    #[arg(long, default_value_t = 5, requires = "tuning_seed")]
    pub tuning_samples: usize,
}

/// The tuning record of a run, refused where a tuning sample's seed is an evaluation sample's
/// (`fathom_eval::ruler::sample_seed`).
fn tuning(a: &RulerArgs, tasks: &[Task]) -> Result<Option<fathom_results::downstream::Tuning>> {
    let Some(seed) = a.tuning_seed else {
        return Ok(None);
    };
    use fathom_eval::ruler::sample_seed;
    for &t in tasks {
        let tuned: std::collections::HashSet<u64> = (0..a.tuning_samples)
            .map(|i| sample_seed(seed, t, i))
            .collect();
        if let Some(i) = (0..a.samples).find(|&i| tuned.contains(&sample_seed(a.common.seed, t, i)))
        {
            bail!(
                "--tuning-seed {seed}: sample {i} of {} at --seed {} was also a tuning sample; evaluate on fresh seeds",
                t.name(),
                a.common.seed
            );
        }
    }
    Ok(Some(fathom_results::downstream::Tuning {
        seed,
        samples_per_task: a.tuning_samples,
        chose: format!("--shape {} --haystack {}", a.shape, a.haystack),
    }))
}

/// `fathom agent-steps`: teacher-forced step agreement on agent-transcript coding contexts.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom agent-steps --model smollm2-135m --context 8192 --sessions 3 --steps 32 --json agent.json\n  \
    fathom agent-steps --model gemma3-270m --context 32768 --k 512 --sessions 16 --steps 64 --device cuda --row-cache 8192 --json agent.json   # a cuda build")]
pub struct AgentStepsArgs {
    #[command(flatten)]
    pub common: EvalCommon,
    /// Sessions.
    #[arg(long, default_value_t = 8)]
    pub sessions: usize,
    /// Teacher-forced steps per session.
    #[arg(long, default_value_t = 64)]
    pub steps: usize,
}

struct Setup {
    model: Model,
    path: PathBuf,
    model_id: ModelId,
    methods: Vec<Box<dyn Scanner>>,
    params: SelectParams,
    corpus: CorpusOptions,
    load_s: f64,
}

fn setup(c: &EvalCommon) -> Result<Setup> {
    let t0 = Instant::now();
    let id: ModelId = c.model.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
    // Arguments first: a bad one fails in milliseconds, not after the model loads.
    let k = c.k.unwrap_or_else(|| default_k(c.context));
    if c.context < 4 + 32 + 1 {
        bail!(
            "--context {} is shorter than sink + local = 36 (+1 query)",
            c.context
        );
    }
    if k == 0 || k > c.context {
        bail!("--k {k} is out of range 1..={} (the context)", c.context);
    }
    if let Some(p) = &c.json {
        crate::check_writable(p)?;
    }
    if c.device == "cuda" {
        let names: Vec<String> = c.methods.split(',').map(|m| m.trim().to_string()).collect();
        crate::gpu_cmds::check_gpu_methods(&names)?;
        // The GPU before the model, the calibration and the CPU work that precede its use.
        fathom_cuda::Gpu::open(0).context("--device cuda needs a GPU")?;
    }
    let fopts = FetchOptions {
        cache_dir: c.cache_dir.clone(),
        offline: c.offline,
        ..Default::default()
    };
    let path = fetch_model(id, &fopts).with_context(|| format!("fetching {id}"))?;
    let weights = match c.cpu_weights.as_str() {
        "f32" => fathom_model::WeightMode::Dequantized,
        "bf16" => fathom_model::WeightMode::Bf16,
        _ => fathom_model::WeightMode::Auto,
    };
    let model = Model::load(&path, &LoadOptions { weights })
        .with_context(|| format!("loading {}", path.display()))?;
    let d = model.config().head_dim;
    let mut list = c.methods.clone();
    for must in ["exact", "dense"] {
        if !list.split(',').any(|m| m.trim() == must) {
            list = format!("{must},{list}");
        }
    }
    let methods = parse_methods(&list, d, c.basis, None)?;
    if c.device == "cuda" && !matches!(c.basis, BasisArg::Raw) {
        bail!("--device cuda stores raw channels: use --basis raw");
    }
    Ok(Setup {
        model,
        path,
        model_id: id,
        methods,
        params: SelectParams {
            sink: 4,
            local: 32,
            k,
        },
        corpus: CorpusOptions {
            cache_dir: c.cache_dir.clone(),
            offline: c.offline,
            ..Default::default()
        },
        load_s: t0.elapsed().as_secs_f64(),
    })
}

/// The evaluation text: the user's `--text` file, else the pinned corpus's eval split; with a
/// description for the results.
fn eval_documents(
    c: &EvalCommon,
    kind: CorpusKind,
    corpus: &CorpusOptions,
) -> Result<(Vec<Document>, String)> {
    match &c.text {
        Some(p) => Ok((
            documents_from_file(p)?,
            format!("user text {}", p.display()),
        )),
        None => {
            let docs = load_split(kind, Split::Eval, corpus)
                .with_context(|| format!("loading the {} corpus", kind.name()))?;
            let m = fetch_corpus(kind, corpus)?;
            Ok((
                docs,
                format!(
                    "{} corpus, eval split, {} {}",
                    kind.name(),
                    m.source,
                    m.selection
                ),
            ))
        }
    }
}

fn needs_calib(methods: &[Box<dyn Scanner>]) -> bool {
    // A scanner outside the fixed-rule grammar (Fathom) needs σ².
    methods
        .iter()
        .any(|m| m.spec().is_none_or(|s| s.needs_calibration()))
}

fn calibration(
    s: &Setup,
    kind: CorpusKind,
    context: usize,
    queries: usize,
) -> Result<(Option<LayerCalib>, Option<CalibrationInfo>)> {
    if !needs_calib(&s.methods) {
        return Ok((None, None));
    }
    let t0 = Instant::now();
    let docs =
        load_split(kind, Split::Calib, &s.corpus).context("loading the calibration split")?;
    let (ids, used) = context_tokens(&docs, s.model.tokenizer(), context, 0)?;
    let cal = calibrate(&s.model, &ids, queries)?;
    let info = CalibrationInfo {
        corpus: kind.name().into(),
        split: "calib".into(),
        tokens: ids.len(),
        documents: used,
        queries,
        seconds: t0.elapsed().as_secs_f64(),
        what: "sigma2, KLT, Loki PCA basis and DS channels per global (layer, KV head) from the keys of one held-out calibration context and the queries of its last positions".into(),
    };
    Ok((Some(cal), Some(info)))
}

fn bar(total: u64) -> ProgressBar {
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg} (eta {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

fn write_json(path: &Option<PathBuf>, doc: fathom_results::Document) -> Result<()> {
    if let Some(p) = path {
        fathom_results::write(p, doc)?;
        eprintln!("wrote {}", p.display());
        let mut q = p.clone().into_os_string();
        q.push(".partial");
        let _ = std::fs::remove_file(q);
    }
    Ok(())
}

/// The results so far, next to the final file (`OUT.partial`), so an interrupted run keeps them.
fn partial<T: serde::Serialize>(path: &Option<PathBuf>, records: &[T]) -> Result<()> {
    if let Some(p) = path {
        let mut q = p.clone().into_os_string();
        q.push(".partial");
        let bytes = serde_json::to_vec(&json!({"complete": false, "results": records}))?;
        write_atomic(std::path::Path::new(&q), &bytes).context("writing partial results")?;
    }
    Ok(())
}

/// What the run's row-cache tallies count: the GPU cache's counters, or on the CPU the
/// reference model over each branch's unions (`None`: a GPU run without a row cache).
fn row_cache_source(gpu: Option<&crate::gpu_cmds::GpuEval>) -> Option<String> {
    match gpu {
        Some(g) if g.row_cache == 0 => None,
        Some(_) => Some(ROW_CACHE_MEASURED.into()),
        None => Some(ROW_CACHE_MODELLED.into()),
    }
}

/// The row-cache hit rate of each method with a union, one column per size (the report's
/// table).
fn print_row_cache(names: &[String], tallies: &[Vec<RowCacheTally>], source: Option<String>) {
    let rows: Vec<(&String, Vec<RowCacheTally>)> =
        names.iter().zip(tallies.iter().cloned()).collect();
    let t = source.map(|src| fathom_report::tables::row_cache_table(&src, &rows));
    if let Some(t) = t.filter(|t| !t.is_empty()) {
        print!("\n{t}");
    }
}

fn header(
    s: &Setup,
    c: &EvalCommon,
    calibration: Option<CalibrationInfo>,
    seconds: f64,
    gpu: Option<&crate::gpu_cmds::GpuEval>,
) -> RunHeader {
    let cfg = s.model.config();
    RunHeader {
        version: fathom_results::VERSION,
        fathom: env!("CARGO_PKG_VERSION").into(),
        command: fathom_results::command_line(),
        model: s.model_id.name().into(),
        layers: cfg.n_layers,
        global_layers: cfg
            .layer_kinds
            .iter()
            .filter(|k| **k == fathom_model::LayerKind::Global)
            .count(),
        layer_kinds: cfg.layer_kinds.iter().map(|k| k.to_string()).collect(),
        hq: cfg.n_heads,
        hkv: cfg.n_kv_heads,
        d: cfg.head_dim,
        context: c.context,
        select: SelectRecord {
            sink: s.params.sink,
            local: s.params.local,
            k: s.params.k,
        },
        methods: s.methods.iter().map(|m| m.name()).collect(),
        seed: c.seed,
        device: match gpu {
            Some(g) => g.device.clone(),
            None => format!("cpu ({} threads)", rayon::current_num_threads()),
        },
        protocol: match gpu {
            None => "one dense prefill per sample; per method a greedy (or teacher-forced) decode from a clone of its KV cache with the method's sink 4 + local 32 + top-k per query head and exact attention on every generated token of every global layer; sliding-window layers keep their window and stay dense".into(),
            Some(_) => "on the GPU (fathom-gpu: bf16 weights, cuBLAS, K|V in fathom-cuda's paged cache in host memory): one dense prefill per sample; per method a greedy (or teacher-forced) decode from a fork of its session with the method's sink 4 + local 32 + top-k per query head and exact attention on every generated token of every global layer, planned, scanned and selected on the GPU; sliding-window layers attend densely over their window".into(),
        },
        load_seconds: s.load_s,
        calibration,
        seconds,
        cublas_math: gpu.map(|_| fathom_gpu::cublas_math().into()),
    }
}

/// The CLI's progress on the run's bar: its message, its position, and with the bar hidden one
/// line per sample (`line`); each record also goes to `OUT.partial` (`to_record`).
fn on_progress<'a, R: 'a, T: serde::Serialize + 'a>(
    pb: &'a ProgressBar,
    json: &'a Option<PathBuf>,
    line: impl Fn(&R) -> String + 'a,
    to_record: impl Fn(&R) -> Result<T> + 'a,
) -> impl FnMut(Progress<'_, R>) -> Result<(), BoxError> + 'a {
    let mut records = Vec::new();
    move |p| {
        match p {
            Progress::Working(m) => pb.set_message(m),
            Progress::Branches(n) => pb.inc(n),
            Progress::Done(r) => {
                if pb.is_hidden() {
                    eprintln!("{}", line(r));
                }
                records.push(to_record(r)?);
                partial(json, &records)?;
            }
        }
        Ok(())
    }
}

/// A sample's record in the `ruler` document.
fn ruler_record(r: &SampleRun) -> Result<RulerRecord> {
    Ok(RulerRecord {
        sample: serde_json::to_value(&r.sample)?,
        prefill_seconds: r.prefill_seconds,
        seconds: r.seconds,
        methods: r
            .methods
            .iter()
            .map(|m| (m.method.clone(), m.result.clone()))
            .collect(),
    })
}

/// A session's record in the `agent-steps` document.
fn agent_record(r: &SessionRun) -> Result<AgentRecord> {
    Ok(AgentRecord {
        session: serde_json::to_value(&r.session)?,
        continuation: r.session.continuation.clone(),
        prefill_seconds: r.prefill_seconds,
        seconds: r.seconds,
        methods: r
            .methods
            .iter()
            .map(|m| (m.method.clone(), m.result.clone()))
            .collect(),
    })
}

/// Runs `fathom ruler`: [`fathom_eval::ruler::run`].
pub fn run_ruler(a: RulerArgs) -> Result<()> {
    let t_all = Instant::now();
    let c = &a.common;
    // Arguments first: a bad one fails before the model loads.
    let shape = fathom_eval::ruler::TaskShape::parse(&a.shape)?;
    let s = setup(c)?;
    let tasks: Vec<Task> = a
        .tasks
        .iter()
        .map(|t| t.trim().parse::<Task>().map_err(|e| anyhow::anyhow!("{e}")))
        .collect::<Result<_>>()?;
    if tasks.is_empty() || a.samples == 0 {
        bail!("nothing to run: give --tasks and --samples ≥ 1");
    }
    let tuning = tuning(&a, &tasks)?;
    let (docs, source) = eval_documents(c, CorpusKind::Prose, &s.corpus)?;
    let mut haystack = Haystack::new(docs.iter().map(|d| d.text.as_str()), &source)?;
    if a.haystack == "prose" {
        haystack = haystack.prose_only()?;
    }
    let words = WordList::fetch(&s.corpus).context("fetching the RULER key word list")?;
    let (calib, calib_info) = calibration(&s, CorpusKind::Prose, c.context, c.calib_queries)?;
    let format = match a.prompt.as_str() {
        "chat" => {
            PromptFormat::Chat(ChatTurn::for_model(s.model_id.name()).with_context(|| {
                format!(
                    "--prompt chat: no chat turn is known for {}",
                    s.model_id.name()
                )
            })?)
        }
        _ => PromptFormat::Ruler,
    };
    let tp = TaskParams {
        context: c.context,
        tokens_to_generate: a.max_new,
        seed: c.seed,
        format,
        shape,
        vt_example: !a.no_vt_example,
        vt_noise: a.vt_haystack == "noise",
        niah_noise: a.haystack == "noise",
    };
    let nm = s.methods.len();
    let names: Vec<String> = s.methods.iter().map(|m| m.name()).collect();
    let pb = bar((tasks.len() * a.samples * nm) as u64);
    let mut gpu = match c.device.as_str() {
        "cuda" => Some(crate::gpu_cmds::GpuEval::new(
            &s.path,
            s.model.config().head_dim,
            &names,
            s.params,
            c.context + a.max_new.unwrap_or(128).max(128) + 64,
            calib.as_ref(),
            c.row_cache,
        )?),
        _ => None,
    };
    let plan = RulerPlan {
        tasks: &tasks,
        samples: a.samples,
        params: &tp,
        haystack: &haystack,
        words: &words,
        line_stop: !a.no_line_stop,
    };
    let line = |r: &SampleRun| {
        let scores: Vec<String> = r
            .methods
            .iter()
            .map(|m| format!("{} {:.2}", m.method, m.result.score))
            .collect();
        format!(
            "{} #{}: {} tokens, prefill {:.0} s, total {:.0} s; {}",
            r.sample.task.name(),
            r.sample.index,
            r.sample.prompt_tokens,
            r.prefill_seconds,
            r.seconds,
            scores.join(", ")
        )
    };
    let run = fathom_eval::ruler::run(
        branching(&s, calib.as_ref()),
        &plan,
        gpu.as_mut().map(|g| g as &mut dyn BatchedBackend),
        &mut on_progress(&pb, &c.json, line, ruler_record),
    )?;
    pb.finish_and_clear();
    // Markdown table: task × method.
    println!(
        "RULER-style, {} at {} tokens, k = {}, {} samples per task (score = mean fraction of gold strings found; `a/b` after a score: samples whose generation equals exact top-k's)\n",
        s.model_id, c.context, s.params.k, a.samples
    );
    println!("| task | {} |", names.join(" | "));
    println!("|---|{}", "---|".repeat(nm));
    let mut summary = BTreeMap::new();
    for t in &run.tasks {
        let cells: Vec<String> = t
            .methods
            .iter()
            .map(|m| format!("{:.3} ({}/{})", m.score, m.same_as_exact, a.samples))
            .collect();
        println!("| {} | {} |", t.task.name(), cells.join(" | "));
        let row: BTreeMap<String, TaskScore> = t
            .methods
            .iter()
            .map(|m| {
                (
                    m.method.clone(),
                    TaskScore {
                        score: m.score,
                        same_as_exact: m.same_as_exact,
                        mean_bits: m.mean_bits,
                        row_cache: m.row_cache.clone(),
                    },
                )
            })
            .collect();
        summary.insert(
            t.task.name().to_string(),
            TaskSummary {
                methods: row,
                seconds: t.seconds,
            },
        );
    }
    let mean_cells: Vec<String> = (0..nm)
        .map(|mi| format!("{:.3}", run.mean_score(mi)))
        .collect();
    println!("| **mean** | {} |", mean_cells.join(" | "));
    let over_tasks: Vec<Vec<RowCacheTally>> = (0..nm).map(|mi| run.row_cache(mi)).collect();
    print_row_cache(&names, &over_tasks, row_cache_source(gpu.as_ref()));
    let total = t_all.elapsed().as_secs_f64();
    println!("\nwall time {total:.0} s");
    let doc = RulerDoc {
        header: header(&s, c, calib_info, total, gpu.as_ref()),
        tasks: tasks.iter().map(|t| t.name().to_string()).collect(),
        samples_per_task: a.samples,
        line_stop: !a.no_line_stop,
        stop: (!a.no_line_stop).then(|| "answer".to_string()),
        prompt: Some(a.prompt.clone()),
        shape: Some(shape.label()),
        vt_example: Some(!a.no_vt_example),
        vt_haystack: Some(a.vt_haystack.clone()),
        niah_haystack: Some(
            if a.haystack == "noise" {
                "noise"
            } else {
                "text"
            }
            .to_string(),
        ),
        haystack: haystack.source.clone(),
        words: Some(words.source.clone()),
        row_cache_source: row_cache_source(gpu.as_ref()),
        tuning,
        summary,
        results: run
            .records
            .iter()
            .map(ruler_record)
            .collect::<Result<_>>()?,
    };
    write_json(&c.json, doc.into())
}

/// What the library runs branch over: the setup's model, methods and selection rule.
fn branching<'a>(s: &'a Setup, calib: Option<&'a LayerCalib>) -> Branching<'a> {
    Branching {
        model: &s.model,
        methods: &s.methods,
        calib,
        params: s.params,
    }
}

/// Runs `fathom agent-steps`: [`fathom_eval::agent::run`].
pub fn run_agent_steps(a: AgentStepsArgs) -> Result<()> {
    let t_all = Instant::now();
    let c = &a.common;
    let s = setup(c)?;
    if a.sessions == 0 || a.steps == 0 {
        bail!("nothing to run: give --sessions and --steps ≥ 1");
    }
    let (docs, source) = eval_documents(c, CorpusKind::Code, &s.corpus)?;
    let (calib, calib_info) = calibration(&s, CorpusKind::Code, c.context, c.calib_queries)?;
    let nm = s.methods.len();
    let names: Vec<String> = s.methods.iter().map(|m| m.name()).collect();
    let pb = bar((a.sessions * nm) as u64);
    let mut gpu = match c.device.as_str() {
        "cuda" => Some(crate::gpu_cmds::GpuEval::new(
            &s.path,
            s.model.config().head_dim,
            &names,
            s.params,
            c.context + a.steps + 64,
            calib.as_ref(),
            c.row_cache,
        )?),
        _ => None,
    };
    let plan = AgentPlan {
        docs: &docs,
        context: c.context,
        steps: a.steps,
        seed: c.seed,
        sessions: a.sessions,
    };
    let line = |r: &SessionRun| {
        format!(
            "session {}: {} tokens, prefill {:.1} s",
            r.session.index, r.session.prompt_tokens, r.prefill_seconds
        )
    };
    let run = fathom_eval::agent::run(
        branching(&s, calib.as_ref()),
        &plan,
        gpu.as_mut().map(|g| g as &mut dyn BatchedBackend),
        &mut on_progress(&pb, &c.json, line, agent_record),
    )?;
    pb.finish_and_clear();
    println!(
        "Agent-session step agreement, {} at {} tokens, k = {}, {} sessions × {} teacher-forced steps\n",
        s.model_id, c.context, s.params.k, a.sessions, a.steps
    );
    println!("| method | bits | agree w/ exact | agree w/ dense | top-1 vs truth |");
    println!("|---|---|---|---|---|");
    let mut summary = BTreeMap::new();
    for m in &run.summary {
        println!(
            "| {} | {:.1} | {:.4} | {:.4} | {:.4} |",
            m.method, m.mean_bits, m.agree_exact, m.agree_dense, m.top1_vs_truth
        );
        summary.insert(
            m.method.clone(),
            AgentSummary {
                agree_exact: m.agree_exact,
                agree_dense: m.agree_dense,
                top1_vs_truth: m.top1_vs_truth,
                mean_bits: m.mean_bits,
                row_cache: m.row_cache.clone(),
            },
        );
    }
    let tallies: Vec<Vec<RowCacheTally>> =
        names.iter().map(|m| summary[m].row_cache.clone()).collect();
    print_row_cache(&names, &tallies, row_cache_source(gpu.as_ref()));
    let total = t_all.elapsed().as_secs_f64();
    println!("\nwall time {total:.0} s");
    let doc = AgentDoc {
        header: header(&s, c, calib_info, total, gpu.as_ref()),
        sessions: a.sessions,
        steps: a.steps,
        code: Some(source),
        row_cache_source: row_cache_source(gpu.as_ref()),
        summary,
        results: run
            .records
            .iter()
            .map(agent_record)
            .collect::<Result<_>>()?,
    };
    write_json(&c.json, doc.into())
}
