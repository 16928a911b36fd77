//! The paged scan kernel's per-token arithmetic on the CPU (`kernels/attend/scan.cu`,
//! `scan_channel<T>`), each trick against the plain definition of docs/SPEC.md §2:
//!
//! * **Spreading a channel's planes into codes.** For one thread's 8 tokens, plane `p`'s byte
//!   holds bit `p` of token `i`'s code at bit `i`. Each nibble is spread into the bytes of a
//!   word by one multiply by `0x00204081` (its four shifted copies never overlap, so no carry
//!   crosses a byte), and Horner's rule stacks the planes with plane 0 the most significant
//!   bit: `q_t(i) = Σ_{p<t} bit_p(i) · 2^(t−1−p)`.
//! * **The code as a float without a conversion.** One byte permute puts the code in the
//!   mantissa of 128.0 (`0x43000000`), giving the float `128 + q_t`, and
//!   `k̂ = fma(128 + q_t, step, off − 128·step)` with `step = m · 2^(1−t)` and
//!   `off = (1/2 − 2^(t−1)) · step`. `off − 128·step` is exact (a multiplier of at most 9
//!   significant bits times an fp16 value) and so is the true `k̂` (at most 16 significant
//!   bits), so `k̂` has the bits of `fma(q_t, step, off)`, the CPU reference's value.
//!
//! The device tests compare the kernel's scores with the CPU reference's; these tests pin the
//! two identities that let the kernel change its instructions without changing a bit.

/// `__byte_perm(x, y, s)` (CUDA): result byte `i` is byte `s`'s nibble `i` of `y:x`
/// (nibble values 8–15 replicate a byte's sign bit).
fn byte_perm(x: u32, y: u32, s: u32) -> u32 {
    let bytes = (u64::from(y) << 32 | u64::from(x)).to_le_bytes();
    (0..4).fold(0u32, |out, i| {
        let n = (s >> (4 * i)) & 0xF;
        let b = bytes[(n & 7) as usize];
        let b = if n & 8 != 0 {
            if b & 0x80 != 0 {
                0xFF
            } else {
                0
            }
        } else {
            b
        };
        out | u32::from(b) << (8 * i)
    })
}

/// The kernel's spreading of `planes` (one byte per plane, plane 0 first) into the 8 tokens'
/// codes as the floats `128 + q_t`, exactly as `scan_channel` computes them.
fn kernel_codes(planes: &[u8]) -> [f32; 8] {
    let (mut c0, mut c1) = (0u32, 0u32);
    for &by in planes {
        let by = u32::from(by);
        c0 = (c0 << 1) | ((by & 0x0F).wrapping_mul(0x0020_4081) & 0x0101_0101);
        c1 = (c1 << 1) | ((by & 0xF0).wrapping_mul(0x0020_4081) & 0x1010_1010);
    }
    c1 >>= 4;
    let k128 = 0x4300_0000;
    std::array::from_fn(|j| {
        let c = if j < 4 { c0 } else { c1 };
        f32::from_bits(byte_perm(c, k128, 0x7044 | ((j as u32 & 3) << 8)))
    })
}

/// `(step, off)` of docs/SPEC.md §2 for an fp16 scale and depth `t`, as the reference forms
/// them in f32, and the kernel's `off − 128·step`.
fn step_offsets(m: f32, t: u32) -> (f32, f32, f32) {
    let step = m * (2.0f32).powi(1 - t as i32);
    let off = (0.5 - (1u32 << (t - 1)) as f32) * step;
    let off128 = (0.5 - (1u32 << (t - 1)) as f32 - 128.0) * step;
    (step, off, off128)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use rand::{Rng, SeedableRng};

    fn plain_code(planes: &[u8], token: usize) -> u32 {
        let t = planes.len();
        planes
            .iter()
            .enumerate()
            .map(|(p, &by)| u32::from((by >> token) & 1) << (t - 1 - p))
            .sum()
    }

    #[test]
    fn the_spread_codes_are_the_plain_codes() {
        // Every byte pair exhaustively at depths 1 and 2; seeded samples at 3 and 4.
        for t in 1..=2usize {
            for x in 0..(1u32 << (8 * t)) {
                let planes: Vec<u8> = (0..t).map(|p| (x >> (8 * p)) as u8).collect();
                let got = kernel_codes(&planes);
                for (j, g) in got.iter().enumerate() {
                    assert_eq!(
                        *g,
                        128.0 + plain_code(&planes, j) as f32,
                        "t {t} planes {planes:?} token {j}"
                    );
                }
            }
        }
        for (seed, t) in [(7u64, 3usize), (11, 4)] {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            for _ in 0..200_000 {
                let planes: Vec<u8> = (0..t).map(|_| rng.gen()).collect();
                let got = kernel_codes(&planes);
                for (j, g) in got.iter().enumerate() {
                    assert_eq!(
                        *g,
                        128.0 + plain_code(&planes, j) as f32,
                        "t {t} planes {planes:?} token {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_biased_khat_has_the_bits_of_the_plain_fma() {
        // Every finite fp16 scale of either sign, every depth and code.
        let mut checked = 0usize;
        for h in (0u16..0x7C00).chain(0x8000..0xFC00) {
            let m = f16::from_bits(h).to_f32();
            for t in 1..=4u32 {
                let (step, off, off128) = step_offsets(m, t);
                for q in 0..(1u32 << t) {
                    let plain = (q as f32).mul_add(step, off);
                    let biased = (128.0 + q as f32).mul_add(step, off128);
                    assert_eq!(plain.to_bits(), biased.to_bits(), "m {m:e} t {t} code {q}");
                    // And both are the exact value (q + 1/2 - 2^(t-1)) * step.
                    let exact = (f64::from(q) + 0.5 - f64::from(1u32 << (t - 1))) * f64::from(step);
                    assert_eq!(f64::from(plain), exact, "m {m:e} t {t} code {q}");
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 2 * 0x7C00 * (2 + 4 + 8 + 16));
    }

    #[test]
    fn byte_perm_follows_cuda() {
        assert_eq!(byte_perm(0x4433_2211, 0x8877_6655, 0x3210), 0x4433_2211);
        assert_eq!(byte_perm(0x4433_2211, 0x8877_6655, 0x7654), 0x8877_6655);
        assert_eq!(byte_perm(0x4433_2211, 0x8877_6655, 0x0123), 0x1122_3344);
        // Sign replication: nibble F copies the sign of y's byte 3 (0x88), 8 that of x's byte 0 (0x11).
        assert_eq!(byte_perm(0x4433_2211, 0x8877_6655, 0x8F), 0x1111_00FF);
    }
}
