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

/// Tokens per quantization block of the store (docs/SPEC.md §2); `page_tokens` is a multiple.
pub const BLOCK_TOKENS: usize = fathom_store::BLOCK;

/// One page of the pool, `0 ≤ id < pages`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageId(pub u32);

impl PageId {
    /// The page's index in the pool, as `usize`.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page {}", self.0)
    }
}

/// A live session: its slot and the slot's generation when the session was created.
///
/// Only [`CacheSessions::create`] and [`CacheSessions::fork`] make one; once the session is
/// freed the id is stale forever (the slot's generation moves on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionId {
    slot: u32,
    generation: u64,
}

impl SessionId {
    /// The slot, `0 ≤ slot < max_sessions` (what a device-side table is indexed by).
    pub fn slot(self) -> usize {
        self.slot as usize
    }
    /// The slot's generation when this session was created.
    pub fn generation(self) -> u64 {
        self.generation
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "session {} (generation {})", self.slot, self.generation)
    }
}

/// Why a page or session operation was refused. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    /// A configuration that cannot form a cache.
    #[error("invalid page configuration: {what}: {detail}")]
    Config {
        /// Which setting.
        what: &'static str,
        /// Why.
        detail: String,
    },
    /// The id's slot never held a session of this cache (or is out of range).
    #[error(
        "unknown {id}: this cache has {max_sessions} slots and the slot holds no such session"
    )]
    UnknownSession {
        /// The id given.
        id: SessionId,
        /// Slots of this cache.
        max_sessions: usize,
    },
    /// The session was freed (its slot may since hold another session).
    #[error("stale {id}: the session was freed; its slot is now at generation {current}")]
    StaleSession {
        /// The id given.
        id: SessionId,
        /// The slot's current generation.
        current: u64,
    },
    /// An append of zero tokens.
    #[error("append of zero tokens to {session}")]
    ZeroLengthAppend {
        /// The session.
        session: SessionId,
    },
    /// The append would take the session past its capacity.
    #[error("{session} holds {len} tokens; appending {requested} would exceed its capacity of {max_tokens}")]
    SessionFull {
        /// The session.
        session: SessionId,
        /// Its length now.
        len: usize,
        /// Tokens asked for.
        requested: usize,
        /// Tokens a session may hold.
        max_tokens: usize,
    },
    /// Not enough free pages.
    #[error("page pool exhausted: {needed} pages needed, {free} free of {capacity}")]
    PoolExhausted {
        /// Pages the call needs.
        needed: usize,
        /// Pages free.
        free: usize,
        /// Pages in the pool.
        capacity: usize,
    },
    /// One batch names a session twice.
    #[error("{session} appears twice in one append batch")]
    DuplicateInBatch {
        /// The session.
        session: SessionId,
    },
    /// Every session slot is taken.
    #[error("too many sessions: all {max_sessions} slots are live (free one first)")]
    TooManySessions {
        /// Slots of this cache.
        max_sessions: usize,
    },
    /// A page id outside the pool.
    #[error("{page} is out of range (the pool has {pages} pages)")]
    PageOutOfRange {
        /// The page.
        page: PageId,
        /// Pages in the pool.
        pages: usize,
    },
    /// A reference-count operation on a page that is free.
    #[error("{page} is free (reference count 0)")]
    PageNotInUse {
        /// The page.
        page: PageId,
    },
    /// An index outside a layout's range (page, head, channel, plane, block or slot).
    #[error("{what} {index} is out of range (0..{limit})")]
    OutOfRange {
        /// Which index.
        what: &'static str,
        /// The value given.
        index: usize,
        /// One past the largest valid value.
        limit: usize,
    },
    /// A token outside a session.
    #[error("token {token} is past the end of {session} ({len} tokens)")]
    TokenOutOfRange {
        /// The session.
        session: SessionId,
        /// The token asked for.
        token: usize,
        /// The session's length.
        len: usize,
    },
    /// A truncation to more tokens than the session holds.
    #[error("{session} holds {len} tokens: it cannot be truncated to {requested}")]
    TruncatePastEnd {
        /// The session.
        session: SessionId,
        /// Its length now.
        len: usize,
        /// The length asked for.
        requested: usize,
    },
    /// A broken invariant (a bug; reported by [`CacheSessions::check`]).
    #[error("page-table invariant broken: {0}")]
    Invariant(String),
}

fn config_err(what: &'static str, detail: impl Into<String>) -> PageError {
    PageError::Config {
        what,
        detail: detail.into(),
    }
}

/// A fixed pool of pages with a free list and per-page reference counts.
///
/// Pages are handed out lowest id first on a fresh pool; a released page is the next one
/// handed out (LIFO), so reuse is prompt and tests see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagePool {
    refcount: Vec<u32>,
    free: Vec<PageId>,
}

impl PagePool {
    /// A pool of `pages` free pages (`1 ≤ pages ≤ 2^32 − 1`).
    pub fn new(pages: usize) -> Result<Self, PageError> {
        if pages == 0 || pages > u32::MAX as usize {
            return Err(config_err(
                "pages",
                format!("{pages} (want 1..={})", u32::MAX),
            ));
        }
        Ok(Self {
            refcount: vec![0; pages],
            free: (0..pages as u32).rev().map(PageId).collect(),
        })
    }

