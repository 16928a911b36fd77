//! End-to-end decode throughput (docs/SPEC.md §9): for each batch size and method, forks of
//! the first B prefilled sessions decode greedily together, one batched step at a time, timed
//! on the host around each whole step (forward, appends, attention, sampling, the copy of the
//! sampled ids), then a few more steps with CUDA events around the stages. The link bytes
//! come from the cache's own counters (the plans' bits, the row fetches that missed the row
//! cache), so they are what the step read, not a model of it.

use fathom_cuda::cache::AttendMethod;
use fathom_cuda::pages::SessionId;
use fathom_cuda::prelude::*;
use fathom_model::LayerKind;
use fathom_results::decode_bench::{DecodeBenchEntry, StageSplit};

use crate::decoder::{Attention, Decoder};
use crate::error::Result;
use crate::GpuDecoder;

/// Instrumented steps per method and batch (after the timed ones).
pub const SPLIT_STEPS: usize = 3;

/// The entries of one run and the host bytes per resident token.
#[derive(Debug, Clone)]
pub struct Measured {
    /// One per batch size and method, in that order.
    pub entries: Vec<DecodeBenchEntry>,
    /// Bytes per resident token, over every layer, of the memory that bounds B: the pinned
    /// host memory of the pages (host residency) or of the records (index-hbm), or HBM (hbm).
    pub host_bytes_per_token: f64,
}

/// The share of the memory the pages may take in [`capacity`].
pub const USABLE_FRACTION: f64 = 0.9;

/// What bounds B: the resident tokens `memory_bytes · USABLE_FRACTION` holds at
/// `bytes_per_token`, and the largest batch of sessions whose contexts cycle through
/// `contexts` (session i has `contexts[i % len]` tokens) that fits.
///
/// ```
/// use fathom_gpu::throughput::capacity;
/// // 128 GiB of host memory at the Qwen3-8B shape's ~167 kB per resident token:
/// let c = capacity(128 << 30, 167_000.0, &[131_072]).unwrap();
/// assert_eq!(c.largest_batch, 5); // 740k tokens fit: 5 sessions of 128k
/// ```
///
/// # Errors
/// A `bytes_per_token` that is not positive and finite, or an empty or zero context list.
pub fn capacity(
    memory_bytes: u64,
    bytes_per_token: f64,
    contexts: &[usize],
) -> Result<fathom_results::decode_bench::Capacity> {
    if !(bytes_per_token.is_finite() && bytes_per_token > 0.0) {
        return Err(crate::error::GpuError::invalid(
            "bytes per token",
            format!("{bytes_per_token} (want a positive number)"),
        ));
    }
    if contexts.is_empty() || contexts.contains(&0) {
        return Err(crate::error::GpuError::invalid(
            "contexts",
            format!("{contexts:?} (want at least one, each ≥ 1 token)"),
        ));
    }
    let max_tokens = (memory_bytes as f64 * USABLE_FRACTION / bytes_per_token).floor() as u64;
    let (mut used, mut b) = (0u64, 0usize);
    loop {
        let next = used + contexts[b % contexts.len()] as u64;
        if next > max_tokens {
            break;
        }
        used = next;
        b += 1;
    }
    Ok(fathom_results::decode_bench::Capacity {
        memory_bytes,
        usable_fraction: USABLE_FRACTION,
        max_resident_tokens: max_tokens,
        largest_batch: b,
    })
}

