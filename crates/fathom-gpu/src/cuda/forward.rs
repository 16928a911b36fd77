//! The layer loop of one forward (see the module docs), the prefill's and the sliding
//! windows' dense attention over the cache's rows, and the logits.

#[allow(unused_imports)]
use super::*;

impl GpuDecoder {
    /// The forward of `rows` rows whose tokens and positions are uploaded and whose cache rows
    /// are reserved in `batch`; `prefill` says which attention the global layers use. Leaves
    /// the final hidden states in `work.x`.
    pub(super) fn layers(
        &mut self,
        batch: &AppendBatch,
        rows: usize,
        prefill: Option<(usize, usize)>,
        attention: Option<&Attention>,
    ) -> Result<()> {
        let c = self.cfg.clone();
        let (e, hq, hkv, d, f) = (c.n_embd, c.n_heads, c.n_kv_heads, c.head_dim, c.n_ff);
        let w = &self.work;
        let (tokens, x) = (w.tokens.ptr, w.x.ptr);
        let scale = c.embed_scale;
        let e32 = e as u32;
        let mut b = self.stream.launch_builder(&self.kernels.embed);
        b.arg(&tokens)
            .arg(&self.embedding.mem.ptr)
            .arg(&e32)
            .arg(&scale)
            .arg(&x);
        // SAFETY: tokens holds `rows` ids < vocab (checked); the table is [vocab][E].
        unsafe { b.launch(launch((rows as u32, 1, 1), THREADS, 0)) }
            .map_err(drv("launch embed"))?;
        for l in 0..c.n_layers {
            let blk = &self.blocks[l];
            let w = &self.work;
            self.rmsnorm(w.x.ptr, blk.attn_norm.ptr, rows, w.xb.ptr)?;
            self.linear(&blk.wqkv, w.xb.ptr, rows, w.qkv.ptr)?;
            let qn = blk.q_norm.as_ref().map_or(0u64, |m| m.ptr);
            let kn = blk.k_norm.as_ref().map_or(0u64, |m| m.ptr);
            let (hq32, hkv32) = (hq as u32, hkv as u32);
            let eps = c.rms_eps;
            let base = layout::rope_base(&c, l);
            let neox = u32::from(c.rope_style == RopeStyle::Neox);
            let mut b = self.stream.launch_builder(&self.kernels.qkv_post);
            b.arg(&w.qkv.ptr)
                .arg(&w.pos.ptr)
                .arg(&qn)
                .arg(&kn)
                .arg(&hq32)
                .arg(&hkv32)
                .arg(&eps)
                .arg(&base)
                .arg(&neox)
                .arg(&w.q.ptr)
                .arg(&w.k.ptr)
                .arg(&w.v.ptr);
            // SAFETY: qkv holds `rows` rows of (Hq + 2Hkv)·D; q, k, v their parts; pos `rows`.
            unsafe { b.launch(launch((rows as u32, (hq + 2 * hkv) as u32, 1), d as u32, 0)) }
                .map_err(drv("launch qkv_post"))?;
            let kv = KvRows {
                k: w.k.f32s().slice(0..rows * hkv * d)?,
                v: w.v.f32s().slice(0..rows * hkv * d)?,
                rows,
            };
            let t = self.mark()?;
            self.cache.append(batch, l, &kv)?;
            Self::close(&self.stream, &mut self.timing, t, |tm| &mut tm.appends)?;
            let kind = c.layer_kinds[l];
            let t = self.mark()?;
            match (prefill, attention, kind) {
                (None, Some(att), LayerKind::Global) => {
                    let q = QueryRows { q: w.q.f32s() };
                    self.cache
                        .attend(batch, l, att.method, &att.params, &q, w.o.f32s_mut())?;
                }
                (None, _, _) => self.window_decode(batch, l, rows)?,
                (Some((pos0, end)), _, _) => {
                    self.prefill_attention(batch, l, kind, pos0, end, rows)?
                }
            }
            Self::close(&self.stream, &mut self.timing, t, |tm| &mut tm.attention)?;
            let blk = &self.blocks[l];
            let w = &self.work;
            self.to_bf16(w.o.ptr, rows * hq * d, w.xb.ptr)?;
            self.linear(&blk.wo, w.xb.ptr, rows, w.a.ptr)?;
            self.norm_add(blk.post_attn.as_ref(), rows)?;
            self.rmsnorm(w.x.ptr, blk.ffn_norm.ptr, rows, w.xb.ptr)?;
            self.linear(&blk.wgu, w.xb.ptr, rows, w.gu.ptr)?;
            let f32_ = f as u32;
            let gelu = u32::from(c.arch == Arch::Gemma3);
            let mut b = self.stream.launch_builder(&self.kernels.act_mul);
            b.arg(&w.gu.ptr).arg(&f32_).arg(&gelu).arg(&w.xb.ptr);
            // SAFETY: gu holds `rows` rows of 2F f32, xb `rows` rows of F bf16 (widest ≥ F).
            unsafe {
                b.launch(launch(
                    (rows as u32, f.div_ceil(THREADS as usize) as u32, 1),
                    THREADS,
                    0,
                ))
            }
            .map_err(drv("launch act_mul"))?;
            self.linear(&blk.wd, w.xb.ptr, rows, w.a.ptr)?;
            self.norm_add(blk.post_ffn.as_ref(), rows)?;
        }
        Ok(())
    }

