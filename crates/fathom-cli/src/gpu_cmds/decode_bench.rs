//! `fathom decode-bench`: end-to-end decode throughput of a batch of sessions on the GPU.

use super::*;

/// `fathom decode-bench`: end-to-end decode throughput of a real model on the GPU.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Each session is prefilled with real prose (timed apart), then every method decodes `--steps` \
greedy tokens for the first B sessions of each `--batch`, all in one batch per step (forks of the prefilled \
sessions, so every method starts from the same caches). Weights: the pinned GGUF's, or for qwen3-8b and \
llama3.1-8b random bf16 made on the device with synthetic K/V (labelled). Needs a build with `--features cuda` \
and a GPU.\n\nExamples:\n  \
    fathom decode-bench --model qwen3-8b --context 128k,512k --batch 2,8 --methods dense,fathom:48,sparq:32\n  \
    fathom decode-bench --model qwen3-8b --context 128k --batch 4 --residency index-hbm --methods fathom:48,sparq:32\n  \
    fathom decode-bench --model smollm2-135m --context 32k --batch 1,4,16 --json decode-bench-smollm2.json\n  \
    fathom decode-bench --model gemma3-270m --context 32k,128k --batch 2,8 --methods dense,fathom:48,sparq:32"
)]
pub struct DecodeBenchArgs {
    /// Model: smollm2-135m or gemma3-270m (real weights, sessions of real prose), or the
    /// random-weight shapes qwen3-8b and llama3.1-8b (synthetic K/V; labelled in the output).
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
    /// Session contexts, cycled over the sessions (`32k`, `128k,512k`, `1m`).
    #[arg(long, value_delimiter = ',', default_value = "8k")]
    pub context: Vec<String>,
    /// Batch sizes to time.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub batch: Vec<usize>,
    /// Methods (`dense` is every record over the link; the rest go through the cache's scan).
    #[arg(long, default_value = "dense,exact,fathom:48,fathom:92,sparq:32")]
    pub methods: String,
    /// Timed decode steps per method and batch (after one untimed step).
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// Top-k per query head.
    #[arg(long, default_value_t = 256)]
    pub k: usize,
    /// Where the pages live: host (the offloaded cache), hbm (the whole cache in HBM: the
    /// in-GPU reference), or index-hbm (the index, planes and scales, in HBM; the K|V records
    /// on the host: only fetched rows cross the link).
    #[arg(long, default_value = "host", value_parser = ["host", "hbm", "index-hbm"])]
    pub residency: String,
    /// HBM row-cache slots per (session, layer, KV head).
    #[arg(long, default_value_t = 0)]
    pub row_cache: usize,
    /// Also time every method and batch with the whole step (forward, appends, attention,
    /// sampling) captured once as a CUDA graph and replayed (entries with `graph: true`; the
    /// step's host work is then the reserve, two small uploads and one launch). Models with
    /// sliding-window layers are refused.
    #[arg(long)]
    pub graph: bool,
    /// Head groups per attend (`CacheOptions::attend_groups`: the scan of group i+1 overlaps
    /// group i's top-k, row fetch and attention on a second stream; the same outputs), 1 to
    /// the model's KV heads.
    #[arg(long, default_value_t = 1)]
    pub attend_groups: usize,
    /// Plane words per global load of the scan (`CacheOptions::scan_vector_words`): 1 (8
    /// bytes) or 2 (16 bytes).
    #[arg(long = "scan-vec", default_value_t = 1)]
    pub scan_vec: u32,
    /// CPU threads of the host gather (`CacheOptions::host_gather_threads`): they copy the row
    /// fetch's missed K|V records into pinned staging the GPU reads in order; 0 (the default):
    /// the GPU reads each record from host memory itself. Needs one head group.
    #[arg(long = "host-gather", default_value_t = 0)]
    pub host_gather: usize,
    /// Percent of the misses the host gather brings while the fetch reads the rest itself,
    /// at once (`CacheOptions::host_gather_share`; 1 to 100, the default 100: all).
    #[arg(long = "host-share", default_value_t = 100)]
    pub host_share: u32,
    /// Split each attend of the stage-split steps by stage (plan, scan, top-k, union, fetch,
    /// attention; `CacheOptions::stage_timing`): a CUDA event after each stage of every plain
    /// (not graph-replayed) attend, so the timed steps carry them too; off by default.
    #[arg(long = "stage-timing")]
    pub stage_timing: bool,
    /// GPUs of this host (sessions spread over `gpus / tp` groups).
    #[arg(long, default_value_t = 1)]
    pub gpus: usize,
    /// Tensor-parallel GPUs per group (KV heads split, Megatron-style).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Write the results as JSON here (atomically).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also plot aggregate tokens/s against B, one line per method (PNG).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub cache: CacheArgs,
}

