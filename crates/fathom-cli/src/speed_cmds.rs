//! `fathom speed`: prefill and dense-decode throughput of the CPU model runtime (fathom-model)
//! on real text, beside llama.cpp (the PyPI wheel `xllamacpp`) on the same token ids, threads
//! and machine.
//!
//! Both sides get the same prompt ids (the prose eval split, cut to the context with the
//! model's own tokenizer), the same thread count and a greedy decode of `--decode-steps`
//! tokens after the prompt. llama.cpp runs with its defaults (f16 KV cache, flash attention
//! chosen automatically, batch 512), which is what a user of it gets. Times are wall-clock of
//! one run each (no warm-up: a prefill of thousands of tokens is far past any warm-up effect).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use fathom_model::corpus::{context_tokens, load_split, CorpusKind, Split};
use fathom_model::fetch::fetch_model;
use fathom_model::{argmax, Dense};
use fathom_results::speed::{ModelSpeed, SpeedRun, Throughput};
use serde_json::json;

use crate::model_cmds::{load_model, CacheArgs};

/// `fathom speed`.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom speed\n  \
    fathom speed --model gemma3-270m --context 2048,8192 --decode-steps 16 --json speed.json\n  \
    fathom speed --no-llama   # fathom-model only")]
pub struct SpeedArgs {
    /// Model: smollm2-135m or gemma3-270m.
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
    /// Prompt lengths in tokens, comma-separated (each at most the model's context).
    #[arg(long, value_delimiter = ',', default_value = "2048")]
    pub context: Vec<usize>,
    /// Greedy decode steps after each prompt.
    #[arg(long, default_value_t = 16)]
    pub decode_steps: usize,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Skip the llama.cpp comparison.
    #[arg(long)]
    pub no_llama: bool,
    /// Threads for llama.cpp (fathom-model uses the rayon pool: all cores).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Write the results as JSON here (atomically).
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub cache: CacheArgs,
}

/// The llama.cpp driver (`scripts/llama_speed.py`), run with `python3 -c`.
const LLAMA_SCRIPT: &str = include_str!("../scripts/llama_speed.py");

fn llama(
    model_path: &std::path::Path,
    ids: &[u32],
    steps: usize,
    threads: usize,
) -> Result<Throughput> {
    let req =
        json!({"ids": ids, "n_predict": steps, "n_ctx": ids.len() + steps + 8, "threads": threads});
    let path = std::env::temp_dir().join(format!("fathom-speed-{}.json", std::process::id()));
    std::fs::write(&path, req.to_string()).context("writing the llama.cpp request")?;
    let python = fathom_model::fetch::default_python();
    let out = std::process::Command::new(&python)
        .arg("-c")
        .arg(LLAMA_SCRIPT)
        .arg(model_path)
        .arg(&path)
        .output()
        .with_context(|| format!("running {python} for llama.cpp"))?;
    let _ = std::fs::remove_file(&path);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        bail!(
            "{}",
            err.lines()
                .rfind(|l| !l.trim().is_empty())
                .unwrap_or("llama.cpp failed")
        );
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let v: Throughput = serde_json::from_str(line.lines().last().unwrap_or(""))
        .context("parsing llama.cpp's timings")?;
    Ok(v)
}

/// Runs `fathom speed`.
///
/// # Errors
/// Bad arguments (a context of 0 or beyond the model's, 0 decode steps), a model or corpus
/// that cannot be fetched, an unwritable `--json` path.
pub fn run_speed(a: SpeedArgs) -> Result<()> {
    if a.decode_steps == 0 {
        bail!("--decode-steps must be at least 1");
    }
    if a.context.is_empty() || a.context.contains(&0) {
        bail!("--context needs positive token counts");
    }
    if let Some(p) = &a.json {
        crate::check_writable(p)?;
    }
    let (id, model) = load_model(&a.model, &a.cache, false)?;
    let max_ctx = model.config().context_length;
    if let Some(&c) = a.context.iter().find(|&&c| c + a.decode_steps > max_ctx) {
        bail!(
            "--context {c} plus {} decode steps exceeds {}'s context of {max_ctx} tokens",
            a.decode_steps,
            a.model
        );
    }
    let model_path = fetch_model(id, &a.cache.fetch_options())?;
    let docs = load_split(CorpusKind::Prose, Split::Eval, &a.cache.corpus_options())?;
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|x| x.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let mut runs = Vec::new();
    println!("| context | fathom-model prefill tok/s | llama.cpp prefill tok/s | fathom-model decode tok/s | llama.cpp decode tok/s |\n|---:|---:|---:|---:|---:|");
    for &n in &a.context {
        let (ids, _) = context_tokens(&docs, model.tokenizer(), n, 0)?;
        eprintln!("speed: {} at {n} tokens: prefill…", a.model);
        let mut cache = model.new_cache(n + a.decode_steps);
        let t0 = Instant::now();
        let mut logits = model.prefill(&ids, &mut cache, a.chunk, None)?;
        let prefill_s = t0.elapsed().as_secs_f64();
        eprintln!(
            "speed: prefill {:.1} s; decoding {} steps…",
            prefill_s, a.decode_steps
        );
        let t1 = Instant::now();
        for _ in 0..a.decode_steps {
            let next = argmax(&logits);
            logits = model.decode_step(next, &mut cache, &mut Dense, None)?;
        }
        let decode_s = t1.elapsed().as_secs_f64();
        drop(cache);
        let ours = Throughput {
            prefill_tok_s: n as f64 / prefill_s,
            prefill_s,
            decode_tok_s: a.decode_steps as f64 / decode_s,
            decode_steps: a.decode_steps,
            prompt_tokens: None,
        };
        let (theirs, err) = if a.no_llama {
            (None, Some("skipped (--no-llama)".to_string()))
        } else {
            eprintln!("speed: llama.cpp on the same {n} ids…");
            match llama(&model_path, &ids, a.decode_steps, a.threads) {
                Ok(v) => (Some(v), None),
                Err(e) => (None, Some(format!("{e:#}"))),
            }
        };
        let f = |x: Option<f64>, p: usize| x.map_or("—".to_string(), |x| format!("{x:.p$}"));
        println!(
            "| {n} | {} | {} | {} | {} |",
            f(Some(ours.prefill_tok_s), 1),
            f(theirs.as_ref().map(|t| t.prefill_tok_s), 1),
            f(Some(ours.decode_tok_s), 2),
            f(theirs.as_ref().map(|t| t.decode_tok_s), 2)
        );
        if let Some(e) = &err {
            eprintln!("speed: llama.cpp: {e}");
        }
        runs.push(SpeedRun {
            context: n,
            fathom_model: ours,
            llama_cpp: theirs,
            llama_cpp_error: err,
        });
    }
    let doc = ModelSpeed {
        version: fathom_results::VERSION,
        fathom: env!("CARGO_PKG_VERSION").into(),
        command: fathom_results::command_line(),
        model: a.model.clone(),
        cpu,
        cores: std::thread::available_parallelism().map_or(1, |x| x.get()),
        llama_threads: a.threads,
        text: "prose eval split (real text), cut with the model's tokenizer".into(),
        runs,
    };
    if let Some(p) = &a.json {
        fathom_results::write(p, doc)?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
