//! Inputs found by the `store` fuzz target (`fuzz/fuzz_targets/store.rs`), kept as
//! regression tests: each must be rejected with an error, quickly, without a panic.

use fathom_store::file::{FileHeader, MAGIC, VERSION};
use fathom_store::{KeyStore, MappedStore, StoreError};

/// A 64-byte header with no payload and a valid CRC-32.
fn header_only(heads: u32, channels: u32) -> Vec<u8> {
    let h = FileHeader {
        magic: MAGIC,
        version: VERSION,
        header_len: 64,
        heads,
        channels,
        tokens: 0,
        nblocks: 0,
        tail_len: 0,
        basis_kind: 0,
        payload_len: 0,
        checksum: 0,
        flags: 0,
    };
    let mut b = bytemuck::bytes_of(&h).to_vec();
    let mut crc = crc32fast::Hasher::new();
    crc.update(&b[..56]);
    crc.update(&b[60..]);
    let c = crc.finalize();
    b[56..60].copy_from_slice(&c.to_le_bytes());
    b
}

#[test]
fn an_empty_store_claiming_huge_shapes_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("huge.fks");
    // 2³² − 1 heads × 2³² − 1 channels overflowed `heads · channels · 4` in the loader; 2²⁰ ×
    // 2²⁰ made it loop 2⁴² times over empty slices.
    for (h, c) in [(u32::MAX, u32::MAX), (1 << 20, 1 << 20), (1, 1 << 25)] {
        std::fs::write(&p, header_only(h, c)).unwrap();
        let t = std::time::Instant::now();
        assert!(
            matches!(KeyStore::load(&p), Err(StoreError::CorruptHeader { .. })),
            "{h} × {c}"
        );
        assert!(
            matches!(MappedStore::open(&p), Err(StoreError::CorruptHeader { .. })),
            "{h} × {c}"
        );
        // Generous for a loaded CI machine; work per channel would take far longer.
        assert!(t.elapsed().as_secs() < 10);
    }
    // The fuzzer's input (a libFuzzer timeout): 1 head × 7 995 394 channels, no tokens. Within
    // the bound, so a valid empty store, but loading it must not do work per channel.
    std::fs::write(&p, header_only(1, 7_995_394)).unwrap();
    let t = std::time::Instant::now();
    assert_eq!(KeyStore::load(&p).unwrap().tokens(), 0);
    assert!(MappedStore::open(&p).is_ok());
    assert!(t.elapsed().as_secs_f64() < 3.0, "{:?}", t.elapsed());
    // The bound is the in-memory one: 2¹² × 2¹² channels with no tokens is still a store.
    std::fs::write(&p, header_only(1 << 12, 1 << 12)).unwrap();
    assert_eq!(KeyStore::load(&p).unwrap().tokens(), 0);
}
