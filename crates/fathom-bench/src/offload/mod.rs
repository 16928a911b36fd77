//! The offload benchmark (docs/SPEC.md §6): every method at every context and residency, timed
//! with CUDA events through the library's paged cache ([`fathom_cuda::PagedCache`]), with
//! per-stage times, bytes and the link-rate floor. Used by `fathom offload-bench`; its report
//! is `fathom_results::offload::OffloadBench`, which the library never sees: the harness
//! converts the device description ([`device_record`]).
//!
//! The timing itself needs this crate's `cuda` feature (`cache_engine`); without it the same
//! entry points return [`CudaError::NotCompiledWithCuda`]. The synthetic key generator
//! ([`synth`]) and the report arithmetic compile in every build.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use fathom_cuda::prelude::*;
use fathom_cuda::{CudaError, Gpu, Method, ModelShape, Residency, Result};

#[cfg(feature = "cuda")]
mod cache_engine;
#[cfg(feature = "cuda")]
mod cache_step;
pub mod synth;

pub use fathom_results::offload::{
    BenchResult, DeviceInfo, OffloadBench, OffloadEngine, OffloadStudy, ShapeRecord, StageBytes,
};
pub use synth::{synth_layer, LayerSource, SynthParams, SYNTH_LABEL};

/// What to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchConfig {
    /// The command line that asked for this run (recorded in the report).
    pub command: String,
    /// What the run is for (recorded in the report).
    #[serde(default)]
    pub study: OffloadStudy,
    /// Shape label as given (`qwen3-8b`, ...).
    pub shape_label: String,
    /// Model shape (per sequence).
    pub shape: ModelShape,
    /// Context lengths.
    pub contexts: Vec<usize>,
    /// Sessions per step `B`, each of every context's length.
    pub batch: usize,
    /// Methods.
    pub methods: Vec<Method>,
    /// Residencies.
    pub residencies: Vec<Residency>,
    /// Timed steps per method (after the warm-ups).
    pub steps: usize,
    /// Warm-up steps (not timed).
    pub warmup: usize,
    /// Top-k per query head; `None` = 512 (docs/SPEC.md §5's 32k value, kept for longer contexts).
    pub k: Option<usize>,
    /// HBM row-cache slots per (layer, KV head); 0 disables it.
    pub cache_rows: usize,
    /// Distinct synthetic source layers.
    pub source_layers: usize,
    /// Base tokens per source layer (tiled to the context).
    pub source_tokens: usize,
    /// Generator seed.
    pub seed: u64,
    /// Bytes of the pinned H2D `memcpy` that measures the link (2 GiB by default).
    pub h2d_probe_bytes: usize,
    /// Head groups per attend to time, each over every method
    /// ([`fathom_cuda::cache::CacheOptions::attend_groups`]: a cache each; 0 = 1; empty: 1).
    pub groups: Vec<usize>,
    /// Write the report here after every (context, residency).
    pub json: Option<PathBuf>,
    /// one ragged batch of these session lengths, timed after the
    /// contexts (empty: none).
    #[serde(default)]
    pub ragged: Vec<usize>,
    /// pinned host bytes the page pools may take (fewer layers are timed
    /// past it).
    #[serde(default = "default_pool_budget")]
    pub pool_budget: u64,
    /// the select paths to time, each over every method
    /// ([`fathom_cuda::cache::CacheOptions::select`]: a cache each; empty: the default).
    #[serde(default)]
    pub select_paths: Vec<fathom_cuda::cache::SelectPath>,
    /// the scan load widths to time, in plane words (1, 2), each over every
    /// method ([`fathom_cuda::cache::CacheOptions::scan_vector_words`]: a cache each; empty: 1).
    #[serde(default)]
    pub scan_vector_words: Vec<u32>,
    /// host-gather threads to time, each over every method
    /// ([`fathom_cuda::cache::CacheOptions::host_gather_threads`]: a cache each; 0: the GPU reads the misses; empty: 0).
    #[serde(default)]
    pub host_gather: Vec<usize>,
    /// shares of the misses (percent, 1 to 100) the host gather brings, each
    /// over every method and gather setting above 0 threads
    /// ([`fathom_cuda::cache::CacheOptions::host_gather_share`]; empty: 100).
    #[serde(default)]
    pub host_gather_share: Vec<u32>,
    /// how each method's decode step is launched, each over every method:
    /// `false`, kernel by kernel; `true`, captured once as a CUDA graph
    /// ([`fathom_cuda::api::KvCache::capture`]) and replayed every step, as a serving engine runs
    /// its decode step (empty: kernel by kernel).
    #[serde(default)]
    pub graphs: Vec<bool>,
    /// rounds of the whole set of settings and methods, each method timed
    /// once per round in the same order, so the rounds interleave the methods in time and
    /// every ratio comes once per round (its spread over rounds gives an interval); 1 times
    /// each once. Entries carry their `round`.
    #[serde(default = "one_round")]
    pub rounds: usize,
    /// what backs the pools in host memory ([`fathom_cuda::HostPages`]).
    #[serde(default)]
    pub host_pages: fathom_cuda::HostPages,
    /// whether the caches split each attend by stage
    /// ([`fathom_cuda::cache::CacheOptions::stage_timing`]): the steps after the timed ones
    /// report `stage_ms`; every plain attend then records its marks, the timed ones too.
    #[serde(default)]
    pub stage_timing: bool,
}

