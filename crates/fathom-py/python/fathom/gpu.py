"""Fathom's offloaded paged KV cache on torch CUDA tensors (docs/SPEC.md §6.1), zero-copy.

Tensors cross by DLPack (``__dlpack__``): any CUDA tensor of a DLPack producer works; nothing
is copied. Every call runs on the stream you pass, by default
``torch.cuda.current_stream()``: the cache's work waits for what that stream queued before the
call, and the stream waits for the cache's work after it (events, no host synchronisation).
A shape, dtype, device or contiguity mismatch raises ``ValueError`` naming the argument, and
nothing is launched.

>>> import torch, fathom.gpu as fg                                    # doctest: +SKIP
>>> cache = fg.GpuCache(layers=2, kv_heads=2, group=4, dim=128,
...                     max_sessions=4, max_tokens=8192)
>>> s = cache.create()
>>> b = cache.reserve([(s, 100)])                   # a 100-token prefill chunk
>>> k = torch.randn(100, 2, 128, device="cuda", dtype=torch.bfloat16)
>>> for layer in range(2):
...     cache.append(b, layer, k, k)               # K and V after RoPE / QK-norm
>>> b = cache.reserve([(s, 1)])                     # one decode token
>>> for layer in range(2):
...     cache.append(b, layer, k[:1], k[:1])
>>> q = torch.randn(1, 8, 128, device="cuda")
>>> out = torch.empty(1, 8, 128, device="cuda")
>>> cache.attend(b, 0, "dense", q, out)             # or "exact", "sparq:32", "fathom:48" (load_sigma2)
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from . import _count, _fathom

Session = _fathom.Session
Batch = _fathom.Batch


def _stream(stream) -> int:
    """A raw CUstream handle: an int, a ``torch.cuda.Stream``, or None for torch's current."""
    if isinstance(stream, int):
        return stream
    if stream is None:
        import torch  # the GPU API is for torch users; imported only when used

        stream = torch.cuda.current_stream()
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        raise ValueError(f"stream: {stream!r} is not a CUDA stream (or a raw handle)")
    return int(handle)


