//! # fathom-gpu
//!
//! Real models decoding on a CUDA GPU through Fathom's offloaded KV cache (docs/SPEC.md §6.1,
//! §7): the GGUF weights of `fathom-model` (SmolLM2-135M, Gemma 3 270M) dequantized on the
//! host, rounded to bf16 and uploaded; every matmul on cuBLAS (bf16 × bf16, f32 sums); norms,
//! QK-norm, RoPE (each model's pairing), the gated activations, Gemma's embedding scale and the
//! attention softmaxes in NVRTC kernels (`kernels/forward.cu`); and every layer's K|V in
//! `fathom-cuda`'s paged cache in pinned host memory. A decode step's global layers attend
//! through the cache with any method of the grammar (dense, exact top-k, `fathom:B`, …);
//! sliding-window layers and the chunked prefill attend densely over rows read back from the
//! same cache, so forks and frees need no other state.
//!
//! The reference is the CPU runtime in [`fathom_model::WeightMode::Bf16`], which rounds what
//! this forward rounds (weights, matmul inputs, cached K and V); the two differ by the order
//! of f32 sums.
//!
//! ```
//! use fathom_gpu::{Attention, Decoder, DecoderConfig, GpuDecoder};
//! use fathom_cuda::prelude::*;
//! use fathom_cuda::{cache::AttendMethod, CudaError, Gpu};
//! use fathom_model::fetch::{fetch_model, FetchOptions, ModelId};
//! use fathom_model::DenseWeights;
//! use fathom_plan::SelectParams;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let gpu = match Gpu::open(0) {
//!     Ok(g) => g,
//!     // CI has no GPU (or this build has no `cuda` feature): nothing to run.
//!     Err(CudaError::NotCompiledWithCuda | CudaError::NoDevice { .. }) => return Ok(()),
//!     Err(e) => return Err(e.into()),
//! };
//! let offline = FetchOptions { offline: true, ..Default::default() };
//! let Ok(path) = fetch_model(ModelId::Smollm2_135m, &offline) else { return Ok(()) };
//! let weights = DenseWeights::load(&path)?;
//! let mut dec = GpuDecoder::new(&gpu, &weights, DecoderConfig::new(2, 4096))?;
//! let prompt: Vec<u32> = (1..200).collect();
//! let s = dec.create()?;
//! let logits = dec.prefill(s, &prompt)?;
//! let mut tok = fathom_model::argmax(&logits);
//! let dense = Attention {
//!     method: AttendMethod::Dense,
//!     params: SelectParams { sink: 4, local: 32, k: 256 },
//! };
//! for _ in 0..8 {
//!     tok = fathom_model::argmax(&dec.decode(&[(s, tok)], &dense)?);
//! }
//! assert_eq!(dec.len(s)?, prompt.len() + 8);
//! # Ok(()) }
//! ```
//!
//! Without the `cuda` feature the same types exist and [`GpuDecoder::new`] returns
//! [`fathom_cuda::CudaError::NotCompiledWithCuda`]; [`layout`] (packing, limits, checks),
//! [`presets`] (random-weight 8B shapes), [`shard`] (multi-GPU plans) and the logic of
//! [`branch`] are pure CPU and compiled in every build. [`parity`] compares the GPU with the
//! CPU runtime, [`branch`] runs the downstream protocol, [`throughput`] times decode steps.
//!
//! **Architecture invariant:** the model's math is `fathom-model`'s (its config, its weights,
//! its layer loop as the reference); the cache and its kernels are `fathom-cuda`'s. This crate
//! only joins them and owns no KV state of its own.
#![deny(missing_docs)]

pub mod branch;
pub mod decoder;
pub mod error;
pub mod layout;
pub mod parity;
pub mod presets;
pub mod shard;
pub mod throughput;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::{GpuDecoder, StepGraph};

#[cfg(not(feature = "cuda"))]
mod dummy;
#[cfg(not(feature = "cuda"))]
pub use dummy::{GpuDecoder, StepGraph};

pub use decoder::{Attention, Decoder, StageTimes};

/// The cuBLAS math mode every GPU decoder of this process uses, read once from the experiment
/// switch `FATHOM_GPU_MATH`: `pedantic` (the prescribed precision in every phase, no
/// reduced-precision accumulation) when it says so, else `default`. Result documents record
/// it, so a run with the switch on says so.
pub fn cublas_math() -> &'static str {
    match std::env::var("FATHOM_GPU_MATH").as_deref() {
        Ok("pedantic") => "pedantic",
        _ => "default",
    }
}
pub use error::{GpuError, Result};
pub use layout::DecoderConfig;
