//! Every result JSON committed under `results/` parses into its typed struct, and every
//! stage log parses line by line. JSON that is no result document (a calibration file, a
//! comparison table made by `scripts/analysis/compare_equal_error.py`, a device measurement of a
//! `fathom-cuda` example under `results/device/engine/`, the soak's report and the A/B
//! comparisons under `results/device/pipeline/`, an interrupted run's records) is refused as
//! such, never read as one.

use std::path::{Path, PathBuf};

use fathom_results::{read, stages::read_stage_log, Document, ResultsError};

fn walk(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, ext, out);
        } else if p.extension().is_some_and(|x| x == ext) {
            out.push(p);
        }
    }
}

fn results_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../results")
}

#[test]
fn every_committed_result_parses() {
    let mut files = Vec::new();
    walk(&results_dir(), "json", &mut files);
    assert!(files.len() >= 40, "only {} JSON files found", files.len());
    let mut kinds = std::collections::BTreeMap::<&str, usize>::new();
    for p in &files {
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        match read(p) {
            Ok(doc) => {
                *kinds.entry(doc.kind()).or_default() += 1;
                if let Document::Fidelity(f) = &doc {
                    assert!(!f.methods.is_empty(), "{}", p.display());
                }
            }
            Err(ResultsError::Input { .. }) if name == "calibration.json" => {}
            Err(ResultsError::NotAResult { .. })
                if name.starts_with("equal-error-")
                    || p.parent().is_some_and(|d| d.ends_with("device/engine"))
                    // The `graph_step` example's own line (examples/graph_step.rs).
                    || name.starts_with("graph-step-")
                    // The Python package's own outputs (kind `fathom-py-…`).
                    || name.starts_with("generate-example")
                    // An interrupted run's records (`"complete": false`, no header).
                    || name.ends_with("-interrupted.json")
                    // The PyTorch path's device run: its generation comparisons and soak.
                    || p.parent().is_some_and(|d| d.ends_with("python/torch-path"))
                    // The soak example's report and scripts/analysis/ab_compare.py's tables.
                    || p.parent().is_some_and(|d| d.ends_with("device/pipeline"))
                        && (name.starts_with("soak-") || name.ends_with("-compare.json")) => {}
            Err(e) => panic!("{e}"),
        }
    }
    for k in [
        "fidelity",
        "calibration-summary",
        "offload-bench",
        "ruler",
        "agent-steps",
        "model-speed",
    ] {
        assert!(
            kinds.get(k).copied().unwrap_or(0) > 0,
            "no committed `{k}` document: {kinds:?}"
        );
    }
}

#[test]
fn every_committed_stage_log_parses() {
    let mut logs = Vec::new();
    walk(&results_dir(), "jsonl", &mut logs);
    assert!(!logs.is_empty());
    for p in &logs {
        let recs = read_stage_log(p).unwrap_or_else(|e| panic!("{e}"));
        assert!(!recs.is_empty(), "{}", p.display());
    }
}

#[test]
fn documents_round_trip_through_write_and_read() {
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    walk(&results_dir(), "json", &mut files);
    for p in files.iter().take(80) {
        if let Ok(doc) = read(p) {
            let out = dir.path().join("x.json");
            fathom_results::write(&out, doc.clone()).unwrap();
            assert_eq!(read(&out).unwrap(), doc, "{}", p.display());
        }
    }
}
