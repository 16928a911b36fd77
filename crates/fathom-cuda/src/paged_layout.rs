//! Byte offsets of the paged store inside one layer's host pool buffer (docs/SPEC.md §2,
//! §6.1).
//!
//! One layer's pool is `N` pages at a stride of `page_bytes`; the `L` layers of a model use
//! `L` such pools (or one buffer at a stride of [`PagedLayout::pool_bytes`]) and share the
//! page tables of [`crate::pages`], since every layer of a session has the same length.
//! With `H = Hkv` heads, `D` channels, `P` tokens per page and `B = P/64` blocks per page,
//! one page holds, in this order:
//!
//! | section | element | index inside the section | bytes |
//! |---|---|---|---|
//! | keys    | one channel run of `R = S + 32·B` bytes per (head, channel) | `h·D + c` | `H·D·R` |
//! | records | bf16 K then bf16 V of one token and head (`4·D` bytes) | `h·P + s` | `H·P·4D` |
//!
//! A channel run holds the channel's `B` fp16 block scales (block `b` at byte `2b`, padded to
//! `S = ⌈2B/16⌉·16` bytes), then its four planes of `B` little-endian `u64` words each, word
//! (`p`, `b`) at byte `S + (p·B + b)·8` (`h` head, `c` channel, `p` plane with 0 the most
//! significant, `b` block in the page, `s` slot in the page). Scales first, so that the
//! bytes a scan of depth `t` reads from one channel of one page, its scales and its first `t`
//! planes, are **one contiguous run** of `S + t·P/8` bytes ([`PagedLayout::read_run_bytes`]):
//! `64 + 256·t` at `P = 2048`, long enough for the link rate
//! (`results/device/engine/gather-sweep.md`). Runs start on 16-byte boundaries, sections on
//! [`SECTION_ALIGN`]-byte and pages on [`PAGE_ALIGN`]-byte boundaries (padding is never read).
//! Bit `i` of a word is token `64·b + i` of the page; the session token in slot `s` of its
//! `j`-th page is `j·P + s`.

use fathom_store::{Dims, PLANES};

use crate::pages::{PageConfig, PageError, PageId, BLOCK_TOKENS};

/// Alignment of each section (planes, scales, records) inside a page, bytes.
pub const SECTION_ALIGN: u64 = 256;
/// Alignment of the page stride, bytes (a host page, so pages never share one).
pub const PAGE_ALIGN: u64 = 4096;

/// The byte layout of one layer's page pool. All offsets are from the start of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedLayout {
    dims: Dims,
    page_tokens: usize,
    pages: usize,
    scale_pad: u64,
    run_bytes: u64,
    records_at: u64,
    page_bytes: u64,
}

fn align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|v| v / a * a)
}

fn range(what: &'static str, index: usize, limit: usize) -> Result<(), PageError> {
    if index < limit {
        Ok(())
    } else {
        Err(PageError::OutOfRange { what, index, limit })
    }
}

impl PagedLayout {
    /// The layout of `pages` pages of `page_tokens` tokens for `dims` (`Hkv`, `D`).
    ///
    /// `page_tokens` follows [`PageConfig::validate`]; the pool must fit in `usize` bytes.
    pub fn new(dims: Dims, page_tokens: usize, pages: usize) -> Result<Self, PageError> {
        let dims = dims.validate().map_err(|e| PageError::Config {
            what: "dims",
            detail: e.to_string(),
        })?;
        PageConfig {
            page_tokens,
            pages,
            max_sessions: 1,
            max_tokens: 1,
        }
        .validate()?;
        let overflow = || PageError::Config {
            what: "pages",
            detail: format!(
                "{pages} pages of {page_tokens} tokens × {} heads × {} channels overflow",
                dims.heads, dims.channels
            ),
        };
        let (h, d, p) = (dims.heads as u64, dims.channels as u64, page_tokens as u64);
        let blocks = p / BLOCK_TOKENS as u64;
        let hd = h.checked_mul(d).ok_or_else(overflow)?;
        let scale_pad = (blocks * 2).div_ceil(16) * 16;
        let run_bytes = scale_pad + PLANES as u64 * blocks * 8;
        let key_bytes = hd.checked_mul(run_bytes).ok_or_else(overflow)?;
        let record_bytes = h
            .checked_mul(p)
            .and_then(|x| x.checked_mul(4 * d))
            .ok_or_else(overflow)?;
        let records_at = align_up(key_bytes, SECTION_ALIGN).ok_or_else(overflow)?;
        let page_bytes = records_at
            .checked_add(record_bytes)
            .and_then(|x| align_up(x, PAGE_ALIGN))
            .ok_or_else(overflow)?;
        let pool = page_bytes.checked_mul(pages as u64).ok_or_else(overflow)?;
        if usize::try_from(pool).is_err() {
            return Err(overflow());
        }
        Ok(Self {
            dims,
            page_tokens,
            pages,
            scale_pad,
            run_bytes,
            records_at,
            page_bytes,
        })
    }

