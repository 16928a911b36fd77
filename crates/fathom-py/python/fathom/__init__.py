"""Fathom on numpy arrays: bit-plane key stores, water-filled scan plans, SPEC §8 captures
and the attention-fidelity harness (docs/SPEC.md in the repository).

>>> import numpy as np, fathom
>>> keys = np.random.default_rng(0).standard_normal((300, 2, 64)).astype(np.float32)
>>> store = fathom.KeyStore.from_keys(keys)          # [N, Hkv, D], 4 bit planes per channel
>>> k2 = store.dequant_prefix(2)                     # every key at its first 2 planes
>>> w = fathom.importance(keys[:4, 0], np.ones(64, np.float32))
>>> depths, bits = fathom.water_fill(w, 48.0)        # a 48-bit scan plan
>>> bits <= 48.0
True

Arrays may be any real dtype (bool, integer or floating point) and layout: they are
converted to C-ordered float32 first (except for :class:`Decoder`, the per-step decode API,
which takes float32 C-ordered arrays as they are, so that no step copies silently; any other
dtype is a ``ValueError``). Complex, string or object arrays, values that are not finite,
shapes that do not fit, and counts that are negative or not integers raise ``ValueError``
naming the argument; the library's own errors (files, formats, method items, budgets) raise
``fathom.FathomError`` (a ``ValueError``) with the library's message.

The offloaded paged KV cache on torch CUDA tensors (DLPack, zero-copy, on the caller's
stream) is :mod:`fathom.gpu` (``fathom.gpu.GpuCache``).
"""

from __future__ import annotations

import json
import operator
import os
from typing import Mapping, Optional, Sequence

import numpy as np

from . import _fathom
from ._fathom import Decoder, FathomError

__all__ = [
    "Decoder",
    "FathomError",
    "KeyStore",
    "importance",
    "water_fill",
    "write_capture",
    "read_capture",
    "calibrate",
    "fidelity",
    "__version__",
]

__version__ = _fathom.version()