    /// Pages in the pool.
    pub fn capacity(&self) -> usize {
        self.refcount.len()
    }
    /// Pages on the free list.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }
    /// Pages with a non-zero reference count.
    pub fn pages_in_use(&self) -> usize {
        self.capacity() - self.free_pages()
    }
    /// Sum of all reference counts (the number of page-table entries that point into the pool).
    pub fn total_refs(&self) -> u64 {
        self.refcount.iter().map(|&r| r as u64).sum()
    }

    /// The reference count of `page` (0 when free).
    pub fn refcount(&self, page: PageId) -> Result<u32, PageError> {
        self.refcount
            .get(page.index())
            .copied()
            .ok_or(PageError::PageOutOfRange {
                page,
                pages: self.capacity(),
            })
    }

    /// Takes one free page (its count becomes 1).
    pub fn alloc(&mut self) -> Result<PageId, PageError> {
        Ok(self.alloc_many(1)?[0])
    }

    /// Takes `count` free pages at once, or none ([`PageError::PoolExhausted`]).
    pub fn alloc_many(&mut self, count: usize) -> Result<Vec<PageId>, PageError> {
        if count > self.free.len() {
            return Err(PageError::PoolExhausted {
                needed: count,
                free: self.free.len(),
                capacity: self.capacity(),
            });
        }
        let pages = self.free.split_off(self.free.len() - count);
        let pages: Vec<PageId> = pages.into_iter().rev().collect();
        for p in &pages {
            self.refcount[p.index()] = 1;
        }
        Ok(pages)
    }

    /// Adds a reference to a page in use.
    pub fn retain(&mut self, page: PageId) -> Result<(), PageError> {
        let pages = self.capacity();
        let rc = self
            .refcount
            .get_mut(page.index())
            .ok_or(PageError::PageOutOfRange { page, pages })?;
        if *rc == 0 {
            return Err(PageError::PageNotInUse { page });
        }
        *rc = rc
            .checked_add(1)
            .ok_or_else(|| PageError::Invariant(format!("{page}: reference count overflows")))?;
        Ok(())
    }

    /// Drops a reference; returns `true` when the count reached 0 and the page went back on
    /// the free list.
    pub fn release(&mut self, page: PageId) -> Result<bool, PageError> {
        let pages = self.capacity();
        let rc = self
            .refcount
            .get_mut(page.index())
            .ok_or(PageError::PageOutOfRange { page, pages })?;
        if *rc == 0 {
            return Err(PageError::PageNotInUse { page });
        }
        *rc -= 1;
        if *rc == 0 {
            self.free.push(page);
            return Ok(true);
        }
        Ok(false)
    }

    /// Checks invariant 1 of the module docs (free ⇔ count 0, no page listed twice).
    pub fn check(&self) -> Result<(), PageError> {
        let mut listed = vec![false; self.capacity()];
        for &p in &self.free {
            let i = p.index();
            if i >= listed.len() {
                return Err(PageError::Invariant(format!(
                    "free list holds {p}, out of range"
                )));
            }
            if listed[i] {
                return Err(PageError::Invariant(format!("free list holds {p} twice")));
            }
            listed[i] = true;
        }
        for (i, (&rc, &l)) in self.refcount.iter().zip(&listed).enumerate() {
            if (rc == 0) != l {
                return Err(PageError::Invariant(format!(
                    "page {i}: reference count {rc} but {} the free list",
                    if l { "on" } else { "not on" }
                )));
            }
        }
        Ok(())
    }
}

/// The shape of a paged cache's bookkeeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageConfig {
    /// Tokens per page `P`: a power of two and a multiple of 64 (the store's block).
    pub page_tokens: usize,
    /// Pages in the pool `N` (`1..=2^32 − 1`).
    pub pages: usize,
    /// Session slots (`1..=2^32 − 1`).
    pub max_sessions: usize,
    /// Tokens one session may hold (`≥ 1`).
    pub max_tokens: usize,
}

impl PageConfig {
    /// Checks the limits in the field docs.
    pub fn validate(self) -> Result<Self, PageError> {
        let p = self.page_tokens;
        if p == 0 || !p.is_power_of_two() || p % BLOCK_TOKENS != 0 {
            return Err(config_err(
                "page_tokens",
                format!("{p} (want a power of two and a multiple of {BLOCK_TOKENS})"),
            ));
        }
        if self.pages == 0 || self.pages > u32::MAX as usize {
            return Err(config_err(
                "pages",
                format!("{} (want 1..={})", self.pages, u32::MAX),
            ));
        }
        if self.max_sessions == 0 || self.max_sessions > u32::MAX as usize {
            return Err(config_err(
                "max_sessions",
                format!("{} (want 1..={})", self.max_sessions, u32::MAX),
            ));
        }
        if self.max_tokens == 0 {
            return Err(config_err("max_tokens", "0 (want at least 1)"));
        }
        Ok(self)
    }

    /// Pages a session of `tokens` tokens holds: `⌈tokens / P⌉`.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page_tokens)
    }
}

/// A partially filled page that a session shares and must copy before appending into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    /// The shared page (stays with the other sessions).
    pub src: PageId,
    /// The fresh page that replaces it in this session's table.
    pub dst: PageId,
    /// Tokens present in `src` (slots `0..tokens`); copying the whole page is also correct.
    pub tokens: usize,
}

/// A partially filled 64-token block that an append re-quantizes with its new tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialBlock {
    /// The page holding it (after any copy: `copy.dst` when the page was shared).
    pub page: PageId,
    /// The block's index inside the page, `0 ≤ block < P/64`.
    pub block: usize,
    /// Tokens already in the block (`1..=63`), re-read from their K records.
    pub tokens: usize,
}

