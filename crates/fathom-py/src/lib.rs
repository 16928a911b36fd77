//! The native half of the `fathom` Python package (`fathom._fathom`): Fathom's CPU library on
//! numpy arrays. The Python half (`python/fathom/__init__.py`) re-exports these and documents
//! them; see its docstrings for the user-facing API.
//!
//! Every function checks its arrays (dtype `float32`, C order, shape, finite values) before
//! it calls the library and raises `ValueError` naming the argument; the library's own errors
//! (files, formats, method items, budgets) arrive as `fathom.FathomError` (a `ValueError`)
//! with the library's message. Nothing here is written twice: stores are
//! `fathom_store::KeyStore`, plans `fathom_plan::water_fill`, captures `fathom_capture` (write)
//! and `fathom_bench::capture` (read), fidelity `fathom_bench::evaluate`.

use std::path::PathBuf;

mod decoder;
mod dlpack;
mod gpu;

use decoder::Decoder;

use numpy::ndarray::Dimension;
use numpy::{
    PyArray, PyArray1, PyArray3, PyArrayMethods, PyReadonlyArray, PyReadonlyArray1,
    PyReadonlyArray2, PyReadonlyArray3, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use fathom_bench::capture::Capture;
use fathom_bench::evaluate::{evaluate, EvaluateArgs};
use fathom_bench::methods::BasisChoice;
use fathom_capture::{tensor_name, CaptureMeta, Dtype, LayerKind, Part};
use fathom_store::{Dims, KeyStore};

pyo3::create_exception!(
    _fathom,
    FathomError,
    PyValueError,
    "An error of the Fathom library (its message names the file, item or value at fault)."
);

pub(crate) fn lib_err(e: impl std::fmt::Display) -> PyErr {
    FathomError::new_err(e.to_string())
}

pub(crate) fn bad(arg: &str, why: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{arg}: {why}"))
}

/// The array's elements, C-contiguous and finite, or a `ValueError` naming `arg`.
fn finite<'a>(arg: &str, x: &'a [f32]) -> PyResult<&'a [f32]> {
    match x.iter().position(|v| !v.is_finite()) {
        None => Ok(x),
        Some(i) => Err(bad(arg, format!("element {i} is {} (not finite)", x[i]))),
    }
}

/// A count or index argument (`i64`, so that a negative one is a `ValueError` naming `arg`
/// rather than pyo3's `OverflowError`).
pub(crate) fn count(arg: &str, x: i64) -> PyResult<usize> {
    usize::try_from(x).map_err(|_| bad(arg, format!("{x} is negative")))
}

/// The most tokens a store may be made for (2^40: far past any context, and small enough that
/// the store's sizes cannot overflow).
const MAX_CAPACITY: usize = 1 << 40;

/// The machine's physical memory in bytes, where the system says (Linux).
fn physical_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses a store capacity that could never be allocated, before anything is: more than
/// [`MAX_CAPACITY`] tokens, or bit planes and scales (`capacity·heads·D·(1/2 + 1/32)` bytes)
/// beyond this machine's memory.
fn store_capacity(arg: &str, capacity: usize, heads: usize, channels: usize) -> PyResult<()> {
    if capacity > MAX_CAPACITY {
        return Err(bad(
            arg,
            format!("{capacity} tokens is absurd (at most 2^40 = {MAX_CAPACITY})"),
        ));
    }
    // 4 planes of one bit and a 2-byte scale per 64-token block, per (head, channel).
    let blocks = capacity.div_ceil(64) as u128;
    let bytes = blocks * heads as u128 * channels as u128 * (4 * 8 + 2);
    let limit = physical_memory().map_or(isize::MAX as u128, u128::from);
    if bytes > limit {
        return Err(bad(
            arg,
            format!(
                "{capacity} tokens of {heads} heads × {channels} channels need {:.1} GiB, \
                 more than this machine's {:.1} GiB of memory",
                bytes as f64 / (1u64 << 30) as f64,
                limit as f64 / (1u64 << 30) as f64
            ),
        ));
    }
    Ok(())
}

/// A float32 numpy array of `D`'s dimensions as it is (no conversion), or a `ValueError`
/// naming `arg` and what it got.
fn f32_array<'py, D: Dimension>(
    arg: &str,
    x: &Bound<'py, PyAny>,
    want: &str,
) -> PyResult<PyReadonlyArray<'py, f32, D>> {
    if let Ok(a) = x.cast::<PyArray<f32, D>>() {
        return a.try_readonly().map_err(|e| bad(arg, e));
    }
    let got = match x.cast::<PyUntypedArray>() {
        Ok(u) => format!("a {} array of shape {:?}", u.dtype(), u.shape()),
        Err(_) => format!("a {}", x.get_type().name()?),
    };
    Err(bad(
        arg,
        format!("{got}; want a float32 numpy array {want} (nothing is converted here)"),
    ))
}

