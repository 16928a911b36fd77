//! One scanner interface for every method (docs/SPEC.md §4–§5).
//!
//! A method supplies only two things for one (layer, KV head): approximate scores of the
//! keys for the `G` queries of the group, and the bits per token it read under docs/SPEC.md §3's
//! accounting. Selection (sink, local, top-k per query head), exact attention and the error
//! metric are the shared protocol of [`crate::select`], [`crate::attention`] and
//! [`crate::metric`], so every comparison is fair by construction.
//!
//! Fathom itself lives here ([`Fathom`]); the baselines live in `fathom-baselines`.

use fathom_store::{Basis, BasisKind, Dims, KeyStore, StoreError, StoreView};

use crate::attention::KvView;
use crate::scan::{scan, ScanError};
use crate::{importance_into, uniform_depth_plan, water_fill, PlanError};

/// Errors of a scanner.
#[derive(Debug, thiserror::Error)]
pub enum ScannerError {
    /// Planning failed.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The scan was given bad shapes.
    #[error(transparent)]
    Scan(#[from] ScanError),
    /// Building an index store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The method needs calibration data that is absent.
    #[error(
        "method {method} needs calibration data `{what}`, which the calibration does not hold"
    )]
    MissingCalibration {
        /// Method name.
        method: String,
        /// What is missing.
        what: &'static str,
    },
    /// A parameter outside its range.
    #[error("{0}")]
    Invalid(String),
}

/// Checks the arguments of [`HeadScanner::score`] before any work: `queries` is `[g][d]`,
/// `out` is `[g][n]` and every query entry is finite. Every scanner (Fathom's and each
/// baseline's) calls it first, so a short slice is an error, never a panic, and a NaN or an
/// infinite query is an error, never a silent `±∞`/NaN score.
///
/// # Errors
/// [`ScannerError::Plan`] holding [`PlanError::ShapeMismatch`] for a length that is not
/// `g·d` (queries) or `g·n` (scores), or [`PlanError::InvalidParameter`] (`g`) when those
/// products overflow; [`PlanError::NonFinite`] (`"queries"`, the flat index) for a NaN or an
/// infinity.
pub fn check_score_args(
    queries: &[f32],
    g: usize,
    d: usize,
    out: &[f32],
    n: usize,
) -> Result<(), ScannerError> {
    let (Some(gd), Some(gn)) = (g.checked_mul(d), g.checked_mul(n)) else {
        return Err(PlanError::InvalidParameter {
            name: "g",
            value: g as f64,
            reason: "g·D or g·n overflows",
        }
        .into());
    };
    for (what, expected, got) in [
        ("queries [g][D]", gd, queries.len()),
        ("scores [g][n]", gn, out.len()),
    ] {
        if expected != got {
            return Err(PlanError::ShapeMismatch {
                what,
                expected,
                got,
            }
            .into());
        }
    }
    if let Some(index) = queries.iter().position(|x| !x.is_finite()) {
        return Err(PlanError::NonFinite {
            what: "queries",
            index,
        }
        .into());
    }
    Ok(())
}

/// Checks that [`HeadInput::store`] is the store of [`HeadInput::keys`]: one head, `D`
/// channels (`keys.dim`) and `N` tokens (`keys.rows()`). Every method that reads `store`
/// calls it in [`Scanner::prepare`], so scores are never read from another head's (or a
/// shorter, or a longer) store.
///
/// # Errors
/// [`ScannerError::Invalid`] naming the mismatch.
pub fn check_head_store(input: &HeadInput<'_>) -> Result<(), ScannerError> {
    let dims = input.store.dims();
    let (n, d) = (input.keys.rows(), input.keys.dim);
    if dims.heads != 1 || dims.channels != d || input.store.tokens() != n {
        return Err(ScannerError::Invalid(format!(
            "the store ({} heads × {} channels, {} tokens) is not the store of the keys \
             (1 head × {d} channels, {n} tokens)",
            dims.heads,
            dims.channels,
            input.store.tokens()
        )));
    }
    Ok(())
}

/// Per-(layer, KV head) calibration (computed by `fathom calibrate`).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct HeadCalib {
    /// `σ_c²` of the raw channels over calibration keys.
    pub sigma2: Vec<f32>,
    /// Mean squared 64-token block maximum per raw channel, `E[m_c²]` (importance ablation).
    pub mean_sq_blockmax: Vec<f32>,
    /// KLT basis, row-major `[D][D]` (columns are eigenvectors, ordered by calibration
    /// score variance), if computed.
    pub klt: Vec<f32>,
    /// Variance of each KLT coordinate (the `σ²` of a KLT store).
    pub klt_sigma2: Vec<f32>,
    /// Loki's PCA basis `[D][D]`: the centred covariance's eigenvectors (the KLT's), columns
    /// ordered by calibration score variance.
    pub loki: Vec<f32>,
    /// Double Sparsity's channels, best first (by mean|q_c|·mean|k_c|).
    pub ds_channels: Vec<u16>,
}

