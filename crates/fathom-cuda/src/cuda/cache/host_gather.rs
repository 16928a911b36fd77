//! The host gather (docs/SPEC.md §6.1, "Host gather"; the protocol is [`crate::host_gather`]):
//! CPU threads that bring the row fetch's misses into a pinned staging buffer.

#[allow(unused_imports)]
use super::*;

/// The host gather's threads and buffers ([`crate::cache::CacheOptions::host_gather_threads`]; host_gather.rs
/// and kernels/attend/fetch.cu give the protocol).
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
    /// Starts the host gather's `threads` CPU threads and their buffers (docs/SPEC.md §6.1,
    /// "Host gather"; [`crate::cache::CacheOptions::host_gather_threads`], checked by
    /// [`CacheConfig::validate`]): the fetch lists each record the row cache does not hold,
    /// the threads copy them into a pinned staging buffer, and the GPU reads it in order,
    /// instead of each record being a random read of mapped host memory. The outputs are the
    /// same bits either way (the same records reach the same rows).
    ///
    /// # Errors
    /// Records not in host memory; a pinned allocation or a thread that fails (typed).
    pub(super) fn start_host_gather(&mut self, threads: usize) -> Result<()> {
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

    /// [`crate::api::KvCache::host_gather_stats`].
    pub(crate) fn host_gather_stats(&self) -> Result<Option<crate::host_gather::HostGatherReport>> {
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
