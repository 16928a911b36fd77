//! Real-model subcommands (fathom-model): `generate`, `capture`, `fetch-models`, `fetch-corpus`.
//!
//! Wiring in `main.rs`:
//!
//! ```text
//! mod model_cmds;
//! Generate(model_cmds::GenerateArgs)         => model_cmds::run_generate(a)
//! Capture(model_cmds::CaptureArgs)           => model_cmds::run_capture(a)
//! FetchModels(model_cmds::FetchModelsArgs)   => model_cmds::run_fetch_models(a)
//! FetchCorpus(model_cmds::FetchCorpusArgs)   => model_cmds::run_fetch_corpus(a)
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use fathom_model::capture::{capture_with_progress, CaptureDtype, CaptureOptions};
use fathom_model::corpus::{
    context_tokens, documents_from_file, fetch_corpus, load_split, text_tokens, CorpusKind,
    CorpusOptions, Split,
};
use fathom_model::fetch::{fetch_model, FetchOptions, ModelId};
use fathom_model::pypi::{fetch_pypi_file, WONDERWORDS};
use fathom_model::{argmax, Dense, LoadOptions, Model, WeightMode};

/// Where models and corpora are cached (shared by the subcommands).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CacheArgs {
    /// Cache directory (default: `$FATHOM_CACHE`, else `~/.cache/fathom`; on Windows
    /// `%LOCALAPPDATA%\fathom`).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Never download; use only what is cached.
    #[arg(long)]
    pub offline: bool,
}

impl CacheArgs {
    pub fn fetch_options(&self) -> FetchOptions {
        FetchOptions {
            cache_dir: self.cache_dir.clone(),
            offline: self.offline,
            ..Default::default()
        }
    }
    pub fn corpus_options(&self) -> CorpusOptions {
        CorpusOptions {
            cache_dir: self.cache_dir.clone(),
            offline: self.offline,
            ..Default::default()
        }
    }
}

/// `fathom generate`: greedy decoding with dense attention.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom generate --prompt \"The three primary colours are\" --max-tokens 16\n  \
    fathom generate --model gemma3-270m --prompt \"def fibonacci(n):\" --max-tokens 64")]
pub struct GenerateArgs {
    /// Model: smollm2-135m or gemma3-270m.
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
    /// Prompt text (the model's BOS is added when its metadata asks for it).
    #[arg(long)]
    pub prompt: String,
    /// Tokens to generate (stops early at an end-of-sequence token).
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Dequantize every weight to f32 (faster prefill, more memory).
    #[arg(long)]
    pub f32_weights: bool,
    #[command(flatten)]
    pub cache: CacheArgs,
}

/// `fathom capture`: docs/SPEC.md §8 activations of a real model on real text.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom capture --model smollm2-135m --corpus prose --split eval --context 4096 --positions 128 --out eval-4k.safetensors\n  \
    fathom capture --model gemma3-270m --text notes.txt --context 2048 --positions 32 --out mine.safetensors\n  \
    fathom capture --model smollm2-135m --text chats.jsonl --context 8192 --out chats.safetensors   # one {\"text\": ...} per line")]
pub struct CaptureArgs {
    /// Model: smollm2-135m or gemma3-270m.
    #[arg(long)]
    pub model: String,
    /// Corpus: prose or code (the pinned Django 5.1.4 sdist's docs/ or its Python source).
    #[arg(long, default_value = "prose", conflicts_with = "text")]
    pub corpus: String,
    /// Your own text instead of a corpus: plain text, or JSONL (`.jsonl`) with a string field
    /// `text` per line. It must give at least --context tokens; it is never repeated.
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Split: calib or eval.
    #[arg(long, default_value = "calib")]
    pub split: String,
    /// Context length N in tokens.
    #[arg(long)]
    pub context: usize,
    /// Query positions P (the last P tokens).
    #[arg(long, default_value_t = 128)]
    pub positions: usize,
    /// Layers to capture, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    pub layers: Option<Vec<usize>>,
    /// Index of the first document of the split to use.
    #[arg(long, default_value_t = 0)]
    pub doc_start: usize,
    /// Storage dtype: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Output safetensors file.
    #[arg(long)]
    pub out: PathBuf,
    /// Also write the context's token ids (a JSON list, atomically), so another tool can run
    /// the same sequence (the capture records their sha256 as `tokens_sha256`).
    #[arg(long)]
    pub tokens_out: Option<PathBuf>,
    /// Dequantize every weight to f32 (exact f32 matmuls). By default Q8_0 and k-quant weights
    /// stay quantized and multiply 8-bit-quantized activations, as llama.cpp does.
    #[arg(long)]
    pub f32_weights: bool,
    #[command(flatten)]
    pub cache: CacheArgs,
}

