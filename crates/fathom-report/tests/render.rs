//! The report reads typed documents only, puts the claims first, flags bounds, and refuses a
//! result document that does not fit its schema.

use std::path::Path;

use fathom_results::fidelity::{EqualErrorRow, FidelityDoc, MethodRow, Study};
use fathom_results::stages::StageRecord;

fn method(name: &str, bits: f64, error: f64) -> MethodRow {
    MethodRow {
        name: name.into(),
        bits,
        error,
        error_se: Some(1e-4),
        per_layer: vec![],
        per_layer_bits: vec![],
        per_position: vec![],
    }
}

fn doc(study: Study, k: usize, saving: f64, lower_bound: bool) -> FidelityDoc {
    FidelityDoc {
        version: fathom_results::VERSION,
        fathom: "test".into(),
        command: "fathom fidelity …".into(),
        study,
        capture: "c.safetensors".into(),
        model: "toy-model".into(),
        synthetic: false,
        basis: Some("Raw".into()),
        d: 64,
        n: 4096,
        hkv: 3,
        g: 3,
        k,
        positions: 128,
        layers: vec![0, 1],
        skipped_local_layers: vec![],
        o_consistency_max: None,
        methods: vec![
            method("fathom:24", 24.0, 0.2),
            method("fathom:48", 48.0, 0.1),
            method("fathom:96", 96.0, 0.05),
            method("ds:32", 136.0, 0.1),
            method("sparq:16", 68.0, 0.2),
        ],
        equal_error: vec![EqualErrorRow {
            baseline: "ds:32".into(),
            convention: Some("r = 32 (136 bits)".into()),
            baseline_bits: 136.0,
            baseline_error: 0.1,
            baseline_error_se: Some(1e-4),
            fathom_bits: Some(136.0 / saving),
            saving: Some(saving),
            lower_bound: Some(lower_bound),
            saving_ci95: Some([saving * 0.9, saving * 1.1]),
            bootstrap: None,
        }],
    }
}

fn render(dir: &Path, stages: Option<&Path>) -> String {
    let inp = fathom_report::collect(dir, stages, dir).unwrap();
    fathom_report::render(&inp, &fathom_report::Stamp::default())
}

#[test]
fn claims_come_first_and_the_stage_log_last() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("toy-4k");
    std::fs::create_dir_all(&sub).unwrap();
    fathom_results::write(
        &sub.join("fidelity.json"),
        doc(Study::Main, 128, 2.83, false),
    )
    .unwrap();
    fathom_results::write(&sub.join("k64.json"), doc(Study::K, 64, 2.83, true)).unwrap();
    let log = dir.path().join("stages.jsonl");
    std::fs::write(
        &log,
        StageRecord::ok("toy: fidelity", 3.0, "fathom fidelity").to_line(),
    )
    .unwrap();
    let md = render(dir.path(), Some(&log));
    let at = |h: &str| md.find(h).unwrap_or_else(|| panic!("no {h:?} in\n{md}"));
    let claims: Vec<usize> = (1..=6).map(|i| at(&format!("## Claim {i}:"))).collect();
    assert!(claims.windows(2).all(|w| w[0] < w[1]));
    assert!(claims[5] < at("## Ablations"));
    assert!(at("## Ablations") < at("## Appendix: stage log"));
    // The main run's saving with its interval, against the paper's 1.8×: holds.
    assert!(md.contains("2.83× [2.55–3.11]"), "{md}");
    assert!(md.contains("holds at 2.83×"), "{md}");
    // The k run is tabled as a bound, under the ablations, not as a main run.
    assert!(md.contains("| k = 64 |"), "{md}");
    assert!(md.contains("≥ 2.83×"), "{md}");
    assert_eq!(md.matches("from `toy-4k/").count(), 1, "{md}");
    // Claim 2 reads the Fathom curve at 68 bits by log-linear interpolation.
    assert!(md.contains("sparq:16 error 2.0000e-1"), "{md}");
    assert!(
        md.contains("| toy: fidelity | ok | 3.0 | `fathom fidelity` |"),
        "{md}"
    );
}

