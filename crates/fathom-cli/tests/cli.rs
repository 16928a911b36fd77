//! The CLI contracts (README's CLI section), run against the built `fathom` binary.

use std::path::Path;
use std::process::Command;

use fathom_bench::tensors::{to_safetensors, TensorFile, WriteDtype};

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

/// A failure: non-zero exit, one line naming `needle`, no panic.
fn fails_with(args: &[&str], needle: &str) {
    let (ok, _, err) = fathom(args);
    assert!(!ok, "{args:?} should fail");
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{args:?} panicked: {err}"
    );
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?}: not one line: {err}"
    );
    assert!(
        err.contains(needle),
        "{args:?}: message lacks {needle:?}: {err}"
    );
}

fn write(path: &Path, tensors: &[(&str, &[f32], &[usize])], dtype: WriteDtype) {
    std::fs::write(path, to_safetensors(tensors, dtype, None).unwrap()).unwrap();
}

fn keys(n: usize, d: usize) -> Vec<f32> {
    (0..n * d)
        .map(|i| (((i * 2654435761) % 1000) as f32 / 100.0) - 5.0)
        .collect()
}

#[test]
fn quantize_info_dequant_roundtrip() {
    let dir = tempfile::tempdir().unwrap();
    let p = |s: &str| dir.path().join(s).display().to_string();
    let (n, d) = (130, 128);
    let k = keys(n, d);
    write(
        Path::new(&p("k.safetensors")),
        &[("k", &k, &[n, d])],
        WriteDtype::F16,
    );
    let (ok, _, err) = fathom(&[
        "store",
        "quantize",
        "--keys",
        &p("k.safetensors"),
        "--tensor",
        "k",
        "--out",
        &p("s.fks"),
    ]);
    assert!(ok, "{err}");
    let (ok, out, err) = fathom(&["store", "info", "--store", &p("s.fks"), "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["tokens"], 130);
    assert_eq!(v["kv_heads"], 1);
    assert_eq!(v["channels"], 128);
    assert_eq!(v["bytes_per_token_per_head"], 68.0);
    for t in 0..=4 {
        let o = p(&format!("deq{t}.safetensors"));
        let (ok, _, err) = fathom(&[
            "store",
            "dequant",
            "--store",
            &p("s.fks"),
            "--planes",
            &t.to_string(),
            "--out",
            &o,
        ]);
        assert!(ok, "{err}");
        let tf = TensorFile::open(Path::new(&o)).unwrap();
        let got = tf.read("keys", &[]).unwrap();
        assert_eq!(got.shape, vec![n, d]);
        // Same values as the library's prefix read of the same store.
        let store = fathom_store::MappedStore::open(Path::new(&p("s.fks"))).unwrap();
        assert_eq!(got.data, store.view().dequant_prefix(t).unwrap());
        if t == 0 {
            assert!(got.data.iter().all(|&x| x == 0.0));
        }
    }
    // [N, Hkv, D] in bf16 keeps its rank.
    let (h, d2) = (3, 64);
    let k3 = keys(70, h * d2);
    write(
        Path::new(&p("k3.safetensors")),
        &[("layers.0.k", &k3, &[70, h, d2])],
        WriteDtype::F32,
    );
    assert!(
        fathom(&[
            "store",
            "quantize",
            "--keys",
            &p("k3.safetensors"),
            "--tensor",
            "layers.0.k",
            "--out",
            &p("s3.fks")
        ])
        .0
    );
    assert!(
        fathom(&[
            "store",
            "dequant",
            "--store",
            &p("s3.fks"),
            "--planes",
            "2",
            "--out",
            &p("d3.safetensors")
        ])
        .0
    );
    let got = TensorFile::open(Path::new(&p("d3.safetensors")))
        .unwrap()
        .read("keys", &[])
        .unwrap();
    assert_eq!(got.shape, vec![70, h, d2]);
    let (_, out, _) = fathom(&["store", "info", "--store", &p("s3.fks"), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["bytes_per_token_per_head"], 34.0);
}

#[test]
fn plan_contract() {
    let dir = tempfile::tempdir().unwrap();
    let w: Vec<f32> = (0..2 * 128).map(|i| ((i % 17) as f32).powi(2)).collect();
    let path = dir.path().join("w.safetensors");
    write(&path, &[("w", &w, &[2, 128])], WriteDtype::F32);
    let ps = path.display().to_string();
    let (ok, out, err) = fathom(&[
        "plan",
        "--weights",
        &ps,
        "--tensor",
        "w",
        "--budget",
        "48",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let depths = v["depths"].as_array().unwrap();
    assert_eq!(depths.len(), 2);
    for (g, row) in depths.iter().enumerate() {
        let t: Vec<u64> = row
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(t.len(), 128);
        let bits =
            t.iter().sum::<u64>() as f64 + 0.25 * t.iter().filter(|&&x| x > 0).count() as f64;
        assert_eq!(v["bits"][g].as_f64().unwrap(), bits);
        assert!(bits <= 48.0);
    }
    fails_with(
        &[
            "plan",
            "--weights",
            &ps,
            "--tensor",
            "w",
            "--budget",
            "-1",
            "--json",
        ],
        "budget",
    );
    fails_with(
        &[
            "plan",
            "--weights",
            &ps,
            "--tensor",
            "w",
            "--budget",
            "545",
            "--json",
        ],
        "out of range",
    );
    fails_with(
        &[
            "plan",
            "--weights",
            &ps,
            "--tensor",
            "nope",
            "--budget",
            "48",
            "--json",
        ],
        "`nope` not found",
    );
}

#[test]
fn bad_input_gets_one_line_errors_and_no_partial_files() {
    let dir = tempfile::tempdir().unwrap();
    let p = |s: &str| dir.path().join(s).display().to_string();
    let mut k = keys(100, 8);
    write(
        Path::new(&p("ok.safetensors")),
        &[("k", &k, &[100, 8])],
        WriteDtype::F32,
    );
    k[37 * 8 + 5] = f32::NAN;
    write(
        Path::new(&p("nan.safetensors")),
        &[("k", &k, &[100, 8])],
        WriteDtype::F32,
    );
    write(
        Path::new(&p("r1.safetensors")),
        &[("k", &k[..8], &[8])],
        WriteDtype::F32,
    );
    let q = |input: &str, t: &str, out: &str| {
        vec![
            "store".to_string(),
            "quantize".into(),
            "--keys".into(),
            p(input),
            "--tensor".into(),
            t.into(),
            "--out".into(),
            p(out),
        ]
    };
    let run = |v: Vec<String>, needle: &str| {
        let refs: Vec<&str> = v.iter().map(String::as_str).collect();
        fails_with(&refs, needle);
    };
    run(q("nan.safetensors", "k", "x.fks"), "[37, 5]");
    run(
        q("ok.safetensors", "missing", "x.fks"),
        "`missing` not found",
    );
    run(q("r1.safetensors", "k", "x.fks"), "rank 2 or 3");
    run(q("absent.safetensors", "k", "x.fks"), "absent.safetensors");
    assert!(
        !Path::new(&p("x.fks")).exists(),
        "a failed quantize left an output file"
    );
    // Truncated and corrupt stores.
    assert!(
        fathom(&[
            "store",
            "quantize",
            "--keys",
            &p("ok.safetensors"),
            "--tensor",
            "k",
            "--out",
            &p("s.fks")
        ])
        .0
    );
    let good = std::fs::read(p("s.fks")).unwrap();
    std::fs::write(p("trunc.fks"), &good[..good.len() - 10]).unwrap();
    fails_with(
        &["store", "info", "--store", &p("trunc.fks"), "--json"],
        "truncated",
    );
    let mut bad = good.clone();
    bad[100] ^= 1;
    std::fs::write(p("flip.fks"), &bad).unwrap();
    fails_with(
        &[
            "store",
            "dequant",
            "--store",
            &p("flip.fks"),
            "--planes",
            "3",
            "--out",
            &p("o.safetensors"),
        ],
        "checksum",
    );
    assert!(!Path::new(&p("o.safetensors")).exists());
    fails_with(
        &[
            "store",
            "dequant",
            "--store",
            &p("s.fks"),
            "--planes",
            "5",
            "--out",
            &p("o.safetensors"),
        ],
        "--planes 5",
    );
    std::fs::write(p("empty.fks"), b"").unwrap();
    fails_with(&["store", "info", "--store", &p("empty.fks")], "empty.fks");
    // An unwritable output path.
    fails_with(
        &[
            "store",
            "quantize",
            "--keys",
            &p("ok.safetensors"),
            "--tensor",
            "k",
            "--out",
            "/nonexistent-dir/x.fks",
        ],
        "nonexistent-dir",
    );
}

#[test]
fn demo_runs_and_labels_synthetic() {
    let (ok, out, err) = fathom(&[
        "demo",
        "--synthetic",
        "--context",
        "512",
        "--k",
        "32",
        "--budgets",
        "32,64",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("SYNTHETIC"));
    assert!(out.contains("| fathom:32 |") && out.contains("| exact |"));
}

#[test]
fn demo_defaults_to_the_embedded_real_capture() {
    let (ok, out, err) = fathom(&["demo", "--budgets", "48"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("EMBEDDED REAL CAPTURE: smollm2-135m") && !out.contains("SYNTHETIC"),
        "{out}"
    );
    // Fathom at 48 bits ranks better than reading nothing: a finite error below 1.
    let line = out
        .lines()
        .find(|l| l.starts_with("| fathom:48 |"))
        .expect("fathom row");
    let e: f64 = line.split('|').nth(3).unwrap().trim().parse().unwrap();
    assert!(e > 0.0 && e < 1.0, "{line}");
}

/// Splits an example line as a shell would for these simple cases: whitespace, double quotes,
/// a trailing `# comment`, and leading `NAME=value` environment words.
fn example_args(line: &str) -> Vec<String> {
    let line = line.split("   #").next().unwrap_or(line);
    let (mut out, mut cur, mut quoted) = (Vec::new(), String::new(), false);
    for ch in line.chars() {
        match ch {
            '"' => quoted = !quoted,
            c if c.is_whitespace() && !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    let at = out
        .iter()
        .position(|w| w == "fathom")
        .expect("an example runs fathom");
    out.split_off(at + 1)
}

/// Every subcommand's help ends with examples, and every example's flags parse (each is run
/// with `--help` appended: clap refuses an unknown flag or value before it prints the help).
#[test]
fn every_command_has_examples_that_parse() {
    let (_, out, _) = fathom(&["--help"]);
    let mut commands: Vec<Vec<String>> = out
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .filter(|c| c != "help" && c != "store")
        .map(|c| vec![c])
        .collect();
    for sub in ["quantize", "dequant", "info"] {
        commands.push(vec!["store".into(), sub.into()]);
    }
    assert!(
        commands.len() > 10,
        "could not parse `fathom --help`:\n{out}"
    );
    let mut checked = 0;
    for cmd in &commands {
        let mut args: Vec<&str> = cmd.iter().map(String::as_str).collect();
        args.push("--help");
        let (ok, help, err) = fathom(&args);
        assert!(ok, "{cmd:?} --help: {err}");
        let examples: Vec<&str> = help
            .lines()
            .skip_while(|l| !l.starts_with("Examples:"))
            .skip(1)
            .map(str::trim)
            .filter(|l| l.contains("fathom "))
            .collect();
        assert!(
            !examples.is_empty(),
            "`fathom {}` has no examples",
            cmd.join(" ")
        );
        for ex in examples {
            let words = example_args(ex);
            let mut argv: Vec<&str> = words.iter().map(String::as_str).collect();
            argv.push("--help");
            let (ok, _, err) = fathom(&argv);
            assert!(
                ok,
                "example of `fathom {}` does not parse: {ex}\n{err}",
                cmd.join(" ")
            );
            checked += 1;
        }
    }
    eprintln!("{checked} examples over {} commands parse", commands.len());
}
