"""`fathom.hf.generate` on randomly initialised small Hugging Face models: dense through
Fathom's decoder gives HF's own tokens; exact top-k that keeps every key is dense; a Fathom
budget reads at most its bits; bad calls fail before generation. Needs torch and
transformers (CI installs both; with FATHOM_REQUIRE_TORCH=1 or FATHOM_REQUIRE_GPU=1 a missing
one fails, elsewhere it skips with the reason).
"""

import pytest

import fathom
from hf_support import gemma3, llama, need, qwen3

torch = need("torch")
transformers = need("transformers")
import fathom.hf  # noqa: E402
from fathom.capture import capture_model  # noqa: E402

PROMPT, NEW = 120, 12


def plain(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, use_cache=True)


@pytest.mark.parametrize("make", [qwen3, llama, gemma3])
def test_dense_through_fathom_generates_the_models_own_tokens(make):
    torch.manual_seed(2)
    model = make().eval()
    ids = torch.randint(0, 300, (1, PROMPT))
    want = plain(model, ids)
    got, att = fathom.hf.generate(model, ids, "dense", k=16, max_new_tokens=NEW)
    assert torch.equal(got, want), (make.__name__, got[0, PROMPT:].tolist(), want[0, PROMPT:].tolist())
    assert att.steps > 0 and att.density == 1.0
    # The model's own attention is back after the call.
    assert model.config._attn_implementation == "sdpa"


def test_exact_top_k_over_every_key_is_dense_and_a_small_k_reads_a_fraction():
    torch.manual_seed(3)
    model = qwen3().eval()
    ids = torch.randint(0, 300, (1, PROMPT))
    want = plain(model, ids)
    got, att = fathom.hf.generate(model, ids, "exact", k=PROMPT + NEW, max_new_tokens=NEW)
    assert torch.equal(got, want)
    assert att.density == pytest.approx(1.0)
    _, small = fathom.hf.generate(model, ids, "exact", k=16, max_new_tokens=NEW)
    assert small.density < 0.5


def test_fathom_with_a_calibration_of_the_same_model_reads_at_most_its_budget(tmp_path):
    torch.manual_seed(4)
    model = qwen3().eval()
    cal_ids = torch.randint(0, 300, (1, 256))
    layers, positions, meta = capture_model(model, cal_ids, 32)
    cap = tmp_path / "cal.safetensors"
    fathom.write_capture(cap, layers, positions, "qwen3-random", qk_norm=True,
                         layer_kinds=meta["layer_kinds"], dtype="f32")
    cal = tmp_path / "cal.json"
    fathom.calibrate(cap, cal, targets=[48.0], k=32)
    ids = torch.randint(0, 300, (1, PROMPT))
    want = plain(model, ids)
    got, att = fathom.hf.generate(model, ids, "fathom:48", k=32, calib=cal, max_new_tokens=NEW)
    assert 0.0 < att.mean_bits <= 48.0
    assert att.density < 1.0
    assert [c[0] for c in att.row_cache] == [64, 256, 1024, 8192]
    assert all(0 < rows and 0 <= hits <= rows for _, rows, hits in att.row_cache)
    agree = float((got[0, PROMPT:] == want[0, PROMPT:]).float().mean())
    print(f"fathom:48 k=32: {agree:.2f} of {NEW} tokens as dense, {att.mean_bits:.1f} bits, density {att.density:.3f}")


def test_bad_calls_fail_before_generation(tmp_path, monkeypatch):
    model = qwen3().eval()
    ids = torch.randint(0, 300, (1, PROMPT))

    def no_generation(*args, **kwargs):
        raise AssertionError("model.generate ran; the bad call should have failed before it")

    monkeypatch.setattr(model, "generate", no_generation)
    # The library's refusal (a method item past the grammar's limits) is fathom.FathomError.
    with pytest.raises(fathom.FathomError, match="sparq:9999"):
        fathom.hf.generate(model, ids, "sparq:9999", k=16)
    # A missing argument is bad input, as the package README says: a plain ValueError naming
    # it (Fathom plans need a calibration; the decoder is built before generation and refuses).
    with pytest.raises(ValueError, match="^calib: method \"fathom:48\" needs a calibration") as e:
        fathom.hf.generate(model, ids, "fathom:48", k=16, max_new_tokens=2)
    assert not isinstance(e.value, fathom.FathomError)
    with pytest.raises(ValueError, match="batch"):
        fathom.hf.generate(model, ids.repeat(2, 1), "dense", k=16)
    with pytest.raises(ValueError, match="one"):
        fathom.hf.generate(model, ids, "dense,exact", k=16)
    assert model.config._attn_implementation == "sdpa"
