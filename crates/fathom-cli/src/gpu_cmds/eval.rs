//! `fathom ruler` and `fathom agent-steps` on the GPU (`--device cuda`): the methods the GPU
//! path runs, and [`GpuEval`], the batched backend that decodes every method's forks of a
//! sample through the paged cache.

use super::*;

/// Refuses, naming them, the methods the GPU path does not run (the CPU runtime's variants and
/// ablations, such as `fathom-klt:B` or `loki-f16:R`; every method of the GPU step grammar,
/// `fathom_cuda::Method`, runs): checked before the model loads.
pub fn check_gpu_methods(methods: &[String]) -> Result<()> {
    let refused: Vec<&String> = methods
        .iter()
        .filter(|m| {
            // A name that does not parse at all is reported later, with the model's D.
            let m = m.trim();
            fathom_plan::method::MethodSpec::parse(m, 256).is_ok_and(|s| s != MethodSpec::Dense)
                && fathom_cuda::Method::parse(m, 256).is_err()
        })
        .collect();
    if !refused.is_empty() {
        bail!(
            "--device cuda: the GPU path does not run {}; remove them from --methods (or run them with --device cpu)",
            refused.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(())
}

/// One method's batch of branches: each branch's output, the batch's seconds and the row
/// counters it added.
type MethodBatch = (
    Vec<fathom_gpu::branch::BranchOut>,
    f64,
    fathom_cuda::cache::RowCounters,
);

/// The downstream tasks' branches on the GPU (`fathom ruler|agent-steps --device cuda`): the
/// sample's dense prefill on the GPU forward, then one fork per method (fathom_gpu::branch).
pub struct GpuEval {
    dec: GpuDecoder,
    atts: Vec<Attention>,
    /// Row-cache slots per (session, layer, KV head) (0: none).
    pub row_cache: usize,
    /// Per method, the row counters since [`GpuEval::take_row_counters`].
    rows: Vec<fathom_cuda::cache::RowCounters>,
    /// The device's name, for the results.
    pub device: String,
    _gpu: Gpu,
}

impl GpuEval {
    /// Opens the GPU, uploads the model and loads the calibration of every global layer.
    /// `methods` are the run's method names in order; a method the GPU path does not run is
    /// refused here, before any work. With a Loki method the cache keeps the PCA index, whose
    /// basis the calibration loads before any session; with landmark or Quest, the block
    /// tables. `row_cache` slots per (session, layer, KV head) of HBM row cache (0: none),
    /// which changes no output; its hits are counted per method.
    pub fn new(
        model_path: &std::path::Path,
        head_dim: usize,
        methods: &[String],
        params: SelectParams,
        max_tokens: usize,
        calib: Option<&fathom_eval::decode::LayerCalib>,
        row_cache: usize,
    ) -> Result<GpuEval> {
        check_gpu_methods(methods)?;
        let atts = methods
            .iter()
            .map(|m| {
                Ok(Attention {
                    method: AttendMethod::parse(m, head_dim)?,
                    params,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let gpu = Gpu::open(0).context("--device cuda needs a GPU")?;
        let weights = DenseWeights::load(model_path)?;
        // A group's roots and their forks of one method alive at once.
        let g = Self::GROUP;
        let mut dcfg = DecoderConfig::new(2 * g, max_tokens);
        dcfg.max_batch = g;
        dcfg.max_k = params.k.max(1).min(max_tokens);
        let per = max_tokens.div_ceil(dcfg.page_tokens);
        dcfg.pages = Some(g * (per + 1) + g + 8);
        dcfg.row_cache = row_cache;
        serve_methods(&mut dcfg, &atts);
        let mut dec = GpuDecoder::new(&gpu, &weights, dcfg)?;
        if let Some(c) = calib {
            for (l, heads) in c.heads.iter().enumerate() {
                if !heads.is_empty() {
                    dec.cache_mut()?.load_calibration(l, heads)?;
                }
            }
        }
        Ok(GpuEval {
            dec,
            rows: vec![Default::default(); atts.len()],
            atts,
            row_cache,
            device: gpu.info().name.clone(),
            _gpu: gpu,
        })
    }

    /// Samples whose branches decode in one batch (bounds the pinned pages a group holds).
    pub const GROUP: usize = 20;

    /// Per method, the union rows and row-cache hits of its branches since the last call (the
    /// cache's counters around each method's batch), and zero for the next call.
    fn take_row_counters(&mut self) -> Vec<fathom_cuda::cache::RowCounters> {
        let zero = vec![Default::default(); self.rows.len()];
        std::mem::replace(&mut self.rows, zero)
    }

    /// Adds each method's row counters since the last call to `rows[method]` as one tally at
    /// this cache's size (none for a method that fetched no union, or without a row cache).
    pub fn add_row_counters(&mut self, rows: &mut [Vec<RowCacheTally>]) {
        for (acc, rc) in rows.iter_mut().zip(self.take_row_counters()) {
            if self.row_cache > 0 && rc.rows > 0 {
                acc.push(RowCacheTally::new(self.row_cache, rc.rows, rc.hits));
            }
        }
    }

    /// One method's batch through `run`: its branches, seconds and the row counters it added.
    fn counted(
        dec: &mut GpuDecoder,
        run: impl FnOnce(&mut GpuDecoder) -> Result<Vec<fathom_gpu::branch::BranchOut>>,
    ) -> Result<MethodBatch> {
        let r0 = dec.cache_mut()?.row_counters()?;
        let t = Instant::now();
        let outs = run(dec)?;
        let secs = t.elapsed().as_secs_f64();
        let r1 = dec.cache_mut()?.row_counters()?;
        let rows = fathom_cuda::cache::RowCounters {
            rows: r1.rows - r0.rows,
            hits: r1.hits - r0.hits,
        };
        Ok((outs, secs, rows))
    }

    /// Per prompt, its dense prefill on the GPU and each method's greedy branch from it, the
    /// prompts in groups of [`GpuEval::GROUP`] whose branches of one method decode in one batch:
    /// each prefill's seconds and `[prompt][method]` = (branch, seconds: the batch's time
    /// shared equally).
    #[allow(clippy::type_complexity)]
    pub fn greedy_batches(
        &mut self,
        prompts: &[&[u32]],
        max_new: usize,
        stop_tokens: &[u32],
        stop: &dyn Fn(&[u32]) -> bool,
    ) -> Result<(Vec<f64>, Vec<Vec<(fathom_eval::decode::Branch, f64)>>)> {
        self.batches(prompts, |dec, atts, roots| {
            let r: Vec<(fathom_cuda::pages::SessionId, &[f32])> =
                roots.iter().map(|(s, l)| (*s, &l[..])).collect();
            atts.iter()
                .map(|att| {
                    Self::counted(dec, |dec| {
                        Ok(fathom_gpu::branch::greedy(
                            dec,
                            &r,
                            att,
                            max_new,
                            stop_tokens,
                            stop,
                        )?)
                    })
                })
                .collect()
        })
    }

    /// As [`GpuEval::greedy_batches`], teacher-forced on `forced[i]` after prompt `i`.
    #[allow(clippy::type_complexity)]
    pub fn forced_batches(
        &mut self,
        prompts: &[&[u32]],
        forced: &[&[u32]],
    ) -> Result<(Vec<f64>, Vec<Vec<(fathom_eval::decode::Branch, f64)>>)> {
        if forced.len() != prompts.len() {
            bail!("one forced continuation per prompt");
        }
        let mut next = 0;
        self.batches(prompts, |dec, atts, roots| {
            let f = &forced[next..next + roots.len()];
            next += roots.len();
            let ids: Vec<fathom_cuda::pages::SessionId> = roots.iter().map(|r| r.0).collect();
            atts.iter()
                .map(|att| {
                    Self::counted(dec, |dec| {
                        Ok(fathom_gpu::branch::forced(dec, &ids, att, f)?)
                    })
                })
                .collect()
        })
    }

    /// Groups of prompts: prefill each (timed), run `per_group` (one result list and its
    /// seconds per method), free the roots.
    #[allow(clippy::type_complexity)]
    fn batches(
        &mut self,
        prompts: &[&[u32]],
        mut per_group: impl FnMut(
            &mut GpuDecoder,
            &[Attention],
            &[(fathom_cuda::pages::SessionId, Vec<f32>)],
        ) -> Result<Vec<MethodBatch>>,
    ) -> Result<(Vec<f64>, Vec<Vec<(fathom_eval::decode::Branch, f64)>>)> {
        let mut pre_s = Vec::with_capacity(prompts.len());
        let mut out = Vec::with_capacity(prompts.len());
        for group in prompts.chunks(Self::GROUP) {
            let mut roots = Vec::with_capacity(group.len());
            for p in group {
                let t = Instant::now();
                let s = self.dec.create()?;
                roots.push((s, self.dec.prefill(s, p)?));
                pre_s.push(t.elapsed().as_secs_f64());
            }
            let r = per_group(&mut self.dec, &self.atts, &roots);
            for (s, _) in &roots {
                self.dec.free(*s)?;
            }
            let per_method = r?;
            for (acc, (_, _, rc)) in self.rows.iter_mut().zip(&per_method) {
                acc.rows += rc.rows;
                acc.hits += rc.hits;
            }
            for i in 0..group.len() {
                out.push(
                    per_method
                        .iter()
                        .map(|(outs, secs, _)| {
                            (Self::to_branch(outs[i].clone()), secs / group.len() as f64)
                        })
                        .collect(),
                );
            }
        }
        Ok((pre_s, out))
    }

    fn to_branch(o: fathom_gpu::branch::BranchOut) -> fathom_eval::decode::Branch {
        fathom_eval::decode::Branch {
            tokens: o.tokens,
            stats: fathom_eval::decode::BranchStats {
                bits_sum: o.bits_sum,
                scans: o.scans,
                selected_sum: o.selected_sum,
                visible_sum: o.visible_sum,
                // The GPU counts rows per method batch, not per branch (GpuEval::take_row_counters).
                ..Default::default()
            },
        }
    }
}

/// The downstream runs' batched backend ([`fathom_eval::ruler::run`],
/// [`fathom_eval::agent::run`]): [`GpuEval`]'s batches.
impl fathom_eval::runner::BatchedBackend for GpuEval {
    fn name(&self) -> &str {
        "GPU"
    }

    fn greedy(
        &mut self,
        prompts: &[&[u32]],
        max_new: usize,
        stop_tokens: &[u32],
        stop: &dyn Fn(&[u32]) -> bool,
    ) -> Result<fathom_eval::runner::Batched, fathom_eval::runner::BoxError> {
        let (prefill_seconds, branches) =
            self.greedy_batches(prompts, max_new, stop_tokens, stop)?;
        Ok(fathom_eval::runner::Batched {
            prefill_seconds,
            branches,
        })
    }

    fn forced(
        &mut self,
        prompts: &[&[u32]],
        forced: &[&[u32]],
    ) -> Result<fathom_eval::runner::Batched, fathom_eval::runner::BoxError> {
        let (prefill_seconds, branches) = self.forced_batches(prompts, forced)?;
        Ok(fathom_eval::runner::Batched {
            prefill_seconds,
            branches,
        })
    }

    fn add_row_counters(&mut self, rows: &mut [Vec<RowCacheTally>]) {
        GpuEval::add_row_counters(self, rows)
    }
}
