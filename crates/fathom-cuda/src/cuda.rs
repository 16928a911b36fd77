//! The CUDA backend: device, memory, NVRTC modules and the offload decode step.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{
    result, CudaContext, CudaFunction, CudaModule, CudaStream, DriverError, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::config::{Method, Residency, SessionConfig};
use crate::error::{CudaError, Result};
use crate::synth::LayerSource;
use crate::types::{DeviceInfo, LayerDebug, SessionLayout, StepStats};

const COMMON: &str = include_str!("../kernels/common.cuh");
const KERNELS: [(&str, &str); 6] = [
    ("plan.cu", include_str!("../kernels/plan.cu")),
    ("gather.cu", include_str!("../kernels/gather.cu")),
    ("scan.cu", include_str!("../kernels/scan.cu")),
    ("topk.cu", include_str!("../kernels/topk.cu")),
    ("rows.cu", include_str!("../kernels/rows.cu")),
    ("attention.cu", include_str!("../kernels/attention.cu")),
];

/// Bytes per CTA of the gather kernel.
const GATHER_CHUNK: u64 = 128 << 10;
/// Threads per CTA of the gather kernel.
const GATHER_THREADS: u32 = 512;
/// Elements per CTA of the streaming top-k passes (`ELEMS` in topk.cu).
const TOPK_ELEMS: u64 = 4096;
/// Rows per CTA of the attention kernel (`CH` in attention.cu).
const ATTN_CHUNK: usize = 64;
/// Level-1 histogram bins of the top-k (`HBINS` in topk.cu and scan.cu).
const HBINS: usize = 1024;

/// One entry of the fixed-size run list (`struct Run` in common.cuh).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    off: u64,
    len: u64,
}
const _: () = assert!(std::mem::size_of::<Run>() == 16);

