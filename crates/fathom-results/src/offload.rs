//! The `offload-bench` document: every method of the docs/SPEC.md §6 offload step at every
//! context and residency, timed with CUDA events, with per-stage times, bytes, the measured
//! link rate and the link-rate floor.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A model's attention shape as the document records it (`fathom_cuda::ModelShape`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShapeRecord {
    /// Layers `L`.
    pub layers: usize,
    /// KV heads `Hkv`.
    pub kv_heads: usize,
    /// Query heads per KV head `G`.
    pub group: usize,
    /// Channels per head `D`.
    pub dim: usize,
}

/// What the device is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// The driver's device name.
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_mem_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: i32,
    /// Driver version (e.g. 13000).
    pub driver_version: i32,
    /// The NVRTC target the kernels were compiled for.
    pub arch: String,
}

/// Where the session's data lives and what is reused (reported with every result).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionLayout {
    /// Distinct synthetic source layers (tiled over the model's layers cyclically).
    pub source_layers: usize,
    /// Base tokens of each source layer (tiled to the context).
    pub source_tokens: usize,
    /// Layers with their own K/V row buffers; layer `l` uses rows of `l mod row_layers`.
    pub row_layers: usize,
    /// Bytes of scan store (planes + scales) over all layers.
    pub store_bytes: u64,
    /// Bytes of landmark + Quest tables over all layers.
    pub table_bytes: u64,
    /// Bytes of K/V records allocated.
    pub row_bytes: u64,
    /// Bytes of the HBM row cache.
    pub cache_bytes: u64,
    /// Seconds spent allocating and filling.
    pub setup_s: f64,
}

/// Bytes each stage moves per step (all layers), and the PCIe total.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageBytes {
    /// Planner: queries and variances read, run list written.
    pub plan: u64,
    /// Gather: planned runs of planes + scales (or the method's table), host → HBM.
    pub gather: u64,
    /// Scan: the gathered bytes read from HBM plus scores written.
    pub scan: u64,
    /// Top-k: scores read twice (histogram, collect).
    pub topk: u64,
    /// Row gather: union rows × record bytes (misses over PCIe, hits from HBM).
    pub row_gather: u64,
    /// Of the row gather, bytes that crossed PCIe (cache misses).
    pub row_gather_pcie: u64,
    /// Attention: gathered rows read.
    pub attention: u64,
    /// Everything that crossed PCIe (host residency): gather + row misses.
    pub pcie_total: u64,
}

/// One (context, residency, method) measurement.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BenchResult {
    /// Context tokens.
    pub context: usize,
    /// `host` or `hbm`.
    pub residency: String,
    /// Method label.
    pub method: String,
    /// Top-k per query head.
    pub k: usize,
    /// Head groups pipelined per layer in the timed steps (instrumented steps use 1).
    pub groups: usize,
    /// Gather grid cap in the timed steps, resolved (0 = uncapped).
    #[serde(default)]
    pub gather_ctas: usize,
    /// Nominal scan bits.
    pub bits_nominal: f64,
    /// Measured mean plan bits.
    pub bits: f64,
    /// Median GPU time per step, ms.
    pub gpu_ms: f64,
    /// Every timed step's GPU time, ms.
    pub gpu_ms_steps: Vec<f64>,
    /// Median wall-clock per step, ms.
    pub wall_ms: f64,
    /// Median per-stage GPU time (instrumented steps), ms, keyed by stage.
    pub stage_ms: BTreeMap<String, f64>,
    /// Bytes per stage per step.
    pub bytes: StageBytes,
    /// Link-rate floor: PCIe bytes / measured H2D bandwidth (host residency), ms.
    pub link_floor_ms: Option<f64>,
    /// GPU time over the floor.
    pub floor_ratio: Option<f64>,
    /// Planner time over step GPU time.
    pub planner_share: f64,
    /// Union rows per step (all layers and KV heads).
    pub union_rows: f64,
    /// Fraction of union rows served by the HBM row cache.
    pub cache_hit_rate: f64,
    /// GPU-time speedup against each 136-bit scan at the same context and residency.
    pub speedup_vs_136: BTreeMap<String, f64>,
    /// Cache engine: how the top-k selected, `filtered>=N` (the filtered select from N
    /// middle tokens, docs/SPEC.md §5) or `scores` (the score array); empty in older runs.
    #[serde(default)]
    pub select: String,
    /// Cache engine, filtered select: of the query-head rows that tried it, the fraction that
    /// fell back to the score path.
    #[serde(default)]
    pub fallback_rate: Option<f64>,
    /// Cache engine, filtered select: the fraction of all query-head rows (timed steps) that
    /// selected from their filtered pairs alone.
    #[serde(default)]
    pub filtered_share: Option<f64>,
    /// Cache engine: plane words per global load of the scan (1: 8 bytes, 2: 16 bytes); 0 in
    /// older runs, which loaded one word.
    #[serde(default)]
    pub scan_vector_words: u32,
    /// Cache engine: the step was one captured CUDA graph replayed (`--graph`), not kernel
    /// by kernel; `false` in older runs.
    #[serde(default)]
    pub graph: bool,
    /// Cache engine: median GPU time of one step's appends (every timed layer), ms, from an
    /// event pair around each append on as many extra steps as were timed, run after them in
    /// the same process (the timed steps carry no extra events); `None` in older runs and for
    /// the benchmark step.
    #[serde(default)]
    pub append_ms: Option<f64>,
    /// Cache engine, `--rounds R`: which of the R rounds timed this entry. Each round times
    /// every setting and method once, in the same order, so the rounds interleave the methods
    /// in time and one round's ratios are paired; 0 in older runs and with one round.
    #[serde(default)]
    pub round: usize,
    /// Cache engine: CPU threads of the host gather that served the row fetch's misses
    /// (`CacheOptions::host_gather_threads`, docs/SPEC.md §6.1); 0 (the GPU read them) in older runs.
    #[serde(default)]
    pub host_gather: usize,
    /// Cache engine with the host gather: the percent of the misses it brought while the
    /// fetch read the rest (`CacheOptions::host_gather_share`); 100 in older runs and with
    /// the gather off.
    #[serde(default = "all_misses")]
    pub host_gather_share: u32,
    /// Cache engine with the host gather: mean wall µs per attend from the threads seeing its
    /// request to its last chunk's mark (the gather's share of the step, per layer).
    #[serde(default)]
    pub host_gather_request_us: Option<f64>,
    /// Cache engine with the host gather: records one thread copied per second (millions).
    #[serde(default)]
    pub host_gather_mrows_per_thread_s: Option<f64>,
}

