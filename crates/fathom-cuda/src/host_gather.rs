//! The host gather (docs/SPEC.md §6.1, "Host gather"): CPU threads that copy the K|V records
//! an attend's row fetch missed into a staging buffer the GPU then reads in order.
//!
//! Where the IOMMU translates device addresses, each random 512-byte read of mapped host
//! memory by the GPU costs one translation, and such reads reach about a third of the link
//! rate over a 4 GiB pool (`results/device/engine/row-sweep.txt`), while CPU cores gather the
//! same records at DRAM speed and the GPU reads the staging buffer sequentially, near the link
//! rate. With the gather on, `paged_gather_list` lists every miss of the host's share (record
//! offset, destination row), `paged_gather_publish` writes the request to the mailbox, these
//! threads copy record `j` of the list into staging slot `j` in chunks of [`GATHER_CHUNK`] and
//! mark chunk `c` done with the request's epoch while `paged_fetch` reads the other misses,
//! and `paged_gather_copy` (on a second stream, at once with the fetch) moves each chunk to its
//! rows once its mark is there (kernels/attend/fetch.cu). No host call sits between the kernels, so a
//! captured decode step replays with the gather in it.
//!
//! The protocol, whose invariants the tests below hold on plain memory:
//! - the device writes the new epoch to the pending word, then `count` and `layer`, then the
//!   epoch, each at system scope; a thread reads the epoch (acquire), then `count` and `layer`,
//!   then the pending word, and retries unless it equals the epoch (a seqlock: fields of a
//!   newer request are written after its pending epoch, so a thread that read any of them
//!   sees that newer pending word; re-reading the epoch itself would not tell);
//! - epochs only grow, and the device publishes epoch `e + 1` only after every chunk of `e`
//!   was marked `e`, so a mark equal to the current epoch is this request's, never an old one;
//! - chunks are claimed through one atomic word `(epoch << 32) | next`: a thread holding an
//!   old epoch finds the word at a newer epoch, or `next` past its chunks, and claims nothing;
//! - a record offset past its layer's pool is counted in [`GatherStats::bad_offsets`] and its
//!   slot zeroed: never a read outside the pool.
//!
//! ```
//! use fathom_cuda::host_gather::{GatherRequest, HostGatherSim};
//! // 3 threads serve requests published on plain memory, as the GPU would.
//! let pool: Vec<u8> = (0..64 * 512).map(|i| (i % 251) as u8).collect();
//! let mut sim = HostGatherSim::new(vec![pool.clone()], 512, 256, 3).unwrap();
//! let offsets: Vec<u64> = vec![5 * 512, 63 * 512, 0, 17 * 512];
//! let staged = sim.serve(&GatherRequest { layer: 0, offsets: offsets.clone() }).unwrap();
//! for (j, &o) in offsets.iter().enumerate() {
//!     assert_eq!(&staged[j * 512..][..512], &pool[o as usize..][..512]);
//! }
//! ```

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{CudaError, Result};

/// Records per chunk: one claim, one copy and one done mark (kernels/attend/fetch.cu `GATHER_CHUNK`).
pub const GATHER_CHUNK: usize = 32;

/// Records a thread's prefetches run ahead of its copies (DRAM latency over a record's copy).
const PREFETCH: usize = 8;

/// The mailbox's words (`u32`): the epoch, the request's record count, its layer, and the
/// epoch being written (equal to the epoch once a request is whole).
const MB_EPOCH: usize = 0;
const MB_COUNT: usize = 1;
const MB_LAYER: usize = 2;
const MB_PENDING: usize = 3;
/// Words of the mailbox.
pub(crate) const MAILBOX_WORDS: usize = 4;

/// How long a thread spins on the mailbox after its last request before it polls it every
/// [`IDLE_POLL`] instead: long enough to stay hot between the layers of a decode step.
const SPIN_WINDOW: Duration = Duration::from_millis(20);
const IDLE_POLL: Duration = Duration::from_micros(200);

