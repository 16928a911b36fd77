//! The downstream documents (docs/SPEC.md §7): `ruler` (RULER-style tasks, greedy generation
//! scored against gold strings) and `agent-steps` (teacher-forced step agreement on real code).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The selection parameters of docs/SPEC.md §5.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectRecord {
    /// Sink tokens.
    pub sink: usize,
    /// Local tokens.
    pub local: usize,
    /// Top-k per query head.
    pub k: usize,
}

/// What the methods that need a calibration were calibrated on (`None`: no method needed one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationInfo {
    /// Corpus (`prose`, `code`).
    pub corpus: String,
    /// Split (`calib`).
    pub split: String,
    /// Tokens of the calibration context.
    pub tokens: usize,
    /// Documents it was cut from.
    pub documents: Vec<String>,
    /// Query positions used.
    pub queries: usize,
    /// Seconds it took.
    pub seconds: f64,
    /// What was computed.
    pub what: String,
}

/// The fields every downstream run records about its model and protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunHeader {
    /// Schema version.
    pub version: u32,
    /// The fathom version that wrote it.
    #[serde(default)]
    pub fathom: String,
    /// The command line.
    pub command: String,
    /// Model name.
    pub model: String,
    /// Model layers.
    pub layers: usize,
    /// Global (full-attention) layers.
    pub global_layers: usize,
    /// Every layer's kind (`global`, `local:W`).
    pub layer_kinds: Vec<String>,
    /// Query heads.
    pub hq: usize,
    /// KV heads.
    pub hkv: usize,
    /// Channels per head.
    pub d: usize,
    /// Context tokens.
    pub context: usize,
    /// Selection.
    pub select: SelectRecord,
    /// Methods, in run order.
    pub methods: Vec<String>,
    /// Seed.
    pub seed: u64,
    /// Where it ran (`cpu (2 threads)`, `NVIDIA H200`).
    pub device: String,
    /// The decoding protocol in words.
    pub protocol: String,
    /// Seconds to load the model.
    pub load_seconds: f64,
    /// The calibration (`None` when no method needed one).
    #[serde(default)]
    pub calibration: Option<CalibrationInfo>,
    /// Total seconds.
    pub seconds: f64,
    /// On the GPU, cuBLAS's math mode (`fathom_gpu::cublas_math`); absent on the CPU and in
    /// older GPU runs, all of which ran `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cublas_math: Option<String>,
}

/// One method's result on one RULER sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RulerGeneration {
    /// The decoded generation.
    pub generation: String,
    /// Fraction of gold strings found.
    pub score: f64,
    /// Tokens generated.
    pub tokens: usize,
    /// Token-identical to exact top-k's generation.
    pub same_as_exact: bool,
    /// First token index where it departs from exact top-k's (`None`: identical).
    pub first_divergence_from_exact: Option<usize>,
    /// Mean scan bits per token per KV head.
    pub mean_bits: f64,
    /// Mean fraction of the context attended.
    pub density: f64,
    /// Seconds.
    pub seconds: f64,
}

/// One RULER sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RulerRecord {
    /// The generator's sample (`fathom_eval::ruler::Sample`: task, prompt tokens, gold, …).
    pub sample: Value,
    /// Seconds of the dense prefill.
    pub prefill_seconds: f64,
    /// Seconds of the whole sample.
    pub seconds: f64,
    /// Per method.
    pub methods: BTreeMap<String, RulerGeneration>,
}

/// One row-cache size's count over a method's decode steps (docs/SPEC.md §6.1, "Row cache"):
/// the union rows its attends fetched and how many a row cache of `slots` slots per (session,
/// layer, KV head) held. Where the counts come from is the document's `row_cache_source`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RowCacheTally {
    /// Slots per (session, layer, KV head).
    pub slots: usize,
    /// Union rows fetched.
    pub rows: u64,
    /// Of those, rows the row cache held.
    pub hits: u64,
    /// `hits / rows` (0 without rows).
    pub hit_rate: f64,
}

impl RowCacheTally {
    /// The tally of `hits` of `rows` at `slots` slots.
    pub fn new(slots: usize, rows: u64, hits: u64) -> Self {
        let hit_rate = if rows == 0 {
            0.0
        } else {
            hits as f64 / rows as f64
        };
        RowCacheTally {
            slots,
            rows,
            hits,
            hit_rate,
        }
    }

