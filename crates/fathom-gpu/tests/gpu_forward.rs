//! The GPU forward on the device against the CPU runtime in its bf16 mode, on both real
//! models, each logit row within the bf16 rounding noise of its step (`fathom_gpu::parity`:
//! the distance of the bf16 CPU runtime from the f32 one on the same tokens): chunked prefill logits (Gemma's prompt is longer than its 512-token window, so the
//! sliding layers really slide), forked sessions decoding in one batch, exact top-k equal to
//! dense where it selects every token, and bad calls refused before anything changes.
//!
//! Skips (printing why) without a GPU path or without the model in the local cache (as on
//! CI); `FATHOM_REQUIRE_GPU=1` turns either skip into a failure.

use fathom_cuda::cache::AttendMethod;
use fathom_cuda::prelude::*;
use fathom_cuda::{CudaError, Gpu, Method};
use fathom_gpu::parity::{max_abs_diff, NOISE_FACTOR};
use fathom_gpu::{Attention, Decoder, DecoderConfig, GpuDecoder, GpuError};
use fathom_model::fetch::{fetch_model, FetchOptions, ModelId};
use fathom_model::{argmax, Dense, DenseWeights, LoadOptions, Model, WeightMode};
use fathom_plan::SelectParams;

/// Real text (fathom-model's frozen test prompt: its own source at commit a7bc0bd).
const TEXT: &str = include_str!("../../fathom-model/tests/data/long_text.rs.txt");

fn required() -> bool {
    std::env::var("FATHOM_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e @ (CudaError::NotCompiledWithCuda | CudaError::NoDevice { .. })) => {
            assert!(
                !required(),
                "FATHOM_REQUIRE_GPU=1 and there is no GPU path: {e}"
            );
            eprintln!("skipping GPU test: {e}");
            None
        }
        Err(e) => panic!("unexpected error opening the GPU: {e}"),
    }
}

/// The bf16 CPU runtime (the reference), the f32 one (whose distance from it is the bf16
/// rounding noise the GPU must stay within, `fathom_gpu::parity`) and the dense weights.
fn model(id: ModelId) -> Option<(Model, Model, DenseWeights)> {
    let opts = FetchOptions {
        offline: true,
        ..Default::default()
    };
    match fetch_model(id, &opts) {
        Ok(p) => {
            let load = |weights| Model::load(&p, &LoadOptions { weights }).unwrap();
            Some((
                load(WeightMode::Bf16),
                load(WeightMode::Dequantized),
                DenseWeights::load(&p).unwrap(),
            ))
        }
        Err(e) => {
            assert!(
                !required(),
                "FATHOM_REQUIRE_GPU=1 and model {id} is missing: {e}"
            );
            eprintln!("skipping: model {id} not in the cache ({e})");
            None
        }
    }
}

fn dense() -> Attention {
    Attention {
        method: AttendMethod::Dense,
        params: SelectParams {
            sink: 4,
            local: 32,
            k: 256,
        },
    }
}

