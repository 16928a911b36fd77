"""The GPU API on the device: torch CUDA tensors in, attention out, zero-copy, against torch's
own attention over the same bf16 K/V. Skips without a GPU (as on CI, which has CPU torch), or
without torch where no run asks for it; with FATHOM_REQUIRE_GPU=1 (the device runs) a missing
GPU or torch fails instead."""

import math

import pytest

from hf_support import need, need_gpu

torch = need("torch")
import fathom  # noqa: E402
import fathom.gpu as fg  # noqa: E402

need_gpu(torch)


def reference(k, v, q, g):
    """Dense attention of q [B, Hq, D] over k, v [n, Hkv, D] (bf16-rounded, as stored)."""
    kb = k.to(torch.bfloat16).float()
    vb = v.to(torch.bfloat16).float()
    n, hkv, d = kb.shape
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        kh, vh = kb[:, h // g], vb[:, h // g]
        w = torch.softmax((q[0, h] @ kh.T) / math.sqrt(d), dim=0)
        out[0, h] = w @ vh
    return out


def fill_alike(caches, k, v):
    """One session per cache holding the same K and V (layer 0); the batches that reserved them."""
    batches = []
    for c in caches:
        b = c.reserve([(c.create(), k.shape[0])])
        c.append(b, 0, k, v)
        batches.append(b)
    return batches


def attend_each(caches, batches, q):
    """Each cache's `exact` (k = 64) output for the same queries, after the stream is done."""
    outs = []
    for c, b in zip(caches, batches):
        out = torch.empty_like(q)
        c.attend(b, 0, "exact", q, out, k=64)
        outs.append(out)
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_append_and_dense_attend_match_torch(dtype):
    torch.manual_seed(0)
    L, hkv, g, d = 2, 2, 4, 128
    cache = fg.GpuCache(layers=L, kv_heads=hkv, group=g, dim=d, max_sessions=2, max_tokens=4096,
                        max_k=1024)
    s = cache.create()
    n = 700
    ks = [torch.randn(n, hkv, d, device="cuda").to(dtype) for _ in range(L)]
    vs = [torch.randn(n, hkv, d, device="cuda").to(dtype) for _ in range(L)]
    b = cache.reserve([(s, n - 1)])
    for l in range(L):
        cache.append(b, l, ks[l][: n - 1], vs[l][: n - 1])
    b = cache.reserve([(s, 1)])
    for l in range(L):
        cache.append(b, l, ks[l][n - 1:], vs[l][n - 1:])
    assert cache.len(s) == n
    stream = torch.cuda.Stream()
    for l in range(L):
        q = torch.randn(1, hkv * g, d, device="cuda")
        out = torch.full_like(q, float("nan"))
        with torch.cuda.stream(stream):
            cache.attend(b, l, "dense", q, out)  # runs on `stream` (torch's current there)
        stream.synchronize()
        want = reference(ks[l].float(), vs[l].float(), q, g)
        err = ((out - want).norm() / want.norm()).item()
        assert err < 1e-3, err
        # exact top-k with a k that keeps every token is dense attention.
        out2 = torch.empty_like(q)
        cache.attend(b, l, "exact", q, out2, k=1024)
        torch.cuda.synchronize()
        assert ((out2 - want).norm() / want.norm()).item() < 1e-3


def test_a_truncated_session_attends_as_one_that_held_only_its_rows():
    """A rejected draft rolled back: the truncated session's exact and dense outputs equal
    those of a session that only ever held the kept rows (nothing dropped is read)."""
    torch.manual_seed(1)
    hkv, g, d = 2, 4, 128
    cache = fg.GpuCache(layers=1, kv_heads=hkv, group=g, dim=d, max_sessions=2, max_tokens=4096,
                        max_k=1024)
    n, keep = 700, 645
    k = torch.randn(n, hkv, d, device="cuda")
    v = torch.randn(n, hkv, d, device="cuda")
    a, c = cache.create(), cache.create()
    cache.append(cache.reserve([(a, n)]), 0, k, v)
    with pytest.raises(Exception, match="cannot be truncated"):
        cache.truncate(a, n + 1)
    cache.truncate(a, keep)
    assert cache.len(a) == keep
    cache.append(cache.reserve([(c, keep)]), 0, k[:keep], v[:keep])
    b = cache.reserve([(a, 1), (c, 1)])
    k1 = torch.randn(1, hkv, d, device="cuda")
    v1 = torch.randn(1, hkv, d, device="cuda")
    cache.append(b, 0, torch.cat([k1, k1]), torch.cat([v1, v1]))
    q1 = torch.randn(1, hkv * g, d, device="cuda")
    q = torch.cat([q1, q1])
    for method in ["dense", "exact"]:
        out = torch.empty_like(q)
        cache.attend(b, 0, method, q, out, k=64)
        torch.cuda.synchronize()
        assert torch.equal(out[0], out[1]), method


def test_mismatches_raise_value_errors_and_launch_nothing():
    cache = fg.GpuCache(layers=1, kv_heads=2, group=4, dim=64, max_sessions=2, max_tokens=1024)
    s = cache.create()
    b = cache.reserve([(s, 10)])
    good = torch.zeros(10, 2, 64, device="cuda")
    for bad, needle in [
        (torch.zeros(10, 2, 64), "CUDA tensor"),
        (torch.zeros(9, 2, 64, device="cuda"), "shape"),
        (torch.zeros(10, 2, 64, device="cuda", dtype=torch.float64), "dtype"),
        (torch.zeros(10, 64, 2, device="cuda").transpose(1, 2), "contiguous"),
    ]:
        with pytest.raises(ValueError, match=needle):
            cache.append(b, 0, bad, good)
    cache.append(b, 0, good, good)
    assert cache.len(s) == 10
    q = torch.zeros(1, 8, 64, device="cuda")
    with pytest.raises(ValueError, match="out"):
        cache.attend(b, 0, "dense", q, torch.zeros(1, 8, 64, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(fathom.FathomError, match="unknown method|nope"):
        cache.attend(b, 0, "nope", q, torch.zeros_like(q))


def test_select_paths_head_groups_and_scan_loads_change_no_output():
    """Every select path, head-group and scan-load setting gives the default's output bit for
    bit; a bad setting is an error before any allocation."""
    torch.manual_seed(3)
    L, hkv, g, d, n = 1, 4, 2, 64, 3000
    shape = dict(layers=L, kv_heads=hkv, group=g, dim=d, max_sessions=1, max_tokens=4096, max_k=64)
    caches = []
    for path, groups, words in [("scores", 1, 1), ("256", 1, 1), ("256+scores", 2, 2), ("scores", 4, 2)]:
        c = fg.GpuCache(**shape, select_path=path, attend_groups=groups, scan_vector_words=words)
        assert (c.attend_groups, c.scan_vector_words) == (groups, words)
        caches.append(c)
    assert caches[1].select_path == "filtered>=256" and caches[0].select_path == "scores"
    with pytest.raises(fathom.FathomError, match="attend groups"):
        fg.GpuCache(**shape, attend_groups=5)
    with pytest.raises(ValueError, match="path"):
        fg.GpuCache(**shape, select_path="8k")
    with pytest.raises(fathom.FathomError, match="scan vector words"):
        fg.GpuCache(**shape, scan_vector_words=3)
    k = torch.randn(n, hkv, d, device="cuda")
    v = torch.randn(n, hkv, d, device="cuda")
    batches = fill_alike(caches, k, v)
    for step in range(3):  # the filtered select needs an estimate from a previous attend
        q = torch.randn(1, hkv * g, d, device="cuda")
        outs = attend_each(caches, batches, q)
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), step


def test_stage_timing_splits_attends_and_changes_no_output():
    """With stage timing on, an attend gives the same output and reports one split attend
    whose stages are all positive (a scan method); reading the times starts afresh."""
    torch.manual_seed(4)
    L, hkv, g, d, n = 1, 2, 2, 64, 3000
    caches = [fg.GpuCache(layers=L, kv_heads=hkv, group=g, dim=d, max_sessions=1,
                          max_tokens=4096, max_k=64, stage_timing=timed) for timed in (False, True)]
    assert caches[1].stage_timing and not caches[0].stage_timing
    k = torch.randn(n, hkv, d, device="cuda")
    v = torch.randn(n, hkv, d, device="cuda")
    batches = fill_alike(caches, k, v)
    q = torch.randn(1, hkv * g, d, device="cuda")
    outs = attend_each(caches, batches, q)
    assert torch.equal(outs[0], outs[1])
    st = caches[1].stage_times()
    assert st["attends"] == 1 and st["untimed"] == 0, st
    assert all(st[s] > 0 for s in fg.GpuCache.STAGES), st
    assert caches[0].stage_times()["attends"] == 0
    assert caches[1].stage_times()["attends"] == 0


def test_row_counters_count_the_unions_and_the_row_caches_hits():
    """A cache with a 64-slot row cache and one without, the same session and queries, two
    attends: the same outputs and union rows; the second attend repeats the first's union, so
    only the row cache counts hits."""
    torch.manual_seed(5)
    L, hkv, g, d, n = 1, 2, 2, 64, 3000
    caches = [fg.GpuCache(layers=L, kv_heads=hkv, group=g, dim=d, max_sessions=1, max_tokens=4096,
                          max_k=64, row_cache=rc) for rc in (64, 0)]
    k = torch.randn(n, hkv, d, device="cuda")
    v = torch.randn(n, hkv, d, device="cuda")
    batches = fill_alike(caches, k, v)
    q = torch.randn(1, hkv * g, d, device="cuda")
    assert all(c.row_counters()["rows"] == 0 for c in caches)
    for _ in range(2):
        outs = attend_each(caches, batches, q)
        assert torch.equal(outs[0], outs[1])
    got, none = (c.row_counters() for c in caches)
    assert got["rows"] == none["rows"] > 0, (got, none)
    assert 0 < got["hits"] <= got["rows"] // 2 and none["hits"] == 0, (got, none)
    assert got["hit_rate"] == got["hits"] / got["rows"]


# (GPU method, the CPU decoder's name for the same scan). The GPU cache's `exact` scans the
# full 4-bit store (every channel at 4 planes: crates/fathom-cuda/README.md); the CPU
# decoder's `exact` scores full-precision keys, and its `fathom:4D` is the full 4-bit store.
GPU_CPU = [("exact", "fathom:272"), ("fathom:48", "fathom:48"), ("sparq:16", "sparq:16"),
           ("ds:16", "ds:16"), ("thumb2", "thumb2")]


@pytest.mark.parametrize("method,cpu_method", GPU_CPU)
def test_every_method_on_the_gpu_equals_the_cpu_decoder(tmp_path, method, cpu_method):
    """The GPU cache's attend and the Rust CPU reference (`fathom.Decoder`, the protocol the
    CPU runtime decodes with) on the same bf16-rounded keys and values and the same
    calibration: the same output within ATTN_TOL (fp32 accumulation orders differ; the
    selections are equal, as crates/fathom-cuda/tests/cache_gpu.rs checks token by token)."""
    import numpy as np

    attn_tol = 1e-3
    r = np.random.default_rng(7)
    L, hkv, g, d, n, k = 2, 2, 4, 64, 900, 64
    scale = (0.2 + np.arange(d) / d).astype(np.float32)  # per-channel spread, as real keys

    def bf16(x):
        return torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).float()

    ks = [bf16(r.standard_normal((n, hkv, d)) * scale) for _ in range(L)]
    vs = [bf16(r.standard_normal((n, hkv, d))) for _ in range(L)]
    positions = [n // 2, n - 1]
    layers = {}
    for l in range(L):
        q = r.standard_normal((len(positions), hkv * g, d)).astype(np.float32)
        layers[l] = {"q": q, "k": ks[l].numpy(), "v": vs[l].numpy()}
    cap = tmp_path / "cap.safetensors"
    fathom.write_capture(cap, layers, positions, "gpu-vs-cpu-random", dtype="f32")
    cal = tmp_path / "cal.json"
    fathom.calibrate(cap, cal, targets=[48.0], k=k)
    cache = fg.GpuCache(layers=L, kv_heads=hkv, group=g, dim=d, max_sessions=1, max_tokens=2048, max_k=k)
    cache.load_calibration(cal)
    dec = fathom.Decoder(cpu_method, L, hkv, d, k, capacity=2048, calib=str(cal))
    # The GPU's `exact` reads every channel's 4 planes; a budget pays a channel's fp16 block
    # scale too (16 bits per 64 tokens: 0.25 bits), so fathom:272 = 64 × 4.25 is every channel
    # at 4 planes at this D (fathom:256 left some at 3: the first device run failed on it).
    assert d * 4.25 == 272
    s = cache.create()
    b = cache.reserve([(s, n)])
    for l in range(L):
        cache.append(b, l, ks[l].cuda(), vs[l].cuda())
        dec.append(l, ks[l].numpy(), vs[l].numpy())
    for l in range(L):
        q = torch.tensor(r.standard_normal((1, hkv * g, d)), dtype=torch.float32)
        out = torch.full((1, hkv * g, d), float("nan"), device="cuda")
        cache.attend(b, l, method, q.cuda(), out, k=k)
        torch.cuda.synchronize()
        want = dec.attend(l, q[0].numpy())
        got = out.cpu()[0].numpy()
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert err <= attn_tol, (method, l, err)
    if method.startswith("fathom"):
        bits, plans = cache.plan_bits()
        assert plans > 0 and 0.0 < bits <= 48.0


@pytest.mark.parametrize("qk_norm", [True, False])
def test_hf_generation_on_the_gpu_cache_gives_the_models_own_tokens(qk_norm):
    transformers = need("transformers")
    import fathom.hf

    torch.manual_seed(5)
    if qk_norm:
        c = transformers.Qwen3Config(vocab_size=300, hidden_size=128, intermediate_size=256,
                                     num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64)
        model = transformers.Qwen3ForCausalLM(c)
    else:
        c = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256,
                                     num_hidden_layers=2, num_attention_heads=8,
                                     num_key_value_heads=2, head_dim=64)
        model = transformers.LlamaForCausalLM(c)
    model = model.eval().to("cuda")
    ids = torch.randint(0, 300, (1, 150), device="cuda")
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=True)
    for method, k in [("dense", 16), ("exact", 400)]:
        got, att = fathom.hf.generate(model, ids, method, k=k, max_new_tokens=12, device="cuda")
        assert torch.equal(got, want), (method, got[0, 150:].tolist(), want[0, 150:].tolist())
        assert att.steps > 0 and att.density == pytest.approx(1.0)
    _, small = fathom.hf.generate(model, ids, "exact", k=16, max_new_tokens=12, device="cuda")
    assert small.density < 0.6
