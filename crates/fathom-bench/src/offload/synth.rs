//! The labelled synthetic GQA key generator, for timing at shapes no real capture has (8B models).
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

use fathom_plan::calib::{channel_moments, ds_scores};
use fathom_plan::KvView;
use fathom_store::{Dims, KeyStore};

use fathom_cuda::Result;

use super::invalid;

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
    /// Real captured queries `[P][H][G][D]` (sources built by [`LayerSource::from_capture`]);
    /// step `s` uses position `s mod P`.
    captured_q: Option<Vec<f32>>,
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
    // Mean |q_c| over the group's heads (the noise-free part of every step's query).
    let qabs: Vec<f64> = (0..hn * d)
        .map(|hc| {
            let (h, c) = (hc / d, hc % d);
            (0..g)
                .map(|gg| {
                    (q_amp[hc] * (q_shared[hc] + 0.6 * q_head[(h * g + gg) * d + c])).abs() as f64
                })
                .sum::<f64>()
                / g as f64
        })
        .collect();
    let (sigma2, ds_score) = channel_stats(&keys, &qabs, hn, d);
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
        captured_q: None,
    })
}

/// Channel statistics the planner and Double Sparsity use: calibration variance `σ²` and
/// `mean|q_c|·mean|k_c|`, from keys `[n][H][D]` and mean absolute queries `[H][D]` — the
/// calibration's own functions (`fathom_plan::calib`), not a copy of them.
fn channel_stats(keys: &[f32], qabs: &[f64], hn: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    let mut sigma2 = Vec::with_capacity(hn * d);
    let mut ds_score = Vec::with_capacity(hn * d);
    for h in 0..hn {
        let m = channel_moments(&KvView::head(keys, hn, d, h));
        sigma2.extend(m.variance.iter().map(|&v| v as f32));
        ds_score.extend(
            ds_scores(&qabs[h * d..(h + 1) * d], &m.mean_abs)
                .iter()
                .map(|&x| x as f32),
        );
    }
    (sigma2, ds_score)
}

impl LayerSource {
    /// A source from real captured activations (docs/SPEC.md §8): keys and values `[n][H][D]` of all
    /// `n` tokens, and the queries `[P][H·G][D]` of `P` positions, which become the decode
    /// steps' queries in turn. `n` is cut to a multiple of 64 (the first `⌊n/64⌋·64` tokens)
    /// so that longer contexts tile whole blocks. `σ²` and Double Sparsity's channel scores
    /// come from the capture itself.
    ///
    /// # Errors
    /// Shapes that do not match, fewer than 64 tokens, no queries, or non-finite values.
    pub fn from_capture(
        heads: usize,
        group: usize,
        dim: usize,
        keys: &[f32],
        values: &[f32],
        queries: Vec<f32>,
        layer: usize,
    ) -> Result<Self> {
        let row = heads * dim;
        if row == 0 || group == 0 || keys.len() % row != 0 || values.len() != keys.len() {
            return Err(invalid(
                "capture",
                format!(
                    "keys ({}) and values ({}) are not [n][{heads}][{dim}]",
                    keys.len(),
                    values.len()
                ),
            ));
        }
        let n = keys.len() / row / 64 * 64;
        let qrow = heads * group * dim;
        if n == 0 || queries.is_empty() || queries.len() % qrow != 0 {
            return Err(invalid(
                "capture",
                format!(
                    "need at least 64 tokens and queries [P][{}][{dim}] (got {} tokens, {} query values)",
                    heads * group,
                    keys.len() / row,
                    queries.len()
                ),
            ));
        }
        if keys
            .iter()
            .chain(values)
            .chain(&queries)
            .any(|x| !x.is_finite())
        {
            return Err(invalid("capture", "a key, value or query is NaN or Inf"));
        }
        let keys = keys[..n * row].to_vec();
        let values = values[..n * row].to_vec();
        let p = queries.len() / qrow;
        let mut qabs = vec![0f64; heads * dim];
        for pi in 0..p {
            for h in 0..heads {
                for gg in 0..group {
                    for c in 0..dim {
                        qabs[h * dim + c] +=
                            queries[((pi * heads + h) * group + gg) * dim + c].abs() as f64;
                    }
                }
            }
        }
        for x in &mut qabs {
            *x /= (p * group) as f64;
        }
        let (sigma2, ds_score) = channel_stats(&keys, &qabs, heads, dim);
        let store = KeyStore::from_keys(
            Dims {
                heads,
                channels: dim,
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
            q_amp: Vec::new(),
            q_shared: Vec::new(),
            q_head: Vec::new(),
            params: SynthParams {
                heads,
                group,
                dim,
                tokens: n,
                seed: 0,
            },
            layer,
            captured_q: Some(queries),
        })
    }
}

