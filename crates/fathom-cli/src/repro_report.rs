//! `fathom report`: renders `REPORT.md` from the result documents of a results directory
//! (the rendering is the `fathom-report` library; this file parses arguments and calls it).

use std::path::PathBuf;

use anyhow::{bail, Result};

/// Arguments of `fathom report`.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom report --dir results --out results/REPORT.md --stages results/full/stages.jsonl --index results/README.md --readme README.md\n  \
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
    /// Also render the claims table into this Markdown file, between its
    /// `<!-- claims-table -->` marker lines (the results index, `results/README.md`).
    #[arg(long)]
    pub index: Option<PathBuf>,
    /// Also render the headline table into this Markdown file, between its
    /// `<!-- headline-table -->` marker lines (the repository's `README.md`).
    #[arg(long)]
    pub readme: Option<PathBuf>,
    /// The date the report names (default: today, UTC).
    #[arg(long)]
    pub date: Option<String>,
    /// The commit the report names (default: `git rev-parse --short HEAD`, or `unknown`).
    #[arg(long)]
    pub commit: Option<String>,
}

/// Today's date, UTC (`2026-12-06`), from the system clock (civil-from-days).
fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The short hash of `HEAD`, or `unknown` outside a git checkout.
fn head_commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "unknown".into())
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
    let stamp = fathom_report::Stamp {
        date: a.date.clone().unwrap_or_else(today),
        commit: a.commit.clone().unwrap_or_else(head_commit),
    };
    fathom_report::write_report(&a.dir, a.stages.as_deref(), &a.out, &stamp)?;
    eprintln!("wrote {}", a.out.display());
    if a.index.is_some() || a.readme.is_some() {
        let base = a.out.parent().unwrap_or(std::path::Path::new("."));
        let inp = fathom_report::collect(&a.dir, a.stages.as_deref(), base)?;
        fathom_report::summary::write_tables(&inp, a.index.as_deref(), a.readme.as_deref())?;
        for f in [&a.index, &a.readme].into_iter().flatten() {
            eprintln!("wrote {}", f.display());
        }
    }
    if let Some(p) = &a.plots {
        let base = a.out.parent().unwrap_or(std::path::Path::new("."));
        let inp = fathom_report::collect(&a.dir, a.stages.as_deref(), base)?;
        for f in fathom_report::write_decode_plots(&inp, p)? {
            eprintln!("wrote {}", f.display());
        }
    }
    Ok(())
}
