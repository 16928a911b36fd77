//! One option set's cache in the offload benchmark: made and prefilled alike for every set
//! ([`Prepared`]), then each (round, launch mode, method) timed on it ([`time_method`]) and
//! turned into a result entry ([`entry`]).

use cudarc::driver::{result, sys, CudaSlice, CudaStream, DevicePtr};

use super::cache_engine::{drv, DeviceSource};
use super::synth::LayerSource;
use super::{invalid, stage_bytes, BenchConfig, BenchResult, OffloadBench};
use fathom_cuda::cache::{AttendMethod, AttendStages, CacheConfig, KvDtype, KvRows, QueryRows};
use fathom_cuda::memory::{DeviceView, DeviceViewMut};
use fathom_cuda::pages::SessionId;
use fathom_cuda::prelude::*;
use fathom_cuda::{Gpu, Method, ModelShape, PagedCache, Residency, Result};
use fathom_plan::scanner::HeadCalib;
use fathom_plan::SelectParams;

/// Tokens per prefill append (per session).
const PREFILL_CHUNK: usize = 8192;

/// One option set's cache, prefilled, with the device buffers of its timed steps.
pub(super) struct Prepared {
    pub(super) cache: PagedCache,
    stream: std::sync::Arc<CudaStream>,
    ids: Vec<SessionId>,
    /// Every step's queries, `[step][layer][b][Hq][D]` f32 (the same sequence for every method).
    qbuf: CudaSlice<f32>,
    /// A captured step reads its queries from one place: each replayed step's are copied there
    /// first (outside the timed events, as a model's forward would have written them).
    qfix: CudaSlice<f32>,
    /// Every layer's new K and V, `[layer][b][Hkv][D]` f32, and the output rows.
    newk: CudaSlice<f32>,
    newv: CudaSlice<f32>,
    out: CudaSlice<f32>,
    params: SelectParams,
}

/// What the steps of one method measured.
pub(super) struct Timing {
    bits: f64,
    union: f64,
    hits: f64,
    gpu_ms: Vec<f64>,
    wall_ms: Vec<f64>,
    append_ms: Vec<f64>,
    stages: Vec<AttendStages>,
    stage_steps_ms: Vec<f64>,
    /// Filtered rows and fallbacks over the timed steps.
    filtered: (u64, u64),
    gather: Option<fathom_cuda::host_gather::GatherDelta>,
}

/// The calibration of layer `l` from its source: σ², Double Sparsity's channels and, for Loki,
/// the PCA basis (loaded before the first append: the PCA index is written from it).
fn calibration(
    src: &LayerSource,
    basis: Option<&Vec<Vec<f32>>>,
    hkv: usize,
    d: usize,
) -> Vec<HeadCalib> {
    (0..hkv)
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
            loki: basis.map_or_else(Vec::new, |b| b[h].clone()),
            ..Default::default()
        })
        .collect()
}

/// A view of `len` f32 at `ptr`, a buffer of the bench's own.
///
/// # Safety
/// `ptr` holds `len` f32 of a live buffer of this context, not freed while the view is used.
unsafe fn f32s<'a>(ptr: u64, len: usize) -> DeviceView<'a> {
    // SAFETY: the caller's contract.
    unsafe { DeviceView::from_raw(ptr, len, KvDtype::F32) }
}

