//! `cargo xtask`: drives `cargo` and the `fathom` CLI; never reimplements them.
//!
//! - `cargo xtask repro [--quick | --full] [--gpu] [--device cpu|cuda] [--out DIR] [--budget-min M]`: the whole
//!   pipeline (models, corpora, captures, calibration, fidelity sweeps, ablations, the model
//!   speed table, downstream tasks, device timing when asked and possible) and
//!   `DIR/REPORT.md` (default `results/`). With `--budget-min`, stages that would overrun the
//!   budget are skipped and the report says which; downstream stages come last. A capture
//!   whose `.cmd` sidecar matches its command is reused.
//! - `cargo xtask fetch-models`, `cargo xtask fetch-corpus`: through the CLI.
//! - `cargo xtask fuzz [--seconds N] [--target T]`: runs each `cargo fuzz` target under `fuzz/`
//!   for N seconds (default 600) and prints the executions and crashes (docs/RELIABILITY.md).
//! - `cargo xtask stress [--seconds N]`: the 16-session append/scan stress test in release for
//!   N seconds (default 600).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use fathom_results::stages::StageRecord;

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("xtask: error: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace")
        .to_path_buf()
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn build_cli(features: &[&str]) -> Result<PathBuf> {
    let mut c = cargo();
    c.args(["build", "--release", "-p", "fathom-cli"]);
    if !features.is_empty() {
        c.args(["--features", &features.join(",")]);
    }
    let st = c.status().context("running cargo build")?;
    if !st.success() {
        bail!("cargo build --release -p fathom-cli failed");
    }
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root().join("target"), PathBuf::from);
    Ok(target.join("release/fathom"))
}

/// One stage: a `fathom` command line, its name and a rough duration estimate (s).
struct Stage {
    name: String,
    args: Vec<String>,
    estimate: f64,
}

fn stage(name: &str, estimate: f64, args: &[&str]) -> Stage {
    Stage {
        name: name.into(),
        args: args.iter().map(|s| s.to_string()).collect(),
        estimate,
    }
}

/// A stage from one command line (arguments split on whitespace; none of the pipeline's
/// arguments contain spaces).
fn stage_cmd(name: &str, estimate: f64, cmd: &str) -> Stage {
    Stage {
        name: name.into(),
        args: cmd.split_whitespace().map(String::from).collect(),
        estimate,
    }
}

/// The files a stage reads that an earlier stage writes (`--capture X`, `--calib X`).
fn stage_inputs(args: &[String]) -> Vec<PathBuf> {
    args.windows(2)
        .filter(|w| w[0] == "--capture" || w[0] == "--calib")
        .map(|w| root().join(&w[1]))
        .collect()
}

/// The output of a `capture` stage, whose sidecar `OUT.cmd` records the command that wrote
/// it: a rerun with the same command reuses the file.
fn capture_output(args: &[String]) -> Option<PathBuf> {
    if args.first().map(String::as_str) != Some("capture") {
        return None;
    }
    args.windows(2)
        .find(|w| w[0] == "--out")
        .map(|w| root().join(&w[1]))
}

fn sidecar(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".cmd");
    PathBuf::from(s)
}