/// What one append needs (`CacheSessions::need`): the length before and after, the shared
/// partial last page to copy, if any, and the fresh pages in all.
struct Need {
    n: usize,
    end: usize,
    shared_last: Option<PageId>,
    pages: usize,
}

/// Where an append's tokens go (the result of [`CacheSessions::reserve`]).
///
/// Tokens `first_token .. first_token + tokens` of the session go to page
/// `pages[⌊i/P⌋ − first_page]`, slot `i mod P`. The backend performs `copy` first (if any),
/// then writes the K|V records of the new tokens, then re-quantizes every 64-token block
/// they touch, the `requant` block included, writing *every* word and scale of each such
/// block (bits past the session's length are zero). Fresh pages may hold stale bytes of an
/// earlier session; nothing outside the written blocks and slots is ever read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendPlan {
    /// The session appended to.
    pub session: SessionId,
    /// Index of the first new token (the session's length before the append).
    pub first_token: usize,
    /// New tokens.
    pub tokens: usize,
    /// Tokens per page `P`.
    pub page_tokens: usize,
    /// Page-table index of `pages[0]` (`⌊first_token / P⌋`).
    pub first_page: usize,
    /// Every page written, in table order: `table[first_page..]` after the append. Each has
    /// reference count 1.
    pub pages: Vec<PageId>,
    /// How many of `pages` (the last ones) were freshly allocated to extend the table.
    pub new_pages: usize,
    /// Copy-on-write of a shared partial last page, to perform before any write.
    pub copy: Option<PageCopy>,
    /// The partially filled block to re-quantize (when `first_token` is not a multiple of 64).
    pub requant: Option<PartialBlock>,
}

impl AppendPlan {
    /// One past the last new token (the session's length after the append).
    pub fn end_token(&self) -> usize {
        self.first_token + self.tokens
    }

    /// The page and slot of session token `token`, if this append writes it.
    pub fn location(&self, token: usize) -> Option<(PageId, usize)> {
        if token < self.first_token || token >= self.end_token() {
            return None;
        }
        let page = self.pages.get(token / self.page_tokens - self.first_page)?;
        Some((*page, token % self.page_tokens))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct SessionState {
    len: usize,
    table: Vec<PageId>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    generation: u64,
    session: Option<SessionState>,
}

/// Up to `max_sessions` sessions, each a length and a page table over one [`PagePool`].
///
/// See the module docs for the invariants and the copy-on-write fork.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheSessions {
    cfg: PageConfig,
    pool: PagePool,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
}

impl CacheSessions {
    /// An empty cache: all pages free, no session live.
    pub fn new(cfg: PageConfig) -> Result<Self, PageError> {
        let cfg = cfg.validate()?;
        Ok(Self {
            cfg,
            pool: PagePool::new(cfg.pages)?,
            slots: Vec::new(),
            free_slots: Vec::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PageConfig {
        &self.cfg
    }
    /// The pool (read-only: pages change only through sessions).
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }
    /// Pages with a non-zero reference count.
    pub fn pages_in_use(&self) -> usize {
        self.pool.pages_in_use()
    }
    /// Pages on the free list.
    pub fn free_pages(&self) -> usize {
        self.pool.free_pages()
    }
    /// Live sessions.
    pub fn live_sessions(&self) -> usize {
        self.slots.len() - self.free_slots.len()
    }
    /// The ids of the live sessions, by slot.
    pub fn session_ids(&self) -> Vec<SessionId> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.session.is_some())
            .map(|(i, s)| SessionId {
                slot: i as u32,
                generation: s.generation,
            })
            .collect()
    }

    fn state(&self, id: SessionId) -> Result<&SessionState, PageError> {
        let slot = self.slots.get(id.slot()).ok_or(PageError::UnknownSession {
            id,
            max_sessions: self.cfg.max_sessions,
        })?;
        if slot.generation != id.generation {
            return if id.generation < slot.generation {
                Err(PageError::StaleSession {
                    id,
                    current: slot.generation,
                })
            } else {
                Err(PageError::UnknownSession {
                    id,
                    max_sessions: self.cfg.max_sessions,
                })
            };
        }
        slot.session.as_ref().ok_or(PageError::StaleSession {
            id,
            current: slot.generation,
        })
    }

    /// The session's length in tokens.
    pub fn len(&self, id: SessionId) -> Result<usize, PageError> {
        Ok(self.state(id)?.len)
    }
    /// Whether the session holds no token.
    pub fn is_empty(&self, id: SessionId) -> Result<bool, PageError> {
        Ok(self.state(id)?.len == 0)
    }
    /// The session's page table (`⌈len / P⌉` pages).
    pub fn page_table(&self, id: SessionId) -> Result<&[PageId], PageError> {
        Ok(&self.state(id)?.table)
    }
    /// The page and slot of the session's token `token`.
    pub fn locate(&self, id: SessionId, token: usize) -> Result<(PageId, usize), PageError> {
        let st = self.state(id)?;
        if token >= st.len {
            return Err(PageError::TokenOutOfRange {
                session: id,
                token,
                len: st.len,
            });
        }
        let p = self.cfg.page_tokens;
        Ok((st.table[token / p], token % p))
    }