#[test]
fn a_saving_below_the_paper_says_so() {
    let dir = tempfile::tempdir().unwrap();
    fathom_results::write(
        &dir.path().join("fidelity.json"),
        doc(Study::Main, 128, 1.2, false),
    )
    .unwrap();
    let md = render(dir.path(), None);
    assert!(
        md.contains("holds at 1.20× [1.08–1.32] (below the paper's 1.8–2.9×)"),
        "{md}"
    );
}

#[test]
fn a_result_that_does_not_fit_its_schema_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("broken.json");
    std::fs::write(&p, r#"{"kind":"fidelity","version":2,"capture":"c"}"#).unwrap();
    let e = fathom_report::collect(dir.path(), None, dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("broken.json") && e.contains("missing field"),
        "{e}"
    );
    std::fs::write(&p, "{not json").unwrap();
    let e = fathom_report::collect(dir.path(), None, dir.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("broken.json") && e.contains("not JSON"), "{e}");
}

#[test]
fn json_that_is_no_result_is_listed_not_read() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("table.json"), r#"{"rows":[]}"#).unwrap();
    let md = render(dir.path(), None);
    assert!(md.contains("- `table.json`: no `kind` field"), "{md}");
    // Another tool's document is named by its kind, not called kindless.
    std::fs::write(
        dir.path().join("other.json"),
        r#"{"kind":"other-tool","version":1,"entries":[]}"#,
    )
    .unwrap();
    let md = render(dir.path(), None);
    assert!(
        md.contains("- `other.json`: `kind` \"other-tool\" is none this crate reads"),
        "{md}"
    );
}

/// A committed task-shape probe (a RULER run of dense and exact only) is listed with its dense
/// scores, and gets no claim section: there is no sparse method in it to judge. The same
/// file with a sparse method added is read as a claim again.
#[test]
fn a_dense_only_ruler_probe_is_listed_not_judged() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let probe = root.join("results/downstream/gpu/tune/tune-gemma3-270m-small.json");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(&probe, dir.path().join("probe.json")).unwrap();
    let md = render(dir.path(), None);
    assert!(
        md.contains("- `probe.json`: a dense-only task probe of gemma3-270m at 32768 tokens"),
        "{md}"
    );
    assert!(md.contains("seed 1; 5 samples per task"), "{md}");
    assert!(!md.contains("`probe.json` (gemma3-270m"), "{md}");
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&probe).unwrap()).unwrap();
    doc["methods"] = serde_json::json!(["dense", "exact", "fathom:48"]);
    std::fs::write(dir.path().join("probe.json"), doc.to_string()).unwrap();
    let md = render(dir.path(), None);
    assert!(md.contains("`probe.json` (gemma3-270m"), "{md}");
}

/// A downstream run that counted row-cache hits gets their table under its claim section,
/// each method's union rows and hit rate per size; a run without `row_cache_source` (every
/// file before the field) gets none.
#[test]
fn a_downstream_run_with_row_cache_tallies_shows_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let run = root.join("results/downstream/rowcache/agent-smollm2-135m-8k.json");
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&run).unwrap()).unwrap();
    let fathom = &doc["summary"]["fathom:48"]["row_cache"];
    let (rows, rate) = (
        fathom[0]["rows"].as_u64().unwrap(),
        fathom[3]["hit_rate"].as_f64().unwrap(),
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("agent.json"), doc.to_string()).unwrap();
    let md = render(dir.path(), None);
    assert!(
        md.contains("Row-cache hit rate on these decode steps"),
        "{md}"
    );
    assert!(
        md.contains("| method | union rows | 64 | 256 | 1024 | 8192 |"),
        "{md}"
    );
    let line = md
        .lines()
        .find(|l| l.starts_with("| fathom:48 | ") && l.contains(&rows.to_string()));
    assert!(
        line.is_some_and(|l| l.ends_with(&format!("| {rate:.3} |"))),
        "{md}"
    );
    assert!(
        !md.contains("| dense | 0 |"),
        "dense fetches no union: {md}"
    );
    doc.as_object_mut().unwrap().remove("row_cache_source");
    std::fs::write(dir.path().join("agent.json"), doc.to_string()).unwrap();
    assert!(!render(dir.path(), None).contains("Row-cache hit rate"));
}