/// Runs every stage; a failing stage is logged and the rest continue. With a `budget`
/// (seconds), a stage whose estimate would overrun it is skipped and logged as such; a stage
/// whose input an earlier stage did not produce is skipped too. Skips are not failures.
fn run_stages(bin: &Path, stages: &[Stage], log: &Path, budget: Option<f64>) -> Result<bool> {
    let mut f =
        std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let total: f64 = stages.iter().map(|s| s.estimate).sum();
    let t0 = Instant::now();
    let mut done_est = 0.0;
    let mut all_ok = true;
    for (i, s) in stages.iter().enumerate() {
        let el = t0.elapsed().as_secs_f64();
        let eta = if done_est > 0.0 {
            (total - done_est) * el / done_est
        } else {
            total
        };
        let cmd = format!("fathom {}", s.args.join(" "));
        let log_line = |f: &mut std::fs::File, ok: bool, secs: f64, err: &str, skipped: &str| {
            let rec = StageRecord {
                version: fathom_results::VERSION,
                stage: s.name.clone(),
                ok,
                seconds: (secs * 100.0).round() / 100.0,
                command: cmd.clone(),
                error: err.into(),
                skipped: skipped.into(),
            };
            writeln!(f, "{}", rec.to_line())
        };
        done_est += s.estimate;
        // A stage is skipped (not failed) when it would overrun the budget or an earlier
        // stage did not produce its input.
        let skip = match (
            budget,
            stage_inputs(&s.args).into_iter().find(|p| !p.exists()),
        ) {
            (Some(b), _) if el + s.estimate > b => Some(format!(
                "time budget: {:.0} s used, this stage's estimate is {:.0} s, the budget {:.0} s",
                el, s.estimate, b
            )),
            (_, Some(missing)) => Some(format!(
                "input {} is missing (the stage that writes it was skipped or failed)",
                missing.display()
            )),
            _ => None,
        };
        if let Some(why) = skip {
            eprintln!(
                "xtask: [{}/{}] {} SKIPPED ({why})",
                i + 1,
                stages.len(),
                s.name
            );
            log_line(&mut f, true, 0.0, "", &why)?;
            continue;
        }
        if let Some(out) = capture_output(&s.args) {
            let same = std::fs::read_to_string(sidecar(&out)).is_ok_and(|c| c.trim() == cmd);
            if same && out.exists() {
                eprintln!(
                    "xtask: [{}/{}] {} — reusing {} (written by the same command)",
                    i + 1,
                    stages.len(),
                    s.name,
                    out.display()
                );
                log_line(
                    &mut f,
                    true,
                    0.0,
                    "",
                    "cached: the same command wrote this capture before",
                )?;
                continue;
            }
        }
        eprintln!(
            "xtask: [{}/{}] {} — elapsed {:.0}s, ETA ~{:.0}s\n        {cmd}",
            i + 1,
            stages.len(),
            s.name,
            el,
            eta,
        );
        let ts = Instant::now();
        let out = Command::new(bin).args(&s.args).current_dir(root()).status();
        let secs = ts.elapsed().as_secs_f64();
        let (ok, err) = match out {
            Ok(st) if st.success() => (true, String::new()),
            Ok(st) => (false, format!("exit status {st}")),
            Err(e) => (false, e.to_string()),
        };
        if !ok {
            eprintln!("xtask: stage {} FAILED ({err}); continuing", s.name);
            all_ok = false;
        } else if let Some(out) = capture_output(&s.args) {
            std::fs::write(sidecar(&out), &cmd)
                .with_context(|| format!("writing {}", sidecar(&out).display()))?;
        }
        log_line(&mut f, ok, secs, &err, "")?;
    }
    eprintln!(
        "xtask: all stages done in {:.0}s",
        t0.elapsed().as_secs_f64()
    );
    Ok(all_ok)
}

/// One (model, context) setting of the pipeline.
#[derive(Clone, Copy)]
struct Setting {
    model: &'static str,
    context: usize,
    positions: usize,
    k: usize,
    /// Evaluate the plan calibrated here at this other context too (cross-context ablation).
    cross: Option<usize>,
}

/// Head dimension of each model the pipeline runs.
fn head_dim(model: &str) -> usize {
    match model {
        "gemma3-270m" => 256,
        _ => 64,
    }
}

/// The main method list at head dimension `d`: [`MAIN_METHODS`] plus the baselines at the
/// fixed-fraction convention r = D/4 (docs/SPEC.md §4) where it differs from r = 32, with the
/// Fathom sweep extended to their bits.
fn main_methods(d: usize) -> String {
    let r = d / 4;
    if r == 32 {
        return MAIN_METHODS.to_string();
    }
    let top = (136.0f64).max(4.25 * r as f64);
    let top = (top / 8.0).floor() as usize * 8;
    let mut list: Vec<String> = MAIN_METHODS
        .split(',')
        .map(|m| {
            if m == "fathom-sweep:24-136/8" {
                format!("fathom-sweep:24-{top}/8")
            } else {
                m.to_string()
            }
        })
        .collect();
    for m in [format!("sparq:{r}"), format!("ds:{r}"), format!("loki:{r}")] {
        if !list.contains(&m) {
            list.push(m);
        }
    }
    list.join(",")
}

const MAIN_METHODS: &str = "dense,exact,fathom-sweep:24-136/8,fathom-layer:48,fathom-layer:64,fathom-uniform:48,fathom-uniform:64,sparq:16,sparq:32,sparq-union:16,sparq-union:32,ds:32,loki:32,thumb2,landmark,quest";
const ABLATION_METHODS: &str = "exact,fathom-raw:32,fathom-raw:48,fathom-raw:64,fathom-raw:92,fathom-raw:136,fathom-klt:32,fathom-klt:48,fathom-klt:64,fathom-klt:92,fathom-klt:136,fathom-blockmax:48,fathom-blockmax:64,loki:32,loki-f16:32,loki-f16:8";
const CROSS_METHODS: &str = "exact,fathom:48,fathom:64,fathom-layer:48,fathom-layer:64,ds:32";
const K_METHODS: &str = "exact,fathom:48,fathom:64,fathom:92,sparq:32,ds:32,loki:32";

