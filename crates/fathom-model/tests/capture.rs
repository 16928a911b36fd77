//! Captures reproduce their own attention output: softmax(q·kᵀ/√D)·v over the visible keys
//! equals `layers.{l}.o`, on fresh SmolLM2 and Gemma 3 captures (Gemma's sliding-window layers
//! too) when the models are cached. (The CLI's embedded fixture is checked in fathom-cli.)

mod common;

use std::collections::BTreeMap;

use fathom_model::capture::{
    capture, capture_with_progress, max_relative_o_error, CaptureDtype, CaptureOptions,
};
use safetensors::SafeTensors;

fn f32s(st: &SafeTensors<'_>, name: &str) -> (Vec<f32>, Vec<usize>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    let v = match t.dtype() {
        safetensors::Dtype::F16 => t
            .data()
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        safetensors::Dtype::BF16 => t
            .data()
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        safetensors::Dtype::F32 => t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        d => panic!("{name}: dtype {d:?}"),
    };
    (v, t.shape().to_vec())
}

/// Check every layer of a capture file; returns the worst relative error per layer.
fn check_file(bytes: &[u8], tol: f32) -> Vec<(usize, f32)> {
    let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
    let meta: BTreeMap<String, String> = meta.metadata().clone().unwrap().into_iter().collect();
    let st = SafeTensors::deserialize(bytes).unwrap();
    let positions: Vec<usize> = serde_json::from_str(&meta["positions"]).unwrap();
    let layers: Vec<usize> = serde_json::from_str(&meta["layers"]).unwrap();
    let kinds: Vec<String> = serde_json::from_str(&meta["layer_kinds"]).unwrap();
    assert!(meta["qk_norm"] == "true" || meta["qk_norm"] == "false");
    let mut out = Vec::new();
    for l in layers {
        let (q, qs) = f32s(&st, &format!("layers.{l}.q"));
        let (k, ks) = f32s(&st, &format!("layers.{l}.k"));
        let (v, _) = f32s(&st, &format!("layers.{l}.v"));
        let (o, os) = f32s(&st, &format!("layers.{l}.o"));
        assert_eq!(qs, os);
        assert_eq!(qs[0], positions.len());
        let window = kinds[l]
            .strip_prefix("local:")
            .map(|w| w.parse::<usize>().unwrap());
        let err = max_relative_o_error(&q, &k, &v, &o, &positions, (qs[1], ks[1], qs[2]), window);
        assert!(err < tol, "layer {l}: relative error {err}");
        out.push((l, err));
    }
    out
}

/// f16 storage of q, k, v and o: each value carries ≈ 2^-11 relative rounding; the recomputed
/// output then differs by a few 1e-3 (measured ≤ 4.3e-3 on the CLI's fixture). 1e-2 still catches any wrong mask,
/// position or head mapping (those give errors of order 1).
const F16_TOL: f32 = 1e-2;
/// f32 storage: only summation order differs.
const F32_TOL: f32 = 1e-4;

#[test]
fn fresh_smollm2_capture_is_consistent() {
    let Some(m) = common::smollm2() else { return };
    let ids = m.tokenizer().encode(common::LONG_TEXT).unwrap();
    let opts = CaptureOptions {
        positions: 4,
        layers: Some(vec![4, 14, 24]),
        chunk: 256,
    };
    let seen = std::sync::Mutex::new(Vec::new());
    let cap = capture_with_progress(m, "smollm2-135m", &ids[..600], &opts, &|done, total| {
        seen.lock().unwrap().push((done, total))
    })
    .unwrap();
    // One report per 256-token chunk, the last at the whole context.
    assert_eq!(
        seen.into_inner().unwrap(),
        [(256, 600), (512, 600), (600, 600)]
    );
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.safetensors");
    cap.write_safetensors(&p, CaptureDtype::F16).unwrap();
    let errs = check_file(&std::fs::read(&p).unwrap(), F16_TOL);
    eprintln!("smollm2 f16: worst relative error of o per layer {errs:?}");
    assert_eq!(cap.metadata["model"], "smollm2-135m");
    assert_eq!(cap.metadata["rope_channel_order"], "interleaved-pairs");
}

#[test]
fn fresh_gemma_capture_is_consistent_on_local_and_global_layers() {
    let Some(m) = common::gemma3() else { return };
    let ids = m.tokenizer().encode(common::LONG_TEXT).unwrap();
    let ids = &ids[..700];
    let opts = CaptureOptions {
        positions: 4,
        layers: Some(vec![0, 5]),
        chunk: 256,
    };
    let cap = capture(m, "gemma3-270m", ids, &opts).unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (dt, tol) in [(CaptureDtype::F32, F32_TOL), (CaptureDtype::F16, F16_TOL)] {
        let p = dir.path().join("c.safetensors");
        cap.write_safetensors(&p, dt).unwrap();
        let errs = check_file(&std::fs::read(&p).unwrap(), tol);
        eprintln!("gemma {dt:?}: {errs:?}");
    }
    assert_eq!(cap.metadata["qk_norm"], "true");
    assert!(cap.metadata["layer_kinds"].starts_with("[\"local:512\""));
}