/// A made-up cache-engine offload-bench document (Qwen3-8B shape, B = 1) of `results`, run by
/// `command`.
fn offload_doc(
    command: &str,
    results: Vec<fathom_results::offload::BenchResult>,
) -> fathom_results::offload::OffloadBench {
    fathom_results::offload::OffloadBench {
        version: 2,
        command: command.into(),
        shape_label: "qwen3-8b".into(),
        batch: 1,
        generator: "synthetic-gqa-v1 (test)".into(),
        engine: fathom_results::offload::OffloadEngine::Cache,
        results,
        ..Default::default()
    }
}

/// An offload run of one cache-engine setting per 136-bit scan, and one of fathom:48 alone:
/// each row names its setting, a speedup is judged only against scans of the same setting,
/// and a row with none gets no verdict (not a silently met target).
#[test]
fn an_offload_row_without_a_136_bit_scan_gets_no_verdict() {
    use fathom_results::offload::BenchResult;
    let dir = tempfile::tempdir().unwrap();
    let row = |method: &str, select: &str, groups: usize, ms: f64| BenchResult {
        context: 1 << 18,
        residency: "host".into(),
        method: method.into(),
        groups,
        select: select.into(),
        gpu_ms: ms,
        ..Default::default()
    };
    let mut with = row("fathom:48", "scores", 2, 10.0);
    with.speedup_vs_136.insert("sparq:32".into(), 2.0);
    let doc = |results: Vec<BenchResult>| {
        offload_doc("/x/y/fathom offload-bench --engine cache", results)
    };
    fathom_results::write(
        &dir.path().join("with.json"),
        doc(vec![with, row("sparq:32", "scores", 2, 20.0)]),
    )
    .unwrap();
    fathom_results::write(
        &dir.path().join("alone.json"),
        doc(vec![row("fathom:48", "scores", 1, 10.0)]),
    )
    .unwrap();
    let md = render(dir.path(), None);
    assert!(md.contains("`fathom offload-bench --engine cache`"), "{md}");
    assert!(
        md.contains("| 262144 | host | scores, 2 head groups | 10.00 | sparq:32 2.00× |"),
        "{md}"
    );
    assert!(md.contains("meets the 1.9× target"), "{md}");
    assert!(
        md.contains("| 262144 | host | scores, 1 head group | 10.00 |  |")
            && md.contains("— (no 136-bit scan under this setting in the run)"),
        "{md}"
    );
}

/// An offload run under a kernel experiment switch (study `experiment`) is listed with its
/// command and never judged; the same rows as a main run get their verdict.
#[test]
fn an_experiment_offload_run_is_listed_not_judged() {
    use fathom_results::offload::{BenchResult, OffloadStudy};
    let row = |method: &str, ms: f64, x: Option<f64>| {
        let mut r = BenchResult {
            context: 1 << 20,
            residency: "hbm".into(),
            method: method.into(),
            groups: 1,
            select: "scores".into(),
            gpu_ms: ms,
            ..Default::default()
        };
        if let Some(x) = x {
            r.speedup_vs_136.insert("sparq:32".into(), x);
        }
        r
    };
    let rows = vec![row("fathom:48", 5.0, Some(1.4)), row("sparq:32", 7.0, None)];
    for (study, judged) in [
        (OffloadStudy::Experiment, false),
        (OffloadStudy::Main, true),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut doc = offload_doc("/x/fathom offload-bench --engine cache", rows.clone());
        doc.study = study;
        fathom_results::write(&dir.path().join("switch.json"), doc).unwrap();
        let md = render(dir.path(), None);
        let listed = md.contains(
            "- `switch.json`: offload-bench, study `experiment` (not judged against the targets): `/x/fathom offload-bench --engine cache`",
        );
        assert_eq!(listed, !judged, "{md}");
        assert_eq!(md.contains("sparq:32 1.40×"), judged, "{md}");
    }
}

