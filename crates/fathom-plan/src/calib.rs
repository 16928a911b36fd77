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
//! let hc = head_calib(&view, &[1.0, 1.0])?;
//! assert_eq!(hc.sigma2, [1.0, 0.0]);
//! assert_eq!(hc.ds_channels, [1, 0]); // mean|k| is 5 on channel 1
//! // Bad input is a typed error from `head_calib`: here a ragged query list.
//! assert!(fathom_plan::calib::head_calib(&view, &[1.0, 1.0, 1.0]).is_err());
//! # Ok::<(), fathom_plan::PlanError>(())
//! ```

use crate::scanner::HeadCalib;
use crate::{KvView, PlanError};

/// The largest head dimension a calibration holds: Double Sparsity's channels are `u16`.
pub const MAX_CALIB_DIM: usize = 1 << 16;

/// Symmetric eigendecomposition by cyclic Jacobi rotations (f64). Returns eigenvalues and
/// eigenvectors as columns of a row-major `[D][D]` matrix.
///
/// # Errors
/// [`PlanError::ShapeMismatch`] unless `a` is `D·D` long; [`PlanError::NonFinite`] for a NaN
/// or an infinite entry (the rotations would spread it over every eigenvector).
pub fn jacobi_eigen(a: &[f64], d: usize) -> Result<(Vec<f64>, Vec<f64>), PlanError> {
    let want = d.checked_mul(d).ok_or(PlanError::InvalidParameter {
        name: "d",
        value: d as f64,
        reason: "D·D overflows",
    })?;
    if a.len() != want {
        return Err(PlanError::ShapeMismatch {
            what: "matrix [D][D]",
            expected: want,
            got: a.len(),
        });
    }
    if let Some(index) = a.iter().position(|x| !x.is_finite()) {
        return Err(PlanError::NonFinite {
            what: "matrix",
            index,
        });
    }
    Ok(jacobi_checked(a, d))
}

/// [`jacobi_eigen`] of a checked `D·D` finite matrix.
fn jacobi_checked(a: &[f64], d: usize) -> (Vec<f64>, Vec<f64>) {
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
/// sources and calibration). No keys give zero moments; a NaN or an infinity in a key gives
/// a non-finite moment of its channel (the data's own; [`head_calib`] refuses such keys
/// before computing anything).
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
///
/// # Panics
/// If the two lengths differ (a programming error: a shorter list would be scored silently).
pub fn ds_scores(mean_abs_q: &[f64], mean_abs_k: &[f64]) -> Vec<f64> {
    assert_eq!(
        mean_abs_q.len(),
        mean_abs_k.len(),
        "ds_scores: one mean per channel in both"
    );
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
///
/// # Errors
/// [`PlanError::InvalidParameter`] (`"D"`) for `D = 0` or `D > 65536` (the channels of
/// [`HeadCalib::ds_channels`] are `u16`); [`PlanError::ShapeMismatch`] for no keys or a query
/// list that is not whole rows of `D`; [`PlanError::NonFinite`] for a NaN or an infinity in a
/// key (`"calibration keys"`, flat index `row·D + channel`) or a query.
pub fn head_calib(keys: &KvView<'_>, queries: &[f32]) -> Result<HeadCalib, PlanError> {
    let (n, d) = (keys.rows(), keys.dim);
    if d == 0 || d > MAX_CALIB_DIM {
        return Err(PlanError::InvalidParameter {
            name: "D",
            value: d as f64,
            reason: "the head dimension must lie in 1..=65536",
        });
    }
    if n == 0 {
        return Err(PlanError::ShapeMismatch {
            what: "calibration keys (at least one row)",
            expected: 1,
            got: 0,
        });
    }
    if queries.len() % d != 0 {
        return Err(PlanError::ShapeMismatch {
            what: "calibration queries (whole rows of D)",
            expected: queries.len() / d * d,
            got: queries.len(),
        });
    }
    for i in 0..n {
        let row = keys.row(i).expect("i < rows");
        if let Some(c) = row.iter().position(|x| !x.is_finite()) {
            return Err(PlanError::NonFinite {
                what: "calibration keys",
                index: i * d + c,
            });
        }
    }
    if let Some(index) = queries.iter().position(|x| !x.is_finite()) {
        return Err(PlanError::NonFinite {
            what: "calibration queries",
            index,
        });
    }
    Ok(head_calib_checked(keys, queries))
}

/// The statistics of a checked input (`D` in range, at least one key, whole finite rows).
fn head_calib_checked(keys: &KvView<'_>, queries: &[f32]) -> HeadCalib {
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
    let (vals, vecs) = jacobi_checked(&cov, d);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every input the statistics cannot be computed from is a typed error: D = 0 (a division
    /// by zero), D past u16 channels (they would wrap), ragged queries (silently truncated),
    /// NaN or infinite keys and queries (NaN σ²), no keys, and a short or NaN Jacobi matrix.
    #[test]
    fn bad_calibration_input_is_a_typed_error() {
        let keys = [1.0f32, 2.0, -1.0, 0.5, 3.0, -2.0];
        let view = KvView::contiguous(&keys, 2);
        assert!(head_calib(&view, &[1.0, 0.5]).is_ok());
        let err = |k: &KvView<'_>, q: &[f32]| head_calib(k, q).unwrap_err();
        assert!(matches!(
            err(&KvView::contiguous(&keys, 0), &[]),
            PlanError::InvalidParameter { name: "D", .. }
        ));
        let wide = vec![0.0f32; MAX_CALIB_DIM + 1];
        assert!(matches!(
            err(&KvView::contiguous(&wide, MAX_CALIB_DIM + 1), &[]),
            PlanError::InvalidParameter { name: "D", .. }
        ));
        assert!(matches!(
            err(&view, &[1.0, 0.5, 2.0]),
            PlanError::ShapeMismatch {
                expected: 2,
                got: 3,
                ..
            }
        ));
        assert!(matches!(
            err(&KvView::contiguous(&[], 2), &[]),
            PlanError::ShapeMismatch { got: 0, .. }
        ));
        for bad in [f32::NAN, f32::INFINITY] {
            let mut k = keys;
            k[3] = bad;
            assert_eq!(
                err(&KvView::contiguous(&k, 2), &[]),
                PlanError::NonFinite {
                    what: "calibration keys",
                    index: 3
                }
            );
            assert_eq!(
                err(&view, &[0.0, 1.0, bad, 0.0]),
                PlanError::NonFinite {
                    what: "calibration queries",
                    index: 2
                }
            );
        }
        assert!(matches!(
            jacobi_eigen(&[1.0, 0.0, 0.0], 2),
            Err(PlanError::ShapeMismatch {
                expected: 4,
                got: 3,
                ..
            })
        ));
        assert!(matches!(
            jacobi_eigen(&[1.0, f64::NAN, f64::NAN, 1.0], 2),
            Err(PlanError::NonFinite { index: 1, .. })
        ));
        let (vals, _) = jacobi_eigen(&[2.0, 0.0, 0.0, 1.0], 2).unwrap();
        assert_eq!(vals, [2.0, 1.0]);
    }
}
