//! The GPU: context, streams, the kernel-module cache, events and the link probes.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{result, CudaContext, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use rayon::prelude::*;

use super::drv;
use super::memory::{stream_upload, DevBuf, HostBuf};
use super::module::{compile_one, Kernels, KERNELS};
use crate::config::anon_huge_bytes;
use crate::config::HostPages;
use crate::error::{CudaError, Result};
use crate::types::{DeviceInfo, RowRate, RowSweep};

/// Bytes per CTA of the gather kernel.
const GATHER_CHUNK: u64 = 128 << 10;
/// Threads per CTA of the gather kernel.
const GATHER_THREADS: u32 = 512;

/// A CUDA device with its stream and a cache of NVRTC-compiled modules.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    info: DeviceInfo,
    arch: &'static str,
    kernels: Mutex<Option<Arc<Kernels>>>,
}

/// One entry of the gather's run list (`struct Run` in common.cuh): a byte range at the same
/// offset of its source and its destination.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) off: u64,
    pub(crate) len: u64,
}
const _: () = assert!(std::mem::size_of::<Run>() == 16);

/// The row sweep's access patterns and, for pairs, the distance of a pair's second row from its
/// first (a random 4 KiB-aligned offset): back to back, independent random rows, and random
/// pairs 1 KiB and 2 KiB apart (one 4 KiB page; 1 KiB is two tokens' records at D = 128),
/// 4 KiB apart (the next page) and 64 KiB apart (a control). Where the second row of a pair
/// costs no access of its own, the bound of random reads is as coarse as that distance (a 4 KiB
/// translation, or a larger DRAM row). A pair closer than a row would overlap: not run.
const ROW_PATTERNS: [(&str, u64); 6] = [
    ("sequential", 0),
    ("random", 0),
    ("pairs+1k", 1024),
    ("pairs+2k", 2048),
    ("pairs+4k", 4096),
    ("pairs+64k", 65536),
];

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

fn driver_library_present() -> std::result::Result<(), String> {
    let names = ["libcuda.so.1", "libcuda.so"];
    let mut errs = Vec::new();
    for n in names {
        // SAFETY: loading the system's CUDA driver library runs its initialisers, which is
        // what cudarc does next anyway; the handle is dropped at once.
        match unsafe { libloading::Library::new(n) } {
            Ok(_) => return Ok(()),
            Err(e) => errs.push(format!("{n}: {e}")),
        }
    }
    Err(format!(
        "CUDA driver library not found ({})",
        errs.join("; ")
    ))
}

