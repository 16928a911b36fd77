//! A re-run reproduces the committed numbers within the tolerance the report states
//! (`fathom_report::summary::REPRO_REL_TOL`): the demo on the embedded real capture, run on
//! this machine, against its committed copy `tests/data/demo-embedded.json` (written by
//! `fathom demo --json` on the machine named in `tests/data/PROVENANCE.md`). The CPU path is
//! not bit-identical across instruction sets, so the check is a tolerance, not equality.

use std::process::Command;

use fathom_report::summary::{departures, REPRO_REL_TOL};
use fathom_results::{read, Document};

#[test]
fn the_demo_reproduces_its_committed_numbers_within_the_stated_tolerance() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("demo.json");
    let run = Command::new(env!("CARGO_BIN_EXE_fathom"))
        .args(["demo", "--json"])
        .arg(&out)
        .output()
        .expect("run fathom");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let golden =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/demo-embedded.json");
    let (Document::Fidelity(committed), Document::Fidelity(rerun)) =
        (read(&golden).unwrap(), read(&out).unwrap())
    else {
        panic!("the demo writes a fidelity document");
    };
    let moved = departures(&committed, &rerun, REPRO_REL_TOL);
    assert!(
        moved.is_empty(),
        "the demo moved past {REPRO_REL_TOL:e} relative: {moved:#?}"
    );
}
