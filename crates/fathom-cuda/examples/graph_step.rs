//! A whole decode step through the paged cache (every layer's append and attend) captured as
//! one CUDA graph and replayed, against the same step launched kernel by kernel: the launch
//! overhead a graph removes. SYNTHETIC workload (seeded uniform K, V and queries; σ² from the
//! keys) at the Qwen3-8B attention shape (36 layers, 8 KV heads, G = 4, D = 128), 4 sessions.
//!
//! ```text
//! cargo run --release --features cuda -p fathom-cuda --example graph_step -- [CONTEXT] [OUT.json] [GATHER_THREADS] [GATHER_SHARE]
//! ```
//!
//! `GATHER_THREADS` > 0 turns the host gather on (`CacheOptions::host_gather_threads`), bringing
//! `GATHER_SHARE` percent of the misses (`host_gather_share`; default 100): the graph then
//! holds the gather's list, publish and copy kernels, served by host threads while it
//! replays. Last, a calibration loaded after the capture must make the graph refuse to replay.
use std::time::Instant;

use fathom_cuda::cache::{AttendMethod, CacheConfig, CacheOptions, KvRows, QueryRows};
use fathom_cuda::memory::DeviceBuffer;
use fathom_cuda::pages::{PageConfig, SessionId};
use fathom_cuda::prelude::*;
use fathom_cuda::{CudaError, Gpu, Method, ModelShape, PagedCache};
use fathom_plan::scanner::HeadCalib;
use fathom_plan::SelectParams;

/// Seeded uniform numbers in [-1, 1) (a 64-bit LCG's top 24 bits): the SYNTHETIC workload.
struct Uniform(u64);

