//! The offloaded KV cache a model drives (docs/SPEC.md §6.1): its configuration, the K/V rows
//! a model appends from device memory, and the checks every backend runs before a launch.
//!
//! A [`CacheConfig`] fixes one model shape (`L` layers, `Hkv` KV heads, `G`, `D`) and a page
//! pool ([`PageConfig`]). Each layer has its own pool of `pages` pages in pinned, mapped host
//! memory ([`crate::paged_layout::PagedLayout`]); the layers share the sessions' page tables
//! ([`crate::pages::CacheSessions`]), since every layer of a session has the same length.
//!
//! A decode step appends one token per session, a prefill a chunk, for a ragged batch:
//!
//! 1. [`crate::api::KvCache::reserve`] grows every session of the batch (all or nothing:
//!    [`crate::pages::CacheSessions::reserve_many`]) and performs the copy-on-write of shared
//!    partial pages in every layer's pool; it returns the [`AppendBatch`] that names where
//!    each new token goes;
//! 2. per layer, [`crate::api::KvCache::append`] takes that layer's K and V rows `[rows][Hkv][D]`
//!    from device memory ([`KvRows`]; rows in batch order, `rows = Σ new_tokens`) and, on the
//!    cache's stream, writes each token's bf16 K|V record and re-quantizes every 64-token
//!    block the new tokens touch, the partial last block included, so that each session's
//!    store equals `fathom_store::KeyStore` of the same bf16 keys **bit for bit**.
//!
//! Shapes, sessions, capacities and pointers are checked on the host before anything is
//! launched or written ([`check_rows`]); the keys' values live on the device, so a NaN, an
//! infinity or a key past fp16's range is caught by the kernel, which skips that block's
//! write and counts the fault ([`crate::api::KvCache::faults`]).

use crate::config::ModelShape;
use crate::error::{CudaError, Result};
use crate::pages::{AppendPlan, PageConfig, SessionId};

mod batch;
mod checks;
mod config;
mod ledger;
mod select;
mod stages;
#[cfg(test)]
mod tests;

pub use batch::*;
pub use checks::*;
pub use config::*;
pub use ledger::*;
pub use select::*;
pub use stages::*;
