//! Bits, selection rules and references of every baseline (docs/SPEC.md §4).

use fathom_baselines::*;
use fathom_plan::scanner::{Fathom, HeadCalib, HeadInput, Scanner};
use fathom_plan::KvView;
use fathom_store::{Dims, KeyStore};
use rand::{rngs::StdRng, Rng, SeedableRng};

struct Fixture {
    keys: Vec<f32>,
    store: KeyStore,
    calib: HeadCalib,
    d: usize,
}

fn fixture(n: usize, d: usize, seed: u64) -> Fixture {
    let mut rng = StdRng::seed_from_u64(seed);
    let scale: Vec<f32> = (0..d).map(|_| rng.gen_range(-1.5f32..1.5).exp()).collect();
    let keys: Vec<f32> = (0..n * d)
        .map(|i| rng.gen_range(-1.0f32..1.0) * scale[i % d])
        .collect();
    let store = KeyStore::from_keys(
        Dims {
            heads: 1,
            channels: d,
        },
        &keys,
        None,
    )
    .unwrap();
    let qs: Vec<f32> = (0..8 * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let calib = fathom_plan::calib::head_calib(&KvView::contiguous(&keys, d), &qs).unwrap();
    Fixture {
        keys,
        store,
        calib,
        d,
    }
}

impl Fixture {
    fn input(&self) -> HeadInput<'_> {
        HeadInput {
            layer: 0,
            keys: KvView::contiguous(&self.keys, self.d),
            store: self.store.view(),
            calib: Some(&self.calib),
            klt_store: None,
        }
    }
    fn score(&self, m: &dyn Scanner, q: &[f32], g: usize) -> (Vec<f32>, f32) {
        let n = self.keys.len() / self.d;
        let head = m.prepare(&self.input()).unwrap();
        let mut out = vec![0f32; g * n];
        let bits = head.score(q, g, &mut out).unwrap();
        (out, bits)
    }
}

