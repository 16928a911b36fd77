//! The zero-copy gather's rate against run length, beside a pinned memcpy in the same run:
//! the measurement the paged cache's page size rests on (docs/SPEC.md §6.1). One run of the
//! first t planes of a channel in a page of P tokens is t·P/8 bytes.
//!
//! ```text
//! cargo run --release --features cuda -p fathom-bench --example gather_sweep -- OUT.json
//! ```

use fathom_cuda::prelude::*;
use fathom_cuda::Gpu;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args().nth(1);
    let gpu = Gpu::open(0)?;
    let memcpy = gpu.h2d_bandwidth(1 << 30)?;
    let total = 1usize << 30;
    println!(
        "{} — pinned H2D memcpy of 1 GiB: {memcpy:.1} GB/s",
        gpu.info().name
    );
    println!("| run bytes | gather GB/s | / memcpy | page tokens at t = 1, 2, 4 |");
    println!("|---:|---:|---:|---|");
    let mut rows = Vec::new();
    for run in [64usize, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536] {
        let rate = gpu.gather_run_bandwidth(run, total)?;
        let pages: Vec<String> = [1, 2, 4]
            .iter()
            .map(|t| (8 * run / t).to_string())
            .collect();
        println!(
            "| {run} | {rate:.1} | {:.2} | {} |",
            rate / memcpy,
            pages.join(", ")
        );
        rows.push(format!(
            "{{\"run_bytes\": {run}, \"gather_gbps\": {rate:.3}, \"ratio_to_memcpy\": {:.4}}}",
            rate / memcpy
        ));
    }
    if let Some(p) = out {
        let doc = format!(
            "{{\"what\": \"zero-copy gather rate against run length (runs spaced 2x their length, 1 GiB gathered), beside a pinned H2D memcpy of 1 GiB in the same run\", \"device\": \"{}\", \"memcpy_gbps\": {memcpy:.3}, \"runs\": [{}]}}\n",
            gpu.info().name,
            rows.join(", ")
        );
        std::fs::write(p, doc)?;
    }
    Ok(())
}
