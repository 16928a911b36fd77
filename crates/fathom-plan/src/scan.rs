//! The CPU bit-plane scan (docs/SPEC.md §2–§3): approximate scores `q_h · k̂` of all `n` keys for
//! the `G` query heads of one KV head, reading **only** the planned planes of the active
//! channels.
//!
//! With `t_c` planes of channel `c` and block scale `m = m_{b,c}`, the prefix value of a
//! token is (docs/SPEC.md §2)
//!
//! ```text
//! k̂_c = m · (Σ_{p<t_c} bit_p · 2^(−p) − 1 + 2^(−t_c)),
//! ```
//!
//! so a block's score splits into a per-block constant and bit-sliced sums:
//!
//! ```text
//! s_h(i) = Σ_c q_hc m_bc (2^(−t_c) − 1)  +  Σ_c (q_hc m_bc) · u_c(i),   u_c(i) = Σ_{p<t_c} bit_p(i) 2^(−p).
//! ```
//!
//! The kernel works from the words directly: for each group of 8 tokens it expands one byte
//! of each plane word through a 256-entry table of 0/1 lanes into `u_c`, then does one fused
//! multiply-add per head. No key is dequantized as a whole, and channels with `t_c = 0` are
//! never touched. Blocks are split across threads with rayon.

use fathom_store::{StoreView, BLOCK, PLANES};
use rayon::prelude::*;

/// Errors of the scan: shapes that do not match the store.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ScanError {
    /// A slice length does not match the store's shape.
    #[error("scan shape mismatch in {what}: expected {expected}, got {got}")]
    Shape {
        /// Which argument.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// The KV head index is out of range.
    #[error("KV head {head} out of range (store has {heads})")]
    Head {
        /// Requested head.
        head: usize,
        /// Heads in the store.
        heads: usize,
    },
    /// A depth above 4 planes.
    #[error("channel {channel} has depth {depth} (at most 4 planes)")]
    Depth {
        /// Channel.
        channel: usize,
        /// Depth given.
        depth: u8,
    },
}

/// `LUT[byte][j] = bit j of byte` as 0.0/1.0: one aligned 8-lane row per byte.
#[repr(C, align(32))]
struct Lut([[f32; 8]; 256]);

static LUT: Lut = {
    let mut t = [[0f32; 8]; 256];
    let mut b = 0;
    while b < 256 {
        let mut j = 0;
        while j < 8 {
            t[b][j] = ((b >> j) & 1) as f32;
            j += 1;
        }
        b += 1;
    }
    Lut(t)
};

/// Blocks per rayon task (16384 tokens): long enough runs per plane stream for the
/// prefetchers, still 64 tasks at 1M tokens for load balance.
const TASK_BLOCKS: usize = 256;
/// Heads handled per kernel pass (accumulators kept in registers).
const HEAD_TILE: usize = 4;
/// Prefetch distance in blocks (each plane run advances 8 bytes per block).
const PREFETCH_BLOCKS: usize = 64;
/// Plane weights `2^(−p)`.
const PW: [f32; 4] = [1.0, 0.5, 0.25, 0.125];

struct Active {
    /// Planes read.
    depth: usize,
    /// Offset of plane 0's block-0 word in `plane_words()`.
    word_base: usize,
    /// Offset of block 0's scale in `scale_words()`.
    scale_base: usize,
    /// `2^(−t) − 1`: with it, `u_c = k̂_c / m` exactly.
    off: f32,
}

/// Eight f32 lanes: the kernel is written once over this and instantiated with AVX2
/// registers where the target has them, and with plain arrays otherwise.
trait Lanes: Copy {
    fn zero() -> Self;
    fn splat(x: f32) -> Self;
    /// # Safety
    /// `p` must be valid for reading 8 `f32` (any alignment).
    unsafe fn load(p: *const f32) -> Self;
    /// # Safety
    /// `p` must be valid for writing 8 `f32` (any alignment).
    unsafe fn store(self, p: *mut f32);
    fn mul(self, o: Self) -> Self;
    /// `self · b + c` (fused where the hardware has it).
    fn mul_add(self, b: Self, c: Self) -> Self;
    /// Widens 8 fp16 values.
    fn from_f16(x: &[half::f16; 8]) -> Self;
}

/// Portable lanes (auto-vectorised where possible).
#[cfg_attr(
    all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    ),
    allow(dead_code)
)]
#[derive(Clone, Copy)]
struct Portable([f32; 8]);

