//! `fathom offload-bench --engine cache`: the offload benchmark as a client of the library
//! (docs/SPEC.md §6, §6.1). Every timed step goes through the public [`PagedCache`] path a
//! model drives: sessions are built by appending (prefilling) the source keys and values, and
//! every timed step reserves one token per session, then per layer appends that token's K/V
//! from device memory and attends the step's queries (device to device). GPU time is the CUDA
//! event pair around the step's appends and attends; then as many steps again time each append
//! by its own event pair (`append_ms`, beside steps timed without them). The host-side
//! `reserve` (one stream synchronisation) is in the wall time only.
//!
//! The pools are pinned, mapped host memory (host residency) or HBM (hbm). When every layer's
//! pool of a run does not fit `pool_budget` bytes, fewer layers are timed (recorded in the
//! notes): every layer of the step is the same work, so the ratios between methods are
//! unchanged.

use cudarc::driver::{result, sys, CudaSlice, DevicePtr};

use super::synth::LayerSource;
use super::{add_speedups, invalid, stage_bytes, BenchConfig, BenchResult, OffloadBench};
use fathom_cuda::cache::{
    AttendMethod, CacheConfig, KvDtype, KvRows, QueryRows, DEFAULT_PAGE_TOKENS,
};
use fathom_cuda::pages::{PageConfig, SessionId};
use fathom_cuda::{CudaError, Gpu, Method, ModelShape, PagedCache, Residency, Result};
use fathom_plan::scanner::HeadCalib;
use fathom_plan::SelectParams;

/// Tokens per prefill append (per session).
const PREFILL_CHUNK: usize = 8192;

fn drv(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        op,
        message: e.to_string(),
    }
}

