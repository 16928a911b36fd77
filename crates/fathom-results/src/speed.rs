//! The `model-speed` document: the CPU model runtime's prefill and decode throughput beside
//! llama.cpp on the same token ids.

use serde::{Deserialize, Serialize};

/// One engine's throughput at one context.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Throughput {
    /// Prompt tokens per second.
    pub prefill_tok_s: f64,
    /// Seconds of the prefill.
    pub prefill_s: f64,
    /// Generated tokens per second.
    pub decode_tok_s: f64,
    /// Decode steps timed.
    pub decode_steps: usize,
    /// Prompt tokens as the engine counted them (llama.cpp reports it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<usize>,
}

/// One context.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpeedRun {
    /// Prompt tokens.
    pub context: usize,
    /// `fathom-model`'s runtime.
    pub fathom_model: Throughput,
    /// llama.cpp (`xllamacpp`); `None` when it was skipped or failed.
    pub llama_cpp: Option<Throughput>,
    /// Why llama.cpp has no numbers.
    #[serde(default)]
    pub llama_cpp_error: Option<String>,
}

/// A `fathom speed` run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpeed {
    /// Schema version.
    pub version: u32,
    /// The fathom version that wrote it.
    #[serde(default)]
    pub fathom: String,
    /// The command line.
    pub command: String,
    /// Model name.
    pub model: String,
    /// CPU model name.
    pub cpu: String,
    /// Cores available.
    pub cores: usize,
    /// Threads llama.cpp was given.
    pub llama_threads: usize,
    /// Where the prompt tokens came from.
    pub text: String,
    /// Per context.
    pub runs: Vec<SpeedRun>,
}

impl SpeedRun {
    /// Decode throughput over llama.cpp's, when both exist.
    pub fn decode_ratio(&self) -> Option<f64> {
        let l = self.llama_cpp.as_ref()?;
        (l.decode_tok_s > 0.0).then(|| self.fathom_model.decode_tok_s / l.decode_tok_s)
    }
}