impl Lanes for Portable {
    #[inline(always)]
    fn zero() -> Self {
        Portable([0.0; 8])
    }
    #[inline(always)]
    fn splat(x: f32) -> Self {
        Portable([x; 8])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: the caller guarantees 8 readable f32 at `p`; read_unaligned has no
        // alignment requirement.
        Portable(unsafe { p.cast::<[f32; 8]>().read_unaligned() })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the caller guarantees 8 writable f32 at `p`; no alignment requirement.
        unsafe { p.cast::<[f32; 8]>().write_unaligned(self.0) }
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        Portable(std::array::from_fn(|k| self.0[k] * o.0[k]))
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        // Unfused on purpose: `f32::mul_add` is a libm call without hardware FMA.
        Portable(std::array::from_fn(|k| self.0[k] * b.0[k] + c.0[k]))
    }
    #[inline(always)]
    fn from_f16(x: &[half::f16; 8]) -> Self {
        Portable(x.map(half::f16::to_f32))
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
mod avx {
    use std::arch::x86_64::*;

    /// One AVX2 register of 8 f32.
    #[derive(Clone, Copy)]
    pub(super) struct Avx(__m256);

    impl super::Lanes for Avx {
        #[inline(always)]
        fn zero() -> Self {
            // SAFETY: AVX is enabled at compile time (cfg on this module).
            Avx(unsafe { _mm256_setzero_ps() })
        }
        #[inline(always)]
        fn splat(x: f32) -> Self {
            // SAFETY: AVX is enabled at compile time (cfg on this module).
            Avx(unsafe { _mm256_set1_ps(x) })
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: the caller guarantees 8 readable f32 at `p`; loadu has no alignment
            // requirement; AVX is enabled at compile time.
            Avx(unsafe { _mm256_loadu_ps(p) })
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            // SAFETY: the caller guarantees 8 writable f32 at `p`; storeu has no alignment
            // requirement; AVX is enabled at compile time.
            unsafe { _mm256_storeu_ps(p, self.0) }
        }
        #[inline(always)]
        fn mul(self, o: Self) -> Self {
            // SAFETY: AVX is enabled at compile time.
            Avx(unsafe { _mm256_mul_ps(self.0, o.0) })
        }
        #[inline(always)]
        fn mul_add(self, b: Self, c: Self) -> Self {
            // SAFETY: FMA is enabled at compile time (cfg on this module).
            Avx(unsafe { _mm256_fmadd_ps(self.0, b.0, c.0) })
        }
        #[inline(always)]
        fn from_f16(x: &[half::f16; 8]) -> Self {
            // SAFETY: `x` is 16 readable bytes (loadu: no alignment needed); F16C is enabled
            // at compile time (cfg on this module).
            Avx(unsafe { _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().cast())) })
        }
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
type Native = avx::Avx;
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
)))]
type Native = Portable;

/// Approximate scores of all `n` tokens of KV head `head` for `g` queries.
///
/// - `queries`: `[g][D]` row-major, **in the store's basis** (rotate with
///   [`StoreView::rotate_query`] first for a KLT store);
/// - `depths`: `[D]` planes per channel (the plan, shared by the group), each `0..=4`;
/// - `out`: `[g][n]` row-major scores.
///
/// Reads exactly the words `plane(head, c, p)[b]` for `p < depths[c]` and the scales of the
/// channels with `depths[c] > 0`.
pub fn scan(
    view: &StoreView<'_>,
    head: usize,
    queries: &[f32],
    g: usize,
    depths: &[u8],
    out: &mut [f32],
) -> Result<(), ScanError> {
    scan_with::<Native>(view, head, queries, g, depths, out)
}

