//! The paged reference against `fathom_store::KeyStore`, bit for bit (docs/SPEC.md §6.1).

use super::*;
use fathom_store::KeyStore;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

/// Keys `[n][row]` with a different spread per channel (some channels all zero), already
/// bf16 values (what a model computing in bf16 hands over).
fn bf16_keys(rng: &mut StdRng, n: usize, row: usize) -> Vec<f32> {
    let normal = Normal::new(0.0f32, 1.0).unwrap();
    let spread: Vec<f32> = (0..row)
        .map(|c| {
            if c % 29 == 7 {
                0.0
            } else {
                rng.gen_range(0.01f32..8.0)
            }
        })
        .collect();
    (0..n * row)
        .map(|i| bf16::from_f32(normal.sample(rng) * spread[i % row]).to_f32())
        .collect()
}

fn values(rng: &mut StdRng, n: usize, row: usize) -> Vec<f32> {
    (0..n * row).map(|_| rng.gen_range(-4.0f32..4.0)).collect()
}

fn cfg(page_tokens: usize, pages: usize, max_sessions: usize, max_tokens: usize) -> PageConfig {
    PageConfig {
        page_tokens,
        pages,
        max_sessions,
        max_tokens,
    }
}

#[track_caller]
fn assert_store(store: &PagedStoreRef, id: SessionId, keys: &[f32], what: &str) {
    let dims = store.layout().dims();
    let ks = KeyStore::from_keys(dims, keys, None).unwrap();
    if let Err(e) = store.export(id).unwrap().compare(&ks.view()) {
        panic!("{what}: {e}");
    }
}

#[track_caller]
fn assert_records(store: &PagedStoreRef, id: SessionId, keys: &[f32], vals: &[f32]) {
    let Dims { heads, channels: d } = store.layout().dims();
    let n = keys.len() / (heads * d);
    let recs = store.records(id).unwrap();
    assert_eq!(recs.len(), heads * n * 2 * d);
    for h in 0..heads {
        for i in 0..n {
            for c in 0..d {
                let src = (i * heads + h) * d + c;
                let at = (h * n + i) * 2 * d;
                assert_eq!(recs[at + c], bf16::from_f32(keys[src]), "K h{h} t{i} c{c}");
                assert_eq!(
                    recs[at + d + c],
                    bf16::from_f32(vals[src]),
                    "V h{h} t{i} c{c}"
                );
            }
        }
    }
}

/// Appends, and checks that no page outside the plan's written pages changed, that every
/// written page is the session's alone, and the page-table invariants.
fn append_isolated(
    store: &mut PagedStoreRef,
    id: SessionId,
    keys: &[f32],
    vals: &[f32],
) -> AppendPlan {
    let before = store.pool_bytes().to_vec();
    let plan = store.append(id, keys, vals).unwrap();
    let lay = *store.layout();
    let pb = lay.page_bytes() as usize;
    for pg in 0..lay.pages() {
        let page = PageId(pg as u32);
        if plan.pages.contains(&page) {
            assert_eq!(
                store.sessions().pool().refcount(page).unwrap(),
                1,
                "{page} written while shared"
            );
            continue;
        }
        assert!(
            before[pg * pb..(pg + 1) * pb] == store.pool_bytes()[pg * pb..(pg + 1) * pb],
            "{page} changed but is not in the plan"
        );
    }
    store.sessions().check().unwrap();
    plan
}

const CHUNKS: [usize; 13] = [1, 1, 2, 3, 5, 17, 63, 64, 65, 127, 128, 129, 300];