/// Checks `--gpus` / `--tp` against the model (`fathom_gpu::shard`) and describes the plan; a
/// plan over several GPUs is refused until the multi-GPU path exists (it needs NCCL and a
/// machine with several GPUs).
fn multi_gpu_plan(
    cfg: &fathom_model::Config,
    gpus: usize,
    tp: usize,
    sessions: &[usize],
) -> Result<()> {
    if gpus == 0 || tp == 0 || gpus % tp != 0 {
        bail!("--gpus {gpus} --tp {tp}: want tp ≥ 1 dividing gpus ≥ 1");
    }
    let shards = fathom_gpu::shard::tensor_parallel(cfg, tp)?;
    let groups = fathom_gpu::shard::data_parallel(sessions, gpus / tp)?;
    if gpus > 1 {
        let heads: Vec<String> = shards
            .iter()
            .map(|s| {
                format!(
                    "GPU {}: KV heads {:?}, FFN rows {:?}",
                    s.rank, s.kv_heads, s.ffn
                )
            })
            .collect();
        bail!(
            "--gpus {gpus}: several GPUs are not run yet (the tensor-parallel all-reduce needs NCCL and a multi-GPU machine); the plan would be: within each of {} groups {}; sessions per group {:?}",
            gpus / tp,
            heads.join("; "),
            groups
        );
    }
    Ok(())
}

