//! Spreading a model over several GPUs of one host (docs/SPEC.md §9):
//! pure CPU and unit-tested, so the plans are checked before any device or NCCL is touched.
//!
//! **Tensor parallelism over the heads** (Megatron's split): GPU `r` of `T` owns KV heads
//! `[r·Hkv/T, (r+1)·Hkv/T)` and their `G` query heads each, so its cache, scan, top-k, fetch
//! and attention involve only its own heads (no communication inside attention). `Wq`, `Wk`,
//! `Wv`, `Wgate` and `Wup` are split by output rows (column-parallel: each GPU computes its
//! heads' q, k, v and its slice of the FFN), `Wo` and `Wdown` by input columns (row-parallel:
//! each GPU's product is a partial sum), and one all-reduce after `Wo` and one after `Wdown`
//! add the partial sums: `Wo·o = Σ_r Wo[:, cols_r]·o[cols_r]`. Norms, embeddings and the LM
//! head are replicated. It needs `T | Hkv` and `T | F`.
//!
//! **Data parallelism over sessions**: sessions are assigned to GPUs with no communication,
//! longest first to the least-loaded GPU (by resident tokens), which keeps the largest load
//! within `4/3` of the best possible (Graham's bound for the longest-processing-time rule).

use fathom_model::{Config, LayerWeights, Matrix};

use crate::error::{GpuError, Result};

/// One GPU's share of a tensor-parallel model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpShard {
    /// Rank `r` of `T`.
    pub rank: usize,
    /// Ranks.
    pub ranks: usize,
    /// KV heads owned, `[lo, hi)`.
    pub kv_heads: std::ops::Range<usize>,
    /// Query heads owned (the KV heads' groups), `[lo, hi)`.
    pub q_heads: std::ops::Range<usize>,
    /// FFN rows owned, `[lo, hi)`.
    pub ffn: std::ops::Range<usize>,
}

/// The tensor-parallel split of `cfg` over `ranks` GPUs.
///
/// # Errors
/// `ranks` of 0, or one that divides neither the KV heads nor the FFN width.
pub fn tensor_parallel(cfg: &Config, ranks: usize) -> Result<Vec<TpShard>> {
    let (hkv, g, f) = (cfg.n_kv_heads, cfg.group(), cfg.n_ff);
    if ranks == 0 || hkv % ranks != 0 || f % ranks != 0 {
        return Err(GpuError::invalid(
            "tp",
            format!(
                "{ranks} GPUs: tensor parallelism over the heads needs a divisor of both the {hkv} KV heads and the FFN width {f}"
            ),
        ));
    }
    let (kh, fw) = (hkv / ranks, f / ranks);
    Ok((0..ranks)
        .map(|r| TpShard {
            rank: r,
            ranks,
            kv_heads: r * kh..(r + 1) * kh,
            q_heads: r * kh * g..(r + 1) * kh * g,
            ffn: r * fw..(r + 1) * fw,
        })
        .collect())
}

fn rows(m: &Matrix, r: std::ops::Range<usize>) -> Matrix {
    Matrix {
        rows: r.len(),
        cols: m.cols,
        data: m.data[r.start * m.cols..r.end * m.cols].to_vec(),
    }
}

fn cols(m: &Matrix, c: std::ops::Range<usize>) -> Matrix {
    let mut data = Vec::with_capacity(m.rows * c.len());
    for row in m.data.chunks(m.cols) {
        data.extend_from_slice(&row[c.clone()]);
    }
    Matrix {
        rows: m.rows,
        cols: c.len(),
        data,
    }
}

/// One block's weights as GPU `s.rank` holds them ([module docs](self)).
pub fn shard_layer(w: &LayerWeights, cfg: &Config, s: &TpShard) -> LayerWeights {
    let d = cfg.head_dim;
    let q = s.q_heads.start * d..s.q_heads.end * d;
    let kv = s.kv_heads.start * d..s.kv_heads.end * d;
    LayerWeights {
        attn_norm: w.attn_norm.clone(),
        wq: rows(&w.wq, q.clone()),
        wk: rows(&w.wk, kv.clone()),
        wv: rows(&w.wv, kv),
        wo: cols(&w.wo, q),
        q_norm: w.q_norm.clone(),
        k_norm: w.k_norm.clone(),
        post_attn_norm: w.post_attn_norm.clone(),
        ffn_norm: w.ffn_norm.clone(),
        gate: rows(&w.gate, s.ffn.clone()),
        up: rows(&w.up, s.ffn.clone()),
        down: cols(&w.down, s.ffn.clone()),
        post_ffn_norm: w.post_ffn_norm.clone(),
    }
}

