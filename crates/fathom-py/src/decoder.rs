//! The CPU protocol's decoder on numpy arrays (`fathom_bench::decode::SparseDecoder`), what
//! `fathom.hf.generate` drives on the CPU.

use std::path::PathBuf;

use numpy::ndarray::{Ix2, Ix3};
use numpy::PyArray1;
use pyo3::prelude::*;

use crate::*;

/// One sequence decoded with one method (`fathom_bench::decode::SparseDecoder`). It holds the
/// sequence's keys and values per layer: `append` adds new tokens' rows `[m, Hkv, D]` (after
/// RoPE and any QK-norm; only the new ones cross from the caller), and `attend` gives the
/// attention output `[Hq, D]` of the last token's queries under the SPEC §5 protocol (sink +
/// local + each query head's own top-k, exact softmax at `1/√D`). The constructor refuses
/// what a step would fail on: a method that needs a calibration without one, a softcap that
/// is not positive and finite, `k = sink = local = 0` for a sparse method, a negative count.
#[pyclass(module = "fathom._fathom")]
pub(crate) struct Decoder {
    inner: fathom_bench::decode::SparseDecoder,
    /// Per layer: keys and values `[n][Hkv][D]`.
    kv: Vec<(Vec<f32>, Vec<f32>)>,
    hkv: usize,
    dim: usize,
    row: usize,
}