fn contiguous<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    arg: &str,
    a: &'a numpy::PyReadonlyArray<'_, T, D>,
) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| bad(arg, "must be C-contiguous (np.ascontiguousarray)"))
}

/// A 4-bit bit-plane key store (docs/SPEC.md §2): keys `[N, Hkv, D]` quantized per 64-token
/// block and channel, read back at any depth of 0–4 planes.
#[pyclass(module = "fathom._fathom")]
struct KeyStoreHandle {
    inner: KeyStore,
}

#[pymethods]
impl KeyStoreHandle {
    /// Quantizes `keys` (`float32 [N, Hkv, D]`) into a new store with room for `capacity`
    /// tokens (at least N) before `append` must reallocate.
    #[staticmethod]
    #[pyo3(signature = (keys, capacity=None))]
    fn from_keys(keys: PyReadonlyArray3<'_, f32>, capacity: Option<i64>) -> PyResult<Self> {
        let s = keys.shape();
        let (n, heads, channels) = (s[0], s[1], s[2]);
        let capacity = capacity.map(|c| count("capacity", c)).transpose()?;
        let capacity = capacity.unwrap_or(n).max(n);
        store_capacity("capacity", capacity, heads, channels)?;
        let x = finite("keys", contiguous("keys", &keys)?)?;
        let dims = Dims { heads, channels };
        let mut inner = KeyStore::with_capacity(dims, capacity, None).map_err(lib_err)?;
        inner.append(x).map_err(lib_err)?;
        Ok(Self { inner })
    }

    /// Loads a store written by `save` (or `fathom quantize`).
    #[staticmethod]
    fn load(path: PathBuf) -> PyResult<Self> {
        Ok(Self {
            inner: KeyStore::load(&path).map_err(lib_err)?,
        })
    }

    /// Appends `keys` (`float32 [M, Hkv, D]`), re-quantizing the partial last block.
    fn append(&mut self, keys: PyReadonlyArray3<'_, f32>) -> PyResult<()> {
        let d = self.inner.dims();
        let s = keys.shape();
        if s[1] != d.heads || s[2] != d.channels {
            return Err(bad(
                "keys",
                format!(
                    "shape [{}, {}, {}], the store holds [N, {}, {}]",
                    s[0], s[1], s[2], d.heads, d.channels
                ),
            ));
        }
        let x = finite("keys", contiguous("keys", &keys)?)?;
        let need = self.inner.tokens() + s[0];
        if need > self.inner.capacity() {
            // Grow geometrically (the stored words move once; the store reads the same).
            self.inner
                .reserve(need.max(2 * self.inner.capacity()))
                .map_err(lib_err)?;
        }
        self.inner.append(x).map_err(lib_err)
    }

    /// Writes the store atomically.
    fn save(&self, path: PathBuf) -> PyResult<()> {
        self.inner.save(&path).map_err(lib_err)
    }

    /// Tokens held.
    #[getter]
    fn tokens(&self) -> usize {
        self.inner.tokens()
    }

    /// KV heads.
    #[getter]
    fn heads(&self) -> usize {
        self.inner.dims().heads
    }

    /// Channels per head.
    #[getter]
    fn dim(&self) -> usize {
        self.inner.dims().channels
    }

    /// Every key at the first `t` planes of every channel (`t` in 0..=4), `float32 [N, Hkv, D]`:
    /// exactly the t-bit quantizer of docs/SPEC.md §2.
    fn dequant_prefix<'py>(&self, py: Python<'py>, t: i64) -> PyResult<Bound<'py, PyArray3<f32>>> {
        let d = self.inner.dims();
        let t = u32::try_from(count("t", t)?).unwrap_or(u32::MAX);
        let v = self.inner.view().dequant_prefix(t).map_err(lib_err)?;
        PyArray1::from_vec(py, v).reshape([self.inner.tokens(), d.heads, d.channels])
    }
}

