"""The comparison a PyTorch user would make: decode through transformers with the KV in HBM
(``DynamicCache``, sdpa), with transformers' ``OffloadedCache`` (the KV in host memory, each
layer moved to the GPU for every step), and with :class:`fathom.hf.FathomCache` (the KV in
host memory, each step scanning Fathom's store and fetching only the selected rows), all in
one process, one run, one GPU.

    python -m fathom.bench_hf --shape qwen3-8b --context 32k,128k --batch 1,2,4,8 \\
        --out results/python/bench-hf --plot

For each context and batch, every cache starts from the same sessions and decodes the same
greedy steps; the JSON records tokens/s and time per output token, the step split (the
model's weights alone, the cache's share, the host's enqueue time) and, where a cache cannot
run a setting, its error (out of memory, say) as its result. ``--shape qwen3-8b`` and
``llama3.1-8b`` are random bf16 weights at those shapes (transformers' dummy-weights
convention) with synthetic K/V sessions (random keys and values written straight into each
cache, since random weights make a prompt's K/V no more meaningful; the decode step's work is
the same): labelled ``"weights": "random"`` and ``"prefill": "synthetic"`` in every entry.
``--gguf FILE`` loads a real model through transformers' GGUF loader instead and prefills each
cache with the model's own forward over real text (``--text``, the pinned prose corpus by
default) in chunks of ``--prefill-chunk``; ``--calib`` gives its Fathom caches their
calibration (labelled ``"weights": "gguf"``):

    python -m fathom.bench_hf --gguf ~/.cache/fathom/models/gemma-3-270m-q4_k_m.gguf \
        --grid 8k:1,4/16k:1,4 --calib gemma3-270m-cal.json --out results/python/bench-hf
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import sys
import time
from typing import List, Optional, Sequence

SHAPES = {
    # Qwen3-8B: 36 layers, 32 query heads, 8 KV heads, D 128, QK-norm.
    "qwen3-8b": ("Qwen3Config", "Qwen3ForCausalLM",
                 dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=1 << 20, rope_theta=1e6)),
    # Llama-3.1-8B: 32 layers, 32 query heads, 8 KV heads, D 128.
    "llama3.1-8b": ("LlamaConfig", "LlamaForCausalLM",
                    dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, max_position_embeddings=1 << 20, rope_theta=5e5)),
}
DEFAULT_CACHES = "dynamic,offloaded,dense,exact,fathom:48,fathom:48+graph,fathom:64,sparq:32"


def tokens(s: str) -> int:
    """``32k`` → 32768, ``1m`` → 1048576, or a plain count."""
    t = s.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    n = int(t[:-1] if mult > 1 else t) * mult
    if n <= 0:
        raise ValueError(f"context: {s!r}")
    return n


def settings(args) -> List[tuple]:
    """``(context, batch)`` pairs: ``--grid 32k:1,4,8/128k:1,4``, or every context with every
    batch."""
    if args.grid:
        out = []
        for part in args.grid.split("/"):
            c, _, b = part.partition(":")
            out += [(tokens(c), int(x)) for x in b.split(",")]
        return out
    return [(tokens(c), int(b)) for c in args.context.split(",") for b in args.batch.split(",")]


def random_model(shape: str):
    """A random bf16 model at ``shape`` on the GPU (weights drawn on the GPU)."""
    import torch
    import transformers

    cfg_name, cls_name, kw = SHAPES[shape]
    cfg = getattr(transformers, cfg_name)(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = getattr(transformers, cls_name)._from_config(cfg, dtype=torch.bfloat16)
    return m.eval()


def _shape(model):
    from .hf import _shape as s

    return s(model.config)


def _synthetic_kv(layers, bs, hkv, n, d, seed, device="cuda"):
    """A generator of one layer's random K and V ``[bs, Hkv, n, D]`` (bf16, unit variance)."""
    import torch

    g = torch.Generator(device).manual_seed(seed)
    for _ in range(layers):
        k = torch.randn((bs, hkv, n, d), device=device, generator=g, dtype=torch.bfloat16)
        v = torch.randn((bs, hkv, n, d), device=device, generator=g, dtype=torch.bfloat16)
        yield k, v