/// The scan over lanes `V` (AVX2 registers or the portable arrays).
fn scan_with<V: Lanes>(
    view: &StoreView<'_>,
    head: usize,
    queries: &[f32],
    g: usize,
    depths: &[u8],
    out: &mut [f32],
) -> Result<(), ScanError> {
    let d = view.dims().channels;
    let n = view.tokens();
    check(view, head, queries, g, depths, out.len())?;
    if n == 0 || g == 0 {
        return Ok(());
    }
    let cap = view.cap_blocks();
    let nb = view.nblocks();
    let words = view.plane_words();
    let scales = view.scale_words();
    // Deepest channels first, so the kernel runs one const-depth loop per depth class.
    let mut order: Vec<usize> = (0..d).filter(|&c| depths[c] > 0).collect();
    order.sort_by_key(|&c| std::cmp::Reverse(depths[c]));
    let active: Vec<Active> = order
        .iter()
        .map(|&c| Active {
            depth: depths[c] as usize,
            word_base: ((head * d + c) * PLANES) * cap,
            scale_base: (head * d + c) * cap,
            off: (0.5f32).powi(depths[c] as i32) - 1.0,
        })
        .collect();
    // Every word and scale the kernel touches is in bounds: checked once here so that the
    // hot loops index without checks.
    for a in &active {
        let last_word = a.word_base + (a.depth - 1) * cap + nb - 1;
        let last_scale = a.scale_base + nb - 1;
        assert!(
            nb <= cap && last_word < words.len() && last_scale < scales.len(),
            "store view smaller than its shape"
        );
    }
    // classes[t] = range of `active` with depth t (t = 1..=4).
    let mut classes = [0..0, 0..0, 0..0, 0..0, 0..0];
    for (t, class) in classes.iter_mut().enumerate().skip(1) {
        let lo = active.iter().position(|a| a.depth == t).unwrap_or(0);
        let len = active.iter().filter(|a| a.depth == t).count();
        *class = lo..lo + len;
    }
    let na = active.len();
    // Query components of the active channels, `[a][gp]`, zero-padded to whole lanes.
    let gp = g.div_ceil(8) * 8;
    let mut qa = vec![0f32; na * gp];
    for (a, &c) in order.iter().enumerate() {
        for h in 0..g {
            qa[a * gp + h] = queries[h * d + c];
        }
    }
    // Split every head's row into the same token ranges: task j owns tokens
    // [j·TASK_BLOCKS·64, …) of every row.
    let chunk = TASK_BLOCKS * BLOCK;
    let mut rows: Vec<std::slice::ChunksMut<'_, f32>> =
        out.chunks_mut(n).map(|r| r.chunks_mut(chunk)).collect();
    let tasks: Vec<(usize, Vec<&mut [f32]>)> = (0..nb.div_ceil(TASK_BLOCKS))
        .map(|j| {
            let parts = rows
                .iter_mut()
                .map(|it| it.next().expect("every row has the same chunks"))
                .collect();
            (j, parts)
        })
        .collect();
    let k = Kernel {
        words,
        scales,
        cap,
        active: &active,
        classes,
        qa: &qa,
        gp,
    };
    tasks.into_par_iter().for_each(|(j, mut parts)| {
        let b0 = j * TASK_BLOCKS;
        let b1 = (b0 + TASK_BLOCKS).min(nb);
        // `[a][gp][8]` coefficients of 8 consecutive blocks, then `[gp][8]` constants.
        let mut coef = vec![0f32; (na + 1) * gp * 8];
        let mut tail = [[0f32; BLOCK]; HEAD_TILE];
        for b in b0..b1 {
            let bi = b % 8;
            if bi == 0 || b == b0 {
                if b + PREFETCH_BLOCKS < nb {
                    k.prefetch_block(b + PREFETCH_BLOCKS);
                }
                k.coefs::<V>(b - bi, nb, &mut coef);
            }
            let lo = (b - b0) * BLOCK;
            let len = BLOCK.min(n - b * BLOCK);
            let mut h0 = 0;
            while h0 < g {
                let tile = (g - h0).min(HEAD_TILE);
                let cf = &coef[h0 * 8 + bi..];
                let heads = &mut parts[h0..h0 + tile];
                match tile {
                    1 => k.tile::<V, 1, 8>(b, cf, heads, lo, len, &mut tail),
                    2 => k.tile::<V, 2, 4>(b, cf, heads, lo, len, &mut tail),
                    3 => k.tile::<V, 3, 2>(b, cf, heads, lo, len, &mut tail),
                    _ => k.tile::<V, 4, 2>(b, cf, heads, lo, len, &mut tail),
                }
                h0 += tile;
            }
        }
    });
    Ok(())
}

#[inline(always)]
fn prefetch(p: *const i8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint; it never faults whatever the address, and SSE is
    // part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Everything the per-block kernel reads, validated by `scan_with`.
struct Kernel<'a> {
    words: &'a [u64],
    scales: &'a [half::f16],
    cap: usize,
    /// Sorted by depth, deepest first; every word/scale index in bounds for `b < nblocks`.
    active: &'a [Active],
    classes: [std::ops::Range<usize>; 5],
    /// `[a][gp]` query components.
    qa: &'a [f32],
    gp: usize,
}

