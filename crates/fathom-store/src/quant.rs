//! The 4-bit block quantizer and its exact prefix reads (docs/SPEC.md §2).
//!
//! For block `b` and channel `c`: `m = fp16(max_i |k_ic|)`, `Δ = m/8`,
//! `q = clamp(⌊k/Δ⌋ + 8, 0, 15)` (all 8 when `m = 0`). Reading the first `t` bits
//! gives `q_t = q >> (4 − t)` and the value
//!
//! ```text
//! k̂_t = (q_t − 2^(t−1) + ½) · m · 2^(1−t)    (t ≥ 1),     k̂_0 = 0,
//! ```
//!
//! the t-bit mid-rise uniform quantizer of `[−m, m]`.

use half::f16;

use crate::error::StoreError;

/// Tokens per quantization block (one fp16 scale and one `u64` word per plane).
pub const BLOCK: usize = 64;
/// Bit planes per channel (4-bit codes).
pub const PLANES: usize = 4;

/// The stored block scale: `fp16(max |k|)` rounded to nearest.
///
/// Returns `None` if the maximum overflows fp16 (the caller reports which value).
#[inline]
pub fn block_scale(max_abs: f32) -> Option<f16> {
    let m = f16::from_f32(max_abs);
    if m.is_finite() {
        Some(m)
    } else {
        None
    }
}

/// The 4-bit code of `x` under the stored scale `m` (docs/SPEC.md §2).
///
/// `q = clamp(⌊x/Δ⌋ + 8, 0, 15)` with `Δ = m/8`; code 8 when `m = 0`.
///
/// # Errors
/// [`QuantFault::NonFinite`] for a NaN or infinite `x` (its code would be meaningless);
/// [`QuantFault::BadScale`] for a scale that is negative, NaN or infinite (no block maximum
/// rounds to one).
#[inline]
pub fn encode(x: f32, m: f16) -> Result<u8, QuantFault> {
    if !x.is_finite() {
        return Err(QuantFault::NonFinite);
    }
    if !(m.is_finite() && m.to_f32() >= 0.0) {
        return Err(QuantFault::BadScale);
    }
    Ok(encode_checked(x, m))
}

/// [`encode`] of a finite `x` under a finite, non-negative scale (checked by the caller).
#[inline]
fn encode_checked(x: f32, m: f16) -> u8 {
    let m = m.to_f32();
    if m == 0.0 {
        return 8;
    }
    let delta = m / 8.0; // exact: division by a power of two
    let v = (x / delta).floor() + 8.0;
    v.clamp(0.0, 15.0) as u8
}

/// The value of the `t`-bit prefix `q_t` (already shifted, `0 ≤ q_t < 2^t`, `t ≤ 4`, both
/// checked by the callers) under scale `m`.
///
/// `k̂_t = (q_t − 2^(t−1) + ½) · m · 2^(1−t)` for `t ≥ 1`; `0` for `t = 0`.
#[inline]
pub(crate) fn prefix_value(q_t: u8, t: u32, m: f32) -> f32 {
    debug_assert!(t as usize <= PLANES && u32::from(q_t) < 1 << t);
    if t == 0 {
        return 0.0;
    }
    let half_range = (1u32 << (t - 1)) as f32;
    let step = m * (2.0f32).powi(1 - t as i32);
    (q_t as f32 - half_range + 0.5) * step
}

/// The value read from the first `t` planes of the 4-bit code `q` under the scale `m`
/// (docs/SPEC.md §2): `k̂_t` of `q_t = q >> (4 − t)`.
///
/// # Errors
/// [`StoreError::Planes`] for `t > 4`; [`StoreError::Code`] for `q > 15`.
#[inline]
pub fn dequant(q: u8, t: u32, m: f32) -> Result<f32, StoreError> {
    if t as usize > PLANES {
        return Err(StoreError::Planes(t));
    }
    if q >= 16 {
        return Err(StoreError::Code(q));
    }
    if t == 0 {
        return Ok(0.0);
    }
    Ok(prefix_value(q >> (4 - t), t, m))
}

