//! The reproduction report: `REPORT.md` rendered from the typed result documents of a
//! results directory ([`fathom_results`]), claims first, each with the paper's figure, ours
//! and a verdict in words; then the ablations, the CPU runtime's speed, the memory table, and
//! the stage log as an appendix. Also the error-against-bits plot ([`plot`]) and the
//! Markdown table of one fidelity run ([`tables::fidelity_markdown`]).
//!
//! The paper's figures and our targets are data ([`claims::PAPER`], [`claims::TARGETS`]); each
//! claim is one function ([`claims::CLAIMS`]).
//!
//! ```
//! let dir = tempfile::tempdir()?;
//! let inputs = fathom_report::collect(dir.path(), None, dir.path())?;
//! let md = fathom_report::render(&inputs, &fathom_report::Stamp::default());
//! assert!(md.starts_with("# Fathom: reproduction report"));
//! assert!(md.contains("## Claim 1:"));
//! assert!(md.contains("not measured in this run"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

pub mod claims;
pub mod downstream;
pub mod intervals;
pub mod plot;
pub mod sections;
pub mod step;
pub mod summary;
pub mod tables;
pub mod torch_path;

use std::path::{Path, PathBuf};

use fathom_results::calibration::CalibrationSummary;
use fathom_results::downstream::{AgentDoc, RulerDoc};
use fathom_results::fidelity::FidelityDoc;
use fathom_results::offload::{OffloadBench, OffloadStudy};
use fathom_results::speed::ModelSpeed;
use fathom_results::stages::StageRecord;
use fathom_results::{Document, ResultsError};

/// What went wrong building the report or a plot.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A result document could not be read (named, with the cause).
    #[error(transparent)]
    Results(#[from] ResultsError),
    /// A directory or file is missing or unreadable.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The plot could not be drawn.
    #[error("plot: {0}")]
    Plot(String),
    /// A Markdown file lacks the marker lines its table goes between.
    #[error("the marker lines {0} are missing or out of order")]
    Markers(String),
}

/// A document and the file it came from.
#[derive(Debug, Clone)]
pub struct Source<T> {
    /// The file.
    pub path: PathBuf,
    /// Its document.
    pub doc: T,
}

/// Every document of a results directory, by kind, each list in path order.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    /// The directory that was read (as given).
    pub dir: PathBuf,
    /// Paths in the report are written relative to this (the report's own folder).
    pub base: PathBuf,
    /// Fidelity runs.
    pub fidelity: Vec<Source<FidelityDoc>>,
    /// Calibration summaries.
    pub calibration: Vec<Source<CalibrationSummary>>,
    /// Offload-step timings.
    pub offload: Vec<Source<OffloadBench>>,
    /// RULER-style runs.
    pub ruler: Vec<Source<RulerDoc>>,
    /// Agent-step runs.
    pub agent: Vec<Source<AgentDoc>>,
    /// CPU runtime speed tables.
    pub speed: Vec<Source<ModelSpeed>>,
    /// End-to-end decode throughput runs (`fathom decode-bench`).
    pub decode: Vec<Source<fathom_results::decode_bench::DecodeBench>>,
    /// The PyTorch path's runs (`python -m fathom.bench_hf`).
    pub bench_hf: Vec<Source<fathom_results::bench_hf::BenchHf>>,
    /// GPU-against-CPU parity runs (`fathom gpu-parity`), also listed in `others`.
    pub gpu_parity: Vec<Source<fathom_results::parity::GpuParity>>,
    /// JSON files that are no result document, with why (listed, never read as results;
    /// calibration files, the runs' inputs, are skipped).
    pub others: Vec<(PathBuf, String)>,
    /// The stage log, when one was given.
    pub stages: Vec<StageRecord>,
}

