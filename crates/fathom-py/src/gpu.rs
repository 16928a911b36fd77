//! The GPU half: `fathom-cuda`'s paged cache on torch CUDA tensors (or any DLPack producer),
//! zero-copy; every tensor is checked at the edge (`crate::dlpack`) before anything is
//! launched.
//!
//! Streams: every call takes the caller's raw `CUstream` (the Python wrapper passes
//! `torch.cuda.current_stream().cuda_stream` by default); the cache's own stream first waits
//! for the work queued on it (`PagedCache::follow`) and the caller's stream then waits for the
//! cache's work (`PagedCache::signal`), so the call behaves as if it ran on the caller's stream,
//! with no host synchronisation.

use pyo3::prelude::*;

use fathom_cuda::cache::{
    AppendBatch, AttendMethod, CacheConfig, KvDtype, KvRows, QueryRows, SelectOut,
};
use fathom_cuda::memory::{DeviceView, DeviceViewMut};
use fathom_cuda::pages::{PageConfig, SessionId};
use fathom_cuda::prelude::*;
use fathom_cuda::{Gpu, ModelShape, PagedCache, Residency};

use crate::dlpack::{check, check_cuda_tensor, cuda_tensor, dlpack_info, tensor_info};
use crate::{bad, lib_err};

/// A session of a [`GpuCache`].
#[pyclass(module = "fathom._fathom", frozen)]
#[derive(Clone, Copy)]
pub struct Session {
    id: SessionId,
}

#[pymethods]
impl Session {
    fn __repr__(&self) -> String {
        format!("Session({})", self.id)
    }
}

/// Where one step's new tokens go (`GpuCache.reserve`); valid until the next reserve, fork or
/// free.
#[pyclass(module = "fathom._fathom")]
pub struct Batch {
    inner: AppendBatch,
}

#[pymethods]
impl Batch {
    /// Rows of the step's K/V arrays (the sum of the sessions' new tokens).
    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows
    }
    /// Sessions in the batch.
    fn __len__(&self) -> usize {
        self.inner.plans.len()
    }
}

/// The paged KV cache of one model shape on a CUDA device (docs/SPEC.md §6.1), on DLPack
/// tensors. See `fathom.GpuCache` for the documented Python API.
#[pyclass(module = "fathom._fathom", unsendable)]
pub struct GpuCache {
    cache: PagedCache,
    _gpu: Gpu,
    device: i32,
}

fn gpu_err(e: fathom_cuda::CudaError) -> PyErr {
    lib_err(e)
}