#[pymethods]
impl Decoder {
    #[new]
    #[pyo3(signature = (method, layers, kv_heads, dim, k, capacity=4096, sink=4, local=32, calib=None, basis="raw", softcap=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        method: &str,
        layers: i64,
        kv_heads: i64,
        dim: i64,
        k: i64,
        capacity: i64,
        sink: i64,
        local: i64,
        calib: Option<PathBuf>,
        basis: &str,
        softcap: Option<f32>,
    ) -> PyResult<Self> {
        use fathom_bench::fidelity::CalibSource;
        let (layers, kv_heads, dim) = (
            count("layers", layers)?,
            count("kv_heads", kv_heads)?,
            count("dim", dim)?,
        );
        let (k, capacity) = (count("k", k)?, count("capacity", capacity)?);
        let (sink, local) = (count("sink", sink)?, count("local", local)?);
        let basis: BasisChoice = basis.parse().map_err(|e| bad("basis", e))?;
        if let Some(c) = softcap {
            if !(c.is_finite() && c > 0.0) {
                return Err(bad("softcap", format!("{c} (must be positive and finite)")));
            }
        }
        store_capacity("capacity", capacity, kv_heads, dim)?;
        let cal = calib
            .as_ref()
            .map(|p| fathom_bench::calib::Calibration::load(p))
            .transpose()
            .map_err(lib_err)?;
        if let Some(c) = &cal {
            if c.d != dim || c.hkv != kv_heads {
                return Err(lib_err(format!(
                    "the calibration is for Hkv = {}, D = {}; the decoder for Hkv = {kv_heads}, D = {dim}",
                    c.hkv, c.d
                )));
            }
        }
        let mut list =
            fathom_bench::methods::scanners(method, dim, basis, cal.as_ref()).map_err(lib_err)?;
        if list.len() != 1 {
            return Err(bad(
                "method",
                format!("{method:?} names {} methods, want one", list.len()),
            ));
        }
        // As the command line decides (`needs_calib`): a method outside the fixed-rule grammar
        // (Fathom's plans) or one whose spec says so needs a calibration.
        if cal.is_none() && list[0].spec().is_none_or(|s| s.needs_calibration()) {
            return Err(bad(
                "calib",
                format!("method {method:?} needs a calibration (fathom.calibrate on a capture of the model)"),
            ));
        }
        if !list[0].is_dense() && k + sink + local == 0 {
            return Err(bad(
                "k",
                "k, sink and local are all 0: no token would be attended",
            ));
        }
        let heads = cal.as_ref().map(|c| {
            (0..layers)
                .map(|l| {
                    (0..kv_heads)
                        .filter_map(|h| c.head(l, h).cloned())
                        .collect()
                })
                .collect()
        });
        let params = fathom_plan::SelectParams { sink, local, k };
        let inner = fathom_bench::decode::SparseDecoder::new(
            list.remove(0),
            params,
            layers,
            kv_heads,
            dim,
            capacity,
            heads,
            softcap,
        )
        .map_err(lib_err)?;
        Ok(Self {
            inner,
            kv: vec![(Vec::new(), Vec::new()); layers],
            hkv: kv_heads,
            dim,
            row: kv_heads * dim,
        })
    }

    /// Appends tokens' keys and values `[m, Hkv, D]` to layer `layer`'s.
    fn append(
        &mut self,
        layer: i64,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (hkv, dim) = (self.hkv, self.dim);
        let want = format!("[m, Hkv = {hkv}, D = {dim}]");
        let keys = f32_array::<Ix3>("keys", keys, &want)?;
        let values = f32_array::<Ix3>("values", values, &want)?;
        let (ksh, vsh) = (keys.shape(), values.shape());
        if ksh[1..] != [hkv, dim] {
            return Err(bad("keys", format!("shape {ksh:?}; want {want}")));
        }
        if vsh != ksh {
            return Err(bad(
                "values",
                format!("shape {vsh:?}; want the keys' {ksh:?}"),
            ));
        }
        let layer = count("layer", layer)?;
        let layers = self.kv.len();
        let (k, v) = self.kv.get_mut(layer).ok_or_else(|| {
            bad(
                "layer",
                format!("{layer} is out of range (the decoder has {layers})"),
            )
        })?;
        let ks = finite("keys", contiguous("keys", &keys)?)?;
        let vs = finite("values", contiguous("values", &values)?)?;
        k.extend_from_slice(ks);
        v.extend_from_slice(vs);
        Ok(())
    }

    /// Tokens held for layer `layer`.
    fn tokens(&self, layer: i64) -> PyResult<usize> {
        self.kv
            .get(count("layer", layer)?)
            .map(|(k, _)| k.len() / self.row)
            .ok_or_else(|| bad("layer", format!("{layer} is out of range")))
    }

    /// The attention output `[Hq, D]` of the last token's queries `q` `[Hq, D]` on global
    /// layer `layer`, over the layer's keys and values so far.
    fn attend<'py>(
        &mut self,
        py: Python<'py>,
        layer: i64,
        q: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, numpy::PyArray2<f32>>> {
        let (hkv, dim) = (self.hkv, self.dim);
        let want = format!("[Hq, D = {dim}] with Hq a positive multiple of Hkv = {hkv}");
        let q = f32_array::<Ix2>("q", q, &want)?;
        let (hq, d) = (q.shape()[0], q.shape()[1]);
        if d != dim || hq == 0 || hq % hkv != 0 {
            return Err(bad("q", format!("shape {:?}; want {want}", q.shape())));
        }
        let n = self.tokens(layer)?;
        let layer = count("layer", layer)?;
        if n == 0 {
            return Err(bad(
                "layer",
                format!("layer {layer} holds no tokens (append first)"),
            ));
        }
        let qs = finite("q", contiguous("q", &q)?)?;
        let mut out = vec![0f32; qs.len()];
        let (inner, (ks, vs)) = (&mut self.inner, &self.kv[layer]);
        py.detach(|| inner.attend(layer, qs, ks, vs, n - 1, &mut out))
            .map_err(lib_err)?;
        PyArray1::from_vec(py, out).reshape([hq, d])
    }

    /// The method's label.
    #[getter]
    fn method(&self) -> String {
        self.inner.method()
    }

    /// Whether the method attends densely.
    #[getter]
    fn is_dense(&self) -> bool {
        self.inner.is_dense()
    }

    /// Mean bits per token and KV head the scans read so far.
    #[getter]
    fn mean_bits(&self) -> f64 {
        self.inner.stats.mean_bits()
    }

    /// Mean fraction of the visible keys attended so far.
    #[getter]
    fn density(&self) -> f64 {
        self.inner.stats.density()
    }

    /// What a GPU row cache would have served of the union rows so far, per size (64, 256,
    /// 1024 and 8192 slots per layer and KV head; the CPU reference of docs/SPEC.md §6.1 "Row
    /// cache" over this decoder's own unions): a list of `(slots, rows, hits)`, empty for
    /// dense.
    #[getter]
    fn row_cache(&self) -> Vec<(usize, u64, u64)> {
        let t = self.inner.stats.row_cache();
        t.iter().map(|x| (x.slots, x.rows, x.hits)).collect()
    }
}
