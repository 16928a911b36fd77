//! The CUDA backend, by job: `memory` (device buffers and pinned, mapped host memory),
//! `module` (NVRTC and the kernel table) and `device` (the GPU, its streams, events and the
//! bandwidth probes). The paged cache is `cache` (a file per stage).

use cudarc::driver::DriverError;

use crate::error::CudaError;

pub(crate) mod cache;
mod device;
mod device_api;
mod memory;
mod module;

pub use cache::{DecodeGraph, PagedCache};
pub use device::Gpu;
pub(crate) use device::{cfg, Event};
pub(crate) use memory::cast_mut;
pub(crate) use memory::{stream_upload, sync_context, DevBuf, HostBuf, Mem};
pub use module::compile_kernels;
pub(crate) use module::{attend_defines, compile_one};

pub(crate) fn drv(op: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |e| CudaError::Driver {
        op,
        message: e.to_string(),
    }
}