def host_available() -> Optional[int]:
    """Bytes of host memory the kernel says a new allocation can take (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_room(kind: str, model, bs: int, ctx: int, available: Optional[int]) -> None:
    """OffloadedCache keeps every layer's K and V in host memory (bf16): where that passes 90 %
    of what the host has free, its fill would have the process killed (seen at 128k × 4 on a
    128 GiB host), so the setting is refused with a ``MemoryError`` that the JSON records."""
    if kind != "offloaded" or available is None:
        return
    layers, _, hkv, d = _shape(model)
    need = 2 * layers * bs * ctx * hkv * d * 2
    if need > 0.9 * available:
        raise MemoryError(f"host memory: OffloadedCache's K/V need {need / 2**30:.1f} GiB, "
                          f"{available / 2**30:.1f} GiB free (not run: the fill would be killed)")


def make_cache(kind: str, model, bs: int, ctx: int, steps: int, k: int, real=None,
               options: Optional[dict] = None):
    """A cache of ``kind`` holding ``bs`` sessions of ``ctx`` tokens: synthetic K/V, or with
    ``real = (ids [bs, ctx], calib, chunk)`` the model's own prefill of ``ids`` in chunks.
    ``options``: further :class:`fathom.gpu.GpuCache` keywords for a FathomCache."""
    import torch
    from transformers import DynamicCache

    layers, hq, hkv, d = _shape(model)
    if real is not None:
        return prefilled(kind, model, bs, ctx, steps, k, *real, options=options)
    if kind in ("dynamic", "offloaded"):
        cache = DynamicCache(config=model.config, offloading=kind == "offloaded")
        dev = next(model.parameters()).device
        for layer, (kk, vv) in enumerate(_synthetic_kv(layers, bs, hkv, ctx, d, 7, dev)):
            cache.update(kk, vv, layer)
            del kk, vv
        return cache
    import numpy as np

    from .hf_cache import FathomCache

    # Synthetic keys have unit variance in every channel: σ² = 1 is their true calibration.
    sigma2 = {layer: np.ones((hkv, d), np.float32) for layer in range(layers)}
    cache = FathomCache(model, kind, k=k, calib=sigma2 if kind.startswith("fathom:") else None,
                        max_tokens=ctx + steps + 8, max_batch=bs, **(options or {}))
    gpu = cache._open(bs, ctx)
    chunk = 16384
    kv = _synthetic_kv(layers * math.ceil(ctx / chunk), bs, hkv, min(chunk, ctx), d, 7)
    for c0 in range(0, ctx, chunk):
        m = min(chunk, ctx - c0)
        batch = gpu.reserve([(s, m) for s in cache.sessions])
        for layer in range(layers):
            kk, vv = next(kv)
            # Rows session by session: [bs, Hkv, m, D] → [bs·m, Hkv, D].
            gpu.append(batch, layer, kk[:, :, :m].transpose(1, 2).contiguous().view(bs * m, hkv, d),
                       vv[:, :, :m].transpose(1, 2).contiguous().view(bs * m, hkv, d))
    for layer in cache.layers:
        if hasattr(layer, "seen"):
            layer.seen = ctx
    torch.cuda.synchronize()
    return cache


def prefilled(kind: str, model, bs: int, ctx: int, steps: int, k: int, ids, calib, chunk: int,
              options: Optional[dict] = None):
    """A cache of ``kind`` filled by the model's own forward over ``ids`` ``[bs, ctx]`` in
    chunks of ``chunk`` tokens (transformers' chunked prefill, the best it allows; for
    FathomCache later chunks read the stored rows back)."""
    import torch
    from transformers import DynamicCache

    if kind in ("dynamic", "offloaded"):
        cache = DynamicCache(config=model.config, offloading=kind == "offloaded")
    else:
        from .hf_cache import FathomCache

        cache = FathomCache(model, kind, k=k, calib=calib, max_tokens=ctx + steps + 8,
                            max_batch=bs, **(options or {}))
    with torch.no_grad():
        for c0 in range(0, ctx, chunk):
            model(input_ids=ids[:, c0:c0 + chunk], past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return cache


def gguf_model(path: str, device: str = "cuda"):
    """A GGUF model through transformers' GGUF loader (dequantized to bf16) on the GPU, and
    its tokenizer."""
    import torch
    import transformers

    d, name = os.path.split(os.path.abspath(path))
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.bfloat16)
    m.config._attn_implementation = "sdpa"
    return m.to(device).eval(), tok


def prose_ids(tok, path: str, ctx: int, bs: int, device: str = "cuda"):
    """``[bs, ctx]`` token ids of real text: the documents of the JSONL ``path`` (``{"text":
    …}`` per line) in file order, joined by blank lines into one token stream, and row b its
    b-th run of ``ctx`` tokens (no text repeats; the pinned prose corpus has no single document
    of 32k tokens, its eval split about 300k together)."""
    import torch

    want, stream = ctx * bs, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            stream += tok(text + "\n\n", add_special_tokens=not stream)["input_ids"]
            if len(stream) >= want:
                break
    if len(stream) < want:
        raise ValueError(f"text: {path} gives {len(stream)} tokens, want {bs} × {ctx} = {want}")
    return torch.tensor(stream[:want], device=device).view(bs, ctx)


def decode(model, cache, bs: int, steps: int, warmup: int, rounds: int = 3, profile: int = 0):
    """Greedy decode of ``bs`` sequences through ``cache``: ``warmup`` steps, then ``rounds``
    rounds of ``steps`` steps, each round timed from one synchronisation to the next (the
    tokens stay on the GPU; the host enqueues ahead as far as the step lets it). Per round,
    the ms per step and the host's ms per step to enqueue it; with ``profile`` > 0, that many
    more steps under torch's profiler (:func:`_profiled`), else None."""
    import torch

    tok = torch.randint(0, 100, (bs, 1), device=next(model.parameters()).device)

    def step():
        nonlocal tok
        tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

    return _timed(step, steps, warmup, rounds, tok.is_cuda, profile)


