//! The page pools (docs/SPEC.md §6.1): the geometry every kernel takes for a layer, what the
//! pools take of HBM, and the copy of a shared partial page.

#[allow(unused_imports)]
use super::*;

impl PagedCache {
    /// The pool geometry every kernel takes, for `layer` (`layer < L`): the key sections'
    /// page stride, and where the records are (in the page, or in the records pool).
    pub(super) fn geom(&self, layer: usize) -> PoolGeom {
        let lay = self.layout;
        let (page_bytes, recs, rec_page_bytes) = match self.rec_pools.get(layer) {
            Some(r) => {
                let (index, records) = lay.split_page_bytes();
                (index, r.dptr(), records)
            }
            None => (
                lay.page_bytes(),
                self.pools[layer].dptr() + lay.records_at(),
                lay.page_bytes(),
            ),
        };
        let g = self.geom32;
        PoolGeom {
            page_bytes,
            run_bytes: g.run_bytes,
            scale_pad: g.scale_pad,
            recs,
            rec_page_bytes,
            page_tokens: g.page_tokens,
            max_pages: g.max_pages,
            heads: g.heads,
            layers: g.layers,
        }
    }

    /// The PCA index's geometry at `layer`: its own key sections (stride
    /// `split_page_bytes().0`), the first index's records.
    pub(super) fn pca_geom(&self, layer: usize) -> PoolGeom {
        PoolGeom {
            page_bytes: self.layout.split_page_bytes().0,
            ..self.geom(layer)
        }
    }

    /// The block tables' geometry at `layer` (every address 0 without them).
    pub(super) fn table_geom(&self, layer: usize) -> TableGeom {
        match (self.landmark_pools.get(layer), self.quest_pools.get(layer)) {
            (Some(l), Some(q)) => TableGeom {
                page_bytes: self.cfg.table_page_bytes(),
                landmark: l.dptr(),
                quest: q.dptr(),
            },
            _ => TableGeom::default(),
        }
    }

    /// [`crate::api::KvCache::pool_hbm_bytes`].
    pub(crate) fn pool_hbm_bytes(&self) -> u64 {
        self.pools
            .iter()
            .chain(&self.rec_pools)
            .chain(&self.pca_pools)
            .chain(&self.landmark_pools)
            .chain(&self.quest_pools)
            .map(|m| match m {
                Mem::Dev(d) => d.bytes as u64,
                Mem::Host(_) => 0,
            })
            .sum()
    }

    /// Copies the valid part of a shared partial page into its fresh replacement, in every
    /// layer's pool: the plane and scale sections whole, the first `tokens` records of each
    /// head.
    pub(super) fn copy_page(&mut self, c: PageCopy) -> Result<()> {
        let lay = self.layout;
        // Validates both page ids.
        lay.page_offset(c.src)?;
        lay.page_offset(c.dst)?;
        let (src, dst) = (c.src.index(), c.dst.index());
        let head_bytes = lay.records_at() as usize;
        let rec = lay.record_bytes() as usize;
        let p = lay.page_tokens();
        let records = |at: usize| {
            (0..self.cfg.shape.kv_heads).map(move |h| (at + h * p * rec, c.tokens * rec))
        };
        let stream = self.stream.clone();
        if self.rec_pools.is_empty() {
            let ranges: Vec<(usize, usize)> = std::iter::once((0, head_bytes))
                .chain(records(head_bytes))
                .collect();
            let stride = lay.page_bytes() as usize;
            for pool in &mut self.pools {
                copy_ranges(pool, &stream, src * stride, dst * stride, &ranges)?;
            }
        } else {
            let rstride = lay.split_page_bytes().1 as usize;
            let ranges: Vec<(usize, usize)> = records(0).collect();
            for (pool, recs) in self.pools.iter_mut().zip(self.rec_pools.iter_mut()) {
                copy_ranges(
                    pool,
                    &stream,
                    src * head_bytes,
                    dst * head_bytes,
                    &[(0, head_bytes)],
                )?;
                copy_ranges(recs, &stream, src * rstride, dst * rstride, &ranges)?;
            }
        }
        // The PCA index's key sections and the block tables, whole.
        let tb = self.cfg.table_page_bytes() as usize;
        for (pools, stride) in [
            (&mut self.pca_pools, head_bytes),
            (&mut self.landmark_pools, tb),
            (&mut self.quest_pools, tb),
        ] {
            for pool in pools.iter_mut() {
                copy_ranges(pool, &stream, src * stride, dst * stride, &[(0, stride)])?;
            }
        }
        Ok(())
    }
}