    /// Takes a slot for a new, empty session (no page yet).
    fn take_slot(&mut self, state: SessionState) -> Result<SessionId, PageError> {
        let slot = if let Some(s) = self.free_slots.pop() {
            s
        } else if self.slots.len() < self.cfg.max_sessions {
            self.slots.push(Slot {
                generation: 0,
                session: None,
            });
            (self.slots.len() - 1) as u32
        } else {
            return Err(PageError::TooManySessions {
                max_sessions: self.cfg.max_sessions,
            });
        };
        let s = &mut self.slots[slot as usize];
        s.session = Some(state);
        Ok(SessionId {
            slot,
            generation: s.generation,
        })
    }

    fn slot_available(&self) -> Result<(), PageError> {
        if self.free_slots.is_empty() && self.slots.len() >= self.cfg.max_sessions {
            return Err(PageError::TooManySessions {
                max_sessions: self.cfg.max_sessions,
            });
        }
        Ok(())
    }

    /// A new empty session. Reuses the most recently freed slot, under a new generation.
    pub fn create(&mut self) -> Result<SessionId, PageError> {
        self.take_slot(SessionState {
            len: 0,
            table: Vec::new(),
        })
    }

    /// A child of `parent`: same length, same pages (each page's count + 1), nothing copied.
    ///
    /// The partial last page is copied lazily by whichever side appends first (module docs).
    pub fn fork(&mut self, parent: SessionId) -> Result<SessionId, PageError> {
        let st = self.state(parent)?.clone();
        self.slot_available()?;
        // Counts cannot overflow: a page's count is at most the live sessions ≤ u32::MAX − 1
        // before this fork. Check anyway, before changing anything.
        for &p in &st.table {
            if self.pool.refcount(p)? == u32::MAX {
                return Err(PageError::Invariant(format!(
                    "{p}: reference count overflows"
                )));
            }
        }
        for &p in &st.table {
            self.pool.retain(p)?;
        }
        self.take_slot(st)
    }

    /// Frees the session: every page's count − 1, pages reaching 0 go back on the free list.
    /// Sessions sharing pages with it keep them. The id (and any copy of it) is stale after.
    pub fn free(&mut self, id: SessionId) -> Result<(), PageError> {
        self.state(id)?;
        let slot = &mut self.slots[id.slot()];
        let Some(st) = slot.session.take() else {
            return Err(PageError::Invariant(format!("{id} vanished")));
        };
        slot.generation += 1;
        self.free_slots.push(id.slot);
        for p in st.table {
            self.pool.release(p)?;
        }
        Ok(())
    }

    /// Shortens the session to `len` tokens: the pages past `⌈len/P⌉` are released (a page
    /// another session shares stays with it). Writes nothing (module docs, "Truncation").
    ///
    /// # Errors
    /// An unknown or stale id; `len` past the session's length. Nothing changes.
    pub fn truncate(&mut self, id: SessionId, len: usize) -> Result<(), PageError> {
        self.check_cut(id, len)?;
        let keep = self.cfg.pages_for(len);
        let slot = &mut self.slots[id.slot()];
        let Some(st) = slot.session.as_mut() else {
            return Err(PageError::Invariant(format!("{id} vanished")));
        };
        let dropped = st.table.split_off(keep);
        st.len = len;
        for p in dropped {
            self.pool.release(p)?;
        }
        Ok(())
    }

    /// `id` is live and holds at least `len` tokens.
    fn check_cut(&self, id: SessionId, len: usize) -> Result<(), PageError> {
        let n = self.state(id)?.len;
        if len > n {
            return Err(PageError::TruncatePastEnd {
                session: id,
                len: n,
                requested: len,
            });
        }
        Ok(())
    }

    /// Whether a backend's truncation of `id` to `len` would succeed now, changing nothing:
    /// the truncation to the start of `len`'s 64-token block, then the re-append of its
    /// `len mod 64` kept tokens, whose copy-on-write of a shared page needs a free page
    /// (docs/SPEC.md §6.1, "Truncate"; checked on a copy of the tables). A cut to the
    /// session's own length does nothing, and succeeds.
    ///
    /// # Errors
    /// What [`CacheSessions::truncate`] or the re-append's reserve would return.
    pub fn check_truncate(&self, id: SessionId, len: usize) -> Result<(), PageError> {
        self.check_cut(id, len)?;
        let r = len % BLOCK_TOKENS;
        if r == 0 || len == self.state(id)?.len {
            return Ok(());
        }
        let mut dry = self.clone();
        dry.truncate(id, len - r)?;
        dry.check_reserve(&[(id, r)])
    }

    /// Grows the session by `new_tokens` and says where they go.
    ///
    /// Adds `⌈(n + m)/P⌉ − ⌈n/P⌉` fresh pages at the end of the table (existing pages never
    /// move) and, when the partial last page is shared (`count > 1`, after a fork), replaces
    /// it by a fresh page and reports the copy. Errors, checked before anything changes:
    /// unknown or stale id, zero tokens, past `max_tokens`, pool exhausted (the copy's page
    /// counted).
    pub fn reserve(
        &mut self,
        session: SessionId,
        new_tokens: usize,
    ) -> Result<AppendPlan, PageError> {
        let p = self.cfg.page_tokens;
        let Need {
            n,
            end,
            shared_last,
            pages: needed,
        } = self.need(session, new_tokens)?;
        // All checks done; from here on nothing can fail (alloc_many is all-or-nothing).
        let mut fresh = self.pool.alloc_many(needed)?;
        let copy = match shared_last {
            Some(src) if !fresh.is_empty() => {
                let dst = fresh.remove(0);
                self.pool.release(src)?; // count > 1: stays in use by the other sessions
                Some(PageCopy {
                    src,
                    dst,
                    tokens: n % p,
                })
            }
            _ => None,
        };
        let new_pages = fresh.len();
        let slot = &mut self.slots[session.slot()];
        let Some(st) = slot.session.as_mut() else {
            return Err(PageError::Invariant(format!("{session} vanished")));
        };
        if let (Some(c), Some(last)) = (copy, st.table.last_mut()) {
            *last = c.dst;
        }
        st.table.extend(fresh);
        st.len = end;
        let first_page = n / p;
        let pages = st.table[first_page..].to_vec();
        let requant = (n % BLOCK_TOKENS != 0).then(|| PartialBlock {
            page: pages[0],
            block: (n % p) / BLOCK_TOKENS,
            tokens: n % BLOCK_TOKENS,
        });
        Ok(AppendPlan {
            session,
            first_token: n,
            tokens: new_tokens,
            page_tokens: p,
            first_page,
            pages,
            new_pages,
            copy,
            requant,
        })
    }

