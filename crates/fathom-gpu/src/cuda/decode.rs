//! Decode steps: the prologue, greedy sampling, graph capture and replay, the synthetic fill,
//! and the [`Decoder`] protocol.

#[allow(unused_imports)]
use super::*;

impl GpuDecoder {
    /// Checks a decode batch, reserves its rows and runs every layer (no logits yet).
    pub(super) fn decode_layers(
        &mut self,
        batch: &[(SessionId, u32)],
        attention: &Attention,
    ) -> Result<()> {
        let ab = self.decode_prologue(batch, attention)?;
        self.layers(&ab, batch.len(), None, Some(attention))
    }

    /// The host part of a decode step: checks the batch and the method, reserves one row per
    /// session and uploads the ids and positions.
    pub(super) fn decode_prologue(
        &mut self,
        batch: &[(SessionId, u32)],
        attention: &Attention,
    ) -> Result<AppendBatch> {
        let toks: Vec<u32> = batch.iter().map(|&(_, t)| t).collect();
        layout::check_tokens(&self.cfg, &toks)?;
        let mut pos = Vec::with_capacity(batch.len());
        for &(s, _) in batch {
            pos.push(self.cache.len(s)? as u32);
        }
        self.prepare(attention.method)?;
        let mut global = false;
        for (l, kind) in self.cfg.layer_kinds.iter().enumerate() {
            if *kind == LayerKind::Global {
                self.cache.check_method(attention.method, l)?;
                global = true;
            }
        }
        // The first global layer's attend would refuse a bad selection only after the reserve
        // and the appends of the layers before it: check it before anything changes.
        if global {
            fathom_cuda::cache::check_select(self.cache.config(), &attention.params)?;
        }
        let sessions: Vec<(SessionId, usize)> = batch.iter().map(|&(s, _)| (s, 1)).collect();
        let ab = self.cache.reserve(&sessions)?;
        self.upload(&toks, &pos)?;
        Ok(ab)
    }

    /// One decode step sampled greedily on the device: appends one token to each session of
    /// `batch` and returns each session's argmax (the lowest index among equal maxima, as
    /// `fathom_model::argmax`), copying only the ids to the host.
    ///
    /// # Errors
    /// As [`Decoder::decode`]; a row whose logits are all NaN (the forward overflowed).
    pub fn decode_greedy(
        &mut self,
        batch: &[(SessionId, u32)],
        attention: &Attention,
    ) -> Result<Vec<u32>> {
        let step = self.mark()?;
        self.decode_layers(batch, attention)?;
        let t = self.mark()?;
        self.sample_greedy(batch.len())?;
        Self::close(&self.stream, &mut self.timing, t, |tm| &mut tm.sampling)?;
        Self::close(&self.stream, &mut self.timing, step, |tm| &mut tm.steps)?;
        self.read_sampled(batch.len())
    }

    /// The LM head and the argmax of the first `rows` rows of the final hidden states, into
    /// `work.sampled` (queued only).
    pub(super) fn sample_greedy(&self, rows: usize) -> Result<()> {
        self.lm_head_rows(0, rows)?;
        let w = &self.work;
        let v = self.cfg.vocab_size as u32;
        let mut b = self.stream.launch_builder(&self.kernels.argmax_rows);
        b.arg(&w.logits.ptr).arg(&v).arg(&w.sampled.ptr);
        // SAFETY: logits holds rows · vocab f32 and sampled max_batch ≥ rows u32.
        unsafe { b.launch(launch((rows as u32, 1, 1), THREADS, 0)) }
            .map_err(drv("launch argmax_rows"))?;
        Ok(())
    }

    /// Waits for the stream, then the `rows` sampled ids (a row past the vocabulary had no
    /// finite logit).
    pub(super) fn read_sampled(&self, rows: usize) -> Result<Vec<u32>> {
        self.stream.synchronize().map_err(drv("synchronize"))?;
        let mut out = vec![0u32; rows];
        // SAFETY: sampled holds at least `rows` u32; the stream is idle.
        unsafe { result::memcpy_dtoh_sync(&mut out, self.work.sampled.ptr) }
            .map_err(drv("memcpy_dtoh sampled tokens"))?;
        if let Some(i) = out.iter().position(|&t| t as usize >= self.cfg.vocab_size) {
            return Err(GpuError::invalid(
                "logits",
                format!("row {i} has no finite maximum (the forward overflowed)"),
            ));
        }
        Ok(out)
    }

