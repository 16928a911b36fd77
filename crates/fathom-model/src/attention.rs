//! Attention over plain slices: the dense prefill kernel, the decode-attention hook and its
//! dense implementation.
//!
//! Layouts (row-major f32): queries `[T, Hq, D]`, the KV cache `[n, Hkv, D]` per layer, outputs
//! `[T, Hq, D]`. Query head `h` reads KV head `h / G` with `G = Hq / Hkv` (GQA, llama.cpp order).
//! For a query at position `pos` the visible keys are `lo..=pos` with `lo = 0` on global layers
//! and `lo = pos + 1 − W` (clamped) on a sliding-window layer of width `W`:
//!
//! ```text
//! o = Σ_j softmax_j(s·q·k_j) v_j,   s = 1/√D,   j ∈ lo..=pos
//! ```
//!
//! The kernel folds `s` into `q` once, computes the scores of the visible range only (that is the
//! mask), then one fused pass does `exp(x − max)` and the sum, and one pass accumulates `V`.

use rayon::prelude::*;

/// A read-only view of one layer's keys or values: `n` rows of `[Hkv, D]`.
#[derive(Clone, Copy, Debug)]
pub struct KvSlice<'a> {
    /// `n · Hkv · D` values, row-major `[n, Hkv, D]`.
    pub data: &'a [f32],
    /// Number of tokens.
    pub n: usize,
    /// KV heads.
    pub n_kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
}

impl<'a> KvSlice<'a> {
    /// The `D` channels of token `i`, KV head `h`.
    #[inline]
    pub fn row(&self, i: usize, h: usize) -> &'a [f32] {
        let d = self.head_dim;
        let off = (i * self.n_kv_heads + h) * d;
        &self.data[off..off + d]
    }
}

/// The attention used for **decode steps** (one new token). Prefill always uses the dense kernel.
///
/// `q` is `[Hq, D]` **unscaled** (after RoPE and any QK-norm, exactly what a capture stores); the
/// implementation applies the model's scale `1/√D`. `k`/`v` hold tokens `0..=pos` (the new token's
/// own key is already in the cache). `window` is `Some(W)` on a sliding-window layer: only keys
/// `pos+1−W..=pos` are visible. `out` is `[Hq, D]`.
///
/// A sparse scanner (the `fathom-plan` selection protocol) implements this trait to replace
/// dense attention on every generated token.
///
/// An implementation that fails returns its error, and [`crate::Model::decode_step`] returns it
/// as [`crate::Error::Attention`] naming the layer: a failed step never falls back to another
/// attention, so no output is labelled with a method that did not make it.
pub trait DecodeAttention {
    /// Attend one decode query for `layer`.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        k: KvSlice<'_>,
        v: KvSlice<'_>,
        pos: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) -> Result<(), AttendError>;
}

/// What a [`DecodeAttention`] returns on failure: the implementation's own error, boxed
/// (downcast it to recover the type).
pub type AttendError = Box<dyn std::error::Error + Send + Sync>;

/// Exact dense attention (the reference and the default).
#[derive(Clone, Copy, Debug, Default)]
pub struct Dense;

impl DecodeAttention for Dense {
    fn attend(
        &mut self,
        _layer: usize,
        q: &[f32],
        k: KvSlice<'_>,
        v: KvSlice<'_>,
        pos: usize,
        window: Option<usize>,
        out: &mut [f32],
    ) -> Result<(), AttendError> {
        let d = k.head_dim;
        let scale = 1.0 / (d as f32).sqrt();
        let qs: Vec<f32> = q.iter().map(|x| x * scale).collect();
        dense_attention(&qs, k, v, pos, 1, window, out);
        Ok(())
    }
}

/// First visible key for a query at `pos`.
#[inline]
pub fn window_start(pos: usize, window: Option<usize>) -> usize {
    match window {
        Some(w) if w > 0 => (pos + 1).saturating_sub(w),
        _ => 0,
    }
}

