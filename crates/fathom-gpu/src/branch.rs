//! Branched decoding, the downstream tasks' protocol (docs/SPEC.md §7): one dense prefill per
//! sample, then per method a fork of each sample's session that decodes greedily (or
//! teacher-forced) with the method on every global layer, freed at the end. The forks share
//! the prefill's pages (copy-on-write), so a branch costs one partial page per layer.
//!
//! [`greedy`] and [`forced`] take many roots at once and decode every unfinished fork in one
//! batch per step (one `decode` call for the whole batch, not one per sample); a fork leaves
//! the batch when it stops. The logic is generic over [`BranchDecoder`] and unit-tested with a
//! scripted decoder; [`crate::GpuDecoder`] implements it.

use fathom_cuda::cache::AttendMethod;
use fathom_cuda::pages::SessionId;
use fathom_cuda::prelude::*;
use fathom_model::{argmax, Config, LayerKind};

use crate::decoder::{Attention, Decoder};
use crate::error::Result;

/// What branching needs beyond [`Decoder`]: the model's shape and the plan-bit counters.
pub trait BranchDecoder: Decoder {
    /// The model's hyper-parameters.
    fn model(&self) -> &Config;
    /// The mean plan bits of every GPU-planned attend so far, and how many plans that is
    /// (`fathom_cuda::PagedCache::plan_bits`).
    fn plan_bits(&mut self) -> Result<(f64, u64)>;
}

impl BranchDecoder for crate::GpuDecoder {
    fn model(&self) -> &Config {
        self.config()
    }
    fn plan_bits(&mut self) -> Result<(f64, u64)> {
        Ok(self.cache_mut()?.plan_bits()?)
    }
}

/// One branch's tokens and scan statistics, in `fathom_bench::decode::DecodeStats`' terms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BranchOut {
    /// Generated (or, teacher-forced, predicted) ids.
    pub tokens: Vec<u32>,
    /// Σ scan bits per token over (step, global layer, KV head): the plans' own mean bits of
    /// the step's batch for Fathom and SparQ, the method's fixed bits otherwise, 0 for dense.
    pub bits_sum: f64,
    /// (step, global layer, KV head) scans.
    pub scans: u64,
    /// Σ tokens attended per query head over scans × G.
    pub selected_sum: f64,
    /// Σ keys visible over scans × G.
    pub visible_sum: f64,
}

/// Counts one decode step at `visible` keys: the selection keeps
/// `min(visible, sink + local + k)` per query head (exactly: the top-k of the middle is `k`
/// when the middle has at least `k` keys), everything for dense.
fn account(c: &Config, out: &mut BranchOut, att: &Attention, visible: usize, bits: f64) {
    let globals = c
        .layer_kinds
        .iter()
        .filter(|k| **k == LayerKind::Global)
        .count();
    let scans = (globals * c.n_kv_heads) as u64;
    let g = c.group() as f64;
    let kept = match att.method {
        AttendMethod::Dense => visible,
        AttendMethod::Scan(_) => visible.min(att.params.sink + att.params.local + att.params.k),
    };
    out.scans += scans;
    out.bits_sum += bits * scans as f64;
    out.selected_sum += kept as f64 * g * scans as f64;
    out.visible_sum += visible as f64 * g * scans as f64;
}

/// One batched decode step of `att` for `batch`: its logits `[batch][vocab]` and the scan bits
/// per token of the step (the plans' mean since the step began for GPU-planned methods).
fn step<D: BranchDecoder + ?Sized>(
    dec: &mut D,
    batch: &[(SessionId, u32)],
    att: &Attention,
) -> Result<(Vec<f32>, f64)> {
    let before = dec.plan_bits()?;
    let logits = dec.decode(batch, att)?;
    let bits = match att.method {
        AttendMethod::Dense => 0.0,
        AttendMethod::Scan(m) => {
            let (mean, n) = dec.plan_bits()?;
            if n > before.1 {
                (mean * n as f64 - before.0 * before.1 as f64) / (n - before.1) as f64
            } else {
                m.bits(dec.model().head_dim) as f64
            }
        }
    };
    Ok((logits, bits))
}

