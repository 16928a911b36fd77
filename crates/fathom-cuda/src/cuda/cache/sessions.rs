//! Sessions (docs/SPEC.md §6.1): create, fork, free, truncate and reserve, and the page tables
//! and descriptors each writes to the device.

#[allow(unused_imports)]
use super::*;

impl PagedCache {
    /// [`crate::api::KvCache::create`].
    pub(crate) fn create(&mut self) -> Result<SessionId> {
        self.not_capturing("create")?;
        let s = self.sessions.create()?;
        self.ledger.created(s);
        self.reset_row_cache(s)?;
        Ok(s)
    }

    /// [`crate::api::KvCache::reset_row_cache`].
    pub(crate) fn reset_row_cache(&self, session: SessionId) -> Result<()> {
        self.not_capturing("reset_row_cache")?;
        self.sessions.len(session)?;
        // The filtered select's estimates too: a new session (or a fork) starts on the score
        // path.
        let s = self.cfg.shape;
        let est_bytes = s.layers * s.kv_heads * s.group * 4;
        let at = self.work.est.ptr + (session.slot() * est_bytes) as u64;
        // SAFETY: the slot's estimates lie inside the buffer (slot < max_sessions).
        unsafe { result::memset_d8_async(at, 0, est_bytes, self.stream.cu_stream()) }
            .map_err(drv("memset select estimates"))?;
        if let Some(tags) = &self.work.row_tags {
            let s = self.cfg.shape;
            let bytes = s.layers * s.kv_heads * self.cfg.row_cache * 4;
            let at = tags.ptr + (session.slot() * bytes) as u64;
            // SAFETY: the slot's tags lie inside the buffer (slot < max_sessions).
            unsafe { result::memset_d8_async(at, 0, bytes, self.stream.cu_stream()) }
                .map_err(drv("memset row-cache tags"))?;
        }
        Ok(())
    }

    /// [`crate::api::KvCache::len`].
    pub(crate) fn len(&self, session: SessionId) -> Result<usize> {
        Ok(self.sessions.len(session)?)
    }

    /// [`crate::api::KvCache::is_empty`].
    pub(crate) fn is_empty(&self, session: SessionId) -> Result<bool> {
        Ok(self.sessions.is_empty(session)?)
    }

    /// [`crate::api::KvCache::fork`].
    pub(crate) fn fork(&mut self, parent: SessionId) -> Result<SessionId> {
        self.sync()?;
        let child = self.sessions.fork(parent)?;
        self.ledger.forked(parent, child);
        self.reset_row_cache(child)?;
        self.write_table(child)?;
        let bytes = tail_elems(&self.cfg) * 2;
        let src = self.tails.ptr + (parent.slot() * bytes) as u64;
        let dst = self.tails.ptr + (child.slot() * bytes) as u64;
        // SAFETY: both ranges lie inside the tails buffer (slots < max_sessions) and differ.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(drv("memcpy_dtod tails"))?;
        // A batch reserved before the fork would append into the parent's partial page,
        // which the child now shares: it is stale from here on (appends and attends refuse it).
        self.step += 1;
        Ok(child)
    }

    /// [`crate::api::KvCache::free`].
    pub(crate) fn free(&mut self, session: SessionId) -> Result<()> {
        self.sync()?;
        self.sessions.free(session)?;
        self.ledger.freed(session);
        self.step += 1;
        Ok(())
    }

