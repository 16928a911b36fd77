//! Both backends expose one API: this file is compiled against the stub (`cargo test`) and
//! against the CUDA backend (`cargo check --features cuda --all-targets`, which CI runs), and
//! the generic code below uses only the traits of `fathom_cuda::api`.

use fathom_cuda::api::{Device, StepSession};
use fathom_cuda::{
    synth_layer, CudaError, Gpu, Method, ModelShape, Residency, Session, SessionConfig, SynthParams,
};

/// One step of one method, written against the traits alone.
fn one_step<S: StepSession>(gpu: &S::Device) -> Result<f64, CudaError> {
    let shape = ModelShape::parse("1,1,4,64")?;
    let src = synth_layer(
        &SynthParams {
            heads: 1,
            group: 4,
            dim: 64,
            tokens: 1024,
            seed: 3,
        },
        0,
    )?;
    let cfg = SessionConfig {
        shape,
        context: 1024,
        k: 64,
        residency: Residency::Host,
        cache_rows: 256,
        row_bytes_budget: 1 << 26,
        tables: false,
        steps: 1,
        groups: 0,
        gather_ctas: 0,
    };
    let mut s = S::new(gpu, &cfg, &[src], &[Method::Fathom(48.0)])?;
    s.set_pipeline(1, 0);
    s.reset_cache()?;
    Ok(s.run_step(Method::Fathom(48.0), 0, false)?.gpu_ms)
}

#[test]
fn both_backends_implement_the_api() {
    // Opening through the trait and through the type agree.
    match (<Gpu as Device>::open(0), Gpu::open(0)) {
        (Ok(gpu), Ok(_)) => {
            let ms = one_step::<Session>(&gpu).expect("one step through the trait API");
            assert!(ms > 0.0);
        }
        (Err(a), Err(b)) => {
            assert_eq!(a.to_string(), b.to_string());
            assert!(
                matches!(
                    a,
                    CudaError::NotCompiledWithCuda | CudaError::NoDevice { .. }
                ),
                "{a}"
            );
            eprintln!("no GPU path ({a}); the API itself is checked at compile time");
        }
        (a, b) => panic!("the trait and the type disagree: {a:?} vs {b:?}"),
    }
}
