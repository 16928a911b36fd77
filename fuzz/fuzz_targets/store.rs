//! Store loader: `KeyStore::load` and `MappedStore::open` (then a full view walk) on arbitrary
//! bytes. Half of the inputs get their CRC-32 recomputed, so mutations reach the semantic
//! checks behind the checksum instead of stopping at it.
#![no_main]

use fathom_store::{KeyStore, MappedStore};
use libfuzzer_sys::fuzz_target;

fn crc_fixed(data: &[u8]) -> Option<Vec<u8>> {
    if data.len() < 64 {
        return None;
    }
    let mut v = data.to_vec();
    let h = crc32fast_like(&v[..56], &v[60..]);
    v[56..60].copy_from_slice(&h.to_le_bytes());
    Some(v)
}

/// CRC-32 (IEEE), bitwise: the fuzz crate keeps its dependencies to the readers.
fn crc32fast_like(a: &[u8], b: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &x in a.iter().chain(b) {
        crc ^= x as u32;
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

fn check(bytes: &[u8]) {
    let path = fathom_fuzz_path("store");
    std::fs::write(&path, bytes).expect("write the fuzz input");
    if let Ok(s) = KeyStore::load(&path) {
        let v = s.view();
        if v.dims().heads * v.dims().channels > 1 << 16 {
            return;
        }
        let _ = v.dequant_prefix(4);
        // What we write from a loaded store must load again to the same bytes.
        let again = fathom_store::file::to_bytes(&v);
        let p2 = fathom_fuzz_path("store-again");
        std::fs::write(&p2, &again).expect("write");
        let s2 = KeyStore::load(&p2).expect("a store we wrote must load");
        assert_eq!(fathom_store::file::to_bytes(&s2.view()), again);
    }
    if let Ok(m) = MappedStore::open(&path) {
        let v = m.view();
        let d = v.dims();
        if d.heads * d.channels > 1 << 16 {
            // A valid empty store of up to 2²⁴ channels: walking it is the harness's own
            // cost (linear in what the header claims), not the loader's.
            return;
        }
        let _ = v.dequant_prefix(2);
        for h in 0..d.heads {
            for c in 0..d.channels {
                let _ = v.channel_run(h, c, 4);
                let _ = v.channel_scales(h, c);
            }
        }
    }
}

fn fathom_fuzz_path(name: &str) -> std::path::PathBuf {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    dir.join(format!("fathom-fuzz-{name}-{}", std::process::id()))
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if let Some(v) = crc_fixed(data) {
        if v != data {
            check(&v);
        }
    }
});
