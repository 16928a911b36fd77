//! `y = W x` for one activation row over raw GGUF `Q4_1` / `Q5_0` blocks, each weight
//! dequantized in registers to exactly the value candle's `dequantize` gives it.
//!
//! Why: candle 0.11.1 has no SIMD dot product for these two types on x86, so
//! [`crate::WeightMode::Auto`] keeps them dequantized to f32 for the matmuls. That is the fast
//! path for a prefill chunk, but a decode step (one token) then reads 32 bits per weight where
//! the file holds 5 or 5.5: SmolLM2-135M's 106 M `Q4_1` weights are 425 MB of f32 per token.
//! This kernel reads the blocks themselves.
//!
//! Math. A block `b` holds 32 weights of one row, `w_i = d_b·q_i + m_b` (`Q4_1`, `q_i ∈ 0..16`)
//! or `w_i = d_b·(q_i − 16)` (`Q5_0`, `q_i ∈ 0..32`), with `d_b`, `m_b` f16 widened exactly to
//! f32. Then, with `X_b = Σ_{i∈b} x_i`,
//!
//! ```text
//! y = Σ_b d_b · Σ_{i∈b} q_i x_i  +  Σ_b c_b · X_b,      c_b = m_b (Q4_1) or −16·d_b (Q5_0),
//! ```
//!
//! which is `Σ_i w_i x_i` in exact arithmetic. In f32 only the order of the additions differs
//! from a dot product of the dequantized row, so both lie within the standard summation bound
//! `γ_n · Σ_i |w_i x_i|` of the exact value (`γ_n = n·u/(1 − n·u)`, `u = 2⁻²⁴`); the tests hold
//! the kernel to that bound against an f64 reference of candle's own dequantized weights.
//!
//! Invariant: the AVX2 kernel and the portable one compute the same formula; the AVX2 one is
//! used only where the CPU reports AVX2 and FMA at run time.

use candle_core::quantized::{GgmlDType, QTensor};
use rayon::prelude::*;

/// Weights per block, for both types.
const QK: usize = 32;

/// Output rows per rayon task: a 576-wide `Q4_1` row is 360 bytes, so 32 rows are ≈ 11 KB of
/// weights per task, enough to amortise the task's dispatch.
const ROWS_PER_TASK: usize = 32;

/// The block types this kernel reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `d: f16, m: f16, qs: [u8; 16]` (20 bytes).
    Q4_1,
    /// `d: f16, qh: [u8; 4], qs: [u8; 16]` (22 bytes).
    Q5_0,
}

impl Kind {
    fn block_bytes(self) -> usize {
        match self {
            Kind::Q4_1 => 20,
            Kind::Q5_0 => 22,
        }
    }
}

/// A `[n_out][n_in]` matrix of raw `Q4_1` or `Q5_0` blocks, read by [`QuantRows::matvec`].
#[derive(Clone, Debug)]
pub(crate) struct QuantRows {
    kind: Kind,
    data: Vec<u8>,
    n_out: usize,
    n_in: usize,
}

impl QuantRows {
    /// The blocks of a `Q4_1` or `Q5_0` matrix of `n_out` rows of `n_in` weights; `None` for
    /// any other type, a shape that is not a whole number of blocks per row, or storage that
    /// is not on the CPU.
    pub(crate) fn new(q: &QTensor, n_out: usize, n_in: usize) -> Option<QuantRows> {
        let kind = match q.dtype() {
            GgmlDType::Q4_1 => Kind::Q4_1,
            GgmlDType::Q5_0 => Kind::Q5_0,
            _ => return None,
        };
        if n_in == 0 || n_in % QK != 0 {
            return None;
        }
        let data = q.data().ok()?.into_owned();
        if data.len() != n_out * (n_in / QK) * kind.block_bytes() {
            return None;
        }
        Some(QuantRows {
            kind,
            data,
            n_out,
            n_in,
        })
    }

    /// `y[r] = Σ_i W[r][i]·x[i]` for every row `r` (rows in parallel on the rayon pool).
    ///
    /// `x.len() == n_in` and `y.len() == n_out` are the caller's contract (checked in debug
    /// builds; [`crate::model`] sizes both from the same matrix).
    pub(crate) fn matvec(&self, x: &[f32], y: &mut [f32]) {
        debug_assert_eq!(x.len(), self.n_in);
        debug_assert_eq!(y.len(), self.n_out);
        let xsum: Vec<f32> = x.chunks_exact(QK).map(|c| c.iter().sum()).collect();
        let row_bytes = (self.n_in / QK) * self.kind.block_bytes();
        let avx2 = has_avx2_fma();
        y.par_chunks_mut(ROWS_PER_TASK)
            .zip(self.data.par_chunks(ROWS_PER_TASK * row_bytes))
            .for_each(|(ys, rows)| {
                for (yr, row) in ys.iter_mut().zip(rows.chunks_exact(row_bytes)) {
                    *yr = dot_row(self.kind, row, x, &xsum, avx2);
                }
            });
    }
}

