//! Typed errors of the GPU forward.

/// Everything the GPU forward refuses or fails at; every check runs before any launch.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The cache, the device or a kernel of `fathom-cuda` failed or refused.
    #[error(transparent)]
    Cuda(#[from] fathom_cuda::CudaError),
    /// The model runtime (weights, tokenizer) failed.
    #[error(transparent)]
    Model(#[from] fathom_model::Error),
    /// cuBLAS could not be loaded.
    #[error("cuBLAS not found ({message}); on the device it is /usr/local/cuda/lib64/libcublas.so.13: add its folder to LD_LIBRARY_PATH")]
    NoCublas {
        /// The loader's messages.
        message: String,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS `{op}` failed: {message}")]
    Blas {
        /// What was being done.
        op: &'static str,
        /// cuBLAS's status.
        message: String,
    },
    /// Arguments that do not fit the model or the decoder's limits.
    #[error("invalid {what}: {detail}")]
    Invalid {
        /// Which argument.
        what: &'static str,
        /// Why.
        detail: String,
    },
}

impl GpuError {
    pub(crate) fn invalid(what: &'static str, detail: impl Into<String>) -> Self {
        GpuError::Invalid {
            what,
            detail: detail.into(),
        }
    }
}

/// `Result` with [`GpuError`].
pub type Result<T> = std::result::Result<T, GpuError>;
