"""Greedy decode steps of a transformers model through a :class:`FathomCache`, each step one
replay of a CUDA graph captured once (docs/SPEC.md §6.1, "Graphs").

    from fathom.hf import FathomCache
    from fathom import hf_graph
    cache = FathomCache(model, "fathom:48", k=256, calib="cal.json", max_tokens=40000)
    out = hf_graph.generate(model, ids, cache, 64, attention_mask=mask)   # [bs, prompt + 64]

:func:`generate` is ``model.generate`` (greedy) with the decode steps replayed; by hand, after
a prefill of your own, the same is

    pos = (mask.cumsum(-1) - 1).clamp(min=0)             # left padding: as generate counts
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                   past_key_values=cache, logits_to_keep=1).logits              # prefill
    steps = hf_graph.GraphedDecode(model, cache)
    tokens = steps.generate(logits[:, -1].argmax(-1), 64)                       # [bs, 64]

It never stops at an end-of-sequence token: every sequence decodes ``new_tokens`` steps.

transformers' eager forward spends a decode step's time launching kernels from Python (tens
of ms for a 135M or an 8B model alike: ``results/python/bench-hf/``). Here the whole step,
the model's forward, every global layer's append and attend through the paged cache, and the
greedy argmax, is captured once into a ``torch.cuda.CUDAGraph`` (the cache in its caller
capture: :meth:`fathom.gpu.GpuCache.begin_caller_capture`, whose grids cover ``max_tokens``
so one graph serves every later length). Each step the host then reserves the step's rows
(the cache's page tables, uploaded after the previous step's work), checks the batch against
the capture, and launches the graph: no Python per layer. The token ids, positions and the
next token live in static device buffers the graph reads and writes.

What it needs: a :class:`FathomCache` after its prefill (its sessions exist), every layer of
the model a global layer in the cache (a sliding-window layer's ``DynamicSlidingWindowLayer``
grows per step, which a graph cannot), the model on the cache's attention function
(``"fathom"``), RoPE without a per-step frequency update (``dynamic`` and ``longrope`` read
the largest position on the host), and a CUDA model. Each is a ``ValueError`` here, before
anything is captured.

transformers counts a CUDA graph capture as tracing, so the captured step builds the causal
mask its eager steps skip, at the capture's length. Nothing reads it: the cache's decode
attends each session's own rows and ignores the mask, and every layer is the cache's (the
checks above), so a stale length there changes no output. The steps equal the eager steps' through the same cache (the
same kernels; the capture's attends read the same rows): the device tests compare them.
"""

from __future__ import annotations

from typing import Optional

import torch

from .hf_cache import FathomCache, FathomLayer


def check(model, cache, prefilled: bool) -> torch.device:
    """What a graphed decode needs of ``model`` and ``cache`` (module docs), each a
    ``ValueError`` naming its argument; ``prefilled`` also asks for the cache's sessions.
    Returns the model's device."""
    if not isinstance(cache, FathomCache):
        raise ValueError(f"cache: a {type(cache).__name__}; GraphedDecode needs a FathomCache")
    sliding = [i for i, layer in enumerate(cache.layers) if not isinstance(layer, FathomLayer)]
    if sliding:
        raise ValueError(f"model: layers {sliding} keep a sliding-window cache of their own, "
                         "which grows each step; a graph needs every layer in the paged cache")
    if prefilled and (cache.gpu is None or not cache.sessions):
        raise ValueError("cache: empty; prefill it (one forward over the prompt) before "
                         "capturing its decode steps")
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != "fathom":
        raise ValueError(f"model: attention {attn!r}; the cache's decode needs \"fathom\" "
                         "(a FathomCache made for this model sets it)")
    rope = getattr(getattr(getattr(model, "model", None), "rotary_emb", None), "rope_type",
                   "default")
    if rope in ("dynamic", "longrope"):
        raise ValueError(f"model: RoPE {rope!r} updates its frequencies from the largest "
                         "position on the host each step, which a graph cannot")
    dev = next(model.parameters()).device
    if dev.type != "cuda":
        raise ValueError(f"model: on {dev}; a CUDA graph needs a CUDA model")
    return dev


def generate(model, input_ids, cache: FathomCache, max_new_tokens: int,
             attention_mask=None) -> torch.Tensor:
    """Greedy ``model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache,
    max_new_tokens=max_new_tokens, do_sample=False)`` with every decode step after the first
    one CUDA graph replay: the prompt (left-padded as transformers pads, ``attention_mask``
    marking its real tokens; all real without one) prefilled through ``cache``, then
    :class:`GraphedDecode`. Returns ``[bs, prompt + max_new_tokens]`` as ``generate`` does,
    except that no sequence stops at an end token. Everything :func:`check` refuses, a cache
    that holds sessions already and ids off the model's device are refused before the
    prefill."""
    dev = check(model, cache, prefilled=False)
    if cache.gpu is not None or cache.sessions:
        raise ValueError("cache: holds sessions already; generate prefills the whole prompt, "
                         "so it needs a fresh FathomCache")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids: {getattr(input_ids, 'shape', type(input_ids).__name__)}; "
                         "want a [batch, prompt] tensor of token ids")
    if input_ids.device != dev:
        raise ValueError(f"input_ids: on {input_ids.device}, the model on {dev}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: {max_new_tokens!r}; at least 1")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask: {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}; want the same shape")
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: as generate counts
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        first = logits[:, -1].argmax(-1)
        new = [first[:, None]]
        if max_new_tokens > 1:
            new.append(GraphedDecode(model, cache).generate(first, max_new_tokens - 1))
    return torch.cat([input_ids, *new], dim=1)


