//! The versioned on-disk format (docs/SPEC.md §8 "Store") and atomic writes.
//!
//! Little-endian, version 1:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `FATHOMKS` |
//! | 8 | 4 | version (1) |
//! | 12 | 4 | header length (64) |
//! | 16 | 4 | heads |
//! | 20 | 4 | channels `D` |
//! | 24 | 8 | tokens `n` |
//! | 32 | 8 | blocks `⌈n/64⌉` (the saved capacity) |
//! | 40 | 4 | tail length (`n mod 64`) |
//! | 44 | 4 | basis kind (0 raw, 1 KLT, 2 custom) |
//! | 48 | 8 | payload length |
//! | 56 | 4 | CRC-32 of every other byte of the file (0..56 and 60..end) |
//! | 60 | 4 | flags (bit 0: the source tensor was `[N, D]`, heads squeezed) |
//!
//! Payload: planes `[heads][D][4][nblocks]` u64; scales `[heads][D][nblocks]` f16, zero-padded
//! to 8 bytes; tail `[tail][heads][D]` f32; basis `[heads][D][D]` f32 if the kind is not raw.
//! Every section starts 8-byte aligned, so a memory map is read in place.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::basis::{Basis, BasisKind};
use crate::error::{Result, StoreError};
use crate::quant::{BLOCK, PLANES};
use crate::store::{blocks_for, section_lens, zeroed, Dims, KeyStore, StoreView};

/// File magic.
pub const MAGIC: [u8; 8] = *b"FATHOMKS";
/// Header flag: the source tensor was rank 2 (`[N, D]`, one head).
pub const FLAG_SQUEEZE_HEADS: u32 = 1;
/// Every flag bit this build knows; a file with another bit set is refused by the loader, and
/// [`KeyStore::save`] refuses to write one.
pub const KNOWN_FLAGS: u32 = FLAG_SQUEEZE_HEADS;
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;

/// The fixed 64-byte header.
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
#[repr(C)]
pub struct FileHeader {
    /// `FATHOMKS`.
    pub magic: [u8; 8],
    /// Format version.
    pub version: u32,
    /// Header length in bytes (64).
    pub header_len: u32,
    /// KV heads.
    pub heads: u32,
    /// Channels per head.
    pub channels: u32,
    /// Tokens.
    pub tokens: u64,
    /// Blocks (= saved capacity).
    pub nblocks: u64,
    /// Tokens in the partial last block.
    pub tail_len: u32,
    /// [`BasisKind`] as u32.
    pub basis_kind: u32,
    /// Payload bytes after the header.
    pub payload_len: u64,
    /// CRC-32 over every other byte of the file (0..56 and 60..end).
    pub checksum: u32,
    /// Flags: bit 0 = [`FLAG_SQUEEZE_HEADS`]; other bits must be zero.
    pub flags: u32,
}

const _: () = assert!(std::mem::size_of::<FileHeader>() == 64);
const _: () = assert!(std::mem::size_of::<f16>() == 2);
const _: () = assert!(std::mem::size_of::<[u64; PLANES]>() == 32);
#[cfg(target_endian = "big")]
compile_error!("fathom-store's file format and mmap loading assume a little-endian host");

struct Sections {
    planes: usize,
    scales: usize,
    scales_padded: usize,
    tail: usize,
    basis: usize,
}

impl Sections {
    fn total(&self) -> Option<u64> {
        (self.planes as u64)
            .checked_add(self.scales_padded as u64)?
            .checked_add(self.tail as u64)?
            .checked_add(self.basis as u64)
    }
}

fn sections(h: &FileHeader) -> Option<Sections> {
    let hc = (h.heads as u64).checked_mul(h.channels as u64)?;
    let planes = hc
        .checked_mul(PLANES as u64)?
        .checked_mul(h.nblocks)?
        .checked_mul(8)?;
    let scales = hc.checked_mul(h.nblocks)?.checked_mul(2)?;
    let scales_padded = scales.div_ceil(8).checked_mul(8)?;
    let tail = (h.tail_len as u64).checked_mul(hc)?.checked_mul(4)?;
    let basis = if h.basis_kind == 0 {
        0
    } else {
        hc.checked_mul(h.channels as u64)?.checked_mul(4)?
    };
    let cv = |x: u64| usize::try_from(x).ok();
    Some(Sections {
        planes: cv(planes)?,
        scales: cv(scales)?,
        scales_padded: cv(scales_padded)?,
        tail: cv(tail)?,
        basis: cv(basis)?,
    })
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, fsync,
/// rename, then fsync of the directory. On any error the temporary file is removed and
/// `path` is untouched.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic_with(path, |f| f.write_all(bytes))
}

