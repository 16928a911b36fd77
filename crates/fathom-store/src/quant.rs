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
#[inline]
pub fn encode(x: f32, m: f16) -> u8 {
    let m = m.to_f32();
    if m == 0.0 {
        return 8;
    }
    let delta = m / 8.0; // exact: division by a power of two
    let v = (x / delta).floor() + 8.0;
    v.clamp(0.0, 15.0) as u8
}

/// The value of the `t`-bit prefix `q_t` (already shifted, `0 ≤ q_t < 2^t`) under scale `m`.
///
/// `k̂_t = (q_t − 2^(t−1) + ½) · m · 2^(1−t)` for `t ≥ 1`; `0` for `t = 0`.
#[inline]
pub fn prefix_value(q_t: u8, t: u32, m: f32) -> f32 {
    if t == 0 {
        return 0.0;
    }
    let half_range = (1u32 << (t - 1)) as f32;
    let step = m * (2.0f32).powi(1 - t as i32);
    (q_t as f32 - half_range + 0.5) * step
}

/// The value read from the first `t` planes of the 4-bit code `q`.
#[inline]
pub fn dequant(q: u8, t: u32, m: f32) -> f32 {
    debug_assert!(t <= 4 && q < 16);
    if t == 0 {
        return 0.0;
    }
    prefix_value(q >> (4 - t), t, m)
}

/// Quantizes one block of one channel: `values[i]` is token `i` of the block (`len ≤ 64`).
///
/// Returns the scale and the four plane words (`words[p]` bit `i` is bit `3 − p` of token
/// `i`'s code; bits at `i ≥ len` are zero). Errors carry the index of the offending value
/// within `values`.
pub fn quantize_block(values: &[f32]) -> Result<(f16, [u64; PLANES]), (usize, QuantFault)> {
    debug_assert!(values.len() <= BLOCK);
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
        let q = encode(v, m);
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
                assert!((dequant(q, t, m) - centre).abs() < 1e-6, "t={t} q={q}");
            }
        }
    }

    #[test]
    fn encode_edges() {
        let m = f16::from_f32(1.0);
        assert_eq!(encode(1.0, m), 15); // +m clamps to the top cell
        assert_eq!(encode(-1.0, m), 0); // −m is the bottom cell
        assert_eq!(encode(0.0, m), 8); // zero is code 8 (sign bit set)
        assert_eq!(encode(-1e-9, m), 7);
        assert_eq!(encode(5.0, f16::ZERO), 8);
    }

    #[test]
    fn four_bit_value_is_q_minus_7_5_delta() {
        let m = 2.0f32;
        for q in 0..16u8 {
            assert_eq!(dequant(q, 4, m), (q as f32 - 7.5) * m / 8.0);
        }
    }
}