/// The importance of each channel for a query group, `w_c = σ²_c Σ_g q_gc²` (docs/SPEC.md §3):
/// `queries float32 [G, D]`, `sigma2 float32 [D]`.
#[pyfunction]
fn importance<'py>(
    py: Python<'py>,
    queries: PyReadonlyArray2<'_, f32>,
    sigma2: PyReadonlyArray1<'_, f32>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let g = queries.shape()[0];
    let q = finite("queries", contiguous("queries", &queries)?)?;
    let s = finite("sigma2", contiguous("sigma2", &sigma2)?)?;
    if queries.shape()[1] != s.len() {
        return Err(bad(
            "queries",
            format!("{} channels, sigma2 has {}", queries.shape()[1], s.len()),
        ));
    }
    let w = fathom_plan::importance(s, q, g).map_err(lib_err)?;
    Ok(PyArray1::from_vec(py, w))
}

/// Reverse water-filling (docs/SPEC.md §3): the depth (0–4 planes) of each channel that
/// minimises `Σ w_c 4^(−t_c)` within `budget` bits per token, and the bits it spends.
#[pyfunction]
fn water_fill<'py>(
    py: Python<'py>,
    importance: PyReadonlyArray1<'_, f32>,
    budget: f32,
) -> PyResult<(Bound<'py, PyArray1<u8>>, f32)> {
    let w = finite("importance", contiguous("importance", &importance)?)?;
    let plan = fathom_plan::water_fill(w, budget).map_err(lib_err)?;
    Ok((PyArray1::from_vec(py, plan.depths), plan.bits))
}

/// Writes a docs/SPEC.md §8 capture atomically. `layers` maps each layer index to a dict of
/// `q [P, Hq, D]`, `k` and `v [N, Hkv, D]` and optionally `o [P, Hq, D]` (float32);
/// `metadata` adds string keys outside the schema's (they pass through every reader).
#[pyfunction]
#[pyo3(signature = (path, layers, positions, model, qk_norm=false, softcap=None, layer_kinds=None, dtype="bf16", metadata=None))]
#[allow(clippy::too_many_arguments)]
fn write_capture(
    path: PathBuf,
    layers: &Bound<'_, PyDict>,
    positions: Vec<i64>,
    model: String,
    qk_norm: bool,
    softcap: Option<f32>,
    layer_kinds: Option<Vec<String>>,
    dtype: &str,
    metadata: Option<std::collections::BTreeMap<String, String>>,
) -> PyResult<()> {
    let dtype: Dtype = dtype.parse().map_err(|e| bad("dtype", e))?;
    if let Some(c) = softcap {
        if !(c.is_finite() && c > 0.0) {
            return Err(bad("softcap", format!("{c} (must be positive and finite)")));
        }
    }
    let positions = positions
        .into_iter()
        .map(|p| count("positions", p))
        .collect::<PyResult<Vec<_>>>()?;
    let kinds = layer_kinds
        .map(|ks| {
            ks.iter()
                .map(|k| k.parse::<LayerKind>().map_err(|e| bad("layer_kinds", e)))
                .collect::<PyResult<Vec<_>>>()
        })
        .transpose()?;
    // Every array first (name as the caller wrote it, tensor name, values, shape), then one
    // check of the shapes against the first layer's q and k.
    let mut idx: Vec<usize> = Vec::new();
    struct Tensor {
        arg: String,
        name: String,
        data: Vec<f32>,
        shape: Vec<usize>,
        part: Part,
    }
    let mut owned: Vec<Tensor> = Vec::new();
    for (key, val) in layers.iter() {
        let l: i64 = key
            .extract()
            .map_err(|_| bad("layers", "keys must be layer indices"))?;
        let l = count("layers", l)?;
        let parts = val
            .cast::<PyDict>()
            .map_err(|_| bad("layers", format!("layer {l}: a dict of q, k, v (and o)")))?;
        idx.push(l);
        for (part, name) in [
            (Part::Q, "q"),
            (Part::K, "k"),
            (Part::V, "v"),
            (Part::O, "o"),
        ] {
            let Some(a) = parts.get_item(name)? else {
                if part == Part::O {
                    continue;
                }
                return Err(bad("layers", format!("layer {l} has no {name}")));
            };
            let arg = format!("layers[{l}].{name}");
            let a: PyReadonlyArray3<'_, f32> = a
                .extract()
                .map_err(|_| bad(&arg, "must be a float32 array of 3 dimensions"))?;
            let x = finite(&arg, contiguous(&arg, &a)?)?.to_vec();
            representable(&arg, &x, dtype)?;
            owned.push(Tensor {
                arg,
                name: tensor_name(l, part),
                data: x,
                shape: a.shape().to_vec(),
                part,
            });
        }
    }
    let first = |p: Part| owned.iter().find(|t| t.part == p).map(|t| t.shape.clone());
    let (Some(qs), Some(ks)) = (first(Part::Q), first(Part::K)) else {
        return Err(bad("layers", "no layers"));
    };
    for t in &owned {
        let want = if matches!(t.part, Part::Q | Part::O) {
            &qs
        } else {
            &ks
        };
        if &t.shape != want {
            return Err(bad(&t.arg, format!("shape {:?}, want {want:?}", t.shape)));
        }
    }
    if qs[2] != ks[2] || ks[1] == 0 || qs[1] % ks[1] != 0 {
        return Err(bad(
            "layers",
            format!("q {qs:?} and k {ks:?}: D must agree and Hq be a multiple of Hkv"),
        ));
    }
    if positions.len() != qs[0] {
        return Err(bad(
            "positions",
            format!("{} positions for {} query rows", positions.len(), qs[0]),
        ));
    }
    if let Some(&p) = positions.iter().find(|&&p| p >= ks[0]) {
        return Err(bad(
            "positions",
            format!("position {p} is past the {} keys", ks[0]),
        ));
    }
    idx.sort_unstable();
    if let (Some(k), Some(&last)) = (&kinds, idx.last()) {
        if k.len() <= last {
            return Err(bad(
                "layer_kinds",
                format!(
                    "{} entries, but layer {last} is written (list the kind of every model layer)",
                    k.len()
                ),
            ));
        }
    }
    let meta = CaptureMeta {
        model,
        positions,
        qk_norm,
        softcap,
        layer_kinds: kinds,
        layers: Some(idx),
    };
    let tensors: Vec<(&str, &[f32], &[usize])> = owned
        .iter()
        .map(|t| (t.name.as_str(), t.data.as_slice(), t.shape.as_slice()))
        .collect();
    let mut map = meta.to_map();
    for (k, v) in metadata.unwrap_or_default() {
        if map.contains_key(&k) {
            return Err(bad(
                "metadata",
                format!("{k:?} is a schema key; pass it as its argument"),
            ));
        }
        map.insert(k, v);
    }
    let bytes = fathom_capture::encode(&tensors, dtype, Some(map)).map_err(lib_err)?;
    drop(tensors);
    drop(owned);
    // What is written is what the package's reader accepts: the bytes are parsed back with it
    // (schema, shapes, metadata, every layer's values) before the atomic write.
    let bytes = reads_back(&path.display().to_string(), bytes).map_err(|e| {
        bad(
            "layers",
            format!("the capture would not read back, so nothing was written: {e}"),
        )
    })?;
    fathom_store::write_atomic(&path, &bytes)
        .map_err(|e| lib_err(format!("{}: {e}", path.display())))
}

