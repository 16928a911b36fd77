//! The labelled synthetic GQA key generator used for timing until real captures exist.
//!
//! Label: [`SYNTH_LABEL`]. Per (layer, KV head) and channel `c`:
//!
//! * channel scale `σ_c ~ LogNormal(0, 0.8)`, with 4 outlier channels ×6 (heavy-tailed
//!   channel variances, as real pre-RoPE/QK-normed keys show);
//! * a channel mean `μ_c = 0.5·σ_c·N(0,1)`;
//! * key `k_ic = μ_c + σ_c·z_ic + α_i·d_c`, `z ~ N(0,1)`, where `d` is the group's shared
//!   query direction and `α_i` is non-zero (`~ 3·|N(0,1)|`) for 2% of tokens: the "relevant"
//!   tokens a top-k should find;
//! * value `v_ic ~ N(0,1)`.
//!
//! Queries of step `s`, head `g`: `q_gc = a_c·(u_c + 0.6·v_gc + 0.35·ε_sgc)` with
//! `a_c ~ LogNormal(0, 0.5)` and a fresh `ε` every step, so adjacent steps share most but not
//! all winners. Longer contexts tile a base of `tokens` keys (see the session docs).

use half::bf16;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal, Normal};
use rayon::prelude::*;

use fathom_store::{Dims, KeyStore};

use crate::error::Result;

/// The generator's label, written into every report.
pub const SYNTH_LABEL: &str = "synthetic-gqa-v1 (lognormal channel σ (0.8) + 4 outliers ×6, channel means, 2% query-aligned tokens, N(0,1) values, per-step query drift 0.35)";

/// What one synthetic layer is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthParams {
    /// KV heads.
    pub heads: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Channels per head.
    pub dim: usize,
    /// Base tokens (a multiple of 64 keeps tiling block-aligned).
    pub tokens: usize,
    /// Seed; layer `l` uses `seed + l`.
    pub seed: u64,
}

/// One layer's data: the store and everything the step and its CPU references need.
#[derive(Debug, Clone)]
pub struct LayerSource {
    /// The 4-bit bit-plane store of the keys (raw basis, capacity = tokens).
    pub store: KeyStore,
    /// Keys `[n][H][D]` f32 (model channels).
    pub keys: Vec<f32>,
    /// Values `[n][H][D]` f32.
    pub values: Vec<f32>,
    /// Calibration variance of every channel `[H][D]` (the planner's `σ²`).
    pub sigma2: Vec<f32>,
    /// Double Sparsity's offline channel score `mean|q_c|·mean|k_c|`, `[H][D]`.
    pub ds_score: Vec<f32>,
    /// Per-channel query amplitude `a` `[H][D]`.
    q_amp: Vec<f32>,
    /// Shared query direction `u` `[H][D]` and per-head part `v` `[H][G][D]`.
    q_shared: Vec<f32>,
    q_head: Vec<f32>,
    params: SynthParams,
    layer: usize,
}

fn normal() -> Normal<f32> {
    Normal::new(0.0, 1.0).expect("unit normal")
}