fn one_round() -> usize {
    1
}

fn default_pool_budget() -> u64 {
    72 << 30
}

/// The library's error for arguments that do not fit together, raised by the harness.
pub(crate) fn invalid(what: &'static str, detail: impl Into<String>) -> CudaError {
    CudaError::Invalid {
        what,
        detail: detail.into(),
    }
}

/// Parses `32k`, `256k`, `1m`, `4096` (k = 1024, m = 1024²).
pub fn parse_context(s: &str) -> Result<usize> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mul) = if let Some(x) = t.strip_suffix('k') {
        (x, 1024)
    } else if let Some(x) = t.strip_suffix('m') {
        (x, 1024 * 1024)
    } else {
        (t.as_str(), 1)
    };
    num.parse::<usize>()
        .map(|v| v * mul)
        .map_err(|e| invalid("context", format!("`{s}`: {e}")))
}

/// Runs the benchmark and returns (and, if asked, writes) the report.
///
/// # Errors
/// [`CudaError::NotCompiledWithCuda`] / [`CudaError::NoDevice`] when there is no GPU path;
/// allocation and driver failures.
pub fn run_offload_bench(c: &BenchConfig, progress: impl FnMut(&str)) -> Result<OffloadBench> {
    run_offload_bench_with(c, None, progress)
}

/// Source layers for [`run_offload_bench_with`] and the label that names them in the report.
#[derive(Debug, Clone)]
pub struct RealSources {
    /// One source per distinct layer (reused cyclically over the shape's layers).
    pub layers: Vec<LayerSource>,
    /// What they are (model, capture file, tokens, positions).
    pub label: String,
}

