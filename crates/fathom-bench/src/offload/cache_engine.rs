//! `fathom offload-bench`: the offload benchmark as a client of the library (docs/SPEC.md §6,
//! §6.1). Every timed step goes through the public [`PagedCache`] path a model drives: sessions
//! are built by appending (prefilling) the source keys and values, and every timed step
//! reserves one token per session, then per layer appends that token's K/V from device memory
//! and attends the step's queries (device to device). GPU time is the CUDA event pair around
//! the step's appends and attends; then as many steps again time each append by its own event
//! pair (`append_ms`, beside steps timed without them). The host-side `reserve` (one stream
//! synchronisation) is in the wall time only.
//!
//! A cache's options are fixed when it is made ([`CacheOptions`]): each combination of select
//! path, head groups, scan loads and host gather asked for is a cache of its own, prefilled
//! alike, on which the rounds, launch modes and methods are timed (`cache_step.rs`).
//!
//! The pools are pinned, mapped host memory (host residency) or HBM (hbm). When every layer's
//! pool of a run does not fit `pool_budget` bytes, fewer layers are timed (recorded in the
//! notes): every layer of the step is the same work, so the ratios between methods are
//! unchanged.

use cudarc::driver::CudaSlice;

use super::cache_step::{entry, time_method, Prepared};
use super::synth::LayerSource;
use super::{add_speedups, BenchConfig, BenchResult, OffloadBench};
use fathom_cuda::cache::{CacheConfig, CacheOptions, DEFAULT_PAGE_TOKENS};
use fathom_cuda::pages::PageConfig;
use fathom_cuda::prelude::*;
use fathom_cuda::{CudaError, Gpu, Method, ModelShape, Residency, Result};

pub(super) fn drv(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        op,
        message: e.to_string(),
    }
}

/// One source layer's values in device memory, `[n0][Hkv][D]` f32 (keys are tiled on the
/// host: [`LayerSource::tiled_keys`]).
pub(super) struct DeviceSource {
    pub(super) v: CudaSlice<f32>,
    pub(super) n0: usize,
}

/// Layers whose pools fit `budget` bytes (at least 1, at most `layers`), and one pool's bytes.
fn layers_that_fit(cfg: &CacheConfig, budget: u64) -> Result<(usize, u64)> {
    let shape = cfg.shape;
    let per_layer = cfg.layer_pool_bytes()?;
    Ok((
        ((budget / per_layer.max(1)) as usize).clamp(1, shape.layers),
        per_layer,
    ))
}

/// Keys of a source layer the PCA basis is computed from (the first ones: enough for a
/// covariance of D ≤ 256 channels, and seconds, not minutes, of Jacobi per head).
const PCA_KEYS: usize = 4096;

/// Loki's PCA basis of KV head `h` of a source layer (`fathom_plan::calib::head_calib` over its
/// first [`PCA_KEYS`] keys and 64 of its queries).
///
/// # Errors
/// Keys or queries the calibration refuses (non-finite, say), typed.
fn pca_basis(src: &LayerSource, h: usize) -> Result<Vec<f32>> {
    let (hkv, d) = (src.store.dims().heads, src.store.dims().channels);
    let n = (src.keys.len() / (hkv * d)).min(PCA_KEYS);
    let g = src.queries(0).len() / (hkv * d);
    let qs: Vec<f32> = (0..64)
        .flat_map(|p| src.queries(p)[h * g * d..(h + 1) * g * d].to_vec())
        .collect();
    Ok(fathom_plan::calib::head_calib(
        &fathom_plan::KvView::head(&src.keys[..n * hkv * d], hkv, d, h),
        &qs,
    )?
    .loki)
}