/// Rough seconds of a downstream stage at `context` tokens on 2 cores (measured: ~6 s per
/// RULER sample and method at 4k; ~4.5 s per agent session and method for 64 teacher-forced
/// steps at 4k).
fn downstream_estimate(cmd: &str, context: usize) -> f64 {
    let flag = |name: &str| -> f64 {
        let parts: Vec<&str> = cmd.split(' ').collect();
        parts
            .windows(2)
            .find(|w| w[0] == name)
            .map_or(1.0, |w| w[1].split(',').count() as f64)
    };
    let count = |name: &str| -> f64 {
        let parts: Vec<&str> = cmd.split(' ').collect();
        parts
            .windows(2)
            .find(|w| w[0] == name)
            .and_then(|w| w[1].parse().ok())
            .unwrap_or(1.0)
    };
    let per = context as f64 / 700.0;
    if cmd.starts_with("ruler") {
        count("--samples") * flag("--tasks") * flag("--methods") * per
    } else {
        count("--sessions") * flag("--methods") * per * count("--steps") / 80.0
    }
}

/// The experiment matrix of one repro mode, as data: the (model, context) settings, the k
/// values of the k-varied study, the downstream commands and the speed table's contexts.
/// Each fidelity stage records its study (`--study`), which is how the report tables it.
struct Matrix {
    settings: Vec<Setting>,
    ks: Vec<usize>,
    downstream: Vec<String>,
    speed: Vec<(&'static str, &'static str)>,
}

/// The full run's RULER wording and task shape: the one `scripts/device/downstream.sh tune`
/// kept on the GPU for both models (dense-only probes on a held-out seed,
/// `results/downstream/gpu/tune/`), i.e. the committed 20-sample GPU runs' setting.
const RULER_FULL: &str = "ruler --prompt chat --shape small,needle=passkey --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,fwe --samples 20 --methods dense,exact,fathom:48,fathom:64,fathom:92,sparq:16,sparq:32,ds:32,loki:32,thumb2,landmark,quest";
const RULER_QUICK: &str =
    "ruler --tasks niah_single,niah_multikey,vt --samples 1 --methods dense,exact,fathom:48,fathom:92,sparq:32,ds:32";
const AGENT_FULL: &str = "agent-steps --sessions 4 --steps 64 --methods dense,exact,fathom:48,fathom:64,fathom:92,sparq:16,sparq:32,ds:32,loki:32,thumb2,landmark,quest";
const AGENT_QUICK: &str =
    "agent-steps --sessions 1 --steps 16 --methods dense,exact,fathom:48,fathom:92,sparq:32,ds:32";
/// A downstream command for `--device cuda`: the same methods (the paged cache runs every one
/// of the full lists: Loki through its PCA index, landmark and Quest through its block
/// tables), on the GPU.
fn on_gpu(cmd: &str) -> String {
    format!("{cmd} --device cuda")
}