class GraphedDecode:
    """Greedy decode of every sequence of ``cache`` (one session each), a CUDA graph per step
    (module docs). ``model``: the model the cache was made for, on a CUDA device."""

    def __init__(self, model, cache: FathomCache):
        dev = check(model, cache, prefilled=True)
        self.model, self.cache = model, cache
        self.bs = len(cache.sessions)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._token = None  # the cache's capture token, which replay checks
        self._pending = None  # the batch reserved at the capture: the first replay's
        # Static buffers the graph reads and writes: this step's tokens and positions, the next
        # token (the argmax), all [bs, 1] int64 on the model's device.
        self.ids = torch.zeros((self.bs, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((self.bs, 1), dtype=torch.long, device=dev)
        self.next = torch.zeros((self.bs, 1), dtype=torch.long, device=dev)

    def _positions(self) -> torch.Tensor:
        """Each sequence's next position: its session's length (its real tokens; left padding
        never entered a session, as transformers' position ids from the mask count it)."""
        return torch.tensor([[self.cache.gpu.len(s)] for s in self.cache.sessions],
                            dtype=torch.long)

    def _forward(self) -> None:
        """One decode step on the static buffers: what the graph holds."""
        out = self.model(input_ids=self.ids, position_ids=self.pos,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.next.copy_(out.logits[:, -1:].argmax(-1))
        self.ids.copy_(self.next)
        self.pos.add_(1)

    def _count_step(self) -> None:
        """The host's counters of one step (each global layer's padded length, the steps),
        which a replay, running no Python, does not touch."""
        for layer in self.cache.layers:
            layer.seen += 1
        self.cache.steps += 1

    def capture(self, tokens: torch.Tensor) -> None:
        """Captures the decode step whose input is ``tokens`` ``[bs]`` or ``[bs, 1]`` (the
        prefill's argmax): one eager step first (it warms the kernels up and its output is a
        real step, kept), then the capture, whose step runs at the first :meth:`step`."""
        t = torch.as_tensor(tokens, device=self.ids.device).reshape(-1, 1)
        if t.shape[0] != self.bs:
            raise ValueError(f"tokens: {t.shape[0]} rows, the cache holds {self.bs} sequences")
        gpu, cache = self.cache.gpu, self.cache
        with torch.no_grad():
            self.ids.copy_(t)
            self.pos.copy_(self._positions())
            # One eager step (it reserves, appends and attends through the cache) on a side
            # stream, as torch asks of a warm-up before a capture (lazy handles, workspaces).
            side = torch.cuda.Stream(device=self.ids.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward()
            torch.cuda.current_stream().wait_stream(side)
            gpu.prepare(cache.method)  # a static method's table (none for the others)
            batch = gpu.reserve([(s, 1) for s in cache.sessions], follow=True)
            graph = torch.cuda.CUDAGraph()
            seen = [layer.seen for layer in cache.layers]
            steps = cache.steps
            gpu.begin_caller_capture(batch)
            try:
                cache._held = batch
                with torch.cuda.graph(graph):
                    self._forward()
            finally:
                # The capture ran the step's Python (each layer's count) but none of its work:
                # the counters as they were, whether or not it got through.
                cache._held = None
                for layer, n in zip(cache.layers, seen):
                    layer.seen = n
                cache.steps = steps
                token = gpu.end_capture()
        self.graph, self._token, self._pending = graph, token, batch

    def step(self) -> torch.Tensor:
        """One decode step: reserves it (after the work queued on the current stream), checks
        it against the capture, replays the graph; returns the static ``[bs, 1]`` buffer of the
        next tokens (overwritten by the next step: clone to keep)."""
        if self.graph is None:
            raise ValueError("GraphedDecode: capture(tokens) first")
        gpu, cache = self.cache.gpu, self.cache
        batch, self._pending = self._pending, None
        if batch is None:
            batch = gpu.reserve([(s, 1) for s in cache.sessions], follow=True)
        gpu.replay(batch, self._token)
        self.graph.replay()
        self._count_step()
        return self.next

    def generate(self, tokens: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """``new_tokens`` greedy tokens after ``tokens`` (the prefill's argmax, ``[bs]``):
        ``[bs, new_tokens]`` on the model's device; the first is the eager warm-up step's,
        the rest replays."""
        if new_tokens < 1:
            raise ValueError(f"new_tokens: {new_tokens}; at least 1")
        self.capture(tokens)
        out = [self.next.clone()]
        with torch.no_grad():
            for _ in range(new_tokens - 1):
                out.append(self.step().clone())
        return torch.cat(out, dim=1)
