//! Typed errors of the GPU path, with the sizes and names that locate them.

/// Everything that can go wrong on (or on the way to) the device.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The crate was built without the `cuda` feature.
    #[error("fathom-cuda was built without the `cuda` feature (rebuild with `--features cuda`)")]
    NotCompiledWithCuda,
    /// No driver library, or no device, or the driver refused to initialise.
    #[error("no CUDA device: {message}")]
    NoDevice {
        /// The driver's (or loader's) message.
        message: String,
    },
    /// A driver call failed.
    #[error("CUDA driver call `{op}` failed: {message}")]
    Driver {
        /// What was being done.
        op: &'static str,
        /// The driver's message.
        message: String,
    },
    /// NVRTC rejected a kernel source; `log` is the compiler's log.
    #[error("NVRTC failed to compile `{kernel}`:\n{log}")]
    Compile {
        /// The `.cu` file.
        kernel: &'static str,
        /// The compiler log.
        log: String,
    },
    /// `cuMemHostAlloc` (pinned, mapped) failed.
    #[error("pinned host allocation of {bytes} bytes for {what} failed: {message}")]
    PinnedAlloc {
        /// What the memory was for.
        what: &'static str,
        /// Bytes requested.
        bytes: u64,
        /// The driver's message.
        message: String,
    },
    /// A host staging buffer (filled here, then copied to the device) could not be allocated.
    #[error("host staging allocation of {bytes} bytes for {what} failed")]
    HostAlloc {
        /// What the memory was for.
        what: &'static str,
        /// Bytes requested.
        bytes: u64,
    },
    /// `cuMemAlloc` failed (device out of memory).
    #[error("device allocation of {bytes} bytes for {what} failed: {message}")]
    DeviceOom {
        /// What the memory was for.
        what: &'static str,
        /// Bytes requested.
        bytes: u64,
        /// The driver's message.
        message: String,
    },
    /// Arguments that do not fit together (shapes, sizes, methods).
    #[error("invalid {what}: {detail}")]
    Invalid {
        /// Which argument.
        what: &'static str,
        /// Why.
        detail: String,
    },
    /// The store rejected synthetic or supplied keys.
    #[error(transparent)]
    Store(#[from] fathom_store::StoreError),
    /// The CPU planner rejected an input.
    #[error(transparent)]
    Plan(#[from] fathom_plan::PlanError),
    /// A page-pool, page-table or paged-layout operation was refused (nothing was changed).
    #[error(transparent)]
    Page(#[from] crate::pages::PageError),
}

/// `Result` with [`CudaError`].
pub type Result<T> = std::result::Result<T, CudaError>;

impl CudaError {
    pub(crate) fn invalid(what: &'static str, detail: impl Into<String>) -> Self {
        CudaError::Invalid {
            what,
            detail: detail.into(),
        }
    }
}
