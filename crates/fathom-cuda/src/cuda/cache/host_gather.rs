//! The host gather (docs/SPEC.md §6.1, "Host gather"; the protocol is [`crate::host_gather`]):
//! CPU threads that bring the row fetch's misses into a pinned staging buffer.

#[allow(unused_imports)]
use super::*;

/// The host gather's threads and buffers ([`PagedCache::set_host_gather`]; host_gather.rs
/// and kernels/attend.cu give the protocol).
pub(super) struct GatherState {
    /// Dropped first (after the stream has drained): the threads stop before the memory they
    /// read is freed.
    pub(super) threads: crate::host_gather::HostGather,
    /// Pinned, mapped: the mailbox `[MAILBOX_WORDS]` u32, a done mark per chunk, the record
    /// offsets `[cap]` u64 and the staging `[cap][4D]` bytes.
    pub(super) mailbox: HostBuf,
    pub(super) done: HostBuf,
    pub(super) list: HostBuf,
    pub(super) staging: HostBuf,
    /// HBM: `[count, epoch, faults, timeouts]` u32 and each listed record's row `[cap]` u32.
    pub(super) gstate: DevBuf,
    pub(super) gdst: DevBuf,
    /// Records one attend may list: every union row of a full batch.
    pub(super) cap: usize,
    pub(super) stream: Arc<CudaStream>,
}

impl Drop for GatherState {
    fn drop(&mut self) {
        // No copy kernel may still wait for marks when the threads stop.
        let _ = self.stream.synchronize();
    }
}

