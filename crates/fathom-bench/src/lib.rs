//! # fathom-bench
//!
//! The measurement apparatus: safetensors tensor I/O, the docs/SPEC.md §8 capture reader, a
//! labelled **synthetic** GQA generator, and the fidelity harness that runs every scanner
//! under the one selection protocol of docs/SPEC.md §5.
//!
//! ```
//! use fathom_bench::synthetic::{generate, SyntheticParams};
//! let (info, layers) = generate(&SyntheticParams { layers: 1, n: 256, p: 4, d: 16, ..Default::default() });
//! assert_eq!(info.g(), 4);
//! assert_eq!(layers[0].k.len(), 256 * info.hkv * 16);
//! ```
//!
//! [`offload`] is the GPU offload benchmark (`fathom offload-bench`): its synthetic key
//! generator and report arithmetic compile in every build; its timing drives
//! `fathom_cuda::PagedCache` through the public API and needs this crate's `cuda` feature.
//!
//! **Invariant:** no kernels and no model runtime here; it reads captures any tool wrote, and
//! it is the layer that turns the GPU library's measurements into report documents
//! (`fathom-cuda` knows no report).
#![deny(missing_docs)]

pub mod calib;
pub mod capture;
pub mod decode;
pub mod document;
pub mod evaluate;
pub mod fidelity;
pub mod methods;
pub mod offload;
pub mod synthetic;
pub mod tensors;
