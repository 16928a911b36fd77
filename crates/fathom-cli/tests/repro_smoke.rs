//! Smoke test of the `cargo xtask repro` pipeline on the tiny committed fixture: the
//! same `fathom` stages `--quick` runs after its captures (calibrate, fidelity with a plot, the
//! ablation sweep, a second k, the model-free part of the report), with quick-like settings,
//! then checks that the report and every JSON file exist and parse. The fixture is the embedded
//! real SmolLM2 capture (2k tokens, 16 positions), so no model download is needed.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fathom_try(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fathom"))
        .args(args)
        .output()
        .expect("running fathom");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn fathom(args: &[&str]) {
    let (ok, err) = fathom_try(args);
    assert!(ok, "fathom {} failed: {err}", args.join(" "));
}

fn json(p: &Path) -> serde_json::Value {
    let bytes = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{} does not parse: {e}", p.display()))
}

#[test]
fn quick_like_pipeline_on_the_fixture_writes_a_report_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cap: PathBuf = d.join("fixture-eval-2k.safetensors");
    std::fs::write(
        &cap,
        include_bytes!("../data/smollm2-prose-eval-2k.safetensors"),
    )
    .unwrap();
    let run = d.join("quick").join("fixture-2k");
    std::fs::create_dir_all(&run).unwrap();
    let p = |name: &str| run.join(name).to_string_lossy().into_owned();
    let capture = cap.to_string_lossy().into_owned();
    let calib = p("calibration.json");
    // The stages of xtask's pipeline, in its order (the fixture stands in for both captures).
    fathom(&[
        "calibrate",
        "--capture",
        &capture,
        "--out",
        &calib,
        "--targets",
        "48,64",
        "--k",
        "64",
    ]);
    let main_args = [
        "fidelity", "--capture", &capture, "--calib", &calib, "--methods",
        "dense,exact,fathom-sweep:24-136/16,fathom-layer:48,fathom-uniform:48,sparq:16,sparq:32,sparq-union:16,ds:32,loki:32,thumb2,landmark,quest",
        "--k", "64", "--json", &p("fidelity.json"),
    ];
    let plot = p("fidelity.png");
    let mut with_plot = main_args.to_vec();
    with_plot.extend(["--plot", plot.as_str()]);
    fathom(&with_plot);
    fathom(&[
        "fidelity",
        "--capture",
        &capture,
        "--calib",
        &calib,
        "--methods",
        "exact,fathom-raw:48,fathom-klt:48,fathom-blockmax:48,loki:32,loki-f16:32",
        "--k",
        "64",
        "--json",
        &p("ablations.json"),
    ]);
    fathom(&[
        "fidelity",
        "--capture",
        &capture,
        "--calib",
        &calib,
        "--methods",
        "exact,fathom:48,sparq:32,ds:32",
        "--k",
        "128",
        "--json",
        &p("k128.json"),
    ]);
    let stages = d.join("quick").join("stages.jsonl");
    std::fs::write(
        &stages,
        "{\"stage\": \"fixture: fidelity\", \"ok\": true, \"seconds\": 1.0, \"command\": \"fathom fidelity ...\", \"error\": \"\", \"skipped\": \"\"}\n\
         {\"stage\": \"fixture: ruler\", \"ok\": true, \"seconds\": 0.0, \"command\": \"fathom ruler ...\", \"error\": \"\", \"skipped\": \"time budget\"}\n",
    )
    .unwrap();
    let report = d.join("REPORT.md");
    fathom(&[
        "report",
        "--dir",
        &d.to_string_lossy(),
        "--out",
        &report.to_string_lossy(),
        "--stages",
        &stages.to_string_lossy(),
    ]);

    // Every JSON parses; the fidelity ones have the fidelity schema.
    for name in ["fidelity.json", "ablations.json", "k128.json"] {
        let v = json(&run.join(name));
        assert!(
            v["capture"].is_string() && v["k"].is_u64() && v["positions"].is_u64(),
            "{name}"
        );
        let methods = v["methods"].as_array().expect("methods");
        assert!(!methods.is_empty(), "{name}");
        for m in methods {
            assert!(
                m["name"].is_string() && m["bits"].is_f64() && m["error"].is_f64(),
                "{name}: {m}"
            );
            assert!(m["per_layer"].is_array(), "{name}: {m}");
        }
        assert!(v["equal_error"].is_array(), "{name}");
    }
    let c = json(&run.join("calibration.json"));
    assert!(
        c["basis_rule"].is_object(),
        "calibration has the basis rule"
    );
    // The plot is a PNG.
    let png = std::fs::read(run.join("fidelity.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    // The report exists, has every claim section, names its JSON and the skipped stage.
    let text = std::fs::read_to_string(&report).unwrap();
    // Claims first, in order; the stage log is the appendix.
    let mut at = 0;
    for section in [
        "## Claim 1",
        "## Claim 2",
        "## Claim 3",
        "## Claim 4",
        "## Claim 5",
        "## Claim 6",
        "## Memory",
        "## Appendix: stage log",
    ] {
        let i = text[at..]
            .find(section)
            .unwrap_or_else(|| panic!("REPORT.md lacks {section:?} after byte {at}"));
        at += i + section.len();
    }
    assert!(text.contains("fidelity.json"), "the report names its JSON");
    assert!(
        text.contains("not run: time budget"),
        "skipped stages are reported"
    );
}
