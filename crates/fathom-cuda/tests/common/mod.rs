//! What every device test shares.

use fathom_cuda::{CudaError, Gpu};

/// The GPU, or `None` (printing why) when there is no GPU path, as on CI; with
/// `FATHOM_REQUIRE_GPU=1` a missing GPU fails the test instead, so a device run cannot pass by
/// skipping.
pub fn gpu() -> Option<Gpu> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e @ (CudaError::NotCompiledWithCuda | CudaError::NoDevice { .. })) => {
            if std::env::var("FATHOM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("FATHOM_REQUIRE_GPU=1 and there is no GPU path: {e}");
            }
            eprintln!("skipping GPU test: {e}");
            None
        }
        Err(e) => panic!("unexpected error opening the GPU: {e}"),
    }
}