impl Prepared {
    /// Makes the cache of `cfg` (validated), calibrates every layer and prefills each session
    /// of `lens` with its tiled source tokens, a chunk at a time (keys through a staging buffer:
    /// tiles after the first are made distinct on the host).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        c: &BenchConfig,
        gpu: &Gpu,
        cfg: CacheConfig,
        lens: &[usize],
        sources: &[LayerSource],
        dev: &[DeviceSource],
        bases: &[Vec<Vec<f32>>],
        label: &str,
        rep: &mut OffloadBench,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Prepared> {
        let s = cfg.shape;
        let (layers, hkv, g, d, b) = (s.layers, s.kv_heads, s.group, s.dim, lens.len());
        let stream = gpu.stream().clone();
        progress(&format!(
            "{label}, {:?}: {layers} layers, pools {:.1} GiB, prefilling",
            cfg.options,
            layers as f64 * cfg.layer_pool_bytes()? as f64 / (1u64 << 30) as f64
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
                "cache engine, {label}: host pools on huge pages (docs/SPEC.md §6.1, \"Host pages\"): {backed}"
            );
            progress(&format!("  {msg}"));
            if !rep.notes.contains(&msg) {
                rep.notes.push(msg);
            }
        }
        let ids: Vec<SessionId> = (0..b).map(|_| cache.create()).collect::<Result<_>>()?;
        for l in 0..layers {
            let src = &sources[l % sources.len()];
            cache.load_calibration(l, &calibration(src, bases.get(l % sources.len()), hkv, d))?;
        }
        let mut kstage: CudaSlice<f32> = stream
            .alloc_zeros(PREFILL_CHUNK * hkv * d)
            .map_err(drv("alloc"))?;
        for (&sid, &n) in ids.iter().zip(lens) {
            let mut done = 0;
            while done < n {
                let src0 = &dev[0];
                let at = done % src0.n0;
                let m = PREFILL_CHUNK.min(src0.n0 - at).min(n - done);
                let batch = cache.reserve(&[(sid, m)])?;
                for l in 0..layers {
                    let src = &dev[l % dev.len()];
                    let keys = sources[l % sources.len()].tiled_keys(l, done, m);
                    stream
                        .memcpy_htod(&keys, &mut kstage)
                        .map_err(drv("upload prefill keys"))?;
                    let row = hkv * d;
                    // SAFETY: the staging buffer holds PREFILL_CHUNK ≥ m rows, the source's
                    // values n0 ≥ at + m rows; both live until the appends have run (the next
                    // staging copy is ordered after them on the stream).
                    let kv = unsafe {
                        KvRows {
                            k: f32s(kstage.device_ptr(&stream).0, m * row),
                            v: f32s(src.v.device_ptr(&stream).0 + (at * row * 4) as u64, m * row),
                            rows: m,
                        }
                    };
                    cache.append(&batch, l, &kv)?;
                }
                done += m;
            }
        }
        let steps = c.warmup + 2 * c.steps;
        let (hq, row) = (hkv * g, b * hkv * g * d);
        let mut qs = Vec::with_capacity(steps * layers * row);
        for step in 0..steps {
            for l in 0..layers {
                for sb in 0..b {
                    qs.extend(sources[l % sources.len()].queries(step * b + sb));
                }
            }
        }
        let alloc = |n: usize| stream.alloc_zeros::<f32>(n).map_err(drv("alloc"));
        let p = Prepared {
            qbuf: stream.clone_htod(&qs).map_err(drv("upload queries"))?,
            qfix: alloc(layers * row)?,
            newk: alloc(layers * b * hkv * d)?,
            newv: alloc(layers * b * hkv * d)?,
            out: alloc(b * hq * d)?,
            params: SelectParams {
                sink: 4,
                local: 32,
                k: cfg.max_k,
            },
            cache,
            stream,
            ids,
        };
        p.stream.synchronize().map_err(drv("synchronize"))?;
        progress(&format!("  set up in {:.1}s", t0.elapsed().as_secs_f64()));
        Ok(p)
    }

    /// The step's new token of each session, per layer: its source's next row (the key tiled
    /// as in the prefill), into `newk` and `newv`.
    fn upload_step(
        &mut self,
        sources: &[LayerSource],
        dev: &[DeviceSource],
        batch: &fathom_cuda::cache::AppendBatch,
    ) -> Result<()> {
        let s = self.cache.config().shape;
        let (layers, kv_row, b) = (s.layers, s.kv_heads * s.dim, batch.plans.len());
        let mut keys = Vec::with_capacity(layers * b * kv_row);
        for l in 0..layers {
            for p in &batch.plans {
                keys.extend(sources[l % sources.len()].tiled_keys(l, p.first_token, 1));
            }
        }
        let st = self.stream.clone();
        st.memcpy_htod(&keys, &mut self.newk)
            .map_err(drv("upload new keys"))?;
        let vp = self.newv.device_ptr(&st).0;
        for l in 0..layers {
            let src = &dev[l % dev.len()];
            for (sb, p) in batch.plans.iter().enumerate() {
                let bytes = kv_row * 4;
                let dst = ((l * b + sb) * bytes) as u64;
                let so = ((p.first_token % src.n0) * bytes) as u64;
                // SAFETY: both ranges lie inside their device buffers.
                unsafe {
                    result::memcpy_dtod_async(
                        vp + dst,
                        src.v.device_ptr(&st).0 + so,
                        bytes,
                        st.cu_stream(),
                    )
                    .map_err(drv("memcpy_dtod new value"))?;
                }
            }
        }
        Ok(())
    }
}

/// The device buffers one bench decode step reads and writes: every layer's new K and V
/// (`[layer][session][Hkv][D]` f32, `kv_row` = Hkv·D floats per session), the queries
/// (`q0`, then `[layer][session][Hq][D]`) and the output rows.
struct StepIo {
    k: u64,
    v: u64,
    q0: u64,
    out: u64,
    layers: usize,
    sessions: usize,
    kv_row: usize,
    q_row: usize,
}