/// The host's memory in bytes (`MemTotal` of `/proc/meminfo`), where the OS exposes it.
pub fn host_memory_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes one step moves over the link (docs/SPEC.md §6's traffic model, the weights aside):
/// `key_heads` (Σ over sessions of keys scanned, times global layers and KV heads) at
/// `plan_bits` each, plus `row_misses` records of `record` bytes fetched past the row cache;
/// dense reads every key's record. With the pages in HBM nothing crosses; with the index in
/// HBM only the records do.
pub fn link_bytes(
    residency: fathom_cuda::Residency,
    dense: bool,
    key_heads: f64,
    plan_bits: f64,
    row_misses: f64,
    record: f64,
) -> f64 {
    use fathom_cuda::Residency;
    match (residency, dense) {
        (Residency::Hbm, _) => 0.0,
        (_, true) => key_heads * record,
        (Residency::Host, false) => key_heads * plan_bits / 8.0 + row_misses * record,
        (Residency::IndexHbm, false) => row_misses * record,
    }
}

/// The value at quantile `p` of `sorted` (nearest rank).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Times `steps` decode steps per batch size in `batches` (each at most `roots.len()`) and
/// method, from forks of `roots` (prefilled sessions with the token each decodes first); with
/// `graph`, each again with the whole step replayed as one CUDA graph
/// ([`GpuDecoder::capture_greedy`]; entries with `graph: true`).
///
/// # Errors
/// Whatever the decoder refuses; a batch larger than the roots.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    dec: &mut GpuDecoder,
    roots: &[(SessionId, u32)],
    methods: &[(String, Attention)],
    batches: &[usize],
    steps: usize,
    h2d_gbps: f64,
    residency: fathom_cuda::Residency,
    graph: bool,
) -> Result<Measured> {
    use fathom_cuda::Residency;
    let cfg = dec.config().clone();
    let d = cfg.head_dim;
    let dc = *dec.decoder_config();
    let layout = fathom_cuda::PagedLayout::new(
        fathom_store::Dims {
            heads: cfg.n_kv_heads,
            channels: d,
        },
        dc.page_tokens,
        1,
    )
    .map_err(fathom_cuda::CudaError::from)?;
    let bounded_page = match residency {
        Residency::IndexHbm => layout.split_page_bytes().1,
        Residency::Host | Residency::Hbm => layout.page_bytes(),
    };
    let host_bytes_per_token = bounded_page as f64 / dc.page_tokens as f64 * cfg.n_layers as f64;
    let globals = cfg
        .layer_kinds
        .iter()
        .filter(|k| **k == LayerKind::Global)
        .count();
    let record = layout.record_bytes() as f64;
    let heads = (globals * cfg.n_kv_heads) as f64;
    let mut entries = Vec::new();
    for &b in batches {
        if b > roots.len() {
            return Err(crate::error::GpuError::invalid(
                "batch",
                format!("{b} sessions, {} prefilled", roots.len()),
            ));
        }
        let modes: &[bool] = if graph { &[false, true] } else { &[false] };
        for ((name, att), &as_graph) in methods
            .iter()
            .flat_map(|m| modes.iter().map(move |g| (m, g)))
        {
            let mut forks = Vec::with_capacity(b);
            for &(s, _) in &roots[..b] {
                forks.push(dec.fork(s)?);
            }
            let gather0 = dec.cache_mut()?.host_gather_stats()?;
            let r = time_one(dec, &forks, &roots[..b], att, steps, as_graph);
            for f in &forks {
                dec.free(*f)?;
            }
            let t = r?;
            let gather = match (gather0, dec.cache_mut()?.host_gather_stats()?) {
                (Some(a), Some(z)) => {
                    let delta = z.since(&a);
                    if delta.faults > 0 {
                        // Rows were zeroed or left unwritten: these steps attended over wrong
                        // rows, so their tokens/s are not the method's.
                        return Err(crate::error::GpuError::invalid(
                            "host gather",
                            format!("faults during {name} at B = {b}: {z:?}"),
                        ));
                    }
                    delta
                }
                _ => fathom_cuda::host_gather::GatherDelta::default(),
            };
            let n = steps as f64;
            let plan_bits = if t.plans1 > t.plans0 {
                (t.bits1 * t.plans1 as f64 - t.bits0 * t.plans0 as f64)
                    / (t.plans1 - t.plans0) as f64
            } else {
                match att.method {
                    AttendMethod::Scan(m) => m.bits(d) as f64,
                    AttendMethod::Dense => 0.0,
                }
            };
            let rows = t.rows as f64 / n;
            let misses = (t.rows - t.hits) as f64 / n;
            let pcie = link_bytes(
                residency,
                matches!(att.method, AttendMethod::Dense),
                t.keys / n * heads,
                plan_bits,
                misses,
                record,
            );
            let total_s: f64 = t.ms.iter().sum::<f64>() / 1e3;
            let mut sorted = t.ms.clone();
            sorted.sort_by(f64::total_cmp);
            entries.push(DecodeBenchEntry {
                method: name.clone(),
                batch: b,
                contexts: roots[..b]
                    .iter()
                    .map(|&(s, _)| dec.len(s))
                    .collect::<Result<Vec<_>>>()?,
                tokens_per_s: b as f64 * n / total_s,
                per_session_tokens_per_s: n / total_s,
                step_ms_p50: percentile(&sorted, 0.5),
                step_ms_p99: percentile(&sorted, 0.99),
                plan_bits,
                pcie_bytes_per_step: pcie,
                link_floor_ms: pcie / (h2d_gbps * 1e9) * 1e3,
                rows_per_step: rows,
                row_hit_rate: if t.rows > 0 {
                    t.hits as f64 / t.rows as f64
                } else {
                    0.0
                },
                split: Some(t.split),
                graph: as_graph,
                host_gather_request_us: gather.request_us,
                host_gather_mrows_per_thread_s: gather.mrows_per_thread_s,
            });
        }
    }
    Ok(Measured {
        entries,
        host_bytes_per_token,
    })
}

/// One method at one batch: the counters around the timed steps and the split.
struct Timed {
    ms: Vec<f64>,
    keys: f64,
    bits0: f64,
    plans0: u64,
    bits1: f64,
    plans1: u64,
    rows: u64,
    hits: u64,
    split: StageSplit,
}

