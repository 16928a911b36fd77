//! The whole decode step as one CUDA graph (`GpuDecoder::capture_greedy` / `replay_greedy`)
//! against plain launches, on the device: a small llama-family model with **random weights**
//! and **synthetic K/V** (no data needed), two sessions of different lengths forked twice from
//! the same prefilled roots, teacher-forced with the same tokens, sample the same ids at every
//! step for dense and the scan methods in host and split residency. Also: the graph refuses
//! another batch, and a capture refuses instrumentation.
//!
//! Skips (printing why) without a GPU path (as on CI); `FATHOM_REQUIRE_GPU=1` turns the skip
//! into a failure.

use fathom_cuda::cache::AttendMethod;
use fathom_cuda::prelude::*;
use fathom_cuda::{CudaError, Gpu, Residency};
use fathom_gpu::{Attention, Decoder, DecoderConfig, GpuDecoder, GpuError};
use fathom_model::{Arch, Config, LayerKind, RopeStyle};
use fathom_plan::SelectParams;

fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e @ (CudaError::NotCompiledWithCuda | CudaError::NoDevice { .. })) => {
            assert!(
                std::env::var("FATHOM_REQUIRE_GPU").map_or(true, |v| v != "1"),
                "FATHOM_REQUIRE_GPU=1 and there is no GPU path: {e}"
            );
            eprintln!("skipping GPU test: {e}");
            None
        }
        Err(e) => panic!("unexpected error opening the GPU: {e}"),
    }
}

/// Two layers of a Qwen3-style block (QK-norm, GQA 4/2, D = 64), vocabulary 512.
fn small() -> Config {
    Config {
        arch: Arch::Llama,
        name: "graph-test (random)".into(),
        n_layers: 2,
        n_embd: 256,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        n_ff: 512,
        vocab_size: 512,
        rms_eps: 1e-6,
        rope_base: 1e6,
        rope_base_local: 1e6,
        rope_style: RopeStyle::Neox,
        layer_kinds: vec![LayerKind::Global; 2],
        context_length: 1 << 16,
        qk_norm: true,
        embed_scale: 1.0,
        attn_softcap: None,
    }
}

#[test]
fn a_replayed_step_samples_what_plain_launches_sample() {
    let Some(gpu) = gpu() else { return };
    let cfg = small();
    let d = cfg.head_dim;
    let steps = 6;
    for residency in [Residency::Host, Residency::IndexHbm] {
        let mut dcfg = DecoderConfig::new(8, 4096);
        dcfg.page_tokens = 256;
        dcfg.max_batch = 2;
        dcfg.max_k = 64;
        dcfg.residency = residency;
        let mut dec = GpuDecoder::random(&gpu, cfg.clone(), 3, dcfg).unwrap();
        let heads = fathom_gpu::presets::synthetic_calibration(&cfg);
        for l in 0..cfg.n_layers {
            dec.cache_mut()
                .unwrap()
                .load_calibration(l, &heads)
                .unwrap();
        }
        let roots: Vec<_> = [2900usize, 1100]
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let s = dec.create().unwrap();
                dec.fill_synthetic(s, n, i as u64).unwrap();
                s
            })
            .collect();
        for m in ["dense", "fathom:48", "sparq:16", "exact"] {
            let att = Attention {
                method: AttendMethod::parse(m, d).unwrap(),
                params: SelectParams {
                    sink: 4,
                    local: 32,
                    k: 64,
                },
            };
            let plain: Vec<_> = roots.iter().map(|&s| dec.fork(s).unwrap()).collect();
            let graphed: Vec<_> = roots.iter().map(|&s| dec.fork(s).unwrap()).collect();
            // Teacher forcing: both sides get the plain side's tokens.
            let mut toks = vec![7u32, 300];
            let mut graph = None;
            for t in 0..steps {
                let batch =
                    |ss: &[_]| -> Vec<_> { ss.iter().copied().zip(toks.iter().copied()).collect() };
                let want = dec.decode_greedy(&batch(&plain), &att).unwrap();
                let got = match &graph {
                    None => {
                        let (got, g) = dec.capture_greedy(&batch(&graphed), &att).unwrap();
                        graph = Some(g);
                        got
                    }
                    Some(g) => dec.replay_greedy(g, &batch(&graphed)).unwrap(),
                };
                assert_eq!(got, want, "{residency:?} {m} step {t}");
                toks = want;
            }
            // Both sides appended every step (the capture's step ran once, by a replay).
            for (i, r) in roots.iter().enumerate() {
                let n = dec.len(*r).unwrap() + steps;
                assert_eq!(dec.len(plain[i]).unwrap(), n, "{m}");
                assert_eq!(dec.len(graphed[i]).unwrap(), n, "{m}");
            }
            // The graph replays its own sessions only, in their order.
            let g = graph.as_ref().unwrap();
            let swapped: Vec<_> = graphed.iter().rev().copied().zip([1u32, 2]).collect();
            let e = dec.replay_greedy(g, &swapped).unwrap_err();
            assert!(matches!(e, GpuError::Invalid { .. }), "{e}");
            for s in plain.iter().chain(&graphed) {
                dec.free(*s).unwrap();
            }
        }
        // Events are not captured: a capture with instrumentation on is refused.
        let s = dec.fork(roots[1]).unwrap();
        dec.set_instrument(true);
        let att = Attention {
            method: AttendMethod::Dense,
            params: SelectParams {
                sink: 4,
                local: 32,
                k: 64,
            },
        };
        let e = dec.capture_greedy(&[(s, 5)], &att).unwrap_err();
        assert!(e.to_string().contains("instrumentation"), "{e}");
        dec.set_instrument(false);
    }
}
