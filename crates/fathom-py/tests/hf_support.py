"""Shared by the Hugging Face tests: the torch/transformers requirement and the random models."""

import importlib
import os

import pytest


# Where torch and transformers must be: the device (FATHOM_REQUIRE_GPU=1) and CI, which
# installs CPU torch and transformers (FATHOM_REQUIRE_TORCH=1, set by .ci/run).
TORCH = ("FATHOM_REQUIRE_GPU", "FATHOM_REQUIRE_TORCH")


def need(name, required_by=TORCH, why="pip install torch transformers; .ci/run installs them"):
    """Imports `name`, or skips the calling test (module) with the reason; with any of the
    `required_by` variables set to 1 a missing module is a failure instead, so that no run
    which promises the packages skips for want of one."""
    try:
        return importlib.import_module(name)
    except ImportError:
        required_by = (required_by,) if isinstance(required_by, str) else required_by
        if any(os.environ.get(v) == "1" for v in required_by):
            raise
        pytest.skip(f"{name} is not installed ({why})", allow_module_level=True)


def need_gpu(torch):
    """Skips the calling test module without a CUDA GPU (as on CI); with FATHOM_REQUIRE_GPU=1
    its absence is a failure instead, so that no device run skips."""
    if not torch.cuda.is_available():
        if os.environ.get("FATHOM_REQUIRE_GPU") == "1":
            raise RuntimeError("FATHOM_REQUIRE_GPU=1 and torch sees no GPU")
        pytest.skip("no GPU (torch.cuda.is_available() is False)", allow_module_level=True)


def qwen3():
    """A random Qwen3-style model: QK-norm, GQA 4/2, D = 32."""
    import transformers

    c = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return transformers.Qwen3ForCausalLM(c)


def llama():
    """A random Llama-style model: no QK-norm, GQA 6/2, D = 16."""
    import transformers

    c = transformers.LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    return transformers.LlamaForCausalLM(c)


def gemma3():
    """A random Gemma 3-style model: two sliding-window layers (W = 24) then a global one, and an
    attention scale that is not 1/sqrt(D) (query_pre_attn_scalar = 64, D = 32)."""
    import transformers

    c = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                      sliding_window=24, layer_types=["sliding_attention", "sliding_attention",
                                                                       "full_attention"],
                                      query_pre_attn_scalar=64)
    return transformers.Gemma3ForCausalLM(c)
