//! Typed errors of the store.

use std::path::PathBuf;

/// Everything that can go wrong while building, reading or writing a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A key value is NaN or infinite.
    #[error("key value at token {token}, head {head}, channel {channel} is {value} (NaN or Inf is not allowed)")]
    NonFinite {
        /// Token index (global, counting from the first token of the store).
        token: u64,
        /// KV head.
        head: usize,
        /// Channel (in the store's basis).
        channel: usize,
        /// The offending value.
        value: f32,
    },
    /// A block maximum does not fit in fp16 (|k| > 65504 after rounding).
    #[error("key magnitude {value} at token {token}, head {head}, channel {channel} overflows the fp16 block scale (max 65504)")]
    ScaleOverflow {
        /// Token index.
        token: u64,
        /// KV head.
        head: usize,
        /// Channel.
        channel: usize,
        /// The offending value.
        value: f32,
    },
    /// A slice has the wrong length for the store's shape.
    #[error("shape mismatch in {what}: expected {expected}, got {got}")]
    Shape {
        /// What was being checked.
        what: &'static str,
        /// Expected length or size.
        expected: usize,
        /// Actual length or size.
        got: usize,
    },
    /// Dimensions that cannot form a store (zero heads, zero channels, overflow).
    #[error("invalid dimensions: {0}")]
    Dims(String),
    /// Appending would exceed the reserved capacity (appends never move words).
    #[error("store capacity exceeded: {needed} tokens needed, {capacity} reserved; create the store with a larger capacity")]
    CapacityExceeded {
        /// Tokens the append would need.
        needed: u64,
        /// Tokens reserved.
        capacity: u64,
    },
    /// The memory for a store could not be allocated (a capacity too large for this machine).
    #[error("cannot allocate {bytes} bytes of {what}: out of memory (reserve a smaller capacity)")]
    OutOfMemory {
        /// What was being allocated.
        what: &'static str,
        /// The bytes asked for.
        bytes: u64,
    },
    /// Header flags with a bit this format version does not define.
    #[error("unknown store flags {flags:#x} (this build knows {known:#x})")]
    UnknownFlags {
        /// The flags.
        flags: u32,
        /// Every bit this build defines ([`crate::file::KNOWN_FLAGS`]).
        known: u32,
    },
    /// A prefix depth outside 0..=4.
    #[error("plane count {0} is out of range (0..=4)")]
    Planes(u32),
    /// A code that is not a 4-bit code.
    #[error("code {0} is not a 4-bit code (0..=15)")]
    Code(u8),
    /// A basis that does not match the store (wrong size or non-finite entries).
    #[error("invalid basis: {0}")]
    Basis(String),
    /// The file is not a store (wrong magic).
    #[error("{path}: not a Fathom store file (bad magic)")]
    BadMagic {
        /// File path.
        path: PathBuf,
    },
    /// The file has an unsupported format version.
    #[error(
        "{path}: unsupported store format version {found} (this build reads version {supported})"
    )]
    Version {
        /// File path.
        path: PathBuf,
        /// Version found in the header.
        found: u32,
        /// Version this build supports.
        supported: u32,
    },
    /// The file is shorter or longer than its header says.
    #[error("{path}: truncated or padded store file: header implies {expected} bytes, file has {actual}")]
    Truncated {
        /// File path.
        path: PathBuf,
        /// Size implied by the header.
        expected: u64,
        /// Actual size.
        actual: u64,
    },
    /// The header is inconsistent (impossible shapes).
    #[error("{path}: corrupt store header: {reason}")]
    CorruptHeader {
        /// File path.
        path: PathBuf,
        /// What is inconsistent.
        reason: String,
    },
    /// The checksum does not match the contents.
    #[error("{path}: store checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the file is corrupt")]
    Checksum {
        /// File path.
        path: PathBuf,
        /// Checksum in the header.
        stored: u32,
        /// Checksum of the contents.
        computed: u32,
    },
    /// An I/O error, with the path involved.
    #[error("{path}: {source}")]
    Io {
        /// File path.
        path: PathBuf,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// Result alias for the store.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