/// `fathom fetch-models`: download and verify the pinned GGUFs.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom fetch-models\n  \
    fathom fetch-models --model gemma3-270m --json\n  \
    FATHOM_CACHE=/data/fathom fathom fetch-models --offline   # verify what is cached")]
pub struct FetchModelsArgs {
    /// Only this model (default: all).
    #[arg(long)]
    pub model: Option<String>,
    /// Keep the downloaded wheels in the cache.
    #[arg(long)]
    pub keep_wheels: bool,
    /// Print one JSON line per model instead (`model`, `path`, `file_name`, `bytes`,
    /// `sha256`): what `scripts/device/stage_model.sh` reads to stage a model on the device.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cache: CacheArgs,
}

/// `fathom fetch-corpus`: build the pinned real-text corpora and their calib/eval splits.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
    fathom fetch-corpus\n  \
    fathom fetch-corpus --corpus code --json")]
pub struct FetchCorpusArgs {
    /// Only this corpus: prose or code (default: both).
    #[arg(long)]
    pub corpus: Option<String>,
    /// Also print the corpora's sources, sizes and split counts as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cache: CacheArgs,
}

pub fn load_model(name: &str, cache: &CacheArgs, f32_weights: bool) -> Result<(ModelId, Model)> {
    let id: ModelId = name.parse()?;
    let path = fetch_model(id, &cache.fetch_options())?;
    let weights = if f32_weights {
        WeightMode::Dequantized
    } else {
        WeightMode::Auto
    };
    let model = Model::load(&path, &LoadOptions { weights })
        .with_context(|| format!("loading {}", path.display()))?;
    Ok((id, model))
}

/// Run `fathom generate`.
pub fn run_generate(a: GenerateArgs) -> Result<()> {
    let (_, model) = load_model(&a.model, &a.cache, a.f32_weights)?;
    let tok = model.tokenizer();
    let ids = tok.encode(&a.prompt)?;
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let mut cache = model.new_cache(ids.len() + a.max_tokens);
    let t0 = Instant::now();
    let mut logits = model.prefill(&ids, &mut cache, a.chunk, None)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut out = Vec::new();
    for i in 0..a.max_tokens {
        let next = argmax(&logits);
        out.push(next);
        if tok.stop_tokens().contains(&next) || i + 1 == a.max_tokens {
            break;
        }
        logits = model.decode_step(next, &mut cache, &mut Dense, None)?;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    println!("{}{}", a.prompt, tok.decode(&out)?);
    eprintln!(
        "prompt {} tokens, prefill {:.1} tok/s; generated {} tokens, decode {:.1} tok/s",
        ids.len(),
        ids.len() as f64 / prefill_s,
        out.len(),
        out.len().saturating_sub(1) as f64 / decode_s.max(1e-9)
    );
    Ok(())
}

/// Run `fathom capture`.
pub fn run_capture(a: CaptureArgs) -> Result<()> {
    let kind: CorpusKind = a.corpus.parse()?;
    let split: Split = a.split.parse()?;
    let user_docs = a.text.as_deref().map(documents_from_file).transpose()?;
    let dtype: CaptureDtype = a.dtype.parse()?;
    // Arguments and the output path first: a bad one fails before the model runs.
    if a.positions == 0 || a.positions > a.context {
        bail!(
            "--positions {} is out of range 1..={} (positions beyond the context)",
            a.positions,
            a.context
        );
    }
    if let Some(parent) = a.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("output {} is not writable", a.out.display()))?;
    }
    crate::check_writable(&a.out)?;
    if let Some(p) = &a.tokens_out {
        crate::check_writable(p)?;
    }
    let (id, model) = load_model(&a.model, &a.cache, a.f32_weights)?;
    let (tokens, used) = match &user_docs {
        Some(docs) => text_tokens(docs, model.tokenizer(), a.context)?,
        None => {
            let docs = load_split(kind, split, &a.cache.corpus_options())?;
            context_tokens(&docs, model.tokenizer(), a.context, a.doc_start)?
        }
    };
    let t0 = Instant::now();
    let opts = CaptureOptions {
        positions: a.positions,
        layers: a.layers.clone(),
        chunk: a.chunk,
    };
    let pb = crate::bar(tokens.len() as u64, "prefill");
    let mut cap = capture_with_progress(&model, id.name(), &tokens, &opts, &|done, _| {
        pb.set_position(done as u64)
    })?;
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    match (&a.text, &user_docs) {
        (Some(path), Some(docs)) => {
            cap.metadata.insert("corpus".into(), "text".into());
            cap.metadata.insert("split".into(), "user".into());
            cap.metadata
                .insert("corpus_package".into(), path.display().to_string());
            let listing: String = docs
                .iter()
                .map(|d| format!("{} {}\n", d.path, d.sha256))
                .collect();
            cap.metadata.insert(
                "corpus_sha256".into(),
                fathom_model::fetch::sha256_bytes(listing.as_bytes()),
            );
        }
        _ => {
            let manifest = fetch_corpus(kind, &a.cache.corpus_options())?;
            cap.metadata.insert("corpus".into(), kind.name().into());
            cap.metadata.insert("split".into(), split.name().into());
            cap.metadata
                .insert("corpus_package".into(), manifest.source.to_string());
            cap.metadata
                .insert("corpus_sha256".into(), manifest.corpus_sha256.clone());
        }
    }
    cap.metadata
        .insert("documents".into(), serde_json::to_string(&used)?);
    cap.metadata
        .insert("doc_start".into(), a.doc_start.to_string());
    cap.metadata.insert(
        "weights".into(),
        if a.f32_weights { "f32" } else { "gguf-auto" }.into(),
    );
    cap.metadata.insert("tokens_sha256".into(), {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        fathom_model::fetch::sha256_bytes(&bytes)
    });
    cap.metadata.insert(
        "command".into(),
        std::env::args().collect::<Vec<_>>().join(" "),
    );
    if let Some(parent) = a.out.parent() {
        if !parent.as_os_str().is_empty() {
            std::fs::create_dir_all(parent)?;
        }
    }
    cap.write_safetensors(&a.out, dtype)?;
    if let Some(p) = &a.tokens_out {
        fathom_store::write_atomic(p, serde_json::to_string(&tokens)?.as_bytes())
            .with_context(|| format!("writing {}", p.display()))?;
    }
    eprintln!(
        "captured {} layers of {} at N = {} (P = {}) from {} documents in {:.1} s ({:.0} tok/s) → {}",
        cap.layers.len(),
        id,
        a.context,
        a.positions,
        used.len(),
        secs,
        a.context as f64 / secs,
        a.out.display()
    );
    Ok(())
}

