//! Device buffers and pinned, mapped host memory.

use std::ffi::c_void;

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUdeviceptr};
#[cfg(target_os = "linux")]
use rayon::prelude::*;

use super::drv;
use crate::config::HostPages;
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
    /// A device copy of `data`, complete when this returns (see [`sync_upload`]).
    pub(crate) fn from_slice<T: Copy>(data: &[T], what: &'static str) -> Result<Self> {
        let b = Self::new(std::mem::size_of_val(data), what)?;
        // SAFETY: the allocation holds `size_of_val(data)` bytes.
        unsafe { sync_upload(b.ptr, data) }?;
        Ok(b)
    }
    pub(crate) fn read<T: Copy + Default>(&self, len: usize) -> Result<Vec<T>> {
        self.read_at(0, len)
    }

    /// `len` elements of `T` from element `first` on.
    ///
    /// # Panics
    /// A range past the allocation (a caller's bug: every caller sizes it from the buffer's
    /// own layout).
    pub(crate) fn read_at<T: Copy + Default>(&self, first: usize, len: usize) -> Result<Vec<T>> {
        let size = std::mem::size_of::<T>();
        assert!((first + len) * size <= self.bytes.max(16));
        let mut v = vec![T::default(); len];
        // SAFETY: reads `len` elements from element `first`, inside the allocation (asserted
        // above).
        unsafe { result::memcpy_dtoh_sync(&mut v, self.ptr + (first * size) as u64) }
            .map_err(drv("memcpy_dtoh"))?;
        Ok(v)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `malloc_sync` and is freed exactly once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Pinned, mapped host memory: `cuMemHostAlloc` with `DEVICEMAP | PORTABLE`, registered
/// anonymous memory on 2 MiB transparent huge pages, or a host-NUMA allocation of the virtual
/// memory API mapped at one address for the CPU and the GPU ([`HostPages`]).
#[derive(Debug)]
pub(crate) struct HostBuf {
    pub(crate) ptr: *mut u8,
    pub(crate) bytes: usize,
    pub(crate) dptr: CUdeviceptr,
    /// Who owns the memory, and so how it is released.
    mapping: Mapping,
}

/// The owner of a [`HostBuf`]'s memory.
#[derive(Debug)]
enum Mapping {
    /// `cuMemHostAlloc`: freed by `cuMemFreeHost`.
    Driver,
    /// `mmap` of `(base, len)` registered at `ptr`: unregistered, then unmapped.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    Mmap(*mut u8, usize),
    /// `cuMemCreate` (host NUMA) of `len` bytes mapped at the reserved range `ptr`: unmapped,
    /// released, then the range freed.
    Vmm {
        handle: sys::CUmemGenericAllocationHandle,
        len: usize,
    },
}

/// Huge pages are 2 MiB on x86-64 and on aarch64 with 4 KiB base pages.
const HUGE_PAGE: usize = 2 << 20;

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
        Ok(HostBuf {
            ptr,
            bytes,
            dptr,
            mapping: Mapping::Driver,
        })
    }

    /// `bytes` of pinned, mapped host memory backed as `pages` says, filled by `fill` (huge
    /// pages: after all cores have faulted them in and before the driver pins them).
    pub(crate) fn with_pages(
        bytes: usize,
        what: &'static str,
        pages: HostPages,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<Self> {
        match pages {
            HostPages::Driver => {
                let mut h = Self::new(bytes, what)?;
                fill(&mut h.as_mut_bytes()[..bytes]);
                Ok(h)
            }
            HostPages::Huge => Self::huge(bytes, what, fill),
            HostPages::Vmm => {
                let mut h = Self::vmm(bytes, what)?;
                fill(&mut h.as_mut_bytes()[..bytes]);
                Ok(h)
            }
        }
    }

    /// Host memory of the virtual memory API: a physical allocation on the GPU's host NUMA
    /// node (`cuMemCreate`, `CU_MEM_LOCATION_TYPE_HOST_NUMA`, rounded up to the recommended
    /// granularity), mapped into a reserved range (`cuMemAddressReserve`, `cuMemMap`) that
    /// `cuMemSetAccess` opens read-write to this device and to the host, so the CPU and the
    /// kernels use one address. The GPU maps such a range at the allocation's granularity
    /// (2 MiB where the driver recommends it); random reads from it measured no faster than
    /// from driver pages (docs/SPEC.md §6.1, "Host pages").
    fn vmm(bytes: usize, what: &'static str) -> Result<Self> {
        let check = |step: &str, r: sys::CUresult| {
            r.result().map_err(|e| CudaError::PinnedAlloc {
                what,
                bytes: bytes as u64,
                message: format!("{step}: {e}"),
            })
        };
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes the current context's device.
        check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
        let mut numa: std::ffi::c_int = -1;
        // SAFETY: writes one attribute of a valid device.
        check("cuDeviceGetAttribute(HOST_NUMA_ID)", unsafe {
            sys::cuDeviceGetAttribute(
                &mut numa,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
                dev,
            )
        })?;
        // SAFETY: the property struct is plain data; zero is "unset" for every field.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA;
        prop.location.id = numa.max(0);
        let mut gran = 0usize;
        // SAFETY: reads `prop`, writes one size.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        })?;
        let gran = gran.max(HUGE_PAGE);
        let len = bytes.max(16).div_ceil(gran) * gran;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: creates one physical allocation of `len` bytes, released once below or in Drop.
        check("cuMemCreate(host NUMA)", unsafe {
            sys::cuMemCreate(&mut handle, len, &prop, 0)
        })?;
        let mut va: CUdeviceptr = 0;
        // SAFETY: reserves `len` bytes of address space, freed once below or in Drop.
        if let Err(e) = check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut va, len, gran, 0, 0)
        }) {
            // SAFETY: the handle created above, released once.
            unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        // SAFETY: maps the whole allocation at the reserved range.
        if let Err(e) = check("cuMemMap", unsafe { sys::cuMemMap(va, len, 0, handle, 0) }) {
            // SAFETY: the range and handle made above, each released once.
            unsafe {
                sys::cuMemAddressFree(va, len);
                sys::cuMemRelease(handle);
            }
            return Err(e);
        }
        let h = HostBuf {
            ptr: va as *mut u8,
            bytes,
            dptr: va,
            mapping: Mapping::Vmm { handle, len },
        };
        // SAFETY: zeroed descriptors; the fields set below are the ones the driver reads.
        let mut access: [sys::CUmemAccessDesc; 2] = unsafe { std::mem::zeroed() };
        access[0].location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        access[0].location.id = dev;
        access[0].flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        access[1].location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA;
        access[1].location.id = numa.max(0);
        access[1].flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the range is fully mapped by one allocation; two descriptors are passed. On
        // an error `h` is dropped: unmap, release, free.
        check("cuMemSetAccess(device, host NUMA)", unsafe {
            sys::cuMemSetAccess(va, len, access.as_ptr(), 2)
        })?;
        Ok(h)
    }

    #[cfg(target_os = "linux")]
    fn huge(bytes: usize, what: &'static str, fill: impl FnOnce(&mut [u8])) -> Result<Self> {
        let len = bytes.max(16).div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let map_len = len + HUGE_PAGE;
        let fail = |message: String| CudaError::PinnedAlloc {
            what,
            bytes: bytes as u64,
            message,
        };
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(fail(format!("mmap: {}", std::io::Error::last_os_error())));
        }
        let base = base as *mut u8;
        let ptr = base.wrapping_add(base.align_offset(HUGE_PAGE));
        let unmap = || {
            // SAFETY: `base` is the mapping of `map_len` bytes made above, unmapped once.
            unsafe { libc::munmap(base as *mut c_void, map_len) };
        };
        // SAFETY: [ptr, ptr + len) lies inside the mapping (ptr is at most HUGE_PAGE past base).
        if unsafe { libc::madvise(ptr as *mut c_void, len, libc::MADV_HUGEPAGE) } != 0 {
            let e = std::io::Error::last_os_error();
            unmap();
            return Err(fail(format!("madvise(MADV_HUGEPAGE): {e}")));
        }
        // SAFETY: the `len` bytes at `ptr` are mapped read-write and owned here; an anonymous
        // mapping reads as zeros, so the slice is initialised.
        let mem = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
        // Fault every huge page in from all cores (the driver's pinning would do it on one).
        // SAFETY: `c` is a live, non-empty chunk of the mapping.
        mem.par_chunks_mut(HUGE_PAGE)
            .for_each(|c| unsafe { std::ptr::write_volatile(c.as_mut_ptr(), 0) });
        fill(&mut mem[..bytes]);
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: registers the live, page-aligned range [ptr, ptr + len), unregistered in Drop
        // before the unmap.
        let registered = unsafe { sys::cuMemHostRegister_v2(ptr as *mut c_void, len, flags) };
        if let Err(e) = registered.result() {
            unmap();
            return Err(fail(format!("cuMemHostRegister: {e}")));
        }
        let mut h = HostBuf {
            ptr,
            bytes,
            dptr: 0,
            mapping: Mapping::Mmap(base, map_len),
        };
        // SAFETY: `ptr` is registered with DEVICEMAP; the driver writes one pointer.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut h.dptr, ptr as *mut c_void, 0) }
            .result()
            .map_err(drv("cuMemHostGetDevicePointer"))?;
        Ok(h)
    }

    #[cfg(not(target_os = "linux"))]
    fn huge(bytes: usize, what: &'static str, _fill: impl FnOnce(&mut [u8])) -> Result<Self> {
        Err(CudaError::PinnedAlloc {
            what,
            bytes: bytes as u64,
            message:
                "huge host pages (madvise + cuMemHostRegister) are Linux only; use driver pages"
                    .into(),
        })
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
        match self.mapping {
            // SAFETY: `ptr` came from `malloc_host` and is freed exactly once.
            Mapping::Driver => drop(unsafe { result::free_host(self.ptr as *mut c_void) }),
            #[cfg(target_os = "linux")]
            Mapping::Mmap(base, len) => {
                // SAFETY: `ptr` was registered by `huge`; it is unregistered once, then the
                // mapping it lies in is unmapped once.
                unsafe {
                    let _ = sys::cuMemHostUnregister(self.ptr as *mut c_void).result();
                    libc::munmap(base as *mut c_void, len);
                }
            }
            #[cfg(not(target_os = "linux"))]
            Mapping::Mmap(..) => {}
            Mapping::Vmm { handle, len } => {
                // SAFETY: the range `dptr..+len` maps `handle` (made by `vmm`); each is undone
                // once, in the reverse order of `vmm`.
                unsafe {
                    sys::cuMemUnmap(self.dptr, len);
                    sys::cuMemRelease(handle);
                    sys::cuMemAddressFree(self.dptr, len);
                }
            }
        }
    }
}

