//! The one API both backends implement: the CUDA backend (`cuda` feature) and the stub that
//! every other build gets ([`crate::CudaError::NotCompiledWithCuda`] from every entry point).
//! Each signature is written once, here: the backends implement these traits directly, as
//! candle's dummy backend implements its CUDA backend's traits, and code written against them
//! compiles, unchanged, in either build (`tests/api.rs` holds both to them; CI checks the
//! crate with and without the feature). Bring them into scope with
//! `use fathom_cuda::prelude::*`.

use half::bf16;

use crate::cache::{
    AppendBatch, AttendDebug, AttendMethod, AttendStages, CacheConfig, KvRows, QueryRows,
    RowCounters, SelectCounters,
};
use crate::error::Result;
use crate::memory::DeviceViewMut;
use crate::paged_layout::PagedLayout;
use crate::paged_ref::PagedExport;
use crate::pages::{CacheSessions, SessionId};
use crate::types::{DeviceInfo, RowSweep};

/// A GPU the cache runs on.
pub trait Device: Sized + std::fmt::Debug {
    /// Opens device `ordinal` ([`crate::CudaError::NotCompiledWithCuda`] in the stub,
    /// [`crate::CudaError::NoDevice`] without a driver or device).
    fn open(ordinal: usize) -> Result<Self>;
    /// The device description.
    fn info(&self) -> &DeviceInfo;
    /// Host-to-device bandwidth of one pinned `memcpy` of `bytes`, GB/s.
    fn h2d_bandwidth(&self, bytes: usize) -> Result<f64>;
    /// Bandwidth of the zero-copy gather kernel over one run of `bytes`, GB/s.
    fn gather_bandwidth(&self, bytes: usize) -> Result<f64>;
    /// Bandwidth of the zero-copy gather over runs of `run_bytes` spread over `total_bytes`,
    /// GB/s.
    fn gather_run_bandwidth(&self, run_bytes: usize, total_bytes: usize) -> Result<f64>;
    /// The zero-copy gather over random and back-to-back rows of host memory on `pages`: each
    /// row size, span and row count of the sweep, with `seed` drawing the rows.
    fn row_gather_sweep(
        &self,
        pages: crate::HostPages,
        row_bytes: usize,
        spans: &[usize],
        rows: &[usize],
        seed: u64,
    ) -> Result<RowSweep>;
}

/// The paged KV cache a model drives (docs/SPEC.md §6.1) on a [`Device`]: sessions in pages
/// of pinned, mapped host memory (or HBM), appends of K/V rows from device memory, and
/// attends of any method of the grammar, each query head over its own sink + local + top-k
/// set. Every argument is checked before any launch or write; a refused call changes nothing.
pub trait KvCache: Sized {
    /// The device type.
    type Device: Device;
    /// A captured decode step ([`KvCache::capture`]).
    type Graph;

    /// Waits for everything queued on the cache's stream (its appends and attends).
    ///
    /// # Errors
    /// A driver failure; a capture under way (nothing may wait for a stream being captured).
    fn synchronize(&self) -> Result<()>;

    /// Allocates the pools (`L ×` [`PagedLayout::pool_bytes`] of pinned, mapped host memory, or
    /// of HBM when [`CacheConfig::residency`] says so), the page tables and the tails, and
    /// compiles the kernels.
    ///
    /// # Errors
    /// A configuration [`CacheConfig::validate`] refuses; a failed allocation (typed, with its
    /// size); an NVRTC or driver failure.
    fn new(gpu: &Self::Device, cfg: CacheConfig) -> Result<Self>;

    /// The configuration.
    fn config(&self) -> &CacheConfig;

    /// The byte layout of each layer's pool.
    fn layout(&self) -> &PagedLayout;

    /// The host-side page tables and sessions.
    fn sessions(&self) -> &CacheSessions;

    /// A new, empty session (its slot's row cache emptied: it sees none of an old session's
    /// rows).
    fn create(&mut self) -> Result<SessionId>;

    /// Tokens in `session`.
    fn len(&self, session: SessionId) -> Result<usize>;

    /// Whether `session` holds no token.
    fn is_empty(&self, session: SessionId) -> Result<bool>;

    /// A session that shares every page of `parent` (docs/SPEC.md §6.1: full pages read-only,
    /// the partial last page copied by whichever side appends to it first) and a copy of its
    /// partial block's keys. Appends to either never change what the other reads.
    fn fork(&mut self, parent: SessionId) -> Result<SessionId>;

