//! The CPU reference of the paged store (docs/SPEC.md §2, §6.1): the oracle a GPU append
//! kernel is compared against.
//!
//! [`PagedStoreRef`] owns one layer's pool as bytes laid out exactly as
//! [`crate::paged_layout::PagedLayout`] says, and the [`CacheSessions`] that address it. An
//! append follows its [`AppendPlan`] in the order a device backend must:
//!
//! 1. the copy-on-write of a shared partial last page (`copy`), the whole page;
//! 2. the bf16 K|V records of the new tokens, at their (page, slot);
//! 3. every 64-token block the new tokens touch is quantized with
//!    [`fathom_store::quant::quantize_block`] from the **bf16 K records of all its tokens**
//!    (the ones already there, `requant`, and the new ones), and all its words and scales are
//!    rewritten in place.
//!
//! # Which keys the store quantizes
//!
//! The exact keys of a partially filled block are its K records, so no separate tail buffer
//! is kept (a fork or a copy-on-write carries them along with the page). The store of a
//! session is therefore `fathom_store::KeyStore`'s store of `bf16(k)`, bit for bit: for keys
//! that are already bf16 values (a model that computes in bf16) it is the store of the keys
//! themselves; f32 keys are rounded to nearest bf16 first. Keys are taken in the store's
//! basis (a rotated store rotates them before the append); a raw store is the usual case.
//!
//! Validation (shapes, NaN/Inf, fp16 scale overflow, the session's capacity and the pool)
//! happens before anything is written: a failed append leaves the pool bytes and the page
//! tables exactly as they were.

use half::{bf16, f16};

use fathom_store::quant::{self, BLOCK, PLANES};
use fathom_store::{blocks_for, Dims, StoreError, StoreView};

use crate::error::{CudaError, Result};
use crate::paged_layout::PagedLayout;
use crate::pages::{AppendPlan, CacheSessions, PageConfig, PageError, PageId, SessionId};

/// One layer's paged store on the CPU: the pool bytes and the sessions' page tables.
#[derive(Debug, Clone)]
pub struct PagedStoreRef {
    sessions: CacheSessions,
    layout: PagedLayout,
    pool: Vec<u8>,
}

/// One session's store, exported to `fathom-store`'s layout with capacity = blocks held:
/// planes `[head][channel][plane][block]`, scales `[head][channel][block]`.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedExport {
    /// Shape.
    pub dims: Dims,
    /// Tokens of the session.
    pub tokens: usize,
    /// Plane words, `((h·D + c)·4 + p)·nblocks + b`.
    pub planes: Vec<u64>,
    /// Block scales, `(h·D + c)·nblocks + b`.
    pub scales: Vec<f16>,
}

impl PagedExport {
    /// Blocks held (`⌈tokens/64⌉`).
    pub fn nblocks(&self) -> usize {
        blocks_for(self.tokens as u64) as usize
    }

    /// Compares with a `fathom-store` view word for word and scale bit for bit; `Err` names
    /// the first difference.
    pub fn compare(&self, view: &StoreView<'_>) -> std::result::Result<(), String> {
        if view.dims() != self.dims || view.tokens() != self.tokens {
            return Err(format!(
                "shape: paged {:?} × {} tokens, store {:?} × {} tokens",
                self.dims,
                self.tokens,
                view.dims(),
                view.tokens()
            ));
        }
        let nb = self.nblocks();
        for h in 0..self.dims.heads {
            for c in 0..self.dims.channels {
                let hc = h * self.dims.channels + c;
                for p in 0..PLANES {
                    let ours = &self.planes[(hc * PLANES + p) * nb..(hc * PLANES + p + 1) * nb];
                    let theirs = view.plane(h, c, p);
                    if let Some(b) = (0..nb).find(|&b| ours[b] != theirs[b]) {
                        return Err(format!(
                            "head {h} channel {c} plane {p} block {b}: paged {:#018x}, store {:#018x}",
                            ours[b], theirs[b]
                        ));
                    }
                }
                let ours = &self.scales[hc * nb..(hc + 1) * nb];
                let theirs = view.channel_scales(h, c);
                if let Some(b) = (0..nb).find(|&b| ours[b].to_bits() != theirs[b].to_bits()) {
                    return Err(format!(
                        "head {h} channel {c} block {b}: scale paged {}, store {}",
                        ours[b], theirs[b]
                    ));
                }
            }
        }
        Ok(())
    }
}

fn get<const N: usize>(buf: &[u8], off: u64) -> Result<[u8; N]> {
    let a = off as usize;
    buf.get(a..a + N)
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| internal(format!("read of {N} bytes at {off} is outside the pool")))
}

