//! Fathom's planner: which bits of which key channels a query group reads (docs/SPEC.md §3), and the
//! selection protocol, exact attention and error metric every scan is judged by (docs/SPEC.md §5).
//!
//! ```
//! use fathom_plan::{importance, water_fill, plan_bits, select_per_head, union_sorted, SelectParams};
//!
//! // Importance w_c = σ_c² Σ_h q_{h,c}² for G = 2 query heads over D = 4 channels.
//! let sigma2 = [4.0, 1.0, 0.25, 0.0];
//! let queries = [1.0, 1.0, 1.0, 1.0, /* head 1 */ 0.5, 0.5, 0.5, 0.5];
//! let w = importance(&sigma2, &queries, 2)?;
//! assert_eq!(w, [5.0, 1.25, 0.3125, 0.0]);
//!
//! // Reverse water-filling at B = 6 bits per token: never over budget.
//! let plan = water_fill(&w, 6.0)?;
//! assert_eq!(plan.depths, [3, 2, 0, 0]);
//! assert_eq!(plan.bits, plan_bits(&plan.depths));
//! assert!(plan.bits <= 6.0);
//!
//! // Each head keeps sink, local window and its top-k; the KV head fetches the union.
//! let params = SelectParams { sink: 1, local: 1, k: 1 };
//! let (mut a, mut b) = (Vec::new(), Vec::new());
//! select_per_head(4, &[0.0, 9.0, 1.0, 2.0, 0.0], &params, &mut a)?;
//! select_per_head(4, &[0.0, 1.0, 1.0, 9.0, 0.0], &params, &mut b)?;
//! assert_eq!(union_sorted(&[a, b]), [0, 1, 3, 4]);
//! # Ok::<(), fathom_plan::PlanError>(())
//! ```
//!
//! # Map
//!
//! * [`importance`](mod@importance): `w_c = σ_c² Σ_h q_{h,c}²`;
//! * [`bits`]: `bits(t) = Σ t_c + 0.25·|active|`, `E(t) = Σ w_c 4^(−t_c)`;
//! * [`waterfill`]: the plan (reverse water-filling by bisection on `log λ`, exact finish),
//!   and the uniform-depth ablation;
//! * [`layers`]: greedy per-layer budgets at a target mean;
//! * [`select`]: sink, local window, top-k per query head, union per KV head;
//! * [`attention`]: exact softmax attention (f64) over a selected set or densely;
//! * [`calib`]: calibration math (σ², the KLT by Jacobi, Loki's basis, Double Sparsity's
//!   channel scores), free of I/O;
//! * [`metric`]: relative error and a running mean;
//! * [`method`]: the one method grammar (`MethodSpec`: parse, display, bits, family);
//! * [`scan`]: the CPU bit-plane scan of a `fathom-store` key store under a plan;
//! * [`scanner`]: the one `Scanner` interface every method (Fathom and the baselines)
//!   implements, and [`Fathom`](scanner::Fathom) itself.
//!
//! **Architecture invariant:** this crate knows nothing of GPUs or files; it works on plain
//! slices, and the GPU planner mirrors [`waterfill`] step by step.
//!
//! # Thread safety
//!
//! Every public type is `Send + Sync`; the functions are pure over shared borrows and write
//! only a caller-owned `&mut` output, so any number of threads may plan and scan the same
//! store view at once ([`scan::scan`] parallelises over blocks on the global rayon pool and is
//! re-entrant). [`MeanAccumulator::push`] takes `&mut self`. `Scanner` and `HeadScanner` are
//! `Send + Sync` and score through `&self`. Checked by `tests/stress.rs` (16 sessions appending
//! and scanning concurrently against a single-thread replay); the full contract is in
//! `docs/RELIABILITY.md`.

#![deny(missing_docs)]

pub mod attention;
pub mod bits;
pub mod calib;
mod error;
pub mod importance;
pub mod layers;
pub mod method;
pub mod metric;
pub mod rowcache;
pub mod scan;
pub mod scanner;
pub mod select;
pub mod waterfill;

#[cfg(test)]
mod testutil;

pub use attention::{attend, attend_dense, attend_dense_tiled, attend_dots, KeyTiles, KvView};
pub use bits::{expected_error, max_budget, plan_bits};
pub use error::PlanError;
pub use importance::{importance, importance_into};
pub use layers::{allocate_layer_budgets, LayerBudgetParams};
pub use metric::{relative_error, MeanAccumulator};
pub use select::{select_group, select_per_head, union_sorted, SelectParams};
pub use waterfill::{uniform_depth_plan, water_fill, water_fill_into, Plan};