/// The caches of one run: every combination of the options asked for (select paths, head
/// groups, scan loads, and each gather thread count at every share; the gather off once).
fn option_sets(c: &BenchConfig) -> Vec<CacheOptions> {
    let or = |v: Vec<usize>, d: usize| if v.is_empty() { vec![d] } else { v };
    let selects = if c.select_paths.is_empty() {
        vec![fathom_cuda::cache::SelectPath::default()]
    } else {
        c.select_paths.clone()
    };
    // Head groups per attend (`--groups`; 0, "auto", is one group).
    let groups = or(c.groups.iter().map(|&g| g.max(1)).collect(), 1);
    let vecs: Vec<u32> = if c.scan_vector_words.is_empty() {
        vec![1]
    } else {
        c.scan_vector_words.clone()
    };
    let shares: Vec<u32> = if c.host_gather_share.is_empty() {
        vec![100]
    } else {
        c.host_gather_share.clone()
    };
    let gathers: Vec<(usize, u32)> = or(c.host_gather.clone(), 0)
        .into_iter()
        .flat_map(|n| {
            let at: Vec<u32> = if n == 0 { vec![100] } else { shares.clone() };
            at.into_iter().map(move |p| (n, p))
        })
        .collect();
    let mut out = Vec::new();
    for &select in &selects {
        for &attend_groups in &groups {
            for &scan_vector_words in &vecs {
                for &(host_gather_threads, host_gather_share) in &gathers {
                    out.push(CacheOptions {
                        select,
                        attend_groups,
                        scan_vector_words,
                        host_gather_threads,
                        host_gather_share,
                        stage_timing: c.stage_timing,
                    });
                }
            }
        }
    }
    out
}

/// One run's cache shape (every option set's the same): its configuration without options
/// (with only the layers that fit the budget), k, and the label of its notes.
struct RunPlan {
    cfg: CacheConfig,
    k: usize,
    label: String,
}

impl RunPlan {
    fn new(
        c: &BenchConfig,
        shape: ModelShape,
        lens: &[usize],
        residency: Residency,
        rep: &mut OffloadBench,
    ) -> Result<RunPlan> {
        let b = lens.len();
        let longest = *lens.iter().max().unwrap_or(&0);
        // Every (round, launch mode, method) of an option set appends its steps to every
        // session of that set's cache.
        let grow =
            (c.warmup + 2 * c.steps) * c.methods.len() * c.graphs.len().max(1) * c.rounds.max(1)
                + 8;
        let page = DEFAULT_PAGE_TOKENS;
        let pages: usize = lens
            .iter()
            .map(|&n| (n + grow).div_ceil(page))
            .sum::<usize>()
            + b;
        let k = c.k.unwrap_or(512).min(longest.saturating_sub(36).max(1));
        // The PCA index and the block tables where a method reads them.
        let cfg = CacheConfig {
            shape,
            pages: PageConfig {
                page_tokens: page,
                pages,
                max_sessions: b,
                max_tokens: longest + grow,
            },
            max_batch: b,
            max_k: k,
            row_cache: c.cache_rows,
            residency,
            pca_index: false,
            block_tables: false,
            host_pages: c.host_pages,
            options: CacheOptions::default(),
        }
        .serving(&c.methods);
        let (layers, pool_bytes) = layers_that_fit(&cfg, c.pool_budget)?;
        let label = if lens.iter().all(|&n| n == longest) {
            format!("{b} × {longest}, {}", residency.label())
        } else {
            format!("ragged {lens:?}, {}", residency.label())
        };
        if layers < shape.layers {
            rep.notes.push(format!(
                "cache engine, {label}: {layers} of {} layers timed (each layer's pool is {:.1} GiB; the budget is {:.0} GiB); every layer is the same work, so the ratios between methods hold for the whole model",
                shape.layers,
                pool_bytes as f64 / (1u64 << 30) as f64,
                c.pool_budget as f64 / (1u64 << 30) as f64
            ));
        }
        let cfg = CacheConfig {
            shape: ModelShape { layers, ..shape },
            ..cfg
        };
        Ok(RunPlan { cfg, k, label })
    }
}

/// Notes `why` once (and prints it).
fn note(rep: &mut OffloadBench, progress: &mut dyn FnMut(&str), why: String) {
    let note = format!("cache engine: {why}");
    progress(&format!("  {note}"));
    if !rep.notes.contains(&note) {
        rep.notes.push(note);
    }
}

