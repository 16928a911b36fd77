//! A model's weights dequantized to f32 in the GGUF's own layout, for runtimes that bring their
//! own matmuls (the GPU forward of `fathom-gpu` rounds them to bf16 and uploads them).
//!
//! Every matrix is `[rows = n_out][cols = n_in]`, row-major: `y = W x` is `y_o = Σ_i W[o][i] x_i`,
//! the layout [`crate::Model`]'s matmuls use. Channel order and norms are as [`crate::model`]
//! documents (llama q/k rows in the GGUF's interleaved-pair order, Gemma's norm weights as
//! stored, already `1 + w`).
//!
//! ```no_run
//! use fathom_model::fetch::{fetch_model, FetchOptions, ModelId};
//! use fathom_model::DenseWeights;
//!
//! # fn main() -> fathom_model::Result<()> {
//! let path = fetch_model(ModelId::Smollm2_135m, &FetchOptions::default())?;
//! let w = DenseWeights::load(&path)?;
//! assert_eq!(w.layers.len(), w.config.n_layers);
//! assert_eq!(w.layers[0].wq.rows, w.config.n_heads * w.config.head_dim);
//! # Ok(()) }
//! ```

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use crate::error::{io_err, Result};
use crate::model::{gguf_err, read_gguf, Config, Loader, WeightMode};

/// A row-major `[rows][cols]` f32 matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    /// Rows (`n_out` of a linear layer).
    pub rows: usize,
    /// Columns (`n_in`).
    pub cols: usize,
    /// `rows · cols` elements.
    pub data: Vec<f32>,
}

/// One transformer block's weights.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    /// RMSNorm before attention, `[E]`.
    pub attn_norm: Vec<f32>,
    /// `[Hq·D][E]`.
    pub wq: Matrix,
    /// `[Hkv·D][E]`.
    pub wk: Matrix,
    /// `[Hkv·D][E]`.
    pub wv: Matrix,
    /// `[E][Hq·D]`.
    pub wo: Matrix,
    /// Per-head RMSNorm of q (QK-norm), `[D]`.
    pub q_norm: Option<Vec<f32>>,
    /// Per-head RMSNorm of k, `[D]`.
    pub k_norm: Option<Vec<f32>>,
    /// RMSNorm of the attention output before the residual add (Gemma 3), `[E]`.
    pub post_attn_norm: Option<Vec<f32>>,
    /// RMSNorm before the MLP, `[E]`.
    pub ffn_norm: Vec<f32>,
    /// `[F][E]`.
    pub gate: Matrix,
    /// `[F][E]`.
    pub up: Matrix,
    /// `[E][F]`.
    pub down: Matrix,
    /// RMSNorm of the MLP output before the residual add (Gemma 3), `[E]`.
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// Every weight of a model, dequantized.
#[derive(Clone, Debug)]
pub struct DenseWeights {
    /// The hyper-parameters.
    pub config: Config,
    /// Token embeddings `[vocab][E]` (unscaled; `config.embed_scale` multiplies them).
    pub embedding: Matrix,
    /// The LM head `[vocab][E]`, or `None` when tied to the embeddings.
    pub lm_head: Option<Matrix>,
    /// The final RMSNorm, `[E]`.
    pub out_norm: Vec<f32>,
    /// The blocks, in order.
    pub layers: Vec<LayerWeights>,
}

