//! GPU time of a decode step through the paged cache (every layer's append and attend) for
//! each method, in one run: fathom:48 against the 136-bit scans (ds:32, sparq:32), the full
//! 4-bit scan (exact) and dense attention. SYNTHETIC workload (seeded uniform K, V and
//! queries; σ² = 1/3; Double Sparsity's channels fixed to 0..D) at the Qwen3-8B attention
//! shape, `SESSIONS` sessions of `CONTEXT` tokens, k = 512, pages of 2048 tokens.
//!
//! ```text
//! cargo run --release --features cuda -p fathom-bench --example cache_bench -- CONTEXT SESSIONS [OUT.json]
//! ```
mod common;
use common::Uniform;
use cudarc::driver::sys;
use fathom_cuda::cache::{AttendMethod, KvRows, QueryRows, DEFAULT_PAGE_TOKENS};
use fathom_cuda::memory::DeviceBuffer;
use fathom_cuda::pages::SessionId;
use fathom_cuda::prelude::*;
use fathom_cuda::{Gpu, ModelShape, PagedCache};
use fathom_plan::scanner::HeadCalib;
use fathom_plan::SelectParams;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let context: usize = args.next().map_or(Ok(32768), |s| s.parse())?;
    let b: usize = args.next().map_or(Ok(1), |s| s.parse())?;
    let out_json = args.next();
    let gpu = Gpu::open(0)?;
    let stream = gpu.stream().clone();
    let shape = ModelShape {
        layers: 36,
        kv_heads: 8,
        group: 4,
        dim: 128,
    };
    let (nl, hkv, g, d) = (shape.layers, shape.kv_heads, shape.group, shape.dim);
    let methods = ["fathom:48", "ds:32", "sparq:32", "exact", "dense"];
    let (warm, timed) = (2usize, 8usize);
    let max_tokens = context + (warm + timed) * methods.len() + 8;
    let page = DEFAULT_PAGE_TOKENS;
    let cfg = common::timing_config(shape, b, max_tokens);
    let t0 = std::time::Instant::now();
    let mut cache = PagedCache::new(&gpu, cfg)?;
    let ids: Vec<SessionId> = (0..b).map(|_| cache.create()).collect::<Result<_, _>>()?;
    let mut rnd = Uniform::new(3);
    // Prefill in chunks of 8192 tokens per session (SYNTHETIC keys and values).
    let row = hkv * d;
    let chunk = 8192usize;
    let mut done = 0;
    while done < context {
        let m = chunk.min(context - done);
        let batch = cache.reserve(&ids.iter().map(|&s| (s, m)).collect::<Vec<_>>())?;
        for l in 0..nl {
            let k: Vec<f32> = rnd.vec(b * m * row);
            cache.append_host(&batch, l, &k, &k)?;
        }
        done += m;
    }
    for l in 0..nl {
        let heads = vec![
            HeadCalib {
                sigma2: vec![1.0 / 3.0; d],
                ds_channels: (0..d as u16).collect(),
                ..Default::default()
            };
            hkv
        ];
        cache.load_calibration(l, &heads)?;
    }
    let setup_s = t0.elapsed().as_secs_f64();
    let mut bufs = Vec::new();
    for _ in 0..nl {
        bufs.push((
            DeviceBuffer::from_host(&gpu, &rnd.vec(b * row))?,
            DeviceBuffer::from_host(&gpu, &rnd.vec(b * hkv * g * d))?,
            DeviceBuffer::<f32>::zeros(&gpu, b * hkv * g * d)?,
        ));
    }
    let params = SelectParams {
        sink: 4,
        local: 32,
        k: 512,
    };
    let decode: Vec<(SessionId, usize)> = ids.iter().map(|&s| (s, 1)).collect();
    let mut rows = Vec::new();
    let mut times = Vec::new();
    for m in methods {
        let am = AttendMethod::parse(m, d)?;
        if let AttendMethod::Scan(mm) = am {
            cache.prepare(mm)?;
        }
        let mut ms = Vec::new();
        for i in 0..warm + timed {
            let batch = cache.reserve(&decode)?;
            let e0 = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            for (l, (k, q, o)) in bufs.iter_mut().enumerate() {
                let rows = KvRows {
                    k: k.view(),
                    v: k.view(),
                    rows: b,
                };
                cache.append(&batch, l, &rows)?;
                let q = QueryRows { q: q.view() };
                cache.attend(&batch, l, am, &params, &q, o.view_mut())?;
            }
            let e1 = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            e1.synchronize()?;
            if i >= warm {
                ms.push(e0.elapsed_ms(&e1)? as f64);
            }
        }
        ms.sort_by(f64::total_cmp);
        let med = ms[ms.len() / 2];
        println!("{m:<10} {med:9.3} ms per step (GPU, median of {timed})");
        times.push((m, med));
    }
    let t = |name: &str| times.iter().find(|x| x.0 == name).map_or(f64::NAN, |x| x.1);
    for (m, med) in &times {
        rows.push(format!(
            "{{\"method\": \"{m}\", \"gpu_ms\": {med:.4}, \"speedup_vs_ds32\": {:.4}, \"speedup_vs_sparq32\": {:.4}, \"speedup_vs_exact\": {:.4}, \"speedup_vs_dense\": {:.4}}}",
            t("ds:32") / med,
            t("sparq:32") / med,
            t("exact") / med,
            t("dense") / med
        ));
    }
    let doc = format!(
        "{{\"what\": \"GPU time of one decode step (36 layers x (append + attend)) through fathom_cuda::PagedCache per method, one run; SYNTHETIC workload (uniform K/V/queries) at the qwen3-8b attention shape; k = 512, sink 4, local 32, pages of {page}\", \"device\": \"{}\", \"context\": {context}, \"sessions\": {b}, \"setup_s\": {setup_s:.1}, \"results\": [{}]}}\n",
        gpu.info().name,
        rows.join(", ")
    );
    print!("{doc}");
    if let Some(p) = out_json {
        std::fs::write(p, doc)?;
    }
    Ok(())
}
