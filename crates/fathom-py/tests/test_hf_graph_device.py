"""GraphedDecode on the device (docs/SPEC.md §6.1, "Graphs"): greedy decoding with the whole
step (forward, the cache's appends and attends, argmax) one CUDA graph replay gives the
tokens of the same FathomCache decoding eagerly through transformers' generate, on random
Qwen3- and Llama-style models, for a batch of 2 left-padded prompts of different lengths,
with exact and sparq:32; the cache's counters then match the eager run's; the `generate`
helper (prefill, then the replays) returns what `model.generate` does. Skips without a
GPU (as on CI); FATHOM_REQUIRE_GPU=1 fails instead."""


import pytest

from hf_support import need, need_gpu

torch = need("torch")
transformers = need("transformers")
from fathom.hf import FathomCache  # noqa: E402
from fathom.hf_graph import GraphedDecode, generate  # noqa: E402

need_gpu(torch)

from test_hf_cache_device import model  # noqa: E402  (the random models of the eager tests)


def prompts(vocab: int, lens, seed: int = 5):
    """Left-padded random prompts and their mask."""
    g = torch.Generator().manual_seed(seed)
    n = max(lens)
    ids = torch.zeros((len(lens), n), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, m in enumerate(lens):
        ids[b, n - m:] = torch.randint(10, vocab, (m,), generator=g)
        mask[b, n - m:] = 1
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("method", ["exact", "sparq:32"])
def test_graph_replays_give_the_eager_caches_tokens(arch, method):
    m = model(arch)
    # GraphedDecode never stops at an end token; nor may the reference (Llama's config has one).
    m.generation_config.eos_token_id = None
    ids, mask = prompts(m.config.vocab_size, [200, 140])
    new = 16
    with torch.no_grad():
        eager = FathomCache(m, method, k=64, max_tokens=256)
        ref = m.generate(ids, attention_mask=mask, past_key_values=eager, max_new_tokens=new + 1,
                         do_sample=False, pad_token_id=0)[:, ids.shape[1]:]
        cache = FathomCache(m, method, k=64, max_tokens=256)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = m(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits
        first = logits[:, -1].argmax(-1)
        steps = GraphedDecode(m, cache)
        got = torch.cat([first[:, None], steps.generate(first, new)], dim=1)
    assert got.tolist() == ref.tolist()
    # The host's counters as the eager run left them: a replay runs no Python, step() counts.
    assert cache.get_seq_length() == eager.get_seq_length()
    assert [cache.gpu.len(s) for s in cache.sessions] == [eager.gpu.len(s) for s in eager.sessions]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_generate_helper_is_greedy_generate(arch):
    """fathom.hf_graph.generate returns what model.generate returns through the same kind of
    cache, the left-padded prompt included."""
    m = model(arch)
    m.generation_config.eos_token_id = None
    ids, mask = prompts(m.config.vocab_size, [180, 120], seed=7)
    with torch.no_grad():
        ref = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                         pad_token_id=0,
                         past_key_values=FathomCache(m, "exact", k=64, max_tokens=256))
    got = generate(m, ids, FathomCache(m, "exact", k=64, max_tokens=256), 12,
                   attention_mask=mask)
    assert got.tolist() == ref.tolist()


def test_a_step_before_its_capture_is_refused():
    m = model("llama")
    ids, mask = prompts(m.config.vocab_size, [64])
    cache = FathomCache(m, "exact", k=64, max_tokens=128)
    with torch.no_grad():
        m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    with pytest.raises(ValueError, match=r"capture\(tokens\) first"):
        GraphedDecode(m, cache).step()
