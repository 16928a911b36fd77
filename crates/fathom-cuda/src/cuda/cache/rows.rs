//! Rows out of the cache: the last K|V records of a batch's sessions to device memory, a
//! session's store in `fathom-store`'s layout (CPU reference: [`crate::paged_ref::export_pool`]),
//! and the fault counters.

#[allow(unused_imports)]
use super::*;

impl PagedCache {
    /// [`crate::api::KvCache::read_rows`].
    pub(crate) fn read_rows(
        &self,
        batch: &AppendBatch,
        layer: usize,
        cap: usize,
        k_out: DeviceViewMut<'_>,
        v_out: DeviceViewMut<'_>,
    ) -> Result<()> {
        crate::cache::check_read_rows(&self.cfg, batch, self.step, layer, cap, &k_out, &v_out)?;
        self.ledger.check_read(batch, layer, "read_rows")?;
        let (k, v) = (k_out.ptr(), v_out.ptr());
        self.launch_read_rows(layer, cap, self.batch_len, k, v)
    }

    /// Launches `read_rows` over the first `nb` descriptors on the device (checked by the
    /// caller: `layer` exists, the descriptors and tables are uploaded, the outputs hold
    /// `nb · cap · Hkv · D` f32 each).
    pub(super) fn launch_read_rows(
        &self,
        layer: usize,
        cap: usize,
        nb: usize,
        k_out: u64,
        v_out: u64,
    ) -> Result<()> {
        let s = self.cfg.shape;
        let geom = self.geom(layer);
        let (descs, tables, pool) = (
            self.descs_dev.ptr,
            self.tables_dev.ptr,
            self.pools[layer].dptr(),
        );
        let cap_u = cap as u32;
        let mut b = self.stream.launch_builder(&self.kernels.read_rows);
        b.arg(&descs)
            .arg(&tables)
            .arg(&pool)
            .arg(&geom)
            .arg(&cap_u)
            .arg(&k_out)
            .arg(&v_out);
        let grid = (cap.div_ceil(READ_ROWS) as u32, s.kv_heads as u32, nb as u32);
        // SAFETY: descriptors, tables and the pool are the cache's own (rows < each session's
        // length, pages < the pool's); the caller's buffers hold batch · cap · Hkv · D f32 (its
        // documented contract; the pointers are checked non-null).
        unsafe { b.launch(cfg(grid, s.dim as u32)) }.map_err(drv("launch read_rows"))?;
        Ok(())
    }

    /// [`crate::api::KvCache::faults`].
    pub(crate) fn faults(&self) -> Result<Vec<u32>> {
        self.sync()?;
        let f: &[u8] = self.faults.as_bytes();
        Ok(f.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// One layer's whole pool as host bytes in [`PagedLayout`]'s page layout (borrowed in host
    /// residency, read back from HBM; the split residency's two pools interleaved page by page).
    pub(super) fn pool_bytes(&self, layer: usize) -> Result<std::borrow::Cow<'_, [u8]>> {
        let pool = self.pools.get(layer).ok_or_else(|| {
            CudaError::invalid("layer", format!("{layer} of {}", self.pools.len()))
        })?;
        fn read(m: &Mem) -> Result<std::borrow::Cow<'_, [u8]>> {
            Ok(match m {
                Mem::Host(h) => std::borrow::Cow::Borrowed(h.as_bytes()),
                Mem::Dev(d) => std::borrow::Cow::Owned(d.read::<u8>(d.bytes)?),
            })
        }
        let Some(recs) = self.rec_pools.get(layer) else {
            return read(pool);
        };
        let (kb, rb) = (read(pool)?, read(recs)?);
        Ok(std::borrow::Cow::Owned(self.layout.join_split(&kb, &rb)?))
    }

    /// `session`'s length, after checking that `layer` exists and that appends wrote every
    /// row of the session in it ([`crate::cache::StepLedger`]).
    pub(super) fn check_whole(
        &self,
        session: SessionId,
        layer: usize,
        what: &'static str,
    ) -> Result<usize> {
        let n = self.sessions.len(session)?;
        if layer >= self.cfg.shape.layers {
            return Err(CudaError::invalid(
                "layer",
                format!("{layer} (the cache has {} layers)", self.cfg.shape.layers),
            ));
        }
        self.ledger.check_written(session, layer, n, what)?;
        Ok(n)
    }

    /// [`crate::api::KvCache::export`].
    pub(crate) fn export(&self, session: SessionId, layer: usize) -> Result<PagedExport> {
        let n = self.check_whole(session, layer, "export")?;
        self.sync()?;
        let pool = self.pool_bytes(layer)?;
        export_pool(&self.layout, &pool, self.sessions.page_table(session)?, n)
    }

    /// [`crate::api::KvCache::export_pca`].
    pub(crate) fn export_pca(&self, session: SessionId, layer: usize) -> Result<PagedExport> {
        let pca = self.pca_pools.get(layer).ok_or_else(|| {
            CudaError::invalid(
                "export_pca",
                format!("layer {layer}: the cache keeps no PCA index there"),
            )
        })?;
        if self.calib.pca[layer].is_none() {
            return Err(CudaError::invalid(
                "export_pca",
                format!("layer {layer}: no PCA basis was loaded, so its index was never written"),
            ));
        }
        let n = self.check_whole(session, layer, "export_pca")?;
        self.sync()?;
        let keys: std::borrow::Cow<'_, [u8]> = match pca {
            Mem::Host(h) => std::borrow::Cow::Borrowed(h.as_bytes()),
            Mem::Dev(d) => std::borrow::Cow::Owned(d.read::<u8>(d.bytes)?),
        };
        let records = vec![0u8; self.layout.pages() * self.layout.split_page_bytes().1 as usize];
        let pool = self.layout.join_split(&keys, &records)?;
        export_pool(&self.layout, &pool, self.sessions.page_table(session)?, n)
    }

    /// [`crate::api::KvCache::records`].
    pub(crate) fn records(&self, session: SessionId, layer: usize) -> Result<Vec<bf16>> {
        let n = self.check_whole(session, layer, "records")?;
        self.sync()?;
        let pool = self.pool_bytes(layer)?;
        records_pool(&self.layout, &pool, self.sessions.page_table(session)?, n)
    }
}
