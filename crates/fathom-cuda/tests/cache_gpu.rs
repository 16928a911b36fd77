//! The paged cache on the device against its CPU references: appends (prefill chunks and
//! decode tokens, ragged batches, lengths that are not multiples of 64, partial blocks) give
//! each session the store `fathom_store::KeyStore` builds from the same bf16 keys, bit for
//! bit, and the same bf16 K|V records; forks diverge without disturbing each other; a freed
//! and reused slot sees none of the old data; bad calls are typed errors before any launch.
//! The store, fork and attend tests run with the pools in host memory and in HBM.
//!
//! Skips (printing why) without a GPU path, as on CI; `FATHOM_REQUIRE_GPU=1` turns the skip
//! into a failure.

use fathom_cuda::cache::{CacheConfig, CacheOptions, KvDtype, KvRows};
use fathom_cuda::memory::DeviceBuffer;
use fathom_cuda::pages::{PageConfig, SessionId};
use fathom_cuda::prelude::*;
use fathom_cuda::{ModelShape, PagedCache, Residency};
use fathom_store::{Dims, KeyStore};
use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;
use common::gpu;

fn config(layers: usize, hkv: usize, d: usize, page_tokens: usize, pages: usize) -> CacheConfig {
    CacheConfig {
        shape: ModelShape {
            layers,
            kv_heads: hkv,
            group: 4,
            dim: d,
        },
        pages: PageConfig {
            page_tokens,
            pages,
            max_sessions: 8,
            max_tokens: 1 << 16,
        },
        max_batch: 8,
        max_k: 256,
        row_cache: 0,
        residency: fathom_cuda::Residency::Host,
        pca_index: false,
        block_tables: false,
        host_pages: fathom_cuda::HostPages::Driver,
        options: CacheOptions::default(),
    }
}

/// `cfg` with the options `set` makes.
fn with(mut cfg: CacheConfig, set: impl FnOnce(&mut CacheOptions)) -> CacheConfig {
    set(&mut cfg.options);
    cfg
}

/// Sink 4, local 32, k = 64: the selection of the tests that compare caches with each other.
fn small_select() -> fathom_plan::SelectParams {
    fathom_plan::SelectParams {
        sink: 4,
        local: 32,
        k: 64,
    }
}

/// The CPU side of one (session, layer): every key and value appended so far, `[n][Hkv][D]`.
#[derive(Default, Clone)]
struct Shadow {
    k: Vec<f32>,
    v: Vec<f32>,
}

fn bf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Checks one session's store and records in every layer against `KeyStore::from_keys` of
/// the bf16 keys and the bf16 values.
fn check(cache: &PagedCache, s: SessionId, shadows: &[Shadow], what: &str) {
    let c = cache.config().shape;
    let dims = Dims {
        heads: c.kv_heads,
        channels: c.dim,
    };
    for (l, sh) in shadows.iter().enumerate() {
        let n = sh.k.len() / dims.row();
        assert_eq!(cache.len(s).unwrap(), n, "{what}: length");
        let keys: Vec<f32> = sh.k.iter().map(|&x| bf(x)).collect();
        let store = KeyStore::from_keys(dims, &keys, None).unwrap();
        let got = cache.export(s, l).unwrap();
        if let Err(e) = got.compare(&store.view()) {
            panic!("{what}, layer {l}, {n} tokens: {e}");
        }
        let rec = cache.records(s, l).unwrap();
        let d = c.dim;
        for h in 0..c.kv_heads {
            for i in 0..n {
                let r = &rec[(h * n + i) * 2 * d..(h * n + i + 1) * 2 * d];
                for ch in 0..d {
                    let src = (i * c.kv_heads + h) * d + ch;
                    assert_eq!(r[ch].to_f32(), bf(sh.k[src]), "{what}: K record");
                    assert_eq!(r[d + ch].to_f32(), bf(sh.v[src]), "{what}: V record");
                }
            }
        }
    }
}

/// One reserve + append of every layer for `batch = [(session, tokens)]`, mirrored in the
/// shadows.
// `l` indexes the inner dimension of `shadows[slot][layer]` and names the layer appended.
#[allow(clippy::needless_range_loop)]
fn step(
    cache: &mut PagedCache,
    rng: &mut StdRng,
    batch: &[(SessionId, usize)],
    shadows: &mut [Vec<Shadow>],
    slot_of: &dyn Fn(SessionId) -> usize,
) -> fathom_cuda::cache::AppendBatch {
    let c = cache.config().shape;
    let row = c.kv_heads * c.dim;
    let ab = cache.reserve(batch).unwrap();
    for l in 0..c.layers {
        let mut k = Vec::new();
        let mut v = Vec::new();
        for &(s, m) in batch {
            // Keys with a per-channel scale (as real keys have) and an occasional outlier.
            let kk: Vec<f32> = (0..m * row)
                .map(|i| {
                    let scale = 0.1 + (i % c.dim) as f32 / c.dim as f32;
                    let x: f32 = rng.gen_range(-1.0..1.0) * scale;
                    if rng.gen_ratio(1, 500) {
                        x * 40.0
                    } else {
                        x
                    }
                })
                .collect();
            let vv: Vec<f32> = (0..m * row).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let sh = &mut shadows[slot_of(s)][l];
            sh.k.extend_from_slice(&kk);
            sh.v.extend_from_slice(&vv);
            k.extend(kk);
            v.extend(vv);
        }
        cache.append_host(&ab, l, &k, &v).unwrap();
    }
    ab
}

#[test]
fn ragged_prefill_and_decode_equal_the_cpu_store_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(7);
    // (D, Hkv, tokens per page, pages per layer's pool)
    for (d, hkv, page, pages, residency) in [
        (64, 3, 128, 48, Residency::Host),
        (128, 2, 4096, 6, Residency::Host),
        (256, 1, 256, 32, Residency::Hbm),
        (128, 1, 64, 80, Residency::Hbm),
        (64, 3, 128, 48, Residency::Hbm),
        // The split residency: planes and scales in HBM, records on the host.
        (64, 3, 128, 48, Residency::IndexHbm),
        (128, 2, 4096, 6, Residency::IndexHbm),
    ] {
        let cfg = CacheConfig {
            residency,
            ..config(2, hkv, d, page, pages)
        };
        let mut cache = PagedCache::new(&gpu, cfg).unwrap();
        let ids: Vec<SessionId> = (0..3).map(|_| cache.create().unwrap()).collect();
        let mut shadows = vec![vec![Shadow::default(); 2]; 8];
        let slot = |s: SessionId| s.slot();
        // A ragged prefill in chunks of mixed sizes (1, 63, 65, 200 and 4097 tokens in all),
        // then 16 decode steps of the whole batch.
        let plan: [&[(usize, usize)]; 4] = [
            &[(0, 1), (1, 63), (2, 65)],
            &[(1, 137), (2, 4032)],
            &[(0, 62), (2, 0)],
            &[(0, 1)],
        ];
        for chunk in plan {
            let batch: Vec<(SessionId, usize)> = chunk
                .iter()
                .filter(|(_, m)| *m > 0)
                .map(|&(i, m)| (ids[i], m))
                .collect();
            step(&mut cache, &mut rng, &batch, &mut shadows, &slot);
        }
        for i in 0..3 {
            check(
                &cache,
                ids[i],
                &shadows[ids[i].slot()],
                &format!("D={d} prefill {i}"),
            );
        }
        for t in 0..16 {
            let batch: Vec<(SessionId, usize)> = ids.iter().map(|&s| (s, 1)).collect();
            step(&mut cache, &mut rng, &batch, &mut shadows, &slot);
            if t % 5 == 4 {
                check(&cache, ids[t % 3], &shadows[ids[t % 3].slot()], "decode");
            }
        }
        for i in 0..3 {
            check(
                &cache,
                ids[i],
                &shadows[ids[i].slot()],
                &format!("D={d} decode {i}"),
            );
        }
        assert_eq!(cache.faults().unwrap(), vec![0, 0]);
        let lens: Vec<usize> = ids.iter().map(|&s| cache.len(s).unwrap()).collect();
        assert_eq!(lens, vec![64 + 16, 200 + 16, 4097 + 16]);
    }
}

#[test]
fn forks_diverge_without_disturbing_each_other() {
    let Some(gpu) = gpu() else { return };
    for residency in [Residency::Host, Residency::Hbm, Residency::IndexHbm] {
        forks_diverge(&gpu, residency);
    }
}

fn forks_diverge(gpu: &fathom_cuda::Gpu, residency: Residency) {
    let mut rng = StdRng::seed_from_u64(11);
    let cfg = CacheConfig {
        residency,
        ..config(2, 2, 128, 128, 64)
    };
    let mut cache = PagedCache::new(gpu, cfg).unwrap();
    let parent = cache.create().unwrap();
    let mut shadows = vec![vec![Shadow::default(); 2]; 8];
    let slot = |s: SessionId| s.slot();
    // Fork mid-block and mid-page (300 tokens: pages of 128, block 4 partial).
    step(&mut cache, &mut rng, &[(parent, 300)], &mut shadows, &slot);
    let child = cache.fork(parent).unwrap();
    shadows[child.slot()] = shadows[parent.slot()].clone();
    check(&cache, child, &shadows[child.slot()], "child at fork");
    for i in 0..40 {
        // Both sides append different tokens, sometimes together, sometimes alone.
        let batch: Vec<(SessionId, usize)> = match i % 3 {
            0 => vec![(parent, 1), (child, 1)],
            1 => vec![(child, 1 + i % 7)],
            _ => vec![(parent, 2)],
        };
        step(&mut cache, &mut rng, &batch, &mut shadows, &slot);
    }
    let grandchild = cache.fork(child).unwrap();
    shadows[grandchild.slot()] = shadows[child.slot()].clone();
    step(
        &mut cache,
        &mut rng,
        &[(grandchild, 5), (child, 3)],
        &mut shadows,
        &slot,
    );
    for (s, what) in [
        (parent, "parent"),
        (child, "child"),
        (grandchild, "grandchild"),
    ] {
        check(&cache, s, &shadows[s.slot()], what);
    }
    cache.free(parent).unwrap();
    check(
        &cache,
        child,
        &shadows[child.slot()],
        "child after the parent is freed",
    );
    check(
        &cache,
        grandchild,
        &shadows[grandchild.slot()],
        "grandchild after the parent is freed",
    );
    cache.sessions().check().unwrap();
}