def decode_graphed(model, cache, bs: int, steps: int, warmup: int, rounds: int = 3,
                   profile: int = 0):
    """As :func:`decode`, each step one replay of the whole step captured as a CUDA graph
    (:class:`fathom.hf_graph.GraphedDecode`; a FathomCache of global layers only)."""
    import torch

    from .hf_graph import GraphedDecode

    g = GraphedDecode(model, cache)
    with torch.no_grad():
        g.capture(torch.randint(0, 100, (bs,), device=next(model.parameters()).device))
    return _timed(g.step, steps, warmup, rounds, True, profile)


def _timed(step, steps: int, warmup: int, rounds: int, cuda: bool, profile: int = 0):
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    wall, host = [], []
    with torch.no_grad():
        for r in range(rounds + 1):
            n = warmup if r == 0 else steps
            sync()
            t0 = time.perf_counter()
            enq = 0.0
            for _ in range(n):
                h0 = time.perf_counter()
                step()
                enq += time.perf_counter() - h0
            sync()
            if r > 0:
                wall.append((time.perf_counter() - t0) * 1e3 / n)
                host.append(enq * 1e3 / n)
    return wall, host, (_profiled(step, profile, cuda) if profile > 0 else None)


def _profiled(step, n: int, cuda: bool, top: int = 15) -> dict:
    """Where a step's host time goes: ``n`` steps under ``torch.profiler`` (its own overhead
    included), the host's ms per step, the ms of it inside torch operators (their self CPU
    time) and the rest (Python, transformers, the cache's binding), and the ``top`` operators
    by self CPU time, each with its calls and CPU and device ms per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad(), profile(activities=acts, acc_events=True) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        host = (time.perf_counter() - t0) * 1e3 / n
        sync()
    avgs = prof.key_averages()

    def dev_ms(a):
        return (getattr(a, "self_device_time_total", None) or getattr(a, "self_cuda_time_total", 0)
                or 0) / 1e3 / n

    ops = sum(a.self_cpu_time_total for a in avgs) / 1e3 / n
    rows = sorted(avgs, key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    return {"steps": n, "host_ms_per_step": host, "torch_ops_cpu_ms_per_step": ops,
            "outside_ops_ms_per_step": host - ops,
            "top_ops": [{"op": a.key, "calls_per_step": a.count / n,
                         "self_cpu_ms_per_step": a.self_cpu_time_total / 1e3 / n,
                         "device_ms_per_step": dev_ms(a)} for a in rows]}


def null_step(model, bs: int, ctx: int, steps: int) -> float:
    """Ms of a decode step whose attention is skipped (zeros) and whose cache keeps nothing:
    the model's weights, norms, sampling and Python alone."""
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, DynamicLayer

    class Null(DynamicLayer):
        def update(self, k, v, *a, **kw):
            return k, v

        def get_seq_length(self):
            return ctx

    def zeros(module, query, key, value, mask, **kw):
        return torch.zeros_like(query).transpose(1, 2), None

    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register("fathom_null", zeros)
    AttentionMaskInterface.register("fathom_null", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    prev = model.config._attn_implementation
    model.set_attn_implementation("fathom_null")
    try:
        cache = Cache(layers=[Null() for _ in range(_shape(model)[0])])
        wall, _, _ = decode(model, cache, bs, steps, 1, rounds=2)
    finally:
        model.set_attn_implementation(prev)
    return sum(wall) / len(wall)


def sdpa_backends():
    """sdpa limited to its flash and memory-efficient kernels, math where neither applies: the
    baselines' best configuration, one kernel family for every cache and null step (cuDNN's
    attention, which torch may otherwise pick on Hopper, is left out)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


def stats(xs: Sequence[float]) -> dict:
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    half = 1.96 * sd / math.sqrt(n) if n > 1 else 0.0
    s = sorted(xs)
    return {"mean": mean, "ci95": [mean - half, mean + half], "p50": s[n // 2], "min": s[0],
            "max": s[-1], "n": n}


def run(args, path: str, db: Optional[dict] = None) -> dict:
    import torch

    tok = None
    if args.gguf:
        model, tok = gguf_model(args.gguf)
        shape, weights, prefill = os.path.basename(args.gguf), "gguf", f"real text ({args.text})"
    else:
        model = random_model(args.shape)
        shape, weights, prefill = args.shape, "random", "synthetic"
    layers, hq, hkv, d = _shape(model)
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    doc = {"kind": "bench-hf", "version": 1, "command": f"python -m fathom.bench_hf {argv}",
           "shape": shape, "weights": weights, "prefill": prefill,
           "model": {"layers": layers, "hq": hq, "hkv": hkv, "d": d},
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "k": args.k,
           "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
           "offloaded_steps": args.offloaded_steps,
           "sdpa": "flash or memory-efficient (math where neither applies)",
           "stage_timing": bool(args.stage_timing), "entries": []}
    with sdpa_backends():
        for ctx, bs in settings(args):
            setting(args, model, tok, ctx, bs, doc, path, db)
    return doc


def setting(args, model, tok, ctx: int, bs: int, doc: dict, path: str, db: Optional[dict]):
    """Every cache at one context and batch, each entry written as it comes."""
    import torch

    weights_ms = null_step(model, bs, ctx, args.steps)
    ids, short = None, None
    try:
        ids = prose_ids(tok, args.text, ctx, bs) if tok is not None else None
    except ValueError as err:  # too little text: every cache's result at this setting
        short = err
    for kind in args.caches.split(","):
        e = {"cache": kind, "context": ctx, "batch": bs, "weights_ms": weights_ms}
        steps = args.offloaded_steps if kind == "offloaded" else args.steps
        rounds = 1 if kind == "offloaded" else args.rounds
        cache = None
        try:
            real = None
            if short is not None:
                raise short
            if ids is not None:
                calib = args.calib if kind.startswith(("fathom:", "ds:")) else None
                real = (ids, calib, args.prefill_chunk)
            base, graphed = kind.removesuffix("+graph"), kind.endswith("+graph")
            if graphed and base in ("dynamic", "offloaded"):
                raise ValueError(f"caches: {kind}; a whole-step graph is FathomCache's")
            check_host_room(base, model, bs, ctx, host_available())
            prof = args.profile_steps if kind in args.profile.split(",") else 0
            opts = {"stage_timing": True} if args.stage_timing else None
            cache = make_cache(base, model, bs, ctx, steps * rounds + args.warmup + prof + 1,
                               args.k, real, opts)
            if hasattr(cache, "gpu") and cache.gpu is not None:
                cache.gpu.stage_times()
            run_steps = decode_graphed if graphed else decode
            wall, host, profiled = run_steps(model, cache, bs, steps, args.warmup, rounds, prof)
            if profiled is not None:
                e["profile"] = profiled
            st = stats(wall)
            e.update(step_ms=st, tokens_per_s=1e3 * bs / st["mean"],
                     tpot_ms=st["mean"], host_enqueue_ms=stats(host)["mean"])
            if not graphed:  # the null step is eager: a replay's step has no share to split
                e["cache_ms"] = st["mean"] - weights_ms
            if hasattr(cache, "gpu") and cache.gpu is not None:
                t = cache.gpu.stage_times()
                if t["attends"] > 0:  # timed attends (--stage-timing; a graph's are untimed)
                    per = len(cache.global_layers) / t["attends"]
                    e["stage_gpu_ms_per_step"] = {s: t[s] * per for s in cache.gpu.STAGES}
                    e["attend_gpu_ms_per_step"] = sum(e["stage_gpu_ms_per_step"].values())
                e["mean_bits"] = cache.mean_bits
        except torch.OutOfMemoryError as err:
            e["error"] = f"out of memory: {str(err).splitlines()[0]}"
        except (RuntimeError, ValueError, MemoryError) as err:
            e["error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        finally:
            del cache
            gc.collect()
            torch.cuda.empty_cache()
            # OffloadedCache's pinned host blocks stay in torch's host cache otherwise (at
            # 128k the next setting then found 66 of 125 GiB free).
            getattr(torch._C, "_host_emptyCache", lambda: None)()
        doc["entries"].append(e)
        if db is not None:
            compare_decode_bench(doc, db)
        write_json(doc, path)  # each entry as it comes: a run cut short keeps what it timed
        print(_line(e), flush=True)


def compare_decode_bench(doc: dict, db: dict) -> None:
    """Adds to each FathomCache entry the tokens/s of `fathom decode-bench` (the Rust forward,
    the same cache, its plain steps) at its method, batch and context, and the ratio; a
    ``+graph`` entry is compared with the same plain steps."""
    doc["decode_bench"] = {"command": db.get("command"), "device": db.get("device")}
    for e in doc["entries"]:
        for r in db.get("entries", []):
            if (r.get("method") == e["cache"].removesuffix("+graph")
                    and r.get("batch") == e["batch"]
                    and set(r.get("contexts", [])) == {e["context"]} and not r.get("graph")
                    and "tokens_per_s" in e):
                e["decode_bench_tokens_per_s"] = r["tokens_per_s"]
                e["of_decode_bench"] = e["tokens_per_s"] / r["tokens_per_s"]


def _line(e: dict) -> str:
    head = f"{e['cache']:>11} ctx {e['context']:>7} B {e['batch']:>2}"
    if "error" in e:
        return f"{head}  {e['error']}"
    line = (f"{head}  {e['tokens_per_s']:8.2f} tok/s  {e['tpot_ms']:8.2f} ms/token  "
            + (f"(weights {e['weights_ms']:.1f} ms, cache {e['cache_ms']:.1f} ms, "
               if "cache_ms" in e else "(one graph replay, ")
            + f"host {e['host_enqueue_ms']:.1f} ms)")
    if "profile" in e:
        p = e["profile"]
        line += (f"\n{'':>24}profiled: host {p['host_ms_per_step']:.1f} ms/step, torch ops "
                 f"{p['torch_ops_cpu_ms_per_step']:.1f}, outside them "
                 f"{p['outside_ops_ms_per_step']:.1f}; top: "
                 + ", ".join(f"{o['op']} {o['self_cpu_ms_per_step']:.2f}"
                             for o in p["top_ops"][:4]))
    return line


def plot(doc: dict, path: str) -> None:
    """Tokens/s against batch, one panel per context, one line per cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = sorted({e["context"] for e in doc["entries"]})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs):
        for kind in dict.fromkeys(e["cache"] for e in doc["entries"]):
            pts = [(e["batch"], e["tokens_per_s"]) for e in doc["entries"]
                   if e["context"] == ctx and e["cache"] == kind and "error" not in e]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=kind)
        ax.set(title=f"{doc['shape']} ({doc['weights']} weights), {ctx // 1024}k",
               xlabel="batch", ylabel="tokens/s", yscale="log")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(doc["device"], fontsize=9)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


