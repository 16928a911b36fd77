"""FathomCache and the torch ops on the device (docs/SPEC.md §6.1): greedy generation through
the offloaded cache gives transformers' own tokens (DynamicCache, sdpa) with ``dense`` and
with ``exact`` at a k that keeps every key, on random Qwen3-, Llama- and Gemma 3-style models
(every divergence must sit on a near-tie of the reference's logits); a ragged batch of 4
generates what 4 batch-1 runs do; ``fathom::select`` is exact top-k for ``exact`` and the set
``attend`` used for every method; bad input raises ``ValueError`` naming the argument and the
cache stays usable; a decode step captured with ``torch.cuda.graphs`` through the ops replays
with outputs identical to eager. Skips without a GPU (as on CI); FATHOM_REQUIRE_GPU=1 fails
instead. With FATHOM_RESULTS set, each generation comparison is written there as JSON."""

import json
import math
import os

import pytest

from hf_support import need, need_gpu

torch = need("torch")
transformers = need("transformers")
import fathom  # noqa: E402
import fathom.gpu as fg  # noqa: E402
import fathom.ops as fo  # noqa: E402
from fathom.hf import FathomCache  # noqa: E402

need_gpu(torch)

# A near-tie: the reference's top-2 logit gap at the first differing token is at most this
# many bf16 ulps of its largest logit. The cache attends in f32 over the same bf16 K/V and
# rounds its output to bf16 once, sdpa rounds its own: each global layer's attention output
# may differ by an ulp (2^-8 relative), which the remaining layers carry into the logits;
# 8 ulps of the largest logit bounds that for these 2–3-layer models.
NEAR_TIE_ULPS = 8


def model(arch: str, seed: int = 0):
    """A random model at a GPU head dimension, bf16 on the GPU, sdpa."""
    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, initializer_range=0.08)
    if arch == "qwen3":
        c = transformers.Qwen3Config(num_hidden_layers=3, num_attention_heads=8,
                                     num_key_value_heads=2, head_dim=128, **common)
        m = transformers.Qwen3ForCausalLM(c)
    elif arch == "llama":
        c = transformers.LlamaConfig(num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64, **common)
        m = transformers.LlamaForCausalLM(c)
    else:
        c = transformers.Gemma3TextConfig(num_hidden_layers=3, num_attention_heads=4,
                                          num_key_value_heads=1, head_dim=256, sliding_window=48,
                                          layer_types=["sliding_attention", "sliding_attention",
                                                       "full_attention"],
                                          query_pre_attn_scalar=128, **common)
        m = transformers.Gemma3ForCausalLM(c)
    m.config._attn_implementation = "sdpa"
    return m.to("cuda", torch.bfloat16).eval()


def greedy(m, ids, mask=None, cache=None, new=24):
    with torch.no_grad():
        r = m.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                       do_sample=False, output_scores=True, return_dict_in_generate=True,
                       pad_token_id=0)
    return r.sequences[:, ids.shape[1]:], r.scores


def explain(ref_tokens, ref_scores, got_tokens, row=0):
    """None when the rows agree, else the first differing step, its reference top-2 gap and
    the near-tie bound; fails unless the gap is within the bound."""
    a, b = ref_tokens[row].tolist(), got_tokens[row].tolist()
    if a == b:
        return None
    t = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    s = ref_scores[t][row].float()
    top = torch.topk(s, 2).values
    gap = float(top[0] - top[1])
    bound = NEAR_TIE_ULPS * 2.0 ** -8 * float(s.abs().max())
    info = {"step": t, "top2_gap": gap, "near_tie_bound": bound, "ref": a[t], "got": b[t]}
    assert gap <= bound, f"a divergence that is no near-tie: {info}"
    return info


def record(name, doc):
    out = os.environ.get("FATHOM_RESULTS")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(doc, f, indent=1)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3"])