#[test]
fn appends_in_mixed_chunks_equal_key_store_bit_for_bit() {
    let mut case = 0u64;
    for &d in &[64usize, 128, 256] {
        for &heads in &[1usize, 2] {
            for &p in &[128usize, 4096] {
                for &n in &[1usize, 63, 65, 200, 4097] {
                    case += 1;
                    let mut rng = StdRng::seed_from_u64(0xFA7 + case);
                    let dims = Dims { heads, channels: d };
                    let row = dims.row();
                    let keys = bf16_keys(&mut rng, n, row);
                    let vals = values(&mut rng, n, row);
                    let pages = n.div_ceil(p);
                    let mut store = PagedStoreRef::new(dims, cfg(p, pages, 1, n)).unwrap();
                    let id = store.create().unwrap();
                    let mut incremental = KeyStore::with_capacity(dims, n, None).unwrap();
                    let mut at = 0;
                    while at < n {
                        let m = CHUNKS[rng.gen_range(0..CHUNKS.len())].min(n - at);
                        let (k, v) = (
                            &keys[at * row..(at + m) * row],
                            &vals[at * row..(at + m) * row],
                        );
                        let plan = store.append(id, k, v).unwrap();
                        assert_eq!((plan.first_token, plan.tokens), (at, m));
                        assert_eq!(plan.requant.is_some(), at % 64 != 0);
                        assert!(plan.copy.is_none());
                        incremental.append(k).unwrap();
                        at += m;
                        let what = format!("D={d} Hkv={heads} P={p} n={n} after {at}");
                        if let Err(e) = store.export(id).unwrap().compare(&incremental.view()) {
                            panic!("{what}: {e}");
                        }
                    }
                    store.sessions().check().unwrap();
                    assert_eq!(store.sessions().free_pages(), 0);
                    assert_store(&store, id, &keys, &format!("D={d} Hkv={heads} P={p} n={n}"));
                    assert_records(&store, id, &keys, &vals);
                }
            }
        }
    }
}

#[test]
fn token_by_token_decode_equals_key_store() {
    let dims = Dims {
        heads: 2,
        channels: 128,
    };
    let (n, row) = (300, dims.row());
    let mut rng = StdRng::seed_from_u64(11);
    let keys = bf16_keys(&mut rng, n, row);
    let vals = values(&mut rng, n, row);
    let mut store = PagedStoreRef::new(dims, cfg(128, 3, 1, n)).unwrap();
    let id = store.create().unwrap();
    for i in 0..n {
        let plan = store
            .append(
                id,
                &keys[i * row..(i + 1) * row],
                &vals[i * row..(i + 1) * row],
            )
            .unwrap();
        assert_eq!(plan.new_pages, usize::from(i % 128 == 0));
        if i % 17 == 0 || i % 64 == 63 {
            assert_store(
                &store,
                id,
                &keys[..(i + 1) * row],
                &format!("after {}", i + 1),
            );
        }
    }
    assert_store(&store, id, &keys, "all");
    assert_records(&store, id, &keys, &vals);
}

#[test]
fn f32_keys_give_the_store_of_their_bf16_rounding() {
    let dims = Dims {
        heads: 2,
        channels: 64,
    };
    let (n, row) = (150, dims.row());
    let mut rng = StdRng::seed_from_u64(5);
    let keys: Vec<f32> = (0..n * row).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
    let vals = values(&mut rng, n, row);
    let rounded: Vec<f32> = keys.iter().map(|&k| bf16::from_f32(k).to_f32()).collect();
    let mut store = PagedStoreRef::new(dims, cfg(128, 2, 1, n)).unwrap();
    let id = store.create().unwrap();
    store
        .append(id, &keys[..70 * row], &vals[..70 * row])
        .unwrap();
    store
        .append(id, &keys[70 * row..], &vals[70 * row..])
        .unwrap();
    assert_store(&store, id, &rounded, "bf16-rounded keys");
}

