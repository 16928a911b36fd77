//! Compiles every kernel with NVRTC for sm_90 (no device needed, only libnvrtc):
//! `cargo run -p fathom-cuda --features cuda --example nvrtc_check`.

fn main() {
    #[cfg(feature = "cuda")]
    for (g, d) in [
        (4, 128),
        (7, 128),
        (1, 128),
        (4, 64),
        (8, 128),
        (3, 64),
        (1, 256),
        (4, 256),
    ] {
        match fathom_cuda::compile_kernels("sm_90", g, d) {
            Ok(n) => println!("G={g} D={d}: {n} modules compiled"),
            Err(e) => {
                eprintln!("G={g} D={d}: {e}");
                std::process::exit(1);
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    eprintln!("built without the `cuda` feature: nothing to compile");
}
