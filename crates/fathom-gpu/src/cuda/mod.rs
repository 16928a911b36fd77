//! The real backend: weights in HBM as bf16, cuBLAS for every matmul, `kernels/forward.cu` for
//! the rest, and every layer's K|V in `fathom-cuda`'s paged cache.
//!
//! Per forward of `R` rows (a prefill chunk of one session, or one token of each session of a
//! decode batch), on the cache's stream with no host synchronisation until the logits are read:
//!
//! ```text
//! x = embed(tokens)
//! per layer:  qkv = Wqkv · bf16(rmsnorm(x))            (cuBLAS, bf16 × bf16 → f32)
//!             q, k, v = qkv_post(qkv)                   (QK-norm, RoPE; k, v rounded to bf16)
//!             cache.append(k, v)
//!             o = global layer, decode:  cache.attend(q)                  (the method)
//!                 otherwise:             dense over cache.read_rows(…)    (causal, windowed)
//!             x += post_norm(Wo · bf16(o));  x += post_norm(Wd · bf16(act(Wg n) ⊙ Wu n))
//! logits = Wlm · bf16(rmsnorm(x))
//! ```

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as bsys, CudaBlas};
use cudarc::driver::{
    result, CudaEvent, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use fathom_cuda::cache::{AppendBatch, AttendMethod, KvDtype, KvRows, QueryRows};
use fathom_cuda::pages::SessionId;
use fathom_cuda::prelude::*;
use fathom_cuda::{CudaError, Gpu, PagedCache};
use fathom_model::{Arch, Config, DenseWeights, LayerKind, RopeStyle};

use crate::decoder::{Attention, Decoder, StageTimes};
use crate::error::{GpuError, Result};
use crate::layout::{self, DecoderConfig};

mod build;
mod decode;
mod forward;
mod ops;
mod timing;

const FORWARD_SRC: &str = include_str!("../../kernels/forward.cu");
const THREADS: u32 = 256;

fn drv(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> GpuError {
    move |e| {
        GpuError::Cuda(CudaError::Driver {
            op,
            message: e.to_string(),
        })
    }
}

fn blas_err(op: &'static str) -> impl Fn(cudarc::cublas::result::CublasError) -> GpuError {
    move |e| GpuError::Blas {
        op,
        message: format!("{e:?}"),
    }
}

/// Device memory freed on drop (`fathom-cuda`'s allocator), with its address at hand for the
/// kernel arguments and cuBLAS calls of the forward.
#[derive(Debug)]
struct Mem {
    ptr: u64,
    buf: fathom_cuda::memory::DeviceBytes,
}

impl Mem {
    fn new(buf: fathom_cuda::memory::DeviceBytes) -> Mem {
        Mem {
            ptr: buf.ptr(),
            buf,
        }
    }

    /// The whole buffer as f32 elements, for the cache's calls.
    fn f32s(&self) -> fathom_cuda::memory::DeviceView<'_> {
        self.buf.view_as(KvDtype::F32)
    }

    /// The whole buffer as writable f32 elements, for the cache's calls. A work buffer of the
    /// forward is device memory that only kernels on the decoder's one stream read and write
    /// (the host holds no reference into it), so a shared borrow of the buffer may hand out
    /// the view its next kernel writes through.
    fn f32s_mut(&self) -> fathom_cuda::memory::DeviceViewMut<'_> {
        let n = self.buf.bytes() / 4;
        // SAFETY: `ptr` is this buffer's device address, `n` f32 long, alive while `self` is;
        // writes through the view are kernels ordered on the decoder's stream (see above).
        unsafe { fathom_cuda::memory::DeviceViewMut::from_raw(self.ptr, n, KvDtype::F32) }
    }
}

/// A bf16 matrix `[rows][cols]` in HBM.
#[derive(Debug)]
struct Weight {
    mem: Mem,
    rows: usize,
    cols: usize,
}

impl Weight {
    fn new(bits: &[u16], rows: usize, cols: usize, what: &'static str) -> Result<Weight> {
        debug_assert_eq!(bits.len(), rows * cols);
        Ok(Weight {
            mem: mem_from(bits, what)?,
            rows,
            cols,
        })
    }
}

#[derive(Debug)]
struct Block {
    wqkv: Weight,
    wo: Weight,
    wgu: Weight,
    wd: Weight,
    attn_norm: Mem,
    ffn_norm: Mem,
    q_norm: Option<Mem>,
    k_norm: Option<Mem>,
    post_attn: Option<Mem>,
    post_ffn: Option<Mem>,
}

struct Kernels {
    embed: CudaFunction,
    rmsnorm_bf16: CudaFunction,
    norm_add: CudaFunction,
    qkv_post: CudaFunction,
    act_mul: CudaFunction,
    to_bf16: CudaFunction,
    causal_softmax: CudaFunction,
    window_decode: CudaFunction,
    argmax_rows: CudaFunction,
    fill_bf16: CudaFunction,
    fill_f32: CudaFunction,
}

