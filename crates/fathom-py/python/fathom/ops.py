"""Fathom's paged cache as torch ops, in the shape sparse-attention engines consume.

    import torch, fathom.gpu as fg, fathom.ops as fo
    cache = fo.OpsCache(fg.GpuCache(layers=36, kv_heads=8, group=4, dim=128,
                                    max_sessions=8, max_tokens=131072))
    a = cache.create()                                       # an int session id
    sessions = torch.tensor([a] * n, dtype=torch.int32)      # per row: its session ...
    positions = torch.arange(n, dtype=torch.int32)           # ... and its logical position
    torch.ops.fathom.append(cache.handle, layer, k, v, sessions, positions)   # k, v [n, Hkv, D]
    idx, lens = torch.ops.fathom.select(cache.handle, q, layer, sess, seq_lens, "fathom:48", 256)
    out = torch.ops.fathom.attend(cache.handle, q, layer, sess, "fathom:48", 256)

The three ops (registered with ``torch.library`` when this module is imported):

- ``fathom::append(Tensor(a!) cache, int layer, Tensor k, Tensor v, Tensor sessions,
  Tensor positions) -> ()``: ``k``, ``v`` ``[rows, Hkv, D]`` (CUDA; float32, float16 or
  bfloat16) after RoPE and any QK-norm; ``sessions`` and ``positions`` ``[rows]`` (CPU
  integer tensors: the host plans the pages) give each row's session and logical position.
  A session's rows are adjacent and its positions run on from its length. The first call of
  a step (rows that start at the sessions' lengths) reserves them; the other layers of the
  step pass the same ``sessions`` and ``positions``.
- ``fathom::select(Tensor cache, Tensor q, int layer, Tensor sessions, Tensor seq_lens, str
  method, int k, int sink=4, int local=32) -> (Tensor, Tensor)``: ``q`` ``[bs, Hq, D]`` (each
  session's last token); returns ``indices`` int32 ``[bs, Hq, sink + local + k]``, the logical
  positions each query head attends (sink, top-k, local window), -1 past ``valid_lengths``
  int32 ``[bs, Hq]``. ``sessions`` and ``seq_lens`` ``[bs]`` (CPU): the step's sessions in
  order and their lengths after its append.
- ``fathom::attend(Tensor cache, Tensor q, int layer, Tensor sessions, str method, int k,
  int sink=4, int local=32) -> Tensor``: the attention over that set (every token for
  ``"dense"``), ``[bs, Hq, D]`` in ``q``'s dtype.

They run on the current stream, never read a CUDA tensor on the host (no ``.item()``), have
fixed-capacity outputs, and have fake implementations, so ``torch.compile`` traces them and
``torch.cuda.graphs`` captures them (:meth:`OpsCache.capture`). The cache argument is the
handle tensor of an :class:`OpsCache` (CPU int64 ``[1]``): ``append`` declares it mutated,
so a compiled graph keeps each append before the selects and attends that read it.

A bad argument (dtype, device, shape, an unknown session, a position that does not continue
its session, a capacity past the cache's) raises ``ValueError`` naming it before any launch;
the cache stays usable.

Mapping onto the engines (their own names):

- SGLang's ``SparsityPolicy`` (``mem_cache/sparsity``): its ``select`` / ``retrieve_topk``
  receives ``queries [bs, Hq, D]``, the ``layer_id``, the ``req_pool_indices`` and
  ``seq_lens`` of the batch; ``fathom::select`` takes the same with ``sessions`` for the
  request pool indices, and returns the fixed-capacity int32 indices (-1 padded) and the
  valid lengths the policy hands to its sparse attention backend.
- vLLM's sparse indexer (``sparse_attn_indexer``): it writes ``topk_indices_buffer``
  ``[num_tokens, topk]`` int32, -1 padded, from ``q``, the layer's index cache, the
  ``positions`` and the block tables; ``fathom::select`` writes per query head, and its
  capacity is ``sink + local + k``. ``fathom::append`` takes the per-token ``positions``
  and, for the slot mapping, the per-token ``sessions`` (the paged layout stays inside the
  cache).
"""

from __future__ import annotations

import itertools
import weakref
from typing import List, Optional, Sequence, Tuple

import torch

from . import gpu as fg

