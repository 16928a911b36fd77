//! Calibration math (docs/SPEC.md §3–§4), free of I/O: per-channel moments (σ²), the KLT by a
//! cyclic Jacobi eigensolver and its ordering by calibration score variance, Loki's basis,
//! Double Sparsity's channel scores, and the per-(layer, KV head) [`HeadCalib`] built from
//! them. `fathom-bench` reads captures and writes calibration files around it; the synthetic
//! GPU sources use the same functions.
//!
//! ```
//! use fathom_plan::calib::{channel_moments, head_calib};
//! use fathom_plan::KvView;
//! // Four keys of D = 2: channel 0 varies, channel 1 is constant.
//! let keys = [1.0, 5.0, -1.0, 5.0, 1.0, 5.0, -1.0, 5.0];
//! let view = KvView::contiguous(&keys, 2);
//! let m = channel_moments(&view);
//! assert_eq!(m.variance, [1.0, 0.0]);
//! let hc = head_calib(&view, &[1.0, 1.0]);
//! assert_eq!(hc.sigma2, [1.0, 0.0]);
//! assert_eq!(hc.ds_channels, [1, 0]); // mean|k| is 5 on channel 1
//! ```

use crate::scanner::HeadCalib;
use crate::KvView;

/// Symmetric eigendecomposition by cyclic Jacobi rotations (f64). Returns eigenvalues and
/// eigenvectors as columns of a row-major `[D][D]` matrix.
pub fn jacobi_eigen(a: &[f64], d: usize) -> (Vec<f64>, Vec<f64>) {
    let mut a = a.to_vec();
    // The eigenvectors are accumulated transposed (`vt[j][k] = V[k][j]`), so each rotation
    // updates two rows; the arithmetic is the same as on V's columns.
    let mut vt = vec![0f64; d * d];
    for i in 0..d {
        vt[i * d + i] = 1.0;
    }
    let norm: f64 = a
        .iter()
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
        .max(f64::MIN_POSITIVE);
    for _sweep in 0..60 {
        let off: f64 = (0..d)
            .flat_map(|i| (0..d).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * d + j] * a[i * d + j])
            .sum::<f64>()
            .sqrt();
        if off <= 1e-13 * norm {
            break;
        }
        for p in 0..d {
            for q in p + 1..d {
                let apq = a[p * d + q];
                if apq.abs() <= 1e-300 {
                    continue;
                }
                let (app, aqq) = (a[p * d + p], a[q * d + q]);
                let theta = (aqq - app) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..d {
                    let (akp, akq) = (a[k * d + p], a[k * d + q]);
                    a[k * d + p] = c * akp - s * akq;
                    a[k * d + q] = s * akp + c * akq;
                }
                for k in 0..d {
                    let (apk, aqk) = (a[p * d + k], a[q * d + k]);
                    a[p * d + k] = c * apk - s * aqk;
                    a[q * d + k] = s * apk + c * aqk;
                }
                // Columns p and q of V are rows p and q of Vᵀ: contiguous, and vectorised.
                let (vp, vq) = vt.split_at_mut(q * d);
                for (x, y) in vp[p * d..(p + 1) * d].iter_mut().zip(&mut vq[..d]) {
                    let (vkp, vkq) = (*x, *y);
                    *x = c * vkp - s * vkq;
                    *y = s * vkp + c * vkq;
                }
            }
        }
    }
    let mut v = vec![0f64; d * d];
    for (j, row) in vt.chunks_exact(d).enumerate() {
        for (k, &x) in row.iter().enumerate() {
            v[k * d + j] = x;
        }
    }
    ((0..d).map(|i| a[i * d + i]).collect(), v)
}

/// Orders eigenvectors by calibration score variance `E[(q·u_j)²]·λ_j` (largest first) and
/// returns `(basis [D][D] f32, λ in that order)`.
fn order_by_score(vals: &[f64], vecs: &[f64], qs: &[f32], d: usize) -> (Vec<f32>, Vec<f32>) {
    let nq = (qs.len() / d).max(1);
    let score: Vec<f64> = (0..d)
        .map(|j| {
            let e: f64 = qs
                .chunks_exact(d)
                .map(|q| {
                    let x: f64 = (0..d).map(|c| q[c] as f64 * vecs[c * d + j]).sum();
                    x * x
                })
                .sum::<f64>()
                / nq as f64;
            e * vals[j].max(0.0)
        })
        .collect();
    let mut order: Vec<usize> = (0..d).collect();
    order.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
    let mut u = vec![0f32; d * d];
    for (jn, &j) in order.iter().enumerate() {
        for c in 0..d {
            u[c * d + jn] = vecs[c * d + j] as f32;
        }
    }
    (u, order.iter().map(|&j| vals[j].max(0.0) as f32).collect())
}