    /// What appending `new_tokens` to `session` needs, with every check of
    /// [`CacheSessions::reserve`] (a live session, a positive count, the capacity); changes
    /// nothing.
    fn need(&self, session: SessionId, new_tokens: usize) -> Result<Need, PageError> {
        let p = self.cfg.page_tokens;
        let st = self.state(session)?;
        if new_tokens == 0 {
            return Err(PageError::ZeroLengthAppend { session });
        }
        let n = st.len;
        let full = PageError::SessionFull {
            session,
            len: n,
            requested: new_tokens,
            max_tokens: self.cfg.max_tokens,
        };
        let end = n.checked_add(new_tokens).ok_or(full.clone())?;
        if end > self.cfg.max_tokens {
            return Err(full);
        }
        let grow = self.cfg.pages_for(end) - st.table.len();
        let shared_last = match st.table.last() {
            Some(&last) if n % p != 0 && self.pool.refcount(last)? > 1 => Some(last),
            _ => None,
        };
        Ok(Need {
            n,
            end,
            shared_last,
            pages: grow + usize::from(shared_last.is_some()),
        })
    }

    /// Reserves room for a ragged batch, all or nothing: `batch[i] = (session, new_tokens)`,
    /// each session at most once. Every check of [`CacheSessions::reserve`] runs for every
    /// entry, and the pages the whole batch needs (growth plus copy-on-write) are counted
    /// against the free list, before any state changes; then the plans are made in order.
    pub fn reserve_many(
        &mut self,
        batch: &[(SessionId, usize)],
    ) -> Result<Vec<AppendPlan>, PageError> {
        self.check_reserve(batch)?;
        batch
            .iter()
            .map(|&(session, new_tokens)| self.reserve(session, new_tokens))
            .collect()
    }

    /// Every check of [`CacheSessions::reserve_many`], changing nothing: whether the batch
    /// would be reserved now. A caller that reserves one prompt in several chunks asks this
    /// for the whole prompt first, so the pool cannot run out half-way through it.
    pub fn check_reserve(&self, batch: &[(SessionId, usize)]) -> Result<(), PageError> {
        let mut needed = 0usize;
        for (i, &(session, new_tokens)) in batch.iter().enumerate() {
            if batch[..i].iter().any(|(s, _)| *s == session) {
                return Err(PageError::DuplicateInBatch { session });
            }
            needed += self.need(session, new_tokens)?.pages;
        }
        if needed > self.pool.free_pages() {
            return Err(PageError::PoolExhausted {
                needed,
                free: self.pool.free_pages(),
                capacity: self.pool.capacity(),
            });
        }
        Ok(())
    }