/// Forks `prefix` tokens in, then appends different keys to parent and child in random
/// order; each must stay equal to its own `KeyStore`, and no append may touch a page the
/// other side can see.
#[test]
fn forks_share_full_pages_and_copy_the_partial_one_on_write() {
    let dims = Dims {
        heads: 2,
        channels: 64,
    };
    let row = dims.row();
    let mut case = 0;
    for &p in &[128usize, 256] {
        for &prefix in &[0usize, 1, 63, 64, 100, 128, 200, 256, 300] {
            case += 1;
            let mut rng = StdRng::seed_from_u64(0xF0 + case);
            let max = prefix + 1000;
            let mut store =
                PagedStoreRef::new(dims, cfg(p, 3 * max.div_ceil(p) + 2, 4, max)).unwrap();
            let parent = store.create().unwrap();
            let k0 = bf16_keys(&mut rng, prefix, row);
            let v0 = values(&mut rng, prefix, row);
            if prefix > 0 {
                let cut = prefix / 3;
                if cut > 0 {
                    store
                        .append(parent, &k0[..cut * row], &v0[..cut * row])
                        .unwrap();
                }
                store
                    .append(parent, &k0[cut * row..], &v0[cut * row..])
                    .unwrap();
            }
            let in_use = store.sessions().pages_in_use();
            let child = store.fork(parent).unwrap();
            // Nothing copied at fork time; every page shared.
            assert_eq!(store.sessions().pages_in_use(), in_use);
            let table = store.sessions().page_table(parent).unwrap().to_vec();
            assert_eq!(store.sessions().page_table(child).unwrap(), &table[..]);
            for &pg in &table {
                assert_eq!(store.sessions().pool().refcount(pg).unwrap(), 2);
            }
            assert_store(&store, child, &k0, "child at fork");
            let partial_shared = prefix % p != 0;
            let (mut kp, mut kc) = (k0.clone(), k0.clone());
            let (mut vp, mut vc) = (v0.clone(), v0.clone());
            let (mut first_p, mut first_c) = (true, true);
            for step in 0..12 {
                let to_parent = rng.gen_bool(0.5);
                let m = CHUNKS[rng.gen_range(0..CHUNKS.len())].min(60);
                let k = bf16_keys(&mut rng, m, row);
                let v = values(&mut rng, m, row);
                let (id, keys, vals, first, other_first) = if to_parent {
                    (parent, &mut kp, &mut vp, &mut first_p, first_c)
                } else {
                    (child, &mut kc, &mut vc, &mut first_c, first_p)
                };
                let other_snapshot = store
                    .export(if to_parent { child } else { parent })
                    .unwrap();
                let plan = append_isolated(&mut store, id, &k, &v);
                // The first append by either side after the fork copies the shared partial
                // page; the other side then owns the original and appends in place.
                let want_copy = partial_shared && *first && other_first;
                assert_eq!(
                    plan.copy.is_some(),
                    want_copy,
                    "P={p} prefix={prefix} step {step}"
                );
                if let Some(c) = plan.copy {
                    assert_eq!(c.tokens, prefix % p);
                    assert_eq!(c.src, table[table.len() - 1]);
                    assert_eq!(plan.pages[0], c.dst);
                }
                *first = false;
                keys.extend_from_slice(&k);
                vals.extend_from_slice(&v);
                assert_eq!(
                    store
                        .export(if to_parent { child } else { parent })
                        .unwrap(),
                    other_snapshot,
                    "the other side changed"
                );
                assert_store(
                    &store,
                    parent,
                    &kp,
                    &format!("parent P={p} prefix={prefix} step {step}"),
                );
                assert_store(
                    &store,
                    child,
                    &kc,
                    &format!("child P={p} prefix={prefix} step {step}"),
                );
            }
            // Full pages of the prefix stay shared for good.
            let full = prefix / p;
            let (tp, tc) = (
                store.sessions().page_table(parent).unwrap().to_vec(),
                store.sessions().page_table(child).unwrap().to_vec(),
            );
            assert_eq!(tp[..full], tc[..full]);
            // A grandchild, then the parent freed: the others keep their data.
            let grand = store.fork(child).unwrap();
            let k = bf16_keys(&mut rng, 77, row);
            let v = values(&mut rng, 77, row);
            append_isolated(&mut store, grand, &k, &v);
            let mut kg = kc.clone();
            kg.extend_from_slice(&k);
            store.free(parent).unwrap();
            store.sessions().check().unwrap();
            assert_store(&store, child, &kc, "child after parent freed");
            assert_store(&store, grand, &kg, "grandchild after parent freed");
            assert_records(&store, child, &kc, &vc);
            let k = bf16_keys(&mut rng, 65, row);
            let v = values(&mut rng, 65, row);
            append_isolated(&mut store, child, &k, &v);
            kc.extend_from_slice(&k);
            assert_store(&store, child, &kc, "child after more appends");
            assert_store(&store, grand, &kg, "grandchild untouched");
            store.free(grand).unwrap();
            store.free(child).unwrap();
            assert_eq!(store.sessions().pages_in_use(), 0);
            store.sessions().check().unwrap();
        }
    }
}

