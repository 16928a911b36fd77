//! `fathom offload-bench`: the GPU offload decode step benchmark (docs/SPEC.md §6), timed through
//! the library's paged cache (`PagedCache`).
//!
//! Wire with `mod offload_cmds;` and a subcommand `OffloadBench(offload_cmds::OffloadBenchArgs)`
//! calling [`run_offload_bench`].

use std::path::PathBuf;

use anyhow::{Context, Result};

use fathom_bench::capture::{Capture, LayerKind};
use fathom_bench::offload::LayerSource;
use fathom_bench::offload::{parse_context, BenchConfig, RealSources};
use fathom_cuda::{Method, ModelShape, Residency};

/// The global layers of a capture as timing sources, and the shape they make.
fn capture_sources(p: &std::path::Path) -> Result<(ModelShape, RealSources)> {
    let cap = Capture::open(p).with_context(|| format!("capture {}", p.display()))?;
    let info = cap.info().clone();
    let g = info.g();
    let mut layers = Vec::new();
    for (&l, kind) in info.layers.iter().zip(&info.kinds) {
        if *kind != LayerKind::Global {
            continue;
        }
        let data = cap
            .layer(l)
            .with_context(|| format!("capture {} layer {l}", p.display()))?;
        eprintln!(
            "capture: layer {l} ({} tokens, {} positions)",
            info.n,
            info.positions.len()
        );
        layers.push(
            LayerSource::from_capture(info.hkv, g, info.d, &data.k, &data.v, data.q, l)
                .with_context(|| format!("capture {} layer {l}", p.display()))?,
        );
    }
    if layers.is_empty() {
        anyhow::bail!("capture {} has no global layers", p.display());
    }
    let shape = ModelShape {
        layers: layers.len(),
        kv_heads: info.hkv,
        group: g,
        dim: info.d,
    };
    let label = format!(
        "real capture {} ({}, {} global layers, N = {} tokens, {} query positions)",
        p.file_name()
            .map_or_else(String::new, |f| f.to_string_lossy().into_owned()),
        info.model,
        layers.len(),
        info.n,
        info.positions.len()
    );
    Ok((shape, RealSources { layers, label }))
}

/// Arguments of `fathom offload-bench`.
#[derive(clap::Args, Debug, Clone)]
#[command(after_help = "Examples:\n  \
    fathom offload-bench --engine cache --context 256k,1m --methods fathom:48,sparq:32,ds:32,exact --residency host --graph --rounds 5 --json offload-host.json\n  \
    fathom offload-bench --engine cache --context 32k --methods fathom:48,sparq:32 --ragged 32k,64k,128k,512k --json ragged.json\n  \
    fathom offload-bench --shape smollm2-135m --capture eval-4k.safetensors --context 64k --json real.json   # real keys, tiled")]