/// Refuses values that the capture's `dtype` turns into infinities (past f16's ±65504, or
/// bf16's ±3.39e38), naming `arg` and the element.
fn representable(arg: &str, x: &[f32], dtype: Dtype) -> PyResult<()> {
    let (name, inf): (&str, fn(f32) -> bool) = match dtype {
        Dtype::F16 => ("f16", |v| half::f16::from_f32(v).is_infinite()),
        Dtype::Bf16 => ("bf16", |v| half::bf16::from_f32(v).is_infinite()),
        _ => return Ok(()),
    };
    // The conversions are monotonic in |v|: only the largest magnitude need be tried.
    let Some((i, &v)) = x
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
    else {
        return Ok(());
    };
    if inf(v) {
        return Err(bad(
            arg,
            format!("element {i} is {v}, which {name} cannot hold (it would be stored as infinity); use dtype=\"f32\" or scale it"),
        ));
    }
    Ok(())
}

/// Parses encoded capture bytes back with the package's reader ([`Capture`]: schema, shapes,
/// metadata, then every layer's values, NaN and infinity refused) and gives them back, or the
/// reader's verdict. `name` stands for the path in the reader's messages.
fn reads_back(name: &str, bytes: Vec<u8>) -> Result<Vec<u8>, String> {
    let cap = Capture::from_vec(name, bytes).map_err(|e| e.to_string())?;
    for &l in &cap.info().layers {
        cap.layer(l).map_err(|e| e.to_string())?;
    }
    Ok(cap.into_bytes())
}