#[test]
fn a_freed_and_reused_slot_sees_none_of_the_old_data() {
    let dims = Dims {
        heads: 2,
        channels: 128,
    };
    let row = dims.row();
    let mut rng = StdRng::seed_from_u64(99);
    let mut store = PagedStoreRef::new(dims, cfg(128, 3, 2, 384)).unwrap();
    let old = store.create().unwrap();
    // Large keys, so any stale word or scale would show.
    let k_old: Vec<f32> = bf16_keys(&mut rng, 300, row)
        .iter()
        .map(|k| k * 100.0)
        .collect();
    let v_old = values(&mut rng, 300, row);
    store.append(old, &k_old, &v_old).unwrap();
    let old_pages = store.sessions().page_table(old).unwrap().to_vec();
    store.free(old).unwrap();
    assert_eq!(store.sessions().free_pages(), 3);
    let new = store.create().unwrap();
    assert_eq!(new.slot(), old.slot());
    assert_ne!(new.generation(), old.generation());
    assert_eq!(store.sessions().len(new).unwrap(), 0);
    assert_store(&store, new, &[], "empty reused session");
    assert!(matches!(
        store.append(old, &k_old[..row], &v_old[..row]),
        Err(CudaError::Page(PageError::StaleSession { .. }))
    ));
    assert!(matches!(
        store.export(old),
        Err(CudaError::Page(PageError::StaleSession { .. }))
    ));
    assert!(matches!(
        store.free(old),
        Err(CudaError::Page(PageError::StaleSession { .. }))
    ));
    let k_new = bf16_keys(&mut rng, 250, row);
    let v_new = values(&mut rng, 250, row);
    store
        .append(new, &k_new[..70 * row], &v_new[..70 * row])
        .unwrap();
    assert!(old_pages.contains(&store.sessions().page_table(new).unwrap()[0]));
    assert_store(&store, new, &k_new[..70 * row], "reused, 70 tokens");
    assert_records(&store, new, &k_new[..70 * row], &v_new[..70 * row]);
    store
        .append(new, &k_new[70 * row..], &v_new[70 * row..])
        .unwrap();
    assert_store(&store, new, &k_new, "reused, 250 tokens");
    assert_records(&store, new, &k_new, &v_new);
}

#[test]
fn failed_appends_change_nothing() {
    let dims = Dims {
        heads: 2,
        channels: 64,
    };
    let row = dims.row();
    let mut rng = StdRng::seed_from_u64(3);
    let mut store = PagedStoreRef::new(dims, cfg(128, 2, 2, 200)).unwrap();
    let id = store.create().unwrap();
    let k = bf16_keys(&mut rng, 100, row);
    let v = values(&mut rng, 100, row);
    store.append(id, &k, &v).unwrap();
    let child = store.fork(id).unwrap(); // the partial page is shared: a COW is pending
    let (sessions, bytes) = (store.sessions().clone(), store.pool_bytes().to_vec());
    let unchanged = |s: &PagedStoreRef| {
        assert!(s.sessions() == &sessions && s.pool_bytes() == &bytes[..]);
    };
    let mut bad = k[..3 * row].to_vec();
    bad[row + 5] = f32::NAN;
    let e = store.append(id, &bad, &v[..3 * row]).unwrap_err();
    assert!(
        matches!(
            e,
            CudaError::Store(StoreError::NonFinite {
                token: 101,
                head: 0,
                channel: 5,
                ..
            })
        ),
        "{e}"
    );
    unchanged(&store);
    bad[row + 5] = 70000.0;
    let e = store.append(id, &bad, &v[..3 * row]).unwrap_err();
    assert!(
        matches!(
            e,
            CudaError::Store(StoreError::ScaleOverflow { token: 101, .. })
        ),
        "{e}"
    );
    unchanged(&store);
    let mut badv = v[..3 * row].to_vec();
    badv[2 * row] = f32::INFINITY;
    assert!(matches!(
        store.append(id, &k[..3 * row], &badv),
        Err(CudaError::Invalid { what: "values", .. })
    ));
    badv[2 * row] = f32::MAX; // finite in f32, infinite in bf16
    assert!(matches!(
        store.append(id, &k[..3 * row], &badv),
        Err(CudaError::Invalid { what: "values", .. })
    ));
    unchanged(&store);
    assert!(matches!(
        store.append(id, &k[..row + 1], &v[..row + 1]),
        Err(CudaError::Store(StoreError::Shape { .. }))
    ));
    assert!(matches!(
        store.append(id, &k[..row], &v[..2 * row]),
        Err(CudaError::Invalid { what: "values", .. })
    ));
    assert!(matches!(
        store.append(id, &[], &[]),
        Err(CudaError::Page(PageError::ZeroLengthAppend { .. }))
    ));
    unchanged(&store);
    let big = bf16_keys(&mut rng, 101, row);
    let bigv = values(&mut rng, 101, row);
    assert!(matches!(
        store.append(id, &big, &bigv),
        Err(CudaError::Page(PageError::SessionFull {
            len: 100,
            requested: 101,
            max_tokens: 200,
            ..
        }))
    ));
    unchanged(&store);
    // 100 → 200 needs a copy of the shared page plus one fresh page: 2 > 1 free.
    assert!(matches!(
        store.append(id, &big[..100 * row], &bigv[..100 * row]),
        Err(CudaError::Page(PageError::PoolExhausted {
            needed: 2,
            free: 1,
            capacity: 2
        }))
    ));
    unchanged(&store);
    // Within the page: only the copy is needed, and it fits.
    let plan = store
        .append(child, &big[..28 * row], &bigv[..28 * row])
        .unwrap();
    assert!(plan.copy.is_some());
    assert_eq!(store.sessions().free_pages(), 0);
    let mut kc = k.clone();
    kc.extend_from_slice(&big[..28 * row]);
    assert_store(&store, child, &kc, "child");
    assert_store(&store, id, &k, "parent");
}