pub struct OffloadBenchArgs {
    /// Model shape: qwen3-8b, llama3.1-8b, qwen2.5-7b or L,HKV,G,D.
    #[arg(long, default_value = "qwen3-8b")]
    pub shape: String,
    /// Context lengths (32k, 256k, 1m, or token counts), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "32k,256k,1m")]
    pub context: Vec<String>,
    /// Sequences per step.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Methods, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "fathom:48,fathom:64,sparq:16,sparq:32,ds:32,loki:32,thumb2,landmark,exact"
    )]
    pub methods: Vec<String>,
    /// Where the store and K/V rows live: host, hbm, or both (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "host")]
    pub residency: Vec<String>,
    /// Timed steps per method (after 2 warm-ups).
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Top-k per query head (default 512).
    #[arg(long)]
    pub k: Option<usize>,
    /// HBM row-cache slots per (layer, KV head); 0 disables the cache.
    #[arg(long, default_value_t = 8192)]
    pub cache_rows: usize,
    /// Distinct synthetic source layers.
    #[arg(long, default_value_t = 4)]
    pub source_layers: usize,
    /// Base tokens per source layer (tiled to the context).
    #[arg(long, default_value_t = 32768)]
    pub source_tokens: usize,
    /// Generator seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Head groups per attend (`CacheOptions::attend_groups`: a cache each): the cache's stream scans
    /// group i+1 while a second stream runs group i's top-k, union, row fetch and attention;
    /// 0 = 1; at most the shape's KV heads. A list times each setting, e.g. `--groups 1,2,4`.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub groups: Vec<usize>,
    /// Size of the pinned H2D memcpy that measures the link, MiB.
    #[arg(long, default_value_t = 2048)]
    pub probe_mib: usize,
    /// Time real captured keys, values and queries instead of the synthetic generator: a
    /// docs/SPEC.md §8 capture (`fathom capture`). Its global layers become the source layers, tiled
    /// to each context; the shape becomes (global layers, Hkv, G, D) of the capture and
    /// `--shape` is ignored.
    #[arg(long)]
    pub capture: Option<PathBuf>,
    /// Write the JSON report here (rewritten after every context).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// What the run is for, recorded in its JSON: `main` (every method; the report's Claim 4),
    /// `pipeline-sweep` (one method pair under many --groups / --gather-ctas settings) or
    /// `experiment` (kernels built under an experiment switch; never judged against targets).
    #[arg(long, default_value = "main", value_parser = ["main", "pipeline-sweep", "experiment"])]
    pub study: String,
    /// The path timed: `cache` (the default and the only engine), the library's paged cache
    /// a model drives (prefilled by appends, one token appended per session every step; pools
    /// in host memory or, with `--residency hbm`, in HBM). `step`, the fixed benchmark step of
    /// earlier versions, is retired: asking for it is an error (its committed results stay
    /// readable, labelled as a retired engine's). Example:
    /// `fathom offload-bench --engine cache --context 256k,1m --ragged 32k,128k,512k --json out.json`.
    #[arg(long, default_value = "cache", value_parser = ["cache", "step"])]
    pub engine: String,
    /// also time one ragged batch of these session lengths (e.g.
    /// `32k,64k,128k,256k,512k`), after the contexts.
    #[arg(long, value_delimiter = ',')]
    pub ragged: Vec<String>,
    /// pinned host memory the page pools may take, GiB (past it, fewer layers
    /// are timed and the JSON says so).
    #[arg(long, default_value_t = 72.0)]
    pub pool_budget_gib: f64,
    /// how the top-k selects (docs/SPEC.md §5): `scores` (the scan writes every
    /// score; the default), `N` (the filtered select from N middle tokens: the scan keeps only
    /// the tokens above an estimate of the k-th score and writes no score array; a row whose
    /// filter fails rescans its KV head) or `N+scores` (filtered, with the scores written too,
    /// so a failed row needs no rescan). Exact either way. A list times each over every
    /// method, e.g. `--select scores,8192,8192+scores`.
    #[arg(long, value_delimiter = ',', default_value = "scores")]
    pub select: Vec<String>,
    /// plane words per global load of the scan, `1` (8 bytes, the default) or
    /// `2` (16 bytes where a page's blocks allow it); the scores are the same bits. A list
    /// times each over every method, e.g. `--scan-vec 1,2`.
    #[arg(long = "scan-vec", value_delimiter = ',', default_value = "1")]
    pub scan_vec: Vec<u32>,
    /// CPU threads of the host gather (`CacheOptions::host_gather_threads`; 0: the
    /// GPU reads each missed K|V record from host memory itself); a list times each over every
    /// method, e.g. `--host-gather 0,14`.
    #[arg(long = "host-gather", value_delimiter = ',', default_value = "0")]
    pub host_gather: Vec<usize>,
    /// percent of the misses the host gather brings while the fetch reads the
    /// rest itself, at once (`CacheOptions::host_gather_share`; 1 to 100); a list times each
    /// over every method and every `--host-gather` above 0, e.g. `--host-gather 0,14
    /// --host-share 100,50,30`.
    #[arg(long = "host-share", value_delimiter = ',', default_value = "100")]
    pub host_share: Vec<u32>,
    /// also time every method with its whole decode step (every layer's append
    /// and attend) captured once as a CUDA graph and replayed each step, as a serving engine
    /// runs decode (`PagedCache::capture`; entries with `graph: true`, compared with the
    /// 136-bit scans timed the same way), beside the kernel-by-kernel launches. Example:
    /// `fathom offload-bench --engine cache --context 1m --methods fathom:48,sparq:32 --graph`.
    #[arg(long)]
    pub graph: bool,
    /// time every setting and method this many times, in rounds that
    /// interleave the methods in time (each entry carries its `round`); every speedup then
    /// comes once per round, and the summary gives its mean with a 95 % Student-t interval over
    /// rounds. Example: `fathom offload-bench --engine cache --context 1m --methods
    /// fathom:48,sparq:32,ds:32 --rounds 5`.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// what backs the pools in host memory, `driver` (`cuMemHostAlloc`, the
    /// default), `huge` (2 MiB transparent huge pages registered with the driver; Linux) or
    /// `vmm` (host-NUMA memory of the virtual memory API, mapped at 2 MiB or more).
    #[arg(long = "host-pages", default_value = "driver")]
    pub host_pages: String,
    /// split each attend of the steps after the timed ones by stage (plan, scan, top-k,
    /// union, fetch, attention: `stage_ms` in the JSON). The caches are then made with stage
    /// timing on, so every plain attend records its events, the timed ones too; graph replays
    /// record none.
    #[arg(long = "stage-timing")]
    pub stage_timing: bool,
}

