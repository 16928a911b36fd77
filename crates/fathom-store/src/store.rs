//! The channel-major bit-plane layout (docs/SPEC.md §2) and its growable owner.
//!
//! For one KV head `h`, channel `c`, plane `p` (0 = most significant) and block `b`, the
//! word sits at `((h·D + c)·4 + p)·cap + b`, where `cap` is the reserved capacity in blocks.
//! The first `t` planes of a channel therefore span one contiguous run of
//! `(t − 1)·cap + nblocks` words (exactly `t·nblocks` when `cap = nblocks`, as in a saved
//! file). Scales sit at `(h·D + c)·cap + b`.
//!
//! # Growth and the partially filled last block
//!
//! Capacity is reserved up front, so an append never moves an existing word. The policy
//! for a partially filled last block (fewer than 64 tokens) is **re-quantize on append**:
//! its exact keys are kept in a small tail buffer (at most 63 tokens), and every append
//! that touches the block re-computes its fp16 scales from the tokens present and rewrites
//! the block's own words in place. Scans therefore read the partial block through the same
//! planes as every other block (approximately, like every other key; those tokens are also
//! inside or next to the always-kept local window of docs/SPEC.md §5 once decoding runs). When the
//! block fills, its scales and words are final. A store built at once and a store built by
//! appends of any sizes are bit-for-bit equal (tested).

use half::f16;

use crate::basis::{Basis, BasisKind};
use crate::error::{Result, StoreError};
use crate::quant::{self, QuantFault, BLOCK, PLANES};

/// Shape of a store: KV heads and channels per head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// KV heads (`Hkv`).
    pub heads: usize,
    /// Channels per head (`D`).
    pub channels: usize,
}

impl Dims {
    /// Checks that both are non-zero and that sizes cannot overflow.
    pub fn validate(self) -> Result<Self> {
        if self.heads == 0 || self.channels == 0 {
            return Err(StoreError::Dims(format!(
                "heads ({}) and channels ({}) must be positive",
                self.heads, self.channels
            )));
        }
        if self
            .heads
            .checked_mul(self.channels)
            .is_none_or(|x| x > 1 << 24)
        {
            return Err(StoreError::Dims("heads × channels is too large".into()));
        }
        Ok(self)
    }

    /// `heads · channels`, the floats per token.
    pub fn row(self) -> usize {
        self.heads * self.channels
    }

    /// Bytes per token per KV head: `D/2` of planes plus `D/32` of scales
    /// (68 at `D = 128`, docs/SPEC.md §2).
    pub fn bytes_per_token_per_head(self) -> f64 {
        self.channels as f64 / 2.0 + self.channels as f64 / 32.0
    }
}

/// Number of blocks holding `tokens` tokens.
pub fn blocks_for(tokens: u64) -> u64 {
    tokens.div_ceil(BLOCK as u64)
}

/// The lengths of the plane and scale arrays of a store of `dims` with room for `cap` blocks:
/// `(heads·D·4·cap, heads·D·cap)`, the one size computation of [`KeyStore::with_capacity`],
/// [`KeyStore::reserve`] and the file loader.
///
/// # Errors
/// [`StoreError::Dims`] if a length, or its size in bytes, overflows (an allocation can never
/// exceed `isize::MAX` bytes).
pub(crate) fn section_lens(dims: Dims, cap: usize) -> Result<(usize, usize)> {
    let hc = dims.row();
    let words = hc.checked_mul(PLANES).and_then(|x| x.checked_mul(cap));
    let scales = hc.checked_mul(cap);
    let fits = |len: usize, size: usize| {
        len.checked_mul(size)
            .is_some_and(|b| b <= isize::MAX as usize)
    };
    match (words, scales) {
        (Some(w), Some(s)) if fits(w, 8) && fits(s, 2) => Ok((w, s)),
        _ => Err(StoreError::Dims(format!(
            "a capacity of {cap} blocks of {} heads × {} channels overflows the address space",
            dims.heads, dims.channels
        ))),
    }
}

/// `len` copies of `zero`, or [`StoreError::OutOfMemory`] (never an abort) when the allocator
/// refuses: capacities come from callers (the Python binding passes the user's).
pub(crate) fn zeroed<T: Copy>(len: usize, zero: T, what: &'static str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| StoreError::OutOfMemory {
            what,
            bytes: (len as u64).saturating_mul(std::mem::size_of::<T>() as u64),
        })?;
    v.resize(len, zero);
    Ok(v)
}

