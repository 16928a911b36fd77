//! A whole RULER-style run ([`run`]): `fathom ruler`'s orchestration, as a library function.

use std::time::Instant;

use super::{answer_ended, generate, score, Haystack, Sample, Task, TaskParams};
use crate::decode::decode_branch;
use crate::runner::{report, BatchedBackend, Branching, OnProgress, Progress};
use crate::words::WordList;
use crate::EvalError;
use fathom_bench::decode::RowCacheTally;
use fathom_results::downstream::RulerGeneration;

/// What a RULER-style run generates and how its branches stop.
#[derive(Debug, Clone, Copy)]
pub struct RulerPlan<'a> {
    /// The tasks, in run order.
    pub tasks: &'a [Task],
    /// Samples per task (drawn by [`generate`] with indices `0..samples`).
    pub samples: usize,
    /// Context, seed, prompt format, shape and haystacks of every sample.
    pub params: &'a TaskParams,
    /// The real-text haystack.
    pub haystack: &'a Haystack,
    /// The word list keys come from.
    pub words: &'a WordList,
    /// Stop each branch at the end of its answer ([`answer_ended`], a task of several gold
    /// values at a blank line); otherwise only at a stop token or after the sample's `max_new`
    /// tokens (RULER's rule).
    pub line_stop: bool,
}

/// One method's generation for one sample: the method and its result, the results
/// document's own type ([`RulerGeneration`]: generation, [`score`] against the gold strings,
/// tokens, agreement with exact top-k, bits, density, seconds).
#[derive(Debug, Clone, PartialEq)]
pub struct MethodGeneration {
    /// The method.
    pub method: String,
    /// What it generated and how it scored.
    pub result: RulerGeneration,
}

/// One sample's results.
#[derive(Debug, Clone)]
pub struct SampleRun {
    /// The sample.
    pub sample: Sample,
    /// Seconds of its dense prefill.
    pub prefill_seconds: f64,
    /// Seconds of the whole sample (prefill, branches and scoring; with a batched backend the
    /// prefill's and the branches' shares).
    pub seconds: f64,
    /// Per method, in the run's order.
    pub methods: Vec<MethodGeneration>,
}

/// One method's results over a task's samples.
#[derive(Debug, Clone, PartialEq)]
pub struct MethodScore {
    /// The method.
    pub method: String,
    /// Σ score over the samples.
    pub score_sum: f64,
    /// Mean score (`score_sum / samples`).
    pub score: f64,
    /// Samples whose generation equals exact top-k's.
    pub same_as_exact: usize,
    /// Mean scan bits over the samples.
    pub mean_bits: f64,
    /// Row-cache tallies over the task's branches, per size ([`RowCacheTally::sum`]; empty for
    /// dense, and with a backend that counts none).
    pub row_cache: Vec<RowCacheTally>,
}

/// One task's summary.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRun {
    /// The task.
    pub task: Task,
    /// Per method, in the run's order.
    pub methods: Vec<MethodScore>,
    /// Seconds of its samples (Σ [`SampleRun::seconds`]).
    pub seconds: f64,
}

/// A RULER-style run's results: every sample's record and each task's summary.
#[derive(Debug, Clone)]
pub struct RulerRun {
    /// Samples per task.
    pub samples_per_task: usize,
    /// Per sample, task by task.
    pub records: Vec<SampleRun>,
    /// Per task, in run order.
    pub tasks: Vec<TaskRun>,
}

impl RulerRun {
    /// Method `method`'s mean score over every task's samples.
    pub fn mean_score(&self, method: usize) -> f64 {
        let n = self.samples_per_task as f64;
        self.tasks
            .iter()
            .map(|t| t.methods[method].score_sum)
            .sum::<f64>()
            / (n * self.tasks.len() as f64)
    }

    /// Method `method`'s row-cache tallies over every task, per size.
    pub fn row_cache(&self, method: usize) -> Vec<RowCacheTally> {
        RowCacheTally::sum(
            self.tasks
                .iter()
                .flat_map(|t| t.methods[method].row_cache.iter().copied()),
        )
    }
}