impl Kernel<'_> {
    /// Hints the cache lines of block `b`'s words (and, every 32 blocks, scales) of every
    /// active channel (called once per 8 blocks, i.e. once per 64-byte line of each
    /// plane run). A hint past the end of the store is harmless: prefetches never fault.
    #[inline(always)]
    fn prefetch_block(&self, b: usize) {
        for ch in self.active {
            for p in 0..ch.depth {
                prefetch(
                    self.words
                        .as_ptr()
                        .wrapping_add(ch.word_base + p * self.cap + b)
                        .cast(),
                );
            }
            if b % 32 < 8 {
                prefetch(self.scales.as_ptr().wrapping_add(ch.scale_base + b).cast());
            }
        }
    }

    /// Coefficients of blocks `b8..b8+8` (`b8 % 8 == 0`), vectorised over the 8 blocks:
    /// `coef[a][h][i] = q_{h,c_a} · m_{b8+i,c_a}` and, after the `na` channel rows,
    /// `konst[h][i] = Σ_a coef[a][h][i] · (2^(−t_a) − 1)`. Blocks past `nb` get scale 0.
    #[inline(always)]
    fn coefs<V: Lanes>(&self, b8: usize, nb: usize, coef: &mut [f32]) {
        let (gp, na) = (self.gp, self.active.len());
        assert!(self.qa.len() >= na * gp && coef.len() >= (na + 1) * gp * 8 && b8 < nb);
        let hi = (b8 + 8).min(nb);
        let kbase = na * gp * 8;
        coef[kbase..].iter_mut().for_each(|x| *x = 0.0);
        for (a, ch) in self.active.iter().enumerate() {
            let mut m = [half::f16::ZERO; 8];
            m[..hi - b8].copy_from_slice(&self.scales[ch.scale_base + b8..ch.scale_base + hi]);
            let m = V::from_f16(&m);
            let off = V::splat(ch.off);
            for h in 0..gp {
                // SAFETY: `a·gp + h < na·gp ≤ qa.len()`; `(a·gp + h)·8 + 8 ≤ na·gp·8` and
                // `kbase + h·8 + 8 ≤ (na + 1)·gp·8 ≤ coef.len()` (asserted).
                unsafe {
                    let c = V::splat(*self.qa.get_unchecked(a * gp + h)).mul(m);
                    c.store(coef.as_mut_ptr().add((a * gp + h) * 8));
                    let kp = coef.as_mut_ptr().add(kbase + h * 8);
                    c.mul_add(off, V::load(kp)).store(kp);
                }
            }
        }
    }

    /// Heads `h0..h0+T` of block `b` (`coef` starts at `[0][h0][b % 8]`), written straight
    /// into the rows `heads` at `lo` (through `tail` only for a partial last block).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn tile<V: Lanes, const T: usize, const J: usize>(
        &self,
        b: usize,
        coef: &[f32],
        heads: &mut [&mut [f32]],
        lo: usize,
        len: usize,
        tail: &mut [[f32; BLOCK]; HEAD_TILE],
    ) {
        if len == BLOCK {
            let mut it = heads.iter_mut();
            let mut dst: [&mut [f32; BLOCK]; T] = std::array::from_fn(|_| {
                let row = it.next().expect("T rows");
                (&mut row[lo..lo + BLOCK]).try_into().expect("64 lanes")
            });
            self.block::<V, T, J>(b, coef, &mut dst);
        } else {
            let mut it = tail.iter_mut();
            let mut dst: [&mut [f32; BLOCK]; T] =
                std::array::from_fn(|_| it.next().expect("T ≤ HEAD_TILE"));
            self.block::<V, T, J>(b, coef, &mut dst);
            for (row, t) in heads.iter_mut().zip(dst.iter()) {
                row[lo..lo + len].copy_from_slice(&t[..len]);
            }
        }
    }

    /// Scores of heads `h0..h0+T` over block `b` into `dst` (`coef` starts at
    /// `[0][h0][b % 8]`): for each run of `J` token groups, `T×J` accumulators stay in
    /// registers over all active channels.
    #[inline(always)]
    fn block<V: Lanes, const T: usize, const J: usize>(
        &self,
        b: usize,
        coef: &[f32],
        dst: &mut [&mut [f32; BLOCK]; T],
    ) {
        let (gp, na) = (self.gp, self.active.len());
        assert!(coef.len() > (na * gp + T - 1) * 8);
        let kp = coef[na * gp * 8..].as_ptr();
        for j0 in (0..8).step_by(J) {
            let mut acc = [[V::zero(); J]; T];
            for (t, row) in acc.iter_mut().enumerate() {
                // SAFETY: `(na·gp + t)·8 < coef.len()` for `t < T` (asserted).
                *row = [V::splat(unsafe { *kp.add(t * 8) }); J];
            }
            // SAFETY: the ranges come from `scan_with`, each of the given depth; `coef`
            // covers `(na·gp + T − 1)·8` (asserted).
            unsafe {
                self.class::<V, T, J, 4>(&mut acc, b, j0, coef, self.classes[4].clone());
                self.class::<V, T, J, 3>(&mut acc, b, j0, coef, self.classes[3].clone());
                self.class::<V, T, J, 2>(&mut acc, b, j0, coef, self.classes[2].clone());
                self.class::<V, T, J, 1>(&mut acc, b, j0, coef, self.classes[1].clone());
            }
            for (row, out) in acc.iter().zip(dst.iter_mut()) {
                for (jj, x) in row.iter().enumerate() {
                    // SAFETY: `8·(j0 + jj) + 8 ≤ 64`: in bounds of the 64-lane row.
                    unsafe { x.store(out.as_mut_ptr().add(8 * (j0 + jj))) };
                }
            }
        }
    }

    /// Adds the channels `range` (all of depth `D`) into `acc` for token groups `j0..j0+J`.
    ///
    /// # Safety
    /// `range ⊆ 0..active.len()`, every channel in it of depth `D`, `b < nblocks`, and
    /// `coef.len() > (na·gp + T − 1)·8`.
    #[inline(always)]
    unsafe fn class<V: Lanes, const T: usize, const J: usize, const D: usize>(
        &self,
        acc: &mut [[V; J]; T],
        b: usize,
        j0: usize,
        coef: &[f32],
        range: std::ops::Range<usize>,
    ) {
        let lut = LUT.0.as_ptr().cast::<f32>();
        let stride = self.cap * 8;
        let cp = coef.as_ptr();
        for a in range {
            debug_assert!(self.active[a].depth == D);
            // SAFETY: `a < na`, so `(a·gp + t)·8 < coef.len()`; the word of plane
            // p of this channel at block b is in bounds (asserted in `scan_with`), and byte
            // `j < 8` of it lies inside that word.
            unsafe {
                let ch = self.active.get_unchecked(a);
                let wp = self.words.as_ptr().add(ch.word_base + b).cast::<u8>();
                let c: [V; T] = std::array::from_fn(|t| V::splat(*cp.add((a * self.gp + t) * 8)));
                for jj in 0..J {
                    let j = j0 + jj;
                    let row = |p: usize| *wp.add(p * stride + le_byte(j)) as usize * 8;
                    // `row(p) < 256·8`: 8 f32 from `lut + row(p)` are inside the table.
                    let mut u = V::load(lut.add(row(0)));
                    for (p, &pw) in PW.iter().enumerate().take(D).skip(1) {
                        u = V::load(lut.add(row(p))).mul_add(V::splat(pw), u);
                    }
                    for (row, &ct) in acc.iter_mut().zip(c.iter()) {
                        row[jj] = ct.mul_add(u, row[jj]);
                    }
                }
            }
        }
    }
}