    /// Sums tallies per size, in the order sizes first appear (each rate recomputed).
    pub fn sum(parts: impl IntoIterator<Item = RowCacheTally>) -> Vec<RowCacheTally> {
        let mut acc: Vec<RowCacheTally> = Vec::new();
        for t in parts {
            match acc.iter_mut().find(|a| a.slots == t.slots) {
                Some(a) => *a = RowCacheTally::new(a.slots, a.rows + t.rows, a.hits + t.hits),
                None => acc.push(RowCacheTally::new(t.slots, t.rows, t.hits)),
            }
        }
        acc
    }
}

/// What a document's row-cache tallies count: the CPU runtime's branches through
/// `fathom_cuda::cache::RowCacheModel` at each of `fathom_bench::decode::ROW_CACHE_SLOTS`.
pub const ROW_CACHE_MODELLED: &str = "modelled: the CPU reference of the GPU row cache (fathom_cuda::cache::RowCacheModel) over each branch's own unions, its cache empty at the branch's start";

/// What a document's row-cache tallies count on the GPU: the cache's own counters.
pub const ROW_CACHE_MEASURED: &str = "measured: the GPU cache's row counters over each method's batched branches (forks start with an empty row cache)";

/// One method's mean over a task's samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskScore {
    /// Mean score.
    pub score: f64,
    /// Samples whose generation equals exact top-k's.
    pub same_as_exact: usize,
    /// Mean scan bits.
    pub mean_bits: f64,
    /// Row-cache hits over the task's decode steps, per size (absent in earlier files and for
    /// dense).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub row_cache: Vec<RowCacheTally>,
}

/// One task's summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskSummary {
    /// Per method.
    pub methods: BTreeMap<String, TaskScore>,
    /// Seconds spent on the task.
    pub seconds: f64,
}

/// A `fathom ruler` run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RulerDoc {
    /// Model, protocol and timing.
    #[serde(flatten)]
    pub header: RunHeader,
    /// Tasks, in run order.
    pub tasks: Vec<String>,
    /// Samples per task.
    pub samples_per_task: usize,
    /// Generation stops at the end of the answer (and not only at a stop token or after
    /// `max_new` tokens, as RULER's does).
    pub line_stop: bool,
    /// Which end-of-answer rule `line_stop` used: `answer` (the end of the first line for a
    /// task of one gold value, the first blank line for a task of several, which models
    /// answer as a list); absent in earlier files, whose rule was the end of the first line
    /// for every task (it cut a list after its first value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<String>,
    /// The prompt format: `ruler` (RULER's templates verbatim) or `chat` (the model's chat
    /// turn, singular answer prefix for one value); absent in runs before the choice existed
    /// (RULER's).
    #[serde(default)]
    pub prompt: Option<String>,
    /// What each task planted: `ruler`, or the counts that differ from RULER's (files before
    /// this field used RULER's).
    #[serde(default)]
    pub shape: Option<String>,
    /// Whether `vt` opened with RULER's in-context example (`true` by default since it was
    /// added; absent in earlier files, which had none). Only `vt`'s prompts depend on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vt_example: Option<bool>,
    /// `vt`'s haystack: `noise` (RULER's line of noise repeated, the default since it was
    /// added) or `text` (the run's real-text haystack); absent in earlier files, which read the
    /// real-text haystack. Only `vt`'s prompts depend on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vt_haystack: Option<String>,
    /// The NIAH tasks' haystack: `noise` (RULER's line of noise repeated, `--haystack noise`,
    /// the `type_haystack` of RULER's `niah_single_1`) or `text` (the real text, the default);
    /// absent in earlier files, which read the real text. Only the NIAH prompts depend on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub niah_haystack: Option<String>,
    /// The haystack text's source.
    pub haystack: String,
    /// The key word list's source.
    #[serde(default)]
    pub words: Option<String>,
    /// What the summaries' `row_cache` tallies count ([`ROW_CACHE_MODELLED`],
    /// [`ROW_CACHE_MEASURED`]); absent in earlier files, which have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row_cache_source: Option<String>,
    /// The probes that chose this run's task shape and haystack, on seeds this run does not
    /// use (docs/SPEC.md §7: choose on tuning seeds, evaluate on fresh ones); absent where
    /// none was recorded (every file before the field; the evaluation seed is the header's
    /// `seed`, each sample's own seed is in its `sample`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tuning: Option<Tuning>,
    /// Per task.
    pub summary: BTreeMap<String, TaskSummary>,
    /// Per sample.
    pub results: Vec<RulerRecord>,
}

