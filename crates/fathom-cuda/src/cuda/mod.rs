//! The CUDA backend, by job: `memory` (device buffers and pinned, mapped host memory),
//! `module` (NVRTC and the kernel table), `device` (the GPU, its streams, events and the
//! bandwidth probes) and `step` (the offload benchmark's decode step, `Session`). The paged
//! cache is `crate::cuda_cache`; the pure-CPU layout and static plans of the step are
//! `crate::step_layout` (compiled without the feature, unit-tested).

use cudarc::driver::DriverError;

use crate::error::CudaError;

pub(crate) mod cache;
mod device;
mod device_api;
mod memory;
mod module;
mod step;

pub use cache::{DecodeGraph, PagedCache};
pub use device::Gpu;
pub(crate) use device::{cfg, Event};
pub(crate) use memory::{anon_huge_bytes, stream_upload, sync_context, DevBuf, HostBuf, Mem};
pub use module::compile_kernels;
pub(crate) use module::{attend_defines, compile_one, Kernels};
pub use step::Session;

pub(crate) use crate::step_layout::cast_mut;

pub(crate) fn drv(op: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |e| CudaError::Driver {
        op,
        message: e.to_string(),
    }
}