/// [`run_offload_bench`] with given source layers (for example real captured keys, values and
/// queries from [`LayerSource::from_capture`]) instead of the synthetic generator. Their
/// shape must match `c.shape`; their base length is tiled to each context.
///
/// # Errors
/// As [`run_offload_bench`], and sources whose shape differs from `c.shape`.
pub fn run_offload_bench_with(
    c: &BenchConfig,
    real: Option<RealSources>,
    mut progress: impl FnMut(&str),
) -> Result<OffloadBench> {
    let gpu = Gpu::open(0)?;
    let shape = c.shape.validate()?;
    let mut rep = OffloadBench {
        command: c.command.clone(),
        study: c.study,
        version: fathom_results::VERSION,
        fathom: env!("CARGO_PKG_VERSION").into(),
        device: Some(device_record(gpu.info())),
        shape_label: c.shape_label.clone(),
        shape: Some(ShapeRecord {
            layers: c.shape.layers,
            kv_heads: c.shape.kv_heads,
            group: c.shape.group,
            dim: c.shape.dim,
        }),
        batch: c.batch,
        generator: real
            .as_ref()
            .map_or_else(|| SYNTH_LABEL.to_string(), |r| r.label.clone()),
        engine: OffloadEngine::Cache,
        ..Default::default()
    };
    progress(&format!("device: {:?}", gpu.info()));
    rep.h2d_gbps = gpu.h2d_bandwidth(c.h2d_probe_bytes)?;
    rep.gather_gbps = gpu.gather_bandwidth(c.h2d_probe_bytes / 2)?;
    progress(&format!(
        "H2D memcpy {:.1} GB/s, zero-copy gather {:.1} GB/s",
        rep.h2d_gbps, rep.gather_gbps
    ));
    let min_ctx = c.contexts.iter().copied().min().unwrap_or(0);
    let sources: Vec<LayerSource> = if let Some(r) = real {
        if c.batch > 1 {
            return Err(invalid("batch", "real sources are timed at batch 1"));
        }
        for s in &r.layers {
            let p = s.params();
            if (p.heads, p.group, p.dim) != (shape.kv_heads, shape.group, shape.dim) {
                return Err(invalid(
                    "sources",
                    format!(
                        "source layers are Hkv={}, G={}, D={}; the shape is Hkv={}, G={}, D={}",
                        p.heads, p.group, p.dim, shape.kv_heads, shape.group, shape.dim
                    ),
                ));
            }
        }
        let n0 = r.layers.first().map_or(0, |s| s.params().tokens);
        rep.notes.push(format!(
            "keys: {}; {} distinct source layers of {n0} tokens (real keys, values and queries) tiled to each context (tiles after the first negate half of their channels and jitter block scales ±3%) and reused cyclically over the {} layers; step s uses the captured queries of position s mod P",
            r.label,
            r.layers.len(),
            shape.layers
        ));
        r.layers
    } else {
        let n0 = (c.source_tokens.min(min_ctx) / 64 * 64).max(64);
        let params = SynthParams {
            heads: shape.kv_heads,
            group: shape.group,
            dim: shape.dim,
            tokens: n0,
            seed: c.seed,
        };
        let t = std::time::Instant::now();
        let sources: Vec<_> = (0..c.source_layers.clamp(1, shape.layers))
            .map(|l| synth_layer(&params, l))
            .collect::<Result<_>>()?;
        progress(&format!(
            "generated {} source layers of {n0} tokens in {:.1}s",
            sources.len(),
            t.elapsed().as_secs_f64()
        ));
        rep.notes.push(format!(
            "keys: {SYNTH_LABEL}; {} distinct source layers of {n0} tokens tiled to each context (tiles after the first get ±3% block-scale jitter) and reused cyclically over the {} layers",
            sources.len(), shape.layers
        ));
        sources
    };
    run_cache_engine(c, &gpu, &sources, rep, progress)
}

/// The cache engine (`cache_engine`): per residency, every context at `batch` equal
/// sessions, then the ragged batch.
#[cfg(feature = "cuda")]
fn run_cache_engine(
    c: &BenchConfig,
    gpu: &Gpu,
    sources: &[LayerSource],
    mut rep: OffloadBench,
    mut progress: impl FnMut(&str),
) -> Result<OffloadBench> {
    rep.notes.push("engine: the library path (PagedCache): sessions are prefilled by appends of the tiled source keys and values (tiles after the first made distinct as the step's store is: half of the channels negated, ±3% per block and channel; LayerSource::tiled_keys); every timed step reserves one token per session, appends that token's K/V for every layer from device memory and attends the step's queries; each query head attends over its own sink + local + top-k set (docs/SPEC.md §5); GPU time is the event pair around the appends and attends".into());
    if c.rounds > 1 {
        rep.notes.push(format!("rounds (`--rounds {}`): every setting and method timed once per round, in the same order, so the rounds interleave the methods in time; each entry's speedups pair it with the 136-bit scans of its own round, and the spread of a ratio over rounds gives its interval", c.rounds));
    }
    if c.graphs.contains(&true) {
        rep.notes.push("graph entries (`--graph`): each method's whole step, every layer's append and attend, captured once as a CUDA graph (PagedCache::capture, at the first warm-up step) and replayed every step; the step's queries are copied to the graph's query buffer before the event pair, as a model's forward would have written them there".into());
    }
    let mut runs: Vec<Vec<usize>> = c
        .contexts
        .iter()
        .map(|&n| vec![n; c.batch.max(1)])
        .collect();
    if !c.ragged.is_empty() {
        runs.push(c.ragged.clone());
    }
    for &res in &c.residencies {
        cache_engine::run(c, gpu, sources, &runs, res, &mut rep, &mut progress)?;
    }
    Ok(rep)
}