#[pymethods]
impl GpuCache {
    #[new]
    #[pyo3(signature = (layers, kv_heads, group, dim, max_sessions, max_tokens, pages=None, page_tokens=2048, max_batch=None, max_k=512, row_cache=0, residency="host", device=0, pca_index=false, block_tables=false, select_path="scores", attend_groups=1, scan_vector_words=1, host_gather=0, host_gather_share=100, stage_timing=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layers: usize,
        kv_heads: usize,
        group: usize,
        dim: usize,
        max_sessions: usize,
        max_tokens: usize,
        pages: Option<usize>,
        page_tokens: usize,
        max_batch: Option<usize>,
        max_k: usize,
        row_cache: usize,
        residency: &str,
        device: i32,
        pca_index: bool,
        block_tables: bool,
        select_path: &str,
        attend_groups: usize,
        scan_vector_words: u32,
        host_gather: usize,
        host_gather_share: u32,
        stage_timing: bool,
    ) -> PyResult<Self> {
        let select = fathom_cuda::cache::SelectPath::parse(select_path)
            .map_err(|e| bad("select_path", e))?;
        let residency = match residency {
            "host" => Residency::Host,
            "hbm" => Residency::Hbm,
            "index-hbm" => Residency::IndexHbm,
            other => {
                return Err(bad(
                    "residency",
                    format!("{other:?} (want host, hbm or index-hbm)"),
                ))
            }
        };
        let per = max_tokens.div_ceil(page_tokens.max(1));
        let cfg = CacheConfig {
            shape: ModelShape {
                layers,
                kv_heads,
                group,
                dim,
            },
            pages: PageConfig {
                page_tokens,
                pages: pages.unwrap_or(max_sessions * (per + 1)),
                max_sessions,
                max_tokens,
            },
            max_batch: max_batch.unwrap_or(max_sessions),
            max_k,
            row_cache,
            residency,
            pca_index,
            block_tables,
            host_pages: fathom_cuda::HostPages::Driver,
            options: fathom_cuda::cache::CacheOptions {
                select,
                attend_groups,
                scan_vector_words,
                host_gather_threads: host_gather,
                host_gather_share,
                stage_timing,
            },
        };
        // Limits first: a bad one is a ValueError before the device is opened.
        let cfg = cfg.validate().map_err(lib_err)?;
        let ordinal = usize::try_from(device).map_err(|_| bad("device", "negative"))?;
        let gpu = Gpu::open(ordinal).map_err(gpu_err)?;
        let cache = PagedCache::new(&gpu, cfg).map_err(gpu_err)?;
        Ok(GpuCache {
            cache,
            _gpu: gpu,
            device,
        })
    }

    /// A new, empty session.
    fn create(&mut self) -> PyResult<Session> {
        Ok(Session {
            id: self.cache.create().map_err(gpu_err)?,
        })
    }

    /// A session sharing every token of `parent` (copy-on-write pages).
    fn fork(&mut self, parent: &Session) -> PyResult<Session> {
        Ok(Session {
            id: self.cache.fork(parent.id).map_err(gpu_err)?,
        })
    }

    /// Frees a session.
    fn free(&mut self, session: &Session) -> PyResult<()> {
        self.cache.free(session.id).map_err(gpu_err)
    }

    /// Tokens in a session.
    fn len(&self, session: &Session) -> PyResult<usize> {
        self.cache.len(session.id).map_err(gpu_err)
    }

    /// Shortens a session to its first `len` tokens in every layer.
    fn truncate(&mut self, session: &Session, len: usize) -> PyResult<()> {
        self.cache.truncate(session.id, len).map_err(gpu_err)
    }

    /// Grows a ragged batch `[(session, new_tokens)]` (all or nothing); `stream` then waits
    /// for the descriptors' upload. With `follow`, the cache first waits for the work queued
    /// on `stream` (a replay of the caller's graph, which reads the descriptors the reserve
    /// rewrites): the reserve's own host wait then covers it.
    fn reserve(
        &mut self,
        batch: Vec<(Session, usize)>,
        stream: u64,
        follow: bool,
    ) -> PyResult<Batch> {
        let b: Vec<(SessionId, usize)> = batch.iter().map(|(s, n)| (s.id, *n)).collect();
        if follow {
            // SAFETY: `stream` is the caller's stream of this device's context (the Python
            // wrapper passes torch's current stream, or the caller's own).
            unsafe { self.cache.follow(stream) }.map_err(gpu_err)?;
        }
        let inner = self.cache.reserve(&b).map_err(gpu_err)?;
        // SAFETY: as above.
        unsafe { self.cache.signal(stream) }.map_err(gpu_err)?;
        Ok(Batch { inner })
    }

    /// The last `min(len, cap)` K|V records of every session of `batch` (after this step's
    /// appends) into `k_out` and `v_out`, `[batch][cap][Hkv][D]` float32 each (rows past a
    /// session's count are not written): the stored bf16 values, exactly.
    fn read_rows(
        &self,
        batch: &Batch,
        layer: usize,
        cap: usize,
        k_out: &Bound<'_, PyAny>,
        v_out: &Bound<'_, PyAny>,
        stream: u64,
    ) -> PyResult<()> {
        let s = self.cache.config().shape;
        let shape = [batch.inner.plans.len(), cap, s.kv_heads, s.dim];
        let (kp, _, _kh) = cuda_tensor("k_out", k_out, stream, self.device, &shape, &["float32"])?;
        let (vp, _, _vh) = cuda_tensor("v_out", v_out, stream, self.device, &shape, &["float32"])?;
        let n = shape.iter().product();
        // SAFETY: both checked CUDA float32 tensors of this device of exactly `shape`
        // (contiguous), alive for the call, the work ordered before `stream`'s next.
        let (ko, vo) = unsafe {
            (
                DeviceViewMut::from_raw(kp, n, KvDtype::F32),
                DeviceViewMut::from_raw(vp, n, KvDtype::F32),
            )
        };
        // SAFETY: as in `reserve`.
        unsafe { self.cache.follow(stream) }.map_err(gpu_err)?;
        self.cache
            .read_rows(&batch.inner, layer, cap, ko, vo)
            .map_err(gpu_err)?;
        // SAFETY: as above.
        unsafe { self.cache.signal(stream) }.map_err(gpu_err)
    }

    /// Prepares `method`'s static plan (a no-op for methods without one, or when prepared):
    /// what a capture needs done before it, since the cache refuses it while capturing.
    fn prepare(&mut self, method: &str) -> PyResult<()> {
        let m = AttendMethod::parse(method, self.cache.config().shape.dim).map_err(lib_err)?;
        if let AttendMethod::Scan(mm) = m {
            self.prepare_static(mm)?;
        }
        Ok(())
    }

    /// Starts a capture the caller makes into its own graph (`torch.cuda.graph`) for the
    /// decode batch `batch`: until `end_capture`, grids cover `max_tokens` and the calls
    /// that would change what the graph reads are refused.
    fn begin_caller_capture(&mut self, batch: &Batch) -> PyResult<()> {
        self.cache
            .begin_caller_capture(&batch.inner)
            .map_err(gpu_err)
    }

    /// Ends the capture; the token `replay` checks before each replay of the caller's graph.
    fn end_capture(&mut self) -> PyResult<Graph> {
        Ok(Graph {
            inner: self.cache.end_capture().map_err(gpu_err)?,
        })
    }

    /// The checks and bookkeeping of one replay of the caller's graph for `batch` (the
    /// current reserve of the captured sessions), then `stream` ordered after the cache's
    /// work: call it right before the graph's replay on `stream`.
    fn replay(&mut self, batch: &Batch, graph: &Graph, stream: u64) -> PyResult<()> {
        self.cache
            .replay(&batch.inner, &graph.inner)
            .map_err(gpu_err)?;
        // SAFETY: as in `reserve`.
        unsafe { self.cache.signal(stream) }.map_err(gpu_err)
    }

    /// Loads one layer's σ² `[Hkv][D]` (float32, host) for `fathom:B`.
    fn load_sigma2(
        &mut self,
        layer: usize,
        sigma2: numpy::PyReadonlyArray2<'_, f32>,
    ) -> PyResult<()> {
        use numpy::PyUntypedArrayMethods;
        let s = self.cache.config().shape;
        if sigma2.shape() != [s.kv_heads, s.dim] {
            return Err(bad(
                "sigma2",
                format!(
                    "shape {:?}, want [{}, {}]",
                    sigma2.shape(),
                    s.kv_heads,
                    s.dim
                ),
            ));
        }
        let x = sigma2
            .as_slice()
            .map_err(|_| bad("sigma2", "must be C-contiguous"))?;
        let heads: Vec<fathom_plan::scanner::HeadCalib> = x
            .chunks(s.dim)
            .map(|c| fathom_plan::scanner::HeadCalib {
                sigma2: c.to_vec(),
                ..Default::default()
            })
            .collect();
        self.cache.load_calibration(layer, &heads).map_err(gpu_err)
    }

    /// Loads a calibration file (`fathom calibrate`'s JSON): σ² and Double Sparsity's channels
    /// of every calibrated layer.
    fn load_calibration(&mut self, path: std::path::PathBuf) -> PyResult<()> {
        let c = fathom_bench::calib::Calibration::load(&path).map_err(lib_err)?;
        let s = self.cache.config().shape;
        if c.d != s.dim || c.hkv != s.kv_heads {
            return Err(lib_err(format!(
                "the calibration is for Hkv = {}, D = {}; the cache for Hkv = {}, D = {}",
                c.hkv, c.d, s.kv_heads, s.dim
            )));
        }
        for (slot, &layer) in c.layers.iter().enumerate() {
            self.cache
                .load_calibration(layer, &c.heads[slot])
                .map_err(gpu_err)?;
        }
        Ok(())
    }

    /// `(mean plan bits per token and KV head, plans)` of every GPU-planned attend so far
    /// (waits for the cache's stream).
    fn plan_bits(&self) -> PyResult<(f64, u64)> {
        self.cache.plan_bits().map_err(gpu_err)
    }

    /// `(union rows, row-cache hits)` of every attend so far (waits for the cache's stream).
    fn row_counters(&self) -> PyResult<(u64, u64)> {
        let r = self.cache.row_counters().map_err(gpu_err)?;
        Ok((r.rows, r.hits))
    }

    /// The select setting's label (`scores` or `filtered>=N`, `+scores` when kept).
    #[getter]
    fn select_path(&self) -> String {
        self.cache.config().options.select.label()
    }

    /// Head groups per attend (fixed when the cache was made).
    #[getter]
    fn attend_groups(&self) -> usize {
        self.cache.config().options.attend_groups
    }

    /// Plane words per global load of the scan (fixed when the cache was made).
    #[getter]
    fn scan_vector_words(&self) -> u32 {
        self.cache.config().options.scan_vector_words
    }

    /// The host gather's threads (0: off; fixed when the cache was made).
    #[getter]
    fn host_gather(&self) -> usize {
        self.cache.config().options.host_gather_threads
    }

    /// The host-gather share, in percent (fixed when the cache was made).
    #[getter]
    fn host_gather_share(&self) -> u32 {
        self.cache.config().options.host_gather_share
    }

    /// Whether attends are split by stage (fixed when the cache was made).
    #[getter]
    fn stage_timing(&self) -> bool {
        self.cache.config().options.stage_timing
    }

    /// `(attends split, attends untimed, [ms per stage in the order plan, scan, topk, union,
    /// fetch, attention])` since the last call (waits for the cache's stream).
    fn stage_times(&mut self) -> PyResult<(u64, u64, Vec<f64>)> {
        let st = self.cache.stage_times().map_err(gpu_err)?;
        Ok((st.attends, st.untimed, st.values().to_vec()))
    }

    /// Appends one layer's K and V (`[rows, Hkv, D]`, float32 / float16 / bfloat16, on this
    /// device) to the batch's sessions, after the work queued on `stream`.
    fn append(
        &mut self,
        batch: &Batch,
        layer: usize,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        stream: u64,
    ) -> PyResult<()> {
        let s = self.cache.config().shape;
        let shape = [batch.inner.rows, s.kv_heads, s.dim];
        let dt = ["float32", "float16", "bfloat16"];
        let (kp, kd, _kh) = cuda_tensor("k", k, stream, self.device, &shape, &dt)?;
        let (vp, vd, _vh) = cuda_tensor("v", v, stream, self.device, &shape, &dt)?;
        if kd != vd {
            return Err(bad("v", format!("has dtype {vd:?}, k has {kd:?}")));
        }
        let n = shape.iter().product();
        // SAFETY: `cuda_tensor` checked both are CUDA tensors of this device with exactly
        // `shape` (contiguous) of dtype `kd`; the DLPack handles keep them alive until this
        // call returns, and the cache's work on them is ordered before `stream`'s next work
        // (`signal` below), as torch's caching allocator requires.
        let kv = unsafe {
            KvRows {
                k: DeviceView::from_raw(kp, n, kd),
                v: DeviceView::from_raw(vp, n, kd),
                rows: shape[0],
            }
        };
        // SAFETY: `stream` is the caller's stream of this device's context (the Python wrapper
        // passes torch's current stream, or the caller's own).
        unsafe { self.cache.follow(stream) }.map_err(gpu_err)?;
        self.cache
            .append(&batch.inner, layer, &kv)
            .map_err(gpu_err)?;
        // SAFETY: as above.
        unsafe { self.cache.signal(stream) }.map_err(gpu_err)
    }

    /// One layer's attention for the batch's sessions: queries `q` `[batch, Hq, D]` into `out`
    /// `[batch, Hq, D]` float32 (written in place), with `method` (`dense` or any method of
    /// the grammar) and the sink + local + top-k selection.
    #[pyo3(signature = (batch, layer, method, q, out, stream, k=256, sink=4, local=32))]
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &mut self,
        batch: &Batch,
        layer: usize,
        method: &str,
        q: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        stream: u64,
        k: usize,
        sink: usize,
        local: usize,
    ) -> PyResult<()> {
        let s = self.cache.config().shape;
        let m = AttendMethod::parse(method, s.dim).map_err(lib_err)?;
        let shape = [batch.inner.plans.len(), s.kv_heads * s.group, s.dim];
        let (qp, qd, _qh) = cuda_tensor(
            "q",
            q,
            stream,
            self.device,
            &shape,
            &["float32", "float16", "bfloat16"],
        )?;
        let (op, _, _oh) = cuda_tensor("out", out, stream, self.device, &shape, &["float32"])?;
        let params = fathom_plan::SelectParams { sink, local, k };
        let n = shape.iter().product();
        // SAFETY: as in `append`: both checked CUDA tensors of this device, `shape`, alive for
        // the call, the work ordered before `stream`'s next; `out` is written in place.
        let (qr, ov) = unsafe {
            (
                QueryRows {
                    q: DeviceView::from_raw(qp, n, qd),
                },
                DeviceViewMut::from_raw(op, n, KvDtype::F32),
            )
        };
        self.ready(m, layer)?;
        // SAFETY: as in `append`.
        unsafe { self.cache.follow(stream) }.map_err(gpu_err)?;
        self.cache
            .attend(&batch.inner, layer, m, &params, &qr, ov)
            .map_err(gpu_err)?;
        // SAFETY: as above.
        unsafe { self.cache.signal(stream) }.map_err(gpu_err)
    }

    /// One layer's selection for the batch's sessions (each at its last token), without the
    /// attention: `indices` `[batch, Hq, cap]` int32 gets each query head's logical positions
    /// (sink, top-k, local window; -1 past its length) and `lengths` `[batch, Hq]` int32 its
    /// length, with `cap ≥ sink + local + k`.
    #[pyo3(signature = (batch, layer, method, q, indices, lengths, stream, k=256, sink=4, local=32))]
    #[allow(clippy::too_many_arguments)]
    fn select(
        &mut self,
        batch: &Batch,
        layer: usize,
        method: &str,
        q: &Bound<'_, PyAny>,
        indices: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        stream: u64,
        k: usize,
        sink: usize,
        local: usize,
    ) -> PyResult<()> {
        let s = self.cache.config().shape;
        let m = AttendMethod::parse(method, s.dim).map_err(lib_err)?;
        let (nb, hq) = (batch.inner.plans.len(), s.kv_heads * s.group);
        let shape = [nb, hq, s.dim];
        let (qp, qd, _qh) = cuda_tensor(
            "q",
            q,
            stream,
            self.device,
            &shape,
            &["float32", "float16", "bfloat16"],
        )?;
        let it = tensor_info("indices", indices, Some(stream))?;
        let cap = match it.shape.as_slice() {
            [_, _, c] if *c >= 0 => *c as usize,
            other => {
                return Err(bad(
                    "indices",
                    format!("has shape {other:?}, want [{nb}, {hq}, cap]"),
                ))
            }
        };
        let (ip, _, _ih) = check("indices", &it, self.device, &[nb, hq, cap], &["int32"])?;
        let (lp, _, _lh) = cuda_tensor(
            "lengths",
            lengths,
            stream,
            self.device,
            &[nb, hq],
            &["int32"],
        )?;
        let params = fathom_plan::SelectParams { sink, local, k };
        // SAFETY: as in `append`: each a checked CUDA tensor of this device of exactly its
        // shape (contiguous), alive for the call, the work ordered before `stream`'s next.
        let (qr, out) = unsafe {
            (
                QueryRows {
                    q: DeviceView::from_raw(qp, shape.iter().product(), qd),
                },
                SelectOut {
                    indices: DeviceViewMut::from_raw(ip, nb * hq * cap, KvDtype::I32),
                    lengths: DeviceViewMut::from_raw(lp, nb * hq, KvDtype::I32),
                    cap,
                },
            )
        };
        self.ready(m, layer)?;
        // SAFETY: as in `append`.
        unsafe { self.cache.follow(stream) }.map_err(gpu_err)?;
        self.cache
            .select(&batch.inner, layer, m, &params, &qr, out)
            .map_err(gpu_err)?;
        // SAFETY: as above.
        unsafe { self.cache.signal(stream) }.map_err(gpu_err)
    }
}

