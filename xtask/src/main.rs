//! `cargo xtask`: drives `cargo` and the `fathom` CLI; never reimplements them.
//!
//! - `cargo xtask repro [--quick | --full] [--out DIR]`: builds the CLI in release and runs the
//!   pipeline, writing results under DIR (default `results/`).
//! - `cargo xtask fetch-models`: downloads and verifies the pinned GGUF models (through the CLI).
//! - `cargo xtask fuzz [--seconds N] [--target T]`: runs each `cargo fuzz` target under `fuzz/`
//!   for N seconds (default 600) and prints the executions and crashes (docs/RELIABILITY.md).
//! - `cargo xtask stress [--seconds N]`: the 16-session append/scan stress test in release for
//!   N seconds (default 600).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
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

fn build_cli() -> Result<PathBuf> {
    let st = cargo()
        .args(["build", "--release", "-p", "fathom-cli"])
        .status()
        .context("running cargo build")?;
    if !st.success() {
        bail!("cargo build --release -p fathom-cli failed");
    }
    Ok(root().join("target/release/fathom"))
}

fn fathom(bin: &Path, args: &[&str]) -> Result<()> {
    eprintln!("xtask: fathom {}", args.join(" "));
    let st = Command::new(bin)
        .args(args)
        .current_dir(root())
        .status()
        .context("running fathom")?;
    if !st.success() {
        bail!("`fathom {}` failed ({st})", args.join(" "));
    }
    Ok(())
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first() else {
        bail!("usage: cargo xtask <repro [--quick|--full] [--out DIR] | fetch-models | fuzz [--seconds N] [--target T] | stress [--seconds N]>");
    };
    match cmd.as_str() {
        "repro" => {
            let mut out = "results".to_string();
            let mut full = false;
            let mut it = args.iter().skip(1);
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--quick" => full = false,
                    "--full" => full = true,
                    "--out" => out = it.next().context("--out needs a directory")?.clone(),
                    "--gpu" => eprintln!("xtask: --gpu: the offload timing runs on the device through `fathom offload-bench`; it is skipped here (no device on this machine); see results/device/ for the last committed device results"),
                    other => bail!("unknown repro flag {other:?}"),
                }
            }
            let bin = build_cli()?;
            std::fs::create_dir_all(root().join(&out))
                .with_context(|| format!("creating {out}"))?;
            let demo_json = format!("{out}/demo-synthetic.json");
            let demo_png = format!("{out}/demo-synthetic.png");
            fathom(&bin, &["demo", "--json", &demo_json, "--plot", &demo_png])?;
            if full {
                eprintln!("xtask: --full: the real-model stages (capture, calibrate, fidelity, downstream) run through `fathom capture/calibrate/fidelity`; see README for the commands run and their results");
            }
            eprintln!("xtask: wrote {demo_json}");
            Ok(())
        }
        "fetch-models" => {
            let bin = build_cli()?;
            fathom(&bin, &["fetch-models"])
        }
        "fuzz" => fuzz(&args[1..]),
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
            Ok(())
        }
        other => bail!("unknown xtask command {other:?}; expected repro, fetch-models, fuzz or stress"),
    }
}

/// The fuzz targets under `fuzz/fuzz_targets/`.
const FUZZ_TARGETS: [&str; 4] = ["store", "capture", "calib", "gguf"];

fn seconds_flag(args: &[String], default: u64) -> Result<u64> {
    let mut secs = default;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                let v = it.next().context("--seconds needs a number")?;
                secs = v.parse().with_context(|| format!("--seconds {v:?} is not a number"))?;
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
    let only = args.iter().position(|a| a == "--target").and_then(|i| args.get(i + 1));
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
        eprintln!("xtask: {t}: {} executions, {}", runs.map_or("?".into(), |r| r.to_string()), if st.success() { "no crash" } else { "CRASH (see the log and fuzz/artifacts/)" });
    }
    let total: u64 = summary.iter().filter_map(|s| s.1).sum();
    let crashed: Vec<&str> = summary.iter().filter(|s| !s.2).map(|s| s.0).collect();
    eprintln!("xtask: fuzz total: {total} executions over {} targets, {} crashed {crashed:?}", summary.len(), crashed.len());
    if !crashed.is_empty() {
        bail!("fuzz targets crashed: {crashed:?}");
    }
    Ok(())
}