#[test]
fn prefill_and_forked_decodes_match_the_bf16_cpu_runtime() {
    let Some(gpu) = gpu() else { return };
    for (id, n) in [(ModelId::Smollm2_135m, 600), (ModelId::Gemma3_270m, 700)] {
        let Some((cpu, f32m, w)) = model(id) else {
            continue;
        };
        let ids = cpu.tokenizer().encode(TEXT).unwrap();
        let ids = &ids[..n];
        let mut dcfg = DecoderConfig::new(4, 1024);
        dcfg.prefill_chunk = 192;
        dcfg.max_k = 1024;
        let mut dec = GpuDecoder::new(&gpu, &w, dcfg).unwrap();
        let s = dec.create().unwrap();
        let g0 = dec.prefill(s, ids).unwrap();
        let mut cache = cpu.new_cache(n + 8);
        let c0 = cpu.prefill(ids, &mut cache, 256, None).unwrap();
        let mut fcache = f32m.new_cache(n + 8);
        let f0 = f32m.prefill(ids, &mut fcache, 256, None).unwrap();
        let (d0, n0, g0n) = (
            max_abs_diff(&g0, &c0),
            max_abs_diff(&f0, &c0),
            max_abs_diff(&f0, &g0),
        );
        eprintln!("{id}: prefill of {n} (GPU chunks 192, CPU 256): max |Δlogit| GPU−CPU {d0:.2e}; from f32: GPU {g0n:.2e}, CPU bf16 {n0:.2e}");
        assert!(
            g0n <= NOISE_FACTOR * n0,
            "{id} prefill: {g0n} vs noise {n0}"
        );

        // A fork decodes beside its parent in one batch: the same tokens give the same
        // logits on both, and both track the CPU; a third session attends with exact top-k
        // at a k that keeps every token, which is dense attention.
        let f = dec.fork(s).unwrap();
        let x = dec.fork(s).unwrap();
        let exact = Attention {
            method: AttendMethod::Scan(Method::Exact),
            params: SelectParams {
                sink: 4,
                local: 32,
                k: 1024,
            },
        };
        let mut tok = argmax(&c0);
        for step in 0..4 {
            let out = dec.decode(&[(s, tok), (f, tok)], &dense()).unwrap();
            let ex = dec.decode(&[(x, tok)], &exact).unwrap();
            let v = cpu.config().vocab_size;
            let c = cpu.decode_step(tok, &mut cache, &mut Dense, None).unwrap();
            let fl = f32m
                .decode_step(tok, &mut fcache, &mut Dense, None)
                .unwrap();
            let noise = max_abs_diff(&fl, &c);
            let (ds, df, dx) = (
                max_abs_diff(&out[..v], &fl),
                max_abs_diff(&out[v..], &fl),
                max_abs_diff(&ex, &fl),
            );
            eprintln!("{id} step {step}: max |Δlogit| from f32: parent {ds:.2e}, fork {df:.2e}, exact top-k {dx:.2e}; CPU bf16 {noise:.2e}");
            let tol = NOISE_FACTOR * noise;
            assert!(
                ds <= tol && df <= tol && dx <= tol,
                "{id} step {step}: past {NOISE_FACTOR}× the bf16 rounding noise {noise}"
            );
            assert!(
                max_abs_diff(&out[..v], &out[v..]) <= 1e-4,
                "{id}: fork and parent"
            );
            tok = argmax(&c);
        }
        assert_eq!(dec.len(s).unwrap(), n + 4);
        assert_eq!(dec.len(f).unwrap(), n + 4);
    }
}

#[test]
fn bad_calls_are_refused_before_anything_changes() {
    let Some(gpu) = gpu() else { return };
    let Some((cpu, _, w)) = model(ModelId::Smollm2_135m) else {
        return;
    };
    let mut dec = GpuDecoder::new(&gpu, &w, DecoderConfig::new(2, 256)).unwrap();
    let s = dec.create().unwrap();
    dec.prefill(s, &[1, 2, 3]).unwrap();
    let vocab = cpu.config().vocab_size as u32;
    let bad = |r: fathom_gpu::Result<Vec<f32>>| match r {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted"),
    };
    let e = bad(dec.prefill(s, &[5, vocab]));
    assert!(e.contains("token 1 is id"), "{e}");
    let e = bad(dec.prefill(s, &vec![1; 300]));
    assert!(e.contains("max_tokens"), "{e}");
    let e = bad(dec.decode(&[(s, vocab + 7)], &dense()));
    assert!(e.contains("vocabulary"), "{e}");
    let fathom = Attention {
        method: AttendMethod::Scan(Method::Fathom(48.0)),
        params: dense().params,
    };
    let e = bad(dec.decode(&[(s, 5)], &fathom));
    assert!(e.contains("σ²"), "{e}");
    // A selection the cache refuses is refused before the reserve and layer 0's append.
    for k in [0, 100_000] {
        let mut a = dense();
        a.params.k = k;
        let e = bad(dec.decode(&[(s, 5)], &a));
        assert!(e.contains("max_k"), "k = {k}: {e}");
    }
    let nan = Attention {
        method: AttendMethod::Scan(Method::Fathom(f32::NAN)),
        params: dense().params,
    };
    assert!(dec.decode(&[(s, 5)], &nan).is_err());
    assert_eq!(dec.len(s).unwrap(), 3, "nothing was appended");
    dec.free(s).unwrap();
    assert!(matches!(
        dec.decode(&[(s, 5)], &dense()),
        Err(GpuError::Cuda(_))
    ));
    // The decoder still works after every refusal.
    let t = dec.create().unwrap();
    assert_eq!(dec.prefill(t, &[1, 2, 3]).unwrap().len(), vocab as usize);
}
