//! # fathom-store
//!
//! The 4-bit K cache stored channel-major as bit planes (docs/SPEC.md §2), so that reading the
//! first `t` planes of a channel is exactly its `t`-bit quantizer.
//!
//! ```
//! use fathom_store::{Dims, KeyStore};
//!
//! // 100 tokens of 2 KV heads × 8 channels, row-major [n][heads][D].
//! let dims = Dims { heads: 2, channels: 8 };
//! let keys: Vec<f32> = (0..100 * 16).map(|i| ((i * 37 % 101) as f32 - 50.0) / 10.0).collect();
//! let store = KeyStore::from_keys(dims, &keys, None)?;
//! let view = store.view();
//! assert_eq!(view.tokens(), 100);
//! // Reading the first 2 planes of every channel is the 2-bit quantizer of [−m, m].
//! let two_bit = view.dequant_prefix(2)?;
//! assert_eq!(two_bit.len(), keys.len());
//! // 68 bytes per token per KV head at D = 128; here D/2 + D/32.
//! assert_eq!(dims.bytes_per_token_per_head(), 4.25);
//! # Ok::<(), fathom_store::StoreError>(())
//! ```
//!
//! **Invariant:** this crate knows nothing of queries, plans or GPUs. It depends on no other
//! workspace crate.
//!
//! # Thread safety
//!
//! Every public type is `Send + Sync`. [`KeyStore::append`], [`KeyStore::reserve`] and
//! [`KeyStore::set_flags`] take `&mut self`; everything else, including [`KeyStore::view`]
//! and [`KeyStore::save`], takes `&self`. A store that is appended to while other threads scan therefore sits behind a lock
//! (e.g. `RwLock`): a [`StoreView`] (`Copy`, read-only) cannot outlive an append, so no scan
//! sees a half-written block. [`MappedStore`] is immutable after [`MappedStore::open`] (the
//! file must not be rewritten in place while mapped; [`write_atomic`] replaces files by
//! rename). [`write_atomic`] may be called from many threads, even for one path: each call has
//! its own temporary file. See `docs/RELIABILITY.md`.
#![deny(missing_docs)]

pub mod basis;
pub mod error;
pub mod file;
pub mod quant;
pub mod store;

pub use basis::{Basis, BasisKind};
pub use error::{Result, StoreError};
pub use file::{write_atomic, write_atomic_with, MappedStore};
pub use quant::{BLOCK, PLANES};
pub use store::{blocks_for, Dims, KeyStore, StoreView};