/// A borrowed, read-only view of a store: what every scan reads.
///
/// Built by [`KeyStore::view`] or by a memory-mapped file.
#[derive(Debug, Clone, Copy)]
pub struct StoreView<'a> {
    pub(crate) dims: Dims,
    pub(crate) tokens: u64,
    pub(crate) cap: usize,
    pub(crate) planes: &'a [u64],
    pub(crate) scales: &'a [f16],
    pub(crate) tail: &'a [f32],
    pub(crate) basis_kind: BasisKind,
    pub(crate) basis: &'a [f32],
    pub(crate) flags: u32,
}

impl<'a> StoreView<'a> {
    /// Shape.
    pub fn dims(&self) -> Dims {
        self.dims
    }
    /// Tokens stored.
    pub fn tokens(&self) -> usize {
        self.tokens as usize
    }
    /// Blocks holding data (`⌈n/64⌉`).
    pub fn nblocks(&self) -> usize {
        blocks_for(self.tokens) as usize
    }
    /// Capacity in blocks: the stride between planes of one channel.
    pub fn cap_blocks(&self) -> usize {
        self.cap
    }
    /// Header flags (see [`crate::file::FLAG_SQUEEZE_HEADS`]).
    pub fn flags(&self) -> u32 {
        self.flags
    }
    /// The basis the channels are in.
    pub fn basis_kind(&self) -> BasisKind {
        self.basis_kind
    }
    /// Row-major `[heads][D][D]` rotation matrices (empty for a raw store).
    pub fn basis_matrices(&self) -> &'a [f32] {
        self.basis
    }
    /// Rotates a query (or key) of `head` into the store's basis: `out = U_hᵀ x`.
    /// A raw store copies.
    ///
    /// # Panics
    /// If `head ≥ heads` or `x` or `out` is not `D` long (a programming error: no other
    /// head's matrix is read and no slice is zero-padded or cut silently).
    pub fn rotate_query(&self, head: usize, x: &[f32], out: &mut [f32]) {
        let d = self.dims.channels;
        self.assert_head_channel(head, 0);
        assert!(
            x.len() == d && out.len() == d,
            "rotate_query: x ({}) and out ({}) must be D = {d} long",
            x.len(),
            out.len()
        );
        if self.basis_kind == BasisKind::Raw {
            out[..d].copy_from_slice(&x[..d]);
        } else {
            let d2 = d * d;
            crate::basis::rotate_with(&self.basis[head * d2..(head + 1) * d2], d, x, out);
        }
    }

    /// All plane words (`[heads][D][4][cap]`).
    pub fn plane_words(&self) -> &'a [u64] {
        self.planes
    }
    /// All scales (`[heads][D][cap]`).
    pub fn scale_words(&self) -> &'a [f16] {
        self.scales
    }
    /// Exact (basis-rotated) keys of the partial last block, `[tail_len][heads][D]`.
    pub fn tail(&self) -> &'a [f32] {
        self.tail
    }

    /// Panics unless `head < heads` and `channel < D` (the accessors' shared contract).
    #[inline]
    #[track_caller]
    fn assert_head_channel(&self, head: usize, channel: usize) {
        assert!(
            head < self.dims.heads && channel < self.dims.channels,
            "head {head} / channel {channel} out of range ({} heads × {} channels)",
            self.dims.heads,
            self.dims.channels
        );
    }

    /// The first `t` planes of channel `c` of head `h`: one contiguous run of
    /// `(t − 1)·cap + nblocks` words; plane `p` starts at offset `p·cap`.
    ///
    /// # Panics
    /// If `head ≥ heads`, `channel ≥ D` or `t > 4` (a programming error: the run would be
    /// another channel's words).
    pub fn channel_run(&self, head: usize, channel: usize, t: usize) -> &'a [u64] {
        self.assert_head_channel(head, channel);
        assert!(t <= PLANES, "channel_run: t = {t} planes (at most 4)");
        if t == 0 {
            return &[];
        }
        let base = ((head * self.dims.channels + channel) * PLANES) * self.cap;
        &self.planes[base..base + (t - 1) * self.cap + self.nblocks()]
    }

    /// Plane `p` of channel `c`, head `h`: `nblocks` words.
    ///
    /// # Panics
    /// If `head ≥ heads`, `channel ≥ D` or `p ≥ 4` (a programming error).
    pub fn plane(&self, head: usize, channel: usize, p: usize) -> &'a [u64] {
        self.assert_head_channel(head, channel);
        assert!(p < PLANES, "plane: p = {p} (planes are 0..4)");
        let base = ((head * self.dims.channels + channel) * PLANES + p) * self.cap;
        &self.planes[base..base + self.nblocks()]
    }

    /// Scales of channel `c`, head `h`: `nblocks` fp16 values.
    ///
    /// # Panics
    /// If `head ≥ heads` or `channel ≥ D` (a programming error).
    pub fn channel_scales(&self, head: usize, channel: usize) -> &'a [f16] {
        self.assert_head_channel(head, channel);
        let base = (head * self.dims.channels + channel) * self.cap;
        &self.scales[base..base + self.nblocks()]
    }

    /// The 4-bit code of token `i`, head `h`, channel `c`, reassembled from the planes.
    ///
    /// # Panics
    /// If `i ≥ tokens`, `head ≥ heads` or `channel ≥ D` (a programming error).
    pub fn code(&self, i: usize, head: usize, channel: usize) -> u8 {
        assert!(i < self.tokens(), "code: token {i} of {}", self.tokens());
        let (b, bit) = (i / BLOCK, i % BLOCK);
        let mut q = 0u8;
        for p in 0..PLANES {
            let w = self.plane(head, channel, p)[b];
            q |= (((w >> bit) & 1) as u8) << (3 - p);
        }
        q
    }

    /// Exact prefix dequantization of all keys at `t` planes (docs/SPEC.md §2), `[n][heads][D]`,
    /// in the store's basis.
    pub fn dequant_prefix(&self, t: u32) -> Result<Vec<f32>> {
        if t > 4 {
            return Err(StoreError::Planes(t));
        }
        let (h_n, d) = (self.dims.heads, self.dims.channels);
        let n = self.tokens();
        let mut out = vec![0f32; n * h_n * d];
        if t == 0 {
            return Ok(out);
        }
        let shift = 4 - t;
        for h in 0..h_n {
            for c in 0..d {
                let scales = self.channel_scales(h, c);
                let planes: [&[u64]; PLANES] = std::array::from_fn(|p| self.plane(h, c, p));
                for i in 0..n {
                    let (b, bit) = (i / BLOCK, i % BLOCK);
                    let mut q = 0u8;
                    for (p, pl) in planes.iter().enumerate() {
                        q |= (((pl[b] >> bit) & 1) as u8) << (3 - p);
                    }
                    out[(i * h_n + h) * d + c] =
                        quant::prefix_value(q >> shift, t, scales[b].to_f32());
                }
            }
        }
        Ok(out)
    }
}