/// Truncations (inside a block, at a block edge, across pages, to 0) keep every layer's store
/// and records equal to the CPU store of the kept keys and values, bit for bit, in every
/// residency; a fork made before a truncation keeps its own tokens; dense attention of the
/// truncated session equals that of a session that only ever held the kept rows; and a
/// session whose step failed after its reserve is healed by a truncation to its written rows.
#[test]
fn truncations_keep_the_store_of_the_kept_keys() {
    let Some(gpu) = gpu() else { return };
    for residency in [Residency::Host, Residency::Hbm, Residency::IndexHbm] {
        let mut rng = StdRng::seed_from_u64(19);
        // With a row cache: attends between the cuts cache rows whose positions later tokens
        // take, which the cut must forget.
        let cfg = CacheConfig {
            residency,
            row_cache: 64,
            ..config(2, 2, 128, 128, 96)
        };
        let row = 2 * 128;
        let sparq = fathom_cuda::cache::AttendMethod::parse("sparq:16", 128).unwrap();
        let q1: Vec<f32> = (0..2 * 4 * 128)
            .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
            .collect();
        let mut cache = PagedCache::new(&gpu, cfg).unwrap();
        let a = cache.create().unwrap();
        let mut shadows = vec![vec![Shadow::default(); 2]; 8];
        let slot = |s: SessionId| s.slot();
        step(&mut cache, &mut rng, &[(a, 300)], &mut shadows, &slot);
        let b = cache.fork(a).unwrap();
        shadows[b.slot()] = shadows[a.slot()].clone();
        let cut = |shadows: &mut Vec<Vec<Shadow>>, s: SessionId, to: usize| {
            for sh in &mut shadows[s.slot()] {
                sh.k.truncate(to * row);
                sh.v.truncate(to * row);
            }
        };
        for i in 0..24 {
            let n = cache.len(a).unwrap();
            match i % 4 {
                0 | 2 => {
                    let to = match i % 8 {
                        0 => n - 3,
                        2 => n - n % 64,
                        4 => n - 70,
                        _ => n - (n % 64) - 1,
                    };
                    cache.truncate(a, to).unwrap();
                    cut(&mut shadows, a, to);
                }
                _ => {
                    let m = [1, 5, 63, 64, 65][i % 5];
                    let ab = step(&mut cache, &mut rng, &[(a, m)], &mut shadows, &slot);
                    for l in 0..2 {
                        cache
                            .attend_host(&ab, l, sparq, &small_select(), &q1)
                            .unwrap();
                    }
                }
            }
            let what = format!("{residency:?} op {i}");
            check(&cache, a, &shadows[a.slot()], &what);
            check(&cache, b, &shadows[b.slot()], &format!("the fork, {what}"));
        }
        let e = cache
            .truncate(a, cache.len(a).unwrap() + 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot be truncated"), "{e}");
        // Dense attention of the truncated session equals that of a session that only ever
        // held its rows (nothing of the dropped rows is read).
        let n = cache.len(a).unwrap();
        let c = cache.create().unwrap();
        let ab = cache.reserve(&[(c, n)]).unwrap();
        for (l, sh) in shadows[a.slot()].iter().enumerate() {
            cache.append_host(&ab, l, &sh.k, &sh.v).unwrap();
        }
        shadows[c.slot()] = shadows[a.slot()].clone();
        check(&cache, c, &shadows[c.slot()], "the rebuilt session");
        // One more token, the same for both, then the same query: the outputs (over the
        // scanned planes, the row cache and the records) are the same bits.
        let ab = cache.reserve(&[(a, 1), (c, 1)]).unwrap();
        let knew: Vec<f32> = (0..row).map(|i| ((i % 13) as f32 - 6.0) / 7.0).collect();
        let vnew: Vec<f32> = (0..row).map(|i| ((i % 11) as f32 - 5.0) / 3.0).collect();
        let k2 = [knew.as_slice(), knew.as_slice()].concat();
        let v2 = [vnew.as_slice(), vnew.as_slice()].concat();
        for l in 0..2 {
            cache.append_host(&ab, l, &k2, &v2).unwrap();
        }
        for s in [a, c] {
            for sh in &mut shadows[s.slot()] {
                sh.k.extend_from_slice(&knew);
                sh.v.extend_from_slice(&vnew);
            }
        }
        let q1: Vec<f32> = (0..2 * 4 * 128)
            .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
            .collect();
        let q = [q1.as_slice(), q1.as_slice()].concat();
        for m in ["dense", "exact", "sparq:16"] {
            let am = fathom_cuda::cache::AttendMethod::parse(m, 128).unwrap();
            if let fathom_cuda::cache::AttendMethod::Scan(sm) = am {
                cache.prepare(sm).unwrap();
            }
            for l in 0..2 {
                let out = cache.attend_host(&ab, l, am, &small_select(), &q).unwrap();
                let (oa, oc) = out.split_at(out.len() / 2);
                assert_eq!(
                    oa, oc,
                    "{residency:?} {m} layer {l}: the truncated session reads only its rows"
                );
            }
        }
        // A step that failed after its reserve (layer 1 never appended): refused until a
        // truncation to the written rows heals it.
        let ab = cache.reserve(&[(b, 2)]).unwrap();
        let sh = &shadows[b.slot()][0];
        let (k, v) = (sh.k[..2 * row].to_vec(), sh.v[..2 * row].to_vec());
        cache.append_host(&ab, 0, &k, &v).unwrap();
        let nb = cache.len(b).unwrap();
        cache.truncate(b, nb).unwrap(); // its own length: nothing to do
        let e = cache.truncate(b, nb - 1).unwrap_err().to_string();
        assert!(e.contains("no append wrote"), "{e}");
        cache.truncate(b, nb - 2).unwrap();
        step(&mut cache, &mut rng, &[(b, 3)], &mut shadows, &slot);
        check(
            &cache,
            b,
            &shadows[b.slot()],
            &format!("{residency:?}: healed"),
        );
        assert_eq!(cache.faults().unwrap(), vec![0, 0]);
        cache.sessions().check().unwrap();
    }
}

#[test]
fn a_freed_and_reused_session_sees_none_of_the_old_data() {
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(3);
    let mut cfg = config(1, 2, 64, 128, 8);
    cfg.pages.max_sessions = 1;
    cfg.max_batch = 1;
    let mut cache = PagedCache::new(&gpu, cfg).unwrap();
    let mut shadows = vec![vec![Shadow::default(); 1]; 1];
    let slot = |s: SessionId| s.slot();
    let a = cache.create().unwrap();
    step(&mut cache, &mut rng, &[(a, 700)], &mut shadows, &slot);
    cache.free(a).unwrap();
    let b = cache.create().unwrap();
    assert_eq!(b.slot(), a.slot());
    shadows[0] = vec![Shadow::default(); 1];
    // A partial block of a reused page and a reused tail: only the new keys may show.
    step(&mut cache, &mut rng, &[(b, 33)], &mut shadows, &slot);
    step(&mut cache, &mut rng, &[(b, 40)], &mut shadows, &slot);
    check(&cache, b, &shadows[0], "reused slot");
    let e = cache.len(a).unwrap_err().to_string();
    assert!(e.contains("generation"), "{e}");
}

#[test]
fn bad_calls_are_typed_errors_before_any_launch() {
    let Some(gpu) = gpu() else { return };
    let mut cfg = config(2, 2, 64, 128, 4);
    cfg.pages.max_tokens = 300;
    let mut cache = PagedCache::new(&gpu, cfg).unwrap();
    let a = cache.create().unwrap();
    let b = cache.create().unwrap();
    let e = cache.reserve(&[(a, 301)]).unwrap_err().to_string();
    assert!(e.contains("300"), "past capacity: {e}");
    let e = cache
        .reserve(&[(a, 200), (b, 300)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("needed") || e.contains("pages"),
        "pool exhausted: {e}"
    );
    assert_eq!(cache.len(a).unwrap(), 0, "a failed batch changes nothing");
    let e = cache.reserve(&[(a, 1), (a, 1)]).unwrap_err().to_string();
    assert!(e.contains("twice"), "{e}");
    let e = cache.reserve(&[]).unwrap_err().to_string();
    assert!(e.contains("0 sessions"), "{e}");
    let batch = cache.reserve(&[(a, 2)]).unwrap();
    let row = 2 * 64;
    let e = cache
        .append_host(&batch, 0, &vec![0.5; row], &vec![0.5; 2 * row])
        .unwrap_err()
        .to_string();
    assert!(e.contains("128 keys") && e.contains("want [2]"), "{e}");
    let mut k = vec![0.5; 2 * row];
    k[row + 3] = f32::NAN;
    let e = cache
        .append_host(&batch, 0, &k, &vec![0.5; 2 * row])
        .unwrap_err()
        .to_string();
    assert!(e.contains("row 1, head 0, channel 3"), "{e}");
    let e = cache
        .append_host(&batch, 2, &vec![0.5; 2 * row], &vec![0.5; 2 * row])
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 layers"), "{e}");
    // Device rows whose length or dtype does not fit: refused before the launch.
    let short = DeviceBuffer::<f32>::zeros(&gpu, row).unwrap();
    let full = DeviceBuffer::<f32>::zeros(&gpu, 2 * row).unwrap();
    let other = DeviceBuffer::<half::f16>::zeros(&gpu, 2 * row).unwrap();
    let kv = KvRows {
        k: short.view(),
        v: full.view(),
        rows: 2,
    };
    let e = cache.append(&batch, 0, &kv).unwrap_err().to_string();
    assert!(e.contains("keys") && e.contains("want at least"), "{e}");
    let kv = KvRows {
        k: full.view(),
        v: other.view(),
        rows: 2,
    };
    let e = cache.append(&batch, 0, &kv).unwrap_err().to_string();
    assert!(e.contains("one dtype"), "{e}");
    let stale = batch.clone();
    let _next = cache.reserve(&[(b, 1)]).unwrap();
    let e = cache
        .append_host(&stale, 0, &vec![0.5; 2 * row], &vec![0.5; 2 * row])
        .unwrap_err()
        .to_string();
    assert!(e.contains("stale"), "{e}");
    // A fork (or a free) between a reserve and its appends makes the batch stale: it would
    // append into a page the fork now shares.
    let held = cache.reserve(&[(b, 1)]).unwrap();
    let fork = cache.fork(b).unwrap();
    let e = cache
        .append_host(&held, 0, &vec![0.5; row], &vec![0.5; row])
        .unwrap_err()
        .to_string();
    assert!(e.contains("stale"), "after a fork: {e}");
    let held = cache.reserve(&[(b, 1)]).unwrap();
    cache.free(fork).unwrap();
    let e = cache
        .append_host(&held, 0, &vec![0.5; row], &vec![0.5; row])
        .unwrap_err()
        .to_string();
    assert!(e.contains("stale"), "after a free: {e}");
    cache.free(b).unwrap();
    let e = cache.reserve(&[(b, 1)]).unwrap_err().to_string();
    assert!(e.contains("generation"), "freed session: {e}");
    assert_eq!(cache.faults().unwrap(), vec![0, 0], "nothing was launched");
    // Session a's step above failed after its reserve (no layer was appended): its rows 0..2
    // hold nothing, so from here on it is refused by name in every layer, never read.
    let batch = cache.reserve(&[(a, 1)]).unwrap();
    let e = cache
        .append_host(&batch, 0, &vec![0.5; row], &vec![0.5; row])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rows 0..2 of layer 0 that no append wrote"),
        "{e}"
    );
    let e = cache.export(a, 1).unwrap_err().to_string();
    assert!(e.contains("rows 0..3 of layer 1"), "{e}");
    cache.free(a).unwrap();
    let a = cache.create().unwrap();
    // An attend or a row read of a layer not yet appended in the batch's step would read the
    // new tokens' empty slots: refused by name, before any launch.
    let batch = cache.reserve(&[(a, 1)]).unwrap();
    cache
        .append_host(&batch, 0, &vec![0.5; row], &vec![0.5; row])
        .unwrap();
    let q = vec![0.1f32; 2 * 4 * 64];
    let am = fathom_cuda::cache::AttendMethod::Dense;
    let params = fathom_plan::SelectParams {
        sink: 4,
        local: 32,
        k: 8,
    };
    let e = cache
        .attend_host(&batch, 1, am, &params, &q)
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer 1 has not been appended"), "{e}");
    let mut outs = [0, 1].map(|_| DeviceBuffer::<f32>::zeros(&gpu, 8 * row).unwrap());
    let [ko, vo] = &mut outs;
    let e = cache
        .read_rows(&batch, 1, 8, ko.view_mut(), vo.view_mut())
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer 1 has not been appended"), "{e}");
    assert!(cache.attend_host(&batch, 0, am, &params, &q).is_ok());
    // A copy of the batch with other offsets is not the reserve's, even at its step.
    let mut forged = batch.clone();
    forged.row0 = vec![5];
    let e = cache
        .attend_host(&forged, 0, am, &params, &q)
        .unwrap_err()
        .to_string();
    assert!(e.contains("last reserve returned"), "{e}");
    // That step never appended layer 1: in the next step, layer 0 goes on, layer 1 is refused
    // (its row 0 holds nothing), and a fork inherits the hole.
    let batch = cache.reserve(&[(a, 1)]).unwrap();
    let e = cache
        .append_host(&batch, 1, &vec![0.5; row], &vec![0.5; row])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rows 0..1 of layer 1 that no append wrote"),
        "{e}"
    );
    cache
        .append_host(&batch, 0, &vec![0.5; row], &vec![0.5; row])
        .unwrap();
    assert!(cache.attend_host(&batch, 0, am, &params, &q).is_ok());
    let child = cache.fork(a).unwrap();
    assert_eq!(cache.export(child, 0).unwrap().tokens, 2);
    let e = cache.records(child, 1).unwrap_err().to_string();
    assert!(e.contains("rows 0..2 of layer 1"), "{e}");
    // Once layer 1 holds appends, a reserve refuses to grow a session with a hole there (the
    // batch's appends would be refused, leaving its other sessions unwritten too).
    cache.free(child).unwrap();
    let c = cache.create().unwrap();
    let batch = cache.reserve(&[(c, 1)]).unwrap();
    for l in 0..2 {
        cache
            .append_host(&batch, l, &vec![0.5; row], &vec![0.5; row])
            .unwrap();
    }
    let e = cache.reserve(&[(c, 1), (a, 1)]).unwrap_err().to_string();
    assert!(
        e.contains("rows 0..2 of layer 1 that no append wrote"),
        "{e}"
    );
    assert_eq!(cache.len(c).unwrap(), 1, "a refused reserve grows nothing");
    assert!(cache.reserve(&[(c, 1)]).is_ok());
}

/// A key whose block scale overflows fp16: from host slices it is refused before any copy
/// (`check_host_rows`); from device memory, which the host does not read, the kernel skips the
/// channel block and counts a fault (never a silent store).
#[test]
fn a_key_past_fp16_range_is_a_counted_fault_not_a_silent_store() {
    let Some(gpu) = gpu() else { return };
    let mut cache = PagedCache::new(&gpu, config(1, 1, 64, 128, 4)).unwrap();
    let a = cache.create().unwrap();
    let batch = cache.reserve(&[(a, 1)]).unwrap();
    let mut k = vec![0.25f32; 64];
    k[5] = 1e6; // finite, but its block scale overflows fp16
    let e = cache
        .append_host(&batch, 0, &k, &vec![0.0; 64])
        .unwrap_err()
        .to_string();
    assert!(e.contains("channel 5") && e.contains("fp16"), "{e}");
    assert_eq!(cache.faults().unwrap(), vec![0], "nothing was launched");
    let (kd, vd) = (
        DeviceBuffer::from_host(&gpu, &k).unwrap(),
        DeviceBuffer::from_host(&gpu, &vec![0.0f32; 64]).unwrap(),
    );
    let kv = KvRows {
        k: kd.view(),
        v: vd.view(),
        rows: 1,
    };
    cache.append(&batch, 0, &kv).unwrap();
    assert_eq!(
        cache.faults().unwrap(),
        vec![1],
        "one channel block refused"
    );
}