impl GpuCache {
    /// Prepares a scan method's static plan the first time it is used (never inside a
    /// capture, where the cache refuses it), then checks that the layer has what the method
    /// needs (a calibration, say).
    fn ready(&mut self, m: AttendMethod, layer: usize) -> PyResult<()> {
        if let AttendMethod::Scan(mm) = m {
            self.prepare_static(mm)?;
        }
        self.cache.check_method(m, layer).map_err(gpu_err)
    }

    /// Makes a static method's depth table once (exact, thumb2, ds:r, loki:r): the methods
    /// that plan per query have none, and their checks are `check_method`'s, so nothing here
    /// runs inside a capture once the table exists.
    fn prepare_static(&mut self, mm: fathom_cuda::config::Method) -> PyResult<()> {
        use fathom_cuda::config::Method as M;
        let per_query = matches!(mm, M::Fathom(_) | M::SparQ(_) | M::Landmark | M::Quest);
        if !per_query && !self.cache.is_prepared(mm) {
            self.cache.prepare(mm).map_err(gpu_err)?;
        }
        Ok(())
    }
}

/// A decode step the caller captured into its own graph (`GpuCache.end_capture`).
#[pyclass(module = "fathom._fathom", unsendable)]
pub struct Graph {
    inner: fathom_cuda::DecodeGraph,
}

/// The GPU half of the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<GpuCache>()?;
    m.add_class::<Session>()?;
    m.add_class::<Batch>()?;
    m.add_class::<Graph>()?;
    m.add_function(wrap_pyfunction!(dlpack_info, m)?)?;
    m.add_function(wrap_pyfunction!(check_cuda_tensor, m)?)?;
    Ok(())
}