    /// [`GpuDecoder::decode_greedy`] whose device work (every layer's forward, append and
    /// attention, the LM head and the argmax) is captured as one CUDA graph, then run once by
    /// replaying it: the step's tokens, and the graph for [`GpuDecoder::replay_greedy`] of the
    /// same sessions with the same attention. The host work left per step is the reserve, the
    /// upload of ids and positions, one graph launch and the copy of the sampled ids. The
    /// cache sizes the attention grids for `max_tokens` while capturing (docs/SPEC.md §6.1),
    /// so the graph stays valid as the sessions grow.
    ///
    /// # Errors
    /// As [`GpuDecoder::decode_greedy`]; instrumentation on (events are not captured); a model
    /// with sliding-window layers (their per-step row counts are uploaded from pageable
    /// memory, which a graph may not capture); a failed capture.
    pub fn capture_greedy(
        &mut self,
        batch: &[(SessionId, u32)],
        attention: &Attention,
    ) -> Result<(Vec<u32>, StepGraph)> {
        if self.timing.is_some() {
            return Err(GpuError::invalid(
                "capture",
                "instrumentation is on (set_instrument(false) first)",
            ));
        }
        if self.cfg.layer_kinds.iter().any(|k| *k != LayerKind::Global) {
            return Err(GpuError::invalid(
                "capture",
                format!(
                    "{} has sliding-window layers: its decode step is not captured",
                    self.cfg.name
                ),
            ));
        }
        if self.blas_workspace.is_none() {
            let ws = mem(BLAS_WORKSPACE_BYTES, "cuBLAS workspace")?;
            // SAFETY: the workspace outlives the handle's use of it (both live in `self`; the
            // handle is only used on this decoder's stream).
            unsafe {
                bsys::cublasSetWorkspace_v2(
                    *self.blas.handle(),
                    ws.ptr as *mut std::ffi::c_void,
                    BLAS_WORKSPACE_BYTES,
                )
            }
            .result()
            .map_err(blas_err("cublasSetWorkspace"))?;
            self.blas_workspace = Some(ws);
        }
        let ab = self.decode_prologue(batch, attention)?;
        let rows = batch.len();
        self.cache.begin_capture(&ab)?;
        let ran = self
            .layers(&ab, rows, None, Some(attention))
            .and_then(|()| self.sample_greedy(rows));
        let graph = self.cache.end_capture();
        ran?;
        let graph = graph?;
        self.cache.replay(&ab, &graph)?;
        let out = self.read_sampled(rows)?;
        Ok((
            out,
            StepGraph {
                graph,
                sessions: batch.iter().map(|b| b.0).collect(),
                attention: *attention,
            },
        ))
    }

    /// One greedy decode step of the sessions `graph` was captured for (in its order, each
    /// with the token it decodes), by replaying it.
    ///
    /// # Errors
    /// Other sessions or another order than the captured ones; the checks of
    /// [`GpuDecoder::decode_greedy`]; a device failure.
    pub fn replay_greedy(
        &mut self,
        graph: &StepGraph,
        batch: &[(SessionId, u32)],
    ) -> Result<Vec<u32>> {
        if batch.len() != graph.sessions.len()
            || batch.iter().zip(&graph.sessions).any(|(b, s)| b.0 != *s)
        {
            return Err(GpuError::invalid(
                "replay",
                "the batch's sessions are not the ones the graph was captured for",
            ));
        }
        self.cache.check_graph(&graph.graph)?;
        let ab = self.decode_prologue(batch, &graph.attention)?;
        self.cache.replay(&ab, &graph.graph)?;
        self.read_sampled(batch.len())
    }