/// Requests and records the threads served, and offsets they refused, since the start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GatherStats {
    /// Requests (attends) in which a thread copied at least one chunk, summed over threads.
    pub requests: u64,
    /// Records copied.
    pub records: u64,
    /// Record offsets past their layer's pool (the slot was zeroed instead).
    pub bad_offsets: u64,
    /// Nanoseconds the threads spent copying chunks, summed over threads (records over this
    /// is the copy rate of one thread).
    pub copy_ns: u64,
    /// Nanoseconds from a request's epoch being seen to its last chunk's mark, summed over
    /// requests (as the thread that marked the last chunk saw it).
    pub request_ns: u64,
    /// Requests whose every chunk was marked (the count `request_ns` sums over).
    pub completed: u64,
}

/// The host gather's counts ([`crate::api::KvCache::host_gather_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostGatherReport {
    /// Threads serving.
    pub threads: usize,
    /// What they served.
    pub served: GatherStats,
    /// Misses listed past the list's capacity (left unfetched: a fault).
    pub overflows: u64,
    /// Chunks whose marks did not come within the device's 2 s wait (a fault).
    pub timeouts: u64,
}

impl HostGatherReport {
    /// Every fault counted since the start: list overflows, marks past the timeout and
    /// refused offsets. A run with any is not to be trusted (some rows were zeroed or left
    /// unwritten), so its callers fail rather than report it.
    ///
    /// ```
    /// use fathom_cuda::host_gather::{GatherStats, HostGatherReport};
    /// let mut r = HostGatherReport { threads: 2, ..Default::default() };
    /// assert_eq!(r.faults(), 0);
    /// r.timeouts = 1;
    /// r.served = GatherStats { bad_offsets: 2, ..Default::default() };
    /// assert_eq!(r.faults(), 3);
    /// ```
    pub fn faults(&self) -> u64 {
        self.overflows + self.timeouts + self.served.bad_offsets
    }

    /// What the gather did between `earlier` and this report of the same cache: the faults
    /// counted in between, the mean wall time of a request from the mailbox to its last mark,
    /// and the records one thread copied per second while copying (`None` where nothing was
    /// served or completed). The one rule `offload-bench` and `decode-bench` report by.
    ///
    /// ```
    /// use fathom_cuda::host_gather::{GatherStats, HostGatherReport};
    /// let a = HostGatherReport { threads: 2, ..Default::default() };
    /// let mut z = a;
    /// z.served = GatherStats {
    ///     requests: 4, records: 8_000, copy_ns: 2_000_000, request_ns: 600_000,
    ///     completed: 3, ..Default::default()
    /// };
    /// let d = z.since(&a);
    /// assert_eq!((d.faults, d.request_us, d.mrows_per_thread_s), (0, Some(200.0), Some(4.0)));
    /// assert_eq!(a.since(&a).request_us, None);
    /// ```
    pub fn since(&self, earlier: &HostGatherReport) -> GatherDelta {
        let (a, z) = (&earlier.served, &self.served);
        let requests = z.requests.saturating_sub(a.requests);
        let records = z.records.saturating_sub(a.records);
        let done = z.completed.saturating_sub(a.completed);
        let copy_ns = z.copy_ns.saturating_sub(a.copy_ns);
        GatherDelta {
            faults: self.faults().saturating_sub(earlier.faults()),
            request_us: (requests > 0 && done > 0)
                .then(|| z.request_ns.saturating_sub(a.request_ns) as f64 / 1e3 / done as f64),
            mrows_per_thread_s: (records > 0 && copy_ns > 0)
                .then(|| records as f64 / (copy_ns as f64 / 1e9) / 1e6),
        }
    }
}

