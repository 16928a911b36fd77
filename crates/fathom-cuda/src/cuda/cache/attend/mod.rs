//! One layer's attention (docs/SPEC.md §5–§6.1), on the cache's stream with no host
//! synchronisation. The stages, in launch order, each in its own file:
//!
//! 1. `plan`: the queries to f32 (rotated into the PCA basis for Loki), then the per-query
//!    depths (Fathom's reverse water-filling, SparQ's top-r; CPU reference
//!    `fathom_plan::waterfill` and `fathom_plan::baselines`);
//! 2. `scan`: each page's planes read in place, every middle token scored, with the top-k's
//!    level-1 histogram (CPU reference `fathom_plan::scan::reference_scores`);
//! 3. `select`: each query head's top-k, then the union per KV head (CPU reference
//!    `fathom_plan::select_per_head`);
//! 4. `fetch`: the union's K|V records into HBM, through the row cache and the host gather;
//! 5. `attention`: exact attention of each query head over its own set, split and combined
//!    (CPU reference `fathom_plan::attend`).
//!
//! With head groups, stages 3–5 of group `i` run on the second stream while the cache's stream
//! scans group `i + 1`.

#[allow(unused_imports)]
use super::*;
use crate::cache::AttendMethod;
use crate::config::Method as M;

mod attention;
mod fetch;
mod plan;
mod scan;
mod select;
mod work;

pub(super) use work::Work;

/// What every launch of one attend reads, fixed before its first launch.
struct Launch<'a> {
    c: &'a PagedCache,
    /// The cache's stream (plan, scan and the combine run there).
    st: &'a CudaStream,
    descs: u64,
    tables: u64,
    /// The pool the scan and the fetch read: the layer's, or its PCA index for Loki.
    pool: u64,
    geom: PoolGeom,
    ag: AttendGeom,
    /// The queries the plan and the scan read (the attention reads `work.qf`).
    qs: u64,
    /// The layer's PCA basis, for Loki.
    rot: Option<u64>,
    /// The depths the scan reads: the method's static table, or the plan's output.
    depths: u64,
    /// The row cache: tags, records and bids (0 when absent).
    tags: u64,
    data: u64,
    claim: u64,
    nb: usize,
    /// Tokens the grids cover: the longest session, or `max_tokens` while capturing.
    longest: usize,
    /// Landmark (0) or Quest (1): scores from the block tables.
    table: Option<u32>,
}

/// The stage marks of one attend ([`crate::cache::CacheOptions::stage_timing`]): an event on
/// the stream after each stage, when on.
struct Marks {
    on: bool,
    marks: Vec<(AttendStage, CudaEvent)>,
}

impl Marks {
    fn mark(&mut self, stage: AttendStage, on: &CudaStream) -> Result<()> {
        if self.on {
            let e = on
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv("record stage event"))?;
            self.marks.push((stage, e));
        }
        Ok(())
    }
}

