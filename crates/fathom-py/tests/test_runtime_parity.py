"""The project's CPU model runtime (`fathom capture`, fathom-model) against Hugging Face
transformers on the same real weights and real text: SmolLM2-135M-Instruct from the pinned
GGUF (`fathom fetch-models`; transformers dequantizes it), the first 1024
tokens of a Django documentation page from the pinned prose corpus (`fathom fetch-corpus`).
Both tokenize the text to the same ids (checked by the capture's `tokens_sha256`), and the q,
k, v and o of three layers agree (q and k after mapping GGUF's interleaved RoPE pairs to HF's
halves where the capture says it keeps them). Gemma 3 270M is not compared: transformers'
tokenizer built from its GGUF does not give the runtime's ids for this text (the capture's
`tokens_sha256` differs), so the two would not see the same sequence.

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
MODELS = [("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf", [0, 15, 29])]


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


@pytest.mark.parametrize("name,gguf,layers", MODELS)
def test_the_cpu_runtime_matches_transformers_on_real_weights_and_text(tmp_path, name, gguf, layers):
    model_path, doc, binary = _inputs(gguf)
    text = tmp_path / "doc.txt"
    text.write_text(doc["text"], encoding="utf-8")
    rust = tmp_path / "rust.safetensors"
    subprocess.run([binary, "capture", "--model", name, "--text", str(text), "--context", str(N),
                    "--positions", str(P), "--layers", ",".join(map(str, layers)), "--dtype", "f32",
                    "--out", str(rust), "--offline", "--cache-dir", CACHE], check=True, capture_output=True)
    info, r = fathom.read_capture(rust)
    d = os.path.dirname(model_path)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=gguf)
    from safetensors import safe_open

    meta = safe_open(str(rust), "np").metadata()
    want = meta["tokens_sha256"]
    # The runtime's ids: the text's tokens, with the tokenizer's special tokens or without.
    ids = next((x for x in (tok(doc["text"]).input_ids[:N], tok(doc["text"], add_special_tokens=False).input_ids[:N])
                if hashlib.sha256(np.array(x, dtype="<u4").tobytes()).hexdigest() == want), None)
    assert ids is not None, "the tokenizers disagree"
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
        print(f"{name} layer {l}: relative difference runtime vs transformers " + ", ".join(f"{k} {v:.2e}" for k, v in e.items()))
    # Both run the same dequantized weights in f32 with different summation orders (f32
    # epsilon 6e-8, sums of up to ~1.5k terms, 30 layers of residual stream): measured ≤ 6e-6
    # on SmolLM2. 1e-4 bounds it with room; a wrong RoPE, norm, scale or GQA mapping gives
    # differences of order 1.
    for l, e in rows:
        for k, v in e.items():
            assert v < 1e-4, (name, l, k, v)
