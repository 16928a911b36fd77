//! `fathom report`: renders `REPORT.md` from the result documents of a results directory
//! (the rendering is the `fathom-report` library; this file parses arguments and calls it).

use std::path::PathBuf;

use anyhow::{bail, Result};

/// Arguments of `fathom report`.
#[derive(clap::Args, Debug)]
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
    fathom_report::write_report(&a.dir, a.stages.as_deref(), &a.out)?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}