/// Run `fathom decode-bench`.
pub fn run_decode_bench(a: DecodeBenchArgs) -> Result<()> {
    let preset = fathom_gpu::presets::preset(&a.model);
    let id: Option<ModelId> = match preset {
        Some(_) => None,
        None => Some(a.model.parse().map_err(|e| {
            anyhow::anyhow!(
                "{e} (or a random-weight shape: {})",
                fathom_gpu::presets::PRESETS.join(", ")
            )
        })?),
    };
    let contexts = a
        .context
        .iter()
        .map(|c| fathom_bench::offload::parse_context(c).map_err(anyhow::Error::from))
        .collect::<Result<Vec<usize>>>()?;
    if contexts.is_empty() || a.batch.is_empty() || a.batch.contains(&0) || a.steps == 0 {
        bail!("--context, --batch (each ≥ 1) and --steps ≥ 1 are needed");
    }
    if a.k == 0 {
        bail!("--k must be at least 1");
    }
    let names: Vec<String> = a.methods.split(',').map(|m| m.trim().to_string()).collect();
    check_gpu_methods(&names)?;
    if let Some(p) = &a.json {
        crate::check_writable(p)?;
    }
    if let Some(p) = &a.plot {
        crate::check_writable(p)?;
    }
    fathom_cuda::cache::check_scan_vector_words(a.scan_vec)
        .map_err(|e| anyhow::anyhow!("--scan-vec: {e}"))?;
    if a.host_gather > fathom_cuda::cache::MAX_GATHER_THREADS {
        bail!(
            "--host-gather {}: at most {} threads",
            a.host_gather,
            fathom_cuda::cache::MAX_GATHER_THREADS
        );
    }
    fathom_cuda::cache::check_host_gather_share(a.host_share)
        .map_err(|e| anyhow::anyhow!("--host-share: {e}"))?;
    if a.host_gather > 0 && a.attend_groups > 1 {
        bail!("--host-gather {} with --attend-groups {}: the host gather serves one fetch at a time (one head group)", a.host_gather, a.attend_groups);
    }
    if a.host_gather > 0 && a.residency == "hbm" {
        bail!("--host-gather {}: --residency hbm keeps the K|V records in HBM, there is nothing to gather on the host (host or index-hbm)", a.host_gather);
    }
    if a.attend_groups == 0 {
        bail!("--attend-groups 0: want 1 to the model's KV heads");
    }
    if let Some(c) = &preset {
        if a.attend_groups > c.n_kv_heads {
            bail!(
                "--attend-groups {}: the model has {} KV heads (a group holds at least one)",
                a.attend_groups,
                c.n_kv_heads
            );
        }
        // The shape is known: the multi-GPU plan is checked before the device is opened.
        let bmax = *a.batch.iter().max().unwrap_or(&1);
        let ctx: Vec<usize> = (0..bmax).map(|i| contexts[i % contexts.len()]).collect();
        multi_gpu_plan(c, a.gpus, a.tp, &ctx)?;
    } else if a.gpus == 0 || a.tp == 0 || a.gpus % a.tp != 0 {
        bail!(
            "--gpus {} --tp {}: want tp ≥ 1 dividing gpus ≥ 1",
            a.gpus,
            a.tp
        );
    }
    let gpu = Gpu::open(0).context("decode-bench needs a GPU")?;
    let h2d_gbps = gpu.h2d_bandwidth(256 << 20)?;
    // Real weights and text, or a preset's random weights and synthetic K/V (labelled).
    let real = match id {
        Some(id) => {
            let path = fetch_model(id, &a.cache.fetch_options())?;
            let cpu = Model::load(&path, &LoadOptions::default())
                .with_context(|| format!("loading {}", path.display()))?;
            Some((cpu, DenseWeights::load(&path)?))
        }
        None => None,
    };
    let cfg = match (&real, &preset) {
        (Some((_, w)), _) => w.config.clone(),
        (None, Some(c)) => c.clone(),
        (None, None) => bail!("no model"),
    };
    if a.attend_groups > cfg.n_kv_heads {
        bail!(
            "--attend-groups {}: the model has {} KV heads (a group holds at least one)",
            a.attend_groups,
            cfg.n_kv_heads
        );
    }
    if a.graph
        && cfg
            .layer_kinds
            .iter()
            .any(|k| *k != fathom_model::LayerKind::Global)
    {
        bail!(
            "--graph: {} has sliding-window layers, whose decode step is not captured as a graph",
            a.model
        );
    }
    let d = cfg.head_dim;
    let atts = names
        .iter()
        .map(|m| {
            Ok(Attention {
                method: AttendMethod::parse(m, d)?,
                params: SelectParams {
                    sink: 4,
                    local: 32,
                    k: a.k,
                },
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let bmax = *a.batch.iter().max().unwrap_or(&1);
    let ctx: Vec<usize> = (0..bmax).map(|i| contexts[i % contexts.len()]).collect();
    multi_gpu_plan(&cfg, a.gpus, a.tp, &ctx)?;
    let max_tokens = ctx.iter().max().copied().unwrap_or(1) + a.steps + 8;
    let mut dcfg = DecoderConfig::new(2 * bmax, max_tokens);
    dcfg.max_batch = bmax;
    dcfg.max_k = a.k.min(max_tokens);
    dcfg.row_cache = a.row_cache;
    dcfg.options = fathom_cuda::cache::CacheOptions {
        attend_groups: a.attend_groups,
        scan_vector_words: a.scan_vec,
        host_gather_threads: a.host_gather,
        host_gather_share: if a.host_gather > 0 { a.host_share } else { 100 },
        stage_timing: a.stage_timing,
        ..fathom_cuda::cache::CacheOptions::default()
    };
    dcfg.residency = fathom_cuda::Residency::parse(&a.residency)?;
    let per: usize = ctx
        .iter()
        .map(|n| (n + a.steps + 8).div_ceil(dcfg.page_tokens))
        .sum();
    dcfg.pages = Some(per + 2 * bmax + 8);
    serve_methods(&mut dcfg, &atts);
    let needs_calib = atts.iter().any(|t| {
        matches!(
            t.method,
            AttendMethod::Scan(
                fathom_cuda::Method::Fathom(_)
                    | fathom_cuda::Method::DoubleSparsity(_)
                    | fathom_cuda::Method::Loki(_)
            )
        )
    });
    let corpus = a.cache.corpus_options();
    let t0;
    let mut roots = Vec::with_capacity(bmax);
    let (mut dec, weights_label) = match &real {
        Some((cpu, weights)) => {
            let mut dec = GpuDecoder::new(&gpu, weights, dcfg)?;
            // σ² and DS channels from one held-out calibration context (as the downstream runs).
            if needs_calib {
                let docs = load_split(CorpusKind::Prose, Split::Calib, &corpus)?;
                let n = ctx.iter().min().copied().unwrap_or(1).min(8192);
                let (ids, _) = context_tokens(&docs, cpu.tokenizer(), n, 0)?;
                let cal = fathom_eval::decode::calibrate(cpu, &ids, 128)?;
                for (l, heads) in cal.heads.iter().enumerate() {
                    if !heads.is_empty() {
                        dec.cache_mut()?.load_calibration(l, heads)?;
                    }
                }
            }
            let docs = load_split(CorpusKind::Prose, Split::Eval, &corpus)?;
            t0 = Instant::now();
            for (i, &n) in ctx.iter().enumerate() {
                let (ids, _) = context_tokens(&docs, cpu.tokenizer(), n, 7 * i)?;
                let s = dec.create()?;
                let logits = dec.prefill(s, &ids)?;
                roots.push((s, fathom_model::argmax(&logits)));
            }
            (
                dec,
                "real (the pinned GGUF's weights; sessions of real prose)".to_string(),
            )
        }
        None => {
            let mut dec = GpuDecoder::random(&gpu, cfg.clone(), 7, dcfg)?;
            // The synthetic keys' exact channel variances as the calibration.
            let heads = fathom_gpu::presets::synthetic_calibration(&cfg);
            for l in 0..cfg.n_layers {
                dec.cache_mut()?.load_calibration(l, &heads)?;
            }
            t0 = Instant::now();
            for (i, &n) in ctx.iter().enumerate() {
                let s = dec.create()?;
                dec.fill_synthetic(s, n, i as u64)?;
                roots.push((s, 0u32));
            }
            let label = format!(
                "{}; K/V synthetic (uniform, keys with channel spreads 0.1 + c/D), no prefill forward",
                fathom_gpu::presets::RANDOM_WEIGHTS
            );
            (dec, label)
        }
    };
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let named: Vec<(String, Attention)> = names.iter().cloned().zip(atts.iter().copied()).collect();
    let m = fathom_gpu::throughput::measure(
        &mut dec,
        &roots,
        &named,
        &a.batch,
        a.steps,
        h2d_gbps,
        dcfg.residency,
        a.graph,
    )?;
    for e in &m.entries {
        let sp = e.split.as_ref();
        println!(
            "B={:<3} {:<12}{} {:>9.1} tok/s ({:.1} per session), step p50 {:.2} ms p99 {:.2} ms, link {:.1} MB/step = floor {:.2} ms; GPU split: weights {:.2}, attention {:.2}, appends {:.2}, sampling {:.2} ms",
            e.batch,
            e.method,
            if e.graph { " graph" } else { "" },
            e.tokens_per_s,
            e.per_session_tokens_per_s,
            e.step_ms_p50,
            e.step_ms_p99,
            e.pcie_bytes_per_step / 1e6,
            e.link_floor_ms,
            sp.map_or(f64::NAN, |x| x.weights_ms),
            sp.map_or(f64::NAN, |x| x.attention_ms),
            sp.map_or(f64::NAN, |x| x.appends_ms),
            sp.map_or(f64::NAN, |x| x.sampling_ms)
        );
        if let Some(x) = sp.filter(|x| !x.attend_ms.is_empty()) {
            let parts: Vec<String> = fathom_cuda::cache::AttendStages::NAMES
                .iter()
                .filter_map(|k| x.attend_ms.get(*k).map(|v| format!("{k} {v:.2}")))
                .collect();
            println!(
                "      attends by stage (ms per step, instrumented plain launches): {}",
                parts.join(", ")
            );
        }
        if let (Some(us), Some(rate)) = (e.host_gather_request_us, e.host_gather_mrows_per_thread_s)
        {
            println!(
                "      host gather: {us:.1} µs per request, {rate:.1} M rows/s per thread ({} threads, {} % of the misses)",
                a.host_gather, a.host_share
            );
        }
    }
    let (entries, host_bytes_per_token) = (m.entries, m.host_bytes_per_token);
    println!(
        "HBM: {:.1} GB in use, {:.1} GB of it the cache's page pools ({})",
        dec.device_bytes_in_use()? as f64 / 1e9,
        dec.cache_mut()?.pool_hbm_bytes() as f64 / 1e9,
        a.residency
    );
    // What bounds B: the memory the pages live in, at this run's bytes per token and contexts.
    let memory = if dcfg.residency == fathom_cuda::Residency::Hbm {
        Some(gpu.info().total_mem_bytes)
    } else {
        fathom_gpu::throughput::host_memory_bytes()
    };
    let capacity = match memory {
        Some(mem) => {
            let c = fathom_gpu::throughput::capacity(mem, host_bytes_per_token, &contexts)?;
            println!(
                "capacity: {:.0} GiB of {} memory × {:.0}% / {:.0} B per resident token = {} tokens: at most {} sessions of {:?} tokens (cycled)",
                mem as f64 / (1u64 << 30) as f64,
                if dcfg.residency == fathom_cuda::Residency::Hbm {
                    "GPU"
                } else {
                    "host"
                },
                100.0 * c.usable_fraction,
                host_bytes_per_token,
                c.max_resident_tokens,
                c.largest_batch,
                contexts
            );
            Some(c)
        }
        None => None,
    };
    let doc = fathom_results::decode_bench::DecodeBench {
        version: fathom_results::VERSION,
        fathom: env!("CARGO_PKG_VERSION").into(),
        command: fathom_results::command_line(),
        model: a.model.clone(),
        weights: weights_label.clone(),
        device: fathom_bench::offload::device_record(gpu.info()),
        residency: a.residency.clone(),
        steps: a.steps,
        h2d_gbps,
        host_bytes_per_token,
        device_bytes_in_use: dec.device_bytes_in_use()?,
        pool_hbm_bytes: Some(dec.cache_mut()?.pool_hbm_bytes()),
        prefill_seconds,
        entries,
        capacity,
        attend_groups: a.attend_groups,
        scan_vector_words: a.scan_vec,
        host_gather: a.host_gather,
        host_gather_share: if a.host_gather > 0 { a.host_share } else { 100 },
        cublas_math: Some(fathom_gpu::cublas_math().into()),
    };
    if let Some(out) = &a.json {
        fathom_results::write(out, doc.clone())
            .with_context(|| format!("writing {}", out.display()))?;
    }
    if let Some(p) = &a.plot {
        let pts: Vec<(String, usize, f64)> = doc
            .entries
            .iter()
            .map(|e| (e.method.clone(), e.batch, e.tokens_per_s))
            .collect();
        let title = format!(
            "{} on {}: decode tokens/s against B (pages in {}; {})",
            doc.model,
            doc.device.name,
            doc.residency,
            if doc.weights.starts_with("real") {
                "real weights"
            } else {
                "random weights"
            }
        );
        // The measurement is written already: a plot that cannot be drawn (an unwritable
        // path, say) is a warning, not a lost run.
        if let Err(e) = fathom_report::plot::tokens_vs_batch(&pts, &title, p) {
            eprintln!("warning: plot {}: {e}", p.display());
        }
    }
    Ok(())
}