    /// Verifies every invariant of the module docs; `Err` names the first one broken.
    pub fn check(&self) -> Result<(), PageError> {
        self.pool.check()?;
        let mut refs = vec![0u64; self.pool.capacity()];
        let mut live = 0usize;
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(st) = &slot.session else {
                if !self.free_slots.contains(&(i as u32)) {
                    return Err(PageError::Invariant(format!(
                        "slot {i} is empty but not on the free-slot list"
                    )));
                }
                continue;
            };
            live += 1;
            if self.free_slots.contains(&(i as u32)) {
                return Err(PageError::Invariant(format!(
                    "slot {i} is live and on the free-slot list"
                )));
            }
            if st.len > self.cfg.max_tokens {
                return Err(PageError::Invariant(format!(
                    "slot {i}: {} tokens > max {}",
                    st.len, self.cfg.max_tokens
                )));
            }
            if st.table.len() != self.cfg.pages_for(st.len) {
                return Err(PageError::Invariant(format!(
                    "slot {i}: {} tokens but {} pages (want {})",
                    st.len,
                    st.table.len(),
                    self.cfg.pages_for(st.len)
                )));
            }
            for (j, &pg) in st.table.iter().enumerate() {
                let r = refs.get_mut(pg.index()).ok_or_else(|| {
                    PageError::Invariant(format!("slot {i} entry {j}: {pg} out of range"))
                })?;
                *r += 1;
                if st.table[..j].contains(&pg) {
                    return Err(PageError::Invariant(format!(
                        "slot {i}: {pg} appears twice in one table"
                    )));
                }
            }
        }
        if live + self.free_slots.len() != self.slots.len()
            || self.slots.len() > self.cfg.max_sessions
        {
            return Err(PageError::Invariant(format!(
                "{live} live + {} free slots != {} slots (max {})",
                self.free_slots.len(),
                self.slots.len(),
                self.cfg.max_sessions
            )));
        }
        for (i, &r) in refs.iter().enumerate() {
            let rc = self.pool.refcount(PageId(i as u32))? as u64;
            if rc != r {
                return Err(PageError::Invariant(format!(
                    "page {i}: reference count {rc} but {r} table entries"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::{BTreeMap, HashMap};

    fn cfg(page_tokens: usize, pages: usize, max_sessions: usize, max_tokens: usize) -> PageConfig {
        PageConfig {
            page_tokens,
            pages,
            max_sessions,
            max_tokens,
        }
    }

    #[test]
    fn config_is_validated() {
        for p in [0, 1, 32, 96, 100, 192, 320] {
            assert!(
                matches!(
                    CacheSessions::new(cfg(p, 4, 2, 100)),
                    Err(PageError::Config {
                        what: "page_tokens",
                        ..
                    })
                ),
                "page_tokens {p}"
            );
        }
        for p in [64, 128, 256, 4096, 1 << 20] {
            assert!(CacheSessions::new(cfg(p, 4, 2, 100)).is_ok());
        }
        assert!(matches!(
            CacheSessions::new(cfg(64, 0, 2, 100)),
            Err(PageError::Config { what: "pages", .. })
        ));
        assert!(matches!(
            CacheSessions::new(cfg(64, 4, 0, 100)),
            Err(PageError::Config {
                what: "max_sessions",
                ..
            })
        ));
        assert!(matches!(
            CacheSessions::new(cfg(64, 4, 2, 0)),
            Err(PageError::Config {
                what: "max_tokens",
                ..
            })
        ));
        assert!(PagePool::new(0).is_err());
    }

    /// `check_reserve` answers as `reserve_many` would and changes nothing.
    #[test]
    fn check_reserve_predicts_the_reserve_without_changing_state() {
        let mut s = CacheSessions::new(cfg(128, 4, 2, 1024)).unwrap();
        let (a, b) = (s.create().unwrap(), s.create().unwrap());
        assert!(s.check_reserve(&[(a, 300), (b, 128)]).is_ok());
        assert!(matches!(
            s.check_reserve(&[(a, 300), (b, 200)]),
            Err(PageError::PoolExhausted {
                needed: 5,
                free: 4,
                ..
            })
        ));
        assert!(matches!(
            s.check_reserve(&[(a, 0)]),
            Err(PageError::ZeroLengthAppend { .. })
        ));
        assert!(matches!(
            s.check_reserve(&[(a, 1), (a, 1)]),
            Err(PageError::DuplicateInBatch { .. })
        ));
        assert_eq!((s.len(a).unwrap(), s.len(b).unwrap()), (0, 0));
        s.check().unwrap();
        assert!(s.reserve_many(&[(a, 300), (b, 128)]).is_ok());
        assert!(s.check_reserve(&[(b, 1)]).is_err(), "the pool is full now");
    }

    #[test]
    fn pool_alloc_retain_release() {
        let mut pool = PagePool::new(3).unwrap();
        assert_eq!(pool.alloc().unwrap(), PageId(0));
        let two = pool.alloc_many(2).unwrap();
        assert_eq!(two, vec![PageId(1), PageId(2)]);
        assert!(matches!(
            pool.alloc(),
            Err(PageError::PoolExhausted {
                needed: 1,
                free: 0,
                capacity: 3
            })
        ));
        pool.retain(PageId(1)).unwrap();
        assert_eq!(pool.refcount(PageId(1)).unwrap(), 2);
        assert!(!pool.release(PageId(1)).unwrap());
        assert!(pool.release(PageId(1)).unwrap());
        assert_eq!(pool.free_pages(), 1);
        assert!(matches!(
            pool.release(PageId(1)),
            Err(PageError::PageNotInUse { .. })
        ));
        assert!(matches!(
            pool.retain(PageId(1)),
            Err(PageError::PageNotInUse { .. })
        ));
        assert!(matches!(
            pool.refcount(PageId(3)),
            Err(PageError::PageOutOfRange { .. })
        ));
        assert!(matches!(
            pool.retain(PageId(9)),
            Err(PageError::PageOutOfRange { .. })
        ));
        // LIFO: the page just released is the next handed out.
        assert_eq!(pool.alloc().unwrap(), PageId(1));
        pool.check().unwrap();
        // alloc_many is all-or-nothing.
        let before = pool.clone();
        assert!(pool.alloc_many(1).is_err());
        assert_eq!(pool, before);
    }

    #[test]
    fn reserve_grows_a_page_at_a_time_and_places_every_token() {
        let mut s = CacheSessions::new(cfg(128, 8, 2, 1000)).unwrap();
        let id = s.create().unwrap();
        assert_eq!(s.len(id).unwrap(), 0);
        assert!(s.page_table(id).unwrap().is_empty());
        let mut tables: Vec<Vec<PageId>> = Vec::new();
        let mut n = 0;
        for m in [1, 62, 1, 64, 100, 1, 300, 7] {
            let plan = s.reserve(id, m).unwrap();
            assert_eq!(plan.first_token, n);
            assert_eq!(plan.end_token(), n + m);
            assert_eq!(plan.first_page, n / 128);
            assert!(plan.copy.is_none());
            assert_eq!(
                plan.requant,
                (n % 64 != 0).then(|| PartialBlock {
                    page: s.page_table(id).unwrap()[n / 128],
                    block: (n % 128) / 64,
                    tokens: n % 64,
                })
            );
            let table = s.page_table(id).unwrap().to_vec();
            assert_eq!(table.len(), (n + m).div_ceil(128));
            assert_eq!(plan.new_pages, table.len() - n.div_ceil(128));
            assert_eq!(plan.pages, table[n / 128..]);
            // Existing pages never move.
            if let Some(prev) = tables.last() {
                assert_eq!(&table[..prev.len()], &prev[..]);
            }
            for t in n..n + m {
                assert_eq!(plan.location(t), Some(s.locate(id, t).unwrap()));
                assert_eq!(plan.location(t).unwrap().1, t % 128);
            }
            assert_eq!(plan.location(n + m), None);
            assert_eq!(plan.location(n.wrapping_sub(1)), None);
            tables.push(table);
            n += m;
            s.check().unwrap();
        }
        assert!(matches!(
            s.locate(id, n),
            Err(PageError::TokenOutOfRange { token, len, .. }) if token == n && len == n
        ));
        assert_eq!(s.pages_in_use(), n.div_ceil(128));
        assert_eq!(s.free_pages(), 8 - n.div_ceil(128));
    }

    #[test]
    fn errors_name_the_problem_and_change_nothing() {
        let mut s = CacheSessions::new(cfg(64, 3, 2, 150)).unwrap();
        let a = s.create().unwrap();
        s.reserve(a, 100).unwrap();
        let before = s.clone();
        assert!(
            matches!(s.reserve(a, 0), Err(PageError::ZeroLengthAppend { session }) if session == a)
        );
        assert!(matches!(
            s.reserve(a, 51),
            Err(PageError::SessionFull {
                len: 100,
                requested: 51,
                max_tokens: 150,
                ..
            })
        ));
        assert!(matches!(
            s.reserve(a, usize::MAX),
            Err(PageError::SessionFull { .. })
        ));
        assert_eq!(s, before);
        let b = s.fork(a).unwrap();
        // b shares both pages; a's partial page needs a copy (1 page) plus 0 new: fits.
        // Then b's 100 → 150 needs 1 new page (its page 1 is now its own): none left.
        let plan = s.reserve(a, 20).unwrap();
        assert!(plan.copy.is_some());
        let before = s.clone();
        assert!(matches!(
            s.reserve(b, 50),
            Err(PageError::PoolExhausted {
                needed: 1,
                free: 0,
                capacity: 3
            })
        ));
        assert!(matches!(
            s.create(),
            Err(PageError::TooManySessions { max_sessions: 2 })
        ));
        assert!(matches!(
            s.fork(b),
            Err(PageError::TooManySessions { max_sessions: 2 })
        ));
        assert_eq!(s, before);
        s.free(b).unwrap();
        let before = s.clone();
        for r in [
            s.reserve(b, 1).map(|_| ()),
            s.free(b),
            s.fork(b).map(|_| ()),
        ] {
            assert!(matches!(r, Err(PageError::StaleSession { id, current: 1 }) if id == b));
        }
        assert!(matches!(s.len(b), Err(PageError::StaleSession { .. })));
        assert_eq!(s, before);
        // An id of another cache with more slots.
        let mut other = CacheSessions::new(cfg(64, 3, 8, 150)).unwrap();
        let mut far = other.create().unwrap();
        for _ in 0..4 {
            far = other.create().unwrap();
        }
        assert!(matches!(
            s.len(far),
            Err(PageError::UnknownSession {
                max_sessions: 2,
                ..
            })
        ));
        s.check().unwrap();
    }

    #[test]
    fn stale_ids_stay_rejected_after_their_slot_is_reused() {
        let mut s = CacheSessions::new(cfg(64, 4, 1, 1000)).unwrap();
        let mut old = Vec::new();
        for g in 0..5u64 {
            let id = s.create().unwrap();
            assert_eq!((id.slot(), id.generation()), (0, g));
            s.reserve(id, 65).unwrap();
            for &o in &old {
                assert!(
                    matches!(s.len(o), Err(PageError::StaleSession { current, .. }) if current == g)
                );
            }
            s.free(id).unwrap();
            assert_eq!(s.free_pages(), 4);
            old.push(id);
        }
    }

    /// A truncation releases the pages past the new end and writes nothing; a kept page a
    /// fork still shares is copied before the truncated session writes it; past the end is
    /// an error that changes nothing.
    #[test]
    fn truncate_releases_pages_and_copies_a_shared_page_before_writing_it() {
        let mut s = CacheSessions::new(cfg(128, 8, 4, 4096)).unwrap();
        let a = s.create().unwrap();
        s.reserve(a, 300).unwrap(); // 3 pages
        let b = s.fork(a).unwrap();
        let before = s.clone();
        assert!(matches!(
            s.truncate(a, 301),
            Err(PageError::TruncatePastEnd {
                len: 300,
                requested: 301,
                ..
            })
        ));
        assert_eq!(s, before, "a refused truncation changes nothing");
        s.truncate(a, 200).unwrap(); // back into page 1, which b shares
        assert_eq!(
            (s.len(a).unwrap(), s.page_table(a).unwrap().len()),
            (200, 2)
        );
        assert_eq!(s.free_pages(), 5, "page 2 stays with b");
        let plan = s.reserve(a, 10).unwrap();
        let c = plan
            .copy
            .expect("the shared page is copied before a writes it");
        assert_eq!((c.src, c.tokens), (s.page_table(b).unwrap()[1], 72));
        assert_eq!(plan.first_token, 200);
        s.truncate(b, 0).unwrap();
        assert_eq!(s.page_table(b).unwrap().len(), 0);
        assert_eq!(s.free_pages(), 8 - 2, "only a's two pages remain");
        s.truncate(a, 210).unwrap(); // its own length: nothing to do
        s.check().unwrap();
    }

    /// Random create / fork / reserve / truncate / free against a shadow model: page contents are tags
    /// of the token written, every session must read back its own tokens through its page
    /// table, no plan may write a page with count > 1, and a failed call changes nothing.
    #[test]
    fn random_operations_keep_every_invariant() {
        for (seed, &(p, pages, max_sessions, max_tokens)) in [
            (64, 16, 4, 500),
            (128, 12, 6, 900),
            (256, 20, 8, 3000),
            (64, 6, 3, 400),
        ]
        .iter()
        .enumerate()
        {
            let mut rng = StdRng::seed_from_u64(0x5EED + seed as u64);
            let mut s = CacheSessions::new(cfg(p, pages, max_sessions, max_tokens)).unwrap();
            let mut content: HashMap<PageId, Vec<u64>> = HashMap::new(); // slot -> tag
                                                                         // Ordered, so the seed alone fixes which session each operation picks.
            let mut expect: BTreeMap<SessionId, Vec<u64>> = BTreeMap::new();
            let mut dead: Vec<SessionId> = Vec::new();
            let mut next_tag = 1u64;
            let (mut copies, mut exhausted, mut full, mut truncations) = (0, 0, 0, 0);
            for _ in 0..3000 {
                let live: Vec<SessionId> = expect.keys().copied().collect();
                let pick = |rng: &mut StdRng| live[rng.gen_range(0..live.len())];
                let before = s.clone();
                let op = rng.gen_range(0..10);
                let result: Result<(), PageError> = if live.is_empty() || op == 0 {
                    s.create().map(|id| {
                        expect.insert(id, Vec::new());
                    })
                } else if op == 1 {
                    let parent = pick(&mut rng);
                    s.fork(parent).map(|id| {
                        let e = expect[&parent].clone();
                        expect.insert(id, e);
                    })
                } else if op == 2 {
                    let id = pick(&mut rng);
                    s.free(id).map(|()| {
                        expect.remove(&id);
                        dead.push(id);
                    })
                } else if op == 4 && rng.gen_bool(0.3) {
                    // Mostly a short rollback (a draft's tokens, a block, a page), sometimes
                    // anywhere in the session, sometimes one past its end.
                    let id = pick(&mut rng);
                    let n = expect[&id].len();
                    let to = match rng.gen_range(0..10) {
                        0 => n + 1,
                        1 => rng.gen_range(0..=n),
                        _ => n.saturating_sub([0, 1, 3, 63, 64, 65, 200][rng.gen_range(0..7)]),
                    };
                    let r = s.truncate(id, to).map(|()| {
                        expect.get_mut(&id).unwrap().truncate(to);
                        truncations += 1;
                    });
                    if to > n {
                        assert!(matches!(r, Err(PageError::TruncatePastEnd { .. })));
                    }
                    r
                } else if op == 3 && !dead.is_empty() {
                    let id = dead[rng.gen_range(0..dead.len())];
                    let r = s.reserve(id, 1).map(|_| ());
                    assert!(matches!(r, Err(PageError::StaleSession { .. })));
                    r
                } else {
                    let id = pick(&mut rng);
                    let m = [0, 1, 1, 1, 3, 63, 64, 65, 200][rng.gen_range(0..9)];
                    s.reserve(id, m).map(|plan| {
                        for &pg in &plan.pages {
                            assert_eq!(s.pool().refcount(pg).unwrap(), 1, "writes shared {pg}");
                        }
                        if let Some(c) = plan.copy {
                            copies += 1;
                            assert!(s.pool().refcount(c.src).unwrap() >= 1);
                            let src = content.get(&c.src).cloned().unwrap_or_default();
                            content.insert(c.dst, src);
                        }
                        for t in plan.first_token..plan.end_token() {
                            let (pg, slot) = plan.location(t).unwrap();
                            let page = content.entry(pg).or_default();
                            if page.len() < p {
                                page.resize(p, 0);
                            }
                            page[slot] = next_tag;
                            expect.get_mut(&id).unwrap().push(next_tag);
                            next_tag += 1;
                        }
                    })
                };
                match &result {
                    Ok(()) => {}
                    Err(e) => {
                        match e {
                            PageError::PoolExhausted { .. } => exhausted += 1,
                            PageError::SessionFull { .. } => full += 1,
                            _ => {}
                        }
                        assert_eq!(s, before, "failed {e} changed state");
                    }
                }
                s.check().unwrap();
                assert_eq!(s.live_sessions(), expect.len());
                let total: usize = expect
                    .keys()
                    .map(|&id| s.page_table(id).unwrap().len())
                    .sum();
                assert_eq!(total as u64, s.pool().total_refs());
                for (&id, tags) in &expect {
                    assert_eq!(s.len(id).unwrap(), tags.len());
                    for (t, &tag) in tags.iter().enumerate() {
                        let (pg, slot) = s.locate(id, t).unwrap();
                        assert_eq!(
                            content[&pg][slot], tag,
                            "{id} token {t} reads another's data"
                        );
                    }
                }
            }
            assert!(
                copies > 0 && exhausted > 0 && truncations > 0,
                "seed {seed}: {copies} copies, {exhausted} exhausted, {full} full, {truncations} truncations"
            );
            for id in expect.keys().copied().collect::<Vec<_>>() {
                s.free(id).unwrap();
            }
            assert_eq!(s.free_pages(), pages);
            s.check().unwrap();
        }
    }
}