fn put(buf: &mut [u8], off: u64, bytes: &[u8]) -> Result<()> {
    let a = off as usize;
    buf.get_mut(a..a + bytes.len())
        .ok_or_else(|| {
            internal(format!(
                "write of {} bytes at {off} is outside the pool",
                bytes.len()
            ))
        })?
        .copy_from_slice(bytes);
    Ok(())
}

fn internal(detail: String) -> CudaError {
    CudaError::Page(PageError::Invariant(detail))
}

impl PagedStoreRef {
    /// An empty store for `dims` (`Hkv`, `D`) over a pool of `cfg.pages` pages of
    /// `cfg.page_tokens` tokens (the pool's bytes are allocated here, zeroed).
    pub fn new(dims: Dims, cfg: PageConfig) -> Result<Self> {
        let sessions = CacheSessions::new(cfg)?;
        let layout = PagedLayout::new(dims, cfg.page_tokens, cfg.pages)?;
        let bytes = layout.pool_bytes() as usize;
        let mut pool = Vec::new();
        pool.try_reserve_exact(bytes)
            .map_err(|_| CudaError::HostAlloc {
                what: "paged reference pool",
                bytes: bytes as u64,
            })?;
        pool.resize(bytes, 0);
        Ok(Self {
            sessions,
            layout,
            pool,
        })
    }

    /// The sessions and page tables.
    pub fn sessions(&self) -> &CacheSessions {
        &self.sessions
    }
    /// The byte layout.
    pub fn layout(&self) -> &PagedLayout {
        &self.layout
    }
    /// The pool's bytes (what a device backend's pinned buffer must equal on the written
    /// blocks and slots).
    pub fn pool_bytes(&self) -> &[u8] {
        &self.pool
    }

    /// A new empty session.
    pub fn create(&mut self) -> Result<SessionId> {
        Ok(self.sessions.create()?)
    }
    /// A child sharing all of `parent`'s pages (copy-on-write, see [`crate::pages`]).
    pub fn fork(&mut self, parent: SessionId) -> Result<SessionId> {
        Ok(self.sessions.fork(parent)?)
    }
    /// Frees a session; pages no other session holds return to the pool (their bytes stay,
    /// stale, until a later append overwrites what it uses).
    pub fn free(&mut self, session: SessionId) -> Result<()> {
        Ok(self.sessions.free(session)?)
    }

    /// Shortens `session` to `len` tokens (docs/SPEC.md §6.1, "Truncate"), as a device
    /// backend must: where `len` falls inside a 64-token block, that block's quantization
    /// holds the dropped tokens too, so its `r = len mod 64` kept tokens are read back from
    /// their K|V records, the session is truncated to the block's start `len − r`, and they
    /// are appended again (the block is then written whole from exactly those bf16 keys and
    /// values: the same records, and the store of the first `len` keys bit for bit). Pages
    /// past the end are released ([`CacheSessions::truncate`]); a kept page a fork shares is
    /// copied before the re-append writes it.
    ///
    /// # Errors
    /// An unknown or stale session, `len` past its length, or a pool that could not hold the
    /// re-append's copy-on-write page (checked first, on a copy of the page tables): nothing
    /// changes.
    pub fn truncate(&mut self, session: SessionId, len: usize) -> Result<()> {
        self.sessions.check_truncate(session, len)?;
        if len == self.sessions.len(session)? {
            return Ok(());
        }
        let base = len - len % BLOCK;
        let (k, v) = self.rows(session, base, len)?;
        self.sessions.truncate(session, base)?;
        if len > base {
            self.append(session, &k, &v)?;
        }
        Ok(())
    }

    /// The K and V of tokens `from..to` of `session`, `[token][Hkv][D]` f32 each (the stored
    /// bf16 values, exactly).
    fn rows(&self, session: SessionId, from: usize, to: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let lay = self.layout;
        let Dims { heads, channels: d } = lay.dims();
        let m = to.saturating_sub(from);
        let (mut k, mut v) = (vec![0f32; m * heads * d], vec![0f32; m * heads * d]);
        for i in 0..m {
            let (page, slot) = self.sessions.locate(session, from + i)?;
            for h in 0..heads {
                let off = lay.record_offset(page, slot, h)?;
                for c in 0..d {
                    let at = (i * heads + h) * d + c;
                    let e = |j: usize| get::<2>(&self.pool, off + 2 * j as u64);
                    k[at] = bf16::from_le_bytes(e(c)?).to_f32();
                    v[at] = bf16::from_le_bytes(e(d + c)?).to_f32();
                }
            }
        }
        Ok((k, v))
    }

