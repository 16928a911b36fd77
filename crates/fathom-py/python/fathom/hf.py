"""Fathom attention inside Hugging Face generation.

    import fathom.hf
    out, att = fathom.hf.generate(model, input_ids, "fathom:48", k=256, calib="cal.json",
                                  max_new_tokens=64)
    print(att.mean_bits, att.density)       # bits read per token and KV head; keys attended

Every decode step of every global layer runs through :class:`fathom.Decoder`: the layer's
keys so far fill a 4-bit bit-plane store (appended to each step), the method scans it, each
query head keeps sink 4 + local 32 + its own top-k, and attends exactly over that set
(docs/SPEC.md §5). Prefill, and the sliding-window layers (Gemma 3's local layers), use the
model's own ``sdpa`` attention, as the protocol does. The integration is an attention
function registered with transformers' attention interface (with sdpa's masks), so it needs
no change to the model: llama-family GQA decoders with or without QK-norm (Llama-3.x,
Qwen2.5, Qwen3) and Gemma 3. This is the CPU reference backend (the library's CPU protocol;
the decoder keeps the sequence's keys and values on the host, so a step copies only the new
token's rows and its queries there); batch 1.

With ``device="cuda"`` the same protocol runs on the GPU through :class:`fathom.gpu.GpuCache`
(the offloaded paged cache: the prompt's and each new token's K/V appended from the model's
own CUDA tensors, zero-copy; plan, scan, top-k and attention on the GPU, on torch's current
stream). Methods there: ``dense``, ``exact``, ``fathom:B``, ``sparq:r``, ``ds:r``, ``thumb2``;
head dimensions 64, 128 or 256.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import numpy as np

from . import _fathom

_NAME = "fathom_decode"


def __getattr__(name):
    # The offloaded cache (fathom.hf_cache) imports torch and transformers: only when used.
    if name in ("FathomCache", "install", "restore"):
        from . import hf_cache

        return getattr(hf_cache, name)
    raise AttributeError(f"module 'fathom.hf' has no attribute {name!r}")


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _shape(config):
    """``(layers, Hq, Hkv, D)`` of a decoder's config."""
    t = _text_config(config)
    hq = int(t.num_attention_heads)
    hkv = int(getattr(t, "num_key_value_heads", None) or hq)
    d = int(getattr(t, "head_dim", None) or t.hidden_size // hq)
    return int(t.num_hidden_layers), hq, hkv, d


class FathomAttention:
    """The attention of one generation with one method (see the module docs)."""

    def __init__(self, method: str, *, k: int, calib: Optional[os.PathLike | str] = None,
                 sink: int = 4, local: int = 32, basis: str = "raw", capacity: int = 4096,
                 device: str = "cpu"):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: {device!r} (want 'cpu' or 'cuda')")
        if device == "cuda" and basis != "raw":
            raise ValueError("device='cuda' stores raw channels: use basis='raw'")
        self.device = device
        self.gpu = None
        self._session = None
        self._batch = None
        self._step_n = -1
        self._step_rows = 0
        self._kept = 0.0
        self._visible = 0.0
        self.method = method
        self.k, self.sink, self.local, self.basis, self.capacity = int(k), int(sink), int(local), basis, int(capacity)
        self.calib = None if calib is None else os.fspath(calib)
        self.decoder: Optional[_fathom.Decoder] = None
        self.steps = 0
        self.softcap: Optional[float] = None

    def _decoder(self, config, hkv: int, d: int) -> "_fathom.Decoder":
        if self.decoder is None:
            text = _text_config(config)
            self.decoder = _fathom.Decoder(
                self.method, int(text.num_hidden_layers), hkv, d, self.k, self.capacity,
                self.sink, self.local, self.calib, self.basis,
                getattr(text, "attn_logit_softcapping", None))
        return self.decoder

    def _gpu(self, config, hkv: int, d: int):
        if self.gpu is None:
            from . import gpu as fg

            text = _text_config(config)
            hq = int(text.num_attention_heads)
            if getattr(text, "attn_logit_softcapping", None):
                raise ValueError("device='cuda': the paged cache has no attention softcap")
            # Loki scans the cache's PCA index, landmark and Quest its block tables.
            name = str(self.method).strip().lower()
            self.gpu = fg.GpuCache(layers=int(text.num_hidden_layers), kv_heads=hkv, group=hq // hkv,
                                   dim=d, max_sessions=1, max_tokens=self.capacity,
                                   max_k=min(self.k, self.capacity),
                                   pca_index=name.startswith("loki:"),
                                   block_tables=name in ("landmark", "quest"))
            if self.calib is not None:
                self.gpu.load_calibration(self.calib)
            self._session = self.gpu.create()
        return self.gpu

    def check(self, config) -> None:
        """Builds the decoder from the model's shape, so a bad method, k or calibration (or a
        method that needs one without it, a softcap that is not positive) is an error before
        generation starts."""
        _, _, hkv, d = _shape(config)
        if self.device == "cuda":
            # The CPU decoder's constructor refuses what would fail at the first step (a
            # method that needs a calibration without one, k = sink = local = 0, a negative
            # count) by the same rules; the cache has no softcap (refused in `_gpu`).
            text = _text_config(config)
            _fathom.Decoder(self.method, int(text.num_hidden_layers), hkv, d, self.k,
                            self.capacity, self.sink, self.local, self.calib, "raw", None)
            self._gpu(config, hkv, d)
        else:
            self._decoder(config, hkv, d)

    def _cuda(self, module, query, key, value, pre: float):
        """One decode step of one global layer through the GPU cache."""
        import torch

        cache = self._gpu(module.config, key.shape[1], query.shape[-1])
        layer, n = int(module.layer_idx), int(key.shape[2])
        if n != self._step_n:
            # The step's first global layer: grow the session by what the cache has not seen
            # (the prompt and the first token at the first step, then one token).
            have = cache.len(self._session)
            if n <= have:
                raise ValueError(f"layer {layer}: the model's cache holds {n} tokens, Fathom's {have}")
            self._batch = cache.reserve([(self._session, n - have)])
            self._step_n, self._step_rows = n, n - have
        rows = self._step_rows
        k_new = key[0, :, n - rows:n].transpose(0, 1).contiguous()
        v_new = value[0, :, n - rows:n].transpose(0, 1).contiguous()
        cache.append(self._batch, layer, k_new, v_new)
        q = (query[0, :, -1, :].float() * pre).unsqueeze(0).contiguous()
        out = torch.empty_like(q)
        # The cache was made with max_k = min(k, capacity): a k past the capacity keeps every
        # token either way.
        cache.attend(self._batch, layer, self.method, q, out, k=min(self.k, self.capacity),
                     sink=self.sink, local=self.local)
        self.steps += 1
        kept = n if self.method == "dense" else min(n, self.sink + self.local + self.k)
        self._kept += kept
        self._visible += n
        return out.to(query.dtype).view(1, 1, query.shape[1], query.shape[-1]), None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        import torch
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        if query.shape[2] != 1 or window:
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          scaling=scaling, dropout=dropout, **kwargs)
        if query.shape[0] != 1:
            raise ValueError(f"fathom.hf decodes one sequence at a time (batch {query.shape[0]})")
        d = query.shape[-1]
        hkv, n = key.shape[1], key.shape[2]
        pre = (1.0 / math.sqrt(d) if scaling is None else float(scaling)) * math.sqrt(d)
        if self.device == "cuda":
            return self._cuda(module, query, key, value, pre)
        dec = self._decoder(module.config, hkv, d)

        def host(t):
            return np.ascontiguousarray(t.detach().to("cpu", dtype=torch.float32).numpy())

        layer = int(module.layer_idx)
        have = dec.tokens(layer)
        if n < have:
            raise ValueError(f"layer {layer}: the model's cache holds {n} tokens, the decoder {have}")
        if n > have:
            # Only the rows the decoder has not seen cross to the host (the prompt at the first step).
            dec.append(layer, host(key[0, :, have:n].transpose(0, 1)), host(value[0, :, have:n].transpose(0, 1)))
        q = host(query[0, :, -1, :]) * np.float32(pre)
        out = dec.attend(layer, np.ascontiguousarray(q))
        self.steps += 1
        o = torch.from_numpy(out).to(device=query.device, dtype=query.dtype)
        return o.view(1, 1, query.shape[1], d), None

    @property
    def mean_bits(self) -> float:
        if self.device == "cuda":
            if self.gpu is None:
                return 0.0
            mean, plans = self.gpu.plan_bits()
            return mean if plans else 0.0
        return 0.0 if self.decoder is None else self.decoder.mean_bits

    @property
    def density(self) -> float:
        if self.device == "cuda":
            return 1.0 if self._visible == 0 else self._kept / self._visible
        return 1.0 if self.decoder is None else self.decoder.density

    @property
    def row_cache(self) -> list:
        """``[(slots, union rows, hits)]``: what a GPU row cache of 64, 256, 1024 and 8192 slots
        per layer and KV head would have served of the rows the steps selected so far (the
        cache's CPU reference over this decoder's own unions; docs/SPEC.md §6.1 "Row cache").
        Empty for dense, and with ``device="cuda"``, whose cache here keeps no row cache."""
        if self.device == "cuda" or self.decoder is None:
            return []
        return self.decoder.row_cache

    @contextlib.contextmanager
    def installed(self, model):
        """Runs ``model``'s attention through this object inside the ``with`` block."""
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        self.check(model.config)
        AttentionInterface.register(_NAME, self)
        AttentionMaskInterface.register(_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        old = model.config._attn_implementation
        model.set_attn_implementation(_NAME)
        try:
            yield self
        finally:
            model.set_attn_implementation(old)


def generate(model, input_ids, method: str, *, k: int, calib: Optional[os.PathLike | str] = None,
             max_new_tokens: int = 32, sink: int = 4, local: int = 32, basis: str = "raw",
             device: str = "cpu", **generate_kwargs):
    """Greedy ``model.generate`` with every decode step's global attention through Fathom's
    protocol with ``method`` (``"dense"``, ``"exact"``, ``"fathom:48"``, ``"sparq:32"``, …);
    returns ``(output_ids, attention)``, the latter with ``mean_bits`` and ``density``.
    Fathom methods need ``calib`` (``fathom.calibrate`` on a capture of the same model).
    ``device="cuda"`` runs the protocol on the GPU through the offloaded paged cache."""
    import torch

    if input_ids.shape[0] != 1:
        raise ValueError(f"input_ids: batch {input_ids.shape[0]}; fathom.hf decodes one sequence")
    att = FathomAttention(method, k=k, calib=calib, sink=sink, local=local, basis=basis,
                          capacity=int(input_ids.shape[1]) + int(max_new_tokens), device=device)
    with att.installed(model), torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False,
                             use_cache=True, **generate_kwargs)
    return out, att


def generate_offloaded(model, input_ids, method: str = "fathom:48", *, k: int = 256,
                       calib: Optional[os.PathLike | str] = None, attention_mask=None,
                       max_new_tokens: int = 32, prefill_chunk_size: Optional[int] = None,
                       sink: int = 4, local: int = 32, residency: str = "host",
                       **generate_kwargs):
    """Greedy ``model.generate`` with a :class:`FathomCache` sized for the batch (left-padded
    rows of ``input_ids`` with their ``attention_mask``): returns ``(output_ids, cache)``. The
    K/V of every global layer live in the offloaded paged cache; each decode step attends
    through it with ``method``."""
    import torch

    from .hf_cache import FathomCache

    cache = FathomCache(model, method, k=k, sink=sink, local=local, calib=calib,
                        max_tokens=int(input_ids.shape[1]) + int(max_new_tokens),
                        max_batch=int(input_ids.shape[0]), residency=residency)
    if prefill_chunk_size is not None:
        generate_kwargs["prefill_chunk_size"] = int(prefill_chunk_size)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache,
                             max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                             **generate_kwargs)
    return out, cache
