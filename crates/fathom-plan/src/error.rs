//! [`PlanError`], the error of planning, selection, attention and calibration. The scan, the
//! scanners and the method grammar have their own: `scan::ScanError`,
//! `scanner::ScannerError` (which wraps `PlanError`, `ScanError` and the store's errors) and
//! `method::MethodError`.

use thiserror::Error;

/// Everything that can go wrong in planning, selection and attention.
///
/// Each variant names the problem and carries the values needed to report it in one line
/// (the CLI prints the `Display` text as is).
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum PlanError {
    /// A budget outside `[0, 4.25·D]` (docs/SPEC.md §3), or not a finite number.
    #[error(
        "budget {budget} bits is out of range: it must lie in [0, {max}] (4.25 bits × channels)"
    )]
    BudgetOutOfRange {
        /// The budget asked for, in bits per token per KV head.
        budget: f32,
        /// The largest budget the channel count allows, `4.25·D`.
        max: f32,
    },
    /// A NaN or an infinity where a finite number is required.
    #[error("{what}[{index}] is not finite (NaN or infinity)")]
    NonFinite {
        /// Which input held it.
        what: &'static str,
        /// Its flat index in that input.
        index: usize,
    },
    /// A negative value where only non-negative ones make sense (variances, importances).
    #[error("{what}[{index}] = {value} is negative")]
    Negative {
        /// Which input held it.
        what: &'static str,
        /// Its flat index in that input.
        index: usize,
        /// The offending value.
        value: f32,
    },
    /// Two inputs whose lengths do not agree.
    #[error("shape mismatch in {what}: expected {expected}, got {got}")]
    ShapeMismatch {
        /// The quantity that was checked.
        what: &'static str,
        /// The length it had to have.
        expected: usize,
        /// The length it had.
        got: usize,
    },
    /// A token index past the end of a key or value view.
    #[error("token index {index} is out of range for {what} with {len} rows")]
    IndexOutOfRange {
        /// The view that was indexed (`"keys"` or `"values"`).
        what: &'static str,
        /// The offending token index.
        index: usize,
        /// The number of rows the view has.
        len: usize,
    },
    /// Attention over an empty set of tokens (its softmax is undefined).
    #[error("attention over an empty set of tokens")]
    EmptySelection,
    /// A parameter that violates its documented constraint.
    #[error("invalid parameter {name} = {value}: {reason}")]
    InvalidParameter {
        /// The parameter's name.
        name: &'static str,
        /// Its value.
        value: f64,
        /// The constraint it broke.
        reason: &'static str,
    },
}
