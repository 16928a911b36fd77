//! The bad-input matrix (docs/RELIABILITY.md): for every CLI command, one case per kind of bad input
//! that applies to it. Each case must exit non-zero within seconds with one line that names
//! the problem, must not panic, and must leave no output file (nor a temporary one) behind.
//!
//! Fixtures are small and synthetic, written by the test itself.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use fathom_bench::capture::{capture_bytes, CaptureInfo, LayerData};
use fathom_bench::synthetic::{generate, SyntheticParams};
use fathom_bench::tensors::{to_safetensors, WriteDtype};

/// A case may take this long at most (the commands fail before any real work).
const LIMIT: Duration = Duration::from_secs(20);

struct Case {
    /// The kind of bad input (one of docs/RELIABILITY.md's list).
    kind: &'static str,
    /// The command under test (`store quantize`, `plan`, …).
    cmd: &'static str,
    args: Vec<String>,
    /// A fragment of the message that names the problem (case-insensitive).
    needle: &'static str,
    /// Output path that must not exist afterwards.
    out: Option<PathBuf>,
}

struct Fx {
    dir: tempfile::TempDir,
}

impl Fx {
    fn p(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }
    fn put(&self, name: &str, bytes: &[u8]) -> String {
        std::fs::write(self.dir.path().join(name), bytes).unwrap();
        self.p(name)
    }
}

fn fathom(args: &[String]) -> (bool, String, String, Duration) {
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_fathom"))
        .args(args)
        .env("FATHOM_CACHE", "/nonexistent-fathom-cache")
        .output()
        .expect("run fathom");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        t.elapsed(),
    )
}

fn keys(n: usize, row: usize) -> Vec<f32> {
    (0..n * row)
        .map(|i| (((i * 2654435761) % 1000) as f32 / 100.0) - 5.0)
        .collect()
}

fn st(tensors: &[(&str, &[f32], &[usize])], meta: Option<HashMap<String, String>>) -> Vec<u8> {
    to_safetensors(tensors, WriteDtype::F32, meta).unwrap()
}

/// A small synthetic capture: 2 layers, Hkv 2, G 2, D 8, N tokens, P positions.
fn capture(n: usize, p: usize) -> (CaptureInfo, Vec<LayerData>) {
    generate(&SyntheticParams {
        layers: 2,
        hkv: 2,
        g: 2,
        d: 8,
        n,
        p,
        channel_sigma: 1.0,
        seed: 7,
    })
}

fn cap_bytes(info: &CaptureInfo, layers: &[LayerData]) -> Vec<u8> {
    capture_bytes(info, layers, WriteDtype::F32).unwrap()
}

/// The docs/SPEC.md §8 metadata of a capture whose tensors are written by hand.
fn cap_meta(positions: &[usize]) -> HashMap<String, String> {
    HashMap::from([
        (
            "positions".into(),
            serde_json::to_string(positions).unwrap(),
        ),
        ("model".into(), "synthetic".into()),
    ])
}

fn s<I: IntoIterator<Item = T>, T: ToString>(xs: I) -> Vec<String> {
    xs.into_iter().map(|x| x.to_string()).collect()
}

fn flip(bytes: &[u8], at: usize) -> Vec<u8> {
    let mut b = bytes.to_vec();
    b[at] ^= 0x40;
    b
}

