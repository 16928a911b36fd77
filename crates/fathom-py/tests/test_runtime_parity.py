"""The project's CPU model runtime (`fathom capture`, fathom-model) against Hugging Face
transformers on the same real weights and real text: SmolLM2-135M-Instruct and Gemma 3 270M
from the pinned GGUFs (`fathom fetch-models`; transformers dequantizes them), the first 1024
tokens of a Django documentation page from the pinned prose corpus (`fathom fetch-corpus`).
transformers runs the runtime's own token ids (`fathom capture --tokens-out`, checked against
the capture's `tokens_sha256`), and the q, k, v and o of three layers agree (q and k after
mapping GGUF's interleaved RoPE pairs to HF's halves where the capture says it keeps them;
Gemma's sliding-window and global layers both), with the runtime's weights dequantized to f32
(`--f32-weights`; transformers dequantizes every weight). By default the runtime keeps Q8_0
and k-quant weights quantized and multiplies 8-bit-quantized activations, as llama.cpp does:
for Gemma 3 (Q8_0 `attn_v`) that moves v by about 1.5% at layer 0, measured here too. For SmolLM2 transformers' own tokenizer
gives the same ids too; for Gemma 3 the tokenizer transformers builds from the GGUF does not
(it splits words into short pieces and adds no BOS), so its ids are not used.

Needs torch and transformers (as the other HF tests), gguf and accelerate, the cached model
and corpus, and the `fathom` binary (`FATHOM_BIN`, default `target/release/fathom`); without
one it skips with the reason (FATHOM_REQUIRE_DATA=1 makes the data ones failures).
"""

import hashlib
import json
import os
import subprocess

import numpy as np
import pytest

import fathom
from hf_support import need

torch = need("torch")
transformers = need("transformers")
# The GGUF loader's packages and the cached model and corpus are data requirements:
# FATHOM_REQUIRE_DATA=1 turns their skip into a failure, as it does for the Rust tests.
need("gguf", "FATHOM_REQUIRE_DATA", "transformers' GGUF loader needs it")
need("accelerate", "FATHOM_REQUIRE_DATA", "transformers' GGUF loader needs it")
from fathom.capture import capture_model  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
CACHE = os.environ.get("FATHOM_CACHE", os.path.expanduser("~/.cache/fathom"))
N, P = 1024, 8
MODELS = [("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf", [0, 15, 29], True),
          ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf", [0, 5, 17], False)]
# (f32 weights, bound on every relative difference): exact f32 matmuls on both sides (f32
# epsilon 6e-8, sums of up to ~2k terms, up to 30 layers of residual stream; measured ≤ 8e-6)
# with room; and the default mode, whose 8-bit activations bound it only loosely (measured
# ≤ 7e-2 on Gemma's layer 17, 0 change on SmolLM2, whose Q4_1 weights are dequantized anyway).
MODES = [(True, 1e-4), (False, 0.2)]


def _inputs(gguf):
    model = os.path.join(CACHE, "models", gguf)
    corpus = os.path.join(CACHE, "corpus", "prose", "eval.jsonl")
    binary = os.environ.get("FATHOM_BIN", os.path.join(ROOT, "target", "release", "fathom"))
    for path, how in [(model, "fathom fetch-models"), (corpus, "fathom fetch-corpus"), (binary, "cargo build --release -p fathom-cli")]:
        if not os.path.exists(path):
            if os.environ.get("FATHOM_REQUIRE_DATA") == "1":
                pytest.fail(f"{path} is missing ({how})")
            pytest.skip(f"{path} is missing ({how})")
    with open(corpus, encoding="utf-8") as f:
        doc = next(d for d in map(json.loads, f) if len(d["text"]) > 20000)
    return model, doc, binary


def gguf_to_hf_order(x):
    """Channels of q/k heads from GGUF's interleaved RoPE pairs (2i, 2i+1) to HF's halves (i, i + D/2)."""
    d = x.shape[-1]
    out = np.empty_like(x)
    out[..., : d // 2] = x[..., 0::2]
    out[..., d // 2 :] = x[..., 1::2]
    return out


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("f32_weights,bound", MODES)
@pytest.mark.parametrize("name,gguf,layers,hf_tokenizer_agrees", MODELS)
def test_the_cpu_runtime_matches_transformers_on_real_weights_and_text(tmp_path, name, gguf, layers,
                                                                       hf_tokenizer_agrees, f32_weights, bound):
    model_path, doc, binary = _inputs(gguf)
    text = tmp_path / "doc.txt"
    text.write_text(doc["text"], encoding="utf-8")
    rust = tmp_path / "rust.safetensors"
    ids_file = tmp_path / "ids.json"
    subprocess.run([binary, "capture", "--model", name, "--text", str(text), "--context", str(N),
                    "--tokens-out", str(ids_file),
                    "--positions", str(P), "--layers", ",".join(map(str, layers)), "--dtype", "f32",
                    "--out", str(rust), "--offline", "--cache-dir", CACHE]
                   + (["--f32-weights"] if f32_weights else []), check=True, capture_output=True)
    info, r = fathom.read_capture(rust)
    d = os.path.dirname(model_path)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=gguf)
    from safetensors import safe_open

    meta = safe_open(str(rust), "np").metadata()
    ids = json.loads(ids_file.read_text())
    assert len(ids) == N
    assert hashlib.sha256(np.array(ids, dtype="<u4").tobytes()).hexdigest() == meta["tokens_sha256"]
    hf_ids = tok(doc["text"]).input_ids[:N]
    assert (hf_ids == ids) is hf_tokenizer_agrees, (name, hf_ids[:8], ids[:8])
    order = gguf_to_hf_order if meta["rope_channel_order"] == "interleaved-pairs" else (lambda x: x)
    assert meta["rope_channel_order"] in ("interleaved-pairs", "neox-halves")
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=gguf, dtype=torch.float32).eval()
    hf, positions, hmeta = capture_model(model, torch.tensor([ids]), P, layers)
    assert positions == info["positions"]
    assert hmeta["layer_kinds"] == info["layer_kinds"] or len(info["layer_kinds"]) == len(layers)
    rows = []
    for l in layers:
        e = {
            "q": rel(order(r[l]["q"]), hf[l]["q"]),
            "k": rel(order(r[l]["k"]), hf[l]["k"]),
            "v": rel(r[l]["v"], hf[l]["v"]),
            "o": rel(r[l]["o"], hf[l]["o"]),
        }
        rows.append((l, e))
        mode = "f32 weights" if f32_weights else "default weights"
        print(f"{name} ({mode}) layer {l}: relative difference runtime vs transformers " + ", ".join(f"{k} {v:.2e}" for k, v in e.items()))
    for l, e in rows:
        for k, v in e.items():
            assert v < bound, (name, f32_weights, l, k, v)