impl Gpu {
    /// Opens device `ordinal`: loads the driver, creates the context and one stream.
    ///
    /// # Errors
    /// [`CudaError::NoDevice`] when the driver library is missing, fails to initialise or has
    /// no such device (with the driver's message).
    pub(crate) fn open(ordinal: usize) -> Result<Self> {
        driver_library_present().map_err(|message| CudaError::NoDevice { message })?;
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|p| CudaError::NoDevice {
                message: p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "driver initialisation panicked".into()),
            })?
            .map_err(|e| CudaError::NoDevice {
                message: e.to_string(),
            })?;
        // One stream, raw pointers: no per-buffer event tracking.
        // SAFETY: this crate never shares CudaSlices across streams.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv("new_stream"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("compute_capability"))?;
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let mut driver_version = 0i32;
        // SAFETY: writes one int.
        let _ = unsafe { sys::cuDriverGetVersion(&mut driver_version) };
        let info = DeviceInfo {
            name: ctx.name().map_err(drv("device name"))?,
            compute_capability: (major, minor),
            total_mem_bytes: ctx.total_mem().map_err(drv("total_mem"))? as u64,
            multiprocessors: ctx
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(drv("attribute"))?,
            driver_version,
            arch: arch.to_string(),
        };
        Ok(Gpu {
            ctx,
            stream,
            info,
            arch,
            kernels: Mutex::new(None),
        })
    }

    /// The device description.
    pub(crate) fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The stream every session and cache of this device launches on, in order: enqueue
    /// the model's own kernels on it (or synchronise with it) to order them with appends
    /// and attends.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Compiles `src` (a `.cu` source; `#include "common.cuh"` is inlined) with NVRTC for this
    /// device's architecture and `options` (`-D…`, `--fmad=false`, …), and loads the module:
    /// how a crate built on this one runs its own kernels with no toolkit at build time.
    ///
    /// # Errors
    /// [`CudaError::Compile`] with the compiler log; [`CudaError::NoDevice`] without libnvrtc;
    /// a driver failure loading the module.
    pub fn load_module(
        &self,
        name: &'static str,
        src: &str,
        options: Vec<String>,
    ) -> Result<Arc<CudaModule>> {
        let ptx = super::compile_one(self.arch, name, src, options)?;
        self.ctx.load_module(ptx).map_err(drv("load_module"))
    }

    pub(crate) fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn arch(&self) -> &'static str {
        self.arch
    }

    /// The device's own kernels, compiled and loaded at first use.
    pub(crate) fn kernels(&self) -> Result<Arc<Kernels>> {
        let mut cache = self.kernels.lock().expect("kernel cache poisoned");
        if let Some(k) = cache.as_ref() {
            return Ok(k.clone());
        }
        let (name, src) = KERNELS[1];
        let ptx = compile_one(self.arch, name, src, Vec::new())?;
        let m = self.ctx.load_module(ptx).map_err(drv("load_module"))?;
        let k = Arc::new(Kernels {
            gather_runs: m
                .load_function("gather_runs")
                .map_err(drv("load_function"))?,
        });
        *cache = Some(k.clone());
        Ok(k)
    }

    fn event(&self) -> Result<Event> {
        Event::new()
    }

    /// GPU time of the work `enqueue` puts on the stream (an event pair around it, then a
    /// synchronisation), ms.
    fn timed_ms(&self, enqueue: impl FnOnce() -> Result<()>) -> Result<f64> {
        let (a, b) = (self.event()?, self.event()?);
        a.record(&self.stream)?;
        enqueue()?;
        b.record(&self.stream)?;
        self.stream.synchronize().map_err(drv("synchronize"))?;
        a.elapsed_ms(&b)
    }

    /// Host-to-device bandwidth of one pinned `cuMemcpyHtoDAsync` of `bytes` (best of 3), GB/s.
    ///
    /// # Errors
    /// Allocation or driver failures.
    pub(crate) fn h2d_bandwidth(&self, bytes: usize) -> Result<f64> {
        let mut h = HostBuf::new(bytes, "H2D bandwidth source")?;
        h.as_mut_bytes()
            .par_chunks_mut(1 << 20)
            .enumerate()
            .for_each(|(i, c)| c.fill(i as u8));
        let d = DevBuf::new(bytes, "H2D bandwidth destination")?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            best = best.min(self.timed_ms(|| {
                // SAFETY: both buffers hold `bytes` bytes and outlive the synchronisation in
                // `timed_ms`.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        d.ptr,
                        h.ptr as *const c_void,
                        bytes,
                        self.stream.cu_stream(),
                    )
                }
                .result()
                .map_err(drv("cuMemcpyHtoDAsync"))
            })?);
        }
        Ok(bytes as f64 / (best * 1e-3) / 1e9)
    }

    /// Bandwidth of the zero-copy gather kernel copying one run of `bytes` from mapped pinned
    /// memory to HBM (best of 3), GB/s.
    ///
    /// # Errors
    /// Allocation, compile or driver failures.
    pub(crate) fn gather_bandwidth(&self, bytes: usize) -> Result<f64> {
        let k = self.kernels()?;
        let mut h = HostBuf::new(bytes, "gather bandwidth source")?;
        h.as_mut_bytes()
            .par_chunks_mut(1 << 20)
            .enumerate()
            .for_each(|(i, c)| c.fill(i as u8));
        let d = DevBuf::new(bytes, "gather bandwidth destination")?;
        let runs = DevBuf::from_slice(
            &[Run {
                off: 0,
                len: bytes as u64,
            }],
            "runs",
        )?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            best =
                best.min(self.timed_ms(|| {
                    self.launch_gather(&k, h.dptr, d.ptr, runs.ptr, 1, bytes as u64)
                })?);
        }
        Ok(bytes as f64 / (best * 1e-3) / 1e9)
    }

    /// Bandwidth of the zero-copy gather kernel over runs of `run_bytes` (a multiple of 16)
    /// spaced `2·run_bytes` apart, `total_bytes` gathered in all, GB/s: how long a run must be
    /// to move at link rate (the paged store's page size follows from it, docs/SPEC.md §6.1).
    ///
    /// # Errors
    /// A run length that is zero or not a multiple of 16; allocation, compile or driver
    /// failures.
    pub(crate) fn gather_run_bandwidth(&self, run_bytes: usize, total_bytes: usize) -> Result<f64> {
        if run_bytes == 0 || run_bytes % 16 != 0 || total_bytes < run_bytes {
            return Err(CudaError::invalid(
                "run_bytes",
                format!("{run_bytes} (want a positive multiple of 16 ≤ {total_bytes})"),
            ));
        }
        let k = self.kernels()?;
        let nruns = total_bytes / run_bytes;
        let span = nruns * run_bytes * 2;
        let mut h = HostBuf::new(span, "gather sweep source")?;
        h.as_mut_bytes()
            .par_chunks_mut(1 << 20)
            .enumerate()
            .for_each(|(i, c)| c.fill(i as u8));
        let d = DevBuf::new(span, "gather sweep destination")?;
        let list: Vec<Run> = (0..nruns)
            .map(|i| Run {
                off: (2 * i * run_bytes) as u64,
                len: run_bytes as u64,
            })
            .collect();
        let runs = DevBuf::from_slice(&list, "runs")?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            best = best.min(self.timed_ms(|| {
                self.launch_gather(&k, h.dptr, d.ptr, runs.ptr, nruns, run_bytes as u64)
            })?);
        }
        Ok((nruns * run_bytes) as f64 / (best * 1e-3) / 1e9)
    }

    /// The zero-copy gather over rows of `row_bytes` drawn at random (and back to back, as a
    /// control; and in random pairs 1, 2, 4 and 64 KiB apart) from each span of `spans` bytes
    /// of host memory backed as `pages` says, with
    /// `rows` rows per launch: whether the union fetch's random record reads are bound by the
    /// link or by address translation (docs/SPEC.md §6.1, "Host pages"). One allocation of the
    /// largest span; best of three launches per point, each with a fresh draw of `seed`'s
    /// stream.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for a row size that is not a positive multiple of 16, an
    /// empty list or a span shorter than a row; allocation, compile or driver failures.
    pub(crate) fn row_gather_sweep(
        &self,
        pages: HostPages,
        row_bytes: usize,
        spans: &[usize],
        rows: &[usize],
        seed: u64,
    ) -> Result<RowSweep> {
        use rand::{Rng, SeedableRng};
        if row_bytes == 0 || row_bytes % 16 != 0 {
            return Err(CudaError::invalid(
                "row_bytes",
                format!("{row_bytes} (want a positive multiple of 16)"),
            ));
        }
        let (Some(&max_span), Some(&max_rows)) = (spans.iter().max(), rows.iter().max()) else {
            return Err(CudaError::invalid(
                "spans, rows",
                "both lists must be non-empty",
            ));
        };
        if spans.iter().any(|&s| s < row_bytes) || rows.contains(&0) {
            return Err(CudaError::invalid(
                "spans, rows",
                format!("every span must hold a row of {row_bytes} bytes and every row count be positive"),
            ));
        }
        let k = self.kernels()?;
        let before = anon_huge_bytes();
        let t0 = std::time::Instant::now();
        let h = HostBuf::with_pages(max_span, "row sweep source", pages, |b| {
            b.par_chunks_mut(1 << 20)
                .enumerate()
                .for_each(|(i, c)| c.fill(i as u8))
        })?;
        let alloc_seconds = t0.elapsed().as_secs_f64();
        let huge_bytes = match (before, anon_huge_bytes()) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        };
        let d = DevBuf::new(max_span, "row sweep destination")?;
        let runs = DevBuf::new(max_rows * std::mem::size_of::<Run>(), "row sweep runs")?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut rates = Vec::new();
        for &span in spans {
            let slots = (span / row_bytes) as u64;
            for &n in rows {
                for (pattern, gap) in ROW_PATTERNS {
                    // A pair pattern needs room for its second row after a 4 KiB-aligned first.
                    if gap > 0
                        && (gap < row_bytes as u64 || (span as u64) < gap + row_bytes as u64 + 4096)
                    {
                        continue;
                    }
                    let mut best = f64::INFINITY;
                    for _ in 0..3 {
                        let start = rng.gen_range(0..slots);
                        let mut first = 0u64;
                        let list: Vec<Run> = (0..n as u64)
                            .map(|i| {
                                let off = match (pattern, i % 2) {
                                    ("sequential", _) => ((start + i) % slots) * row_bytes as u64,
                                    ("random", _) => rng.gen_range(0..slots) * row_bytes as u64,
                                    (_, 0) => {
                                        let pages = (span as u64 - gap - row_bytes as u64) / 4096;
                                        first = rng.gen_range(0..pages) * 4096;
                                        first
                                    }
                                    _ => first + gap,
                                };
                                Run {
                                    off,
                                    len: row_bytes as u64,
                                }
                            })
                            .collect();
                        // SAFETY: `runs` holds `max_rows >= n` runs; the last launch that
                        // read it has finished (`timed_ms` synchronises).
                        unsafe {
                            stream_upload(runs.ptr, &list, self.stream.cu_stream(), "upload runs")
                        }?;
                        best = best.min(self.timed_ms(|| {
                            self.launch_gather(&k, h.dptr, d.ptr, runs.ptr, n, row_bytes as u64)
                        })?);
                    }
                    rates.push(RowRate {
                        pattern: pattern.into(),
                        span_bytes: span as u64,
                        rows: n as u64,
                        row_bytes: row_bytes as u64,
                        gbps: (n * row_bytes) as f64 / (best * 1e-3) / 1e9,
                    });
                }
            }
        }
        Ok(RowSweep {
            pages: pages.label().into(),
            alloc_bytes: max_span as u64,
            huge_bytes,
            alloc_seconds,
            rates,
        })
    }

    fn launch_gather(
        &self,
        k: &Kernels,
        src: u64,
        dst: u64,
        runs: u64,
        nruns: usize,
        max_len: u64,
    ) -> Result<()> {
        let chunks = max_len.div_ceil(GATHER_CHUNK).max(1);
        let chunk = GATHER_CHUNK;
        let nr = nruns as u64;
        let mut b = self.stream.launch_builder(&k.gather_runs);
        b.arg(&src)
            .arg(&dst)
            .arg(&runs)
            .arg(&chunk)
            .arg(&nr)
            .arg(&chunks);
        // SAFETY: the run list holds `nruns` runs inside both buffers (built by the planner
        // kernels or on the host from the same layout).
        unsafe { b.launch(cfg((gather_grid(nr * chunks, 0), 1, 1), GATHER_THREADS)) }
            .map_err(drv("launch gather_runs"))?;
        Ok(())
    }
}