    /// Appends `m` tokens: `keys` and `values` are `[m][Hkv][D]` row-major f32 (rounded to
    /// bf16 for the records; the store quantizes the rounded keys). Returns the plan it
    /// followed.
    ///
    /// Errors (nothing changed): unknown or stale session; wrong lengths; a NaN/Inf key
    /// ([`StoreError::NonFinite`]) or one whose magnitude overflows the fp16 scale
    /// ([`StoreError::ScaleOverflow`]), with its global token index; a value that is not
    /// finite in bf16; zero tokens; the session's capacity; the pool.
    pub fn append(
        &mut self,
        session: SessionId,
        keys: &[f32],
        values: &[f32],
    ) -> Result<AppendPlan> {
        let dims = self.layout.dims();
        let (hn, d) = (dims.heads, dims.channels);
        let row = dims.row();
        let n = self.sessions.len(session)?;
        if keys.len() % row != 0 {
            return Err(StoreError::Shape {
                what: "appended keys [m][heads][D]",
                expected: row * (keys.len() / row + 1),
                got: keys.len(),
            }
            .into());
        }
        if values.len() != keys.len() {
            return Err(CudaError::invalid(
                "values",
                format!(
                    "{} values for {} keys (want [m][heads][D] of both)",
                    values.len(),
                    keys.len()
                ),
            ));
        }
        let m = keys.len() / row;
        for (pos, &x) in keys.iter().enumerate() {
            let (token, head, channel) = ((n + pos / row) as u64, pos % row / d, pos % d);
            if !x.is_finite() {
                return Err(StoreError::NonFinite {
                    token,
                    head,
                    channel,
                    value: x,
                }
                .into());
            }
            // The block scale is fp16 of the block's largest |bf16(k)|; it overflows iff some
            // key's own fp16 rounding does (rounding is monotone).
            if quant::block_scale(bf16::from_f32(x).to_f32().abs()).is_none() {
                return Err(StoreError::ScaleOverflow {
                    token,
                    head,
                    channel,
                    value: x,
                }
                .into());
            }
        }
        if let Some(pos) = values
            .iter()
            .position(|&v| !bf16::from_f32(v).to_f32().is_finite())
        {
            return Err(CudaError::invalid(
                "values",
                format!(
                    "value {} at token {}, head {}, channel {} is not finite in bf16",
                    values[pos],
                    n + pos / row,
                    pos % row / d,
                    pos % d
                ),
            ));
        }
        // Checks done; reserve is itself all-or-nothing, and nothing after it can fail on
        // offsets the layout accepted for pages of this pool.
        let plan = self.sessions.reserve(session, m)?;
        let lay = self.layout;
        if let Some(c) = plan.copy {
            let (src, dst) = (lay.page_offset(c.src)?, lay.page_offset(c.dst)?);
            let len = lay.page_bytes();
            self.pool
                .copy_within(src as usize..(src + len) as usize, dst as usize);
        }
        // 2. Records of the new tokens.
        for i in 0..m {
            let token = n + i;
            let (page, slot) = plan
                .location(token)
                .ok_or_else(|| internal(format!("plan does not place token {token}")))?;
            for h in 0..hn {
                let off = lay.record_offset(page, slot, h)?;
                let src = (i * hn + h) * d;
                let mut rec = Vec::with_capacity(4 * d);
                for &k in &keys[src..src + d] {
                    rec.extend_from_slice(&bf16::from_f32(k).to_le_bytes());
                }
                for &v in &values[src..src + d] {
                    rec.extend_from_slice(&bf16::from_f32(v).to_le_bytes());
                }
                put(&mut self.pool, off, &rec)?;
            }
        }
        // 3. Re-quantize every block the append touched, from the K records.
        let p = lay.page_tokens();
        let end = plan.end_token();
        for gb in n / BLOCK..=(end - 1) / BLOCK {
            let start = gb * BLOCK;
            let len = BLOCK.min(end - start);
            let page = *plan
                .pages
                .get(start / p - plan.first_page)
                .ok_or_else(|| internal(format!("plan has no page for block {gb}")))?;
            self.requantize_block(page, (start % p) / BLOCK, len)?;
        }
        Ok(plan)
    }