    /// [`crate::api::KvCache::truncate`].
    pub(crate) fn truncate(&mut self, session: SessionId, len: usize) -> Result<()> {
        self.not_capturing("truncate")?;
        let n = self.sessions.len(session)?;
        if len == n {
            return Ok(());
        }
        let layers = self.ledger.appended_layers();
        let r = len % BLOCK_TOKENS;
        let base = len - r;
        if r == 0 || layers.is_empty() {
            // Nothing to append again (a block edge, or no layer ever appended): a plain cut,
            // which checks the length itself.
            self.sessions.truncate(session, len)?;
            return self.cut_done(session, len);
        }
        self.sessions.check_truncate(session, len)?;
        for &l in &layers {
            self.ledger.check_written(session, l, len, "truncate")?;
        }
        // The kept rows of the partial block, every appended layer's, `[layer][r][Hkv][D]`
        // for K, then the same for V, in the grow-only staging buffer `append_host` uses
        // (it waits for the stream before it writes there).
        let row = self.cfg.shape.kv_heads * self.cfg.shape.dim;
        let bytes = layers.len() * r * row * 4;
        if self
            .staging
            .as_ref()
            .is_none_or(|(_, cap)| *cap < 2 * bytes)
        {
            self.sync()?;
            self.staging = Some((DevBuf::new(2 * bytes, "append staging")?, 2 * bytes));
        }
        let buf = self.staging.as_ref().map_or(0, |(b, _)| b.ptr);
        self.sync()?;
        // Any batch reserved before is stale from here (descriptor 0 is rewritten below).
        self.step += 1;
        let d: &mut [AppendDesc] = cast_mut(self.descs.as_mut_bytes());
        d[0] = AppendDesc {
            slot: session.slot() as u32,
            n0: len as u32,
            m: 0,
            row0: 0,
        };
        self.upload_tables()?;
        for (i, &l) in layers.iter().enumerate() {
            let off = (i * r * row * 4) as u64;
            // Tokens len − r .. len of the one descriptor, which ends at `len`.
            self.launch_read_rows(l, r, 1, buf + off, buf + bytes as u64 + off)?;
        }
        // Checked above: nothing below fails but the driver.
        self.sessions.truncate(session, base)?;
        self.ledger.truncated(session, base);
        let again = (|| {
            let batch = self.reserve(&[(session, r)])?;
            for (i, &l) in layers.iter().enumerate() {
                let off = (i * r * row * 4) as u64;
                let n = r * row;
                // SAFETY: the staging buffer holds 2·bytes: layer i's kept keys at `off`, its
                // values `bytes` further, `n` f32 each, written by the reads above on the
                // stream and not rewritten before the append's kernels read them.
                let kv = unsafe {
                    KvRows {
                        k: DeviceView::from_raw(buf + off, n, crate::cache::KvDtype::F32),
                        v: DeviceView::from_raw(
                            buf + bytes as u64 + off,
                            n,
                            crate::cache::KvDtype::F32,
                        ),
                        rows: r,
                    }
                };
                self.append(&batch, l, &kv)?;
            }
            Ok::<(), CudaError>(())
        })();
        if let Err(e) = again {
            // Never a session with rows no append wrote: back to the block's start, said so.
            self.sessions.truncate(session, base)?;
            self.ledger.truncated(session, base);
            self.cut_done(session, base)?;
            return Err(CudaError::invalid(
                "truncate",
                format!(
                    "{session} was cut to {base} tokens, but its kept rows {base}..{len} could not be appended again ({e}): it now holds {base} tokens"
                ),
            ));
        }
        self.cut_done(session, len)
    }

    /// After a cut of `session` to `len` tokens: its table on the host, a new step (any batch
    /// reserved before is stale), and its row cache emptied (its slots may hold dropped rows,
    /// whose positions new tokens will take).
    pub(super) fn cut_done(&mut self, session: SessionId, len: usize) -> Result<()> {
        self.ledger.truncated(session, len);
        // The host table is pinned memory an upload may still be reading.
        self.sync()?;
        self.write_table(session)?;
        self.step += 1;
        self.reset_row_cache(session)
    }

    /// Queues the copies of the host page tables and append descriptors to the device, on
    /// the stream. The caller synchronised the stream before writing either (no copy of an
    /// earlier step still reads them), and whoever writes them next waits for it first.
    pub(super) fn upload_tables(&self) -> Result<()> {
        // SAFETY: both sources are pinned host buffers of exactly the destinations' sizes, not
        // written again before the stream has run these copies (see above).
        unsafe {
            result::memcpy_htod_async(
                self.tables_dev.ptr,
                self.tables.as_bytes(),
                self.stream.cu_stream(),
            )
            .map_err(drv("memcpy_htod page tables"))?;
            result::memcpy_htod_async(
                self.descs_dev.ptr,
                self.descs.as_bytes(),
                self.stream.cu_stream(),
            )
            .map_err(drv("memcpy_htod append descriptors"))?;
        }
        self.uploaded
            .record(&self.stream)
            .map_err(drv("record upload event"))
    }