pub(crate) fn drv(op: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |e| CudaError::Driver {
        op,
        message: e.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Memory

/// Device memory (`cuMemAlloc`), freed on drop.
#[derive(Debug)]
pub(crate) struct DevBuf {
    pub(crate) ptr: CUdeviceptr,
    bytes: usize,
}

impl DevBuf {
    pub(crate) fn new(bytes: usize, what: &'static str) -> Result<Self> {
        // SAFETY: a plain allocation of `bytes.max(16)` bytes; the pointer is owned by the
        // returned value and freed once in `Drop`.
        let ptr =
            unsafe { result::malloc_sync(bytes.max(16)) }.map_err(|e| CudaError::DeviceOom {
                what,
                bytes: bytes as u64,
                message: e.to_string(),
            })?;
        Ok(DevBuf { ptr, bytes })
    }
    pub(crate) fn zeroed(bytes: usize, what: &'static str) -> Result<Self> {
        let b = Self::new(bytes, what)?;
        // SAFETY: `b.ptr` is a live allocation of at least `bytes` bytes.
        unsafe { result::memset_d8_sync(b.ptr, 0, bytes.max(16)) }.map_err(drv("memset"))?;
        Ok(b)
    }
    pub(crate) fn from_slice<T: Copy>(data: &[T], what: &'static str) -> Result<Self> {
        let b = Self::new(std::mem::size_of_val(data), what)?;
        // SAFETY: the allocation holds `size_of_val(data)` bytes; the copy is synchronous.
        unsafe { result::memcpy_htod_sync(b.ptr, data) }.map_err(drv("memcpy_htod"))?;
        Ok(b)
    }
    pub(crate) fn read<T: Copy + Default>(&self, len: usize) -> Result<Vec<T>> {
        assert!(len * std::mem::size_of::<T>() <= self.bytes.max(16));
        let mut v = vec![T::default(); len];
        // SAFETY: reads `len` elements that lie inside the allocation (asserted above).
        unsafe { result::memcpy_dtoh_sync(&mut v, self.ptr) }.map_err(drv("memcpy_dtoh"))?;
        Ok(v)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_sync` and is freed exactly once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Pinned, mapped host memory (`cuMemHostAlloc` with `DEVICEMAP | PORTABLE`).
#[derive(Debug)]
pub(crate) struct HostBuf {
    ptr: *mut u8,
    bytes: usize,
    pub(crate) dptr: CUdeviceptr,
}

// SAFETY: the buffer is plain memory owned by this value; access is through &/&mut self.
unsafe impl Send for HostBuf {}
// SAFETY: as above; shared references only read.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    pub(crate) fn new(bytes: usize, what: &'static str) -> Result<Self> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: allocation of `bytes` page-locked bytes; freed once in `Drop`.
        let ptr = unsafe { result::malloc_host(bytes.max(16), flags) }.map_err(|e| {
            CudaError::PinnedAlloc {
                what,
                bytes: bytes as u64,
                message: e.to_string(),
            }
        })? as *mut u8;
        let mut dptr: CUdeviceptr = 0;
        // SAFETY: `ptr` is a live mapped pinned allocation; the driver writes one pointer.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr as *mut c_void, 0) }
            .result()
            .map_err(drv("cuMemHostGetDevicePointer"))?;
        Ok(HostBuf { ptr, bytes, dptr })
    }
    pub(crate) fn as_bytes(&self) -> &[u8] {
        // SAFETY: `ptr` points to `bytes` bytes owned by `self`; the caller has synchronised
        // every stream that writes them.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }
    pub(crate) fn as_mut_bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `bytes` bytes owned by `self`, uniquely borrowed here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_host` and is freed exactly once.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

/// A session buffer in host (mapped) or device memory.
#[derive(Debug)]
enum Mem {
    Host(HostBuf),
    Dev(DevBuf),
}

impl Mem {
    fn dptr(&self) -> u64 {
        match self {
            Mem::Host(h) => h.dptr,
            Mem::Dev(d) => d.ptr,
        }
    }
    /// Allocates `bytes` where `residency` says and fills them with `fill` (run on an 8-aligned
    /// host buffer: the pinned memory itself, or a staging vector copied to the device).
    fn filled(
        residency: Residency,
        bytes: usize,
        what: &'static str,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<Self> {
        match residency {
            Residency::Host => {
                let mut h = HostBuf::new(bytes, what)?;
                fill(&mut h.as_mut_bytes()[..bytes]);
                Ok(Mem::Host(h))
            }
            Residency::Hbm => {
                // Device memory first (a typed `DeviceOom` before any host work), then a
                // fallible staging vector (a typed `HostAlloc` instead of an abort).
                let dev = DevBuf::new(bytes, what)?;
                let words = bytes.div_ceil(8);
                let mut v: Vec<u64> = Vec::new();
                v.try_reserve_exact(words)
                    .map_err(|_| CudaError::HostAlloc {
                        what,
                        bytes: bytes as u64,
                    })?;
                v.resize(words, 0);
                // SAFETY: reinterpreting initialised u64s as bytes (no padding, align 1).
                let b = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, bytes) };
                fill(b);
                // SAFETY: `dev` holds `bytes` bytes; the copy is synchronous.
                unsafe { result::memcpy_htod_sync(dev.ptr, &b[..]) }.map_err(drv("memcpy_htod"))?;
                Ok(Mem::Dev(dev))
            }
        }
    }
}

/// Views 8-aligned bytes as `T`s.
pub(crate) fn cast_mut<T>(b: &mut [u8]) -> &mut [T] {
    let n = b.len() / std::mem::size_of::<T>();
    assert_eq!(
        b.as_ptr() as usize % std::mem::align_of::<T>(),
        0,
        "unaligned buffer"
    );
    // SAFETY: alignment checked; T is a plain integer/half type valid for any bits.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut T, n) }
}

// ---------------------------------------------------------------------------------------------
// Device and modules

struct Kernels {
    fathom_plan: CudaFunction,
    sparq_plan: CudaFunction,
    gather_runs: CudaFunction,
    scan_planes: CudaFunction,
    scan_landmark: CudaFunction,
    scan_quest: CudaFunction,
    topk_hist: CudaFunction,
    topk_select: CudaFunction,
    topk_collect: CudaFunction,
    topk_finish: CudaFunction,
    topk_union: CudaFunction,
    rows_gather: CudaFunction,
    rows_claim: CudaFunction,
    rows_fill: CudaFunction,
    attn_partial: CudaFunction,
    attn_combine: CudaFunction,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Kernels { .. }")
    }
}

/// A CUDA device with its stream and a cache of NVRTC-compiled modules.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    copy_stream: Arc<CudaStream>,
    info: DeviceInfo,
    arch: &'static str,
    modules: Mutex<HashMap<(usize, usize), Arc<Kernels>>>,
}

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
    pub fn open(ordinal: usize) -> Result<Self> {
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
        // The gather stream gets the highest priority, so that pipelined gathers keep the
        // link busy while compute kernels of earlier head groups run.
        let (_, greatest) = {
            let (mut lo, mut hi) = (0i32, 0i32);
            // SAFETY: writes two ints.
            unsafe { sys::cuCtxGetStreamPriorityRange(&mut lo, &mut hi) }
                .result()
                .map_err(drv("cuCtxGetStreamPriorityRange"))?;
            (lo, hi)
        };
        let copy_stream = ctx
            .new_stream_with_priority(greatest)
            .map_err(drv("new_stream_with_priority"))?;
        Ok(Gpu {
            ctx,
            stream,
            copy_stream,
            info,
            arch,
            modules: Mutex::new(HashMap::new()),
        })
    }

    /// The device description.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The stream every session and cache of this device launches on, in order: enqueue
    /// the model's own kernels on it (or synchronise with it) to order them with appends
    /// and attends.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn arch(&self) -> &'static str {
        self.arch
    }

    fn kernels(&self, g: usize, d: usize) -> Result<Arc<Kernels>> {
        let mut cache = self.modules.lock().expect("module cache poisoned");
        if let Some(k) = cache.get(&(g, d)) {
            return Ok(k.clone());
        }
        let mut mods: HashMap<&'static str, Arc<CudaModule>> = HashMap::new();
        for (name, ptx) in compile_all(self.arch, g, d)? {
            let m = self.ctx.load_module(ptx).map_err(drv("load_module"))?;
            mods.insert(name, m);
        }
        let f = |m: &str, n: &str| mods[m].load_function(n).map_err(drv("load_function"));
        let k = Arc::new(Kernels {
            fathom_plan: f("plan.cu", "fathom_plan")?,
            sparq_plan: f("plan.cu", "sparq_plan")?,
            gather_runs: f("gather.cu", "gather_runs")?,
            scan_planes: f("scan.cu", "scan_planes")?,
            scan_landmark: f("scan.cu", "scan_landmark")?,
            scan_quest: f("scan.cu", "scan_quest")?,
            topk_hist: f("topk.cu", "topk_hist")?,
            topk_select: f("topk.cu", "topk_select")?,
            topk_collect: f("topk.cu", "topk_collect")?,
            topk_finish: f("topk.cu", "topk_finish")?,
            topk_union: f("topk.cu", "topk_union")?,
            rows_gather: f("rows.cu", "rows_gather")?,
            rows_claim: f("rows.cu", "rows_claim")?,
            rows_fill: f("rows.cu", "rows_fill")?,
            attn_partial: f("attention.cu", "attn_partial")?,
            attn_combine: f("attention.cu", "attn_combine")?,
        });
        cache.insert((g, d), k.clone());
        Ok(k)
    }

    fn event(&self) -> Result<Event> {
        Event::new()
    }

    /// Host-to-device bandwidth of one pinned `cuMemcpyHtoDAsync` of `bytes` (best of 3), GB/s.
    ///
    /// # Errors
    /// Allocation or driver failures.
    pub fn h2d_bandwidth(&self, bytes: usize) -> Result<f64> {
        let mut h = HostBuf::new(bytes, "H2D bandwidth source")?;
        h.as_mut_bytes()
            .par_chunks_mut(1 << 20)
            .enumerate()
            .for_each(|(i, c)| c.fill(i as u8));
        let d = DevBuf::new(bytes, "H2D bandwidth destination")?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let (a, b) = (self.event()?, self.event()?);
            a.record(&self.stream)?;
            // SAFETY: both buffers hold `bytes` bytes and outlive the synchronisation below.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    d.ptr,
                    h.ptr as *const c_void,
                    bytes,
                    self.stream.cu_stream(),
                )
            }
            .result()
            .map_err(drv("cuMemcpyHtoDAsync"))?;
            b.record(&self.stream)?;
            self.stream.synchronize().map_err(drv("synchronize"))?;
            best = best.min(a.elapsed_ms(&b)?);
        }
        Ok(bytes as f64 / (best * 1e-3) / 1e9)
    }

    /// Bandwidth of the zero-copy gather kernel copying one run of `bytes` from mapped pinned
    /// memory to HBM (best of 3), GB/s.
    ///
    /// # Errors
    /// Allocation, compile or driver failures.
    pub fn gather_bandwidth(&self, bytes: usize) -> Result<f64> {
        let k = self.kernels(1, 128)?;
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
            let (a, b) = (self.event()?, self.event()?);
            a.record(&self.stream)?;
            self.launch_gather(&k, h.dptr, d.ptr, runs.ptr, 1, bytes as u64)?;
            b.record(&self.stream)?;
            self.stream.synchronize().map_err(drv("synchronize"))?;
            best = best.min(a.elapsed_ms(&b)?);
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
    pub fn gather_run_bandwidth(&self, run_bytes: usize, total_bytes: usize) -> Result<f64> {
        if run_bytes == 0 || run_bytes % 16 != 0 || total_bytes < run_bytes {
            return Err(CudaError::invalid(
                "run_bytes",
                format!("{run_bytes} (want a positive multiple of 16 ≤ {total_bytes})"),
            ));
        }
        let k = self.kernels(1, 128)?;
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
            let (a, b) = (self.event()?, self.event()?);
            a.record(&self.stream)?;
            self.launch_gather(&k, h.dptr, d.ptr, runs.ptr, nruns, run_bytes as u64)?;
            b.record(&self.stream)?;
            self.stream.synchronize().map_err(drv("synchronize"))?;
            best = best.min(a.elapsed_ms(&b)?);
        }
        Ok((nruns * run_bytes) as f64 / (best * 1e-3) / 1e9)
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

/// Compiles one `.cu` source (with `common.cuh` inlined) for `arch` with `defines`.
pub(crate) fn compile_one(
    arch: &'static str,
    name: &'static str,
    src: &str,
    defines: Vec<String>,
) -> Result<cudarc::nvrtc::Ptx> {
    let src = src.replace("#include \"common.cuh\"", COMMON);
    let opts = CompileOptions {
        arch: Some(arch),
        options: defines,
        name: Some(name.to_string()),
        ..Default::default()
    };
    std::panic::catch_unwind(|| compile_ptx_with_opts(&src, opts))
        .map_err(|_| CudaError::NoDevice {
            message: "NVRTC library (libnvrtc) not found".into(),
        })?
        .map_err(|e| CudaError::Compile {
            kernel: name,
            log: format!("{e:?}"),
        })
}

fn compile_all(
    arch: &'static str,
    g: usize,
    d: usize,
) -> Result<Vec<(&'static str, cudarc::nvrtc::Ptx)>> {
    let mut out = Vec::new();
    for (name, src) in KERNELS {
        let mut o = vec![format!("-DGQ={g}"), format!("-DDIM={d}")];
        // Experiment switch: warp-aggregated histogram updates in the scan.
        if std::env::var("FATHOM_SCAN_HIST").is_ok_and(|v| v == "match") {
            o.push("-DHIST_MATCH=1".into());
        }
        out.push((name, compile_one(arch, name, src, o)?));
    }
    let append = compile_one(
        arch,
        "append.cu",
        crate::cuda_cache::APPEND_SRC,
        vec![format!("-DDIM={d}")],
    )?;
    out.push(("append.cu", append));
    if g <= 8 {
        let gd = vec![format!("-DGQ={g}"), format!("-DDIM={d}")];
        out.push((
            "attend.cu",
            compile_one(arch, "attend.cu", crate::cuda_cache::ATTEND_SRC, gd)?,
        ));
    }
    Ok(out)
}

/// Compiles every kernel with NVRTC for `arch` (e.g. `sm_90`) at `G`, `D`, without a device:
/// a check that needs only the NVRTC library.
///
/// # Errors
/// [`CudaError::Compile`] with the compiler log; [`CudaError::NoDevice`] without libnvrtc.
pub fn compile_kernels(arch: &'static str, g: usize, d: usize) -> Result<usize> {
    let all = compile_all(arch, g, d)?;
    if let Some(dir) = std::env::var_os("FATHOM_PTX_DIR") {
        for (name, ptx) in &all {
            let path = std::path::Path::new(&dir).join(format!("{name}.G{g}.D{d}.ptx"));
            let _ = std::fs::write(path, ptx.to_src());
        }
    }
    Ok(all.len())
}

/// CTAs of one gather launch: one per work item (run × chunk), capped at `cap` when `cap > 0`
/// (the kernel strides over the rest), and at the grid's x limit.
fn gather_grid(items: u64, cap: usize) -> u32 {
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
struct Event(sys::CUevent);

impl Event {
    /// An event for ordering only (no timing).
    fn sync_only() -> Result<Self> {
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(drv("event create"))?;
        Ok(Event(e))
    }
    /// Makes stream `s` wait for the work recorded in this event.
    fn wait_on(&self, s: &CudaStream) -> Result<()> {
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
    fn new() -> Result<Self> {
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(drv("event create"))?;
        Ok(Event(e))
    }
    fn record(&self, s: &CudaStream) -> Result<()> {
        // SAFETY: a live event and a live stream of the current context.
        unsafe { result::event::record(self.0, s.cu_stream()) }.map_err(drv("event record"))
    }
    fn elapsed_ms(&self, end: &Event) -> Result<f64> {
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

// ---------------------------------------------------------------------------------------------
// Host-side layout of the session (tiling synthetic sources to the context)

use crate::synth::{hash01, tile_flips};

/// Writes one layer's store for `nb` blocks into `dst` (planes `[H][D][4][nb]` then scales
/// `[H][D][nb]`), tiling the source's `nb0` blocks. Tiles after the first are made distinct
/// tokens: half of their channels are negated (all plane bits inverted: `q → 15 − q`, an exact
/// negation of the value) and their block scales are jittered by up to ±3%, so that tiled
/// copies neither tie nor win together.
fn fill_store(dst: &mut [u8], src: &LayerSource, nb: usize, layer: usize) {
    let v = src.store.view();
    let (hn, d) = (v.dims().heads, v.dims().channels);
    let nb0 = v.nblocks();
    let plane_bytes = hn * d * 4 * nb * 8;
    let (pl, sc) = dst.split_at_mut(plane_bytes);
    let planes: &mut [u64] = cast_mut(pl);
    let scales: &mut [f16] = cast_mut(&mut sc[..hn * d * nb * 2]);
    planes
        .par_chunks_mut(4 * nb)
        .enumerate()
        .for_each(|(hc, out)| {
            let (h, c) = (hc / d, hc % d);
            for p in 0..4 {
                let s = v.plane(h, c, p);
                let o = &mut out[p * nb..(p + 1) * nb];
                for (t, chunk) in o.chunks_mut(nb0).enumerate() {
                    chunk.copy_from_slice(&s[..chunk.len()]);
                    if tile_flips(layer, hc, t) {
                        // Code q -> 15 - q negates the channel's value exactly.
                        chunk.iter_mut().for_each(|w| *w = !*w);
                    }
                }
            }
        });
    scales.par_chunks_mut(nb).enumerate().for_each(|(hc, out)| {
        let (h, c) = (hc / d, hc % d);
        let s = v.channel_scales(h, c);
        for (b, o) in out.iter_mut().enumerate() {
            let m = s[b % nb0];
            *o = if b < nb0 {
                m
            } else {
                f16::from_f32(m.to_f32() * (1.0 + 0.03 * hash01(layer as u64, hc as u64, b as u64)))
            };
        }
    });
}

fn fill_records(dst: &mut [u8], recs: &[bf16], _hn: usize, n0: usize, n: usize, rec: usize) {
    let per = rec / 2; // bf16 per record
    let out: &mut [bf16] = cast_mut(dst);
    out.par_chunks_mut(n * per).enumerate().for_each(|(h, o)| {
        let s = &recs[h * n0 * per..(h + 1) * n0 * per];
        for chunk in o.chunks_mut(n0 * per) {
            chunk.copy_from_slice(&s[..chunk.len()]);
        }
    });
}

/// Landmark (`[H][n/8][D]`, mean of 8 keys) or Quest (`[H][n/16][2][D]`, min and max of 16
/// keys) tables in fp16, from the bf16 keys of the records, tiled to `n`.
#[allow(clippy::too_many_arguments)]
fn fill_table(
    dst: &mut [u8],
    recs: &[bf16],
    hn: usize,
    d: usize,
    n0: usize,
    n: usize,
    quest: bool,
    layer: usize,
) {
    let span = if quest { 16 } else { 8 };
    let width = if quest { 2 * d } else { d };
    let (g0, g) = (n0.div_ceil(span), n.div_ceil(span));
    let out: &mut [f16] = cast_mut(dst);
    out[..hn * g * width]
        .par_chunks_mut(g * width)
        .enumerate()
        .for_each(|(h, o)| {
            let mut base = vec![f16::ZERO; g0 * width];
            for gi in 0..g0 {
                for c in 0..d {
                    let toks = (gi * span)..((gi + 1) * span).min(n0);
                    let keys = toks.map(|i| recs[(h * n0 + i) * 2 * d + c].to_f32());
                    // The baselines' own rules; their results are fp16 values, so the
                    // conversions below are exact.
                    if quest {
                        let (lo, hi) = fathom_baselines::quest_bounds(keys);
                        base[gi * width + c] = f16::from_f32(lo);
                        base[gi * width + d + c] = f16::from_f32(hi);
                    } else {
                        base[gi * width + c] = f16::from_f32(fathom_baselines::landmark_mean(keys));
                    }
                }
            }
            for (t, chunk) in o.chunks_mut(g0 * width).enumerate() {
                chunk.copy_from_slice(&base[..chunk.len()]);
                // The same channel negations as the plane store's tiles.
                for c in (0..d).filter(|&c| tile_flips(layer, h * d + c, t)) {
                    for row in chunk.chunks_mut(width) {
                        if quest {
                            let (lo, hi) = (row[c], row[d + c]);
                            row[c] = -hi;
                            row[d + c] = -lo;
                        } else {
                            row[c] = -row[c];
                        }
                    }
                }
            }
        });
}

// ---------------------------------------------------------------------------------------------
// The session

struct StaticPlan {
    depths: DevBuf, // [L][H][D] u8
    runs: DevBuf,   // [L][nruns] Run
    nruns: usize,
    max_len: u64,
    bits: f64,
}

impl std::fmt::Debug for StaticPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaticPlan")
            .field("nruns", &self.nruns)
            .field("bits", &self.bits)
            .finish()
    }
}

/// One decode session: the store, tables and rows of every layer (host-pinned or in HBM),
/// and every working buffer of the step, allocated once.
pub struct Session {
    stream: Arc<CudaStream>,
    copy_stream: Arc<CudaStream>,
    ev_plan: Event,
    ev_gather: Vec<Event>,
    groups: usize,
    gather_ctas: usize,
    k: Arc<Kernels>,
    cfg: SessionConfig,
    n: usize,
    nb: usize,
    layout: SessionLayout,
    stores: Vec<Mem>,
    landmark: Vec<Mem>,
    quest: Vec<Mem>,
    rows: Vec<Mem>,
    sigma2: DevBuf,
    queries: DevBuf,
    staging: DevBuf,
    scores: DevBuf,
    hist: DevBuf,
    sel: DevBuf,
    win: DevBuf,
    wcount: DevBuf,
    cand_key: DevBuf,
    cand_idx: DevBuf,
    ccount: DevBuf,
    tcount: DevBuf,
    stamp: DevBuf,
    ulist: DevBuf,
    ucount: DevBuf,
    gathered: DevBuf,
    pm: DevBuf,
    pl: DevBuf,
    pacc: DevBuf,
    out: DevBuf,
    depths: DevBuf,
    bits: DevBuf,
    runs: DevBuf,
    counters: DevBuf, // [0] hits u32, [1] union rows u32, [2] bits_acc f32
    cache_tags: Option<DevBuf>,
    cache_data: Option<DevBuf>,
    cache_claim: Option<DevBuf>,
    statics: HashMap<String, StaticPlan>,
    tag: u32,
    stamp_ctr: u64,
    nsplit: usize,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("cfg", &self.cfg)
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Allocates and fills the session: the store of every layer (tiled from `sources`,
    /// layer `l` from `sources[l mod len]`), the landmark/Quest tables if asked, the K/V
    /// records of as many layers as `row_bytes_budget` allows (reused cyclically), static
    /// plans for `methods`, the HBM row cache and every working buffer.
    ///
    /// # Errors
    /// Allocation failures (with sizes), compile errors, or inconsistent sources.
    pub fn new(
        gpu: &Gpu,
        cfg: &SessionConfig,
        sources: &[LayerSource],
        methods: &[Method],
    ) -> Result<Self> {
        let t0 = Instant::now();
        let shape = cfg.shape.validate()?;
        let (hn, g, d, l_n) = (shape.kv_heads, shape.group, shape.dim, shape.layers);
        if sources.is_empty() {
            return Err(CudaError::invalid("sources", "no source layers"));
        }
        let n0 = sources[0].params().tokens;
        for s in sources {
            let p = s.params();
            if (p.heads, p.group, p.dim, p.tokens) != (hn, g, d, n0) {
                return Err(CudaError::invalid(
                    "sources",
                    "source shapes differ from the session shape",
                ));
            }
        }
        if n0 % 64 != 0 && cfg.context != n0 {
            return Err(CudaError::invalid(
                "sources",
                format!("base tokens {n0} must be a multiple of 64 to tile"),
            ));
        }
        let n = cfg.context;
        if n == 0 || n > u32::MAX as usize || cfg.k == 0 {
            return Err(CudaError::invalid(
                "context",
                format!("n = {n}, k = {}", cfg.k),
            ));
        }
        let nb = n.div_ceil(64);
        let k = gpu.kernels(g, d)?;
        let rec = shape.record_bytes();
        let store_bytes = hn * d * nb * (32 + 2);
        let lm_bytes = hn * n.div_ceil(8) * d * 2;
        let quest_bytes = hn * n.div_ceil(16) * 2 * d * 2;
        let row_layer_bytes = hn * n * rec;

        let mut stores = Vec::with_capacity(l_n);
        let mut landmark = Vec::new();
        let mut quest = Vec::new();
        for l in 0..l_n {
            let src = &sources[l % sources.len()];
            stores.push(Mem::filled(
                cfg.residency,
                store_bytes,
                "scan store",
                |b| fill_store(b, src, nb, l),
            )?);
        }
        let recs: Vec<Vec<bf16>> = sources.iter().map(|s| s.records()).collect();
        if cfg.tables {
            for l in 0..l_n {
                let r = &recs[l % sources.len()];
                landmark.push(Mem::filled(
                    cfg.residency,
                    lm_bytes,
                    "landmark table",
                    |b| fill_table(b, r, hn, d, n0, n, false, l),
                )?);
                quest.push(Mem::filled(
                    cfg.residency,
                    quest_bytes,
                    "quest table",
                    |b| fill_table(b, r, hn, d, n0, n, true, l),
                )?);
            }
        }
        let row_layers = ((cfg.row_bytes_budget / row_layer_bytes as u64) as usize).clamp(1, l_n);
        let mut rows = Vec::with_capacity(row_layers);
        for l in 0..row_layers {
            let r = &recs[l % sources.len()];
            rows.push(Mem::filled(
                cfg.residency,
                row_layer_bytes,
                "K/V records",
                |b| fill_records(b, r, hn, n0, n, rec),
            )?);
        }

        let mut sigma2 = Vec::with_capacity(l_n * hn * d);
        for l in 0..l_n {
            sigma2.extend_from_slice(&sources[l % sources.len()].sigma2);
        }
        let steps = cfg.steps.max(1);
        let mut q = Vec::with_capacity(steps * l_n * hn * g * d);
        for s in 0..steps {
            for l in 0..l_n {
                q.extend(sources[l % sources.len()].queries(s));
            }
        }
        let r_n = hn * g;
        let umax = cfg.union_max();
        let nsplit = umax.div_ceil(ATTN_CHUNK);
        let mid = n.saturating_sub(36).max(1);
        let staging_bytes = if cfg.residency == Residency::Host {
            store_bytes.max(if cfg.tables {
                lm_bytes.max(quest_bytes)
            } else {
                0
            })
        } else {
            16
        };
        let (cache_tags, cache_data, cache_claim) =
            if cfg.cache_rows > 0 && cfg.residency == Residency::Host {
                let slots = l_n * hn * cfg.cache_rows;
                (
                    Some(DevBuf::zeroed(slots * 4, "row cache tags")?),
                    Some(DevBuf::new(slots * rec, "row cache data")?),
                    Some(DevBuf::zeroed(slots * 8, "row cache claims")?),
                )
            } else {
                (None, None, None)
            };

        let mut statics = HashMap::new();
        for m in methods {
            if let Some(sp) = static_plan(m, sources, &shape, nb, n)? {
                statics.insert(m.label(), sp);
            }
        }

        let layout = SessionLayout {
            source_layers: sources.len().min(l_n),
            source_tokens: n0,
            row_layers,
            store_bytes: (store_bytes * l_n) as u64,
            table_bytes: if cfg.tables {
                ((lm_bytes + quest_bytes) * l_n) as u64
            } else {
                0
            },
            row_bytes: (row_layer_bytes * row_layers) as u64,
            cache_bytes: cache_data.as_ref().map_or(0, |c| c.bytes as u64),
            setup_s: 0.0,
        };
        let mut s = Session {
            stream: gpu.stream.clone(),
            copy_stream: gpu.copy_stream.clone(),
            ev_plan: Event::sync_only()?,
            ev_gather: (0..hn).map(|_| Event::sync_only()).collect::<Result<_>>()?,
            groups: cfg.pipeline_groups(),
            gather_ctas: cfg.gather_cap(),
            k,
            cfg: cfg.clone(),
            n,
            nb,
            layout,
            stores,
            landmark,
            quest,
            rows,
            sigma2: DevBuf::from_slice(&sigma2, "sigma2")?,
            queries: DevBuf::from_slice(&q, "queries")?,
            staging: DevBuf::new(staging_bytes, "HBM staging")?,
            scores: DevBuf::new(r_n * n * 4, "scores")?,
            hist: DevBuf::new(r_n * HBINS * 4, "top-k histogram")?,
            sel: DevBuf::new(r_n * 8, "top-k selection")?,
            win: DevBuf::new(r_n * cfg.k * 4, "winners")?,
            wcount: DevBuf::zeroed(r_n * 4, "winner counts")?,
            cand_key: DevBuf::new(r_n * mid * 4, "top-k candidate keys")?,
            cand_idx: DevBuf::new(r_n * mid * 4, "top-k candidate indices")?,
            ccount: DevBuf::zeroed(r_n * 4, "candidate counts")?,
            tcount: DevBuf::zeroed(r_n * 4, "tie counts")?,
            stamp: DevBuf::zeroed(hn * n * 4, "union stamps")?,
            ulist: DevBuf::new(hn * umax * 4, "union lists")?,
            ucount: DevBuf::zeroed(hn * 4, "union counts")?,
            gathered: DevBuf::new(hn * umax * rec, "gathered rows")?,
            pm: DevBuf::new(hn * nsplit * g * 4, "attention partial max")?,
            pl: DevBuf::new(hn * nsplit * g * 4, "attention partial sum")?,
            pacc: DevBuf::new(hn * nsplit * g * d * 4, "attention partial output")?,
            out: DevBuf::new(hn * g * d * 4, "attention output")?,
            depths: DevBuf::zeroed(hn * d, "depths")?,
            bits: DevBuf::zeroed(hn * 4, "plan bits")?,
            runs: DevBuf::zeroed(2 * hn * d * 16, "run list")?,
            counters: DevBuf::zeroed(16, "counters")?,
            cache_tags,
            cache_data,
            cache_claim,
            statics,
            tag: 0,
            stamp_ctr: 0,
            nsplit,
        };
        s.layout.setup_s = t0.elapsed().as_secs_f64();
        Ok(s)
    }

    /// Where the data lives.
    pub fn layout(&self) -> &SessionLayout {
        &self.layout
    }

    /// Empties the HBM row cache (between methods, so none reuses another's rows).
    ///
    /// # Errors
    /// Driver failures.
    pub fn reset_cache(&mut self) -> Result<()> {
        if let Some(t) = &self.cache_tags {
            self.memset(t.ptr, t.bytes)?;
            self.stream.synchronize().map_err(drv("synchronize"))?;
        }
        Ok(())
    }

    /// Changes the host-residency pipelining of later steps: `groups` head groups per layer
    /// and at most `gather_ctas` CTAs per gather launch (0 = auto for both, see
    /// [`SessionConfig::groups`] and [`SessionConfig::gather_ctas`]). Results do not change,
    /// only timing.
    pub fn set_pipeline(&mut self, groups: usize, gather_ctas: usize) {
        self.cfg.groups = groups;
        self.cfg.gather_ctas = gather_ctas;
        self.groups = self.cfg.pipeline_groups();
        self.gather_ctas = self.cfg.gather_cap();
    }

    /// Runs one decode step (every layer, in order, no host synchronisation inside) with the
    /// queries of `step`, and reports its GPU time, wall-clock and counters. With
    /// `instrument`, an event pair brackets every stage of every layer (per-stage times).
    ///
    /// # Errors
    /// Driver failures, or a method without the tables/plan it needs.
    pub fn run_step(&mut self, method: Method, step: usize, instrument: bool) -> Result<StepStats> {
        let l_n = self.cfg.shape.layers;
        self.memset(self.counters.ptr, 16)?;
        let begin = Event::new()?;
        let end = Event::new()?;
        let stage_events: Vec<Event> = if instrument {
            (0..l_n * 7).map(|_| Event::new()).collect::<Result<_>>()?
        } else {
            Vec::new()
        };
        let t0 = Instant::now();
        begin.record(&self.stream)?;
        for l in 0..l_n {
            let ev = if instrument {
                Some(&stage_events[l * 7..(l + 1) * 7])
            } else {
                None
            };
            self.launch_layer(method, l, step, ev)?;
        }
        end.record(&self.stream)?;
        self.stream.synchronize().map_err(drv("synchronize"))?;
        let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
        let gpu_ms = begin.elapsed_ms(&end)?;
        let stage_ms = if instrument {
            let mut s = [0f64; 6];
            for l in 0..l_n {
                for (i, x) in s.iter_mut().enumerate() {
                    *x += stage_events[l * 7 + i].elapsed_ms(&stage_events[l * 7 + i + 1])?;
                }
            }
            Some(s)
        } else {
            None
        };
        let c: Vec<u32> = self.counters.read(4)?;
        let bits = match method {
            Method::Fathom(_) => {
                f32::from_bits(c[2]) as f64 / (l_n * self.cfg.shape.kv_heads) as f64
            }
            m => self
                .statics
                .get(&m.label())
                .map_or(m.bits(self.cfg.shape.dim) as f64, |s| s.bits),
        };
        Ok(StepStats {
            gpu_ms,
            wall_ms,
            stage_ms,
            union_rows: c[1] as u64,
            cache_hits: c[0] as u64,
            bits,
        })
    }

    /// Runs layer `layer`'s step with the queries of `step` and reads back every
    /// intermediate (for the correctness tests).
    ///
    /// # Errors
    /// As [`Session::run_step`].
    pub fn layer_debug(&mut self, method: Method, layer: usize, step: usize) -> Result<LayerDebug> {
        let (hn, g, d) = (
            self.cfg.shape.kv_heads,
            self.cfg.shape.group,
            self.cfg.shape.dim,
        );
        let (n, kk, umax) = (self.n, self.cfg.k, self.cfg.union_max());
        self.memset(self.counters.ptr, 16)?;
        self.launch_layer(method, layer, step, None)?;
        self.stream.synchronize().map_err(drv("synchronize"))?;
        let r_n = hn * g;
        let depths: Vec<u8> = self.depths.read(hn * d)?;
        let bits: Vec<f32> = self.bits.read(hn)?;
        let scores: Vec<f32> = self.scores.read(r_n * n)?;
        let wc: Vec<u32> = self.wcount.read(r_n)?;
        let win: Vec<u32> = self.win.read(r_n * kk)?;
        let winners = (0..r_n)
            .map(|r| {
                let mut v = win[r * kk..r * kk + (wc[r] as usize).min(kk)].to_vec();
                v.sort_unstable();
                v
            })
            .collect();
        let uc: Vec<u32> = self.ucount.read(hn)?;
        let ul: Vec<u32> = self.ulist.read(hn * umax)?;
        let unions = (0..hn)
            .map(|h| {
                let mut v = ul[h * umax..h * umax + (uc[h] as usize).min(umax)].to_vec();
                v.sort_unstable();
                v
            })
            .collect();
        let out: Vec<f32> = self.out.read(hn * g * d)?;
        Ok(LayerDebug {
            depths,
            bits,
            scores,
            winners,
            unions,
            out,
        })
    }

    fn memset(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: callers pass a live device allocation of at least `bytes` bytes.
        unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }
            .map_err(drv("memset"))
    }

    /// Enqueues one layer's step. `ev`, if given, holds 7 events recorded at the stage
    /// boundaries; the layer then runs as one head group so that stages do not overlap.
    /// Otherwise (host residency) the KV heads are split into `groups` head groups: the copy
    /// stream gathers group after group over PCIe while the compute stream scans, selects,
    /// fetches rows and attends for the groups already gathered (docs/SPEC.md §6 step order per group;
    /// no host synchronisation).
    fn launch_layer(
        &mut self,
        method: Method,
        l: usize,
        step: usize,
        ev: Option<&[Event]>,
    ) -> Result<()> {
        let sh = self.cfg.shape;
        let (hn, g, d) = (sh.kv_heads, sh.group, sh.dim);
        let (n, nb) = (self.n as u64, self.nb as u64);
        let heads = hn as i32;
        let kk = self.cfg.k as u32;
        let umax = self.cfg.union_max() as u64;
        let host = self.cfg.residency == Residency::Host;
        let steps = self.cfg.steps.max(1);
        let qbase = self.queries.ptr + (((step % steps) * sh.layers + l) * hn * g * d * 4) as u64;
        let k = self.k.clone();
        let st = self.stream.clone();
        let cs = self.copy_stream.clone();
        let groups = if ev.is_some() || !host {
            1
        } else {
            self.groups.clamp(1, hn)
        };
        let mark = |i: usize| -> Result<()> {
            if let Some(e) = ev {
                e[i].record(&st)?;
            }
            Ok(())
        };
        mark(0)?;
        // 1. Plan (all heads at once).
        let bits_acc = self.counters.ptr + 8;
        let (depths_ptr, runs_ptr, runs_per_head, max_len) = match method {
            Method::Fathom(budget) => {
                let sig = self.sigma2.ptr + (l * hn * d * 4) as u64;
                let steps_i = fathom_plan::waterfill::BISECTION_STEPS as i32;
                let mut b = st.launch_builder(&k.fathom_plan);
                b.arg(&qbase)
                    .arg(&sig)
                    .arg(&budget)
                    .arg(&steps_i)
                    .arg(&heads)
                    .arg(&nb)
                    .arg(&self.depths.ptr)
                    .arg(&self.bits.ptr)
                    .arg(&self.runs.ptr)
                    .arg(&bits_acc);
                // SAFETY: q [H][G][D], sigma2 [H][D], depths [H][D], bits [H], runs [H][2D] are
                // allocated at those sizes; one warp per head.
                unsafe { b.launch(cfg((hn as u32, 1, 1), 32)) }
                    .map_err(drv("launch fathom_plan"))?;
                (self.depths.ptr, self.runs.ptr, 2 * d, 4 * nb * 8)
            }
            Method::SparQ(r) => {
                let r = r as i32;
                let mut b = st.launch_builder(&k.sparq_plan);
                b.arg(&qbase)
                    .arg(&r)
                    .arg(&heads)
                    .arg(&nb)
                    .arg(&self.depths.ptr)
                    .arg(&self.bits.ptr)
                    .arg(&self.runs.ptr)
                    .arg(&bits_acc);
                // SAFETY: as for fathom_plan; one CTA of D threads per head.
                unsafe { b.launch(cfg((hn as u32, 1, 1), d as u32)) }
                    .map_err(drv("launch sparq_plan"))?;
                (self.depths.ptr, self.runs.ptr, 2 * d, 4 * nb * 8)
            }
            m => {
                let sp = self.statics.get(&m.label()).ok_or_else(|| {
                    CudaError::invalid(
                        "method",
                        format!("{} was not prepared for this session", m.label()),
                    )
                })?;
                let dp = sp.depths.ptr + (l * hn * d) as u64;
                let rp = sp.runs.ptr + (l * sp.nruns * 16) as u64;
                if m.uses_planes() {
                    // Debug readback and scans read the session's depth buffer.
                    // SAFETY: both buffers hold H·D bytes.
                    unsafe {
                        result::memcpy_dtod_async(self.depths.ptr, dp, hn * d, st.cu_stream())
                    }
                    .map_err(drv("memcpy_dtod"))?;
                }
                (self.depths.ptr, rp, sp.nruns / hn, sp.max_len)
            }
        };
        mark(1)?;
        let (src_base, table_head_bytes) = match method {
            Method::Landmark => (
                self.landmark.get(l).map(Mem::dptr),
                n.div_ceil(8) * d as u64 * 2,
            ),
            Method::Quest => (
                self.quest.get(l).map(Mem::dptr),
                n.div_ceil(16) * 2 * d as u64 * 2,
            ),
            _ => (Some(self.stores[l].dptr()), 0),
        };
        let src_base = src_base.ok_or_else(|| {
            CudaError::invalid("method", "landmark/quest need a session built with tables")
        })?;
        let hpg = hn.div_ceil(groups);
        let ranges: Vec<(usize, usize)> = (0..hn)
            .step_by(hpg)
            .map(|h0| (h0, (h0 + hpg).min(hn)))
            .collect();
        // 2. Gather (host residency) into HBM staging at the same offsets, group by group.
        let base = if host { self.staging.ptr } else { src_base };
        if host {
            let gs = if groups > 1 { &cs } else { &st };
            if groups > 1 {
                self.ev_plan.record(&st)?;
                self.ev_plan.wait_on(&cs)?;
            }
            for (i, &(h0, h1)) in ranges.iter().enumerate() {
                let chunks = max_len.div_ceil(GATHER_CHUNK).max(1);
                let chunk = GATHER_CHUNK;
                let rp = runs_ptr + (h0 * runs_per_head * 16) as u64;
                let nr = ((h1 - h0) * runs_per_head) as u64;
                let grid = gather_grid(nr * chunks, self.gather_ctas);
                let mut b = gs.launch_builder(&k.gather_runs);
                b.arg(&src_base)
                    .arg(&base)
                    .arg(&rp)
                    .arg(&chunk)
                    .arg(&nr)
                    .arg(&chunks);
                // SAFETY: every run lies inside the layer's source buffer and the staging
                // buffer (same layout, staging sized to the largest layer buffer).
                unsafe { b.launch(cfg((grid, 1, 1), GATHER_THREADS)) }
                    .map_err(drv("launch gather_runs"))?;
                if groups > 1 {
                    self.ev_gather[i].record(&cs)?;
                }
            }
        }
        mark(2)?;
        let rec = sh.record_bytes() as u64;
        let rows_src = self.rows[l % self.rows.len()].dptr();
        let cache_rows = self.cfg.cache_rows as u64;
        let (tags0, cdata0, claim0) = match (&self.cache_tags, &self.cache_data, &self.cache_claim)
        {
            (Some(t), Some(c), Some(cl)) => {
                let slot0 = (l * hn) as u64 * cache_rows;
                (t.ptr + slot0 * 4, c.ptr + slot0 * rec, cl.ptr + slot0 * 8)
            }
            _ => (0u64, 0u64, 0u64),
        };
        let c_arg = cache_rows.max(1);
        let hits = self.counters.ptr;
        let utot = self.counters.ptr + 4;
        let mid = n.saturating_sub(36).max(1);
        let chunks = mid.div_ceil(TOPK_ELEMS) as u32;
        let ccap = mid;
        let fused_hist = method.uses_planes() && g <= 8;
        let scale = 1.0f32 / (d as f32).sqrt();
        let ns = self.nsplit as u64;
        self.tag = self.tag.wrapping_add(1).max(1);
        let tag = self.tag;
        self.stamp_ctr += 1;
        let stamp = self.stamp_ctr;
        for (i, &(h0, h1)) in ranges.iter().enumerate() {
            if groups > 1 {
                self.ev_gather[i].wait_on(&st)?;
            }
            let (h0u, hg) = (h0 as u64, (h1 - h0) as u32);
            let r0 = h0u * g as u64;
            let rg = hg * g as u32;
            let q = qbase + h0u * (g * d * 4) as u64;
            let scores = self.scores.ptr + r0 * n * 4;
            let hist = self.hist.ptr + r0 * HBINS as u64 * 4;
            let sel = self.sel.ptr + r0 * 8;
            let win = self.win.ptr + r0 * kk as u64 * 4;
            let wcount = self.wcount.ptr + r0 * 4;
            let ccount = self.ccount.ptr + r0 * 4;
            let tcount = self.tcount.ptr + r0 * 4;
            let ckey = self.cand_key.ptr + r0 * ccap * 4;
            let cidx = self.cand_idx.ptr + r0 * ccap * 4;
            let ucount = self.ucount.ptr + h0u * 4;
            let ulist = self.ulist.ptr + h0u * umax * 4;
            let stampp = self.stamp.ptr + h0u * n * 4;
            let gathered = self.gathered.ptr + h0u * umax * rec;
            // 3. Scan (the plane scan also builds the level-1 top-k histogram when G ≤ 8).
            self.memset(hist, rg as usize * HBINS * 4)?;
            match method {
                Method::Landmark | Method::Quest => {
                    let span = if method == Method::Landmark { 8 } else { 16 };
                    let ngroups = n.div_ceil(span);
                    let table = base + h0u * table_head_bytes;
                    let f = if method == Method::Landmark {
                        &k.scan_landmark
                    } else {
                        &k.scan_quest
                    };
                    let mut b = st.launch_builder(f);
                    b.arg(&table).arg(&n).arg(&q).arg(&scores);
                    // SAFETY: the table holds [hg][ngroups] rows; scores [hg][G][n].
                    unsafe { b.launch(cfg((ngroups.div_ceil(256) as u32, hg, 1), 256)) }
                        .map_err(drv("launch scan_table"))?;
                }
                _ => {
                    let planes = base + h0u * (d as u64) * 4 * nb * 8;
                    let scales =
                        base + (hn as u64) * (d as u64) * 4 * nb * 8 + h0u * (d as u64) * nb * 2;
                    let dp = depths_ptr + h0u * d as u64;
                    let mut b = st.launch_builder(&k.scan_planes);
                    b.arg(&planes)
                        .arg(&scales)
                        .arg(&nb)
                        .arg(&n)
                        .arg(&dp)
                        .arg(&q)
                        .arg(&scores)
                        .arg(&hist);
                    // SAFETY: planes/scales point at head h0 of a layer in the store layout for
                    // nb blocks; scores [hg][G][n]; hist [hg·G][HBINS].
                    unsafe { b.launch(cfg((nb.div_ceil(32) as u32, hg, 1), 256)) }
                        .map_err(drv("launch scan_planes"))?;
                }
            }
            mark(3)?;
            // 4. Top-k per query head, union per KV head.
            if !fused_hist {
                let mut b = st.launch_builder(&k.topk_hist);
                b.arg(&scores).arg(&n).arg(&hist);
                // SAFETY: scores [rg][n], hist [rg][HBINS].
                unsafe { b.launch(cfg((chunks, rg, 1), 256)) }.map_err(drv("launch topk_hist"))?;
            }
            {
                let mut b = st.launch_builder(&k.topk_select);
                b.arg(&hist)
                    .arg(&kk)
                    .arg(&sel)
                    .arg(&wcount)
                    .arg(&ccount)
                    .arg(&tcount)
                    .arg(&ucount);
                // SAFETY: per-row buffers of rg entries, ucount [hg].
                unsafe { b.launch(cfg((rg, 1, 1), 1024)) }.map_err(drv("launch topk_select"))?;
            }
            {
                let mut b = st.launch_builder(&k.topk_collect);
                b.arg(&scores)
                    .arg(&n)
                    .arg(&kk)
                    .arg(&sel)
                    .arg(&win)
                    .arg(&wcount)
                    .arg(&ckey)
                    .arg(&cidx)
                    .arg(&ccap)
                    .arg(&ccount);
                // SAFETY: win [rg][k], candidates [rg][ccap].
                unsafe { b.launch(cfg((chunks, rg, 1), 256)) }
                    .map_err(drv("launch topk_collect"))?;
            }
            {
                let mut b = st.launch_builder(&k.topk_finish);
                b.arg(&sel)
                    .arg(&kk)
                    .arg(&ckey)
                    .arg(&cidx)
                    .arg(&ccap)
                    .arg(&ccount)
                    .arg(&win)
                    .arg(&wcount)
                    .arg(&tcount);
                // SAFETY: as topk_collect.
                unsafe { b.launch(cfg((rg, 1, 1), 1024)) }.map_err(drv("launch topk_finish"))?;
            }
            {
                let total = (g * self.cfg.k + 36) as u64;
                let mut b = st.launch_builder(&k.topk_union);
                b.arg(&win)
                    .arg(&wcount)
                    .arg(&kk)
                    .arg(&n)
                    .arg(&tag)
                    .arg(&stampp)
                    .arg(&ulist)
                    .arg(&umax)
                    .arg(&ucount);
                // SAFETY: stamp [hg][n], ulist [hg][umax].
                unsafe { b.launch(cfg((total.div_ceil(256) as u32, hg, 1), 256)) }
                    .map_err(drv("launch topk_union"))?;
            }
            mark(4)?;
            // 5. Row gather (cache first), then cache update.
            let src = rows_src + h0u * n * rec;
            let (tags, cdata, claim) = if tags0 != 0 {
                (
                    tags0 + h0u * cache_rows * 4,
                    cdata0 + h0u * cache_rows * rec,
                    claim0 + h0u * cache_rows * 8,
                )
            } else {
                (0, 0, 0)
            };
            {
                let mut b = st.launch_builder(&k.rows_gather);
                b.arg(&src)
                    .arg(&n)
                    .arg(&ulist)
                    .arg(&ucount)
                    .arg(&umax)
                    .arg(&tags)
                    .arg(&cdata)
                    .arg(&c_arg)
                    .arg(&gathered)
                    .arg(&hits)
                    .arg(&utot);
                // SAFETY: records [hg][n][REC]; cache [hg][C]; gathered [hg][umax][REC].
                unsafe { b.launch(cfg((umax.div_ceil(8) as u32, hg, 1), 256)) }
                    .map_err(drv("launch rows_gather"))?;
            }
            if tags != 0 {
                let mut b = st.launch_builder(&k.rows_claim);
                b.arg(&ulist)
                    .arg(&ucount)
                    .arg(&umax)
                    .arg(&tags)
                    .arg(&c_arg)
                    .arg(&claim)
                    .arg(&stamp);
                // SAFETY: cache arrays of this group hold [hg][C] slots.
                unsafe { b.launch(cfg((umax.div_ceil(256) as u32, hg, 1), 256)) }
                    .map_err(drv("launch rows_claim"))?;
                let mut b = st.launch_builder(&k.rows_fill);
                b.arg(&ulist)
                    .arg(&ucount)
                    .arg(&umax)
                    .arg(&tags)
                    .arg(&cdata)
                    .arg(&c_arg)
                    .arg(&claim)
                    .arg(&stamp)
                    .arg(&gathered);
                // SAFETY: as rows_claim; gathered rows [hg][umax][REC].
                unsafe { b.launch(cfg((umax.div_ceil(8) as u32, hg, 1), 256)) }
                    .map_err(drv("launch rows_fill"))?;
            }
            mark(5)?;
            // 6. Exact attention over the gathered rows.
            let pm = self.pm.ptr + h0u * ns * g as u64 * 4;
            let pl = self.pl.ptr + h0u * ns * g as u64 * 4;
            let pacc = self.pacc.ptr + h0u * ns * (g * d) as u64 * 4;
            let out = self.out.ptr + r0 * d as u64 * 4;
            {
                let mut b = st.launch_builder(&k.attn_partial);
                b.arg(&gathered)
                    .arg(&ucount)
                    .arg(&umax)
                    .arg(&q)
                    .arg(&scale)
                    .arg(&pm)
                    .arg(&pl)
                    .arg(&pacc);
                // SAFETY: partials sized [hg][nsplit][G](×D).
                unsafe { b.launch(cfg((self.nsplit as u32, hg, 1), 128)) }
                    .map_err(drv("launch attn_partial"))?;
            }
            {
                let nsi = self.nsplit as i32;
                let mut b = st.launch_builder(&k.attn_combine);
                b.arg(&pm).arg(&pl).arg(&pacc).arg(&nsi).arg(&out);
                // SAFETY: out [hg][G][D].
                unsafe { b.launch(cfg((rg, 1, 1), d as u32)) }
                    .map_err(drv("launch attn_combine"))?;
            }
            mark(6)?;
        }
        Ok(())
    }
}

/// Host-built plans of the methods whose channels do not depend on the query.
fn static_plan(
    m: &Method,
    sources: &[LayerSource],
    shape: &crate::ModelShape,
    nb: usize,
    n: usize,
) -> Result<Option<StaticPlan>> {
    let (hn, d, l_n) = (shape.kv_heads, shape.dim, shape.layers);
    let nb64 = nb as u64;
    let plane_runs = |depths: &[u8]| -> Vec<Run> {
        let mut runs = vec![Run::default(); 2 * hn * d];
        for (hc, &t) in depths.iter().enumerate().take(hn * d) {
            let t = t as u64;
            // Layout [H][2][D]: a head group's runs are one contiguous slice.
            let (h, c) = (hc / d, hc % d);
            runs[h * 2 * d + c] = Run {
                off: hc as u64 * 4 * nb64 * 8,
                len: t * nb64 * 8,
            };
            runs[h * 2 * d + d + c] = Run {
                off: (hn * d) as u64 * 4 * nb64 * 8 + hc as u64 * nb64 * 2,
                len: if t > 0 { nb64 * 2 } else { 0 },
            };
        }
        runs
    };
    let per_layer_depths: Vec<Vec<u8>> = match *m {
        Method::Fathom(_) | Method::SparQ(_) => return Ok(None),
        Method::Thumb2 => vec![vec![2u8; hn * d]; l_n],
        Method::Exact => vec![vec![4u8; hn * d]; l_n],
        Method::Loki(r) => vec![
            (0..hn * d)
                .map(|hc| if hc % d < r { 4 } else { 0 })
                .collect();
            l_n
        ],
        Method::DoubleSparsity(r) => (0..l_n)
            .map(|l| {
                let s = &sources[l % sources.len()].ds_score;
                let mut dep = vec![0u8; hn * d];
                for h in 0..hn {
                    let mut order: Vec<usize> = (0..d).collect();
                    order.sort_by(|&a, &b| s[h * d + b].total_cmp(&s[h * d + a]).then(a.cmp(&b)));
                    for &c in order.iter().take(r) {
                        dep[h * d + c] = 4;
                    }
                }
                dep
            })
            .collect(),
        Method::Landmark | Method::Quest => {
            let per_head = if *m == Method::Landmark {
                n.div_ceil(8) * d * 2
            } else {
                n.div_ceil(16) * 2 * d * 2
            } as u64;
            let runs: Vec<Run> = (0..l_n)
                .flat_map(|_| {
                    (0..hn).map(move |h| Run {
                        off: h as u64 * per_head,
                        len: per_head,
                    })
                })
                .collect();
            return Ok(Some(StaticPlan {
                depths: DevBuf::zeroed(l_n * hn * d, "static depths")?,
                runs: DevBuf::from_slice(&runs, "static runs")?,
                nruns: hn,
                max_len: per_head,
                bits: m.bits(d) as f64,
            }));
        }
    };
    let mut runs = Vec::with_capacity(l_n * 2 * hn * d);
    let mut depths = Vec::with_capacity(l_n * hn * d);
    for dep in &per_layer_depths {
        runs.extend(plane_runs(dep));
        depths.extend_from_slice(dep);
    }
    let bits = fathom_plan::plan_bits(&per_layer_depths[0][..d]) as f64;
    let max_len = per_layer_depths
        .iter()
        .flatten()
        .map(|&t| t as u64)
        .max()
        .unwrap_or(0)
        * nb64
        * 8;
    Ok(Some(StaticPlan {
        depths: DevBuf::from_slice(&depths, "static depths")?,
        runs: DevBuf::from_slice(&runs, "static runs")?,
        nruns: 2 * hn * d,
        max_len: max_len.max(nb64 * 2),
        bits,
    }))
}