/// CTAs of one gather launch: one per work item (run × chunk), capped at `cap` when `cap > 0`
/// (the kernel strides over the rest), and at the grid's x limit.
pub(crate) fn gather_grid(items: u64, cap: usize) -> u32 {
    let g = if cap > 0 {
        items.min(cap as u64)
    } else {
        items
    };
    g.clamp(1, i32::MAX as u64) as u32
}

pub(crate) fn cfg(grid: (u32, u32, u32), threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A timing event (raw, so that no tracking syncs are involved).
pub(crate) struct Event(sys::CUevent);

impl Event {
    /// An event for ordering only (no timing).
    pub(crate) fn sync_only() -> Result<Self> {
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(drv("event create"))?;
        Ok(Event(e))
    }
    /// Makes stream `s` wait for the work recorded in this event.
    pub(crate) fn wait_on(&self, s: &CudaStream) -> Result<()> {
        // SAFETY: a live event and a live stream of the current context.
        unsafe {
            result::stream::wait_event(
                s.cu_stream(),
                self.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(drv("stream wait event"))
    }
    pub(crate) fn new() -> Result<Self> {
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(drv("event create"))?;
        Ok(Event(e))
    }
    pub(crate) fn record(&self, s: &CudaStream) -> Result<()> {
        // SAFETY: a live event and a live stream of the current context.
        unsafe { result::event::record(self.0, s.cu_stream()) }.map_err(drv("event record"))
    }
    /// Records on a raw stream handle of this context (a caller's stream).
    ///
    /// # Safety
    /// `s` must be a live stream of the current context (or 0, the legacy default stream).
    pub(crate) unsafe fn record_raw(&self, s: sys::CUstream) -> Result<()> {
        // SAFETY: a live event; the caller vouches for the stream.
        unsafe { result::event::record(self.0, s) }.map_err(drv("event record"))
    }
    /// Makes a raw stream handle wait for this event.
    ///
    /// # Safety
    /// As [`Event::record_raw`].
    pub(crate) unsafe fn wait_on_raw(&self, s: sys::CUstream) -> Result<()> {
        // SAFETY: a live event; the caller vouches for the stream.
        unsafe {
            result::stream::wait_event(s, self.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        }
        .map_err(drv("stream wait event"))
    }
    pub(crate) fn elapsed_ms(&self, end: &Event) -> Result<f64> {
        // SAFETY: both events are live and have completed (the caller synchronised).
        Ok(unsafe { result::event::elapsed(self.0, end.0) }.map_err(drv("event elapsed"))? as f64)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroyed exactly once.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}