    /// Waits on the host until the last upload of the tables and descriptors has run (a
    /// wait, so refused while capturing, as `sync` is).
    fn wait_uploaded(&self) -> Result<()> {
        if self.capturing.is_some() {
            return self.sync();
        }
        self.uploaded
            .synchronize()
            .map_err(drv("synchronize upload event"))
    }

    pub(super) fn write_table(&mut self, session: SessionId) -> Result<()> {
        let table: Vec<u32> = self
            .sessions
            .page_table(session)?
            .iter()
            .map(|p| p.0)
            .collect();
        let row = session.slot() * self.max_pages;
        let t: &mut [u32] = cast_mut(self.tables.as_mut_bytes());
        t[row..row + table.len()].copy_from_slice(&table);
        Ok(())
    }

    /// [`crate::api::KvCache::check_reserve`].
    pub(crate) fn check_reserve(&self, batch: &[(SessionId, usize)]) -> Result<()> {
        self.sessions.check_reserve(batch)?;
        self.check_grow(batch)
    }

    /// No session of `batch` holds rows no append wrote ([`crate::cache::StepLedger::check_grow`];
    /// unknown sessions are left to the reserve's own checks).
    pub(super) fn check_grow(&self, batch: &[(SessionId, usize)]) -> Result<()> {
        let lens: Vec<(SessionId, usize)> = batch
            .iter()
            .filter_map(|&(s, _)| self.sessions.len(s).ok().map(|n| (s, n)))
            .collect();
        self.ledger.check_grow(&lens, "reserve")
    }

    /// [`crate::api::KvCache::reserve`].
    pub(crate) fn reserve(&mut self, batch: &[(SessionId, usize)]) -> Result<AppendBatch> {
        if batch.is_empty() || batch.len() > self.cfg.max_batch {
            return Err(CudaError::invalid(
                "batch",
                format!(
                    "{} sessions (want 1..={}, the cache's max_batch)",
                    batch.len(),
                    self.cfg.max_batch
                ),
            ));
        }
        if let Some(&(s, m)) = batch.iter().find(|(_, m)| *m > u32::MAX as usize / 2) {
            return Err(CudaError::invalid(
                "batch",
                format!("{m} new tokens for {s}"),
            ));
        }
        self.check_grow(batch)?;
        // The host tables and descriptors are pinned buffers the last upload read: wait for
        // that upload only, not for the step's kernels still running (a caller whose Python
        // enqueues the next step meanwhile keeps the GPU busy). Nothing else the reserve
        // writes is in use: new pages were freed after a synchronisation (`free`,
        // `truncate`), and a copied page is shared, so no kernel writes it.
        self.wait_uploaded()?;
        let plans = self.sessions.reserve_many(batch)?;
        // Checks are done; the rest writes host memory the GPU is not reading (see above).
        for p in &plans {
            if let Some(c) = p.copy {
                self.copy_page(c)?;
            }
            self.write_table(p.session)?;
        }
        self.step += 1;
        let out = AppendBatch::new(plans, self.step);
        let d: &mut [AppendDesc] = cast_mut(self.descs.as_mut_bytes());
        for (i, p) in out.plans.iter().enumerate() {
            d[i] = AppendDesc {
                slot: p.session.slot() as u32,
                n0: p.first_token as u32,
                m: p.tokens as u32,
                row0: out.row0[i] as u32,
            };
        }
        self.upload_tables()?;
        self.batch_len = out.plans.len();
        self.batch_max_m = out.plans.iter().map(|p| p.tokens).max().unwrap_or(0);
        self.batch_max_blocks = out
            .plans
            .iter()
            .map(|p| p.end_token().div_ceil(BLOCK_TOKENS) - p.first_token / BLOCK_TOKENS)
            .max()
            .unwrap_or(0);
        self.ledger.reserved(&out);
        Ok(out)
    }
}
