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
use fathom_cuda::{CudaError, Gpu, PagedCache};
use fathom_model::{Arch, Config, DenseWeights, LayerKind, RopeStyle};

use crate::decoder::{Attention, Decoder, StageTimes};
use crate::error::{GpuError, Result};
use crate::layout::{self, DecoderConfig};

const FORWARD_SRC: &str = include_str!("../kernels/forward.cu");
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

/// Device memory freed on drop: `fathom-cuda`'s allocator.
type Mem = fathom_cuda::memory::DeviceBytes;

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
    /// Rounds the weights to bf16, uploads them, compiles the kernels and makes the cache
    /// ([`DecoderConfig::cache_config`]).
    ///
    /// # Errors
    /// A weight that is not finite (named), limits the cache refuses, cuBLAS or NVRTC missing,
    /// an allocation that does not fit (typed, with its size).
    pub fn new(gpu: &Gpu, weights: &DenseWeights, dcfg: DecoderConfig) -> Result<Self> {
        layout::check_norms(weights)?;
        Self::build(gpu, weights.config.clone(), dcfg, Init::Dense(weights))
    }

    /// A decoder for `cfg` with **random** bf16 weights made on the device (uniform, variance
    /// `1/n_in`; norms 1): the throughput convention of vLLM's `--load-format dummy`
    /// ([`crate::presets`]). Its outputs mean nothing; label every result.
    ///
    /// # Errors
    /// As [`GpuDecoder::new`].
    pub fn random(gpu: &Gpu, cfg: Config, seed: u64, dcfg: DecoderConfig) -> Result<Self> {
        Self::build(gpu, cfg, dcfg, Init::Random(seed))
    }

    fn build(gpu: &Gpu, cfg: Config, dcfg: DecoderConfig, init: Init<'_>) -> Result<Self> {
        let cache_cfg = dcfg.cache_config(&cfg)?;
        cublas_present().map_err(|message| GpuError::NoCublas { message })?;
        let stream = gpu.stream().clone();
        stream
            .context()
            .bind_to_thread()
            .map_err(drv("bind context"))?;
        let blas = std::panic::catch_unwind(|| CudaBlas::new(stream.clone()))
            .map_err(|_| GpuError::NoCublas {
                message: "cudarc's cuBLAS loader panicked".into(),
            })?
            .map_err(blas_err("cublasCreate"))?;
        // Experiment switch (crate::cublas_math): FATHOM_GPU_MATH=pedantic asks cuBLAS for the
        // prescribed precision in every phase (no reduced-precision accumulation), to see how
        // much of the distance from the f32 model the tensor cores' accumulation adds
        // (fathom_gpu::parity).
        if crate::cublas_math() == "pedantic" {
            // SAFETY: a live handle; sets a mode flag.
            unsafe {
                bsys::cublasSetMathMode(*blas.handle(), bsys::cublasMath_t::CUBLAS_PEDANTIC_MATH)
            }
            .result()
            .map_err(blas_err("cublasSetMathMode"))?;
        }
        let (e, hq, hkv, d, f) = (
            cfg.n_embd,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            cfg.n_ff,
        );
        let module = gpu.load_module(
            "forward.cu",
            FORWARD_SRC,
            vec![format!("-DDIM={d}"), "--fmad=false".into()],
        )?;
        let k = |n: &str| module.load_function(n).map_err(drv("load_function"));
        let kernels = Kernels {
            embed: k("embed")?,
            rmsnorm_bf16: k("rmsnorm_bf16")?,
            norm_add: k("norm_add")?,
            qkv_post: k("qkv_post")?,
            act_mul: k("act_mul")?,
            to_bf16: k("to_bf16")?,
            causal_softmax: k("causal_softmax")?,
            window_decode: k("window_decode")?,
            argmax_rows: k("argmax_rows")?,
            fill_bf16: k("fill_uniform_bf16")?,
            fill_f32: k("fill_uniform_f32")?,
        };
        let (embedding, lm_head, out_norm, blocks) = match init {
            Init::Dense(weights) => {
                let (emb, head) = layout::pack_embeddings(weights)?;
                let embedding = Weight::new(&emb, cfg.vocab_size, e, "embedding")?;
                let lm_head = head
                    .map(|h| Weight::new(&h, cfg.vocab_size, e, "LM head"))
                    .transpose()?;
                let opt =
                    |v: &Option<Vec<f32>>, what| v.as_ref().map(|v| mem_from(v, what)).transpose();
                let mut blocks = Vec::with_capacity(cfg.n_layers);
                for (l, w) in weights.layers.iter().enumerate() {
                    let p = layout::pack_layer(w, l)?;
                    blocks.push(Block {
                        wqkv: Weight::new(&p.wqkv, (hq + 2 * hkv) * d, e, "Wqkv")?,
                        wo: Weight::new(&p.wo, e, hq * d, "Wo")?,
                        wgu: Weight::new(&p.wgu, 2 * f, e, "Wgate|Wup")?,
                        wd: Weight::new(&p.wd, e, f, "Wdown")?,
                        attn_norm: mem_from(&w.attn_norm, "attn_norm")?,
                        ffn_norm: mem_from(&w.ffn_norm, "ffn_norm")?,
                        q_norm: opt(&w.q_norm, "q_norm")?,
                        k_norm: opt(&w.k_norm, "k_norm")?,
                        post_attn: opt(&w.post_attn_norm, "post_attention_norm")?,
                        post_ffn: opt(&w.post_ffn_norm, "post_ffw_norm")?,
                    });
                }
                let out_norm = mem_from(&weights.out_norm, "output_norm")?;
                (embedding, lm_head, out_norm, blocks)
            }
            Init::Random(seed) => {
                let mut salt = 0u64;
                let mut rnd = |rows: usize, cols: usize, what: &'static str| -> Result<Weight> {
                    salt += 1;
                    let n = rows * cols;
                    let mem = mem(n * 2, what)?;
                    // Variance 1/n_in: uniform on ±√(3/n_in) (the embedding: ±1).
                    let scale = if what == "embedding" {
                        1.0f32
                    } else {
                        (3.0 / cols as f32).sqrt()
                    };
                    let (n64, sd) = (n as u64, seed.wrapping_mul(1_000_003).wrapping_add(salt));
                    let mut b = stream.launch_builder(&kernels.fill_bf16);
                    b.arg(&mem.ptr()).arg(&n64).arg(&sd).arg(&scale);
                    // SAFETY: mem holds n bf16; a grid-stride loop over n.
                    unsafe { b.launch(launch((1024, 1, 1), THREADS, 0)) }
                        .map_err(drv("launch fill_uniform_bf16"))?;
                    Ok(Weight { mem, rows, cols })
                };
                let embedding = rnd(cfg.vocab_size, e, "embedding")?;
                let lm_head = Some(rnd(cfg.vocab_size, e, "LM head")?);
                let mut blocks = Vec::with_capacity(cfg.n_layers);
                for _ in 0..cfg.n_layers {
                    blocks.push(Block {
                        wqkv: rnd((hq + 2 * hkv) * d, e, "Wqkv")?,
                        wo: rnd(e, hq * d, "Wo")?,
                        wgu: rnd(2 * f, e, "Wgate|Wup")?,
                        wd: rnd(e, f, "Wdown")?,
                        attn_norm: mem_from(&vec![1f32; e], "attn_norm")?,
                        ffn_norm: mem_from(&vec![1f32; e], "ffn_norm")?,
                        q_norm: cfg
                            .qk_norm
                            .then(|| mem_from(&vec![1f32; d], "q_norm"))
                            .transpose()?,
                        k_norm: cfg
                            .qk_norm
                            .then(|| mem_from(&vec![1f32; d], "k_norm"))
                            .transpose()?,
                        post_attn: None,
                        post_ffn: None,
                    });
                }
                let out_norm = mem_from(&vec![1f32; e], "output_norm")?;
                (embedding, lm_head, out_norm, blocks)
            }
        };
        let window = layout::max_window(&cfg);
        let r = dcfg.max_rows();
        let b = dcfg.max_batch;
        let win_rows = dcfg.max_tokens.max(b * window);
        let widest = e.max(hq * d).max(f);
        let work = Work {
            tokens: mem(r * 4, "tokens")?,
            pos: mem(r * 4, "positions")?,
            counts: mem(b * 4, "window counts")?,
            x: mem(r * e * 4, "residual")?,
            xb: mem(r * widest * 2, "matmul inputs")?,
            qkv: mem(r * (hq + 2 * hkv) * d * 4, "qkv")?,
            q: mem(r * hq * d * 4, "q")?,
            k: mem(r * hkv * d * 4, "k")?,
            v: mem(r * hkv * d * 4, "v")?,
            o: mem(r * hq * d * 4, "attention output")?,
            a: mem(r * e * 4, "projection output")?,
            gu: mem(r * 2 * f * 4, "gate|up")?,
            logits: mem(b * cfg.vocab_size * 4, "logits")?,
            sampled: mem(b * 4, "sampled tokens")?,
            kwin: mem(win_rows * hkv * d * 4, "attention keys")?,
            vwin: mem(win_rows * hkv * d * 4, "attention values")?,
            scores: mem(dcfg.prefill_chunk * dcfg.max_tokens * 4, "prefill scores")?,
        };
        let cache = PagedCache::new(gpu, cache_cfg)?;
        Ok(GpuDecoder {
            cfg,
            dcfg,
            stream,
            blas,
            kernels,
            _module: module,
            cache,
            embedding,
            lm_head,
            out_norm,
            blocks,
            work,
            window,
            timing: None,
            blas_workspace: None,
        })
    }

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

    /// `y[rows][w.rows] = x[rows][w.cols] · wᵀ` with bf16 `x` and `w`, f32 `y` and sums.
    fn linear(&self, w: &Weight, x: u64, rows: usize, y: u64) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: w holds rows·cols bf16; x holds `rows` rows of w.cols bf16 and y `rows` rows
        // of w.rows f32 (the work buffers are sized for max_rows); alpha/beta are host f32.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                bsys::cublasOperation_t::CUBLAS_OP_T,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                w.rows as i32,
                rows as i32,
                w.cols as i32,
                &alpha as *const f32 as *const c_void,
                w.mem.ptr() as *const c_void,
                bsys::cudaDataType::CUDA_R_16BF,
                w.cols as i32,
                x as *const c_void,
                bsys::cudaDataType::CUDA_R_16BF,
                w.cols as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                bsys::cudaDataType::CUDA_R_32F,
                w.rows as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err("gemm_ex"))
    }

    /// Column-major f32 GEMM `C = α op(A) op(B)` (the prefill attention's two products).
    #[allow(clippy::too_many_arguments)]
    fn sgemm(
        &self,
        ta: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: u64,
        lda: usize,
        b: u64,
        ldb: usize,
        c: u64,
        ldc: usize,
    ) -> Result<()> {
        let beta = 0f32;
        let op = |t: bool| {
            if t {
                bsys::cublasOperation_t::CUBLAS_OP_T
            } else {
                bsys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // SAFETY: the callers pass work buffers and cache reads sized for these extents.
        unsafe {
            blas::sgemm(
                *self.blas.handle(),
                op(ta),
                op(false),
                m as i32,
                n as i32,
                k as i32,
                &alpha,
                a as *const f32,
                lda as i32,
                b as *const f32,
                ldb as i32,
                &beta,
                c as *mut f32,
                ldc as i32,
            )
        }
        .map_err(blas_err("sgemm"))
    }

    fn rmsnorm(&self, x: u64, w: u64, rows: usize, out: u64) -> Result<()> {
        let e = self.cfg.n_embd as u32;
        let eps = self.cfg.rms_eps;
        let mut b = self.stream.launch_builder(&self.kernels.rmsnorm_bf16);
        b.arg(&x).arg(&w).arg(&e).arg(&eps).arg(&out);
        // SAFETY: x and out hold `rows` rows of E; w holds E.
        unsafe { b.launch(launch((rows as u32, 1, 1), THREADS, 0)) }
            .map_err(drv("launch rmsnorm_bf16"))?;
        Ok(())
    }

    fn norm_add(&self, w: Option<&Mem>, rows: usize) -> Result<()> {
        let (x, a) = (self.work.x.ptr(), self.work.a.ptr());
        let wp = w.map_or(0u64, |m| m.ptr());
        let e = self.cfg.n_embd as u32;
        let eps = self.cfg.rms_eps;
        let mut b = self.stream.launch_builder(&self.kernels.norm_add);
        b.arg(&x).arg(&a).arg(&wp).arg(&e).arg(&eps);
        // SAFETY: x and a hold `rows` rows of E; w (when not null) holds E.
        unsafe { b.launch(launch((rows as u32, 1, 1), THREADS, 0)) }
            .map_err(drv("launch norm_add"))?;
        Ok(())
    }

    fn to_bf16(&self, x: u64, n: usize, out: u64) -> Result<()> {
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&self.kernels.to_bf16);
        b.arg(&x).arg(&out).arg(&n64);
        // SAFETY: x holds n f32 and out n bf16.
        unsafe {
            b.launch(launch(
                (n.div_ceil(THREADS as usize) as u32, 1, 1),
                THREADS,
                0,
            ))
        }
        .map_err(drv("launch to_bf16"))?;
        Ok(())
    }

    /// Uploads this forward's token ids and positions (pageable copies: staged by the driver
    /// before the call returns).
    fn upload(&self, tokens: &[u32], pos: &[u32]) -> Result<()> {
        // SAFETY: both buffers hold max_rows u32 and the slices are no longer (checked by the
        // callers).
        unsafe {
            result::memcpy_htod_async(self.work.tokens.ptr(), tokens, self.stream.cu_stream())
                .map_err(drv("memcpy_htod tokens"))?;
            result::memcpy_htod_async(self.work.pos.ptr(), pos, self.stream.cu_stream())
                .map_err(drv("memcpy_htod positions"))?;
        }
        Ok(())
    }

    /// The forward of `rows` rows whose tokens and positions are uploaded and whose cache rows
    /// are reserved in `batch`; `prefill` says which attention the global layers use. Leaves
    /// the final hidden states in `work.x`.
    fn layers(
        &mut self,
        batch: &AppendBatch,
        rows: usize,
        prefill: Option<(usize, usize)>,
        attention: Option<&Attention>,
    ) -> Result<()> {
        let c = self.cfg.clone();
        let (e, hq, hkv, d, f) = (c.n_embd, c.n_heads, c.n_kv_heads, c.head_dim, c.n_ff);
        let w = &self.work;
        let (tokens, x) = (w.tokens.ptr(), w.x.ptr());
        let scale = c.embed_scale;
        let e32 = e as u32;
        let mut b = self.stream.launch_builder(&self.kernels.embed);
        b.arg(&tokens)
            .arg(&self.embedding.mem.ptr())
            .arg(&e32)
            .arg(&scale)
            .arg(&x);
        // SAFETY: tokens holds `rows` ids < vocab (checked); the table is [vocab][E].
        unsafe { b.launch(launch((rows as u32, 1, 1), THREADS, 0)) }
            .map_err(drv("launch embed"))?;
        for l in 0..c.n_layers {
            let blk = &self.blocks[l];
            let w = &self.work;
            self.rmsnorm(w.x.ptr(), blk.attn_norm.ptr(), rows, w.xb.ptr())?;
            self.linear(&blk.wqkv, w.xb.ptr(), rows, w.qkv.ptr())?;
            let qn = blk.q_norm.as_ref().map_or(0u64, |m| m.ptr());
            let kn = blk.k_norm.as_ref().map_or(0u64, |m| m.ptr());
            let (hq32, hkv32) = (hq as u32, hkv as u32);
            let eps = c.rms_eps;
            let base = layout::rope_base(&c, l);
            let neox = u32::from(c.rope_style == RopeStyle::Neox);
            let mut b = self.stream.launch_builder(&self.kernels.qkv_post);
            b.arg(&w.qkv.ptr())
                .arg(&w.pos.ptr())
                .arg(&qn)
                .arg(&kn)
                .arg(&hq32)
                .arg(&hkv32)
                .arg(&eps)
                .arg(&base)
                .arg(&neox)
                .arg(&w.q.ptr())
                .arg(&w.k.ptr())
                .arg(&w.v.ptr());
            // SAFETY: qkv holds `rows` rows of (Hq + 2Hkv)·D; q, k, v their parts; pos `rows`.
            unsafe { b.launch(launch((rows as u32, (hq + 2 * hkv) as u32, 1), d as u32, 0)) }
                .map_err(drv("launch qkv_post"))?;
            let kv = KvRows {
                k: w.k.view_as(KvDtype::F32).slice(0..rows * hkv * d)?,
                v: w.v.view_as(KvDtype::F32).slice(0..rows * hkv * d)?,
                rows,
            };
            let t = self.mark()?;
            self.cache.append(batch, l, &kv)?;
            Self::close(&self.stream, &mut self.timing, t, |tm| &mut tm.appends)?;
            let kind = c.layer_kinds[l];
            let t = self.mark()?;
            match (prefill, attention, kind) {
                (None, Some(att), LayerKind::Global) => {
                    let q = QueryRows {
                        q: w.q.view_as(KvDtype::F32),
                    };
                    self.cache.attend(
                        batch,
                        l,
                        att.method,
                        &att.params,
                        &q,
                        w.o.view_mut_as(KvDtype::F32),
                    )?;
                }
                (None, _, _) => self.window_decode(batch, l, rows)?,
                (Some((pos0, end)), _, _) => {
                    self.prefill_attention(batch, l, kind, pos0, end, rows)?
                }
            }
            Self::close(&self.stream, &mut self.timing, t, |tm| &mut tm.attention)?;
            let blk = &self.blocks[l];
            let w = &self.work;
            self.to_bf16(w.o.ptr(), rows * hq * d, w.xb.ptr())?;
            self.linear(&blk.wo, w.xb.ptr(), rows, w.a.ptr())?;
            self.norm_add(blk.post_attn.as_ref(), rows)?;
            self.rmsnorm(w.x.ptr(), blk.ffn_norm.ptr(), rows, w.xb.ptr())?;
            self.linear(&blk.wgu, w.xb.ptr(), rows, w.gu.ptr())?;
            let f32_ = f as u32;
            let gelu = u32::from(c.arch == Arch::Gemma3);
            let mut b = self.stream.launch_builder(&self.kernels.act_mul);
            b.arg(&w.gu.ptr()).arg(&f32_).arg(&gelu).arg(&w.xb.ptr());
            // SAFETY: gu holds `rows` rows of 2F f32, xb `rows` rows of F bf16 (widest ≥ F).
            unsafe {
                b.launch(launch(
                    (rows as u32, f.div_ceil(THREADS as usize) as u32, 1),
                    THREADS,
                    0,
                ))
            }
            .map_err(drv("launch act_mul"))?;
            self.linear(&blk.wd, w.xb.ptr(), rows, w.a.ptr())?;
            self.norm_add(blk.post_ffn.as_ref(), rows)?;
        }
        Ok(())
    }

    /// Dense causal attention of one session's prefill chunk (`rows` queries at positions
    /// `pos0..end`) over the cache's rows of layer `l`, per query head two f32 GEMMs around the
    /// masked softmax.
    fn prefill_attention(
        &self,
        batch: &AppendBatch,
        l: usize,
        kind: LayerKind,
        pos0: usize,
        end: usize,
        rows: usize,
    ) -> Result<()> {
        let c = &self.cfg;
        let (hq, hkv, d, g) = (c.n_heads, c.n_kv_heads, c.head_dim, c.group());
        let w = &self.work;
        let cap = layout::prefill_rows(kind, end, rows);
        self.cache.read_rows(
            batch,
            l,
            cap,
            w.kwin.view_mut_as(KvDtype::F32),
            w.vwin.view_mut_as(KvDtype::F32),
        )?;
        let key0 = (end - cap) as u32;
        let window = kind.window().unwrap_or(0) as u32;
        let scale = 1.0 / (d as f32).sqrt();
        let (cap32, pos32) = (cap as u32, pos0 as u32);
        for hd in 0..hq {
            let h = hd / g;
            // Sᵀ (cap × rows, column-major) = K_h (D × cap)ᵀ · Q_hd (D × rows): row r of S is
            // query r's scores over the cap keys.
            self.sgemm(
                true,
                cap,
                rows,
                d,
                scale,
                w.kwin.ptr() + (h * d * 4) as u64,
                hkv * d,
                w.q.ptr() + (hd * d * 4) as u64,
                hq * d,
                w.scores.ptr(),
                cap,
            )?;
            let mut b = self.stream.launch_builder(&self.kernels.causal_softmax);
            b.arg(&w.scores.ptr())
                .arg(&cap32)
                .arg(&key0)
                .arg(&pos32)
                .arg(&window);
            // SAFETY: scores holds rows · cap f32 (rows ≤ chunk, cap ≤ max_tokens).
            unsafe { b.launch(launch((rows as u32, 1, 1), THREADS, 0)) }
                .map_err(drv("launch causal_softmax"))?;
            // O_hd (D × rows) = V_h (D × cap) · P (cap × rows).
            self.sgemm(
                false,
                d,
                rows,
                cap,
                1.0,
                w.vwin.ptr() + (h * d * 4) as u64,
                hkv * d,
                w.scores.ptr(),
                cap,
                w.o.ptr() + (hd * d * 4) as u64,
                hq * d,
            )?;
        }
        Ok(())
    }

    /// Sliding-window (or, for a dense decode, any non-global) layer of a decode batch: each
    /// session's last `min(len, W)` rows from the cache, then one CTA per query head.
    fn window_decode(&self, batch: &AppendBatch, l: usize, rows: usize) -> Result<()> {
        let c = &self.cfg;
        let w = &self.work;
        // No session holds more than max_tokens rows, so a wider window reads the same rows.
        let win = c.layer_kinds[l]
            .window()
            .unwrap_or(self.window)
            .clamp(1, self.dcfg.max_tokens);
        let counts: Vec<u32> = batch
            .plans
            .iter()
            .map(|p| p.end_token().min(win) as u32)
            .collect();
        // SAFETY: counts holds max_batch u32 ≥ the batch; a pageable copy, staged at once.
        unsafe { result::memcpy_htod_async(w.counts.ptr(), &counts, self.stream.cu_stream()) }
            .map_err(drv("memcpy_htod window counts"))?;
        self.cache.read_rows(
            batch,
            l,
            win,
            w.kwin.view_mut_as(KvDtype::F32),
            w.vwin.view_mut_as(KvDtype::F32),
        )?;
        let (win32, hq32, hkv32) = (win as u32, c.n_heads as u32, c.n_kv_heads as u32);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let mut b = self.stream.launch_builder(&self.kernels.window_decode);
        b.arg(&w.q.ptr())
            .arg(&w.kwin.ptr())
            .arg(&w.vwin.ptr())
            .arg(&w.counts.ptr())
            .arg(&win32)
            .arg(&hq32)
            .arg(&hkv32)
            .arg(&scale)
            .arg(&w.o.ptr());
        // SAFETY: q/o hold `rows` rows of Hq·D; kwin/vwin rows·W rows of Hkv·D (sized for
        // max_batch · window); counts ≤ W.
        unsafe {
            b.launch(launch(
                (rows as u32, c.n_heads as u32, 1),
                THREADS,
                win32 * 4,
            ))
        }
        .map_err(drv("launch window_decode"))?;
        Ok(())
    }

    /// Final norm and LM head of `rows` hidden states starting at row `first` of `work.x`; the
    /// logits `[rows][vocab]` copied to the host (waits for the stream).
    fn logits(&self, first: usize, rows: usize) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let w = &self.work;
        self.lm_head_rows(first, rows)?;
        let mut out = vec![0f32; rows * c.vocab_size];
        self.stream.synchronize().map_err(drv("synchronize"))?;
        // SAFETY: logits holds max_batch · vocab ≥ rows · vocab f32; the stream is idle.
        unsafe { result::memcpy_dtoh_sync(&mut out, w.logits.ptr()) }
            .map_err(drv("memcpy_dtoh logits"))?;
        if let Some(i) = out.iter().position(|v| !v.is_finite()) {
            return Err(GpuError::invalid(
                "logits",
                format!(
                    "row {} token {} is {} (the forward overflowed)",
                    i / c.vocab_size,
                    i % c.vocab_size,
                    out[i]
                ),
            ));
        }
        Ok(out)
    }

    /// Final norm and LM head of `rows` hidden states from row `first` into `work.logits`.
    fn lm_head_rows(&self, first: usize, rows: usize) -> Result<()> {
        let w = &self.work;
        let x = w.x.ptr() + (first * self.cfg.n_embd * 4) as u64;
        self.rmsnorm(x, self.out_norm.ptr(), rows, w.xb.ptr())?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embedding);
        self.linear(head, w.xb.ptr(), rows, w.logits.ptr())
    }

    /// Checks a decode batch, reserves its rows and runs every layer (no logits yet).
    fn decode_layers(&mut self, batch: &[(SessionId, u32)], attention: &Attention) -> Result<()> {
        let ab = self.decode_prologue(batch, attention)?;
        self.layers(&ab, batch.len(), None, Some(attention))
    }

    /// The host part of a decode step: checks the batch and the method, reserves one row per
    /// session and uploads the ids and positions.
    fn decode_prologue(
        &mut self,
        batch: &[(SessionId, u32)],
        attention: &Attention,
    ) -> Result<AppendBatch> {
        let toks: Vec<u32> = batch.iter().map(|&(_, t)| t).collect();
        layout::check_tokens(&self.cfg, &toks)?;
        let mut pos = Vec::with_capacity(batch.len());
        for &(s, _) in batch {
            pos.push(self.cache.len(s)? as u32);
        }
        self.prepare(attention.method)?;
        let mut global = false;
        for (l, kind) in self.cfg.layer_kinds.iter().enumerate() {
            if *kind == LayerKind::Global {
                self.cache.check_method(attention.method, l)?;
                global = true;
            }
        }
        // The first global layer's attend would refuse a bad selection only after the reserve
        // and the appends of the layers before it: check it before anything changes.
        if global {
            fathom_cuda::cache::check_select(self.cache.config(), &attention.params)?;
        }
        let sessions: Vec<(SessionId, usize)> = batch.iter().map(|&(s, _)| (s, 1)).collect();
        let ab = self.cache.reserve(&sessions)?;
        self.upload(&toks, &pos)?;
        Ok(ab)
    }

    /// One decode step sampled greedily on the device: appends one token to each session of
    /// `batch` and returns each session's argmax (the lowest index among equal maxima, as
    /// `fathom_model::argmax`), copying only the ids to the host.
    ///
    /// # Errors
    /// As [`Decoder::decode`]; a row whose logits are all NaN (the forward overflowed).
    pub fn decode_greedy(
        &mut self,
        batch: &[(SessionId, u32)],
        attention: &Attention,
    ) -> Result<Vec<u32>> {
        let step = self.mark()?;
        self.decode_layers(batch, attention)?;
        let t = self.mark()?;
        self.sample_greedy(batch.len())?;
        Self::close(&self.stream, &mut self.timing, t, |tm| &mut tm.sampling)?;
        Self::close(&self.stream, &mut self.timing, step, |tm| &mut tm.steps)?;
        self.read_sampled(batch.len())
    }

    /// The LM head and the argmax of the first `rows` rows of the final hidden states, into
    /// `work.sampled` (queued only).
    fn sample_greedy(&self, rows: usize) -> Result<()> {
        self.lm_head_rows(0, rows)?;
        let w = &self.work;
        let v = self.cfg.vocab_size as u32;
        let mut b = self.stream.launch_builder(&self.kernels.argmax_rows);
        b.arg(&w.logits.ptr()).arg(&v).arg(&w.sampled.ptr());
        // SAFETY: logits holds rows · vocab f32 and sampled max_batch ≥ rows u32.
        unsafe { b.launch(launch((rows as u32, 1, 1), THREADS, 0)) }
            .map_err(drv("launch argmax_rows"))?;
        Ok(())
    }

    /// Waits for the stream, then the `rows` sampled ids (a row past the vocabulary had no
    /// finite logit).
    fn read_sampled(&self, rows: usize) -> Result<Vec<u32>> {
        self.stream.synchronize().map_err(drv("synchronize"))?;
        let mut out = vec![0u32; rows];
        // SAFETY: sampled holds at least `rows` u32; the stream is idle.
        unsafe { result::memcpy_dtoh_sync(&mut out, self.work.sampled.ptr()) }
            .map_err(drv("memcpy_dtoh sampled tokens"))?;
        if let Some(i) = out.iter().position(|&t| t as usize >= self.cfg.vocab_size) {
            return Err(GpuError::invalid(
                "logits",
                format!("row {i} has no finite maximum (the forward overflowed)"),
            ));
        }
        Ok(out)
    }

    /// [`GpuDecoder::decode_greedy`] whose device work (every layer's forward, append and
    /// attention, the LM head and the argmax) is captured as one CUDA graph, then run once by
    /// replaying it: the step's tokens, and the graph for [`GpuDecoder::replay_greedy`] of the
    /// same sessions with the same attention. The host work left per step is the reserve, the
    /// upload of ids and positions, one graph launch and the copy of the sampled ids. The
    /// cache sizes the attention grids for `max_tokens` while capturing (docs/SPEC.md §6.1),
    /// so the graph stays valid as the sessions grow.
    ///
    /// # Errors
    /// As [`GpuDecoder::decode_greedy`]; instrumentation on (events are not captured); a model
    /// with sliding-window layers (their per-step row counts are uploaded from pageable
    /// memory, which a graph may not capture); a failed capture.
    pub fn capture_greedy(
        &mut self,
        batch: &[(SessionId, u32)],
        attention: &Attention,
    ) -> Result<(Vec<u32>, StepGraph)> {
        if self.timing.is_some() {
            return Err(GpuError::invalid(
                "capture",
                "instrumentation is on (set_instrument(false) first)",
            ));
        }
        if self.cfg.layer_kinds.iter().any(|k| *k != LayerKind::Global) {
            return Err(GpuError::invalid(
                "capture",
                format!(
                    "{} has sliding-window layers: its decode step is not captured",
                    self.cfg.name
                ),
            ));
        }
        if self.blas_workspace.is_none() {
            let ws = mem(BLAS_WORKSPACE_BYTES, "cuBLAS workspace")?;
            // SAFETY: the workspace outlives the handle's use of it (both live in `self`; the
            // handle is only used on this decoder's stream).
            unsafe {
                bsys::cublasSetWorkspace_v2(
                    *self.blas.handle(),
                    ws.ptr() as *mut std::ffi::c_void,
                    BLAS_WORKSPACE_BYTES,
                )
            }
            .result()
            .map_err(blas_err("cublasSetWorkspace"))?;
            self.blas_workspace = Some(ws);
        }
        let ab = self.decode_prologue(batch, attention)?;
        let rows = batch.len();
        self.cache.begin_capture(&ab)?;
        let ran = self
            .layers(&ab, rows, None, Some(attention))
            .and_then(|()| self.sample_greedy(rows));
        let graph = self.cache.end_capture();
        ran?;
        let graph = graph?;
        self.cache.replay(&ab, &graph)?;
        let out = self.read_sampled(rows)?;
        Ok((
            out,
            StepGraph {
                graph,
                sessions: batch.iter().map(|b| b.0).collect(),
                attention: *attention,
            },
        ))
    }

    /// One greedy decode step of the sessions `graph` was captured for (in its order, each
    /// with the token it decodes), by replaying it.
    ///
    /// # Errors
    /// Other sessions or another order than the captured ones; the checks of
    /// [`GpuDecoder::decode_greedy`]; a device failure.
    pub fn replay_greedy(
        &mut self,
        graph: &StepGraph,
        batch: &[(SessionId, u32)],
    ) -> Result<Vec<u32>> {
        if batch.len() != graph.sessions.len()
            || batch.iter().zip(&graph.sessions).any(|(b, s)| b.0 != *s)
        {
            return Err(GpuError::invalid(
                "replay",
                "the batch's sessions are not the ones the graph was captured for",
            ));
        }
        self.cache.check_graph(&graph.graph)?;
        let ab = self.decode_prologue(batch, &graph.attention)?;
        self.cache.replay(&ab, &graph.graph)?;
        self.read_sampled(batch.len())
    }

    /// Appends `tokens` **synthetic** K/V rows to `session` in every layer (keys uniform with
    /// channel spreads `0.1 + c/D`, values uniform on ±1, made on the device from `seed`) with
    /// no forward: how a throughput run fills long contexts of a model with random weights,
    /// whose prefill would compute nothing meaningful. Label every result.
    ///
    /// # Errors
    /// A session past its capacity; device failures.
    pub fn fill_synthetic(&mut self, session: SessionId, tokens: usize, seed: u64) -> Result<()> {
        let c = &self.cfg;
        let row = c.n_kv_heads * c.head_dim;
        let chunk = self.dcfg.prefill_chunk;
        let n0 = self.cache.len(session)?;
        if n0 + tokens > self.dcfg.max_tokens {
            return Err(GpuError::invalid(
                "fill_synthetic",
                format!(
                    "{n0} + {tokens} tokens past max_tokens {}",
                    self.dcfg.max_tokens
                ),
            ));
        }
        if tokens > 0 {
            self.cache.check_reserve(&[(session, tokens)])?;
        }
        let mut done = 0;
        while done < tokens {
            let m = chunk.min(tokens - done);
            let batch = self.cache.reserve(&[(session, m)])?;
            for l in 0..c.n_layers {
                for (buf, slope) in [(self.work.k.ptr(), 1u32), (self.work.v.ptr(), 0u32)] {
                    let n = (m * row) as u64;
                    let sd = seed
                        .wrapping_mul(0x9E37_79B9)
                        .wrapping_add(((n0 + done) * c.n_layers + l) as u64 * 2 + slope as u64);
                    let mut b = self.stream.launch_builder(&self.kernels.fill_f32);
                    b.arg(&buf).arg(&n).arg(&sd).arg(&slope);
                    // SAFETY: k and v hold max_rows ≥ m rows of Hkv·D f32.
                    unsafe { b.launch(launch((256, 1, 1), THREADS, 0)) }
                        .map_err(drv("launch fill_uniform_f32"))?;
                }
                let n = m * c.n_kv_heads * c.head_dim;
                let kv = KvRows {
                    k: self.work.k.view_as(KvDtype::F32).slice(0..n)?,
                    v: self.work.v.view_as(KvDtype::F32).slice(0..n)?,
                    rows: m,
                };
                self.cache.append(&batch, l, &kv)?;
            }
            done += m;
        }
        Ok(())
    }

    /// Turns the per-stage timing of [`GpuDecoder::decode_greedy`] steps on or off (CUDA events
    /// around every append, attention and the sampling; leave it off for throughput). The
    /// split of each attend by stage comes from the cache, when it was made with
    /// [`fathom_cuda::cache::CacheOptions::stage_timing`] (`DecoderConfig::options`).
    pub fn set_instrument(&mut self, on: bool) {
        self.timing = on.then(Timing::default);
    }

    /// The stage times of the instrumented steps since the last call (waits for the stream).
    ///
    /// # Errors
    /// Instrumentation off; a driver failure.
    pub fn take_stage_times(&mut self) -> Result<StageTimes> {
        let tm = self.timing.replace(Timing::default()).ok_or_else(|| {
            GpuError::invalid("stage times", "instrumentation is off (set_instrument)")
        })?;
        self.stream.synchronize().map_err(drv("synchronize"))?;
        let sum = |v: &[(CudaEvent, CudaEvent)]| -> Result<f64> {
            let mut t = 0.0;
            for (a, b) in v {
                t += a.elapsed_ms(b).map_err(drv("event elapsed"))? as f64;
            }
            Ok(t)
        };
        let (total, attention, appends, sampling) = (
            sum(&tm.steps)?,
            sum(&tm.attention)?,
            sum(&tm.appends)?,
            sum(&tm.sampling)?,
        );
        Ok(StageTimes {
            steps: tm.steps.len(),
            total_ms: total,
            attention_ms: attention,
            appends_ms: appends,
            sampling_ms: sampling,
            weights_ms: (total - attention - appends - sampling).max(0.0),
            attend: self.cache.stage_times()?,
        })
    }

    /// A timing event recorded now when instrumenting.
    fn mark(&self) -> Result<Option<CudaEvent>> {
        if self.timing.is_none() {
            return Ok(None);
        }
        Ok(Some(
            self.stream
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv("event record"))?,
        ))
    }

    /// Closes a `mark` into the stage list `pick` chooses (a function of the two fields, so
    /// that callers may hold other fields borrowed).
    fn close(
        stream: &CudaStream,
        timing: &mut Option<Timing>,
        start: Option<CudaEvent>,
        pick: impl FnOnce(&mut Timing) -> &mut Vec<(CudaEvent, CudaEvent)>,
    ) -> Result<()> {
        let (Some(a), Some(tm)) = (start, timing.as_mut()) else {
            return Ok(());
        };
        let b = stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("event record"))?;
        pick(tm).push((a, b));
        Ok(())
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

    fn prepare(&mut self, method: AttendMethod) -> Result<()> {
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

impl Decoder for GpuDecoder {
    fn create(&mut self) -> Result<SessionId> {
        Ok(self.cache.create()?)
    }

    fn fork(&mut self, parent: SessionId) -> Result<SessionId> {
        Ok(self.cache.fork(parent)?)
    }

    fn free(&mut self, session: SessionId) -> Result<()> {
        Ok(self.cache.free(session)?)
    }

    fn len(&self, session: SessionId) -> Result<usize> {
        Ok(self.cache.len(session)?)
    }

    fn truncate(&mut self, session: SessionId, len: usize) -> Result<()> {
        Ok(self.cache.truncate(session, len)?)
    }

    fn prefill(&mut self, session: SessionId, tokens: &[u32]) -> Result<Vec<f32>> {
        layout::check_tokens(&self.cfg, tokens)?;
        let n0 = self.cache.len(session)?;
        if n0 + tokens.len() > self.dcfg.max_tokens {
            return Err(GpuError::invalid(
                "prefill",
                format!(
                    "{n0} + {} tokens past the decoder's max_tokens {}",
                    tokens.len(),
                    self.dcfg.max_tokens
                ),
            ));
        }
        // The whole prompt's pages before its first chunk: no partial prompt on a full pool.
        self.cache.check_reserve(&[(session, tokens.len())])?;
        let mut pos0 = n0;
        let mut last = 0;
        for chunk in tokens.chunks(self.dcfg.prefill_chunk) {
            let batch = self.cache.reserve(&[(session, chunk.len())])?;
            let pos: Vec<u32> = (pos0..pos0 + chunk.len()).map(|p| p as u32).collect();
            self.upload(chunk, &pos)?;
            let end = pos0 + chunk.len();
            self.layers(&batch, chunk.len(), Some((pos0, end)), None)?;
            last = chunk.len();
            pos0 = end;
        }
        self.logits(last - 1, 1)
    }

    fn decode(&mut self, batch: &[(SessionId, u32)], attention: &Attention) -> Result<Vec<f32>> {
        self.decode_layers(batch, attention)?;
        self.logits(0, batch.len())
    }
}

/// `bytes` of device memory (a typed out-of-memory error naming `what`).
fn mem(bytes: usize, what: &'static str) -> Result<Mem> {
    Ok(Mem::new(bytes, what)?)
}

/// A device copy of `data`, complete when this returns.
fn mem_from<T: Copy>(data: &[T], what: &'static str) -> Result<Mem> {
    Ok(Mem::from_slice(data, what)?)
}
