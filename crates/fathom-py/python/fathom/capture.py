"""Captures from any Hugging Face causal LM (docs/SPEC.md §8).

    python -m fathom.capture --model NAME_OR_PATH --text FILE --context N --positions P \\
        --out X.safetensors [--layers 0,4,8] [--dtype bf16] [--device cuda]

One prefill forward pass over the first N tokens of the text; for the last P tokens, every
captured layer's queries ``[P, Hq, D]`` after RoPE and any QK-norm, its keys and values
``[N, Hkv, D]``, and the model's own attention output ``o`` ``[P, Hq, D]``. The tensors are
taken inside the attention function, through transformers' attention interface: the function
registered here receives exactly the ``query``, ``key`` and ``value`` the model's attention
would, calls the model's own ``sdpa`` attention on them, and keeps what it needs. A model
whose attention scale is not ``1/√D`` has its queries multiplied by ``scale·√D`` (metadata
``q_prescaled``), so that the fidelity harness's ``1/√D`` attention reproduces ``o``.

Then ``fathom calibrate --capture X.safetensors`` and ``fathom fidelity`` (or
``fathom.calibrate`` / ``fathom.fidelity``) evaluate Fathom on that model. Supported: the
llama-family GQA decoders with or without QK-norm (Llama-3.x, Qwen2.5, Qwen3) and Gemma 3's
global and sliding-window layers; other architectures work where their attention goes
through the attention interface.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional, Sequence

import numpy as np

from . import write_capture

_NAME = "fathom_capture"


class _Recorder:
    """What the attention function keeps, per layer."""

    def __init__(self, positions: int, layers: Optional[Sequence[int]]):
        self.p = positions
        self.layers = None if layers is None else set(layers)
        self.out: dict[int, dict[str, np.ndarray]] = {}
        self.prescaled = False
        self.softcap: Optional[float] = None

    def keep(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers


def _attention(rec: _Recorder):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def f32(t):
        return t.detach().to("cpu", dtype=torch.float32).numpy()

    def fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out, weights = sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
        layer = int(getattr(module, "layer_idx", -1))
        if rec.keep(layer):
            if query.shape[0] != 1:
                raise ValueError("fathom.capture runs one sequence at a time (batch 1)")
            d = query.shape[-1]
            scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
            pre = scale * math.sqrt(d)
            if abs(pre - 1.0) > 1e-6:
                rec.prescaled = True
            if kwargs.get("softcap"):
                rec.softcap = float(kwargs["softcap"])
            p = rec.p
            # query [1, Hq, N, D], key/value [1, Hkv, N, D], out [1, N, Hq, D].
            rec.out[layer] = {
                "q": np.ascontiguousarray(f32(query[0, :, -p:, :]).transpose(1, 0, 2) * pre),
                "k": np.ascontiguousarray(f32(key[0]).transpose(1, 0, 2)),
                "v": np.ascontiguousarray(f32(value[0]).transpose(1, 0, 2)),
                "o": np.ascontiguousarray(f32(out[0, -p:])),
            }
        return out, weights

    return fn


def layer_kinds(config) -> list[str]:
    """``global`` or ``local:W`` for every layer of the model (docs/SPEC.md §8)."""
    text = getattr(config, "text_config", None) or config
    n = int(text.num_hidden_layers)
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if not types:
        return ["global"] * n
    return [f"local:{int(window)}" if t == "sliding_attention" and window else "global" for t in types]


def capture_model(model, input_ids, positions: int, layers: Optional[Sequence[int]] = None):
    """Runs one prefill forward pass of ``input_ids`` (``[1, N]``) through ``model`` with the
    capturing attention and returns ``(layers, positions, meta)``: ``layers`` as
    :func:`fathom.write_capture` takes them, the last ``positions`` token indices, and the
    metadata (``qk_norm``, ``softcap``, ``layer_kinds``, ``q_prescaled``)."""
    import torch
    from transformers import AttentionInterface

    n = int(input_ids.shape[-1])
    if not 1 <= positions <= n:
        raise ValueError(f"positions: {positions} is out of range 1..={n} (the context)")
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    rec = _Recorder(positions, layers)
    AttentionInterface.register(_NAME, _attention(rec))
    # The masks (causal, sliding window) are built as for sdpa, whose attention runs inside.
    AttentionMaskInterface.register(_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    old = model.config._attn_implementation
    model.set_attn_implementation(_NAME)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        model.set_attn_implementation(old)
    if not rec.out:
        raise ValueError("no attention layer went through the attention interface")
    if layers is not None and set(layers) - set(rec.out):
        raise ValueError(f"layers {sorted(set(layers) - set(rec.out))} are not in the model")
    attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    meta = {
        "qk_norm": any(hasattr(m, "q_norm") for m in attn),
        "softcap": rec.softcap,
        "layer_kinds": layer_kinds(model.config),
        "q_prescaled": rec.prescaled,
    }
    return rec.out, list(range(n - positions, n)), meta


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fathom.capture",
        description="Write a docs/SPEC.md §8 capture (q after RoPE and QK-norm, k, v, the model's own o) "
        "from a Hugging Face causal LM.",
        epilog="example: python -m fathom.capture --model Qwen/Qwen3-8B --text doc.txt --context 32768 "
        "--positions 64 --out qwen3-8b-32k.safetensors --device cuda",
    )
    ap.add_argument("--model", required=True, help="a model name or a local directory (from_pretrained)")
    ap.add_argument("--text", required=True, help="a UTF-8 text file; its first --context tokens are used")
    ap.add_argument("--context", type=int, required=True, help="tokens N of the prefill")
    ap.add_argument("--positions", type=int, default=64, help="query positions P: the last P tokens")
    ap.add_argument("--out", required=True, help="the capture file (written atomically)")
    ap.add_argument("--layers", default=None, help="comma-separated layer indices (default: all)")
    ap.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"], help="storage precision")
    ap.add_argument("--device", default="cpu", help="torch device of the forward pass (cpu, cuda)")
    ap.add_argument("--torch-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="precision of the forward pass")
    ap.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if a.context < 1:
        ap.error(f"--context {a.context} must be positive")
    if not 1 <= a.positions <= a.context:
        ap.error(f"--positions {a.positions} is out of range 1..={a.context}")
    layers = None if a.layers is None else [int(x) for x in a.layers.split(",") if x.strip()]
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.access(out_dir, os.W_OK):
        ap.error(f"--out: {out_dir} is not writable")
    with open(a.text, encoding="utf-8") as f:
        text = f.read()
    tok = AutoTokenizer.from_pretrained(a.model)
    ids = tok(text, return_tensors="pt", add_special_tokens=True).input_ids[:, : a.context]
    if ids.shape[1] < a.context:
        ap.error(f"--text has {ids.shape[1]} tokens, fewer than --context {a.context}")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.torch_dtype))
    model.to(a.device).eval()
    got, positions, meta = capture_model(model, ids.to(a.device), a.positions, layers)
    name = getattr(model.config, "_name_or_path", None) or a.model
    write_capture(
        a.out,
        got,
        positions,
        f"hf:{name}",
        qk_norm=meta["qk_norm"],
        softcap=meta["softcap"],
        layer_kinds=meta["layer_kinds"],
        dtype=a.dtype,
        metadata={
            "q_prescaled": json.dumps(meta["q_prescaled"]),
            "capture_tool": "fathom.capture (transformers attention interface)",
            "text": os.path.basename(a.text),
        },
    )
    summary = {
        "out": a.out,
        "model": name,
        "layers": sorted(got),
        "context": a.context,
        "positions": a.positions,
        **{k: meta[k] for k in ("qk_norm", "softcap", "q_prescaled")},
    }
    print(json.dumps(summary) if a.json else f"wrote {a.out}: {summary}", file=sys.stdout if a.json else sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