/// The host gather's work between two reports ([`HostGatherReport::since`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GatherDelta {
    /// Faults counted in between (list overflows, marks past the timeout, refused offsets).
    pub faults: u64,
    /// Mean microseconds from a request's epoch being seen to its last chunk's mark.
    pub request_us: Option<f64>,
    /// Millions of records one thread copied per second of copying.
    pub mrows_per_thread_s: Option<f64>,
}

/// What the threads share: pointers into memory the device (or a test) also writes.
pub(crate) struct Shared {
    /// `[MAILBOX_WORDS]` u32.
    mailbox: *const u32,
    /// `[cap / GATHER_CHUNK]` u32 done marks.
    done: *mut u32,
    /// `[cap]` u64 record offsets from the layer's base.
    list: *const u64,
    /// `[cap][rec_bytes]`.
    staging: *mut u8,
    cap: usize,
    rec_bytes: usize,
    /// Per layer: the records' base address and the bytes from it the records pool holds.
    bases: Vec<(usize, usize)>,
    claim: AtomicU64,
    quit: AtomicBool,
    requests: AtomicU64,
    records: AtomicU64,
    bad: AtomicU64,
    copy_ns: AtomicU64,
    request_ns: AtomicU64,
    completed: AtomicU64,
    /// Chunks marked in the current epoch: `(epoch << 32) | marked`.
    marked: AtomicU64,
}

// SAFETY: the pointers are to pinned (or test) memory that outlives the threads (the owner
// joins them before freeing it); every shared word is accessed atomically, and each staging
// slot is written by the one thread that claimed its chunk.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// # Safety
    /// `mailbox` holds [`MAILBOX_WORDS`] u32, `done` `cap / GATHER_CHUNK` u32, `list` `cap`
    /// u64 and `staging` `cap · rec_bytes` bytes, each aligned; every `(base, len)` is
    /// readable memory; all stay valid until the [`HostGather`] made of this is dropped.
    pub(crate) unsafe fn new(
        mailbox: *const u32,
        done: *mut u32,
        list: *const u64,
        staging: *mut u8,
        cap: usize,
        rec_bytes: usize,
        bases: Vec<(usize, usize)>,
    ) -> Self {
        // SAFETY: the caller guarantees the mailbox.
        let epoch = unsafe { atomic32(mailbox as *mut u32, MB_EPOCH) }.load(Ordering::Acquire);
        Shared {
            mailbox,
            done,
            list,
            staging,
            cap,
            rec_bytes,
            bases,
            claim: AtomicU64::new(u64::from(epoch) << 32),
            quit: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            records: AtomicU64::new(0),
            bad: AtomicU64::new(0),
            copy_ns: AtomicU64::new(0),
            request_ns: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            marked: AtomicU64::new(u64::from(epoch) << 32),
        }
    }

    fn mb(&self, word: usize) -> u32 {
        // SAFETY: `mailbox` holds MAILBOX_WORDS aligned u32 (Shared::new's contract).
        unsafe { atomic32(self.mailbox as *mut u32, word) }.load(Ordering::Acquire)
    }

    /// A consistent request newer than `seen`: (epoch, count, layer).
    fn request(&self, seen: u32) -> Option<(u32, usize, usize)> {
        let e = self.mb(MB_EPOCH);
        if e == seen {
            return None;
        }
        let (count, layer) = (self.mb(MB_COUNT) as usize, self.mb(MB_LAYER) as usize);
        (self.mb(MB_PENDING) == e).then_some((e, count.min(self.cap), layer))
    }

    /// The next chunk of epoch `e` (of `chunks`), or none left for this thread.
    fn claim(&self, e: u32, chunks: usize) -> Option<usize> {
        take(&self.claim, e, chunks)
    }

    /// Counts one more chunk of epoch `e` marked; returns the epoch's marked chunks so far.
    fn mark_one(&self, e: u32) -> usize {
        take(&self.marked, e, usize::MAX).map_or(0, |i| i + 1)
    }

    /// Copies chunk `c` of a request of `count` records at `layer` into its staging slots
    /// (the caller counts it, then marks it with [`Shared::mark_done`]).
    fn copy_chunk(&self, c: usize, count: usize, layer: usize) {
        let (j0, j1) = (c * GATHER_CHUNK, ((c + 1) * GATHER_CHUNK).min(count));
        let rb = self.rec_bytes;
        let (base, len) = self.bases.get(layer).copied().unwrap_or((0, 0));
        let mut bad = 0;
        // The first PREFETCH records' lines, then each record's PREFETCH ahead as it goes.
        for j in j0..(j0 + PREFETCH).min(j1) {
            // SAFETY: j < count ≤ cap (Shared::new's contract); a prefetch never faults.
            let o = unsafe { std::ptr::read_volatile(self.list.add(j)) } as usize;
            prefetch(base.wrapping_add(o), rb);
        }
        for j in j0..j1 {
            // SAFETY: j < count ≤ cap: the list and staging hold it (Shared::new's contract).
            let off = unsafe { std::ptr::read_volatile(self.list.add(j)) } as usize;
            if let Some(k) = j.checked_add(PREFETCH).filter(|&k| k < j1) {
                // SAFETY: as above; the offset is only read here, and a prefetch of any
                // address is harmless.
                let ahead = unsafe { std::ptr::read_volatile(self.list.add(k)) } as usize;
                prefetch(base.wrapping_add(ahead), rb);
            }
            // SAFETY: staging slot j is this thread's (its chunk was claimed by it alone).
            let dst = unsafe { std::slice::from_raw_parts_mut(self.staging.add(j * rb), rb) };
            if off.checked_add(rb).is_some_and(|end| end <= len) {
                // SAFETY: base..base + len is readable (Shared::new's contract).
                let src = unsafe { std::slice::from_raw_parts((base + off) as *const u8, rb) };
                dst.copy_from_slice(src);
            } else {
                dst.fill(0);
                bad += 1;
            }
        }
        if bad > 0 {
            self.bad.fetch_add(bad, Ordering::Relaxed);
        }
        self.records.fetch_add((j1 - j0) as u64, Ordering::Relaxed);
    }

    /// Marks chunk `c` done with epoch `e` (release: its staging slots and every count made
    /// before it are visible to whoever sees the mark).
    fn mark_done(&self, e: u32, c: usize) {
        // SAFETY: c < chunks ≤ cap / GATHER_CHUNK (rounded up): `done` holds it.
        unsafe { atomic32(self.done, c) }.store(e, Ordering::Release);
    }
}

