//! The benchmark step's host-side layout (docs/SPEC.md §6): its stores, records and landmark
//! or Quest tables filled by tiling source layers to a context, and the run lists of the
//! methods whose channels do not depend on the query. Pure CPU: compiled in every build and
//! unit-tested here; the CUDA step (`crate::cuda::step`) uploads what these build.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use half::{bf16, f16};
use rayon::prelude::*;

use crate::config::Method;
use crate::synth::{hash01, tile_flips, LayerSource};

/// One entry of the fixed-size run list (`struct Run` in common.cuh).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) off: u64,
    pub(crate) len: u64,
}
const _: () = assert!(std::mem::size_of::<Run>() == 16);

/// Views 8-aligned bytes as `T`s.
pub(crate) fn cast_mut<T>(b: &mut [u8]) -> &mut [T] {
    let n = b.len() / std::mem::size_of::<T>();
    assert_eq!(
        b.as_ptr() as usize % std::mem::align_of::<T>(),
        0,
        "unaligned buffer"
    );
    // SAFETY: alignment checked; T is a plain integer/half type valid for any bits.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut T, n) }
}

/// Writes one layer's store for `nb` blocks into `dst` (planes `[H][D][4][nb]` then scales
/// `[H][D][nb]`), tiling the source's `nb0` blocks. Tiles after the first are made distinct
/// tokens: half of their channels are negated (all plane bits inverted: `q → 15 − q`, an exact
/// negation of the value) and their block scales are jittered by up to ±3%, so that tiled
/// copies neither tie nor win together.
pub(crate) fn fill_store(dst: &mut [u8], src: &LayerSource, nb: usize, layer: usize) {
    let v = src.store.view();
    let (hn, d) = (v.dims().heads, v.dims().channels);
    let nb0 = v.nblocks();
    let plane_bytes = hn * d * 4 * nb * 8;
    let (pl, sc) = dst.split_at_mut(plane_bytes);
    let planes: &mut [u64] = cast_mut(pl);
    let scales: &mut [f16] = cast_mut(&mut sc[..hn * d * nb * 2]);
    planes
        .par_chunks_mut(4 * nb)
        .enumerate()
        .for_each(|(hc, out)| {
            let (h, c) = (hc / d, hc % d);
            for p in 0..4 {
                let s = v.plane(h, c, p);
                let o = &mut out[p * nb..(p + 1) * nb];
                for (t, chunk) in o.chunks_mut(nb0).enumerate() {
                    chunk.copy_from_slice(&s[..chunk.len()]);
                    if tile_flips(layer, hc, t) {
                        // Code q -> 15 - q negates the channel's value exactly.
                        chunk.iter_mut().for_each(|w| *w = !*w);
                    }
                }
            }
        });
    scales.par_chunks_mut(nb).enumerate().for_each(|(hc, out)| {
        let (h, c) = (hc / d, hc % d);
        let s = v.channel_scales(h, c);
        for (b, o) in out.iter_mut().enumerate() {
            let m = s[b % nb0];
            *o = if b < nb0 {
                m
            } else {
                f16::from_f32(m.to_f32() * (1.0 + 0.03 * hash01(layer as u64, hc as u64, b as u64)))
            };
        }
    });
}

pub(crate) fn fill_records(
    dst: &mut [u8],
    recs: &[bf16],
    _hn: usize,
    n0: usize,
    n: usize,
    rec: usize,
) {
    let per = rec / 2; // bf16 per record
    let out: &mut [bf16] = cast_mut(dst);
    out.par_chunks_mut(n * per).enumerate().for_each(|(h, o)| {
        let s = &recs[h * n0 * per..(h + 1) * n0 * per];
        for chunk in o.chunks_mut(n0 * per) {
            chunk.copy_from_slice(&s[..chunk.len()]);
        }
    });
}

