//! Stage 2, the scan (docs/SPEC.md §2, §6.1): each page's planned planes read in place
//! (zero-copy from host memory, or from HBM), every middle token scored from its first `t`
//! planes per channel, with the top-k's level-1 histogram built on the way. CPU reference:
//! `fathom_plan::scan::reference_scores` (and, for landmark and Quest, the block-table scores of
//! `fathom_baselines`).

#[allow(unused_imports)]
use super::*;

impl Launch<'_> {
    /// Clears what the scan accumulates into: the histogram, the rows' select modes for the
    /// table methods (no scan of theirs writes them, so a filtered attend before must not
    /// leave its modes for the top-k kernels to skip these rows by), and the filtered counts.
    pub(super) fn clear_select(&self) -> Result<()> {
        let (w, st) = (&self.c.work, self.st);
        let s = self.c.cfg.shape;
        let rows = self.nb * s.kv_heads * s.group;
        // SAFETY: the histogram holds max_batch·Hq rows of HIST_BINS u32.
        unsafe { result::memset_d8_async(w.hist.ptr, 0, rows * HIST_BINS * 4, st.cu_stream()) }
            .map_err(drv("memset top-k histogram"))?;
        if self.table.is_some() {
            // SAFETY: the modes hold max_batch·Hq u32.
            unsafe { result::memset_d8_async(w.mode.ptr, 0, rows * 4, st.cu_stream()) }
                .map_err(drv("memset select modes"))?;
        }
        if self.ag.fuse_min > 0 {
            // SAFETY: the counts hold max_batch·Hq u32.
            unsafe { result::memset_d8_async(w.fcount.ptr, 0, rows * 4, st.cu_stream()) }
                .map_err(drv("memset filtered counts"))?;
        }
        Ok(())
    }

    /// One pass of the plane scan over the `hn` KV heads of `ag`'s group (pass 1: the filtered
    /// select's second pass over the rows that fell back).
    pub(super) fn scan(&self, pass: u32, ag: &AttendGeom, hn: u32) -> Result<()> {
        let c = self.c;
        let (k, w) = (&c.attend_kernels, &c.work);
        let per_cta = SCAN_BLOCKS.min(c.layout.blocks_per_page());
        let ctas = self.longest.div_ceil(BLOCK_TOKENS).div_ceil(per_cta) as u32;
        let scan_fn = if c.scan_vec == 2 { &k.scan_v2 } else { &k.scan };
        let mut b = self.st.launch_builder(scan_fn);
        b.arg(&self.descs)
            .arg(&self.tables)
            .arg(&self.pool)
            .arg(&self.geom)
            .arg(ag)
            .arg(&self.qs)
            .arg(&self.depths)
            .arg(&w.scores.ptr)
            .arg(&w.hist.ptr)
            .arg(&pass)
            .arg(&w.est.ptr)
            .arg(&w.mode.ptr)
            .arg(&w.fcand.ptr)
            .arg(&w.fcount.ptr);
        // SAFETY: only pages < each session's table length are read (the kernel checks its
        // length); scores hold max_batch·Hq rows of max_tokens, the filtered pairs fcap per row
        // (bounded in the kernel), the estimates max_sessions·L·Hq.
        unsafe {
            b.launch(cfg(
                (ctas.max(1), hn, self.nb as u32),
                8 * SCAN_BLOCKS as u32,
            ))
        }
        .map_err(drv("launch paged_scan"))?;
        Ok(())
    }

    /// The block-table scan of landmark (`quest` 0: the mean key of every 8 tokens) or Quest
    /// (1: the channel bounds of every 16).
    pub(super) fn table_scan(&self, ag: &AttendGeom, hn: u32, quest: u32) -> Result<()> {
        let c = self.c;
        let (k, w) = (&c.attend_kernels, &c.work);
        let s = c.cfg.shape;
        let tg = c.table_geom(ag.layer as usize);
        let gs = if quest == 1 { 16 } else { 8 };
        let grid = (
            self.longest
                .div_ceil(gs)
                .div_ceil(crate::cache::table_scan_groups(s.dim, s.group))
                .max(1) as u32,
            hn,
            self.nb as u32,
        );
        let mut b = self.st.launch_builder(&k.table_scan);
        b.arg(&self.descs)
            .arg(&self.tables)
            .arg(&self.geom)
            .arg(ag)
            .arg(&tg)
            .arg(&quest)
            .arg(&self.qs)
            .arg(&w.scores.ptr)
            .arg(&w.hist.ptr);
        // SAFETY: the tables hold every pool page (checked: the cache keeps them); groups past
        // each session's length are skipped; scores and the histogram hold max_batch·Hq rows.
        unsafe { b.launch(cfg(grid, TABLE_SCAN_THREADS)) }
            .map_err(drv("launch paged_table_scan"))?;
        Ok(())
    }
}