/// One decode step's launches on `cache`, the same whether run or captured: per layer, the
/// append of the step's new K/V, then the attend of its queries; `mark` runs just before and
/// just after each append (where the appends' timing puts its events).
fn launch_step(
    cache: &mut PagedCache,
    batch: &fathom_cuda::cache::AppendBatch,
    io: &StepIo,
    method: AttendMethod,
    params: &SelectParams,
    mut mark: impl FnMut() -> Result<()>,
) -> Result<()> {
    let n = io.sessions * io.kv_row;
    for l in 0..io.layers {
        let off = ((l * n) * 4) as u64;
        // SAFETY: the bench's buffers (`Prepared`) hold every layer's rows and queries and the
        // output, live for the step (and for every replay of a captured one).
        let (kv, q, out) = unsafe {
            (
                KvRows {
                    k: f32s(io.k + off, n),
                    v: f32s(io.v + off, n),
                    rows: io.sessions,
                },
                QueryRows {
                    q: f32s(io.q0 + (l * io.q_row * 4) as u64, io.q_row),
                },
                DeviceViewMut::from_raw(io.out, io.q_row, KvDtype::F32),
            )
        };
        mark()?;
        cache.append(batch, l, &kv)?;
        mark()?;
        cache.attend(batch, l, method, params, &q, out)?;
    }
    Ok(())
}

/// Times `m` on `p`'s cache: warm-up steps, timed steps (each replaying one captured step
/// with `as_graph`), then as many plain steps again with each append timed by its own event
/// pair (and, with stage timing, each attend split by stage).
pub(super) fn time_method(
    p: &mut Prepared,
    c: &BenchConfig,
    sources: &[LayerSource],
    dev: &[DeviceSource],
    m: Method,
    as_graph: bool,
) -> Result<Timing> {
    let s = p.cache.config().shape;
    let (layers, b) = (s.layers, p.ids.len());
    let row = b * s.kv_heads * s.group * s.dim;
    let steps = c.warmup + 2 * c.steps;
    let am = AttendMethod::Scan(m);
    for &sid in &p.ids {
        p.cache.reset_row_cache(sid)?;
    }
    let (bits0, plans0) = p.cache.plan_bits()?;
    let rows0 = p.cache.row_counters()?;
    let gather0 = p.cache.host_gather_stats()?;
    let (mut sel0, mut sel1) = (p.cache.select_counters()?, p.cache.select_counters()?);
    let mut t = Timing {
        bits: 0.0,
        union: 0.0,
        hits: 0.0,
        gpu_ms: Vec::new(),
        wall_ms: Vec::new(),
        append_ms: Vec::new(),
        stages: Vec::new(),
        stage_steps_ms: Vec::new(),
        filtered: (0, 0),
        gather: None,
    };
    let st = p.stream.clone();
    let qp = p.qbuf.device_ptr(&st).0;
    let qf = p.qfix.device_ptr(&st).0;
    let (kp, vp, op) = (
        p.newk.device_ptr(&st).0,
        p.newv.device_ptr(&st).0,
        p.out.device_ptr(&st).0,
    );
    let io = |q0: u64| StepIo {
        k: kp,
        v: vp,
        q0,
        out: op,
        layers,
        sessions: b,
        kv_row: s.kv_heads * s.dim,
        q_row: row,
    };
    let (io_fixed, ev) = (io(qf), |s: &CudaStream| {
        s.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("record event"))
    });
    let decode: Vec<(SessionId, usize)> = p.ids.iter().map(|&s| (s, 1)).collect();
    let timed_end = c.warmup + c.steps;
    let mut graph: Option<fathom_cuda::DecodeGraph> = None;
    for step in 0..steps {
        // After the timed steps: an event pair around each append, summed per step.
        let time_appends = step >= timed_end;
        if step == timed_end {
            // The stage split covers the steps from here on, not the timed ones before.
            p.cache.stage_times()?;
        }
        let w0 = std::time::Instant::now();
        let batch = p.cache.reserve(&decode)?;
        p.upload_step(sources, dev, &batch)?;
        let q0 = qp + ((step * layers * row) * 4) as u64;
        let replayed = as_graph && !time_appends;
        if replayed {
            // SAFETY: both ranges lie inside their device buffers (`layers · row` f32).
            unsafe {
                result::memcpy_dtod_async(qf, q0, layers * row * 4, st.cu_stream())
                    .map_err(drv("memcpy_dtod step queries"))?;
            }
            if graph.is_none() {
                let params = p.params;
                graph = Some(p.cache.capture(&batch, |cache| {
                    launch_step(cache, &batch, &io_fixed, am, &params, || Ok(()))
                })?);
            }
        }
        let e0 = ev(&st)?;
        let mut append_events = Vec::new();
        if let (true, Some(g)) = (replayed, &graph) {
            p.cache.replay(&batch, g)?;
        } else {
            let params = p.params;
            launch_step(&mut p.cache, &batch, &io(q0), am, &params, || {
                if time_appends {
                    append_events.push(ev(&st)?);
                }
                Ok(())
            })?;
        }
        let e1 = ev(&st)?;
        e1.synchronize().map_err(drv("event synchronize"))?;
        if step + 1 == c.warmup {
            // The filtered select's counts cover the timed steps only (each row's first
            // attend after the reset is on the score path by design).
            sel0 = p.cache.select_counters()?;
        }
        if step + 1 == timed_end {
            sel1 = p.cache.select_counters()?;
        }
        if time_appends {
            let mut ms = 0.0;
            for pair in append_events.chunks_exact(2) {
                ms += pair[0].elapsed_ms(&pair[1]).map_err(drv("elapsed"))? as f64;
            }
            t.append_ms.push(ms);
            let split = p.cache.stage_times()?;
            if split.untimed == 0 && split.attends > 0 {
                t.stages.push(split);
                t.stage_steps_ms
                    .push(e0.elapsed_ms(&e1).map_err(drv("elapsed"))? as f64);
            }
        } else if step >= c.warmup {
            t.gpu_ms
                .push(e0.elapsed_ms(&e1).map_err(drv("elapsed"))? as f64);
            t.wall_ms.push(w0.elapsed().as_secs_f64() * 1e3);
        }
    }
    let (bits1, plans1) = p.cache.plan_bits()?;
    let rows1 = p.cache.row_counters()?;
    t.bits = if plans1 > plans0 {
        (bits1 * plans1 as f64 - bits0 * plans0 as f64) / (plans1 - plans0) as f64
    } else {
        m.bits(s.dim) as f64
    };
    t.union = (rows1.rows - rows0.rows) as f64 / steps as f64;
    t.hits = (rows1.hits - rows0.hits) as f64 / steps as f64;
    t.filtered = (
        sel1.filtered - sel0.filtered,
        sel1.fallbacks - sel0.fallbacks,
    );
    if let (Some(a), Some(z)) = (gather0, p.cache.host_gather_stats()?) {
        let delta = z.since(&a);
        if delta.faults > 0 {
            return Err(invalid(
                "host gather",
                format!("faults during {}: {z:?}", m.label()),
            ));
        }
        t.gather = Some(delta);
    }
    Ok(t)
}