impl Inputs {
    /// Whether `p` is a current result: a file at the top of its topic folder (at most one
    /// folder below the results directory: `device/offload-….json`, `full/….json`) or of a
    /// run of `cargo xtask repro` (`full/<setting>/….json`). Deeper folders hold studies and
    /// history (A/B runs, sweeps, earlier attempts), which the report lists briefly.
    pub fn is_current(&self, p: &Path) -> bool {
        let rel = p.strip_prefix(&self.dir).unwrap_or(p);
        let depth = rel.components().count().saturating_sub(1);
        let run = rel
            .components()
            .next()
            .is_some_and(|c| c.as_os_str() == "full" || c.as_os_str() == "quick");
        depth <= 1 || run && depth <= 2
    }

    /// `p` relative to the report's folder.
    pub fn rel(&self, p: &Path) -> String {
        p.strip_prefix(&self.base)
            .unwrap_or(p)
            .display()
            .to_string()
    }
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), ReportError> {
    let rd = std::fs::read_dir(dir).map_err(|source| ReportError::Io {
        path: dir.into(),
        source,
    })?;
    let mut entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, out)?;
        } else if p.extension().is_some_and(|e| e == "json") {
            out.push(p);
        }
    }
    Ok(())
}

/// Reads every `*.json` under `dir` (recursively) and the stage log `stages`, if given.
/// `base` is the folder the report will be written to (its links are relative to it).
///
/// A file that is JSON but no result document (a calibration file, a comparison table) is
/// listed in [`Inputs::others`]; a result document that does not fit its schema, or a
/// file that is not JSON at all, is an error naming the file: a report never silently drops a
/// result. A calibration summary is read in place of the calibration beside it.
pub fn collect(dir: &Path, stages: Option<&Path>, base: &Path) -> Result<Inputs, ReportError> {
    let mut files = Vec::new();
    walk(dir, &mut files)?;
    let mut inp = Inputs {
        dir: dir.into(),
        base: base.into(),
        ..Inputs::default()
    };
    for path in files {
        match fathom_results::read(&path) {
            Ok(doc) => {
                macro_rules! push {
                    ($list:ident, $d:expr) => {
                        inp.$list.push(Source {
                            path: path.clone(),
                            doc: $d,
                        })
                    };
                }
                match doc {
                    Document::Fidelity(d) => push!(fidelity, d),
                    Document::CalibrationSummary(d) => push!(calibration, d),
                    Document::OffloadBench(d) if d.study == OffloadStudy::Main => {
                        push!(offload, d)
                    }
                    // Sweeps and experiment switches are records, not claims: listed with
                    // their command, never judged against a target.
                    Document::OffloadBench(d) => inp.others.push((
                        path.clone(),
                        format!(
                            "offload-bench, study `{}`{} (not judged against the targets): `{}`",
                            d.study.as_str(),
                            if d.engine.is_retired() {
                                format!(", {} (history)", d.engine.label())
                            } else {
                                String::new()
                            },
                            d.command
                        ),
                    )),
                    // A run of dense and exact alone (a task-shape probe) has no sparse
                    // method to judge: listed with its dense scores, not read as a claim.
                    Document::Ruler(d)
                        if d.header
                            .methods
                            .iter()
                            .all(|m| m == "dense" || m == "exact") =>
                    {
                        inp.others.push((path.clone(), dense_probe_line(&d)))
                    }
                    Document::Ruler(d) => push!(ruler, d),
                    Document::AgentSteps(d) => push!(agent, d),
                    Document::ModelSpeed(d) => push!(speed, d),
                    Document::Stage(_) => inp
                        .others
                        .push((path.clone(), "a single stage record".into())),
                    Document::DecodeBench(d) => push!(decode, d),
                    Document::BenchHf(d) => push!(bench_hf, d),
                    Document::GpuParity(d) => {
                        push!(gpu_parity, d.clone());
                        inp.others.push((
                        path.clone(),
                        format!(
                            "GPU-against-CPU parity of {} on {}: {} of {} prompts' greedy tokens identical, {} diverge at a near-tie; GPU from f32 at most {:.2}× the CPU bf16 forward's distance (limit {}×): {}",
                            d.model,
                            d.device.name,
                            d.report.identical,
                            d.report.prompts.len(),
                            d.report.explained_by_ties,
                            d.report.worst_ratio,
                            d.report.noise_factor,
                            if d.report.pass { "pass" } else { "fail" }
                        ),
                    ))
                    }
                }
            }
            Err(ResultsError::NotAResult { why, .. }) => inp.others.push((path, why)),
            // Inputs (calibration files, git-ignored) are not results: the report does not
            // depend on whether they are present.
            Err(ResultsError::Input { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    if let Some(st) = stages {
        inp.stages = fathom_results::stages::read_stage_log(st)?;
    }
    Ok(inp)
}

/// The line that lists a dense-only RULER run (a task-shape probe): its model, context,
/// shape, seed and dense score per task.
fn dense_probe_line(d: &RulerDoc) -> String {
    let scores: Vec<String> = d
        .tasks
        .iter()
        .map(|t| {
            let dense = d
                .summary
                .get(t)
                .and_then(|s| s.methods.get("dense"))
                .map_or("—".to_string(), |m| format!("{:.2}", m.score));
            format!("{t} {dense}")
        })
        .collect();
    format!(
        "a dense-only task probe of {} at {} tokens (shape: {}; seed {}; {} samples per task), no sparse method to judge: dense {}",
        d.header.model,
        d.header.context,
        d.shape.as_deref().unwrap_or("ruler"),
        d.header.seed,
        d.samples_per_task,
        scores.join(", ")
    )
}

/// When and from what tree a report was rendered (the only words of it that the results do
/// not determine).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stamp {
    /// `2026-12-06` (UTC).
    pub date: String,
    /// The commit of the tree it was rendered in (`abc1234`), `unknown` outside git.
    pub commit: String,
}

impl Stamp {
    /// The stamp line of a rendered report, read back (`None` if it has none).
    pub fn read(report: &str) -> Option<Stamp> {
        let line = report.lines().find(|l| l.contains(STAMP_PREFIX))?;
        let (_, rest) = line.split_once(STAMP_PREFIX)?;
        let (date, commit) = rest.split_once(" from the tree at ")?;
        Some(Stamp {
            date: date.to_string(),
            commit: commit.trim_end_matches('.').to_string(),
        })
    }
}

const STAMP_PREFIX: &str = "Rendered on ";

/// The machines the results were measured on, from the documents that name theirs.
pub fn machines(inp: &Inputs) -> Vec<String> {
    let mut m: Vec<String> = Vec::new();
    let mut add = |x: String| {
        if !m.contains(&x) {
            m.push(x)
        }
    };
    for o in &inp.offload {
        if let Some(d) = &o.doc.device {
            add(format!("{} (offload step)", d.name));
        }
    }
    for d in &inp.decode {
        add(format!("{} (decode throughput)", d.doc.device.name));
    }
    for b in &inp.bench_hf {
        add(format!("{} (PyTorch path)", b.doc.device));
    }
    for sp in &inp.speed {
        add(format!(
            "{}, {} cores (CPU model runtime)",
            sp.doc.cpu, sp.doc.cores
        ));
    }
    m
}

/// Renders the whole report: the summary (stamp, machines, the claims table of
/// [`summary::claims_table`] and how closely a re-run reproduces the numbers), every claim
/// of [`claims::CLAIMS`] in order, then [`sections`]' ablations, CPU speed and decode
/// throughput, [`torch_path`]'s PyTorch path, memory and other files, and the stage log
/// appendix.
pub fn render(inp: &Inputs, stamp: &Stamp) -> String {
    let mut s = String::new();
    s.push_str("# Fathom: reproduction report\n\n");
    s.push_str(&format!(
        "Generated by `fathom report --dir {}` from the JSON files beside this report. Every table names the JSON it came from; each JSON holds the command line that produced it. {STAMP_PREFIX}{} from the tree at {}.\n\n",
        inp.dir.display(),
        stamp.date,
        stamp.commit
    ));
    s.push_str("## Summary\n\n");
    s.push_str(&format!(
        "Machines: {}; fidelity, calibration and the downstream runs marked CPU on x86-64 CPUs.\n\n",
        machines(inp).join("; ")
    ));
    s.push_str("Each claim of the paper and each target of ours, from the current results (files at the top of their topic folder; sub-folders hold studies and history, listed in the sections below):\n\n");
    s.push_str(&summary::claims_table(inp, ""));
    s.push_str(&format!(
        "\n**Reproducing these numbers.** The CPU results are not bit-identical across CPUs: a capture's model forward and the scans' f32 reductions sum in a different order under different instruction sets. A re-run of `cargo xtask repro --quick` on another x86-64 machine changed the fidelity errors in the 4th–5th significant digit (fathom:24 on SmolLM2 at 2k: 1.2750e-1 against 1.2751e-1). A re-run reproduces each method's mean error and bits within a relative {:.0e} (`fathom_report::summary::REPRO_REL_TOL`); `cargo test` checks the demo's numbers on the embedded capture against their committed copy within it. Equal-error savings are read off interpolated curves and can move in their last printed digit. Device timings vary from run to run; their intervals over rounds say by how much.\n\n",
        summary::REPRO_REL_TOL
    ));
    for c in claims::CLAIMS {
        s.push_str(&format!("## {}: {}\n\n", c.id, c.title));
        s.push_str(&format!("Paper: {}\n\n", (c.paper)()));
        (c.render)(inp, &mut s);
    }
    sections::ablations(inp, &mut s);
    sections::cpu_speed(inp, &mut s);
    sections::decode_throughput(inp, &mut s);
    torch_path::pytorch_path(inp, &mut s);
    sections::memory(inp, &mut s);
    sections::others(inp, &mut s);
    sections::stage_log(inp, &mut s);
    s
}

/// A throughput curve's group: (model, residency, real weights).
pub type CurveKey = (String, String, bool);
/// A point of a throughput curve: (method, x, tokens/s).
pub type CurvePoint = (String, usize, f64);

/// The points of the decode-throughput plot against context: per (model, residency, weights
/// kind), the one-session entries (B = 1) of every `decode-bench` run, as `(method, context,
/// tokens_per_s)`; groups with fewer than two contexts are left out. Sorted by key.
pub fn decode_context_points(inp: &Inputs) -> Vec<(CurveKey, Vec<CurvePoint>)> {
    let mut groups: std::collections::BTreeMap<CurveKey, Vec<CurvePoint>> = Default::default();
    for d in &inp.decode {
        let v = &d.doc;
        let key = (
            v.model.clone(),
            v.residency.clone(),
            v.weights.starts_with("real"),
        );
        for e in v.entries.iter().filter(|e| e.batch == 1) {
            if let Some(&n) = e.contexts.first() {
                groups
                    .entry(key.clone())
                    .or_default()
                    .push((e.method.clone(), n, e.tokens_per_s));
            }
        }
    }
    groups
        .into_iter()
        .filter(|(_, pts)| {
            let mut c: Vec<usize> = pts.iter().map(|p| p.1).collect();
            c.sort_unstable();
            c.dedup();
            c.len() >= 2
        })
        .collect()
}

/// Draws, into `dir`, one `decode-<model>-<residency>-tokens-vs-context.png` per group of
/// [`decode_context_points`]; returns the files written.
///
/// # Errors
/// A plot that cannot be drawn (no font) or written.
pub fn write_decode_plots(inp: &Inputs, dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    let mut out = Vec::new();
    for ((model, residency, real), pts) in decode_context_points(inp) {
        let path = dir.join(format!("decode-{model}-{residency}-tokens-vs-context.png"));
        let title = format!(
            "{model}: decode tokens/s of one session against its context (pages in {residency}; {})",
            if real { "real weights" } else { "random weights, synthetic K/V" }
        );
        plot::tokens_vs_context(&pts, &title, &path)?;
        out.push(path);
    }
    Ok(out)
}

/// [`collect`], [`render`] and an atomic write of the report to `out`.
pub fn write_report(
    dir: &Path,
    stages: Option<&Path>,
    out: &Path,
    stamp: &Stamp,
) -> Result<(), ReportError> {
    let base = out
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let inp = collect(dir, stages, &base)?;
    fathom_store::write_atomic(out, render(&inp, stamp).as_bytes()).map_err(|e| ReportError::Io {
        path: out.into(),
        source: std::io::Error::other(e.to_string()),
    })
}