/// Forks every root, runs `body` on the forks, frees them (also when `body` fails).
fn with_forks<D: BranchDecoder + ?Sized, T>(
    dec: &mut D,
    roots: &[SessionId],
    body: impl FnOnce(&mut D, &[SessionId]) -> Result<T>,
) -> Result<T> {
    let mut forks = Vec::with_capacity(roots.len());
    let mut r = Ok(());
    for &root in roots {
        match dec.fork(root) {
            Ok(f) => forks.push(f),
            Err(e) => {
                r = Err(e);
                break;
            }
        }
    }
    let out = r.and_then(|()| body(dec, &forks));
    for f in forks {
        dec.free(f)?;
    }
    out
}

/// Greedy decoding of up to `max_new` tokens from a fork of each root (prefilled, with its
/// last logits), every unfinished fork in one batch per step; a branch stops after a stop
/// token or when `stop(&generated)` says so. Returns one [`BranchOut`] per root, in order; the
/// forks are freed.
///
/// # Errors
/// Whatever the decoder refuses (a method without its calibration, a session past its
/// capacity, more roots than its batch); the forks are freed then too.
pub fn greedy<D: BranchDecoder + ?Sized>(
    dec: &mut D,
    roots: &[(SessionId, &[f32])],
    att: &Attention,
    max_new: usize,
    stop_tokens: &[u32],
    stop: &dyn Fn(&[u32]) -> bool,
) -> Result<Vec<BranchOut>> {
    if max_new == 0 {
        return Ok(vec![BranchOut::default(); roots.len()]);
    }
    let ids: Vec<SessionId> = roots.iter().map(|r| r.0).collect();
    with_forks(dec, &ids, |dec, forks| {
        let mut outs: Vec<BranchOut> = roots
            .iter()
            .map(|(_, l)| BranchOut {
                tokens: vec![argmax(l)],
                ..BranchOut::default()
            })
            .collect();
        loop {
            let active: Vec<usize> = (0..outs.len())
                .filter(|&i| {
                    let t = &outs[i].tokens;
                    let last = t[t.len() - 1];
                    !(stop_tokens.contains(&last) || t.len() >= max_new || stop(t))
                })
                .collect();
            if active.is_empty() {
                break;
            }
            let batch: Vec<(SessionId, u32)> = active
                .iter()
                .map(|&i| (forks[i], *outs[i].tokens.last().unwrap_or(&0)))
                .collect();
            let (logits, bits) = step(dec, &batch, att)?;
            let v = dec.model().vocab_size;
            for (j, &i) in active.iter().enumerate() {
                let visible = dec.len(forks[i])?;
                account(dec.model(), &mut outs[i], att, visible, bits);
                outs[i].tokens.push(argmax(&logits[j * v..(j + 1) * v]));
            }
        }
        Ok(outs)
    })
}

