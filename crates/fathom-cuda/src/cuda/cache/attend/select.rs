//! Stage 3, the selection (docs/SPEC.md §5): each query head's top-k of its middle tokens (the
//! boundary bucket of the level-1 histogram, one streaming pass, the exact boundary among the
//! bucket's candidates, ties to the lower index; or the filtered select's survivors), then the
//! union of the sink, the local window and every query head's winners per KV head. CPU
//! reference: `fathom_plan::select_per_head`.

#[allow(unused_imports)]
use super::*;

impl Launch<'_> {
    /// The filtered rows' selection, or their fall-back to the score path.
    pub(super) fn topk_fused(&self, ag: &AttendGeom, gq: u32) -> Result<()> {
        let (k, w) = (&self.c.attend_kernels, &self.c.work);
        let mut b = self.st.launch_builder(&k.topk_fused);
        b.arg(&self.descs)
            .arg(&self.geom)
            .arg(ag)
            .arg(&self.qs)
            .arg(&self.depths)
            .arg(&w.est.ptr)
            .arg(&w.mode.ptr)
            .arg(&w.fcand.ptr)
            .arg(&w.fcount.ptr)
            .arg(&w.winners.ptr)
            .arg(&w.counts.ptr)
            .arg(&w.counters.ptr);
        // SAFETY: rows < max_batch·Hq of every per-row array; pairs read < min(count, fcap).
        unsafe { b.launch(cfg((gq, self.nb as u32, 1), TOPK_THREADS)) }
            .map_err(drv("launch paged_topk_fused"))?;
        Ok(())
    }

    /// Each other row's top-k, on `ps`: the boundary bucket, one streaming pass, the exact
    /// boundary among the bucket's candidates. With the filtered select off, every row's mode
    /// is 0 already.
    pub(super) fn topk(&self, ps: &CudaStream, ag: &AttendGeom, gq: u32) -> Result<()> {
        let (k, w) = (&self.c.attend_kernels, &self.c.work);
        let nb32 = self.nb as u32;
        let mut b = ps.launch_builder(&k.topk_select);
        b.arg(&self.descs)
            .arg(&self.geom)
            .arg(ag)
            .arg(&w.hist.ptr)
            .arg(&w.sel.ptr)
            .arg(&w.counts.ptr)
            .arg(&w.ccount.ptr)
            .arg(&w.mode.ptr);
        // SAFETY: rows < max_batch·Hq of every per-row array.
        unsafe { b.launch(cfg((gq, nb32, 1), TOPK_THREADS)) }
            .map_err(drv("launch paged_topk_select"))?;
        let chunks = self.longest.div_ceil(COLLECT_ELEMS).max(1) as u32;
        let mut b = ps.launch_builder(&k.topk_collect);
        b.arg(&self.descs)
            .arg(&self.geom)
            .arg(ag)
            .arg(&w.scores.ptr)
            .arg(&w.sel.ptr)
            .arg(&w.winners.ptr)
            .arg(&w.counts.ptr)
            .arg(&w.cand.ptr)
            .arg(&w.ccount.ptr)
            .arg(&w.mode.ptr);
        // SAFETY: winners hold max_k per row (k ≤ max_k was checked), candidates max_tokens
        // per row; both lists are bounded in the kernel.
        unsafe { b.launch(cfg((chunks, gq, nb32), 256)) }
            .map_err(drv("launch paged_topk_collect"))?;
        let mut b = ps.launch_builder(&k.topk_finish);
        b.arg(&self.descs)
            .arg(&self.geom)
            .arg(ag)
            .arg(&w.scores.ptr)
            .arg(&w.sel.ptr)
            .arg(&w.winners.ptr)
            .arg(&w.counts.ptr)
            .arg(&w.cand.ptr)
            .arg(&w.ccount.ptr)
            .arg(&w.mode.ptr)
            .arg(&self.qs)
            .arg(&self.depths)
            .arg(&w.est.ptr);
        // SAFETY: as above.
        unsafe { b.launch(cfg((gq, nb32, 1), TOPK_THREADS)) }
            .map_err(drv("launch paged_topk_finish"))?;
        Ok(())
    }

    /// The union per KV head of the group's `hn` heads: its rows and the mask of the query
    /// heads that chose each.
    pub(super) fn union(&self, ps: &CudaStream, ag: &AttendGeom, hn: u32) -> Result<()> {
        let (k, w) = (&self.c.attend_kernels, &self.c.work);
        let mut b = ps.launch_builder(&k.union);
        b.arg(&self.descs)
            .arg(&self.geom)
            .arg(ag)
            .arg(&w.winners.ptr)
            .arg(&w.counts.ptr)
            .arg(&w.urows.ptr)
            .arg(&w.umask.ptr)
            .arg(&w.ucount.ptr);
        // SAFETY: union lists hold umax = 64 + G·max_k rows ≥ sink + local + G·k.
        unsafe { b.launch(cfg((self.nb as u32, hn, 1), TOPK_THREADS)) }
            .map_err(drv("launch paged_union"))?;
        Ok(())
    }
}