/// A hash of three integers to a uniform value in [-1, 1) (the tiling's jitter).
pub(crate) fn hash01(a: u64, b: u64, c: u64) -> f32 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ c.wrapping_mul(0x1656_67B1_9E37_79F9);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// Whether tile `t ≥ 1` of channel `hc` of `layer` is negated (half of them are).
pub(crate) fn tile_flips(layer: usize, hc: usize, tile: usize) -> bool {
    tile > 0 && hash01(layer as u64 ^ 0xF1, hc as u64, tile as u64) < 0.0
}

impl LayerSource {
    /// Keys of tokens `[t0, t0 + m)` of this source tiled to any length, `[m][H][D]`, for
    /// model layer `layer`: token `t` is source token `t mod n0`, and tiles after the first
    /// are made distinct tokens as the benchmark step's store is (`fill_store`): half of their
    /// channels negated (by a hash of layer, channel and tile) and every (channel, 64-token
    /// block) past the first tile scaled by `1 + 0.03·u`, `u ∈ [-1, 1)` hashed, so tiled
    /// copies neither tie nor win together.
    pub fn tiled_keys(&self, layer: usize, t0: usize, m: usize) -> Vec<f32> {
        let (hn, d) = (self.params.heads, self.params.dim);
        let row = hn * d;
        let n0 = self.keys.len() / row;
        let mut out = vec![0f32; m * row];
        out.par_chunks_mut(64 * row)
            .enumerate()
            .for_each(|(ci, chunk)| {
                let mut factor = vec![1f32; row];
                let mut key = (usize::MAX, usize::MAX);
                for (j, o) in chunk.chunks_mut(row).enumerate() {
                    let t = t0 + ci * 64 + j;
                    let (tile, block) = (t / n0, t / 64);
                    let src = &self.keys[(t % n0) * row..(t % n0 + 1) * row];
                    if tile == 0 {
                        o.copy_from_slice(src);
                        continue;
                    }
                    if key != (tile, block) {
                        for (hc, f) in factor.iter_mut().enumerate() {
                            let sign = if tile_flips(layer, hc, tile) {
                                -1.0
                            } else {
                                1.0
                            };
                            *f =
                                sign * (1.0 + 0.03 * hash01(layer as u64, hc as u64, block as u64));
                        }
                        key = (tile, block);
                    }
                    for ((o, &x), &f) in o.iter_mut().zip(src).zip(&factor) {
                        *o = x * f;
                    }
                }
            });
        out
    }