/// What an offload-bench entry's run varied besides the method and the round ([`BenchResult::setting`]):
/// select path, head groups, scan load words, CUDA graph, host-gather threads and share.
pub type Setting = (String, usize, u32, bool, usize, u32);

fn all_misses() -> u32 {
    100
}

impl BenchResult {
    /// What the entry's run varied besides the method and the round: the select path, head
    /// groups, scan load width, launch mode, host-gather threads and share (entries compare
    /// only under equal settings).
    pub fn setting(&self) -> Setting {
        (
            self.select.clone(),
            self.groups,
            self.scan_vector_words,
            self.graph,
            self.host_gather,
            self.host_gather_share,
        )
    }
}

/// One method's speedup against one 136-bit scan under one setting, a ratio per round
/// ([`round_ratios`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RoundRatios {
    /// Context tokens.
    pub context: usize,
    /// `host` or `hbm`.
    pub residency: String,
    /// [`BenchResult::setting`].
    pub setting: Setting,
    /// The method.
    pub method: String,
    /// The 136-bit scan it is measured against.
    pub against: String,
    /// `against`'s GPU ms over `method`'s, round by round (in round order).
    pub ratios: Vec<f64>,
}

/// The per-round speedups of every entry against every 136-bit scan of its round (the
/// entries' `speedup_vs_136`, which pair within a round), grouped over rounds by context,
/// residency, setting, method and scan, in the results' order; only groups of two rounds or
/// more (one round has no spread).
pub fn round_ratios(results: &[BenchResult]) -> Vec<RoundRatios> {
    let mut out: Vec<RoundRatios> = Vec::new();
    let mut sorted: Vec<&BenchResult> = results.iter().collect();
    sorted.sort_by_key(|r| r.round); // stable: the results' order within a round
    for r in sorted {
        for (against, &x) in &r.speedup_vs_136 {
            let same = |g: &RoundRatios| {
                g.context == r.context
                    && g.residency == r.residency
                    && g.setting == r.setting()
                    && g.method == r.method
                    && g.against == *against
            };
            match out.iter_mut().find(|g| same(g)) {
                Some(g) => g.ratios.push(x),
                None => out.push(RoundRatios {
                    context: r.context,
                    residency: r.residency.clone(),
                    setting: r.setting(),
                    method: r.method.clone(),
                    against: against.clone(),
                    ratios: vec![x],
                }),
            }
        }
    }
    out.retain(|g| g.ratios.len() >= 2);
    out
}

