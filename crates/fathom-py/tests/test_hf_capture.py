"""`fathom.capture` on randomly initialised small Hugging Face models (no hub weights): the
captured q, k, v reproduce the model's own attention output o (docs/SPEC.md §8), for a
Qwen3-style model (QK-norm), a Llama-style one and a Gemma 3-style one (sliding-window layers,
an attention scale that is not 1/√D). Needs torch and transformers: CI installs CPU builds of
both; where neither FATHOM_REQUIRE_TORCH=1 (CI) nor FATHOM_REQUIRE_GPU=1 (the device) asks for
them, these tests skip with the reason, and where one does a missing package fails.
"""

import math
import os

import numpy as np
import pytest

import fathom
from hf_support import gemma3, llama, need, qwen3

torch = need("torch")
transformers = need("transformers")
from fathom.capture import capture_model, main  # noqa: E402

N, P = 160, 8


def reference_o(q, k, v, positions, window=None):
    """Dense softmax attention with scale 1/√D over keys 0..=pos (or pos−W+1..=pos), f64."""
    p, hq, d = q.shape
    g = hq // k.shape[1]
    o = np.zeros(q.shape)
    for i, pos in enumerate(positions):
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(hq):
            s = k[lo : pos + 1, h // g].astype(np.float64) @ q[i, h].astype(np.float64) / math.sqrt(d)
            a = np.exp(s - s.max())
            o[i, h] = (a / a.sum()) @ v[lo : pos + 1, h // g].astype(np.float64)
    return o


@pytest.mark.parametrize("make,qk_norm", [(qwen3, True), (llama, False), (gemma3, True)])
def test_captured_qkv_reproduce_the_models_own_attention_output(tmp_path, make, qk_norm):
    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(0, 300, (1, N))
    layers, positions, meta = capture_model(model, ids, P)
    assert positions == list(range(N - P, N))
    assert meta["qk_norm"] is qk_norm
    kinds = meta["layer_kinds"]
    assert len(kinds) == model.config.num_hidden_layers == len(layers)
    for l, t in layers.items():
        assert t["q"].shape == (P, model.config.num_attention_heads, model.config.head_dim)
        assert t["k"].shape == (N, model.config.num_key_value_heads, model.config.head_dim)
        window = int(kinds[l].split(":")[1]) if kinds[l].startswith("local:") else None
        ref = reference_o(t["q"], t["k"], t["v"], positions, window)
        err = np.linalg.norm(t["o"] - ref) / np.linalg.norm(ref)
        assert err < 1e-5, (make.__name__, l, kinds[l], err)
    if make is gemma3:
        assert meta["q_prescaled"] and kinds[:2] == ["local:24", "local:24"] and kinds[2] == "global"
    path = tmp_path / "cap.safetensors"
    fathom.write_capture(path, layers, positions, make.__name__, qk_norm=meta["qk_norm"],
                         layer_kinds=kinds, dtype="f32")
    doc = fathom.fidelity(path, "dense,exact,sparq:4", k=32)
    assert doc["o_consistency_max"] < 1e-4
    assert doc["layers"] == [l for l, k in enumerate(kinds) if k == "global"]
    by = {m["name"]: m for m in doc["methods"]}
    assert by["dense"]["error"] < 1e-5


def test_the_command_line_writes_a_capture_from_a_saved_model_and_its_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md"), encoding="utf-8").read()
    words = sorted(set(text.split()))[:290]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]"] + words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    torch.manual_seed(1)
    model = qwen3()
    d = tmp_path / "model"
    model.save_pretrained(d)
    fast.save_pretrained(d)
    txt = tmp_path / "text.txt"
    txt.write_text(text, encoding="utf-8")
    out = tmp_path / "cli.safetensors"
    assert main(["--model", str(d), "--text", str(txt), "--context", "128", "--positions", "4",
                 "--out", str(out), "--dtype", "f32", "--layers", "0,2"]) == 0
    info, layers = fathom.read_capture(out)
    assert info["layers"] == [0, 2] and info["n"] == 128 and info["positions"] == [124, 125, 126, 127]
    assert info["qk_norm"] is True
    doc = fathom.fidelity(out, "dense,exact", k=16)
    assert doc["o_consistency_max"] < 1e-4
    with pytest.raises(SystemExit):
        main(["--model", str(d), "--text", str(txt), "--context", "100000", "--positions", "4", "--out", str(out)])