#[cfg(not(feature = "cuda"))]
fn run_cache_engine(
    _c: &BenchConfig,
    _gpu: &Gpu,
    _sources: &[LayerSource],
    _rep: OffloadBench,
    _progress: impl FnMut(&str),
) -> Result<OffloadBench> {
    Err(CudaError::NotCompiledWithCuda)
}

/// The report's record of a device: the library's description ([`fathom_cuda::DeviceInfo`],
/// what `Gpu::info` returns) in the results schema.
#[must_use]
pub fn device_record(d: &fathom_cuda::DeviceInfo) -> DeviceInfo {
    DeviceInfo {
        name: d.name.clone(),
        compute_capability: d.compute_capability,
        total_mem_bytes: d.total_mem_bytes,
        multiprocessors: d.multiprocessors,
        driver_version: d.driver_version,
        arch: d.arch.clone(),
    }
}

/// Speedups of every result against every 136-bit scan among `results` (one context and
/// residency).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn add_speedups(results: &mut [BenchResult], dim: usize) {
    // Against the 136-bit scans timed under the same select, head-group, load and launch
    // settings, in the same round.
    type Setting = (fathom_results::offload::Setting, usize);
    let base: Vec<(Setting, String, f64)> = results
        .iter()
        .filter(|r| {
            fathom_plan::method::MethodSpec::parse(&r.method, dim)
                .is_ok_and(|m| m.is_136_bit_scan())
        })
        .map(|r| ((r.setting(), r.round), r.method.clone(), r.gpu_ms))
        .collect();
    for r in results {
        let setting = (r.setting(), r.round);
        for (s, name, ms) in &base {
            if *s == setting {
                r.speedup_vs_136.insert(name.clone(), ms / r.gpu_ms);
            }
        }
    }
}