fn cases(fx: &Fx) -> Vec<Case> {
    let mut v = Vec::new();
    let mut case = |kind, cmd, args: Vec<String>, needle, out: Option<String>| {
        v.push(Case {
            kind,
            cmd,
            args,
            needle,
            out: out.map(PathBuf::from),
        })
    };
    // clap's own errors keep what they list: the missing arguments, by name.
    case(
        "missing arguments",
        "fidelity",
        s(["fidelity"]),
        "--capture <CAPTURE> --methods <METHODS>",
        None,
    );
    // A file where a directory is expected: unwritable even for root.
    let blocker = fx.put("blocker", b"a plain file");
    let unwritable = |name: &str| format!("{blocker}/{name}");

    // ---- key tensors for `store quantize`
    let (n, h, d) = (100, 2, 8);
    let k = keys(n, h * d);
    let mut k_nan = k.clone();
    k_nan[37] = f32::NAN;
    let mut k_inf = k.clone();
    k_inf[5] = f32::INFINITY;
    let keys_f = fx.put(
        "keys.safetensors",
        &st(
            &[
                ("k", &k, &[n, h, d]),
                ("nan", &k_nan, &[n, h, d]),
                ("inf", &k_inf, &[n, h, d]),
                ("r1", &k, &[n * h * d]),
                ("r4", &k, &[n, h, 2, d / 2]),
                ("zero_heads", &[], &[n, 0, d]),
            ],
            None,
        ),
    );
    let keys_bytes = std::fs::read(&keys_f).unwrap();
    let q = |t: &str, out: &str| {
        s([
            "store", "quantize", "--keys", &keys_f, "--tensor", t, "--out", out,
        ])
    };
    let out = fx.p("q.fks");
    case(
        "NaN",
        "store quantize",
        q("nan", &out),
        "NaN or Inf",
        Some(out.clone()),
    );
    case(
        "Inf",
        "store quantize",
        q("inf", &out),
        "inf",
        Some(out.clone()),
    );
    case(
        "wrong rank (1)",
        "store quantize",
        q("r1", &out),
        "rank 2 or 3",
        Some(out.clone()),
    );
    case(
        "wrong rank (4)",
        "store quantize",
        q("r4", &out),
        "rank 2 or 3",
        Some(out.clone()),
    );
    case(
        "zero heads",
        "store quantize",
        q("zero_heads", &out),
        "must be positive",
        Some(out.clone()),
    );
    case(
        "missing tensor",
        "store quantize",
        q("nope", &out),
        "not found",
        Some(out.clone()),
    );
    let trunc = fx.put(
        "keys-trunc.safetensors",
        &keys_bytes[..keys_bytes.len() / 2],
    );
    case(
        "truncated file",
        "store quantize",
        s([
            "store", "quantize", "--keys", &trunc, "--tensor", "k", "--out", &out,
        ]),
        "safetensors",
        Some(out.clone()),
    );
    let flipped = fx.put("keys-flip.safetensors", &flip(&keys_bytes, 3));
    case(
        "flipped byte",
        "store quantize",
        s([
            "store", "quantize", "--keys", &flipped, "--tensor", "k", "--out", &out,
        ]),
        "safetensors",
        Some(out.clone()),
    );
    let empty = fx.put("empty", b"");
    case(
        "empty file",
        "store quantize",
        s([
            "store", "quantize", "--keys", &empty, "--tensor", "k", "--out", &out,
        ]),
        "safetensors",
        Some(out.clone()),
    );
    let uw = unwritable("q.fks");
    case(
        "unwritable output",
        "store quantize",
        q("k", &uw),
        "q.fks",
        Some(uw),
    );

    // ---- a good store, and broken copies, for `store dequant` and `store info`
    let good_store = fx.p("good.fks");
    let (ok, _, err, _) = fathom(&q("k", &good_store));
    assert!(ok, "fixture store: {err}");
    let sb = std::fs::read(&good_store).unwrap();
    let trunc_s = fx.put("trunc.fks", &sb[..sb.len() - 100]);
    let flip_s = fx.put("flip.fks", &flip(&sb, sb.len() / 2));
    let magic_s = fx.put("magic.fks", &flip(&sb, 0));
    let mut ver = sb.clone();
    ver[8..12].copy_from_slice(&7u32.to_le_bytes());
    let ver_s = fx.put("version.fks", &ver);
    let dq = |store: &str, planes: &str, out: &str| {
        s([
            "store", "dequant", "--store", store, "--planes", planes, "--out", out,
        ])
    };
    let out = fx.p("dq.safetensors");
    case(
        "truncated file",
        "store dequant",
        dq(&trunc_s, "4", &out),
        "truncated",
        Some(out.clone()),
    );
    case(
        "flipped byte",
        "store dequant",
        dq(&flip_s, "4", &out),
        "checksum",
        Some(out.clone()),
    );
    case(
        "wrong magic",
        "store dequant",
        dq(&magic_s, "4", &out),
        "not a fathom store",
        Some(out.clone()),
    );
    case(
        "wrong version",
        "store dequant",
        dq(&ver_s, "4", &out),
        "version 7",
        Some(out.clone()),
    );
    case(
        "empty file",
        "store dequant",
        dq(&empty, "4", &out),
        "truncated",
        Some(out.clone()),
    );
    case(
        "planes above max",
        "store dequant",
        dq(&good_store, "5", &out),
        "out of range",
        Some(out.clone()),
    );
    case(
        "planes below 0",
        "store dequant",
        dq(&good_store, "-1", &out),
        "-1",
        Some(out.clone()),
    );
    let uw = unwritable("dq.safetensors");
    case(
        "unwritable output",
        "store dequant",
        dq(&good_store, "4", &uw),
        "dq.safetensors",
        Some(uw),
    );
    let info = |store: &str| s(["store", "info", "--store", store, "--json"]);
    case(
        "truncated file",
        "store info",
        info(&trunc_s),
        "truncated",
        None,
    );
    case(
        "flipped byte",
        "store info",
        info(&flip_s),
        "checksum",
        None,
    );
    case(
        "wrong magic",
        "store info",
        info(&magic_s),
        "not a fathom store",
        None,
    );
    case(
        "wrong version",
        "store info",
        info(&ver_s),
        "version 7",
        None,
    );
    case("empty file", "store info", info(&empty), "truncated", None);
    case(
        "missing file",
        "store info",
        info(&fx.p("nope.fks")),
        "nope.fks",
        None,
    );

    // ---- importance weights for `plan`
    let w = keys(4, d).iter().map(|x| x.abs()).collect::<Vec<_>>();
    let mut w_nan = w.clone();
    w_nan[9] = f32::NAN;
    let mut w_inf = w.clone();
    w_inf[3] = f32::NEG_INFINITY;
    let mut w_neg = w.clone();
    w_neg[2] = -1.0;
    let wf = fx.put(
        "w.safetensors",
        &st(
            &[
                ("w", &w, &[4, d]),
                ("nan", &w_nan, &[4, d]),
                ("inf", &w_inf, &[4, d]),
                ("neg", &w_neg, &[4, d]),
                ("r3", &w, &[2, 2, d]),
            ],
            None,
        ),
    );
    let wb = std::fs::read(&wf).unwrap();
    let plan = |f: &str, t: &str, b: &str| {
        s([
            "plan",
            "--weights",
            f,
            "--tensor",
            t,
            "--budget",
            b,
            "--json",
        ])
    };
    case("NaN", "plan", plan(&wf, "nan", "32"), "NaN or Inf", None);
    case("Inf", "plan", plan(&wf, "inf", "32"), "inf", None);
    case(
        "negative importance",
        "plan",
        plan(&wf, "neg", "32"),
        "negative",
        None,
    );
    case("wrong rank", "plan", plan(&wf, "r3", "32"), "rank 2", None);
    case(
        "budget below 0",
        "plan",
        plan(&wf, "w", "-1"),
        "out of range",
        None,
    );
    case(
        "budget above max",
        "plan",
        plan(&wf, "w", "35"),
        "out of range",
        None,
    );
    case(
        "budget NaN",
        "plan",
        plan(&wf, "w", "NaN"),
        "out of range",
        None,
    );
    let wt = fx.put("w-trunc.safetensors", &wb[..wb.len() - 7]);
    case(
        "truncated file",
        "plan",
        plan(&wt, "w", "32"),
        "safetensors",
        None,
    );
    let wfl = fx.put("w-flip.safetensors", &flip(&wb, 1));
    case(
        "flipped byte",
        "plan",
        plan(&wfl, "w", "32"),
        "safetensors",
        None,
    );
    case(
        "empty file",
        "plan",
        plan(&empty, "w", "32"),
        "safetensors",
        None,
    );

    // ---- `demo` (embedded synthetic workload)
    let out = fx.p("demo.json");
    case(
        "context shorter than sink + local",
        "demo",
        s(["demo", "--context", "20", "--json", &out]),
        "too short",
        Some(out.clone()),
    );
    case(
        "k > n",
        "demo",
        s(["demo", "--context", "64", "--k", "65", "--json", &out]),
        "--k 65",
        Some(out.clone()),
    );
    case(
        "k = 0",
        "demo",
        s(["demo", "--context", "64", "--k", "0", "--json", &out]),
        "--k 0",
        Some(out.clone()),
    );
    case(
        "budget below 0",
        "demo",
        s([
            "demo",
            "--context",
            "64",
            "--k",
            "32",
            "--budgets",
            "-4",
            "--json",
            &out,
        ]),
        "-4",
        Some(out.clone()),
    );
    case(
        "budget above max",
        "demo",
        s([
            "demo",
            "--context",
            "64",
            "--k",
            "32",
            "--budgets",
            "1000",
            "--json",
            &out,
        ]),
        "1000",
        Some(out.clone()),
    );
    let uw = unwritable("demo.json");
    case(
        "unwritable output",
        "demo",
        s(["demo", "--context", "64", "--k", "32", "--json", &uw]),
        "demo.json",
        Some(uw),
    );
    let uw = unwritable("demo.png");
    case(
        "unwritable plot",
        "demo",
        s(["demo", "--context", "64", "--k", "32", "--plot", &uw]),
        "demo.png",
        Some(uw),
    );

    // ---- captures for `calibrate` and `fidelity`
    let (ci, cl) = capture(64, 4);
    let cap = cap_bytes(&ci, &cl);
    let good_cap = fx.put("cap.safetensors", &cap);
    let mut bad = cl.clone();
    bad[1].k[100] = f32::NAN;
    let cap_nan = fx.put("cap-nan.safetensors", &cap_bytes(&ci, &bad));
    let mut bad = cl.clone();
    bad[0].q[3] = f32::INFINITY;
    let cap_inf = fx.put("cap-inf.safetensors", &cap_bytes(&ci, &bad));
    let l0 = &cl[0];
    let qs = [ci.positions.len(), ci.hq, ci.d];
    let ks = [ci.n, ci.hkv, ci.d];
    let cap_rank = fx.put(
        "cap-rank.safetensors",
        &st(
            &[
                ("layers.0.q", &l0.q, &[ci.positions.len() * ci.hq, ci.d]),
                ("layers.0.k", &l0.k, &ks),
                ("layers.0.v", &l0.v, &ks),
            ],
            Some(cap_meta(&ci.positions)),
        ),
    );
    let cap_shape = fx.put(
        "cap-shape.safetensors",
        &st(
            &[
                ("layers.0.q", &l0.q, &qs),
                ("layers.0.k", &l0.k, &ks),
                (
                    "layers.0.v",
                    &l0.v[..ci.n / 2 * ci.hkv * ci.d],
                    &[ci.n / 2, ci.hkv, ci.d],
                ),
            ],
            Some(cap_meta(&ci.positions)),
        ),
    );
    // 4 query heads over 3 KV heads: the K/V tensors are [N, 3, D'] with the same floats.
    let cap_heads = fx.put(
        "cap-heads.safetensors",
        &st(
            &[
                (
                    "layers.0.q",
                    &l0.q[..ci.positions.len() * 4 * 4],
                    &[ci.positions.len(), 4, 4],
                ),
                ("layers.0.k", &l0.k[..ci.n * 3 * 4], &[ci.n, 3, 4]),
                ("layers.0.v", &l0.v[..ci.n * 3 * 4], &[ci.n, 3, 4]),
            ],
            Some(cap_meta(&ci.positions)),
        ),
    );
    let mut beyond = ci.positions.clone();
    beyond[1] = ci.n;
    let cap_pos = fx.put(
        "cap-pos.safetensors",
        &st(
            &[
                ("layers.0.q", &l0.q, &qs),
                ("layers.0.k", &l0.k, &ks),
                ("layers.0.v", &l0.v, &ks),
            ],
            Some(cap_meta(&beyond)),
        ),
    );
    let cap_trunc = fx.put("cap-trunc.safetensors", &cap[..cap.len() - 64]);
    let cap_flip = fx.put("cap-flip.safetensors", &flip(&cap, 9));
    let cap_magic = fx.put("cap-magic.safetensors", &sb); // a store file is not a capture
                                                          // Positions 4..8: contexts of 5..9 tokens, shorter than sink 4 + local 32.
    let (si, sl) = capture(64, 4);
    let short = CaptureInfo {
        positions: vec![4, 5, 6, 7],
        ..si.clone()
    };
    let cap_short = fx.put("cap-short.safetensors", &cap_bytes(&short, &sl));
    let captures: [(&str, &str, &str); 11] = [
        ("NaN", &cap_nan, "NaN or Inf"),
        ("Inf", &cap_inf, "inf"),
        ("wrong rank", &cap_rank, "[P, Hq, D]"),
        ("wrong shape", &cap_shape, "the shape of layers.0.k"),
        ("heads that do not divide", &cap_heads, "do not divide"),
        ("positions beyond N", &cap_pos, "beyond"),
        ("truncated file", &cap_trunc, "safetensors"),
        ("flipped byte", &cap_flip, "safetensors"),
        ("wrong magic", &cap_magic, "safetensors"),
        ("empty file", &empty, "safetensors"),
        (
            "context shorter than sink + local",
            &cap_short,
            "sink + local",
        ),
    ];
    let out = fx.p("cal.json");
    let cal =
        |c: &str, out: &str| s(["calibrate", "--capture", c, "--out", out, "--targets", "16"]);
    for (kind, c, needle) in captures {
        case(kind, "calibrate", cal(c, &out), needle, Some(out.clone()));
    }
    let mut a = cal(&good_cap, &out);
    a[6] = "-1".into();
    case(
        "budget below 0",
        "calibrate",
        a.clone(),
        "out of range",
        Some(out.clone()),
    );
    a[6] = "35".into();
    case(
        "budget above max",
        "calibrate",
        a,
        "out of range",
        Some(out.clone()),
    );
    let mut a = cal(&good_cap, &out);
    a.extend(s(["--k", "65"]));
    case("k > n", "calibrate", a, "--k 65", Some(out.clone()));
    let uw = unwritable("cal.json");
    case(
        "unwritable output",
        "calibrate",
        cal(&good_cap, &uw),
        "cal.json",
        Some(uw),
    );

    // ---- a good calibration, and broken copies, for `fidelity`
    let good_cal = fx.p("good-cal.json");
    let (ok, _, err, _) = fathom(&cal(&good_cap, &good_cal));
    assert!(ok, "fixture calibration: {err}");
    let cb = std::fs::read(&good_cal).unwrap();
    let cal_trunc = fx.put("cal-trunc.json", &cb[..cb.len() / 2]);
    let cal_flip = fx.put("cal-flip.json", &flip(&cb, 0)); // `{` → `;`
    let cal_text = String::from_utf8(cb.clone()).unwrap();
    let cal_magic = fx.put(
        "cal-magic.json",
        cal_text
            .replacen("fathom-calibration", "fathom-calibratiom", 1)
            .as_bytes(),
    );
    let cal_ver = fx.put(
        "cal-version.json",
        cal_text
            .replacen("\"version\":1", "\"version\":9", 1)
            .as_bytes(),
    );
    let cal_nan = fx.put(
        "cal-nan.json",
        cal_text
            .replacen("\"sigma2\":[", "\"sigma2\":[1e999,", 1)
            .as_bytes(),
    );
    let other = fx.put("cal-other.json", {
        let (oi, ol) = capture(64, 4);
        let oi = CaptureInfo { d: 8, ..oi };
        let c2 = fx.put("cap2.safetensors", &cap_bytes(&oi, &ol[..1]));
        let o = fx.p("cal2.json");
        let (ok, _, err, _) = fathom(&cal(&c2, &o));
        assert!(ok, "fixture calibration 2: {err}");
        &std::fs::read(&o).unwrap()
    });
    let _ = other;
    let out = fx.p("fid.json");
    let fid = |c: &str, calib: &str, methods: &str, out: &str| {
        s([
            "fidelity",
            "--capture",
            c,
            "--calib",
            calib,
            "--methods",
            methods,
            "--k",
            "8",
            "--json",
            out,
        ])
    };
    for (kind, c, needle) in captures {
        case(
            kind,
            "fidelity",
            fid(c, &good_cal, "exact,fathom:32", &out),
            needle,
            Some(out.clone()),
        );
    }
    for (kind, c, needle) in [
        ("truncated file", &cal_trunc, "not a fathom calibration"),
        ("flipped byte", &cal_flip, "not a fathom calibration"),
        ("wrong magic", &cal_magic, "format tag"),
        ("wrong version", &cal_ver, "version 9"),
        ("Inf", &cal_nan, "calibration"),
        ("empty file", &empty, "not a fathom calibration"),
    ] {
        case(
            kind,
            "fidelity",
            fid(&good_cap, c, "exact,fathom:32", &out),
            needle,
            Some(out.clone()),
        );
    }
    case(
        "budget below 0",
        "fidelity",
        fid(&good_cap, &good_cal, "fathom:-1", &out),
        "-1",
        Some(out.clone()),
    );
    case(
        "budget above max",
        "fidelity",
        fid(&good_cap, &good_cal, "fathom:35", &out),
        "35",
        Some(out.clone()),
    );
    let mut a = fid(&good_cap, &good_cal, "exact", &out);
    a[8] = "65".into();
    case("k > n", "fidelity", a, "--k 65", Some(out.clone()));
    let uw = unwritable("fid.json");
    case(
        "unwritable output",
        "fidelity",
        fid(&good_cap, &good_cal, "exact", &uw),
        "fid.json",
        Some(uw),
    );

    // ---- `offload-bench`: no GPU on a CI machine (or a build without `cuda`).
    let out = fx.p("bench.json");
    case(
        "missing GPU",
        "offload-bench",
        s([
            "offload-bench",
            "--context",
            "32k",
            "--steps",
            "1",
            "--json",
            &out,
        ]),
        "cuda",
        Some(out.clone()),
    );
    // Method typos and out-of-range arguments are found where they were typed, before the
    // device is opened: the message names the method, not the missing GPU.
    for (bad, needle) in [
        ("sparq:-3", "sparq:-3"),
        ("fathom:999", "out of range"),
        ("fathom-uniform:48", "not a GPU step method"),
        ("nope", "unknown method"),
    ] {
        case(
            "bad method",
            "offload-bench",
            s(["offload-bench", "--methods", bad, "--json", &out]),
            needle,
            Some(out.clone()),
        );
    }
    case(
        "bad select path",
        "offload-bench",
        s(["offload-bench", "--select", "8k", "--json", &out]),
        "8k",
        Some(out.clone()),
    );
    case(
        "bad scan load width",
        "offload-bench",
        s(["offload-bench", "--scan-vec", "1,3", "--json", &out]),
        "scan vector words",
        Some(out.clone()),
    );
    case(
        "zero rounds",
        "offload-bench",
        s(["offload-bench", "--rounds", "0", "--json", &out]),
        "--rounds 0",
        Some(out.clone()),
    );
    case(
        "the retired step engine",
        "offload-bench",
        s(["offload-bench", "--engine", "step", "--json", &out]),
        "the fixed benchmark step engine is retired",
        Some(out.clone()),
    );
    case(
        "a flag of the retired step engine",
        "offload-bench",
        s(["offload-bench", "--gather-ctas", "8", "--json", &out]),
        "--gather-ctas",
        Some(out.clone()),
    );
    case(
        "too many host-gather threads",
        "offload-bench",
        s(["offload-bench", "--host-gather", "0,1000", "--json", &out]),
        "at most 256 threads",
        Some(out.clone()),
    );
    case(
        "a host-gather share of 0",
        "offload-bench",
        s(["offload-bench", "--host-share", "100,0", "--json", &out]),
        "--host-share 0",
        Some(out.clone()),
    );
    case(
        "split residency in offload-bench",
        "offload-bench",
        s(["offload-bench", "--residency", "index-hbm", "--json", &out]),
        "decode-bench --residency index-hbm",
        Some(out.clone()),
    );
    // `k > n` and the shapes of a capture are validated on the device path, after the device
    // check, so without a GPU only the missing device is observable for them here.

    // ---- model and evaluation commands: bad names, and a model or corpus that is not there
    // (an empty cache, offline: the analogue of a missing GPU). Nothing is downloaded.
    let cache = fx.p("empty-cache");
    std::fs::create_dir_all(&cache).unwrap();
    let off = |mut a: Vec<String>| {
        a.extend(s(["--offline", "--cache-dir", &cache]));
        a
    };
    case(
        "unknown model",
        "generate",
        off(s(["generate", "--model", "nope", "--prompt", "hi"])),
        "unknown model",
        None,
    );
    case(
        "missing model",
        "generate",
        off(s(["generate", "--prompt", "hi"])),
        "offline",
        None,
    );
    let out = fx.p("capture.safetensors");
    let capture = |extra: &[&str]| {
        let model = if extra.contains(&"--model") {
            vec![]
        } else {
            s(["--model", "smollm2-135m"])
        };
        let mut a = s(["capture", "--context", "256", "--out", &out]);
        a.extend(model);
        a.extend(s(extra));
        off(a)
    };
    case(
        "unknown model",
        "capture",
        capture(&["--model", "nope"]),
        "unknown model",
        Some(out.clone()),
    );
    case(
        "wrong dtype",
        "capture",
        capture(&["--dtype", "f8"]),
        "dtype",
        Some(out.clone()),
    );
    case(
        "unknown corpus",
        "capture",
        capture(&["--corpus", "nope"]),
        "corpus",
        Some(out.clone()),
    );
    case(
        "missing model",
        "capture",
        capture(&[]),
        "offline",
        Some(out.clone()),
    );
    case(
        "missing text file",
        "capture",
        capture(&["--text", &fx.p("no-such-text.txt")]),
        "no-such-text.txt",
        Some(out.clone()),
    );
    let bad_jsonl = fx.put("bad.jsonl", b"{\"text\": \"ok\"}\n{\"body\": 1}\n");
    case(
        "corrupt JSONL text",
        "capture",
        capture(&["--text", &bad_jsonl]),
        "bad.jsonl:2",
        Some(out.clone()),
    );
    case(
        "positions beyond N",
        "capture",
        capture(&["--positions", "257"]),
        "--positions 257",
        Some(out.clone()),
    );
    let uw = unwritable("capture.safetensors");
    case(
        "unwritable output",
        "capture",
        off(s([
            "capture",
            "--model",
            "smollm2-135m",
            "--context",
            "256",
            "--out",
            &uw,
        ])),
        "capture.safetensors",
        Some(uw),
    );
    case(
        "unknown model",
        "fetch-models",
        off(s(["fetch-models", "--model", "nope"])),
        "unknown model",
        None,
    );
    case(
        "missing model",
        "fetch-models",
        off(s(["fetch-models"])),
        "offline",
        None,
    );
    case(
        "unknown corpus",
        "fetch-corpus",
        off(s(["fetch-corpus", "--corpus", "nope"])),
        "unknown corpus",
        None,
    );
    case(
        "missing corpus",
        "fetch-corpus",
        off(s(["fetch-corpus"])),
        "offline",
        None,
    );
    let out = fx.p("eval.json");
    for cmd in ["ruler", "agent-steps"] {
        case(
            "missing model",
            cmd,
            off(s([cmd, "--json", &out])),
            "offline",
            Some(out.clone()),
        );
        case(
            "context shorter than sink + local",
            cmd,
            off(s([cmd, "--context", "20", "--json", &out])),
            "sink + local",
            Some(out.clone()),
        );
        case(
            "k > n",
            cmd,
            off(s([cmd, "--context", "512", "--k", "513", "--json", &out])),
            "--k 513",
            Some(out.clone()),
        );
        let uw = unwritable("eval.json");
        case(
            "unwritable output",
            cmd,
            off(s([cmd, "--json", &uw])),
            "eval.json",
            Some(uw),
        );
        case(
            "bad method",
            cmd,
            off(s([
                cmd,
                "--device",
                "cuda",
                "--methods",
                "exact,loki-f16:16",
                "--json",
                &out,
            ])),
            "loki-f16:16",
            Some(out.clone()),
        );
        // No GPU (CI, or a build without `cuda`): refused before the model loads, not after
        // the calibration and the CPU work that precede the GPU's first use.
        case(
            "missing GPU",
            cmd,
            off(s([cmd, "--device", "cuda", "--json", &out])),
            "needs a GPU",
            Some(out.clone()),
        );
    }
    // ---- `gpu-parity`: arguments first, then the device (none on CI, or no `cuda` build),
    // and `--device cuda` of the evaluation commands refuses what the cache does not run.
    let out = fx.p("parity.json");
    case(
        "missing GPU",
        "gpu-parity",
        off(s(["gpu-parity", "--json", &out])),
        "gpu",
        Some(out.clone()),
    );
    case(
        "unknown model",
        "gpu-parity",
        off(s(["gpu-parity", "--model", "nope", "--json", &out])),
        "unknown model",
        Some(out.clone()),
    );
    case(
        "zero prompts",
        "gpu-parity",
        off(s(["gpu-parity", "--prompts", "0", "--json", &out])),
        "at least 1",
        Some(out.clone()),
    );
    let uw = unwritable("parity.json");
    case(
        "unwritable output",
        "gpu-parity",
        off(s(["gpu-parity", "--json", &uw])),
        "parity.json",
        Some(uw),
    );
    let out_db = fx.p("decode-bench.json");
    case(
        "missing GPU",
        "decode-bench",
        off(s(["decode-bench", "--json", &out_db])),
        "gpu",
        Some(out_db.clone()),
    );
    case(
        "bad scan load width",
        "decode-bench",
        off(s(["decode-bench", "--scan-vec", "4", "--json", &out_db])),
        "--scan-vec",
        Some(out_db.clone()),
    );
    case(
        "the host gather with head groups",
        "decode-bench",
        off(s([
            "decode-bench",
            "--host-gather",
            "4",
            "--attend-groups",
            "2",
            "--json",
            &out_db,
        ])),
        "one head group",
        Some(out_db.clone()),
    );
    case(
        "a host-gather share past 100",
        "decode-bench",
        off(s([
            "decode-bench",
            "--host-share",
            "101",
            "--json",
            &out_db,
        ])),
        "--host-share",
        Some(out_db.clone()),
    );
    case(
        "the host gather with the cache in HBM",
        "decode-bench",
        off(s([
            "decode-bench",
            "--host-gather",
            "4",
            "--residency",
            "hbm",
            "--json",
            &out_db,
        ])),
        "nothing to gather",
        Some(out_db.clone()),
    );
    case(
        "more head groups than KV heads",
        "decode-bench",
        off(s([
            "decode-bench",
            "--model",
            "qwen3-8b",
            "--attend-groups",
            "9",
            "--json",
            &out_db,
        ])),
        "8 KV heads",
        Some(out_db.clone()),
    );
    case(
        "zero batch",
        "decode-bench",
        off(s(["decode-bench", "--batch", "0,4", "--json", &out_db])),
        "--batch",
        Some(out_db.clone()),
    );
    case(
        "bad context",
        "decode-bench",
        off(s(["decode-bench", "--context", "12q", "--json", &out_db])),
        "12q",
        Some(out_db.clone()),
    );
    case(
        "bad method",
        "decode-bench",
        off(s([
            "decode-bench",
            "--methods",
            "dense,fathom-klt:92",
            "--json",
            &out_db,
        ])),
        "fathom-klt:92",
        Some(out_db.clone()),
    );
    case(
        "impossible split",
        "decode-bench",
        off(s([
            "decode-bench",
            "--model",
            "qwen3-8b",
            "--gpus",
            "6",
            "--tp",
            "3",
            "--json",
            &out_db,
        ])),
        "KV heads",
        Some(out_db.clone()),
    );
    case(
        "several GPUs (not run yet)",
        "decode-bench",
        off(s([
            "decode-bench",
            "--model",
            "qwen3-8b",
            "--gpus",
            "4",
            "--tp",
            "2",
            "--json",
            &out_db,
        ])),
        "several GPUs are not run yet",
        Some(out_db.clone()),
    );
    let uw = unwritable("decode-bench.json");
    case(
        "unwritable output",
        "decode-bench",
        off(s(["decode-bench", "--json", &uw])),
        "decode-bench.json",
        Some(uw),
    );
    case(
        "bad task shape",
        "ruler",
        off(s(["ruler", "--shape", "small,digits=0", "--json", &out])),
        "digits=0",
        Some(out.clone()),
    );
    case(
        "unknown haystack",
        "ruler",
        off(s(["ruler", "--haystack", "essays", "--json", &out])),
        "essays",
        Some(out.clone()),
    );
    let out = fx.p("speed.json");
    case(
        "missing model",
        "speed",
        off(s(["speed", "--json", &out])),
        "offline",
        Some(out.clone()),
    );
    case(
        "zero decode steps",
        "speed",
        off(s(["speed", "--decode-steps", "0", "--json", &out])),
        "--decode-steps",
        Some(out.clone()),
    );
    case(
        "empty context",
        "speed",
        off(s(["speed", "--context", "0", "--json", &out])),
        "--context",
        Some(out.clone()),
    );
    let uw = unwritable("speed.json");
    case(
        "unwritable output",
        "speed",
        off(s(["speed", "--json", &uw])),
        "speed.json",
        Some(uw),
    );
    // `report` renders a results directory that `xtask repro` wrote.
    let md = fx.p("REPORT.md");
    let missing_dir = fx.p("no-such-results");
    case(
        "missing results directory",
        "report",
        s(["report", "--dir", &missing_dir, "--out", &md]),
        "does not exist",
        Some(md.clone()),
    );
    case(
        "missing stage log",
        "report",
        s([
            "report",
            "--dir",
            &fx.p(""),
            "--out",
            &md,
            "--stages",
            &fx.p("nope.jsonl"),
        ]),
        "nope.jsonl",
        Some(md.clone()),
    );
    case(
        "missing plot folder",
        "report",
        s([
            "report",
            "--dir",
            &fx.p(""),
            "--out",
            &md,
            "--plots",
            &fx.p("no-such-plots"),
        ]),
        "no-such-plots",
        Some(md.clone()),
    );
    let uw = unwritable("REPORT.md");
    case(
        "unwritable output",
        "report",
        s(["report", "--dir", &fx.p(""), "--out", &uw]),
        "REPORT.md",
        Some(uw),
    );
    v
}