/// Decode with rollbacks, as speculative decoding does: random appends and truncations (to
/// a block edge, inside a block, inside the last block, across pages, to 0) keep the store
/// equal to `KeyStore` of the kept keys and the records equal to the kept rows, bit for bit,
/// after each call; a fork made before a truncation keeps reading its own tokens, and the
/// truncated side copies the page they share before writing it.
#[test]
fn truncations_keep_the_store_of_the_kept_keys() {
    for (case, &(d, heads, p)) in [(64usize, 1usize, 128usize), (128, 2, 256), (64, 3, 4096)]
        .iter()
        .enumerate()
    {
        let mut rng = StdRng::seed_from_u64(0x7A11 + case as u64);
        let dims = Dims { heads, channels: d };
        let row = dims.row();
        let mut store = PagedStoreRef::new(dims, cfg(p, 64, 3, 1 << 16)).unwrap();
        let id = store.create().unwrap();
        let (mut keys, mut vals) = (Vec::new(), Vec::new());
        let mut fork: Option<(SessionId, Vec<f32>, Vec<f32>)> = None;
        let (mut inside, mut edges) = (0, 0);
        for step in 0..120 {
            let n = keys.len() / row;
            if rng.gen_bool(0.35) && n > 0 {
                let to = match rng.gen_range(0..6) {
                    0 => n - n % 64,
                    1 => 0,
                    2 => rng.gen_range(0..=n),
                    _ => n.saturating_sub(rng.gen_range(1..=8)),
                };
                if rng.gen_bool(0.2) && fork.is_none() {
                    // A fork before the truncation: it shares the pages being cut.
                    let f = store.fork(id).unwrap();
                    fork = Some((f, keys.clone(), vals.clone()));
                }
                let before = store.pool_bytes().to_vec();
                let e = store.truncate(id, n + 1).unwrap_err().to_string();
                assert!(e.contains("cannot be truncated"), "{e}");
                assert_eq!(
                    store.pool_bytes(),
                    &before[..],
                    "a refused truncation writes nothing"
                );
                store.truncate(id, to).unwrap();
                if to % 64 == 0 {
                    edges += 1;
                } else {
                    inside += 1;
                }
                keys.truncate(to * row);
                vals.truncate(to * row);
            } else {
                let m = CHUNKS[rng.gen_range(0..CHUNKS.len())];
                let (k, v) = (bf16_keys(&mut rng, m, row), values(&mut rng, m, row));
                store.append(id, &k, &v).unwrap();
                keys.extend(k);
                vals.extend(v);
            }
            let what = format!(
                "D={d} Hkv={heads} P={p} step {step}, {} tokens",
                keys.len() / row
            );
            assert_eq!(
                store.sessions().len(id).unwrap() * row,
                keys.len(),
                "{what}"
            );
            assert_store(&store, id, &keys, &what);
            assert_records(&store, id, &keys, &vals);
            if let Some((f, fk, fv)) = &fork {
                assert_store(&store, *f, fk, &format!("the fork, {what}"));
                assert_records(&store, *f, fk, fv);
            }
            store.sessions().check().unwrap();
        }
        assert!(
            inside > 5 && edges > 2,
            "{inside} inside a block, {edges} at an edge"
        );
        assert!(fork.is_some(), "a fork was cut under");
    }
}
