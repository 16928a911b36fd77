//! Loading a GGUF into a [`Model`]: the [`Loader`] reads each named tensor from the file,
//! kept quantized or dequantized as [`WeightMode`] says, and [`Model::load`] assembles the
//! layers for the architecture.

use super::*;

pub(crate) struct Loader<'a> {
    content: &'a Content,
    file: BufReader<File>,
    mode: WeightMode,
}

impl<'a> Loader<'a> {
    /// A loader over an opened GGUF file.
    pub(crate) fn new(content: &'a Content, file: BufReader<File>, mode: WeightMode) -> Self {
        Loader {
            content,
            file,
            mode,
        }
    }

    /// A `[rows][cols]` tensor dequantized to f32, as stored (GGUF `ne = [cols, rows]`).
    pub(crate) fn matrix(&mut self, name: &str) -> Result<(usize, usize, Vec<f32>)> {
        let q = self.qtensor(name)?;
        let dims = q.shape().dims().to_vec();
        let (rows, cols) = match dims.as_slice() {
            [o, i] => (*o, *i),
            _ => return Err(gguf_err(name, format!("expected a matrix, got {dims:?}"))),
        };
        let t = q.dequantize(&Device::Cpu).map_err(|e| gguf_err(name, e))?;
        let data = t
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| gguf_err(name, e))?;
        Ok((rows, cols, data))
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        self.content
            .tensor(&mut self.file, name, &Device::Cpu)
            .map_err(|e| gguf_err(name, e))
    }

    pub(crate) fn vec(&mut self, name: &str) -> Result<Vec<f32>> {
        let t = self.qtensor(name)?;
        let t = t.dequantize(&Device::Cpu).map_err(|e| gguf_err(name, e))?;
        t.flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| gguf_err(name, e))
    }

    pub(crate) fn opt_vec(&mut self, name: &str) -> Result<Option<Vec<f32>>> {
        if self.content.tensor_infos.contains_key(name) {
            Ok(Some(self.vec(name)?))
        } else {
            Ok(None)
        }
    }

    fn linear_from(&self, name: &str, q: Arc<QTensor>) -> Result<Linear> {
        let dims = q.shape().dims().to_vec();
        let (n_out, n_in) = match dims.as_slice() {
            [o, i] => (*o, *i),
            _ => return Err(gguf_err(name, format!("expected a matrix, got {dims:?}"))),
        };
        let dequant = match self.mode {
            WeightMode::Quantized => false,
            WeightMode::Dequantized | WeightMode::Bf16 => true,
            WeightMode::Auto => matches!(
                q.dtype(),
                GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1
            ),
        };
        let bf16 = self.mode == WeightMode::Bf16;
        let blocks = if self.mode == WeightMode::Auto {
            crate::qmatvec::QuantRows::new(&q, n_out, n_in)
        } else {
            None
        };
        let mm = if dequant {
            let t = q.dequantize(&Device::Cpu).map_err(|e| gguf_err(name, e))?;
            let t = if bf16 {
                let mut w = t
                    .flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(|e| gguf_err(name, e))?;
                round_bf16(&mut w);
                Tensor::from_vec(w, (n_out, n_in), &Device::Cpu).map_err(|e| gguf_err(name, e))?
            } else {
                t
            };
            QMatMul::Tensor(t)
        } else {
            QMatMul::from_arc(q).map_err(|e| gguf_err(name, e))?
        };
        Ok(Linear {
            mm,
            blocks,
            n_in,
            n_out,
            bf16_input: bf16,
        })
    }

    fn linear(&mut self, name: &str) -> Result<Linear> {
        let q = Arc::new(self.qtensor(name)?);
        self.linear_from(name, q)
    }
}

impl Model {
    /// Load a GGUF file (architecture `llama` or `gemma3`).
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Model> {
        let f = File::open(path).map_err(io_err("open", path))?;
        let mut file = BufReader::new(f);
        let content = read_gguf(&mut file)?;
        let cfg = Config::from_gguf(&content)?;
        let tokenizer = Tokenizer::from_gguf(&content)?;
        let mut ld = Loader {
            content: &content,
            file,
            mode: opts.weights,
        };
        let embd_q = Arc::new(ld.qtensor("token_embd.weight")?);
        let bf16 = opts.weights == WeightMode::Bf16;
        let embd = match embd_q.dtype() {
            GgmlDType::Q8_0 if !bf16 => Embedding::Q8_0(embd_q.clone()),
            _ => {
                let t = embd_q
                    .dequantize(&Device::Cpu)
                    .map_err(|e| gguf_err("token_embd.weight", e))?;
                let mut w: Vec<f32> = t
                    .flatten_all()
                    .and_then(|t| t.to_vec1())
                    .map_err(|e| gguf_err("token_embd", e))?;
                if bf16 {
                    round_bf16(&mut w);
                }
                Embedding::F32(w)
            }
        };
        let lm_head = if content.tensor_infos.contains_key("output.weight") {
            ld.linear("output.weight")?
        } else {
            // Tied embeddings: keep the LM head quantized (Q8_0 has a SIMD path) unless asked.
            let mode = ld.mode;
            ld.mode = if matches!(mode, WeightMode::Dequantized | WeightMode::Bf16) {
                mode
            } else {
                WeightMode::Quantized
            };
            let l = ld.linear_from("token_embd.weight", embd_q)?;
            ld.mode = mode;
            l
        };
        let out_norm = ld.vec("output_norm.weight")?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: ld.vec(&n("attn_norm"))?,
                wq: ld.linear(&n("attn_q"))?,
                wk: ld.linear(&n("attn_k"))?,
                wv: ld.linear(&n("attn_v"))?,
                wo: ld.linear(&n("attn_output"))?,
                q_norm: ld.opt_vec(&n("attn_q_norm"))?,
                k_norm: ld.opt_vec(&n("attn_k_norm"))?,
                post_attn_norm: ld.opt_vec(&n("post_attention_norm"))?,
                ffn_norm: ld.vec(&n("ffn_norm"))?,
                gate: ld.linear(&n("ffn_gate"))?,
                up: ld.linear(&n("ffn_up"))?,
                down: ld.linear(&n("ffn_down"))?,
                post_ffn_norm: ld.opt_vec(&n("post_ffw_norm"))?,
            });
        }
        let (hq, hkv, d) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let l0 = &layers[0];
        if l0.wq.n_out != hq * d
            || l0.wk.n_out != hkv * d
            || l0.wv.n_out != hkv * d
            || l0.wo.n_in != hq * d
        {
            return Err(gguf_err(
                "attention shapes",
                "q/k/v/o do not match heads × head_dim",
            ));
        }
        if cfg.qk_norm && (l0.q_norm.is_none() || l0.k_norm.is_none()) {
            return Err(gguf_err("attn_q_norm", "gemma3 without QK-norm weights"));
        }
        Ok(Model {
            cfg,
            tokenizer,
            embd,
            layers,
            out_norm,
            lm_head,
            bf16_kv: bf16,
        })
    }
}
