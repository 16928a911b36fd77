//! Exact softmax attention over a selected set of tokens (SPEC §5), the fidelity reference.
//!
//! For one query head `q ∈ R^D` and a token set `S`,
//!
//! ```text
//! ℓ_i = s · (q · k_i)                       (s: the scale, 1/√D by default)
//! ℓ_i ← cap · tanh(ℓ_i / cap)               (optional softcap, Gemma-style, after scaling)
//! o   = Σ_{i∈S} exp(ℓ_i − max ℓ) v_i / Σ_{i∈S} exp(ℓ_i − max ℓ)
//! ```
//!
//! Everything is accumulated in `f64` (an online softmax: one pass, the running maximum
//! rescales the sums) and rounded once to `f32`. Keys and values are read in place through a
//! [`KvView`], so an `[N, Hkv, D]` tensor needs no copy.

use crate::PlanError;

/// A strided view of `N` rows of `dim` floats: row `i` is `data[i·stride + offset ..][..dim]`.
///
/// For an `[N, Hkv, D]` row-major tensor, head `h` is `stride = Hkv·D`, `offset = h·D`,
/// `dim = D` ([`KvView::head`]).
#[derive(Debug, Clone, Copy)]
pub struct KvView<'a> {
    /// The backing storage.
    pub data: &'a [f32],
    /// Floats from one row to the next.
    pub stride: usize,
    /// Floats before row 0.
    pub offset: usize,
    /// Floats per row (`D`).
    pub dim: usize,
}

impl<'a> KvView<'a> {
    /// Rows of `dim` floats packed back to back (`[N, D]`).
    pub fn contiguous(data: &'a [f32], dim: usize) -> Self {
        KvView {
            data,
            stride: dim,
            offset: 0,
            dim,
        }
    }

    /// KV head `h` of an `[N, hkv, dim]` row-major tensor.
    pub fn head(data: &'a [f32], hkv: usize, dim: usize, h: usize) -> Self {
        KvView {
            data,
            stride: hkv * dim,
            offset: h * dim,
            dim,
        }
    }

    /// The number of complete rows the view holds.
    pub fn rows(&self) -> usize {
        match (
            self.data.len().checked_sub(self.offset + self.dim),
            self.stride,
        ) {
            (None, _) => 0,
            // Every row is the same slice; treat it as a single row.
            (Some(_), 0) => 1,
            (Some(rest), stride) => rest / stride + 1,
        }
    }

    /// Row `i`, or `None` past the end.
    pub fn row(&self, i: usize) -> Option<&'a [f32]> {
        (i < self.rows()).then(|| {
            let start = i * self.stride + self.offset;
            &self.data[start..start + self.dim]
        })
    }
}

/// Exact attention of one query head over the tokens `idx` (SPEC §5); see the
/// [module docs](self). `idx` may be in any order; a repeated index counts twice.
///
/// ```
/// use fathom_plan::{attend, KvView};
/// let keys = [1.0, 0.0, 0.0, 1.0];      // [2, 2]
/// let values = [10.0, 0.0, 0.0, 10.0]; // [2, 2]
/// let mut out = [0.0; 2];
/// let (k, v) = (KvView::contiguous(&keys, 2), KvView::contiguous(&values, 2));
/// attend(&[0.0, 0.0], k, v, &[0, 1], 1.0, None, &mut out)?;
/// assert_eq!(out, [5.0, 5.0]); // equal logits: the mean of the values
/// # Ok::<(), fathom_plan::PlanError>(())
/// ```
///
/// # Errors
/// [`PlanError::ShapeMismatch`] if `q` or `out` do not match the views' `dim`;
/// [`PlanError::IndexOutOfRange`] for a token past either view; [`PlanError::EmptySelection`]
/// for an empty `idx`; [`PlanError::InvalidParameter`] for a non-finite scale or a softcap
/// that is not positive and finite; [`PlanError::NonFinite`] if a logit is NaN or infinite
/// (the index is the token).
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    keys: KvView<'_>,
    values: KvView<'_>,
    idx: &[u32],
    scale: f32,
    softcap: Option<f32>,
    out: &mut [f32],
) -> Result<(), PlanError> {
    attend_iter(
        q,
        keys,
        values,
        idx.iter().map(|&i| i as usize),
        scale,
        softcap,
        out,
    )
}

