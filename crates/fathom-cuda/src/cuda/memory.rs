//! Device buffers and pinned, mapped host memory.

use std::ffi::c_void;

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUdeviceptr};

use super::drv;
use crate::config::Residency;
use crate::error::{CudaError, Result};

/// Device memory (`cuMemAlloc`), freed on drop.
#[derive(Debug)]
pub(crate) struct DevBuf {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) bytes: usize,
}

impl DevBuf {
    pub(crate) fn new(bytes: usize, what: &'static str) -> Result<Self> {
        // SAFETY: a plain allocation of `bytes.max(16)` bytes; the pointer is owned by the
        // returned value and freed once in `Drop`.
        let ptr =
            unsafe { result::malloc_sync(bytes.max(16)) }.map_err(|e| CudaError::DeviceOom {
                what,
                bytes: bytes as u64,
                message: e.to_string(),
            })?;
        Ok(DevBuf { ptr, bytes })
    }
    pub(crate) fn zeroed(bytes: usize, what: &'static str) -> Result<Self> {
        let b = Self::new(bytes, what)?;
        // SAFETY: `b.ptr` is a live allocation of at least `bytes` bytes.
        unsafe { result::memset_d8_sync(b.ptr, 0, bytes.max(16)) }.map_err(drv("memset"))?;
        Ok(b)
    }
    pub(crate) fn from_slice<T: Copy>(data: &[T], what: &'static str) -> Result<Self> {
        let b = Self::new(std::mem::size_of_val(data), what)?;
        // SAFETY: the allocation holds `size_of_val(data)` bytes; the copy is synchronous.
        unsafe { result::memcpy_htod_sync(b.ptr, data) }.map_err(drv("memcpy_htod"))?;
        Ok(b)
    }
    pub(crate) fn read<T: Copy + Default>(&self, len: usize) -> Result<Vec<T>> {
        assert!(len * std::mem::size_of::<T>() <= self.bytes.max(16));
        let mut v = vec![T::default(); len];
        // SAFETY: reads `len` elements that lie inside the allocation (asserted above).
        unsafe { result::memcpy_dtoh_sync(&mut v, self.ptr) }.map_err(drv("memcpy_dtoh"))?;
        Ok(v)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_sync` and is freed exactly once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Pinned, mapped host memory (`cuMemHostAlloc` with `DEVICEMAP | PORTABLE`).
#[derive(Debug)]
pub(crate) struct HostBuf {
    pub(crate) ptr: *mut u8,
    pub(crate) bytes: usize,
    pub(crate) dptr: CUdeviceptr,
}

// SAFETY: the buffer is plain memory owned by this value; access is through &/&mut self.
unsafe impl Send for HostBuf {}
// SAFETY: as above; shared references only read.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    pub(crate) fn new(bytes: usize, what: &'static str) -> Result<Self> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: allocation of `bytes` page-locked bytes; freed once in `Drop`.
        let ptr = unsafe { result::malloc_host(bytes.max(16), flags) }.map_err(|e| {
            CudaError::PinnedAlloc {
                what,
                bytes: bytes as u64,
                message: e.to_string(),
            }
        })? as *mut u8;
        let mut dptr: CUdeviceptr = 0;
        // SAFETY: `ptr` is a live mapped pinned allocation; the driver writes one pointer.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr as *mut c_void, 0) }
            .result()
            .map_err(drv("cuMemHostGetDevicePointer"))?;
        Ok(HostBuf { ptr, bytes, dptr })
    }
    pub(crate) fn as_bytes(&self) -> &[u8] {
        // SAFETY: `ptr` points to `bytes` bytes owned by `self`; the caller has synchronised
        // every stream that writes them.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }
    pub(crate) fn as_mut_bytes(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `bytes` bytes owned by `self`, uniquely borrowed here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_host` and is freed exactly once.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

/// A session buffer in host (mapped) or device memory.
#[derive(Debug)]
pub(crate) enum Mem {
    Host(HostBuf),
    Dev(DevBuf),
}

impl Mem {
    pub(crate) fn dptr(&self) -> u64 {
        match self {
            Mem::Host(h) => h.dptr,
            Mem::Dev(d) => d.ptr,
        }
    }
    /// Allocates `bytes` where `residency` says and fills them with `fill` (run on an 8-aligned
    /// host buffer: the pinned memory itself, or a staging vector copied to the device).
    pub(crate) fn filled(
        residency: Residency,
        bytes: usize,
        what: &'static str,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<Self> {
        match residency {
            Residency::IndexHbm => Err(CudaError::invalid(
                "residency",
                "index-hbm is the paged cache's split residency (PagedCache); the step engine takes host or hbm",
            )),
            Residency::Host => {
                let mut h = HostBuf::new(bytes, what)?;
                fill(&mut h.as_mut_bytes()[..bytes]);
                Ok(Mem::Host(h))
            }
            Residency::Hbm => {
                // Device memory first (a typed `DeviceOom` before any host work), then a
                // fallible staging vector (a typed `HostAlloc` instead of an abort).
                let dev = DevBuf::new(bytes, what)?;
                let words = bytes.div_ceil(8);
                let mut v: Vec<u64> = Vec::new();
                v.try_reserve_exact(words)
                    .map_err(|_| CudaError::HostAlloc {
                        what,
                        bytes: bytes as u64,
                    })?;
                v.resize(words, 0);
                // SAFETY: reinterpreting initialised u64s as bytes (no padding, align 1).
                let b = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, bytes) };
                fill(b);
                // SAFETY: `dev` holds `bytes` bytes; the copy is synchronous.
                unsafe { result::memcpy_htod_sync(dev.ptr, &b[..]) }.map_err(drv("memcpy_htod"))?;
                Ok(Mem::Dev(dev))
            }
        }
    }
}
