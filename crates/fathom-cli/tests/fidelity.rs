//! End to end: calibrate and fidelity on a small (synthetic, labelled) capture fixture; the
//! JSON matches the fidelity schema.

use std::process::Command;

use fathom_bench::capture::capture_bytes;
use fathom_bench::synthetic::{generate, SyntheticParams};
use fathom_bench::tensors::WriteDtype;

fn fathom(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fathom"))
        .args(args)
        .output()
        .expect("run fathom");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn calibrate_then_fidelity_writes_schema_json() {
    let dir = tempfile::tempdir().unwrap();
    let p = |s: &str| dir.path().join(s).display().to_string();
    let (info, layers) = generate(&SyntheticParams {
        layers: 2,
        hkv: 1,
        g: 2,
        d: 64,
        n: 700,
        p: 4,
        ..Default::default()
    });
    std::fs::write(
        p("cap.safetensors"),
        capture_bytes(&info, &layers, WriteDtype::F16).unwrap(),
    )
    .unwrap();
    let (ok, _, err) = fathom(&[
        "calibrate",
        "--capture",
        &p("cap.safetensors"),
        "--out",
        &p("cal.json"),
        "--targets",
        "48",
        "--k",
        "32",
        "--quantum",
        "8",
    ]);
    assert!(ok, "{err}");
    let (ok, out, err) = fathom(&[
        "fidelity", "--capture", &p("cap.safetensors"), "--calib", &p("cal.json"), "--k", "32",
        "--methods", "dense,exact,fathom-sweep:16-160/16,fathom-layer:48,fathom-uniform:48,sparq:16,sparq:32,sparq-union:16,ds:32,loki:32,loki-f16:8,thumb2,landmark,quest",
        "--json", &p("out.json"), "--plot", &p("out.png"),
    ]);
    assert!(ok, "{err}");
    let png = std::fs::read(p("out.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(out.contains("| method |"), "{out}");
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(p("out.json")).unwrap()).unwrap();
    assert!(v["capture"].is_string());
    assert_eq!(v["k"], 32);
    assert_eq!(v["positions"], 4);
    let methods = v["methods"].as_array().unwrap();
    assert_eq!(methods.len(), 2 + 10 + 11);
    for m in methods {
        assert!(m["name"].is_string() && m["bits"].is_f64() && m["error"].is_f64());
        assert_eq!(m["per_layer"].as_array().unwrap().len(), 2);
    }
    assert_eq!(methods[0]["error"], 0.0, "dense has zero error");
    let eq = v["equal_error"].as_array().unwrap();
    // sparq:32, ds:32 and loki:32 at the fixed-bits convention; sparq:16 is r = D/4 at D = 64.
    let rows: Vec<(&str, &str)> = eq
        .iter()
        .map(|e| {
            (
                e["baseline"].as_str().unwrap(),
                e["convention"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("sparq:16", "r = D/4"),
            ("sparq:32", "r = 32 (136 bits)"),
            ("ds:32", "r = 32 (136 bits)"),
            ("loki:32", "r = 32 (136 bits)"),
        ]
    );
    for e in eq {
        let want = if e["baseline"] == "sparq:16" {
            68.0
        } else {
            136.0
        };
        assert_eq!(e["baseline_bits"].as_f64(), Some(want), "{e}");
        assert!(e["fathom_bits"].is_f64() || e["fathom_bits"].is_null());
        assert!(e["saving"].is_f64() || e["saving"].is_null());
        assert!(
            e["lower_bound"].is_boolean() || e["fathom_bits"].is_null(),
            "{e}"
        );
        if let Some(ci) = e["saving_ci95"].as_array() {
            let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
            assert!(lo <= hi, "{e}");
        }
    }
    for m in methods {
        assert_eq!(m["per_position"].as_array().unwrap().len(), 4);
        assert!(m["error_se"].as_f64().unwrap() >= 0.0);
    }
    // Bad input: fathom-layer at an uncalibrated target, k larger than n.
    let (ok, _, err) = fathom(&[
        "fidelity",
        "--capture",
        &p("cap.safetensors"),
        "--calib",
        &p("cal.json"),
        "--methods",
        "fathom-layer:64",
    ]);
    assert!(
        !ok && err.contains("no per-layer budgets for target 64"),
        "{err}"
    );
    let (ok, _, err) = fathom(&[
        "fidelity",
        "--capture",
        &p("cap.safetensors"),
        "--methods",
        "exact",
        "--k",
        "5000",
    ]);
    assert!(!ok && err.contains("--k 5000"), "{err}");
}