/// Times every method of `c` through [`PagedCache`] for each run of session lengths
/// (`runs`: one entry per context of `B` equal sessions, or the ragged set), on a cache per
/// option set, appending the results to `rep` and writing it after each run when `c.json` is
/// set.
pub(crate) fn run(
    c: &BenchConfig,
    gpu: &Gpu,
    sources: &[LayerSource],
    runs: &[Vec<usize>],
    residency: Residency,
    rep: &mut OffloadBench,
    progress: &mut dyn FnMut(&str),
) -> Result<()> {
    let shape = c.shape.validate()?;
    let (hkv, d) = (shape.kv_heads, shape.dim);
    let stream = gpu.stream().clone();
    let dev = sources
        .iter()
        .map(|s| {
            Ok(DeviceSource {
                v: stream
                    .clone_htod(&s.values)
                    .map_err(drv("upload source values"))?,
                n0: s.keys.len() / (hkv * d),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    // Loki's PCA basis per source layer and KV head, once (a D × D Jacobi each), when a method
    // reads the PCA index.
    let bases: Vec<Vec<Vec<f32>>> = if c.methods.iter().any(Method::reads_pca_index) {
        sources
            .iter()
            .map(|src| (0..hkv).map(|h| pca_basis(src, h)).collect())
            .collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    let graphs: Vec<bool> = if c.graphs.is_empty() {
        vec![false]
    } else {
        c.graphs.clone()
    };
    for lens in runs {
        let plan = RunPlan::new(c, shape, lens, residency, rep)?;
        let first = rep.results.len();
        for opts in option_sets(c) {
            let cfg = CacheConfig {
                options: opts,
                ..plan.cfg
            };
            // A setting the cache refuses is noted once and skipped, as a method it cannot run.
            if let Err(e) = cfg.validate() {
                note(rep, progress, format!("{opts:?} not timed: {e}"));
                continue;
            }
            let mut p = Prepared::new(
                c,
                gpu,
                cfg,
                lens,
                sources,
                &dev,
                &bases,
                &plan.label,
                rep,
                progress,
            )?;
            for round in 0..c.rounds.max(1) {
                for &as_graph in &graphs {
                    for &m in &c.methods {
                        if let Err(e) = p.cache.prepare(m) {
                            note(rep, progress, format!("{} not timed: {e}", m.label()));
                            continue;
                        }
                        let t = time_method(&mut p, c, sources, &dev, m, as_graph)?;
                        let r = entry(
                            rep,
                            c,
                            &p,
                            t,
                            (lens, residency, plan.k, m),
                            (round, as_graph),
                        );
                        report(c, &r, progress);
                        rep.results.push(r);
                    }
                }
            }
        }
        add_speedups(&mut rep.results[first..], d);
        if let Some(p) = &c.json {
            super::write_json(rep, p)?;
        }
    }
    Ok(())
}

/// Prints one entry's line (and its stage split).
fn report(c: &BenchConfig, r: &BenchResult, progress: &mut dyn FnMut(&str)) {
    progress(&format!(
        "  {}{:<10} {:<15} groups {} loads {}×8 B {}{}  bits {:6.1}  gpu {:8.3} ms  wall {:8.3} ms  floor {:>8}  hit {:4.1}%  filtered {}  appends {}",
        if c.rounds > 1 {
            format!("round {} ", r.round + 1)
        } else {
            String::new()
        },
        r.method,
        r.select,
        r.groups,
        r.scan_vector_words,
        if r.graph { "graph " } else { "launch" },
        if r.host_gather > 0 {
            format!(
                " gather {:>2} × {:>3}% ({:.1} µs/attend, {:.1} M rows/s/thread)",
                r.host_gather,
                r.host_gather_share,
                r.host_gather_request_us.unwrap_or(0.0),
                r.host_gather_mrows_per_thread_s.unwrap_or(0.0)
            )
        } else {
            String::new()
        },
        r.bits,
        r.gpu_ms,
        r.wall_ms,
        r.link_floor_ms.map_or("-".into(), |f| format!("{f:.3}")),
        100.0 * r.cache_hit_rate,
        match (r.filtered_share, r.fallback_rate) {
            (Some(f), Some(b)) => format!("{:.1}% (fallbacks {:.1}%)", 100.0 * f, 100.0 * b),
            _ => "-".into(),
        },
        r.append_ms.map_or("-".into(), |a| format!(
            "{a:.3} ms ({:.2}% of the step)",
            100.0 * a / r.gpu_ms
        ))
    ));
    if !r.stage_ms.is_empty() {
        progress(&format!(
            "    stages ms (plain launches): {}",
            fathom_cuda::cache::AttendStages::NAMES
                .iter()
                .map(|k| format!("{k}={:.3}", r.stage_ms[*k]))
                .collect::<Vec<_>>()
                .join(" ")
        ));
    }
}
