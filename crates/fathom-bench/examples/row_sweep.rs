//! Random record reads from host memory against address translation: the zero-copy gather
//! over rows of 512 bytes (one bf16 K|V record at D = 128) drawn at random from spans of pinned
//! host memory, beside the same rows back to back, random pairs of rows, and a pinned memcpy,
//! for the driver's pages, for 2 MiB transparent huge pages and for the virtual memory API's
//! host allocations (docs/SPEC.md §6.1, "Host pages"). The union fetch's misses are such
//! reads, spread over a 41 GiB pool at 256k tokens.
//!
//! A third argument sweeps the row size (a list of bytes, default 512) and a fourth narrows the
//! kinds of pages (default every kind): whether the random rate is bound per access (it then
//! grows with the row) or per byte; the pair patterns say how far apart two reads may lie and
//! still cost one access.
//!
//! ```text
//! cargo run --release --features cuda -p fathom-bench --example row_sweep -- OUT.json [GiB] [ROW_BYTES,...] [PAGES,...]
//! cargo run --release --features cuda -p fathom-bench --example row_sweep -- rows.json 32 512,2048,8192 huge
//! ```

use fathom_cuda::prelude::*;
use fathom_cuda::{Gpu, HostPages};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = args.next();
    let max_gib: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(32);
    let row_sizes: Vec<usize> = match args.next() {
        Some(s) => s.split(',').map(|x| x.parse()).collect::<Result<_, _>>()?,
        None => vec![512],
    };
    let kinds: Vec<HostPages> = match args.next() {
        Some(s) => s
            .split(',')
            .map(HostPages::parse)
            .collect::<Result<_, _>>()?,
        None => HostPages::ALL.to_vec(),
    };
    let gpu = Gpu::open(0)?;
    let memcpy = gpu.h2d_bandwidth(1 << 30)?;
    let thp = |f: &str| {
        std::fs::read_to_string(format!("/sys/kernel/mm/transparent_hugepage/{f}"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "absent".into())
    };
    let (enabled, defrag) = (thp("enabled"), thp("defrag"));
    println!(
        "{} — pinned H2D memcpy of 1 GiB: {memcpy:.1} GB/s; THP enabled: {enabled}; defrag: {defrag}",
        gpu.info().name
    );
    let spans: Vec<usize> = [1usize << 28, 4 << 30, max_gib << 30]
        .into_iter()
        .filter(|&s| s <= max_gib << 30)
        .collect();
    let rows = [16384usize, 262144];
    let mut sweeps = Vec::new();
    for (pages, row_bytes) in kinds
        .iter()
        .flat_map(|&p| row_sizes.iter().map(move |&r| (p, r)))
    {
        let s = match gpu.row_gather_sweep(pages, row_bytes, &spans, &rows, 7) {
            Ok(s) => s,
            Err(e) => {
                println!("{}: {e}", pages.label());
                continue;
            }
        };
        println!(
            "## {} pages, rows of {row_bytes} bytes: {:.1} GiB in {:.1} s, huge pages back {}",
            s.pages,
            s.alloc_bytes as f64 / (1u64 << 30) as f64,
            s.alloc_seconds,
            s.huge_bytes
                .map(|b| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64))
                .unwrap_or_else(|| "(unknown)".into())
        );
        println!("| span GiB | rows | pattern | GB/s | / memcpy |");
        println!("|---:|---:|---|---:|---:|");
        for r in &s.rates {
            println!(
                "| {:.2} | {} | {} | {:.1} | {:.2} |",
                r.span_bytes as f64 / (1u64 << 30) as f64,
                r.rows,
                r.pattern,
                r.gbps,
                r.gbps / memcpy
            );
        }
        sweeps.push(s);
    }
    if let Some(p) = out {
        let doc = serde_json::json!({
            "what": "zero-copy gather of rows (each rate names its row_bytes) drawn at random (and back to back, and in random pairs 1, 2, 4 or 64 KiB apart: patterns pairs+1k, pairs+2k, pairs+4k, pairs+64k) from spans of pinned host memory, driver pages against 2 MiB transparent huge pages registered with cuMemHostRegister and against host-NUMA memory of the virtual memory API (cuMemCreate + cuMemMap); best of 3 launches per point, a fresh draw each",
            "device": gpu.info().name,
            "memcpy_gbps": memcpy,
            "thp_enabled": enabled,
            "thp_defrag": defrag,
            "sweeps": sweeps,
        });
        std::fs::write(p, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    Ok(())
}