/// Temporary files a failed atomic write might leave behind (`.NAME.tmp-PID`).
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp") || n.starts_with(".fathom-write-probe"))
        .collect()
}

#[test]
fn every_command_rejects_bad_input_cleanly() {
    let fx = Fx {
        dir: tempfile::tempdir().unwrap(),
    };
    let cases = cases(&fx);
    let mut failures = Vec::new();
    for c in &cases {
        if let Some(o) = &c.out {
            let _ = std::fs::remove_file(o);
        }
        let (ok, stdout, err, took) = fathom(&c.args);
        let mut why = Vec::new();
        if ok {
            why.push("exited 0".to_string());
        }
        if err.contains("panicked")
            || err.contains("RUST_BACKTRACE")
            || err.contains("internal error")
        {
            why.push("panicked".into());
        }
        if err.trim_end().lines().count() != 1 {
            why.push(format!(
                "{} lines on stderr",
                err.trim_end().lines().count()
            ));
        }
        if !err.to_lowercase().contains(&c.needle.to_lowercase()) {
            why.push(format!("message lacks {:?}", c.needle));
        }
        if took > LIMIT {
            why.push(format!("took {took:?}"));
        }
        if let Some(o) = &c.out {
            if o.exists() {
                why.push(format!("left {}", o.display()));
            }
        }
        let left = leftovers(fx.dir.path());
        if !left.is_empty() {
            why.push(format!("left temporary files {left:?}"));
        }
        if !why.is_empty() {
            failures.push(format!(
                "[{}] {}: {}\n    args: {:?}\n    stderr: {}\n    stdout: {}",
                c.cmd,
                c.kind,
                why.join(", "),
                c.args,
                err.trim_end(),
                stdout.lines().take(3).collect::<Vec<_>>().join(" | ")
            ));
        }
    }
    let mut commands = std::collections::BTreeMap::<&str, usize>::new();
    for c in &cases {
        *commands.entry(c.cmd).or_default() += 1;
    }
    eprintln!(
        "bad-input matrix: {} cases over {} commands ({:?}), {} failed",
        cases.len(),
        commands.len(),
        commands,
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// A library error that prints its cause is not followed by the same cause again.
#[test]
fn a_cause_is_printed_once() {
    let missing = std::env::temp_dir().join("fathom-no-such-capture.safetensors");
    let (ok, _, err, _) = fathom(&s([
        "fidelity",
        "--capture",
        missing.to_str().unwrap(),
        "--methods",
        "exact",
    ]));
    assert!(!ok);
    let cause = std::io::Error::from(std::io::ErrorKind::NotFound).to_string();
    let os = err.matches("os error 2").count();
    assert_eq!(os, 1, "the cause {cause:?} is printed {os} times: {err}");
}

/// Every subcommand `fathom --help` lists is in the matrix (or says why it is not).
#[test]
fn the_matrix_covers_every_command() {
    let (_, out, _, _) = fathom(&s(["--help"]));
    let listed: Vec<String> = out
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .filter(|c| c != "help")
        .collect();
    assert!(
        !listed.is_empty(),
        "could not parse `fathom --help`:\n{out}"
    );
    let fx = Fx {
        dir: tempfile::tempdir().unwrap(),
    };
    let covered: Vec<&str> = cases(&fx)
        .iter()
        .map(|c| c.cmd.split(' ').next().unwrap())
        .collect();
    let exempt: [&str; 0] = [];
    let missing: Vec<&String> = listed
        .iter()
        .filter(|c| !covered.contains(&c.as_str()) && !exempt.contains(&c.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "commands without bad-input cases: {missing:?}"
    );
}
