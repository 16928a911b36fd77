//! The equal-error rule, its lower-bound flag and the bootstrap interval over positions, on
//! hand-made curves whose answers are known in closed form.

use fathom_bench::fidelity::{
    bootstrap_saving, equal_error, error_at_bits, standard_error, MethodResult,
};

fn method(name: &str, bits: f64, per_position: Vec<f64>) -> MethodResult {
    let error = per_position.iter().sum::<f64>() / per_position.len() as f64;
    MethodResult {
        name: name.into(),
        bits,
        error,
        per_layer: vec![error],
        per_layer_bits: vec![bits],
        error_se: standard_error(&per_position),
        per_position,
    }
}

#[test]
fn log_linear_reading_between_points_and_its_inverse() {
    // Error halves from 48 to 64 bits: e(56) = 0.1 / √2.
    let curve = [(48.0, 0.2), (64.0, 0.1), (96.0, 0.05)];
    let target = 0.2 / 2f64.sqrt();
    let e = equal_error(&curve, target).unwrap();
    assert!((e.bits - 56.0).abs() < 1e-9, "{e:?}");
    assert!(!e.lower_bound);
    let back = error_at_bits(&curve, e.bits).unwrap();
    assert!((back - target).abs() < 1e-12);
    assert!(
        equal_error(&curve, 0.01).is_none(),
        "never reached in the sweep"
    );
}

#[test]
fn a_baseline_beaten_at_the_lowest_budget_is_flagged_as_a_bound() {
    let curve = [(24.0, 0.1), (48.0, 0.05)];
    let e = equal_error(&curve, 0.2).unwrap();
    assert_eq!(e.bits, 24.0);
    assert!(e.lower_bound);
}

#[test]
fn standard_error_is_sd_over_root_n() {
    assert_eq!(standard_error(&[1.0]), 0.0);
    // sd of {1, 3} (n − 1 denominator) is √2; over √2 gives 1.
    assert!((standard_error(&[1.0, 3.0]) - 1.0).abs() < 1e-12);
}

#[test]
fn the_bootstrap_interval_holds_the_point_estimate_and_collapses_without_noise() {
    // Every position alike: every resample is the same, so the interval is a point.
    let p = 16;
    let fathom = [
        method("fathom:48", 48.0, vec![0.2; p]),
        method("fathom:64", 64.0, vec![0.1; p]),
    ];
    let base = method("ds:32", 136.0, vec![0.1; p]);
    let refs: Vec<&MethodResult> = fathom.iter().collect();
    let (lo, hi) = bootstrap_saving(&refs, &base, 200, 7).unwrap();
    assert!(
        (lo - 136.0 / 64.0).abs() < 1e-9 && (hi - lo).abs() < 1e-12,
        "{lo} {hi}"
    );

    // Positions that differ: the interval has width and contains the full-sample saving.
    let wobble = |m: f64| {
        (0..p)
            .map(|i| m * (1.0 + 0.3 * ((i % 4) as f64 - 1.5) / 1.5))
            .collect::<Vec<_>>()
    };
    let fathom = [
        method("fathom:48", 48.0, wobble(0.2)),
        method("fathom:64", 64.0, wobble(0.1)),
        method("fathom:96", 96.0, wobble(0.06)),
    ];
    let base = method(
        "ds:32",
        136.0,
        (0..p)
            .map(|i| 0.12 + 0.02 * ((i * 7 % 5) as f64 - 2.0))
            .collect(),
    );
    let refs: Vec<&MethodResult> = fathom.iter().collect();
    let curve: Vec<(f64, f64)> = fathom.iter().map(|m| (m.bits, m.error)).collect();
    let point = 136.0 / equal_error(&curve, base.error).unwrap().bits;
    let (lo, hi) = bootstrap_saving(&refs, &base, 1000, 0).unwrap();
    assert!(lo < point && point < hi, "{lo} {point} {hi}");
    assert_eq!(
        bootstrap_saving(&refs, &base, 1000, 0),
        Some((lo, hi)),
        "seeded"
    );
    assert!(bootstrap_saving(&refs[..1], &base, 100, 0).is_none());
}