/// Whether this machine shows an NVIDIA GPU (`nvidia-smi -L` lists one), with the reason when not.
fn gpu_present() -> std::result::Result<(), String> {
    match Command::new("nvidia-smi").arg("-L").output() {
        Ok(o) if o.status.success() && String::from_utf8_lossy(&o.stdout).contains("GPU") => Ok(()),
        Ok(o) => Err(format!(
            "nvidia-smi -L lists no GPU ({})",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("nvidia-smi not found ({e})")),
    }
}

const fn setting(model: &'static str, context: usize, k: usize, cross: Option<usize>) -> Setting {
    Setting {
        model,
        context,
        positions: 128,
        k,
        cross,
    }
}

const FULL_SETTINGS: [Setting; 5] = [
    setting("smollm2-135m", 4096, 128, Some(8192)),
    setting("smollm2-135m", 8192, 256, None),
    setting("gemma3-270m", 8192, 256, None),
    setting("gemma3-270m", 16384, 256, None),
    setting("gemma3-270m", 32768, 512, None),
];
const QUICK_SETTING: Setting = Setting {
    model: "smollm2-135m",
    context: 2048,
    positions: 16,
    k: 128,
    cross: Some(4096),
};

/// The matrix of `--full` or `--quick`; the downstream commands only where the CLI has them
/// (`help` is `fathom --help`).
fn matrix(full: bool, help: &str) -> Matrix {
    let mut downstream = Vec::new();
    if help.contains("ruler") {
        downstream.push(if full { RULER_FULL } else { RULER_QUICK }.to_string());
    }
    if help.contains("agent-steps") {
        downstream.push(if full { AGENT_FULL } else { AGENT_QUICK }.to_string());
    }
    if full {
        Matrix {
            settings: FULL_SETTINGS.to_vec(),
            ks: vec![64, 128, 256, 512, 1024],
            downstream,
            speed: vec![
                ("smollm2-135m", "2048,8176"),
                ("gemma3-270m", "2048,8192,32752"),
            ],
        }
    } else {
        Matrix {
            settings: vec![QUICK_SETTING],
            ks: vec![64, 256],
            downstream,
            speed: vec![("smollm2-135m", "2048")],
        }
    }
}

/// The stages of one setting: its captures, calibration, fidelity studies (main, ablation,
/// k, cross-context), and, in `later`, its downstream runs.
fn setting_stages(
    s: &Setting,
    ks: &[usize],
    out: &str,
    cache: &str,
    downstream: &[String],
    st: &mut Vec<Stage>,
    later: &mut Vec<Stage>,
) {
    let (model, context, k) = (s.model, s.context, s.k);
    let tag = format!("{model}-{}k", context / 1024);
    let dir = format!("{out}/{tag}");
    let cap =
        |split: &str, ctx: usize| format!("{cache}/{model}-{split}-{}k.safetensors", ctx / 1024);
    let est = context as f64 / 150.0;
    let capture = |split: &str, ctx: usize| {
        format!(
            "capture --model {model} --corpus prose --split {split} --context {ctx} --positions {} --dtype f16 --out {}",
            s.positions,
            cap(split, ctx)
        )
    };
    for split in ["calib", "eval"] {
        st.push(stage_cmd(
            &format!("{tag}: capture {split}"),
            est,
            &capture(split, context),
        ));
    }
    let calib = format!("{dir}/calibration.json");
    st.push(stage_cmd(
        &format!("{tag}: calibrate"),
        est / 2.0,
        &format!(
            "calibrate --capture {} --out {calib} --targets 48,64 --k {k}",
            cap("calib", context)
        ),
    ));
    let eval = cap("eval", context);
    let fidelity = |methods: &str, k: usize, json: &str, study: &str| {
        format!("fidelity --capture {eval} --calib {calib} --methods {methods} --k {k} --json {dir}/{json} --study {study}")
    };
    let main = main_methods(head_dim(model));
    st.push(stage_cmd(
        &format!("{tag}: fidelity"),
        est,
        &format!(
            "{} --plot {dir}/fidelity.png",
            fidelity(&main, k, "fidelity.json", "main")
        ),
    ));
    st.push(stage_cmd(
        &format!("{tag}: ablations (basis, proxy, Loki fp16)"),
        est,
        &format!(
            "{} --plot {dir}/ablations.png",
            fidelity(ABLATION_METHODS, k, "ablations.json", "ablation")
        ),
    ));
    for &kk in ks {
        st.push(stage_cmd(
            &format!("{tag}: k = {kk}"),
            est / 3.0,
            &fidelity(K_METHODS, kk, &format!("k{kk}.json"), "k"),
        ));
    }
    if let Some(c2) = s.cross {
        st.push(stage_cmd(
            &format!("{tag}: capture eval at {}k (cross-context)", c2 / 1024),
            c2 as f64 / 150.0,
            &capture("eval", c2),
        ));
        st.push(stage_cmd(
            &format!("{tag}: plan calibrated at {}k, evaluated at {}k", context / 1024, c2 / 1024),
            c2 as f64 / 150.0,
            &format!(
                "fidelity --capture {} --calib {calib} --methods {CROSS_METHODS} --k {k} --json {dir}/cross-context-{}k.json --study ablation",
                cap("eval", c2),
                c2 / 1024
            ),
        ));
    }
    for d in downstream {
        let name = d.split(' ').next().unwrap_or("");
        later.push(stage_cmd(
            &format!("{tag}: {name}"),
            downstream_estimate(d, context),
            &format!("{d} --model {model} --context {context} --json {dir}/{name}.json"),
        ));
    }
}

/// The speed table's stages.
fn speed_stages(speed: &[(&str, &str)], out: &str, st: &mut Vec<Stage>) {
    for (model, ctxs) in speed {
        let n: f64 = ctxs.split(',').filter_map(|c| c.parse::<f64>().ok()).sum();
        st.push(stage(
            &format!("{model}: speed beside llama.cpp at {ctxs} tokens"),
            n / 100.0,
            &[
                "speed",
                "--model",
                model,
                "--context",
                ctxs,
                "--decode-steps",
                "16",
                "--json",
                &format!("{out}/speed-{model}.json"),
            ],
        ));
    }
}

/// Every stage of a run, in order: fetches, each distinct capture once, the fidelity work and
/// speed table, then the downstream runs (so that a time budget cuts the most expensive
/// part first).
fn pipeline(m: &Matrix, out: &str, cache: &str) -> Vec<Stage> {
    let mut st = vec![
        stage("fetch models", 5.0, &["fetch-models"]),
        stage("fetch corpus", 10.0, &["fetch-corpus"]),
    ];
    let mut later = Vec::new();
    for s in &m.settings {
        setting_stages(s, &m.ks, out, cache, &m.downstream, &mut st, &mut later);
    }
    speed_stages(&m.speed, out, &mut st);
    st.extend(later);
    // Captures first (they depend only on the fetches), each distinct command once: a budgeted
    // run spends its first minutes on the model forward passes, and a later run reuses them.
    let (mut caps, rest): (Vec<Stage>, Vec<Stage>) =
        st.into_iter().partition(|s| s.args[0] == "capture");
    let mut seen = std::collections::HashSet::new();
    caps.retain(|s| seen.insert(s.args.clone()));
    let (fetch, rest): (Vec<Stage>, Vec<Stage>) = rest
        .into_iter()
        .partition(|s| s.args[0].starts_with("fetch-"));
    fetch.into_iter().chain(caps).chain(rest).collect()
}

fn run() -> Result<bool> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first() else {
        bail!("usage: cargo xtask <repro [--quick|--full] [--gpu] [--device cpu|cuda] [--out DIR] [--budget-min M] | fetch-models | fetch-corpus | fuzz [--seconds N] [--target T] | stress [--seconds N]>");
    };
    match cmd.as_str() {
        "repro" => repro(&args[1..]),
        "fetch-models" => {
            let bin = build_cli(&[])?;
            Ok(Command::new(bin).arg("fetch-models").status()?.success())
        }
        "fetch-corpus" => {
            let bin = build_cli(&[])?;
            Ok(Command::new(bin).arg("fetch-corpus").status()?.success())
        }
        "fuzz" => fuzz(&args[1..]).map(|()| true),
        "stress" => {
            let secs = seconds_flag(&args[1..], 600)?;
            let st = cargo()
                .args(["test", "--release", "-p", "fathom-plan", "--test", "stress", "--", "--nocapture"])
                .env("FATHOM_STRESS_SECS", secs.to_string())
                .status()
                .context("running cargo test")?;
            if !st.success() {
                bail!("the stress test failed ({st})");
            }
            Ok(true)
        }
        other => bail!("unknown xtask command {other:?}; expected repro, fetch-models, fetch-corpus, fuzz or stress"),
    }
}
/// The fuzz targets under `fuzz/fuzz_targets/`.
const FUZZ_TARGETS: [&str; 4] = ["store", "capture", "calib", "gguf"];