/// Bytes each stage of one step moves (docs/SPEC.md §6's traffic model) for sessions of
/// `lens` tokens with `shape.kv_heads` KV heads each: the planned scan bytes at `bits` per
/// token and head (`Σ t_c + ¼·active`, so bytes = bits·nb·8), the scores the top-k reads, and
/// `union` K|V records per step of which `hits` came from the HBM row cache.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn stage_bytes(
    shape: ModelShape,
    lens: &[usize],
    m: Method,
    bits: f64,
    union: f64,
    hits: f64,
    host: bool,
) -> StageBytes {
    let (l_n, hn, g, d) = (
        shape.layers as u64,
        shape.kv_heads as u64,
        shape.group as u64,
        shape.dim as u64,
    );
    let (mut gather, mut scores) = (0u64, 0u64);
    for &n in lens {
        let n = n as u64;
        gather += match m {
            Method::Landmark => hn * n.div_ceil(8) * d * 2 * l_n,
            Method::Quest => hn * n.div_ceil(16) * 2 * d * 2 * l_n,
            _ => (bits * (n.div_ceil(64) * 8) as f64) as u64 * hn * l_n,
        };
        scores += hn * g * n * 4 * l_n;
    }
    let rec = shape.record_bytes() as u64;
    let row = (union * rec as f64) as u64;
    let row_pcie = if host {
        ((union - hits).max(0.0) * rec as f64) as u64
    } else {
        0
    };
    StageBytes {
        plan: if matches!(m, Method::Fathom(_) | Method::SparQ(_)) {
            l_n * hn * lens.len() as u64 * (g * d * 4 + d * 4 + 2 * d * 16)
        } else {
            0
        },
        gather: if host { gather } else { 0 },
        scan: gather + scores,
        // Plane scans build the level-1 histogram themselves (G ≤ 8): one read of the scores.
        topk: if m.uses_planes() && g <= 8 { 1 } else { 2 } * scores,
        row_gather: row,
        row_gather_pcie: row_pcie,
        attention: row,
        pcie_total: if host { gather + row_pcie } else { 0 },
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn write_json(rep: &OffloadBench, p: &Path) -> Result<()> {
    // Atomic (temporary file, fsync, rename): the report is rewritten after every context, and
    // a crash mid-write must leave the previous whole report, not a partial one.
    fathom_results::write(p, rep.clone()).map_err(|e| invalid("json path", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(method: &str, round: usize, graph: bool, gpu_ms: f64) -> BenchResult {
        BenchResult {
            context: 1 << 20,
            residency: "host".into(),
            method: method.into(),
            groups: 1,
            round,
            graph,
            gpu_ms,
            ..Default::default()
        }
    }

    /// A speedup pairs an entry with the 136-bit scans of its own round and launch mode only:
    /// round 2's slower scan does not leak into round 1's ratio, nor a graph's into a launch's.
    #[test]
    fn speedups_pair_within_a_round_and_a_setting() {
        let mut r = vec![
            entry("fathom:48", 0, false, 10.0),
            entry("sparq:32", 0, false, 22.0),
            entry("fathom:48", 1, false, 10.0),
            entry("sparq:32", 1, false, 24.0),
            entry("fathom:48", 0, true, 9.0),
            entry("sparq:32", 0, true, 21.6),
        ];
        add_speedups(&mut r, 128);
        let x = |i: usize| r[i].speedup_vs_136["sparq:32"];
        let near = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(
            near(x(0), 2.2) && near(x(2), 2.4) && near(x(4), 2.4),
            "{r:?}"
        );
        assert_eq!(r[0].speedup_vs_136.len(), 1, "{:?}", r[0].speedup_vs_136);
        assert!(near(x(1), 1.0));
        let groups = fathom_results::offload::round_ratios(&r);
        let launches = groups
            .iter()
            .find(|g| g.method == "fathom:48" && !g.setting.3)
            .unwrap();
        assert_eq!(launches.ratios.len(), 2);
        assert!(near(launches.ratios[0], 2.2) && near(launches.ratios[1], 2.4));
        assert!(
            !groups.iter().any(|g| g.setting.3),
            "the graph ran one round: no interval"
        );
    }

    /// Entries of the host gather pair only with the 136-bit scans that ran with the same
    /// threads and share: a gather entry never borrows the GPU fetch's scan, nor the other
    /// way round, nor one share another's.
    #[test]
    fn speedups_pair_within_a_host_gather_setting() {
        let gathered = |mut e: BenchResult, n: usize, share: u32| {
            e.host_gather = n;
            e.host_gather_share = share;
            e
        };
        let mut r = vec![
            entry("fathom:48", 0, false, 10.0),
            entry("sparq:32", 0, false, 22.0),
            gathered(entry("fathom:48", 0, false, 11.0), 14, 100),
            gathered(entry("sparq:32", 0, false, 22.0), 14, 100),
            gathered(entry("fathom:48", 0, false, 12.0), 8, 100),
            gathered(entry("fathom:48", 0, false, 8.0), 14, 50),
            gathered(entry("sparq:32", 0, false, 20.0), 14, 50),
        ];
        add_speedups(&mut r, 128);
        let near = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(near(r[0].speedup_vs_136["sparq:32"], 2.2), "{r:?}");
        assert!(near(r[2].speedup_vs_136["sparq:32"], 2.0), "{r:?}");
        assert!(
            r[4].speedup_vs_136.is_empty(),
            "no 136-bit scan ran with 8 threads: {r:?}"
        );
        assert!(near(r[5].speedup_vs_136["sparq:32"], 2.5), "{r:?}");
        assert_ne!(r[0].setting(), r[2].setting());
        assert_ne!(r[2].setting(), r[5].setting());
    }
}
