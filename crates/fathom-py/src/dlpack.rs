//! DLPack at the binding's edge: a tensor is read through its `__dlpack__` capsule (the legacy
//! unversioned `DLManagedTensor`, which every producer still gives by default): its data
//! pointer, device, dtype, shape and strides are checked against what a call needs, and a
//! mismatch is a `ValueError` naming the argument, raised before anything is launched. The
//! capsule is kept alive for the call and never consumed (the producer keeps ownership).

use std::ffi::c_void;

use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};

use fathom_cuda::cache::KvDtype;

use crate::bad;

/// `DLDevice` of dlpack.h.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType` of dlpack.h.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor` of dlpack.h.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// `DLManagedTensor` of dlpack.h (the unversioned capsule `"dltensor"`).
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// `kDLCPU`, `kDLCUDA`.
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;

/// What a DLPack capsule says about a tensor.
pub(crate) struct TensorInfo {
    pub(crate) ptr: u64,
    device_type: i32,
    device_id: i32,
    /// `float32`, `float16`, `bfloat16`, `int32`, or `code:bits:lanes` for anything else.
    dtype: String,
    pub(crate) shape: Vec<i64>,
    contiguous: bool,
    /// Keeps the capsule (and so the producer's buffer) alive.
    _capsule: Py<PyAny>,
}

fn dtype_name(t: DlDataType) -> String {
    match (t.code, t.bits, t.lanes) {
        (2, 32, 1) => "float32".into(),
        (2, 16, 1) => "float16".into(),
        (4, 16, 1) => "bfloat16".into(),
        (0, 32, 1) => "int32".into(),
        (c, b, l) => format!("dlpack type code {c}, {b} bits, {l} lanes"),
    }
}

/// The `stream` argument of `__dlpack__` for a raw `CUstream`. DLPack reserves 0 on CUDA
/// (ambiguous, and torch refuses it) and names the legacy default stream 1, so the null
/// handle, which is what `torch.cuda.current_stream().cuda_stream` is on the default
/// stream, becomes 1; any other handle passes unchanged.
fn dlpack_stream(raw: u64) -> i64 {
    if raw == 0 {
        1
    } else {
        raw as i64
    }
}

/// Reads `obj.__dlpack__(stream=...)` without consuming the capsule.
pub(crate) fn tensor_info(
    arg: &str,
    obj: &Bound<'_, PyAny>,
    stream: Option<u64>,
) -> PyResult<TensorInfo> {
    if !obj.hasattr("__dlpack__")? {
        return Err(bad(
            arg,
            "is not a DLPack tensor (no __dlpack__; pass a torch tensor)",
        ));
    }
    let kwargs = PyDict::new(obj.py());
    if let Some(s) = stream {
        // A CPU producer (numpy) refuses any stream; CUDA producers order their work on it.
        let dev: (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
        if dev.0 == DL_CUDA {
            kwargs.set_item("stream", dlpack_stream(s))?;
        }
    }
    let cap = obj.call_method("__dlpack__", (), Some(&kwargs))?;
    let capsule = cap
        .cast::<PyCapsule>()
        .map_err(|_| bad(arg, "__dlpack__ did not return a capsule"))?;
    if !capsule.is_valid_checked(Some(c"dltensor")) {
        return Err(bad(
            arg,
            "its DLPack capsule is not an unconsumed \"dltensor\" with a tensor",
        ));
    }
    let p = capsule
        .pointer_checked(Some(c"dltensor"))
        .map_err(|_| bad(arg, "its DLPack capsule holds no tensor"))?
        .as_ptr() as *const DlManagedTensor;
    // SAFETY: a live "dltensor" capsule points at a DLManagedTensor its producer keeps alive
    // while the capsule lives (we hold it in `_capsule`); we only read it.
    let t = unsafe { &(*p).dl_tensor };
    let ndim = usize::try_from(t.ndim).map_err(|_| bad(arg, "negative ndim"))?;
    // SAFETY: `shape` has `ndim` entries and `strides` is null or has `ndim` entries
    // (dlpack.h); both live as long as the capsule.
    let shape: Vec<i64> = if ndim == 0 {
        Vec::new()
    } else {
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec()
    };
    let contiguous = if t.strides.is_null() || ndim == 0 {
        true
    } else {
        // SAFETY: as above.
        let st = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut want = 1i64;
        let mut ok = true;
        for i in (0..ndim).rev() {
            if shape[i] != 1 && st[i] != want {
                ok = false;
            }
            want *= shape[i];
        }
        ok
    };
    Ok(TensorInfo {
        ptr: t.data as u64 + t.byte_offset,
        device_type: t.device.device_type,
        device_id: t.device.device_id,
        dtype: dtype_name(t.dtype),
        shape,
        contiguous,
        _capsule: cap.clone().unbind(),
    })
}

/// What DLPack says about a tensor: `{"device_type", "device_id", "dtype", "shape",
/// "contiguous"}` (`device_type` 1 is the CPU, 2 CUDA) — for tests and for checking what a
/// framework hands over.
#[pyfunction]
pub fn dlpack_info<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
    let t = tensor_info("tensor", obj, None)?;
    let d = PyDict::new(obj.py());
    d.set_item("device_type", t.device_type)?;
    d.set_item("device_id", t.device_id)?;
    d.set_item("dtype", t.dtype)?;
    d.set_item("shape", t.shape)?;
    d.set_item("contiguous", t.contiguous)?;
    Ok(d)
}