    /// Appends `tokens` **synthetic** K/V rows to `session` in every layer (keys uniform with
    /// channel spreads `0.1 + c/D`, values uniform on ±1, made on the device from `seed`) with
    /// no forward: how a throughput run fills long contexts of a model with random weights,
    /// whose prefill would compute nothing meaningful. Label every result.
    ///
    /// # Errors
    /// A session past its capacity; device failures.
    pub fn fill_synthetic(&mut self, session: SessionId, tokens: usize, seed: u64) -> Result<()> {
        let c = &self.cfg;
        let row = c.n_kv_heads * c.head_dim;
        let chunk = self.dcfg.prefill_chunk;
        let n0 = self.cache.len(session)?;
        if n0 + tokens > self.dcfg.max_tokens {
            return Err(GpuError::invalid(
                "fill_synthetic",
                format!(
                    "{n0} + {tokens} tokens past max_tokens {}",
                    self.dcfg.max_tokens
                ),
            ));
        }
        if tokens > 0 {
            self.cache.check_reserve(&[(session, tokens)])?;
        }
        let mut done = 0;
        while done < tokens {
            let m = chunk.min(tokens - done);
            let batch = self.cache.reserve(&[(session, m)])?;
            for l in 0..c.n_layers {
                for (buf, slope) in [(self.work.k.ptr, 1u32), (self.work.v.ptr, 0u32)] {
                    let n = (m * row) as u64;
                    let sd = seed
                        .wrapping_mul(0x9E37_79B9)
                        .wrapping_add(((n0 + done) * c.n_layers + l) as u64 * 2 + slope as u64);
                    let mut b = self.stream.launch_builder(&self.kernels.fill_f32);
                    b.arg(&buf).arg(&n).arg(&sd).arg(&slope);
                    // SAFETY: k and v hold max_rows ≥ m rows of Hkv·D f32.
                    unsafe { b.launch(launch((256, 1, 1), THREADS, 0)) }
                        .map_err(drv("launch fill_uniform_f32"))?;
                }
                let n = m * c.n_kv_heads * c.head_dim;
                let kv = KvRows {
                    k: self.work.k.f32s().slice(0..n)?,
                    v: self.work.v.f32s().slice(0..n)?,
                    rows: m,
                };
                self.cache.append(&batch, l, &kv)?;
            }
            done += m;
        }
        Ok(())
    }
}

impl Decoder for GpuDecoder {
    fn create(&mut self) -> Result<SessionId> {
        Ok(self.cache.create()?)
    }

    fn fork(&mut self, parent: SessionId) -> Result<SessionId> {
        Ok(self.cache.fork(parent)?)
    }

    fn free(&mut self, session: SessionId) -> Result<()> {
        Ok(self.cache.free(session)?)
    }

    fn len(&self, session: SessionId) -> Result<usize> {
        Ok(self.cache.len(session)?)
    }

    fn truncate(&mut self, session: SessionId, len: usize) -> Result<()> {
        Ok(self.cache.truncate(session, len)?)
    }

    fn prefill(&mut self, session: SessionId, tokens: &[u32]) -> Result<Vec<f32>> {
        layout::check_tokens(&self.cfg, tokens)?;
        let n0 = self.cache.len(session)?;
        if n0 + tokens.len() > self.dcfg.max_tokens {
            return Err(GpuError::invalid(
                "prefill",
                format!(
                    "{n0} + {} tokens past the decoder's max_tokens {}",
                    tokens.len(),
                    self.dcfg.max_tokens
                ),
            ));
        }
        // The whole prompt's pages before its first chunk: no partial prompt on a full pool.
        self.cache.check_reserve(&[(session, tokens.len())])?;
        let mut pos0 = n0;
        let mut last = 0;
        for chunk in tokens.chunks(self.dcfg.prefill_chunk) {
            let batch = self.cache.reserve(&[(session, chunk.len())])?;
            let pos: Vec<u32> = (pos0..pos0 + chunk.len()).map(|p| p as u32).collect();
            self.upload(chunk, &pos)?;
            let end = pos0 + chunk.len();
            self.layers(&batch, chunk.len(), Some((pos0, end)), None)?;
            last = chunk.len();
            pos0 = end;
        }
        self.logits(last - 1, 1)
    }

    fn decode(&mut self, batch: &[(SessionId, u32)], attention: &Attention) -> Result<Vec<f32>> {
        self.decode_layers(batch, attention)?;
        self.logits(0, batch.len())
    }
}
