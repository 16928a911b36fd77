//! `fathom report`: renders `REPORT.md` from the result documents of a results directory
//! (the rendering is the `fathom-report` library; this file parses arguments and calls it).

use std::path::PathBuf;

use anyhow::{bail, Result};

/// Arguments of `fathom report`.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom report --dir results --out results/REPORT.md --stages results/full/stages.jsonl\n  \
    fathom report --dir results --out results/REPORT.md --plots results/device/decode-bench")]
pub struct ReportArgs {
    /// Results directory (searched recursively for *.json).
    #[arg(long)]
    pub dir: PathBuf,
    /// Output Markdown file (written atomically).
    #[arg(long)]
    pub out: PathBuf,
    /// Stage log (`stages.jsonl`, one `stage` record per line) written by `cargo xtask repro`.
    #[arg(long)]
    pub stages: Option<PathBuf>,
    /// Also draw the decode-throughput plots against context into this folder (one PNG per
    /// model and residency with one-session runs at two or more contexts).
    #[arg(long)]
    pub plots: Option<PathBuf>,
}

/// Renders the report.
pub fn run_report(a: ReportArgs) -> Result<()> {
    if !a.dir.is_dir() {
        bail!("results directory {} does not exist", a.dir.display());
    }
    if let Some(st) = &a.stages {
        if !st.is_file() {
            bail!("stage log {} does not exist", st.display());
        }
    }
    crate::check_writable(&a.out)?;
    if let Some(p) = &a.plots {
        if !p.is_dir() {
            bail!("plot folder {} does not exist", p.display());
        }
    }
    fathom_report::write_report(&a.dir, a.stages.as_deref(), &a.out)?;
    eprintln!("wrote {}", a.out.display());
    if let Some(p) = &a.plots {
        let base = a.out.parent().unwrap_or(std::path::Path::new("."));
        let inp = fathom_report::collect(&a.dir, a.stages.as_deref(), base)?;
        for f in fathom_report::write_decode_plots(&inp, p)? {
            eprintln!("wrote {}", f.display());
        }
    }
    Ok(())
}
