//! What every device test shares.

use fathom_cuda::prelude::*;
use fathom_cuda::{CudaError, Gpu};

/// The GPU, or `None` (printing why) when there is no GPU path, as on CI; with
/// `FATHOM_REQUIRE_GPU=1` a missing GPU fails the test instead, so a device run cannot pass by
/// skipping.
pub fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e @ (CudaError::NotCompiledWithCuda | CudaError::NoDevice { .. })) => {
            if std::env::var("FATHOM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("FATHOM_REQUIRE_GPU=1 and there is no GPU path: {e}");
            }
            eprintln!("skipping GPU test: {e}");
            None
        }
        Err(e) => panic!("unexpected error opening the GPU: {e}"),
    }
}

/// The depths of a static top-r plan (docs/SPEC.md §4): the `r` channels with the largest
/// `score` at 4 planes, ties to the lower channel.
#[allow(dead_code)] // each test binary uses what it needs
pub fn top_r_depths(score: &[f32], r: usize) -> Vec<u8> {
    let mut o: Vec<usize> = (0..score.len()).collect();
    o.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
    let mut dep = vec![0u8; score.len()];
    o.iter().take(r).for_each(|&c| dep[c] = 4);
    dep
}

/// SparQ's plan for one KV head's queries `qh` `[G][D]`: the `r` channels with the largest
/// `Σ_g |q_gc|` (ties to the lower channel) at 4 planes.
#[allow(dead_code)]
pub fn sparq_depths(qh: &[f32], g: usize, d: usize, r: usize) -> Vec<u8> {
    let s: Vec<f32> = (0..d)
        .map(|c| (0..g).map(|gg| qh[gg * d + c].abs()).sum())
        .collect();
    top_r_depths(&s, r)
}
