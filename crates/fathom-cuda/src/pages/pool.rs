//! The page pool: a free list and a reference count per page (invariants 1 and 2).

#[allow(unused_imports)]
use super::*;

/// A fixed pool of pages with a free list and per-page reference counts.
///
/// Pages are handed out lowest id first on a fresh pool; a released page is the next one
/// handed out (LIFO), so reuse is prompt and tests see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagePool {
    pub(super) refcount: Vec<u32>,
    pub(super) free: Vec<PageId>,
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
