//! The baselines through the fidelity harness, on SYNTHETIC keys: dense has zero error and
//! exact top-k beats a low-budget Fathom. (Here rather than in fathom-baselines, which this
//! crate depends on, so that no dev-dependency runs back.)

use fathom_baselines::{Dense, Exact};
use fathom_plan::scanner::{Fathom, Scanner};

#[test]
fn dense_has_zero_error_and_exact_beats_fathom_on_synthetic() {
    use fathom_bench::fidelity::{run, FidelityParams, InMemory};
    use fathom_bench::synthetic::{generate, SyntheticParams};
    let (info, layers) = generate(&SyntheticParams {
        layers: 1,
        n: 600,
        p: 4,
        d: 32,
        ..Default::default()
    });
    let src = InMemory { info, layers };
    let cal = fathom_bench::calib::Calibration::statistics_only(&src, "synthetic").unwrap();
    let methods: Vec<Box<dyn Scanner>> =
        vec![Box::new(Dense), Box::new(Exact), Box::new(Fathom::new(8.0))];
    let mut p = FidelityParams::default();
    p.select.k = 16;
    let r = run(&src, Some(&cal), &methods, &p, &|_| {}).unwrap();
    assert_eq!(r.methods[0].error, 0.0);
    assert!(r.methods[1].error <= r.methods[2].error, "{:?}", r.methods);
}