/// One source layer's values in device memory, `[n0][Hkv][D]` f32 (keys are tiled on the
/// host: [`LayerSource::tiled_keys`]).
struct DeviceSource {
    v: CudaSlice<f32>,
    n0: usize,
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

/// Times every method of `c` through [`PagedCache`] for each run of session lengths
/// (`runs`: one entry per context of `B` equal sessions, or the ragged set), appending the
/// results to `rep` and writing it after each run when `c.json` is set.
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
    let (hkv, g, d) = (shape.kv_heads, shape.group, shape.dim);
    let stream = gpu.stream().clone();
    // Warm-up, timed steps, then as many steps again with the appends timed one by one.
    let steps_per_method = c.warmup + 2 * c.steps;
    let dev = sources
        .iter()
        .map(|s| {
            let n0 = s.keys.len() / (hkv * d);
            Ok(DeviceSource {
                v: stream
                    .clone_htod(&s.values)
                    .map_err(drv("upload source values"))?,
                n0,
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
    for lens in runs {
        let b = lens.len();
        let longest = *lens.iter().max().unwrap_or(&0);
        // Every (select path, head groups, method) setting appends its steps to every session.
        let grow = steps_per_method
            * c.methods.len()
            * c.select_paths.len().max(1)
            * c.groups.len().max(1)
            * c.scan_vector_words.len().max(1)
            * c.host_gather.len().max(1)
            * c.host_gather_share.len().max(1)
            * c.graphs.len().max(1)
            * c.rounds.max(1)
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
        }
        .serving(&c.methods);
        let (layers, pool_bytes) = layers_that_fit(&cfg, c.pool_budget)?;
        let run_label = if lens.iter().all(|&n| n == longest) {
            format!("{b} × {longest}, {}", residency.label())
        } else {
            format!("ragged {lens:?}, {}", residency.label())
        };
        if layers < shape.layers {
            rep.notes.push(format!(
                "cache engine, {run_label}: {layers} of {} layers timed (each layer's pool is {:.1} GiB; the budget is {:.0} GiB); every layer is the same work, so the ratios between methods hold for the whole model",
                shape.layers,
                pool_bytes as f64 / (1u64 << 30) as f64,
                c.pool_budget as f64 / (1u64 << 30) as f64
            ));
        }
        let cshape = ModelShape { layers, ..shape };
        let cfg = CacheConfig {
            shape: cshape,
            ..cfg
        };
        progress(&format!(
            "{run_label}: {layers} layers, pools {:.1} GiB, prefilling",
            layers as f64 * pool_bytes as f64 / (1u64 << 30) as f64
        ));
        let t0 = std::time::Instant::now();
        let huge_before = fathom_cuda::anon_huge_bytes();
        let mut cache = PagedCache::new(gpu, cfg)?;
        if c.host_pages == fathom_cuda::HostPages::Huge {
            // What the kernel actually gave (it may fall back to ordinary pages).
            let backed = match (huge_before, fathom_cuda::anon_huge_bytes()) {
                (Some(a), Some(z)) => format!(
                    "{:.1} GiB on huge pages (AnonHugePages growth)",
                    z.saturating_sub(a) as f64 / (1u64 << 30) as f64
                ),
                _ => "the kernel does not say how much on huge pages".into(),
            };
            let msg = format!(
                "cache engine, {run_label}: host pools on huge pages (docs/SPEC.md §6.1, \"Host pages\"): {backed}"
            );
            progress(&format!("  {msg}"));
            rep.notes.push(msg);
        }
        let ids: Vec<SessionId> = (0..b).map(|_| cache.create()).collect::<Result<_>>()?;
        // Calibration first: σ², DS channels and, for Loki, the PCA basis.
        for l in 0..layers {
            let src = &sources[l % sources.len()];
            let heads: Vec<HeadCalib> = (0..hkv)
                .map(|h| HeadCalib {
                    sigma2: src.sigma2[h * d..(h + 1) * d].to_vec(),
                    ds_channels: fathom_plan::calib::ds_order(
                        &src.ds_score[h * d..(h + 1) * d]
                            .iter()
                            .map(|&x| x as f64)
                            .collect::<Vec<_>>(),
                    )
                    .into_iter()
                    .map(|c| c as u16)
                    .collect(),
                    // Loki's basis, before the first append (the PCA index is written from it).
                    loki: bases
                        .get(l % sources.len())
                        .map_or_else(Vec::new, |b| b[h].clone()),
                    ..Default::default()
                })
                .collect();
            cache.load_calibration(l, &heads)?;
        }
        // Prefill: each session appends its tiled source tokens, a chunk at a time (keys
        // through a staging buffer: tiles after the first are made distinct on the host).
        let mut kstage: CudaSlice<f32> = stream
            .alloc_zeros(PREFILL_CHUNK * hkv * d)
            .map_err(drv("alloc"))?;
        for (&s, &n) in ids.iter().zip(lens) {
            let mut done = 0;
            while done < n {
                let src0 = &dev[0];
                let at = done % src0.n0;
                let m = PREFILL_CHUNK.min(src0.n0 - at).min(n - done);
                let batch = cache.reserve(&[(s, m)])?;
                for l in 0..layers {
                    let src = &dev[l % dev.len()];
                    let off = (at * hkv * d * 4) as u64;
                    let keys = sources[l % sources.len()].tiled_keys(l, done, m);
                    stream
                        .memcpy_htod(&keys, &mut kstage)
                        .map_err(drv("upload prefill keys"))?;
                    cache.append(
                        &batch,
                        l,
                        &KvRows {
                            k: kstage.device_ptr(&stream).0,
                            v: src.v.device_ptr(&stream).0 + off,
                            dtype: KvDtype::F32,
                            rows: m,
                        },
                    )?;
                }
                done += m;
            }
        }
        // Every step's queries (the same sequence for every method), `[step][layer][b][Hq][D]`.
        let hq = hkv * g;
        let row = b * hq * d;
        let mut qs = Vec::with_capacity(steps_per_method * layers * row);
        for step in 0..steps_per_method {
            for l in 0..layers {
                for sb in 0..b {
                    qs.extend(sources[l % sources.len()].queries(step * b + sb));
                }
            }
        }
        let qbuf = stream.clone_htod(&qs).map_err(drv("upload queries"))?;
        let mut newk: CudaSlice<f32> = stream
            .alloc_zeros(layers * b * hkv * d)
            .map_err(drv("alloc"))?;
        let newv: CudaSlice<f32> = stream
            .alloc_zeros(layers * b * hkv * d)
            .map_err(drv("alloc"))?;
        let out: CudaSlice<f32> = stream.alloc_zeros(b * hq * d).map_err(drv("alloc"))?;
        // A captured step reads its queries from one place: each replayed step's are copied
        // there first (outside the timed events, as a model's forward would have written them).
        let qfix: CudaSlice<f32> = stream.alloc_zeros(layers * row).map_err(drv("alloc"))?;
        stream.synchronize().map_err(drv("synchronize"))?;
        progress(&format!("  set up in {:.1}s", t0.elapsed().as_secs_f64()));
        let params = SelectParams {
            sink: 4,
            local: 32,
            k,
        };
        let qp = qbuf.device_ptr(&stream).0;
        let (kp, vp, op) = (
            newk.device_ptr(&stream).0,
            newv.device_ptr(&stream).0,
            out.device_ptr(&stream).0,
        );
        let decode: Vec<(SessionId, usize)> = ids.iter().map(|&s| (s, 1)).collect();
        let first = rep.results.len();
        let settings = if c.select_paths.is_empty() {
            vec![fathom_cuda::cache::SelectPath::default()]
        } else {
            c.select_paths.clone()
        };
        // Head groups per attend (`--groups`; 0, "auto", is one group on this engine).
        let attend_groups: Vec<usize> = if c.groups.is_empty() {
            vec![1]
        } else {
            c.groups.iter().map(|&g| g.max(1)).collect()
        };
        let vecs: Vec<u32> = if c.scan_vector_words.is_empty() {
            vec![1]
        } else {
            c.scan_vector_words.clone()
        };
        // (threads, share) pairs: the gather off once, each thread count at every share.
        let shares: Vec<u32> = if c.host_gather_share.is_empty() {
            vec![100]
        } else {
            c.host_gather_share.clone()
        };
        let gathers: Vec<(usize, u32)> = if c.host_gather.is_empty() {
            vec![(0, 100)]
        } else {
            c.host_gather
                .iter()
                .flat_map(|&n| {
                    let at: Vec<u32> = if n == 0 { vec![100] } else { shares.clone() };
                    at.into_iter().map(move |p| (n, p))
                })
                .collect()
        };
        let graphs: Vec<bool> = if c.graphs.is_empty() {
            vec![false]
        } else {
            c.graphs.clone()
        };
        let qf = qfix.device_ptr(&stream).0;
        let io = StepIo {
            k: kp,
            v: vp,
            out: op,
            layers,
            sessions: b,
            kv_row: hkv * d,
        };
        for ((round, fuse, groups, vec, as_graph), (gather, share), &m) in (0..c.rounds.max(1))
            .flat_map(|round| settings.iter().map(move |&f| (round, f)))
            .flat_map(|(round, f)| attend_groups.iter().map(move |&g| (round, f, g)))
            .flat_map(|(round, f, g)| vecs.iter().map(move |&v| (round, f, g, v)))
            .flat_map(|(round, f, g, v)| graphs.iter().map(move |&x| (round, f, g, v, x)))
            .flat_map(|s| gathers.iter().map(move |&n| (s, n)))
            .flat_map(|(s, n)| c.methods.iter().map(move |m| (s, n, m)))
        {
            cache.set_select_path(fuse)?;
            let select = fuse.label();
            let am = AttendMethod::Scan(m);
            // A setting the cache refuses is noted once and skipped, as a method it cannot run.
            // Head groups refuse a gather that is on: off first then (a no-op when it is).
            let refused = if groups > 1 {
                cache.set_host_gather(0)
            } else {
                Ok(())
            }
            .map_err(|e| format!("--host-gather 0: {e}"))
            .and_then(|()| {
                cache
                    .set_scan_vector_words(vec)
                    .map_err(|e| format!("--scan-vec {vec} not timed: {e}"))
            })
            .and_then(|()| {
                cache
                    .set_attend_groups(groups)
                    .map_err(|e| format!("--groups {groups} not timed: {e}"))
            })
            .and_then(|()| {
                cache
                    .set_host_gather(gather)
                    .map_err(|e| format!("--host-gather {gather} not timed: {e}"))
            })
            .and_then(|()| {
                cache
                    .set_host_gather_share(share)
                    .map_err(|e| format!("--host-share {share} not timed: {e}"))
            })
            .and_then(|()| {
                cache
                    .prepare(m)
                    .map_err(|e| format!("{} not timed: {e}", m.label()))
            });
            if let Err(why) = refused {
                let note = format!("cache engine: {why}");
                progress(&format!("  {note}"));
                if !rep.notes.contains(&note) {
                    rep.notes.push(note);
                }
                continue;
            }
            for &s in &ids {
                cache.reset_row_cache(s)?;
            }
            let (bits0, plans0) = cache.plan_bits()?;
            let rows0 = cache.row_counters()?;
            let gather0 = cache.host_gather_stats()?;
            let mut sel0 = cache.select_counters()?;
            let mut sel1 = sel0;
            let (mut gpu_ms, mut wall_ms, mut append_ms) = (Vec::new(), Vec::new(), Vec::new());
            // The steps after the timed ones (plain launches) are also split by stage
            // (PagedCache::set_stage_timing), one AttendStages per step.
            let mut stages: Vec<fathom_cuda::cache::AttendStages> = Vec::new();
            let mut stage_steps_ms = Vec::new();
            let timed_end = c.warmup + c.steps;
            // `--graph`: the warm-up and timed steps replay one captured step (captured at the
            // first, which then replays it); the appends' steps after them stay plain launches
            // (a graph holds no timing events).
            let mut graph: Option<fathom_cuda::DecodeGraph> = None;
            for step in 0..steps_per_method {
                // After the timed steps: an event pair around each append, summed per step.
                let time_appends = step >= timed_end;
                cache.set_stage_timing(time_appends);
                let w0 = std::time::Instant::now();
                let batch = cache.reserve(&decode)?;
                // This step's new token of each session: its source's next row, per layer
                // (the key tiled as in the prefill).
                let mut keys = Vec::with_capacity(layers * b * hkv * d);
                for l in 0..layers {
                    for p in &batch.plans {
                        keys.extend(sources[l % sources.len()].tiled_keys(l, p.first_token, 1));
                    }
                }
                stream
                    .memcpy_htod(&keys, &mut newk)
                    .map_err(drv("upload new keys"))?;
                for l in 0..layers {
                    let src = &dev[l % dev.len()];
                    for (sb, p) in batch.plans.iter().enumerate() {
                        let tok = p.first_token % src.n0;
                        let bytes = hkv * d * 4;
                        let dst = ((l * b + sb) * hkv * d * 4) as u64;
                        let so = (tok * bytes) as u64;
                        // SAFETY: both ranges lie inside their device buffers.
                        unsafe {
                            result::memcpy_dtod_async(
                                vp + dst,
                                src.v.device_ptr(&stream).0 + so,
                                bytes,
                                stream.cu_stream(),
                            )
                            .map_err(drv("memcpy_dtod new value"))?;
                        }
                    }
                }
                let ev = |s: &std::sync::Arc<cudarc::driver::CudaStream>| {
                    s.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                        .map_err(drv("record event"))
                };
                let replayed = as_graph && !time_appends;
                if replayed {
                    let q_off = ((step * layers * row) * 4) as u64;
                    // SAFETY: both ranges lie inside their device buffers (`layers · row` f32).
                    unsafe {
                        result::memcpy_dtod_async(
                            qf,
                            qp + q_off,
                            layers * row * 4,
                            stream.cu_stream(),
                        )
                        .map_err(drv("memcpy_dtod step queries"))?;
                    }
                    if graph.is_none() {
                        graph = Some(cache.capture(&batch, |cache| {
                            launch_step(
                                cache,
                                &batch,
                                &io,
                                am,
                                &params,
                                |l| qf + ((l * row) * 4) as u64,
                                || Ok(()),
                            )
                        })?);
                    }
                }
                let e0 = ev(&stream)?;
                let mut append_events = Vec::new();
                if let (true, Some(g)) = (replayed, &graph) {
                    cache.replay(&batch, g)?;
                } else {
                    let q0 = qp + ((step * layers * row) * 4) as u64;
                    launch_step(
                        &mut cache,
                        &batch,
                        &io,
                        am,
                        &params,
                        |l| q0 + ((l * row) * 4) as u64,
                        || {
                            if time_appends {
                                append_events.push(ev(&stream)?);
                            }
                            Ok(())
                        },
                    )?;
                }
                let e1 = ev(&stream)?;
                e1.synchronize().map_err(drv("event synchronize"))?;
                if step + 1 == c.warmup {
                    // The filtered select's counts cover the timed steps only (each row's
                    // first attend after the reset is on the score path by design).
                    sel0 = cache.select_counters()?;
                }
                if step + 1 == timed_end {
                    sel1 = cache.select_counters()?;
                }
                if time_appends {
                    let mut ms = 0.0;
                    for p in append_events.chunks_exact(2) {
                        ms += p[0].elapsed_ms(&p[1]).map_err(drv("elapsed"))? as f64;
                    }
                    append_ms.push(ms);
                    let st = cache.stage_times()?;
                    if st.untimed == 0 && st.attends > 0 {
                        stages.push(st);
                        stage_steps_ms.push(e0.elapsed_ms(&e1).map_err(drv("elapsed"))? as f64);
                    }
                } else if step >= c.warmup {
                    gpu_ms.push(e0.elapsed_ms(&e1).map_err(drv("elapsed"))? as f64);
                    wall_ms.push(w0.elapsed().as_secs_f64() * 1e3);
                }
            }
            cache.set_stage_timing(false);
            let (bits1, plans1) = cache.plan_bits()?;
            let rows1 = cache.row_counters()?;
            let gather1 = cache.host_gather_stats()?;
            let bits = if plans1 > plans0 {
                (bits1 * plans1 as f64 - bits0 * plans0 as f64) / (plans1 - plans0) as f64
            } else {
                m.bits(d) as f64
            };
            let nsteps = steps_per_method as f64;
            let union = (rows1.rows - rows0.rows) as f64 / nsteps;
            let hits = (rows1.hits - rows0.hits) as f64 / nsteps;
            let mut r = result(
                rep, cshape, lens, residency, k, m, bits, union, hits, gpu_ms, wall_ms,
            );
            r.append_ms = (!append_ms.is_empty()).then(|| median(&append_ms));
            if !stages.is_empty() {
                // Median per stage over the split steps (each step's sum over its layers).
                for (i, name) in fathom_cuda::cache::AttendStages::NAMES.iter().enumerate() {
                    let v: Vec<f64> = stages.iter().map(|st| st.values()[i]).collect();
                    r.stage_ms.insert((*name).to_string(), median(&v));
                }
                // As the step engine's: the plan's share of the instrumented steps' GPU time
                // (here with the queries' conversion, part of the plan stage).
                let total = median(&stage_steps_ms);
                if total > 0.0 {
                    r.planner_share = r.stage_ms["plan"] / total;
                }
            }
            r.select = select;
            r.groups = groups;
            r.scan_vector_words = vec;
            r.graph = as_graph;
            r.round = round;
            r.host_gather = gather;
            r.host_gather_share = share;
            if let (Some(a), Some(z)) = (gather0, gather1) {
                let delta = z.since(&a);
                if delta.faults > 0 {
                    return Err(invalid(
                        "host gather",
                        format!("faults during {}: {z:?}", m.label()),
                    ));
                }
                // Per attend: the wall time from the request to its last mark, and the
                // records one thread copies per second.
                r.host_gather_request_us = delta.request_us;
                r.host_gather_mrows_per_thread_s = delta.mrows_per_thread_s;
            }
            if fuse != fathom_cuda::cache::SelectPath::Scores {
                let filtered = sel1.filtered - sel0.filtered;
                let fallbacks = sel1.fallbacks - sel0.fallbacks;
                let rows = (c.steps * layers * b * hq) as f64;
                r.filtered_share = Some(filtered as f64 / rows.max(1.0));
                r.fallback_rate = Some(if filtered + fallbacks == 0 {
                    0.0
                } else {
                    fallbacks as f64 / (filtered + fallbacks) as f64
                });
            }
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
            rep.results.push(r);
        }
        add_speedups(&mut rep.results[first..], d);
        drop(cache);
        if let Some(p) = &c.json {
            super::write_json(rep, p)?;
        }
    }
    Ok(())
}

/// The device buffers one bench decode step reads and writes: every layer's new K and V
/// (`[layer][session][Hkv][D]` f32, `kv_row` = Hkv·D floats per session) and the output rows.
struct StepIo {
    k: u64,
    v: u64,
    out: u64,
    layers: usize,
    sessions: usize,
    kv_row: usize,
}

/// One decode step's launches on `cache`, the same whether run or captured: per layer, the
/// append of the step's new K/V, then the attend of the queries at `q(layer)`; `mark` runs
/// just before and just after each append (where the appends' timing puts its events).
fn launch_step(
    cache: &mut PagedCache,
    batch: &fathom_cuda::cache::AppendBatch,
    io: &StepIo,
    method: AttendMethod,
    params: &SelectParams,
    q: impl Fn(usize) -> u64,
    mut mark: impl FnMut() -> Result<()>,
) -> Result<()> {
    for l in 0..io.layers {
        let off = ((l * io.sessions * io.kv_row) * 4) as u64;
        mark()?;
        cache.append(
            batch,
            l,
            &KvRows {
                k: io.k + off,
                v: io.v + off,
                dtype: KvDtype::F32,
                rows: io.sessions,
            },
        )?;
        mark()?;
        cache.attend(
            batch,
            l,
            method,
            params,
            &QueryRows {
                q: q(l),
                dtype: KvDtype::F32,
            },
            io.out,
        )?;
    }
    Ok(())
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

#[allow(clippy::too_many_arguments)]
fn result(
    rep: &OffloadBench,
    shape: ModelShape,
    lens: &[usize],
    residency: Residency,
    k: usize,
    m: Method,
    bits: f64,
    union: f64,
    hits: f64,
    gpu: Vec<f64>,
    wall: Vec<f64>,
) -> BenchResult {
    let host = residency == Residency::Host;
    let bytes = stage_bytes(shape, lens, m, bits, union, hits, host);
    let gpu_ms = median(&gpu);
    let link_floor_ms = host.then(|| bytes.pcie_total as f64 / (rep.h2d_gbps * 1e9) * 1e3);
    BenchResult {
        context: lens.iter().sum(),
        residency: residency.label().into(),
        method: m.label(),
        k,
        groups: 1,
        gather_ctas: 0,
        bits_nominal: m.bits(shape.dim) as f64,
        bits,
        gpu_ms,
        gpu_ms_steps: gpu,
        wall_ms: median(&wall),
        stage_ms: Default::default(),
        bytes,
        link_floor_ms,
        floor_ratio: link_floor_ms.map(|f| gpu_ms / f),
        planner_share: 0.0,
        union_rows: union,
        cache_hit_rate: if union > 0.0 { hits / union } else { 0.0 },
        speedup_vs_136: Default::default(),
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