/// Copies `ranges` (offset, length) of one page at byte `src` of `mem` to the page at `dst`:
/// on the host for pinned memory, stream-ordered on the device for HBM.
fn copy_ranges(
    mem: &mut Mem,
    stream: &CudaStream,
    src: usize,
    dst: usize,
    ranges: &[(usize, usize)],
) -> Result<()> {
    match mem {
        Mem::Host(hb) => {
            let b = hb.as_mut_bytes();
            for &(off, len) in ranges {
                b.copy_within(src + off..src + off + len, dst + off);
            }
        }
        Mem::Dev(db) => {
            for &(off, len) in ranges {
                // SAFETY: both ranges lie inside the pool (pages < its page count) and are
                // different pages; stream-ordered before any later append.
                unsafe {
                    result::memcpy_dtod_async(
                        db.ptr + (dst + off) as u64,
                        db.ptr + (src + off) as u64,
                        len,
                        stream.cu_stream(),
                    )
                }
                .map_err(drv("memcpy_dtod page copy"))?;
            }
        }
    }
    Ok(())
}

/// Every layer's pools ([`CacheConfig::residency`], [`CacheConfig::pca_index`],
/// [`CacheConfig::block_tables`]), zeroed.
pub(super) struct Pools {
    pub(super) pools: Vec<Mem>,
    pub(super) rec_pools: Vec<Mem>,
    pub(super) pca_pools: Vec<Mem>,
    pub(super) landmark_pools: Vec<Mem>,
    pub(super) quest_pools: Vec<Mem>,
}

impl Pools {
    /// Allocates the pools of `cfg` (validated) with page layout `layout`: the HBM first, so
    /// that an out-of-memory is typed before any host pinning.
    pub(super) fn new(cfg: &CacheConfig, layout: &PagedLayout) -> Result<Pools> {
        let s = cfg.shape;
        let pool_bytes = usize::try_from(layout.pool_bytes()).map_err(|_| {
            CudaError::invalid("pages", "pool larger than the address space".to_string())
        })?;
        let pages = layout.pages();
        let (index_page, record_page) = layout.split_page_bytes();
        let key_pool = pages * index_page as usize;
        let rec_pool = pages * record_page as usize;
        // The pools in host memory, on the pages the configuration names (the driver's pages
        // come zeroed from the OS; huge pages are anonymous memory, zero too).
        let host_pool = |bytes: usize, what: &'static str| {
            HostBuf::with_pages(bytes, what, cfg.host_pages, |_| {}).map(Mem::Host)
        };
        let pools = (0..s.layers)
            .map(|_| match cfg.residency {
                Residency::Host => host_pool(pool_bytes, "page pool"),
                Residency::Hbm => DevBuf::zeroed(pool_bytes, "page pool").map(Mem::Dev),
                Residency::IndexHbm => DevBuf::zeroed(key_pool, "page index pool").map(Mem::Dev),
            })
            .collect::<Result<Vec<_>>>()?;
        // After the HBM (a typed out-of-memory before any host pinning).
        let rec_pools = match cfg.residency {
            Residency::IndexHbm => (0..s.layers)
                .map(|_| host_pool(rec_pool, "page records pool"))
                .collect::<Result<Vec<_>>>()?,
            Residency::Host | Residency::Hbm => Vec::new(),
        };
        let pca_pools = if cfg.pca_index {
            (0..s.layers)
                .map(|_| match cfg.residency {
                    Residency::Host => host_pool(key_pool, "PCA index pool"),
                    Residency::Hbm | Residency::IndexHbm => {
                        DevBuf::zeroed(key_pool, "PCA index pool").map(Mem::Dev)
                    }
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let table_pool = pages * cfg.table_page_bytes() as usize;
        let table_pools = |what: &'static str| -> Result<Vec<Mem>> {
            if !cfg.block_tables {
                return Ok(Vec::new());
            }
            (0..s.layers)
                .map(|_| match cfg.residency {
                    Residency::Host => host_pool(table_pool, what),
                    Residency::Hbm | Residency::IndexHbm => {
                        DevBuf::zeroed(table_pool, what).map(Mem::Dev)
                    }
                })
                .collect()
        };
        let landmark_pools = table_pools("landmark table pool")?;
        let quest_pools = table_pools("Quest table pool")?;
        Ok(Pools {
            pools,
            rec_pools,
            pca_pools,
            landmark_pools,
            quest_pools,
        })
    }
}
