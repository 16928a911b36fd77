//! Out-of-contract inputs of the public store API: impossible capacities, unknown flags and
//! out-of-range accessors give typed errors (or a documented panic for a programming error),
//! never an abort, a file the loader refuses, or a neighbour's words.

use fathom_store::file::{FLAG_SQUEEZE_HEADS, KNOWN_FLAGS};
use fathom_store::{Basis, BasisKind, Dims, KeyStore, StoreError};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn keys(seed: u64, n: usize, row: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n * row).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

const ONE: Dims = Dims {
    heads: 1,
    channels: 4,
};

/// A capacity whose sizes overflow, or that no allocator can give, is a typed error from
/// `with_capacity`, `reserve` and `load_with_capacity` (the Python binding passes the user's
/// capacity), never a "capacity overflow" panic or an allocation abort; a failed `reserve`
/// leaves the store as it was.
#[test]
fn impossible_capacities_are_typed_errors() {
    let wide = Dims {
        heads: 8,
        channels: 128,
    };
    for (dims, cap) in [
        (ONE, 1usize << 62),
        (ONE, usize::MAX),
        (wide, 1 << 50),
        (wide, usize::MAX - 3),
    ] {
        let r = KeyStore::with_capacity(dims, cap, None);
        assert!(
            matches!(r, Err(StoreError::Dims(_) | StoreError::OutOfMemory { .. })),
            "{dims:?} × {cap}: {:?}",
            r.map(|s| s.capacity())
        );
    }
    let ks = keys(1, 70, 4);
    let mut s = KeyStore::from_keys(ONE, &ks, None).unwrap();
    let before = s.view().dequant_prefix(4).unwrap();
    for cap in [1usize << 62, usize::MAX] {
        assert!(matches!(
            s.reserve(cap),
            Err(StoreError::Dims(_) | StoreError::OutOfMemory { .. })
        ));
        assert_eq!(s.capacity(), 128);
        assert_eq!(s.view().dequant_prefix(4).unwrap(), before);
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.fks");
    s.save(&path).unwrap();
    for cap in [1usize << 62, usize::MAX] {
        assert!(matches!(
            KeyStore::load_with_capacity(&path, cap),
            Err(StoreError::Dims(_) | StoreError::OutOfMemory { .. })
        ));
    }
    let back = KeyStore::load_with_capacity(&path, 1000).unwrap();
    assert_eq!(back.capacity(), 1024);
    assert_eq!(back.view().dequant_prefix(4).unwrap(), before);
}

/// Flags the loader would refuse are refused by `save`, before anything is written; the
/// known flag round-trips.
#[test]
fn unknown_flags_are_refused_before_writing() {
    let mut s = KeyStore::from_keys(ONE, &keys(2, 10, 4), None).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for bad in [2u32, 0x8000_0000, FLAG_SQUEEZE_HEADS | 4, u32::MAX] {
        s.set_flags(bad);
        let path = dir.path().join(format!("bad-{bad:x}.fks"));
        assert!(matches!(
            s.save(&path),
            Err(StoreError::UnknownFlags { flags, known: KNOWN_FLAGS }) if flags == bad
        ));
        assert!(!path.exists(), "{bad:#x}: a file was written");
    }
    s.set_flags(FLAG_SQUEEZE_HEADS);
    let path = dir.path().join("ok.fks");
    s.save(&path).unwrap();
    assert_eq!(
        KeyStore::load(&path).unwrap().view().flags(),
        FLAG_SQUEEZE_HEADS
    );
}

fn panics(f: impl FnOnce() + std::panic::UnwindSafe) -> bool {
    std::panic::catch_unwind(f).is_err()
}

/// Out-of-range heads, channels, planes and tokens, and short vectors, panic (the documented
/// programming-error contract) instead of reading a neighbour's words or a zero-padded vector.
#[test]
fn accessors_out_of_range_panic_instead_of_reading_neighbours() {
    let dims = Dims {
        heads: 2,
        channels: 4,
    };
    let mut rng = StdRng::seed_from_u64(3);
    let mats: Vec<f32> = (0..2 * 16)
        .map(|i| if i % 16 % 5 == 0 { 1.0 } else { 0.0 })
        .collect();
    let basis = Basis::new(BasisKind::Custom, 2, 4, mats).unwrap();
    let ks: Vec<f32> = (0..100 * 8).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let s = KeyStore::from_keys(dims, &ks, Some(basis.clone())).unwrap();
    let v = s.view();
    // In range: fine.
    assert_eq!(v.channel_run(1, 3, 4).len(), 3 * 2 + 2);
    assert_eq!(v.plane(1, 3, 3).len(), 2);
    assert_eq!(v.channel_scales(1, 3).len(), 2);
    let _ = v.code(99, 1, 3);
    let mut out = [0f32; 4];
    v.rotate_query(1, &[1.0; 4], &mut out);
    basis.rotate(1, &[1.0; 4], &mut out);
    basis.unrotate(1, &[1.0; 4], &mut out);
    // Out of range: each panics.
    assert!(panics(|| {
        let _ = v.channel_run(0, 0, 5);
    }));
    assert!(panics(|| {
        let _ = v.channel_run(0, 4, 1);
    }));
    assert!(panics(|| {
        let _ = v.channel_run(2, 0, 1);
    }));
    assert!(panics(|| {
        let _ = v.plane(0, 0, 4);
    }));
    assert!(panics(|| {
        let _ = v.plane(0, 4, 0);
    }));
    assert!(panics(|| {
        let _ = v.plane(2, 0, 0);
    }));
    assert!(panics(|| {
        let _ = v.channel_scales(0, 4);
    }));
    assert!(panics(|| {
        let _ = v.channel_scales(2, 0);
    }));
    assert!(panics(|| {
        let _ = v.code(100, 0, 0);
    }));
    assert!(panics(|| v.rotate_query(2, &[1.0; 4], &mut [0.0; 4])));
    assert!(panics(|| v.rotate_query(0, &[1.0; 3], &mut [0.0; 4])));
    assert!(panics(|| v.rotate_query(0, &[1.0; 4], &mut [0.0; 3])));
    assert!(panics(|| basis.rotate(2, &[1.0; 4], &mut [0.0; 4])));
    assert!(panics(|| basis.rotate(0, &[1.0; 3], &mut [0.0; 4])));
    assert!(panics(|| basis.rotate(0, &[1.0; 4], &mut [0.0; 3])));
    assert!(panics(|| basis.unrotate(0, &[1.0; 3], &mut [0.0; 4])));
    assert!(panics(|| basis.unrotate(0, &[1.0; 4], &mut [0.0; 3])));
    assert!(panics(|| {
        let _ = basis.matrix(2);
    }));
    // A raw store, too.
    let raw = KeyStore::from_keys(dims, &ks, None).unwrap();
    let rv = raw.view();
    assert!(panics(|| rv.rotate_query(2, &[1.0; 4], &mut [0.0; 4])));
    assert!(panics(|| rv.rotate_query(0, &[1.0; 5], &mut [0.0; 5])));
}
