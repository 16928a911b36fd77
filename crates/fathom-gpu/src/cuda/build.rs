//! Making a decoder: the weights to HBM (bf16), the kernels, the working memory and the
//! paged cache.

#[allow(unused_imports)]
use super::*;

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

    pub(super) fn build(
        gpu: &Gpu,
        cfg: Config,
        dcfg: DecoderConfig,
        init: Init<'_>,
    ) -> Result<Self> {
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
        let d = cfg.head_dim;
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
        let (embedding, lm_head, out_norm, blocks) = upload_weights(&stream, &kernels, &cfg, init)?;
        let window = layout::max_window(&cfg);
        let work = work_buffers(&cfg, &dcfg, window)?;
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
}

/// The model's weights in HBM as bf16 (norms as f32): the dense GGUF weights packed by
/// `layout`, or random ones drawn on the device (variance 1/n_in) at `cfg`'s shape.
#[allow(clippy::type_complexity)]
fn upload_weights(
    stream: &Arc<CudaStream>,
    kernels: &Kernels,
    cfg: &Config,
    init: Init<'_>,
) -> Result<(Weight, Option<Weight>, Mem, Vec<Block>)> {
    let (e, hq, hkv, d, f) = (
        cfg.n_embd,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.n_ff,
    );
    Ok(match init {
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
                b.arg(&mem.ptr).arg(&n64).arg(&sd).arg(&scale);
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
    })
}

/// The forward's working memory for `dcfg`'s limits (rows, batch, windows of `window` tokens).
fn work_buffers(cfg: &Config, dcfg: &DecoderConfig, window: usize) -> Result<Work> {
    let r = dcfg.max_rows();
    let b = dcfg.max_batch;
    let win_rows = dcfg.max_tokens.max(b * window);
    let (e, hq, hkv, d, f) = (
        cfg.n_embd,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.n_ff,
    );
    let widest = e.max(hq * d).max(f);
    Ok(Work {
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
    })
}
