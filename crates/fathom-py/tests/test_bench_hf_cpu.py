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
    wall, host = bench_hf.decode(m, cache, 2, 2, 1, rounds=2)
    assert len(wall) == 2 and all(w > 0 for w in wall) and len(host) == 2
    assert cache.get_seq_length() == 64 + 1 + 4
    need("matplotlib", (), "the plot needs matplotlib")
    doc = {"shape": "qwen3-8b", "weights": "random", "device": "cpu", "entries": [
        {"cache": "dynamic", "context": 32768, "batch": b, "tokens_per_s": 10.0 * b} for b in (1, 2)]}
    p = tmp_path / "x.json"
    p.write_text(json.dumps(doc))
    assert bench_hf.main(["--plot-only", str(p)]) == 0
    assert (tmp_path / "x.png").stat().st_size > 1000