/// Working memory for `R` rows, sized once.
#[derive(Debug)]
struct Work {
    tokens: Mem,
    pos: Mem,
    counts: Mem,
    x: Mem,
    xb: Mem,
    qkv: Mem,
    q: Mem,
    k: Mem,
    v: Mem,
    o: Mem,
    a: Mem,
    gu: Mem,
    logits: Mem,
    sampled: Mem,
    kwin: Mem,
    vwin: Mem,
    scores: Mem,
}

/// A model's weights on a device and its sessions in the offloaded cache.
pub struct GpuDecoder {
    cfg: Config,
    dcfg: DecoderConfig,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    _module: Arc<CudaModule>,
    cache: PagedCache,
    embedding: Weight,
    lm_head: Option<Weight>,
    out_norm: Mem,
    blocks: Vec<Block>,
    work: Work,
    window: usize,
    /// Timing events of instrumented decode steps (`set_instrument`): per stage, the (start,
    /// end) pairs recorded since the last `take_stage_times`.
    timing: Option<Timing>,
    /// cuBLAS's own workspace, set before the first capture ([`GpuDecoder::capture_greedy`]):
    /// a captured GEMM may not allocate.
    blas_workspace: Option<Mem>,
}

/// Bytes of the cuBLAS workspace a captured step uses (NVIDIA's recommendation for Hopper).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A whole greedy decode step (every layer's forward, appends and attention, the LM head and
/// the argmax) captured as one CUDA graph by [`GpuDecoder::capture_greedy`], for one batch of
/// sessions and one attention; replayed by [`GpuDecoder::replay_greedy`].
pub struct StepGraph {
    graph: fathom_cuda::DecodeGraph,
    sessions: Vec<SessionId>,
    attention: Attention,
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraph")
            .field("sessions", &self.sessions)
            .field("attention", &self.attention)
            .finish_non_exhaustive()
    }
}

/// Events of instrumented steps.
#[derive(Default)]
struct Timing {
    steps: Vec<(CudaEvent, CudaEvent)>,
    attention: Vec<(CudaEvent, CudaEvent)>,
    appends: Vec<(CudaEvent, CudaEvent)>,
    sampling: Vec<(CudaEvent, CudaEvent)>,
}

impl std::fmt::Debug for GpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDecoder")
            .field("model", &self.cfg.name)
            .field("config", &self.dcfg)
            .finish_non_exhaustive()
    }
}

fn cublas_present() -> std::result::Result<(), String> {
    let mut errs = Vec::new();
    for n in ["libcublas.so.13", "libcublas.so.12", "libcublas.so"] {
        // SAFETY: loading the system's cuBLAS runs its initialisers, which cudarc does next
        // anyway; the handle is dropped at once.
        match unsafe { libloading::Library::new(n) } {
            Ok(_) => return Ok(()),
            Err(e) => errs.push(format!("{n}: {e}")),
        }
    }
    Err(errs.join("; "))
}

/// Where the weights come from.
enum Init<'a> {
    /// A model's dequantized GGUF, rounded to bf16 on the host.
    Dense(&'a DenseWeights),
    /// Random bf16 made on the device from this seed.
    Random(u64),
}

fn launch(grid: (u32, u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

impl GpuDecoder {
    /// The model's hyper-parameters.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The decoder's limits.
    pub fn decoder_config(&self) -> &DecoderConfig {
        &self.dcfg
    }

    /// The cache (for calibrations and counters).
    ///
    /// # Errors
    /// None in this build.
    pub fn cache_mut(&mut self) -> Result<&mut PagedCache> {
        Ok(&mut self.cache)
    }

    /// Bytes of device memory in use on the device (every allocation of the process and
    /// others: weights, the cache's working memory, pools in HBM residency).
    ///
    /// # Errors
    /// A driver failure.
    pub fn device_bytes_in_use(&self) -> Result<u64> {
        let (free, total) = result::mem_get_info().map_err(drv("cuMemGetInfo"))?;
        Ok((total - free) as u64)
    }

    pub(super) fn prepare(&mut self, method: AttendMethod) -> Result<()> {
        // Asked of the cache each time: a recalibration through `cache_mut` drops the static
        // tables it made from the old calibration.
        if let AttendMethod::Scan(m) = method {
            if !self.cache.is_prepared(m) {
                self.cache.prepare(m)?;
            }
        }
        Ok(())
    }
}

/// `bytes` of device memory (a typed out-of-memory error naming `what`).
fn mem(bytes: usize, what: &'static str) -> Result<Mem> {
    Ok(Mem::new(fathom_cuda::memory::DeviceBytes::new(
        bytes, what,
    )?))
}

/// A device copy of `data`, complete when this returns.
fn mem_from<T: Copy>(data: &[T], what: &'static str) -> Result<Mem> {
    Ok(Mem::new(fathom_cuda::memory::DeviceBytes::from_slice(
        data, what,
    )?))
}