def write_json(doc: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fathom.bench_hf", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m fathom.bench_hf --shape qwen3-8b --context 32k --batch 1,4\n"
               "  python -m fathom.bench_hf --gguf model.gguf --grid 8k:1,4 --calib cal.json\n"
               "  python -m fathom.bench_hf --shape llama3.1-8b --grid 32k:1 --caches "
               "dynamic,fathom:48,fathom:48+graph --profile dynamic,fathom:48 --stage-timing\n"
               "  python -m fathom.bench_hf --plot-only results/python/bench-hf/qwen3-8b.json")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b",
                   help="random bf16 weights at this shape, synthetic sessions")
    p.add_argument("--gguf", metavar="FILE",
                   help="a real model instead (transformers' GGUF loader), prefilled with --text")
    p.add_argument("--text", metavar="JSONL",
                   default=os.path.expanduser("~/.cache/fathom/corpus/prose/eval.jsonl"),
                   help="real text for --gguf: one {\"text\": ...} per line (default: the pinned "
                        "prose corpus, `fathom fetch-corpus`)")
    p.add_argument("--calib", metavar="JSON",
                   help="`fathom calibrate`'s file for --gguf's fathom and ds caches")
    p.add_argument("--prefill-chunk", type=int, default=4096,
                   help="prefill chunk for --gguf (tokens)")
    p.add_argument("--context", default="32k", help="contexts, comma-separated (32k,128k)")
    p.add_argument("--batch", default="1,2,4,8", help="batch sizes, comma-separated")
    p.add_argument("--grid", help="context:batches pairs, slash-separated (32k:1,4,8/128k:1,4); "
                                  "overrides --context and --batch")
    p.add_argument("--caches", default=DEFAULT_CACHES,
                   help=f"dynamic, offloaded and FathomCache methods (default {DEFAULT_CACHES}); "
                        "a method with +graph (fathom:48+graph) decodes with the whole step "
                        "captured as one CUDA graph (models without sliding-window layers)")
    p.add_argument("--k", type=int, default=256, help="top-k per query head")
    p.add_argument("--steps", type=int, default=8, help="decode steps per timed round")
    p.add_argument("--offloaded-steps", type=int, default=3,
                   help="timed steps of OffloadedCache (each moves the whole KV)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of --steps steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="bench-hf", help="folder for the JSON and the plot")
    p.add_argument("--plot", action="store_true", help="also draw tokens/s against batch")
    p.add_argument("--profile", default="", metavar="CACHES",
                   help="caches (as in --caches) whose entries also get a torch.profiler "
                        "summary of --profile-steps more steps: host ms per step, how much of "
                        "it torch operators take, the top operators")
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--stage-timing", action="store_true",
                   help="FathomCache entries also get their attends' GPU ms per step by stage "
                        "(plan, scan, top-k, union, fetch, attention): a CUDA event after each")
    p.add_argument("--decode-bench", metavar="JSON",
                   help="`fathom decode-bench --json` of the same shape on the same machine: "
                        "each FathomCache entry gets its tokens/s and the ratio")
    p.add_argument("--plot-only", metavar="JSON", help="draw the plot of an earlier run")
    args = p.parse_args(argv)
    if args.plot_only:
        with open(args.plot_only) as f:
            doc = json.load(f)
        plot(doc, os.path.splitext(args.plot_only)[0] + ".png")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("error: bench_hf needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.splitext(os.path.basename(args.gguf))[0] if args.gguf else args.shape
    path = os.path.join(args.out, f"{stem}.json")
    db = None
    if args.decode_bench:
        with open(args.decode_bench) as f:
            db = json.load(f)
    doc = run(args, path, db)  # each entry with its ratio as it comes: a killed run keeps them
    write_json(doc, path)
    if args.plot:
        plot(doc, os.path.splitext(path)[0] + ".png")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
