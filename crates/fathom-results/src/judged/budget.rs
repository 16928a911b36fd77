//! The budget rule (docs/SPEC.md §4, "A budget per channel"): which Fathom budget per channel
//! `x` (`fathom:xc`, `x·D` bits) a user picks for head dimension `D`, read off the judged RULER
//! settings (docs/SPEC.md §7).
//!
//! A setting `s` (a model, context and k with head dimension `D_s`) is at parity with exact
//! top-k at every run budget from `B_s` up ([`FathomReading::at_parity_from`]), so at every
//! budget per channel from `x_s = B_s / D_s` up. The rule is the smallest `x` at parity on
//! every setting: `x = max_s x_s`. Where `x·D_s` lies between two budgets run at `s`, both at
//! parity, it is read as at parity (more bits plan a closer scan); where it lies above the
//! largest budget run at `s` it is untested there, and the rule names that setting instead
//! of claiming it. A setting at parity at no budget run leaves the rule unstated.
//!
//! ```
//! use fathom_results::judged::budget::{budget_rule, Rule, Setting};
//! use fathom_results::judged::ruler::FathomReading;
//! use fathom_results::judged::stats::Verdict::{AtParity, Below};
//! let small = Setting { name: "D 64".into(), d: 64, reading: FathomReading::from_budgets(
//!     vec![(16.0, Below), (32.0, AtParity), (48.0, AtParity)]) };
//! let large = Setting { name: "D 256".into(), d: 256, reading: FathomReading::from_budgets(
//!     vec![(48.0, Below), (64.0, AtParity), (128.0, AtParity)]) };
//! // 32/64 = 0.5 and 64/256 = 0.25 bits per channel: 0.5 holds on both (128 bits at D 256).
//! match budget_rule(&[small, large]) {
//!     Rule::Stated { per_channel, from, untested } => {
//!         assert_eq!((per_channel, from.as_str()), (0.5, "D 64"));
//!         assert!(untested.is_empty());
//!     }
//!     other => panic!("{other:?}"),
//! }
//! ```

use super::ruler::{FathomReading, RulerJudgement};
use crate::downstream::RulerDoc;

/// Fewest samples per task of a judged setting (docs/SPEC.md §7).
pub const JUDGED_SAMPLES: usize = 40;

/// Whether a RULER run is a judged setting: tuned on seeds it does not use (`tuning`
/// recorded), at least [`JUDGED_SAMPLES`] samples per task, and a task dense can do.
pub fn is_judged_setting(doc: &RulerDoc, j: &RulerJudgement) -> bool {
    doc.tuning.is_some() && doc.samples_per_task >= JUDGED_SAMPLES && !j.informative().is_empty()
}

/// One judged setting's reading of its Fathom budgets.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    /// How the rule names the setting (model, context).
    pub name: String,
    /// Head dimension D.
    pub d: usize,
    /// Its budgets and verdicts.
    pub reading: FathomReading,
}

/// The rule the judged settings support (module docs).
#[derive(Debug, Clone, PartialEq)]
pub enum Rule {
    /// No judged setting yet.
    Pending,
    /// These settings are at parity at no budget they ran: no `x` is supported.
    Unmet {
        /// The settings' names.
        settings: Vec<String>,
    },
    /// `x = max_s x_s` bits per channel.
    Stated {
        /// `x`.
        per_channel: f32,
        /// The setting whose `x_s` is the largest.
        from: String,
        /// Settings where `x·D_s` is above every budget they ran: `(name, x·D_s, the largest
        /// budget run)`.
        untested: Vec<(String, f32, f32)>,
    },
}

/// The rule of `settings` (module docs).
pub fn budget_rule(settings: &[Setting]) -> Rule {
    if settings.is_empty() {
        return Rule::Pending;
    }
    let unmet: Vec<String> = settings
        .iter()
        .filter(|s| s.reading.at_parity_from.is_none())
        .map(|s| s.name.clone())
        .collect();
    if !unmet.is_empty() {
        return Rule::Unmet { settings: unmet };
    }
    let x_of = |s: &Setting| s.reading.at_parity_from.unwrap_or(f32::NAN) / s.d as f32;
    let top = settings
        .iter()
        .max_by(|a, b| x_of(a).total_cmp(&x_of(b)))
        .expect("settings is not empty");
    let x = x_of(top);
    let untested = settings
        .iter()
        .filter_map(|s| {
            let largest = s.reading.budgets.last()?.0;
            let bits = x * s.d as f32;
            (bits > largest).then(|| (s.name.clone(), bits, largest))
        })
        .collect();
    Rule::Stated {
        per_channel: x,
        from: top.name.clone(),
        untested,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judged::stats::Verdict::{AtParity, Below, Undecided};

    fn setting(name: &str, d: usize, budgets: &[(f32, crate::judged::stats::Verdict)]) -> Setting {
        Setting {
            name: name.into(),
            d,
            reading: FathomReading::from_budgets(budgets.to_vec()),
        }
    }

    #[test]
    fn no_setting_is_pending_and_one_without_parity_leaves_it_unstated() {
        assert_eq!(budget_rule(&[]), Rule::Pending);
        let a = setting("a", 64, &[(32.0, AtParity), (48.0, AtParity)]);
        let b = setting("b", 256, &[(48.0, AtParity), (92.0, Undecided)]);
        assert_eq!(
            budget_rule(&[a, b]),
            Rule::Unmet {
                settings: vec!["b".into()]
            }
        );
    }

    /// The largest x_s sets the rule, whichever D it has; a setting whose runs stop below
    /// x·D is named as untested, not counted as at parity.
    #[test]
    fn the_rule_is_the_largest_per_channel_threshold() {
        let s64 = setting(
            "s64",
            64,
            &[(16.0, Below), (24.0, AtParity), (32.0, AtParity)],
        );
        let s256 = setting(
            "s256",
            256,
            &[(48.0, Below), (92.0, AtParity), (128.0, AtParity)],
        );
        // x_s: 24/64 = 0.375, 92/256 = 0.359: 0.375 from s64; 96 bits at s256, bracketed.
        assert_eq!(
            budget_rule(&[s64.clone(), s256.clone()]),
            Rule::Stated {
                per_channel: 0.375,
                from: "s64".into(),
                untested: vec![]
            }
        );
        let s256 = setting(
            "s256",
            256,
            &[(48.0, Below), (64.0, AtParity), (92.0, AtParity)],
        );
        let s64 = setting(
            "s64",
            64,
            &[(32.0, Below), (48.0, AtParity), (64.0, AtParity)],
        );
        // 48/64 = 0.75 from s64; 192 bits at s256, above its largest run (92).
        assert_eq!(
            budget_rule(&[s256, s64]),
            Rule::Stated {
                per_channel: 0.75,
                from: "s64".into(),
                untested: vec![("s256".into(), 192.0, 92.0)]
            }
        );
    }
}
