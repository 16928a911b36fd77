//! # fathom-baselines
//!
//! The scans Fathom is compared against (docs/SPEC.md §4), each supplying only scores and bits
//! through [`fathom_plan::scanner::Scanner`]; selection, attention and the error metric are
//! the shared protocol of `fathom-plan`.
//!
//! | method | reads | bits at D = 128 |
//! |---|---|---|
//! | [`SparQ`] | per KV head, the `r` channels with the largest `Σ_h |q_{h,c}|`, 4-bit | `4.25·r` (68 / 136) |
//! | [`SparQUnion`] | each query head's own top-`r` channels; the union is read | `4.25·|∪|` |
//! | [`DoubleSparsity`] | `r` calibrated channels, 4-bit | `4.25·r` |
//! | [`Loki`] | first `r` coordinates of the calibration PCA basis, 4-bit | `4.25·r` |
//! | [`Thumbnail`] | every channel at 2 planes | `2.25·D` = 288 |
//! | [`Landmark`] | fp16 mean key of each 8-token block | `2·D` = 256 |
//! | [`Quest`] | fp16 channel min/max per 16-token page | `2·D` = 256 |
//! | [`Exact`] | exact keys (oracle) | `16·D` (fp16 keys) |
//! | [`Dense`] | everything, no selection | `16·D` |
//!
//! All 4-bit reads go through the store's codes and block scales (the same bit-plane scan
//! Fathom uses, at depth 4 on the chosen channels).
//!
//! ```
//! use fathom_baselines::SparQ;
//! use fathom_plan::scanner::{HeadInput, Scanner};
//! use fathom_plan::KvView;
//! use fathom_store::{Dims, KeyStore};
//!
//! let keys: Vec<f32> = (0..200 * 8).map(|i| ((i * 7919) % 13) as f32 - 6.0).collect();
//! let store = KeyStore::from_keys(Dims { heads: 1, channels: 8 }, &keys, None)?;
//! let input = HeadInput { layer: 0, keys: KvView::contiguous(&keys, 8), store: store.view(), calib: None, klt_store: None };
//! let sparq = SparQ { r: 2 };
//! let head = sparq.prepare(&input)?;
//! let mut scores = vec![0f32; 200];
//! let bits = head.score(&[1.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0], 1, &mut scores)?;
//! assert_eq!(bits, 8.5); // 2 channels × (4 bits + 0.25 for the scale)
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **Invariant:** no method re-implements selection or attention; none touches a GPU.
#![deny(missing_docs)]

mod methods;

/// The README's example is compiled and run as a doc test, so it cannot fall behind the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
pub use methods::*;