/// Generates layer `layer` of the synthetic model.
///
/// # Errors
/// Only if the store rejects the keys (it cannot for finite, moderate values).
pub fn synth_layer(p: &SynthParams, layer: usize) -> Result<LayerSource> {
    let (hn, g, d, n) = (p.heads, p.group, p.dim, p.tokens);
    let seed = p.seed.wrapping_mul(0x9E37_79B9).wrapping_add(layer as u64);
    let mut rng = StdRng::seed_from_u64(seed);
    let ln = LogNormal::new(0.0f32, 0.8).expect("lognormal");
    let la = LogNormal::new(0.0f32, 0.5).expect("lognormal");
    let nz = normal();
    let mut sigma = vec![0f32; hn * d];
    let mut mu = vec![0f32; hn * d];
    let mut q_amp = vec![0f32; hn * d];
    let mut q_shared = vec![0f32; hn * d];
    let mut q_head = vec![0f32; hn * g * d];
    for h in 0..hn {
        for c in 0..d {
            sigma[h * d + c] = ln.sample(&mut rng).min(40.0);
        }
        for _ in 0..4 {
            let c = rng.gen_range(0..d);
            sigma[h * d + c] *= 6.0;
        }
        for c in 0..d {
            mu[h * d + c] = 0.5 * sigma[h * d + c] * nz.sample(&mut rng);
            q_amp[h * d + c] = la.sample(&mut rng);
            q_shared[h * d + c] = nz.sample(&mut rng);
        }
        for x in &mut q_head[h * g * d..(h + 1) * g * d] {
            *x = nz.sample(&mut rng);
        }
    }
    // Per-head key columns, generated in parallel.
    let cols: Vec<(Vec<f32>, Vec<f32>)> = (0..hn)
        .into_par_iter()
        .map(|h| {
            let mut r = StdRng::seed_from_u64(seed ^ ((h as u64 + 1) << 40));
            let nz = normal();
            let dir: Vec<f32> = {
                let u = &q_shared[h * d..(h + 1) * d];
                let a = &q_amp[h * d..(h + 1) * d];
                let v: Vec<f32> = (0..d).map(|c| u[c] * a[c]).collect();
                let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                (0..d)
                    .map(|c| {
                        v[c] / norm * sigma[h * d..(h + 1) * d].iter().sum::<f32>() / d as f32 * 3.0
                    })
                    .collect()
            };
            let mut k = vec![0f32; n * d];
            let mut v = vec![0f32; n * d];
            for i in 0..n {
                let alpha = if r.gen::<f32>() < 0.02 {
                    3.0 * nz.sample(&mut r).abs()
                } else {
                    0.0
                };
                for c in 0..d {
                    k[i * d + c] =
                        mu[h * d + c] + sigma[h * d + c] * nz.sample(&mut r) + alpha * dir[c];
                    v[i * d + c] = nz.sample(&mut r);
                }
            }
            (k, v)
        })
        .collect();
    let mut keys = vec![0f32; n * hn * d];
    let mut values = vec![0f32; n * hn * d];
    for (h, (k, v)) in cols.iter().enumerate() {
        for i in 0..n {
            keys[(i * hn + h) * d..(i * hn + h + 1) * d].copy_from_slice(&k[i * d..(i + 1) * d]);
            values[(i * hn + h) * d..(i * hn + h + 1) * d].copy_from_slice(&v[i * d..(i + 1) * d]);
        }
    }
    let mut sigma2 = vec![0f32; hn * d];
    let mut ds_score = vec![0f32; hn * d];
    for h in 0..hn {
        for c in 0..d {
            let (mut s, mut s2, mut sa) = (0f64, 0f64, 0f64);
            for i in 0..n {
                let x = keys[(i * hn + h) * d + c] as f64;
                s += x;
                s2 += x * x;
                sa += x.abs();
            }
            let mean = s / n as f64;
            sigma2[h * d + c] = (s2 / n as f64 - mean * mean).max(0.0) as f32;
            let qa: f64 = (0..g)
                .map(|gg| {
                    (q_amp[h * d + c] * (q_shared[h * d + c] + 0.6 * q_head[(h * g + gg) * d + c]))
                        .abs() as f64
                })
                .sum::<f64>()
                / g as f64;
            ds_score[h * d + c] = (qa * sa / n as f64) as f32;
        }
    }
    let store = KeyStore::from_keys(
        Dims {
            heads: hn,
            channels: d,
        },
        &keys,
        None,
    )?;
    Ok(LayerSource {
        store,
        keys,
        values,
        sigma2,
        ds_score,
        q_amp,
        q_shared,
        q_head,
        params: *p,
        layer,
    })
}

impl LayerSource {
    /// The queries of decode step `step`, `[H][G][D]`.
    pub fn queries(&self, step: usize) -> Vec<f32> {
        let (hn, g, d) = (self.params.heads, self.params.group, self.params.dim);
        let mut r = StdRng::seed_from_u64(
            self.params.seed ^ (self.layer as u64) << 20 ^ (step as u64 + 7) << 44,
        );
        let nz = normal();
        let mut q = vec![0f32; hn * g * d];
        for h in 0..hn {
            for gg in 0..g {
                for c in 0..d {
                    let e: f32 = nz.sample(&mut r);
                    q[(h * g + gg) * d + c] = self.q_amp[h * d + c]
                        * (self.q_shared[h * d + c]
                            + 0.6 * self.q_head[(h * g + gg) * d + c]
                            + 0.35 * e);
                }
            }
        }
        q
    }

    /// K/V records `[H][n][K D | V D]` in bf16: what the row gather fetches.
    pub fn records(&self) -> Vec<bf16> {
        let (hn, d) = (self.params.heads, self.params.dim);
        let n = self.params.tokens;
        let mut out = vec![bf16::ZERO; hn * n * 2 * d];
        out.par_chunks_mut(n * 2 * d)
            .enumerate()
            .for_each(|(h, dst)| {
                for i in 0..n {
                    let src = (i * hn + h) * d;
                    for c in 0..d {
                        dst[i * 2 * d + c] = bf16::from_f32(self.keys[src + c]);
                        dst[i * 2 * d + d + c] = bf16::from_f32(self.values[src + c]);
                    }
                }
            });
        out
    }

    /// The layer's parameters.
    pub fn params(&self) -> &SynthParams {
        &self.params
    }
}