impl PagedCache {
    /// [`crate::api::KvCache::attend`].
    pub(crate) fn attend(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        method: AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &crate::cache::QueryRows,
        out: DeviceViewMut<'_>,
    ) -> Result<()> {
        crate::cache::check_attend(&self.cfg, batch, self.step, layer, params, q, &out)?;
        self.ledger.check_read(batch, layer, "attend")?;
        let (static_depths, sigma) = self.method_inputs(method, layer)?;
        let hkv = self.cfg.shape.kv_heads;
        let dense = matches!(method, AttendMethod::Dense);
        // Head groups: `per` KV heads each (the last may hold fewer); one for dense attends.
        let groups = if dense { 1 } else { self.groups.min(hkv) };
        // Stage marks (stage timing): plain launches of one head group only, an event on the
        // stream after each stage (all on the cache's stream then).
        let split = self.stage_timing
            && self.capturing.is_none()
            && groups == 1
            && self.stage_marks.len() + 7 <= MAX_STAGE_MARKS
            // A caller's own capture that took in the cache's stream counts as a capture.
            && matches!(
                self.stream.capture_status(),
                Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
            );
        if self.stage_timing && !split {
            self.stage_untimed += 1;
        }
        let mut marks = Marks {
            on: split,
            marks: Vec::new(),
        };
        let l = self.launch(batch, layer, method, params, static_depths)?;
        marks.mark(AttendStage::Start, l.st)?;
        l.queries(q)?;
        if dense {
            marks.mark(AttendStage::Plan, l.st)?;
            l.partial(l.st, &l.ag, hkv as u32)?;
        } else {
            l.plan(method, sigma)?;
            marks.mark(AttendStage::Plan, l.st)?;
            l.clear_select()?;
            let per = hkv.div_ceil(groups);
            for gi in 0..groups {
                let h0 = gi * per;
                if h0 >= hkv {
                    break;
                }
                l.group(h0, per.min(hkv - h0), groups, &mut marks)?;
            }
            if groups > 1 {
                self.joined
                    .record(&self.side)
                    .map_err(drv("record event"))?;
                l.st.wait(&self.joined).map_err(drv("wait event"))?;
            }
        }
        l.combine(out.ptr())?;
        marks.mark(AttendStage::Attention, l.st)?;
        let nb = l.nb;
        self.stage_marks.extend(marks.marks);
        if matches!(method, AttendMethod::Scan(M::Fathom(_) | M::SparQ(_))) {
            self.plans_counted += (nb * hkv) as u64;
        }
        Ok(())
    }

    /// The launch parameters of one attend of `method` at `layer` (checked by the caller).
    fn launch(
        &self,
        batch: &AppendBatch,
        layer: usize,
        method: AttendMethod,
        params: &fathom_plan::SelectParams,
        static_depths: Option<u64>,
    ) -> Result<Launch<'_>> {
        let s = self.cfg.shape;
        let (hkv, d) = (s.kv_heads, s.dim);
        let w = &self.work;
        // Loki scans the PCA index (its own key sections, the same records) with the queries
        // rotated into its basis; every other method the first index with the raw queries.
        let loki = matches!(method, AttendMethod::Scan(M::Loki(_)));
        let dense = matches!(method, AttendMethod::Dense);
        // Landmark (0) and Quest (1) score from the block tables, and take the score path.
        let table = match method {
            AttendMethod::Scan(M::Landmark) => Some(0u32),
            AttendMethod::Scan(M::Quest) => Some(1u32),
            _ => None,
        };
        let ag = AttendGeom {
            sink: params.sink as u32,
            local: params.local as u32,
            k: params.k as u32,
            max_k: self.cfg.max_k as u32,
            max_tokens: self.cfg.pages.max_tokens as u64,
            depth_stride: if static_depths.is_some() {
                0
            } else {
                (hkv * d) as u32
            },
            dense: u32::from(dense),
            scale: 1.0 / (d as f32).sqrt(),
            umax: w.umax as u32,
            cache_rows: self.cfg.row_cache as u32,
            layer: layer as u32,
            nsplit: if dense {
                DENSE_SPLITS
            } else {
                w.umax.div_ceil(ATTN_GRAN).min(SPARSE_SPLITS)
            } as u32,
            fuse_min: match self.select {
                _ if table.is_some() => 0,
                crate::cache::SelectPath::Filtered {
                    min_middle_tokens, ..
                } => min_middle_tokens.min(u32::MAX as usize) as u32,
                crate::cache::SelectPath::Scores => 0,
            },
            fcap: w.fcap as u32,
            keep_scores: u32::from(matches!(
                self.select,
                crate::cache::SelectPath::Filtered {
                    keep_scores: true,
                    ..
                }
            )),
            h0: 0,
            host_gather: if self.gather.is_some() {
                self.gather_share
            } else {
                0
            },
        };
        let (qs, rot) = match (loki, &w.qr, &self.calib.pca[layer]) {
            (true, Some(qr), Some((_, rot))) => (qr.ptr, Some(rot.ptr)),
            (true, ..) => {
                return Err(CudaError::invalid(
                    "method",
                    format!("loki at layer {layer}: the cache has no PCA index or basis there"),
                ))
            }
            (false, ..) => (w.qf.ptr, None),
        };
        let ptr = |x: &Option<DevBuf>| x.as_ref().map_or(0, |b| b.ptr);
        Ok(Launch {
            c: self,
            st: &self.stream,
            descs: self.descs_dev.ptr,
            tables: self.tables_dev.ptr,
            pool: if loki {
                self.pca_pools[layer].dptr()
            } else {
                self.pools[layer].dptr()
            },
            geom: if loki {
                self.pca_geom(layer)
            } else {
                self.geom(layer)
            },
            ag,
            qs,
            rot,
            depths: static_depths.unwrap_or(w.depths.ptr),
            tags: ptr(&w.row_tags),
            data: ptr(&w.row_data),
            claim: ptr(&w.row_claim),
            nb: self.batch_len,
            // Grids cover the longest session of the batch, or `max_tokens` while capturing
            // (the kernels skip what lies past each session's length).
            longest: if self.fixed_grids {
                self.cfg.pages.max_tokens
            } else {
                batch.plans.iter().map(|p| p.end_token()).max().unwrap_or(0)
            },
            table,
        })
    }
}