    /// Shape (`Hkv`, `D`).
    pub fn dims(&self) -> Dims {
        self.dims
    }
    /// Tokens per page `P`.
    pub fn page_tokens(&self) -> usize {
        self.page_tokens
    }
    /// Pages in the pool.
    pub fn pages(&self) -> usize {
        self.pages
    }
    /// 64-token blocks per page `B = P/64`.
    pub fn blocks_per_page(&self) -> usize {
        self.page_tokens / BLOCK_TOKENS
    }
    /// Bytes of one page, padding included (the page stride).
    pub fn page_bytes(&self) -> u64 {
        self.page_bytes
    }
    /// Bytes of the whole pool (`pages · page_bytes`).
    pub fn pool_bytes(&self) -> u64 {
        self.page_bytes * self.pages as u64
    }
    /// Bytes of the key section of one page (`Hkv·D·R`).
    pub fn key_section_bytes(&self) -> u64 {
        self.dims.row() as u64 * self.run_bytes
    }
    /// Bytes of the record section of one page (`Hkv·P·4D`).
    pub fn record_section_bytes(&self) -> u64 {
        (self.dims.heads * self.page_tokens) as u64 * self.record_bytes()
    }
    /// Bytes of one channel run `R = S + 32·B` (the stride of channel runs in a page).
    pub fn channel_run_bytes(&self) -> u64 {
        self.run_bytes
    }
    /// Bytes `S` of the scales at the head of a channel run (`2B` padded to 16).
    pub fn scale_pad_bytes(&self) -> u64 {
        self.scale_pad
    }
    /// Bytes a scan of depth `t` reads from one channel of one page: its scales and first `t`
    /// planes, one contiguous run from [`PagedLayout::channel_run_offset`] (`S + t·P/8`; 0 at
    /// `t = 0`).
    pub fn read_run_bytes(&self, t: usize) -> Result<u64, PageError> {
        Ok(if t == 0 {
            0
        } else {
            self.scale_pad + self.plane_run_bytes(t)?
        })
    }
    /// Offset of the record section inside a page.
    pub fn records_at(&self) -> u64 {
        self.records_at
    }
    /// The page strides of the split residency (`Residency::IndexHbm`, docs/SPEC.md §6.1):
    /// `(index, records)`, the key section with its alignment padding (the HBM pool's stride,
    /// [`PagedLayout::records_at`]) and the rest of the page (the host pool's). They add up to
    /// [`PagedLayout::page_bytes`], so the two pools hold exactly the bytes of one.
    pub fn split_page_bytes(&self) -> (u64, u64) {
        (self.records_at, self.page_bytes - self.records_at)
    }
    /// The split residency's two pools (`index`: every page's key section at stride
    /// `split_page_bytes().0`; `records`: the rest at stride `.1`) interleaved back into one pool
    /// in this layout, page by page: what the CPU readers of a pool take.
    ///
    /// # Errors
    /// A pool whose length is not [`PagedLayout::pages`] times its stride.
    pub fn join_split(&self, index: &[u8], records: &[u8]) -> Result<Vec<u8>, PageError> {
        let (key, rec) = self.split_page_bytes();
        let (key, rec) = (key as usize, rec as usize);
        for (what, got, stride) in [
            ("index pool", index.len(), key),
            ("records pool", records.len(), rec),
        ] {
            if got != self.pages * stride {
                return Err(PageError::Config {
                    what,
                    detail: format!("{got} bytes, want {} pages × {stride}", self.pages),
                });
            }
        }
        let mut out = vec![0u8; self.pool_bytes() as usize];
        for (i, page) in out.chunks_exact_mut(self.page_bytes as usize).enumerate() {
            page[..key].copy_from_slice(&index[i * key..(i + 1) * key]);
            page[key..].copy_from_slice(&records[i * rec..(i + 1) * rec]);
        }
        Ok(out)
    }

