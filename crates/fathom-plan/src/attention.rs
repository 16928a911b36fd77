//! Exact softmax attention over a selected set of tokens (docs/SPEC.md §5), the fidelity reference.
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
    ///
    /// # Panics
    /// If `h ≥ hkv` (a programming error: the view would read the next token's heads).
    pub fn head(data: &'a [f32], hkv: usize, dim: usize, h: usize) -> Self {
        assert!(
            h < hkv,
            "KvView::head: head {h} out of range ({hkv} KV heads)"
        );
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

    /// Rows `from..to` as a view of their own (row `from` becomes row 0); `None` when the range
    /// is empty or runs past the end.
    pub fn slice_rows(&self, from: usize, to: usize) -> Option<KvView<'a>> {
        if from >= to || to > self.rows() {
            return None;
        }
        let start = from * self.stride;
        let end = (to - 1) * self.stride + self.offset + self.dim;
        Some(KvView {
            data: &self.data[start..end],
            stride: self.stride,
            offset: self.offset,
            dim: self.dim,
        })
    }

    /// Row `i`, or `None` past the end.
    pub fn row(&self, i: usize) -> Option<&'a [f32]> {
        (i < self.rows()).then(|| {
            let start = i * self.stride + self.offset;
            &self.data[start..start + self.dim]
        })
    }
}

/// Exact attention of one query head over the tokens `idx` (docs/SPEC.md §5); see the
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
/// that is not positive and finite; [`PlanError::NonFinite`] if a logit is NaN or infinite, or
/// a selected value row holds a NaN or an infinity (the index is the token), never a NaN
/// output.
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
    attend_iter(
        q,
        keys,
        values,
        dense_range(upto_inclusive, window),
        scale,
        softcap,
        out,
    )
}

/// The tokens dense attention reads: `0..=upto`, or its last `window` (`Some(0)`: none, which
/// [`attend_iter`] refuses as an empty selection).
fn dense_range(upto_inclusive: usize, window: Option<usize>) -> std::ops::Range<usize> {
    match window {
        Some(w) => (upto_inclusive + 1).saturating_sub(w)..upto_inclusive + 1,
        None => 0..upto_inclusive + 1,
    }
}

/// [`attend_dense`] with the keys read from [`KeyTiles`]: the same output, bit for bit,
/// several times faster (the dot products vectorise across tokens).
///
/// # Errors
/// As [`attend_dense`].
#[allow(clippy::too_many_arguments)]
pub fn attend_dense_tiled(
    q: &[f32],
    keys: &KeyTiles,
    values: KvView<'_>,
    upto_inclusive: usize,
    window: Option<usize>,
    scale: f32,
    softcap: Option<f32>,
    out: &mut [f32],
) -> Result<(), PlanError> {
    attend_iter(
        q,
        keys,
        values,
        dense_range(upto_inclusive, window),
        scale,
        softcap,
        out,
    )
}

/// [`attend`] with the exact dot products already computed: `dots[i] = Σ_c f64(q_c)·f64(k_ic)`
/// summed in channel order (as [`KeyTiles::dots`] gives them) for every token in `idx`. The
/// output is the same as [`attend`]'s, bit for bit; worth it when many selections of one
/// query share the products.
///
/// # Errors
/// As [`attend`] (a token past `dots` is [`PlanError::IndexOutOfRange`] on "keys").
pub fn attend_dots(
    dots: &[f64],
    values: KvView<'_>,
    idx: &[u32],
    scale: f32,
    softcap: Option<f32>,
    out: &mut [f32],
) -> Result<(), PlanError> {
    attend_iter(
        &[],
        Precomputed(dots),
        values,
        idx.iter().map(|&i| i as usize),
        scale,
        softcap,
        out,
    )
}

/// Dot products computed beforehand (the query is not read).
struct Precomputed<'a>(&'a [f64]);

impl DotSource for Precomputed<'_> {
    fn rows(&self) -> usize {
        self.0.len()
    }
    fn dim(&self) -> usize {
        0
    }
    #[inline]
    fn dots(&self, _q: &[f64], ids: &[usize]) -> [f64; DOT_LANES] {
        let mut acc = [0f64; DOT_LANES];
        for (a, &i) in acc.iter_mut().zip(ids) {
            *a = self.0[i];
        }
        acc
    }
}

/// Where [`attend_iter`] gets its exact dot products: rows of a [`KvView`] or [`KeyTiles`].
trait DotSource {
    fn rows(&self) -> usize;
    fn dim(&self) -> usize;
    /// `q · k_i` for the tokens `ids` (at most [`DOT_LANES`], each `< rows()`), summed in
    /// channel order from `0.0`; `q` is the query widened to f64.
    fn dots(&self, q: &[f64], ids: &[usize]) -> [f64; DOT_LANES];
}