@pytest.mark.parametrize("method", ["dense", "exact"])
def test_generation_gives_transformers_tokens(arch, method):
    m = model(arch)
    ids = torch.randint(1, 512, (1, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ref, scores = greedy(m, ids)
    cache = FathomCache(m, method, k=512, max_tokens=400)
    got, _ = greedy(m, ids, cache=cache)
    info = explain(ref, scores, got)
    record(f"generate-{arch}-{method}", {"arch": arch, "method": method, "prompt": 300,
                                         "new_tokens": 24, "identical": info is None,
                                         "divergence": info, "device": torch.cuda.get_device_name()})
    # Chunked prefill (later chunks read the stored rows back) gives the same tokens.
    with torch.no_grad():
        chunked = m.generate(ids, past_key_values=FathomCache(m, method, k=512, max_tokens=400),
                             max_new_tokens=24, do_sample=False, prefill_chunk_size=128,
                             pad_token_id=0)[:, ids.shape[1]:]
    explain(ref, scores, chunked)


@pytest.mark.parametrize("method", ["exact", "sparq:32"])
def test_a_ragged_batch_generates_what_single_runs_do(method):
    m = model("qwen3", seed=2)
    g = torch.Generator("cuda").manual_seed(3)
    lens = [150, 260, 90, 300]
    rows = [torch.randint(1, 512, (n,), device="cuda", generator=g) for n in lens]
    width = max(lens)
    ids = torch.zeros((4, width), dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = r
        mask[b, width - len(r):] = 1
    batch, _ = greedy(m, ids, mask, FathomCache(m, method, k=64, max_tokens=width + 24))
    for b, r in enumerate(rows):
        one, one_scores = greedy(m, r[None], None, FathomCache(m, method, k=64, max_tokens=len(r) + 24))
        explain(one, one_scores, batch[b:b + 1])


def filled(cache, lens, seed=4):
    """Sessions of ``lens`` random bf16 keys and values (layer 0) through the ops, then one
    decode token each; returns the OpsCache, the session ids, and each session's K and V
    ``[n, Hkv, D]``."""
    oc = fo.OpsCache(cache)
    g = torch.Generator("cuda").manual_seed(seed)
    sids = [oc.create() for _ in lens]
    ks, vs = [[] for _ in lens], [[] for _ in lens]
    for step in (lens, [1] * len(lens)):
        k = torch.randn(sum(step), 2, 128, device="cuda", generator=g).to(torch.bfloat16)
        v = torch.randn(sum(step), 2, 128, device="cuda", generator=g).to(torch.bfloat16)
        s = torch.tensor([sid for sid, n in zip(sids, step) for _ in range(n)], dtype=torch.int32)
        p = torch.tensor([oc.len(sid) + i for sid, n in zip(sids, step) for i in range(n)],
                         dtype=torch.int32)
        torch.ops.fathom.append(oc.handle, 0, k, v, s, p)
        o = 0
        for i, n in enumerate(step):
            ks[i].append(k[o:o + n])
            vs[i].append(v[o:o + n])
            o += n
    return oc, sids, [torch.cat(x) for x in ks], [torch.cat(x) for x in vs]


def test_select_is_top_k_for_exact_and_what_attend_used():
    lens = [300, 1000, 2500]
    cache = fg.GpuCache(layers=1, kv_heads=2, group=4, dim=128, max_sessions=4, max_tokens=4096,
                        max_k=128)
    cache.load_sigma2(0, __import__("numpy").ones((2, 128), dtype="float32"))
    oc, sids, keys, values = filled(cache, lens)
    s = torch.tensor(sids, dtype=torch.int32)
    n = torch.tensor([x + 1 for x in lens], dtype=torch.int32)
    q = torch.randn(3, 8, 128, device="cuda")
    k = 100
    stores = [torch.from_numpy(fathom.KeyStore.from_keys(kb.float().cpu().numpy()).dequant_prefix(4)).double()
              for kb in keys]
    idx, ln = torch.ops.fathom.select(oc.handle, q, 0, s, n, "exact", k)
    torch.cuda.synchronize()
    for b, kb in enumerate(keys):
        nb = kb.shape[0]
        for h in range(8):
            row = idx[b, h, :int(ln[b, h])].tolist()
            assert sorted(row) == sorted(set(row)) and int(ln[b, h]) == min(nb, 4 + 32 + k)
            assert all(x == -1 for x in idx[b, h, int(ln[b, h]):].tolist())
            mid = set(range(4, nb - 32))
            chosen = set(row) & mid
            # The CPU protocol's exact: top-k over the 4-bit store of the same bf16 keys
            # (docs/SPEC.md §6.1; the cache's store equals fathom-store's bit for bit).
            k4 = stores[b][4:nb - 32, h // 4]
            scores = k4 @ q[b, h].double().cpu()
            top = torch.topk(scores, k)
            want = {4 + i for i in top.indices.tolist()}
            if chosen != want:
                # Ties aside: what differs scores within the GPU's f32 rounding of the k-th
                # score (D = 128 products summed in f32: 128 · 2^-24 relative, with room).
                kth = float(top.values[-1])
                for t in chosen ^ want:
                    assert abs(float(scores[t - 4]) - kth) <= 1e-4 * max(1.0, abs(kth)), (b, h, t)
    # For every method, attend's output is the attention over select's set.
    for method in ("exact", "fathom:48", "sparq:16"):
        idx, ln = torch.ops.fathom.select(oc.handle, q, 0, s, n, method, k)
        out = torch.ops.fathom.attend(oc.handle, q, 0, s, method, k)
        torch.cuda.synchronize()
        for b, kb in enumerate(keys):
            vb = values[b]
            for h in range(8):
                sel = idx[b, h, :int(ln[b, h])].long()
                kk, vv = kb[sel, h // 4].float(), vb[sel, h // 4].float()
                w = torch.softmax(kk @ q[b, h] / math.sqrt(128), 0)
                torch.testing.assert_close(out[b, h], w @ vv, rtol=1e-4, atol=1e-5)


def test_bad_input_names_the_argument_and_the_cache_stays_usable():
    cache = fg.GpuCache(layers=1, kv_heads=2, group=4, dim=128, max_sessions=2, max_tokens=512,
                        max_k=64)
    oc, sids, _, _ = filled(cache, [100, 200])
    s = torch.tensor(sids, dtype=torch.int32)
    n = torch.tensor([101, 201], dtype=torch.int32)
    q = torch.randn(2, 8, 128, device="cuda")
    h = oc.handle
    cases = [
        ("q", lambda: torch.ops.fathom.attend(h, q.int(), 0, s, "exact", 64)),
        ("q", lambda: torch.ops.fathom.attend(h, q.cpu(), 0, s, "exact", 64)),
        ("q", lambda: torch.ops.fathom.attend(h, q[:, :4], 0, s, "exact", 64)),
        ("sessions", lambda: torch.ops.fathom.attend(h, q, 0, torch.tensor([0, 9], dtype=torch.int32), "exact", 64)),
        ("seq_lens", lambda: torch.ops.fathom.select(h, q, 0, s, n + 1, "exact", 64)),
        ("k", lambda: torch.ops.fathom.select(h, q, 0, s, n, "exact", 65)),
        ("positions", lambda: torch.ops.fathom.append(
            h, 0, q[:, :2].contiguous(), q[:, :2].contiguous(), s, torch.tensor([5, 5], dtype=torch.int32))),
        ("sessions", lambda: torch.ops.fathom.append(
            h, 0, q[:1, :2].contiguous(), q[:1, :2].contiguous(), torch.tensor([7], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32))),
    ]
    for arg, call in cases:
        with pytest.raises(ValueError, match=arg):
            call()
    with pytest.raises(ValueError, match="q: shape"):
        torch.ops.fathom.select(h, q[0], 0, s, n, "exact", 64)
    # A capacity overrun: 512 tokens per session, 201 held, 400 more.
    big = torch.randn(400, 2, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        torch.ops.fathom.append(h, 0, big, big, torch.full((400,), sids[1], dtype=torch.int32),
                                torch.arange(201, 601, dtype=torch.int32))
    out = torch.ops.fathom.attend(h, q, 0, s, "exact", 64)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    # A rolled-back step: truncate, then the same rows appended again reserve anew.
    for sid in sids:
        oc.truncate(sid, oc.len(sid) - 1)
    k1 = torch.randn(2, 2, 128, device="cuda", dtype=torch.bfloat16)
    torch.ops.fathom.append(h, 0, k1, k1, s, torch.tensor([100, 200], dtype=torch.int32))
    out = torch.ops.fathom.attend(h, q, 0, s, "exact", 64)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


class Mini:
    """A random Qwen3-style decoder step through the ops: QK-norm, RoPE, GQA 8/2, D = 128."""

    def __init__(self, layers=2, hidden=256, vocab=512, seed=5):
        g = torch.Generator("cuda").manual_seed(seed)

        def w(*shape):
            return (torch.randn(*shape, device="cuda", generator=g) * shape[0] ** -0.5).to(torch.bfloat16)

        self.layers, self.emb = layers, w(vocab, hidden)
        self.w = [dict(q=w(hidden, 8 * 128), k=w(hidden, 2 * 128), v=w(hidden, 2 * 128),
                       o=w(8 * 128, hidden), up=w(hidden, 512), down=w(512, hidden))
                  for _ in range(layers)]
        self.inv = 1.0 / (10000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))

    def rope(self, x, pos):
        f = pos.float()[:, None] * self.inv[None]
        cos, sin = f.cos()[:, None], f.sin()[:, None]
        a, b = x[..., :64].float(), x[..., 64:].float()
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(x.dtype)

    def step(self, oc, tokens, pos, sessions, positions, method, k):
        x = self.emb[tokens]
        bs = x.shape[0]
        for l, p in enumerate(self.w):
            norm = lambda t: t * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(t.dtype)
            q = self.rope(norm((x @ p["q"]).view(bs, 8, 128)), pos)
            kk = self.rope(norm((x @ p["k"]).view(bs, 2, 128)), pos)
            vv = (x @ p["v"]).view(bs, 2, 128)
            torch.ops.fathom.append(oc.handle, l, kk, vv, sessions, positions)
            o = torch.ops.fathom.attend(oc.handle, q, l, sessions, method, k)
            x = x + o.reshape(bs, 8 * 128) @ p["o"]
            x = x + torch.nn.functional.silu(x @ p["up"]) @ p["down"]
        return (x @ self.emb.T).float()


@pytest.mark.parametrize("method", ["exact", "sparq:32"])
def test_a_graph_captured_step_replays_what_eager_computes(method):
    mini = Mini()
    lens = [700, 1500]
    caches = []
    for _ in range(2):
        c = fg.GpuCache(layers=2, kv_heads=2, group=4, dim=128, max_sessions=2, max_tokens=4096,
                        max_k=256)
        oc = fo.OpsCache(c)
        sids = [oc.create() for _ in lens]
        g = torch.Generator("cuda").manual_seed(6)
        kv = torch.randn(sum(lens), 2, 128, device="cuda", generator=g).to(torch.bfloat16)
        s = torch.tensor([sid for sid, n in zip(sids, lens) for _ in range(n)], dtype=torch.int32)
        p = torch.tensor([i for n in lens for i in range(n)], dtype=torch.int32)
        for l in range(2):
            torch.ops.fathom.append(oc.handle, l, kv, kv, s, p)
        caches.append((oc, sids))
    (ea, sa), (gb, sb) = caches
    tokens = torch.tensor([3, 4], device="cuda")
    pos = torch.tensor(lens, device="cuda")
    graph = torch.cuda.CUDAGraph()
    sess = torch.tensor(sb, dtype=torch.int32)
    token, static_out = gb.capture(
        graph, lambda: mini.step(gb, tokens, pos, sess, torch.tensor(lens, dtype=torch.int32), method, 128),
        sb, methods=[method])
    for step in range(3):
        lens_now = [ea.len(x) for x in sa]
        eager = mini.step(ea, tokens, pos, torch.tensor(sa, dtype=torch.int32),
                          torch.tensor(lens_now, dtype=torch.int32), method, 128)
        gb.replay(graph, token, sb)
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager), f"step {step}"
        nxt = eager.argmax(-1)
        tokens.copy_(nxt)
        pos.add_(1)


GGUF = [("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"), ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf")]


@pytest.mark.parametrize("name,gguf", GGUF)
@pytest.mark.parametrize("method", ["dense", "exact"])
def test_the_pinned_gguf_models_generate_transformers_tokens(name, gguf, method):
    # The models are data (staged on the device with scripts/device/stage_model.sh):
    # FATHOM_REQUIRE_DATA=1 turns their absence into a failure.
    need("gguf", "FATHOM_REQUIRE_DATA", "transformers' GGUF loader needs it")
    need("accelerate", "FATHOM_REQUIRE_DATA", "transformers' GGUF loader needs it")
    cache_dir = os.environ.get("FATHOM_CACHE", os.path.expanduser("~/.cache/fathom"))
    path = os.path.join(cache_dir, "models", gguf)
    if not os.path.exists(path):
        if os.environ.get("FATHOM_REQUIRE_DATA") == "1":
            pytest.fail(f"{path} is missing (fathom fetch-models)")
        pytest.skip(f"{path} is missing (fathom fetch-models, or stage_model.sh on the device)")
    m = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=gguf, dtype=torch.bfloat16).to("cuda").eval()
    m.config._attn_implementation = "sdpa"
    vocab = m.config.get_text_config().vocab_size
    ids = torch.randint(10, vocab, (1, 1000), device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    ref, scores = greedy(m, ids, new=32)
    got, _ = greedy(m, ids, cache=FathomCache(m, method, k=1024, max_tokens=1100), new=32)
    info = explain(ref, scores, got)
    record(f"generate-{name}-{method}", {"model": name, "method": method, "prompt": 1000,
                                         "new_tokens": 32, "identical": info is None,
                                         "divergence": info, "device": torch.cuda.get_device_name()})