/// f32 accumulation of ≤ D = 256 products on the GPU against f64 on the CPU: |error| ≤
/// D·ε·Σ|terms| ≈ 1.5e-5 of the magnitude in the worst case; 2e-5 leaves headroom.
const SCORE_TOL: f64 = 2e-5;
/// bf16 rows, f32 online softmax on the GPU against the CPU's f64 (as the step's tests).
const ATTN_TOL: f64 = 1e-3;

/// The CPU plan of docs/SPEC.md §3–4 for one KV head, from the method's rule.
fn cpu_depths(
    m: fathom_cuda::Method,
    calib: &fathom_plan::scanner::HeadCalib,
    qh: &[f32],
    g: usize,
    d: usize,
) -> Vec<u8> {
    use fathom_cuda::Method as M;
    match m {
        M::Fathom(b) => {
            let w = fathom_plan::importance(&calib.sigma2, qh, g).unwrap();
            fathom_plan::water_fill(&w, b).unwrap().depths
        }
        M::SparQ(r) => common::sparq_depths(qh, g, d, r),
        M::DoubleSparsity(r) => {
            let mut dep = vec![0u8; d];
            calib
                .ds_channels
                .iter()
                .take(r)
                .for_each(|&c| dep[c as usize] = 4);
            dep
        }
        M::Thumb2 => vec![2; d],
        M::Exact => vec![4; d],
        other => panic!("{other:?} is not run by the paged cache"),
    }
}

/// A cache of `layers` layers at (D, G, Hkv, tokens per page, residency) with `pages` pages per
/// layer, and three new sessions in it.
fn three_sessions(
    gpu: &fathom_cuda::Gpu,
    layers: usize,
    (d, g, hkv, page, residency): (usize, usize, usize, usize, Residency),
    pages: usize,
) -> (PagedCache, Vec<SessionId>) {
    let mut cfg = config(layers, hkv, d, page, pages);
    cfg.shape.group = g;
    cfg.residency = residency;
    let mut cache = PagedCache::new(gpu, cfg).unwrap();
    let ids = (0..3).map(|_| cache.create().unwrap()).collect();
    (cache, ids)
}