fn time_one(
    dec: &mut GpuDecoder,
    forks: &[SessionId],
    roots: &[(SessionId, u32)],
    att: &Attention,
    steps: usize,
    graph: bool,
) -> Result<Timed> {
    let mut toks: Vec<u32> = roots.iter().map(|r| r.1).collect();
    let batch_of = |toks: &[u32]| -> Vec<(SessionId, u32)> {
        forks.iter().copied().zip(toks.iter().copied()).collect()
    };
    let step = |dec: &mut GpuDecoder, toks: &mut Vec<u32>| -> Result<()> {
        *toks = dec.decode_greedy(&batch_of(toks), att)?;
        Ok(())
    };
    step(dec, &mut toks)?; // untimed: the method's first plans and the row cache
                           // With `graph`, a second untimed step captures the whole step (and runs it once).
    let captured = if graph {
        let (t, g) = dec.capture_greedy(&batch_of(&toks), att)?;
        toks = t;
        Some(g)
    } else {
        None
    };
    let (bits0, plans0) = dec.cache_mut()?.plan_bits()?;
    let rc0 = dec.cache_mut()?.row_counters()?;
    let mut ms = Vec::with_capacity(steps);
    let mut keys = 0f64;
    for _ in 0..steps {
        for &f in forks {
            keys += (dec.len(f)? + 1) as f64;
        }
        let t = std::time::Instant::now();
        match &captured {
            Some(g) => toks = dec.replay_greedy(g, &batch_of(&toks))?,
            None => step(dec, &mut toks)?,
        }
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let (bits1, plans1) = dec.cache_mut()?.plan_bits()?;
    let rc1 = dec.cache_mut()?.row_counters()?;
    dec.set_instrument(true);
    let r = (0..SPLIT_STEPS).try_for_each(|_| step(dec, &mut toks));
    let st = dec.take_stage_times();
    dec.set_instrument(false);
    r?;
    let st = st?;
    let per = |x: f64| x / st.steps.max(1) as f64;
    Ok(Timed {
        ms,
        keys,
        bits0,
        plans0,
        bits1,
        plans1,
        rows: rc1.rows - rc0.rows,
        hits: rc1.hits - rc0.hits,
        split: StageSplit {
            steps: st.steps,
            total_ms: per(st.total_ms),
            weights_ms: per(st.weights_ms),
            attention_ms: per(st.attention_ms),
            appends_ms: per(st.appends_ms),
            sampling_ms: per(st.sampling_ms),
            attend_ms: if st.attend.attends > 0 && st.attend.untimed == 0 {
                fathom_cuda::cache::AttendStages::NAMES
                    .iter()
                    .zip(st.attend.values())
                    .map(|(k, v)| ((*k).to_string(), per(v)))
                    .collect()
            } else {
                Default::default()
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::{capacity, host_memory_bytes, link_bytes, percentile, USABLE_FRACTION};
    use fathom_cuda::Residency;

    #[test]
    fn link_bytes_follow_the_residency() {
        // 1000 keys × layers × heads at 48 bits, 10 row misses of 512 bytes.
        let (k, b, m, r) = (1000.0, 48.0, 10.0, 512.0);
        assert_eq!(
            link_bytes(Residency::Host, false, k, b, m, r),
            6000.0 + 5120.0
        );
        assert_eq!(link_bytes(Residency::IndexHbm, false, k, b, m, r), 5120.0);
        assert_eq!(link_bytes(Residency::Hbm, false, k, b, m, r), 0.0);
        for res in [Residency::Host, Residency::IndexHbm] {
            assert_eq!(link_bytes(res, true, k, 0.0, 0.0, r), 512_000.0);
        }
        assert_eq!(link_bytes(Residency::Hbm, true, k, 0.0, 0.0, r), 0.0);
    }

    #[test]
    fn capacity_fills_the_usable_memory_with_the_cycled_contexts() {
        // 1000 tokens fit (1 MB usable at 900 B per token... = 1e6 · 0.9 / 900).
        let c = capacity(1_000_000, 900.0, &[300, 100]).unwrap();
        assert_eq!(c.max_resident_tokens, 1000);
        // 300 + 100 + 300 + 100 = 800; the next 300 would make 1100.
        assert_eq!(c.largest_batch, 4);
        assert_eq!(c.usable_fraction, USABLE_FRACTION);
        assert_eq!(
            capacity(1_000_000, 900.0, &[1001]).unwrap().largest_batch,
            0
        );
        assert_eq!(
            capacity(1_000_000, 900.0, &[1000]).unwrap().largest_batch,
            1
        );
        // The issue's arithmetic: 128 GiB at ~167 kB per token holds about 700k tokens.
        let q = capacity(128 << 30, 167_000.0, &[65_536]).unwrap();
        assert_eq!(q.max_resident_tokens / 1000, 740);
        assert_eq!(q.largest_batch, 11);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(capacity(1 << 30, bad, &[8]).is_err(), "{bad}");
        }
        assert!(capacity(1 << 30, 8.0, &[]).is_err());
        assert!(capacity(1 << 30, 8.0, &[8, 0]).is_err());
        if cfg!(target_os = "linux") {
            assert!(host_memory_bytes().is_some_and(|b| b > 1 << 20));
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let x: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&x, 0.5), 51.0);
        assert_eq!(percentile(&x, 0.99), 99.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
        assert!(percentile(&[], 0.5).is_nan());
    }
}