/// Dense causal attention for `t` consecutive queries at positions `pos0..pos0+t`.
///
/// `q_scaled` is `[t, Hq, D]` already multiplied by the softmax scale; `out` is `[t, Hq, D]`.
/// Work is cut into tiles of up to [`TILE_TOKENS`] tokens × the `G` query heads of one KV head,
/// each two GEMMs (`S = Q Kᵀ` over the tile's key range, then `O = P V`) around a fused masked
/// softmax, one rayon task per tile. Grouping the `G` heads reads each key and value row once
/// per group, which is what bounds a decode step at long context (memory traffic).
pub fn dense_attention(
    q_scaled: &[f32],
    k: KvSlice<'_>,
    v: KvSlice<'_>,
    pos0: usize,
    t: usize,
    window: Option<usize>,
    out: &mut [f32],
) {
    let d = k.head_dim;
    let hkv = k.n_kv_heads;
    let hq = q_scaled.len() / (t * d);
    let g = hq / hkv;
    assert_eq!(q_scaled.len(), t * hq * d, "q shape");
    assert_eq!(out.len(), t * hq * d, "out shape");
    assert!(
        pos0 + t <= k.n && pos0 + t <= v.n,
        "keys 0..{} not in the cache of {}",
        pos0 + t,
        k.n
    );
    let n_tiles = t.div_ceil(TILE_TOKENS);
    let tiles: Vec<(usize, usize, Vec<f32>)> = (0..hkv * n_tiles)
        .into_par_iter()
        .map(|task| {
            let (kvh, tile) = (task / n_tiles, task % n_tiles);
            let a = tile * TILE_TOKENS;
            let b = (a + TILE_TOKENS).min(t);
            (
                kvh,
                a,
                attend_tile(q_scaled, k, v, kvh, g, pos0, a, b, window),
            )
        })
        .collect();
    for (kvh, a, o) in tiles {
        // o is [tokens, G, D]; scatter into out [t, Hq, D].
        for (ti, rows) in o.chunks(g * d).enumerate() {
            let dst = ((a + ti) * hq + kvh * g) * d;
            out[dst..dst + g * d].copy_from_slice(rows);
        }
    }
}

/// Query tokens per prefill attention tile.
pub const TILE_TOKENS: usize = 32;

/// Tokens `a..b` of the chunk × the `g` query heads of KV head `kvh`: returns `[b−a, g, D]`.
#[allow(clippy::too_many_arguments)]
fn attend_tile(
    q_scaled: &[f32],
    k: KvSlice<'_>,
    v: KvSlice<'_>,
    kvh: usize,
    g: usize,
    pos0: usize,
    a: usize,
    b: usize,
    window: Option<usize>,
) -> Vec<f32> {
    let d = k.head_dim;
    let hq = g * k.n_kv_heads;
    let row_stride = k.n_kv_heads * d;
    let m = (b - a) * g;
    let lo = window_start(pos0 + a, window);
    let hi = pos0 + b - 1;
    let nk = hi + 1 - lo;
    // Q tile [m, D], rows (token, head-in-group).
    let mut qt = Vec::with_capacity(m * d);
    for ti in a..b {
        let off = (ti * hq + kvh * g) * d;
        qt.extend_from_slice(&q_scaled[off..off + g * d]);
    }
    let mut s = vec![0f32; m * nk];
    let kbase = &k.data[lo * row_stride + kvh * d..];
    let vbase = &v.data[lo * row_stride + kvh * d..];
    debug_assert!(
        kbase.len() >= (nk - 1) * row_stride + d && vbase.len() >= (nk - 1) * row_stride + d
    );
    // SAFETY: S is m × nk (row-major), Q is m × D (row-major), and the key matrix read as D × nk
    // with column stride `row_stride` stays inside `kbase` (checked above); no aliasing.
    unsafe {
        gemm::gemm(
            m,
            nk,
            d,
            s.as_mut_ptr(),
            1,
            nk as isize,
            false,
            qt.as_ptr(),
            1,
            d as isize,
            kbase.as_ptr(),
            row_stride as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
    let mut inv = vec![0f32; m];
    for (r, row) in s.chunks_mut(nk).enumerate() {
        let pos = pos0 + a + r / g;
        let (rlo, rhi) = (window_start(pos, window) - lo, pos - lo);
        row[..rlo].fill(0.0);
        row[rhi + 1..].fill(0.0);
        let vis = &mut row[rlo..=rhi];
        let max = vis.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        inv[r] = 1.0 / exp_sub_sum(vis, max);
    }
    let mut o = vec![0f32; m * d];
    // SAFETY: O is m × D, P (= S) is m × nk, the value matrix nk × D with row stride
    // `row_stride` stays inside `vbase` (checked above); no aliasing.
    unsafe {
        gemm::gemm(
            m,
            d,
            nk,
            o.as_mut_ptr(),
            1,
            d as isize,
            false,
            s.as_ptr(),
            1,
            nk as isize,
            vbase.as_ptr(),
            1,
            row_stride as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
    for (row, &f) in o.chunks_mut(d).zip(&inv) {
        row.iter_mut().for_each(|x| *x *= f);
    }
    o
}

/// One query against keys `lo..=hi` of KV head `kvh`; `q` pre-scaled.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn attend_one(
    q: &[f32],
    k: KvSlice<'_>,
    v: KvSlice<'_>,
    kvh: usize,
    lo: usize,
    hi: usize,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let n = hi + 1 - lo;
    scores.clear();
    scores.resize(n, 0.0);
    let mut max = f32::NEG_INFINITY;
    for (j, s) in scores.iter_mut().enumerate() {
        let x = dot(q, k.row(lo + j, kvh));
        *s = x;
        max = max.max(x);
    }
    let sum = exp_sub_sum(scores, max);
    let inv = 1.0 / sum;
    out.fill(0.0);
    for (j, &p) in scores.iter().enumerate() {
        axpy(p * inv, v.row(lo + j, kvh), out);
    }
}

/// `Σ a_i b_i` with 16 independent FMA lanes (vectorises to AVX2/FMA on x86-64-v3).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y += a·x`.
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi = xi.mul_add(a, *yi);
    }
}

/// In place `x_i ← exp(x_i − m)`; returns `Σ x_i`. Branch-free polynomial exp so that the loop
/// vectorises; relative error below 2e-7 on the range used (arguments ≤ 0).
#[inline]
pub fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        for i in 0..8 {
            let e = fast_exp(c[i] - m);
            c[i] = e;
            acc[i] += e;
        }
    }
    let mut s: f32 = acc.iter().sum();
    for xi in chunks.into_remainder() {
        let e = fast_exp(*xi - m);
        *xi = e;
        s += e;
    }
    s
}