/// Teacher forcing from a fork of each root: feeds `forced[i]` one token per step (every root
/// that still has tokens in one batch; the sequences may differ in length) and returns the
/// argmax after each (prediction `j` is for `forced[i][j + 1]`); the forks are freed.
///
/// # Errors
/// As [`greedy`]; not one forced sequence per root.
pub fn forced<D: BranchDecoder + ?Sized>(
    dec: &mut D,
    roots: &[SessionId],
    att: &Attention,
    forced: &[&[u32]],
) -> Result<Vec<BranchOut>> {
    if forced.len() != roots.len() {
        return Err(crate::error::GpuError::invalid(
            "forced",
            format!(
                "{} forced sequences for {} roots",
                forced.len(),
                roots.len()
            ),
        ));
    }
    let n = forced.iter().map(|f| f.len()).max().unwrap_or(0);
    with_forks(dec, roots, |dec, forks| {
        let mut outs = vec![BranchOut::default(); roots.len()];
        for j in 0..n {
            let active: Vec<usize> = (0..roots.len()).filter(|&i| j < forced[i].len()).collect();
            let batch: Vec<(SessionId, u32)> =
                active.iter().map(|&i| (forks[i], forced[i][j])).collect();
            let (logits, bits) = step(dec, &batch, att)?;
            let v = dec.model().vocab_size;
            for (r, &i) in active.iter().enumerate() {
                let visible = dec.len(forks[i])?;
                account(dec.model(), &mut outs[i], att, visible, bits);
                outs[i].tokens.push(argmax(&logits[r * v..(r + 1) * v]));
            }
        }
        Ok(outs)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::GpuError;
    use fathom_cuda::pages::{CacheSessions, PageConfig};
    use fathom_model::{Arch, RopeStyle};
    use fathom_plan::SelectParams;

    /// A scripted decoder: the next token after `t` in a session is `(t · 7 + len) % V`, so a
    /// branch's tokens depend only on its own history; sessions are real `CacheSessions`
    /// (forks share pages, frees return them), every decode's batch size is recorded, and
    /// decode fails once `fail_at` calls have been made.
    struct Scripted {
        cfg: Config,
        sessions: CacheSessions,
        batches: Vec<usize>,
        fail_at: Option<usize>,
    }

    const V: usize = 50;

    impl Scripted {
        fn new() -> Self {
            Scripted {
                cfg: Config {
                    arch: Arch::Llama,
                    name: "scripted".into(),
                    n_layers: 2,
                    n_embd: 8,
                    n_heads: 4,
                    n_kv_heads: 2,
                    head_dim: 64,
                    n_ff: 16,
                    vocab_size: V,
                    rms_eps: 1e-5,
                    rope_base: 1e4,
                    rope_base_local: 1e4,
                    rope_style: RopeStyle::Interleaved,
                    layer_kinds: vec![LayerKind::Global, LayerKind::Local(8)],
                    context_length: 4096,
                    qk_norm: false,
                    embed_scale: 1.0,
                    attn_softcap: None,
                },
                sessions: CacheSessions::new(PageConfig {
                    page_tokens: 64,
                    pages: 64,
                    max_sessions: 16,
                    max_tokens: 1024,
                })
                .unwrap(),
                batches: Vec::new(),
                fail_at: None,
            }
        }
        fn next(t: u32, len: usize) -> u32 {
            ((t as usize * 7 + len) % V) as u32
        }
        fn logits(t: u32) -> Vec<f32> {
            (0..V)
                .map(|i| if i as u32 == t { 1.0 } else { 0.0 })
                .collect()
        }
    }

    impl Decoder for Scripted {
        fn create(&mut self) -> Result<SessionId> {
            Ok(self
                .sessions
                .create()
                .map_err(fathom_cuda::CudaError::from)?)
        }
        fn fork(&mut self, p: SessionId) -> Result<SessionId> {
            Ok(self
                .sessions
                .fork(p)
                .map_err(fathom_cuda::CudaError::from)?)
        }
        fn free(&mut self, s: SessionId) -> Result<()> {
            Ok(self
                .sessions
                .free(s)
                .map_err(fathom_cuda::CudaError::from)?)
        }
        fn len(&self, s: SessionId) -> Result<usize> {
            Ok(self.sessions.len(s).map_err(fathom_cuda::CudaError::from)?)
        }
        fn truncate(&mut self, s: SessionId, len: usize) -> Result<()> {
            Ok(self
                .sessions
                .truncate(s, len)
                .map_err(fathom_cuda::CudaError::from)?)
        }
        fn prefill(&mut self, s: SessionId, tokens: &[u32]) -> Result<Vec<f32>> {
            self.sessions
                .reserve_many(&[(s, tokens.len())])
                .map_err(fathom_cuda::CudaError::from)?;
            let n = self.len(s)?;
            Ok(Self::logits(Self::next(tokens[tokens.len() - 1], n)))
        }
        fn decode(&mut self, batch: &[(SessionId, u32)], _: &Attention) -> Result<Vec<f32>> {
            if self.fail_at == Some(self.batches.len()) {
                return Err(GpuError::invalid("decode", "scripted failure"));
            }
            self.batches.push(batch.len());
            let grow: Vec<(SessionId, usize)> = batch.iter().map(|&(s, _)| (s, 1)).collect();
            self.sessions
                .reserve_many(&grow)
                .map_err(fathom_cuda::CudaError::from)?;
            let mut out = Vec::new();
            for &(s, t) in batch {
                out.extend(Self::logits(Self::next(t, self.len(s)?)));
            }
            Ok(out)
        }
    }

    impl BranchDecoder for Scripted {
        fn model(&self) -> &Config {
            &self.cfg
        }
        fn plan_bits(&mut self) -> Result<(f64, u64)> {
            Ok((0.0, 0))
        }
    }

    fn att() -> Attention {
        Attention {
            method: AttendMethod::Dense,
            params: SelectParams {
                sink: 4,
                local: 32,
                k: 64,
            },
        }
    }

    fn roots(dec: &mut Scripted, lens: &[usize]) -> Vec<(SessionId, Vec<f32>)> {
        lens.iter()
            .map(|&n| {
                let s = dec.create().unwrap();
                let p: Vec<u32> = (0..n as u32).collect();
                let l = dec.prefill(s, &p).unwrap();
                (s, l)
            })
            .collect()
    }

    #[test]
    fn a_batch_of_branches_decodes_as_each_branch_alone() {
        for (lens, max_new) in [
            (vec![10usize, 70, 33], 9usize),
            (vec![5], 1),
            (vec![64, 1, 200, 7], 20),
        ] {
            let mut dec = Scripted::new();
            let rs = roots(&mut dec, &lens);
            let live = dec.sessions.live_sessions();
            // A branch stops at token 3 (a stop token) or when its sum passes 150.
            let stop = |t: &[u32]| t.iter().sum::<u32>() > 150;
            let r: Vec<(SessionId, &[f32])> = rs.iter().map(|(s, l)| (*s, &l[..])).collect();
            let all = greedy(&mut dec, &r, &att(), max_new, &[3], &stop).unwrap();
            assert_eq!(dec.sessions.live_sessions(), live, "every fork freed");
            for (i, one) in r.iter().enumerate() {
                let alone = greedy(&mut dec, &[*one], &att(), max_new, &[3], &stop).unwrap();
                assert_eq!(all[i], alone[0], "branch {i} of {lens:?}");
                let t = &all[i].tokens;
                assert!(t.len() <= max_new && !t.is_empty());
                let done = t.contains(&3) || t.len() == max_new || stop(t);
                assert!(done, "branch {i} stopped early: {t:?}");
                assert_eq!(
                    all[i].scans,
                    (t.len() as u64 - 1) * 2,
                    "one global layer × 2 KV heads per step"
                );
            }
            // Batches only shrink.
            let b = &dec.batches[..];
            assert!(b
                .windows(2)
                .take(max_new)
                .all(|w| w[0] >= w[1] || w[1] == 1));
        }
    }

    #[test]
    fn teacher_forcing_predicts_each_step_and_failures_free_the_forks() {
        let mut dec = Scripted::new();
        let rs = roots(&mut dec, &[12, 40]);
        let ids: Vec<SessionId> = rs.iter().map(|r| r.0).collect();
        let f0: Vec<u32> = vec![1, 2, 3, 4, 5];
        let f1: Vec<u32> = vec![9, 8, 7, 6, 5];
        let out = forced(&mut dec, &ids, &att(), &[&f0, &f1]).unwrap();
        for (i, (f, n0)) in [(&f0, 12usize), (&f1, 40)].iter().enumerate() {
            let want: Vec<u32> = f
                .iter()
                .enumerate()
                .map(|(j, &t)| Scripted::next(t, n0 + j + 1))
                .collect();
            assert_eq!(out[i].tokens, want);
        }
        // Sequences of different lengths: each root is fed its own, the shorter leaves the batch.
        let ragged = forced(&mut dec, &ids, &att(), &[&f0, &f1[..3]]).unwrap();
        assert_eq!(ragged[0].tokens, out[0].tokens);
        assert_eq!(ragged[1].tokens, out[1].tokens[..3].to_vec());
        let live = dec.sessions.live_sessions();
        assert!(forced(&mut dec, &ids, &att(), &[&f0]).is_err());
        dec.fail_at = Some(dec.batches.len() + 2);
        assert!(forced(&mut dec, &ids, &att(), &[&f0, &f1]).is_err());
        assert_eq!(
            dec.sessions.live_sessions(),
            live,
            "forks freed after a failure"
        );
        assert_eq!(dec.len(ids[0]).unwrap(), 12, "roots untouched");
    }
}
