"""``FathomCache``: a transformers ``Cache`` whose global layers live in Fathom's offloaded
paged cache (docs/SPEC.md §6.1), for any decoder that transformers runs through its attention
interface.

    from fathom.hf import FathomCache
    cache = FathomCache(model, "fathom:48", k=256, calib="cal.json", max_tokens=40000)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

Each sequence of the batch is a session of one :class:`fathom.gpu.GpuCache`, its K/V in
pinned host memory (``residency="host"``). Prefill (in chunks with ``prefill_chunk_size``)
appends each chunk's rows, padding left out (left padding, as transformers pads decoder-only
prompts), and runs the model's own ``sdpa`` over the session's keys: the chunk's own tensors
for the first chunk, the stored rows read back for later ones (:meth:`GpuCache.read_rows`).
Every decode step of every global layer appends the new token's K/V and attends through the
cache with the method (``dense``, ``exact`` or any method of the grammar): plan, scan, top-k,
row fetch and attention on the GPU, on torch's current stream, with no host synchronisation
inside the step (the step's one reserve, at the first layer, waits only for the cache's own
work of the step before). Sliding-window layers (Gemma 3's local layers) keep the model's own
path and a transformers ``DynamicSlidingWindowLayer`` in HBM.

Constructing the cache registers the attention function ``"fathom"`` with transformers and
switches the model to it; with any other cache it is the model's ``sdpa``, so other
generations are unchanged. :func:`fathom.hf.restore` switches the model back.
"""

from __future__ import annotations

import math
import os
import threading
from typing import List, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from . import _fathom
from . import gpu as fg
from .hf import _shape, _text_config

NAME = "fathom"
_pending = threading.local()


