//! Device memory at the public API: every device operand of the cache is a view that carries
//! its address, its length in elements and its element type, so that a wrong length or dtype
//! is a typed error before any launch, never a kernel writing past a buffer.
//!
//! - [`DeviceBuffer<T>`] owns `len` elements of `T` on the GPU (freed on drop);
//! - [`DeviceView`] and [`DeviceViewMut`] borrow one (or a caller's tensor, made with the
//!   `unsafe` [`DeviceView::from_raw`] at the caller's edge: PyTorch's data pointer through
//!   DLPack, a model's own buffers).
//!
//! The addresses stay inside this crate: no safe function takes or returns a raw device
//! pointer. Without the `cuda` feature the types exist and every allocation returns
//! [`CudaError::NotCompiledWithCuda`].
//!
//! ```
//! use fathom_cuda::memory::{DeviceBuffer, DeviceView};
//! use fathom_cuda::{CudaError, Gpu};
//! use fathom_cuda::prelude::*;
//! let gpu = match Gpu::open(0) {
//!     Ok(gpu) => gpu,
//!     Err(CudaError::NotCompiledWithCuda | CudaError::NoDevice { .. }) => return Ok(()),
//!     Err(e) => return Err(e),
//! };
//! let buf = DeviceBuffer::from_host(&gpu, &[1.0f32, 2.0, 3.0])?;
//! let view: DeviceView<'_> = buf.view();
//! assert_eq!((view.len(), view.dtype()), (3, fathom_cuda::cache::KvDtype::F32));
//! assert_eq!(buf.to_host()?, vec![1.0, 2.0, 3.0]);
//! # Ok::<(), CudaError>(())
//! ```

use std::marker::PhantomData;

use crate::cache::KvDtype;
use crate::error::{CudaError, Result};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i32 {}
}

/// An element type the cache reads from or writes to device memory.
pub trait DeviceElem: Copy + Default + Send + Sync + 'static + sealed::Sealed {
    /// The element type's tag.
    const DTYPE: KvDtype;
}

impl DeviceElem for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
}
impl DeviceElem for half::f16 {
    const DTYPE: KvDtype = KvDtype::F16;
}
impl DeviceElem for half::bf16 {
    const DTYPE: KvDtype = KvDtype::Bf16;
}
impl DeviceElem for i32 {
    const DTYPE: KvDtype = KvDtype::I32;
}

/// A read-only view of `len` elements of one dtype in device memory, borrowed for `'a`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceView<'a> {
    ptr: u64,
    len: usize,
    dtype: KvDtype,
    _borrow: PhantomData<&'a ()>,
}

/// A writable view of `len` elements of one dtype in device memory, borrowed for `'a`.
#[derive(Debug, PartialEq, Eq)]
pub struct DeviceViewMut<'a> {
    ptr: u64,
    len: usize,
    dtype: KvDtype,
    _borrow: PhantomData<&'a mut ()>,
}

impl<'a> DeviceView<'a> {
    /// A view of memory the caller owns (a tensor's storage, say).
    ///
    /// # Safety
    /// `ptr` must be a device address (or a mapped host address the GPU reads) of the
    /// current CUDA context, readable for `len` elements of `dtype` for all of `'a`.
    pub unsafe fn from_raw(ptr: u64, len: usize, dtype: KvDtype) -> DeviceView<'a> {
        DeviceView {
            ptr,
            len,
            dtype,
            _borrow: PhantomData,
        }
    }

    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The element type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Elements `range` of the view.
    ///
    /// # Errors
    /// A range past the view's end.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Result<DeviceView<'a>> {
        let (ptr, len) = sub(self.ptr, self.len, self.dtype, range)?;
        Ok(DeviceView {
            ptr,
            len,
            dtype: self.dtype,
            _borrow: PhantomData,
        })
    }

    /// The device address, for the launches of this crate.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// The address and length of elements `range` of a view at `ptr` of `len` elements.
fn sub(
    ptr: u64,
    len: usize,
    dtype: KvDtype,
    range: std::ops::Range<usize>,
) -> Result<(u64, usize)> {
    if range.start > range.end || range.end > len {
        return Err(CudaError::invalid(
            "slice",
            format!("elements {range:?} of a view of {len}"),
        ));
    }
    Ok((
        ptr + (range.start * dtype.bytes()) as u64,
        range.end - range.start,
    ))
}

