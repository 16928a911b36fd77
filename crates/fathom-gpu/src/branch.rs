//! Branched decoding on the GPU, the downstream tasks' protocol (docs/SPEC.md §7): one dense
//! prefill per sample, then per method a fork of its session that decodes greedily (or
//! teacher-forced) with the method on every global layer, freed at the end. The forks share
//! the prefill's pages (copy-on-write), so a branch costs one partial page per layer.

use fathom_cuda::cache::AttendMethod;
use fathom_cuda::pages::SessionId;
use fathom_model::{argmax, LayerKind};

use crate::decoder::{Attention, Decoder};
use crate::error::Result;
use crate::GpuDecoder;

/// One branch's tokens and scan statistics, in `fathom_bench::decode::DecodeStats`' terms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BranchOut {
    /// Generated (or, teacher-forced, predicted) ids.
    pub tokens: Vec<u32>,
    /// Σ scan bits per token over (step, global layer, KV head): the GPU plan's own bits for
    /// Fathom and SparQ, the method's fixed bits otherwise, 0 for dense.
    pub bits_sum: f64,
    /// (step, global layer, KV head) scans.
    pub scans: u64,
    /// Σ tokens attended per query head over scans × G.
    pub selected_sum: f64,
    /// Σ keys visible over scans × G.
    pub visible_sum: f64,
}

/// Counts one decode step at `visible` keys: what the selection keeps is
/// `min(visible, sink + local + k)` per query head (exactly: the top-k of the middle is `k`
/// when the middle has at least `k` keys), everything for dense.
fn account(dec: &GpuDecoder, out: &mut BranchOut, att: &Attention, visible: usize, bits: f64) {
    let c = dec.config();
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

/// Scan bits per token of one step of `att` (the plan's mean since `before` for GPU-planned
/// methods, whose counters advance by one plan per KV head and global layer).
fn step_bits(dec: &mut GpuDecoder, att: &Attention, before: (f64, u64)) -> Result<f64> {
    Ok(match att.method {
        AttendMethod::Dense => 0.0,
        AttendMethod::Scan(m) => {
            let (mean, n) = dec.cache_mut()?.plan_bits()?;
            if n > before.1 {
                (mean * n as f64 - before.0 * before.1 as f64) / (n - before.1) as f64
            } else {
                m.bits(dec.config().head_dim) as f64
            }
        }
    })
}

/// Greedy decoding of up to `max_new` tokens from a fork of `root` (prefilled, whose last
/// logits are `logits`); stops after a stop token or when `stop(&generated)` says so. The
/// fork is freed before returning.
///
/// # Errors
/// Whatever the decoder refuses (a method without its calibration, a session past its
/// capacity); the fork is freed then too.
pub fn greedy(
    dec: &mut GpuDecoder,
    root: SessionId,
    logits: &[f32],
    att: &Attention,
    max_new: usize,
    stop_tokens: &[u32],
    stop: &dyn Fn(&[u32]) -> bool,
) -> Result<BranchOut> {
    let fork = dec.fork(root)?;
    let r = greedy_on(dec, fork, logits, att, max_new, stop_tokens, stop);
    dec.free(fork)?;
    r
}

fn greedy_on(
    dec: &mut GpuDecoder,
    s: SessionId,
    logits: &[f32],
    att: &Attention,
    max_new: usize,
    stop_tokens: &[u32],
    stop: &dyn Fn(&[u32]) -> bool,
) -> Result<BranchOut> {
    let mut out = BranchOut::default();
    let mut next = argmax(logits);
    for i in 0..max_new {
        out.tokens.push(next);
        if stop_tokens.contains(&next) || i + 1 == max_new || stop(&out.tokens) {
            break;
        }
        let before = dec.cache_mut()?.plan_bits()?;
        let l = dec.decode(&[(s, next)], att)?;
        let bits = step_bits(dec, att, before)?;
        let visible = dec.len(s)?;
        account(dec, &mut out, att, visible, bits);
        next = argmax(&l);
    }
    Ok(out)
}

/// Teacher forcing from a fork of `root`: feeds `forced` one token per step with `att` and
/// returns the argmax after each (prediction `i` is for `forced[i + 1]`); the fork is freed.
///
/// # Errors
/// As [`greedy`].
pub fn forced(
    dec: &mut GpuDecoder,
    root: SessionId,
    att: &Attention,
    forced: &[u32],
) -> Result<BranchOut> {
    let fork = dec.fork(root)?;
    let r = (|| {
        let mut out = BranchOut::default();
        for &t in forced {
            let before = dec.cache_mut()?.plan_bits()?;
            let l = dec.decode(&[(fork, t)], att)?;
            let bits = step_bits(dec, att, before)?;
            let visible = dec.len(fork)?;
            account(dec, &mut out, att, visible, bits);
            out.tokens.push(argmax(&l));
        }
        Ok(out)
    })();
    dec.free(fork)?;
    r
}
