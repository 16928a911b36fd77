//! The selection entry (`KvCache::select`, docs/SPEC.md §5) on the device: for every method
//! of a ragged batch (a session shorter than sink + local + k, two longer ones), each query
//! head's row holds exactly its sink, the winners the attend of the same queries chose (its
//! debug readback) and its local window, -1 past its length: what the CPU twin
//! `select_out_row` writes from those winners. Bad calls are typed errors before any launch,
//! and the cache stays usable.
//!
//! Skips (printing why) without a GPU path, as on CI; `FATHOM_REQUIRE_GPU=1` turns the skip
//! into a failure.

use fathom_cuda::cache::{
    select_out_row, AttendMethod, CacheConfig, CacheOptions, QueryRows, SelectOut, SelectOutParams,
};
use fathom_cuda::memory::DeviceBuffer;
use fathom_cuda::pages::{PageConfig, SessionId};
use fathom_cuda::prelude::*;
use fathom_cuda::{CudaError, ModelShape, PagedCache, Residency};
use rand::{rngs::StdRng, Rng, SeedableRng};

mod common;
use common::gpu;

const HKV: usize = 2;
const G: usize = 4;
const D: usize = 64;
const LENS: [usize; 3] = [50, 3000, 5000];

fn config(residency: Residency) -> CacheConfig {
    CacheConfig {
        shape: ModelShape {
            layers: 1,
            kv_heads: HKV,
            group: G,
            dim: D,
        },
        pages: PageConfig {
            page_tokens: 1024,
            pages: 32,
            max_sessions: 4,
            max_tokens: 8192,
        },
        max_batch: 4,
        max_k: 128,
        row_cache: 0,
        residency,
        pca_index: false,
        block_tables: false,
        host_pages: fathom_cuda::HostPages::Driver,
        options: CacheOptions::default(),
    }
}

/// Three sessions prefilled with seeded keys and values, then one decode token each; σ² of
/// ones loaded (for `fathom:B`). Returns the sessions and the decode batch.
fn prefilled(
    cache: &mut PagedCache,
    rng: &mut StdRng,
) -> (Vec<SessionId>, fathom_cuda::cache::AppendBatch) {
    let s: Vec<SessionId> = (0..3).map(|_| cache.create().unwrap()).collect();
    for (step, lens) in [LENS, [1, 1, 1]].into_iter().enumerate() {
        let plan: Vec<(SessionId, usize)> = s.iter().copied().zip(lens).collect();
        let batch = cache.reserve(&plan).unwrap();
        let rows: usize = lens.iter().sum();
        let mut kv = || -> Vec<f32> {
            (0..rows * HKV * D)
                .map(|_| rng.gen_range(-1.0f32..1.0))
                .collect()
        };
        let (k, v) = (kv(), kv());
        cache.append_host(&batch, 0, &k, &v).unwrap();
        if step == 1 {
            let calib = vec![
                fathom_plan::scanner::HeadCalib {
                    sigma2: vec![1.0; D],
                    ..Default::default()
                };
                HKV
            ];
            cache.load_calibration(0, &calib).unwrap();
            return (s, batch);
        }
    }
    unreachable!()
}

#[test]
fn select_writes_the_sink_the_attends_winners_and_the_local_window() {
    let Some(gpu) = gpu() else { return };
    for residency in [Residency::Host, Residency::Hbm] {
        let mut cache = PagedCache::new(&gpu, config(residency).validate().unwrap()).unwrap();
        let mut rng = StdRng::seed_from_u64(11);
        let (_, batch) = prefilled(&mut cache, &mut rng);
        let params = fathom_plan::SelectParams {
            sink: 4,
            local: 32,
            k: 100,
        };
        let cap = 4 + 32 + 100 + 3;
        let hq = HKV * G;
        let rows = LENS.len() * hq;
        for m in ["exact", "fathom:48", "sparq:16", "thumb2"] {
            let am = AttendMethod::parse(m, D).unwrap();
            if let AttendMethod::Scan(mm) = am {
                cache.prepare(mm).unwrap();
            }
            let q: Vec<f32> = (0..rows * D).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            cache.attend_host(&batch, 0, am, &params, &q).unwrap();
            let winners: Vec<Vec<Vec<u32>>> = (0..LENS.len())
                .map(|b| cache.debug_readback(&batch, b).unwrap().winners)
                .collect();
            let qd = DeviceBuffer::from_host(&gpu, &q).unwrap();
            let mut idx = DeviceBuffer::<i32>::zeros(&gpu, rows * cap).unwrap();
            let mut len = DeviceBuffer::<i32>::zeros(&gpu, rows).unwrap();
            let out = SelectOut {
                indices: idx.view_mut(),
                lengths: len.view_mut(),
                cap,
            };
            cache
                .select(&batch, 0, am, &params, &QueryRows { q: qd.view() }, out)
                .unwrap();
            cache.synchronize().unwrap();
            let (idx, len) = (idx.to_host().unwrap(), len.to_host().unwrap());
            let p = SelectOutParams {
                sink: 4,
                local: 32,
                max_k: 128,
                cap: cap as u32,
                hq: hq as u32,
            };
            for (b, &n0) in LENS.iter().enumerate() {
                let n = (n0 + 1) as u32;
                for (h, wh) in winners[b].iter().enumerate() {
                    let r = b * hq + h;
                    let got = &idx[r * cap..(r + 1) * cap];
                    let (want, want_len) = select_out_row(&p, n, wh);
                    assert_eq!(len[r], want_len, "{m} {residency:?} session {b} head {h}");
                    // The winners' order within the row is the top-k's; the readback sorts.
                    let l = want_len as usize;
                    let mut g: Vec<i32> = got[..l].to_vec();
                    let mut w: Vec<i32> = want[..l].to_vec();
                    g.sort_unstable();
                    w.sort_unstable();
                    assert_eq!(g, w, "{m} {residency:?} session {b} head {h}");
                    assert!(got[l..].iter().all(|&x| x == -1), "{m}: padding");
                    g.dedup();
                    assert_eq!(g.len(), l, "{m}: a position twice");
                    assert!(g.iter().all(|&x| x >= 0 && (x as u32) < n));
                    let expect_len = (n0 + 1).min(136);
                    assert_eq!(l, expect_len, "{m}: sink + local + k, or every token");
                }
            }
        }
    }
}

