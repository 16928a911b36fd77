//! The offload benchmark (docs/SPEC.md §6): every method at every context and residency, timed with
//! CUDA events, with per-stage times, bytes and the link-rate floor. Used by
//! `fathom offload-bench`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{Method, ModelShape, Residency, SessionConfig};
use crate::error::{CudaError, Result};
use crate::synth::{synth_layer, LayerSource, SynthParams, SYNTH_LABEL};
use crate::types::{StepStats, STAGES};
use crate::{Gpu, Session};
pub use fathom_results::offload::{
    BenchResult, OffloadBench, OffloadEngine, OffloadStudy, ShapeRecord, StageBytes,
};

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
    /// Sequences per step `B`; they are laid out as `B·Hkv` KV heads.
    pub batch: usize,
    /// Methods.
    pub methods: Vec<Method>,
    /// Residencies.
    pub residencies: Vec<Residency>,
    /// Timed steps per method (after the warm-ups).
    pub steps: usize,
    /// Warm-up steps (not timed).
    pub warmup: usize,
    /// Extra steps with an event pair around every stage (for the breakdown).
    pub instrumented_steps: usize,
    /// Top-k per query head; `None` = 512 (docs/SPEC.md §5's 32k value, kept for longer contexts).
    pub k: Option<usize>,
    /// HBM row-cache slots per (layer, KV head); 0 disables it.
    pub cache_rows: usize,
    /// Host bytes for K/V records (past it, row layers are reused cyclically).
    pub row_bytes_budget: u64,
    /// Distinct synthetic source layers.
    pub source_layers: usize,
    /// Base tokens per source layer (tiled to the context).
    pub source_tokens: usize,
    /// Generator seed.
    pub seed: u64,
    /// Bytes of the pinned H2D `memcpy` that measures the link (2 GiB by default).
    pub h2d_probe_bytes: usize,
    /// Head-group pipelining settings to time, each over every method (0 = auto; see
    /// [`SessionConfig::groups`]).
    pub groups: Vec<usize>,
    /// Gather grid caps to time (0 = auto; see [`SessionConfig::gather_ctas`]).
    pub gather_ctas: Vec<usize>,
    /// Write the report here after every (context, residency).
    pub json: Option<PathBuf>,
    /// Which path is timed: the library's paged cache (the default) or the fixed benchmark
    /// step.
    #[serde(default)]
    pub engine: OffloadEngine,
    /// Cache engine only: one ragged batch of these session lengths, timed after the
    /// contexts (empty: none).
    #[serde(default)]
    pub ragged: Vec<usize>,
    /// Cache engine only: pinned host bytes the page pools may take (fewer layers are timed
    /// past it).
    #[serde(default = "default_pool_budget")]
    pub pool_budget: u64,
    /// Cache engine only: the select paths to time, each over every method
    /// ([`crate::PagedCache::set_select_path`]; empty: the default).
    #[serde(default)]
    pub select_paths: Vec<crate::cache::SelectPath>,
    /// Cache engine only: the scan load widths to time, in plane words (1, 2), each over every
    /// method ([`crate::PagedCache::set_scan_vector_words`]; empty: 1).
    #[serde(default)]
    pub scan_vector_words: Vec<u32>,
    /// Cache engine only: host-gather threads to time, each over every method
    /// ([`crate::PagedCache::set_host_gather`]; 0: the GPU reads the misses; empty: 0).
    #[serde(default)]
    pub host_gather: Vec<usize>,
    /// Cache engine only: shares of the misses (percent, 1 to 100) the host gather brings, each
    /// over every method and gather setting above 0 threads
    /// ([`crate::PagedCache::set_host_gather_share`]; empty: 100).
    #[serde(default)]
    pub host_gather_share: Vec<u32>,
    /// Cache engine only: how each method's decode step is launched, each over every method:
    /// `false`, kernel by kernel; `true`, captured once as a CUDA graph
    /// ([`crate::PagedCache::capture`]) and replayed every step, as a serving engine runs
    /// its decode step (empty: kernel by kernel).
    #[serde(default)]
    pub graphs: Vec<bool>,
    /// Cache engine only: rounds of the whole set of settings and methods, each method timed
    /// once per round in the same order, so the rounds interleave the methods in time and
    /// every ratio comes once per round (its spread over rounds gives an interval); 1 times
    /// each once. Entries carry their `round`.
    #[serde(default = "one_round")]
    pub rounds: usize,
    /// Cache engine only: what backs the pools in host memory ([`crate::HostPages`]).
    #[serde(default)]
    pub host_pages: crate::HostPages,
}

fn one_round() -> usize {
    1
}

