//! Decoding through the paged cache: two sessions of different lengths are prefilled in one
//! ragged batch, then decoded for 16 steps, each step appending one token per session to
//! every layer and attending with `fathom:48`, with the second session rolled back by 3 tokens
//! half-way (`truncate`, as a rejected speculative draft); every output is checked against the CPU
//! reference of the same protocol (`fathom-plan`: importance, water-filling, the bit-plane
//! scan, each query head's own top-k, exact attention). Keys, values and queries are a
//! labelled synthetic workload (seeded uniform numbers), not model activations. Keys, values
//! and queries reach the cache as bf16 and f32 device buffers, as a model's do.
//!
//! ```text
//! cargo run --release --features cuda -p fathom-cuda --example paged_decode
//! ```
use fathom_cuda::cache::{AttendMethod, CacheConfig, KvRows, QueryRows};
use fathom_cuda::memory::DeviceBuffer;
use fathom_cuda::pages::PageConfig;
use fathom_cuda::prelude::*;
use fathom_cuda::{CudaError, Gpu, Method, ModelShape, PagedCache};
use fathom_plan::{calib::head_calib, KvView, SelectParams};
use fathom_store::{Dims, KeyStore};
use half::bf16;

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
    let cfg = CacheConfig {
        shape,
        pages: PageConfig {
            page_tokens: 1024,
            pages: 16,
            max_sessions: 4,
            max_tokens: 8192,
        },
        max_batch: 4,
        max_k: 128,
        row_cache: 0,
        residency: fathom_cuda::Residency::Host,
        pca_index: false,
        block_tables: false,
        host_pages: fathom_cuda::HostPages::Driver,
        options: Default::default(),
    };
    let mut cache = PagedCache::new(&gpu, cfg)?;
    let (a, b) = (cache.create()?, cache.create()?);
    // SYNTHETIC workload: a seeded generator stands in for the model's K, V and queries.
    let mut w = Workload {
        seed: 1,
        row: hkv * d,
        keys: vec![vec![Vec::new(); 2]; 2],
        vals: vec![vec![Vec::new(); 2]; 2],
    };
    let row = hkv * d;
    // A ragged prefill: 1500 and 3000 tokens in one batch.
    w.feed(&gpu, &mut cache, &[(0, 1500), (1, 3000)], [a, b])?;
    // σ² per layer and head from the first session's keys (a stand-in for a calibration).
    let bf = |x: &f32| bf16::from_f32(*x).to_f32();
    let mut calibs = Vec::new();
    for l in 0..2 {
        let kb: Vec<f32> = w.keys[0][l].iter().map(bf).collect();
        let qs: Vec<f32> = (0..8 * g * d).map(|_| w.rnd()).collect();
        let heads: Vec<_> = (0..hkv)
            .map(|h| head_calib(&KvView::head(&kb, hkv, d, h), &qs))
            .collect::<Result<_, _>>()?;
        cache.load_calibration(l, &heads)?;
        calibs.push(heads);
    }
    let params = SelectParams {
        sink: 4,
        local: 32,
        k: 128,
    };
    let method = AttendMethod::Scan(Method::Fathom(48.0));
    let (mut worst, mut heads, mut differ) = (0f64, 0usize, 0usize);
    for step in 0..16 {
        if step == 8 {
            // A speculative draft of 3 tokens rejected: session b rolls back, inside a block.
            let n = cache.len(b)? - 3;
            cache.truncate(b, n)?;
            for l in 0..2 {
                w.keys[1][l].truncate(n * row);
                w.vals[1][l].truncate(n * row);
            }
        }
        let ab = w.feed(&gpu, &mut cache, &[(0, 1), (1, 1)], [a, b])?;
        for (l, layer_calib) in calibs.iter().enumerate() {
            let q: Vec<f32> = (0..2 * hkv * g * d).map(|_| w.rnd()).collect();
            // Queries `[batch][Hq][D]` in, outputs `[batch][Hq][D]` f32 out, both on the device.
            let qd = DeviceBuffer::from_host(&gpu, &q)?;
            let mut od = DeviceBuffer::<f32>::zeros(&gpu, q.len())?;
            cache.attend(
                &ab,
                l,
                method,
                &params,
                &QueryRows { q: qd.view() },
                od.view_mut(),
            )?;
            let out = od.to_host()?;
            // The CPU reference of docs/SPEC.md §3–5 for each session and head.
            for s in 0..2 {
                let dbg = cache.debug_readback(&ab, s)?;
                let kb: Vec<f32> = w.keys[s][l].iter().map(bf).collect();
                let vb: Vec<f32> = w.vals[s][l].iter().map(bf).collect();
                let n = kb.len() / row;
                let store = KeyStore::from_keys(
                    Dims {
                        heads: hkv,
                        channels: d,
                    },
                    &kb,
                    None,
                )?;
                for h in 0..hkv {
                    let qh = &q[(s * hkv + h) * g * d..(s * hkv + h + 1) * g * d];
                    let w = fathom_plan::importance(&layer_calib[h].sigma2, qh, g)?;
                    let depths = fathom_plan::water_fill(&w, 48.0)?.depths;
                    let (scores, _) =
                        fathom_plan::scan::reference_scores(&store.view(), h, qh, g, &depths)?;
                    for gg in 0..g {
                        let row: Vec<f32> = scores[gg * n..(gg + 1) * n]
                            .iter()
                            .map(|&x| x as f32)
                            .collect();
                        let mut set = Vec::new();
                        fathom_plan::select_per_head(n - 1, &row, &params, &mut set)?;
                        // f32 GPU scores against f64 CPU scores may order a near-tie at the
                        // top-k boundary differently; such heads are counted, not compared.
                        let mid = params.middle(n - 1);
                        let cpu_mid: Vec<u32> = set
                            .iter()
                            .copied()
                            .filter(|&i| mid.contains(&(i as usize)))
                            .collect();
                        heads += 1;
                        if dbg.winners[h * g + gg] != cpu_mid {
                            differ += 1;
                            continue;
                        }
                        let mut want = vec![0f32; d];
                        let (kv, vv) = (KvView::head(&kb, hkv, d, h), KvView::head(&vb, hkv, d, h));
                        let qg = &qh[gg * d..(gg + 1) * d];
                        fathom_plan::attend(
                            qg,
                            kv,
                            vv,
                            &set,
                            1.0 / (d as f32).sqrt(),
                            None,
                            &mut want,
                        )?;
                        let o = ((s * hkv + h) * g + gg) * d;
                        worst = worst.max(fathom_plan::relative_error(&out[o..o + d], &want));
                    }
                }
            }
        }
    }
    let (bits, plans) = cache.plan_bits()?;
    println!(
        "sessions of {} and {} tokens after 16 decode steps (the second rolled back by 3); fathom:48 read {bits:.1} bits per token and KV head over {plans} plans; {differ} of {heads} query-head selections differ from the CPU's (near-ties); worst relative error of the others against the CPU reference {worst:.2e}",
        cache.len(a)?,
        cache.len(b)?
    );
    assert!(worst <= 1e-3, "GPU and CPU outputs disagree: {worst}");
    assert!(
        differ * 100 <= heads,
        "too many selections differ: {differ} of {heads}"
    );
    Ok(())
}