/// An offload run timing the GPU's row fetch against the host gather: one row per setting,
/// the gather's row named with its threads and judged against its own scans.
#[test]
fn an_offload_row_of_the_host_gather_names_its_threads() {
    use fathom_results::offload::BenchResult;
    let dir = tempfile::tempdir().unwrap();
    let row = |method: &str, gather: usize, ms: f64, x: Option<f64>| {
        let mut r = BenchResult {
            context: 1 << 20,
            residency: "host".into(),
            method: method.into(),
            groups: 1,
            select: "scores".into(),
            host_gather: gather,
            gpu_ms: ms,
            ..Default::default()
        };
        if let Some(x) = x {
            r.speedup_vs_136.insert("sparq:32".into(), x);
        }
        r
    };
    let doc = offload_doc(
        "/x/y/fathom offload-bench --engine cache --host-gather 0,14",
        vec![
            row("fathom:48", 0, 20.0, Some(2.4)),
            row("sparq:32", 0, 48.0, None),
            row("fathom:48", 14, 21.0, Some(2.2)),
            row("sparq:32", 14, 46.2, None),
        ],
    );
    fathom_results::write(&dir.path().join("gather.json"), doc).unwrap();
    let md = render(dir.path(), None);
    assert!(
        md.contains("| 1048576 | host | scores, 1 head group | 20.00 | sparq:32 2.40× |"),
        "{md}"
    );
    assert!(
        md.contains(
            "| 1048576 | host | scores, 1 head group, misses gathered by 14 host threads | 21.00 | sparq:32 2.20× |"
        ),
        "{md}"
    );
    assert!(
        md.contains("meets the 2.3× target") && md.contains("misses the 2.3× target at 2.20×"),
        "{md}"
    );
}

/// An offload run in rounds: one row per setting, its speedup the mean over rounds with the
/// interval, and a verdict only where the whole interval lies on one side of the target (a
/// target inside the interval is neither met nor missed).
#[test]
fn offload_rounds_give_one_row_with_an_interval_and_an_interval_verdict() {
    use fathom_results::offload::BenchResult;
    // fathom:48 at 10 ms every round, sparq:32 at `scan` ms in round i.
    let run = |context: usize, scan: &[f64]| -> Vec<BenchResult> {
        let mut out = Vec::new();
        for (round, &ms) in scan.iter().enumerate() {
            let row = |method: &str, gpu_ms: f64| BenchResult {
                context,
                residency: "host".into(),
                method: method.into(),
                groups: 1,
                select: "scores".into(),
                gpu_ms,
                round,
                ..Default::default()
            };
            let mut f = row("fathom:48", 10.0);
            f.speedup_vs_136.insert("sparq:32".into(), ms / 10.0);
            out.push(f);
            out.push(row("sparq:32", ms));
        }
        out
    };
    let dir = tempfile::tempdir().unwrap();
    let mut results = run(1 << 18, &[20.0, 20.2, 19.8]); // 2.00× [1.95, 2.05]: above 1.9
    results.extend(run(1 << 20, &[22.5, 23.5, 23.0])); // 2.30× [2.18, 2.42]: 2.3 inside
    let mut doc = offload_doc("/x/fathom offload-bench --engine cache --rounds 3", results);
    fathom_results::write(&dir.path().join("rounds.json"), doc.clone()).unwrap();
    let md = render(dir.path(), None);
    assert!(md.contains("Timed in 3 rounds"), "{md}");
    assert!(
        md.contains(
            "| 262144 | host | scores, 1 head group | 10.00 | sparq:32 2.00× [1.95, 2.05] |"
        ),
        "{md}"
    );
    assert!(md.contains("meets the 1.9× target"), "{md}");
    assert!(
        md.contains("sparq:32 2.30× [2.18, 2.42]")
            && md.contains("the 2.3× target lies inside the interval"),
        "{md}"
    );
    assert_eq!(md.matches("| 262144 | host |").count(), 1, "{md}");
    // Tighter rounds below the target: missed.
    doc.results = run(1 << 20, &[22.0, 22.1, 21.9]);
    fathom_results::write(&dir.path().join("rounds.json"), doc).unwrap();
    let md = render(dir.path(), None);
    assert!(md.contains("misses the 2.3× target at 2.20×"), "{md}");
}

