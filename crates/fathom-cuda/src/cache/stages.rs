//! The stages of one attend and their measured times (docs/SPEC.md §6.1), and what a debug
//! readback returns.

#[allow(unused_imports)]
use super::*;

/// CUDA's limit on a grid's y and z extents.
pub const MAX_GRID_YZ: usize = 65_535;

/// The stages of one attend, in launch order (docs/SPEC.md §6.1): where
/// [`crate::cache::CacheOptions::stage_timing`] records an event on the cache's stream. Each
/// mark but [`AttendStage::Start`] ends its stage, so the time from the mark before it is
/// that stage's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttendStage {
    /// Before the attend's first launch: starts a new attend.
    Start,
    /// The queries to f32 (rotated for Loki) and the per-query plan.
    Plan,
    /// The scan (with the filtered select's fused top-k and its fallback rescan).
    Scan,
    /// The top-k: boundary bucket, collect, finish.
    TopK,
    /// The union of a KV head's selections.
    Union,
    /// The row fetch into HBM (with the host gather's list and the wait for its copy).
    Fetch,
    /// The exact attention: partials and their combine (all of a dense attend after its
    /// queries).
    Attention,
}

/// The most stage marks [`crate::PagedCache`] holds between two calls of
/// [`crate::api::KvCache::stage_times`] (seven per attend); attends past it count as untimed.
pub const MAX_STAGE_MARKS: usize = 1 << 16;

/// GPU time of attends by stage ([`crate::api::KvCache::stage_times`]), from CUDA events on the
/// cache's stream between the stages of each attend (plain launches only). An event pair
/// times the GPU from one mark to the next, so the stages sum to the attends' GPU time, idle
/// gaps between launches included.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttendStages {
    /// Attends split into stages.
    pub attends: u64,
    /// Attends not split: inside a graph capture (a graph holds no timing events), with more
    /// than one head group (whose stages overlap on two streams), or past
    /// [`MAX_STAGE_MARKS`].
    pub untimed: u64,
    /// [`AttendStage::Plan`], ms.
    pub plan_ms: f64,
    /// [`AttendStage::Scan`], ms.
    pub scan_ms: f64,
    /// [`AttendStage::TopK`], ms.
    pub topk_ms: f64,
    /// [`AttendStage::Union`], ms.
    pub union_ms: f64,
    /// [`AttendStage::Fetch`], ms.
    pub fetch_ms: f64,
    /// [`AttendStage::Attention`], ms.
    pub attention_ms: f64,
}

impl AttendStages {
    /// The stages' names as `offload-bench` records them, in launch order.
    pub const NAMES: [&'static str; 6] = ["plan", "scan", "topk", "union", "fetch", "attention"];

    /// Adds one mark: `ms` is the GPU time from the mark before (ignored for
    /// [`AttendStage::Start`], which counts a new attend).
    pub fn add(&mut self, stage: AttendStage, ms: f64) {
        match stage {
            AttendStage::Start => self.attends += 1,
            AttendStage::Plan => self.plan_ms += ms,
            AttendStage::Scan => self.scan_ms += ms,
            AttendStage::TopK => self.topk_ms += ms,
            AttendStage::Union => self.union_ms += ms,
            AttendStage::Fetch => self.fetch_ms += ms,
            AttendStage::Attention => self.attention_ms += ms,
        }
    }

    /// The stage times in the order of [`AttendStages::NAMES`], ms.
    pub fn values(&self) -> [f64; 6] {
        [
            self.plan_ms,
            self.scan_ms,
            self.topk_ms,
            self.union_ms,
            self.fetch_ms,
            self.attention_ms,
        ]
    }

    /// Every stage's time, ms.
    pub fn total_ms(&self) -> f64 {
        self.values().iter().sum()
    }
}

/// What `crate::api::KvCache::debug_readback` returns for one session.
#[derive(Debug, Clone, PartialEq)]
pub struct AttendDebug {
    /// Depths `[Hkv][D]` of the last GPU-planned method (static plans are not copied here).
    pub depths: Vec<u8>,
    /// Scores `[Hkv][G][n]`.
    pub scores: Vec<f32>,
    /// Winners per query head `h·G + g`, sorted (middle tokens only).
    pub winners: Vec<Vec<u32>>,
}
