//! The offload benchmark's decode step (docs/SPEC.md §6): a `Session` holds every layer's
//! store, tables and rows (filled from its sources by `crate::step_layout`) and its working
//! buffers, and `run_step` launches plan, gather, scan, top-k, row gather and attention.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, CudaStream, PushKernelArg};
use half::bf16;

use super::device::{gather_grid, GATHER_CHUNK, GATHER_THREADS};
use super::{cfg, drv, DevBuf, Event, Gpu, Kernels, Mem};
use crate::config::{Method, Residency, SessionConfig, STEP_LOCAL, STEP_SINK};
use crate::error::{CudaError, Result};
use crate::step_layout::{fill_records, fill_store, fill_table, static_plan};
use crate::synth::LayerSource;
use crate::types::{LayerDebug, SessionLayout, StepStats};

/// Elements per CTA of the streaming top-k passes (`ELEMS` in topk.cu).
const TOPK_ELEMS: u64 = 4096;
/// Rows per CTA of the attention kernel (`CH` in attention.cu).
const ATTN_CHUNK: usize = 64;
/// Level-1 histogram bins of the top-k (`HBINS` in topk.cu and scan.cu).
const HBINS: usize = 1024;

// ---------------------------------------------------------------------------------------------
// The session

struct StaticPlan {
    depths: DevBuf, // [L][H][D] u8
    runs: DevBuf,   // [L][nruns] Run
    nruns: usize,
    max_len: u64,
    bits: f64,
}

impl std::fmt::Debug for StaticPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaticPlan")
            .field("nruns", &self.nruns)
            .field("bits", &self.bits)
            .finish()
    }
}

/// What the plan stage leaves for the gather and the scan: the depths, the run list, runs per
/// head and the longest run.
struct PlanOut {
    depths: u64,
    runs: u64,
    runs_per_head: usize,
    max_len: u64,
}

/// Where a layer's scan reads: the staging (host residency) or the store itself, and the
/// bytes per head of a landmark or Quest table.
struct ScanSource {
    base: u64,
    table_head_bytes: u64,
}

/// The device pointers of one head group's working buffers (first KV head `h0`, `hg` heads,
/// `rg` query-head rows).
struct Group {
    h0: u64,
    hg: u32,
    rg: u32,
    q: u64,
    scores: u64,
    hist: u64,
    sel: u64,
    win: u64,
    wcount: u64,
    ccount: u64,
    tcount: u64,
    ckey: u64,
    cidx: u64,
    ccap: u64,
    ucount: u64,
    ulist: u64,
    stamp: u64,
    gathered: u64,
    /// This group's K|V records.
    rows: u64,
    /// Row-cache tags, data and claims of this group (zeros: no cache).
    cache: (u64, u64, u64),
    pm: u64,
    pl: u64,
    pacc: u64,
    out: u64,
}