/// Runs `fathom offload-bench`.
///
/// # Errors
/// Bad arguments, no GPU path (`NotCompiledWithCuda`, `NoDevice`), device failures.
pub fn run_offload_bench(a: OffloadBenchArgs) -> Result<()> {
    let (shape, shape_label, real) = match &a.capture {
        None => (ModelShape::parse(&a.shape)?, a.shape.clone(), None),
        Some(p) => {
            let (shape, real) = capture_sources(p)?;
            let label = format!(
                "capture:{},{},{},{}",
                shape.layers, shape.kv_heads, shape.group, shape.dim
            );
            (shape, label, Some(real))
        }
    };
    let contexts = a
        .context
        .iter()
        .map(|c| parse_context(c))
        .collect::<Result<Vec<_>, _>>()?;
    let methods = a
        .methods
        .iter()
        .map(|m| Method::parse(m, shape.dim))
        .collect::<Result<Vec<_>, _>>()?;
    let ragged = a
        .ragged
        .iter()
        .map(|c| parse_context(c))
        .collect::<Result<Vec<_>, _>>()?;
    let residencies = a
        .residency
        .iter()
        .map(|r| match Residency::parse(r) {
            Ok(Residency::IndexHbm) => Err(anyhow::anyhow!(
                "--residency index-hbm: offload-bench times host and hbm; the split residency runs in `fathom decode-bench --residency index-hbm`"
            )),
            r => r.map_err(anyhow::Error::from),
        })
        .collect::<Result<Vec<_>>>()?;
    if a.engine == "step" {
        anyhow::bail!("--engine step: the fixed benchmark step engine is retired; offload-bench times the library's paged cache (`--engine cache`, the default). Results it wrote earlier stay readable and are labelled as a retired engine's");
    }
    if a.rounds == 0 {
        anyhow::bail!("--rounds 0: want at least one round");
    }
    if let Some(&n) = a
        .host_gather
        .iter()
        .find(|&&n| n > fathom_cuda::cache::MAX_GATHER_THREADS)
    {
        anyhow::bail!(
            "--host-gather {n}: at most {} threads",
            fathom_cuda::cache::MAX_GATHER_THREADS
        );
    }
    for &p in &a.host_share {
        fathom_cuda::cache::check_host_gather_share(p)
            .map_err(|e| anyhow::anyhow!("--host-share {p}: {e}"))?;
    }
    let cfg = BenchConfig {
        command: fathom_results::command_line(),
        study: [
            fathom_bench::offload::OffloadStudy::PipelineSweep,
            fathom_bench::offload::OffloadStudy::Experiment,
        ]
        .into_iter()
        .find(|s| s.as_str() == a.study)
        .unwrap_or_default(),
        shape_label,
        shape,
        contexts,
        batch: a.batch,
        methods,
        residencies,
        steps: a.steps,
        warmup: 2,
        k: a.k,
        cache_rows: a.cache_rows,
        source_layers: a.source_layers,
        source_tokens: a.source_tokens,
        seed: a.seed,
        h2d_probe_bytes: a.probe_mib << 20,
        groups: a.groups.clone(),
        json: a.json.clone(),
        ragged,
        pool_budget: (a.pool_budget_gib * (1u64 << 30) as f64) as u64,
        select_paths: a
            .select
            .iter()
            .map(|s| fathom_cuda::cache::SelectPath::parse(s))
            .collect::<Result<Vec<_>, _>>()?,
        scan_vector_words: a
            .scan_vec
            .iter()
            .map(|&w| fathom_cuda::cache::check_scan_vector_words(w).map(|()| w))
            .collect::<Result<Vec<_>, _>>()?,
        host_gather: a.host_gather.clone(),
        host_gather_share: a.host_share.clone(),
        host_pages: fathom_cuda::HostPages::parse(&a.host_pages)?,
        stage_timing: a.stage_timing,
        graphs: if a.graph {
            vec![false, true]
        } else {
            Vec::new()
        },
        rounds: a.rounds,
    };
    let rep = fathom_bench::offload::run_offload_bench_with(&cfg, real, |s| eprintln!("{s}"))
        .context("offload-bench")?;
    println!(
        "{:<9} {:<5} {:<8} {:<10} {:>7} {:>10} {:>10} {:>8} {:>8} {:>7}  speedup vs 136-bit",
        "context",
        "res",
        "grp/cta",
        "method",
        "bits",
        "gpu ms",
        "floor ms",
        "ratio",
        "plan %",
        "hit %"
    );
    for r in &rep.results {
        println!(
            "{:<9} {:<5} {:<8} {:<10} {:>7.1} {:>10.3} {:>10} {:>8} {:>8.2} {:>7.1}  {}",
            r.context,
            r.residency,
            format!("{}/{}", r.groups, r.gather_ctas),
            format!(
                "{}{}",
                match (r.select.is_empty(), r.graph) {
                    (true, false) => r.method.clone(),
                    (true, true) => format!("{} [graph]", r.method),
                    (false, false) => format!("{} [{}]", r.method, r.select),
                    (false, true) => format!("{} [{}, graph]", r.method, r.select),
                },
                if a.rounds > 1 {
                    format!(" r{}", r.round + 1)
                } else {
                    String::new()
                }
            ),
            r.bits,
            r.gpu_ms,
            r.link_floor_ms.map_or("-".into(), |f| format!("{f:.3}")),
            r.floor_ratio.map_or("-".into(), |f| format!("{f:.2}")),
            100.0 * r.planner_share,
            100.0 * r.cache_hit_rate,
            r.speedup_vs_136
                .iter()
                .map(|(k, v)| format!("{k}={v:.2}x"))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    let rounds = fathom_results::offload::round_ratios(&rep.results);
    if !rounds.is_empty() {
        println!("\nspeedups over rounds (mean, 95 % Student-t interval over rounds):");
        for g in &rounds {
            let i = fathom_report::intervals::Interval::of(&g.ratios);
            println!(
                "{:<9} {:<5} {:<24} ÷ {:<10} {:.3}× [{:.3}, {:.3}] ({} rounds; min {:.3}×)",
                g.context,
                g.residency,
                format!("{}{}", g.method, if g.setting.3 { " [graph]" } else { "" }),
                g.against,
                i.mean,
                i.lo,
                i.hi,
                i.n,
                g.ratios.iter().copied().fold(f64::INFINITY, f64::min)
            );
        }
    }
    if let Some(p) = &a.json {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