_CACHES: "weakref.WeakValueDictionary[int, OpsCache]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def _ints(name: str, t, rows: Optional[int] = None) -> List[int]:
    """A CPU integer tensor ``[rows]`` as a list, or ``ValueError`` naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: want a CPU integer tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: must be a CPU tensor (the cache plans on the host; reading "
                         f"a {t.device.type} tensor there would synchronise), got {t.device}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: dtype {t.dtype}, want torch.int32 or torch.int64")
    if t.dim() != 1 or (rows is not None and t.shape[0] != rows):
        want = f"[{rows}]" if rows is not None else "one dimension"
        raise ValueError(f"{name}: shape {list(t.shape)}, want {want}")
    return t.tolist()


def plan_rows(sessions, positions, rows: int) -> List[Tuple[int, int, int]]:
    """The runs ``[(session, first position, rows)]`` of an append's per-row ``sessions`` and
    ``positions`` (CPU integer tensors ``[rows]``): each session's rows adjacent, its
    positions consecutive. ``ValueError`` naming the argument otherwise."""
    s = _ints("sessions", sessions, rows)
    p = _ints("positions", positions, rows)
    if rows == 0:
        raise ValueError("k: no rows to append")
    runs: List[Tuple[int, int, int]] = []
    for i, (si, pi) in enumerate(zip(s, p)):
        if runs and runs[-1][0] == si:
            sid, p0, m = runs[-1]
            if pi != p0 + m:
                raise ValueError(f"positions: row {i} of session {si} is at {pi}, want {p0 + m} "
                                 "(a session's positions run on)")
            runs[-1] = (sid, p0, m + 1)
        else:
            if any(r[0] == si for r in runs):
                raise ValueError(f"sessions: session {si}'s rows are not adjacent (row {i})")
            if pi < 0:
                raise ValueError(f"positions: row {i} is at {pi}")
            runs.append((si, pi, 1))
    return runs


def _cache(handle) -> "OpsCache":
    """The :class:`OpsCache` of a handle tensor."""
    if not isinstance(handle, torch.Tensor) or handle.device.type != "cpu" \
            or handle.dtype != torch.int64 or handle.numel() != 1:
        raise ValueError("cache: want an OpsCache's handle (a CPU int64 tensor of one element)")
    c = _CACHES.get(int(handle.reshape(()).item()))
    if c is None:
        raise ValueError("cache: no live OpsCache has this handle")
    return c


class OpsCache:
    """A :class:`fathom.gpu.GpuCache` the ops address by :attr:`handle`, with integer session
    ids (what ``sessions`` tensors hold) and the step the ops are in."""

    def __init__(self, cache: fg.GpuCache):
        if not isinstance(cache, fg.GpuCache):
            raise ValueError(f"cache: want a fathom.gpu.GpuCache, got {type(cache).__name__}")
        self.cache = cache
        self._id = next(_IDS)
        self.handle = torch.tensor([self._id], dtype=torch.int64)
        self._sessions: dict = {}
        self._next = itertools.count(0)
        self._batch = None
        self._runs: Optional[List[Tuple[int, int, int]]] = None
        _CACHES[self._id] = self

    def create(self) -> int:
        """A new, empty session; its id."""
        sid = next(self._next)
        self._sessions[sid] = self.cache.create()
        return sid

    def free(self, sid: int) -> None:
        """Frees session ``sid``."""
        self.cache.free(self._session(sid))
        del self._sessions[sid]
        self._batch, self._runs = None, None

    def truncate(self, sid: int, length: int) -> None:
        """Shortens session ``sid`` to its first ``length`` tokens (a rejected draft, a
        rolled-back step); the next append reserves anew."""
        self.cache.truncate(self._session(sid), length)
        self._batch, self._runs = None, None

    def len(self, sid: int) -> int:
        """Tokens in session ``sid``."""
        return self.cache.len(self._session(sid))

    def _session(self, sid: int):
        try:
            return self._sessions[int(sid)]
        except KeyError:
            raise ValueError(f"sessions: no session {sid} in this cache") from None

    def step(self, runs: Sequence[Tuple[int, int, int]], follow: bool = False):
        """Reserves a step's rows ``[(session, first position, rows)]`` (each starting at the
        session's length), or returns the current batch when these are its runs."""
        runs = list(runs)
        if runs == self._runs and self._batch is not None:
            return self._batch
        for sid, p0, _ in runs:
            n = self.len(sid)
            if p0 != n:
                raise ValueError(f"positions: session {sid} holds {n} tokens; its rows start at "
                                 f"{p0} (appends continue a session, and every layer of a step "
                                 "passes the same rows)")
        self._batch = self.cache.reserve([(self._session(s), m) for s, _, m in runs],
                                         follow=follow)
        self._runs = runs
        return self._batch

    def decode_step(self, sids: Sequence[int], follow: bool = False):
        """Reserves one token for each session of ``sids`` (a decode step)."""
        return self.step([(s, self.len(s), 1) for s in sids], follow=follow)

    def batch_for(self, sessions, seq_lens=None):
        """The current batch, checked against the ``sessions`` (and their ``seq_lens``) an op
        was given: the step's sessions in order, each at its length."""
        s = _ints("sessions", sessions)
        if self._runs is None or [r[0] for r in self._runs] != s:
            raise ValueError(f"sessions: {s} are not the current step's sessions "
                             f"{[r[0] for r in self._runs or []]} (append the step first)")
        if seq_lens is not None:
            n = _ints("seq_lens", seq_lens, len(s))
            want = [p0 + m for _, p0, m in self._runs]
            if n != want:
                raise ValueError(f"seq_lens: {n}, the sessions hold {want} after this step")
        return self._batch

    def capture(self, graph: "torch.cuda.CUDAGraph", step, sids: Sequence[int],
                methods: Sequence[str] = ()):
        """Captures ``step()`` (a decode step that calls the ops for ``sids``, one token each,
        with ``methods``) into ``graph``; returns ``(token, step's outputs)``, the token
        :meth:`replay` takes. Reserves the step first; nothing of it runs until a replay."""
        for m in methods:
            self.cache.prepare(m)
        batch = self.decode_step(sids, follow=True)
        self.cache.begin_caller_capture(batch)
        try:
            with torch.cuda.graph(graph):
                out = step()
        finally:
            token = self.cache.end_capture()
        self._captured = batch
        return token, out

    def replay(self, graph: "torch.cuda.CUDAGraph", token, sids: Sequence[int]) -> None:
        """Runs the captured step: first for the step reserved at the capture, then each call
        for one more decode step of ``sids``, reserved after the work queued on the current
        stream; checked against the capture, then replayed."""
        batch = getattr(self, "_captured", None)
        self._captured = None
        if batch is None or batch is not self._batch:
            batch = self.decode_step(sids, follow=True)
        self.cache.replay(batch, token)
        graph.replay()


