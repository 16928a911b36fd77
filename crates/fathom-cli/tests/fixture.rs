//! The real capture embedded in `fathom` (`data/smollm2-prose-eval-2k.safetensors`, provenance
//! in `data/PROVENANCE.md`) reads from memory and reproduces its own attention output: dense
//! attention recomputed from its q, k, v is within f16 storage error of its `o`.

use fathom_baselines::Dense;
use fathom_bench::capture::Capture;
use fathom_bench::fidelity::{run, FidelityParams, InMemory};
use fathom_plan::scanner::Scanner;

const FIXTURE: &[u8] = include_bytes!("../data/smollm2-prose-eval-2k.safetensors");

/// f16 storage of q, k, v and o: each value carries ≈ 2^-11 relative rounding, and the
/// recomputed output differs by a few 1e-3 (measured ≤ 4.3e-3); 1e-2 still catches a wrong
/// mask, position or head mapping (errors of order 1).
const F16_TOL: f64 = 1e-2;

#[test]
fn the_embedded_capture_is_real_and_consistent() {
    assert!(FIXTURE.len() <= 5 * 1024 * 1024);
    let cap = Capture::from_bytes("embedded fixture", FIXTURE).expect("a valid capture");
    let info = cap.info().clone();
    assert_eq!(info.model, "smollm2-135m");
    assert_eq!(info.layers, [4, 14, 24]);
    assert_eq!((info.n, info.positions.len()), (2048, 16));
    let layers = info
        .layers
        .iter()
        .map(|&l| cap.layer(l).unwrap())
        .collect::<Vec<_>>();
    let src = InMemory { info, layers };
    let methods: Vec<Box<dyn Scanner>> = vec![Box::new(Dense)];
    let r = run(&src, None, &methods, &FidelityParams::default(), &|_| {}).unwrap();
    let o = r.o_consistency_max.expect("the fixture carries o");
    eprintln!("embedded fixture: largest relative difference of o from dense {o:.3e}");
    assert!(o < F16_TOL, "{o}");
}

#[test]
fn a_corrupt_embedded_buffer_is_a_typed_error() {
    let cut: &'static [u8] = &FIXTURE[..FIXTURE.len() / 2];
    let e = Capture::from_bytes("embedded fixture", cut).unwrap_err();
    assert!(e.to_string().contains("embedded fixture"), "{e}");
}

/// Owned bytes read as the embedded ones do, and come back unchanged; a truncated buffer is
/// the same typed error.
#[test]
fn owned_bytes_read_back_and_are_given_back() {
    let cap = Capture::from_vec("owned fixture", FIXTURE.to_vec()).expect("a valid capture");
    assert_eq!(cap.info().layers, [4, 14, 24]);
    assert_eq!(cap.layer(14).unwrap().k.len(), {
        let i = cap.info();
        i.n * i.hkv * i.d
    });
    assert_eq!(cap.into_bytes(), FIXTURE);
    let e = Capture::from_vec("owned fixture", FIXTURE[..FIXTURE.len() / 2].to_vec()).unwrap_err();
    assert!(e.to_string().contains("owned fixture"), "{e}");
}
