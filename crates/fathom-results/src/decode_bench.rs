//! The `decode-bench` document: end-to-end decode throughput of a real model on the GPU for a
//! batch of sessions whose K|V live in the offloaded paged cache (docs/SPEC.md §9), one entry
//! per method and batch size.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One method at one batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeBenchEntry {
    /// The method (`dense`, `exact`, `fathom:48`, …).
    pub method: String,
    /// Sessions decoding together.
    pub batch: usize,
    /// Each session's context at the first timed step.
    pub contexts: Vec<usize>,
    /// Aggregate generated tokens per second (`batch · steps / Σ step seconds`).
    pub tokens_per_s: f64,
    /// Tokens per second of one session (`steps / Σ step seconds`).
    pub per_session_tokens_per_s: f64,
    /// Step latency, median (ms, host wall clock around one whole step: forward, appends,
    /// attention, sampling and the copy of the sampled ids).
    pub step_ms_p50: f64,
    /// Step latency, 99th percentile (ms).
    pub step_ms_p99: f64,
    /// Mean scan bits per token and KV head of the GPU-planned methods' plans (0 otherwise).
    pub plan_bits: f64,
    /// Bytes per step that cross the link: the scans' planned bits of every key of every
    /// global layer and KV head, plus the K|V records fetched (row-cache misses); for dense
    /// every record of every global layer; 0 with the pages in HBM.
    pub pcie_bytes_per_step: f64,
    /// `pcie_bytes_per_step` at the measured host-to-device rate (ms).
    pub link_floor_ms: f64,
    /// Union rows per step and the share the HBM row cache served.
    pub rows_per_step: f64,
    /// Row-cache hit rate.
    pub row_hit_rate: f64,
    /// Where the GPU time of a few instrumented steps went (CUDA events; not the timed steps).
    #[serde(default)]
    pub split: Option<StageSplit>,
    /// Whether the timed steps replayed the whole step as one CUDA graph (`--graph`); the
    /// split's steps are never graphs (absent in older runs: false).
    #[serde(default)]
    pub graph: bool,
    /// With the host gather on: the mean microseconds from a request (one attend's misses of
    /// the host's share) to its last chunk's mark, over this entry's steps (absent otherwise
    /// and in older runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_gather_request_us: Option<f64>,
    /// With the host gather on: records one host thread copied per second of copying
    /// (millions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_gather_mrows_per_thread_s: Option<f64>,
}

/// Mean GPU milliseconds per instrumented step, by stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageSplit {
    /// Instrumented steps averaged.
    pub steps: usize,
    /// Whole step.
    pub total_ms: f64,
    /// Embeddings, norms, QK-norm and RoPE and every matmul but the LM head (the weights).
    pub weights_ms: f64,
    /// Attention (the cache's attends; sliding layers' windows).
    pub attention_ms: f64,
    /// K/V appends.
    pub appends_ms: f64,
    /// Final norm, LM head and greedy sampling.
    pub sampling_ms: f64,
    /// The cache's attends (the global layers' attention) by stage, ms per step:
    /// `plan`, `scan`, `topk`, `union`, `fetch`, `attention` (`fathom_cuda`'s
    /// `AttendStages`). Absent in older runs.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attend_ms: BTreeMap<String, f64>,
}

/// A `fathom decode-bench` run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeBench {
    /// Schema version.
    pub version: u32,
    /// The fathom version that wrote it.
    #[serde(default)]
    pub fathom: String,
    /// The command line.
    pub command: String,
    /// Model name.
    pub model: String,
    /// `real` (the pinned GGUF's weights) or a labelled synthetic kind.
    pub weights: String,
    /// The GPU.
    pub device: crate::offload::DeviceInfo,
    /// Where the pages live (`host` or `hbm`).
    pub residency: String,
    /// Timed decode steps per method and batch.
    pub steps: usize,
    /// Measured pinned host-to-device copy rate (GB/s), the link floor's denominator.
    pub h2d_gbps: f64,
    /// Bytes of pinned host memory (or HBM) per resident token, over every layer.
    pub host_bytes_per_token: f64,
    /// Device memory in use at the end (weights, working memory, HBM pools), bytes.
    pub device_bytes_in_use: u64,
    /// HBM of the cache's page pools alone, bytes: every page in `hbm`, the index in
    /// `index-hbm`, none in `host` (absent in older runs).
    #[serde(default)]
    pub pool_hbm_bytes: Option<u64>,
    /// Seconds of the dense prefill of every session (real text), apart from decode.
    pub prefill_seconds: f64,
    /// One entry per method and batch.
    pub entries: Vec<DecodeBenchEntry>,
    /// What bounds B on the machine that ran it (absent in older runs, or where the host's
    /// memory could not be read).
    #[serde(default)]
    pub capacity: Option<Capacity>,
    /// Head groups per attend (`CacheOptions::attend_groups`); 0 in older runs (one group).
    #[serde(default)]
    pub attend_groups: usize,
    /// Plane words per scan load (`CacheOptions::scan_vector_words`); 0 in older runs (one).
    #[serde(default)]
    pub scan_vector_words: u32,
    /// CPU threads of the host gather (`CacheOptions::host_gather_threads`); 0 (the GPU read the
    /// row fetch's misses) in older runs.
    #[serde(default)]
    pub host_gather: usize,
    /// Percent of the row fetch's misses the host gather brought
    /// (`CacheOptions::host_gather_share`); 100 in older runs and with the gather off.
    #[serde(default = "all_misses")]
    pub host_gather_share: u32,
    /// cuBLAS math mode of the forward (`fathom_gpu::cublas_math`: `default`, or `pedantic`
    /// under the experiment switch); absent in older runs, all of which ran `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cublas_math: Option<String>,
}

fn all_misses() -> u32 {
    100
}

/// How many resident tokens, and so sessions, the machine's memory holds at
/// `host_bytes_per_token` (docs/SPEC.md §9: host memory bounds B when the pages live there).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    /// The memory the pages live in: the host's (`MemTotal`) or, with HBM pages, the GPU's.
    pub memory_bytes: u64,
    /// The share of it the pages may take (the rest: the OS, the process, staging buffers).
    pub usable_fraction: f64,
    /// Resident tokens that fit: usable bytes over bytes per resident token.
    pub max_resident_tokens: u64,
    /// The largest batch of sessions with this run's contexts (cycled as the run cycles them)
    /// that fits.
    pub largest_batch: usize,
}