#[test]
fn bad_selects_are_typed_errors_and_the_cache_stays_usable() {
    let Some(gpu) = gpu() else { return };
    let mut cache = PagedCache::new(&gpu, config(Residency::Host).validate().unwrap()).unwrap();
    let mut rng = StdRng::seed_from_u64(12);
    let (_, batch) = prefilled(&mut cache, &mut rng);
    let params = fathom_plan::SelectParams {
        sink: 4,
        local: 32,
        k: 64,
    };
    let rows = LENS.len() * HKV * G;
    let qd = DeviceBuffer::from_host(&gpu, &vec![0.5f32; rows * D]).unwrap();
    let q = QueryRows { q: qd.view() };
    let exact = AttendMethod::parse("exact", D).unwrap();
    if let AttendMethod::Scan(mm) = exact {
        cache.prepare(mm).unwrap();
    }
    let mut idx = DeviceBuffer::<i32>::zeros(&gpu, rows * 100).unwrap();
    let mut len = DeviceBuffer::<i32>::zeros(&gpu, rows).unwrap();
    let mut fidx = DeviceBuffer::<f32>::zeros(&gpu, rows * 100).unwrap();
    let cases: Vec<(&str, Result<(), CudaError>)> = vec![
        (
            "method",
            cache.select(
                &batch,
                0,
                AttendMethod::Dense,
                &params,
                &q,
                SelectOut {
                    indices: idx.view_mut(),
                    lengths: len.view_mut(),
                    cap: 100,
                },
            ),
        ),
        (
            "indices",
            cache.select(
                &batch,
                0,
                exact,
                &params,
                &q,
                SelectOut {
                    indices: idx.view_mut(),
                    lengths: len.view_mut(),
                    cap: 99,
                },
            ),
        ),
        (
            "indices",
            cache.select(
                &batch,
                0,
                exact,
                &params,
                &q,
                SelectOut {
                    indices: fidx.view_mut(),
                    lengths: len.view_mut(),
                    cap: 100,
                },
            ),
        ),
        (
            "indices",
            cache.select(
                &batch,
                0,
                exact,
                &params,
                &q,
                SelectOut {
                    indices: idx.view_mut(),
                    lengths: len.view_mut(),
                    cap: 120,
                },
            ),
        ),
        (
            "layer",
            cache.select(
                &batch,
                1,
                exact,
                &params,
                &q,
                SelectOut {
                    indices: idx.view_mut(),
                    lengths: len.view_mut(),
                    cap: 100,
                },
            ),
        ),
    ];
    for (i, (want, r)) in cases.into_iter().enumerate() {
        match r {
            Err(CudaError::Invalid { what, .. }) if what == want => {}
            other => panic!("case {i}: want a refusal naming {want}, got {other:?}"),
        }
    }
    // Nothing was launched by the refusals: the same call with good arguments works.
    cache
        .select(
            &batch,
            0,
            exact,
            &params,
            &q,
            SelectOut {
                indices: idx.view_mut(),
                lengths: len.view_mut(),
                cap: 100,
            },
        )
        .unwrap();
    cache.synchronize().unwrap();
    let l = len.to_host().unwrap();
    assert!(l.iter().all(|&x| x == 51 || x == 100), "{l:?}");
}
