//! Durability: no truncated capture or calibration file loads as valid. Checked at
//! every 4 KiB offset and at odd offsets in between.

use fathom_bench::calib::Calibration;
use fathom_bench::capture::{capture_bytes, Capture};
use fathom_bench::synthetic::{generate, SyntheticParams};
use fathom_bench::tensors::WriteDtype;

fn offsets(len: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..len).step_by(4096).collect();
    v.extend((1..len).step_by(4093));
    v.extend([1, 7, 8, 9, len - 1]);
    v
}

#[test]
fn no_truncated_capture_opens() {
    let (info, layers) = generate(&SyntheticParams {
        layers: 2,
        hkv: 2,
        g: 2,
        d: 16,
        n: 512,
        p: 4,
        channel_sigma: 1.0,
        seed: 3,
    });
    let bytes = capture_bytes(&info, &layers, WriteDtype::F16).unwrap();
    assert!(bytes.len() > 16 * 4096);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cut.safetensors");
    let offs = offsets(bytes.len());
    for &cut in &offs {
        std::fs::write(&p, &bytes[..cut]).unwrap();
        // Opening checks the schema; reading every layer checks the data.
        let loaded = Capture::open(&p).and_then(|c| {
            for &l in &c.info().layers.clone() {
                c.layer(l)?;
            }
            Ok(())
        });
        assert!(
            loaded.is_err(),
            "a capture cut at {cut} of {} bytes loads",
            bytes.len()
        );
    }
    std::fs::write(&p, &bytes).unwrap();
    assert!(Capture::open(&p).is_ok());
    eprintln!("durability: {} truncated captures rejected", offs.len());
}

#[test]
fn no_truncated_calibration_loads() {
    // A real calibration document: statistics of a small synthetic capture, written by the
    // same serializer `fathom calibrate` uses.
    let (info, layers) = generate(&SyntheticParams {
        layers: 2,
        hkv: 2,
        g: 2,
        d: 32,
        n: 256,
        p: 4,
        channel_sigma: 1.0,
        seed: 4,
    });
    let cal = Calibration::statistics_only(
        &fathom_bench::fidelity::InMemory { info, layers },
        "synthetic",
    )
    .unwrap();
    let bytes = serde_json::to_vec(&cal).unwrap();
    assert!(bytes.len() > 8 * 4096, "{} bytes", bytes.len());
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cut.json");
    let offs = offsets(bytes.len());
    for &cut in &offs {
        std::fs::write(&p, &bytes[..cut]).unwrap();
        assert!(
            Calibration::load(&p).is_err(),
            "a calibration cut at {cut} of {} bytes loads",
            bytes.len()
        );
    }
    std::fs::write(&p, &bytes).unwrap();
    assert!(Calibration::load(&p).is_ok());
    eprintln!("durability: {} truncated calibrations rejected", offs.len());
}

/// A workload with a non-finite key gives a typed error naming its layer, not a calibration of
/// NaN statistics (and not a panic).
#[test]
fn a_non_finite_workload_is_not_calibrated() {
    let (info, mut layers) = generate(&SyntheticParams {
        layers: 2,
        hkv: 2,
        g: 2,
        d: 32,
        n: 128,
        p: 4,
        channel_sigma: 1.0,
        seed: 5,
    });
    let bad = layers[1].index;
    layers[1].k[77] = f32::NAN;
    let e = Calibration::statistics_only(
        &fathom_bench::fidelity::InMemory { info, layers },
        "synthetic",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains(&format!("layer {bad}")), "{e}");
}
