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