/// Per-channel statistics of keys (`f64` sums in token order): mean, mean `|k_c|` and the
/// variance `σ²_c = E[k_c²] − E[k_c]²` (clamped at 0), the planner's importance weights
/// (docs/SPEC.md §3).
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelMoments {
    /// `E[k_c]`.
    pub mean: Vec<f64>,
    /// `E[|k_c|]`.
    pub mean_abs: Vec<f64>,
    /// `σ²_c`.
    pub variance: Vec<f64>,
}

/// [`ChannelMoments`] of `keys` (the one implementation of σ² for captures, synthetic
/// sources and calibration).
pub fn channel_moments(keys: &KvView<'_>) -> ChannelMoments {
    let (n, d) = (keys.rows(), keys.dim);
    let (mut s, mut s2, mut sa) = (vec![0f64; d], vec![0f64; d], vec![0f64; d]);
    for i in 0..n {
        let k = keys.row(i).expect("row");
        for c in 0..d {
            let x = k[c] as f64;
            s[c] += x;
            s2[c] += x * x;
            sa[c] += x.abs();
        }
    }
    let nf = n.max(1) as f64;
    let mean: Vec<f64> = s.iter().map(|x| x / nf).collect();
    ChannelMoments {
        variance: (0..d)
            .map(|c| (s2[c] / nf - mean[c] * mean[c]).max(0.0))
            .collect(),
        mean_abs: sa.iter().map(|x| x / nf).collect(),
        mean,
    }
}

/// Double Sparsity's offline channel score `mean|q_c| · mean|k_c|` (docs/SPEC.md §4).
pub fn ds_scores(mean_abs_q: &[f64], mean_abs_k: &[f64]) -> Vec<f64> {
    mean_abs_q
        .iter()
        .zip(mean_abs_k)
        .map(|(q, k)| q * k)
        .collect()
}

/// Channels by descending score, ties to the lower channel: Double Sparsity's choice order.
pub fn ds_order(scores: &[f64]) -> Vec<usize> {
    let mut ds: Vec<usize> = (0..scores.len()).collect();
    ds.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    ds
}

/// Statistics of one (layer, KV head) from its keys and its group's calibration queries
/// (`[P·G][D]`): σ², the KLT and its eigenvalues, Loki's basis (the same centred PCA),
/// the mean squared 64-token block maximum and Double Sparsity's channel order.
pub fn head_calib(keys: &KvView<'_>, queries: &[f32]) -> HeadCalib {
    let (n, d) = (keys.rows(), keys.dim);
    let moments = channel_moments(keys);
    let mean = &moments.mean;
    let mut second = vec![0f64; d * d];
    for i in 0..n {
        let k = keys.row(i).expect("row");
        for c in 0..d {
            let kc = k[c] as f64;
            for e in c..d {
                second[c * d + e] += kc * k[e] as f64;
            }
        }
    }
    let nf = n.max(1) as f64;
    for c in 0..d {
        for e in c..d {
            second[c * d + e] /= nf;
            second[e * d + c] = second[c * d + e];
        }
    }
    let cov: Vec<f64> = (0..d * d)
        .map(|i| second[i] - mean[i / d] * mean[i % d])
        .collect();
    let sigma2: Vec<f32> = moments.variance.iter().map(|&v| v as f32).collect();
    let (vals, vecs) = jacobi_eigen(&cov, d);
    let (klt, klt_sigma2) = order_by_score(&vals, &vecs, queries, d);
    // Loki is ordinary PCA: the eigenvectors of the *centred* covariance, which are the KLT's.
    // (An uncentred basis spends its leading coordinates on the key mean, which adds the same
    // amount to every key's score and so cannot change a top-k.) Ordered, like the KLT, by
    // calibration score variance (docs/SPEC.md §4).
    let loki = klt.clone();
    // Mean squared 64-token block maximum.
    let nb = n.div_ceil(64).max(1);
    let mut msb = vec![0f64; d];
    for b in 0..n.div_ceil(64) {
        for (c, acc) in msb.iter_mut().enumerate() {
            let m = (b * 64..((b + 1) * 64).min(n))
                .map(|i| keys.row(i).expect("row")[c].abs())
                .fold(0f32, f32::max) as f64;
            *acc += m * m;
        }
    }
    // Double Sparsity: mean|q_c| · mean|k_c|.
    let nq = (queries.len() / d).max(1) as f64;
    let mean_abs_q: Vec<f64> = (0..d)
        .map(|c| {
            queries
                .chunks_exact(d)
                .map(|q| (q[c] as f64).abs())
                .sum::<f64>()
                / nq
        })
        .collect();
    let ds = ds_order(&ds_scores(&mean_abs_q, &moments.mean_abs));
    HeadCalib {
        sigma2,
        mean_sq_blockmax: msb.iter().map(|x| (x / nb as f64) as f32).collect(),
        klt,
        klt_sigma2,
        loki,
        ds_channels: ds.iter().map(|&c| c as u16).collect(),
    }
}
