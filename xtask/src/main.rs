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

mod matrix;
mod stages;
use matrix::*;
use stages::*;

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