/// Views 8-aligned bytes as `T`s.
pub(crate) fn cast_mut<T>(b: &mut [u8]) -> &mut [T] {
    let n = b.len() / std::mem::size_of::<T>();
    assert_eq!(
        b.as_ptr() as usize % std::mem::align_of::<T>(),
        0,
        "unaligned buffer"
    );
    // SAFETY: alignment checked; T is a plain integer/half type valid for any bits.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut T, n) }
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
}

/// Copies `src` to device memory at `dst` and waits until the copy has landed.
///
/// A synchronous `cuMemcpyHtoD` from pageable memory returns once the data is staged, before
/// its DMA reaches the destination (the CUDA Driver API's "API synchronization behavior"
/// section), and it is ordered only with the legacy default stream,
/// not with the non-blocking streams every kernel of this crate runs on: a kernel launched
/// right after it may read the old bytes. The context synchronisation after it closes that
/// window (setup-time uploads only; per-call uploads go through [`stream_upload`]).
///
/// # Safety
/// `dst` must be device memory of at least `size_of_val(src)` bytes.
pub(crate) unsafe fn sync_upload<T>(dst: CUdeviceptr, src: &[T]) -> Result<()> {
    // SAFETY: the caller guarantees the destination's size.
    unsafe { result::memcpy_htod_sync(dst, src) }.map_err(drv("memcpy_htod"))?;
    result::ctx::synchronize().map_err(drv("synchronize after memcpy_htod"))
}

/// Copies `src` to device memory at `dst` in order on `stream`: every kernel launched on that
/// stream after this call sees the data, and `src` may be reused when this returns (the driver
/// stages pageable memory before it returns).
///
/// # Safety
/// `dst` must be device memory of at least `size_of_val(src)` bytes that no other stream
/// writes or reads meanwhile.
pub(crate) unsafe fn stream_upload<T>(
    dst: CUdeviceptr,
    src: &[T],
    stream: sys::CUstream,
    what: &'static str,
) -> Result<()> {
    // SAFETY: the caller guarantees the destination.
    unsafe { result::memcpy_htod_async(dst, src, stream) }.map_err(drv(what))
}

/// Waits for every stream of the current context.
pub(crate) fn sync_context() -> Result<()> {
    result::ctx::synchronize().map_err(drv("synchronize"))
}