/// The SYNTHETIC workload: seeded uniform keys, values and queries in [-1, 1), and host
/// copies of every key and value per (session, layer) for the CPU reference.
struct Workload {
    seed: u64,
    row: usize,
    keys: Vec<Vec<Vec<f32>>>,
    vals: Vec<Vec<Vec<f32>>>,
}

impl Workload {
    fn rnd(&mut self) -> f32 {
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Reserves `batch = [(session index, tokens)]` and appends fresh keys and values to
    /// every layer, as bf16 rows `[rows][Hkv][D]` in device memory.
    fn feed(
        &mut self,
        gpu: &Gpu,
        cache: &mut PagedCache,
        batch: &[(usize, usize)],
        ids: [fathom_cuda::pages::SessionId; 2],
    ) -> Result<fathom_cuda::cache::AppendBatch, CudaError> {
        let plan: Vec<_> = batch.iter().map(|&(s, m)| (ids[s], m)).collect();
        let ab = cache.reserve(&plan)?;
        for l in 0..cache.config().shape.layers {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for &(s, m) in batch {
                let kk: Vec<f32> = (0..m * self.row).map(|_| self.rnd()).collect();
                let vv: Vec<f32> = (0..m * self.row).map(|_| self.rnd()).collect();
                self.keys[s][l].extend_from_slice(&kk);
                self.vals[s][l].extend_from_slice(&vv);
                k.extend(kk);
                v.extend(vv);
            }
            let up = |x: &[f32]| {
                let x: Vec<bf16> = x.iter().map(|&e| bf16::from_f32(e)).collect();
                DeviceBuffer::from_host(gpu, &x)
            };
            let (kd, vd) = (up(&k)?, up(&v)?);
            let rows = KvRows {
                k: kd.view(),
                v: vd.view(),
                rows: ab.rows,
            };
            cache.append(&ab, l, &rows)?;
        }
        Ok(ab)
    }
}