    /// Frees `session`; pages it shared stay with the other sessions. A batch reserved before
    /// is stale afterwards (it may name the freed session's pages).
    fn free(&mut self, session: SessionId) -> Result<()>;

    /// Shortens `session` to `len` tokens in every layer (docs/SPEC.md §6.1, "Truncate"): a
    /// rejected speculative draft, a step rolled back, or a session whose step failed after
    /// its reserve cut back to the rows its appends wrote. Pages past the end are released (a
    /// fork keeps what it shares). Where `len` falls inside a 64-token block, the block's
    /// quantization still holds the dropped tokens, so its `len mod 64` kept rows are read
    /// from their records, the session is cut to the block's start and they are appended
    /// again: the store is then the store of the first `len` keys bit for bit, as the CPU
    /// reference's [`crate::paged_ref::PagedStoreRef::truncate`] is. The session's row cache
    /// is emptied (its slots may hold dropped rows). Waits for the stream; a batch reserved
    /// before is stale afterwards.
    ///
    /// A cut to the session's own length does nothing. The kept rows are appended again as
    /// they are stored: a key whose channel block faulted at its first append (past fp16)
    /// faults again and is counted again.
    ///
    /// # Errors
    /// Refused before any change: a capture under way; an unknown or freed session; `len`
    /// past its length; rows below `len` that no append wrote, in a layer appends have
    /// written (truncate to the rows written instead); no free page for the re-append's
    /// copy-on-write of a page a fork shares; a device allocation for the kept rows. A driver
    /// failure while appending the kept rows again leaves the session cut to the block's
    /// start, and the error says so.
    fn truncate(&mut self, session: SessionId, len: usize) -> Result<()>;

    /// Whether [`crate::api::KvCache::reserve`] of `batch` would succeed now (sessions, lengths, free
    /// pages), changing nothing: a prompt reserved in chunks is checked whole first.
    ///
    /// # Errors
    /// What the reserve would return.
    fn check_reserve(&self, batch: &[(SessionId, usize)]) -> Result<()>;

    /// Grows every session of `batch = [(session, new_tokens)]` (all or nothing, each session
    /// at most once, at most `max_batch` sessions), performs the copy-on-write of shared
    /// partial pages in every layer's pool, and writes the device's tables and descriptors.
    /// Waits for the stream first. The returned batch is valid for this step's
    /// [`crate::api::KvCache::append`] calls, one per layer, until the next `reserve`.
    ///
    /// # Errors
    /// A batch of 0 or more than `max_batch` sessions, a session twice, unknown or freed, past
    /// `max_tokens`, not enough free pages; a session holding rows no append wrote (a step
    /// that failed after its reserve; [`crate::cache::StepLedger::check_grow`]). Nothing is
    /// changed.
    fn reserve(&mut self, batch: &[(SessionId, usize)]) -> Result<AppendBatch>;

    /// Appends one layer's K and V rows (device memory, `[rows][Hkv][D]`, batch order) to the
    /// sessions of `batch`, on the cache's stream, with no host synchronisation: the records
    /// of the new tokens, and every 64-token block they touch re-quantized.
    ///
    /// # Errors
    /// Checked before the launch ([`crate::cache::check_rows`]): a layer out of range, a stale batch, a
    /// row count that differs from the batch's, a null pointer; a batch other than the last
    /// reserve's, or a session whose earlier rows in `layer` no append wrote (a step that
    /// failed after its reserve: such a session is refused until it is freed;
    /// [`crate::cache::StepLedger`]).
    fn append(&mut self, batch: &AppendBatch, layer: usize, kv: &KvRows) -> Result<()>;