/// One decode session: the store, tables and rows of every layer (host-pinned or in HBM),
/// and every working buffer of the step, allocated once.
pub struct Session {
    stream: Arc<CudaStream>,
    copy_stream: Arc<CudaStream>,
    ev_plan: Event,
    ev_gather: Vec<Event>,
    groups: usize,
    gather_ctas: usize,
    k: Arc<Kernels>,
    cfg: SessionConfig,
    n: usize,
    nb: usize,
    layout: SessionLayout,
    stores: Vec<Mem>,
    landmark: Vec<Mem>,
    quest: Vec<Mem>,
    rows: Vec<Mem>,
    sigma2: DevBuf,
    queries: DevBuf,
    staging: DevBuf,
    scores: DevBuf,
    hist: DevBuf,
    sel: DevBuf,
    win: DevBuf,
    wcount: DevBuf,
    cand_key: DevBuf,
    cand_idx: DevBuf,
    ccount: DevBuf,
    tcount: DevBuf,
    stamp: DevBuf,
    ulist: DevBuf,
    ucount: DevBuf,
    gathered: DevBuf,
    pm: DevBuf,
    pl: DevBuf,
    pacc: DevBuf,
    out: DevBuf,
    depths: DevBuf,
    bits: DevBuf,
    runs: DevBuf,
    counters: DevBuf, // [0] hits u32, [1] union rows u32, [2] bits_acc f32
    cache_tags: Option<DevBuf>,
    cache_data: Option<DevBuf>,
    cache_claim: Option<DevBuf>,
    statics: HashMap<String, StaticPlan>,
    tag: u32,
    stamp_ctr: u64,
    nsplit: usize,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("cfg", &self.cfg)
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Allocates and fills the session: the store of every layer (tiled from `sources`,
    /// layer `l` from `sources[l mod len]`), the landmark/Quest tables if asked, the K/V
    /// records of as many layers as `row_bytes_budget` allows (reused cyclically), static
    /// plans for `methods`, the HBM row cache and every working buffer.
    ///
    /// # Errors
    /// Allocation failures (with sizes), compile errors, or inconsistent sources.
    pub fn new(
        gpu: &Gpu,
        cfg: &SessionConfig,
        sources: &[LayerSource],
        methods: &[Method],
    ) -> Result<Self> {
        let t0 = Instant::now();
        let shape = cfg.shape.validate()?;
        let (hn, g, d, l_n) = (shape.kv_heads, shape.group, shape.dim, shape.layers);
        if sources.is_empty() {
            return Err(CudaError::invalid("sources", "no source layers"));
        }
        let n0 = sources[0].params().tokens;
        for s in sources {
            let p = s.params();
            if (p.heads, p.group, p.dim, p.tokens) != (hn, g, d, n0) {
                return Err(CudaError::invalid(
                    "sources",
                    "source shapes differ from the session shape",
                ));
            }
        }
        if n0 % 64 != 0 && cfg.context != n0 {
            return Err(CudaError::invalid(
                "sources",
                format!("base tokens {n0} must be a multiple of 64 to tile"),
            ));
        }
        let n = cfg.context;
        if n == 0 || n > u32::MAX as usize || cfg.k == 0 {
            return Err(CudaError::invalid(
                "context",
                format!("n = {n}, k = {}", cfg.k),
            ));
        }
        let nb = n.div_ceil(64);
        let k = gpu.kernels(g, d)?;
        let rec = shape.record_bytes();
        let store_bytes = hn * d * nb * (32 + 2);
        let lm_bytes = hn * n.div_ceil(8) * d * 2;
        let quest_bytes = hn * n.div_ceil(16) * 2 * d * 2;
        let row_layer_bytes = hn * n * rec;

        let mut stores = Vec::with_capacity(l_n);
        let mut landmark = Vec::new();
        let mut quest = Vec::new();
        for l in 0..l_n {
            let src = &sources[l % sources.len()];
            stores.push(Mem::filled(
                cfg.residency,
                store_bytes,
                "scan store",
                |b| fill_store(b, src, nb, l),
            )?);
        }
        let recs: Vec<Vec<bf16>> = sources.iter().map(|s| s.records()).collect();
        if cfg.tables {
            for l in 0..l_n {
                let r = &recs[l % sources.len()];
                landmark.push(Mem::filled(
                    cfg.residency,
                    lm_bytes,
                    "landmark table",
                    |b| fill_table(b, r, hn, d, n0, n, false, l),
                )?);
                quest.push(Mem::filled(
                    cfg.residency,
                    quest_bytes,
                    "quest table",
                    |b| fill_table(b, r, hn, d, n0, n, true, l),
                )?);
            }
        }
        let row_layers = ((cfg.row_bytes_budget / row_layer_bytes as u64) as usize).clamp(1, l_n);
        let mut rows = Vec::with_capacity(row_layers);
        for l in 0..row_layers {
            let r = &recs[l % sources.len()];
            rows.push(Mem::filled(
                cfg.residency,
                row_layer_bytes,
                "K/V records",
                |b| fill_records(b, r, hn, n0, n, rec),
            )?);
        }

        let mut sigma2 = Vec::with_capacity(l_n * hn * d);
        for l in 0..l_n {
            sigma2.extend_from_slice(&sources[l % sources.len()].sigma2);
        }
        let steps = cfg.steps.max(1);
        let mut q = Vec::with_capacity(steps * l_n * hn * g * d);
        for s in 0..steps {
            for l in 0..l_n {
                q.extend(sources[l % sources.len()].queries(s));
            }
        }
        let r_n = hn * g;
        let umax = cfg.union_max();
        let nsplit = umax.div_ceil(ATTN_CHUNK);
        let mid = n.saturating_sub(STEP_SINK + STEP_LOCAL).max(1);
        let staging_bytes = if cfg.residency == Residency::Host {
            store_bytes.max(if cfg.tables {
                lm_bytes.max(quest_bytes)
            } else {
                0
            })
        } else {
            16
        };
        let (cache_tags, cache_data, cache_claim) =
            if cfg.cache_rows > 0 && cfg.residency == Residency::Host {
                let slots = l_n * hn * cfg.cache_rows;
                (
                    Some(DevBuf::zeroed(slots * 4, "row cache tags")?),
                    Some(DevBuf::new(slots * rec, "row cache data")?),
                    Some(DevBuf::zeroed(slots * 8, "row cache claims")?),
                )
            } else {
                (None, None, None)
            };

        let mut statics = HashMap::new();
        for m in methods {
            if let Some(sp) = static_plan(m, sources, &shape, nb, n) {
                statics.insert(
                    m.label(),
                    StaticPlan {
                        depths: DevBuf::from_slice(&sp.depths, "static depths")?,
                        runs: DevBuf::from_slice(&sp.runs, "static runs")?,
                        nruns: sp.nruns,
                        max_len: sp.max_len,
                        bits: sp.bits,
                    },
                );
            }
        }

        let layout = SessionLayout {
            source_layers: sources.len().min(l_n),
            source_tokens: n0,
            row_layers,
            store_bytes: (store_bytes * l_n) as u64,
            table_bytes: if cfg.tables {
                ((lm_bytes + quest_bytes) * l_n) as u64
            } else {
                0
            },
            row_bytes: (row_layer_bytes * row_layers) as u64,
            cache_bytes: cache_data.as_ref().map_or(0, |c| c.bytes as u64),
            setup_s: 0.0,
        };
        let mut s = Session {
            stream: gpu.stream.clone(),
            copy_stream: gpu.copy_stream.clone(),
            ev_plan: Event::sync_only()?,
            ev_gather: (0..hn).map(|_| Event::sync_only()).collect::<Result<_>>()?,
            groups: cfg.pipeline_groups(),
            gather_ctas: cfg.gather_cap(),
            k,
            cfg: cfg.clone(),
            n,
            nb,
            layout,
            stores,
            landmark,
            quest,
            rows,
            sigma2: DevBuf::from_slice(&sigma2, "sigma2")?,
            queries: DevBuf::from_slice(&q, "queries")?,
            staging: DevBuf::new(staging_bytes, "HBM staging")?,
            scores: DevBuf::new(r_n * n * 4, "scores")?,
            hist: DevBuf::new(r_n * HBINS * 4, "top-k histogram")?,
            sel: DevBuf::new(r_n * 8, "top-k selection")?,
            win: DevBuf::new(r_n * cfg.k * 4, "winners")?,
            wcount: DevBuf::zeroed(r_n * 4, "winner counts")?,
            cand_key: DevBuf::new(r_n * mid * 4, "top-k candidate keys")?,
            cand_idx: DevBuf::new(r_n * mid * 4, "top-k candidate indices")?,
            ccount: DevBuf::zeroed(r_n * 4, "candidate counts")?,
            tcount: DevBuf::zeroed(r_n * 4, "tie counts")?,
            stamp: DevBuf::zeroed(hn * n * 4, "union stamps")?,
            ulist: DevBuf::new(hn * umax * 4, "union lists")?,
            ucount: DevBuf::zeroed(hn * 4, "union counts")?,
            gathered: DevBuf::new(hn * umax * rec, "gathered rows")?,
            pm: DevBuf::new(hn * nsplit * g * 4, "attention partial max")?,
            pl: DevBuf::new(hn * nsplit * g * 4, "attention partial sum")?,
            pacc: DevBuf::new(hn * nsplit * g * d * 4, "attention partial output")?,
            out: DevBuf::new(hn * g * d * 4, "attention output")?,
            depths: DevBuf::zeroed(hn * d, "depths")?,
            bits: DevBuf::zeroed(hn * 4, "plan bits")?,
            runs: DevBuf::zeroed(2 * hn * d * 16, "run list")?,
            counters: DevBuf::zeroed(16, "counters")?,
            cache_tags,
            cache_data,
            cache_claim,
            statics,
            tag: 0,
            stamp_ctr: 0,
            nsplit,
        };
        s.layout.setup_s = t0.elapsed().as_secs_f64();
        Ok(s)
    }

    /// Where the data lives.
    pub fn layout(&self) -> &SessionLayout {
        &self.layout
    }

    /// Empties the HBM row cache (between methods, so none reuses another's rows).
    ///
    /// # Errors
    /// Driver failures.
    pub fn reset_cache(&mut self) -> Result<()> {
        if let Some(t) = &self.cache_tags {
            self.memset(t.ptr, t.bytes)?;
            self.stream.synchronize().map_err(drv("synchronize"))?;
        }
        Ok(())
    }

    /// Changes the host-residency pipelining of later steps: `groups` head groups per layer
    /// and at most `gather_ctas` CTAs per gather launch (0 = auto for both, see
    /// [`SessionConfig::groups`] and [`SessionConfig::gather_ctas`]). Results do not change,
    /// only timing.
    pub fn set_pipeline(&mut self, groups: usize, gather_ctas: usize) {
        self.cfg.groups = groups;
        self.cfg.gather_ctas = gather_ctas;
        self.groups = self.cfg.pipeline_groups();
        self.gather_ctas = self.cfg.gather_cap();
    }

    /// Runs one decode step (every layer, in order, no host synchronisation inside) with the
    /// queries of `step`, and reports its GPU time, wall-clock and counters. With
    /// `instrument`, an event pair brackets every stage of every layer (per-stage times).
    ///
    /// # Errors
    /// Driver failures, or a method without the tables/plan it needs.
    pub fn run_step(&mut self, method: Method, step: usize, instrument: bool) -> Result<StepStats> {
        let l_n = self.cfg.shape.layers;
        self.memset(self.counters.ptr, 16)?;
        let begin = Event::new()?;
        let end = Event::new()?;
        let stage_events: Vec<Event> = if instrument {
            (0..l_n * 7).map(|_| Event::new()).collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        let t0 = Instant::now();
        begin.record(&self.stream)?;
        for l in 0..l_n {
            let ev = if instrument {
                Some(&stage_events[l * 7..(l + 1) * 7])
            } else {
                None
            };
            self.launch_layer(method, l, step, ev)?;
        }
        end.record(&self.stream)?;
        self.stream.synchronize().map_err(drv("synchronize"))?;
        let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
        let gpu_ms = begin.elapsed_ms(&end)?;
        let stage_ms = if instrument {
            let mut s = [0f64; 6];
            for l in 0..l_n {
                for (i, x) in s.iter_mut().enumerate() {
                    *x += stage_events[l * 7 + i].elapsed_ms(&stage_events[l * 7 + i + 1])?;
                }
            }
            Some(s)
        } else {
            None
        };
        let c: Vec<u32> = self.counters.read(4)?;
        let bits = match method {
            Method::Fathom(_) => {
                f32::from_bits(c[2]) as f64 / (l_n * self.cfg.shape.kv_heads) as f64
            }
            m => self
                .statics
                .get(&m.label())
                .map_or(m.bits(self.cfg.shape.dim) as f64, |s| s.bits),
        };
        Ok(StepStats {
            gpu_ms,
            wall_ms,
            stage_ms,
            union_rows: c[1] as u64,
            cache_hits: c[0] as u64,
            bits,
        })
    }

    /// Runs layer `layer`'s step with the queries of `step` and reads back every
    /// intermediate (for the correctness tests).
    ///
    /// # Errors
    /// As [`Session::run_step`].
    pub fn layer_debug(&mut self, method: Method, layer: usize, step: usize) -> Result<LayerDebug> {
        let (hn, g, d) = (
            self.cfg.shape.kv_heads,
            self.cfg.shape.group,
            self.cfg.shape.dim,
        );
        let (n, kk, umax) = (self.n, self.cfg.k, self.cfg.union_max());
        self.memset(self.counters.ptr, 16)?;
        self.launch_layer(method, layer, step, None)?;
        self.stream.synchronize().map_err(drv("synchronize"))?;
        let r_n = hn * g;
        let depths: Vec<u8> = self.depths.read(hn * d)?;
        let bits: Vec<f32> = self.bits.read(hn)?;
        let scores: Vec<f32> = self.scores.read(r_n * n)?;
        let wc: Vec<u32> = self.wcount.read(r_n)?;
        let win: Vec<u32> = self.win.read(r_n * kk)?;
        let winners = (0..r_n)
            .map(|r| {
                let mut v = win[r * kk..r * kk + (wc[r] as usize).min(kk)].to_vec();
                v.sort_unstable();
                v
            })
            .collect();
        let uc: Vec<u32> = self.ucount.read(hn)?;
        let ul: Vec<u32> = self.ulist.read(hn * umax)?;
        let unions = (0..hn)
            .map(|h| {
                let mut v = ul[h * umax..h * umax + (uc[h] as usize).min(umax)].to_vec();
                v.sort_unstable();
                v
            })
            .collect();
        let out: Vec<f32> = self.out.read(hn * g * d)?;
        Ok(LayerDebug {
            depths,
            bits,
            scores,
            winners,
            unions,
            out,
        })
    }

    fn memset(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: callers pass a live device allocation of at least `bytes` bytes.
        unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }
            .map_err(drv("memset"))
    }

    /// Enqueues one layer's step, one function per stage (docs/SPEC.md §6 step order):
    /// [`Session::plan_stage`], [`Session::gather_stage`], then per head group
    /// [`Session::scan_stage`], [`Session::topk_stage`], [`Session::rows_stage`] and
    /// [`Session::attention_stage`]. `ev`, if given, holds 7 events recorded at the stage
    /// boundaries; the layer then runs as one head group so that stages do not overlap.
    /// Otherwise (host residency) the KV heads are split into `groups` head groups: the copy
    /// stream gathers group after group over PCIe while the compute stream scans, selects,
    /// fetches rows and attends for the groups already gathered (no host synchronisation).
    fn launch_layer(
        &mut self,
        method: Method,
        l: usize,
        step: usize,
        ev: Option<&[Event]>,
    ) -> Result<()> {
        let sh = self.cfg.shape;
        let (hn, g, d) = (sh.kv_heads, sh.group, sh.dim);
        let host = self.cfg.residency == Residency::Host;
        let steps = self.cfg.steps.max(1);
        let qbase = self.queries.ptr + (((step % steps) * sh.layers + l) * hn * g * d * 4) as u64;
        let groups = if ev.is_some() || !host {
            1
        } else {
            self.groups.clamp(1, hn)
        };
        let st = self.stream.clone();
        let mark = |i: usize| -> Result<()> {
            if let Some(e) = ev {
                e[i].record(&st)?;
            }
            Ok(())
        };
        mark(0)?;
        let plan = self.plan_stage(method, l, qbase)?;
        mark(1)?;
        let hpg = hn.div_ceil(groups);
        let ranges: Vec<(usize, usize)> = (0..hn)
            .step_by(hpg)
            .map(|h0| (h0, (h0 + hpg).min(hn)))
            .collect();
        let src = self.gather_stage(method, l, &plan, &ranges)?;
        mark(2)?;
        self.tag = self.tag.wrapping_add(1).max(1);
        self.stamp_ctr += 1;
        for (i, &(h0, h1)) in ranges.iter().enumerate() {
            if ranges.len() > 1 {
                self.ev_gather[i].wait_on(&st)?;
            }
            let grp = self.group(l, h0, h1, qbase);
            self.scan_stage(method, &plan, &src, &grp)?;
            mark(3)?;
            self.topk_stage(method, &grp)?;
            mark(4)?;
            self.rows_stage(&grp)?;
            mark(5)?;
            self.attention_stage(&grp)?;
            mark(6)?;
        }
        Ok(())
    }

    /// Stage 1, the plan (all heads at once): Fathom's water-filling or SparQ's rule on the
    /// GPU, or a static plan's depths and runs.
    fn plan_stage(&self, method: Method, l: usize, qbase: u64) -> Result<PlanOut> {
        let sh = self.cfg.shape;
        let (hn, d) = (sh.kv_heads, sh.dim);
        let nb = self.nb as u64;
        let heads = hn as i32;
        let (k, st) = (&self.k, &self.stream);
        let bits_acc = self.counters.ptr + 8;
        Ok(match method {
            Method::Fathom(budget) => {
                let sig = self.sigma2.ptr + (l * hn * d * 4) as u64;
                let steps_i = fathom_plan::waterfill::BISECTION_STEPS as i32;
                let mut b = st.launch_builder(&k.fathom_plan);
                b.arg(&qbase)
                    .arg(&sig)
                    .arg(&budget)
                    .arg(&steps_i)
                    .arg(&heads)
                    .arg(&nb)
                    .arg(&self.depths.ptr)
                    .arg(&self.bits.ptr)
                    .arg(&self.runs.ptr)
                    .arg(&bits_acc);
                // SAFETY: q [H][G][D], sigma2 [H][D], depths [H][D], bits [H], runs [H][2D] are
                // allocated at those sizes; one warp per head.
                unsafe { b.launch(cfg((hn as u32, 1, 1), 32)) }
                    .map_err(drv("launch fathom_plan"))?;
                PlanOut {
                    depths: self.depths.ptr,
                    runs: self.runs.ptr,
                    runs_per_head: 2 * d,
                    max_len: 4 * nb * 8,
                }
            }
            Method::SparQ(r) => {
                let r = r as i32;
                let mut b = st.launch_builder(&k.sparq_plan);
                b.arg(&qbase)
                    .arg(&r)
                    .arg(&heads)
                    .arg(&nb)
                    .arg(&self.depths.ptr)
                    .arg(&self.bits.ptr)
                    .arg(&self.runs.ptr)
                    .arg(&bits_acc);
                // SAFETY: as for fathom_plan; one CTA of D threads per head.
                unsafe { b.launch(cfg((hn as u32, 1, 1), d as u32)) }
                    .map_err(drv("launch sparq_plan"))?;
                PlanOut {
                    depths: self.depths.ptr,
                    runs: self.runs.ptr,
                    runs_per_head: 2 * d,
                    max_len: 4 * nb * 8,
                }
            }
            m => {
                let sp = self.statics.get(&m.label()).ok_or_else(|| {
                    CudaError::invalid(
                        "method",
                        format!("{} was not prepared for this session", m.label()),
                    )
                })?;
                let dp = sp.depths.ptr + (l * hn * d) as u64;
                let rp = sp.runs.ptr + (l * sp.nruns * 16) as u64;
                if m.uses_planes() {
                    // Debug readback and scans read the session's depth buffer.
                    // SAFETY: both buffers hold H·D bytes.
                    unsafe {
                        result::memcpy_dtod_async(self.depths.ptr, dp, hn * d, st.cu_stream())
                    }
                    .map_err(drv("memcpy_dtod"))?;
                }
                PlanOut {
                    depths: self.depths.ptr,
                    runs: rp,
                    runs_per_head: sp.nruns / hn,
                    max_len: sp.max_len,
                }
            }
        })
    }

    /// Stage 2, the gather (host residency): the planned runs of each head group into HBM
    /// staging at the same offsets, on the copy stream when pipelined. Returns where the scan
    /// reads from.
    fn gather_stage(
        &self,
        method: Method,
        l: usize,
        plan: &PlanOut,
        ranges: &[(usize, usize)],
    ) -> Result<ScanSource> {
        let sh = self.cfg.shape;
        let (n, d) = (self.n as u64, sh.dim as u64);
        let host = self.cfg.residency == Residency::Host;
        let (src_base, table_head_bytes) = match method {
            Method::Landmark => (self.landmark.get(l).map(Mem::dptr), n.div_ceil(8) * d * 2),
            Method::Quest => (self.quest.get(l).map(Mem::dptr), n.div_ceil(16) * 2 * d * 2),
            _ => (Some(self.stores[l].dptr()), 0),
        };
        let src_base = src_base.ok_or_else(|| {
            CudaError::invalid("method", "landmark/quest need a session built with tables")
        })?;
        let base = if host { self.staging.ptr } else { src_base };
        if host {
            let (st, cs) = (&self.stream, &self.copy_stream);
            let pipelined = ranges.len() > 1;
            let gs = if pipelined { cs } else { st };
            if pipelined {
                self.ev_plan.record(st)?;
                self.ev_plan.wait_on(cs)?;
            }
            for (i, &(h0, h1)) in ranges.iter().enumerate() {
                let chunks = plan.max_len.div_ceil(GATHER_CHUNK).max(1);
                let chunk = GATHER_CHUNK;
                let rp = plan.runs + (h0 * plan.runs_per_head * 16) as u64;
                let nr = ((h1 - h0) * plan.runs_per_head) as u64;
                let grid = gather_grid(nr * chunks, self.gather_ctas);
                let mut b = gs.launch_builder(&self.k.gather_runs);
                b.arg(&src_base)
                    .arg(&base)
                    .arg(&rp)
                    .arg(&chunk)
                    .arg(&nr)
                    .arg(&chunks);
                // SAFETY: every run lies inside the layer's source buffer and the staging
                // buffer (same layout, staging sized to the largest layer buffer).
                unsafe { b.launch(cfg((grid, 1, 1), GATHER_THREADS)) }
                    .map_err(drv("launch gather_runs"))?;
                if pipelined {
                    self.ev_gather[i].record(cs)?;
                }
            }
        }
        Ok(ScanSource {
            base,
            table_head_bytes,
        })
    }

    /// The working pointers of KV heads `[h0, h1)` of layer `l`.
    fn group(&self, l: usize, h0: usize, h1: usize, qbase: u64) -> Group {
        let sh = self.cfg.shape;
        let (hn, g, d) = (sh.kv_heads, sh.group, sh.dim);
        let n = self.n as u64;
        let kk = self.cfg.k as u64;
        let umax = self.cfg.union_max() as u64;
        let rec = sh.record_bytes() as u64;
        let ccap = n.saturating_sub((STEP_SINK + STEP_LOCAL) as u64).max(1);
        let ns = self.nsplit as u64;
        let (h0u, hg) = (h0 as u64, (h1 - h0) as u32);
        let r0 = h0u * g as u64;
        let cache_rows = self.cfg.cache_rows as u64;
        let cache = match (&self.cache_tags, &self.cache_data, &self.cache_claim) {
            (Some(t), Some(c), Some(cl)) => {
                let slot0 = (l * hn) as u64 * cache_rows + h0u * cache_rows;
                (t.ptr + slot0 * 4, c.ptr + slot0 * rec, cl.ptr + slot0 * 8)
            }
            _ => (0, 0, 0),
        };
        Group {
            h0: h0u,
            hg,
            rg: hg * g as u32,
            q: qbase + h0u * (g * d * 4) as u64,
            scores: self.scores.ptr + r0 * n * 4,
            hist: self.hist.ptr + r0 * HBINS as u64 * 4,
            sel: self.sel.ptr + r0 * 8,
            win: self.win.ptr + r0 * kk * 4,
            wcount: self.wcount.ptr + r0 * 4,
            ccount: self.ccount.ptr + r0 * 4,
            tcount: self.tcount.ptr + r0 * 4,
            ckey: self.cand_key.ptr + r0 * ccap * 4,
            cidx: self.cand_idx.ptr + r0 * ccap * 4,
            ccap,
            ucount: self.ucount.ptr + h0u * 4,
            ulist: self.ulist.ptr + h0u * umax * 4,
            stamp: self.stamp.ptr + h0u * n * 4,
            gathered: self.gathered.ptr + h0u * umax * rec,
            rows: self.rows[l % self.rows.len()].dptr() + h0u * n * rec,
            cache,
            pm: self.pm.ptr + h0u * ns * g as u64 * 4,
            pl: self.pl.ptr + h0u * ns * g as u64 * 4,
            pacc: self.pacc.ptr + h0u * ns * (g * d) as u64 * 4,
            out: self.out.ptr + r0 * d as u64 * 4,
        }
    }

    /// Stage 3, the scan of one head group (the plane scan also builds the level-1 top-k
    /// histogram when G ≤ 8; the landmark and Quest scans read their fp16 tables).
    fn scan_stage(
        &self,
        method: Method,
        plan: &PlanOut,
        src: &ScanSource,
        grp: &Group,
    ) -> Result<()> {
        let sh = self.cfg.shape;
        let (hn, d) = (sh.kv_heads as u64, sh.dim as u64);
        let (n, nb) = (self.n as u64, self.nb as u64);
        let (k, st) = (&self.k, &self.stream);
        let (h0u, hg) = (grp.h0, grp.hg);
        self.memset(grp.hist, grp.rg as usize * HBINS * 4)?;
        match method {
            Method::Landmark | Method::Quest => {
                let span = if method == Method::Landmark { 8 } else { 16 };
                let ngroups = n.div_ceil(span);
                let table = src.base + h0u * src.table_head_bytes;
                let f = if method == Method::Landmark {
                    &k.scan_landmark
                } else {
                    &k.scan_quest
                };
                let mut b = st.launch_builder(f);
                b.arg(&table).arg(&n).arg(&grp.q).arg(&grp.scores);
                // SAFETY: the table holds [hg][ngroups] rows; scores [hg][G][n].
                unsafe { b.launch(cfg((ngroups.div_ceil(256) as u32, hg, 1), 256)) }
                    .map_err(drv("launch scan_table"))?;
            }
            _ => {
                let planes = src.base + h0u * d * 4 * nb * 8;
                let scales = src.base + hn * d * 4 * nb * 8 + h0u * d * nb * 2;
                let dp = plan.depths + h0u * d;
                let mut b = st.launch_builder(&k.scan_planes);
                b.arg(&planes)
                    .arg(&scales)
                    .arg(&nb)
                    .arg(&n)
                    .arg(&dp)
                    .arg(&grp.q)
                    .arg(&grp.scores)
                    .arg(&grp.hist);
                // SAFETY: planes/scales point at head h0 of a layer in the store layout for
                // nb blocks; scores [hg][G][n]; hist [hg·G][HBINS].
                unsafe { b.launch(cfg((nb.div_ceil(32) as u32, hg, 1), 256)) }
                    .map_err(drv("launch scan_planes"))?;
            }
        }
        Ok(())
    }

    /// Stage 4, the top-k per query head (level-1 histogram, boundary, one streaming pass,
    /// the exact boundary among the candidates) and the union per KV head.
    fn topk_stage(&self, method: Method, grp: &Group) -> Result<()> {
        let g = self.cfg.shape.group;
        let n = self.n as u64;
        let kk = self.cfg.k as u32;
        let umax = self.cfg.union_max() as u64;
        let (k, st) = (&self.k, &self.stream);
        let (hg, rg) = (grp.hg, grp.rg);
        let mid = n.saturating_sub((STEP_SINK + STEP_LOCAL) as u64).max(1);
        let chunks = mid.div_ceil(TOPK_ELEMS) as u32;
        if !(method.uses_planes() && g <= 8) {
            let mut b = st.launch_builder(&k.topk_hist);
            b.arg(&grp.scores).arg(&n).arg(&grp.hist);
            // SAFETY: scores [rg][n], hist [rg][HBINS].
            unsafe { b.launch(cfg((chunks, rg, 1), 256)) }.map_err(drv("launch topk_hist"))?;
        }
        let mut b = st.launch_builder(&k.topk_select);
        b.arg(&grp.hist)
            .arg(&kk)
            .arg(&grp.sel)
            .arg(&grp.wcount)
            .arg(&grp.ccount)
            .arg(&grp.tcount)
            .arg(&grp.ucount);
        // SAFETY: per-row buffers of rg entries, ucount [hg].
        unsafe { b.launch(cfg((rg, 1, 1), 1024)) }.map_err(drv("launch topk_select"))?;
        let mut b = st.launch_builder(&k.topk_collect);
        b.arg(&grp.scores)
            .arg(&n)
            .arg(&kk)
            .arg(&grp.sel)
            .arg(&grp.win)
            .arg(&grp.wcount)
            .arg(&grp.ckey)
            .arg(&grp.cidx)
            .arg(&grp.ccap)
            .arg(&grp.ccount);
        // SAFETY: win [rg][k], candidates [rg][ccap].
        unsafe { b.launch(cfg((chunks, rg, 1), 256)) }.map_err(drv("launch topk_collect"))?;
        let mut b = st.launch_builder(&k.topk_finish);
        b.arg(&grp.sel)
            .arg(&kk)
            .arg(&grp.ckey)
            .arg(&grp.cidx)
            .arg(&grp.ccap)
            .arg(&grp.ccount)
            .arg(&grp.win)
            .arg(&grp.wcount)
            .arg(&grp.tcount);
        // SAFETY: as topk_collect.
        unsafe { b.launch(cfg((rg, 1, 1), 1024)) }.map_err(drv("launch topk_finish"))?;
        let total = (g * self.cfg.k + STEP_SINK + STEP_LOCAL) as u64;
        let tag = self.tag;
        let mut b = st.launch_builder(&k.topk_union);
        b.arg(&grp.win)
            .arg(&grp.wcount)
            .arg(&kk)
            .arg(&n)
            .arg(&tag)
            .arg(&grp.stamp)
            .arg(&grp.ulist)
            .arg(&umax)
            .arg(&grp.ucount);
        // SAFETY: stamp [hg][n], ulist [hg][umax].
        unsafe { b.launch(cfg((total.div_ceil(256) as u32, hg, 1), 256)) }
            .map_err(drv("launch topk_union"))?;
        Ok(())
    }

    /// Stage 5, the row gather of one head group's union (the HBM row cache first), then the
    /// cache update.
    fn rows_stage(&self, grp: &Group) -> Result<()> {
        let n = self.n as u64;
        let umax = self.cfg.union_max() as u64;
        let (k, st) = (&self.k, &self.stream);
        let hg = grp.hg;
        let c_arg = (self.cfg.cache_rows as u64).max(1);
        let (hits, utot) = (self.counters.ptr, self.counters.ptr + 4);
        let (tags, cdata, claim) = grp.cache;
        let stamp = self.stamp_ctr;
        let mut b = st.launch_builder(&k.rows_gather);
        b.arg(&grp.rows)
            .arg(&n)
            .arg(&grp.ulist)
            .arg(&grp.ucount)
            .arg(&umax)
            .arg(&tags)
            .arg(&cdata)
            .arg(&c_arg)
            .arg(&grp.gathered)
            .arg(&hits)
            .arg(&utot);
        // SAFETY: records [hg][n][REC]; cache [hg][C]; gathered [hg][umax][REC].
        unsafe { b.launch(cfg((umax.div_ceil(8) as u32, hg, 1), 256)) }
            .map_err(drv("launch rows_gather"))?;
        if tags != 0 {
            let mut b = st.launch_builder(&k.rows_claim);
            b.arg(&grp.ulist)
                .arg(&grp.ucount)
                .arg(&umax)
                .arg(&tags)
                .arg(&c_arg)
                .arg(&claim)
                .arg(&stamp);
            // SAFETY: cache arrays of this group hold [hg][C] slots.
            unsafe { b.launch(cfg((umax.div_ceil(256) as u32, hg, 1), 256)) }
                .map_err(drv("launch rows_claim"))?;
            let mut b = st.launch_builder(&k.rows_fill);
            b.arg(&grp.ulist)
                .arg(&grp.ucount)
                .arg(&umax)
                .arg(&tags)
                .arg(&cdata)
                .arg(&c_arg)
                .arg(&claim)
                .arg(&stamp)
                .arg(&grp.gathered);
            // SAFETY: as rows_claim; gathered rows [hg][umax][REC].
            unsafe { b.launch(cfg((umax.div_ceil(8) as u32, hg, 1), 256)) }
                .map_err(drv("launch rows_fill"))?;
        }
        Ok(())
    }

    /// Stage 6, exact attention of one head group over its gathered rows (split, combined).
    fn attention_stage(&self, grp: &Group) -> Result<()> {
        let d = self.cfg.shape.dim;
        let umax = self.cfg.union_max() as u64;
        let (k, st) = (&self.k, &self.stream);
        let scale = 1.0f32 / (d as f32).sqrt();
        let mut b = st.launch_builder(&k.attn_partial);
        b.arg(&grp.gathered)
            .arg(&grp.ucount)
            .arg(&umax)
            .arg(&grp.q)
            .arg(&scale)
            .arg(&grp.pm)
            .arg(&grp.pl)
            .arg(&grp.pacc);
        // SAFETY: partials sized [hg][nsplit][G](×D).
        unsafe { b.launch(cfg((self.nsplit as u32, grp.hg, 1), 128)) }
            .map_err(drv("launch attn_partial"))?;
        let nsi = self.nsplit as i32;
        let mut b = st.launch_builder(&k.attn_combine);
        b.arg(&grp.pm)
            .arg(&grp.pl)
            .arg(&grp.pacc)
            .arg(&nsi)
            .arg(&grp.out);
        // SAFETY: out [hg][G][D].
        unsafe { b.launch(cfg((grp.rg, 1, 1), d as u32)) }.map_err(drv("launch attn_combine"))?;
        Ok(())
    }
}