fn default_pool_budget() -> u64 {
    72 << 30
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        0.5 * (s[m - 1] + s[m])
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
        .map_err(|e| CudaError::invalid("context", format!("`{s}`: {e}")))
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
    let cache_engine = c.engine == OffloadEngine::Cache;
    // The step lays a batch out as B·Hkv KV heads of one length; the cache holds sessions.
    let shape = ModelShape {
        kv_heads: if cache_engine {
            c.shape.kv_heads
        } else {
            c.shape.kv_heads * c.batch.max(1)
        },
        ..c.shape
    }
    .validate()?;
    let mut rep = OffloadBench {
        command: c.command.clone(),
        study: c.study,
        version: fathom_results::VERSION,
        fathom: env!("CARGO_PKG_VERSION").into(),
        device: Some(gpu.info().clone()),
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
        engine: c.engine,
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
            return Err(CudaError::invalid(
                "batch",
                "real sources are timed at batch 1",
            ));
        }
        for s in &r.layers {
            let p = s.params();
            if (p.heads, p.group, p.dim) != (shape.kv_heads, shape.group, shape.dim) {
                return Err(CudaError::invalid(
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
    if cache_engine {
        return run_cache_engine(c, &gpu, &sources, rep, progress);
    }
    rep.notes.push("exact = the full 4-bit store (all channels at 4 planes, 544 bits), read through the same gather; loki reads channels 0..r of the store (the timing store is in the raw basis, bytes identical to a KLT store); ds uses channels chosen offline by mean|q|·mean|k| on the source layers' own keys and queries; landmark and quest read their own fp16 tables".into());
    rep.notes.push("every step scores all n tokens with that step's queries (n is not grown between steps); weights are not modelled (W = 0 in docs/SPEC.md §6's traffic model)".into());
    if c.batch > 1 {
        rep.notes.push(format!(
            "batch {}: the B sequences are laid out as B·Hkv = {} KV heads per layer",
            c.batch, shape.kv_heads
        ));
    }
    if !c.ragged.is_empty() {
        return Err(CudaError::invalid(
            "ragged",
            "a ragged batch is timed by the cache engine only (--engine cache)",
        ));
    }
    let total_steps = c.warmup + c.steps + c.instrumented_steps;
    for &n in &c.contexts {
        for &res in &c.residencies {
            let k = c.k.unwrap_or(512).min(n.saturating_sub(36).max(1));
            let cfg = SessionConfig {
                shape,
                context: n,
                k,
                residency: res,
                cache_rows: c.cache_rows,
                row_bytes_budget: c.row_bytes_budget,
                tables: c.methods.iter().any(|m| !m.uses_planes()),
                steps: total_steps,
                groups: c.groups.first().copied().unwrap_or(0),
                gather_ctas: c.gather_ctas.first().copied().unwrap_or(0),
            };
            progress(&format!("context {n}, {}: allocating", res.label()));
            let mut s = Session::new(&gpu, &cfg, &sources, &c.methods)?;
            let layout = s.layout().clone();
            progress(&format!("  layout {layout:?}"));
            if layout.row_layers < shape.layers {
                rep.notes.push(format!(
                    "context {n} {}: K/V records of all {} layers do not fit the {:.0} GiB row budget; {} row layers are allocated and reused cyclically (layer l reads rows of l mod {})",
                    res.label(), shape.layers, c.row_bytes_budget as f64 / (1u64 << 30) as f64, layout.row_layers, layout.row_layers
                ));
            }
            rep.layouts.insert(format!("{n}/{}", res.label()), layout);
            let pipelines: Vec<(usize, usize)> = if res == Residency::Host {
                let gs = if c.groups.is_empty() {
                    vec![0]
                } else {
                    c.groups.clone()
                };
                let cs = if c.gather_ctas.is_empty() {
                    vec![0]
                } else {
                    c.gather_ctas.clone()
                };
                gs.iter()
                    .flat_map(|&g| cs.iter().map(move |&x| (g, x)))
                    .collect()
            } else {
                vec![(1, 0)]
            };
            for &(groups, ctas) in &pipelines {
                s.set_pipeline(groups, ctas);
                let cfg = SessionConfig {
                    groups,
                    gather_ctas: ctas,
                    ..cfg.clone()
                };
                if pipelines.len() > 1 {
                    progress(&format!(
                        "  pipeline: {} head groups, gather grid cap {}",
                        cfg.pipeline_groups(),
                        if ctas == 0 {
                            "none".to_string()
                        } else {
                            ctas.to_string()
                        }
                    ));
                }
                let first = rep.results.len();
                for &m in &c.methods {
                    s.reset_cache()?;
                    let mut timed: Vec<StepStats> = Vec::new();
                    let mut inst: Vec<StepStats> = Vec::new();
                    for step in 0..total_steps {
                        let st = s.run_step(m, step, step >= c.warmup + c.steps)?;
                        if step >= c.warmup + c.steps {
                            inst.push(st);
                        } else if step >= c.warmup {
                            timed.push(st);
                        }
                    }
                    let r = summarize(&rep, &cfg, m, &timed, &inst);
                    progress(&format!(
                    "  {:<10} bits {:6.1}  gpu {:8.3} ms  wall {:8.3} ms  floor {:>8}  plan {:5.2}%  hit {:4.1}%  stages ms: {}",
                    r.method, r.bits, r.gpu_ms, r.wall_ms,
                    r.link_floor_ms.map_or("-".into(), |f| format!("{f:.3}")),
                    100.0 * r.planner_share, 100.0 * r.cache_hit_rate,
                    STAGES
                        .iter()
                        .map(|k| format!("{k}={:.3}", r.stage_ms[*k]))
                        .collect::<Vec<_>>()
                        .join(" ")
                ));
                    rep.results.push(r);
                }
                add_speedups(&mut rep.results[first..], shape.dim);
            }
            // The CUDA session frees its device and pinned memory here, before the next
            // context allocates; the stub's session has nothing to free.
            #[allow(clippy::drop_non_drop)]
            drop(s);
            if let Some(p) = &c.json {
                write_json(&rep, p)?;
            }
        }
    }
    Ok(rep)
}

/// The cache engine ([`crate::bench_cache`]): per residency, every context at `batch` equal
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
        crate::bench_cache::run(c, gpu, sources, &runs, res, &mut rep, &mut progress)?;
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

/// Speedups of every result against every 136-bit scan among `results` (one context and
/// residency).
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

pub(crate) fn write_json(rep: &OffloadBench, p: &Path) -> Result<()> {
    // Atomic (temporary file, fsync, rename): the report is rewritten after every context, and
    // a crash mid-write must leave the previous whole report, not a partial one.
    fathom_results::write(p, rep.clone())
        .map_err(|e| CudaError::invalid("json path", e.to_string()))
}

fn summarize(
    rep: &OffloadBench,
    cfg: &SessionConfig,
    m: Method,
    timed: &[StepStats],
    inst: &[StepStats],
) -> BenchResult {
    let sh = cfg.shape;
    let gpu: Vec<f64> = timed.iter().map(|s| s.gpu_ms).collect();
    let wall: Vec<f64> = timed.iter().map(|s| s.wall_ms).collect();
    let all: Vec<&StepStats> = timed.iter().chain(inst).collect();
    let bits = median(&all.iter().map(|s| s.bits).collect::<Vec<_>>());
    let union = median(&all.iter().map(|s| s.union_rows as f64).collect::<Vec<_>>());
    let hits = median(&all.iter().map(|s| s.cache_hits as f64).collect::<Vec<_>>());
    let mut stage_ms = BTreeMap::new();
    for (i, name) in STAGES.iter().enumerate() {
        let v: Vec<f64> = inst
            .iter()
            .filter_map(|s| s.stage_ms.map(|a| a[i]))
            .collect();
        stage_ms.insert(name.to_string(), median(&v));
    }
    let host = cfg.residency == Residency::Host;
    let bytes = stage_bytes(sh, &[cfg.context], m, bits, union, hits, host);
    let gpu_ms = median(&gpu);
    let link_floor_ms = host.then(|| bytes.pcie_total as f64 / (rep.h2d_gbps * 1e9) * 1e3);
    let plan_ms = stage_ms.get("plan").copied().unwrap_or(0.0);
    let inst_total = median(&inst.iter().map(|s| s.gpu_ms).collect::<Vec<_>>());
    BenchResult {
        context: cfg.context,
        residency: cfg.residency.label().into(),
        method: m.label(),
        k: cfg.k,
        groups: if cfg.residency == Residency::Host {
            cfg.pipeline_groups()
        } else {
            1
        },
        gather_ctas: if cfg.residency == Residency::Host {
            cfg.gather_cap()
        } else {
            0
        },
        bits_nominal: m.bits(sh.dim) as f64,
        bits,
        gpu_ms,
        gpu_ms_steps: gpu,
        wall_ms: median(&wall),
        stage_ms,
        bytes,
        link_floor_ms,
        floor_ratio: link_floor_ms.map(|f| gpu_ms / f),
        planner_share: if inst_total > 0.0 {
            plan_ms / inst_total
        } else {
            0.0
        },
        union_rows: union,
        cache_hit_rate: if union > 0.0 { hits / union } else { 0.0 },
        speedup_vs_136: BTreeMap::new(),
        select: String::new(),
        fallback_rate: None,
        filtered_share: None,
        scan_vector_words: 0,
        graph: false,
        append_ms: None,
        round: 0,
        host_gather: 0,
        host_gather_share: 100,
        host_gather_request_us: None,
        host_gather_mrows_per_thread_s: None,
    }
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