/// Dense attention of one query head over keys `0..=upto_inclusive`, or over the last
/// `window` of them (`upto − W + 1 ..= upto`, for sliding-window layers): the reference every
/// selection is measured against.
///
/// # Errors
/// As [`attend`]; `window = Some(0)` is [`PlanError::EmptySelection`].
#[allow(clippy::too_many_arguments)]
pub fn attend_dense(
    q: &[f32],
    keys: KvView<'_>,
    values: KvView<'_>,
    upto_inclusive: usize,
    window: Option<usize>,
    scale: f32,
    softcap: Option<f32>,
    out: &mut [f32],
) -> Result<(), PlanError> {
    let first = match window {
        Some(w) => (upto_inclusive + 1).saturating_sub(w),
        None => 0,
    };
    let end = if window == Some(0) {
        first
    } else {
        upto_inclusive + 1
    };
    attend_iter(q, keys, values, first..end, scale, softcap, out)
}

fn attend_iter(
    q: &[f32],
    keys: KvView<'_>,
    values: KvView<'_>,
    tokens: impl Iterator<Item = usize>,
    scale: f32,
    softcap: Option<f32>,
    out: &mut [f32],
) -> Result<(), PlanError> {
    if q.len() != keys.dim {
        return Err(PlanError::ShapeMismatch {
            what: "query length (key dim)",
            expected: keys.dim,
            got: q.len(),
        });
    }
    if out.len() != values.dim {
        return Err(PlanError::ShapeMismatch {
            what: "output length (value dim)",
            expected: values.dim,
            got: out.len(),
        });
    }
    if !scale.is_finite() {
        return Err(PlanError::InvalidParameter {
            name: "scale",
            value: f64::from(scale),
            reason: "must be finite",
        });
    }
    if let Some(cap) = softcap {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(PlanError::InvalidParameter {
                name: "softcap",
                value: f64::from(cap),
                reason: "must be positive and finite",
            });
        }
    }
    let (krows, vrows) = (keys.rows(), values.rows());
    let scale = f64::from(scale);
    let cap = softcap.map(f64::from);
    let mut acc = vec![0.0f64; values.dim];
    let mut max = f64::NEG_INFINITY;
    let mut sum = 0.0f64;
    for i in tokens {
        let k = keys.row(i).ok_or(PlanError::IndexOutOfRange {
            what: "keys",
            index: i,
            len: krows,
        })?;
        let v = values.row(i).ok_or(PlanError::IndexOutOfRange {
            what: "values",
            index: i,
            len: vrows,
        })?;
        let dot: f64 = q
            .iter()
            .zip(k)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum();
        let mut logit = scale * dot;
        if let Some(c) = cap {
            logit = c * (logit / c).tanh();
        }
        if !logit.is_finite() {
            return Err(PlanError::NonFinite {
                what: "attention logit of token",
                index: i,
            });
        }
        if logit > max {
            let rescale = (max - logit).exp(); // exp(−∞) = 0 on the first token
            sum *= rescale;
            acc.iter_mut().for_each(|a| *a *= rescale);
            max = logit;
        }
        let p = (logit - max).exp();
        sum += p;
        for (a, &x) in acc.iter_mut().zip(v) {
            *a += p * f64::from(x);
        }
    }
    if sum == 0.0 {
        return Err(PlanError::EmptySelection);
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = (a / sum) as f32;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_distr::StandardNormal;

    use super::*;

    /// The textbook formula, two passes, f64 (softmax over max-subtracted logits).
    fn naive(
        q: &[f32],
        k: &[Vec<f32>],
        v: &[Vec<f32>],
        idx: &[usize],
        scale: f64,
        cap: Option<f64>,
    ) -> Vec<f64> {
        let logits: Vec<f64> = idx
            .iter()
            .map(|&i| {
                let l = scale
                    * q.iter()
                        .zip(&k[i])
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum::<f64>();
                cap.map_or(l, |c| c * (l / c).tanh())
            })
            .collect();
        let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
        let z: f64 = p.iter().sum();
        (0..v[0].len())
            .map(|c| {
                idx.iter()
                    .zip(&p)
                    .map(|(&i, &pi)| pi * f64::from(v[i][c]))
                    .sum::<f64>()
                    / z
            })
            .collect()
    }

    #[test]
    fn matches_the_naive_reference_on_strided_heads() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (n, hkv, d) in [
            (1, 1, 4),
            (50, 2, 8),
            (300, 4, 64),
            (129, 1, 128),
            (64, 2, 256),
        ] {
            let mut gen = |len: usize, sd: f32| -> Vec<f32> {
                (0..len)
                    .map(|_| sd * rng.sample::<f32, _>(StandardNormal))
                    .collect()
            };
            let keys = gen(n * hkv * d, 3.0);
            let values = gen(n * hkv * d, 1.0);
            let q = gen(d, 1.0);
            let h = hkv - 1;
            let rows = |t: &[f32]| -> Vec<Vec<f32>> {
                (0..n)
                    .map(|i| t[(i * hkv + h) * d..][..d].to_vec())
                    .collect()
            };
            let (kr, vr) = (rows(&keys), rows(&values));
            let (kv, vv) = (
                KvView::head(&keys, hkv, d, h),
                KvView::head(&values, hkv, d, h),
            );
            assert_eq!(kv.rows(), n);
            let scale = 1.0 / (d as f32).sqrt();
            let idx: Vec<u32> = (0..n as u32).filter(|i| i % 3 != 1 || n == 1).collect();
            let idx_us: Vec<usize> = idx.iter().map(|&i| i as usize).collect();
            for cap in [None, Some(5.0f32), Some(50.0)] {
                let mut out = vec![0.0; d];
                attend(&q, kv, vv, &idx, scale, cap, &mut out).unwrap();
                let expect = naive(&q, &kr, &vr, &idx_us, f64::from(scale), cap.map(f64::from));
                for (o, e) in out.iter().zip(&expect) {
                    // One f32 rounding of an f64 result: 1e-6 relative to the value scale.
                    assert!(
                        (f64::from(*o) - e).abs() <= 1e-6 * (1.0 + e.abs()),
                        "n {n} d {d}: {o} vs {e}"
                    );
                }
                // Dense over 0..=n−1 equals attend over every index; a window equals its range.
                let all: Vec<u32> = (0..n as u32).collect();
                let (mut a, mut b) = (vec![0.0; d], vec![0.0; d]);
                attend(&q, kv, vv, &all, scale, cap, &mut a).unwrap();
                attend_dense(&q, kv, vv, n - 1, None, scale, cap, &mut b).unwrap();
                assert_eq!(a, b);
                let w = n.div_ceil(2);
                let tail: Vec<u32> = ((n - w) as u32..n as u32).collect();
                attend(&q, kv, vv, &tail, scale, cap, &mut a).unwrap();
                attend_dense(&q, kv, vv, n - 1, Some(w), scale, cap, &mut b).unwrap();
                assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn softcap_bounds_the_logits() {
        // Logits 100 and 0 under cap 1 become tanh(100) ≈ 1 and 0: weights e/(1+e), 1/(1+e).
        let keys = [100.0, 0.0];
        let values = [1.0, 0.0];
        let (k, v) = (KvView::contiguous(&keys, 1), KvView::contiguous(&values, 1));
        let mut out = [0.0];
        attend(&[1.0], k, v, &[0, 1], 1.0, Some(1.0), &mut out).unwrap();
        let e = std::f64::consts::E;
        assert!((f64::from(out[0]) - e / (1.0 + e)).abs() < 1e-7);
        attend(&[1.0], k, v, &[0, 1], 1.0, None, &mut out).unwrap();
        assert_eq!(out[0], 1.0);
    }

    #[test]
    fn errors_name_the_problem() {
        let data = [0.0f32; 12];
        let kv = KvView::head(&data, 2, 3, 1); // 2 rows
        assert_eq!(kv.rows(), 2);
        assert_eq!(kv.row(1), Some(&data[9..12]));
        assert_eq!(kv.row(2), None);
        let mut out = [0.0; 3];
        let q = [1.0, 2.0, 3.0];
        assert_eq!(
            attend(&q, kv, kv, &[0, 2], 1.0, None, &mut out),
            Err(PlanError::IndexOutOfRange {
                what: "keys",
                index: 2,
                len: 2
            })
        );
        assert_eq!(
            attend(&q, kv, kv, &[], 1.0, None, &mut out),
            Err(PlanError::EmptySelection)
        );
        assert_eq!(
            attend_dense(&q, kv, kv, 1, Some(0), 1.0, None, &mut out),
            Err(PlanError::EmptySelection)
        );
        assert!(matches!(
            attend(&q[..2], kv, kv, &[0], 1.0, None, &mut out),
            Err(PlanError::ShapeMismatch {
                expected: 3,
                got: 2,
                ..
            })
        ));
        assert!(matches!(
            attend(&q, kv, kv, &[0], 1.0, None, &mut out[..1]),
            Err(PlanError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            attend(&q, kv, kv, &[0], 1.0, Some(0.0), &mut out),
            Err(PlanError::InvalidParameter {
                name: "softcap",
                ..
            })
        ));
        assert!(matches!(
            attend(&q, kv, kv, &[0], f32::NAN, None, &mut out),
            Err(PlanError::InvalidParameter { name: "scale", .. })
        ));
        let bad = [0.0, 0.0, 0.0, f32::NAN, 0.0, 0.0];
        let kb = KvView::contiguous(&bad, 3);
        assert_eq!(
            attend(&q, kb, kb, &[0, 1], 1.0, None, &mut out),
            Err(PlanError::NonFinite {
                what: "attention logit of token",
                index: 1
            })
        );
        assert_eq!(KvView::contiguous(&[], 3).rows(), 0);
    }
}