/// An owned, growable store for one layer: `heads` KV heads of `D` channels.
///
/// Appends never move existing words (capacity is reserved at creation); see the module
/// docs for the partial-block policy.
#[derive(Debug, Clone)]
pub struct KeyStore {
    dims: Dims,
    tokens: u64,
    cap: usize,
    planes: Vec<u64>,
    scales: Vec<f16>,
    tail: Vec<f32>,
    basis: Option<Basis>,
    flags: u32,
}

impl KeyStore {
    /// An empty store with room for `capacity_tokens` tokens (rounded up to whole blocks).
    ///
    /// # Errors
    /// [`StoreError::Dims`] for zero or too large dimensions, or a capacity whose sizes
    /// overflow; [`StoreError::OutOfMemory`] when the memory cannot be allocated;
    /// [`StoreError::Basis`] for a basis of another shape.
    pub fn with_capacity(dims: Dims, capacity_tokens: usize, basis: Option<Basis>) -> Result<Self> {
        let dims = dims.validate()?;
        if let Some(b) = &basis {
            if b.heads() != dims.heads || b.dim() != dims.channels {
                return Err(StoreError::Basis(format!(
                    "basis is for {} heads × {} channels, store is {} × {}",
                    b.heads(),
                    b.dim(),
                    dims.heads,
                    dims.channels
                )));
            }
        }
        let cap = blocks_for(capacity_tokens as u64) as usize;
        let (words, nscales) = section_lens(dims, cap)?;
        Ok(Self {
            dims,
            tokens: 0,
            cap,
            planes: zeroed(words, 0u64, "plane words")?,
            scales: zeroed(nscales, f16::ZERO, "block scales")?,
            tail: Vec::new(),
            basis,
            flags: 0,
        })
    }