/// Landmark (`[H][n/8][D]`, mean of 8 keys) or Quest (`[H][n/16][2][D]`, min and max of 16
/// keys) tables in fp16, from the bf16 keys of the records, tiled to `n`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fill_table(
    dst: &mut [u8],
    recs: &[bf16],
    hn: usize,
    d: usize,
    n0: usize,
    n: usize,
    quest: bool,
    layer: usize,
) {
    let span = if quest { 16 } else { 8 };
    let width = if quest { 2 * d } else { d };
    let (g0, g) = (n0.div_ceil(span), n.div_ceil(span));
    let out: &mut [f16] = cast_mut(dst);
    out[..hn * g * width]
        .par_chunks_mut(g * width)
        .enumerate()
        .for_each(|(h, o)| {
            let mut base = vec![f16::ZERO; g0 * width];
            for gi in 0..g0 {
                for c in 0..d {
                    let toks = (gi * span)..((gi + 1) * span).min(n0);
                    let keys = toks.map(|i| recs[(h * n0 + i) * 2 * d + c].to_f32());
                    // The baselines' own rules; their results are fp16 values, so the
                    // conversions below are exact.
                    if quest {
                        let (lo, hi) = fathom_baselines::quest_bounds(keys);
                        base[gi * width + c] = f16::from_f32(lo);
                        base[gi * width + d + c] = f16::from_f32(hi);
                    } else {
                        base[gi * width + c] = f16::from_f32(fathom_baselines::landmark_mean(keys));
                    }
                }
            }
            for (t, chunk) in o.chunks_mut(g0 * width).enumerate() {
                chunk.copy_from_slice(&base[..chunk.len()]);
                // The same channel negations as the plane store's tiles.
                for c in (0..d).filter(|&c| tile_flips(layer, h * d + c, t)) {
                    for row in chunk.chunks_mut(width) {
                        if quest {
                            let (lo, hi) = (row[c], row[d + c]);
                            row[c] = -hi;
                            row[d + c] = -lo;
                        } else {
                            row[c] = -row[c];
                        }
                    }
                }
            }
        });
}

/// The host-built plan of a method whose channels do not depend on the query: depths
/// `[L][H][D]` and each layer's run list (`nruns` runs), the longest run and the bits read
/// per token and head.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HostStaticPlan {
    pub(crate) depths: Vec<u8>,
    pub(crate) runs: Vec<Run>,
    pub(crate) nruns: usize,
    pub(crate) max_len: u64,
    pub(crate) bits: f64,
}