impl PagedCache {
    /// Serves the row fetch's misses with `threads` CPU threads (docs/SPEC.md §6.1, "Host
    /// gather"; [`crate::host_gather`]): the fetch lists each record the row cache does not
    /// hold, the threads copy them into a pinned staging buffer, and the GPU reads it in
    /// order, instead of each record being a random read of mapped host memory. `0` (the
    /// default) turns it off. The outputs are the same bits either way (the same records reach
    /// the same rows). The threads spin on a mailbox while attends come (each uses a core),
    /// and poll it every 200 µs after 20 ms without one. Whether it pays is a property of the
    /// host (its IOMMU, cores and memory): on the lent H200's 16-vCPU guest, bringing every
    /// miss does not, while a split with [`PagedCache::set_host_gather_share`] at 50 % takes 5 %
    /// off the 1M step (`results/device/gather/split/README.md`); measure it with
    /// `offload-bench --host-gather 0,N --host-share 100,P`.
    ///
    /// # Errors
    /// HBM residency (the records are in HBM), head groups above 1, more than
    /// [`crate::cache::MAX_GATHER_THREADS`] threads, a change while a step is being captured,
    /// a pinned allocation or a thread that fails (typed); a driver failure waiting for the
    /// stream.
    pub fn set_host_gather(&mut self, threads: usize) -> Result<()> {
        crate::cache::check_host_gather(&self.cfg, threads, self.groups)?;
        if threads == self.host_gather() {
            return Ok(());
        }
        if self.capturing.is_some() {
            // Changing it drains the stream, which a capture forbids.
            return Err(CudaError::invalid(
                "host gather",
                "set while a decode step is being captured (set it before `capture`)",
            ));
        }
        // Drains the stream, then stops the old threads (a graph captured with them is stale).
        self.settings += 1;
        self.gather = None;
        if threads == 0 {
            return Ok(());
        }
        let s = self.cfg.shape;
        let cap = self.cfg.max_batch * s.kv_heads * self.work.umax;
        let rec_bytes = 4 * s.dim;
        let chunks = cap.div_ceil(crate::host_gather::GATHER_CHUNK);
        let zeroed = |bytes: usize, what: &'static str| -> Result<HostBuf> {
            let mut h = HostBuf::new(bytes, what)?;
            h.as_mut_bytes().fill(0);
            Ok(h)
        };
        let mailbox = zeroed(crate::host_gather::MAILBOX_WORDS * 4, "host-gather mailbox")?;
        let done = zeroed(chunks * 4, "host-gather marks")?;
        let list = zeroed(cap * 8, "host-gather list")?;
        let staging = zeroed(cap * rec_bytes, "host-gather staging")?;
        let gstate = DevBuf::zeroed(16, "host-gather state")?;
        let gdst = DevBuf::zeroed(cap * 4, "host-gather rows")?;
        // Each layer's records: in the page pool after the key sections, or their own pool.
        let records_at = self.layout.records_at() as usize;
        let bases = (0..s.layers)
            .map(|l| match (self.rec_pools.get(l), &self.pools[l]) {
                (Some(Mem::Host(r)), _) => Ok((r.ptr as usize, r.bytes)),
                (None, Mem::Host(p)) => Ok((
                    p.ptr as usize + records_at,
                    p.bytes.saturating_sub(records_at),
                )),
                _ => Err(CudaError::invalid(
                    "host gather",
                    "the K|V records are not in host memory",
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: the buffers have the sizes Shared::new asks for, are pinned (never moved),
        // and outlive the threads (GatherState drops them after joining); the bases are the
        // records pools' host mappings, which live as long as the cache.
        let shared = unsafe {
            crate::host_gather::Shared::new(
                mailbox.ptr as *const u32,
                done.ptr as *mut u32,
                list.ptr as *const u64,
                staging.ptr,
                cap,
                rec_bytes,
                bases,
            )
        };
        self.gather = Some(GatherState {
            threads: crate::host_gather::HostGather::start(shared, threads)?,
            mailbox,
            done,
            list,
            staging,
            gstate,
            gdst,
            cap,
            stream: self.stream.clone(),
        });
        Ok(())
    }

    /// The share of the row fetch's misses the host gather brings, in percent (1 to 100; 100,
    /// the default, is every miss): the others the fetch reads itself while the host threads
    /// copy, so the two reads (one bound by the IOMMU's translations, the other by the host's
    /// cores) run at once (docs/SPEC.md §6.1, "Host gather"). Which misses are the host's is a
    /// fixed hash of the union row's index. It takes effect while the gather is on, and the
    /// outputs are the same bits for every share.
    ///
    /// # Errors
    /// A share of 0 or above 100, or a change while a step is being captured (typed).
    pub fn set_host_gather_share(&mut self, percent: u32) -> Result<()> {
        crate::cache::check_host_gather_share(percent)?;
        if percent == self.gather_share {
            return Ok(());
        }
        if self.capturing.is_some() {
            return Err(CudaError::invalid(
                "host gather share",
                "set while a decode step is being captured (set it before `capture`)",
            ));
        }
        self.settings += 1;
        self.gather_share = percent;
        Ok(())
    }

    /// The setting of [`PagedCache::set_host_gather_share`], in percent.
    pub fn host_gather_share(&self) -> u32 {
        self.gather_share
    }

    /// The setting of [`PagedCache::set_host_gather`]: its threads, 0 when off.
    pub fn host_gather(&self) -> usize {
        self.gather.as_ref().map_or(0, |g| g.threads.threads())
    }

    /// What the host gather served since it was set, with the device's fault counts: listed
    /// records past the list's capacity and chunks whose marks did not come within 2 s (both
    /// 0 in a correct run; a nonzero count means those rows are wrong). `None` when off.
    ///
    /// # Errors
    /// A driver failure reading the device counters (waits for the stream).
    pub fn host_gather_stats(&self) -> Result<Option<crate::host_gather::HostGatherReport>> {
        let Some(g) = &self.gather else {
            return Ok(None);
        };
        self.sync()?;
        let mut st = [0u32; 4];
        // SAFETY: the state holds 4 u32; the stream is idle.
        unsafe { result::memcpy_dtoh_sync(&mut st, g.gstate.ptr) }
            .map_err(drv("read host-gather state"))?;
        Ok(Some(crate::host_gather::HostGatherReport {
            threads: g.threads.threads(),
            served: g.threads.stats(),
            overflows: u64::from(st[2]),
            timeouts: u64::from(st[3]),
        }))
    }
}
