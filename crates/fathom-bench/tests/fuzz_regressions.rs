//! Calibration files the `calib` fuzz target (`fuzz/fuzz_targets/calib.rs`) and its review
//! turned up, kept as regression tests: each must be rejected with an error, not a panic.

use fathom_bench::calib::Calibration;

fn load(json: &str) -> Result<Calibration, String> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.json");
    std::fs::write(&p, json).unwrap();
    Calibration::load(&p).map_err(|e| e.to_string())
}

fn doc(d: &str, klt: &str, budgets: &str) -> String {
    format!(
        r#"{{"format":"fathom-calibration","version":1,"model":"m","capture":"c","n":8,"hkv":1,"g":1,"d":{d},
        "layers":[0],"heads":[[{{"sigma2":[1.0,1.0],"mean_sq_blockmax":[1.0,1.0],"klt":{klt},"klt_sigma2":[],"loki":[],"ds_channels":[0,1]}}]],
        "budgets":{budgets},"basis_rule":null}}"#
    )
}

#[test]
fn the_baseline_loads() {
    load(&doc(
        "2",
        "[1,0,0,1]",
        r#"[{"target":4.0,"basis":"Raw","per_layer":[4.0]}]"#,
    ))
    .unwrap();
}

#[test]
fn a_huge_d_is_an_error_not_an_overflow() {
    // d · d overflowed usize before the check.
    let e = load(&doc("8589934592", "[1,0,0,1]", "[]")).unwrap_err();
    assert!(e.contains("inconsistent"), "{e}");
}

#[test]
fn budgets_outside_0_to_max_are_errors() {
    for b in ["-1.0", "9.5", "1e30"] {
        let e = load(&doc(
            "2",
            "[]",
            &format!(r#"[{{"target":4.0,"basis":"Raw","per_layer":[{b}]}}]"#),
        ))
        .unwrap_err();
        assert!(e.contains("outside [0, 8.5]"), "{b}: {e}");
    }
    let e = load(&doc(
        "2",
        "[]",
        r#"[{"target":-3.0,"basis":"Raw","per_layer":[]}]"#,
    ))
    .unwrap_err();
    assert!(e.contains("outside"), "{e}");
}