/// Whether this CPU can run the AVX2 kernel (detected once per call, cheaply cached by std).
fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn dot_row(kind: Kind, row: &[u8], x: &[f32], xsum: &[f32], avx2: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: the caller checked AVX2 and FMA at run time; `row` holds `xsum.len()` whole
        // blocks and `x` `32·xsum.len()` values (the matrix's shape, checked in `new`).
        return unsafe {
            match kind {
                Kind::Q4_1 => avx2::dot_q4_1(row, x, xsum),
                Kind::Q5_0 => avx2::dot_q5_0(row, x, xsum),
            }
        };
    }
    let _ = avx2;
    match kind {
        Kind::Q4_1 => portable::dot_q4_1(row, x, xsum),
        Kind::Q5_0 => portable::dot_q5_0(row, x, xsum),
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The reference: the module formula, one weight at a time.
mod portable {
    use super::{f16_at, QK};

    pub(super) fn dot_q4_1(row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
        let mut acc = 0f32;
        for ((blk, xb), &xs) in row.chunks_exact(20).zip(x.chunks_exact(QK)).zip(xsum) {
            let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
            let mut s = 0f32;
            for j in 0..QK / 2 {
                let q = blk[4 + j];
                s += (q & 0x0F) as f32 * xb[j] + (q >> 4) as f32 * xb[j + QK / 2];
            }
            acc += d * s + m * xs;
        }
        acc
    }

    pub(super) fn dot_q5_0(row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
        let mut acc = 0f32;
        for ((blk, xb), &xs) in row.chunks_exact(22).zip(x.chunks_exact(QK)).zip(xsum) {
            let d = f16_at(blk, 0);
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            let mut s = 0f32;
            for j in 0..QK / 2 {
                let q = blk[6 + j];
                let lo = (q & 0x0F) as u32 | ((qh >> j) & 1) << 4;
                let hi = (q >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
                s += lo as f32 * xb[j] + hi as f32 * xb[j + QK / 2];
            }
            acc += d * s - 16.0 * d * xs;
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{f16_at, QK};
    use std::arch::x86_64::*;

    /// Eight `u8` codes (the low 8 bytes of `b`) as eight f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn widen8(b: __m128i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))
    }

    /// Σ over the block of `codes[i]·x[i]`, for 32 codes given as low (elements 0..16) and
    /// high (16..32) byte vectors.
    ///
    /// # Safety
    /// `xb` points at 32 readable f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block_dot(lo: __m128i, hi: __m128i, xb: *const f32) -> __m256 {
        // SAFETY: `xb` has 32 readable f32 (the caller's contract); unaligned loads.
        unsafe {
            let mut s = _mm256_mul_ps(widen8(lo), _mm256_loadu_ps(xb));
            s = _mm256_fmadd_ps(
                widen8(_mm_srli_si128::<8>(lo)),
                _mm256_loadu_ps(xb.add(8)),
                s,
            );
            s = _mm256_fmadd_ps(widen8(hi), _mm256_loadu_ps(xb.add(16)), s);
            _mm256_fmadd_ps(
                widen8(_mm_srli_si128::<8>(hi)),
                _mm256_loadu_ps(xb.add(24)),
                s,
            )
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// AVX2 and FMA are available; `row` holds `xsum.len()` blocks of 20 bytes and `x` at
    /// least `32·xsum.len()` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_q4_1(row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
        let nib = _mm_set1_epi8(0x0F);
        let mut acc = _mm256_setzero_ps();
        let mut bias = 0f32;
        for (b, &xs) in xsum.iter().enumerate() {
            let blk = &row[b * 20..(b + 1) * 20];
            let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
            // SAFETY: `blk[4..20]` is 16 readable bytes; `x[32b..32b+32]` is in bounds (the
            // contract above).
            unsafe {
                let qs = _mm_loadu_si128(blk.as_ptr().add(4) as *const __m128i);
                let lo = _mm_and_si128(qs, nib);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), nib);
                let s = block_dot(lo, hi, x.as_ptr().add(b * QK));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc);
            }
            bias += m * xs;
        }
        hsum(acc) + bias
    }

    /// 0x10 in byte `i` where bit `i mod 8` of `k0` (bytes 0..8) or `k1` (bytes 8..16) is set.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn fifth_bits(k0: u8, k1: u8, bit: __m128i) -> __m128i {
        let spread = _mm_set_epi64x(i64::from_le_bytes([k1; 8]), i64::from_le_bytes([k0; 8]));
        let set = _mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit);
        _mm_and_si128(set, _mm_set1_epi8(0x10))
    }

    /// # Safety
    /// AVX2 and FMA are available; `row` holds `xsum.len()` blocks of 22 bytes and `x` at
    /// least `32·xsum.len()` values.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_q5_0(row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
        let nib = _mm_set1_epi8(0x0F);
        // Byte i of the 16-byte lane picks bit (i mod 8) of the qh byte broadcast into it.
        let bit = _mm_set_epi8(-128, 64, 32, 16, 8, 4, 2, 1, -128, 64, 32, 16, 8, 4, 2, 1);
        let mut acc = _mm256_setzero_ps();
        let mut bias = 0f32;
        for (b, &xs) in xsum.iter().enumerate() {
            let blk = &row[b * 22..(b + 1) * 22];
            let d = f16_at(blk, 0);
            // The fifth bit of element i is bit i of qh: bytes 0..2 of qh serve elements
            // 0..16, bytes 2..4 elements 16..32.
            let (lo5, hi5) = (
                fifth_bits(blk[2], blk[3], bit),
                fifth_bits(blk[4], blk[5], bit),
            );
            // SAFETY: `blk[6..22]` is 16 readable bytes; `x[32b..32b+32]` is in bounds (the
            // contract above).
            unsafe {
                let qs = _mm_loadu_si128(blk.as_ptr().add(6) as *const __m128i);
                let lo = _mm_or_si128(_mm_and_si128(qs, nib), lo5);
                let hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16::<4>(qs), nib), hi5);
                let s = block_dot(lo, hi, x.as_ptr().add(b * QK));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc);
            }
            bias -= 16.0 * d * xs;
        }
        hsum(acc) + bias
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};
    use rand::{Rng, SeedableRng};

    /// The summation bound `γ_n = n·u/(1 − n·u)` of the module doc, with a `n + 64` count of
    /// roundings: `n` products and additions, the block sums of x, the scale products and the
    /// combine across lanes and blocks (fewer than 64 extra for these sizes).
    fn gamma(n: usize) -> f64 {
        let u = f32::EPSILON as f64 / 2.0;
        let k = (n + 64) as f64 * u;
        k / (1.0 - k)
    }

    fn check(dtype: GgmlDType, n_out: usize, n_in: usize, seed: u64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let w: Vec<f32> = (0..n_out * n_in)
            .map(|_| rng.gen_range(-1.0f32..1.0) * if rng.gen_bool(0.01) { 8.0 } else { 1.0 })
            .collect();
        let x: Vec<f32> = (0..n_in).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
        let t = Tensor::from_vec(w, (n_out, n_in), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, dtype).unwrap();
        let deq: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let rows = QuantRows::new(&q, n_out, n_in).expect("a Q4_1/Q5_0 matrix");
        let mut y = vec![0f32; n_out];
        rows.matvec(&x, &mut y);
        let xsum: Vec<f32> = x.chunks_exact(QK).map(|c| c.iter().sum()).collect();
        let rb = (n_in / QK) * rows.kind.block_bytes();
        for r in 0..n_out {
            let wr = &deq[r * n_in..(r + 1) * n_in];
            let exact: f64 = wr.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = wr
                .iter()
                .zip(&x)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            // The kernel rounds d·Σq·x and c·X with c = m (Q4_1) or −16·d (Q5_0), terms as large
            // as |w·x| + |c|·|x| each: bound by Σ|w·x| + 2·Σ_b |c_b|·Σ_{i∈b}|x_i|.
            let row = &rows.data[r * rb..(r + 1) * rb];
            let offsets: f64 = row
                .chunks_exact(rows.kind.block_bytes())
                .zip(x.chunks_exact(QK))
                .map(|(blk, xb)| {
                    let c = match rows.kind {
                        Kind::Q4_1 => f16_at(blk, 2).abs() as f64,
                        Kind::Q5_0 => 16.0 * f16_at(blk, 0).abs() as f64,
                    };
                    c * xb.iter().map(|v| v.abs() as f64).sum::<f64>()
                })
                .sum();
            let tol = gamma(n_in) * (mag + 2.0 * offsets);
            let port = match rows.kind {
                Kind::Q4_1 => portable::dot_q4_1(row, &x, &xsum),
                Kind::Q5_0 => portable::dot_q5_0(row, &x, &xsum),
            };
            for (what, got) in [("matvec", y[r]), ("portable", port)] {
                assert!(
                    (got as f64 - exact).abs() <= tol,
                    "{dtype:?} {n_out}×{n_in} seed {seed} row {r} {what}: {got} vs {exact} (tol {tol:e})"
                );
            }
        }
    }

    #[test]
    fn the_block_kernels_match_candles_dequantized_weights_at_several_sizes() {
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q5_0] {
            for (seed, (n_out, n_in)) in [(1, 32), (7, 64), (33, 576), (192, 576), (65, 1536)]
                .into_iter()
                .enumerate()
            {
                check(dtype, n_out, n_in, seed as u64);
            }
        }
    }

    #[test]
    fn other_types_and_ragged_rows_are_refused() {
        let t = Tensor::zeros((4, 64), candle_core::DType::F32, &Device::Cpu).unwrap();
        let q8 = QTensor::quantize(&t, GgmlDType::Q8_0).unwrap();
        assert!(QuantRows::new(&q8, 4, 64).is_none());
        let q41 = QTensor::quantize(&t, GgmlDType::Q4_1).unwrap();
        assert!(QuantRows::new(&q41, 4, 64).is_some());
        assert!(QuantRows::new(&q41, 8, 64).is_none(), "wrong row count");
        assert!(QuantRows::new(&q41, 4, 48).is_none(), "not whole blocks");
    }
}
