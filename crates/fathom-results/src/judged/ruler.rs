//! The judged RULER statistics of one run (one setting: model, context, k), docs/SPEC.md §7:
//! per method the paired difference against exact top-k and against dense, per task and
//! pooled over the tasks dense can do, the fraction of generations identical to exact's, the
//! budget in bits, bits per channel and the fraction of context k keeps, and the verdict.

use std::collections::BTreeMap;

use fathom_plan::method::{FathomVariant, MethodSpec};

use super::stats::{interval, judge, Interval, Verdict, DENSE_CAN_DO, PARITY_MARGIN};
use crate::downstream::{RulerDoc, RulerRecord};

/// One method's row of a setting's table.
#[derive(Debug, Clone, PartialEq)]
pub struct MethodRow {
    /// The method's label.
    pub method: String,
    /// Mean scan bits per token per KV head over the pooled samples.
    pub bits: f64,
    /// `bits / D`.
    pub bits_per_channel: f64,
    /// Pooled `score(method) − score(exact)`.
    pub vs_exact: Interval,
    /// Pooled `score(method) − score(dense)`.
    pub vs_dense: Interval,
    /// Pooled generations token-identical to exact's.
    pub identical: usize,
    /// Pooled samples the method ran.
    pub samples: usize,
    /// The verdict on `vs_exact` at [`PARITY_MARGIN`] (`None` for exact itself).
    pub verdict: Option<Verdict>,
}

/// One task's row: its dense and exact means and each method's difference against exact.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRow {
    /// The task.
    pub task: String,
    /// Samples.
    pub samples: usize,
    /// Dense's mean score.
    pub dense: f64,
    /// Exact top-k's mean score.
    pub exact: f64,
    /// Dense ≥ [`DENSE_CAN_DO`]: the task is pooled.
    pub informative: bool,
    /// Per method (exact left out): `score − exact` and the identical generations.
    pub vs_exact: BTreeMap<String, (Interval, usize)>,
}

/// A run's judgement.
#[derive(Debug, Clone, PartialEq)]
pub struct RulerJudgement {
    /// Head dimension D.
    pub d: usize,
    /// Context tokens.
    pub context: usize,
    /// Top-k per query head.
    pub k: usize,
    /// `k / context`: the fraction of the context k keeps per query head.
    pub k_fraction: f64,
    /// Per task, in run order.
    pub tasks: Vec<TaskRow>,
    /// Per method, in run order (exact included, with no verdict).
    pub methods: Vec<MethodRow>,
}

impl RulerJudgement {
    /// The tasks pooled (dense ≥ [`DENSE_CAN_DO`]).
    pub fn informative(&self) -> Vec<&str> {
        self.tasks
            .iter()
            .filter(|t| t.informative)
            .map(|t| t.task.as_str())
            .collect()
    }
}

fn task_of(r: &RulerRecord) -> Option<&str> {
    r.sample.get("task").and_then(|t| t.as_str())
}