#[test]
fn bits_are_charged_as_spec_section_4() {
    let f = fixture(300, 128, 1);
    let mut rng = StdRng::seed_from_u64(2);
    let q: Vec<f32> = (0..4 * 128).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let check = |m: &dyn Scanner, want: f32| assert_eq!(f.score(m, &q, 4).1, want, "{}", m.name());
    check(&SparQ { r: 16 }, 68.0);
    check(&SparQ { r: 32 }, 136.0);
    check(&DoubleSparsity { r: 32 }, 136.0);
    check(&Loki { r: 32 }, 136.0);
    check(&Thumbnail, 288.0);
    check(&Landmark, 256.0);
    check(&Quest, 256.0);
    // The union reads at least one head's channels and at most all heads' channels.
    let u = f.score(&SparQUnion { r: 32 }, &q, 4).1;
    assert!((136.0..=4.0 * 136.0).contains(&u), "{u}");
    for b in [0.0f32, 13.25, 48.0, 64.0, 92.0, 136.0, 544.0] {
        let bits = f.score(&Fathom::new(b), &q, 4).1;
        assert!(bits <= b, "fathom:{b} read {bits}");
    }
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

#[test]
fn sparq_reads_the_channels_with_largest_group_abs_query() {
    let f = fixture(100, 8, 3);
    // Two heads; Σ_h |q_c| is largest on channels 6 and 1.
    let q = [
        0.1, 2.0, 0.0, 0.3, 0.0, 0.0, -3.0, 0.2, /* head 1 */ 0.0, -1.0, 0.5, 0.0, 0.4, 0.0,
        1.0, 0.0,
    ];
    let (s, bits) = f.score(&SparQ { r: 2 }, &q, 2);
    assert_eq!(bits, 8.5);
    let deq = f.store.view().dequant_prefix(4).unwrap();
    for h in 0..2 {
        for i in 0..100 {
            let want = q[h * 8 + 1] as f64 * deq[i * 8 + 1] as f64
                + q[h * 8 + 6] as f64 * deq[i * 8 + 6] as f64;
            assert!((s[h * 100 + i] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()));
        }
    }
}

#[test]
fn landmark_scores_a_token_by_its_block_mean() {
    let f = fixture(20, 4, 4);
    let q = [1.0, -2.0, 0.5, 0.25];
    let (s, _) = f.score(&Landmark, &q, 1);
    for i in 0..20 {
        let b = i / 8;
        let (lo, hi) = (b * 8, ((b + 1) * 8).min(20));
        let mean: Vec<f32> = (0..4)
            .map(|c| {
                (lo..hi).map(|j| f.keys[j * 4 + c] as f64).sum::<f64>() as f32 / (hi - lo) as f32
            })
            .collect();
        let want = dot64(&q, &mean);
        assert!(
            (s[i] as f64 - want).abs() < 2e-3 * (1.0 + want.abs()),
            "token {i}: {} vs {want}",
            s[i]
        );
        assert_eq!(s[i], s[lo]);
    }
}

#[test]
fn quest_page_score_bounds_every_key_in_the_page() {
    for seed in 0..5 {
        let f = fixture(100, 16, 10 + seed);
        let mut rng = StdRng::seed_from_u64(seed);
        let q: Vec<f32> = (0..16).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
        let (s, _) = f.score(&Quest, &q, 1);
        assert_eq!(s.len(), 100);
        for (i, (&page, key)) in s.iter().zip(f.keys.chunks_exact(16)).enumerate() {
            let exact = dot64(&q, key);
            assert!(
                page as f64 >= exact - 1e-4,
                "token {i}: page score {page} < key score {exact}"
            );
        }
    }
}

#[test]
fn exact_equals_f64_reference() {
    let f = fixture(77, 32, 5);
    let mut rng = StdRng::seed_from_u64(6);
    let q: Vec<f32> = (0..3 * 32).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let (s, _) = f.score(&Exact, &q, 3);
    for h in 0..3 {
        for i in 0..77 {
            let want = dot64(&q[h * 32..(h + 1) * 32], &f.keys[i * 32..(i + 1) * 32]);
            assert!((s[h * 77 + i] as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()));
        }
    }
}

#[test]
fn calibration_rotations_are_orthogonal_and_klt_scores_equal_raw() {
    let f = fixture(500, 32, 7);
    let d = 32;
    for u in [&f.calib.klt, &f.calib.loki] {
        for a in 0..d {
            for b in 0..d {
                let x: f64 = (0..d)
                    .map(|i| u[i * d + a] as f64 * u[i * d + b] as f64)
                    .sum();
                let want = if a == b { 1.0 } else { 0.0 };
                assert!((x - want).abs() < 1e-5, "UᵀU[{a},{b}] = {x}");
            }
        }
    }
    // Exact scores in the KLT basis equal the raw scores: q·k = (Uᵀq)·(Uᵀk).
    let store = fathom_plan::scanner::rotated_store(
        &KvView::contiguous(&f.keys, d),
        &f.calib.klt,
        fathom_store::BasisKind::Klt,
    )
    .unwrap();
    let mut rng = StdRng::seed_from_u64(8);
    let q: Vec<f32> = (0..d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let mut qr = vec![0f32; d];
    store.view().rotate_query(0, &q, &mut qr);
    let u = &f.calib.klt;
    for i in 0..500 {
        let k = &f.keys[i * d..(i + 1) * d];
        let kr: Vec<f32> = (0..d)
            .map(|j| {
                (0..d)
                    .map(|c| u[c * d + j] as f64 * k[c] as f64)
                    .sum::<f64>() as f32
            })
            .collect();
        let (a, b) = (dot64(&q, k), dot64(&qr, &kr));
        assert!((a - b).abs() < 1e-5 * (1.0 + a.abs()), "{a} vs {b}");
    }
    // KLT eigenvalues are the variances of the rotated coordinates and sum to the trace.
    let tr: f32 = f.calib.sigma2.iter().sum();
    let ev: f32 = f.calib.klt_sigma2.iter().sum();
    assert!((tr - ev).abs() < 1e-3 * tr, "{tr} vs {ev}");
}

/// Every method, Fathom's own included (docs/SPEC.md §4's list and `fathom:B`).
fn every_method() -> Vec<Box<dyn Scanner>> {
    let mut klt = Fathom::new(48.0);
    klt.basis = fathom_plan::scanner::StoreBasis::Klt;
    klt.label = "fathom-klt:48".into();
    vec![
        Box::new(Fathom::new(48.0)),
        Box::new(klt),
        Box::new(SparQ { r: 4 }),
        Box::new(SparQUnion { r: 4 }),
        Box::new(DoubleSparsity { r: 4 }),
        Box::new(Loki { r: 4 }),
        Box::new(LokiF16 { r: 4 }),
        Box::new(Thumbnail),
        Box::new(Landmark),
        Box::new(Quest),
        Box::new(Exact),
        Box::new(Dense),
    ]
}

/// Short or long query and score slices, and NaN or infinite queries, are typed errors from
/// every `HeadScanner::score` (the shared `check_score_args`), never a panic or a silent
/// `±∞` score; `out` is not written.
#[test]
fn every_scorer_rejects_bad_shapes_and_non_finite_queries() {
    use fathom_plan::scanner::ScannerError;
    use fathom_plan::PlanError;
    let f = fixture(100, 16, 11);
    let (n, d, g) = (100, 16, 2);
    let mut rng = StdRng::seed_from_u64(12);
    let q: Vec<f32> = (0..g * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    for m in every_method() {
        let head = m.prepare(&f.input()).unwrap();
        let name = m.name();
        let mut out = vec![7f32; g * n];
        // Baseline: the right shapes score.
        head.score(&q, g, &mut out).unwrap();
        let shape = |r: Result<f32, ScannerError>| {
            assert!(
                matches!(r, Err(ScannerError::Plan(PlanError::ShapeMismatch { .. }))),
                "{name}: {r:?}"
            )
        };
        shape(head.score(&q[..g * d - 1], g, &mut out));
        shape(head.score(&q[..d], g, &mut out));
        shape(head.score(&q, g, &mut out[..g * n - 1]));
        shape(head.score(&q, g + 1, &mut vec![0f32; (g + 1) * n]));
        let huge = usize::MAX / 2;
        assert!(
            matches!(
                head.score(&q, huge, &mut out),
                Err(ScannerError::Plan(PlanError::InvalidParameter {
                    name: "g",
                    ..
                }))
            ),
            "{name}"
        );
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut qb = q.clone();
            qb[d + 3] = bad;
            let mut out = vec![7f32; g * n];
            let r = head.score(&qb, g, &mut out);
            assert!(
                matches!(
                    r,
                    Err(ScannerError::Plan(PlanError::NonFinite {
                        what: "queries",
                        index
                    })) if index == d + 3
                ),
                "{name} {bad}: {r:?}"
            );
            assert!(out.iter().all(|&x| x == 7.0), "{name}: out written");
        }
    }
}

/// A store that is not the keys' store (another head count, another length, another `D`) is
/// refused by every method that reads it; the methods that score from the keys alone ignore it.
#[test]
fn a_store_that_is_not_the_keys_store_is_refused() {
    use fathom_plan::scanner::ScannerError;
    let f = fixture(100, 16, 13);
    let shorter = fixture(99, 16, 13);
    let wider = fixture(100, 32, 13);
    let two_heads = KeyStore::from_keys(
        Dims {
            heads: 2,
            channels: 8,
        },
        &f.keys,
        None,
    )
    .unwrap();
    let reads_store =
        |name: &str| ["fathom:48", "sparq:4", "sparq-union:4", "ds:4", "thumb2"].contains(&name);
    for store in [shorter.store.view(), wider.store.view(), two_heads.view()] {
        let input = HeadInput { store, ..f.input() };
        for m in every_method() {
            let name = m.name();
            let r = m.prepare(&input);
            if reads_store(&name) {
                assert!(
                    matches!(r, Err(ScannerError::Invalid(_))),
                    "{name}: {:?}",
                    r.err()
                );
            } else {
                assert!(r.is_ok(), "{name}: {:?}", r.err());
            }
        }
    }
}
