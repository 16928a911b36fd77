//! One append and one attend of every method the paged cache runs, in one small cache made for
//! all of them (`CacheConfig::serving`: the PCA index for Loki, the block tables for landmark
//! and Quest), on both select paths (a cache each): the workload `compute-sanitizer` checks
//! (memcheck, racecheck, initcheck, synccheck; `scripts/device/engine.sh sanitize`). Two
//! sessions of different lengths are prefilled in one ragged batch from host slices, then take
//! one decode token each from bf16 device rows; every method attends twice from device
//! queries to a device output, and every output must be finite. The device tests (`tests/cache_gpu.rs`) compare the same paths with the CPU
//! references; this only exercises them once each, fast enough under a sanitizer. Keys, values
//! and queries are a labelled synthetic workload (seeded uniform numbers).
//!
//! ```text
//! cargo run --release --features cuda -p fathom-cuda --example every_method
//! ```
use fathom_cuda::cache::{AttendMethod, CacheConfig, KvRows, QueryRows, SelectPath};
use fathom_cuda::memory::DeviceBuffer;
use fathom_cuda::pages::PageConfig;
use fathom_cuda::prelude::*;
use fathom_cuda::{CudaError, Gpu, Method, ModelShape, PagedCache, Residency};
use fathom_plan::{calib::head_calib, KvView, SelectParams};
use rand::{rngs::StdRng, Rng, SeedableRng};

const METHODS: [&str; 9] = [
    "dense",
    "exact",
    "fathom:48",
    "sparq:16",
    "ds:16",
    "loki:32",
    "thumb2",
    "landmark",
    "quest",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e @ (CudaError::NotCompiledWithCuda | CudaError::NoDevice { .. })) => {
            eprintln!("no GPU path ({e}): nothing to run");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let shape = ModelShape {
        layers: 2,
        kv_heads: 2,
        group: 4,
        dim: 128,
    };
    let (hkv, g, d) = (shape.kv_heads, shape.group, shape.dim);
    let methods: Vec<AttendMethod> = METHODS
        .iter()
        .map(|m| AttendMethod::parse(m, d))
        .collect::<Result<_, _>>()?;
    let scans: Vec<Method> = methods
        .iter()
        .filter_map(|m| match m {
            AttendMethod::Scan(s) => Some(*s),
            AttendMethod::Dense => None,
        })
        .collect();
    let residency = std::env::args()
        .nth(1)
        .map(|r| Residency::parse(&r))
        .transpose()?
        .unwrap_or(Residency::Host);
    for path in [
        SelectPath::Scores,
        SelectPath::Filtered {
            min_middle_tokens: 64,
            keep_scores: false,
        },
    ] {
        let mut cfg = CacheConfig {
            shape,
            pages: PageConfig {
                page_tokens: 256,
                pages: 24,
                max_sessions: 2,
                max_tokens: 2048,
            },
            max_batch: 2,
            max_k: 64,
            row_cache: 64,
            residency,
            pca_index: false,
            block_tables: false,
            host_pages: fathom_cuda::HostPages::Driver,
            options: Default::default(),
        }
        .serving(&scans);
        cfg.options.select = path;
        let mut cache = PagedCache::new(&gpu, cfg)?;
        // SYNTHETIC workload: seeded uniform keys with a per-channel spread, values and queries.
        let mut rng = StdRng::seed_from_u64(3);
        let mut keys = |n: usize| -> Vec<f32> {
            (0..n * hkv * d)
                .map(|i| rng.gen_range(-1.0..1.0f32) * (0.1 + (i % d) as f32 / d as f32))
                .collect()
        };
        // The calibration (σ², DS channels, the PCA basis) before the first append.
        let ck = keys(512);
        let mut rq = StdRng::seed_from_u64(4);
        let cq: Vec<f32> = (0..16 * g * d).map(|_| rq.gen_range(-1.0..1.0)).collect();
        let heads: Vec<_> = (0..hkv)
            .map(|h| head_calib(&KvView::head(&ck, hkv, d, h), &cq))
            .collect::<Result<_, _>>()?;
        for l in 0..shape.layers {
            cache.load_calibration(l, &heads)?;
        }
        for &m in &scans {
            cache.prepare(m)?;
        }
        let (a, b) = (cache.create()?, cache.create()?);
        // A ragged prefill (300 and 1000 tokens) from host slices.
        let ab = cache.reserve(&[(a, 300), (b, 1000)])?;
        for l in 0..shape.layers {
            let k = keys(ab.rows);
            let v: Vec<f32> = k.iter().map(|x| 2.0 * x - 0.25).collect();
            cache.append_host(&ab, l, &k, &v)?;
        }
        // One decode token each, from bf16 rows in device memory.
        let ab = cache.reserve(&[(a, 1), (b, 1)])?;
        for l in 0..shape.layers {
            let k: Vec<half::bf16> = keys(2).into_iter().map(half::bf16::from_f32).collect();
            let v: Vec<half::bf16> = k.iter().map(|x| *x * half::bf16::from_f32(0.5)).collect();
            let (kd, vd) = (
                DeviceBuffer::from_host(&gpu, &k)?,
                DeviceBuffer::from_host(&gpu, &v)?,
            );
            let rows = KvRows {
                k: kd.view(),
                v: vd.view(),
                rows: 2,
            };
            cache.append(&ab, l, &rows)?;
        }
        let params = SelectParams {
            sink: 4,
            local: 32,
            k: 48,
        };
        let q: Vec<f32> = (0..2 * hkv * g * d)
            .map(|_| rq.gen_range(-1.0..1.0))
            .collect();
        let qd = DeviceBuffer::from_host(&gpu, &q)?;
        let mut od = DeviceBuffer::<f32>::zeros(&gpu, q.len())?;
        for (name, &m) in METHODS.iter().zip(&methods) {
            // Twice: the second attend of a row on the filtered path filters.
            for _ in 0..2 {
                let qr = QueryRows { q: qd.view() };
                cache.attend(&ab, 0, m, &params, &qr, od.view_mut())?;
                let out = od.to_host()?;
                if let Some(i) = out.iter().position(|x| !x.is_finite()) {
                    return Err(format!("{name}: output {i} is {}", out[i]).into());
                }
            }
            println!("{:<10} {:<16} ok", name, path.label());
        }
        let c = cache.select_counters()?;
        println!(
            "every method attended on the {} path ({residency:?}); filtered rows {}, fallbacks {}; faults {:?}",
            path.label(),
            c.filtered,
            c.fallbacks,
            cache.faults()?
        );
    }
    Ok(())
}