    /// [`crate::api::KvCache::append`] from host slices `[rows][Hkv][D]` f32 (a convenience for CPU
    /// callers and tests: the rows are checked, copied to a device staging buffer, then
    /// appended; the copy waits for the stream).
    ///
    /// # Errors
    /// As [`crate::api::KvCache::append`], and, before any copy, slices of the wrong length or a key
    /// or value that is not finite (named by token, head and channel).
    fn append_host(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<()>;

    /// Orders the cache's stream after everything queued so far on the caller's stream
    /// `external` (a raw `CUstream` of this device's context, as `torch.cuda.current_stream()
    /// .cuda_stream` gives; 0 is the legacy default stream): call it before appends and
    /// attends whose inputs the caller's stream produced. With [`crate::api::KvCache::signal`] after
    /// them, the cache's work runs as if on the caller's stream. No host synchronisation.
    ///
    /// # Safety
    /// `external` must be a live stream of the cache's CUDA context (or 0).
    ///
    /// # Errors
    /// A driver failure.
    unsafe fn follow(&self, external: u64) -> Result<()>;

    /// Makes the caller's stream `external` wait for everything queued so far on the cache's
    /// stream (the outputs of the appends and attends before it).
    ///
    /// # Safety
    /// As [`crate::api::KvCache::follow`].
    ///
    /// # Errors
    /// A driver failure.
    unsafe fn signal(&self, external: u64) -> Result<()>;

    /// Copies the last `min(len, cap)` K|V records of every session of `batch` (its length
    /// after this step's appends) from the pools to device memory as f32, on the cache's
    /// stream: session `b`'s `i`-th row lands at `[b][i][Hkv][D]` of `k_out` and `v_out`
    /// (each `batch.len() · cap · Hkv · D` f32), rows past its count are not written. This is
    /// how a model's dense prefill attention and its sliding-window layers read the cache
    /// (the values are the stored bf16, exactly).
    ///
    /// # Errors
    /// Checked before the launch: a layer out of range, a stale batch, `cap` of 0 or past the
    /// cache's `max_tokens`, a null pointer.
    fn read_rows(
        &self,
        batch: &AppendBatch,
        layer: usize,
        cap: usize,
        k_out: DeviceViewMut<'_>,
        v_out: DeviceViewMut<'_>,
    ) -> Result<()>;

    /// Waits for the stream, then one layer's K|V records of `session`,
    /// `[head][token][K | V]` bf16.
    fn records(&self, session: SessionId, layer: usize) -> Result<Vec<bf16>>;

    /// Waits for the stream, then one layer's store of `session` in `fathom-store`'s layout
    /// (what the tests compare with `KeyStore` bit for bit).
    fn export(&self, session: SessionId, layer: usize) -> Result<PagedExport>;

    /// Waits for the stream, then one layer's PCA index of `session` in `fathom-store`'s
    /// layout (what the tests compare with a `KeyStore` in the basis bit for bit).
    ///
    /// # Errors
    /// A cache without the PCA index, a layer or session that does not exist.
    fn export_pca(&self, session: SessionId, layer: usize) -> Result<PagedExport>;

    /// Waits for the stream, then the faults counted per layer since the cache was made
    /// (a channel block whose keys were not finite or whose maximum overflowed fp16 was not
    /// written).
    fn faults(&self) -> Result<Vec<u32>>;

    /// Loads one layer's calibration: per KV head σ² (Fathom's importance) and Double
    /// Sparsity's channels (`fathom_plan::calib::head_calib`'s `sigma2` and `ds_channels`),
    /// and, in a cache with the PCA index, the basis `loki` of every head (`[D][D]`, column j
    /// the j-th coordinate): from then on the layer's appends write the PCA index too.
    ///
    /// # Errors
    /// A layer out of range, a head count or σ² length that differs from the shape, a σ² that
    /// is negative or not finite; with the PCA index, a basis of the wrong size or not finite,
    /// or one that differs from the loaded one after the layer's first append (the index of the
    /// tokens already there would be in the old basis). Nothing is changed then.
    fn load_calibration(
        &mut self,
        layer: usize,
        heads: &[fathom_plan::scanner::HeadCalib],
    ) -> Result<()>;

    /// Makes the static depth table of `method` (Double Sparsity, Loki, thumb2, exact) for
    /// every layer; Fathom and SparQ plan on the GPU per query, landmark and Quest read their
    /// block tables, and need nothing.
    ///
    /// # Errors
    /// Double Sparsity before any layer's calibration is loaded; Loki in a cache without the
    /// PCA index, or with `r` of 0 or past D; landmark or Quest in a cache without the block
    /// tables.
    fn prepare(&mut self, method: crate::config::Method) -> Result<()>;

    /// Whether `method`'s static depth table is made and current ([`crate::api::KvCache::prepare`] has
    /// nothing to do): false for the methods that plan per query (their `prepare` only checks),
    /// and for Double Sparsity after a [`crate::api::KvCache::load_calibration`] dropped its table.
    fn is_prepared(&self, method: crate::config::Method) -> bool;

    /// Checks that `method` can attend layer `layer` (its static plan prepared, its
    /// calibration loaded) without launching anything: what [`crate::api::KvCache::attend`] checks
    /// first, for a caller that must refuse a step before it reserves or appends.
    ///
    /// # Errors
    /// A method that was not prepared, or a layer without the calibration it needs.
    fn check_method(&self, method: crate::cache::AttendMethod, layer: usize) -> Result<()>;

    /// One layer's attention for the sessions of `batch` (each at its last token), on the
    /// cache's stream with no host synchronisation: queries `q` `[batch][Hq][D]` give outputs
    /// `out` `[batch][Hq][D]` f32 (device pointers). Each query head attends exactly over its
    /// own sink + local + top-k set (docs/SPEC.md §5), or over every token for
    /// [`AttendMethod::Dense`]. Launch parameters are
    /// fixed-size structs; working memory was sized when the cache was made.
    ///
    /// # Errors
    /// Checked before any launch ([`crate::cache::check_attend`]): layer, stale batch, k past
    /// `max_k`, null pointers; a method that needs a calibration or a static plan not loaded.
    fn attend(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        method: AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &QueryRows<'_>,
        out: DeviceViewMut<'_>,
    ) -> Result<()>;

    /// One layer's selection without the attention: for each query head of the batch's
    /// sessions (each at its last token), the logical positions of its sink + local + top-k
    /// set chosen by `method` (docs/SPEC.md §5), written to `out` as i32 `[batch][Hq][cap]`,
    /// -1-padded, with each row's length (the contract of SGLang's `SparsityPolicy` and
    /// vLLM's sparse indexer). The plan, scan and top-k are those of
    /// [`crate::api::KvCache::attend`] with the same arguments, on the same stream; nothing is
    /// fetched. Within a row: the sink in order, the top-k winners in the order the top-k
    /// wrote them, then the local window in order (CPU twin
    /// [`crate::cache::select_out_row`]).
    ///
    /// # Errors
    /// Checked before any launch ([`crate::cache::check_select_out`]): those of `attend`,
    /// `dense` (which has no selection), outputs that are not i32, too short, or of a `cap`
    /// below `sink + local + k`.
    fn select(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        method: AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &QueryRows<'_>,
        out: crate::cache::SelectOut<'_>,
    ) -> Result<()>;

    /// [`crate::api::KvCache::attend`] from and to host slices (a convenience for CPU callers and tests):
    /// `q` is `[batch][Hq][D]` f32; returns the outputs `[batch][Hq][D]`. Waits for the stream.
    ///
    /// # Errors
    /// As [`crate::api::KvCache::attend`], and a `q` of the wrong length or with a non-finite value.
    fn attend_host(
        &mut self,
        batch: &AppendBatch,
        layer: usize,
        method: crate::cache::AttendMethod,
        params: &fathom_plan::SelectParams,
        q: &[f32],
    ) -> Result<Vec<f32>>;

    /// Captures one decode step into a CUDA graph: `step` is called once, on this cache, and
    /// must only [`crate::api::KvCache::append`] and [`crate::api::KvCache::attend`] (device pointers; the model's
    /// own kernels may run on the cache's stream (`PagedCache::stream` in the CUDA build) too) for `batch`, a decode batch (one
    /// token per session). While capturing, the scan's grid covers `max_tokens`, so the graph
    /// stays valid as the sessions grow. Replay it with [`crate::api::KvCache::replay`] after each
    /// [`crate::api::KvCache::reserve`] of the same sessions, with this step's K, V and queries written
    /// to the same device buffers.
    ///
    /// # Errors
    /// A batch that is not a decode batch; whatever `step` returns; a failed capture.
    fn capture(
        &mut self,
        batch: &AppendBatch,
        step: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<Self::Graph>;

    /// [`crate::api::KvCache::capture`] in two calls, for a caller whose step is not a closure over
    /// the cache (a model whose forward owns it): from here until [`crate::api::KvCache::end_capture`]
    /// everything queued on the cache's stream (`PagedCache::stream` in the CUDA build) is recorded, not run, and attends size
    /// their grids for `max_tokens`. Nothing in between may wait for the stream, and the
    /// calls that would change what the graph reads (a setting, a calibration, a `prepare`, a
    /// new session) are refused by name. The graph replays only on this cache, and only while
    /// its settings are those of the capture ([`crate::api::KvCache::check_graph`]).
    ///
    /// # Errors
    /// A batch that is not the current decode batch; a capture already under way; a driver
    /// failure (nothing is left capturing).
    fn begin_capture(&mut self, batch: &AppendBatch) -> Result<()>;

    /// [`crate::api::KvCache::begin_capture`] for a step the caller captures into its own graph
    /// (`torch.cuda.graph`, say) on a stream the cache follows: the cache's stream is not put
    /// into capture mode but joins the caller's capture through
    /// [`crate::api::KvCache::follow`] and [`crate::api::KvCache::signal`] around each call;
    /// grids are sized for `max_tokens` and the same calls are refused until
    /// [`crate::api::KvCache::end_capture`], whose graph then holds no kernels: before each
    /// replay of their own graph, after the reserve, the caller passes it to
    /// [`crate::api::KvCache::replay`] (the checks and the bookkeeping of the step) and orders
    /// its stream after the cache's ([`crate::api::KvCache::signal`]).
    ///
    /// # Errors
    /// As [`crate::api::KvCache::begin_capture`].
    fn begin_caller_capture(&mut self, batch: &AppendBatch) -> Result<()>;

    /// Ends the capture [`crate::api::KvCache::begin_capture`] started and instantiates the graph.
    ///
    /// # Errors
    /// No capture under way; a failed capture (a launch that may not be captured, a wait for
    /// the stream in between) or nothing captured.
    fn end_capture(&mut self) -> Result<Self::Graph>;

    /// Replays a captured decode step for `batch`, the current reserve of the same sessions
    /// (one token each), on the cache's stream. For a graph of the caller's own capture
    /// ([`crate::api::KvCache::begin_caller_capture`]) it launches nothing: it checks and
    /// records the step, and the caller then replays its graph.
    ///
    /// # Errors
    /// A stale batch, or one whose sessions or token counts differ from the captured one's; a
    /// graph captured before a setting changed (it would run the old step); a session whose
    /// earlier rows no append wrote in a layer the graph appends.
    fn replay(&mut self, batch: &AppendBatch, graph: &Self::Graph) -> Result<()>;

    /// Whether `graph` may still be replayed on this cache: refused when a setting changed
    /// since its capture (its kernels were recorded with other settings, and buffers it reads,
    /// such as the host gather's or a replaced calibration's, may be freed). A caller that
    /// reserves before [`crate::api::KvCache::replay`] checks this first, so a stale graph changes
    /// nothing.
    ///
    /// # Errors
    /// The stale graph.
    fn check_graph(&self, graph: &Self::Graph) -> Result<()>;

    /// Empties the HBM row cache of `session` (on the stream): its next attends fetch every
    /// row over the link again. A no-op without a row cache.
    ///
    /// # Errors
    /// An unknown or freed session.
    fn reset_row_cache(&self, session: SessionId) -> Result<()>;

    /// Waits for the stream, then the union rows fetched and how many of them the HBM row
    /// cache served, summed over every attend since the cache was made.
    fn row_counters(&self) -> Result<RowCounters>;

    /// Waits for the stream, then how the query-head rows of every attend since the cache was
    /// made took their top-k: by the filtered select, or by falling back to the score path
    /// after their filter failed.
    fn select_counters(&self) -> Result<SelectCounters>;

    /// Waits for the stream, then the mean plan bits per (session, KV head) of every
    /// GPU-planned attend (Fathom, SparQ) since the cache was made, and how many plans that is.
    fn plan_bits(&self) -> Result<(f64, u64)>;

    /// The stage times of the attends since the last call (or since the cache was made), and
    /// a fresh start for the next: waits for the cache's stream, then reads each pair of
    /// consecutive marks of an attend.
    ///
    /// # Errors
    /// A driver failure waiting for the stream or reading an event.
    fn stage_times(&mut self) -> Result<AttendStages>;

    /// What the host gather served since it was set, with the device's fault counts: listed
    /// records past the list's capacity and chunks whose marks did not come within 2 s (both
    /// 0 in a correct run; a nonzero count means those rows are wrong). `None` when off.
    ///
    /// # Errors
    /// A driver failure reading the device counters (waits for the stream).
    fn host_gather_stats(&self) -> Result<Option<crate::host_gather::HostGatherReport>>;

    /// Bytes of HBM the page pools take (every layer's): the whole pools in HBM residency,
    /// the index in the split residency, 0 in host residency; the PCA index's and the block
    /// tables' where they are in HBM.
    fn pool_hbm_bytes(&self) -> u64;

    /// After an attend (waits for the stream): session `b`'s depths `[Hkv][D]` (of the last
    /// planned method), scores `[Hkv][G][n]` and each query head's winners, sorted. For tests
    /// and debugging; the step itself never reads back.
    fn debug_readback(&self, batch: &AppendBatch, b: usize) -> Result<AttendDebug>;
}