def layer_types(config) -> List[str]:
    """Each layer's attention kind (``full_attention``, ``sliding_attention``, …), as
    transformers' own caches read it."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    return list(get_layer_types_and_kwargs(_text_config(config))[0])


class FathomLayer(CacheLayerMixin):
    """One global layer: its K/V are in the paged cache; this object only counts positions
    (the padded length transformers builds masks for) and hands the step's new rows to the
    attention function."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: "FathomCache", layer: int):
        super().__init__()
        self.owner, self.layer, self.seen = owner, layer, 0
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        self.owner._arrive(self.layer, key_states, value_states)
        self.seen += int(key_states.shape[-2])
        return key_states, value_states

    def get_mask_sizes(self, query_length: int):
        return self.seen + int(query_length), 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise ValueError("FathomCache: make a new cache for a new generation")

    def reorder_cache(self, beam_idx) -> None:
        raise ValueError("FathomCache: beam search is not supported (each sequence is a session)")

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("FathomCache: crop is not supported (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("FathomCache: num_return_sequences > 1 and beams are not supported")

    def batch_select_indices(self, indices) -> None:
        raise ValueError("FathomCache: selecting batch rows is not supported")

    def offload(self):
        return None

    def prefetch(self):
        return None


class FathomCache(Cache):
    """A transformers cache whose global layers are a Fathom paged cache (module docs).

    ``method``: ``"dense"``, ``"exact"`` or any method of the grammar (``"fathom:48"``,
    ``"sparq:32"``, …); ``k``, ``sink``, ``local``: the selection (docs/SPEC.md §5).
    ``calib``: ``fathom calibrate``'s JSON for methods that need one (``fathom:B``'s σ²,
    ``ds:r``'s channels), or ``{layer: σ² [Hkv, D]}`` (numpy float32; serves ``fathom:B``);
    a missing one is a ``ValueError`` here. ``max_tokens``: tokens per
    sequence (prompt with its padding, plus new tokens; default: the prompt's + 2048, fixed at
    the first forward). ``max_batch``: sequences (default: the first forward's batch).
    ``residency``: ``"host"`` (pinned host memory, read over PCIe), ``"index-hbm"`` or
    ``"hbm"``; further keywords go to :class:`fathom.gpu.GpuCache` (``page_tokens``,
    ``row_cache``, ``attend_groups``, …)."""

    def __init__(self, model, method: str = "fathom:48", *, k: int = 256, sink: int = 4,
                 local: int = 32, calib: Optional[os.PathLike | str] = None,
                 max_tokens: Optional[int] = None, max_batch: Optional[int] = None,
                 residency: str = "host", **cache_options):
        self.layers_total, self.hq, self.hkv, self.dim = _shape(model.config)
        kinds = layer_types(model.config)
        sliding = getattr(_text_config(model.config), "sliding_window", None)
        layers: list = []
        self.global_layers: List[int] = []
        for i, kind in enumerate(kinds):
            if kind == "full_attention":
                layers.append(FathomLayer(self, i))
                self.global_layers.append(i)
            elif kind in ("sliding_attention", "chunked_attention") and sliding:
                layers.append(DynamicSlidingWindowLayer(sliding_window=int(sliding)))
            else:
                raise ValueError(f"model: layer {i} is {kind!r}; FathomCache supports "
                                 "full_attention and sliding_attention layers")
        if not self.global_layers:
            raise ValueError("model: no full-attention layer for the cache to hold")
        super().__init__(layers=layers)
        if getattr(_text_config(model.config), "attn_logit_softcapping", None):
            raise ValueError("model: the paged cache has no attention softcap")
        self.method, self.k, self.sink, self.local = str(method), int(k), int(sink), int(local)
        self.sigma2 = None
        if isinstance(calib, dict):
            self.sigma2, self.calib = {int(k): v for k, v in calib.items()}, None
        else:
            self.calib = None if calib is None else os.fspath(calib)
        # The CPU decoder's constructor refuses what the first step would (a method outside
        # the grammar, one that needs a calibration without it, a bad count) by the same
        # rules; σ² given by layer serves fathom:B (checked at the first attend otherwise).
        try:
            _fathom.Decoder(self.method, self.layers_total, self.hkv, self.dim, self.k, 1,
                            self.sink, self.local, self.calib, "raw", None)
        except ValueError as e:
            if self.sigma2 is None or not str(e).startswith("calib"):
                raise
        self.max_tokens, self.max_batch = max_tokens, max_batch
        self.residency, self.options = residency, dict(cache_options)
        self.device = next(model.parameters()).device
        self.gpu: Optional[fg.GpuCache] = None
        self.sessions: list = []
        self._batch = None
        self._held = None  # the batch of a step being captured (fathom.hf_graph)
        self._step_lens: List[int] = []
        self.steps = 0
        install(model)

    # -- the paged cache ------------------------------------------------------------------
    def _open(self, batch: int, tokens: int) -> fg.GpuCache:
        """The paged cache, made at the first forward (its size known then)."""
        if self.gpu is None:
            if self.device.type != "cuda":
                raise ValueError(f"model: on {self.device}; FathomCache needs a CUDA model")
            max_tokens = int(self.max_tokens or tokens + 2048)
            max_batch = int(self.max_batch or batch)
            if batch > max_batch:
                raise ValueError(f"input_ids: batch {batch} past max_batch {max_batch}")
            name = self.method.strip().lower()
            # A k past the sequence keeps every token either way.
            self._k = min(self.k, max_tokens)
            self.gpu = fg.GpuCache(
                layers=self.layers_total, kv_heads=self.hkv, group=self.hq // self.hkv,
                dim=self.dim, max_sessions=max_batch, max_tokens=max_tokens,
                max_k=self._k, residency=self.residency,
                device=self.device.index or 0, pca_index=name.startswith("loki:"),
                block_tables=name in ("landmark", "quest"), **self.options)
            if self.calib is not None:
                self.gpu.load_calibration(self.calib)
            for layer, s2 in (self.sigma2 or {}).items():
                self.gpu.load_sigma2(layer, s2)
            self.sessions = [self.gpu.create() for _ in range(batch)]
        if batch != len(self.sessions):
            raise ValueError(f"input_ids: batch {batch}, the cache holds {len(self.sessions)} "
                             "sequences")
        return self.gpu

    def _arrive(self, layer: int, key_states, value_states) -> None:
        """A global layer's new K/V ``[bs, Hkv, q, D]``, for the attention function."""
        _pending.item = (self, layer, key_states, value_states)

    def _reserve(self, counts: List[int]):
        """The step's batch: sessions with new rows and their counts (at the first global
        layer of each forward)."""
        plan = [(s, m) for s, m in zip(self.sessions, counts) if m > 0]
        self._batch = self.gpu.reserve(plan)
        self._rows = [b for b, m in enumerate(counts) if m > 0]
        self._counts = [m for m in counts if m > 0]
        return self._batch

    # -- the attention of one global layer ------------------------------------------------
    def attention(self, module, query, key, value, attention_mask, scaling, **kwargs):
        """One global layer's attention: the new rows appended, then the decode step through
        the cache, or the prefill chunk through sdpa over the session's keys."""
        layer = int(module.layer_idx)
        bs, q_len = int(query.shape[0]), int(query.shape[2])
        gpu = self._open(bs, self.layers[layer].seen)
        first = layer == self.global_layers[0]
        pre = (1.0 / math.sqrt(self.dim) if scaling is None else float(scaling)) * math.sqrt(self.dim)
        if q_len == 1:
            if first:
                if self._held is not None:  # a graph's capture: reserved before it
                    self._batch = self._held
                else:
                    self._reserve([1] * bs)
                self.steps += 1
            gpu.append(self._batch, layer, key[:, :, 0, :], value[:, :, 0, :])
            q = query[:, :, 0, :]
            q = (q * pre if pre != 1.0 else q).contiguous()
            out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            gpu.attend(self._batch, layer, self.method, q, out, k=self._k, sink=self.sink,
                       local=self.local)
            return out.to(query.dtype).unsqueeze(1), None
        return self._prefill(module, query, key, value, attention_mask, scaling, layer, first,
                             **kwargs)

    def _prefill(self, module, query, key, value, attention_mask, scaling, layer, first,
                 **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        bs, q_len = int(query.shape[0]), int(query.shape[2])
        seen = self.layers[layer].seen  # after this chunk
        if first:
            self._reserve(_real_rows(attention_mask, bs, q_len, seen))
        counts = self._counts
        if self._rows:
            k_new = torch.cat([key[b, :, q_len - m:].transpose(0, 1)
                               for b, m in zip(self._rows, counts)]).contiguous()
            v_new = torch.cat([value[b, :, q_len - m:].transpose(0, 1)
                               for b, m in zip(self._rows, counts)]).contiguous()
            self.gpu.append(self._batch, layer, k_new, v_new)
        if seen > q_len:
            key, value = self._history(layer, seen, key)
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, **kwargs)

    def _history(self, layer: int, seen: int, like):
        """Every session's stored rows, right-aligned (left padding) into ``[bs, Hkv, seen,
        D]`` of ``like``'s dtype: what a later prefill chunk's sdpa attends."""
        lens = [self.gpu.len(s) for s in self.sessions]
        cap = max(lens[b] for b in self._rows)
        ko = torch.empty((len(self._rows), cap, self.hkv, self.dim), dtype=torch.float32,
                         device=like.device)
        vo = torch.empty_like(ko)
        self.gpu.read_rows(self._batch, layer, cap, ko, vo)
        k = torch.zeros((like.shape[0], self.hkv, seen, self.dim), dtype=like.dtype,
                        device=like.device)
        v = torch.zeros_like(k)
        for i, b in enumerate(self._rows):
            n = lens[b]
            k[b, :, seen - n:] = ko[i, :n].transpose(0, 1)
            v[b, :, seen - n:] = vo[i, :n].transpose(0, 1)
        return k, v

    @property
    def mean_bits(self) -> float:
        """Mean plan bits per token and KV head of the GPU-planned attends so far."""
        if self.gpu is None:
            return 0.0
        mean, plans = self.gpu.plan_bits()
        return mean if plans else 0.0


def _real_rows(attention_mask, bs: int, q_len: int, seen: int) -> List[int]:
    """Per row, the chunk's real (not padding) tokens, from the last query's row of the 4-D
    boolean mask (left padding: a row's real tokens are a suffix). Reads the mask on the host
    (prefill only)."""
    if attention_mask is None:
        return [q_len] * bs
    m = attention_mask
    if m.dim() != 4 or m.dtype != torch.bool:
        raise ValueError(f"attention_mask: a {m.dim()}-D {m.dtype} mask; FathomCache reads sdpa's "
                         "4-D boolean masks")
    real = m[:, 0, -1, seen - q_len:seen].to("cpu")
    if real.shape[0] == 1 and bs > 1:
        real = real.expand(bs, -1)
    out = []
    for b in range(bs):
        r = real[b].tolist()
        n = sum(r)
        if r != [False] * (q_len - n) + [True] * n:
            raise ValueError("attention_mask: padding that is not on the left (FathomCache "
                             "needs tokenizer.padding_side = 'left', as decoder-only generation does)")
        out.append(n)
    return out


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function: a FathomCache's global layer goes through it, any
    other call (another cache, a sliding-window layer) is the model's ``sdpa``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    item = getattr(_pending, "item", None)
    _pending.item = None
    if item is not None and item[1] == getattr(module, "layer_idx", None):
        cache = item[0]
        return cache.attention(module, query, key, value, attention_mask, scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                  dropout=dropout, **kwargs)


def install(model) -> None:
    """Registers the ``"fathom"`` attention function (with sdpa's masks) and switches
    ``model`` to it; every call without a FathomCache stays the model's sdpa."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    if model.config._attn_implementation != NAME:
        model._fathom_previous_attn = model.config._attn_implementation
        model.set_attn_implementation(NAME)


def restore(model) -> None:
    """Switches ``model`` back to the attention it had before a FathomCache was made for it."""
    prev = getattr(model, "_fathom_previous_attn", None)
    if prev is not None:
        model.set_attn_implementation(prev)
        del model._fathom_previous_attn
