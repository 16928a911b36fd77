//! fathom:48 in an offload run, one row per setting: the numbers Claim 4 prints and the claims
//! table quotes, judged against the targets (docs/SPEC.md §6).

use fathom_results::offload::{BenchResult, OffloadBench, OffloadEngine};

use crate::claims::{speedup_target, TARGETS};
use crate::intervals::Interval;

/// `262144 host 1.91×, 1048576 host 2.27×`: per context and residency of a run, the best
/// setting's lowest speedup against the 136-bit scans.
pub fn best_per_context(v: &OffloadBench) -> String {
    let mut best: Vec<(usize, String, f64)> = Vec::new();
    for row in fathom48_rows(v) {
        let r = row.result;
        if !row.min.0.is_finite() {
            continue;
        }
        match best
            .iter_mut()
            .find(|b| b.0 == r.context && b.1 == r.residency)
        {
            Some(b) => b.2 = b.2.max(row.min.0),
            None => best.push((r.context, r.residency.clone(), row.min.0)),
        }
    }
    if best.is_empty() {
        return "no 136-bit scan in the run".into();
    }
    best.iter()
        .map(|(c, res, x)| format!("{c} {res} {x:.2}×"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// fathom:48 at one setting of an offload run (round 1's entry; over rounds, the median GPU
/// time and each speedup's interval), judged against [`TARGETS`].
#[derive(Debug, Clone)]
pub struct StepRow<'a> {
    /// Round 1's entry of this setting.
    pub result: &'a BenchResult,
    /// What the run varied, in words.
    pub setting: String,
    /// Whether this is the library's default path (no host gather, plain launches).
    pub default_path: bool,
    /// Median GPU ms over rounds.
    pub gpu_ms: f64,
    /// Per 136-bit scan, the speedup's interval over rounds (empty for a one-round run).
    pub rounds: Vec<(String, Interval)>,
    /// The lowest speedup against the 136-bit scans, with its interval's bounds (the same
    /// number three times for a one-round run).
    pub min: (f64, f64, f64),
    /// The target at this context (none for a ragged batch or another shape).
    pub target: Option<f64>,
    /// The planner's share of the step, where the run timed its stages.
    pub planner_share: Option<f64>,
    /// The verdict in words.
    pub verdict: String,
}

/// Every fathom:48 setting of an offload run, in the run's order.
pub fn fathom48_rows(v: &OffloadBench) -> Vec<StepRow<'_>> {
    let rounds = fathom_results::offload::round_ratios(&v.results);
    let mut out = Vec::new();
    for r in v
        .results
        .iter()
        .filter(|r| r.method == "fathom:48" && r.round == 0)
    {
        let groups: Vec<_> = rounds
            .iter()
            .filter(|g| {
                g.context == r.context
                    && g.residency == r.residency
                    && g.setting == r.setting()
                    && g.method == r.method
            })
            .map(|g| (g.against.clone(), Interval::of(&g.ratios)))
            .collect();
        let gpu_ms = {
            let mut ms: Vec<f64> = v
                .results
                .iter()
                .filter(|x| {
                    x.method == r.method
                        && x.context == r.context
                        && x.residency == r.residency
                        && x.setting() == r.setting()
                })
                .map(|x| x.gpu_ms)
                .collect();
            ms.sort_by(f64::total_cmp);
            ms[ms.len() / 2]
        };
        // The lowest speedup (or, over rounds, the lowest interval: its bounds).
        let (min, min_lo, min_hi) = if groups.is_empty() {
            let m = r
                .speedup_vs_136
                .values()
                .copied()
                .fold(f64::INFINITY, f64::min);
            (m, m, m)
        } else {
            let lo = groups
                .iter()
                .map(|(_, i)| i.lo)
                .fold(f64::INFINITY, f64::min);
            let hi = groups
                .iter()
                .map(|(_, i)| i.hi)
                .fold(f64::INFINITY, f64::min);
            let m = groups
                .iter()
                .map(|(_, i)| i.mean)
                .fold(f64::INFINITY, f64::min);
            (m, lo, hi)
        };
        // A cache-engine context is the batch's total; the targets are for one session.
        let one_session = v.engine == OffloadEngine::Step || v.batch <= 1 && r.context <= 1 << 20;
        let ragged = v.engine == OffloadEngine::Cache && !one_session;
        let target = speedup_target(&v.shape_label, r.context).filter(|_| !ragged);
        let verdict = match (r.residency.as_str(), target) {
            _ if r.speedup_vs_136.is_empty() => {
                "— (no 136-bit scan under this setting in the run)".into()
            }
            ("host", Some(t)) if min_lo >= t => format!("meets the {t}× target"),
            ("host", Some(t)) if min_hi < t || groups.is_empty() => {
                format!("misses the {t}× target at {min:.2}×")
            }
            ("host", Some(t)) => format!(
                "the {t}× target lies inside the interval ({min:.2}× [{min_lo:.2}, {min_hi:.2}]): neither met nor missed at 95 %"
            ),
            ("hbm", _) if min <= TARGETS.hbm_parity => {
                "not faster in HBM, as the paper found".into()
            }
            ("hbm", _) => format!("{min:.2}× in HBM (the paper found no speedup there)"),
            _ if ragged => "— (a ragged batch: no single-session target)".into(),
            _ => "—".into(),
        };
        let planner_share = match v.engine {
            OffloadEngine::Cache if r.stage_ms.is_empty() => None,
            _ => Some(r.planner_share),
        };
        out.push(StepRow {
            result: r,
            setting: setting_words(v, r),
            default_path: r.host_gather == 0 && !r.graph,
            gpu_ms,
            rounds: groups,
            min: (min, min_lo, min_hi),
            target,
            planner_share,
            verdict,
        });
    }
    out
}

/// What an offload run varied at one entry: the select path and head groups (cache engine),
/// or the pipelining and gather grid (step engine).
pub fn setting_words(v: &OffloadBench, r: &BenchResult) -> String {
    match v.engine {
        OffloadEngine::Cache => {
            format!(
                "{}, {} head group{}{}{}",
                if r.select.is_empty() {
                    "scores"
                } else {
                    r.select.as_str()
                },
                r.groups,
                if r.groups == 1 { "" } else { "s" },
                if r.scan_vector_words == 2 {
                    ", 16-byte scan loads"
                } else {
                    ""
                },
                if r.graph {
                    ", one CUDA graph per step"
                } else {
                    ""
                },
            ) + &if r.host_gather > 0 {
                format!(
                    ", misses gathered by {} host threads{}",
                    r.host_gather,
                    crate::sections::share_note(r.host_gather_share)
                )
            } else {
                String::new()
            }
        }
        OffloadEngine::Step => {
            format!(
                "groups {}, gather CTAs {} ({})",
                r.groups,
                r.gather_ctas,
                OffloadEngine::Step.label()
            )
        }
    }
}