/// A committed offload file of the retired benchmark step engine (one that predates the
/// `engine` field, so it reads as the step's) stays readable and renders as history: labelled
/// as a retired engine's wherever it appears.
#[test]
fn a_retired_step_engine_file_renders_as_history() {
    use fathom_results::offload::BenchResult;
    let dir = tempfile::tempdir().unwrap();
    let mut r = BenchResult {
        context: 1 << 18,
        residency: "host".into(),
        method: "fathom:48".into(),
        groups: 1,
        gpu_ms: 10.0,
        ..Default::default()
    };
    r.speedup_vs_136.insert("sparq:32".into(), 2.0);
    let path = dir.path().join("step.json");
    fathom_results::write(&path, offload_doc("/x/fathom offload-bench", vec![r])).unwrap();
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(doc.as_object_mut().unwrap().remove("engine").is_some());
    std::fs::write(&path, doc.to_string()).unwrap();
    let md = render(dir.path(), None);
    assert!(md.contains("**Retired engine (history).**"), "{md}");
    assert!(
        md.contains("| 262144 | host | groups 1, gather CTAs 0 (retired benchmark step engine) |"),
        "{md}"
    );
}

/// A judged setting (tuning recorded, 40 samples per task) made from the committed probe's
/// first record: `score(method, i)` per sample of its one task, at head dimension `d`.
fn judged_setting(
    model: &str,
    d: usize,
    methods: &[&str],
    score: impl Fn(&str, usize) -> f64,
) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let probe = root.join("results/downstream/gpu/tune/tune-gemma3-270m-small.json");
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(probe).unwrap()).unwrap();
    let first = doc["results"][0].clone();
    let results: Vec<serde_json::Value> = (0..40)
        .map(|i| {
            let mut r = first.clone();
            r["sample"]["index"] = i.into();
            let template = r["methods"]["dense"].clone();
            let ms: serde_json::Map<String, serde_json::Value> = methods
                .iter()
                .map(|m| {
                    let mut x = template.clone();
                    x["score"] = score(m, i).into();
                    x["same_as_exact"] = (score(m, i) == score("exact", i)).into();
                    (m.to_string(), x)
                })
                .collect();
            r["methods"] = ms.into();
            r
        })
        .collect();
    doc["model"] = model.into();
    doc["d"] = d.into();
    doc["methods"] = serde_json::json!(methods);
    doc["tasks"] = serde_json::json!(["niah_single"]);
    doc["samples_per_task"] = 40.into();
    doc["seed"] = 2.into();
    doc["tuning"] = serde_json::json!({"seed": 1, "samples_per_task": 5, "chose": "small/docs"});
    doc["summary"] = serde_json::json!({});
    doc["results"] = results.into();
    doc.to_string()
}

/// The budget rule is read off the judged settings: the largest per-channel threshold (0.75
/// from D 64's fathom:48), and the setting whose runs stop below it (D 256: 192 bits against
/// its largest 92) named as untested. A run without tuning seeds is no judged setting.
#[test]
fn the_budget_rule_is_the_largest_threshold_of_the_judged_settings() {
    let m = ["dense", "exact", "fathom:48", "fathom:92"];
    let dir = tempfile::tempdir().unwrap();
    let wide = judged_setting("wide", 256, &m, |m, i| match m {
        "fathom:48" => f64::from(u8::from(i % 2 == 0)),
        _ => 1.0,
    });
    let narrow = judged_setting("narrow", 64, &m, |_, _| 1.0);
    std::fs::write(dir.path().join("wide.json"), &wide).unwrap();
    let md = render(dir.path(), None);
    assert!(md.contains("Rule: **fathom:0.359375c**"), "{md}");
    std::fs::write(dir.path().join("narrow.json"), &narrow).unwrap();
    let md = render(dir.path(), None);
    assert!(
        md.contains("| `narrow.json` (narrow at 32768 tokens) | 64 | 48 bits (0.750 per channel) | 48 (at parity), 92 (at parity) |"),
        "{md}"
    );
    assert!(
        md.contains("Rule: **fathom:0.75c**: 0.75 bits per channel (48 bits at D = 64, 96 at D = 128 (no judged setting), 192 bits at D = 256), set by narrow at 32768 tokens. Untested on wide at 32768 tokens: 192 bits is above the largest budget it ran (92)."),
        "{md}"
    );
    let mut untuned: serde_json::Value = serde_json::from_str(&narrow).unwrap();
    untuned.as_object_mut().unwrap().remove("tuning");
    std::fs::write(dir.path().join("narrow.json"), untuned.to_string()).unwrap();
    std::fs::remove_file(dir.path().join("wide.json")).unwrap();
    assert!(render(dir.path(), None).contains("Rule: Not stated yet: no judged setting."));
}