/// Checks a tensor for a call: a contiguous CUDA tensor on `device`, of `shape`, of one of
/// `dtypes`; its data pointer and dtype, or a `ValueError` naming `arg`.
pub(crate) fn cuda_tensor(
    arg: &str,
    obj: &Bound<'_, PyAny>,
    stream: u64,
    device: i32,
    shape: &[usize],
    dtypes: &[&str],
) -> PyResult<(u64, KvDtype, TensorInfo)> {
    let t = tensor_info(arg, obj, Some(stream))?;
    check(arg, &t, device, shape, dtypes)
}

pub(crate) fn check(
    arg: &str,
    t: &TensorInfo,
    device: i32,
    shape: &[usize],
    dtypes: &[&str],
) -> PyResult<(u64, KvDtype, TensorInfo)> {
    if t.device_type != DL_CUDA {
        let what = if t.device_type == DL_CPU {
            "the CPU".to_string()
        } else {
            format!("DLPack device type {}", t.device_type)
        };
        return Err(bad(arg, format!("must be a CUDA tensor; it is on {what}")));
    }
    if t.device_id != device {
        return Err(bad(
            arg,
            format!("is on cuda:{}, the cache on cuda:{device}", t.device_id),
        ));
    }
    let want: Vec<i64> = shape.iter().map(|&x| x as i64).collect();
    if t.shape != want {
        return Err(bad(arg, format!("has shape {:?}, want {want:?}", t.shape)));
    }
    if !dtypes.contains(&t.dtype.as_str()) {
        return Err(bad(
            arg,
            format!("has dtype {}, want one of {}", t.dtype, dtypes.join(", ")),
        ));
    }
    if !t.contiguous {
        return Err(bad(arg, "must be contiguous (.contiguous())"));
    }
    let dt = match t.dtype.as_str() {
        "float16" => KvDtype::F16,
        "bfloat16" => KvDtype::Bf16,
        "int32" => KvDtype::I32,
        _ => KvDtype::F32,
    };
    Ok((
        t.ptr,
        dt,
        TensorInfo {
            ptr: t.ptr,
            device_type: t.device_type,
            device_id: t.device_id,
            dtype: t.dtype.clone(),
            shape: t.shape.clone(),
            contiguous: t.contiguous,
            _capsule: Python::attach(|py| t._capsule.clone_ref(py)),
        },
    ))
}

/// Checks a tensor the way a cache call would, without a cache: for tests (`ValueError`
/// naming `arg` on a mismatch; the dtype the cache would read otherwise).
#[pyfunction]
#[pyo3(signature = (arg, obj, shape, dtypes, device=0))]
pub fn check_cuda_tensor(
    arg: &str,
    obj: &Bound<'_, PyAny>,
    shape: Vec<usize>,
    dtypes: Vec<String>,
    device: i32,
) -> PyResult<String> {
    let t = tensor_info(arg, obj, None)?;
    let d: Vec<&str> = dtypes.iter().map(|s| s.as_str()).collect();
    let (_, dt, _) = check(arg, &t, device, &shape, &d)?;
    Ok(format!("{dt:?}"))
}