/// An `offload-bench` run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OffloadBench {
    /// Schema version.
    pub version: u32,
    /// The fathom version that wrote it.
    #[serde(default)]
    pub fathom: String,
    /// Command line.
    pub command: String,
    /// What the run is for: the main comparison, or a pipelining sweep that times one method
    /// pair under many head-group and gather-grid settings (tabled in its README, not in the
    /// report's claims).
    #[serde(default)]
    pub study: OffloadStudy,
    /// Device.
    pub device: Option<DeviceInfo>,
    /// Shape label and shape.
    pub shape_label: String,
    /// Shape.
    pub shape: Option<ShapeRecord>,
    /// Batch.
    pub batch: usize,
    /// Key generator.
    pub generator: String,
    /// Measured pinned H2D memcpy bandwidth, GB/s.
    pub h2d_gbps: f64,
    /// Measured zero-copy gather kernel bandwidth (one long run), GB/s.
    pub gather_gbps: f64,
    /// Session layout per (context, residency), keyed `"{context}/{residency}"`.
    pub layouts: BTreeMap<String, SessionLayout>,
    /// Results.
    pub results: Vec<BenchResult>,
    /// Notes on what is simulated or reused.
    pub notes: Vec<String>,
    /// The path that was timed (files before the cache engine timed the benchmark step, an
    /// engine since retired: [`OffloadEngine::is_retired`]).
    #[serde(default)]
    pub engine: OffloadEngine,
}

/// Which path an offload run timed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OffloadEngine {
    /// Retired: the fixed benchmark step (`fathom_cuda::Session` of earlier versions), sessions
    /// filled from their sources, a batch laid out as B·Hkv KV heads of one length, each query
    /// head attending over its KV head's whole union. No version measures it any more; its
    /// committed files stay readable as history (and are the default of files that predate
    /// the `engine` field).
    #[default]
    Step,
    /// The library path a model drives (`fathom_cuda::PagedCache`): sessions prefilled by
    /// appends, one token appended per session every step, each query head attending over its
    /// own set.
    Cache,
}

impl OffloadEngine {
    /// Whether the engine is retired: its results are history that no current version
    /// re-measures, and every rendering labels them so.
    #[must_use]
    pub fn is_retired(self) -> bool {
        matches!(self, OffloadEngine::Step)
    }

    /// The engine's name in renderings: `paged cache`, or `retired benchmark step engine`.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            OffloadEngine::Step => "retired benchmark step engine",
            OffloadEngine::Cache => "paged cache",
        }
    }
}

/// What an offload run is for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OffloadStudy {
    /// Every method at the default settings (Claim 4).
    #[default]
    Main,
    /// Head-group pipelining and gather-grid settings swept over one method pair.
    PipelineSweep,
    /// A run of a kernel under an experiment switch, not the default build: a record of what
    /// the experiment measured, never judged against the targets.
    Experiment,
}

impl OffloadStudy {
    /// The name a JSON file and `--study` give it (`main`, `pipeline-sweep`, `experiment`).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Main => "main",
            Self::PipelineSweep => "pipeline-sweep",
            Self::Experiment => "experiment",
        }
    }
}

/// Version 1 offload files said a pipelining sweep only by their file name (`pipeline*`).
pub(crate) fn upgrade_legacy(what: &str, obj: &mut serde_json::Map<String, serde_json::Value>) {
    let sweep = std::path::Path::new(what)
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with("pipeline"));
    let study = if sweep { "pipeline-sweep" } else { "main" };
    obj.insert("study".into(), study.into());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ratios pair within a round and group over rounds by setting; a setting timed in one
    /// round only has no group.
    #[test]
    fn round_ratios_group_each_setting_over_rounds() {
        let row = |method: &str, round: usize, graph: bool, x: Option<f64>| {
            let mut r = BenchResult {
                context: 1 << 20,
                residency: "host".into(),
                method: method.into(),
                groups: 1,
                round,
                graph,
                ..Default::default()
            };
            if let Some(x) = x {
                r.speedup_vs_136.insert("sparq:32".into(), x);
            }
            r
        };
        let results = vec![
            row("fathom:48", 1, false, Some(2.2)),
            row("fathom:48", 0, false, Some(2.3)),
            row("fathom:48", 0, true, Some(2.4)),
            row("sparq:32", 0, false, Some(1.0)),
            row("sparq:32", 1, false, Some(1.0)),
        ];
        let g = round_ratios(&results);
        assert_eq!(g.len(), 2, "{g:?}");
        assert_eq!(g[0].method, "fathom:48");
        assert_eq!(g[0].ratios, vec![2.3, 2.2], "in round order");
        assert!(!g[0].setting.3);
        assert_eq!(g[1].method, "sparq:32");
        assert_eq!(g[1].ratios, vec![1.0, 1.0]);
    }
}