impl Launch<'_> {
    /// Stages 2–5 of the head group of KV heads `h0..h0 + hn`: its scan on the cache's
    /// stream, the rest on the second stream when there are several groups.
    fn group(&self, h0: usize, hn: usize, groups: usize, marks: &mut Marks) -> Result<()> {
        let c = self.c;
        let ag = AttendGeom {
            h0: h0 as u32,
            ..self.ag
        };
        let (hn, gq) = (hn as u32, (hn * c.cfg.shape.group) as u32);
        self.scan_stage(&ag, hn, gq)?;
        marks.mark(AttendStage::Scan, self.st)?;
        // With head groups, the rest of this group's attend runs on the second stream (after
        // this group's scan), while the cache's stream scans the next group.
        let ps: &CudaStream = if groups > 1 {
            c.scanned.record(self.st).map_err(drv("record event"))?;
            c.side.wait(&c.scanned).map_err(drv("wait event"))?;
            &c.side
        } else {
            self.st
        };
        self.topk(ps, &ag, gq)?;
        marks.mark(AttendStage::TopK, ps)?;
        self.union(ps, &ag, hn)?;
        marks.mark(AttendStage::Union, ps)?;
        self.fetch(ps, &ag, hn)?;
        marks.mark(AttendStage::Fetch, ps)?;
        self.partial(ps, &ag, hn)
    }
}
impl Launch<'_> {
    /// Stage 2 of `ag`'s head group of `hn` KV heads (`gq` query heads) on the cache's stream:
    /// the scan (of the planes or the block tables), then the filtered rows' selection or
    /// their fallback before each other row's top-k.
    fn scan_stage(&self, ag: &AttendGeom, hn: u32, gq: u32) -> Result<()> {
        match self.table {
            Some(quest) => self.table_scan(ag, hn, quest)?,
            None => self.scan(0, ag, hn)?,
        }
        if ag.fuse_min > 0 {
            self.topk_fused(ag, gq)?;
            if ag.keep_scores == 0 {
                self.scan(1, ag, hn)?;
            }
        }
        Ok(())
    }
}

