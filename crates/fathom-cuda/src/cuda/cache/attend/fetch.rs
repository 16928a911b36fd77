//! Stage 4, the fetch (docs/SPEC.md §6.1): the union's K|V records into HBM, each from the HBM
//! row cache where it holds the row, else over the link; with the host gather on, a share of
//! the misses is listed for the host's threads, which copy them into pinned staging that a
//! second stream moves into place while the fetch reads the rest.

#[allow(unused_imports)]
use super::*;

impl Launch<'_> {
    /// The fetch of the group's `hn` KV heads on `ps` (with the host gather's request, copy and
    /// join around it when the gather is on).
    pub(super) fn fetch(&self, ps: &CudaStream, ag: &AttendGeom, hn: u32) -> Result<()> {
        let c = self.c;
        let (k, w) = (&c.attend_kernels, &c.work);
        if let Some(g) = &c.gather {
            self.gather_request(ps, ag, hn, g)?;
        }
        let row_chunks = w.umax.div_ceil(FETCH_ROWS) as u32;
        let mut b = ps.launch_builder(&k.fetch);
        b.arg(&self.descs)
            .arg(&self.tables)
            .arg(&self.pool)
            .arg(&self.geom)
            .arg(ag)
            .arg(&w.urows.ptr)
            .arg(&w.ucount.ptr)
            .arg(&self.tags)
            .arg(&self.data)
            .arg(&self.claim)
            .arg(&w.rows.ptr)
            .arg(&w.counters.ptr);
        // SAFETY: every union row is a token < the session's length; rows hold umax records;
        // the row cache (when present) has cache_rows slots per (slot, layer, head).
        unsafe { b.launch(cfg((row_chunks, hn, self.nb as u32), 256)) }
            .map_err(drv("launch paged_fetch"))?;
        if c.gather.is_some() {
            // The rows the host brought, copied on the second stream, join here.
            ps.wait(&c.copied).map_err(drv("wait event"))?;
        }
        Ok(())
    }

    /// The host gather's share of the misses: listed, published to the host's threads, and
    /// copied from the staging into their rows on the second stream, at once with the fetch
    /// of the GPU's own share (the rows they write are disjoint: each miss is given to one of
    /// them). With the gather on there is one head group, so the second stream is free.
    fn gather_request(
        &self,
        ps: &CudaStream,
        ag: &AttendGeom,
        hn: u32,
        g: &GatherState,
    ) -> Result<()> {
        let c = self.c;
        let (k, w) = (&c.attend_kernels, &c.work);
        // SAFETY: the state holds 4 u32; the count is its first.
        unsafe { result::memset_d8_async(g.gstate.ptr, 0, 4, ps.cu_stream()) }
            .map_err(drv("memset host-gather count"))?;
        let gcap = g.cap as u32;
        let mut b = ps.launch_builder(&k.gather_list);
        b.arg(&self.descs)
            .arg(&self.tables)
            .arg(&self.geom)
            .arg(ag)
            .arg(&w.urows.ptr)
            .arg(&w.ucount.ptr)
            .arg(&self.tags)
            .arg(&g.gstate.ptr)
            .arg(&g.list.dptr)
            .arg(&g.gdst.ptr)
            .arg(&gcap);
        let list_chunks = w.umax.div_ceil(GATHER_LIST_THREADS) as u32;
        // SAFETY: as the fetch's; the list and rows hold gcap entries (bounded in the kernel).
        unsafe {
            b.launch(cfg(
                (list_chunks, hn, self.nb as u32),
                GATHER_LIST_THREADS as u32,
            ))
        }
        .map_err(drv("launch paged_gather_list"))?;
        let mut b = ps.launch_builder(&k.gather_publish);
        b.arg(ag).arg(&g.gstate.ptr).arg(&gcap).arg(&g.mailbox.dptr);
        // SAFETY: one thread; the mailbox holds MAILBOX_WORDS u32.
        unsafe { b.launch(cfg((1, 1, 1), 1)) }.map_err(drv("launch paged_gather_publish"))?;
        c.published.record(ps).map_err(drv("record event"))?;
        c.side.wait(&c.published).map_err(drv("wait event"))?;
        let chunks = g.cap.div_ceil(crate::host_gather::GATHER_CHUNK);
        let ctas = chunks.min(GATHER_COPY_CTAS) as u32;
        let mut b = c.side.launch_builder(&k.gather_copy);
        b.arg(&g.gstate.ptr)
            .arg(&gcap)
            .arg(&g.done.dptr)
            .arg(&g.staging.dptr)
            .arg(&g.gdst.ptr)
            .arg(&w.rows.ptr);
        // SAFETY: done holds a mark per chunk of gcap, staging gcap records, and every gdst
        // entry is a row of `rows` that the fetch does not write.
        unsafe { b.launch(cfg((ctas, 1, 1), 256)) }.map_err(drv("launch paged_gather_copy"))?;
        c.copied.record(&c.side).map_err(drv("record event"))?;
        Ok(())
    }
}
