//! The CPU bit-plane scan (SPEC §2–§3): approximate scores `q_h · k̂` of all `n` keys for
//! the `G` query heads of one KV head, reading **only** the planned planes of the active
//! channels.
//!
//! With `t_c` planes of channel `c` and block scale `m = m_{b,c}`, the prefix value of a
//! token is (SPEC §2)
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

/// Blocks per rayon task (2048 tokens).
const TASK_BLOCKS: usize = 32;
/// Heads handled per kernel pass (accumulators kept in registers).
const HEAD_TILE: usize = 8;

struct Active {
    /// Channel index.
    channel: usize,
    /// Planes read.
    depth: usize,
    /// Offset of plane 0's block-0 word in `plane_words()`.
    word_base: usize,
    /// Offset of block 0's scale in `scale_words()`.
    scale_base: usize,
}

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
    let d = view.dims().channels;
    let n = view.tokens();
    check(view, head, queries, g, depths, out.len())?;
    if n == 0 || g == 0 {
        return Ok(());
    }
    let cap = view.cap_blocks();
    let active: Vec<Active> = depths
        .iter()
        .enumerate()
        .filter(|(_, &t)| t > 0)
        .map(|(c, &t)| Active {
            channel: c,
            depth: t as usize,
            word_base: ((head * d + c) * PLANES) * cap,
            scale_base: (head * d + c) * cap,
        })
        .collect();
    let nb = view.nblocks();
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
    tasks.into_par_iter().for_each(|(j, mut parts)| {
        let b0 = j * TASK_BLOCKS;
        let b1 = (b0 + TASK_BLOCKS).min(nb);
        let mut coef = vec![0f32; active.len() * g];
        let mut konst = vec![0f32; g];
        let mut acc = vec![0f32; g * BLOCK];
        for b in b0..b1 {
            block_scores(
                view, &active, b, queries, g, d, &mut coef, &mut konst, &mut acc,
            );
            let lo = (b - b0) * BLOCK;
            let len = BLOCK.min(n - b * BLOCK);
            for (h, part) in parts.iter_mut().enumerate() {
                part[lo..lo + len].copy_from_slice(&acc[h * BLOCK..h * BLOCK + len]);
            }
        }
    });
    Ok(())
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
    shape("queries [g][D]", g * d, queries.len())?;
    shape("depths [D]", d, depths.len())?;
    shape("scores [g][n]", g * view.tokens(), out_len)?;
    if let Some(c) = depths.iter().position(|&t| t as usize > PLANES) {
        return Err(ScanError::Depth {
            channel: c,
            depth: depths[c],
        });
    }
    Ok(())
}

/// Scores of the 64 tokens of block `b` into `acc` (`[g][64]`).
#[allow(clippy::too_many_arguments)]
#[inline]
fn block_scores(
    view: &StoreView<'_>,
    active: &[Active],
    b: usize,
    queries: &[f32],
    g: usize,
    d: usize,
    coef: &mut [f32],
    konst: &mut [f32],
    acc: &mut [f32],
) {
    let scales = view.scale_words();
    konst.iter_mut().for_each(|k| *k = 0.0);
    // coef[a][h] = q_hc · m_bc; the constant gathers m(2^(−t) − 1) per head.
    for (a, ch) in active.iter().enumerate() {
        let m = scales[ch.scale_base + b].to_f32();
        let off = (0.5f32).powi(ch.depth as i32) - 1.0;
        for h in 0..g {
            let c = queries[h * d + ch.channel] * m;
            coef[a * g + h] = c;
            konst[h] += c * off;
        }
    }
    let words = view.plane_words();
    let cap = view.cap_blocks();
    let mut h0 = 0;
    while h0 < g {
        let tile = (g - h0).min(HEAD_TILE);
        match tile {
            1 => tile_kernel::<1>(words, cap, active, b, coef, konst, g, h0, acc),
            2 => tile_kernel::<2>(words, cap, active, b, coef, konst, g, h0, acc),
            3 => tile_kernel::<3>(words, cap, active, b, coef, konst, g, h0, acc),
            4 => tile_kernel::<4>(words, cap, active, b, coef, konst, g, h0, acc),
            5 => tile_kernel::<5>(words, cap, active, b, coef, konst, g, h0, acc),
            6 => tile_kernel::<6>(words, cap, active, b, coef, konst, g, h0, acc),
            7 => tile_kernel::<7>(words, cap, active, b, coef, konst, g, h0, acc),
            _ => tile_kernel::<8>(words, cap, active, b, coef, konst, g, h0, acc),
        }
        h0 += tile;
    }
}

/// Heads `h0..h0+T` of one block: per 8-token group, `u_c` from the plane bytes via the
/// table, then one multiply-add per head, accumulators in registers.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile_kernel<const T: usize>(
    words: &[u64],
    cap: usize,
    active: &[Active],
    b: usize,
    coef: &[f32],
    konst: &[f32],
    g: usize,
    h0: usize,
    acc: &mut [f32],
) {
    const PW: [f32; 4] = [1.0, 0.5, 0.25, 0.125];
    for j in 0..8 {
        let shift = 8 * j;
        let mut a = [[0f32; 8]; T];
        for (t, row) in a.iter_mut().enumerate() {
            *row = [konst[h0 + t]; 8];
        }
        for (ai, ch) in active.iter().enumerate() {
            let mut u = [0f32; 8];
            for (p, pw) in PW.iter().enumerate().take(ch.depth) {
                let w = words[ch.word_base + p * cap + b];
                let lut = &LUT.0[((w >> shift) & 0xff) as usize];
                for k in 0..8 {
                    u[k] += lut[k] * pw;
                }
            }
            let cs = &coef[ai * g + h0..ai * g + h0 + T];
            for t in 0..T {
                for k in 0..8 {
                    a[t][k] += cs[t] * u[k];
                }
            }
        }
        for t in 0..T {
            acc[(h0 + t) * BLOCK + 8 * j..(h0 + t) * BLOCK + 8 * j + 8].copy_from_slice(&a[t]);
        }
    }
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
    check(view, head, queries, g, depths, g * n)?;
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