#[test]
fn attend_matches_the_per_head_cpu_protocol_for_every_method() {
    use fathom_cuda::cache::AttendMethod;
    use fathom_plan::KvView;
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(5);
    let params = small_select();
    let methods = [
        "dense",
        "exact",
        "fathom:48",
        "fathom:92",
        "sparq:16",
        "ds:16",
        "thumb2",
    ];
    // (D, G, Hkv, tokens per page)
    for (d, g, hkv, page, residency) in [
        (64, 3, 3, 128, Residency::Host),
        (128, 4, 2, 256, Residency::Host),
        (256, 1, 1, 128, Residency::Hbm),
        (128, 8, 1, 64, Residency::Host),
        (128, 4, 2, 256, Residency::Hbm),
        (64, 3, 3, 128, Residency::IndexHbm),
        (128, 4, 2, 256, Residency::IndexHbm),
    ] {
        let hq = hkv * g;
        let (mut cache, ids) = three_sessions(&gpu, 2, (d, g, hkv, page, residency), 160);
        let mut shadows = vec![vec![Shadow::default(); 2]; 8];
        let slot = |s: SessionId| s.slot();
        // A ragged prefill: 300, 1000 and 2100 tokens (the last two in two chunks).
        step(
            &mut cache,
            &mut rng,
            &[(ids[0], 300), (ids[1], 700), (ids[2], 1100)],
            &mut shadows,
            &slot,
        );
        step(
            &mut cache,
            &mut rng,
            &[(ids[1], 300), (ids[2], 1000)],
            &mut shadows,
            &slot,
        );
        // Calibration from session 0's keys (bf16) and random queries, per layer and head.
        let dims = Dims {
            heads: hkv,
            channels: d,
        };
        let calibs: Vec<Vec<fathom_plan::scanner::HeadCalib>> = (0..2)
            .map(|l| {
                let kb: Vec<f32> = shadows[ids[0].slot()][l].k.iter().map(|&x| bf(x)).collect();
                let qs: Vec<f32> = (0..16 * g * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
                (0..hkv)
                    .map(|h| {
                        fathom_plan::calib::head_calib(&KvView::head(&kb, hkv, d, h), &qs).unwrap()
                    })
                    .collect()
            })
            .collect();
        for (l, c) in calibs.iter().enumerate() {
            cache.load_calibration(l, c).unwrap();
        }
        for m in &methods {
            if let AttendMethod::Scan(mm) = AttendMethod::parse(m, d).unwrap() {
                cache.prepare(mm).unwrap();
            }
        }
        for t in 0..3 {
            // A decode step of all three sessions, then attend at each one's new token.
            let all: Vec<(SessionId, usize)> = ids.iter().map(|&s| (s, 1)).collect();
            let batch = step(&mut cache, &mut rng, &all, &mut shadows, &slot);
            for l in 0..2 {
                let q: Vec<f32> = (0..3 * hq * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
                for m in &methods {
                    let am = AttendMethod::parse(m, d).unwrap();
                    let out = cache.attend_host(&batch, l, am, &params, &q).unwrap();
                    let dbg: Vec<_> = (0..3)
                        .map(|b| cache.debug_readback(&batch, b).unwrap())
                        .collect();
                    for (b, &s) in ids.iter().enumerate() {
                        let sh = &shadows[s.slot()][l];
                        let n = sh.k.len() / dims.row();
                        let kb: Vec<f32> = sh.k.iter().map(|&x| bf(x)).collect();
                        let vb: Vec<f32> = sh.v.iter().map(|&x| bf(x)).collect();
                        let store = KeyStore::from_keys(dims, &kb, None).unwrap();
                        let view = store.view();
                        for h in 0..hkv {
                            let qh = &q[(b * hq + h * g) * d..(b * hq + (h + 1) * g) * d];
                            let kv = KvView::head(&kb, hkv, d, h);
                            let vv = KvView::head(&vb, hkv, d, h);
                            let scale = 1.0 / (d as f32).sqrt();
                            let what =
                                format!("D={d} G={g} {residency:?} {m} step {t} layer {l} session {b} head {h}");
                            let sets: Vec<Vec<u32>> = match am {
                                AttendMethod::Dense => {
                                    (0..g).map(|_| (0..n as u32).collect()).collect()
                                }
                                AttendMethod::Scan(mm) => {
                                    let depths = cpu_depths(mm, &calibs[l][h], qh, g, d);
                                    if matches!(
                                        mm,
                                        fathom_cuda::Method::Fathom(_)
                                            | fathom_cuda::Method::SparQ(_)
                                    ) {
                                        assert_eq!(
                                            &dbg[b].depths[h * d..(h + 1) * d],
                                            &depths[..],
                                            "{what}: depths"
                                        );
                                    }
                                    let (refs, mag) = fathom_plan::scan::reference_scores(
                                        &view, h, qh, g, &depths,
                                    )
                                    .unwrap();
                                    (0..g)
                                        .map(|gg| {
                                            let row = &dbg[b].scores
                                                [(h * g + gg) * n..(h * g + gg + 1) * n];
                                            for i in 0..n {
                                                let (got, want) = (row[i] as f64, refs[gg * n + i]);
                                                assert!(
                                                    (got - want).abs()
                                                        <= SCORE_TOL * mag[gg * n + i] + 1e-30,
                                                    "{what} q {gg} token {i}: gpu {got} cpu {want}"
                                                );
                                            }
                                            // The CPU selection over the GPU's scores: equal,
                                            // ties included (both take the lower index).
                                            let mut sel = Vec::new();
                                            fathom_plan::select_per_head(
                                                n - 1,
                                                row,
                                                &params,
                                                &mut sel,
                                            )
                                            .unwrap();
                                            let mid = params.middle(n - 1);
                                            let cpu_mid: Vec<u32> = sel
                                                .iter()
                                                .copied()
                                                .filter(|&i| mid.contains(&(i as usize)))
                                                .collect();
                                            assert_eq!(
                                                dbg[b].winners[h * g + gg],
                                                cpu_mid,
                                                "{what} q {gg}: top-k"
                                            );
                                            sel
                                        })
                                        .collect()
                                }
                            };
                            for gg in 0..g {
                                let mut want = vec![0f32; d];
                                fathom_plan::attend(
                                    &qh[gg * d..(gg + 1) * d],
                                    kv,
                                    vv,
                                    &sets[gg],
                                    scale,
                                    None,
                                    &mut want,
                                )
                                .unwrap();
                                let o = (b * hq + h * g + gg) * d;
                                let err = fathom_plan::relative_error(&out[o..o + d], &want);
                                assert!(
                                    err <= ATTN_TOL,
                                    "{what} q {gg}: attention relative error {err}"
                                );
                            }
                        }
                    }
                }
            }
        }
        let (bits, plans) = cache.plan_bits().unwrap();
        assert!(
            plans > 0 && bits > 0.0,
            "plan counters: {bits} over {plans}"
        );
    }
}

/// Device rows of either 16-bit type.
enum Rows {
    Bf16(DeviceBuffer<bf16>),
    F16(DeviceBuffer<half::f16>),
}

impl Rows {
    fn view(&self) -> fathom_cuda::memory::DeviceView<'_> {
        match self {
            Rows::Bf16(b) => b.view(),
            Rows::F16(b) => b.view(),
        }
    }
}

/// Keys and values handed over in device memory as bf16 and f16 (what a model passes) give
/// the store of their bf16 rounding, as f32 host rows do.
#[test]
fn bf16_and_f16_rows_from_device_memory_are_stored_as_their_bf16_rounding() {
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(9);
    let (hkv, d) = (2, 128);
    let mut cache = PagedCache::new(&gpu, config(1, hkv, d, 128, 16)).unwrap();
    let dims = Dims {
        heads: hkv,
        channels: d,
    };
    for (dtype, n) in [(KvDtype::Bf16, 200), (KvDtype::F16, 77)] {
        let s = cache.create().unwrap();
        let keys: Vec<f32> = (0..n * hkv * d).map(|_| rng.gen_range(-3.0..3.0)).collect();
        let bits: Vec<u16> = keys
            .iter()
            .map(|&x| match dtype {
                KvDtype::Bf16 => bf16::from_f32(x).to_bits(),
                _ => half::f16::from_f32(x).to_bits(),
            })
            .collect();
        let as_f32: Vec<f32> = bits
            .iter()
            .map(|&b| match dtype {
                KvDtype::Bf16 => bf16::from_bits(b).to_f32(),
                _ => half::f16::from_bits(b).to_f32(),
            })
            .collect();
        let (kd, vd) = match dtype {
            KvDtype::Bf16 => {
                let x: Vec<bf16> = bits.iter().map(|&b| bf16::from_bits(b)).collect();
                let up = || DeviceBuffer::from_host(&gpu, &x).unwrap();
                (Rows::Bf16(up()), Rows::Bf16(up()))
            }
            _ => {
                let x: Vec<half::f16> = bits.iter().map(|&b| half::f16::from_bits(b)).collect();
                let up = || DeviceBuffer::from_host(&gpu, &x).unwrap();
                (Rows::F16(up()), Rows::F16(up()))
            }
        };
        // Two appends: a chunk, then the rest (a partial block re-quantized in place).
        let first = n / 2 + 1;
        for (lo, hi) in [(0, first), (first, n)] {
            let batch = cache.reserve(&[(s, hi - lo)]).unwrap();
            let rows = lo * hkv * d..hi * hkv * d;
            let kv = KvRows {
                k: kd.view().slice(rows.clone()).unwrap(),
                v: vd.view().slice(rows).unwrap(),
                rows: hi - lo,
            };
            cache.append(&batch, 0, &kv).unwrap();
        }
        let want: Vec<f32> = as_f32.iter().map(|&x| bf(x)).collect();
        let store = KeyStore::from_keys(dims, &want, None).unwrap();
        if let Err(e) = cache.export(s, 0).unwrap().compare(&store.view()) {
            panic!("{dtype:?}: {e}");
        }
        let rec = cache.records(s, 0).unwrap();
        for h in 0..hkv {
            for i in 0..n {
                for c in 0..d {
                    let r = rec[(h * n + i) * 2 * d + d + c].to_f32();
                    assert_eq!(r, want[(i * hkv + h) * d + c], "{dtype:?} V record");
                }
            }
        }
    }
    assert_eq!(cache.faults().unwrap(), vec![0]);
}

/// The HBM row cache only changes where a union row is read from: attends through a cache
/// with a small row cache (64 slots per (session, layer, KV head), so that slots collide and
/// are re-claimed every step) give outputs identical, bit for bit, to the same attends
/// without one, over decode steps of a ragged batch that keep most winners; the counters
/// see the same union rows, and hits only where there is a row cache. A fork made after
/// three steps, of a session whose row cache is warm, starts with an empty one and still
/// agrees. The counters equal the CPU reference `RowCacheModel`'s over the unions the attends
/// read back.
#[cfg(feature = "cuda")]
#[test]
fn a_row_cache_serves_the_same_rows_as_the_link() {
    use fathom_cuda::cache::{AttendMethod, RowCacheModel};
    let Some(gpu) = gpu() else { return };
    let params = small_select();
    let (hkv, d, g) = (2, 128, 4);
    let hq = hkv * g;
    let mut with = config(2, hkv, d, 256, 200);
    with.row_cache = 64;
    let without = config(2, hkv, d, 256, 200);
    let mut caches = [
        PagedCache::new(&gpu, with).unwrap(),
        PagedCache::new(&gpu, without).unwrap(),
    ];
    let mut rngs = [StdRng::seed_from_u64(9), StdRng::seed_from_u64(9)];
    let mut ids: Vec<Vec<SessionId>> = Vec::new();
    for (c, rng) in caches.iter_mut().zip(&mut rngs) {
        let s: Vec<SessionId> = (0..3).map(|_| c.create().unwrap()).collect();
        let mut shadows = vec![vec![Shadow::default(); 2]; 8];
        let slot = |s: SessionId| s.slot();
        step(
            c,
            rng,
            &[(s[0], 700), (s[1], 1500), (s[2], 3000)],
            &mut shadows,
            &slot,
        );
        ids.push(s);
    }
    let mut qrng = StdRng::seed_from_u64(10);
    let base: Vec<f32> = (0..4 * hq * d).map(|_| qrng.gen_range(-1.0..1.0)).collect();
    // The CPU reference of the row cache, per (session, layer, KV head), fed each attend's
    // union (sink, local and the G heads' winners) as the GPU read it back.
    let mut model: Vec<RowCacheModel> = (0..4 * 2 * hkv)
        .map(|_| RowCacheModel::new(64).unwrap())
        .collect();
    let mut want = fathom_cuda::cache::RowCounters::default();
    for t in 0..6 {
        if t == 3 {
            // A fork of a session whose row cache is warm starts with an empty one: the model
            // of its slot starts empty too, so a fork that kept its parent's tags would count
            // more hits than the model.
            for (c, s) in caches.iter_mut().zip(&mut ids) {
                let f = c.fork(s[2]).unwrap();
                s.push(f);
            }
        }
        // Queries drift a little each step, so most winners repeat (row-cache hits).
        let q: Vec<f32> = base[..ids[0].len() * hq * d]
            .iter()
            .map(|&x| x + 0.05 * qrng.gen_range(-1.0..1.0))
            .collect();
        for m in ["fathom:48", "sparq:16", "exact"] {
            let mut outs = Vec::new();
            for (ci, c) in caches.iter_mut().enumerate() {
                let am = AttendMethod::parse(m, d).unwrap();
                if let AttendMethod::Scan(mm) = am {
                    if matches!(mm, fathom_cuda::Method::Fathom(_)) {
                        let calib = vec![
                            fathom_plan::scanner::HeadCalib {
                                sigma2: vec![1.0; d],
                                ..Default::default()
                            };
                            hkv
                        ];
                        c.load_calibration(0, &calib).unwrap();
                        c.load_calibration(1, &calib).unwrap();
                    }
                    c.prepare(mm).unwrap();
                }
                let all: Vec<(SessionId, usize)> = ids[ci].iter().map(|&s| (s, 1)).collect();
                let mut shadows = vec![vec![Shadow::default(); 2]; 8];
                let slot = |s: SessionId| s.slot();
                let batch = step(c, &mut rngs[ci], &all, &mut shadows, &slot);
                let mut o = Vec::new();
                for l in 0..2 {
                    o.extend(c.attend_host(&batch, l, am, &params, &q).unwrap());
                    if ci > 0 {
                        continue;
                    }
                    for (b, &s) in ids[0].iter().enumerate() {
                        let n = c.len(s).unwrap() as u32;
                        let win = c.debug_readback(&batch, b).unwrap().winners;
                        let sink = (params.sink as u32).min(n);
                        let local = n.saturating_sub(params.local as u32).max(sink);
                        for h in 0..hkv {
                            let mut u: Vec<u32> = (0..sink).chain(local..n).collect();
                            u.extend(win[h * g..(h + 1) * g].iter().flatten());
                            u.sort_unstable();
                            u.dedup();
                            want.rows += u.len() as u64;
                            want.hits += model[(b * 2 + l) * hkv + h].attend(&u);
                        }
                    }
                }
                outs.push(o);
            }
            assert_eq!(
                outs[0], outs[1],
                "step {t} {m}: outputs with and without a row cache"
            );
        }
    }
    let (a, b) = (
        caches[0].row_counters().unwrap(),
        caches[1].row_counters().unwrap(),
    );
    assert_eq!(a.rows, b.rows, "union rows");
    assert!(a.rows > 0 && a.hits > 0, "row cache: {a:?}");
    assert_eq!(b.hits, 0, "no row cache, no hits: {b:?}");
    assert_eq!(
        a, want,
        "the cache's counters against RowCacheModel over the same unions"
    );
}

/// Caches that must agree (one setting each) fed the same appends: three sessions of
/// `lens` tokens each, from one seed, and the same σ² on every layer. Returns each cache's
/// random stream (to keep feeding them alike) and its sessions.
fn prefill_alike(
    caches: &mut [PagedCache],
    seed: u64,
    lens: [usize; 3],
    sigma2: &[f32],
) -> (Vec<StdRng>, Vec<Vec<SessionId>>) {
    let mut rngs: Vec<StdRng> = caches.iter().map(|_| StdRng::seed_from_u64(seed)).collect();
    let mut ids = Vec::new();
    for (c, rng) in caches.iter_mut().zip(&mut rngs) {
        let sh = c.config().shape;
        let s: Vec<SessionId> = (0..3).map(|_| c.create().unwrap()).collect();
        let mut shadows = vec![vec![Shadow::default(); sh.layers]; 8];
        let slot = |s: SessionId| s.slot();
        let batch: Vec<(SessionId, usize)> = s.iter().copied().zip(lens).collect();
        step(c, rng, &batch, &mut shadows, &slot);
        let calib = vec![
            fathom_plan::scanner::HeadCalib {
                sigma2: sigma2.to_vec(),
                ..Default::default()
            };
            sh.kv_heads
        ];
        for l in 0..sh.layers {
            c.load_calibration(l, &calib).unwrap();
        }
        ids.push(s);
    }
    (rngs, ids)
}

/// One decode step of every session in each cache (the same new keys in each), then an
/// attend of every layer with `q`: per cache, the outputs, the winners of every (layer,
/// session) and the row counters after it.
#[allow(clippy::type_complexity)]
fn attend_alike(
    caches: &mut [PagedCache],
    rngs: &mut [StdRng],
    ids: &[Vec<SessionId>],
    m: &str,
    params: &fathom_plan::SelectParams,
    q: &[f32],
) -> Vec<(
    Vec<f32>,
    Vec<Vec<Vec<u32>>>,
    fathom_cuda::cache::RowCounters,
)> {
    use fathom_cuda::cache::AttendMethod;
    let mut seen = Vec::new();
    for (ci, c) in caches.iter_mut().enumerate() {
        let sh = c.config().shape;
        let am = AttendMethod::parse(m, sh.dim).unwrap();
        if let AttendMethod::Scan(mm) = am {
            c.prepare(mm).unwrap();
        }
        let all: Vec<(SessionId, usize)> = ids[ci].iter().map(|&s| (s, 1)).collect();
        let mut shadows = vec![vec![Shadow::default(); sh.layers]; 8];
        let slot = |s: SessionId| s.slot();
        let batch = step(c, &mut rngs[ci], &all, &mut shadows, &slot);
        let mut o = Vec::new();
        let mut w = Vec::new();
        for l in 0..sh.layers {
            o.extend(c.attend_host(&batch, l, am, params, q).unwrap());
            for b in 0..all.len() {
                w.push(c.debug_readback(&batch, b).unwrap().winners);
            }
        }
        seen.push((o, w, c.row_counters().unwrap()));
    }
    seen
}

/// The filtered select (docs/SPEC.md §5) picks exactly the score path's winners: three caches
/// fed the same appends, one on the score path and two with the filtered select from 256
/// middle tokens (failed rows rescan; failed rows use the kept scores), attend a ragged batch
/// (3000, 5000 and 9000 tokens) for 8 decode steps × 3 methods with drifting queries; every
/// query head's winners and every output are equal, and the filtered cache really took the
/// filtered path (after each row's first attend). Then a zero query (every score ties at 0):
/// the 3000-token session selects the lowest tokens from its pairs, the 5000-token one too,
/// and the 9000-token one passes more tokens than the pair capacity (24 · max_k = 6144) and
/// falls back, with the same winners as the score path.
#[test]
fn the_filtered_select_picks_the_score_paths_winners() {
    use fathom_cuda::cache::SelectPath;
    let Some(gpu) = gpu() else { return };
    let params = small_select();
    let (hkv, d, g, layers) = (2, 128, 4, 2);
    let hq = hkv * g;
    // The score path, the filtered select whose failed rows rescan, and the one that keeps
    // the scores for them.
    let paths = [
        SelectPath::Scores,
        SelectPath::Filtered {
            min_middle_tokens: 256,
            keep_scores: false,
        },
        SelectPath::Filtered {
            min_middle_tokens: 256,
            keep_scores: true,
        },
    ];
    let mut caches = paths.map(|p| {
        let cfg = with(config(layers, hkv, d, 256, 200), |o| o.select = p);
        PagedCache::new(&gpu, cfg).unwrap()
    });
    let (mut rngs, ids) = prefill_alike(&mut caches, 21, [3000, 5000, 9000], &vec![1.0; d]);
    let mut qrng = StdRng::seed_from_u64(22);
    let base: Vec<f32> = (0..3 * hq * d).map(|_| qrng.gen_range(-1.0..1.0)).collect();
    let mut attend_all = |caches: &mut [PagedCache; 3], q: &[f32], m: &str, what: &str| {
        let seen = attend_alike(caches, &mut rngs, &ids, m, &params, q);
        for i in 1..3 {
            let p = paths[i].label();
            assert_eq!(
                seen[0].1, seen[i].1,
                "{what} {m}: winners, score path vs {p}"
            );
            assert_eq!(
                seen[0].0, seen[i].0,
                "{what} {m}: outputs, score path vs {p}"
            );
        }
    };
    for t in 0..8 {
        let q: Vec<f32> = base
            .iter()
            .map(|&x| x + 0.1 * qrng.gen_range(-1.0..1.0))
            .collect();
        for m in ["fathom:48", "sparq:16", "exact"] {
            attend_all(&mut caches, &q, m, &format!("step {t}"));
        }
    }
    let counters =
        |caches: &[PagedCache; 3]| caches.each_ref().map(|c| c.select_counters().unwrap());
    let before = counters(&caches);
    assert_eq!(
        before[0],
        fathom_cuda::cache::SelectCounters::default(),
        "filtered select off"
    );
    // 8 steps × 3 methods × 2 layers × 3 sessions × 8 heads rows; each (session, layer, head)
    // starts on the score path, and a method's scores differ in scale from the previous one's.
    for c in &before[1..] {
        assert!(c.filtered > 0, "the filtered path ran: {c:?}");
    }
    attend_all(&mut caches, &vec![0.0; 3 * hq * d], "exact", "zero query");
    let after = counters(&caches);
    for i in 1..3 {
        assert!(
            after[i].fallbacks > before[i].fallbacks,
            "every score ties at 0: the 9000-token session's filters overflow ({:?} -> {:?})",
            before[i],
            after[i]
        );
    }
}

/// Head groups ([`CacheOptions::attend_groups`]: the scan of group i + 1 on the cache's stream
/// while the second stream runs group i's top-k, union, fetch and attention) and 16-byte scan
/// loads ([`CacheOptions::scan_vector_words`] 2) change no bit: the same winners, outputs and
/// row-cache hits as one group of 8-byte loads, for 1, 2 and 3 groups of 3 KV heads (the last
/// group smaller at 2) and for 16-byte loads alone and with 3 groups, with the row cache on,
/// on the score path and the filtered select, in host, split and HBM residency; 0 and 4
/// groups and 3-word loads are typed errors before anything is allocated.
#[test]
fn head_groups_and_scan_loads_change_no_bit() {
    use fathom_cuda::cache::SelectPath;
    let Some(gpu) = gpu() else { return };
    let params = small_select();
    let (hkv, d, g, layers) = (3, 128, 4, 2);
    let hq = hkv * g;
    let settings = [(1, 1), (2, 1), (3, 1), (1, 2), (3, 2)];
    let base = config(layers, hkv, d, 256, 200);
    for bad in [0, 4] {
        let cfg = with(base, |o| o.attend_groups = bad);
        assert!(cfg.validate().is_err(), "{bad} groups");
        assert!(PagedCache::new(&gpu, cfg).is_err(), "{bad} groups");
    }
    let cfg = with(base, |o| o.scan_vector_words = 3);
    assert!(PagedCache::new(&gpu, cfg).is_err(), "3-word loads");
    let filtered = SelectPath::Filtered {
        min_middle_tokens: 256,
        keep_scores: false,
    };
    for residency in [Residency::Host, Residency::Hbm, Residency::IndexHbm] {
        for path in [SelectPath::Scores, filtered] {
            let mut caches = settings.map(|(n, words)| {
                let mut c = config(layers, hkv, d, 256, 200);
                c.residency = residency;
                c.row_cache = 64;
                let c = with(c, |o| {
                    (o.attend_groups, o.scan_vector_words, o.select) = (n, words, path)
                });
                PagedCache::new(&gpu, c).unwrap()
            });
            for (c, (n, words)) in caches.iter().zip(settings) {
                let o = c.config().options;
                assert_eq!((o.attend_groups, o.scan_vector_words), (n, words));
            }
            let sigma2: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / d as f32).collect();
            let (mut rngs, ids) = prefill_alike(&mut caches, 41, [1500, 4000, 7000], &sigma2);
            let mut qrng = StdRng::seed_from_u64(42);
            for t in 0..2 {
                let q: Vec<f32> = (0..3 * hq * d).map(|_| qrng.gen_range(-1.0..1.0)).collect();
                for m in ["fathom:48", "sparq:16", "exact", "dense"] {
                    let seen = attend_alike(&mut caches, &mut rngs, &ids, m, &params, &q);
                    for i in 1..settings.len() {
                        let what = format!(
                            "{residency:?} step {t} {} {m}: (groups, load words) {:?} against (1, 1)",
                            path.label(),
                            settings[i]
                        );
                        assert_eq!(seen[0].1, seen[i].1, "{what}: winners");
                        assert_eq!(seen[0].0, seen[i].0, "{what}: outputs");
                        assert_eq!(seen[0].2, seen[i].2, "{what}: row-cache counters");
                    }
                }
            }
        }
    }
}