impl DotSource for KvView<'_> {
    fn rows(&self) -> usize {
        KvView::rows(self)
    }
    fn dim(&self) -> usize {
        self.dim
    }
    #[inline]
    fn dots(&self, q: &[f64], ids: &[usize]) -> [f64; DOT_LANES] {
        dot_lanes(q, self, ids)
    }
}

impl DotSource for &KeyTiles {
    fn rows(&self) -> usize {
        self.n
    }
    fn dim(&self) -> usize {
        self.dim
    }
    #[inline]
    fn dots(&self, q: &[f64], ids: &[usize]) -> [f64; DOT_LANES] {
        let t0 = ids.first().map_or(0, |&i| i);
        let aligned = t0 % DOT_LANES == 0 && ids.iter().enumerate().all(|(j, &i)| i == t0 + j);
        if aligned {
            let mut acc = self.tile_dots(q, t0 / DOT_LANES);
            for a in &mut acc[ids.len()..] {
                *a = 0.0;
            }
            return acc;
        }
        let mut acc = [0f64; DOT_LANES];
        for (a, &i) in acc.iter_mut().zip(ids) {
            let tile = self.tile(i / DOT_LANES);
            let lane = i % DOT_LANES;
            for (c, &qc) in q.iter().enumerate() {
                *a += qc * f64::from(tile[c * DOT_LANES + lane]);
            }
        }
        acc
    }
}

/// Keys transposed into tiles of eight tokens (`DOT_LANES`), `[⌈N/8⌉][D][8]` (zero-padded): the
/// exact dot products `q · k_i` of eight consecutive tokens then run as vector lanes, each
/// still summed in f64 channel by channel, so every value equals a sequential loop's.
#[derive(Debug, Clone)]
pub struct KeyTiles {
    tiles: Vec<f32>,
    n: usize,
    dim: usize,
}

impl KeyTiles {
    /// Transposes the rows of `keys`.
    pub fn new(keys: KvView<'_>) -> Self {
        let (n, d) = (keys.rows(), keys.dim);
        let mut tiles = vec![0f32; n.div_ceil(DOT_LANES) * d * DOT_LANES];
        for i in 0..n {
            let row = row_unchecked(&keys, i);
            let base = (i / DOT_LANES) * d * DOT_LANES + i % DOT_LANES;
            for (c, &x) in row.iter().enumerate() {
                tiles[base + c * DOT_LANES] = x;
            }
        }
        KeyTiles { tiles, n, dim: d }
    }

    /// Tokens held.
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Channels per token.
    pub fn dim(&self) -> usize {
        self.dim
    }

    fn tile(&self, t: usize) -> &[f32] {
        let len = self.dim * DOT_LANES;
        &self.tiles[t * len..(t + 1) * len]
    }

    #[inline]
    fn tile_dots(&self, q: &[f64], t: usize) -> [f64; DOT_LANES] {
        let mut acc = [0f64; DOT_LANES];
        for (&qc, col) in q.iter().zip(self.tile(t).chunks_exact(DOT_LANES)) {
            for (a, &x) in acc.iter_mut().zip(col) {
                *a += qc * f64::from(x);
            }
        }
        acc
    }

    /// Exact dot products of one query with the first `out.len()` keys:
    /// `out[i] = Σ_c f64(q_c)·f64(k_ic)`, summed in channel order (for [`attend_dots`]).
    ///
    /// # Errors
    /// [`PlanError::ShapeMismatch`] if `q.len() ≠ D` or `out.len() > N`.
    pub fn dots(&self, q: &[f32], out: &mut [f64]) -> Result<(), PlanError> {
        if q.len() != self.dim {
            return Err(PlanError::ShapeMismatch {
                what: "query length (key dim)",
                expected: self.dim,
                got: q.len(),
            });
        }
        if out.len() > self.n {
            return Err(PlanError::ShapeMismatch {
                what: "dots length (at most the key rows)",
                expected: self.n,
                got: out.len(),
            });
        }
        let q: Vec<f64> = q.iter().map(|&x| f64::from(x)).collect();
        for (t, chunk) in out.chunks_mut(DOT_LANES).enumerate() {
            chunk.copy_from_slice(&self.tile_dots(&q, t)[..chunk.len()]);
        }
        Ok(())
    }

