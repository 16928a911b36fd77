//! # fathom-cuda
//!
//! Fathom's offloaded decode step on a CUDA GPU (docs/SPEC.md §6): the bit-plane scan store and
//! the bf16 K/V records live in pinned, mapped host memory; per layer and with no host
//! synchronisation, the GPU plans (importance + reverse water-filling), reads the planned
//! runs of planes over PCIe, scans, takes the top-k per query head and the union per KV head,
//! fetches the winners' K/V records (through an HBM cache of recently fetched rows) and runs
//! exact attention. One entry point runs it: [`PagedCache`], the library a model drives.
//!
//! Kernels are `.cu` files under `kernels/`, embedded with `include_str!` and compiled by
//! NVRTC for the device's compute capability at first use (modules cached per `(G, D)`).
//!
//! Without the `cuda` feature the same types exist and every entry point that would touch a
//! device returns [`CudaError::NotCompiledWithCuda`]; with it and no driver or device,
//! [`CudaError::NoDevice`].
//!
//! # The paged cache a model drives (docs/SPEC.md §6.1)
//!
//! [`PagedCache`] is the library a model drives: it holds many sessions of one model shape in
//! pages of pinned, mapped host memory (or HBM), with an HBM cache of recently fetched K|V
//! rows. Per step a model reserves room for a ragged batch, appends each layer's K and V
//! from device memory (quantized and packed on the GPU, bit-exact with `fathom-store`), and
//! attends each layer's queries with any method of the grammar; each query head attends over
//! its own sink + local + top-k set. This example (`examples/paged_decode.rs`) prefills two
//! sessions of different lengths and decodes 16 steps, rolling one back by 3 tokens half-way
//! (`truncate`), checking every output against the CPU reference; without a GPU it prints why
//! and returns.
//!
//! ```
#![doc = include_str!("../examples/paged_decode.rs")]
//! ```
//!
//! The cache's pure-CPU core compiles in every build: [`pages`] (the page pool, per-session page tables, copy-on-write forks),
//! [`paged_layout`] (byte offsets of planes, scales and K|V records inside a page) and
//! [`paged_ref`] (the CPU reference of paged appends, equal to `fathom_store::KeyStore` bit
//! for bit: the oracle of a GPU append kernel).
//!
//! **Architecture invariant:** the CPU references are `fathom-plan`'s (`water_fill`,
//! `scan::reference_scores`, `select_per_head`, `attend`); the kernels mirror them and the
//! tests hold them to it. Nothing here writes into another crate.
#![deny(missing_docs)]

pub mod api;
/// The traits to bring into scope: `use fathom_cuda::prelude::*`.
pub mod prelude {
    pub use crate::api::{Device, KvCache};
}
pub mod cache;
pub mod config;
pub mod error;
pub mod host_gather;
pub mod memory;
pub mod paged_layout;
pub mod paged_ref;
pub mod pages;
#[cfg(test)]
mod scan_arith;
pub mod types;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::{compile_kernels, Gpu};
#[cfg(feature = "cuda")]
pub use cuda::{DecodeGraph, PagedCache};

#[cfg(not(feature = "cuda"))]
mod dummy;
#[cfg(not(feature = "cuda"))]
pub use dummy::{DecodeGraph, Gpu, PagedCache};

pub use config::{anon_huge_bytes, HostPages, Method, ModelShape, Residency};
pub use error::{CudaError, Result};
pub use paged_layout::PagedLayout;
pub use paged_ref::{PagedExport, PagedStoreRef};
pub use pages::{
    AppendPlan, CacheSessions, PageConfig, PageCopy, PageError, PageId, PagePool, PartialBlock,
    SessionId,
};
pub use types::{DeviceInfo, RowRate, RowSweep};