impl<'a> DeviceViewMut<'a> {
    /// A writable view of memory the caller owns.
    ///
    /// # Safety
    /// As [`DeviceView::from_raw`], writable, and no other view of it is used while this one
    /// lives.
    pub unsafe fn from_raw(ptr: u64, len: usize, dtype: KvDtype) -> DeviceViewMut<'a> {
        DeviceViewMut {
            ptr,
            len,
            dtype,
            _borrow: PhantomData,
        }
    }

    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The element type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// A read-only view of the same memory, for as long as this one is borrowed.
    pub fn as_view(&self) -> DeviceView<'_> {
        DeviceView {
            ptr: self.ptr,
            len: self.len,
            dtype: self.dtype,
            _borrow: PhantomData,
        }
    }

    /// Elements `range` of the view, writable for as long as this one is borrowed.
    ///
    /// # Errors
    /// A range past the view's end.
    pub fn slice_mut(&mut self, range: std::ops::Range<usize>) -> Result<DeviceViewMut<'_>> {
        let (ptr, len) = sub(self.ptr, self.len, self.dtype, range)?;
        Ok(DeviceViewMut {
            ptr,
            len,
            dtype: self.dtype,
            _borrow: PhantomData,
        })
    }

    /// A shorter borrow of the same view (to pass it on and keep it).
    pub fn reborrow(&mut self) -> DeviceViewMut<'_> {
        DeviceViewMut {
            ptr: self.ptr,
            len: self.len,
            dtype: self.dtype,
            _borrow: PhantomData,
        }
    }

    /// The device address, for the launches of this crate.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

