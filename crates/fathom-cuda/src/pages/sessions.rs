//! Sessions over the pool: page tables, create, fork, free, truncate and reserve (invariants
//! 3 to 5, and the copy-on-write of a shared partial page).

#[allow(unused_imports)]
use super::*;

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
