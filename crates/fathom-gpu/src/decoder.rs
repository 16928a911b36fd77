//! The one interface of the GPU decoder, implemented by the real backend and by the stub of a
//! build without the `cuda` feature (so the compiler checks the stub).

use fathom_cuda::cache::AttendMethod;
use fathom_cuda::pages::SessionId;
use fathom_plan::SelectParams;

use crate::error::Result;

/// How a decode step's global layers attend: a method of the grammar (or dense) and the
/// selection's sink, local and top-k.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attention {
    /// The method.
    pub method: AttendMethod,
    /// Sink, local and k.
    pub params: SelectParams,
}

/// Sessions of one model decoding on a device.
pub trait Decoder {
    /// A new, empty session.
    fn create(&mut self) -> Result<SessionId>;
    /// A session sharing every token of `parent` (copy-on-write pages).
    fn fork(&mut self, parent: SessionId) -> Result<SessionId>;
    /// Frees a session.
    fn free(&mut self, session: SessionId) -> Result<()>;
    /// Tokens in a session.
    fn len(&self, session: SessionId) -> Result<usize>;
    /// Shortens a session to its first `len` tokens (a rejected speculative draft, a rolled
    /// back step), in every layer; the next token goes at position `len`.
    fn truncate(&mut self, session: SessionId, len: usize) -> Result<()>;
    /// Appends `tokens` to a session with dense causal attention, in chunks; returns the
    /// last token's logits `[vocab]`.
    fn prefill(&mut self, session: SessionId, tokens: &[u32]) -> Result<Vec<f32>>;
    /// One decode step: appends one token to each session of `batch` and returns the
    /// logits `[batch][vocab]`; global layers attend through the cache with `attention`,
    /// sliding-window layers densely over their window.
    fn decode(&mut self, batch: &[(SessionId, u32)], attention: &Attention) -> Result<Vec<f32>>;
}

/// Where instrumented decode steps spent their GPU time (ms summed over the steps, CUDA
/// events; the events themselves add a little to each step).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimes {
    /// Instrumented steps.
    pub steps: usize,
    /// Whole steps.
    pub total_ms: f64,
    /// The global layers' attends and the sliding layers' window attention.
    pub attention_ms: f64,
    /// The K/V appends.
    pub appends_ms: f64,
    /// The final norm, LM head and greedy sampling.
    pub sampling_ms: f64,
    /// The rest: embeddings, norms, QK-norm and RoPE, every other matmul (the weights' share).
    pub weights_ms: f64,
    /// The cache's attends (part of `attention_ms`) by stage
    /// (`CacheOptions::stage_timing`, `DecoderConfig::options`), summed over the steps.
    pub attend: fathom_cuda::cache::AttendStages,
}