    /// Quantizes `keys` (`[n][heads][D]` row-major, in the model's channels) at once.
    ///
    /// With a basis, each key is rotated first (`k' = U_hᵀ k`).
    pub fn from_keys(dims: Dims, keys: &[f32], basis: Option<Basis>) -> Result<Self> {
        let dims = dims.validate()?;
        if keys.len() % dims.row() != 0 {
            return Err(StoreError::Shape {
                what: "keys [n][heads][D]",
                expected: dims.row() * (keys.len() / dims.row()).max(1),
                got: keys.len(),
            });
        }
        let n = keys.len() / dims.row();
        let mut s = Self::with_capacity(dims, n, basis)?;
        s.append(keys)?;
        Ok(s)
    }

    /// Shape.
    pub fn dims(&self) -> Dims {
        self.dims
    }
    /// Tokens stored.
    pub fn tokens(&self) -> usize {
        self.tokens as usize
    }
    /// Reserved capacity in tokens.
    pub fn capacity(&self) -> usize {
        self.cap * BLOCK
    }
    /// The rotation, if any.
    pub fn basis(&self) -> Option<&Basis> {
        self.basis.as_ref()
    }

    /// The read-only view every scan takes.
    pub fn view(&self) -> StoreView<'_> {
        StoreView {
            dims: self.dims,
            tokens: self.tokens,
            cap: self.cap,
            planes: &self.planes,
            scales: &self.scales,
            tail: &self.tail,
            basis_kind: self.basis.as_ref().map_or(BasisKind::Raw, |b| b.kind()),
            basis: self.basis.as_ref().map_or(&[][..], |b| b.matrices()),
            flags: self.flags,
        }
    }

    /// Grows the reserved capacity to at least `capacity_tokens` (rounded up to whole
    /// blocks), moving each channel run once; a no-op when the store is already that large.
    /// The stored words, scales and tail are unchanged, so the store reads the same.
    ///
    /// # Errors
    /// As [`KeyStore::with_capacity`]; on error the store is unchanged.
    pub fn reserve(&mut self, capacity_tokens: usize) -> Result<()> {
        let cap = blocks_for(capacity_tokens as u64) as usize;
        if cap <= self.cap {
            return Ok(());
        }
        let hc = self.dims.row();
        let (words, nscales) = section_lens(self.dims, cap)?;
        let nb = blocks_for(self.tokens) as usize;
        let mut planes = zeroed(words, 0u64, "plane words")?;
        let mut scales = zeroed(nscales, f16::ZERO, "block scales")?;
        for i in 0..hc * PLANES {
            planes[i * cap..i * cap + nb]
                .copy_from_slice(&self.planes[i * self.cap..i * self.cap + nb]);
        }
        for i in 0..hc {
            scales[i * cap..i * cap + nb]
                .copy_from_slice(&self.scales[i * self.cap..i * self.cap + nb]);
        }
        self.planes = planes;
        self.scales = scales;
        self.cap = cap;
        Ok(())
    }

    /// Appends `keys` (`[m][heads][D]`, model channels) after the stored tokens.
    ///
    /// Validates everything first: on error nothing is changed.
    pub fn append(&mut self, keys: &[f32]) -> Result<()> {
        let row = self.dims.row();
        if keys.len() % row != 0 {
            return Err(StoreError::Shape {
                what: "appended keys [m][heads][D]",
                expected: row * (keys.len() / row + 1),
                got: keys.len(),
            });
        }
        let m = keys.len() / row;
        let needed = self.tokens + m as u64;
        if needed > (self.cap * BLOCK) as u64 {
            return Err(StoreError::CapacityExceeded {
                needed,
                capacity: (self.cap * BLOCK) as u64,
            });
        }
        if let Some(pos) = keys.iter().position(|x| !x.is_finite()) {
            let (tok, rest) = (pos / row, pos % row);
            return Err(StoreError::NonFinite {
                token: self.tokens + tok as u64,
                head: rest / self.dims.channels,
                channel: rest % self.dims.channels,
                value: keys[pos],
            });
        }
        // Rotate into the store's basis.
        let rotated;
        let keys = match &self.basis {
            None => keys,
            Some(b) => {
                let d = self.dims.channels;
                let mut r = vec![0f32; keys.len()];
                for t in 0..m {
                    for h in 0..self.dims.heads {
                        let off = t * row + h * d;
                        b.rotate(h, &keys[off..off + d], &mut r[off..off + d]);
                    }
                }
                rotated = r;
                &rotated[..]
            }
        };
        // Check fp16 overflow of every block touched before writing anything.
        let mut staged: Vec<(usize, Vec<f32>)> = Vec::new();
        let mut consumed = 0usize;
        let mut tokens = self.tokens as usize;
        // A copy: on an error below, `self.tail` must still hold the partial block.
        let mut tail = self.tail.clone();
        while consumed < m {
            let in_block = tokens % BLOCK;
            let take = (BLOCK - in_block).min(m - consumed);
            tail.extend_from_slice(&keys[consumed * row..(consumed + take) * row]);
            consumed += take;
            tokens += take;
            let block = (tokens - 1) / BLOCK;
            if tokens % BLOCK == 0 {
                staged.push((block, std::mem::take(&mut tail)));
            } else {
                staged.push((block, tail.clone()));
            }
        }
        // Quantize staged blocks into scratch first (so an overflow leaves the store intact).
        let mut results = Vec::with_capacity(staged.len());
        for (block, vals) in &staged {
            results.push(self.quantize_block_rows(*block, vals)?);
        }
        for ((block, _), qb) in staged.iter().zip(results) {
            self.write_block(*block, &qb);
        }
        self.tokens = tokens as u64;
        self.tail = tail;
        Ok(())
    }

    /// Quantizes rows `[len][heads][D]` of block `block` into per-(head, channel) scale and words.
    fn quantize_block_rows(&self, block: usize, rows: &[f32]) -> Result<Vec<(f16, [u64; PLANES])>> {
        let (h_n, d) = (self.dims.heads, self.dims.channels);
        let row = h_n * d;
        let len = rows.len() / row;
        let mut col = vec![0f32; len];
        let mut out = Vec::with_capacity(row);
        for h in 0..h_n {
            for c in 0..d {
                for (i, v) in col.iter_mut().enumerate() {
                    *v = rows[i * row + h * d + c];
                }
                match quant::quantize_block(&col) {
                    Ok(x) => out.push(x),
                    Err((i, fault)) => {
                        let token = (block * BLOCK + i) as u64;
                        return Err(match fault {
                            QuantFault::NonFinite => StoreError::NonFinite {
                                token,
                                head: h,
                                channel: c,
                                value: col[i],
                            },
                            QuantFault::Overflow => StoreError::ScaleOverflow {
                                token,
                                head: h,
                                channel: c,
                                value: col[i],
                            },
                            // A block is never longer than 64 rows, and the scale is computed
                            // by `quantize_block` itself: kept typed regardless.
                            QuantFault::TooLong | QuantFault::BadScale => StoreError::Shape {
                                what: "block rows (at most 64 tokens)",
                                expected: BLOCK,
                                got: len,
                            },
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    fn write_block(&mut self, block: usize, qb: &[(f16, [u64; PLANES])]) {
        for (hc, (m, words)) in qb.iter().enumerate() {
            self.scales[hc * self.cap + block] = *m;
            for (p, w) in words.iter().enumerate() {
                self.planes[(hc * PLANES + p) * self.cap + block] = *w;
            }
        }
    }

    /// Rebuilds an owned store from raw parts (used by the file loader).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn from_parts(
        dims: Dims,
        tokens: u64,
        cap: usize,
        planes: Vec<u64>,
        scales: Vec<f16>,
        tail: Vec<f32>,
        basis: Option<Basis>,
    ) -> Self {
        Self {
            dims,
            tokens,
            cap,
            planes,
            scales,
            tail,
            basis,
            flags: 0,
        }
    }

    /// Sets the header flags saved with the store (see [`crate::file::FLAG_SQUEEZE_HEADS`]).
    /// Only the bits of [`crate::file::KNOWN_FLAGS`] may be saved: [`KeyStore::save`] refuses
    /// any other with [`StoreError::UnknownFlags`] before writing.
    pub fn set_flags(&mut self, flags: u32) {
        self.flags = flags;
    }
}
