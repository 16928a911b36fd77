//! `cargo xtask`: drives `cargo` and the `fathom` CLI; never reimplements them.
//!
//! - `cargo xtask repro [--quick | --full] [--out DIR]`: builds the CLI in release and runs the
//!   pipeline, writing results under DIR (default `results/`).
//! - `cargo xtask fetch-models`: downloads and verifies the pinned GGUF models (through the CLI).

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
        bail!("usage: cargo xtask <repro [--quick|--full] [--out DIR] | fetch-models>");
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
        other => bail!("unknown xtask command {other:?}; expected repro or fetch-models"),
    }
}