/// `(a − b)` per sample of `recs` where both methods ran.
fn diffs(recs: &[&RulerRecord], a: &str, b: &str) -> Vec<f64> {
    recs.iter()
        .filter_map(|r| Some(r.methods.get(a)?.score - r.methods.get(b)?.score))
        .collect()
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

/// Judges a RULER run (module docs; the rule is docs/SPEC.md §7's).
pub fn judge_ruler(doc: &RulerDoc) -> RulerJudgement {
    let h = &doc.header;
    let by_task: Vec<(&str, Vec<&RulerRecord>)> = doc
        .tasks
        .iter()
        .map(|t| {
            let recs = doc
                .results
                .iter()
                .filter(|r| task_of(r) == Some(t.as_str()))
                .collect();
            (t.as_str(), recs)
        })
        .filter(|(_, recs): &(&str, Vec<&RulerRecord>)| !recs.is_empty())
        .collect();
    let score = |recs: &[&RulerRecord], m: &str| {
        let s: Vec<f64> = recs
            .iter()
            .filter_map(|r| r.methods.get(m).map(|x| x.score))
            .collect();
        mean(&s)
    };
    let tasks: Vec<TaskRow> = by_task
        .iter()
        .map(|(task, recs)| {
            let dense = score(recs, "dense");
            TaskRow {
                task: task.to_string(),
                samples: recs.len(),
                dense,
                exact: score(recs, "exact"),
                informative: dense >= DENSE_CAN_DO,
                vs_exact: h
                    .methods
                    .iter()
                    .filter(|m| *m != "exact")
                    .map(|m| {
                        let same = recs
                            .iter()
                            .filter(|r| r.methods.get(m).is_some_and(|x| x.same_as_exact))
                            .count();
                        (m.clone(), (interval(&[&diffs(recs, m, "exact")]), same))
                    })
                    .collect(),
            }
        })
        .collect();
    let pooled: Vec<&Vec<&RulerRecord>> = by_task
        .iter()
        .zip(&tasks)
        .filter(|(_, t)| t.informative)
        .map(|((_, recs), _)| recs)
        .collect();
    let methods = h
        .methods
        .iter()
        .map(|m| method_row(m, &pooled, h.d))
        .collect();
    RulerJudgement {
        d: h.d,
        context: h.context,
        k: h.select.k,
        k_fraction: h.select.k as f64 / h.context as f64,
        tasks,
        methods,
    }
}

/// One method's pooled row over the informative tasks' samples (`pooled`, one stratum each).
fn method_row(m: &str, pooled: &[&Vec<&RulerRecord>], d: usize) -> MethodRow {
    let strata = |b: &str| -> Vec<Vec<f64>> { pooled.iter().map(|r| diffs(r, m, b)).collect() };
    let pool = |s: &[Vec<f64>]| {
        let refs: Vec<&[f64]> = s.iter().map(Vec::as_slice).collect();
        interval(&refs)
    };
    let ran: Vec<&&RulerRecord> = pooled
        .iter()
        .flat_map(|r| r.iter())
        .filter(|r| r.methods.contains_key(m))
        .collect();
    let bits = mean(
        &ran.iter()
            .map(|r| r.methods[m].mean_bits)
            .collect::<Vec<_>>(),
    );
    let vs_exact = pool(&strata("exact"));
    MethodRow {
        method: m.to_string(),
        bits,
        bits_per_channel: bits / d as f64,
        vs_dense: if m == "dense" {
            Interval::EMPTY
        } else {
            pool(&strata("dense"))
        },
        identical: ran.iter().filter(|r| r.methods[m].same_as_exact).count(),
        samples: ran.len(),
        verdict: (m != "exact").then(|| judge(&vs_exact, PARITY_MARGIN)),
        vs_exact,
    }
}

/// What a run says of Fathom's budgets (`fathom:B` of the plain planner): the smallest `B`
/// from which every budget run is at parity with exact top-k, and the budgets below it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FathomReading {
    /// The smallest run budget `B` such that every run budget `≥ B` is at parity (`None`:
    /// the largest is not).
    pub at_parity_from: Option<f32>,
    /// Budgets whose verdict is "below".
    pub below: Vec<f32>,
    /// Every budget run, ascending, with its verdict.
    pub budgets: Vec<(f32, Verdict)>,
}

/// [`FathomReading`] of a judgement.
pub fn fathom_reading(j: &RulerJudgement) -> FathomReading {
    let budgets: Vec<(f32, Verdict)> = j
        .methods
        .iter()
        .filter_map(|r| match MethodSpec::parse(&r.method, j.d).ok()? {
            MethodSpec::Fathom {
                variant: FathomVariant::Plan,
                budget,
            } => Some((budget, r.verdict?)),
            _ => None,
        })
        .collect();
    FathomReading::from_budgets(budgets)
}

impl FathomReading {
    /// The reading of budgets run and their verdicts (any order).
    pub fn from_budgets(mut budgets: Vec<(f32, Verdict)>) -> Self {
        budgets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut at_parity_from = None;
        for &(b, v) in budgets.iter().rev() {
            if v != Verdict::AtParity {
                break;
            }
            at_parity_from = Some(b);
        }
        FathomReading {
            at_parity_from,
            below: budgets
                .iter()
                .filter(|(_, v)| *v == Verdict::Below)
                .map(|(b, _)| *b)
                .collect(),
            budgets,
        }
    }
}
