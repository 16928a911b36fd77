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
    spec_states_the_budget_rule(&inp);
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

/// docs/SPEC.md §4 tells users which budget per channel to pick ("pick `x ≥ X` bits per
/// channel; `fathom:Yc` meets it"): `X` must be the rule the committed judged settings support
/// rounded up to two decimals, and `Y` at least that rule. A judged run that moves the rule
/// fails here until the SPEC (and the CLI help that cites it) says the new one.
fn spec_states_the_budget_rule(inp: &fathom_report::Inputs) {
    use fathom_results::judged::budget::Rule;
    let spec = std::fs::read_to_string("docs/SPEC.md").unwrap();
    let head = "**The budget rule: pick `x ≥ ";
    let line = spec
        .lines()
        .find(|l| l.starts_with(head))
        .expect("docs/SPEC.md §4 states the budget rule");
    let number = |s: &str| s.parse::<f32>().unwrap_or_else(|e| panic!("{s:?}: {e}"));
    let rest = &line[head.len()..];
    let x = number(&rest[..rest.find('`').unwrap()]);
    let y = rest
        .split("`fathom:")
        .nth(1)
        .and_then(|t| t.split("c` meets it").next());
    let y = number(y.expect("the rule names a `fathom:Yc` that meets it"));
    let Rule::Stated { per_channel, .. } = fathom_report::downstream::judged_budget_rule(inp)
    else {
        panic!("docs/SPEC.md states a budget rule, but the judged results support none");
    };
    let rounded = (per_channel * 100.0).ceil() / 100.0;
    assert!(
        (x - rounded).abs() < 1e-4,
        "docs/SPEC.md §4 says x ≥ {x}; the judged results give {per_channel} (≥ {rounded})"
    );
    assert!(
        y >= per_channel,
        "docs/SPEC.md §4's fathom:{y}c is below the rule {per_channel}"
    );
}
