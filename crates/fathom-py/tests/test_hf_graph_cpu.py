"""GraphedDecode's refusals without a GPU (CI runs these with CPU torch): every one is a
ValueError naming its argument, before anything is captured; bench_hf's `+graph` caches
compare with decode-bench's plain steps. The graph itself runs in test_hf_graph_device.py."""

import types

import pytest

from hf_support import gemma3, llama, need

torch = need("torch")
need("transformers")
from fathom import bench_hf  # noqa: E402
from fathom.hf import FathomCache  # noqa: E402
from fathom.hf_graph import GraphedDecode, generate  # noqa: E402


def test_a_graph_needs_a_fathom_cache():
    m = llama().eval()
    with pytest.raises(ValueError, match="cache: a DynamicCache; GraphedDecode needs a FathomCache"):
        GraphedDecode(m, __import__("transformers").DynamicCache(config=m.config))


def test_sliding_window_layers_are_refused_by_index():
    m = gemma3().eval()
    with pytest.raises(ValueError, match=r"model: layers \[0, 1\] keep a sliding-window cache"):
        GraphedDecode(m, FathomCache(m, "exact", k=16))


def test_a_cache_before_its_prefill_is_refused():
    m = llama().eval()
    with pytest.raises(ValueError, match="cache: empty; prefill it"):
        GraphedDecode(m, FathomCache(m, "exact", k=16))


def as_prefilled(m):
    """A FathomCache for ``m`` that looks as after a prefill (which a CPU model cannot make:
    FathomCache refuses it first), so the checks after the emptiness one are reached."""
    cache = FathomCache(m, "exact", k=16)
    cache.gpu, cache.sessions = types.SimpleNamespace(), [object()]
    return cache


def test_a_model_off_the_caches_attention_is_refused():
    m = llama().eval()
    cache = as_prefilled(m)
    m.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="model: attention 'sdpa'; the cache's decode needs"):
        GraphedDecode(m, cache)


def test_a_rope_that_updates_on_the_host_is_refused():
    m = llama().eval()
    cache = as_prefilled(m)
    m.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(ValueError, match="model: RoPE 'dynamic' updates its frequencies"):
        GraphedDecode(m, cache)


def test_a_cpu_model_is_refused():
    m = llama().eval()
    cache = as_prefilled(m)
    with pytest.raises(ValueError, match="model: on cpu; a CUDA graph needs a CUDA model"):
        GraphedDecode(m, cache)


def test_generate_refuses_before_its_prefill():
    """The helper checks what the graph needs before the prefill writes anything."""
    ids = torch.randint(10, 100, (2, 12))
    m = gemma3().eval()
    cache = FathomCache(m, "exact", k=16)
    with pytest.raises(ValueError, match=r"model: layers \[0, 1\] keep a sliding-window cache"):
        generate(m, ids, cache, 4)
    m = llama().eval()
    cache = FathomCache(m, "exact", k=16)
    with pytest.raises(ValueError, match="model: on cpu; a CUDA graph needs a CUDA model"):
        generate(m, ids, cache, 4)
    assert cache.gpu is None and not cache.sessions  # nothing was prefilled


def test_generate_names_its_bad_arguments(monkeypatch):
    m = llama().eval()
    cache = FathomCache(m, "exact", k=16)
    # Past the model checks (a CPU model is refused first), to reach the argument checks;
    # the ids' device is then what the model's is said to be.
    monkeypatch.setattr("fathom.hf_graph.check", lambda *a, **k: torch.device("cpu"))
    ids = torch.randint(10, 100, (2, 12))
    with pytest.raises(ValueError, match=r"input_ids: torch.Size\(\[12\]\); want a \[batch"):
        generate(m, ids[0], cache, 4)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"max_new_tokens: {bad!r}; at least 1"):
            generate(m, ids, cache, bad)
    with pytest.raises(ValueError, match=r"attention_mask: \(2, 11\), input_ids \(2, 12\)"):
        generate(m, ids, cache, 4, attention_mask=torch.ones((2, 11), dtype=torch.long))
    assert cache.gpu is None and not cache.sessions
    monkeypatch.setattr("fathom.hf_graph.check", lambda *a, **k: torch.device("cuda"))
    with pytest.raises(ValueError, match="input_ids: on cpu, the model on cuda"):
        generate(m, ids, cache, 4)
    used = as_prefilled(m)
    with pytest.raises(ValueError, match="cache: holds sessions already; generate prefills"):
        generate(m, ids, used, 4)


def test_graph_entries_compare_with_decode_bench_plain_steps():
    doc = {"entries": [{"cache": "fathom:48+graph", "batch": 1, "context": 8192,
                        "tokens_per_s": 90.0}]}
    db = {"entries": [{"method": "fathom:48", "batch": 1, "contexts": [8192],
                       "tokens_per_s": 100.0, "graph": False},
                      {"method": "fathom:48", "batch": 1, "contexts": [8192],
                       "tokens_per_s": 300.0, "graph": True}]}
    bench_hf.compare_decode_bench(doc, db)
    assert doc["entries"][0]["of_decode_bench"] == 0.9