/// The rule of an epoch-tagged counter `(epoch << 32) | next`: takes index `next` of epoch `e`
/// (below `limit`) and bumps it; the first take of a newer epoch starts it at 0; a taker of an
/// older epoch, or one past the limit, takes nothing.
fn take(word: &AtomicU64, e: u32, limit: usize) -> Option<usize> {
    let mut cur = word.load(Ordering::Acquire);
    loop {
        let (ce, next) = ((cur >> 32) as u32, (cur & 0xffff_ffff) as usize);
        let (want, got) = if ce == e {
            if next >= limit {
                return None;
            }
            (cur + 1, next)
        } else if e.wrapping_sub(ce) as i32 > 0 {
            if limit == 0 {
                // An empty request has nothing to take (a take here would mark chunk 0 with
                // an epoch the device never waits for, over a newer request's mark).
                return None;
            }
            ((u64::from(e) << 32) | 1, 0)
        } else {
            return None;
        };
        match word.compare_exchange_weak(cur, want, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(got),
            Err(now) => cur = now,
        }
    }
}

/// The `i`-th u32 at `p` as an atomic.
///
/// # Safety
/// `p.add(i)` is a live, aligned u32 for the duration of the use.
unsafe fn atomic32<'a>(p: *mut u32, i: usize) -> &'a AtomicU32 {
    // SAFETY: the caller guarantees the word; AtomicU32 has u32's layout.
    unsafe { AtomicU32::from_ptr(p.add(i)) }
}