def _append(cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
            sessions: torch.Tensor, positions: torch.Tensor) -> None:
    c = _cache(cache)
    if not isinstance(k, torch.Tensor) or k.dim() != 3:
        raise ValueError(f"k: want a [rows, Hkv, D] tensor, got shape {list(getattr(k, 'shape', []))}")
    runs = plan_rows(sessions, positions, k.shape[0])
    for sid, _, _ in runs:
        c._session(sid)
    batch = c.step(runs)
    c.cache.append(batch, layer, k, v)


def _select(cache: torch.Tensor, q: torch.Tensor, layer: int, sessions: torch.Tensor,
            seq_lens: torch.Tensor, method: str, k: int, sink: int = 4,
            local: int = 32) -> Tuple[torch.Tensor, torch.Tensor]:
    c = _cache(cache)
    batch = c.batch_for(sessions, seq_lens)
    if q.dim() != 3:
        raise ValueError(f"q: shape {list(q.shape)}, want [bs, Hq, D]")
    bs, hq = len(batch), q.shape[1]
    cap = int(sink) + int(local) + int(k)
    idx = torch.empty((bs, hq, cap), dtype=torch.int32, device=q.device)
    lens = torch.empty((bs, hq), dtype=torch.int32, device=q.device)
    c.cache.select(batch, layer, method, q, idx, lens, k=k, sink=sink, local=local)
    return idx, lens


def _attend(cache: torch.Tensor, q: torch.Tensor, layer: int, sessions: torch.Tensor,
            method: str, k: int, sink: int = 4, local: int = 32) -> torch.Tensor:
    c = _cache(cache)
    batch = c.batch_for(sessions)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    c.cache.attend(batch, layer, method, q, out, k=k, sink=sink, local=local)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


append = torch.library.custom_op("fathom::append", _append, mutates_args=("cache",))
select = torch.library.custom_op("fathom::select", _select, mutates_args=())
attend = torch.library.custom_op("fathom::attend", _attend, mutates_args=())


@append.register_fake
def _append_fake(cache, layer, k, v, sessions, positions):
    return None


@select.register_fake
def _select_fake(cache, q, layer, sessions, seq_lens, method, k, sink=4, local=32):
    cap = int(sink) + int(local) + int(k)
    return (q.new_empty((q.shape[0], q.shape[1], cap), dtype=torch.int32),
            q.new_empty((q.shape[0], q.shape[1]), dtype=torch.int32))


@attend.register_fake
def _attend_fake(cache, q, layer, sessions, method, k, sink=4, local=32):
    return torch.empty_like(q)