/// Offset of byte `j` (tokens `8j..8j+8`) of a little-endian word in memory.
#[inline(always)]
const fn le_byte(j: usize) -> usize {
    if cfg!(target_endian = "little") {
        j
    } else {
        7 - j
    }
}

fn check(
    view: &StoreView<'_>,
    head: usize,
    queries: &[f32],
    g: usize,
    depths: &[u8],
    out_len: usize,
) -> Result<(), ScanError> {
    let d = view.dims().channels;
    if head >= view.dims().heads {
        return Err(ScanError::Head {
            head,
            heads: view.dims().heads,
        });
    }
    let shape = |what, expected, got| {
        if expected == got {
            Ok(())
        } else {
            Err(ScanError::Shape {
                what,
                expected,
                got,
            })
        }
    };
    // An overflowing product matches no slice length (saturated, it is reported as such).
    shape("queries [g][D]", g.saturating_mul(d), queries.len())?;
    shape("depths [D]", d, depths.len())?;
    shape("scores [g][n]", g.saturating_mul(view.tokens()), out_len)?;
    if let Some(c) = depths.iter().position(|&t| t as usize > PLANES) {
        return Err(ScanError::Depth {
            channel: c,
            depth: depths[c],
        });
    }
    Ok(())
}

/// Plane and scale bytes the scan reads for one KV head at `depths` over `n` tokens:
/// `Σ_c t_c · ⌈n/64⌉ · 8` plus `2·⌈n/64⌉` per active channel.
pub fn bytes_read(depths: &[u8], tokens: usize) -> usize {
    let nb = tokens.div_ceil(BLOCK);
    depths
        .iter()
        .map(|&t| t as usize * nb * 8 + if t > 0 { 2 * nb } else { 0 })
        .sum()
}