class GpuCache:
    """The paged cache of one model shape (``layers``, ``kv_heads``, ``group`` query heads per
    KV head, head ``dim``) for up to ``max_sessions`` sessions of ``max_tokens`` tokens, its
    pages in pinned host memory (``residency="host"``, read over PCIe), in HBM (``"hbm"``), or
    split (``"index-hbm"``: the bit planes and scales in HBM, the K|V records in host memory, so
    only the fetched rows cross the link). ``pca_index=True`` keeps the second index that
    ``loki:R`` scans (its basis, the calibration's ``loki``, is loaded before a layer's first
    append); ``block_tables=True`` keeps the tables ``landmark`` and ``quest`` read.

    How attends run is fixed here too; every setting gives the same outputs (docs/SPEC.md
    §6.1):

    - ``select_path``: ``"scores"`` (the default: the scan writes every score), ``"N"`` (the
      filtered select from N middle tokens: only the tokens above an estimate of the k-th
      score are kept, a failed row rescans) or ``"N+scores"`` (filtered, scores kept for
      failed rows); measured on the H200, neither filtered setting is faster than ``"scores"``;
    - ``attend_groups``: head groups per attend (1 to ``kv_heads``): the cache's stream scans
      group i + 1 while a second stream runs group i's top-k, union, row fetch and attention;
    - ``scan_vector_words``: plane words per global load of the scan, 1 (8 bytes) or 2;
    - ``host_gather``: CPU threads that copy the row fetch's missed K|V records into pinned
      staging the GPU reads in order (0, the default: the GPU reads each record itself), and
      ``host_gather_share``, the percent of the misses they bring (1 to 100) while the fetch
      reads the rest; on the lent H200 host 14 threads at 50 % make the 1M step 5 % shorter;
    - ``stage_timing``: one CUDA event after each stage of every attend, read by
      :meth:`stage_times` (attends inside a CUDA graph capture or with head groups are
      counted as untimed)."""

    def __init__(self, layers: int, kv_heads: int, group: int, dim: int, max_sessions: int,
                 max_tokens: int, pages: Optional[int] = None, page_tokens: int = 2048,
                 max_batch: Optional[int] = None, max_k: int = 512, row_cache: int = 0,
                 residency: str = "host", device: int = 0, pca_index: bool = False,
                 block_tables: bool = False, select_path: str = "scores",
                 attend_groups: int = 1, scan_vector_words: int = 1, host_gather: int = 0,
                 host_gather_share: int = 100, stage_timing: bool = False):
        n = {name: _count(x, name) for name, x in [
            ("layers", layers), ("kv_heads", kv_heads), ("group", group), ("dim", dim),
            ("max_sessions", max_sessions), ("max_tokens", max_tokens),
            ("page_tokens", page_tokens), ("max_k", max_k), ("row_cache", row_cache),
            ("device", device), ("attend_groups", attend_groups),
            ("scan_vector_words", scan_vector_words), ("host_gather", host_gather),
            ("host_gather_share", host_gather_share)]}
        self._c = _fathom.GpuCache(
            n["layers"], n["kv_heads"], n["group"], n["dim"], n["max_sessions"],
            n["max_tokens"], None if pages is None else _count(pages, "pages"),
            n["page_tokens"], None if max_batch is None else _count(max_batch, "max_batch"),
            n["max_k"], n["row_cache"], residency, n["device"], pca_index, block_tables,
            str(select_path), n["attend_groups"], n["scan_vector_words"], n["host_gather"],
            n["host_gather_share"], bool(stage_timing))

    def create(self) -> Session:
        """A new, empty session."""
        return self._c.create()

    def fork(self, parent: Session) -> Session:
        """A session sharing every token of ``parent`` (copy-on-write pages)."""
        return self._c.fork(parent)

    def free(self, session: Session) -> None:
        """Frees a session (pages it shares stay with the others)."""
        self._c.free(session)

    def len(self, session: Session) -> int:
        """Tokens in a session."""
        return self._c.len(session)

    def truncate(self, session: Session, length: int) -> None:
        """Shortens a session to its first ``length`` tokens in every layer: a rejected
        speculative draft, a rolled-back step, or a session whose step failed after its
        reserve cut back to the rows its appends wrote. The store is then exactly the store of
        the kept keys (a block the cut falls inside is re-quantized from their records), pages
        past the end are released (a fork keeps what it shares), and the session's row cache
        is emptied. A batch reserved before is stale afterwards."""
        self._c.truncate(session, _count(length, "length"))

    def reserve(self, batch: Sequence[Tuple[Session, int]], stream=None,
                follow: bool = False) -> Batch:
        """Grows a ragged batch ``[(session, new_tokens)]`` (all or nothing); valid for this
        step's appends and attends until the next reserve, fork or free. Append every layer
        the cache attends in each step: a session whose step failed between its reserve and
        an append holds rows no append wrote, and is refused by name (by reserves, appends and
        attends of that layer) until it is freed. ``stream`` then waits for the batch's
        descriptors; with ``follow`` the reserve first waits for the work queued on
        ``stream`` (needed before replaying a graph of your own: see :meth:`replay`)."""
        return self._c.reserve([(s, _count(m, "new_tokens")) for s, m in batch],
                               _stream(stream), bool(follow))

    def read_rows(self, batch: Batch, layer: int, cap: int, k_out, v_out, stream=None) -> None:
        """The last ``min(len, cap)`` K|V records of every session of ``batch`` (after this
        step's appends) into ``k_out`` and ``v_out`` ``[len(batch), cap, kv_heads, dim]``
        (float32 CUDA tensors; rows past a session's count are left as they were): the
        stored bf16 values exactly. How a dense prefill reads back what the cache holds."""
        self._c.read_rows(batch, _count(layer, "layer"), _count(cap, "cap"), k_out, v_out,
                          _stream(stream))

    def select(self, batch: Batch, layer: int, method: str, q, indices, lengths, stream=None,
               k: int = 256, sink: int = 4, local: int = 32) -> None:
        """One layer's selection without the attention (docs/SPEC.md §5): for each query head
        of ``q`` ``[len(batch), kv_heads·group, dim]``, the logical positions of its sink,
        its top-k by ``method`` and its local window into ``indices`` ``[len(batch), Hq,
        cap]`` (int32, -1 past the row's length; ``cap ≥ sink + local + k``) and the row's
        length into ``lengths`` ``[len(batch), Hq]`` (int32). Exactly the set
        :meth:`attend` with the same arguments attends; ``dense`` has none."""
        self._c.select(batch, _count(layer, "layer"), method, q, indices, lengths,
                       _stream(stream), _count(k, "k"), _count(sink, "sink"),
                       _count(local, "local"))

    def prepare(self, method: str) -> None:
        """Prepares ``method``'s static plan (done by the first attend otherwise): call it
        before capturing a step that uses the method, since a capture refuses it."""
        self._c.prepare(method)

    def begin_caller_capture(self, batch: Batch) -> None:
        """Before capturing a decode step that calls this cache into your own graph
        (``torch.cuda.graph``): the attends' grids then cover ``max_tokens``, so the graph
        stays valid as the sessions grow, and calls that would change what it reads are
        refused until :meth:`end_capture`."""
        self._c.begin_caller_capture(batch)

    def end_capture(self):
        """Ends the capture; returns the token :meth:`replay` checks."""
        return self._c.end_capture()

    def replay(self, batch: Batch, graph, stream=None) -> None:
        """Right before each replay of your graph on ``stream``: checks that ``batch`` (from
        ``reserve(..., follow=True)``) is the decode batch of the captured sessions and
        records the step's appends; ``stream`` then waits for the cache's work."""
        self._c.replay(batch, graph, _stream(stream))

    def load_sigma2(self, layer: int, sigma2) -> None:
        """One layer's channel variances ``[kv_heads, dim]`` (numpy float32), for ``fathom:B``."""
        import numpy as np

        self._c.load_sigma2(_count(layer, "layer"),
                            np.ascontiguousarray(sigma2, dtype=np.float32))

    def load_calibration(self, path) -> None:
        """Loads ``fathom calibrate``'s JSON: σ² (``fathom:B``) and Double Sparsity's channels
        of every calibrated layer."""
        import os

        self._c.load_calibration(os.fspath(path))

    def plan_bits(self) -> Tuple[float, int]:
        """``(mean plan bits per token and KV head, plans)`` of the GPU-planned attends so far."""
        return self._c.plan_bits()

    def row_counters(self) -> dict:
        """``{"rows": union rows fetched, "hits": rows the HBM row cache served, "hit_rate":
        hits / rows}`` over every attend so far (0 hits without ``row_cache``; docs/SPEC.md
        §6.1, "Row cache"). Waits for the cache's stream."""
        rows, hits = self._c.row_counters()
        return {"rows": rows, "hits": hits, "hit_rate": hits / rows if rows else 0.0}

    @property
    def select_path(self) -> str:
        """The select setting's label."""
        return self._c.select_path

    @property
    def attend_groups(self) -> int:
        """Head groups per attend."""
        return self._c.attend_groups

    @property
    def scan_vector_words(self) -> int:
        """Plane words per scan load."""
        return self._c.scan_vector_words

    @property
    def host_gather(self) -> int:
        """The host gather's threads (0 when off)."""
        return self._c.host_gather

    @property
    def host_gather_share(self) -> int:
        """The host-gather share, in percent."""
        return self._c.host_gather_share

    STAGES = ("plan", "scan", "topk", "union", "fetch", "attention")

    @property
    def stage_timing(self) -> bool:
        """Whether attends are split by stage."""
        return self._c.stage_timing

    def stage_times(self) -> dict:
        """The attends' GPU time by stage since the last call, and a fresh start: ``{"attends":
        n, "untimed": m, "plan": ms, "scan": ms, "topk": ms, "union": ms, "fetch": ms,
        "attention": ms}``. Waits for the cache's stream."""
        attends, untimed, ms = self._c.stage_times()
        return {"attends": attends, "untimed": untimed, **dict(zip(self.STAGES, ms))}

    def append(self, batch: Batch, layer: int, k, v, stream=None) -> None:
        """Appends one layer's K and V ``[batch.rows, kv_heads, dim]`` (float32, float16 or
        bfloat16 CUDA tensors) to the batch's sessions: quantized and packed on the GPU (bit
        for bit the CPU store of the same bf16 keys) and written as bf16 records."""
        self._c.append(batch, _count(layer, "layer"), k, v, _stream(stream))

    def attend(self, batch: Batch, layer: int, method: str, q, out, stream=None, k: int = 256,
               sink: int = 4, local: int = 32) -> None:
        """One layer's attention for the batch's sessions (each at its last token): queries
        ``q`` ``[len(batch), kv_heads·group, dim]`` into ``out`` (float32, same shape, written
        in place). Each query head attends exactly over its own sink + local + top-k set
        (docs/SPEC.md §5) chosen by ``method``, or over every token for ``"dense"``."""
        self._c.attend(batch, _count(layer, "layer"), method, q, out, _stream(stream),
                       _count(k, "k"), _count(sink, "sink"), _count(local, "local"))


def dlpack_info(tensor) -> dict:
    """What DLPack says about ``tensor``: device type (1 CPU, 2 CUDA), device id, dtype,
    shape and whether it is contiguous."""
    return _fathom.dlpack_info(tensor)
