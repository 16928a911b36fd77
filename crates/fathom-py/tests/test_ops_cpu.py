"""The torch ops and FathomCache without a GPU (CI runs these with CPU torch): the ops are
registered with their schemas, their fake implementations trace under ``make_fx`` (what
``torch.compile`` does) with the engines' output shapes, and bad arguments are ``ValueError``s
naming the argument, raised before anything reaches a cache."""

import pytest

from hf_support import need, qwen3

torch = need("torch")
transformers = need("transformers")
import fathom.ops as fo  # noqa: E402
from fathom.hf import FathomCache  # noqa: E402


def test_the_ops_are_registered_with_the_engines_signatures():
    s = str(torch.ops.fathom.append.default._schema)
    assert s.startswith("fathom::append(Tensor(a0!) cache, SymInt layer, Tensor k, Tensor v, "
                        "Tensor sessions, Tensor positions) -> ()"), s
    s = str(torch.ops.fathom.select.default._schema)
    assert "Tensor q, SymInt layer, Tensor sessions, Tensor seq_lens, str method, SymInt k" in s, s
    assert s.endswith("-> (Tensor, Tensor)"), s
    s = str(torch.ops.fathom.attend.default._schema)
    assert s.endswith("-> Tensor"), s


def test_fake_implementations_trace_a_decode_step():
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(cache, q, k, v, sessions, positions, seq_lens):
        torch.ops.fathom.append(cache, 0, k, v, sessions, positions)
        idx, lens = torch.ops.fathom.select(cache, q, 0, sessions, seq_lens, "fathom:48", 100)
        out = torch.ops.fathom.attend(cache, q, 0, sessions, "fathom:48", 100)
        return idx, lens, out

    bs, hq, hkv, d = 3, 8, 2, 128
    args = (torch.zeros(1, dtype=torch.int64), torch.randn(bs, hq, d, dtype=torch.bfloat16),
            torch.randn(bs, hkv, d), torch.randn(bs, hkv, d),
            torch.arange(bs, dtype=torch.int32), torch.full((bs,), 7, dtype=torch.int32),
            torch.full((bs,), 8, dtype=torch.int32))
    g = make_fx(step, tracing_mode="fake")(*args)
    targets = [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
    assert any("fathom.append" in t for t in targets), targets
    assert any("fathom.select" in t for t in targets), targets
    assert any("fathom.attend" in t for t in targets), targets
    outs = [n for n in g.graph.nodes if n.op == "output"][0].args[0]
    idx, lens, out = (o.meta["val"] for o in outs)
    assert (tuple(idx.shape), idx.dtype) == ((bs, hq, 4 + 32 + 100), torch.int32)
    assert (tuple(lens.shape), lens.dtype) == ((bs, hq), torch.int32)
    assert (tuple(out.shape), out.dtype) == ((bs, hq, d), torch.bfloat16)


def test_torch_compile_traces_the_ops_in_one_graph():
    # fullgraph=True fails on a graph break; aot_eager traces through the fake
    # implementations, then runs the compiled graph, whose op then refuses the handle (no
    # cache lives here): the error is the op's own, raised at run time, after the trace.
    def step(cache, q, sessions):
        return torch.ops.fathom.attend(cache, q, 0, sessions, "exact", 64) * 2

    f = torch.compile(step, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="cache: no live OpsCache has this handle"):
        f(torch.tensor([10 ** 9]), torch.randn(2, 4, 64), torch.arange(2, dtype=torch.int32))


@pytest.mark.parametrize("sessions,positions,err", [
    ([0, 0, 1], [5, 6, 0], None),
    ([0, 1, 0], [5, 0, 6], "sessions: session 0's rows are not adjacent"),
    ([0, 0, 1], [5, 7, 0], "positions: row 1 of session 0 is at 7, want 6"),
    ([0, 0, 1], [-1, 0, 0], "positions: row 0 is at -1"),
])
def test_an_appends_rows_group_by_session(sessions, positions, err):
    s = torch.tensor(sessions, dtype=torch.int32)
    p = torch.tensor(positions, dtype=torch.int64)
    if err is None:
        assert fo.plan_rows(s, p, 3) == [(0, 5, 2), (1, 0, 1)]
    else:
        with pytest.raises(ValueError, match=err):
            fo.plan_rows(s, p, 3)


def test_bad_metadata_names_the_argument():
    ok = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="sessions: dtype torch.float32"):
        fo.plan_rows(torch.zeros(3), ok, 3)
    with pytest.raises(ValueError, match=r"positions: shape \[2\], want \[3\]"):
        fo.plan_rows(ok, torch.zeros(2, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="sessions: want a CPU integer tensor"):
        fo.plan_rows([0, 0, 0], ok, 3)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="sessions: must be a CPU tensor"):
            fo.plan_rows(ok.cuda(), ok, 3)
    # An unknown handle, or not a handle at all, is refused before any cache is touched.
    q = torch.zeros(1, 4, 64)
    with pytest.raises(ValueError, match="cache: no live OpsCache"):
        torch.ops.fathom.attend(torch.tensor([10 ** 9]), q, 0, ok[:1], "exact", 8)
    with pytest.raises(ValueError, match="cache: want an OpsCache's handle"):
        torch.ops.fathom.attend(torch.zeros(2), q, 0, ok[:1], "exact", 8)
    with pytest.raises(ValueError, match="cache: want a fathom.gpu.GpuCache"):
        fo.OpsCache(object())


def test_fathom_cache_refuses_before_generation():
    model = qwen3()
    # A method that needs a calibration, given none; a method outside the grammar.
    with pytest.raises(ValueError, match="calib"):
        FathomCache(model, "fathom:48", k=16)
    with pytest.raises(ValueError):
        FathomCache(model, "nonsense:3", k=16)
    # A CPU model: the paged cache is on the GPU, refused at the first forward by name.
    cache = FathomCache(model, "exact", k=16)
    assert [type(layer).__name__ for layer in cache.layers] == ["FathomLayer"] * 3
    ids = torch.randint(0, 300, (1, 10))
    with pytest.raises(ValueError, match="FathomCache needs a CUDA model"):
        model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    from fathom.hf import restore

    restore(model)
    assert model.config._attn_implementation != "fathom"


def test_the_attention_function_is_sdpa_without_a_fathom_cache():
    # Installed, the function changes nothing for a generation with transformers' own cache.
    model = qwen3().eval()
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
    FathomCache(model, "exact", k=16)
    assert model.config._attn_implementation == "fathom"
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_padding_is_read_from_the_mask_and_must_be_on_the_left():
    from fathom.hf_cache import _real_rows

    # Two rows, a 4-token chunk after 2 earlier positions: row 0 all real, row 1 padded 3.
    q, seen = 4, 6
    m = torch.ones((2, 1, q, seen), dtype=torch.bool)
    m[1, 0, :, :5] = False
    assert _real_rows(m, 2, q, seen) == [4, 1]
    assert _real_rows(None, 3, q, seen) == [4, 4, 4]
    # One mask broadcast over the batch.
    assert _real_rows(torch.ones((1, 1, q, seen), dtype=torch.bool), 2, q, seen) == [4, 4]
    right = torch.ones((1, 1, q, seen), dtype=torch.bool)
    right[0, 0, :, 5] = False
    with pytest.raises(ValueError, match="padding that is not on the left"):
        _real_rows(right, 1, q, seen)
    with pytest.raises(ValueError, match="4-D boolean"):
        _real_rows(torch.zeros((1, 1, q, seen)), 1, q, seen)
