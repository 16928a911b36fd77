//! The cache's settings.

#[allow(unused_imports)]
use super::*;

impl PagedCache {
    /// Sets how attends take each query head's top-k ([`crate::cache::SelectPath`],
    /// docs/SPEC.md §5 "Selection without a score array"). With
    /// [`SelectPath::Filtered`](crate::cache::SelectPath::Filtered), a row with enough middle
    /// tokens filters its scan by an estimate left by its previous attend and keeps only the
    /// tokens that pass; the winners are exactly those of the score path (a row whose filter
    /// passes fewer than k tokens, or too many, falls back to it within the same attend). The
    /// default is [`SelectPath::Scores`](crate::cache::SelectPath::Scores).
    ///
    /// # Errors
    /// A driver failure clearing the rows' modes (when switching to the score path).
    pub fn set_select_path(&mut self, path: crate::cache::SelectPath) -> Result<()> {
        self.not_capturing("set_select_path")?;
        if path == crate::cache::SelectPath::Scores && self.select != path {
            // Every row back on the score path: the kernels that skip filtered rows read
            // these, and nothing writes them while the setting is off.
            let w = &self.work;
            let bytes = self.cfg.max_batch * self.cfg.shape.kv_heads * self.cfg.shape.group * 4;
            // SAFETY: the modes hold max_batch·Hq u32.
            unsafe { result::memset_d8_async(w.mode.ptr, 0, bytes, self.stream.cu_stream()) }
                .map_err(drv("memset select modes"))?;
        }
        if self.select != path {
            self.settings += 1;
        }
        self.select = path;
        Ok(())
    }

    /// The setting of [`PagedCache::set_select_path`].
    pub fn select_path(&self) -> crate::cache::SelectPath {
        self.select
    }

    /// Splits each attend's KV heads into `groups` head groups of `⌈Hkv / groups⌉` heads (the
    /// last may hold fewer): the cache's stream scans group `i + 1` while a second stream runs
    /// group `i`'s top-k, union, row fetch and partial attention, so the scan's plane reads
    /// keep the link busy while the kernels that do not read it run (docs/SPEC.md §6.1). The
    /// outputs are the same bits for every setting: each head's launches are the same, only
    /// their order across heads changes. Dense attends stay one group. `1` is the default.
    ///
    /// # Errors
    /// `groups` of 0 or more than the model's KV heads.
    pub fn set_attend_groups(&mut self, groups: usize) -> Result<()> {
        self.not_capturing("set_attend_groups")?;
        crate::cache::check_attend_groups(&self.cfg, groups)?;
        crate::cache::check_host_gather(&self.cfg, self.host_gather(), groups)?;
        if self.groups != groups {
            self.settings += 1;
        }
        self.groups = groups;
        Ok(())
    }

    /// The setting of [`PagedCache::set_attend_groups`].
    pub fn attend_groups(&self) -> usize {
        self.groups
    }

    /// Plane words per global load of the scan (docs/SPEC.md §6.1; a setting so that it is
    /// settled by measurement): 1 (the default) reads one 8-byte word of a plane run per load,
    /// 2 two adjacent words (16 bytes, aligned) where a page holds an even number of 64-token
    /// blocks, half the load instructions for the same bytes. The scores are the same bits
    /// either way (the same words reach the same shared memory).
    ///
    /// # Errors
    /// Any value but 1 or 2.
    pub fn set_scan_vector_words(&mut self, words: u32) -> Result<()> {
        self.not_capturing("set_scan_vector_words")?;
        crate::cache::check_scan_vector_words(words)?;
        if self.scan_vec != words {
            self.settings += 1;
        }
        self.scan_vec = words;
        Ok(())
    }

    /// The setting of [`PagedCache::set_scan_vector_words`].
    pub fn scan_vector_words(&self) -> u32 {
        self.scan_vec
    }

    /// Splits each attend's GPU time by stage ([`AttendStage`]: plan, scan, top-k, union,
    /// row fetch, attention) with a CUDA event on the cache's stream after each stage, read by
    /// [`PagedCache::stage_times`]: a per-stage profile of real decode steps without a
    /// profiler. Off by default. The events serialize nothing (one stream), but each costs a
    /// launch slot, so time whole steps with it off. Attends inside a graph capture (the
    /// cache's or a caller's that took in its stream), with more than one head group, or past
    /// [`MAX_STAGE_MARKS`] marks since the last read are counted as untimed instead. A change
    /// of the setting drops the marks not yet read. The outputs are the same bits either way.
    pub fn set_stage_timing(&mut self, on: bool) {
        if on != self.stage_timing {
            // A change starts afresh: no marks of the other setting's attends are read.
            self.stage_marks.clear();
            self.stage_untimed = 0;
        }
        self.stage_timing = on;
    }

    /// The setting of [`PagedCache::set_stage_timing`].
    pub fn stage_timing(&self) -> bool {
        self.stage_timing
    }
}
