//! A whole agent-session run ([`run`]): `fathom agent-steps`' orchestration, as a library
//! function.

use std::time::Instant;

use fathom_model::corpus::Document;

use super::{agreement, session, Session};
use crate::decode::forced_branch;
use crate::runner::{report, BatchedBackend, Branching, OnProgress, Progress};
use crate::EvalError;
use fathom_bench::decode::RowCacheTally;
use fathom_results::downstream::AgentSteps;

/// Which sessions an agent-session run builds ([`session`]).
#[derive(Debug, Clone, Copy)]
pub struct AgentPlan<'a> {
    /// The code documents sessions read.
    pub docs: &'a [Document],
    /// Session length in tokens (prompt + steps).
    pub context: usize,
    /// Teacher-forced steps per session.
    pub steps: usize,
    /// Base seed.
    pub seed: u64,
    /// Sessions (indices `0..sessions`).
    pub sessions: usize,
}

/// One method's agreement over one session: the method and its result, the results
/// document's own type ([`AgentSteps`]: agreement with exact top-k, dense and the truth
/// ([`agreement`]), the steps that differ from exact's, the argmax after each forced token,
/// bits, density, seconds).
#[derive(Debug, Clone, PartialEq)]
pub struct StepAgreement {
    /// The method.
    pub method: String,
    /// Its agreement and statistics.
    pub result: AgentSteps,
}

/// One session's results.
#[derive(Debug, Clone)]
pub struct SessionRun {
    /// The session.
    pub session: Session,
    /// Seconds of its dense prefill.
    pub prefill_seconds: f64,
    /// Seconds of the whole session (with a batched backend: the prefill's and the branches'
    /// shares).
    pub seconds: f64,
    /// Per method, in the run's order.
    pub methods: Vec<StepAgreement>,
}

/// One method's means over the sessions.
#[derive(Debug, Clone, PartialEq)]
pub struct MethodAgreement {
    /// The method.
    pub method: String,
    /// Mean agreement with exact top-k.
    pub agree_exact: f64,
    /// Mean agreement with dense.
    pub agree_dense: f64,
    /// Mean top-1 agreement with the true continuation.
    pub top1_vs_truth: f64,
    /// Mean scan bits.
    pub mean_bits: f64,
    /// Row-cache tallies over every session's branch, per size ([`RowCacheTally::sum`]; empty for
    /// dense, and with a backend that counts none).
    pub row_cache: Vec<RowCacheTally>,
}

/// An agent-session run's results.
#[derive(Debug, Clone)]
pub struct AgentRun {
    /// Per session.
    pub records: Vec<SessionRun>,
    /// Per method, in the run's order.
    pub summary: Vec<MethodAgreement>,
}

/// Runs teacher-forced step agreement on agent sessions (docs/SPEC.md §7): `plan.sessions`
/// sessions ([`session`]); per session one dense prefill and per method a teacher-forced branch
/// over the true continuation ([`forced_branch`]), or with `backend` every session's branches
/// batched there; each method's argmax per step compared with exact top-k's, dense's and the
/// truth ([`agreement`]). `b.methods` must include `exact` and `dense`. Progress: a message
/// before each branch decoded here (`session 3 sparq:32`) or the batch, branches done
/// (sessions × methods in all) and each session's record.
pub fn run(
    b: Branching<'_>,
    plan: &AgentPlan<'_>,
    mut backend: Option<&mut dyn BatchedBackend>,
    progress: &mut OnProgress<'_, SessionRun>,
) -> Result<AgentRun, EvalError> {
    if plan.sessions == 0 || plan.steps == 0 {
        return Err(EvalError::Invalid(
            "nothing to run: no sessions or no steps".into(),
        ));
    }
    let tok = b.model.tokenizer();
    let nm = b.methods.len();
    let names = b.names();
    let exact_i = b.index("exact")?;
    let dense_i = b.index("dense")?;
    let mut records = Vec::new();
    let mut sums = vec![(0f64, 0f64, 0f64, 0f64); nm];
    // rows[method]: the row-cache tallies of its branches.
    let mut rows = vec![Vec::new(); nm];
    let all = (0..plan.sessions)
        .map(|i| session(plan.docs, tok, plan.context, plan.steps, plan.seed, i))
        .collect::<Result<Vec<_>, _>>()?;
    let batched = match backend.as_mut() {
        None => None,
        Some(g) => {
            report(
                progress,
                Progress::Working(format!("sessions ({}, batched)", g.name())),
            )?;
            let prompts: Vec<&[u32]> = all.iter().map(|x| &x.prompt_ids[..]).collect();
            let forced: Vec<&[u32]> = all.iter().map(|x| &x.continuation[..]).collect();
            let r = g.forced(&prompts, &forced).map_err(EvalError::Caller)?;
            g.add_row_counters(&mut rows);
            report(progress, Progress::Branches((all.len() * nm) as u64))?;
            Some(r)
        }
    };
    for (i, ses) in all.into_iter().enumerate() {
        let t0 = Instant::now();
        let (preds, prefill_s) = b.per_method(
            &ses.prompt_ids,
            plan.steps,
            batched
                .as_ref()
                .map(|r| (r.prefill_seconds[i], &r.branches[i][..])),
            progress,
            &|m| format!("session {i} {m}"),
            &|m| format!("session {i}, method {m}"),
            &|pre, m| forced_branch(b.model, pre, m, b.calib, b.params, &ses.continuation),
        )?;
        let truth = &ses.continuation[1..];
        let mut methods = Vec::with_capacity(nm);
        for (mi, (br, secs)) in preds.iter().enumerate() {
            let ae = agreement(&br.tokens, &preds[exact_i].0.tokens);
            let ad = agreement(&br.tokens, &preds[dense_i].0.tokens);
            let top1 = agreement(&br.tokens[..truth.len()], truth);
            let differ: Vec<usize> = br
                .tokens
                .iter()
                .zip(&preds[exact_i].0.tokens)
                .enumerate()
                .filter(|(_, (x, y))| x != y)
                .map(|(j, _)| j)
                .collect();
            sums[mi].0 += ae;
            sums[mi].1 += ad;
            sums[mi].2 += top1;
            sums[mi].3 += br.stats.mean_bits();
            rows[mi].extend(br.stats.row_cache());
            methods.push(StepAgreement {
                method: names[mi].clone(),
                result: AgentSteps {
                    agree_exact: ae,
                    agree_dense: ad,
                    top1_vs_truth: top1,
                    steps_differing_from_exact: differ,
                    argmax: br.tokens.clone(),
                    mean_bits: br.stats.mean_bits(),
                    density: br.stats.density(),
                    seconds: *secs,
                },
            });
        }
        let secs = match &batched {
            Some(_) => prefill_s + preds.iter().map(|p| p.1).sum::<f64>(),
            None => t0.elapsed().as_secs_f64(),
        };
        records.push(SessionRun {
            session: ses,
            prefill_seconds: prefill_s,
            seconds: secs,
            methods,
        });
        report(progress, Progress::Done(&records[records.len() - 1]))?;
    }
    let n = plan.sessions as f64;
    let summary = names
        .iter()
        .enumerate()
        .map(|(mi, m)| {
            let (ae, ad, t1, bits) = sums[mi];
            MethodAgreement {
                method: m.clone(),
                agree_exact: ae / n,
                agree_dense: ad / n,
                top1_vs_truth: t1 / n,
                mean_bits: bits / n,
                row_cache: RowCacheTally::sum(rows[mi].iter().copied()),
            }
        })
        .collect();
    Ok(AgentRun { records, summary })
}