/// `cargo xtask repro` flags.
struct ReproArgs {
    out: String,
    full: bool,
    gpu: bool,
    /// `--device cuda`: the downstream stages on the GPU forward.
    cuda: bool,
    /// Seconds.
    budget: Option<f64>,
}

impl ReproArgs {
    fn parse(args: &[String]) -> Result<ReproArgs> {
        let mut r = ReproArgs {
            out: "results".into(),
            full: false,
            gpu: false,
            cuda: false,
            budget: None,
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--quick" => r.full = false,
                "--full" => r.full = true,
                "--gpu" => r.gpu = true,
                "--device" => match it.next().map(String::as_str) {
                    Some("cuda") => r.cuda = true,
                    Some("cpu") => r.cuda = false,
                    v => bail!("--device {v:?}: want cpu or cuda"),
                },
                "--out" => r.out = it.next().context("--out needs a directory")?.clone(),
                "--budget-min" => {
                    let v = it.next().context("--budget-min needs minutes")?;
                    let m: f64 = v
                        .parse()
                        .ok()
                        .filter(|m: &f64| m.is_finite() && *m > 0.0)
                        .with_context(|| format!("--budget-min {v:?} is not a positive number"))?;
                    r.budget = Some(m * 60.0);
                }
                other => bail!("unknown repro flag {other:?}"),
            }
        }
        Ok(r)
    }
}

