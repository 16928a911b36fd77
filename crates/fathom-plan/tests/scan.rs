//! The CPU scan equals the dequantize-then-dot f64 reference (docs/SPEC.md §2–§3).

use fathom_plan::scan::{bytes_read, reference_scores, scan, ScanError};
use fathom_store::{Dims, KeyStore};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// f32 accumulation of at most `D·4` terms: error ≤ ~`D·4·ε·Σ|terms|`; 1e-5 relative to the
/// magnitude `Σ_c |q_c k̂_c|` holds with a wide margin for D ≤ 256.
const REL: f64 = 1e-5;

fn check(n: usize, heads: usize, d: usize, g: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let dims = Dims { heads, channels: d };
    // Heavy-tailed channel scales, as in real keys.
    let scale: Vec<f32> = (0..d)
        .map(|_| (rng.gen_range(-2.0f32..2.0)).exp())
        .collect();
    let keys: Vec<f32> = (0..n * heads * d)
        .map(|i| rng.gen_range(-1.0f32..1.0) * scale[i % d])
        .collect();
    // Capacity above n: the scan must respect the plane stride of a growable store.
    let mut store = KeyStore::with_capacity(dims, n + 130, None).unwrap();
    store.append(&keys).unwrap();
    let view = store.view();
    let queries: Vec<f32> = (0..g * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    for trial in 0..3 {
        let depths: Vec<u8> = (0..d)
            .map(|c| match trial {
                0 => rng.gen_range(0..=4),
                1 => 4,
                _ => (c % 3 == 0) as u8,
            })
            .collect();
        for head in 0..heads {
            let mut out = vec![f32::NAN; g * n];
            scan(&view, head, &queries, g, &depths, &mut out).unwrap();
            let (want, mag) = reference_scores(&view, head, &queries, g, &depths).unwrap();
            for i in 0..g * n {
                let err = (out[i] as f64 - want[i]).abs();
                assert!(
                    err <= REL * mag[i].max(f64::MIN_POSITIVE) + 1e-30,
                    "n={n} d={d} g={g} head={head} idx={i}: {} vs {} (mag {})",
                    out[i],
                    want[i],
                    mag[i]
                );
            }
        }
    }
}

#[test]
fn scan_matches_reference_at_several_sizes() {
    for (i, &(n, heads, d, g)) in [
        (1, 1, 4, 1),
        (63, 1, 8, 3),
        (64, 2, 16, 4),
        (65, 1, 64, 3),
        (1000, 2, 128, 4),
        (5000, 1, 128, 7),
        (3000, 1, 256, 4),
        (300, 1, 32, 11), // more heads than one register tile
    ]
    .iter()
    .enumerate()
    {
        check(n, heads, d, g, 100 + i as u64);
    }
}

#[test]
fn zero_depth_gives_zero_scores_and_reads_nothing() {
    let dims = Dims {
        heads: 1,
        channels: 8,
    };
    let keys: Vec<f32> = (0..100 * 8).map(|i| i as f32 * 0.01).collect();
    let store = KeyStore::from_keys(dims, &keys, None).unwrap();
    let mut out = vec![1f32; 100];
    scan(&store.view(), 0, &[1.0; 8], 1, &[0; 8], &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 0.0));
    assert_eq!(bytes_read(&[0; 8], 100), 0);
    // 2 blocks, channel 0 at 3 planes: 3·2·8 word bytes + 2·2 scale bytes.
    assert_eq!(bytes_read(&[3, 0, 0, 0, 0, 0, 0, 0], 100), 52);
}

#[test]
fn bad_shapes_are_errors() {
    let dims = Dims {
        heads: 2,
        channels: 4,
    };
    let store = KeyStore::from_keys(dims, &[0.5; 10 * 8], None).unwrap();
    let v = store.view();
    let mut out = vec![0f32; 10];
    assert!(matches!(
        scan(&v, 2, &[0.0; 4], 1, &[1; 4], &mut out),
        Err(ScanError::Head { .. })
    ));
    assert!(matches!(
        scan(&v, 0, &[0.0; 3], 1, &[1; 4], &mut out),
        Err(ScanError::Shape { .. })
    ));
    assert!(matches!(
        scan(&v, 0, &[0.0; 4], 1, &[5; 4], &mut out),
        Err(ScanError::Depth { .. })
    ));
    assert!(matches!(
        scan(&v, 0, &[0.0; 4], 1, &[1; 4], &mut out[..9]),
        Err(ScanError::Shape { .. })
    ));
}
