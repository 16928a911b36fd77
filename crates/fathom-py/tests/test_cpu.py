"""The CPU API of the `fathom` package against plain-numpy references (seeded, several sizes)."""

import math
import os

import numpy as np
import pytest

import fathom


def keys(n, h, d, seed):
    return np.random.default_rng(seed).standard_normal((n, h, d)).astype(np.float32)


def block_max(x):
    """Per 64-token block and (head, channel): the largest |key|, as the fp16 scale rounds it."""
    n = x.shape[0]
    out = np.empty_like(x)
    for b in range(0, n, 64):
        m = np.abs(x[b : b + 64]).max(axis=0).astype(np.float16).astype(np.float32)
        out[b : b + 64] = m
    return out


@pytest.mark.parametrize("n,h,d,seed", [(1, 1, 32, 0), (64, 2, 64, 1), (300, 2, 64, 2), (1000, 3, 128, 3)])
def test_the_four_plane_store_is_within_half_a_step_of_every_key(n, h, d, seed):
    x = keys(n, h, d, seed)
    s = fathom.KeyStore.from_keys(x)
    assert (s.tokens, s.heads, s.dim) == (n, h, d)
    x4 = s.dequant_prefix(4)
    assert x4.shape == x.shape and x4.dtype == np.float32
    # 4 bits: step m/8 over [-m, m), so |x - x̂| <= m/16 (docs/SPEC.md §2), plus the bf16
    # rounding of the stored key (2^-8 relative).
    m = block_max(x)
    assert np.all(np.abs(x - x4) <= m / 16 * (1 + 1e-6) + np.abs(x) * 2.0**-8)


