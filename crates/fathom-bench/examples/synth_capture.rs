//! Writes a SYNTHETIC docs/SPEC.md §8 capture (the labelled generator of `fathom_bench::synthetic`) of
//! any shape, for timing `fathom fidelity` and `fathom calibrate` at sizes no shipped model
//! has (for example Qwen2.5-7B's 28 layers × 4 KV heads × G 7 × D 128 at 32k tokens):
//!
//! ```text
//! cargo run --release -p fathom-bench --example synth_capture -- \
//!     LAYERS HKV G D N P OUT.safetensors
//! ```
//!
//! Numbers measured on it are synthetic and must be labelled so.
use fathom_bench::capture::capture_bytes;
use fathom_bench::synthetic::{generate, SyntheticParams};
use fathom_bench::tensors::WriteDtype;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() != 7 {
        return Err("usage: synth_capture LAYERS HKV G D N P OUT.safetensors".into());
    }
    let num = |i: usize| -> Result<usize, Box<dyn std::error::Error>> {
        a[i].parse::<usize>()
            .map_err(|e| format!("argument {} ({:?}): {e}", i + 1, a[i]).into())
    };
    let p = SyntheticParams {
        layers: num(0)?,
        hkv: num(1)?,
        g: num(2)?,
        d: num(3)?,
        n: num(4)?,
        p: num(5)?,
        ..Default::default()
    };
    let t = std::time::Instant::now();
    let (info, layers) = generate(&p);
    let bytes = capture_bytes(&info, &layers, WriteDtype::F16)?;
    drop(layers);
    fathom_store::write_atomic(std::path::Path::new(&a[6]), &bytes)?;
    eprintln!(
        "wrote SYNTHETIC capture {} ({} layers, Hkv {}, G {}, D {}, N {}, P {}; {:.2} GB) in {:.1} s",
        a[6],
        p.layers,
        p.hkv,
        p.g,
        p.d,
        p.n,
        p.p,
        bytes.len() as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