impl DenseWeights {
    /// Reads and dequantizes every tensor of a `llama` or `gemma3` GGUF.
    ///
    /// # Errors
    /// I/O, a malformed GGUF, a missing tensor, or shapes that do not match the config.
    pub fn load(path: &Path) -> Result<DenseWeights> {
        let f = File::open(path).map_err(io_err("open", path))?;
        let mut file = BufReader::new(f);
        let content = read_gguf(&mut file)?;
        let config = Config::from_gguf(&content)?;
        let mut ld = Loader::new(&content, file, WeightMode::Dequantized);
        let matrix = |ld: &mut Loader, name: &str| -> Result<Matrix> {
            let (rows, cols, data) = ld.matrix(name)?;
            Ok(Matrix { rows, cols, data })
        };
        let embedding = matrix(&mut ld, "token_embd.weight")?;
        let lm_head = if ld.has("output.weight") {
            Some(matrix(&mut ld, "output.weight")?)
        } else {
            None
        };
        let out_norm = ld.vec("output_norm.weight")?;
        let mut layers = Vec::with_capacity(config.n_layers);
        for l in 0..config.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(LayerWeights {
                attn_norm: ld.vec(&n("attn_norm"))?,
                wq: matrix(&mut ld, &n("attn_q"))?,
                wk: matrix(&mut ld, &n("attn_k"))?,
                wv: matrix(&mut ld, &n("attn_v"))?,
                wo: matrix(&mut ld, &n("attn_output"))?,
                q_norm: ld.opt_vec(&n("attn_q_norm"))?,
                k_norm: ld.opt_vec(&n("attn_k_norm"))?,
                post_attn_norm: ld.opt_vec(&n("post_attention_norm"))?,
                ffn_norm: ld.vec(&n("ffn_norm"))?,
                gate: matrix(&mut ld, &n("ffn_gate"))?,
                up: matrix(&mut ld, &n("ffn_up"))?,
                down: matrix(&mut ld, &n("ffn_down"))?,
                post_ffn_norm: ld.opt_vec(&n("post_ffw_norm"))?,
            });
        }
        let w = DenseWeights {
            config,
            embedding,
            lm_head,
            out_norm,
            layers,
        };
        w.check()?;
        Ok(w)
    }

    /// Checks every shape against the config.
    fn check(&self) -> Result<()> {
        let c = &self.config;
        let (e, qd, kvd, f) = (
            c.n_embd,
            c.n_heads * c.head_dim,
            c.n_kv_heads * c.head_dim,
            c.n_ff,
        );
        let want = |m: &Matrix, rows: usize, cols: usize, what: &str| {
            if m.rows == rows && m.cols == cols && m.data.len() == rows * cols {
                Ok(())
            } else {
                Err(gguf_err(
                    what,
                    format!("[{}][{}], want [{rows}][{cols}]", m.rows, m.cols),
                ))
            }
        };
        let vec = |v: &[f32], n: usize, what: &str| {
            if v.len() == n {
                Ok(())
            } else {
                Err(gguf_err(what, format!("{} elements, want {n}", v.len())))
            }
        };
        want(&self.embedding, c.vocab_size, e, "token_embd")?;
        if let Some(h) = &self.lm_head {
            want(h, c.vocab_size, e, "output")?;
        }
        vec(&self.out_norm, e, "output_norm")?;
        for (l, w) in self.layers.iter().enumerate() {
            let at = |s: &str| format!("blk.{l}.{s}");
            want(&w.wq, qd, e, &at("attn_q"))?;
            want(&w.wk, kvd, e, &at("attn_k"))?;
            want(&w.wv, kvd, e, &at("attn_v"))?;
            want(&w.wo, e, qd, &at("attn_output"))?;
            want(&w.gate, f, e, &at("ffn_gate"))?;
            want(&w.up, f, e, &at("ffn_up"))?;
            want(&w.down, e, f, &at("ffn_down"))?;
            vec(&w.attn_norm, e, &at("attn_norm"))?;
            vec(&w.ffn_norm, e, &at("ffn_norm"))?;
            for (v, n, s) in [
                (&w.q_norm, c.head_dim, "attn_q_norm"),
                (&w.k_norm, c.head_dim, "attn_k_norm"),
                (&w.post_attn_norm, e, "post_attention_norm"),
                (&w.post_ffn_norm, e, "post_ffw_norm"),
            ] {
                if let Some(v) = v {
                    vec(v, n, &at(s))?;
                }
            }
            if c.qk_norm && (w.q_norm.is_none() || w.k_norm.is_none()) {
                return Err(gguf_err(&at("attn_q_norm"), "QK-norm weights missing"));
            }
        }
        Ok(())
    }
}