    /// Exact scores of every key for one query (the exact top-k oracle's, in docs/SPEC.md
    /// §4's table): `out[i] = (Σ_c f64(q_c)·f64(k_ic)) as f32`, summed in channel order.
    ///
    /// # Errors
    /// [`PlanError::ShapeMismatch`] if `q.len() ≠ D` or `out.len() ≠ N`.
    pub fn scores(&self, q: &[f32], out: &mut [f32]) -> Result<(), PlanError> {
        if q.len() != self.dim {
            return Err(PlanError::ShapeMismatch {
                what: "query length (key dim)",
                expected: self.dim,
                got: q.len(),
            });
        }
        if out.len() != self.n {
            return Err(PlanError::ShapeMismatch {
                what: "scores length (key rows)",
                expected: self.n,
                got: out.len(),
            });
        }
        let q: Vec<f64> = q.iter().map(|&x| f64::from(x)).collect();
        for (t, chunk) in out.chunks_mut(DOT_LANES).enumerate() {
            for (o, x) in chunk.iter_mut().zip(self.tile_dots(&q, t)) {
                *o = x as f32;
            }
        }
        Ok(())
    }
}

fn attend_iter(
    q: &[f32],
    keys: impl DotSource,
    values: KvView<'_>,
    tokens: impl Iterator<Item = usize> + Clone,
    scale: f32,
    softcap: Option<f32>,
    out: &mut [f32],
) -> Result<(), PlanError> {
    if q.len() != keys.dim() {
        return Err(PlanError::ShapeMismatch {
            what: "query length (key dim)",
            expected: keys.dim(),
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
    let q64: Vec<f64> = q.iter().map(|&x| f64::from(x)).collect();
    let all = tokens.clone();
    let mut tokens = tokens.peekable();
    while tokens.peek().is_some() {
        // Up to eight tokens at a time: their dot products are independent chains, so they
        // overlap in the pipeline; each is still summed channel by channel, in order.
        let mut ids = [0usize; DOT_LANES];
        let mut cnt = 0;
        for (slot, i) in ids.iter_mut().zip(tokens.by_ref()) {
            *slot = i;
            cnt += 1;
        }
        let valid = ids[..cnt].iter().take_while(|&&i| i < krows).count();
        let dots = keys.dots(&q64, &ids[..valid]);
        for (j, &i) in ids[..cnt].iter().enumerate() {
            if j >= valid {
                return Err(PlanError::IndexOutOfRange {
                    what: "keys",
                    index: i,
                    len: krows,
                });
            }
            if i >= vrows {
                return Err(PlanError::IndexOutOfRange {
                    what: "values",
                    index: i,
                    len: vrows,
                });
            }
            let v = row_unchecked(&values, i);
            let mut logit = scale * dots[j];
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
    }
    if sum == 0.0 {
        return Err(PlanError::EmptySelection);
    }
    // A NaN or an infinity in a value row makes its accumulator non-finite (whatever its
    // weight: 0·∞ is NaN), and finite f32 values cannot overflow an f64 sum; so one check
    // here finds every bad row, and only then are the rows searched for the first one.
    if acc.iter().any(|a| !a.is_finite()) {
        let index = all
            .into_iter()
            .find(|&i| row_unchecked(&values, i).iter().any(|x| !x.is_finite()))
            .unwrap_or(0);
        return Err(PlanError::NonFinite {
            what: "value row of token",
            index,
        });
    }
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = (a / sum) as f32;
    }
    Ok(())
}

/// Tokens whose dot products [`dot_lanes`] computes together.
const DOT_LANES: usize = 8;

/// Row `i` of a view, for `i < view.rows()` (checked by the caller; the slice index still
/// bounds-checks).
#[inline(always)]
fn row_unchecked<'a>(view: &KvView<'a>, i: usize) -> &'a [f32] {
    let start = i * view.stride + view.offset;
    &view.data[start..start + view.dim]
}

/// `q · k_i` in f64 for up to [`DOT_LANES`] rows `ids` (each `< keys.rows()`), every sum
/// accumulated channel by channel from `0.0` in channel order: the value of a sequential
/// `Σ_c f64(q_c)·f64(k_ic)` loop, bit for bit (an f32×f32 product is exact in f64, so fused
/// and unfused multiply-adds agree). Lanes past `ids.len()` are left at 0.
#[inline]
fn dot_lanes(q: &[f64], keys: &KvView<'_>, ids: &[usize]) -> [f64; DOT_LANES] {
    let d = keys.dim;
    let q = &q[..d];
    let first = ids.first().map_or(&[][..], |&i| row_unchecked(keys, i));
    let mut rows: [&[f32]; DOT_LANES] = [first; DOT_LANES];
    for (r, &i) in rows.iter_mut().zip(ids) {
        *r = row_unchecked(keys, i);
    }
    let mut acc = [0f64; DOT_LANES];
    if ids.is_empty() {
        return acc;
    }
    for (c, &qc) in q.iter().enumerate() {
        for (a, r) in acc.iter_mut().zip(&rows) {
            *a += qc * f64::from(r[c]);
        }
    }
    for a in &mut acc[ids.len()..] {
        *a = 0.0;
    }
    acc
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

    /// The tiled keys give the same dense outputs and exact scores, bit for bit, as the row
    /// reads and a sequential f64 loop (dims not a multiple of 8, windows at odd offsets).
    #[test]
    fn key_tiles_are_bit_identical() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for (n, hkv, d) in [(1, 1, 4), (13, 2, 8), (300, 3, 64), (1001, 1, 72)] {
            let keys: Vec<f32> = (0..n * hkv * d)
                .map(|_| 4.0 * rng.sample::<f32, _>(StandardNormal))
                .collect();
            let values: Vec<f32> = (0..n * hkv * d)
                .map(|_| rng.sample::<f32, _>(StandardNormal))
                .collect();
            let h = hkv - 1;
            let (kv, vv) = (
                KvView::head(&keys, hkv, d, h),
                KvView::head(&values, hkv, d, h),
            );
            let tiles = KeyTiles::new(kv);
            assert_eq!((tiles.rows(), tiles.dim()), (n, d));
            let q: Vec<f32> = (0..d).map(|_| rng.sample(StandardNormal)).collect();
            let mut scores = vec![0f32; n];
            tiles.scores(&q, &mut scores).unwrap();
            for (i, s) in scores.iter().enumerate() {
                let k = kv.row(i).unwrap();
                let e: f64 = q
                    .iter()
                    .zip(k)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum();
                assert_eq!(s.to_bits(), (e as f32).to_bits(), "n {n} d {d} token {i}");
            }
            let scale = 1.0 / (d as f32).sqrt();
            for upto in [0, n / 2, n - 1] {
                for window in [None, Some(1), Some(5), Some(n)] {
                    for cap in [None, Some(30.0f32)] {
                        let (mut a, mut b) = (vec![0.0; d], vec![0.0; d]);
                        attend_dense(&q, kv, vv, upto, window, scale, cap, &mut a).unwrap();
                        attend_dense_tiled(&q, &tiles, vv, upto, window, scale, cap, &mut b)
                            .unwrap();
                        assert_eq!(a, b, "n {n} d {d} upto {upto} window {window:?}");
                        let mut dots = vec![0f64; upto + 1];
                        tiles.dots(&q, &mut dots).unwrap();
                        let idx: Vec<u32> = (0..=upto as u32).filter(|i| i % 3 != 1).collect();
                        if !idx.is_empty() {
                            attend(&q, kv, vv, &idx, scale, cap, &mut a).unwrap();
                            attend_dots(&dots, vv, &idx, scale, cap, &mut b).unwrap();
                            assert_eq!(a, b, "attend_dots: n {n} d {d} upto {upto}");
                        }
                    }
                }
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

    /// A NaN or an infinity in a selected value row is an error naming the token, from every
    /// entry point, even when its weight underflows to 0; never a NaN output with `Ok`.
    #[test]
    fn non_finite_values_are_errors() {
        let keys = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 900.0, 0.0]; // [4, 2]
        let k = KvView::contiguous(&keys, 2);
        let q = [1.0, 0.0];
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut values = [1.0f32; 8];
            values[2 * 2 + 1] = bad; // token 2, whose logit 0 is far below token 3's 900
            let v = KvView::contiguous(&values, 2);
            let want = Err(PlanError::NonFinite {
                what: "value row of token",
                index: 2,
            });
            let mut out = [7.0f32; 2];
            assert_eq!(attend(&q, k, v, &[0, 2, 3], 1.0, None, &mut out), want);
            assert_eq!(out, [7.0, 7.0], "out written");
            assert_eq!(attend_dense(&q, k, v, 3, None, 1.0, None, &mut out), want);
            let tiles = KeyTiles::new(k);
            assert_eq!(
                attend_dense_tiled(&q, &tiles, v, 3, None, 1.0, None, &mut out),
                want
            );
            let mut dots = [0f64; 4];
            tiles.dots(&q, &mut dots).unwrap();
            assert_eq!(attend_dots(&dots, v, &[3, 2], 1.0, None, &mut out), want);
            // A bad row that is not selected is not read.
            attend(&q, k, v, &[0, 1, 3], 1.0, None, &mut out).unwrap();
            assert!(out.iter().all(|x| x.is_finite()));
        }
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn a_head_past_hkv_panics() {
        let data = [0f32; 12];
        let _ = KvView::head(&data, 2, 3, 2);
    }
}