/// Like [`write_atomic`], streaming through `write` into the temporary file.
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<&File>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "path has no file name")
    })?;
    // Unique per process and per call, so that threads writing the same path concurrently
    // never share a temporary file (the last rename wins with a whole file).
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let result = (|| {
        let f = File::create(&tmp)?;
        {
            let mut w = std::io::BufWriter::new(&f);
            write(&mut w)?;
            w.flush()?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Serialises a view into the version-1 byte layout (compacting capacity to `nblocks`).
///
/// The view's flags are written as they are: a view of a store whose flags hold a bit outside
/// [`KNOWN_FLAGS`] gives bytes the loader refuses ([`KeyStore::save`] checks first).
pub fn to_bytes(v: &StoreView<'_>) -> Vec<u8> {
    let dims = v.dims();
    let nb = v.nblocks();
    let hc = dims.row();
    let mut header = FileHeader {
        magic: MAGIC,
        version: VERSION,
        header_len: 64,
        heads: dims.heads as u32,
        channels: dims.channels as u32,
        tokens: v.tokens() as u64,
        nblocks: nb as u64,
        tail_len: (v.tokens() % BLOCK) as u32,
        basis_kind: v.basis_kind() as u32,
        payload_len: 0,
        checksum: 0,
        flags: v.flags,
    };
    let sec = sections(&header).expect("an in-memory store has representable sections");
    header.payload_len = sec.total().expect("fits");
    let mut out = Vec::with_capacity(64 + header.payload_len as usize);
    out.extend_from_slice(bytemuck::bytes_of(&header));
    for hcix in 0..hc {
        for p in 0..PLANES {
            let (h, c) = (hcix / dims.channels, hcix % dims.channels);
            out.extend_from_slice(bytemuck::cast_slice(v.plane(h, c, p)));
        }
    }
    for hcix in 0..hc {
        let (h, c) = (hcix / dims.channels, hcix % dims.channels);
        out.extend_from_slice(bytemuck::cast_slice(v.channel_scales(h, c)));
    }
    out.resize(out.len() + (sec.scales_padded - sec.scales), 0);
    out.extend_from_slice(bytemuck::cast_slice(v.tail()));
    out.extend_from_slice(bytemuck::cast_slice(v.basis_matrices()));
    debug_assert_eq!(out.len() as u64, 64 + header.payload_len);
    let crc = checksum(&out);
    out[56..60].copy_from_slice(&crc.to_le_bytes());
    out
}

fn checksum(file: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&file[..56]);
    h.update(&file[60..]);
    h.finalize()
}

/// Parsed and verified file contents, borrowed from a byte buffer.
struct Parsed<'a> {
    header: FileHeader,
    planes: &'a [u64],
    scales: &'a [f16],
    tail: &'a [f32],
    basis: &'a [f32],
}

/// Splits a size-checked buffer into its sections (no verification).
fn slice_sections<'a>(header: &FileHeader, bytes: &'a [u8]) -> Option<Parsed<'a>> {
    let sec = sections(header)?;
    let payload = bytes.get(64..)?;
    if payload.len() as u64 != sec.total()? {
        return None;
    }
    let (planes, rest) = payload.split_at(sec.planes);
    let (scales, rest) = rest.split_at(sec.scales_padded);
    let (tail, basis) = rest.split_at(sec.tail);
    Some(Parsed {
        header: *header,
        planes: bytemuck::try_cast_slice(planes).ok()?,
        scales: bytemuck::try_cast_slice(&scales[..sec.scales]).ok()?,
        tail: bytemuck::try_cast_slice(tail).ok()?,
        basis: bytemuck::try_cast_slice(basis).ok()?,
    })
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<Parsed<'a>> {
    let corrupt = |reason: String| StoreError::CorruptHeader {
        path: path.to_path_buf(),
        reason,
    };
    if bytes.len() < 8 || bytes[..8] != MAGIC {
        if bytes.len() < 64 && MAGIC.starts_with(&bytes[..bytes.len().min(8)]) {
            return Err(StoreError::Truncated {
                path: path.to_path_buf(),
                expected: 64,
                actual: bytes.len() as u64,
            });
        }
        return Err(StoreError::BadMagic {
            path: path.to_path_buf(),
        });
    }
    if bytes.len() < 64 {
        return Err(StoreError::Truncated {
            path: path.to_path_buf(),
            expected: 64,
            actual: bytes.len() as u64,
        });
    }
    let header: FileHeader = bytemuck::pod_read_unaligned(&bytes[..64]);
    if header.version != VERSION {
        return Err(StoreError::Version {
            path: path.to_path_buf(),
            found: header.version,
            supported: VERSION,
        });
    }
    if header.header_len != 64 {
        return Err(corrupt(format!(
            "header length {} (expected 64)",
            header.header_len
        )));
    }
    let sec = sections(&header).ok_or_else(|| corrupt("section sizes overflow".into()))?;
    let total = sec
        .total()
        .ok_or_else(|| corrupt("section sizes overflow".into()))?;
    if total != header.payload_len {
        return Err(corrupt(format!(
            "payload length {} does not match the shapes ({total})",
            header.payload_len
        )));
    }
    let expected = 64 + total;
    if bytes.len() as u64 != expected {
        return Err(StoreError::Truncated {
            path: path.to_path_buf(),
            expected,
            actual: bytes.len() as u64,
        });
    }
    let computed = checksum(bytes);
    if computed != header.checksum {
        return Err(StoreError::Checksum {
            path: path.to_path_buf(),
            stored: header.checksum,
            computed,
        });
    }
    // Semantic checks, after the checksum (a valid checksum with bad shapes is a writer bug).
    if header.heads == 0 || header.channels == 0 {
        return Err(corrupt("zero heads or channels".into()));
    }
    // The same bound as in-memory stores: a 64-byte empty store claiming 2³² × 2³² channels
    // would otherwise make loaders and scans loop (or overflow) over nothing (fuzz: store).
    Dims {
        heads: header.heads as usize,
        channels: header.channels as usize,
    }
    .validate()
    .map_err(|e| corrupt(e.to_string()))?;
    if header.nblocks != blocks_for(header.tokens) {
        return Err(corrupt(format!(
            "{} blocks for {} tokens",
            header.nblocks, header.tokens
        )));
    }
    if header.tail_len as u64 != header.tokens % BLOCK as u64 {
        return Err(corrupt(format!(
            "tail of {} tokens for {} tokens",
            header.tail_len, header.tokens
        )));
    }
    if header.flags & !KNOWN_FLAGS != 0 {
        return Err(corrupt(format!("unknown flags {:#x}", header.flags)));
    }
    if BasisKind::from_u32(header.basis_kind).is_none() {
        return Err(corrupt(format!("unknown basis kind {}", header.basis_kind)));
    }
    let parsed =
        slice_sections(&header, bytes).ok_or_else(|| corrupt("a section is misaligned".into()))?;
    if let Some(i) = parsed
        .tail
        .iter()
        .chain(parsed.basis)
        .position(|x| !x.is_finite())
    {
        return Err(corrupt(format!(
            "non-finite float at index {i} of the tail/basis"
        )));
    }
    if let Some(i) = parsed
        .scales
        .iter()
        .position(|x| !x.is_finite() || x.to_f32() < 0.0)
    {
        return Err(corrupt(format!("invalid block scale at index {i}")));
    }
    Ok(parsed)
}