/// `cargo xtask repro`: build the CLI, run the matrix's stages, then render the report.
fn repro(args: &[String]) -> Result<bool> {
    let a = ReproArgs::parse(args)?;
    let cuda = a.cuda
        && match gpu_present() {
            Ok(()) => true,
            Err(why) => {
                eprintln!(
                    "xtask: --device cuda: the downstream stages run on the CPU instead: {why}"
                );
                false
            }
        };
    let bin = build_cli(if cuda { &["cuda"] } else { &[] })?;
    let mode = if a.full { "full" } else { "quick" };
    let run_dir = format!("{}/{mode}", a.out);
    std::fs::create_dir_all(root().join(&run_dir))
        .with_context(|| format!("creating {run_dir}"))?;
    let cache = ".cache/captures".to_string();
    std::fs::create_dir_all(root().join(&cache))?;
    let help = Command::new(&bin)
        .arg("--help")
        .output()
        .context("running fathom --help")?;
    let mut m = matrix(a.full, &String::from_utf8_lossy(&help.stdout));
    if cuda {
        eprintln!("xtask: --device cuda: downstream stages on the GPU");
        m.downstream = m.downstream.iter().map(|d| on_gpu(d)).collect();
    }
    for s in &m.settings {
        let dir = root()
            .join(&run_dir)
            .join(format!("{}-{}k", s.model, s.context / 1024));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut stages = pipeline(&m, &run_dir, &cache);
    if a.gpu {
        stages.push(stage(
            "offload timing (device)",
            120.0,
            &[
                "offload-bench",
                "--context",
                "32k,256k,1m",
                "--residency",
                "host,hbm",
                "--json",
                &format!("{run_dir}/device-offload.json"),
            ],
        ));
    } else {
        eprintln!("xtask: device timing skipped: --gpu not given (this machine has no GPU); the report lists the last committed device results under results/device/, labelled as such");
    }
    let log = root().join(&run_dir).join("stages.jsonl");
    let ok = run_stages(&bin, &stages, &log, a.budget)?;
    // The report: this run plus the last committed device results.
    let report = format!("{}/REPORT.md", a.out);
    let log_arg = log.display().to_string();
    let mut report_args = vec![
        "report", "--dir", &a.out, "--out", &report, "--stages", &log_arg,
    ];
    // The committed results' index and the README's headline table are rendered from the
    // same documents: keep them current with the report.
    if a.out == "results" {
        report_args.extend(["--index", "results/README.md", "--readme", "README.md"]);
    }
    let report_stage = [stage("report", 1.0, &report_args)];
    let ok2 = run_stages(
        &bin,
        &report_stage,
        &root().join(&run_dir).join("report-stage.jsonl"),
        None,
    )?;
    eprintln!("xtask: report at {report}");
    Ok(ok && ok2)
}

fn seconds_flag(args: &[String], default: u64) -> Result<u64> {
    let mut secs = default;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                let v = it.next().context("--seconds needs a number")?;
                secs = v
                    .parse()
                    .with_context(|| format!("--seconds {v:?} is not a number"))?;
            }
            "--target" => {
                it.next();
            }
            other => bail!("unknown flag {other:?}"),
        }
    }
    Ok(secs)
}