/// Quantizes one block of one channel: `values[i]` is token `i` of the block (`len ≤ 64`).
///
/// Returns the scale and the four plane words (`words[p]` bit `i` is bit `3 − p` of token
/// `i`'s code; bits at `i ≥ len` are zero). Errors carry the index of the offending value
/// within `values`.
///
/// # Errors
/// `(64, `[`QuantFault::TooLong`]`)` for more than 64 values (a word has one bit per token);
/// [`QuantFault::NonFinite`] for a NaN or an infinity; [`QuantFault::Overflow`] (the index of
/// the largest magnitude) when the block maximum overflows fp16.
pub fn quantize_block(values: &[f32]) -> Result<(f16, [u64; PLANES]), (usize, QuantFault)> {
    if values.len() > BLOCK {
        return Err((BLOCK, QuantFault::TooLong));
    }
    let mut max_abs = 0.0f32;
    let mut arg = 0usize;
    for (i, &v) in values.iter().enumerate() {
        if !v.is_finite() {
            return Err((i, QuantFault::NonFinite));
        }
        if v.abs() > max_abs {
            max_abs = v.abs();
            arg = i;
        }
    }
    let m = block_scale(max_abs).ok_or((arg, QuantFault::Overflow))?;
    let mut words = [0u64; PLANES];
    for (i, &v) in values.iter().enumerate() {
        let q = encode_checked(v, m);
        for (p, w) in words.iter_mut().enumerate() {
            *w |= (((q >> (3 - p)) & 1) as u64) << i;
        }
    }
    Ok((m, words))
}

/// Why a value could not be quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantFault {
    /// NaN or ±Inf.
    NonFinite,
    /// The block maximum overflows fp16.
    Overflow,
    /// More values than the 64 tokens of a block (the index is 64, the first that does not
    /// fit).
    TooLong,
    /// A scale that is negative, NaN or infinite.
    BadScale,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_is_the_t_bit_midrise_quantizer() {
        // For every t, every code maps to the centre of its cell of width 2m/2^t.
        let m = 3.0f32;
        for t in 1..=4u32 {
            let cells = 1u32 << t;
            let width = 2.0 * m / cells as f32;
            for q in 0..16u8 {
                let qt = (q >> (4 - t)) as f32;
                let centre = -m + (qt + 0.5) * width;
                assert!(
                    (dequant(q, t, m).unwrap() - centre).abs() < 1e-6,
                    "t={t} q={q}"
                );
            }
        }
    }

    #[test]
    fn encode_edges() {
        let m = f16::from_f32(1.0);
        assert_eq!(encode(1.0, m), Ok(15)); // +m clamps to the top cell
        assert_eq!(encode(-1.0, m), Ok(0)); // −m is the bottom cell
        assert_eq!(encode(0.0, m), Ok(8)); // zero is code 8 (sign bit set)
        assert_eq!(encode(-1e-9, m), Ok(7));
        assert_eq!(encode(5.0, f16::ZERO), Ok(8));
    }

    #[test]
    fn four_bit_value_is_q_minus_7_5_delta() {
        let m = 2.0f32;
        for q in 0..16u8 {
            assert_eq!(dequant(q, 4, m).unwrap(), (q as f32 - 7.5) * m / 8.0);
        }
    }

    /// NaN and infinite values, bad scales, depths past 4, codes past 15 and blocks past 64
    /// tokens are typed errors, never a silent code 0, a wrapped shift or bits in the wrong
    /// token.
    #[test]
    fn out_of_contract_inputs_are_errors() {
        let m = f16::from_f32(1.0);
        for x in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert_eq!(encode(x, m), Err(QuantFault::NonFinite), "{x}");
        }
        for bad in [f16::NAN, f16::INFINITY, f16::from_f32(-1.0)] {
            assert_eq!(encode(0.5, bad), Err(QuantFault::BadScale), "{bad}");
        }
        for t in [5u32, 8, 33, u32::MAX] {
            assert!(matches!(dequant(3, t, 1.0), Err(StoreError::Planes(x)) if x == t));
        }
        assert!(matches!(dequant(16, 2, 1.0), Err(StoreError::Code(16))));
        assert_eq!(
            quantize_block(&[0.5; BLOCK + 1]),
            Err((BLOCK, QuantFault::TooLong))
        );
        assert!(quantize_block(&[0.5; BLOCK]).is_ok());
    }
}