impl PagedCache {
    /// [`crate::api::KvCache::select`]: the attend's stages 1–3 over every KV head on the
    /// cache's stream, then the selection written out.
    pub(crate) fn select(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        method: AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &crate::cache::QueryRows,
        out: crate::cache::SelectOut<'_>,
    ) -> Result<()> {
        crate::cache::check_select_out(
            &self.cfg,
            batch,
            (self.step, layer),
            method,
            params,
            q,
            &out,
        )?;
        self.ledger.check_read(batch, layer, "select")?;
        let (static_depths, sigma) = self.method_inputs(method, layer)?;
        let s = self.cfg.shape;
        let l = self.launch(batch, layer, method, params, static_depths)?;
        l.queries(q)?;
        l.plan(method, sigma)?;
        l.clear_select()?;
        let (hkv, hq) = (s.kv_heads as u32, (s.kv_heads * s.group) as u32);
        l.scan_stage(&l.ag, hkv, hq)?;
        l.topk(l.st, &l.ag, hq)?;
        let p = crate::cache::SelectOutParams {
            sink: params.sink as u32,
            local: params.local as u32,
            max_k: self.cfg.max_k as u32,
            cap: out.cap as u32,
            hq,
        };
        let w = &self.work;
        let (ip, lp) = (out.indices.ptr(), out.lengths.ptr());
        let mut b = l.st.launch_builder(&self.attend_kernels.select_out);
        b.arg(&l.descs)
            .arg(&p)
            .arg(&w.winners.ptr)
            .arg(&w.counts.ptr)
            .arg(&ip)
            .arg(&lp);
        // SAFETY: rows = batch·Hq < max_batch·Hq of the winners and counts; `indices` holds
        // rows·cap i32 and `lengths` rows i32 (checked above); the grid is (Hq, batch).
        unsafe { b.launch(cfg((hq, l.nb as u32, 1), 128)) }
            .map_err(drv("launch paged_select_out"))?;
        if matches!(method, AttendMethod::Scan(M::Fathom(_) | M::SparQ(_))) {
            self.plans_counted += (l.nb * s.kv_heads) as u64;
        }
        Ok(())
    }

    /// [`crate::api::KvCache::attend_host`].
    pub(crate) fn attend_host(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        method: crate::cache::AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &[f32],
    ) -> Result<Vec<f32>> {
        let s = self.cfg.shape;
        let want = batch.plans.len() * s.kv_heads * s.group * s.dim;
        if q.len() != want {
            return Err(CudaError::invalid(
                "queries",
                format!(
                    "{} values (want [{}][Hq][D] = {want})",
                    q.len(),
                    batch.plans.len()
                ),
            ));
        }
        if let Some(x) = q.iter().find(|x| !x.is_finite()) {
            return Err(CudaError::invalid("queries", format!("{x} is not finite")));
        }
        let bytes = want * 4;
        if self
            .staging
            .as_ref()
            .is_none_or(|(_, cap)| *cap < 2 * bytes)
        {
            self.sync()?;
            self.staging = Some((DevBuf::new(2 * bytes, "attend staging")?, 2 * bytes));
        }
        let base = self.staging.as_ref().map_or(0, |(b, _)| b.ptr);
        self.sync()?;
        // SAFETY: the staging buffer holds 2·bytes, only this stream uses it, and the stream is
        // idle (synchronised above); the copy is ordered before the attend's kernels.
        unsafe { stream_upload(base, q, self.stream.cu_stream(), "memcpy_htod queries") }?;
        // SAFETY: the staging buffer holds 2·bytes: the queries at `base` (`want` f32, copied
        // above on the stream), the outputs after them (`want` f32), only this attend uses it,
        // and it is read back below after a synchronisation.
        let (qr, out) = unsafe {
            (
                crate::cache::QueryRows {
                    q: DeviceView::from_raw(base, want, crate::cache::KvDtype::F32),
                },
                DeviceViewMut::from_raw(base + bytes as u64, want, crate::cache::KvDtype::F32),
            )
        };
        self.attend(batch, layer, method, params, &qr, out)?;
        self.sync()?;
        let mut out = vec![0f32; want];
        // SAFETY: `out` has `want` f32 slots; the source holds as many; synchronous copy.
        unsafe { result::memcpy_dtoh_sync(&mut out, base + bytes as u64) }
            .map_err(drv("memcpy_dtoh outputs"))?;
        Ok(out)
    }
}