impl Uniform {
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let context: usize = args.next().map_or(Ok(4096), |s| s.parse())?;
    let out_json = args.next();
    let gather: usize = args.next().map_or(Ok(0), |s| s.parse())?;
    let share: u32 = args.next().map_or(Ok(100), |s| s.parse())?;
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e @ (CudaError::NotCompiledWithCuda | CudaError::NoDevice { .. })) => {
            eprintln!("no GPU path ({e}): nothing to run");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let shape = ModelShape {
        layers: 36,
        kv_heads: 8,
        group: 4,
        dim: 128,
    };
    let (nl, hkv, g, d) = (shape.layers, shape.kv_heads, shape.group, shape.dim);
    let b = 4usize;
    let steps = 30usize;
    let max_tokens = context + steps + 64;
    let page = fathom_cuda::cache::DEFAULT_PAGE_TOKENS;
    // `b` sessions in pages of DEFAULT_PAGE_TOKENS in host memory, k ≤ 512, no row cache.
    let cfg = CacheConfig {
        shape,
        pages: PageConfig {
            page_tokens: page,
            pages: b * max_tokens.div_ceil(page) + b,
            max_sessions: b,
            max_tokens,
        },
        max_batch: b,
        max_k: 512,
        row_cache: 0,
        residency: fathom_cuda::Residency::Host,
        pca_index: false,
        block_tables: false,
        host_pages: fathom_cuda::HostPages::Driver,
        options: CacheOptions {
            host_gather_threads: gather,
            host_gather_share: share,
            ..CacheOptions::default()
        },
    };
    let t0 = Instant::now();
    let mut cache = PagedCache::new(&gpu, cfg)?;
    let ids: Vec<SessionId> = (0..b).map(|_| cache.create()).collect::<Result<_, _>>()?;
    let mut rnd = Uniform(7);
    // Prefill every session to `context` tokens (SYNTHETIC keys and values).
    let row = hkv * d;
    let pre = cache.reserve(&ids.iter().map(|&s| (s, context)).collect::<Vec<_>>())?;
    for l in 0..nl {
        let k: Vec<f32> = rnd.vec(b * context * row);
        let v: Vec<f32> = rnd.vec(b * context * row);
        cache.append_host(&pre, l, &k, &v)?;
        // Uniform keys in [-1, 1): σ² = 1/3 per channel.
        let heads = vec![
            HeadCalib {
                sigma2: vec![1.0 / 3.0; d],
                ..Default::default()
            };
            hkv
        ];
        cache.load_calibration(l, &heads)?;
    }
    let setup_s = t0.elapsed().as_secs_f64();
    // Device buffers of one step: K, V, queries and outputs per layer.
    let mut bufs = Vec::new();
    for _ in 0..nl {
        let k = DeviceBuffer::from_host(&gpu, &rnd.vec(b * row))?;
        let v = DeviceBuffer::from_host(&gpu, &rnd.vec(b * row))?;
        let q = DeviceBuffer::from_host(&gpu, &rnd.vec(b * hkv * g * d))?;
        let o = DeviceBuffer::<f32>::zeros(&gpu, b * hkv * g * d)?;
        bufs.push((k, v, q, o));
    }
    let params = SelectParams {
        sink: 4,
        local: 32,
        k: 512,
    };
    let method = AttendMethod::Scan(Method::Fathom(48.0));
    let mut layer_step = |cache: &mut PagedCache, batch: &fathom_cuda::cache::AppendBatch| {
        for (l, (k, v, q, o)) in bufs.iter_mut().enumerate() {
            let rows = KvRows {
                k: k.view(),
                v: v.view(),
                rows: b,
            };
            cache.append(batch, l, &rows)?;
            let q = QueryRows { q: q.view() };
            cache.attend(batch, l, method, &params, &q, o.view_mut())?;
        }
        Ok::<(), CudaError>(())
    };
    let decode: Vec<(SessionId, usize)> = ids.iter().map(|&s| (s, 1)).collect();
    // Plain launches.
    let (mut plain_wall, mut plain_enqueue) = (Vec::new(), Vec::new());
    for i in 0..steps / 2 + 3 {
        let batch = cache.reserve(&decode)?;
        let t = Instant::now();
        layer_step(&mut cache, &batch)?;
        let e = t.elapsed().as_secs_f64() * 1e3;
        cache.synchronize()?;
        if i >= 3 {
            plain_enqueue.push(e);
            plain_wall.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    // One captured step, replayed.
    let batch = cache.reserve(&decode)?;
    let graph = cache.capture(&batch, |c| layer_step(c, &batch))?;
    cache.replay(&batch, &graph)?;
    cache.synchronize()?;
    let (mut graph_wall, mut graph_enqueue) = (Vec::new(), Vec::new());
    let mut batch = batch;
    for _ in 0..steps / 2 {
        batch = cache.reserve(&decode)?;
        let t = Instant::now();
        cache.replay(&batch, &graph)?;
        let e = t.elapsed().as_secs_f64() * 1e3;
        cache.synchronize()?;
        graph_enqueue.push(e);
        graph_wall.push(t.elapsed().as_secs_f64() * 1e3);
    }
    // The graph computes what plain launches compute: re-attend the last layer of the last
    // replayed step (its batch is still the current one) by hand and compare.
    let last = nl - 1;
    let mut again = DeviceBuffer::<f32>::zeros(&gpu, b * hkv * g * d)?;
    let q = QueryRows {
        q: bufs[last].2.view(),
    };
    cache.attend(&batch, last, method, &params, &q, again.view_mut())?;
    let by_graph = bufs[last].3.to_host()?;
    let by_hand = again.to_host()?;
    let rel = fathom_plan::relative_error(&by_graph, &by_hand);
    assert!(rel <= 1e-5, "graph and plain outputs differ: {rel}");
    if let Some(r) = cache.host_gather_stats()? {
        println!("host gather: {r:?}");
        assert_eq!(
            (r.overflows, r.timeouts, r.served.bad_offsets),
            (0, 0, 0),
            "host gather faults"
        );
    }
    let (pw, pe, gw, ge) = (
        median(&mut plain_wall),
        median(&mut plain_enqueue),
        median(&mut graph_wall),
        median(&mut graph_enqueue),
    );
    let (bits, plans) = cache.plan_bits()?;
    let line = format!(
        "{{\"what\": \"one decode step (36 layers x (append + fathom:48 attend)) of 4 sessions, plain launches against one CUDA graph replay; SYNTHETIC workload at the qwen3-8b attention shape\", \"device\": \"{}\", \"context\": {context}, \"page_tokens\": {page}, \"plain_step_ms\": {pw:.4}, \"plain_enqueue_ms\": {pe:.4}, \"graph_step_ms\": {gw:.4}, \"graph_enqueue_ms\": {ge:.4}, \"step_ratio_plain_over_graph\": {:.4}, \"enqueue_ratio_plain_over_graph\": {:.3}, \"mean_plan_bits\": {bits:.3}, \"plans\": {plans}, \"setup_s\": {setup_s:.1}, \"graph_vs_plain_output_rel_error\": {rel:.3e}, \"host_gather_threads\": {gather}, \"host_gather_share\": {share}}}",
        gpu.info().name,
        pw / gw,
        pe / ge
    );
    println!("{line}");
    // A graph that read a calibration since replaced is refused, not replayed.
    let heads = vec![
        HeadCalib {
            sigma2: vec![0.25; d],
            ..Default::default()
        };
        hkv
    ];
    cache.load_calibration(0, &heads)?;
    let batch = cache.reserve(&decode)?;
    match cache.replay(&batch, &graph) {
        Err(e) if e.to_string().contains("capture the step again") => {
            println!("stale graph refused: {e}")
        }
        other => return Err(format!("a stale graph was not refused: {other:?}").into()),
    }
    if let Some(p) = out_json {
        std::fs::write(p, format!("{line}\n"))?;
    }
    Ok(())
}
