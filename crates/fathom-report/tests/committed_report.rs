//! The committed report and the two tables rendered from the same results (the claims table
//! of `results/README.md`, the headline table of `README.md`) are current. Alone in its test
//! binary: it renders from the repository root (the report's paths are relative to it), so it
//! changes the process's working directory, which no other test may share.
//!
//! `FATHOM_BLESS=1 cargo test -p fathom-report --test committed_report` rewrites the three
//! files instead of checking them, keeping the report's stamp unless `FATHOM_REPORT_DATE`
//! and `FATHOM_REPORT_COMMIT` give a new one; `fathom report` does the same with its
//! `--index` and `--readme` flags.

use std::path::Path;

use fathom_report::summary::{self, INDEX_MARKERS, README_MARKERS};

fn first_difference(a: &str, b: &str) -> usize {
    a.lines()
        .zip(b.lines())
        .position(|(x, y)| x != y)
        .unwrap_or(0)
        + 1
}

/// `results/REPORT.md` is what `fathom report` renders from the committed results today, and
/// the tables of `results/README.md` and `README.md` are what it splices into them: a result
/// changed without re-rendering fails here.
#[test]
fn the_committed_report_and_tables_are_rendered_from_the_committed_results() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // `collect` resolves paths relative to the working directory: run from the root.
    std::env::set_current_dir(&root).unwrap();
    let committed = std::fs::read_to_string("results/REPORT.md").unwrap();
    let mut stamp = fathom_report::Stamp::read(&committed).unwrap_or_default();
    if let (Ok(date), Ok(commit)) = (
        std::env::var("FATHOM_REPORT_DATE"),
        std::env::var("FATHOM_REPORT_COMMIT"),
    ) {
        stamp = fathom_report::Stamp { date, commit };
    }
    let inp = fathom_report::collect(
        Path::new("results"),
        Some(Path::new("results/full/stages.jsonl")),
        Path::new("results"),
    )
    .unwrap();
    let bless = std::env::var_os("FATHOM_BLESS").is_some();
    let md = fathom_report::render(&inp, &stamp);
    let index = std::fs::read_to_string("results/README.md").unwrap();
    let index_new = summary::splice(
        &index,
        INDEX_MARKERS,
        &summary::claims_table(
            &inp,
            &summary::prefix_to(Path::new("results/README.md"), Path::new("results")),
        ),
    )
    .unwrap();
    let readme = std::fs::read_to_string("README.md").unwrap();
    let readme_new = summary::splice(
        &readme,
        README_MARKERS,
        &summary::headline_table(
            &inp,
            &summary::prefix_to(Path::new("README.md"), Path::new("results")),
        ),
    )
    .unwrap();
    if bless {
        std::fs::write("results/REPORT.md", &md).unwrap();
        std::fs::write("results/README.md", &index_new).unwrap();
        std::fs::write("README.md", &readme_new).unwrap();
        return;
    }
    let fix = "re-run `fathom report --dir results --out results/REPORT.md --stages results/full/stages.jsonl --index results/README.md --readme README.md`";
    assert!(
        md == committed,
        "results/REPORT.md is stale from line {}: {fix}",
        first_difference(&md, &committed)
    );
    assert!(
        index_new == index,
        "the claims table of results/README.md is stale from line {}: {fix}",
        first_difference(&index_new, &index)
    );
    assert!(
        readme_new == readme,
        "the headline table of README.md is stale from line {}: {fix}",
        first_difference(&readme_new, &readme)
    );
}
