//! The committed report is current. Alone in its test binary: it renders from the repository
//! root (the report's paths are relative to it), so it changes the process's working
//! directory, which no other test may share.

use std::path::Path;

/// `results/REPORT.md` is what `fathom report` renders from the committed results today: a
/// result changed without re-rendering the report fails here.
#[test]
fn the_committed_report_is_rendered_from_the_committed_results() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let results = root.join("results");
    let committed = std::fs::read_to_string(results.join("REPORT.md")).unwrap();
    let inp = fathom_report::collect(
        Path::new("results"),
        Some(&results.join("full/stages.jsonl")),
        Path::new("results"),
    );
    // `collect` resolves paths relative to the working directory: run from the root.
    let inp = inp.or_else(|_| {
        std::env::set_current_dir(&root).unwrap();
        fathom_report::collect(
            Path::new("results"),
            Some(Path::new("results/full/stages.jsonl")),
            Path::new("results"),
        )
    });
    let md = fathom_report::render(&inp.unwrap());
    if md != committed {
        let line = md
            .lines()
            .zip(committed.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        panic!(
            "results/REPORT.md is stale from line {}: re-run `fathom report --dir results --out results/REPORT.md --stages results/full/stages.jsonl`",
            line + 1
        );
    }
}