/// The shard's config: its heads and FFN slice (for sizing its decoder and cache).
pub fn shard_config(cfg: &Config, s: &TpShard) -> Config {
    let mut c = cfg.clone();
    c.n_kv_heads = s.kv_heads.len();
    c.n_heads = s.q_heads.len();
    c.n_ff = s.ffn.len();
    c
}

/// Assigns sessions (their resident tokens) to `gpus` GPUs: longest first, each to the GPU
/// with the fewest tokens so far (ties to the lower GPU). Returns the session indices per GPU,
/// each list in the order assigned.
///
/// # Errors
/// `gpus` of 0.
pub fn data_parallel(tokens: &[usize], gpus: usize) -> Result<Vec<Vec<usize>>> {
    if gpus == 0 {
        return Err(GpuError::invalid("gpus", "0 GPUs"));
    }
    let mut order: Vec<usize> = (0..tokens.len()).collect();
    order.sort_by(|&a, &b| tokens[b].cmp(&tokens[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; gpus];
    let mut out = vec![Vec::new(); gpus];
    for i in order {
        let g = (0..gpus).min_by_key(|&g| (load[g], g)).unwrap_or(0);
        load[g] += tokens[i];
        out[g].push(i);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fathom_model::{Arch, LayerKind, RopeStyle};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn config(hq: usize, hkv: usize, d: usize, e: usize, f: usize) -> Config {
        Config {
            arch: Arch::Llama,
            name: "shard-test".into(),
            n_layers: 1,
            n_embd: e,
            n_heads: hq,
            n_kv_heads: hkv,
            head_dim: d,
            n_ff: f,
            vocab_size: 16,
            rms_eps: 1e-5,
            rope_base: 1e4,
            rope_base_local: 1e4,
            rope_style: RopeStyle::Neox,
            layer_kinds: vec![LayerKind::Global],
            context_length: 64,
            qk_norm: false,
            embed_scale: 1.0,
            attn_softcap: None,
        }
    }

    fn mat(rng: &mut StdRng, rows: usize, cols: usize) -> Matrix {
        Matrix {
            rows,
            cols,
            data: (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect(),
        }
    }

    fn matvec(m: &Matrix, x: &[f64]) -> Vec<f64> {
        m.data
            .chunks(m.cols)
            .map(|r| r.iter().zip(x).map(|(a, b)| *a as f64 * b).sum())
            .collect()
    }

    fn layer(rng: &mut StdRng, c: &Config) -> LayerWeights {
        let (e, q, kv, f) = (
            c.n_embd,
            c.n_heads * c.head_dim,
            c.n_kv_heads * c.head_dim,
            c.n_ff,
        );
        LayerWeights {
            attn_norm: vec![1.0; e],
            wq: mat(rng, q, e),
            wk: mat(rng, kv, e),
            wv: mat(rng, kv, e),
            wo: mat(rng, e, q),
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            ffn_norm: vec![1.0; e],
            gate: mat(rng, f, e),
            up: mat(rng, f, e),
            down: mat(rng, e, f),
            post_ffn_norm: None,
        }
    }

    /// One token's attention block and MLP with a single key/value per KV head (softmax of
    /// one key is 1, so the output per query head is its KV head's value): enough to check
    /// the head mapping and both all-reduces exactly.
    fn block(w: &LayerWeights, c: &Config, x: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let d = c.head_dim;
        let g = c.n_heads / c.n_kv_heads;
        let v = matvec(&w.wv, x);
        let q = matvec(&w.wq, x); // computed as the GPU does; unused by a one-key softmax
        assert_eq!(q.len(), c.n_heads * d);
        let mut o = vec![0f64; c.n_heads * d];
        for h in 0..c.n_heads {
            o[h * d..(h + 1) * d].copy_from_slice(&v[(h / g) * d..(h / g + 1) * d]);
        }
        let attn = matvec(&w.wo, &o);
        let gate = matvec(&w.gate, x);
        let up = matvec(&w.up, x);
        let hmid: Vec<f64> = gate
            .iter()
            .zip(&up)
            .map(|(a, b)| a / (1.0 + (-a).exp()) * b)
            .collect();
        (attn, matvec(&w.down, &hmid))
    }

    #[test]
    fn tensor_parallel_shards_sum_to_the_unsharded_block() {
        let mut rng = StdRng::seed_from_u64(11);
        for (hq, hkv, d, e, f, t) in [
            (8, 2, 4, 16, 24, 2),
            (12, 4, 8, 24, 32, 4),
            (32, 8, 16, 32, 48, 8),
            (4, 1, 8, 8, 8, 1),
        ] {
            let c = config(hq, hkv, d, e, f);
            let w = layer(&mut rng, &c);
            let x: Vec<f64> = (0..e).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let (a, m) = block(&w, &c, &x);
            let shards = tensor_parallel(&c, t).unwrap();
            // Every KV head, query head and FFN row is owned exactly once, and a query head
            // sits with its KV head.
            let mut owner = vec![usize::MAX; hq];
            for s in &shards {
                for h in s.q_heads.clone() {
                    assert_eq!(owner[h], usize::MAX);
                    owner[h] = s.rank;
                    assert!(s.kv_heads.contains(&(h / (hq / hkv))));
                }
            }
            assert!(owner.iter().all(|&o| o < t));
            assert_eq!(shards.iter().map(|s| s.ffn.len()).sum::<usize>(), f);
            // The all-reduce of the partial sums is the unsharded result.
            let (mut sa, mut sm) = (vec![0f64; e], vec![0f64; e]);
            for s in &shards {
                let cs = shard_config(&c, s);
                let (pa, pm) = block(&shard_layer(&w, &c, s), &cs, &x);
                sa.iter_mut().zip(&pa).for_each(|(x, y)| *x += y);
                sm.iter_mut().zip(&pm).for_each(|(x, y)| *x += y);
            }
            for (u, v) in a.iter().zip(&sa).chain(m.iter().zip(&sm)) {
                assert!(
                    (u - v).abs() <= 1e-9 * (1.0 + u.abs()),
                    "{u} vs {v} (T = {t})"
                );
            }
        }
    }

    #[test]
    fn a_split_that_does_not_divide_the_heads_is_refused() {
        let c = config(8, 2, 4, 16, 24);
        for t in [0, 3, 4] {
            let e = tensor_parallel(&c, t).unwrap_err().to_string();
            assert!(e.contains("KV heads"), "{e}");
        }
    }

    #[test]
    fn sessions_spread_by_resident_tokens_within_the_lpt_bound() {
        let mut rng = StdRng::seed_from_u64(5);
        for gpus in [1usize, 2, 4, 8] {
            for n in [0usize, 1, 7, 33] {
                let tokens: Vec<usize> = (0..n).map(|_| rng.gen_range(1..600_000)).collect();
                let plan = data_parallel(&tokens, gpus).unwrap();
                let mut seen: Vec<usize> = plan.iter().flatten().copied().collect();
                seen.sort();
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "every session once");
                let loads: Vec<usize> = plan
                    .iter()
                    .map(|p| p.iter().map(|&i| tokens[i]).sum())
                    .collect();
                let total: usize = tokens.iter().sum();
                let biggest = tokens.iter().copied().max().unwrap_or(0);
                // OPT ≥ max(total / gpus, biggest); LPT ≤ 4/3 · OPT.
                let lower = (total as f64 / gpus as f64).max(biggest as f64);
                let worst = loads.iter().copied().max().unwrap_or(0) as f64;
                assert!(worst <= 4.0 / 3.0 * lower + 1.0, "{worst} vs {lower}");
            }
        }
        assert!(data_parallel(&[1, 2], 0).is_err());
    }
}