/// The f64 reference: dequantize each channel at its depth, then dot (tests and GPU checks).
///
/// Returns `(scores [g][n], magnitudes [g][n])` where `magnitude = Σ_c |q_c · k̂_c|` is the
/// scale against which a float score's rounding error is judged.
pub fn reference_scores(
    view: &StoreView<'_>,
    head: usize,
    queries: &[f32],
    g: usize,
    depths: &[u8],
) -> Result<(Vec<f64>, Vec<f64>), ScanError> {
    let d = view.dims().channels;
    let hn = view.dims().heads;
    let n = view.tokens();
    check(view, head, queries, g, depths, g.saturating_mul(n))?;
    let deq: Vec<Vec<f32>> = (0..=4)
        .map(|t| view.dequant_prefix(t).expect("t ≤ 4"))
        .collect();
    let mut s = vec![0f64; g * n];
    let mut mag = vec![0f64; g * n];
    for i in 0..n {
        for c in 0..d {
            let k = deq[depths[c] as usize][(i * hn + head) * d + c] as f64;
            for h in 0..g {
                let x = queries[h * d + c] as f64 * k;
                s[h * n + i] += x;
                mag[h * n + i] += x.abs();
            }
        }
    }
    Ok((s, mag))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fathom_store::{Dims, KeyStore};

    /// A group size whose `g·D` or `g·n` overflows is a shape error, not an overflow panic.
    #[test]
    fn an_overflowing_group_size_is_a_shape_error() {
        let dims = Dims {
            heads: 1,
            channels: 4,
        };
        let store = KeyStore::from_keys(dims, &[0.5f32; 4 * 10], None).unwrap();
        let v = store.view();
        for g in [usize::MAX, usize::MAX / 4 + 1] {
            assert!(matches!(
                scan(&v, 0, &[0.0; 4], g, &[4; 4], &mut []),
                Err(ScanError::Shape { .. })
            ));
            assert!(matches!(
                reference_scores(&v, 0, &[0.0; 4], g, &[4; 4]),
                Err(ScanError::Shape { .. })
            ));
        }
    }

    /// The portable lanes agree with the f64 reference too (the native path is covered by
    /// `tests/scan.rs`), including a partial last block and more heads than one tile.
    #[test]
    fn portable_path_matches_reference() {
        let (n, d, g) = (1000usize, 32usize, 6usize);
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let keys: Vec<f32> = (0..n * d).map(|i| rnd() * (1.0 + (i % d) as f32)).collect();
        let mut store = KeyStore::with_capacity(
            Dims {
                heads: 1,
                channels: d,
            },
            n + 100,
            None,
        )
        .expect("store");
        store.append(&keys).expect("append");
        let view = store.view();
        let queries: Vec<f32> = (0..g * d).map(|_| rnd()).collect();
        let depths: Vec<u8> = (0..d).map(|c| (c % 5) as u8).collect();
        let mut out = vec![f32::NAN; g * n];
        scan_with::<Portable>(&view, 0, &queries, g, &depths, &mut out).expect("scan");
        let (want, mag) = reference_scores(&view, 0, &queries, g, &depths).expect("reference");
        for i in 0..g * n {
            assert!(
                (out[i] as f64 - want[i]).abs() <= 1e-5 * mag[i] + 1e-30,
                "{i}"
            );
        }
    }
}
