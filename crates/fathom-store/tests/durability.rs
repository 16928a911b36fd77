//! Durability: a crash mid-write never leaves a file that loads as valid. Files are
//! written through temporary file, fsync and rename (`write_atomic`), so a reader sees either
//! the old file or the whole new one; and should a truncated file ever appear (a copy cut
//! short, a full disk), no prefix of a saved store loads. Checked at every 4 KiB offset (the
//! page-cache granularity a crash would cut at) and at odd offsets in between.

use fathom_store::{Basis, BasisKind, Dims, KeyStore, MappedStore};

fn keys(n: usize, row: usize) -> Vec<f32> {
    (0..n * row)
        .map(|i| (((i * 2654435761) % 1000) as f32 / 100.0) - 5.0)
        .collect()
}

fn assert_no_prefix_loads(bytes: &[u8], what: &str) -> usize {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.fks");
    let mut offsets: Vec<usize> = (0..bytes.len()).step_by(4096).collect();
    offsets.extend((1..bytes.len()).step_by(4093));
    offsets.extend([1, 8, 63, 64, 65, bytes.len() - 1]);
    for &cut in &offsets {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        assert!(
            KeyStore::load(&path).is_err(),
            "{what}: a prefix of {cut} bytes loads"
        );
        assert!(
            MappedStore::open(&path).is_err(),
            "{what}: a prefix of {cut} bytes maps"
        );
    }
    std::fs::write(&path, bytes).unwrap();
    assert!(
        KeyStore::load(&path).is_ok(),
        "{what}: the whole file loads"
    );
    offsets.len()
}

#[test]
fn no_truncated_store_loads() {
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    // Raw with a partial last block (tail), and a rotated store (basis section at the end).
    let dims = Dims {
        heads: 2,
        channels: 64,
    };
    let raw = KeyStore::from_keys(dims, &keys(3001, dims.row()), None).unwrap();
    let mut id = vec![0f32; 2 * 64 * 64];
    for h in 0..2 {
        for i in 0..64 {
            id[h * 64 * 64 + i * 64 + (63 - i)] = 1.0;
        }
    }
    let basis = Basis::new(BasisKind::Custom, 2, 64, id).unwrap();
    let rot = KeyStore::from_keys(dims, &keys(1000, dims.row()), Some(basis)).unwrap();
    for (name, s) in [("raw", &raw), ("rotated", &rot)] {
        let p = dir.path().join(format!("{name}.fks"));
        s.save(&p).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert!(
            bytes.len() > 8 * 4096,
            "{name}: the fixture spans many pages"
        );
        checked += assert_no_prefix_loads(&bytes, name);
    }
    eprintln!("durability: {checked} truncated stores rejected");
}

#[test]
fn a_failed_save_leaves_the_old_file_and_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.fks");
    let dims = Dims {
        heads: 1,
        channels: 8,
    };
    let old = KeyStore::from_keys(dims, &keys(100, 8), None).unwrap();
    old.save(&p).unwrap();
    let before = std::fs::read(&p).unwrap();
    // A writer that fails half way (a crash stand-in): the target keeps its old bytes.
    let r = fathom_store::write_atomic_with(&p, |w| {
        use std::io::Write;
        w.write_all(&before[..before.len() / 2])?;
        Err(std::io::Error::other("simulated crash"))
    });
    assert!(r.is_err());
    assert_eq!(std::fs::read(&p).unwrap(), before);
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        vec!["s.fks".to_string()],
        "no temporary file is left"
    );
    assert!(KeyStore::load(&p).is_ok());
}

#[test]
fn concurrent_saves_to_one_path_leave_one_whole_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.fks");
    let dims = Dims {
        heads: 1,
        channels: 16,
    };
    let stores: Vec<KeyStore> = (0..8)
        .map(|i| KeyStore::from_keys(dims, &keys(200 + 64 * i, 16), None).unwrap())
        .collect();
    std::thread::scope(|sc| {
        for s in &stores {
            let p = &p;
            sc.spawn(move || {
                for _ in 0..20 {
                    s.save(p).unwrap();
                }
            });
        }
    });
    let loaded = KeyStore::load(&p).expect("a whole file");
    assert!(stores.iter().any(|s| s.tokens() == loaded.tokens()));
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary file is left"
    );
}