    /// Dense causal attention of one session's prefill chunk (`rows` queries at positions
    /// `pos0..end`) over the cache's rows of layer `l`, per query head two f32 GEMMs around the
    /// masked softmax.
    pub(super) fn prefill_attention(
        &self,
        batch: &AppendBatch,
        l: usize,
        kind: LayerKind,
        pos0: usize,
        end: usize,
        rows: usize,
    ) -> Result<()> {
        let c = &self.cfg;
        let (hq, hkv, d, g) = (c.n_heads, c.n_kv_heads, c.head_dim, c.group());
        let w = &self.work;
        let cap = layout::prefill_rows(kind, end, rows);
        self.cache
            .read_rows(batch, l, cap, w.kwin.f32s_mut(), w.vwin.f32s_mut())?;
        let key0 = (end - cap) as u32;
        let window = kind.window().unwrap_or(0) as u32;
        let scale = 1.0 / (d as f32).sqrt();
        let (cap32, pos32) = (cap as u32, pos0 as u32);
        for hd in 0..hq {
            let h = hd / g;
            // Sᵀ (cap × rows, column-major) = K_h (D × cap)ᵀ · Q_hd (D × rows): row r of S is
            // query r's scores over the cap keys.
            self.sgemm(
                true,
                cap,
                rows,
                d,
                scale,
                w.kwin.ptr + (h * d * 4) as u64,
                hkv * d,
                w.q.ptr + (hd * d * 4) as u64,
                hq * d,
                w.scores.ptr,
                cap,
            )?;
            let mut b = self.stream.launch_builder(&self.kernels.causal_softmax);
            b.arg(&w.scores.ptr)
                .arg(&cap32)
                .arg(&key0)
                .arg(&pos32)
                .arg(&window);
            // SAFETY: scores holds rows · cap f32 (rows ≤ chunk, cap ≤ max_tokens).
            unsafe { b.launch(launch((rows as u32, 1, 1), THREADS, 0)) }
                .map_err(drv("launch causal_softmax"))?;
            // O_hd (D × rows) = V_h (D × cap) · P (cap × rows).
            self.sgemm(
                false,
                d,
                rows,
                cap,
                1.0,
                w.vwin.ptr + (h * d * 4) as u64,
                hkv * d,
                w.scores.ptr,
                cap,
                w.o.ptr + (hd * d * 4) as u64,
                hq * d,
            )?;
        }
        Ok(())
    }

    /// Sliding-window (or, for a dense decode, any non-global) layer of a decode batch: each
    /// session's last `min(len, W)` rows from the cache, then one CTA per query head.
    pub(super) fn window_decode(&self, batch: &AppendBatch, l: usize, rows: usize) -> Result<()> {
        let c = &self.cfg;
        let w = &self.work;
        // No session holds more than max_tokens rows, so a wider window reads the same rows.
        let win = c.layer_kinds[l]
            .window()
            .unwrap_or(self.window)
            .clamp(1, self.dcfg.max_tokens);
        let counts: Vec<u32> = batch
            .plans
            .iter()
            .map(|p| p.end_token().min(win) as u32)
            .collect();
        // SAFETY: counts holds max_batch u32 ≥ the batch; a pageable copy, staged at once.
        unsafe { result::memcpy_htod_async(w.counts.ptr, &counts, self.stream.cu_stream()) }
            .map_err(drv("memcpy_htod window counts"))?;
        self.cache
            .read_rows(batch, l, win, w.kwin.f32s_mut(), w.vwin.f32s_mut())?;
        let (win32, hq32, hkv32) = (win as u32, c.n_heads as u32, c.n_kv_heads as u32);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let mut b = self.stream.launch_builder(&self.kernels.window_decode);
        b.arg(&w.q.ptr)
            .arg(&w.kwin.ptr)
            .arg(&w.vwin.ptr)
            .arg(&w.counts.ptr)
            .arg(&win32)
            .arg(&hq32)
            .arg(&hkv32)
            .arg(&scale)
            .arg(&w.o.ptr);
        // SAFETY: q/o hold `rows` rows of Hq·D; kwin/vwin rows·W rows of Hkv·D (sized for
        // max_batch · window); counts ≤ W.
        unsafe {
            b.launch(launch(
                (rows as u32, c.n_heads as u32, 1),
                THREADS,
                win32 * 4,
            ))
        }
        .map_err(drv("launch window_decode"))?;
        Ok(())
    }

    /// Final norm and LM head of `rows` hidden states starting at row `first` of `work.x`; the
    /// logits `[rows][vocab]` copied to the host (waits for the stream).
    pub(super) fn logits(&self, first: usize, rows: usize) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let w = &self.work;
        self.lm_head_rows(first, rows)?;
        let mut out = vec![0f32; rows * c.vocab_size];
        self.stream.synchronize().map_err(drv("synchronize"))?;
        // SAFETY: logits holds max_batch · vocab ≥ rows · vocab f32; the stream is idle.
        unsafe { result::memcpy_dtoh_sync(&mut out, w.logits.ptr) }
            .map_err(drv("memcpy_dtoh logits"))?;
        if let Some(i) = out.iter().position(|v| !v.is_finite()) {
            return Err(GpuError::invalid(
                "logits",
                format!(
                    "row {} token {} is {} (the forward overflowed)",
                    i / c.vocab_size,
                    i % c.vocab_size,
                    out[i]
                ),
            ));
        }
        Ok(out)
    }

    /// Final norm and LM head of `rows` hidden states from row `first` into `work.logits`.
    pub(super) fn lm_head_rows(&self, first: usize, rows: usize) -> Result<()> {
        let w = &self.work;
        let x = w.x.ptr + (first * self.cfg.n_embd * 4) as u64;
        self.rmsnorm(x, self.out_norm.ptr, rows, w.xb.ptr)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embedding);
        self.linear(head, w.xb.ptr, rows, w.logits.ptr)
    }
}
