//! The page pool and per-session page tables of the cache a model drives (docs/SPEC.md §6.1).
//!
//! A cache for one model shape holds many sessions, each with its own length `n_s`, in one
//! pool of `N` pages of `P` tokens each (`P` a power of two and a multiple of the store's
//! 64-token block, chosen by the caller). Session `s` owns a page table `T_s`; its token `i`
//! lives in page `T_s[⌊i/P⌋]`, slot `i mod P`. Sessions grow a page at a time and never move
//! an existing page, as in paged attention's block manager. This module is pure bookkeeping:
//! it owns no page contents (see [`crate::paged_layout`] for where bytes sit and
//! [`crate::paged_ref`] for the CPU reference that writes them).
//!
//! # Invariants
//!
//! With `r(p)` the reference count of page `p`, `F` the free list and `S` the live sessions,
//! after every call (failed or not; [`CacheSessions::check`] verifies them):
//!
//! 1. `p ∈ F ⇔ r(p) = 0`, and `F` holds no page twice;
//! 2. `r(p) = |{(s, j) : s ∈ S, T_s[j] = p}|`, so `Σ_s |T_s| = Σ_p r(p)` and
//!    `pages_in_use + free_pages = N`;
//! 3. `|T_s| = ⌈n_s / P⌉` and `n_s ≤ max_tokens`;
//! 4. a page with `r(p) > 1` is never written: [`CacheSessions::reserve`] only hands out
//!    pages with `r(p) = 1` (the session's own partial last page, after copy-on-write if it
//!    was shared, and fresh pages);
//! 5. at most `max_sessions` sessions are live; a [`SessionId`] names a slot *and* the
//!    generation of that slot, so an id kept past [`CacheSessions::free`] is rejected even
//!    after the slot is reused.
//!
//! Every operation checks its arguments and the pool **before** changing anything: a call
//! that returns an error leaves the pool, the tables and the free lists exactly as they were.
//!
//! # Fork semantics: lazy copy-on-write of the partial last page
//!
//! [`CacheSessions::fork`] gives the child the parent's length and a copy of its page table;
//! every page's count goes up by one and nothing is copied. Full pages stay shared for good
//! (no one writes a full page: appends only touch slots `≥ n_s`). The partial last page, if
//! any, is shared until the first append by *either* side: [`CacheSessions::reserve`] then
//! sees `r(last) > 1`, takes a fresh page, moves its own table entry to it and reports
//! [`AppendPlan::copy`] (`src → dst`, the `n_s mod P` tokens present), which the backend
//! performs before it writes. The other side, now the sole owner of the old page (`r = 1`,
//! if no one else shares it), appends into it in place. So an append by one never writes a
//! page the other can see, and a fork that is never appended to costs no copy.
//!
//! # Truncation
//!
//! [`CacheSessions::truncate`] shortens a session to `n' ≤ n_s` tokens (a rejected
//! speculative draft, a step rolled back): the pages past `⌈n'/P⌉` lose this session's
//! reference (freed where it was the last), and nothing is written. A page kept as the new
//! partial last page may be shared (a fork made before the truncation still reads it whole):
//! the next append sees `r(last) > 1` and copies it first, as after a fork, so invariant 4
//! holds. Slots past `n'` keep stale contents until appends overwrite them, as a reused page's
//! do.
//!
//! ```
//! use fathom_cuda::{CacheSessions, PageConfig};
//!
//! let cfg = PageConfig { page_tokens: 128, pages: 8, max_sessions: 4, max_tokens: 1 << 20 };
//! let mut cache = CacheSessions::new(cfg)?;
//! let a = cache.create()?;
//! let plan = cache.reserve(a, 200)?; // prefill: two pages
//! assert_eq!((plan.first_token, plan.new_pages, plan.copy), (0, 2, None));
//! let b = cache.fork(a)?; // shares both pages, copies nothing
//! assert_eq!(cache.page_table(a)?, cache.page_table(b)?);
//! let plan = cache.reserve(b, 1)?; // b's first append copies the shared partial page
//! let copy = plan.copy.expect("the partial page was shared");
//! assert_eq!((copy.src, copy.tokens), (cache.page_table(a)?[1], 72));
//! assert_eq!(plan.location(200), Some((copy.dst, 72)));
//! assert!(cache.reserve(a, 1)?.copy.is_none()); // a now owns the original alone
//! cache.free(a)?;
//! assert!(cache.len(a).is_err()); // stale id
//! cache.check()?;
//! # Ok::<(), fathom_cuda::PageError>(())
//! ```

use std::fmt;

mod ids;
mod pool;
mod sessions;
#[cfg(test)]
mod tests;

pub use ids::*;
pub use pool::*;
pub use sessions::*;