impl KeyStore {
    /// Saves atomically (temporary file, fsync, rename) in format version 1.
    ///
    /// # Errors
    /// [`StoreError::UnknownFlags`] if [`KeyStore::set_flags`] set a bit outside
    /// [`KNOWN_FLAGS`] (the loader would refuse the file), checked before anything is written;
    /// [`StoreError::Io`] for a failed write (the destination is then untouched).
    pub fn save(&self, path: &Path) -> Result<()> {
        let flags = self.view().flags();
        if flags & !KNOWN_FLAGS != 0 {
            return Err(StoreError::UnknownFlags {
                flags,
                known: KNOWN_FLAGS,
            });
        }
        let bytes = to_bytes(&self.view());
        write_atomic(path, &bytes).map_err(io_err(path))
    }

    /// Loads a file into an owned, appendable store (capacity = stored blocks; see
    /// [`KeyStore::load_with_capacity`]).
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_with_capacity(path, 0)
    }

    /// Loads a file, reserving room for at least `capacity_tokens` tokens.
    ///
    /// # Errors
    /// The file errors of [`MappedStore::open`] (I/O, magic, version, sizes, checksum, corrupt
    /// header); the capacity errors of [`KeyStore::with_capacity`] (sizes that overflow,
    /// [`StoreError::OutOfMemory`]).
    pub fn load_with_capacity(path: &Path, capacity_tokens: usize) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(io_err(path))?;
        // Copy into an 8-aligned buffer.
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(&bytes);
        let aligned = &bytemuck::cast_slice::<u64, u8>(&words)[..bytes.len()];
        let p = parse(path, aligned)?;
        let h = p.header;
        let dims = Dims {
            heads: h.heads as usize,
            channels: h.channels as usize,
        };
        let nb = h.nblocks as usize;
        let cap = nb.max(blocks_for(capacity_tokens as u64) as usize);
        let hc = dims.row();
        let (words, nscales) = section_lens(dims, cap)?;
        let mut planes = zeroed(words, 0u64, "plane words")?;
        let mut scales = zeroed(nscales, f16::ZERO, "block scales")?;
        // (No blocks, nothing to copy: skip the heads × channels loop; fuzz: store.)
        for i in 0..if nb == 0 { 0 } else { hc * PLANES } {
            planes[i * cap..i * cap + nb].copy_from_slice(&p.planes[i * nb..(i + 1) * nb]);
        }
        for i in 0..if nb == 0 { 0 } else { hc } {
            scales[i * cap..i * cap + nb].copy_from_slice(&p.scales[i * nb..(i + 1) * nb]);
        }
        let basis = match BasisKind::from_u32(h.basis_kind) {
            Some(BasisKind::Raw) | None => None,
            Some(k) => Some(Basis::new(k, dims.heads, dims.channels, p.basis.to_vec())?),
        };
        let mut s =
            KeyStore::from_parts(dims, h.tokens, cap, planes, scales, p.tail.to_vec(), basis);
        s.set_flags(h.flags);
        Ok(s)
    }
}