    /// Offset of `page`.
    pub fn page_offset(&self, page: PageId) -> Result<u64, PageError> {
        range("page", page.index(), self.pages)?;
        Ok(page.0 as u64 * self.page_bytes)
    }

    fn check_hc(&self, page: PageId, head: usize, channel: usize) -> Result<u64, PageError> {
        range("head", head, self.dims.heads)?;
        range("channel", channel, self.dims.channels)?;
        self.page_offset(page)
    }

    /// Offset of the channel run of (`head`, `channel`) in `page`: its scales, then its planes.
    pub fn channel_run_offset(
        &self,
        page: PageId,
        head: usize,
        channel: usize,
    ) -> Result<u64, PageError> {
        let base = self.check_hc(page, head, channel)?;
        let hc = (head * self.dims.channels + channel) as u64;
        Ok(base + hc * self.run_bytes)
    }

    /// Offset of plane 0, block 0 of (`head`, `channel`) in `page`: the start of the run whose
    /// first [`PagedLayout::plane_run_bytes`]`(t)` bytes are the channel's first `t` planes.
    pub fn plane_run_offset(
        &self,
        page: PageId,
        head: usize,
        channel: usize,
    ) -> Result<u64, PageError> {
        Ok(self.channel_run_offset(page, head, channel)? + self.scale_pad)
    }

    /// Bytes of the first `t` planes of one channel in one page (`t·P/8`), `0 ≤ t ≤ 4`.
    pub fn plane_run_bytes(&self, t: usize) -> Result<u64, PageError> {
        range("plane count", t, PLANES + 1)?;
        Ok((t * self.blocks_per_page() * 8) as u64)
    }

    /// Offset of the `u64` word of `plane`, `block` (in the page) of (`head`, `channel`).
    pub fn plane_word_offset(
        &self,
        page: PageId,
        head: usize,
        channel: usize,
        plane: usize,
        block: usize,
    ) -> Result<u64, PageError> {
        range("plane", plane, PLANES)?;
        range("block", block, self.blocks_per_page())?;
        let run = self.plane_run_offset(page, head, channel)?;
        Ok(run + ((plane * self.blocks_per_page() + block) * 8) as u64)
    }

    /// Offset of the fp16 scale of block 0 of (`head`, `channel`) in `page`; the page's `B`
    /// scales of the channel follow contiguously ([`PagedLayout::scale_run_bytes`]).
    pub fn scale_offset(
        &self,
        page: PageId,
        head: usize,
        channel: usize,
    ) -> Result<u64, PageError> {
        self.channel_run_offset(page, head, channel)
    }

    /// Offset of the fp16 scale of `block` (in the page) of (`head`, `channel`).
    pub fn block_scale_offset(
        &self,
        page: PageId,
        head: usize,
        channel: usize,
        block: usize,
    ) -> Result<u64, PageError> {
        range("block", block, self.blocks_per_page())?;
        Ok(self.scale_offset(page, head, channel)? + (block * 2) as u64)
    }

    /// Bytes of one channel's scales in one page (`2B`).
    pub fn scale_run_bytes(&self) -> u64 {
        (self.blocks_per_page() * 2) as u64
    }

    /// Offset of the K|V record of (`slot`, `head`) in `page`: `D` bf16 of K, then `D` of V.
    pub fn record_offset(&self, page: PageId, slot: usize, head: usize) -> Result<u64, PageError> {
        range("slot", slot, self.page_tokens)?;
        range("head", head, self.dims.heads)?;
        let base = self.page_offset(page)?;
        Ok(base + self.records_at + (head * self.page_tokens + slot) as u64 * self.record_bytes())
    }