/// What a method may read for one (layer, KV head).
#[derive(Debug, Clone, Copy)]
pub struct HeadInput<'a> {
    /// Layer index (for per-layer budgets).
    pub layer: usize,
    /// Exact keys of this KV head (`N` rows of `D`), model channels.
    pub keys: KvView<'a>,
    /// The 4-bit store of these keys in raw channels: one head, `D` channels, `N` tokens
    /// (checked by [`check_head_store`] in every method that reads it; the methods that score
    /// from `keys` alone — Loki, landmark, Quest, exact, dense and Fathom in the KLT basis —
    /// do not read it).
    pub store: StoreView<'a>,
    /// Calibration for this (layer, KV head), if any.
    pub calib: Option<&'a HeadCalib>,
    /// The 4-bit store of these keys in the calibration KLT basis (`calib.klt`), when the
    /// caller built one to share among methods; a method that needs it and finds `None` (or
    /// a store in another basis) builds its own.
    pub klt_store: Option<StoreView<'a>>,
}

/// A method: builds per-head state once, then scores query groups.
pub trait Scanner: Send + Sync {
    /// Display name, e.g. `fathom:48`.
    fn name(&self) -> String;
    /// The method in the one grammar ([`crate::method`]) when the scanner is one of its
    /// fixed-rule methods (every baseline); `None` for a Fathom scanner, whose label, basis and
    /// budgets are free, and for a caller's own scanner.
    fn spec(&self) -> Option<crate::method::MethodSpec> {
        None
    }
    /// Whether the method attends to every key (dense): selection is skipped.
    fn is_dense(&self) -> bool {
        false
    }
    /// Builds the per-(layer, KV head) state (rotated stores, page tables, …).
    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError>;
}

/// A method bound to one (layer, KV head).
pub trait HeadScanner: Send + Sync {
    /// Scores of all `n` keys for `g` queries (`[g][D]`, model channels) into `out`
    /// (`[g][n]`); returns the bits per token read for this query group.
    ///
    /// # Errors
    /// Every implementation first checks its arguments with [`check_score_args`] (lengths,
    /// finite queries); then the method's own errors.
    fn score(&self, queries: &[f32], g: usize, out: &mut [f32]) -> Result<f32, ScannerError>;
}

/// Which basis a Fathom store is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StoreBasis {
    /// Raw channels.
    Raw,
    /// The calibration KLT.
    Klt,
}

/// How Fathom turns importance into depths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DepthRule {
    /// Reverse water-filling (docs/SPEC.md §3).
    WaterFill,
    /// Ablation A4 ([`uniform_depth_plan`]): one depth `t` for the `n_t` most important
    /// channels of positive importance (not the water-filling plan's own active set), as many
    /// as fit the budget: within 2% of `B` when there are enough channels, never over it.
    Uniform,
}

/// Which statistic scales importance (`w_c = s_c Σ_h q_{h,c}²`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportanceProxy {
    /// `σ_c²` (docs/SPEC.md §3).
    Variance,
    /// Mean squared block maximum `E[m_c²]` (ablation).
    BlockMax,
}

/// Fathom: per-query water-filled planes at budget `B` (docs/SPEC.md §3).
#[derive(Debug, Clone)]
pub struct Fathom {
    /// Flat budget in bits per token per KV head.
    pub budget: f32,
    /// Per-layer budgets: when `Some`, entry `l` is layer `l`'s budget and `budget` is not
    /// used; a layer past the end of the list is an error ([`ScannerError::Invalid`] from
    /// `prepare`), never a fall-back to `budget`.
    pub layer_budgets: Option<Vec<f32>>,
    /// Store basis.
    pub basis: StoreBasis,
    /// Depth rule.
    pub rule: DepthRule,
    /// Importance statistic.
    pub proxy: ImportanceProxy,
    /// Display name.
    pub label: String,
}

impl Fathom {
    /// Flat-budget Fathom in raw channels with water-filling.
    pub fn new(budget: f32) -> Self {
        Self {
            budget,
            layer_budgets: None,
            basis: StoreBasis::Raw,
            rule: DepthRule::WaterFill,
            proxy: ImportanceProxy::Variance,
            label: format!("fathom:{budget}"),
        }
    }
}