/// A read-only store memory-mapped from a file (verified on open).
#[derive(Debug)]
pub struct MappedStore {
    map: memmap2::Mmap,
    header: FileHeader,
}

impl MappedStore {
    /// Maps and verifies (magic, version, sizes, checksum) a store file.
    pub fn open(path: &Path) -> Result<Self> {
        let f = File::open(path).map_err(io_err(path))?;
        // SAFETY: the map is read-only; the file may be modified by another process while
        // mapped, which would be a misuse outside our control (as with any mmap). Files we
        // write are replaced by rename, never rewritten in place.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(io_err(path))?;
        let header = parse(path, &map)?.header;
        Ok(Self { map, header })
    }

    /// The header.
    pub fn header(&self) -> &FileHeader {
        &self.header
    }

    /// The view every scan takes, borrowing the mapped words in place.
    pub fn view(&self) -> StoreView<'_> {
        // Sizes and alignment were verified at open (a page-aligned map, 8-aligned sections)
        // and the map is immutable, so slicing cannot fail.
        let p = slice_sections(&self.header, &self.map).expect("verified at open");
        StoreView {
            dims: Dims {
                heads: p.header.heads as usize,
                channels: p.header.channels as usize,
            },
            tokens: p.header.tokens,
            cap: p.header.nblocks as usize,
            planes: p.planes,
            scales: p.scales,
            tail: p.tail,
            basis_kind: BasisKind::from_u32(p.header.basis_kind).unwrap_or(BasisKind::Raw),
            basis: p.basis,
            flags: p.header.flags,
        }
    }
}