/// Runs RULER-style tasks with branched sparse decoding (docs/SPEC.md §7): per task
/// `plan.samples` samples ([`generate`]); per sample one dense prefill and per method a greedy
/// branch ([`decode_branch`]), or with `backend` every sample's branches batched there; each
/// generation decoded, scored against the gold strings ([`score`]) and compared with exact
/// top-k's tokens. Progress: a message before each branch decoded here (`niah_single #3
/// sparq:32`) or each task's batch, branches done (tasks × samples × methods in all) and each
/// sample's record.
pub fn run(
    b: Branching<'_>,
    plan: &RulerPlan<'_>,
    mut backend: Option<&mut dyn BatchedBackend>,
    progress: &mut OnProgress<'_, SampleRun>,
) -> Result<RulerRun, EvalError> {
    if plan.tasks.is_empty() || plan.samples == 0 {
        return Err(EvalError::Invalid(
            "nothing to run: no tasks or no samples".into(),
        ));
    }
    let tok = b.model.tokenizer();
    let nm = b.methods.len();
    let names = b.names();
    let exact_i = b.index("exact")?;
    let mut records = Vec::new();
    // sums[task][method] = (score, agree-with-exact text, bits)
    let mut sums = vec![vec![(0f64, 0usize, 0f64); nm]; plan.tasks.len()];
    // rows[task][method]: the row-cache tallies of its branches.
    let mut rows = vec![vec![Vec::new(); nm]; plan.tasks.len()];
    let mut per_task_secs = vec![0f64; plan.tasks.len()];
    for (ti, &task) in plan.tasks.iter().enumerate() {
        let samples = (0..plan.samples)
            .map(|i| generate(task, plan.params, tok, plan.haystack, plan.words, i))
            .collect::<Result<Vec<_>, _>>()?;
        let several = samples.first().is_some_and(|x| x.gold.len() > 1);
        let stop = |ids: &[u32]| {
            plan.line_stop && tok.decode(ids).is_ok_and(|t| answer_ended(&t, several))
        };
        // With a backend every sample's prefill first, then each method's branches of a group
        // of samples in one batch.
        let batched = match backend.as_mut() {
            None => None,
            Some(g) => {
                report(
                    progress,
                    Progress::Working(format!("{} ({}, batched)", task.name(), g.name())),
                )?;
                let prompts: Vec<&[u32]> = samples.iter().map(|x| &x.prompt_ids[..]).collect();
                let max_new = samples.iter().map(|x| x.max_new).max().unwrap_or(1);
                let r = g
                    .greedy(&prompts, max_new, tok.stop_tokens(), &stop)
                    .map_err(|e| EvalError::In {
                        what: format!("{} on the {}", task.name(), g.name()),
                        source: e,
                    })?;
                g.add_row_counters(&mut rows[ti]);
                report(progress, Progress::Branches((samples.len() * nm) as u64))?;
                Some(r)
            }
        };
        for (i, sample) in samples.into_iter().enumerate() {
            let t0 = Instant::now();
            let (branches, prefill_s) = b.per_method(
                &sample.prompt_ids,
                sample.max_new,
                batched
                    .as_ref()
                    .map(|r| (r.prefill_seconds[i], &r.branches[i][..])),
                progress,
                &|m| format!("{} #{i} {m}", task.name()),
                &|m| format!("{} sample {i}, method {m}", task.name()),
                &|pre, m| decode_branch(b.model, pre, m, b.calib, b.params, sample.max_new, &stop),
            )?;
            let exact_tokens = &branches[exact_i].0.tokens;
            let mut methods = Vec::with_capacity(nm);
            for (mi, (br, secs)) in branches.iter().enumerate() {
                let text = tok.decode(&br.tokens)?;
                let sc = score(&text, &sample.gold);
                let same = br.tokens == *exact_tokens;
                let diverge = br
                    .tokens
                    .iter()
                    .zip(exact_tokens)
                    .position(|(x, y)| x != y)
                    .or_else(|| {
                        (br.tokens.len() != exact_tokens.len())
                            .then(|| br.tokens.len().min(exact_tokens.len()))
                    });
                sums[ti][mi].0 += sc;
                sums[ti][mi].1 += same as usize;
                sums[ti][mi].2 += br.stats.mean_bits();
                rows[ti][mi].extend(br.stats.row_cache());
                methods.push(MethodGeneration {
                    method: names[mi].clone(),
                    result: RulerGeneration {
                        generation: text,
                        score: sc,
                        tokens: br.tokens.len(),
                        same_as_exact: same,
                        first_divergence_from_exact: diverge,
                        mean_bits: br.stats.mean_bits(),
                        density: br.stats.density(),
                        seconds: *secs,
                    },
                });
            }
            let secs = match &batched {
                Some(_) => prefill_s + methods.iter().map(|m| m.result.seconds).sum::<f64>(),
                None => t0.elapsed().as_secs_f64(),
            };
            per_task_secs[ti] += secs;
            records.push(SampleRun {
                sample,
                prefill_seconds: prefill_s,
                seconds: secs,
                methods,
            });
            report(progress, Progress::Done(&records[records.len() - 1]))?;
        }
    }
    let n = plan.samples as f64;
    let tasks = plan
        .tasks
        .iter()
        .enumerate()
        .map(|(ti, &task)| TaskRun {
            task,
            methods: names
                .iter()
                .enumerate()
                .map(|(mi, m)| {
                    let (sc, same, bits) = sums[ti][mi];
                    MethodScore {
                        method: m.clone(),
                        score_sum: sc,
                        score: sc / n,
                        same_as_exact: same,
                        mean_bits: bits / n,
                        row_cache: RowCacheTally::sum(rows[ti][mi].iter().copied()),
                    }
                })
                .collect(),
            seconds: per_task_secs[ti],
        })
        .collect();
    Ok(RulerRun {
        samples_per_task: plan.samples,
        records,
        tasks,
    })
}