/// Reads a docs/SPEC.md §8 capture: `(info, layers)`, `info` a dict of the capture-wide facts
/// and `layers` a dict of layer index to a dict of float32 arrays `q`, `k`, `v` (and `o`).
#[pyfunction]
fn read_capture<'py>(
    py: Python<'py>,
    path: PathBuf,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
    let cap = Capture::open(&path).map_err(|e| lib_err(format!("{}: {e}", path.display())))?;
    let i = cap.info();
    let info = PyDict::new(py);
    info.set_item("model", &i.model)?;
    info.set_item("qk_norm", i.qk_norm)?;
    info.set_item("softcap", i.softcap)?;
    info.set_item("positions", i.positions.clone())?;
    info.set_item("layers", i.layers.clone())?;
    info.set_item(
        "layer_kinds",
        i.kinds.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
    )?;
    for (k, v) in [("n", i.n), ("hq", i.hq), ("hkv", i.hkv), ("d", i.d)] {
        info.set_item(k, v)?;
    }
    let layers = PyDict::new(py);
    for &l in &i.layers {
        let data = cap.layer(l).map_err(lib_err)?;
        let d = PyDict::new(py);
        let p = i.positions.len();
        d.set_item("q", PyArray1::from_vec(py, data.q).reshape([p, i.hq, i.d])?)?;
        d.set_item(
            "k",
            PyArray1::from_vec(py, data.k).reshape([i.n, i.hkv, i.d])?,
        )?;
        d.set_item(
            "v",
            PyArray1::from_vec(py, data.v).reshape([i.n, i.hkv, i.d])?,
        )?;
        if let Some(o) = data.o {
            d.set_item("o", PyArray1::from_vec(py, o).reshape([p, i.hq, i.d])?)?;
        }
        layers.set_item(l, d)?;
    }
    Ok((info, layers))
}

/// Runs the fidelity evaluation of a capture (what `fathom fidelity --json` writes) and
/// returns the document as a JSON string.
#[pyfunction]
#[pyo3(signature = (capture, methods, k=None, calib=None, layers=None, basis="auto"))]
fn fidelity_json(
    py: Python<'_>,
    capture: PathBuf,
    methods: &str,
    k: Option<i64>,
    calib: Option<PathBuf>,
    layers: Option<Vec<i64>>,
    basis: &str,
) -> PyResult<String> {
    let basis: BasisChoice = basis.parse().map_err(|e| bad("basis", e))?;
    let k = k.map(|k| count("k", k)).transpose()?;
    let layers = layers
        .map(|ls| ls.into_iter().map(|l| count("layers", l)).collect())
        .transpose()?;
    let args = EvaluateArgs {
        capture: &capture,
        methods,
        basis,
        calib: calib.as_deref(),
        k,
        layers,
        study: Default::default(),
        command: format!("fathom.fidelity({}, {methods:?})", capture.display()),
    };
    // The error as its message inside the closure (the library's error type is large).
    let (doc, _) = py
        .detach(|| evaluate(&args, &|_| {}).map_err(|e| e.to_string()))
        .map_err(lib_err)?;
    let doc: fathom_results::Document = doc.into();
    serde_json::to_string(&doc).map_err(lib_err)
}

/// Calibrates on a capture (what `fathom calibrate` writes): σ², the KLT and the basis rule
/// per (layer, KV head), per-layer budgets for each target; writes `out` and its summary and
/// returns the basis the rule chose (`"Raw"` or `"Klt"`, or None without global layers).
#[pyfunction]
#[pyo3(signature = (capture, out, targets=vec![48.0, 64.0], k=None, quantum=4.0))]
fn calibrate(
    py: Python<'_>,
    capture: PathBuf,
    out: PathBuf,
    targets: Vec<f32>,
    k: Option<i64>,
    quantum: f32,
) -> PyResult<Option<String>> {
    let k = k.map(|k| count("k", k)).transpose()?;
    let args = fathom_bench::evaluate::CalibrateArgs {
        capture: &capture,
        out: &out,
        targets,
        k,
        quantum,
        command: format!("fathom.calibrate({}, {})", capture.display(), out.display()),
    };
    let cal = py
        .detach(|| {
            fathom_bench::evaluate::calibrate_file(&args, &|_, _, _| {}).map_err(|e| e.to_string())
        })
        .map_err(lib_err)?;
    Ok(cal.basis_rule.map(|r| format!("{:?}", r.choice)))
}

/// The library's version (the workspace's).
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[pymodule]
fn _fathom(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FathomError", m.py().get_type::<FathomError>())?;
    m.add_class::<KeyStoreHandle>()?;
    m.add_class::<Decoder>()?;
    m.add_function(wrap_pyfunction!(importance, m)?)?;
    m.add_function(wrap_pyfunction!(water_fill, m)?)?;
    m.add_function(wrap_pyfunction!(write_capture, m)?)?;
    m.add_function(wrap_pyfunction!(read_capture, m)?)?;
    m.add_function(wrap_pyfunction!(fidelity_json, m)?)?;
    m.add_function(wrap_pyfunction!(calibrate, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    gpu::register(m)?;
    Ok(())
}