/// Run `fathom fetch-models`.
pub fn run_fetch_models(a: FetchModelsArgs) -> Result<()> {
    let ids: Vec<ModelId> = match &a.model {
        Some(m) => vec![m.parse()?],
        None => ModelId::ALL.to_vec(),
    };
    let mut opts = a.cache.fetch_options();
    opts.remove_wheels = !a.keep_wheels;
    for id in ids {
        let t0 = Instant::now();
        let path = fetch_model(id, &opts)?;
        let spec = id.spec();
        if a.json {
            println!(
                "{}",
                serde_json::json!({
                    "model": id.to_string(), "path": path, "file_name": spec.file_name,
                    "bytes": spec.size, "sha256": spec.sha256,
                })
            );
        } else {
            println!(
                "{id}: {} (sha256 {} verified, {:.1} s)",
                path.display(),
                spec.sha256,
                t0.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

/// Run `fathom fetch-corpus`.
pub fn run_fetch_corpus(a: FetchCorpusArgs) -> Result<()> {
    let kinds = match &a.corpus {
        Some(c) => vec![c.parse::<CorpusKind>()?],
        None => CorpusKind::ALL.to_vec(),
    };
    let opts = a.cache.corpus_options();
    let mut report = Vec::new();
    for kind in kinds {
        let t0 = Instant::now();
        let m = fetch_corpus(kind, &opts)?;
        let (nc, bc) = m.count(Split::Calib);
        let (ne, be) = m.count(Split::Eval);
        println!(
            "{}: {} (sha256 {}), {} documents ({nc} calib {:.2} MB, {ne} eval {:.2} MB), corpus sha256 {} ({:.1} s)",
            kind.name(),
            m.source,
            m.source.sha256,
            m.documents.len(),
            bc as f64 / 1e6,
            be as f64 / 1e6,
            m.corpus_sha256,
            t0.elapsed().as_secs_f64()
        );
        report.push(serde_json::json!({
            "kind": kind.name(), "source": m.source, "selection": m.selection,
            "documents": m.documents.len(),
            "calib": {"documents": nc, "bytes": bc}, "eval": {"documents": ne, "bytes": be},
            "corpus_sha256": m.corpus_sha256,
        }));
    }
    // The RULER keys' word list (read by fathom-eval) comes from a pinned PyPI file too.
    let w = fetch_pypi_file(
        &WONDERWORDS,
        &opts.sources_dir(),
        &opts.python,
        opts.offline,
    )?;
    println!(
        "words: {} (sha256 {} verified)",
        w.display(),
        WONDERWORDS.sha256
    );
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "corpora": report,
                "words": {"file": WONDERWORDS.file_name, "sha256": WONDERWORDS.sha256},
            }))?
        );
    }
    Ok(())
}
