//! Stage 5, the attention (docs/SPEC.md §5): exact attention of each query head over its own
//! set (or every token, dense), split over the union's rows (each split fills the row cache
//! from its rows), then the splits combined. CPU reference: `fathom_plan::attend`.

#[allow(unused_imports)]
use super::*;

impl Launch<'_> {
    /// The partial attention of the group's `hn` KV heads on `ps`.
    pub(super) fn partial(&self, ps: &CudaStream, ag: &AttendGeom, hn: u32) -> Result<()> {
        let (k, w) = (&self.c.attend_kernels, &self.c.work);
        let mut b = ps.launch_builder(&k.attn_partial);
        b.arg(&self.descs)
            .arg(&self.tables)
            .arg(&self.pool)
            .arg(&self.geom)
            .arg(ag)
            .arg(&w.qf.ptr)
            .arg(&w.rows.ptr)
            .arg(&w.urows.ptr)
            .arg(&w.umask.ptr)
            .arg(&w.ucount.ptr)
            .arg(&self.tags)
            .arg(&self.data)
            .arg(&self.claim)
            .arg(&w.pm.ptr)
            .arg(&w.pl.ptr)
            .arg(&w.pacc.ptr);
        // SAFETY: partials hold DENSE_SPLITS ≥ nsplit per row; rows are read through the
        // session's pages only at tokens < its length; the row cache (when present) has
        // cache_rows slots per (slot, layer, head).
        unsafe { b.launch(cfg((ag.nsplit, hn, self.nb as u32), ATTN_THREADS)) }
            .map_err(drv("launch paged_attn_partial"))?;
        Ok(())
    }

    /// The splits of every query head combined into `out` `[batch][Hq][D]` f32, on the cache's
    /// stream (after every group).
    pub(super) fn combine(&self, out: u64) -> Result<()> {
        let (k, w) = (&self.c.attend_kernels, &self.c.work);
        let s = self.c.cfg.shape;
        let hq = (s.kv_heads * s.group) as u32;
        let mut b = self.st.launch_builder(&k.attn_combine);
        b.arg(&self.geom)
            .arg(&self.ag)
            .arg(&w.pm.ptr)
            .arg(&w.pl.ptr)
            .arg(&w.pacc.ptr)
            .arg(&out);
        // SAFETY: out holds batch·Hq·D f32 (the caller's contract).
        unsafe { b.launch(cfg((hq, self.nb as u32, 1), s.dim as u32)) }
            .map_err(drv("launch paged_attn_combine"))?;
        Ok(())
    }
}
