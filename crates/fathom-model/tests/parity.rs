//! Parity with llama.cpp (the `xllamacpp` wheel): greedy tokens and top-5 log-probabilities.
//!
//! llama.cpp decodes greedily from our prompt ids; we teacher-force its tokens through our
//! prefill + decode path and compare, at every step, our argmax with its token and our
//! log-probabilities of its top-5 tokens with its own. Llama.cpp is also given the prompt as
//! text, which must tokenize to the same ids (same count, identical log-probabilities).
//!
//! Skips (printing why) when `python3 -c "import xllamacpp"` fails or a model is not cached.
//! CI: `pip install xllamacpp` and `fathom fetch-models` before `cargo test`.

mod common;

use std::process::Command;

use fathom_model::{argmax, log_softmax, Dense, Model};
use serde_json::Value;

const N_PREDICT: usize = 16;
/// Steps whose argmax must agree (unless llama.cpp's own top-2 margin is a near tie).
const ARGMAX_STEPS: usize = 8;
/// A top-1/top-2 gap below this (nats) is a tie that quantization noise may flip (llama.cpp itself
/// flips such a step, margin 0.09, between its f16 and f32 KV cache).
const TIE_MARGIN: f64 = 0.1;
/// Mean |Δ logprob| over shared top-5 tokens (the parity tolerance of the model runtime).
const MEAN_LOGPROB_TOL: f64 = 0.2;
/// The same for Gemma 3 on a prompt longer than its window (measured 0.18–0.23).
const LONG_GEMMA_MEAN_TOL: f64 = 0.3;

fn prompts(m: &Model) -> Vec<(String, Vec<u32>)> {
    let long = common::LONG_TEXT;
    let short = "The capital of France is".to_string();
    // > 512 tokens so Gemma's sliding window is exercised.
    let ids = m.tokenizer().encode(long).unwrap();
    let text = m.tokenizer().decode(&ids[..ids.len().min(900)]).unwrap();
    [short, text]
        .into_iter()
        .map(|t| {
            let ids = m.tokenizer().encode(&t).unwrap();
            (t, ids)
        })
        .collect()
}

fn reference(model_path: &std::path::Path, prompts: &[(String, Vec<u32>)]) -> Option<Value> {
    let n_ctx = prompts.iter().map(|p| p.1.len()).max().unwrap() + N_PREDICT + 16;
    let req = serde_json::json!({
        "n_predict": N_PREDICT, "n_ctx": n_ctx,
        "prompts": prompts.iter().map(|(t, ids)| serde_json::json!({"ids": ids, "text": t})).collect::<Vec<_>>(),
    });
    let dir = tempfile::tempdir().unwrap();
    let req_path = dir.path().join("req.json");
    std::fs::write(&req_path, req.to_string()).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/llamacpp_ref.py");
    let python = fathom_model::fetch::default_python();
    let out = match Command::new(&python)
        .arg(script)
        .arg(model_path)
        .arg(&req_path)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIP: cannot run {python}: {e}");
            return None;
        }
    };
    if out.status.code() == Some(3) {
        eprintln!(
            "SKIP: {} (pip install xllamacpp)",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    assert!(
        out.status.success(),
        "llama.cpp reference failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).expect("reference JSON"))
}

fn check(id: fathom_model::fetch::ModelId) {
    let mode = match std::env::var("PARITY_WEIGHTS").as_deref() {
        Ok("quantized") => fathom_model::WeightMode::Quantized,
        Ok("f32") => fathom_model::WeightMode::Dequantized,
        _ => fathom_model::WeightMode::Auto,
    };
    let Some(m) = common::load_with(id, mode) else {
        return;
    };
    let path = fathom_model::fetch::model_path(id, &Default::default());
    let ps = prompts(&m);
    let Some(refj) = reference(&path, &ps) else {
        return;
    };
    for ((text, ids), res) in ps.iter().zip(refj["results"].as_array().unwrap()) {
        let r = &res["ids"];
        let rt = &res["text"];
        assert_eq!(
            rt["prompt_tokens"].as_u64().unwrap() as usize,
            ids.len(),
            "{id}: token count of text prompt"
        );
        let steps = r["steps"].as_array().unwrap();
        let tsteps = rt["steps"].as_array().unwrap();
        assert_eq!(
            steps[0], tsteps[0],
            "{id}: llama.cpp differs between text and our ids → tokenization differs"
        );
        let _ = text;
        // Gemma past its 512-token window: Q8 activation rounding makes the logits heavy-tailed
        // noisy (our own one-shot vs decode differ by up to 0.3 in a top-5 log-prob, and llama.cpp
        // flips near-ties between its own cache types); measured mean 0.18–0.23 over the
        // 900-token prompt, with single steps off by up to 1.0. Checked looser, see module docs.
        let long_gemma = id == fathom_model::fetch::ModelId::Gemma3_270m && ids.len() > 512;
        let (strict_steps, mean_tol, min_agree) = if long_gemma {
            (0, LONG_GEMMA_MEAN_TOL, 12)
        } else {
            (ARGMAX_STEPS, MEAN_LOGPROB_TOL, 14)
        };
        let mut cache = m.new_cache(ids.len() + N_PREDICT);
        let mut logits = m.prefill(ids, &mut cache, 256, None).unwrap();
        let (mut agree, mut sum, mut cnt, mut worst) = (0usize, 0f64, 0usize, 0f64);
        for (i, s) in steps.iter().enumerate() {
            let tok = s["id"].as_u64().unwrap() as u32;
            let top = s["top"].as_array().unwrap();
            let lp = log_softmax(&logits);
            let ours = argmax(&logits);
            let margin = top[0][1].as_f64().unwrap() - top[1][1].as_f64().unwrap();
            if ours == tok {
                agree += 1;
            } else if i < strict_steps && std::env::var("PARITY_NOASSERT").is_err() {
                assert!(margin < TIE_MARGIN, "{id} prompt of {} tokens, step {i}: ours {ours} vs llama.cpp {tok} (margin {margin:.3})", ids.len());
            }
            if std::env::var("PARITY_VERBOSE").is_ok() {
                let mine: Vec<String> = top
                    .iter()
                    .map(|t| {
                        format!(
                            "{}:{:.3}/{:.3}",
                            t[0],
                            lp[t[0].as_u64().unwrap() as usize],
                            t[1].as_f64().unwrap()
                        )
                    })
                    .collect();
                eprintln!("  step {i}: {}", mine.join(" "));
            }
            for t in top {
                let d = (lp[t[0].as_u64().unwrap() as usize] as f64 - t[1].as_f64().unwrap()).abs();
                sum += d;
                cnt += 1;
                worst = worst.max(d);
            }
            if i + 1 < steps.len() {
                logits = m.decode_step(tok, &mut cache, &mut Dense, None).unwrap();
            }
        }
        let mean = sum / cnt as f64;
        eprintln!(
            "PARITY {id}: prompt {} tokens, argmax agreement {agree}/{}, mean |Δlogprob| top-5 {mean:.4}, max {worst:.4}",
            ids.len(),
            steps.len()
        );
        assert!(mean <= mean_tol, "{id}: mean |Δlogprob| {mean}");
        assert!(
            agree >= min_agree,
            "{id}: argmax agreement {agree}/{}",
            steps.len()
        );
    }
}

#[test]
fn smollm2_matches_llama_cpp() {
    check(fathom_model::fetch::ModelId::Smollm2_135m);
}

#[test]
fn gemma3_matches_llama_cpp() {
    check(fathom_model::fetch::ModelId::Gemma3_270m);
}