/// The result entry of one timed method of `c` (`what`: the run's lengths, residency, k and the
/// method; `at`: its round and launch mode).
pub(super) fn entry(
    rep: &OffloadBench,
    c: &BenchConfig,
    p: &Prepared,
    t: Timing,
    what: (&[usize], Residency, usize, Method),
    at: (usize, bool),
) -> BenchResult {
    let (lens, residency, k, m) = what;
    let cfg = p.cache.config();
    let o = cfg.options;
    let mut r = result(
        rep, cfg.shape, lens, residency, k, m, t.bits, t.union, t.hits, t.gpu_ms, t.wall_ms,
    );
    r.append_ms = (!t.append_ms.is_empty()).then(|| median(&t.append_ms));
    if !t.stages.is_empty() {
        // Median per stage over the split steps (each step's sum over its layers).
        for (i, name) in AttendStages::NAMES.iter().enumerate() {
            let v: Vec<f64> = t.stages.iter().map(|st| st.values()[i]).collect();
            r.stage_ms.insert((*name).to_string(), median(&v));
        }
        // The plan's share of the split steps' GPU time (with the queries' conversion, part of
        // the plan stage).
        let total = median(&t.stage_steps_ms);
        if total > 0.0 {
            r.planner_share = r.stage_ms["plan"] / total;
        }
    }
    r.select = o.select.label();
    r.groups = o.attend_groups;
    r.scan_vector_words = o.scan_vector_words;
    (r.round, r.graph) = at;
    r.host_gather = o.host_gather_threads;
    r.host_gather_share = o.host_gather_share;
    if let Some(delta) = t.gather {
        // Per attend: the wall time from the request to its last mark, and the records one
        // thread copies per second.
        r.host_gather_request_us = delta.request_us;
        r.host_gather_mrows_per_thread_s = delta.mrows_per_thread_s;
    }
    if o.select != fathom_cuda::cache::SelectPath::Scores {
        let (filtered, fallbacks) = t.filtered;
        let s = cfg.shape;
        let rows = (c.steps * s.layers * lens.len() * s.kv_heads * s.group) as f64;
        r.filtered_share = Some(filtered as f64 / rows.max(1.0));
        r.fallback_rate = Some(if filtered + fallbacks == 0 {
            0.0
        } else {
            fallbacks as f64 / (filtered + fallbacks) as f64
        });
    }
    r
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