    /// Quantizes block `block` of `page` from the K records of its first `len` slots and
    /// writes all its words and scales.
    fn requantize_block(&mut self, page: PageId, block: usize, len: usize) -> Result<()> {
        let lay = self.layout;
        let Dims { heads, channels: d } = lay.dims();
        let slot0 = block * BLOCK;
        let mut keys = vec![0f32; len * d];
        let mut col = vec![0f32; len];
        for h in 0..heads {
            for i in 0..len {
                let off = lay.record_offset(page, slot0 + i, h)?;
                for c in 0..d {
                    let b = get::<2>(&self.pool, off + 2 * c as u64)?;
                    keys[i * d + c] = bf16::from_le_bytes(b).to_f32();
                }
            }
            for c in 0..d {
                for (i, v) in col.iter_mut().enumerate() {
                    *v = keys[i * d + c];
                }
                let (scale, words) = quant::quantize_block(&col).map_err(|(i, fault)| {
                    internal(format!(
                        "validated key at slot {} head {h} channel {c} failed to quantize ({fault:?})",
                        slot0 + i
                    ))
                })?;
                put(
                    &mut self.pool,
                    lay.block_scale_offset(page, h, c, block)?,
                    &scale.to_le_bytes(),
                )?;
                for (pl, w) in words.iter().enumerate() {
                    put(
                        &mut self.pool,
                        lay.plane_word_offset(page, h, c, pl, block)?,
                        &w.to_le_bytes(),
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The session's planes and scales in `fathom-store`'s layout (capacity = blocks held).
    pub fn export(&self, session: SessionId) -> Result<PagedExport> {
        let n = self.sessions.len(session)?;
        export_pool(
            &self.layout,
            &self.pool,
            self.sessions.page_table(session)?,
            n,
        )
    }

    /// The session's K|V records, `[head][token][K (D) | V (D)]` bf16 (the layout of
    /// `fathom_bench::offload::LayerSource::records`).
    pub fn records(&self, session: SessionId) -> Result<Vec<bf16>> {
        let lay = self.layout;
        let Dims { heads, channels: d } = lay.dims();
        let n = self.sessions.len(session)?;
        let mut out = Vec::with_capacity(heads * n * 2 * d);
        for h in 0..heads {
            for i in 0..n {
                let (page, slot) = self.sessions.locate(session, i)?;
                let off = lay.record_offset(page, slot, h)?;
                for e in 0..2 * d {
                    out.push(bf16::from_le_bytes(get::<2>(
                        &self.pool,
                        off + 2 * e as u64,
                    )?));
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;

/// The planes and scales of a session of `n` tokens whose pages are `table`, read from one
/// layer's pool bytes `pool` laid out by `layout`, in `fathom-store`'s layout (capacity =
/// blocks held). The CPU reference and the GPU cache both export through this.
pub fn export_pool(
    layout: &PagedLayout,
    pool: &[u8],
    table: &[PageId],
    n: usize,
) -> Result<PagedExport> {
    let dims = layout.dims();
    let nb = blocks_for(n as u64) as usize;
    let bp = layout.blocks_per_page();
    if table.len() < nb.div_ceil(bp) {
        return Err(CudaError::invalid(
            "page table",
            format!("{} pages for {n} tokens", table.len()),
        ));
    }
    let mut planes = vec![0u64; dims.row() * PLANES * nb];
    let mut scales = vec![f16::ZERO; dims.row() * nb];
    for h in 0..dims.heads {
        for c in 0..dims.channels {
            let hc = h * dims.channels + c;
            for gb in 0..nb {
                let page = table[gb / bp];
                let b = gb % bp;
                for pl in 0..PLANES {
                    let off = layout.plane_word_offset(page, h, c, pl, b)?;
                    planes[(hc * PLANES + pl) * nb + gb] = u64::from_le_bytes(get::<8>(pool, off)?);
                }
                let off = layout.block_scale_offset(page, h, c, b)?;
                scales[hc * nb + gb] = f16::from_le_bytes(get::<2>(pool, off)?);
            }
        }
    }
    Ok(PagedExport {
        dims,
        tokens: n,
        planes,
        scales,
    })
}

/// The K|V records `[head][token][K (D) | V (D)]` (bf16) of a session of `n` tokens whose
/// pages are `table`, read from one layer's pool bytes.
pub fn records_pool(
    layout: &PagedLayout,
    pool: &[u8],
    table: &[PageId],
    n: usize,
) -> Result<Vec<bf16>> {
    let Dims { heads, channels: d } = layout.dims();
    let p = layout.page_tokens();
    let mut out = Vec::with_capacity(heads * n * 2 * d);
    for h in 0..heads {
        for i in 0..n {
            let page = *table.get(i / p).ok_or_else(|| {
                CudaError::invalid(
                    "page table",
                    format!("{} pages for {n} tokens", table.len()),
                )
            })?;
            let off = layout.record_offset(page, i % p, h)?;
            for e in 0..2 * d {
                out.push(bf16::from_le_bytes(get::<2>(pool, off + 2 * e as u64)?));
            }
        }
    }
    Ok(out)
}
