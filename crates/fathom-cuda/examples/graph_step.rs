//! A whole decode step through the paged cache (every layer's append and attend) captured as
//! one CUDA graph and replayed, against the same step launched kernel by kernel: the launch
//! overhead a graph removes. SYNTHETIC workload (seeded uniform K, V and queries; σ² from the
//! keys) at the Qwen3-8B attention shape (36 layers, 8 KV heads, G = 4, D = 128), 4 sessions.
//!
//! ```text
//! cargo run --release --features cuda -p fathom-cuda --example graph_step -- [CONTEXT] [OUT.json] [GATHER_THREADS] [GATHER_SHARE]
//! ```
//!
//! `GATHER_THREADS` > 0 turns the host gather on (`PagedCache::set_host_gather`), bringing
//! `GATHER_SHARE` percent of the misses (`set_host_gather_share`; default 100): the graph then
//! holds the gather's list, publish and copy kernels, served by host threads while it
//! replays. Last, a setting changed after the capture must make the graph refuse to replay.
use std::time::Instant;

mod common;
use common::Uniform;

use cudarc::driver::{CudaSlice, DevicePtr};
use fathom_cuda::cache::{AttendMethod, KvDtype, KvRows, QueryRows};
use fathom_cuda::pages::SessionId;
use fathom_cuda::{Gpu, Method, ModelShape, PagedCache};
use fathom_plan::scanner::HeadCalib;
use fathom_plan::SelectParams;

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
    let gpu = Gpu::open(0)?;
    let stream = gpu.stream().clone();
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
    let cfg = common::timing_config(shape, b, max_tokens);
    let t0 = Instant::now();
    let mut cache = PagedCache::new(&gpu, cfg)?;
    let ids: Vec<SessionId> = (0..b).map(|_| cache.create()).collect::<Result<_, _>>()?;
    let mut rnd = Uniform::new(7);
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
    cache.set_host_gather(gather)?;
    cache.set_host_gather_share(share)?;
    // Device buffers of one step: K, V, queries and outputs per layer.
    let mut bufs = Vec::new();
    for _ in 0..nl {
        let k = rnd.upload(&stream, b * row)?;
        let v = rnd.upload(&stream, b * row)?;
        let q = rnd.upload(&stream, b * hkv * g * d)?;
        let o: CudaSlice<f32> = stream.alloc_zeros(b * hkv * g * d)?;
        bufs.push((k, v, q, o));
    }
    let ptr = |s: &CudaSlice<f32>| s.device_ptr(&stream).0;
    let ptrs: Vec<(u64, u64, u64, u64)> = bufs
        .iter()
        .map(|(k, v, q, o)| (ptr(k), ptr(v), ptr(q), ptr(o)))
        .collect();
    let params = SelectParams {
        sink: 4,
        local: 32,
        k: 512,
    };
    let method = AttendMethod::Scan(Method::Fathom(48.0));
    let layer_step = |cache: &mut PagedCache, batch: &fathom_cuda::cache::AppendBatch| {
        for (l, &(k, v, q, o)) in ptrs.iter().enumerate() {
            cache.append(
                batch,
                l,
                &KvRows {
                    k,
                    v,
                    dtype: KvDtype::F32,
                    rows: b,
                },
            )?;
            cache.attend(
                batch,
                l,
                method,
                &params,
                &QueryRows {
                    q,
                    dtype: KvDtype::F32,
                },
                o,
            )?;
        }
        Ok::<(), fathom_cuda::CudaError>(())
    };
    let decode: Vec<(SessionId, usize)> = ids.iter().map(|&s| (s, 1)).collect();
    // Plain launches.
    let (mut plain_wall, mut plain_enqueue) = (Vec::new(), Vec::new());
    for i in 0..steps / 2 + 3 {
        let batch = cache.reserve(&decode)?;
        let t = Instant::now();
        layer_step(&mut cache, &batch)?;
        let e = t.elapsed().as_secs_f64() * 1e3;
        stream.synchronize()?;
        if i >= 3 {
            plain_enqueue.push(e);
            plain_wall.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    // One captured step, replayed.
    let batch = cache.reserve(&decode)?;
    let graph = cache.capture(&batch, |c| layer_step(c, &batch))?;
    cache.replay(&batch, &graph)?;
    stream.synchronize()?;
    let (mut graph_wall, mut graph_enqueue) = (Vec::new(), Vec::new());
    let mut batch = batch;
    for _ in 0..steps / 2 {
        batch = cache.reserve(&decode)?;
        let t = Instant::now();
        cache.replay(&batch, &graph)?;
        let e = t.elapsed().as_secs_f64() * 1e3;
        stream.synchronize()?;
        graph_enqueue.push(e);
        graph_wall.push(t.elapsed().as_secs_f64() * 1e3);
    }
    // The graph computes what plain launches compute: re-attend the last layer of the last
    // replayed step (its batch is still the current one) by hand and compare.
    let last = nl - 1;
    let (_, _, q, o) = ptrs[last];
    let again: CudaSlice<f32> = stream.alloc_zeros(b * hkv * g * d)?;
    cache.attend(
        &batch,
        last,
        method,
        &params,
        &QueryRows {
            q,
            dtype: KvDtype::F32,
        },
        ptr(&again),
    )?;
    stream.synchronize()?;
    let by_graph = stream.clone_dtoh(&bufs[last].3)?;
    let by_hand = stream.clone_dtoh(&again)?;
    let _ = o;
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
    // A graph recorded under other settings is refused, not replayed.
    cache.set_scan_vector_words(3 - cache.scan_vector_words())?;
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
