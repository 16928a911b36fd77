//! Stage 1, the plan (docs/SPEC.md §3–§4): the queries to f32 (and into the PCA basis for
//! Loki), then each (session, KV head)'s depths per channel. CPU references:
//! `fathom_plan::waterfill` (Fathom's reverse water-filling under a bit budget) and
//! `fathom_plan::baselines` (SparQ's top-r channels at 4 planes).

#[allow(unused_imports)]
use super::*;

impl Launch<'_> {
    /// The queries `[batch][Hq][D]` of `q`'s dtype to f32 (`work.qf`), and, for Loki, rotated
    /// into the layer's PCA basis (`work.qr`).
    pub(super) fn queries(&self, q: &crate::cache::QueryRows) -> Result<()> {
        let (k, w, st) = (&self.c.attend_kernels, &self.c.work, self.st);
        let s = self.c.cfg.shape;
        let (hq, d) = (s.kv_heads * s.group, s.dim);
        let (qp, dtype) = (q.q.ptr(), q.q.dtype().code());
        let mut b = st.launch_builder(&k.queries);
        b.arg(&qp).arg(&dtype).arg(&w.qf.ptr);
        // SAFETY: q holds batch·Hq·D elements (the caller's contract), qf max_batch·Hq·D.
        unsafe { b.launch(cfg(((self.nb * hq) as u32, 1, 1), d as u32)) }
            .map_err(drv("launch attend_queries"))?;
        if let Some(rot) = self.rot {
            let hq_u = hq as u32;
            let mut b = st.launch_builder(&k.rotate_queries);
            b.arg(&w.qf.ptr).arg(&rot).arg(&hq_u).arg(&self.qs);
            // SAFETY: qf and qr hold max_batch·Hq·D f32, rot Hkv·D·D.
            unsafe { b.launch(cfg(((self.nb * hq) as u32, 1, 1), d as u32)) }
                .map_err(drv("launch attend_rotate_queries"))?;
        }
        Ok(())
    }

    /// The per-query plan of the methods that plan on the GPU (Fathom, SparQ) into
    /// `work.depths`; the others read a static table and plan nothing here.
    pub(super) fn plan(&self, method: AttendMethod, sigma: Option<u64>) -> Result<()> {
        let (k, w, st) = (&self.c.attend_kernels, &self.c.work, self.st);
        let s = self.c.cfg.shape;
        let heads = (self.nb * s.kv_heads) as i32;
        let one = 1u64;
        match method {
            AttendMethod::Scan(M::Fathom(budget)) => {
                let steps = fathom_plan::waterfill::BISECTION_STEPS as i32;
                let sig = sigma.unwrap_or(0);
                let mut b = st.launch_builder(&k.fathom_plan);
                b.arg(&w.qf.ptr)
                    .arg(&sig)
                    .arg(&budget)
                    .arg(&steps)
                    .arg(&heads)
                    .arg(&one)
                    .arg(&w.depths.ptr)
                    .arg(&w.bits.ptr)
                    .arg(&w.runs.ptr)
                    .arg(&w.bits_acc.ptr);
                // SAFETY: qf [B·Hkv][G][D], σ² tiled [max_batch][Hkv][D], depths, bits and
                // runs sized for max_batch·Hkv heads; one warp per head.
                unsafe { b.launch(cfg((heads as u32, 1, 1), 32)) }
                    .map_err(drv("launch fathom_plan"))?;
            }
            AttendMethod::Scan(M::SparQ(r)) => {
                let r = r as i32;
                let mut b = st.launch_builder(&k.sparq_plan);
                b.arg(&w.qf.ptr)
                    .arg(&r)
                    .arg(&heads)
                    .arg(&one)
                    .arg(&w.depths.ptr)
                    .arg(&w.bits.ptr)
                    .arg(&w.runs.ptr)
                    .arg(&w.bits_acc.ptr);
                // SAFETY: as above; one CTA of D threads per head.
                unsafe { b.launch(cfg((heads as u32, 1, 1), s.dim as u32)) }
                    .map_err(drv("launch sparq_plan"))?;
            }
            _ => {}
        }
        Ok(())
    }
}