/// Host-built plans of the methods whose channels do not depend on the query (none for
/// Fathom and SparQ, which plan per query on the GPU). The plane runs of head `h` and
/// channel `c` are `[H][2][D]`: the first `t_c` planes, then the channel's scales.
pub(crate) fn static_plan(
    m: &Method,
    sources: &[LayerSource],
    shape: &crate::ModelShape,
    nb: usize,
    n: usize,
) -> Option<HostStaticPlan> {
    let (hn, d, l_n) = (shape.kv_heads, shape.dim, shape.layers);
    let nb64 = nb as u64;
    let plane_runs = |depths: &[u8]| -> Vec<Run> {
        let mut runs = vec![Run::default(); 2 * hn * d];
        for (hc, &t) in depths.iter().enumerate().take(hn * d) {
            let t = t as u64;
            // Layout [H][2][D]: a head group's runs are one contiguous slice.
            let (h, c) = (hc / d, hc % d);
            runs[h * 2 * d + c] = Run {
                off: hc as u64 * 4 * nb64 * 8,
                len: t * nb64 * 8,
            };
            runs[h * 2 * d + d + c] = Run {
                off: (hn * d) as u64 * 4 * nb64 * 8 + hc as u64 * nb64 * 2,
                len: if t > 0 { nb64 * 2 } else { 0 },
            };
        }
        runs
    };
    let per_layer_depths: Vec<Vec<u8>> = match *m {
        Method::Fathom(_) | Method::SparQ(_) => return None,
        Method::Thumb2 => vec![vec![2u8; hn * d]; l_n],
        Method::Exact => vec![vec![4u8; hn * d]; l_n],
        Method::Loki(r) => vec![
            (0..hn * d)
                .map(|hc| if hc % d < r { 4 } else { 0 })
                .collect();
            l_n
        ],
        Method::DoubleSparsity(r) => (0..l_n)
            .map(|l| {
                let s = &sources[l % sources.len()].ds_score;
                let mut dep = vec![0u8; hn * d];
                for h in 0..hn {
                    let mut order: Vec<usize> = (0..d).collect();
                    order.sort_by(|&a, &b| s[h * d + b].total_cmp(&s[h * d + a]).then(a.cmp(&b)));
                    for &c in order.iter().take(r) {
                        dep[h * d + c] = 4;
                    }
                }
                dep
            })
            .collect(),
        Method::Landmark | Method::Quest => {
            let per_head = if *m == Method::Landmark {
                n.div_ceil(8) * d * 2
            } else {
                n.div_ceil(16) * 2 * d * 2
            } as u64;
            let runs: Vec<Run> = (0..l_n)
                .flat_map(|_| {
                    (0..hn).map(move |h| Run {
                        off: h as u64 * per_head,
                        len: per_head,
                    })
                })
                .collect();
            return Some(HostStaticPlan {
                depths: vec![0; l_n * hn * d],
                runs,
                nruns: hn,
                max_len: per_head,
                bits: m.bits(d) as f64,
            });
        }
    };
    let mut runs = Vec::with_capacity(l_n * 2 * hn * d);
    let mut depths = Vec::with_capacity(l_n * hn * d);
    for dep in &per_layer_depths {
        runs.extend(plane_runs(dep));
        depths.extend_from_slice(dep);
    }
    let bits = fathom_plan::plan_bits(&per_layer_depths[0][..d]) as f64;
    let max_len = per_layer_depths
        .iter()
        .flatten()
        .map(|&t| t as u64)
        .max()
        .unwrap_or(0)
        * nb64
        * 8;
    Some(HostStaticPlan {
        depths,
        runs,
        nruns: 2 * hn * d,
        max_len: max_len.max(nb64 * 2),
        bits,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{synth_layer, SynthParams};

    fn source(heads: usize, dim: usize, tokens: usize) -> LayerSource {
        let p = SynthParams {
            heads,
            group: 2,
            dim,
            tokens,
            seed: 11,
        };
        synth_layer(&p, 0).unwrap()
    }

    /// 8-aligned scratch of `bytes` bytes.
    fn scratch(bytes: usize) -> Vec<u64> {
        vec![0u64; bytes.div_ceil(8)]
    }

    fn bytes(v: &mut [u64]) -> &mut [u8] {
        // SAFETY: u64 storage viewed as bytes (any bit pattern is valid).
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 8) }
    }

    #[test]
    fn static_plans_read_exactly_their_channels() {
        for (heads, dim) in [(1, 64), (2, 128), (3, 32)] {
            let src = source(heads, dim, 128);
            let shape = crate::ModelShape {
                layers: 3,
                kv_heads: heads,
                group: 2,
                dim,
            };
            let (nb, n) = (6, 384);
            assert!(static_plan(
                &Method::Fathom(48.0),
                std::slice::from_ref(&src),
                &shape,
                nb,
                n
            )
            .is_none());
            assert!(
                static_plan(&Method::SparQ(8), std::slice::from_ref(&src), &shape, nb, n).is_none()
            );
            for m in [
                Method::Exact,
                Method::Thumb2,
                Method::DoubleSparsity(8),
                Method::Loki(4),
            ] {
                let p = static_plan(&m, std::slice::from_ref(&src), &shape, nb, n).unwrap();
                assert_eq!(p.depths.len(), 3 * heads * dim);
                assert_eq!(p.nruns, 2 * heads * dim);
                assert_eq!(p.runs.len(), 3 * p.nruns);
                let per_channel = match m {
                    Method::Exact => 4,
                    Method::Thumb2 => 2,
                    _ => 0,
                };
                for (hc, &t) in p.depths[..heads * dim].iter().enumerate() {
                    let (h, c) = (hc / dim, hc % dim);
                    if per_channel > 0 {
                        assert_eq!(t, per_channel);
                    }
                    // Plane run: the first t planes of the channel; scale run when active.
                    let pr = p.runs[h * 2 * dim + c];
                    assert_eq!(pr.off, (hc * 4 * nb * 8) as u64);
                    assert_eq!(pr.len, (t as usize * nb * 8) as u64);
                    let sr = p.runs[h * 2 * dim + dim + c];
                    assert_eq!(sr.off, (heads * dim * 4 * nb * 8 + hc * nb * 2) as u64);
                    assert_eq!(sr.len, if t > 0 { (nb * 2) as u64 } else { 0 });
                }
                let active = p.depths[..dim].iter().filter(|&&t| t > 0).count();
                match m {
                    Method::DoubleSparsity(r) | Method::Loki(r) => assert_eq!(active, r),
                    _ => assert_eq!(active, dim),
                }
                assert_eq!(p.bits, fathom_plan::plan_bits(&p.depths[..dim]) as f64);
            }
            // Double Sparsity takes the r best channels by the offline score, per head.
            let p = static_plan(
                &Method::DoubleSparsity(8),
                std::slice::from_ref(&src),
                &shape,
                nb,
                n,
            )
            .unwrap();
            for h in 0..heads {
                let s = &src.ds_score[h * dim..(h + 1) * dim];
                let worst_in = (0..dim)
                    .filter(|&c| p.depths[h * dim + c] > 0)
                    .map(|c| s[c])
                    .fold(f32::INFINITY, f32::min);
                let best_out = (0..dim)
                    .filter(|&c| p.depths[h * dim + c] == 0)
                    .map(|c| s[c])
                    .fold(f32::NEG_INFINITY, f32::max);
                assert!(worst_in >= best_out, "head {h}: {worst_in} < {best_out}");
            }
        }
    }

    #[test]
    fn a_tiled_store_copies_the_first_tile_and_negates_flipped_channels_after_it() {
        let (heads, dim, n0) = (2, 32, 128);
        let src = source(heads, dim, n0);
        let (nb0, nb) = (n0 / 64, 5);
        let plane_bytes = heads * dim * 4 * nb * 8;
        let mut buf = scratch(plane_bytes + heads * dim * nb * 2);
        fill_store(bytes(&mut buf), &src, nb, 3);
        let v = src.store.view();
        let planes = &buf[..plane_bytes / 8];
        for h in 0..heads {
            for c in 0..dim {
                let hc = h * dim + c;
                for p in 0..4 {
                    let want = v.plane(h, c, p);
                    for b in 0..nb {
                        let got = planes[(hc * 4 + p) * nb + b];
                        let w = want[b % nb0];
                        let flip = tile_flips(3, hc, b / nb0);
                        assert_eq!(got, if flip { !w } else { w }, "h {h} c {c} p {p} b {b}");
                    }
                }
            }
        }
    }

    #[test]
    fn tiled_records_repeat_the_source_per_head() {
        let (heads, n0, n, per) = (2, 3, 8, 4);
        let recs: Vec<bf16> = (0..heads * n0 * per)
            .map(|i| bf16::from_f32(i as f32))
            .collect();
        let mut buf = scratch(heads * n * per * 2);
        fill_records(bytes(&mut buf), &recs, heads, n0, n, per * 2);
        let out: &[bf16] = cast_mut(bytes(&mut buf));
        for h in 0..heads {
            for t in 0..n {
                for e in 0..per {
                    assert_eq!(
                        out[(h * n + t) * per + e],
                        recs[(h * n0 + t % n0) * per + e]
                    );
                }
            }
        }
    }
}