/// Stage timing ([`CacheOptions::stage_timing`]) splits each attend's GPU time without
/// changing a bit: two caches fed the same appends, one timed, give the same outputs, winners
/// and row-cache counters for three methods on the score path, the filtered select and (host
/// residency) the host gather; the timed cache reports one split attend per layer and
/// method, every stage non-negative, every stage of a scan method positive (a stage whose mark
/// went missing would read 0) and a dense attend's time in its plan and attention; a timed
/// cache of two head groups counts its attends untimed, and the untimed cache reports nothing.
#[test]
fn stage_timing_splits_attends_and_changes_no_bit() {
    use fathom_cuda::cache::SelectPath;
    let Some(gpu) = gpu() else { return };
    let params = small_select();
    let (hkv, d, g, layers) = (2, 128, 4, 2);
    let hq = hkv * g;
    let filtered = SelectPath::Filtered {
        min_middle_tokens: 256,
        keep_scores: false,
    };
    let sigma2: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / d as f32).collect();
    for residency in [Residency::Host, Residency::Hbm] {
        // (select path, host gather threads): the gather only where the records are on the host.
        let mut variants = vec![(SelectPath::Scores, 0), (filtered, 0)];
        if residency == Residency::Host {
            variants.push((SelectPath::Scores, 2));
        }
        let cache = |timed: bool, path: SelectPath, gather: usize, groups: usize| {
            let mut c = config(layers, hkv, d, 256, 120);
            c.residency = residency;
            c.row_cache = 64;
            let c = with(c, |o| {
                o.stage_timing = timed;
                o.select = path;
                o.host_gather_threads = gather;
                o.attend_groups = groups;
            });
            PagedCache::new(&gpu, c).unwrap()
        };
        let mut qrng = StdRng::seed_from_u64(44);
        for (path, gather) in variants {
            let mut caches = vec![cache(false, path, gather, 1), cache(true, path, gather, 1)];
            assert!(caches[1].config().options.stage_timing);
            let (mut rngs, ids) = prefill_alike(&mut caches, 43, [1500, 4000, 7000], &sigma2);
            // The prefill's appends are no attends: nothing to split yet.
            assert_eq!(caches[1].stage_times().unwrap().attends, 0);
            let q: Vec<f32> = (0..3 * hq * d).map(|_| qrng.gen_range(-1.0..1.0)).collect();
            for m in ["fathom:48", "sparq:16", "dense"] {
                let seen = attend_alike(&mut caches, &mut rngs, &ids, m, &params, &q);
                let what = format!("{residency:?} {} gather {gather} {m}", path.label());
                assert_eq!(seen[0].0, seen[1].0, "{what}: outputs");
                assert_eq!(seen[0].1, seen[1].1, "{what}: winners");
                assert_eq!(seen[0].2, seen[1].2, "{what}: row-cache counters");
                let st = caches[1].stage_times().unwrap();
                assert_eq!(
                    (st.attends, st.untimed),
                    (layers as u64, 0),
                    "{what}: {st:?}"
                );
                assert!(st.values().iter().all(|&v| v >= 0.0), "{what}: {st:?}");
                if m == "dense" {
                    assert!(st.plan_ms > 0.0 && st.attention_ms > 0.0, "{what}: {st:?}");
                    let skipped = (st.scan_ms, st.topk_ms, st.union_ms, st.fetch_ms);
                    assert_eq!(skipped, (0.0, 0.0, 0.0, 0.0), "{what}: {st:?}");
                } else {
                    assert!(st.values().iter().all(|&v| v > 0.0), "{what}: {st:?}");
                }
                assert_eq!(
                    caches[0].stage_times().unwrap(),
                    Default::default(),
                    "{what}"
                );
            }
        }
        let mut caches = vec![
            cache(false, SelectPath::Scores, 0, 1),
            cache(true, SelectPath::Scores, 0, 2),
        ];
        let (mut rngs, ids) = prefill_alike(&mut caches, 43, [1500, 4000, 7000], &sigma2);
        let q: Vec<f32> = (0..3 * hq * d).map(|_| qrng.gen_range(-1.0..1.0)).collect();
        let seen = attend_alike(&mut caches, &mut rngs, &ids, "sparq:16", &params, &q);
        assert_eq!(seen[0], seen[1], "{residency:?}: two groups, timed");
        let st = caches[1].stage_times().unwrap();
        assert_eq!(
            (st.attends, st.untimed),
            (0, layers as u64),
            "{residency:?}: {st:?}"
        );
    }
}

/// Every kind of host pages (docs/SPEC.md §6.1, "Host pages": the driver's, 2 MiB huge pages
/// registered with the driver, the virtual memory API's host-NUMA memory) holds the same bytes
/// and serves the same step: three caches that differ only in `host_pages`, fed the same
/// appends (a ragged prefill, then decode steps), have the same store and records as the cache
/// on the driver's pages and give the same winners, outputs and row-cache counters for four
/// methods, in host and split residency. A kind this machine cannot give (huge pages off Linux, no host
/// NUMA allocations) is a typed allocation error, printed and skipped; the driver's never is.
#[test]
fn every_kind_of_host_pages_serves_the_same_bits() {
    use fathom_cuda::HostPages;
    let Some(gpu) = gpu() else { return };
    let params = small_select();
    let (hkv, d, g, layers) = (2, 128, 4, 2);
    let hq = hkv * g;
    for residency in [Residency::Host, Residency::IndexHbm] {
        let mut caches = Vec::new();
        let mut kinds = Vec::new();
        for pages in HostPages::ALL {
            let mut c = config(layers, hkv, d, 256, 120);
            c.residency = residency;
            c.row_cache = 64;
            c.host_pages = pages;
            match PagedCache::new(&gpu, c) {
                Ok(cache) => {
                    caches.push(cache);
                    kinds.push(pages);
                }
                Err(e @ fathom_cuda::CudaError::PinnedAlloc { .. })
                    if pages != HostPages::Driver =>
                {
                    println!(
                        "{residency:?}: {} pages unavailable here: {e}",
                        pages.label()
                    );
                }
                Err(e) => panic!("{residency:?} {}: {e}", pages.label()),
            }
        }
        let sigma2: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / d as f32).collect();
        let (mut rngs, ids) = prefill_alike(&mut caches, 51, [700, 2500, 4100], &sigma2);
        let mut qrng = StdRng::seed_from_u64(52);
        for t in 0..3 {
            let q: Vec<f32> = (0..3 * hq * d).map(|_| qrng.gen_range(-1.0..1.0)).collect();
            for m in ["fathom:48", "sparq:16", "exact", "dense"] {
                let seen = attend_alike(&mut caches, &mut rngs, &ids, m, &params, &q);
                for i in 1..kinds.len() {
                    let what = format!(
                        "{residency:?} step {t} {m}: {} pages against driver pages",
                        kinds[i].label()
                    );
                    assert_eq!(seen[0].1, seen[i].1, "{what}: winners");
                    assert_eq!(seen[0].0, seen[i].0, "{what}: outputs");
                    assert_eq!(seen[0].2, seen[i].2, "{what}: row-cache counters");
                }
            }
        }
        for (i, c) in caches.iter().enumerate().skip(1) {
            for (s0, si) in ids[0].iter().zip(&ids[i]) {
                for l in 0..layers {
                    let what = format!("{residency:?} {} pages, layer {l}", kinds[i].label());
                    assert_eq!(
                        caches[0].records(*s0, l).unwrap(),
                        c.records(*si, l).unwrap(),
                        "{what}: records"
                    );
                    let (a, b) = (caches[0].export(*s0, l).unwrap(), c.export(*si, l).unwrap());
                    assert!(a == b, "{what}: store");
                }
            }
        }
    }
}

/// The host gather (docs/SPEC.md §6.1, [`CacheOptions::host_gather_threads`]: CPU threads copy the fetch's
/// misses into pinned staging, the GPU reads it in order) changes no bit: caches fed the same
/// appends, without the gather and with 1, 2 and 3 threads bringing all the misses or a share
/// of them (50 %, 30 %: the fetch reads the rest at once), with a 64-slot row cache (hits and
/// misses in every attend) and without one (every union row a miss), give the same winners,
/// outputs and row counters for four methods over four decode steps of a ragged batch, in
/// host and split residency; the threads served every miss of their share (records = union
/// rows − hits at 100 %, within 0.1 of the share otherwise) with no overflow, timeout or
/// refused offset. HBM residency, head groups with the gather on, 1000 threads and a share of 0
/// or 101 are typed errors before anything is allocated; a new session inside a capture is
/// refused by name.
#[test]
fn the_host_gather_changes_no_bit() {
    let Some(gpu) = gpu() else { return };
    let params = small_select();
    let (hkv, d, g, layers) = (3, 128, 4, 2);
    let hq = hkv * g;
    // (row-cache slots, gather threads, its share in percent); the first is the reference.
    let settings = [
        (64, 0, 100),
        (64, 1, 100),
        (64, 3, 50),
        (0, 0, 100),
        (0, 3, 100),
        (0, 2, 30),
    ];
    for residency in [Residency::Host, Residency::IndexHbm] {
        let cfg = |rows: usize, threads: usize, share: u32, groups: usize| {
            let mut c = config(layers, hkv, d, 256, 200);
            c.residency = residency;
            c.row_cache = rows;
            with(c, |o| {
                o.host_gather_threads = threads;
                o.host_gather_share = share;
                o.attend_groups = groups;
            })
        };
        for bad in [0, 101] {
            assert!(cfg(64, 1, bad, 1).validate().is_err(), "share {bad}");
        }
        assert!(
            cfg(64, 1, 100, 2).validate().is_err(),
            "groups with the gather on"
        );
        assert!(cfg(64, 1_000, 100, 1).validate().is_err(), "1000 threads");
        assert!(
            PagedCache::new(&gpu, cfg(64, 2, 100, 3)).is_err(),
            "the gather with 3 groups"
        );
        let mut caches = settings.map(|(rows, threads, share)| {
            PagedCache::new(&gpu, cfg(rows, threads, share, 1)).unwrap()
        });
        for (c, (_, threads, share)) in caches.iter().zip(settings) {
            let o = c.config().options;
            assert_eq!(
                (o.host_gather_threads, o.host_gather_share),
                (threads, share)
            );
        }
        let sigma2: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / d as f32).collect();
        let (mut rngs, ids) = prefill_alike(&mut caches, 61, [900, 3000, 6100], &sigma2);
        let mut qrng = StdRng::seed_from_u64(62);
        for t in 0..4 {
            let q: Vec<f32> = (0..3 * hq * d).map(|_| qrng.gen_range(-1.0..1.0)).collect();
            for m in ["fathom:48", "sparq:16", "exact", "dense"] {
                let seen = attend_alike(&mut caches, &mut rngs, &ids, m, &params, &q);
                for i in 1..settings.len() {
                    let what = format!(
                        "{residency:?} step {t} {m}: (row cache, threads, share) {:?}",
                        settings[i]
                    );
                    let r = if settings[i].0 == settings[0].0 { 0 } else { 3 };
                    assert_eq!(seen[r].1, seen[i].1, "{what}: winners");
                    assert_eq!(seen[r].0, seen[i].0, "{what}: outputs");
                    assert_eq!(seen[r].2, seen[i].2, "{what}: row counters");
                }
            }
        }
        for (c, (_, threads, share)) in caches.iter().zip(settings) {
            let report = c.host_gather_stats().unwrap();
            if threads == 0 {
                assert!(report.is_none());
                continue;
            }
            let r = report.unwrap();
            let rc = c.row_counters().unwrap();
            assert_eq!(
                (r.overflows, r.timeouts, r.served.bad_offsets),
                (0, 0, 0),
                "{residency:?} {threads} threads: {r:?}"
            );
            let misses = rc.rows - rc.hits;
            if share == 100 {
                assert_eq!(
                    r.served.records, misses,
                    "{residency:?}: every miss served once"
                );
            } else {
                // The hash splits the misses near the share (thousands of them here).
                let got = r.served.records as f64 / misses as f64;
                assert!(
                    (got - f64::from(share) / 100.0).abs() < 0.1,
                    "{residency:?} share {share}%: the host brought {got:.3} of the misses"
                );
            }
            assert!(r.served.records > 0 && r.threads == threads);
        }
        // A new session inside a capture: named, nothing recorded.
        let decode: Vec<(SessionId, usize)> = ids[1].iter().map(|&s| (s, 1)).collect();
        let batch = caches[1].reserve(&decode).unwrap();
        let e = caches[1]
            .capture(&batch, |c| c.create().map(|_| ()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("create") && e.contains("during a capture"),
            "{e}"
        );
    }
    let mut c = config(layers, hkv, d, 256, 16);
    c.residency = Residency::Hbm;
    let e = PagedCache::new(&gpu, with(c, |o| o.host_gather_threads = 2)).unwrap_err();
    assert!(e.to_string().contains("HBM"), "{e}");
}

