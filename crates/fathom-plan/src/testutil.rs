//! Shared helpers for the property tests: a seeded runner and importance strategies.

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// The channel counts every planner property is checked at.
pub const SIZES: [usize; 5] = [4, 8, 64, 128, 256];

/// A deterministic (seeded) runner with `cases` cases and no failure files.
pub fn runner(cases: u32) -> TestRunner {
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha))
}

/// One importance value: zeros, small integers times powers of 4 (which make exact ties
/// between planes of different channels), and log-uniform values over 2^±20.
pub fn weight() -> impl Strategy<Value = f32> {
    prop_oneof![
        1 => Just(0.0f32),
        2 => (1u32..8, 0i32..4).prop_map(|(m, k)| m as f32 * 4f32.powi(k)),
        3 => (-20.0f32..20.0).prop_map(f32::exp2),
    ]
}

/// `d` importances and a budget in `[0, 4.25·d]`, half the time a multiple of 0.25.
pub fn weights_and_budget(d: usize) -> impl Strategy<Value = (Vec<f32>, f32)> {
    let max = 4.25 * d as f32;
    (
        prop::collection::vec(weight(), d),
        0.0f32..=1.0,
        any::<bool>(),
    )
        .prop_map(move |(w, f, snap)| {
            let b = (f * max).min(max);
            (w, if snap { (b * 4.0).floor() / 4.0 } else { b })
        })
}