/// `e^x` for `x ≤ 0` (clamped below at −87.3, where it returns ≈ 1e-38; `−∞` gives that too).
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.clamp(-87.3, 88.0);
    let n = (x * LOG2E).round();
    let r = x - n * LN2_HI - n * LN2_LO;
    // exp(r) on |r| ≤ ln2/2: degree-6 Taylor/minimax, error < 2e-7 relative
    let p = 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    let bits = ((n as i32 + 127) as u32) << 23;
    p * f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_std() {
        let mut worst = 0f32;
        let mut x = -80.0f32;
        while x <= 0.0 {
            let rel = ((fast_exp(x) - x.exp()) / x.exp()).abs();
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert!(fast_exp(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn dense_matches_naive() {
        let (n, hkv, g, d) = (80usize, 2usize, 3usize, 24usize);
        let hq = hkv * g;
        let mut seed = 1u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        let kd: Vec<f32> = (0..n * hkv * d).map(|_| rnd()).collect();
        let vd: Vec<f32> = (0..n * hkv * d).map(|_| rnd()).collect();
        let k = KvSlice {
            data: &kd,
            n,
            n_kv_heads: hkv,
            head_dim: d,
        };
        let v = KvSlice {
            data: &vd,
            n,
            n_kv_heads: hkv,
            head_dim: d,
        };
        for window in [None, Some(5)] {
            for t in [1usize, 4, 37] {
                let pos0 = n - t;
                let q: Vec<f32> = (0..t * hq * d).map(|_| rnd()).collect();
                let mut out = vec![0.0; t * hq * d];
                dense_attention(&q, k, v, pos0, t, window, &mut out);
                for ti in 0..t {
                    for h in 0..hq {
                        let pos = pos0 + ti;
                        let qi = &q[(ti * hq + h) * d..][..d];
                        let lo = window_start(pos, window);
                        let s: Vec<f64> = (lo..=pos)
                            .map(|j| {
                                qi.iter()
                                    .zip(k.row(j, h / g))
                                    .map(|(a, b)| (*a as f64) * (*b as f64))
                                    .sum()
                            })
                            .collect();
                        let m = s.iter().cloned().fold(f64::MIN, f64::max);
                        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                        for c in 0..d {
                            let want: f64 = (lo..=pos)
                                .zip(&s)
                                .map(|(j, x)| (x - m).exp() / z * v.row(j, h / g)[c] as f64)
                                .sum();
                            let got = out[(ti * hq + h) * d + c] as f64;
                            assert!(
                                (got - want).abs() < 1e-5,
                                "t{ti} h{h} c{c}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