/// Prefetches the cache lines of `bytes` at `addr` (a hint; any address is allowed).
#[inline]
fn prefetch(addr: usize, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..bytes).step_by(64) {
        // SAFETY: prefetch instructions do not fault on any address.
        unsafe {
            std::arch::x86_64::_mm_prefetch(
                addr.wrapping_add(line) as *const i8,
                std::arch::x86_64::_MM_HINT_T0,
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (addr, bytes);
}

fn worker(s: &Shared) {
    let mut seen = (s.claim.load(Ordering::Acquire) >> 32) as u32;
    let mut last = Instant::now();
    loop {
        if s.quit.load(Ordering::Acquire) {
            return;
        }
        let Some((e, count, layer)) = s.request(seen) else {
            if last.elapsed() < SPIN_WINDOW {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(IDLE_POLL);
            }
            continue;
        };
        seen = e;
        last = Instant::now();
        let chunks = count.div_ceil(GATHER_CHUNK);
        let mut any = false;
        // Every count of a chunk is made before its done mark: the device publishes the next
        // epoch only after seeing every mark, so no count of epoch `e` can land in `e + 1`'s
        // (where `mark_one` would drop it), and a reader who saw the marks sees the counts.
        while let Some(c) = s.claim(e, chunks) {
            if !any {
                s.requests.fetch_add(1, Ordering::Relaxed);
                any = true;
            }
            let t = Instant::now();
            s.copy_chunk(c, count, layer);
            s.copy_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if s.mark_one(e) == chunks {
                s.request_ns
                    .fetch_add(last.elapsed().as_nanos() as u64, Ordering::Relaxed);
                s.completed.fetch_add(1, Ordering::Relaxed);
            }
            s.mark_done(e, c);
        }
    }
}

/// The threads of one cache's host gather; dropping it stops and joins them.
pub(crate) struct HostGather {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl HostGather {
    /// Starts `threads` threads serving `shared`.
    ///
    /// # Errors
    /// `threads` of 0, or a thread the OS would not start (typed).
    pub(crate) fn start(shared: Shared, threads: usize) -> Result<Self> {
        if threads == 0 {
            return Err(CudaError::invalid(
                "host gather threads",
                "0 (0 turns the gather off)",
            ));
        }
        let shared = Arc::new(shared);
        let mut g = HostGather {
            shared,
            threads: Vec::with_capacity(threads),
        };
        for i in 0..threads {
            let s = Arc::clone(&g.shared);
            let t = std::thread::Builder::new()
                .name(format!("fathom-gather-{i}"))
                .spawn(move || worker(&s))
                .map_err(|e| {
                    CudaError::invalid("host gather threads", format!("thread {i}: {e}"))
                })?;
            g.threads.push(t);
        }
        Ok(g)
    }

    /// Threads serving.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn threads(&self) -> usize {
        self.threads.len()
    }

    /// What the threads served.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn stats(&self) -> GatherStats {
        let s = &self.shared;
        GatherStats {
            requests: s.requests.load(Ordering::Relaxed),
            records: s.records.load(Ordering::Relaxed),
            bad_offsets: s.bad.load(Ordering::Relaxed),
            copy_ns: s.copy_ns.load(Ordering::Relaxed),
            request_ns: s.request_ns.load(Ordering::Relaxed),
            completed: s.completed.load(Ordering::Relaxed),
        }
    }
}

impl Drop for HostGather {
    fn drop(&mut self) {
        self.shared.quit.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// One request as the device would publish it: a layer and its record offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatherRequest {
    /// Layer whose records pool the offsets index.
    pub layer: usize,
    /// Byte offsets of the records from the pool's start.
    pub offsets: Vec<u64>,
}

impl std::fmt::Debug for HostGatherSim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostGatherSim")
            .field("layers", &self.pools.len())
            .field("cap", &self.list.len())
            .field("rec_bytes", &self.rec_bytes)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

/// The host gather on plain memory, with this value in the device's place: it publishes a
/// request as `paged_gather_publish` does and waits for every chunk's mark as
/// `paged_gather_copy` does. For tests and for reading the protocol; the cache drives the real
/// one from kernels.
pub struct HostGatherSim {
    // Declared first: dropped (threads joined) before the memory they read.
    gather: Option<HostGather>,
    pools: Vec<Vec<u8>>,
    mailbox: Vec<u32>,
    done: Vec<u32>,
    list: Vec<u64>,
    staging: Vec<u8>,
    rec_bytes: usize,
    epoch: u32,
}

impl HostGatherSim {
    /// `threads` threads over `pools` (one per layer), records of `rec_bytes`, requests of at
    /// most `cap` records.
    ///
    /// # Errors
    /// `threads` of 0, `rec_bytes` or `cap` of 0, or a thread that would not start.
    pub fn new(pools: Vec<Vec<u8>>, rec_bytes: usize, cap: usize, threads: usize) -> Result<Self> {
        if rec_bytes == 0 || cap == 0 {
            return Err(CudaError::invalid(
                "host gather",
                format!("records of {rec_bytes} bytes, capacity {cap}: both must be positive"),
            ));
        }
        let mut sim = HostGatherSim {
            gather: None,
            pools,
            mailbox: vec![0; MAILBOX_WORDS],
            done: vec![0; cap.div_ceil(GATHER_CHUNK)],
            list: vec![0; cap],
            staging: vec![0; cap * rec_bytes],
            rec_bytes,
            epoch: 0,
        };
        let bases = sim
            .pools
            .iter()
            .map(|p| (p.as_ptr() as usize, p.len()))
            .collect();
        // SAFETY: the vectors have the sizes Shared::new asks for, are never reallocated, and
        // outlive `gather` (dropped first).
        let shared = unsafe {
            Shared::new(
                sim.mailbox.as_ptr(),
                sim.done.as_mut_ptr(),
                sim.list.as_ptr(),
                sim.staging.as_mut_ptr(),
                cap,
                rec_bytes,
                bases,
            )
        };
        sim.gather = Some(HostGather::start(shared, threads)?);
        Ok(sim)
    }

    /// Publishes `req`, waits (at most 10 s) for every chunk's mark, and returns the staged
    /// records (`offsets.len() · rec_bytes` bytes).
    ///
    /// # Errors
    /// A request past the capacity, or marks that did not come within 10 s.
    pub fn serve(&mut self, req: &GatherRequest) -> Result<Vec<u8>> {
        let n = req.offsets.len();
        if n > self.list.len() {
            return Err(CudaError::invalid(
                "host gather request",
                format!("{n} records past the capacity {}", self.list.len()),
            ));
        }
        for (j, &o) in req.offsets.iter().enumerate() {
            // SAFETY: j < cap; the threads read the list only after the epoch below.
            unsafe { std::ptr::write_volatile(self.list.as_mut_ptr().add(j), o) };
        }
        self.epoch = self.epoch.wrapping_add(1);
        let e = self.epoch;
        let mb = self.mailbox.as_mut_ptr();
        // SAFETY: the mailbox holds MAILBOX_WORDS words.
        unsafe {
            atomic32(mb, MB_PENDING).store(e, Ordering::Release);
            atomic32(mb, MB_COUNT).store(n as u32, Ordering::Release);
            atomic32(mb, MB_LAYER).store(req.layer as u32, Ordering::Release);
            atomic32(mb, MB_EPOCH).store(e, Ordering::Release);
        }
        let t0 = Instant::now();
        for c in 0..n.div_ceil(GATHER_CHUNK) {
            // SAFETY: c < done.len().
            let mark = unsafe { atomic32(self.done.as_mut_ptr(), c) };
            while mark.load(Ordering::Acquire) != e {
                if t0.elapsed() > Duration::from_secs(10) {
                    return Err(CudaError::invalid(
                        "host gather",
                        format!("chunk {c} of epoch {e} not marked within 10 s"),
                    ));
                }
                std::hint::spin_loop();
            }
        }
        Ok(self.staging[..n * self.rec_bytes].to_vec())
    }

    /// What the threads served.
    pub fn stats(&self) -> GatherStats {
        self.gather
            .as_ref()
            .map(HostGather::stats)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn pools(layers: usize, records: usize, rb: usize, seed: u64) -> Vec<Vec<u8>> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..layers)
            .map(|_| (0..records * rb).map(|_| rng.gen()).collect())
            .collect()
    }

    /// Every request of random sizes (0 to the capacity, chunk edges included) and layers is
    /// staged exactly, record for record, by 1, 2 and 5 threads, over hundreds of epochs
    /// published back to back (each only after the previous one's marks, as the device does).
    #[test]
    fn every_request_is_staged_exactly() {
        for (threads, rb, cap, seed) in [(1, 64, 100, 1), (2, 512, 257, 2), (5, 256, 1024, 3)] {
            let records = 300;
            let p = pools(3, records, rb, seed);
            let mut sim = HostGatherSim::new(p.clone(), rb, cap, threads).unwrap();
            let mut rng = StdRng::seed_from_u64(seed + 10);
            let mut sizes: Vec<usize> =
                vec![0, 1, GATHER_CHUNK - 1, GATHER_CHUNK, GATHER_CHUNK + 1, cap];
            sizes.extend((0..300).map(|_| rng.gen_range(0..=cap)));
            let (mut total, mut nonempty) = (0, 0);
            for n in sizes {
                let layer = rng.gen_range(0..3);
                let offsets: Vec<u64> = (0..n)
                    .map(|_| (rng.gen_range(0..records) * rb) as u64)
                    .collect();
                let staged = sim
                    .serve(&GatherRequest {
                        layer,
                        offsets: offsets.clone(),
                    })
                    .unwrap();
                for (j, &o) in offsets.iter().enumerate() {
                    assert_eq!(
                        &staged[j * rb..][..rb],
                        &p[layer][o as usize..][..rb],
                        "{threads} threads, record {j} of {n} at layer {layer}"
                    );
                }
                total += n as u64;
                nonempty += u64::from(n > 0);
                // The counts are made before the marks, so they are exact as soon as the
                // request is served (read after every request: a count made after its mark
                // would be missed here, or dropped into the next epoch).
                let st = sim.stats();
                assert_eq!(
                    (st.records, st.bad_offsets, st.completed),
                    (total, 0, nonempty),
                    "{threads} threads: each request completed once, after {n} records"
                );
                assert!(
                    (nonempty..=nonempty * threads as u64).contains(&st.requests),
                    "{threads} threads: {} requests served for {nonempty}",
                    st.requests
                );
            }
        }
    }

    /// An offset whose record would end past its pool is refused: the slot is zeroed and
    /// counted, and the records around it are still staged.
    #[test]
    fn an_offset_past_the_pool_is_zeroed_and_counted() {
        let rb = 128;
        let p = pools(1, 10, rb, 7);
        let mut sim = HostGatherSim::new(p.clone(), rb, 64, 2).unwrap();
        let offsets = vec![
            0,
            (10 * rb) as u64,
            (9 * rb + 1) as u64,
            u64::MAX - 3,
            (3 * rb) as u64,
        ];
        let staged = sim.serve(&GatherRequest { layer: 0, offsets }).unwrap();
        assert_eq!(&staged[..rb], &p[0][..rb]);
        assert!(
            staged[rb..4 * rb].iter().all(|&b| b == 0),
            "refused slots are zeroed"
        );
        assert_eq!(&staged[4 * rb..], &p[0][3 * rb..4 * rb]);
        assert_eq!(sim.stats().bad_offsets, 3);
        // A layer the gather has no pool for: every offset refused.
        let staged = sim
            .serve(&GatherRequest {
                layer: 4,
                offsets: vec![0],
            })
            .unwrap();
        assert!(staged.iter().all(|&b| b == 0));
        assert_eq!(sim.stats().bad_offsets, 4);
    }

    /// Bad settings are typed errors, and a request past the capacity is refused before any
    /// write; an idle gather stops when dropped.
    #[test]
    fn bad_settings_are_typed_errors() {
        assert!(
            HostGatherSim::new(vec![vec![0; 64]], 64, 8, 0).is_err(),
            "0 threads"
        );
        assert!(
            HostGatherSim::new(vec![vec![0; 64]], 0, 8, 1).is_err(),
            "0-byte records"
        );
        assert!(
            HostGatherSim::new(vec![vec![0; 64]], 64, 0, 1).is_err(),
            "capacity 0"
        );
        let mut sim = HostGatherSim::new(vec![vec![0; 64]], 64, 8, 2).unwrap();
        let e = sim
            .serve(&GatherRequest {
                layer: 0,
                offsets: vec![0; 9],
            })
            .unwrap_err();
        assert!(e.to_string().contains("capacity"), "{e}");
        drop(sim);
    }

    /// A request is read only whole: fields written under a newer pending epoch (the count
    /// of request 2 while the epoch still says 1) are not taken as request 1's, and the
    /// request is read once its epoch catches up (the mailbox's rule, without threads).
    #[test]
    fn a_request_being_written_is_not_read() {
        let mut mb = [0u32; MAILBOX_WORDS];
        let mut done = [0u32; 4];
        let list = [0u64; 128];
        let mut staging = vec![0u8; 128];
        let mut s = |mb: &[u32; MAILBOX_WORDS]| {
            // SAFETY: the arrays have the sizes asked for and outlive the value (dropped at
            // the end of each statement).
            unsafe {
                Shared::new(
                    mb.as_ptr(),
                    done.as_mut_ptr(),
                    list.as_ptr(),
                    staging.as_mut_ptr(),
                    128,
                    1,
                    vec![],
                )
            }
            .request(0)
        };
        mb[MB_EPOCH] = 1;
        mb[MB_PENDING] = 1;
        mb[MB_COUNT] = 40;
        assert_eq!(s(&mb), Some((1, 40, 0)), "a whole request");
        // Request 2 is being written: its count is there, its epoch not yet.
        mb[MB_PENDING] = 2;
        mb[MB_COUNT] = 100;
        mb[MB_LAYER] = 3;
        assert_eq!(s(&mb), None, "count 100 is request 2's, not request 1's");
        mb[MB_EPOCH] = 2;
        assert_eq!(s(&mb), Some((2, 100, 3)));
    }

    /// A thread holding an old epoch claims nothing of a newer one, and claims run out at the
    /// request's chunk count (the claim word's rule, without threads).
    #[test]
    fn claims_follow_the_epoch() {
        let mb = [0u32; MAILBOX_WORDS];
        let mut done = [0u32; 4];
        let list = [0u64; 128];
        let mut staging = vec![0u8; 128];
        // SAFETY: the arrays have the sizes asked for and outlive `s`.
        let s = unsafe {
            Shared::new(
                mb.as_ptr(),
                done.as_mut_ptr(),
                list.as_ptr(),
                staging.as_mut_ptr(),
                128,
                1,
                vec![],
            )
        };
        assert_eq!(
            (s.claim(1, 3), s.claim(1, 3), s.claim(1, 3), s.claim(1, 3)),
            (Some(0), Some(1), Some(2), None)
        );
        assert_eq!(s.claim(2, 0), None, "an empty request has no chunk 0");
        assert_eq!(s.claim(2, 1), Some(0), "a newer epoch starts at chunk 0");
        assert_eq!(s.claim(1, 3), None, "an old epoch claims nothing");
        assert_eq!(s.claim(2, 1), None);
    }
}