/// A session of 2^20 + 37 tokens, the length the benchmark's 1M rows time: every score of
/// the scan, the top-k and the attention equal the CPU reference, on the score path and on the
/// filtered select (scores kept), for exact, Fathom and SparQ. The tests above stay below
/// 10⁴ tokens; this one reaches what only long sessions do: 513 scan CTAs per KV head, page
/// indices past 2⁹, a middle of 2²⁰ tokens for the top-k's histogram, and a 16-bit CTA bin
/// count at its largest. Host residency, one layer, one KV head (G = 4, D = 128).
#[test]
fn a_million_token_session_matches_the_cpu_reference() {
    use fathom_cuda::cache::{AttendMethod, SelectPath};
    use fathom_plan::{KvView, SelectParams};
    let Some(gpu) = gpu() else { return };
    let (d, g, hkv, page) = (128, 4, 1, 2048);
    let hq = hkv * g;
    let n0 = (1usize << 20) + 36;
    let paths = [
        SelectPath::Scores,
        SelectPath::Filtered {
            min_middle_tokens: 8192,
            keep_scores: true,
        },
    ];
    for path in paths {
        // Each path on its own cache, fed the same keys (the same seed).
        let mut cfg = config(1, hkv, d, page, n0.div_ceil(page) + 2);
        cfg.options.select = path;
        cfg.shape.group = g;
        cfg.pages.max_sessions = 1;
        cfg.pages.max_tokens = n0 + 64;
        cfg.max_batch = 1;
        cfg.max_k = 512;
        let mut cache = PagedCache::new(&gpu, cfg).unwrap();
        let s = cache.create().unwrap();
        let mut shadows = vec![vec![Shadow::default(); 1]; 1];
        let slot = |_: SessionId| 0;
        let mut rng = StdRng::seed_from_u64(31);
        let mut left = n0;
        while left > 0 {
            let m = left.min(1 << 17);
            step(&mut cache, &mut rng, &[(s, m)], &mut shadows, &slot);
            left -= m;
        }
        let dims = Dims {
            heads: hkv,
            channels: d,
        };
        // Calibration from the first 8192 keys and random queries.
        let head: Vec<f32> = shadows[0][0].k[..8192 * d].iter().map(|&x| bf(x)).collect();
        let qs: Vec<f32> = (0..16 * g * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let calib =
            vec![fathom_plan::calib::head_calib(&KvView::head(&head, hkv, d, 0), &qs).unwrap()];
        cache.load_calibration(0, &calib).unwrap();
        let params = SelectParams {
            sink: 4,
            local: 32,
            k: 512,
        };
        let base: Vec<f32> = (0..hq * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let batch = step(&mut cache, &mut rng, &[(s, 1)], &mut shadows, &slot);
        let sh = &shadows[0][0];
        let n = sh.k.len() / dims.row();
        assert_eq!(n, n0 + 1);
        let kb: Vec<f32> = sh.k.iter().map(|&x| bf(x)).collect();
        let vb: Vec<f32> = sh.v.iter().map(|&x| bf(x)).collect();
        let store = KeyStore::from_keys(dims, &kb, None).unwrap();
        let view = store.view();
        let (kv, vv) = (KvView::head(&kb, hkv, d, 0), KvView::head(&vb, hkv, d, 0));
        for m in ["exact", "fathom:48", "sparq:16"] {
            let am = AttendMethod::parse(m, d).unwrap();
            let AttendMethod::Scan(mm) = am else {
                unreachable!()
            };
            cache.prepare(mm).unwrap();
            // Twice: the second attend of a filtered path runs on the first one's estimate.
            for rep in 0..2 {
                let q: Vec<f32> = base
                    .iter()
                    .map(|&x| x + 0.05 * rng.gen_range(-1.0..1.0))
                    .collect();
                let out = cache.attend_host(&batch, 0, am, &params, &q).unwrap();
                let dbg = cache.debug_readback(&batch, 0).unwrap();
                let what = format!("{} {m} attend {rep}, {n} tokens", path.label());
                let depths = cpu_depths(mm, &calib[0], &q, g, d);
                let (refs, mag) =
                    fathom_plan::scan::reference_scores(&view, 0, &q, g, &depths).unwrap();
                for gg in 0..g {
                    let row = &dbg.scores[gg * n..(gg + 1) * n];
                    let bad = (0..n)
                        .filter(|&i| {
                            (row[i] as f64 - refs[gg * n + i]).abs()
                                > SCORE_TOL * mag[gg * n + i] + 1e-30
                        })
                        .count();
                    assert_eq!(bad, 0, "{what} q {gg}: scores off the reference");
                    let mut sel = Vec::new();
                    fathom_plan::select_per_head(n - 1, row, &params, &mut sel).unwrap();
                    let mid = params.middle(n - 1);
                    let cpu_mid: Vec<u32> = sel
                        .iter()
                        .copied()
                        .filter(|&i| mid.contains(&(i as usize)))
                        .collect();
                    assert_eq!(dbg.winners[gg], cpu_mid, "{what} q {gg}: top-k");
                    let mut want = vec![0f32; d];
                    let scale = 1.0 / (d as f32).sqrt();
                    fathom_plan::attend(
                        &q[gg * d..(gg + 1) * d],
                        kv,
                        vv,
                        &sel,
                        scale,
                        None,
                        &mut want,
                    )
                    .unwrap();
                    let err = fathom_plan::relative_error(&out[gg * d..(gg + 1) * d], &want);
                    assert!(
                        err <= ATTN_TOL,
                        "{what} q {gg}: attention relative error {err}"
                    );
                }
            }
        }
        if let SelectPath::Filtered { .. } = path {
            let c = cache.select_counters().unwrap();
            assert!(
                c.filtered > 0,
                "the filtered path ran at 2^20 tokens: {c:?}"
            );
        }
    }
}

/// `read_rows` returns each session's last `min(len, cap)` records as the stored bf16, in
/// batch order, for a ragged batch, with caps below, at and above the lengths, in host and
/// HBM residency; rows past a session's count are left as they were.
#[test]
// `l` and `b` name the layer and batch row as well as index the shadows.
#[allow(clippy::needless_range_loop)]
fn read_rows_returns_each_sessions_last_records() {
    let Some(gpu) = gpu() else { return };
    for residency in [Residency::Host, Residency::Hbm, Residency::IndexHbm] {
        let mut rng = StdRng::seed_from_u64(21);
        let mut cfg = config(2, 2, 64, 128, 64);
        cfg.residency = residency;
        let (hkv, d) = (2, 64);
        let row = hkv * d;
        let mut cache = PagedCache::new(&gpu, cfg).unwrap();
        let s: Vec<SessionId> = (0..3).map(|_| cache.create().unwrap()).collect();
        let slot = |x: SessionId| s.iter().position(|&y| y == x).unwrap();
        let mut shadows = vec![vec![Shadow::default(); 2]; 3];
        step(
            &mut cache,
            &mut rng,
            &[(s[0], 300), (s[1], 7), (s[2], 129)],
            &mut shadows,
            &slot,
        );
        let ab = step(
            &mut cache,
            &mut rng,
            &[(s[0], 1), (s[1], 1), (s[2], 1)],
            &mut shadows,
            &slot,
        );
        for cap in [5usize, 8, 130, 400] {
            for l in 0..2 {
                let sentinel = -7.0f32;
                let fill = vec![sentinel; 3 * cap * row];
                let mut kd = DeviceBuffer::from_host(&gpu, &fill).unwrap();
                let mut vd = DeviceBuffer::from_host(&gpu, &fill).unwrap();
                cache
                    .read_rows(&ab, l, cap, kd.view_mut(), vd.view_mut())
                    .unwrap();
                let (k, v) = (kd.to_host().unwrap(), vd.to_host().unwrap());
                for b in 0..3 {
                    let sh = &shadows[b][l];
                    let n = sh.k.len() / row;
                    let r = n.min(cap);
                    for i in 0..cap {
                        for e in 0..row {
                            let o = (b * cap + i) * row + e;
                            let (wk, wv) = if i < r {
                                let src = (n - r + i) * row + e;
                                (bf(sh.k[src]), bf(sh.v[src]))
                            } else {
                                (sentinel, sentinel)
                            };
                            assert_eq!(
                                k[o], wk,
                                "{residency:?} cap {cap} layer {l} session {b} row {i} K"
                            );
                            assert_eq!(
                                v[o], wv,
                                "{residency:?} cap {cap} layer {l} session {b} row {i} V"
                            );
                        }
                    }
                }
            }
        }
        // Checked before any launch.
        let mut k = DeviceBuffer::<f32>::zeros(&gpu, 3 * 8 * row).unwrap();
        let mut v = DeviceBuffer::<f32>::zeros(&gpu, 3 * 8 * row).unwrap();
        let mut short = DeviceBuffer::<f32>::zeros(&gpu, 3 * 8 * row - 1).unwrap();
        let mut half16 = DeviceBuffer::<half::f16>::zeros(&gpu, 3 * 8 * row).unwrap();
        assert!(cache
            .read_rows(&ab, 2, 8, k.view_mut(), v.view_mut())
            .is_err());
        assert!(cache
            .read_rows(&ab, 0, 0, k.view_mut(), v.view_mut())
            .is_err());
        let e = cache
            .read_rows(&ab, 0, 8, short.view_mut(), v.view_mut())
            .unwrap_err();
        assert!(e.to_string().contains("want at least"), "{e}");
        let e = cache
            .read_rows(&ab, 0, 8, k.view_mut(), half16.view_mut())
            .unwrap_err();
        assert!(e.to_string().contains("F16"), "{e}");
    }
}

/// Double Sparsity on a model whose calibration covers only some layers (Gemma 3's global
/// ones): `prepare` builds the table from the calibrated layers, an attend of a calibrated
/// layer runs, one of an uncalibrated layer is a typed error before any launch, and a later
/// calibration of that layer makes it run (the table is rebuilt).
#[cfg(feature = "cuda")]
#[test]
fn double_sparsity_runs_on_the_calibrated_layers_only() {
    use fathom_cuda::cache::AttendMethod;
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(31);
    let (hkv, d) = (2, 64);
    let hq = hkv * 4;
    let mut cache = PagedCache::new(&gpu, config(2, hkv, d, 128, 16)).unwrap();
    let s = cache.create().unwrap();
    let mut shadows = vec![vec![Shadow::default(); 2]; 1];
    let slot = |_: SessionId| 0;
    step(&mut cache, &mut rng, &[(s, 300)], &mut shadows, &slot);
    let calib = vec![
        fathom_plan::scanner::HeadCalib {
            sigma2: vec![1.0; d],
            ds_channels: (0..d as u16).rev().collect(),
            ..Default::default()
        };
        hkv
    ];
    let ds = fathom_cuda::Method::DoubleSparsity(16);
    assert!(cache.prepare(ds).is_err(), "no calibration at all");
    cache.load_calibration(1, &calib).unwrap();
    cache.prepare(ds).unwrap();
    let params = small_select();
    let batch = step(&mut cache, &mut rng, &[(s, 1)], &mut shadows, &slot);
    let q: Vec<f32> = (0..hq * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let am = AttendMethod::Scan(ds);
    let e = cache
        .attend_host(&batch, 0, am, &params, &q)
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer 0's calibration"), "{e}");
    assert!(cache.check_method(am, 0).is_err() && cache.check_method(am, 1).is_ok());
    let out = cache.attend_host(&batch, 1, am, &params, &q).unwrap();
    assert!(out.iter().all(|v| v.is_finite()));
    cache.load_calibration(0, &calib).unwrap();
    cache.prepare(ds).unwrap();
    assert!(cache.attend_host(&batch, 0, am, &params, &q).is_ok());
}

/// Calibrations of `hkv` heads from 512 keys drawn as `step` draws them and random queries:
/// σ², Double Sparsity's channels and the PCA basis Loki reads (`HeadCalib::loki`).
fn drawn_calibration(
    rng: &mut StdRng,
    hkv: usize,
    g: usize,
    d: usize,
) -> Vec<fathom_plan::scanner::HeadCalib> {
    let n = 512;
    let keys: Vec<f32> = (0..n * hkv * d)
        .map(|i| bf(rng.gen_range(-1.0..1.0) * (0.1 + (i % d) as f32 / d as f32)))
        .collect();
    let qs: Vec<f32> = (0..16 * g * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
    (0..hkv)
        .map(|h| {
            fathom_plan::calib::head_calib(&fathom_plan::KvView::head(&keys, hkv, d, h), &qs)
                .unwrap()
        })
        .collect()
}

/// The (D, G, Hkv, tokens per page, residency) settings of the PCA-index and block-table tests.
const OWN_SHAPES: [(usize, usize, usize, usize, Residency); 4] = [
    (64, 3, 3, 128, Residency::Host),
    (128, 4, 2, 256, Residency::Hbm),
    (256, 1, 2, 128, Residency::IndexHbm),
    (128, 8, 1, 64, Residency::Host),
];

/// A cache of `layers` layers at one of [`OWN_SHAPES`], with `with` applied to its
/// configuration; also its shape as `Dims`.
fn own_cache(
    gpu: &fathom_cuda::Gpu,
    layers: usize,
    (d, g, hkv, page, residency): (usize, usize, usize, usize, Residency),
    with: impl FnOnce(&mut CacheConfig),
) -> (PagedCache, Dims) {
    let mut cfg = config(layers, hkv, d, page, 200);
    cfg.shape.group = g;
    cfg.residency = residency;
    with(&mut cfg);
    let dims = Dims {
        heads: hkv,
        channels: d,
    };
    (PagedCache::new(gpu, cfg).unwrap(), dims)
}

/// A ragged prefill of two new sessions, `a` tokens and `b.0 + b.1` (in two chunks), then a
/// fork of the first: the parent, the other session and the fork, mirrored in `shadows`.
fn prefill_and_fork(
    cache: &mut PagedCache,
    rng: &mut StdRng,
    shadows: &mut [Vec<Shadow>],
    a: usize,
    b: (usize, usize),
) -> [SessionId; 3] {
    let ids: Vec<SessionId> = (0..2).map(|_| cache.create().unwrap()).collect();
    let slot = |s: SessionId| s.slot();
    step(cache, rng, &[(ids[0], a), (ids[1], b.0)], shadows, &slot);
    step(cache, rng, &[(ids[1], b.1)], shadows, &slot);
    let fork = cache.fork(ids[0]).unwrap();
    shadows[fork.slot()] = shadows[ids[0].slot()].clone();
    [ids[0], ids[1], fork]
}

/// `cfg` on the filtered select from 64 middle tokens (failed rows rescanned).
fn filtered(cfg: &CacheConfig) -> CacheConfig {
    with(*cfg, |o| {
        o.select = fathom_cuda::cache::SelectPath::Filtered {
            min_middle_tokens: 64,
            keep_scores: false,
        }
    })
}

/// The sessions `ids` of another cache, each holding the keys and values of its `shadows`
/// (`[slot][layer]`), in a new cache of `cfg` with `calibs` loaded first (per layer, where
/// given): a prefill of all but each session's last token, then a decode step of them all in
/// `ids`' order. Returns the cache and that step's batch.
// `l` names the layer appended as well as indexes `shadows[slot][layer]`.
#[allow(clippy::needless_range_loop)]
fn replica(
    gpu: &fathom_cuda::Gpu,
    cfg: CacheConfig,
    calibs: &[Option<&Vec<fathom_plan::scanner::HeadCalib>>],
    ids: &[SessionId],
    shadows: &[Vec<Shadow>],
) -> (PagedCache, fathom_cuda::cache::AppendBatch) {
    let mut c = PagedCache::new(gpu, cfg).unwrap();
    for (l, cal) in calibs.iter().enumerate() {
        if let Some(cal) = cal {
            c.load_calibration(l, cal).unwrap();
        }
    }
    let row = cfg.shape.kv_heads * cfg.shape.dim;
    let new: Vec<SessionId> = ids.iter().map(|_| c.create().unwrap()).collect();
    let lens: Vec<usize> = ids
        .iter()
        .map(|s| shadows[s.slot()][0].k.len() / row)
        .collect();
    let mut batch = None;
    for last in [false, true] {
        let grow: Vec<(SessionId, usize)> = new
            .iter()
            .zip(&lens)
            .map(|(&s, &n)| (s, if last { 1 } else { n - 1 }))
            .collect();
        let ab = c.reserve(&grow).unwrap();
        for l in 0..cfg.shape.layers {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for (s, &n) in ids.iter().zip(&lens) {
                let sh = &shadows[s.slot()][l];
                let rows = if last { n - 1..n } else { 0..n - 1 };
                k.extend_from_slice(&sh.k[rows.start * row..rows.end * row]);
                v.extend_from_slice(&sh.v[rows.start * row..rows.end * row]);
            }
            c.append_host(&ab, l, &k, &v).unwrap();
        }
        batch = Some(ab);
    }
    (c, batch.unwrap())
}

/// On a cache on the filtered select ([`filtered`]): two attends of `first` (the first sets
/// the rows' estimates, the second filters; some row must) and then one of `then`; returns
/// the second `first` output and the `then` output.
fn filtered_then(
    cache: &mut PagedCache,
    batch: &fathom_cuda::cache::AppendBatch,
    params: &fathom_plan::SelectParams,
    q: &[f32],
    first: fathom_cuda::cache::AttendMethod,
    then: fathom_cuda::cache::AttendMethod,
) -> (Vec<f32>, Vec<f32>) {
    let before = cache.select_counters().unwrap().filtered;
    cache.attend_host(batch, 0, first, params, q).unwrap();
    let filtered_out = cache.attend_host(batch, 0, first, params, q).unwrap();
    let rows = cache.select_counters().unwrap().filtered - before;
    assert!(rows > 0, "{first:?}: no row took the filtered select");
    let then_out = cache.attend_host(batch, 0, then, params, q).unwrap();
    (filtered_out, then_out)
}

/// One query head's share of an attend against the per-head CPU protocol: the CPU selection
/// over the GPU's scores `row` (ties to the lower index, as on the GPU) equals the GPU's
/// winners of the middle, and the GPU's output `out` is exact attention of the raw query `q`
/// over the raw bf16 keys and values of KV head `h` on that set, within [`ATTN_TOL`].
#[allow(clippy::too_many_arguments)]
fn check_head(
    tag: &str,
    row: &[f32],
    winners: &[u32],
    params: &fathom_plan::SelectParams,
    q: &[f32],
    (kb, vb): (&[f32], &[f32]),
    (hkv, d, h): (usize, usize, usize),
    out: &[f32],
) {
    use fathom_plan::KvView;
    let n = row.len();
    let mut sel = Vec::new();
    fathom_plan::select_per_head(n - 1, row, params, &mut sel).unwrap();
    let mid = params.middle(n - 1);
    let cpu_mid: Vec<u32> = sel
        .iter()
        .copied()
        .filter(|&i| mid.contains(&(i as usize)))
        .collect();
    assert_eq!(winners, &cpu_mid[..], "{tag}: top-k");
    let mut want = vec![0f32; d];
    fathom_plan::attend(
        q,
        KvView::head(kb, hkv, d, h),
        KvView::head(vb, hkv, d, h),
        &sel,
        1.0 / (d as f32).sqrt(),
        None,
        &mut want,
    )
    .unwrap();
    let err = fathom_plan::relative_error(out, &want);
    assert!(err <= ATTN_TOL, "{tag}: attention relative error {err}");
}

/// The PCA index (docs/SPEC.md §6.1) and Loki in its own basis (§4): a cache made with
/// `pca_index` keeps, beside the raw store, each session's store in the calibration PCA basis,
/// bit for bit `KeyStore::from_keys` of the same bf16 keys with that basis (ragged prefill
/// chunks, decode tokens, partial blocks, a fork that diverges from its parent); `loki:R`
/// scans it with the queries rotated into the basis, takes each query head's top-k and
/// attends exactly over the raw records, as the per-head CPU protocol does. A basis that
/// changes after a layer's first append, Loki on a layer without a basis and Loki on a cache
/// without the index are typed errors.
#[test]
fn the_pca_index_runs_loki_in_its_own_basis() {
    use fathom_cuda::cache::AttendMethod;
    use fathom_plan::SelectParams;
    use fathom_store::{Basis, BasisKind};
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(29);
    let params = SelectParams {
        sink: 4,
        local: 32,
        k: 48,
    };
    for shape @ (d, g, hkv, _, residency) in OWN_SHAPES {
        let (mut cache, dims) = own_cache(&gpu, 3, shape, |c| c.pca_index = true);
        let hq = hkv * g;
        let r = d / 4;
        let loki = fathom_cuda::Method::Loki(r);
        // Layers 0 and 1 calibrated before any append; layer 2 never.
        let calibs: Vec<_> = (0..2)
            .map(|_| drawn_calibration(&mut rng, hkv, g, d))
            .collect();
        for (l, c) in calibs.iter().enumerate() {
            cache.load_calibration(l, c).unwrap();
        }
        cache.prepare(loki).unwrap();
        let basis: Vec<Basis> = calibs
            .iter()
            .map(|c| {
                let mats: Vec<f32> = c.iter().flat_map(|h| h.loki.iter().copied()).collect();
                Basis::new(BasisKind::Custom, hkv, d, mats).unwrap()
            })
            .collect();
        let what = format!("D={d} G={g} {residency:?}");
        let check_pca = |cache: &PagedCache, s: SessionId, sh: &[Shadow], tag: &str| {
            for l in 0..2 {
                let kb: Vec<f32> = sh[l].k.iter().map(|&x| bf(x)).collect();
                let store = KeyStore::from_keys(dims, &kb, Some(basis[l].clone())).unwrap();
                let got = cache.export_pca(s, l).unwrap();
                if let Err(e) = got.compare(&store.view()) {
                    panic!(
                        "{what} {tag} layer {l}, {} tokens: PCA index {e}",
                        store.tokens()
                    );
                }
            }
        };
        let mut shadows = vec![vec![Shadow::default(); 3]; 8];
        let slot = |s: SessionId| s.slot();
        // A ragged prefill, 700 and 1300 tokens (the second in two chunks), then a fork of
        // session 0 mid-block that diverges from it.
        let all = prefill_and_fork(&mut cache, &mut rng, &mut shadows, 700, (900, 400));
        let [parent, _, fork] = all;
        for s in all {
            check_pca(&cache, s, &shadows[s.slot()], "after the prefill");
        }
        // The same basis may be loaded again; another one may not, once the layer holds tokens.
        cache.load_calibration(0, &calibs[0]).unwrap();
        let other = drawn_calibration(&mut rng, hkv, g, d);
        let e = cache.load_calibration(0, &other).unwrap_err();
        assert!(e.to_string().contains("first append"), "{e}");
        for t in 0..4 {
            let dec: Vec<(SessionId, usize)> = all.iter().map(|&s| (s, 1 + t % 2)).collect();
            let batch = step(&mut cache, &mut rng, &dec, &mut shadows, &slot);
            let q: Vec<f32> = (0..3 * hq * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let am = AttendMethod::Scan(loki);
            let e = cache.attend_host(&batch, 2, am, &params, &q).unwrap_err();
            assert!(e.to_string().contains("PCA basis"), "{e}");
            for l in 0..2 {
                let out = cache.attend_host(&batch, l, am, &params, &q).unwrap();
                for (b, &s) in all.iter().enumerate() {
                    let dbg = cache.debug_readback(&batch, b).unwrap();
                    let sh = &shadows[s.slot()][l];
                    let n = sh.k.len() / dims.row();
                    let kb: Vec<f32> = sh.k.iter().map(|&x| bf(x)).collect();
                    let vb: Vec<f32> = sh.v.iter().map(|&x| bf(x)).collect();
                    let store = KeyStore::from_keys(dims, &kb, Some(basis[l].clone())).unwrap();
                    let view = store.view();
                    let depths: Vec<u8> = (0..d).map(|c| if c < r { 4 } else { 0 }).collect();
                    for h in 0..hkv {
                        let tag =
                            format!("{what} loki:{r} step {t} layer {l} session {b} head {h}");
                        let qh = &q[(b * hq + h * g) * d..(b * hq + (h + 1) * g) * d];
                        let mut qr = vec![0f32; g * d];
                        for gg in 0..g {
                            view.rotate_query(
                                h,
                                &qh[gg * d..(gg + 1) * d],
                                &mut qr[gg * d..(gg + 1) * d],
                            );
                        }
                        let (refs, mag) =
                            fathom_plan::scan::reference_scores(&view, h, &qr, g, &depths).unwrap();
                        for gg in 0..g {
                            let row = &dbg.scores[(h * g + gg) * n..(h * g + gg + 1) * n];
                            for i in 0..n {
                                let (got, want) = (row[i] as f64, refs[gg * n + i]);
                                assert!(
                                    (got - want).abs() <= SCORE_TOL * mag[gg * n + i] + 1e-30,
                                    "{tag} q {gg} token {i}: gpu {got} cpu {want}"
                                );
                            }
                            // Attention over the raw records with the raw query.
                            let o = (b * hq + h * g + gg) * d;
                            check_head(
                                &format!("{tag} q {gg}"),
                                row,
                                &dbg.winners[h * g + gg],
                                &params,
                                &qh[gg * d..(gg + 1) * d],
                                (&kb, &vb),
                                (hkv, d, h),
                                &out[o..o + d],
                            );
                        }
                    }
                }
            }
        }
        // The filtered select over the PCA index (its estimates from the rotated queries)
        // picks the score path's winners: loki's outputs on both paths are the same bits.
        {
            let dec: Vec<(SessionId, usize)> = all.iter().map(|&s| (s, 1)).collect();
            let batch = step(&mut cache, &mut rng, &dec, &mut shadows, &slot);
            let q: Vec<f32> = (0..3 * hq * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let am = AttendMethod::Scan(loki);
            let plain = cache.attend_host(&batch, 0, am, &params, &q).unwrap();
            let cal = [Some(&calibs[0]), Some(&calibs[1])];
            let cfg = filtered(cache.config());
            let (mut fc, fb) = replica(&gpu, cfg, &cal, &all, &shadows);
            fc.prepare(loki).unwrap();
            let (filtered, _) = filtered_then(&mut fc, &fb, &params, &q, am, am);
            assert_eq!(
                filtered, plain,
                "{what}: loki, filtered against the score path"
            );
        }
        for s in all {
            check_pca(&cache, s, &shadows[s.slot()], "after decoding");
            // The first index is untouched by the second.
            check(
                &cache,
                s,
                &shadows[s.slot()][..2],
                "raw store beside the PCA index",
            );
        }
        cache.free(parent).unwrap();
        check_pca(
            &cache,
            fork,
            &shadows[fork.slot()],
            "fork after its parent is freed",
        );
    }
    // Loki on a cache without the index.
    let mut plain = PagedCache::new(&gpu, config(1, 1, 64, 128, 8)).unwrap();
    let e = plain.prepare(fathom_cuda::Method::Loki(16)).unwrap_err();
    assert!(e.to_string().contains("PCA index"), "{e}");
    let s = plain.create().unwrap();
    assert!(plain.export_pca(s, 0).is_err());
}

/// Block tables (docs/SPEC.md §6.1) and the two table methods of §4 through the cache:
/// appends keep, per page, the fp16 mean key of every 8 tokens and the fp16 channel bounds of
/// every 16 from the bf16 keys (ragged prefill chunks, decode tokens, partial groups, a fork
/// that diverges from its parent); `landmark` and `quest` score every token from them, and the
/// scores are `fathom_baselines`' CPU scanners' over the same bf16 keys **bit for bit** (exact
/// products in f64, summed in channel order); each query head's top-k and exact attention
/// follow the per-head CPU protocol. Either method on a cache without the tables is a typed
/// error.
// `l` names the layer attended and indexes `shadows[slot][layer]`.
#[allow(clippy::needless_range_loop)]
#[test]
fn block_tables_run_landmark_and_quest() {
    use fathom_baselines::{Landmark, Quest};
    use fathom_cuda::cache::AttendMethod;
    use fathom_plan::scanner::{HeadInput, Scanner};
    use fathom_plan::{KvView, SelectParams};
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(31);
    let params = SelectParams {
        sink: 4,
        local: 32,
        k: 40,
    };
    for shape @ (d, g, hkv, _, residency) in OWN_SHAPES {
        let (mut cache, dims) = own_cache(&gpu, 2, shape, |c| c.block_tables = true);
        let hq = hkv * g;
        for m in [fathom_cuda::Method::Landmark, fathom_cuda::Method::Quest] {
            cache.prepare(m).unwrap();
        }
        let mut shadows = vec![vec![Shadow::default(); 2]; 8];
        let slot = |s: SessionId| s.slot();
        // A ragged prefill (the second session in two chunks, neither a multiple of 16), then
        // a fork of session 0 mid-group.
        let all = prefill_and_fork(&mut cache, &mut rng, &mut shadows, 699, (901, 403));
        let [parent, other, fork] = all;
        for t in 0..5 {
            let dec: Vec<(SessionId, usize)> = all.iter().map(|&s| (s, 1 + t % 3)).collect();
            let batch = step(&mut cache, &mut rng, &dec, &mut shadows, &slot);
            let q: Vec<f32> = (0..3 * hq * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
            for (label, am) in [
                (
                    "landmark",
                    AttendMethod::Scan(fathom_cuda::Method::Landmark),
                ),
                ("quest", AttendMethod::Scan(fathom_cuda::Method::Quest)),
            ] {
                for l in 0..2 {
                    let out = cache.attend_host(&batch, l, am, &params, &q).unwrap();
                    for (b, &s) in all.iter().enumerate() {
                        let dbg = cache.debug_readback(&batch, b).unwrap();
                        let sh = &shadows[s.slot()][l];
                        let n = sh.k.len() / dims.row();
                        let kb: Vec<f32> = sh.k.iter().map(|&x| bf(x)).collect();
                        let vb: Vec<f32> = sh.v.iter().map(|&x| bf(x)).collect();
                        let store = KeyStore::from_keys(dims, &kb, None).unwrap();
                        for h in 0..hkv {
                            let tag = format!(
                                "D={d} G={g} {residency:?} {label} step {t} layer {l} session {b} head {h}"
                            );
                            let qh = &q[(b * hq + h * g) * d..(b * hq + (h + 1) * g) * d];
                            let input = HeadInput {
                                layer: l,
                                keys: KvView::head(&kb, hkv, d, h),
                                store: store.view(),
                                calib: None,
                                klt_store: None,
                            };
                            let scanner = match label {
                                "landmark" => Landmark.prepare(&input).unwrap(),
                                _ => Quest.prepare(&input).unwrap(),
                            };
                            let mut want = vec![0f32; g * n];
                            scanner.score(qh, g, &mut want).unwrap();
                            for gg in 0..g {
                                let row = &dbg.scores[(h * g + gg) * n..(h * g + gg + 1) * n];
                                if let Some(i) = (0..n).find(|&i| row[i] != want[gg * n + i]) {
                                    panic!(
                                        "{tag} q {gg} token {i} of {n}: gpu {} cpu {}",
                                        row[i],
                                        want[gg * n + i]
                                    );
                                }
                                let o = (b * hq + h * g + gg) * d;
                                check_head(
                                    &format!("{tag} q {gg}"),
                                    row,
                                    &dbg.winners[h * g + gg],
                                    &params,
                                    &qh[gg * d..(gg + 1) * d],
                                    (&kb, &vb),
                                    (hkv, d, h),
                                    &out[o..o + d],
                                );
                            }
                        }
                    }
                }
            }
        }
        // A filtered attend of another method must not leave its rows' select modes for a
        // table method (which takes the score path): landmark after two filtered sparq:16
        // attends (the first sets the estimates, the second filters) equals landmark alone.
        let dec: Vec<(SessionId, usize)> = all.iter().map(|&s| (s, 1)).collect();
        let batch = step(&mut cache, &mut rng, &dec, &mut shadows, &slot);
        let q: Vec<f32> = (0..3 * hq * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let lm = AttendMethod::Scan(fathom_cuda::Method::Landmark);
        let alone = cache.attend_host(&batch, 0, lm, &params, &q).unwrap();
        let sq = AttendMethod::Scan(fathom_cuda::Method::SparQ(16));
        let (mut fc, fb) = replica(&gpu, filtered(cache.config()), &[], &all, &shadows);
        fc.prepare(fathom_cuda::Method::Landmark).unwrap();
        let (_, after) = filtered_then(&mut fc, &fb, &params, &q, sq, lm);
        assert_eq!(
            after, alone,
            "D={d} {residency:?}: landmark after a filtered attend"
        );
        cache.free(parent).unwrap();
        for s in [other, fork] {
            check(
                &cache,
                s,
                &shadows[s.slot()],
                "store beside the block tables",
            );
        }
    }
    let mut plain = PagedCache::new(&gpu, config(1, 1, 64, 128, 8)).unwrap();
    for m in [fathom_cuda::Method::Landmark, fathom_cuda::Method::Quest] {
        let e = plain.prepare(m).unwrap_err();
        assert!(e.to_string().contains("block tables"), "{e}");
    }
}

/// The host-slice conveniences order their uploads before the kernels that read them: many
/// attends in a row, each with fresh queries, every output against the CPU's dense attention
/// over the same bf16 rows. (A synchronous copy from pageable memory is ordered only with the
/// legacy stream and may return before its DMA lands; when the cache used one, the attend
/// test above failed about one run in four, on dense, the first method after fresh queries.)
#[test]
fn host_slice_uploads_are_ordered_before_the_kernels() {
    use fathom_cuda::cache::AttendMethod;
    use fathom_plan::KvView;
    let Some(gpu) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(17);
    let (hkv, g, d) = (3, 3, 64);
    let hq = hkv * g;
    let (mut cache, ids) = three_sessions(&gpu, 1, (d, g, hkv, 128, Residency::IndexHbm), 64);
    let mut shadows = vec![vec![Shadow::default(); 1]; 8];
    let slot = |s: SessionId| s.slot();
    step(
        &mut cache,
        &mut rng,
        &[(ids[0], 300), (ids[1], 1000), (ids[2], 2100)],
        &mut shadows,
        &slot,
    );
    let params = small_select();
    for t in 0..48 {
        // A decode token (appended through append_host), then fresh queries.
        let all: Vec<(SessionId, usize)> = ids.iter().map(|&s| (s, 1)).collect();
        let batch = step(&mut cache, &mut rng, &all, &mut shadows, &slot);
        let q: Vec<f32> = (0..3 * hq * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let out = cache
            .attend_host(&batch, 0, AttendMethod::Dense, &params, &q)
            .unwrap();
        for (b, &s) in ids.iter().enumerate() {
            let sh = &shadows[s.slot()][0];
            let n = sh.k.len() / (hkv * d);
            let kb: Vec<f32> = sh.k.iter().map(|&x| bf(x)).collect();
            let vb: Vec<f32> = sh.v.iter().map(|&x| bf(x)).collect();
            let all_rows: Vec<u32> = (0..n as u32).collect();
            for h in 0..hkv {
                for gg in 0..g {
                    let r = b * hq + h * g + gg;
                    let mut want = vec![0f32; d];
                    fathom_plan::attend(
                        &q[r * d..(r + 1) * d],
                        KvView::head(&kb, hkv, d, h),
                        KvView::head(&vb, hkv, d, h),
                        &all_rows,
                        1.0 / (d as f32).sqrt(),
                        None,
                        &mut want,
                    )
                    .unwrap();
                    let err = fathom_plan::relative_error(&out[r * d..(r + 1) * d], &want);
                    assert!(
                        err <= ATTN_TOL,
                        "attend {t} session {b} head {h} q {gg}: relative error {err}"
                    );
                }
            }
        }
    }
}

/// Allocation failures are typed errors that carry the size requested, never an abort: a pool
/// of 2^16 pages of 2048 tokens (≈ 0.6 TB per layer at 8 KV heads, D = 128: more than the
/// device holds) in HBM, and three times that in pinned host memory (more than any host here
/// pins).
#[test]
fn allocation_failures_are_typed_errors() {
    let Some(gpu) = gpu() else { return };
    for (residency, pages) in [(Residency::Hbm, 1usize << 16), (Residency::Host, 3 << 16)] {
        let cfg = CacheConfig {
            residency,
            ..config(1, 8, 128, 2048, pages)
        };
        let t = std::time::Instant::now();
        match PagedCache::new(&gpu, cfg) {
            Ok(_) => panic!("{residency:?} {pages} pages: a cache that cannot fit was created"),
            Err(
                e @ (fathom_cuda::CudaError::DeviceOom { bytes, .. }
                | fathom_cuda::CudaError::PinnedAlloc { bytes, .. }),
            ) => {
                eprintln!("{residency:?} {pages} pages: {e} ({:.2?})", t.elapsed());
                assert!(bytes >= 1 << 36, "{e}: the error names too small a size");
                assert!(e.to_string().contains(&bytes.to_string()), "{e}");
            }
            Err(e) => panic!("{residency:?} {pages} pages: unexpected error {e}"),
        }
    }
}
