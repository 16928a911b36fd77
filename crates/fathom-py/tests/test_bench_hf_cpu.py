"""`python -m fathom.bench_hf` without a GPU: its settings, statistics and the comparison with
`fathom decode-bench` are what the JSON records; without a GPU it says so and exits 2; a
baseline's decode loop runs (transformers' DynamicCache on a random CPU model)."""

import argparse
import json

import pytest

from hf_support import need, qwen3

torch = need("torch")
need("transformers")
from fathom import bench_hf  # noqa: E402


def test_contexts_and_the_grid():
    assert bench_hf.tokens("32k") == 32768 and bench_hf.tokens("1m") == 1 << 20
    assert bench_hf.tokens("100") == 100
    with pytest.raises(ValueError):
        bench_hf.tokens("0k")
    a = argparse.Namespace(grid="32k:1,4/128k:2", context=None, batch=None)
    assert bench_hf.settings(a) == [(32768, 1), (32768, 4), (131072, 2)]
    a = argparse.Namespace(grid=None, context="8k,16k", batch="1,2")
    assert bench_hf.settings(a) == [(8192, 1), (8192, 2), (16384, 1), (16384, 2)]


def test_statistics_and_the_decode_bench_ratio():
    s = bench_hf.stats([10.0, 12.0, 14.0])
    assert s["mean"] == 12.0 and s["ci95"][0] < 12.0 < s["ci95"][1] and s["n"] == 3
    doc = {"entries": [{"cache": "fathom:48", "batch": 4, "context": 32768, "tokens_per_s": 60.0},
                       {"cache": "dynamic", "batch": 4, "context": 32768, "tokens_per_s": 30.0},
                       {"cache": "fathom:48", "batch": 1, "context": 32768, "error": "x"}]}
    db = {"command": "fathom decode-bench", "device": {"name": "H100"}, "entries": [
        {"method": "fathom:48", "batch": 4, "contexts": [32768] * 4, "tokens_per_s": 120.0,
         "graph": False},
        {"method": "fathom:48", "batch": 4, "contexts": [32768] * 4, "tokens_per_s": 999.0,
         "graph": True}]}
    bench_hf.compare_decode_bench(doc, db)
    assert doc["entries"][0]["of_decode_bench"] == 0.5
    assert "of_decode_bench" not in doc["entries"][1] and "of_decode_bench" not in doc["entries"][2]


def test_without_a_gpu_it_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench_hf.main(["--shape", "qwen3-8b"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_baseline_decodes_and_the_plot_is_drawn(tmp_path):
    m = qwen3().eval()
    cache = bench_hf.make_cache("dynamic", m, 2, 64, 4, 16)
    assert cache.get_seq_length() == 64
    with bench_hf.sdpa_backends():  # the kernels every cache runs under (math on the CPU)
        wall, host, prof = bench_hf.decode(m, cache, 2, 2, 1, rounds=2, profile=2)
    assert len(wall) == 2 and all(w > 0 for w in wall) and len(host) == 2
    assert cache.get_seq_length() == 64 + 1 + 4 + 2
    # The profile: its host time splits into torch operators and the rest; the top operators
    # of a transformers step include its matrix products.
    assert prof["steps"] == 2 and prof["host_ms_per_step"] > 0
    assert 0 < prof["torch_ops_cpu_ms_per_step"]
    assert prof["outside_ops_ms_per_step"] == pytest.approx(
        prof["host_ms_per_step"] - prof["torch_ops_cpu_ms_per_step"])
    ops = [o["op"] for o in prof["top_ops"]]
    assert 0 < len(ops) <= 15 and any(o in ("aten::mm", "aten::addmm", "aten::linear",
                                            "aten::matmul", "aten::bmm") for o in ops), ops
    e = {"cache": "dynamic", "context": 64, "batch": 2, "tokens_per_s": 1.0, "tpot_ms": 1.0,
         "weights_ms": 0.5, "cache_ms": 0.5, "host_enqueue_ms": 1.0, "profile": prof}
    assert "profiled: host" in bench_hf._line(e)
    need("matplotlib", (), "the plot needs matplotlib")
    doc = {"shape": "qwen3-8b", "weights": "random", "device": "cpu", "entries": [
        {"cache": "dynamic", "context": 32768, "batch": b, "tokens_per_s": 10.0 * b} for b in (1, 2)]}
    p = tmp_path / "x.json"
    p.write_text(json.dumps(doc))
    assert bench_hf.main(["--plot-only", str(p)]) == 0
    assert (tmp_path / "x.png").stat().st_size > 1000


def test_real_text_is_one_stream_cut_into_rows(tmp_path):
    # A tokenizer of one id per character: the rows are consecutive runs of the joined
    # documents, no text repeats, and too little text is a ValueError naming the file.
    class Chars:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([0] if add_special_tokens else []) + [ord(c) for c in text]}

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("abc", "defgh", "ij")))
    ids = bench_hf.prose_ids(Chars(), str(path), 4, 3, device="cpu")
    stream = [0] + [ord(c) for c in "abc\n\ndefgh\n\nij\n\n"]
    assert ids.tolist() == [stream[0:4], stream[4:8], stream[8:12]]
    with pytest.raises(ValueError, match="docs.jsonl gives 17 tokens, want 4 × 5 = 20"):
        bench_hf.prose_ids(Chars(), str(path), 5, 4, device="cpu")


def test_offloaded_is_refused_where_the_host_cannot_hold_its_kv():
    # Qwen3-8B's shape: 36 layers × 8 KV heads × 128 channels, K and V in bf16: 144 KiB a
    # token, so 4 × 128k tokens need 72 GiB.
    m = argparse.Namespace(config=argparse.Namespace(
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        hidden_size=4096))
    with pytest.raises(MemoryError, match="need 72.0 GiB, 64.0 GiB free"):
        bench_hf.check_host_room("offloaded", m, 4, 131072, 64 << 30)
    bench_hf.check_host_room("offloaded", m, 4, 131072, 100 << 30)
    bench_hf.check_host_room("fathom:48", m, 4, 131072, 1 << 30)  # only OffloadedCache
    bench_hf.check_host_room("offloaded", m, 4, 131072, None)  # unknown: tried