    /// Bytes of one K|V record (`4·D`: bf16 K and V of one token and KV head).
    pub fn record_bytes(&self) -> u64 {
        4 * self.dims.channels as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layouts() -> Vec<PagedLayout> {
        let mut v = Vec::new();
        for &(heads, channels) in &[(1, 64), (2, 128), (3, 96), (1, 1), (2, 256)] {
            for &p in &[64, 128, 256, 1024] {
                v.push(PagedLayout::new(Dims { heads, channels }, p, 3).unwrap());
            }
        }
        v
    }

    /// Marks `[off, off + len)` in `map`, failing on any byte already marked.
    fn mark(map: &mut [u8], off: u64, len: u64, what: &str) {
        let (a, b) = (off as usize, (off + len) as usize);
        assert!(
            b <= map.len(),
            "{what}: [{a}, {b}) past the pool ({})",
            map.len()
        );
        for (i, m) in map[a..b].iter_mut().enumerate() {
            assert_eq!(*m, 0, "{what}: byte {} overlaps", a + i);
            *m = 1;
        }
    }

    #[test]
    fn runs_are_contiguous_and_disjoint_and_fill_the_page() {
        for lay in layouts() {
            let Dims { heads, channels } = lay.dims();
            let bp = lay.blocks_per_page();
            let mut map = vec![0u8; lay.pool_bytes() as usize];
            for pg in 0..lay.pages() {
                let page = PageId(pg as u32);
                for h in 0..heads {
                    for c in 0..channels {
                        let run = lay.plane_run_offset(page, h, c).unwrap();
                        assert_eq!(run % 8, 0);
                        // The first t planes are one run: word (p, b) is at run + (p·B + b)·8.
                        for p in 0..PLANES {
                            for b in 0..bp {
                                assert_eq!(
                                    lay.plane_word_offset(page, h, c, p, b).unwrap(),
                                    run + ((p * bp + b) * 8) as u64
                                );
                            }
                        }
                        for t in 0..=PLANES {
                            assert_eq!(
                                lay.plane_run_bytes(t).unwrap(),
                                (t * lay.page_tokens() / 8) as u64
                            );
                        }
                        mark(&mut map, run, lay.plane_run_bytes(4).unwrap(), "planes");
                        let s = lay.scale_offset(page, h, c).unwrap();
                        assert_eq!(s % 16, 0);
                        assert_eq!(s, lay.channel_run_offset(page, h, c).unwrap());
                        for b in 0..bp {
                            assert_eq!(
                                lay.block_scale_offset(page, h, c, b).unwrap(),
                                s + 2 * b as u64
                            );
                        }
                        mark(&mut map, s, lay.scale_run_bytes(), "scales");
                        // Scales then the first t planes: one run of S + t·P/8 bytes.
                        for t in 1..=PLANES {
                            assert_eq!(
                                s + lay.read_run_bytes(t).unwrap(),
                                run + lay.plane_run_bytes(t).unwrap()
                            );
                        }
                        assert_eq!(lay.read_run_bytes(0).unwrap(), 0);
                    }
                    for slot in 0..lay.page_tokens() {
                        let r = lay.record_offset(page, slot, h).unwrap();
                        assert_eq!(r % 2, 0);
                        mark(&mut map, r, lay.record_bytes(), "records");
                    }
                }
            }
            let used = map.iter().filter(|&&m| m == 1).count() as u64;
            let per_page = lay.key_section_bytes() + lay.record_section_bytes();
            let hd = (heads * channels) as u64;
            let pt = lay.page_tokens() as u64;
            // 64 bytes of planes per token per head at D = 128 and 2 bytes of scale per block
            // (padded to 16 per channel run), plus 4D of records.
            let pad = (2 * bp as u64).div_ceil(16) * 16;
            assert_eq!(
                per_page,
                hd * (pt / 2 + pad) + heads as u64 * pt * 4 * channels as u64
            );
            // Every byte of a channel run is a scale, a plane word or the scales' padding.
            let padding = hd * (pad - 2 * bp as u64) * lay.pages() as u64;
            assert_eq!(used + padding, per_page * lay.pages() as u64);
            assert_eq!(lay.page_bytes() % PAGE_ALIGN, 0);
            assert!(lay.page_bytes() - per_page < SECTION_ALIGN + PAGE_ALIGN);
            assert_eq!(lay.records_at() % SECTION_ALIGN, 0);
            assert!(lay.records_at() >= lay.key_section_bytes());
            // The split residency's two strides: every byte once; the records keep the
            // 16-byte alignment the row fetch's loads need.
            let (index, records) = lay.split_page_bytes();
            assert_eq!(index + records, lay.page_bytes());
            assert!(records >= lay.record_section_bytes());
            assert_eq!(records % 16, 0);
            // Joining the two pools gives back the one pool, byte for byte.
            let pool: Vec<u8> = (0..lay.pool_bytes())
                .map(|i| (i * 31 % 251) as u8)
                .collect();
            let (pb, ix) = (lay.page_bytes() as usize, index as usize);
            let idx: Vec<u8> = pool.chunks(pb).flat_map(|p| p[..ix].to_vec()).collect();
            let rec: Vec<u8> = pool.chunks(pb).flat_map(|p| p[ix..].to_vec()).collect();
            assert_eq!(lay.join_split(&idx, &rec).unwrap(), pool);
            assert!(lay.join_split(&idx[1..], &rec).is_err());
        }
    }

    #[test]
    fn out_of_range_indices_are_errors() {
        let lay = PagedLayout::new(
            Dims {
                heads: 2,
                channels: 64,
            },
            128,
            4,
        )
        .unwrap();
        let p = PageId(0);
        assert!(matches!(
            lay.plane_run_offset(PageId(4), 0, 0),
            Err(PageError::OutOfRange {
                what: "page",
                index: 4,
                limit: 4
            })
        ));
        assert!(matches!(
            lay.plane_run_offset(p, 2, 0),
            Err(PageError::OutOfRange { what: "head", .. })
        ));
        assert!(matches!(
            lay.scale_offset(p, 0, 64),
            Err(PageError::OutOfRange {
                what: "channel",
                ..
            })
        ));
        assert!(matches!(
            lay.plane_word_offset(p, 0, 0, 4, 0),
            Err(PageError::OutOfRange { what: "plane", .. })
        ));
        assert!(matches!(
            lay.plane_word_offset(p, 0, 0, 0, 2),
            Err(PageError::OutOfRange { what: "block", .. })
        ));
        assert!(matches!(
            lay.record_offset(p, 128, 0),
            Err(PageError::OutOfRange { what: "slot", .. })
        ));
        assert!(lay.plane_run_bytes(5).is_err());
    }

    #[test]
    fn bad_configs_are_errors() {
        let d = Dims {
            heads: 1,
            channels: 64,
        };
        for p in [0, 32, 96, 192] {
            assert!(matches!(
                PagedLayout::new(d, p, 1),
                Err(PageError::Config {
                    what: "page_tokens",
                    ..
                })
            ));
        }
        assert!(PagedLayout::new(d, 64, 0).is_err());
        assert!(PagedLayout::new(
            Dims {
                heads: 0,
                channels: 64
            },
            64,
            1
        )
        .is_err());
        assert!(matches!(
            PagedLayout::new(
                Dims {
                    heads: 1 << 12,
                    channels: 1 << 12
                },
                1 << 20,
                u32::MAX as usize
            ),
            Err(PageError::Config { what: "pages", .. })
        ));
    }

    #[test]
    fn qwen3_8b_page_of_1024_tokens() {
        // Hkv = 8, D = 128, P = 1024: 512 KiB of planes, 32 KiB of scales, 4 MiB of records;
        // sections already aligned, so no padding.
        let lay = PagedLayout::new(
            Dims {
                heads: 8,
                channels: 128,
            },
            1024,
            2,
        )
        .unwrap();
        // Channel runs of 32 + 512 bytes (scales, then runs of t·128 bytes of planes).
        assert_eq!(lay.channel_run_bytes(), 544);
        assert_eq!(lay.key_section_bytes(), (512 << 10) + (32 << 10));
        assert_eq!(lay.record_section_bytes(), 4 << 20);
        assert_eq!(lay.page_bytes(), (512 << 10) + (32 << 10) + (4 << 20));
        assert_eq!(lay.plane_run_bytes(4).unwrap(), 512);
    }
}