/// A store a head scanner reads: the shared raw store, or one it built (a rotated basis).
#[derive(Debug)]
pub enum Held<'a> {
    /// The shared store of [`HeadInput::store`].
    Borrowed(StoreView<'a>),
    /// A store owned by the head scanner.
    Owned(KeyStore),
}

impl Held<'_> {
    /// The view every scan takes.
    pub fn view(&self) -> StoreView<'_> {
        match self {
            Held::Borrowed(v) => *v,
            Held::Owned(s) => s.view(),
        }
    }
}

struct FathomHead<'a> {
    store: Held<'a>,
    stat: Vec<f32>,
    budget: f32,
    rule: DepthRule,
}

/// Copies one head's rows into a contiguous `[N][D]` buffer.
pub fn gather_rows(keys: &KvView<'_>) -> Vec<f32> {
    let mut v = Vec::with_capacity(keys.rows() * keys.dim);
    for i in 0..keys.rows() {
        v.extend_from_slice(keys.row(i).expect("i < rows"));
    }
    v
}

/// Builds a one-head store of `keys` in the basis `u` (`[D][D]`, columns are basis vectors).
pub fn rotated_store(
    keys: &KvView<'_>,
    u: &[f32],
    kind: BasisKind,
) -> Result<KeyStore, ScannerError> {
    let d = keys.dim;
    let basis = Basis::new(kind, 1, d, u.to_vec())?;
    Ok(KeyStore::from_keys(
        Dims {
            heads: 1,
            channels: d,
        },
        &gather_rows(keys),
        Some(basis),
    )?)
}

impl Scanner for Fathom {
    fn name(&self) -> String {
        self.label.clone()
    }

    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError> {
        let d = input.keys.dim;
        let budget = match &self.layer_budgets {
            Some(b) => *b.get(input.layer).ok_or_else(|| {
                ScannerError::Invalid(format!("no per-layer budget for layer {}", input.layer))
            })?,
            None => self.budget,
        };
        let missing = |what| ScannerError::MissingCalibration {
            method: self.label.clone(),
            what,
        };
        let calib = input.calib.ok_or_else(|| missing("sigma2"))?;
        if self.basis == StoreBasis::Raw {
            check_head_store(input)?;
        }
        let (store, stat) = match (self.basis, self.proxy) {
            (StoreBasis::Raw, ImportanceProxy::Variance) => {
                (Held::Borrowed(input.store), calib.sigma2.clone())
            }
            (StoreBasis::Raw, ImportanceProxy::BlockMax) => {
                (Held::Borrowed(input.store), calib.mean_sq_blockmax.clone())
            }
            (StoreBasis::Klt, _) => {
                if calib.klt.len() != d * d || calib.klt_sigma2.len() != d {
                    return Err(missing("klt"));
                }
                let shared = input.klt_store.filter(|v| {
                    v.basis_kind() == BasisKind::Klt
                        && v.basis_matrices() == calib.klt.as_slice()
                        && v.tokens() == input.keys.rows()
                });
                let store = match shared {
                    Some(v) => Held::Borrowed(v),
                    None => Held::Owned(rotated_store(&input.keys, &calib.klt, BasisKind::Klt)?),
                };
                (store, calib.klt_sigma2.clone())
            }
        };
        if stat.len() != d {
            return Err(missing(match self.proxy {
                ImportanceProxy::Variance => "sigma2",
                ImportanceProxy::BlockMax => "mean_sq_blockmax",
            }));
        }
        Ok(Box::new(FathomHead {
            store,
            stat,
            budget,
            rule: self.rule,
        }))
    }
}

impl HeadScanner for FathomHead<'_> {
    fn score(&self, queries: &[f32], g: usize, out: &mut [f32]) -> Result<f32, ScannerError> {
        let view = self.store.view();
        let d = view.dims().channels;
        check_score_args(queries, g, d, out, view.tokens())?;
        let mut q = vec![0f32; g * d];
        for h in 0..g {
            view.rotate_query(0, &queries[h * d..(h + 1) * d], &mut q[h * d..(h + 1) * d]);
        }
        let mut w = vec![0f32; d];
        importance_into(&self.stat, &q, g, &mut w)?;
        let mut plan = water_fill(&w, self.budget)?;
        if self.rule == DepthRule::Uniform {
            plan = uniform_depth_plan(&plan, &w, self.budget)?;
        }
        scan(&view, 0, &q, g, &plan.depths, out)?;
        Ok(plan.bits)
    }
}
