//! The PyTorch path's section: every `python -m fathom.bench_hf` run (`fathom_results::bench_hf`),
//! one table per file, each cache's tokens/s beside the ratios a PyTorch user would ask for,
//! all within the file's own run: against `DynamicCache` (the KV in HBM), against
//! `OffloadedCache` (the KV in host memory) and against `fathom decode-bench` at the same
//! setting.

use fathom_results::bench_hf::{BenchHf, BenchHfEntry};

use crate::Inputs;

/// The entry of `cache` at `e`'s context and batch in `doc`, where it has a timing.
fn peer<'a>(doc: &'a BenchHf, e: &BenchHfEntry, cache: &str) -> Option<&'a BenchHfEntry> {
    doc.entries.iter().find(|x| {
        x.cache == cache && x.context == e.context && x.batch == e.batch && x.tokens_per_s.is_some()
    })
}

/// `a / b` as `1.23×`, or `–`.
fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "–".into(),
    }
}

fn row(doc: &BenchHf, e: &BenchHfEntry) -> String {
    let head = format!("| {} | {} | {} |", e.context, e.batch, e.cache);
    let Some(tps) = e.tokens_per_s else {
        let why = e.error.as_deref().unwrap_or("no timing");
        let why: String = why.chars().take(120).collect();
        return format!(
            "{head} – | – | {:.1} | – | – | – | not run: {} |\n",
            e.weights_ms,
            why.replace('|', "/")
        );
    };
    let base = |c: &str| peer(doc, e, c).and_then(|x| x.tokens_per_s);
    let versus = |c: &str| {
        if e.cache == c {
            "–".into()
        } else {
            ratio(Some(tps), base(c))
        }
    };
    format!(
        "{head} {tps:.2} | {:.1} ({:.1}) | {:.1} | {} | {} | {} | |\n",
        e.tpot_ms.unwrap_or(f64::NAN),
        e.host_enqueue_ms.unwrap_or(f64::NAN),
        e.weights_ms,
        versus("dynamic"),
        versus("offloaded"),
        e.of_decode_bench
            .map_or("–".into(), |r| format!("{:.1} %", 100.0 * r)),
    )
}

/// The section (module docs).
pub fn pytorch_path(inp: &Inputs, s: &mut String) {
    s.push_str("## The PyTorch path: transformers' caches against FathomCache\n\n");
    if inp.bench_hf.is_empty() {
        s.push_str(
            "No `python -m fathom.bench_hf` results were found: not measured in this run.\n\n",
        );
        return;
    }
    s.push_str("`python -m fathom.bench_hf` (the wheel): a transformers model decoding greedily through `dynamic` (transformers' `DynamicCache`, the KV in HBM), `offloaded` (`OffloadedCache`, the KV in host memory, each layer moved over for every step) and `FathomCache` with each method (the KV in pinned host memory through the paged cache; `+graph`: the whole step replayed as one CUDA graph, `fathom.hf_graph`), one process per file. ms/token is the step (the host's time to enqueue it in brackets); weights ms is the same model's eager step with attention replaced by zeros. Every ratio is within the file's own run: against `dynamic` and `offloaded` at the same context and batch, and against `fathom decode-bench` (the project's own forward over the same cache) at the same method, context and batch, run on the same machine in the same call.\n\n");
    for b in &inp.bench_hf {
        let v = &b.doc;
        s.push_str(&format!(
            "`{}` ({}, weights: {}, prefill: {}; {} layers, {} query and {} K/V heads, D = {}; {}; torch {}, transformers {}; sdpa: {}; k = {}; {} rounds of {} steps after {} warm-up):\n\n",
            inp.rel(&b.path),
            v.shape,
            v.weights,
            v.prefill,
            v.model.layers,
            v.model.hq,
            v.model.hkv,
            v.model.d,
            v.device,
            v.torch,
            v.transformers,
            v.sdpa.as_deref().unwrap_or("torch's choice"),
            v.k,
            v.rounds,
            v.steps,
            v.warmup,
        ));
        s.push_str("| context | batch | cache | tokens/s | ms/token (host) | weights ms | vs dynamic | vs offloaded | of decode-bench | |\n|---:|---:|---|---:|---:|---:|---:|---:|---:|---|\n");
        let mut entries: Vec<&BenchHfEntry> = v.entries.iter().collect();
        entries.sort_by_key(|e| (e.context, e.batch)); // stable: run order within a setting
        for e in entries {
            s.push_str(&row(v, e));
        }
        if let Some(k) = &v.killed {
            s.push_str(&format!("\nThe run ended early: {k}.\n"));
        }
        s.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fathom_results::bench_hf::ModelDims;

    fn entry(cache: &str, tps: Option<f64>) -> BenchHfEntry {
        BenchHfEntry {
            cache: cache.into(),
            context: 32768,
            batch: 1,
            weights_ms: 20.0,
            tokens_per_s: tps,
            tpot_ms: tps.map(|t| 1e3 / t),
            host_enqueue_ms: tps.map(|t| 1e3 / t),
            cache_ms: None,
            step_ms: None,
            attend_gpu_ms_per_step: None,
            stage_gpu_ms_per_step: None,
            mean_bits: None,
            decode_bench_tokens_per_s: None,
            of_decode_bench: tps
                .filter(|_| cache.starts_with("fathom"))
                .map(|t| t / 50.0),
            error: tps.is_none().then(|| "out of memory: CUDA | full".into()),
            profile: None,
        }
    }

    #[test]
    fn ratios_are_within_the_setting_and_errors_are_rows() {
        let doc = BenchHf {
            version: 1,
            command: "bench_hf".into(),
            shape: "s".into(),
            weights: "random".into(),
            prefill: "synthetic".into(),
            model: ModelDims {
                layers: 1,
                hq: 1,
                hkv: 1,
                d: 128,
            },
            device: "GPU".into(),
            torch: "t".into(),
            transformers: "x".into(),
            k: 256,
            steps: 4,
            rounds: 3,
            warmup: 1,
            offloaded_steps: 2,
            sdpa: None,
            stage_timing: None,
            killed: None,
            decode_bench: None,
            entries: vec![
                entry("dynamic", Some(40.0)),
                entry("offloaded", None),
                entry("fathom:48", Some(30.0)),
            ],
        };
        let f = row(&doc, &doc.entries[2]);
        assert!(
            f.starts_with(
                "| 32768 | 1 | fathom:48 | 30.00 | 33.3 (33.3) | 20.0 | 0.75× | – | 60.0 % |"
            ),
            "{f}"
        );
        let o = row(&doc, &doc.entries[1]);
        assert!(
            o.ends_with("not run: out of memory: CUDA / full |\n"),
            "{o}"
        );
        let d = row(&doc, &doc.entries[0]);
        assert!(
            d.contains("| 40.00 | 25.0 (25.0) | 20.0 | – | – | – |"),
            "{d}"
        );
    }
}
