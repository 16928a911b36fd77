"""Shared by the Hugging Face tests: the torch/transformers requirement and the random models."""

import importlib
import os

import pytest


def need(name, required_by="FATHOM_REQUIRE_GPU", why="CI has no torch; the device does"):
    """Imports `name`, or skips the calling test module with the reason; with `required_by`
    set to 1 (FATHOM_REQUIRE_GPU=1 on the device, where torch and transformers are) a missing
    module is a failure instead."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if os.environ.get(required_by) == "1":
            raise
        pytest.skip(f"{name} is not installed ({why})", allow_module_level=True)


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