def test_fewer_planes_give_a_coarser_quantizer_and_zero_planes_give_zero():
    x = keys(512, 2, 64, 7)
    s = fathom.KeyStore.from_keys(x)
    errs = [float(np.mean((s.dequant_prefix(t) - x) ** 2)) for t in range(1, 5)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert not np.any(s.dequant_prefix(0))


def test_appends_equal_one_store_of_all_the_keys():
    x = keys(333, 2, 64, 11)
    whole = fathom.KeyStore.from_keys(x)
    grown = fathom.KeyStore.from_keys(x[:10])  # room for 64: the appends must grow it
    for a, b in [(10, 64), (64, 65), (65, 200), (200, 333)]:
        grown.append(x[a:b])
    assert len(grown) == 333
    for t in range(5):
        np.testing.assert_array_equal(grown.dequant_prefix(t), whole.dequant_prefix(t))


def test_a_saved_store_loads_back_and_a_truncated_one_is_an_error(tmp_path):
    x = keys(200, 2, 64, 5)
    s = fathom.KeyStore.from_keys(x)
    p = tmp_path / "k.fks"
    s.save(p)
    np.testing.assert_array_equal(fathom.KeyStore.load(p).dequant_prefix(3), s.dequant_prefix(3))
    data = p.read_bytes()
    (tmp_path / "cut.fks").write_bytes(data[: len(data) // 2])
    with pytest.raises(fathom.FathomError):
        fathom.KeyStore.load(tmp_path / "cut.fks")
    with pytest.raises(fathom.FathomError):
        fathom.KeyStore.load(tmp_path / "missing.fks")


def test_bad_arrays_are_value_errors_naming_the_argument():
    x = keys(100, 2, 64, 1)
    x[3, 1, 5] = np.nan
    with pytest.raises(ValueError, match="keys"):
        fathom.KeyStore.from_keys(x)
    with pytest.raises(ValueError, match="3"):
        fathom.KeyStore.from_keys(np.zeros((4, 64), np.float32))
    s = fathom.KeyStore.from_keys(keys(10, 2, 64, 2))
    with pytest.raises(ValueError, match="shape"):
        s.append(keys(5, 3, 64, 3))
    with pytest.raises(fathom.FathomError):
        s.dequant_prefix(5)


@pytest.mark.parametrize("g,d,seed", [(1, 16, 0), (4, 64, 1), (8, 128, 2)])
def test_importance_is_sigma2_times_the_sum_of_squares(g, d, seed):
    r = np.random.default_rng(seed)
    q = r.standard_normal((g, d)).astype(np.float32)
    s2 = r.uniform(0.1, 3.0, d).astype(np.float32)
    w = fathom.importance(q, s2)
    np.testing.assert_allclose(w, s2 * (q.astype(np.float64) ** 2).sum(0), rtol=1e-6)


@pytest.mark.parametrize("d,budget,seed", [(16, 8.0, 0), (64, 48.0, 1), (128, 48.0, 2), (128, 136.0, 3), (128, 544.0, 4)])
def test_water_filling_spends_at_most_the_budget_and_favours_important_channels(d, budget, seed):
    w = np.random.default_rng(seed).lognormal(0.0, 1.5, d).astype(np.float32)
    depths, bits = fathom.water_fill(w, budget)
    assert depths.dtype == np.uint8 and depths.shape == (d,)
    assert depths.max() <= 4
    active = int((depths > 0).sum())
    assert math.isclose(bits, float(depths.sum()) + 0.25 * active, abs_tol=1e-6)
    assert bits <= budget + 1e-6
    if budget >= 4.25 * d:
        assert np.all(depths == 4)
    # A more important channel is never read shallower than a less important one.
    order = np.argsort(-w, kind="stable")
    assert np.all(np.diff(depths[order].astype(int)) <= 0)


def test_an_impossible_budget_is_an_error():
    with pytest.raises(fathom.FathomError):
        fathom.water_fill(np.ones(8, np.float32), -1.0)
    with pytest.raises(fathom.FathomError, match="out of range"):
        fathom.water_fill(np.ones(128, np.float32), 600.0)  # past 4.25 bits × 128 channels
    with pytest.raises(ValueError, match="importance"):
        fathom.water_fill(np.array([1.0, np.inf, 2.0]), 4.0)


def dense_attention(q, k, v, positions):
    """Softmax attention of each query row over keys 0..=position, GQA, scale 1/sqrt(D)."""
    p, hq, d = q.shape
    g = hq // k.shape[1]
    o = np.zeros_like(q, dtype=np.float64)
    for i, pos in enumerate(positions):
        for h in range(hq):
            kk = k[: pos + 1, h // g].astype(np.float64)
            s = kk @ q[i, h].astype(np.float64) / math.sqrt(d)
            a = np.exp(s - s.max())
            o[i, h] = (a / a.sum()) @ v[: pos + 1, h // g].astype(np.float64)
    return o.astype(np.float32)


def small_capture(path, n=512, hkv=2, g=2, d=64, seed=0, dtype="f32", with_o=True):
    r = np.random.default_rng(seed)
    positions = [200, 350, n - 1]
    layers = {}
    for l in (0, 2):
        q = r.standard_normal((len(positions), hkv * g, d)).astype(np.float32)
        k = r.standard_normal((n, hkv, d)).astype(np.float32)
        v = r.standard_normal((n, hkv, d)).astype(np.float32)
        layers[l] = {"q": q, "k": k, "v": v}
        if with_o:
            layers[l]["o"] = dense_attention(q, k, v, positions)
    fathom.write_capture(path, layers, positions, "test-random", dtype=dtype,
                         layer_kinds=["global", "local:128", "global"])
    return layers, positions


def test_a_written_capture_reads_back(tmp_path):
    p = tmp_path / "c.safetensors"
    layers, positions = small_capture(p)
    info, got = fathom.read_capture(p)
    assert info["model"] == "test-random" and info["positions"] == positions
    assert info["layers"] == [0, 2] and (info["n"], info["hq"], info["hkv"], info["d"]) == (512, 4, 2, 64)
    for l in (0, 2):
        for part in "qkvo":
            np.testing.assert_array_equal(got[l][part], layers[l][part])
    q = tmp_path / "b.safetensors"
    small_capture(q, dtype="bf16")
    _, b = fathom.read_capture(q)
    np.testing.assert_allclose(b[0]["k"], layers[0]["k"], rtol=2.0**-8)


def test_bad_captures_are_refused_before_anything_is_written(tmp_path):
    p = tmp_path / "bad.safetensors"
    q = np.zeros((2, 4, 64), np.float32)
    k = np.zeros((100, 2, 64), np.float32)
    with pytest.raises(ValueError, match="positions"):
        fathom.write_capture(p, {0: {"q": q, "k": k, "v": k}}, [10, 200], "m")
    with pytest.raises(ValueError, match=r"layers\[0\]\.v"):
        fathom.write_capture(p, {0: {"q": q, "k": k, "v": k[:50]}}, [10, 20], "m")
    k2 = k.copy()
    k2[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="not finite"):
        fathom.write_capture(p, {0: {"q": q, "k": k2, "v": k}}, [10, 20], "m")
    with pytest.raises(ValueError, match="no v"):
        fathom.write_capture(p, {0: {"q": q, "k": k}}, [10, 20], "m")
    assert not p.exists()
    with pytest.raises(fathom.FathomError):
        fathom.read_capture(tmp_path / "missing.safetensors")


def test_fidelity_returns_the_document_fathom_fidelity_writes(tmp_path):
    p = tmp_path / "c.safetensors"
    small_capture(p)
    cal = tmp_path / "cal.json"
    assert fathom.calibrate(p, cal, targets=[48.0], k=64) in ("Raw", "Klt")
    assert cal.exists() and (tmp_path / "cal-summary.json").exists()
    doc = fathom.fidelity(p, "dense,exact,fathom:48,sparq:16,ds:16,quest", k=64, calib=cal)
    assert doc["kind"] == "fidelity"
    by = {m["name"]: m for m in doc["methods"]}
    assert set(by) >= {"dense", "exact", "fathom:48", "sparq:16", "ds:16", "quest"}
    assert by["dense"]["error"] < 1e-5
    assert by["fathom:48"]["bits"] <= 48.0 + 1e-9
    for m in by.values():
        assert math.isfinite(m["error"]) and m["error"] >= 0.0
    # Exact top-k of 64 of up to 512 random keys: a real but partial approximation.
    assert 0.0 < by["exact"]["error"] < 1.0
    # The capture's own o is dense attention of its q, k, v (docs/SPEC.md §8 consistency).
    assert doc["o_consistency_max"] < 1e-4
    # Only the global layers are evaluated; the local one (layer 1) is absent from the file.
    assert doc["layers"] == [0, 2]
    # Methods without a calibration need none.
    plain = fathom.fidelity(p, "exact,sparq:16", k=64)
    assert {m["name"] for m in plain["methods"]} == {"exact", "sparq:16"}


def test_fidelity_errors_name_the_problem(tmp_path):
    p = tmp_path / "c.safetensors"
    small_capture(p, with_o=False)
    with pytest.raises(fathom.FathomError, match="sparq:9999"):
        fathom.fidelity(p, "exact,sparq:9999")
    with pytest.raises(fathom.FathomError, match="out of range"):
        fathom.fidelity(p, "exact", k=100000)
    with pytest.raises(fathom.FathomError, match="fathom-layer"):
        fathom.fidelity(p, "fathom-layer:48")
    with pytest.raises(fathom.FathomError, match="sigma2"):
        fathom.fidelity(p, "fathom:48")  # Fathom plans need σ² (fathom.calibrate)
    with pytest.raises(fathom.FathomError, match="out of range"):
        fathom.calibrate(p, tmp_path / "c.json", targets=[1000.0])
    with pytest.raises(ValueError, match="basis"):
        fathom.fidelity(p, "exact", basis="pca")


def test_the_version_is_the_workspace_version():
    here = os.path.dirname(__file__)
    text = open(os.path.join(here, "..", "..", "..", "Cargo.toml")).read()
    ws = text.split("[workspace.package]")[1]
    want = ws.split('version = "')[1].split('"')[0]
    assert fathom.__version__ == want


@pytest.mark.parametrize("hkv,g,d,n,seed", [(1, 1, 16, 50, 0), (2, 3, 32, 130, 1), (2, 2, 64, 300, 2)])
def test_a_dense_decoder_attends_like_numpy_and_exact_over_every_key_is_dense(hkv, g, d, n, seed):
    r = np.random.default_rng(seed)
    k = r.standard_normal((n, hkv, d)).astype(np.float32)
    v = r.standard_normal((n, hkv, d)).astype(np.float32)
    dense = fathom.Decoder("dense", 1, hkv, d, 16)
    every = fathom.Decoder("exact", 1, hkv, d, n)
    small = fathom.Decoder("exact", 1, hkv, d, 8, capacity=8)  # its stores grow as it goes
    for dec in (dense, every, small):
        dec.append(0, k[: n - 5], v[: n - 5])
    for pos in range(n - 5, n):
        q = r.standard_normal((hkv * g, d)).astype(np.float32)
        for dec in (dense, every, small):
            dec.append(0, k[pos : pos + 1], v[pos : pos + 1])
        assert dense.tokens(0) == pos + 1
        want = dense_attention(q[None], k, v, [pos])[0]
        np.testing.assert_allclose(dense.attend(0, q), want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(every.attend(0, q), want, rtol=1e-4, atol=1e-5)
        small.attend(0, q)
    assert dense.is_dense and not every.is_dense
    assert every.density == pytest.approx(1.0) and small.density < 1.0
    # Keeping every key, each step's union is the whole prefix; 8192 slots hold all of the
    # previous step's rows (the first step starts from an empty cache).
    rows = hkv * sum(p + 1 for p in range(n - 5, n))
    held = hkv * sum(p for p in range(n - 4, n))
    assert every.row_cache[-1] == (8192, rows, held)
    assert [c[0] for c in every.row_cache] == [64, 256, 1024, 8192]
    assert dense.row_cache == []


def test_decoder_bad_calls_are_errors():
    dec = fathom.Decoder("exact", 2, 2, 16, 8)
    with pytest.raises(ValueError, match="no tokens"):
        dec.attend(0, np.zeros((2, 16), np.float32))
    with pytest.raises(ValueError, match="layer"):
        dec.append(5, np.zeros((1, 2, 16), np.float32), np.zeros((1, 2, 16), np.float32))
    with pytest.raises(ValueError, match="Hkv"):
        dec.append(0, np.zeros((1, 3, 16), np.float32), np.zeros((1, 3, 16), np.float32))
    with pytest.raises(fathom.FathomError, match="sparq:99"):
        fathom.Decoder("sparq:99", 1, 2, 16, 8)
    with pytest.raises(ValueError, match="one"):
        fathom.Decoder("dense,exact", 1, 2, 16, 8)


# Bad input is a ValueError naming the argument, before any work or write (review items).


def test_an_absurd_capacity_is_a_value_error_before_anything_is_allocated():
    small = np.zeros((4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="capacity"):
        fathom.KeyStore.from_keys(small, capacity=2**62)  # was a PanicException
    with pytest.raises(ValueError, match="capacity"):
        fathom.KeyStore.from_keys(small, capacity=2**41)
    # 2^34 tokens of 8 × 128 channels: ~9 TB, past any machine's memory (was an abort).
    with pytest.raises(ValueError, match="capacity.*memory"):
        fathom.KeyStore.from_keys(np.zeros((4, 8, 128), np.float32), capacity=2**34)
    with pytest.raises(ValueError, match="capacity"):
        fathom.Decoder("exact", 1, 8, 128, 8, capacity=2**34)
    assert fathom.KeyStore.from_keys(small, capacity=1000).tokens == 4


def test_decoder_shapes_must_be_the_documented_ones():
    dec = fathom.Decoder("dense", 1, 2, 16, 8)
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    with pytest.raises(ValueError, match="^keys: shape"):
        dec.append(0, z(1, 4, 8), z(1, 4, 8))  # Hkv·D fits, the shape does not
    with pytest.raises(ValueError, match="^values: shape"):
        dec.append(0, z(2, 2, 16), z(1, 4, 16))
    with pytest.raises(ValueError, match="^values: shape"):
        dec.append(0, z(2, 2, 16), z(1, 2, 16))
    assert dec.tokens(0) == 0
    dec.append(0, np.ones((3, 2, 16), np.float32), np.ones((3, 2, 16), np.float32))
    with pytest.raises(ValueError, match="^q: shape"):
        dec.attend(0, np.ones((8, 8), np.float32))  # D = 8 of a D = 16 decoder
    with pytest.raises(ValueError, match="^q: shape"):
        dec.attend(0, np.ones((3, 16), np.float32))  # Hq not a multiple of Hkv
    with pytest.raises(ValueError, match="^q: shape"):
        dec.attend(0, np.ones((0, 16), np.float32))
    assert dec.attend(0, np.ones((4, 16), np.float32)).shape == (4, 16)


def test_write_capture_writes_nothing_its_reader_would_refuse(tmp_path):
    p = tmp_path / "c.safetensors"
    r = np.random.default_rng(0)
    q = r.standard_normal((1, 2, 16)).astype(np.float32)
    k = r.standard_normal((10, 2, 16)).astype(np.float32)
    one = {0: {"q": q, "k": k, "v": k}}
    for bad in (float("nan"), -1.0, 0.0, float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            fathom.write_capture(p, one, [5], "m", softcap=bad)
    with pytest.raises(ValueError, match="layer_kinds"):
        fathom.write_capture(p, {0: one[0], 3: one[0]}, [5], "m", layer_kinds=["global", "global"])
    big = k.copy()
    big[2, 1, 3] = 7.0e4  # past f16's 65504: stored as infinity, which the reader refuses
    with pytest.raises(ValueError, match=r"layers\[0\]\.k.*f16"):
        fathom.write_capture(p, {0: {"q": q, "k": big, "v": k}}, [5], "m", dtype="f16")
    big[2, 1, 3] = 3.4e38  # past bf16's largest
    with pytest.raises(ValueError, match=r"layers\[0\]\.k.*bf16"):
        fathom.write_capture(p, {0: {"q": q, "k": big, "v": k}}, [5], "m")
    assert not p.exists()
    # What is written reads back: f32 holds 7e4, f16 the largest finite value.
    big[2, 1, 3] = 7.0e4
    fathom.write_capture(p, {0: {"q": q, "k": big, "v": k}}, [5], "m", dtype="f32", softcap=30.0)
    info, layers = fathom.read_capture(p)
    assert info["softcap"] == 30.0 and layers[0]["k"][2, 1, 3] == np.float32(7.0e4)
    big[2, 1, 3] = 65504.0
    fathom.write_capture(p, {0: {"q": q, "k": big, "v": k}}, [5], "m", dtype="f16")
    assert fathom.read_capture(p)[1][0]["k"][2, 1, 3] == 65504.0


def test_fidelity_defaults_to_the_basis_fathom_fidelity_uses(tmp_path):
    # Keys of rank 4 in 64 channels: the KLT concentrates them, so the basis rule picks it
    # and a Fathom plan reads differently in the raw channels.
    r = np.random.default_rng(3)
    n, hkv, g, d = 512, 2, 2, 64
    positions = [200, 350, n - 1]
    layers = {}
    for l in (0, 1):
        mix = r.standard_normal((hkv, 4, d)).astype(np.float32)
        k = np.einsum("nhr,hrd->nhd", r.standard_normal((n, hkv, 4)), mix).astype(np.float32)
        k += 0.01 * r.standard_normal(k.shape).astype(np.float32)
        v = r.standard_normal((n, hkv, d)).astype(np.float32)
        q = np.einsum("phr,hrd->phd", r.standard_normal((3, hkv * g, 4)),
                      np.repeat(mix, g, axis=0)).astype(np.float32)
        layers[l] = {"q": q, "k": k, "v": v}
    p = tmp_path / "c.safetensors"
    fathom.write_capture(p, layers, positions, "low-rank", dtype="f32")
    cal = tmp_path / "cal.json"
    assert fathom.calibrate(p, cal, targets=[16.0], k=32) == "Klt"
    err = lambda doc: [m["error"] for m in doc["methods"]]  # noqa: E731
    default = fathom.fidelity(p, "fathom:16", k=32, calib=cal)
    assert err(default) == err(fathom.fidelity(p, "fathom:16", k=32, calib=cal, basis="auto"))
    assert err(default) == err(fathom.fidelity(p, "fathom:16", k=32, calib=cal, basis="klt"))
    assert err(default) != err(fathom.fidelity(p, "fathom:16", k=32, calib=cal, basis="raw"))


def test_wrong_dtypes_and_negative_counts_are_value_errors_naming_the_argument(tmp_path):
    dec = fathom.Decoder("dense", 2, 2, 16, 8)
    f32 = np.ones((3, 2, 16), np.float32)
    dec.append(0, f32, f32)
    with pytest.raises(ValueError, match="q.*float64"):
        dec.attend(0, np.ones((2, 16)))  # was a TypeError "cannot be cast"
    with pytest.raises(ValueError, match="keys.*float64"):
        dec.append(0, np.ones((3, 2, 16)), f32)
    with pytest.raises(ValueError, match="values"):
        dec.append(0, f32, [[1.0]])
    for call in (lambda: dec.attend(-1, np.ones((2, 16), np.float32)),
                 lambda: dec.append(-1, f32, f32), lambda: dec.tokens(-1)):
        with pytest.raises(ValueError, match="layer.*negative"):
            call()
    s = fathom.KeyStore.from_keys(f32)
    with pytest.raises(ValueError, match="t.*negative"):
        s.dequant_prefix(-1)  # was an OverflowError
    with pytest.raises(ValueError, match="capacity.*negative"):
        fathom.KeyStore.from_keys(f32, capacity=-1)
    with pytest.raises(ValueError, match="capacity"):
        fathom.KeyStore.from_keys(f32, capacity=2.5)
    for arg in ("layers", "kv_heads", "dim", "k", "capacity", "sink", "local"):
        kw = dict(method="exact", layers=1, kv_heads=2, dim=16, k=8)
        kw[arg] = -1
        with pytest.raises(ValueError, match=f"{arg}.*negative"):
            fathom.Decoder(**kw)
    q = np.zeros((1, 2, 16), np.float32)
    k = np.zeros((10, 2, 16), np.float32)
    with pytest.raises(ValueError, match="positions.*negative"):
        fathom.write_capture(tmp_path / "c.safetensors", {0: {"q": q, "k": k, "v": k}}, [-1], "m")
    with pytest.raises(ValueError, match="layers.*negative"):
        fathom.write_capture(tmp_path / "c.safetensors", {-1: {"q": q, "k": k, "v": k}}, [1], "m")
    with pytest.raises(ValueError, match="k.*negative"):
        fathom.fidelity(tmp_path / "c.safetensors", "exact", k=-1)
    assert not (tmp_path / "c.safetensors").exists()


def test_complex_and_non_numeric_arrays_are_refused():
    with pytest.raises(ValueError, match="keys.*complex"):
        fathom.KeyStore.from_keys(np.ones((4, 2, 8), np.complex64))  # was the real part
    with pytest.raises(ValueError, match="queries.*complex"):
        fathom.importance(np.ones((2, 8)) + 1j, np.ones(8))
    with pytest.raises(ValueError, match="importance"):
        fathom.water_fill(np.array(["1.0", "2.0"]), 4.0)  # strings are not numbers
    # Integer and bool arrays are real: converted.
    assert fathom.KeyStore.from_keys(np.ones((4, 2, 8), np.int64)).tokens == 4


def test_a_decoder_that_would_fail_at_its_first_step_is_refused_at_construction():
    for m in ("fathom:48", "ds:8", "loki:8"):
        # A missing argument is bad input: a plain ValueError naming it, not the library's
        # FathomError (which an unknown or out-of-range method item is).
        with pytest.raises(ValueError, match="^calib: ") as e:
            fathom.Decoder(m, 1, 2, 16, 8)
        assert not isinstance(e.value, fathom.FathomError)
    for bad in (float("nan"), 0.0, -5.0, float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            fathom.Decoder("exact", 1, 2, 16, 8, softcap=bad)
    with pytest.raises(ValueError, match="k, sink and local"):
        fathom.Decoder("exact", 1, 2, 16, 0, sink=0, local=0)
    # Dense attends every key whatever k is; softcap 30 is a softcap.
    dense = fathom.Decoder("dense", 1, 2, 16, 0, sink=0, local=0, softcap=30.0)
    dense.append(0, np.ones((3, 2, 16), np.float32), np.ones((3, 2, 16), np.float32))
    np.testing.assert_allclose(dense.attend(0, np.ones((2, 16), np.float32)), 1.0, rtol=1e-6)


def test_the_readme_device_log_counts_are_the_logs():
    import re

    here = os.path.dirname(os.path.abspath(__file__))
    text = " ".join(open(os.path.join(here, "..", "README.md")).read().split())
    logs = os.path.join(here, "..", "..", "..", "results", "device", "py")
    claims = re.findall(r"(pytest-device[\w.-]*\.log)`? \((\d+) passed(?:, (\d+) skipped)?", text)
    assert claims, "the README names its device logs with their counts"
    for name, passed, skipped in claims:
        path = os.path.join(logs, name)
        if not os.path.exists(path):
            pytest.skip(f"{path} is not in this checkout")
        last = re.findall(r"(\d+) passed(?:, (\d+) skipped)?", open(path).read())[-1]
        assert (passed, skipped or "0") == (last[0], last[1] or "0"), name


def test_fathom_hf_refuses_a_decoder_that_would_fail_before_generation():
    from types import SimpleNamespace

    import fathom.hf

    config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, hidden_size=64)
    with pytest.raises(ValueError, match="calib"):
        fathom.hf.FathomAttention("fathom:48", k=8).check(config)
    with pytest.raises(ValueError, match="k, sink and local"):
        fathom.hf.FathomAttention("exact", k=0, sink=0, local=0).check(config)
    with pytest.raises(ValueError, match="softcap"):
        fathom.hf.FathomAttention("exact", k=8).check(SimpleNamespace(**vars(config), attn_logit_softcapping=0.0))
    fathom.hf.FathomAttention("exact", k=8).check(config)
    # The GPU path checks the same before it makes its cache (here: before any GPU is needed).
    with pytest.raises(ValueError, match="calib"):
        fathom.hf.FathomAttention("ds:8", k=8, device="cuda").check(
            SimpleNamespace(**{**vars(config), "head_dim": 64}))
