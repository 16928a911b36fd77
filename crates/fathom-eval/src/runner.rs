//! What the two downstream runs share ([`crate::ruler::run`], [`crate::agent::run`];
//! docs/SPEC.md §7): the model and methods a run branches over ([`Branching`]), the batched
//! backend a run may hand every branch to instead ([`BatchedBackend`]: in `fathom-cli` the
//! GPU's, which this crate does not depend on), row-cache tallies ([`RowCacheTally`], fathom-bench's) and progress
//! reports ([`Progress`]).
//!
//! Without a backend, each sample (session) has one dense prefill on the CPU and one branch per
//! method decoded from a clone of it ([`crate::decode`]). With one, the backend prefills every
//! prompt and decodes each method's branches of many prompts in one batch; the run scores them
//! exactly as it scores its own.

use fathom_model::Model;
use fathom_plan::scanner::Scanner;
use fathom_plan::SelectParams;

use crate::decode::{loki_r, Branch, LayerCalib, Prefill};
use crate::EvalError;
use fathom_bench::decode::RowCacheTally;

/// An error of a [`BatchedBackend`] or of a progress callback, kept as the caller's own.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What a run decodes with: the model, the methods (every result lists them in this order),
/// the calibration the methods read (σ², KLT, Loki's basis, DS channels per global layer and
/// KV head; `None` when no method needs one) and the selection rule (sink + local + top-k per
/// query head).
#[derive(Clone, Copy)]
pub struct Branching<'a> {
    /// The model.
    pub model: &'a Model,
    /// The methods; `exact` must be among them (and for [`crate::agent::run`], `dense`).
    pub methods: &'a [Box<dyn Scanner>],
    /// Their calibration.
    pub calib: Option<&'a LayerCalib>,
    /// Sink, local window and top-k.
    pub params: SelectParams,
}

impl std::fmt::Debug for Branching<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Branching")
            .field("methods", &self.names())
            .field("calibrated", &self.calib.is_some())
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

impl Branching<'_> {
    /// The methods' names, in order.
    pub fn names(&self) -> Vec<String> {
        self.methods.iter().map(|m| m.name()).collect()
    }

    /// The index of method `name`.
    pub(crate) fn index(&self, name: &str) -> Result<usize, EvalError> {
        self.methods
            .iter()
            .position(|m| m.name() == name)
            .ok_or_else(|| EvalError::Invalid(format!("the methods must include {name}")))
    }

    /// Per method, its branch and seconds for one prompt, and the prefill's seconds: taken from
    /// a backend's batch (`batched`: the prefill's seconds and `[method]`), else decoded here
    /// from one dense prefill of `prompt` (room for `extra` tokens) by `branch`. Before each
    /// branch decoded here the progress message is `message(method)`, after it one branch is
    /// reported done; a failed branch names itself with `context(method)`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn per_method<R>(
        &self,
        prompt: &[u32],
        extra: usize,
        batched: Option<(f64, &[(Branch, f64)])>,
        progress: &mut OnProgress<'_, R>,
        message: &dyn Fn(&str) -> String,
        context: &dyn Fn(&str) -> String,
        branch: &dyn Fn(&Prefill, &dyn Scanner) -> Result<Branch, EvalError>,
    ) -> Result<(Vec<(Branch, f64)>, f64), EvalError> {
        if let Some((prefill_s, per)) = batched {
            return Ok((per.to_vec(), prefill_s));
        }
        let t0 = std::time::Instant::now();
        let with_loki = self.methods.iter().any(|m| loki_r(m.as_ref()).is_some());
        let pre = Prefill::new(self.model, prompt, extra, self.calib, with_loki)?;
        let prefill_s = t0.elapsed().as_secs_f64();
        let mut out = Vec::with_capacity(self.methods.len());
        for m in self.methods {
            let tm = std::time::Instant::now();
            report(progress, Progress::Working(message(&m.name())))?;
            let br = branch(&pre, m.as_ref()).map_err(|e| EvalError::In {
                what: context(&m.name()),
                source: Box::new(e),
            })?;
            report(progress, Progress::Branches(1))?;
            out.push((br, tm.elapsed().as_secs_f64()));
        }
        Ok((out, prefill_s))
    }
}

/// Branches a [`BatchedBackend`] decoded for a list of prompts.
#[derive(Debug, Clone, Default)]
pub struct Batched {
    /// Per prompt, the seconds of its dense prefill.
    pub prefill_seconds: Vec<f64>,
    /// `[prompt][method]`: the method's branch from that prompt and its seconds (a batch's
    /// time may be shared equally among its branches).
    pub branches: Vec<Vec<(Branch, f64)>>,
}

/// A backend that decodes every method's branches of many prompts in batches (`fathom-cli`'s
/// GPU evaluation). It was built for the run's methods, in the run's order, with the run's
/// selection rule and calibration; each call prefills every prompt itself.
pub trait BatchedBackend {
    /// Where the branches run, for progress and error messages (`GPU`).
    fn name(&self) -> &str;

    /// Per prompt, its dense prefill and each method's greedy branch from it: up to `max_new`
    /// tokens, ending after a token of `stop_tokens` or when `stop(&generated)` says so, as
    /// [`crate::decode::decode_branch`] does.
    fn greedy(
        &mut self,
        prompts: &[&[u32]],
        max_new: usize,
        stop_tokens: &[u32],
        stop: &dyn Fn(&[u32]) -> bool,
    ) -> Result<Batched, BoxError>;

    /// As [`BatchedBackend::greedy`], teacher-forced on `forced[i]` after prompt `i`, as
    /// [`crate::decode::forced_branch`] is.
    fn forced(&mut self, prompts: &[&[u32]], forced: &[&[u32]]) -> Result<Batched, BoxError>;

    /// Adds each method's row-cache counters since the last call to `rows[method]` (none for a
    /// method that fetched no union, or without a row cache), and starts counting afresh. A
    /// backend counts per method batch; its branches' own [`crate::decode::BranchStats`] carry no row counts.
    fn add_row_counters(&mut self, rows: &mut [Vec<RowCacheTally>]);
}

/// A run's progress, reported as it goes.
#[derive(Debug)]
pub enum Progress<'a, R> {
    /// Work on this starts (a progress bar's message).
    Working(String),
    /// This many more branches are done (of samples × methods in all).
    Branches(u64),
    /// A sample (session) is done: its record, as the run's results will hold it.
    Done(&'a R),
}

/// A progress callback; its error stops the run and comes back as [`EvalError::Caller`].
pub type OnProgress<'a, R> = dyn FnMut(Progress<'_, R>) -> Result<(), BoxError> + 'a;

/// Reports `p`.
pub(crate) fn report<R>(
    progress: &mut OnProgress<'_, R>,
    p: Progress<'_, R>,
) -> Result<(), EvalError> {
    progress(p).map_err(EvalError::Caller)
}
