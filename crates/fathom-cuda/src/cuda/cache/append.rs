//! Appends (docs/SPEC.md §6.1): one layer's K/V rows into the pools, quantized and packed on the
//! GPU bit-exact with `fathom_store::KeyStore` (CPU reference: [`crate::paged_ref::PagedStoreRef::append`]),
//! and the ordering with a caller's stream.

#[allow(unused_imports)]
use super::*;

impl PagedCache {
    /// [`crate::api::KvCache::append`].
    pub(crate) fn append(&mut self, batch: &AppendBatch, layer: usize, kv: &KvRows) -> Result<()> {
        check_rows(&self.cfg, batch, self.step, layer, kv)?;
        self.ledger.check_append(batch, layer, "append")?;
        if self.fixed_grids && self.batch_max_m != 1 {
            return Err(CudaError::invalid(
                "append",
                "a captured step appends one token per session (a decode batch)",
            ));
        }
        let s = self.cfg.shape;
        let geom = self.geom(layer);
        let (descs, tables, pool) = (
            self.descs_dev.ptr,
            self.tables_dev.ptr,
            self.pools[layer].dptr(),
        );
        let (tails, faults) = (self.tails.ptr, self.faults.dptr);
        let (k, v, dtype) = (kv.k.ptr(), kv.v.ptr(), kv.k.dtype().code());
        let layer_u = layer as u32;
        let nb = self.batch_len as u32;
        // Every session's new tokens in one block (a decode batch): one kernel writes the
        // planes, the records and the tail.
        let fused = u32::from(self.batch_max_blocks <= 1);
        let grid = (self.batch_max_blocks as u32, s.kv_heads as u32, nb);
        let quant =
            |pool: u64, geom: &PoolGeom, fused: u32, rot: u64, tg: TableGeom| -> Result<()> {
                let mut b = self.stream.launch_builder(&self.kernels.quant);
                b.arg(&descs)
                    .arg(&tables)
                    .arg(&pool)
                    .arg(geom)
                    .arg(&tails)
                    .arg(&k)
                    .arg(&v)
                    .arg(&dtype)
                    .arg(&layer_u)
                    .arg(&fused)
                    .arg(&faults)
                    .arg(&rot)
                    .arg(&tg);
                // SAFETY: descriptors, tables, pool, tails and faults are allocated at the sizes
                // the kernel indexes (batch ≤ max_batch, slots < max_sessions, pages < pool pages,
                // layer < L); `kv` holds `batch.rows` rows of [Hkv][D] (checked count; the caller
                // owns the pointers' validity); `rot` is null or the layer's [Hkv][D][D] basis;
                // the tables (when present) hold every pool page.
                unsafe { b.launch(cfg(grid, (s.dim * APPEND_QUARTERS) as u32)) }
                    .map_err(drv("launch append_quant"))?;
                Ok(())
            };
        quant(pool, &geom, fused, 0, self.table_geom(layer))?;
        // The PCA index, where the layer's basis is loaded: the same blocks from the same raw
        // keys (new rows and the tail, which the pass above left as it read it), rotated; no
        // records or tail written.
        if let (Some(pca), Some((_, rot))) = (self.pca_pools.get(layer), &self.calib.pca[layer]) {
            quant(
                pca.dptr(),
                &self.pca_geom(layer),
                0,
                rot.ptr,
                TableGeom::default(),
            )?;
        }
        self.calib.appended[layer] = true;
        if fused == 0 {
            let mut b = self.stream.launch_builder(&self.kernels.records);
            b.arg(&descs)
                .arg(&tables)
                .arg(&pool)
                .arg(&geom)
                .arg(&tails)
                .arg(&k)
                .arg(&v)
                .arg(&dtype)
                .arg(&layer_u);
            let grid = (self.batch_max_m as u32, s.kv_heads as u32, nb);
            // SAFETY: as above.
            unsafe { b.launch(cfg(grid, s.dim as u32)) }.map_err(drv("launch append_records"))?;
        }
        // Written once every launch of the append is queued.
        self.ledger.appended(batch, layer);
        Ok(())
    }

    /// [`crate::api::KvCache::append_host`].
    pub(crate) fn append_host(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        crate::cache::check_host_rows(&self.cfg, batch, k, v)?;
        let bytes = k.len() * 4;
        if self
            .staging
            .as_ref()
            .is_none_or(|(_, cap)| *cap < 2 * bytes)
        {
            self.staging = Some((DevBuf::new(2 * bytes, "append staging")?, 2 * bytes));
        }
        let base = self.staging.as_ref().map_or(0, |(b, _)| b.ptr);
        self.sync()?;
        // SAFETY: the staging buffer holds 2·bytes, only this stream uses it, and the stream is
        // idle (synchronised above); the copies are ordered before the append's kernels.
        unsafe {
            let st = self.stream.cu_stream();
            stream_upload(base, k, st, "memcpy_htod keys")?;
            stream_upload(base + bytes as u64, v, st, "memcpy_htod values")?;
        }
        let n = k.len();
        // SAFETY: the staging buffer holds 2·bytes: the keys at `base`, the values after them,
        // `n` f32 each, alive and unwritten until the append's kernels have read them (the
        // next writer synchronises first).
        let kv = unsafe {
            KvRows {
                k: DeviceView::from_raw(base, n, crate::cache::KvDtype::F32),
                v: DeviceView::from_raw(base + bytes as u64, n, crate::cache::KvDtype::F32),
                rows: batch.rows,
            }
        };
        self.append(batch, layer, &kv)
    }

    /// [`crate::api::KvCache::follow`].
    pub(crate) unsafe fn follow(&self, external: u64) -> Result<()> {
        let e = crate::cuda::Event::sync_only()?;
        // SAFETY: the caller vouches for `external`; the cache's stream is live.
        unsafe { e.record_raw(external as cudarc::driver::sys::CUstream)? };
        e.wait_on(&self.stream)
    }

    /// [`crate::api::KvCache::signal`].
    pub(crate) unsafe fn signal(&self, external: u64) -> Result<()> {
        let e = crate::cuda::Event::sync_only()?;
        e.record(&self.stream)?;
        // SAFETY: the caller vouches for `external`.
        unsafe { e.wait_on_raw(external as cudarc::driver::sys::CUstream) }
    }
}
