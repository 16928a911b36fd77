//! `fathom-eval`: downstream evaluation of sparse decoding (docs/SPEC.md §7).
//!
//! * [`decode`]: a [`fathom_model::DecodeAttention`] that runs any
//!   [`Scanner`](fathom_plan::scanner::Scanner) through the shared selection protocol (sink 4 +
//!   local 32 + top-k per query head, exact attention) on **every generated token** of every
//!   global layer, and greedy decoding branched per method from one dense prefill;
//! * [`ruler`]: RULER-style tasks (`niah_single`, `niah_multikey`, `niah_multivalue`,
//!   `niah_multiquery`, `vt`, `fwe`) over real-text haystacks, and their scoring;
//! * [`agent`]: agent-transcript coding contexts for teacher-forced step agreement;
//! * [`words`]: the English word list the needle keys come from;
//! * [`ruler::run`] and [`agent::run`]: whole runs (`fathom ruler`, `fathom agent-steps`):
//!   per sample every method's branch, scored against the gold strings or the true
//!   continuation and compared with exact top-k's, with per-task (per-method) summaries and
//!   row-cache tallies; on the CPU, or through a [`runner::BatchedBackend`] (the GPU's);
//! * [`runner`]: what those runs share.
//!
//! ```no_run
//! use fathom_eval::{decode::{decode_branch, Prefill}, ruler::{generate, Task, TaskParams}};
//! # fn run(model: &fathom_model::Model, haystack: &fathom_eval::ruler::Haystack,
//! #        words: &fathom_eval::words::WordList) -> Result<(), fathom_eval::EvalError> {
//! let sample = generate(Task::NiahSingle, &TaskParams::new(4096), model.tokenizer(), haystack, words, 7)?;
//! let pre = Prefill::new(model, &sample.prompt_ids, sample.max_new, None, false)?;
//! let exact = fathom_baselines::Exact;
//! let params = fathom_plan::SelectParams { sink: 4, local: 32, k: 128 };
//! let out = decode_branch(model, &pre, &exact, None, params, sample.max_new, &|_| false)?;
//! let text = model.tokenizer().decode(&out.tokens)?;
//! println!("{text}: score {}", fathom_eval::ruler::score(&text, &sample.gold));
//! # Ok(()) }
//! ```
//!
//! **Architecture invariant:** this crate drives the model only through its public decode API
//! (`Model::prefill`, `Model::decode_step` with a `DecodeAttention`, `KvCache::clone`); every
//! method's scores come from its own `Scanner`, and selection and attention are `fathom-plan`'s.
#![deny(missing_docs)]

pub mod agent;
pub mod decode;
pub mod ruler;
pub mod runner;
pub mod words;

/// Errors of the evaluation.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The model runtime failed.
    #[error(transparent)]
    Model(#[from] fathom_model::Error),
    /// A scanner failed.
    #[error(transparent)]
    Scanner(#[from] fathom_plan::scanner::ScannerError),
    /// Selection or attention failed.
    #[error(transparent)]
    Plan(#[from] fathom_plan::PlanError),
    /// A key store failed.
    #[error(transparent)]
    Store(#[from] fathom_store::StoreError),
    /// A sparse decode step failed (the method and layer named).
    #[error(transparent)]
    Decode(#[from] fathom_bench::fidelity::FidelityError),
    /// Reading the word list failed.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Bad input (too short a context, an empty corpus, …).
    #[error("{0}")]
    Invalid(String),
    /// A batched backend or a progress callback failed ([`runner`]): its own error.
    #[error(transparent)]
    Caller(runner::BoxError),
    /// Work on one sample, method or batch of a run failed; `what` names it.
    #[error("{what}")]
    In {
        /// What failed (`niah_single sample 3, method sparq:32`).
        what: String,
        /// The cause.
        #[source]
        source: runner::BoxError,
    },
}