    /// The queries of decode step `step`, `[H][G][D]`.
    pub fn queries(&self, step: usize) -> Vec<f32> {
        let (hn, g, d) = (self.params.heads, self.params.group, self.params.dim);
        if let Some(q) = &self.captured_q {
            let row = hn * g * d;
            let p = q.len() / row;
            let i = step % p;
            return q[i * row..(i + 1) * row].to_vec();
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiled_keys_copy_the_first_tile_and_flip_and_jitter_the_others() {
        let p = SynthParams {
            heads: 2,
            group: 2,
            dim: 16,
            tokens: 128,
            seed: 3,
        };
        let s = synth_layer(&p, 1).unwrap();
        let row = p.heads * p.dim;
        // Any window, across tile boundaries and at unaligned starts, equals token-by-token.
        for (t0, m) in [(0, 128), (100, 60), (128, 1), (250, 200), (383, 1)] {
            let got = s.tiled_keys(5, t0, m);
            assert_eq!(got.len(), m * row);
            for j in 0..m {
                let t = t0 + j;
                let one = s.tiled_keys(5, t, 1);
                assert_eq!(&got[j * row..(j + 1) * row], &one[..], "token {t}");
                let src = &s.keys[(t % 128) * row..(t % 128 + 1) * row];
                for hc in 0..row {
                    let (x, y) = (src[hc], one[hc]);
                    if t < 128 {
                        assert_eq!(x, y);
                    } else {
                        let sign = if tile_flips(5, hc, t / 128) {
                            -1.0
                        } else {
                            1.0
                        };
                        let r = y / (sign * x);
                        assert!(x == 0.0 || (0.97..=1.03).contains(&r), "t {t} hc {hc}: {r}");
                    }
                }
            }
        }
        // Half of the channels of a later tile are negated, not all or none.
        let flips = (0..row).filter(|&hc| tile_flips(5, hc, 1)).count();
        assert!(flips > 0 && flips < row, "{flips} of {row}");
    }

    #[test]
    fn capture_sources_cut_to_blocks_cycle_queries_and_reject_bad_input() {
        let (h, g, d, n, p) = (2, 3, 8, 130, 4);
        let keys: Vec<f32> = (0..n * h * d)
            .map(|i| ((i * 7919) % 97) as f32 / 13.0 - 3.0)
            .collect();
        let values: Vec<f32> = keys.iter().map(|x| x * 0.5).collect();
        let q: Vec<f32> = (0..p * h * g * d).map(|i| i as f32 * 0.01).collect();
        let s = LayerSource::from_capture(h, g, d, &keys, &values, q.clone(), 3).unwrap();
        // 130 tokens → 128 (two whole blocks); the store matches.
        assert_eq!(s.params().tokens, 128);
        assert_eq!(s.store.tokens(), 128);
        assert_eq!(s.keys.len(), 128 * h * d);
        // Step s uses position s mod P.
        let row = h * g * d;
        assert_eq!(s.queries(1), q[row..2 * row].to_vec());
        assert_eq!(s.queries(p + 2), q[2 * row..3 * row].to_vec());
        // σ² is the keys' per-channel variance.
        let c = 5;
        let xs: Vec<f64> = (0..128).map(|i| keys[i * h * d + c] as f64).collect();
        let m = xs.iter().sum::<f64>() / 128.0;
        let var = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / 128.0;
        assert!((s.sigma2[c] as f64 - var).abs() < 1e-4 * var.max(1.0));
        // Records hold K then V in bf16.
        let r = s.records();
        assert_eq!(r.len(), h * 128 * 2 * d);
        assert_eq!(r[d].to_f32(), half::bf16::from_f32(values[0]).to_f32());
        // Bad input: wrong shapes, too few tokens, NaN.
        assert!(
            LayerSource::from_capture(h, g, d, &keys[..7], &values[..7], q.clone(), 0).is_err()
        );
        assert!(LayerSource::from_capture(
            h,
            g,
            d,
            &keys[..63 * h * d],
            &values[..63 * h * d],
            q.clone(),
            0
        )
        .is_err());
        assert!(LayerSource::from_capture(h, g, d, &keys, &values, q[..5].to_vec(), 0).is_err());
        let mut kn = keys.clone();
        kn[17] = f32::NAN;
        assert!(LayerSource::from_capture(h, g, d, &kn, &values, q, 0).is_err());
    }
}
