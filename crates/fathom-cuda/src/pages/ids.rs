//! The ids the bookkeeping hands out (pages, sessions) and its errors.

#[allow(unused_imports)]
use super::*;

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
    pub(super) slot: u32,
    pub(super) generation: u64,
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

pub(super) fn config_err(what: &'static str, detail: impl Into<String>) -> PageError {
    PageError::Config {
        what,
        detail: detail.into(),
    }
}