/// `cargo fuzz` needs nightly flags (`-Zsanitizer`, `-Cpasses=sancov-module`): on the stable
/// toolchain it runs with `RUSTC_BOOTSTRAP=1`. No sanitizer (`-s none`: the readers are safe
/// Rust; debug assertions (`-a`) catch overflow), libFuzzer's own crash and timeout detection.
fn fuzz(args: &[String]) -> Result<()> {
    let secs = seconds_flag(args, 600)?;
    let only = args
        .iter()
        .position(|a| a == "--target")
        .and_then(|i| args.get(i + 1));
    let targets: Vec<&str> = FUZZ_TARGETS
        .iter()
        .copied()
        .filter(|t| only.is_none_or(|o| o == t))
        .collect();
    if targets.is_empty() {
        bail!("unknown fuzz target {only:?}; expected one of {FUZZ_TARGETS:?}");
    }
    let logs = root().join("target/fuzz-logs");
    std::fs::create_dir_all(&logs).context("creating target/fuzz-logs")?;
    let mut summary = Vec::new();
    for t in targets {
        let log = logs.join(format!("{t}.log"));
        eprintln!("xtask: fuzzing {t} for {secs} s (log: {})", log.display());
        let st = cargo()
            .env("RUSTC_BOOTSTRAP", "1")
            .args(["fuzz", "run", "-s", "none", "-a", "-O", t, "--"])
            .arg(format!("-max_total_time={secs}"))
            .args(["-timeout=10", "-rss_limit_mb=4096", "-print_final_stats=1"])
            .stderr(std::fs::File::create(&log).context("creating the log")?)
            .status()
            .context("running cargo fuzz (install it with `cargo install cargo-fuzz`)")?;
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let runs = text
            .lines()
            .filter_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
            .filter_map(|v| v.trim().parse::<u64>().ok())
            .next_back();
        summary.push((t, runs, st.success()));
        eprintln!(
            "xtask: {t}: {} executions, {}",
            runs.map_or("?".into(), |r| r.to_string()),
            if st.success() {
                "no crash"
            } else {
                "CRASH (see the log and fuzz/artifacts/)"
            }
        );
    }
    let total: u64 = summary.iter().filter_map(|s| s.1).sum();
    let crashed: Vec<&str> = summary.iter().filter(|s| !s.2).map(|s| s.0).collect();
    eprintln!(
        "xtask: fuzz total: {total} executions over {} targets, {} crashed {crashed:?}",
        summary.len(),
        crashed.len()
    );
    if !crashed.is_empty() {
        bail!("fuzz targets crashed: {crashed:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Vec<Setting> {
        vec![
            Setting {
                model: "smollm2-135m",
                context: 2048,
                positions: 16,
                k: 128,
                cross: Some(4096),
            },
            Setting {
                model: "gemma3-270m",
                context: 8192,
                positions: 32,
                k: 256,
                cross: None,
            },
        ]
    }

    /// Every file a stage reads is written by an earlier stage (captures and calibrations),
    /// and every stage has a positive estimate, so budgets and dependency skips behave.
    #[test]
    fn stages_read_only_what_earlier_stages_write() {
        let down = vec![
            "ruler --tasks niah_single,vt --samples 2 --methods dense,exact".to_string(),
            "agent-steps --sessions 1 --steps 16 --methods dense,exact".to_string(),
        ];
        let m = Matrix {
            settings: settings(),
            ks: vec![64, 256],
            downstream: down,
            speed: vec![("smollm2-135m", "2048")],
        };
        let st = pipeline(&m, "results/quick", ".cache/captures");
        let mut written: Vec<String> = Vec::new();
        for s in &st {
            assert!(s.estimate > 0.0, "{}", s.name);
            for w in s.args.windows(2) {
                if w[0] == "--capture" || w[0] == "--calib" {
                    assert!(
                        written.contains(&w[1]),
                        "{} reads {} before it is written",
                        s.name,
                        w[1]
                    );
                }
            }
            for w in s.args.windows(2) {
                if w[0] == "--out" {
                    written.push(w[1].clone());
                }
            }
        }
        // Captures right after the fetches, each once.
        let caps: Vec<_> = st.iter().filter(|s| s.args[0] == "capture").collect();
        assert!(st[2..2 + caps.len()].iter().all(|s| s.args[0] == "capture"));
        let args: Vec<Vec<String>> = caps.iter().map(|s| s.args.clone()).collect();
        assert_eq!(duplicates(&args), 0, "a capture command runs twice");
        // Downstream stages come after every fidelity stage and the speed table.
        let first_down = st.iter().position(|s| s.args[0] == "ruler").unwrap();
        assert!(st[first_down..]
            .iter()
            .all(|s| s.args[0] == "ruler" || s.args[0] == "agent-steps"));
        assert!(st[..first_down].iter().any(|s| s.args[0] == "speed"));
    }

    /// How many items repeat an earlier one (sorted first, so repeats need not be adjacent).
    fn duplicates<T: Ord + Clone>(items: &[T]) -> usize {
        let mut v = items.to_vec();
        v.sort();
        v.dedup();
        items.len() - v.len()
    }

    /// `fathom-*` names in one `[section]` of a Cargo.toml.
    fn workspace_deps(toml: &str, section: &str) -> Vec<String> {
        let mut on = false;
        let mut out = Vec::new();
        for line in toml.lines().map(str::trim) {
            if line.starts_with('[') {
                on = line == section;
                continue;
            }
            if on && line.starts_with("fathom-") {
                if let Some(name) = line.split(['=', ' ', '.']).next() {
                    out.push(name.to_string());
                }
            }
        }
        out.sort();
        out
    }

    /// The crate map of ARCHITECTURE.md: each library's workspace dependencies, exactly; and
    /// no dev-dependency on a crate that depends (transitively) on the crate itself.
    #[test]
    fn crate_map_matches_architecture() {
        let allowed: &[(&str, &[&str])] = &[
            ("fathom-store", &[]),
            ("fathom-plan", &["fathom-store"]),
            ("fathom-baselines", &["fathom-plan", "fathom-store"]),
            ("fathom-capture", &[]),
            ("fathom-results", &["fathom-plan", "fathom-store"]),
            (
                "fathom-bench",
                &[
                    "fathom-baselines",
                    "fathom-capture",
                    "fathom-cuda",
                    "fathom-plan",
                    "fathom-results",
                    "fathom-store",
                ],
            ),
            (
                "fathom-report",
                &[
                    "fathom-bench",
                    "fathom-plan",
                    "fathom-results",
                    "fathom-store",
                ],
            ),
            (
                "fathom-cuda",
                &["fathom-baselines", "fathom-plan", "fathom-store"],
            ),
            ("fathom-model", &["fathom-capture"]),
            (
                "fathom-gpu",
                &[
                    "fathom-cuda",
                    "fathom-model",
                    "fathom-plan",
                    "fathom-results",
                    "fathom-store",
                ],
            ),
            (
                "fathom-eval",
                &[
                    "fathom-baselines",
                    "fathom-bench",
                    "fathom-model",
                    "fathom-plan",
                    "fathom-results",
                    "fathom-store",
                ],
            ),
        ];
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let read = |c: &str| {
            std::fs::read_to_string(root.join("crates").join(c).join("Cargo.toml"))
                .unwrap_or_else(|e| panic!("{c}: {e}"))
        };
        let deps: std::collections::BTreeMap<&str, Vec<String>> = allowed
            .iter()
            .map(|(c, _)| (*c, workspace_deps(&read(c), "[dependencies]")))
            .collect();
        for (c, want) in allowed {
            assert_eq!(
                deps[c], *want,
                "{c}'s workspace dependencies differ from ARCHITECTURE.md"
            );
        }
        // Transitive dependents of each crate.
        let depends_on = |a: &str, b: &str| -> bool {
            let mut stack = vec![a.to_string()];
            let mut seen = std::collections::BTreeSet::new();
            while let Some(x) = stack.pop() {
                if x == b {
                    return true;
                }
                if seen.insert(x.clone()) {
                    stack.extend(deps.get(x.as_str()).into_iter().flatten().cloned());
                }
            }
            false
        };
        for (c, _) in allowed {
            for dev in workspace_deps(&read(c), "[dev-dependencies]") {
                assert!(
                    !depends_on(&dev, c),
                    "{c} dev-depends on {dev}, which depends on {c}: a cycle"
                );
            }
        }
        assert!(depends_on("fathom-eval", "fathom-store"));
    }

    #[test]
    fn gpu_downstream_commands_keep_every_method() {
        let c = on_gpu(RULER_FULL);
        assert!(c.ends_with(" --device cuda"), "{c}");
        assert!(
            c.contains("dense,exact,fathom:48") && c.contains("thumb2"),
            "{c}"
        );
        assert!(
            c.contains("loki:32") && c.contains("landmark") && c.contains("quest"),
            "{c}"
        );
        assert!(on_gpu(AGENT_QUICK)
            .contains("--methods dense,exact,fathom:48,fathom:92,sparq:32,ds:32 --device cuda"));
    }

    #[test]
    fn the_duplicate_check_finds_repeats_that_are_not_adjacent() {
        assert_eq!(duplicates(&["a", "b", "a"]), 1);
        assert_eq!(duplicates(&["a", "b", "c"]), 0);
    }

    #[test]
    fn downstream_estimates_scale_with_samples_methods_and_context() {
        let a = downstream_estimate("ruler --tasks a,b --samples 2 --methods x,y,z", 4096);
        let b = downstream_estimate("ruler --tasks a,b --samples 4 --methods x,y,z", 8192);
        assert!((b / a - 4.0).abs() < 1e-9, "{a} {b}");
        assert!(downstream_estimate("agent-steps --sessions 1 --steps 16 --methods x", 2048) > 0.0);
    }
}