/// Checks a view's dtype (`want_dtype`, or any float dtype when `None`) and that it holds at
/// least `want` elements, naming `what`.
///
/// # Errors
/// The other dtype, or a view shorter than `want`.
pub(crate) fn check_view(
    what: &'static str,
    len: usize,
    dtype: KvDtype,
    want: usize,
    want_dtype: Option<KvDtype>,
) -> Result<()> {
    if let Some(t) = want_dtype {
        if dtype != t {
            return Err(CudaError::invalid(
                what,
                format!("{dtype:?} elements (want {t:?})"),
            ));
        }
    } else if !dtype.is_float() {
        return Err(CudaError::invalid(
            what,
            format!("{dtype:?} elements (want F32, F16 or Bf16)"),
        ));
    }
    if len < want {
        return Err(CudaError::invalid(
            what,
            format!("{len} elements (want at least {want})"),
        ));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
type Backing = crate::cuda::DevBuf;

/// Nothing backs a buffer without the `cuda` feature: none can be made.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
enum Backing {}

/// `len` elements of `T` in device memory, freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer<T: DeviceElem> {
    buf: Backing,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: DeviceElem> DeviceBuffer<T> {
    /// `len` zeroed elements on `gpu`'s device.
    ///
    /// # Errors
    /// A failed allocation (typed, with its size); [`CudaError::NotCompiledWithCuda`] in the
    /// stub.
    pub fn zeros(gpu: &crate::Gpu, len: usize) -> Result<Self> {
        let _ = gpu;
        #[cfg(feature = "cuda")]
        {
            let buf = crate::cuda::DevBuf::zeroed(len * std::mem::size_of::<T>(), "device buffer")?;
            Ok(DeviceBuffer {
                buf,
                len,
                _t: PhantomData,
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = len;
            Err(CudaError::NotCompiledWithCuda)
        }
    }

    /// A device copy of `data`, complete when this returns.
    ///
    /// # Errors
    /// As [`DeviceBuffer::zeros`], and a failed copy.
    pub fn from_host(gpu: &crate::Gpu, data: &[T]) -> Result<Self> {
        let _ = gpu;
        #[cfg(feature = "cuda")]
        {
            let buf = crate::cuda::DevBuf::from_slice(data, "device buffer")?;
            Ok(DeviceBuffer {
                buf,
                len: data.len(),
                _t: PhantomData,
            })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = data;
            Err(CudaError::NotCompiledWithCuda)
        }
    }

    /// The elements, copied to the host. Waits for the device's pending work first (the copy
    /// is ordered after every stream of the context).
    ///
    /// # Errors
    /// A driver failure.
    pub fn to_host(&self) -> Result<Vec<T>> {
        #[cfg(feature = "cuda")]
        {
            crate::cuda::sync_context()?;
            self.buf.read(self.len)
        }
        #[cfg(not(feature = "cuda"))]
        match self.buf {}
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A read-only view of the whole buffer.
    pub fn view(&self) -> DeviceView<'_> {
        DeviceView {
            ptr: self.addr(),
            len: self.len,
            dtype: T::DTYPE,
            _borrow: PhantomData,
        }
    }

    /// A writable view of the whole buffer.
    pub fn view_mut(&mut self) -> DeviceViewMut<'_> {
        DeviceViewMut {
            ptr: self.addr(),
            len: self.len,
            dtype: T::DTYPE,
            _borrow: PhantomData,
        }
    }

    fn addr(&self) -> u64 {
        #[cfg(feature = "cuda")]
        {
            self.buf.ptr
        }
        #[cfg(not(feature = "cuda"))]
        match self.buf {}
    }
}

/// Untyped device memory for the CUDA code of other crates (a model's weights and
/// activations, which its own kernels and cuBLAS read): the one allocator of the workspace,
/// freed on drop. Typed views of it are what the cache takes.
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct DeviceBytes(crate::cuda::DevBuf);

#[cfg(feature = "cuda")]
impl DeviceBytes {
    /// `bytes` bytes of device memory, uninitialised, named `what` in an out-of-memory error.
    ///
    /// # Errors
    /// A failed allocation (typed, with its size).
    pub fn new(bytes: usize, what: &'static str) -> Result<Self> {
        crate::cuda::DevBuf::new(bytes, what).map(DeviceBytes)
    }

    /// A device copy of `data`, complete when this returns.
    ///
    /// # Errors
    /// A failed allocation or copy.
    pub fn from_slice<T: Copy>(data: &[T], what: &'static str) -> Result<Self> {
        crate::cuda::DevBuf::from_slice(data, what).map(DeviceBytes)
    }

    /// `len` elements of `T` from element `first` on, copied to the host after the
    /// context's pending work.
    ///
    /// # Errors
    /// A range past the allocation; a driver failure.
    pub fn read<T: Copy + Default>(&self, first: usize, len: usize) -> Result<Vec<T>> {
        if (first + len) * std::mem::size_of::<T>() > self.0.bytes {
            return Err(CudaError::invalid(
                "read",
                format!(
                    "elements {first}..{} of {} bytes",
                    first + len,
                    self.0.bytes
                ),
            ));
        }
        crate::cuda::sync_context()?;
        self.0.read_at(first, len)
    }

    /// Copies `data` to the start of the buffer in order on `stream` (a raw `CUstream` of this
    /// context): every kernel launched on it afterwards sees the data.
    ///
    /// # Safety
    /// `stream` is a live stream of the buffer's context, and no other stream uses the bytes
    /// meanwhile.
    ///
    /// # Errors
    /// `data` larger than the buffer; a driver failure.
    pub unsafe fn upload_on<T: Copy>(&self, data: &[T], stream: u64) -> Result<()> {
        if std::mem::size_of_val(data) > self.0.bytes {
            return Err(CudaError::invalid(
                "upload",
                format!(
                    "{} bytes into {}",
                    std::mem::size_of_val(data),
                    self.0.bytes
                ),
            ));
        }
        // SAFETY: the buffer holds the data (checked); the caller vouches for the stream.
        unsafe {
            crate::cuda::stream_upload(
                self.0.ptr,
                data,
                stream as cudarc::driver::sys::CUstream,
                "upload",
            )
        }
    }

    /// The device address, for the caller's own launches and cuBLAS calls.
    pub fn ptr(&self) -> u64 {
        self.0.ptr
    }

    /// Bytes in the buffer.
    pub fn bytes(&self) -> usize {
        self.0.bytes
    }

    /// A view of the whole buffer as elements of `dtype`.
    pub fn view_as(&self, dtype: KvDtype) -> DeviceView<'_> {
        DeviceView {
            ptr: self.0.ptr,
            len: self.0.bytes / dtype.bytes(),
            dtype,
            _borrow: PhantomData,
        }
    }

    /// A writable view of the whole buffer as elements of `dtype`.
    pub fn view_mut_as(&mut self, dtype: KvDtype) -> DeviceViewMut<'_> {
        DeviceViewMut {
            ptr: self.0.ptr,
            len: self.0.bytes / dtype.bytes(),
            dtype,
            _borrow: PhantomData,
        }
    }
}
