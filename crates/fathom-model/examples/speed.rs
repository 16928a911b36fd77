//! Prefill and dense-decode throughput on real text (prose eval split):
//! `cargo run --release -p fathom-model --example speed -- smollm2-135m 2048 [decode_steps] [--llama]`
//! With `--llama`, the same token ids also go through llama.cpp (`xllamacpp`) for comparison.
use std::time::Instant;

use fathom_model::corpus::{context_tokens, load_split, CorpusKind, CorpusOptions, Split};
use fathom_model::fetch::{fetch_model, FetchOptions, ModelId};
use fathom_model::{argmax, Dense, LoadOptions, Model};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let id: ModelId = args
        .get(1)
        .map(|s| s.as_str())
        .unwrap_or("smollm2-135m")
        .parse()?;
    let n: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(2048);
    let steps: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(16);
    let llama = args.iter().any(|a| a == "--llama");
    let path = fetch_model(id, &FetchOptions::default())?;
    let model = Model::load(&path, &LoadOptions::default())?;
    let docs = load_split(CorpusKind::Prose, Split::Eval, &CorpusOptions::default())?;
    let (ids, _) = context_tokens(&docs, model.tokenizer(), n, 0)?;
    let mut cache = model.new_cache(n + steps);
    let t0 = Instant::now();
    let mut logits = model.prefill(&ids, &mut cache, 512, None)?;
    let pf = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for _ in 0..steps {
        let next = argmax(&logits);
        logits = model.decode_step(next, &mut cache, &mut Dense, None)?;
    }
    let dc = t1.elapsed().as_secs_f64();
    println!(
        "fathom-model {id} n={n}: prefill {:.1} tok/s ({pf:.1} s), decode {:.2} tok/s",
        n as f64 / pf,
        steps as f64 / dc
    );
    if llama {
        let req = serde_json::json!({"ids": ids, "n_predict": steps, "n_ctx": n + steps + 8});
        let dir = std::env::temp_dir().join("fathom-speed-req.json");
        std::fs::write(&dir, req.to_string())?;
        let script = r#"
import json, sys, xllamacpp as xl
req = json.load(open(sys.argv[2]))
p = xl.CommonParams(); p.model.path = sys.argv[1]; p.n_ctx = req["n_ctx"]
p.n_batch = 512; p.n_ubatch = 512; p.cpuparams.n_threads = 2; p.cpuparams_batch.n_threads = 2; p.warmup = False
s = xl.Server(p)
r = s.handle_completions({"prompt": req["ids"], "n_predict": req["n_predict"], "temperature": 0, "ignore_eos": True, "cache_prompt": False})
t = r.get("timings") or sys.exit(f"no timings: {r.get('error')}"); print(f"llama.cpp: prefill {t['prompt_per_second']:.1f} tok/s, decode {t['predicted_per_second']:.2f} tok/s")
"#;
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&path)
            .arg(&dir)
            .output()?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            eprintln!(
                "llama.cpp failed: {}",
                err.lines().rev().take(3).collect::<Vec<_>>().join(" | ")
            );
        }
    }
    Ok(())
}