/// The task-shape probes a RULER run was tuned on (docs/SPEC.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tuning {
    /// The probes' base seed (never the run's own `seed`).
    pub seed: u64,
    /// Samples per task of each probe (sample `i` of task `t` drew the seed
    /// `fathom_eval::ruler::sample_seed(seed, t, i)`, `i < samples_per_task`).
    pub samples_per_task: usize,
    /// What the probes chose: the run's `--shape` and `--haystack`.
    pub chose: String,
}

/// One method's result on one agent session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentSteps {
    /// Fraction of steps whose argmax equals exact top-k's.
    pub agree_exact: f64,
    /// Fraction of steps whose argmax equals dense attention's.
    pub agree_dense: f64,
    /// Fraction of steps whose argmax is the true next token.
    pub top1_vs_truth: f64,
    /// Steps whose argmax differs from exact top-k's.
    pub steps_differing_from_exact: Vec<usize>,
    /// The argmax at every step.
    pub argmax: Vec<u32>,
    /// Mean scan bits.
    pub mean_bits: f64,
    /// Mean fraction of the context attended.
    pub density: f64,
    /// Seconds.
    pub seconds: f64,
}

/// One agent session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRecord {
    /// The session builder's record (`fathom_eval::agent::Session`: files, prompt tokens, …).
    pub session: Value,
    /// The teacher-forced continuation's token ids.
    pub continuation: Vec<u32>,
    /// Seconds of the dense prefill.
    pub prefill_seconds: f64,
    /// Seconds of the whole session.
    pub seconds: f64,
    /// Per method.
    pub methods: BTreeMap<String, AgentSteps>,
}

/// One method's means over sessions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentSummary {
    /// Mean agreement with exact top-k.
    pub agree_exact: f64,
    /// Mean agreement with dense.
    pub agree_dense: f64,
    /// Mean top-1 accuracy against the true continuation.
    pub top1_vs_truth: f64,
    /// Mean scan bits.
    pub mean_bits: f64,
    /// Row-cache hits over every session's steps, per size (absent in earlier files and for
    /// dense).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub row_cache: Vec<RowCacheTally>,
}

/// A `fathom agent-steps` run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentDoc {
    /// Model, protocol and timing.
    #[serde(flatten)]
    pub header: RunHeader,
    /// Sessions.
    pub sessions: usize,
    /// Teacher-forced steps per session.
    pub steps: usize,
    /// The code text's source (absent in runs made on the earlier Debian corpus).
    #[serde(default)]
    pub code: Option<String>,
    /// What the summaries' `row_cache` tallies count; absent in earlier files, which have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row_cache_source: Option<String>,
    /// Per method.
    pub summary: BTreeMap<String, AgentSummary>,
    /// Per session.
    pub results: Vec<AgentRecord>,
}

#[cfg(test)]
mod tests {
    use super::RowCacheTally;

    /// Tallies sum per size in first-seen order, and the rate is hits over rows (0 without).
    #[test]
    fn row_cache_tallies_sum_per_size() {
        let t = RowCacheTally::sum(
            [(64, 10, 2), (8192, 10, 7), (64, 30, 6), (8192, 0, 0)]
                .map(|(c, r, h)| RowCacheTally::new(c, r, h)),
        );
        assert_eq!(
            t,
            vec![
                RowCacheTally::new(64, 40, 8),
                RowCacheTally::new(8192, 10, 7)
            ]
        );
        assert_eq!(t[0].hit_rate, 0.2);
        assert_eq!(RowCacheTally::new(1, 0, 0).hit_rate, 0.0);
        assert!(RowCacheTally::sum([]).is_empty());
    }
}
