//! Judged downstream statistics (docs/SPEC.md §7, "Judging parity"): paired bootstrap
//! intervals, the equivalence verdict at the declared margin, and their reading of a RULER run
//! ([`ruler`]), an agent-steps run ([`agent`]) and a GPU parity run ([`parity`]), and the
//! budget rule the judged settings support ([`budget`]). Typed values
//! only: `fathom-report` renders them.
//!
//! ```
//! use fathom_results::judged::stats::{judge, Interval, Verdict, PARITY_MARGIN};
//! let iv = Interval { mean: -0.02, lo: -0.07, hi: 0.03, n: 40 };
//! assert_eq!(judge(&iv, PARITY_MARGIN), Verdict::AtParity);
//! let iv = Interval { mean: -0.10, lo: -0.25, hi: 0.04, n: 40 };
//! assert_eq!(judge(&iv, PARITY_MARGIN), Verdict::Undecided);
//! ```

pub mod agent;
pub mod budget;
pub mod parity;
pub mod ruler;
pub mod stats;

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::agent::judge_agent;
    use super::ruler::{fathom_reading, judge_ruler};
    use super::stats::Verdict;
    use crate::downstream::{AgentDoc, RulerDoc};

    fn header(methods: &[&str]) -> Value {
        json!({
            "version": 2, "command": "fathom ruler", "model": "m", "layers": 1,
            "global_layers": 1, "layer_kinds": ["global"], "hq": 2, "hkv": 1, "d": 64,
            "context": 4096, "select": {"sink": 4, "local": 32, "k": 128},
            "methods": methods, "seed": 2, "device": "cpu", "protocol": "p",
            "load_seconds": 0.0, "seconds": 0.0
        })
    }

    /// A RULER run of `n` samples on each task; `score(task, i, method)`.
    fn ruler(
        tasks: &[&str],
        n: usize,
        methods: &[&str],
        score: impl Fn(&str, usize, &str) -> f64,
    ) -> RulerDoc {
        let mut v = header(methods);
        let mut results = Vec::new();
        for t in tasks {
            for i in 0..n {
                let ms: serde_json::Map<String, Value> = methods
                    .iter()
                    .map(|m| {
                        let s = score(t, i, m);
                        let same = s == score(t, i, "exact");
                        let bits = m
                            .strip_prefix("fathom:")
                            .map_or(0.0, |b| b.parse().unwrap());
                        (
                            m.to_string(),
                            json!({"generation": "", "score": s, "tokens": 1,
                            "same_as_exact": same, "first_divergence_from_exact": null,
                            "mean_bits": bits, "density": 0.1, "seconds": 0.0}),
                        )
                    })
                    .collect();
                results.push(
                    json!({"sample": {"task": t, "index": i}, "prefill_seconds": 0.0,
                    "seconds": 0.0, "methods": ms}),
                );
            }
        }
        let o = v.as_object_mut().unwrap();
        o.insert("tasks".into(), json!(tasks));
        o.insert("samples_per_task".into(), json!(n));
        o.insert("line_stop".into(), json!(true));
        o.insert("haystack".into(), json!("h"));
        o.insert("summary".into(), json!({}));
        o.insert("results".into(), Value::Array(results));
        serde_json::from_value(v).unwrap()
    }

    /// Dense does task `a` (1.0) and not `b` (0.0); fathom:64 equals exact everywhere,
    /// fathom:32 loses every second sample of `a`, sparq:32 fails `b` only (not pooled).
    #[test]
    fn ruler_rows_pool_only_the_tasks_dense_can_do() {
        let m = ["dense", "exact", "fathom:32", "fathom:64", "sparq:32"];
        let doc = ruler(&["a", "b"], 40, &m, |t, i, m| match (t, m) {
            ("a", "fathom:32") => f64::from(u8::from(i % 2 == 0)),
            ("a", _) => 1.0,
            ("b", "dense") => 0.0,
            ("b", "sparq:32") => 0.0,
            _ => 0.5,
        });
        let j = judge_ruler(&doc);
        assert_eq!(j.informative(), ["a"]);
        assert_eq!((j.k_fraction, j.d), (128.0 / 4096.0, 64));
        let row = |name: &str| j.methods.iter().find(|r| r.method == name).unwrap();
        assert_eq!(row("fathom:64").verdict, Some(Verdict::AtParity));
        assert_eq!(row("fathom:64").identical, 40);
        assert_eq!(row("fathom:64").bits_per_channel, 1.0);
        assert_eq!(
            row("sparq:32").verdict,
            Some(Verdict::AtParity),
            "task b is not pooled"
        );
        assert_eq!(row("fathom:32").verdict, Some(Verdict::Below));
        assert!((row("fathom:32").vs_exact.mean + 0.5).abs() < 1e-12);
        assert!((row("fathom:32").vs_dense.mean + 0.5).abs() < 1e-12);
        assert_eq!(row("exact").verdict, None);
        assert_eq!(row("dense").vs_dense.n, 0);
        // Task b's own row still shows sparq:32's loss.
        let b = &j.tasks[1];
        assert!(!b.informative && (b.vs_exact["sparq:32"].0.mean + 0.5).abs() < 1e-12);
        let f = fathom_reading(&j);
        assert_eq!(f.at_parity_from, Some(64.0));
        assert_eq!(f.below, [32.0]);
    }

    /// Twenty clean samples are not enough for parity; no task dense can do judges nothing.
    #[test]
    fn small_or_uninformative_runs_are_undecided() {
        let m = ["dense", "exact", "fathom:48"];
        let j = judge_ruler(&ruler(&["a"], 20, &m, |_, _, _| 1.0));
        assert_eq!(j.methods[2].verdict, Some(Verdict::Undecided));
        assert_eq!(fathom_reading(&j).at_parity_from, None);
        let j = judge_ruler(&ruler(&["a"], 40, &m, |_, _, _| 0.0));
        assert!(j.informative().is_empty());
        assert_eq!(j.methods[2].vs_exact.n, 0);
        assert_eq!(j.methods[2].verdict, Some(Verdict::Undecided));
    }

    fn agent(sessions: usize, agree: impl Fn(usize, &str) -> f64, methods: &[&str]) -> AgentDoc {
        let mut v = header(methods);
        let summary: serde_json::Map<String, Value> = methods
            .iter()
            .map(|m| {
                let mean = (0..sessions).map(|s| agree(s, m)).sum::<f64>() / sessions as f64;
                (
                    m.to_string(),
                    json!({"agree_exact": mean, "agree_dense": mean,
                    "top1_vs_truth": 0.5, "mean_bits": 1.0}),
                )
            })
            .collect();
        let results: Vec<Value> = (0..sessions)
            .map(|s| {
                let ms: serde_json::Map<String, Value> = methods
                    .iter()
                    .map(|m| (m.to_string(), json!({"agree_exact": agree(s, m), "agree_dense": agree(s, m),
                        "top1_vs_truth": 0.5, "steps_differing_from_exact": [], "argmax": [],
                        "mean_bits": 1.0, "density": 0.1, "seconds": 0.0})))
                    .collect();
                json!({"session": {}, "continuation": [], "prefill_seconds": 0.0, "seconds": 0.0, "methods": ms})
            })
            .collect();
        let o = v.as_object_mut().unwrap();
        o.insert("sessions".into(), json!(sessions));
        o.insert("steps".into(), json!(64));
        o.insert("summary".into(), Value::Object(summary));
        o.insert("results".into(), Value::Array(results));
        serde_json::from_value(v).unwrap()
    }

    /// The best 136-bit scan is the one with the highest mean; fathom:48 is 0.05 short of it
    /// (outside the margin), fathom:64 0.01 short on every session (inside it).
    #[test]
    fn the_smallest_budget_that_reaches_the_best_136_bit_scan() {
        let m = [
            "dense",
            "exact",
            "fathom:48",
            "fathom:64",
            "sparq:32",
            "ds:32",
            "ds:64",
        ];
        let doc = agent(
            16,
            |s, m| {
                let wobble = if s % 2 == 0 { 0.01 } else { -0.01 };
                wobble
                    + match m {
                        "fathom:48" => 0.85,
                        "fathom:64" => 0.89,
                        "sparq:32" => 0.80,
                        "ds:32" => 0.90,
                        "ds:64" => 0.99,
                        _ => 1.0,
                    }
            },
            &m,
        );
        let j = judge_agent(&doc);
        assert_eq!(j.best_136.as_ref().map(|b| b.0.as_str()), Some("ds:32"));
        let (b, iv) = j.smallest_reaching.unwrap();
        assert_eq!(b, 64.0);
        assert!((iv.mean + 0.01).abs() < 1e-9 && iv.n == 16);
        let r48 = j.rows.iter().find(|r| r.method == "fathom:48").unwrap();
        assert!(r48.vs_best.unwrap().hi < -0.02);
        assert!(j
            .rows
            .iter()
            .find(|r| r.method == "ds:64")
            .unwrap()
            .vs_best
            .is_none());
    }
}
