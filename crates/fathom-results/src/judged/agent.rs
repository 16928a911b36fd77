//! The judged agent-step statistics of one run, docs/SPEC.md §7: per method the step agreement
//! with exact top-k and with dense, each with a 95 % interval over sessions (a session's steps
//! share one context, so the session is the unit), and the smallest Fathom budget that
//! reaches the best 136-bit scan.

use fathom_plan::method::{FathomVariant, MethodSpec};

use super::stats::{interval, Interval, AGENT_MARGIN, MIN_UNITS};
use crate::downstream::AgentDoc;

/// One method's row.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentRow {
    /// The method's label.
    pub method: String,
    /// Mean scan bits per token per KV head.
    pub bits: f64,
    /// `bits / D`.
    pub bits_per_channel: f64,
    /// Agreement with exact top-k, over sessions.
    pub agree_exact: Interval,
    /// Agreement with dense, over sessions.
    pub agree_dense: Interval,
    /// For a Fathom budget: `agree_exact(method) − agree_exact(best 136-bit scan)`, paired by
    /// session.
    pub vs_best: Option<Interval>,
}

/// A run's judgement.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentJudgement {
    /// Head dimension D.
    pub d: usize,
    /// Per method, in label order.
    pub rows: Vec<AgentRow>,
    /// The 136-bit scan (SparQ, DS or Loki at r = 32) with the highest mean agreement with
    /// exact, and that mean.
    pub best_136: Option<(String, f64)>,
    /// The smallest Fathom budget that reaches it: the 95 % interval of the paired difference
    /// lies above `−AGENT_MARGIN`, over at least [`MIN_UNITS`] sessions.
    pub smallest_reaching: Option<(f32, Interval)>,
}

/// Whether a paired difference `Fathom − best 136-bit` reaches the scan (docs/SPEC.md §7).
pub fn reaches(iv: &Interval) -> bool {
    iv.n >= MIN_UNITS && iv.lo >= -AGENT_MARGIN
}

/// Judges an agent-steps run (module docs).
pub fn judge_agent(doc: &AgentDoc) -> AgentJudgement {
    let d = doc.header.d;
    let per = |m: &str, dense: bool| -> Vec<f64> {
        doc.results
            .iter()
            .filter_map(|r| r.methods.get(m))
            .map(|x| if dense { x.agree_dense } else { x.agree_exact })
            .collect()
    };
    let best_136 = doc
        .summary
        .iter()
        .filter(|(m, _)| MethodSpec::parse(m, d).is_ok_and(|s| s.is_136_bit_scan()))
        .max_by(|a, b| a.1.agree_exact.total_cmp(&b.1.agree_exact))
        .map(|(m, x)| (m.clone(), x.agree_exact));
    // Paired by session: only sessions where both ran.
    let vs = |m: &str, b: &str| -> Interval {
        let x: Vec<f64> = doc
            .results
            .iter()
            .filter_map(|r| Some(r.methods.get(m)?.agree_exact - r.methods.get(b)?.agree_exact))
            .collect();
        interval(&[&x])
    };
    let budget = |m: &str| match MethodSpec::parse(m, d).ok()? {
        MethodSpec::Fathom {
            variant: FathomVariant::Plan,
            budget,
        } => Some(budget),
        _ => None,
    };
    let rows: Vec<AgentRow> = doc
        .summary
        .iter()
        .map(|(m, x)| AgentRow {
            method: m.clone(),
            bits: x.mean_bits,
            bits_per_channel: x.mean_bits / d as f64,
            agree_exact: interval(&[&per(m, false)]),
            agree_dense: interval(&[&per(m, true)]),
            vs_best: match (&best_136, budget(m)) {
                (Some((b, _)), Some(_)) => Some(vs(m, b)),
                _ => None,
            },
        })
        .collect();
    let mut fathoms: Vec<(f32, Interval)> = rows
        .iter()
        .filter_map(|r| Some((budget(&r.method)?, r.vs_best?)))
        .collect();
    fathoms.sort_by(|a, b| a.0.total_cmp(&b.0));
    AgentJudgement {
        d,
        smallest_reaching: fathoms.into_iter().find(|(_, iv)| reaches(iv)),
        rows,
        best_136,
    }
}
