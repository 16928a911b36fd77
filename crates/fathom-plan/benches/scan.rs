//! Planes' bytes read per second by the CPU scan, beside two memcpy baselines in the same
//! run:
//!
//! - `memcpy/<B>`: a memcpy of the **same byte count** as the scan reads — a few MiB, so it
//!   is cache-resident and flatters memcpy (upper bound on what any pass over those bytes
//!   could reach);
//! - `memcpy_dram/256MiB`: a memcpy of a 256 MiB buffer (far beyond the LLC), reported in
//!   decimal GB/s, the DRAM-streaming figure.
//!
//! Workload: **synthetic** keys with heavy-tailed channel variances, D = 128, G = 4, one
//! KV head, a Fathom plan at B = 48 and B = 92 bits. The scan also writes `G·n` f32 scores
//! (16 MiB at 1M tokens), which the byte count does not include. Numbers on a shared
//! machine are noisy: repeat and take the best.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fathom_plan::scan::{bytes_read, scan};
use fathom_store::{Dims, KeyStore};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn bench(c: &mut Criterion) {
    let (d, g) = (128usize, 4usize);
    let n: usize = std::env::var("FATHOM_BENCH_TOKENS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1 << 20);
    let mut rng = StdRng::seed_from_u64(1);
    let scale: Vec<f32> = (0..d).map(|_| rng.gen_range(-2.5f32..2.5).exp()).collect();
    let keys: Vec<f32> = (0..n * d)
        .map(|i| rng.gen_range(-1.0f32..1.0) * scale[i % d])
        .collect();
    let store = KeyStore::from_keys(
        Dims {
            heads: 1,
            channels: d,
        },
        &keys,
        None,
    )
    .unwrap();
    drop(keys);
    let view = store.view();
    let queries: Vec<f32> = (0..g * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let sigma2: Vec<f32> = scale.iter().map(|s| s * s / 3.0).collect();
    let w: Vec<f32> = (0..d)
        .map(|c| sigma2[c] * (0..g).map(|h| queries[h * d + c].powi(2)).sum::<f32>())
        .collect();
    let mut out = vec![0f32; g * n];
    let mut group = c.benchmark_group("scan_vs_memcpy");
    group.sample_size(20);
    for budget in [48.0f32, 92.0] {
        let plan = fathom_plan::water_fill(&w, budget).unwrap();
        let bytes = bytes_read(&plan.depths, n);
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_with_input(
            BenchmarkId::new("scan", budget as u32),
            &plan.depths,
            |bch, depths| bch.iter(|| scan(&view, 0, &queries, g, depths, &mut out).unwrap()),
        );
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        group.bench_with_input(
            BenchmarkId::new("memcpy", budget as u32),
            &bytes,
            |bch, _| {
                bch.iter(|| {
                    dst.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box(&mut dst);
                })
            },
        );
    }
    // DRAM-sized copy: 256 MiB each way, touched once before timing.
    let big = 256usize << 20;
    let src = vec![1u8; big];
    let mut dst = vec![0u8; big];
    group.sample_size(10);
    group.throughput(Throughput::BytesDecimal(big as u64));
    group.bench_function("memcpy_dram/256MiB", |bch| {
        bch.iter(|| {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
