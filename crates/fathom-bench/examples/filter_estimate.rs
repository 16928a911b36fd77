//! How often the filtered select of docs/SPEC.md §5 ("Selection without a score array") would
//! select from its filtered pairs alone, on the consecutive decode positions of a real capture:
//! the estimator rule of `fathom-cuda`'s `paged_topk_fused` (the filter of a row is the
//! previous position's `FUSE_TARGET · kk`-th largest middle score over the query's norm, times
//! this query's norm) replayed on the CPU over the exact dot products of the captured q and k,
//! with `fathom_plan::select::select_filtered` (every selection it makes is checked against
//! `select_per_head`).
//!
//! ```text
//! cargo run --release -p fathom-bench --example filter_estimate -- CAPTURE.safetensors K [TARGET CAP_PER_K]
//! # TARGET and CAP_PER_K default to the kernels' FUSE_TARGET (6) and FUSE_CAP_PER_K (24)
//! ```
//!
//! Prints one markdown row per global layer and a total: rows that had an estimate, the share
//! selected from their pairs, the fallbacks (too few passed / more than the cap), and the mean
//! passing tokens per winner.
use fathom_bench::capture::Capture;
use fathom_plan::select::{select_filtered, FilterOutcome};
use fathom_plan::{select_per_head, SelectParams};

#[derive(Default, Clone, Copy)]
struct Tally {
    eligible: usize,
    with_estimate: usize,
    selected: usize,
    too_few: usize,
    overflow: usize,
    passed_per_winner: f64,
    /// (KV head, position) steps that had an estimate, and those where any of the KV head's
    /// G rows fell back (a rescan of the KV head, or a score-path select over kept scores).
    kv_steps: usize,
    kv_fallbacks: usize,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.eligible += o.eligible;
        self.with_estimate += o.with_estimate;
        self.selected += o.selected;
        self.too_few += o.too_few;
        self.overflow += o.overflow;
        self.passed_per_winner += o.passed_per_winner;
        self.kv_steps += o.kv_steps;
        self.kv_fallbacks += o.kv_fallbacks;
    }
    fn row(&self, name: &str) -> String {
        let pct = |x: usize| 100.0 * x as f64 / self.with_estimate.max(1) as f64;
        format!(
            "| {name} | {} | {} | {:.1}% | {:.1}% | {:.1}% | {:.2} | {:.1}% |",
            self.eligible,
            self.with_estimate,
            pct(self.selected),
            pct(self.too_few),
            pct(self.overflow),
            self.passed_per_winner / self.selected.max(1) as f64,
            100.0 * self.kv_fallbacks as f64 / self.kv_steps.max(1) as f64
        )
    }
}

/// The `m`-th largest middle score (1-based) of `scores` at `pos`.
fn mth_largest(scores: &[f32], p: &SelectParams, pos: usize, m: usize) -> f32 {
    let mut mid: Vec<f32> = scores[p.middle(pos)].to_vec();
    mid.sort_by(|a, b| b.total_cmp(a));
    mid[(m - 1).min(mid.len() - 1)]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 2 {
        return Err("usage: filter_estimate CAPTURE.safetensors K [TARGET CAP_PER_K]".into());
    }
    let cap = Capture::open(std::path::Path::new(&a[0]))?;
    let k: usize = a[1].parse()?;
    let target: usize = a.get(2).map_or(Ok(6), |s| s.parse())?;
    let cap_per_k: usize = a.get(3).map_or(Ok(24), |s| s.parse())?;
    let info = cap.info().clone();
    let (hq, hkv, d, g) = (info.hq, info.hkv, info.d, info.g());
    let p = SelectParams {
        sink: 4,
        local: 32,
        k,
    };
    let mut order: Vec<usize> = (0..info.positions.len()).collect();
    order.sort_by_key(|&i| info.positions[i]);
    println!(
        "capture {} ({}, {} tokens, positions {}..={}), k = {k}, target {target}·kk, cap {cap_per_k}·k; exact dot products",
        a[0],
        info.model,
        info.n,
        info.positions[order[0]],
        info.positions[*order.last().unwrap_or(&0)]
    );
    println!();
    println!("| layer | rows eligible | with an estimate | selected from pairs | fallback: too few | fallback: overflow | passed / winner | KV heads with a fallback |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut total = Tally::default();
    let (mut a_out, mut b_out) = (Vec::new(), Vec::new());
    for (li, &layer) in info.layers.iter().enumerate() {
        if info.kinds.get(li).is_some_and(|k| k.window().is_some()) {
            continue; // sliding-window layers attend densely
        }
        let data = cap.layer(layer)?;
        let mut t = Tally::default();
        // (KV head, position index) → (had an estimate, any row fell back).
        let mut kv = std::collections::BTreeMap::<(usize, usize), bool>::new();
        for h in 0..hq {
            let kvh = h / g;
            let mut est: Option<f32> = None;
            for &pi in &order {
                let pos = info.positions[pi];
                let q = &data.q[(pi * hq + h) * d..(pi * hq + h + 1) * d];
                let norm = q.iter().map(|x| x * x).sum::<f32>().sqrt();
                let scores: Vec<f32> = (0..=pos)
                    .map(|i| {
                        let kr = &data.k[(i * hkv + kvh) * d..(i * hkv + kvh + 1) * d];
                        q.iter().zip(kr).map(|(a, b)| a * b).sum()
                    })
                    .collect();
                let mid = p.middle(pos).len();
                let kk = k.min(mid);
                let m = target * kk;
                if mid < 2 * m || kk == 0 {
                    est = None;
                    continue;
                }
                t.eligible += 1;
                let fresh = |s: &[f32]| Some(mth_largest(s, &p, pos, m) / norm);
                match est {
                    None => est = fresh(&scores),
                    Some(e) => {
                        t.with_estimate += 1;
                        let failed = kv.entry((kvh, pi)).or_insert(false);
                        let o =
                            select_filtered(pos, &scores, &p, e * norm, cap_per_k * k, &mut a_out)?;
                        match o {
                            FilterOutcome::Selected { passed } => {
                                select_per_head(pos, &scores, &p, &mut b_out)?;
                                if a_out != b_out {
                                    return Err(format!(
                                        "layer {layer} head {h} pos {pos}: the filtered select differs"
                                    )
                                    .into());
                                }
                                t.selected += 1;
                                t.passed_per_winner += passed as f64 / kk as f64;
                                if passed > 2 * m {
                                    est = fresh(&scores);
                                }
                            }
                            FilterOutcome::TooFew { .. } => {
                                t.too_few += 1;
                                *failed = true;
                                est = fresh(&scores);
                            }
                            FilterOutcome::Overflow { .. } => {
                                t.overflow += 1;
                                *failed = true;
                                est = fresh(&scores);
                            }
                        }
                    }
                }
            }
        }
        t.kv_steps = kv.len();
        t.kv_fallbacks = kv.values().filter(|&&f| f).count();
        println!("{}", t.row(&layer.to_string()));
        total.add(&t);
    }
    println!("{}", total.row("**all**"));
    Ok(())
}
