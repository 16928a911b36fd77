//! docs/SPEC.md §8 capture reading: a valid capture round-trips; violations get errors naming the tensor.

use fathom_bench::capture::{capture_bytes, Capture};
use fathom_bench::synthetic::{generate, SyntheticParams};
use fathom_bench::tensors::{to_safetensors, WriteDtype};
use std::collections::HashMap;

fn small() -> (
    fathom_bench::capture::CaptureInfo,
    Vec<fathom_bench::capture::LayerData>,
) {
    generate(&SyntheticParams {
        layers: 2,
        hkv: 2,
        g: 2,
        d: 8,
        n: 100,
        p: 3,
        ..Default::default()
    })
}

#[test]
fn roundtrip() {
    let dir = tempfile::tempdir().unwrap();
    let (info, layers) = small();
    let path = dir.path().join("c.safetensors");
    std::fs::write(
        &path,
        capture_bytes(&info, &layers, WriteDtype::F32).unwrap(),
    )
    .unwrap();
    let c = Capture::open(&path).unwrap();
    assert_eq!(c.info().positions, info.positions);
    assert_eq!(
        (c.info().hq, c.info().hkv, c.info().d, c.info().n),
        (4, 2, 8, 100)
    );
    assert_eq!(c.layer(1).unwrap().k, layers[1].k);
}

fn expect_err(tensors: &[(&str, &[f32], &[usize])], meta: &[(&str, &str)], needle: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    let m: HashMap<String, String> = meta
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    std::fs::write(
        &path,
        to_safetensors(tensors, WriteDtype::F32, Some(m)).unwrap(),
    )
    .unwrap();
    let err = match Capture::open(&path) {
        Err(e) => e.to_string(),
        Ok(c) => match c.layer(0) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("accepted a bad capture ({needle})"),
        },
    };
    assert!(err.contains(needle), "error {err:?} lacks {needle:?}");
}

#[test]
fn violations_name_the_tensor() {
    let q = vec![0.5f32; 2 * 4 * 8];
    let k = vec![0.5f32; 10 * 2 * 8];
    let pos = [("positions", "[5, 9]")];
    // Missing v.
    expect_err(
        &[
            ("layers.0.q", &q, &[2, 4, 8]),
            ("layers.0.k", &k, &[10, 2, 8]),
        ],
        &pos,
        "layers.0.v",
    );
    // Heads that do not divide.
    let k3 = vec![0.5f32; 10 * 3 * 8];
    expect_err(
        &[
            ("layers.0.q", &q, &[2, 4, 8]),
            ("layers.0.k", &k3, &[10, 3, 8]),
            ("layers.0.v", &k3, &[10, 3, 8]),
        ],
        &pos,
        "do not divide",
    );
    // A position beyond N.
    let ok = [
        ("layers.0.q", &q[..], &[2usize, 4, 8][..]),
        ("layers.0.k", &k, &[10, 2, 8]),
        ("layers.0.v", &k, &[10, 2, 8]),
    ];
    expect_err(&ok, &[("positions", "[5, 10]")], "positions[1] = 10");
    // NaN in a tensor: named with its index.
    let mut kn = k.clone();
    kn[3 * 16 + 8 + 2] = f32::NAN;
    expect_err(
        &[
            ("layers.0.q", &q, &[2, 4, 8]),
            ("layers.0.k", &kn, &[10, 2, 8]),
            ("layers.0.v", &k, &[10, 2, 8]),
        ],
        &pos,
        "layers.0.k` holds NaN at index [3, 1, 2]",
    );
    // Wrong rank.
    expect_err(
        &[
            ("layers.0.q", &q, &[8, 8]),
            ("layers.0.k", &k, &[10, 2, 8]),
            ("layers.0.v", &k, &[10, 2, 8]),
        ],
        &pos,
        "layers.0.q",
    );
    // Missing positions.
    expect_err(&ok, &[], "positions");
}