def _f32(x, name: str) -> np.ndarray:
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: not a real array ({e})") from None
    if a.dtype.kind not in "biuf":
        why = " (complex: its imaginary part would be dropped)" if a.dtype.kind == "c" else ""
        raise ValueError(f"{name}: dtype {a.dtype} is not real numbers{why}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _count(x, name: str) -> int:
    """A non-negative integer argument (``operator.index``: Python and numpy integers), or a
    ``ValueError`` naming it."""
    try:
        v = operator.index(x)
    except TypeError:
        raise ValueError(f"{name}: {x!r} is not an integer") from None
    if v < 0:
        raise ValueError(f"{name}: {v} is negative")
    if v >= 2**63:
        raise ValueError(f"{name}: {v} is too large")
    return v


def _nd(x, ndim: int, name: str) -> np.ndarray:
    a = _f32(x, name)
    if a.ndim != ndim:
        raise ValueError(f"{name}: {a.ndim} dimensions, want {ndim} (shape {a.shape})")
    return a


class KeyStore:
    """A 4-bit bit-plane key store (docs/SPEC.md §2): keys ``[N, Hkv, D]`` quantized per
    64-token block and channel. Reading the first ``t`` planes of a channel is exactly its
    t-bit quantizer."""

    __slots__ = ("_h",)

    def __init__(self, handle):
        self._h = handle

    @classmethod
    def from_keys(cls, keys, capacity: Optional[int] = None) -> "KeyStore":
        """Quantizes ``keys`` ``[N, Hkv, D]`` into a new store with room for ``capacity``
        tokens (at least N) before an :meth:`append` has to move the stored words. A capacity
        past 2^40 tokens, or whose store would not fit in this machine's memory, is a
        ``ValueError``."""
        return cls(_fathom.KeyStoreHandle.from_keys(
            _nd(keys, 3, "keys"), None if capacity is None else _count(capacity, "capacity")))

    @classmethod
    def load(cls, path: os.PathLike | str) -> "KeyStore":
        """Loads a store written by :meth:`save`."""
        return cls(_fathom.KeyStoreHandle.load(os.fspath(path)))

    def append(self, keys) -> None:
        """Appends ``keys`` ``[M, Hkv, D]`` (the partial last block is re-quantized)."""
        self._h.append(_nd(keys, 3, "keys"))

    def save(self, path: os.PathLike | str) -> None:
        """Writes the store atomically."""
        self._h.save(os.fspath(path))

    def dequant_prefix(self, t: int) -> np.ndarray:
        """Every key at the first ``t`` planes (0..=4) of every channel, ``[N, Hkv, D]``."""
        return self._h.dequant_prefix(_count(t, "t"))

    @property
    def tokens(self) -> int:
        return self._h.tokens

    @property
    def heads(self) -> int:
        return self._h.heads

    @property
    def dim(self) -> int:
        return self._h.dim

    def __len__(self) -> int:
        return self.tokens

    def __repr__(self) -> str:
        return f"KeyStore(tokens={self.tokens}, heads={self.heads}, dim={self.dim})"


def importance(queries, sigma2) -> np.ndarray:
    """Channel importance of a query group, ``w_c = σ²_c Σ_g q_gc²`` (docs/SPEC.md §3):
    ``queries [G, D]``, ``sigma2 [D]``."""
    return _fathom.importance(_nd(queries, 2, "queries"), _nd(sigma2, 1, "sigma2"))


def water_fill(importance, budget: float) -> tuple[np.ndarray, float]:
    """Reverse water-filling (docs/SPEC.md §3): ``(depths, bits)``, the planes (0–4) read of
    each channel minimising ``Σ w_c 4^(−t_c)`` within ``budget`` bits per token, and the bits
    the plan spends (``Σ t_c + 0.25·active``)."""
    return _fathom.water_fill(_nd(importance, 1, "importance"), float(budget))


def write_capture(
    path: os.PathLike | str,
    layers: Mapping[int, Mapping[str, object]],
    positions: Sequence[int],
    model: str,
    *,
    qk_norm: bool = False,
    softcap: Optional[float] = None,
    layer_kinds: Optional[Sequence[str]] = None,
    dtype: str = "bf16",
    metadata: Optional[Mapping[str, str]] = None,
) -> None:
    """Writes a docs/SPEC.md §8 capture atomically.

    ``layers`` maps a layer index to ``{"q": [P, Hq, D], "k": [N, Hkv, D], "v": [N, Hkv, D]}``
    and optionally ``"o": [P, Hq, D]`` (the model's own attention output, post-RoPE and
    QK-norm inputs); ``positions[p]`` is the position of query row ``p`` (it attends to keys
    ``0..=positions[p]``); ``layer_kinds`` lists ``"global"`` or ``"local:W"`` for every
    model layer; ``dtype`` is ``"f32"``, ``"f16"`` or ``"bf16"``; ``metadata`` adds string
    keys outside the schema's (provenance, say). ``softcap``, where given, is positive and
    finite. Nothing is written that :func:`read_capture` would refuse: the encoded file is
    read back first (a value that ``dtype`` would make infinite, past f16's ±65504, is a
    ``ValueError`` naming its array).
    """
    conv = {}
    for l, parts in layers.items():
        conv[_count(l, "layers")] = {n: _nd(a, 3, f"layers[{l}].{n}") for n, a in parts.items()}
    _fathom.write_capture(
        os.fspath(path),
        conv,
        [_count(p, "positions") for p in positions],
        str(model),
        bool(qk_norm),
        None if softcap is None else float(softcap),
        None if layer_kinds is None else [str(k) for k in layer_kinds],
        dtype,
        None if metadata is None else {str(k): str(v) for k, v in metadata.items()},
    )


def read_capture(path: os.PathLike | str) -> tuple[dict, dict]:
    """Reads a docs/SPEC.md §8 capture: ``(info, layers)``, ``info`` the capture-wide facts
    (``model``, ``positions``, ``layers``, ``layer_kinds``, ``n``, ``hq``, ``hkv``, ``d``, …)
    and ``layers`` a dict of layer index to float32 arrays ``q``, ``k``, ``v`` (and ``o``)."""
    return _fathom.read_capture(os.fspath(path))


def calibrate(
    capture: os.PathLike | str,
    out: os.PathLike | str,
    *,
    targets: Sequence[float] = (48.0, 64.0),
    k: Optional[int] = None,
    quantum: float = 4.0,
) -> Optional[str]:
    """Calibrates on a capture, as ``fathom calibrate`` does (docs/SPEC.md §3): σ², the KLT
    and the basis rule per (layer, KV head) and per-layer budgets for each target mean
    budget; writes ``out`` (JSON, atomically) and its ``-summary.json``. Returns the basis
    the rule chose (``"Raw"`` or ``"Klt"``). Fathom methods in :func:`fidelity` need it."""
    return _fathom.calibrate(
        os.fspath(capture), os.fspath(out), [float(t) for t in targets],
        None if k is None else _count(k, "k"), float(quantum))


def fidelity(
    capture: os.PathLike | str,
    methods: str,
    *,
    k: Optional[int] = None,
    calib: Optional[os.PathLike | str] = None,
    layers: Optional[Sequence[int]] = None,
    basis: str = "auto",
) -> dict:
    """Attention fidelity of every method of ``methods`` (the grammar of ``fathom fidelity
    --help``: ``"dense,exact,fathom:48,sparq:32,ds:32,loki:32,thumb2,landmark,quest"``) on a
    capture, under the selection protocol of docs/SPEC.md §5 (sink 4, local 32, top ``k``).
    Returns the document ``fathom fidelity --json`` writes, as a dict: per method its bits
    per token and KV head and its mean relative error of the attention output. ``basis`` is
    the store basis of the Fathom methods, ``"raw"``, ``"klt"`` or ``"auto"`` (the default,
    as ``fathom fidelity``'s: the calibration's basis rule, raw without one)."""
    return json.loads(
        _fathom.fidelity_json(
            os.fspath(capture),
            str(methods),
            None if k is None else _count(k, "k"),
            None if calib is None else os.fspath(calib),
            None if layers is None else [_count(x, "layers") for x in layers],
            basis,
        )
    )
