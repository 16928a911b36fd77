"""The GPU API's checks, on the CPU (CI): DLPack tensors are read without copying and a
tensor that is not what a call needs is refused with a ValueError naming the argument; the
cache itself needs a GPU, and without one its construction raises the library's error. The
device tests (torch CUDA tensors against torch's own attention) are in test_gpu_device.py."""

import numpy as np
import pytest

import fathom
import fathom.gpu as fg
from hf_support import need


def test_dlpack_reads_a_numpy_tensor_without_copying():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    info = fg.dlpack_info(a)
    assert info == {"device_type": 1, "device_id": 0, "dtype": "float32", "shape": [2, 3, 4],
                    "contiguous": True}
    t = np.ascontiguousarray(a.transpose(1, 0, 2))
    assert fg.dlpack_info(t)["contiguous"]
    assert not fg.dlpack_info(a.transpose(1, 0, 2))["contiguous"]
    assert fg.dlpack_info(np.zeros((2, 2), np.float16))["dtype"] == "float16"


@pytest.mark.parametrize("arr,shape,dtypes,needle", [
    (np.zeros((2, 3, 4), np.float32), [2, 3, 4], ["float32"], "must be a CUDA tensor; it is on the CPU"),
    ([1.0, 2.0], [2], ["float32"], "not a DLPack tensor"),
])
def test_a_tensor_that_does_not_fit_is_named(arr, shape, dtypes, needle):
    with pytest.raises(ValueError, match="k: ") as e:
        fathom._fathom.check_cuda_tensor("k", arr, shape, dtypes)
    assert needle in str(e.value)


def test_the_cache_needs_a_gpu_and_says_so():
    # Limits are checked before the device is opened.
    with pytest.raises(ValueError, match="D = 100"):
        fg.GpuCache(layers=1, kv_heads=1, group=1, dim=100, max_sessions=1, max_tokens=64,
                    page_tokens=64)
    with pytest.raises(ValueError, match="residency"):
        fg.GpuCache(layers=1, kv_heads=1, group=1, dim=64, max_sessions=1, max_tokens=64,
                    page_tokens=64, residency="disk")
    try:
        import torch
        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    # Without a GPU, device 0 is missing; with one (the device run, where nothing may skip),
    # device 99 is: the same typed error either way.
    with pytest.raises(fathom.FathomError, match="CUDA|cuda"):
        fg.GpuCache(layers=1, kv_heads=1, group=1, dim=64, max_sessions=1, max_tokens=64,
                    page_tokens=64, max_k=32, device=99 if gpu else 0)
    # The PCA index and the block tables (Loki, landmark and Quest) are options of the same
    # constructor, checked the same way.
    with pytest.raises(ValueError, match="D = 100"):
        fg.GpuCache(layers=1, kv_heads=1, group=1, dim=100, max_sessions=1, max_tokens=64,
                    page_tokens=64, pca_index=True, block_tables=True)
    with pytest.raises(fathom.FathomError, match="CUDA|cuda"):
        fg.GpuCache(layers=1, kv_heads=1, group=1, dim=64, max_sessions=1, max_tokens=64,
                    page_tokens=64, max_k=32, device=99 if gpu else 0, pca_index=True,
                    block_tables=True)


@pytest.mark.parametrize("arg", ["layers", "dim", "max_tokens", "page_tokens", "max_k",
                                 "row_cache", "pages", "max_batch"])
def test_a_negative_count_is_a_value_error_naming_it(arg):
    kw = dict(layers=1, kv_heads=1, group=1, dim=64, max_sessions=1, max_tokens=64,
              page_tokens=64)
    kw[arg] = -3
    with pytest.raises(ValueError, match=f"{arg}: -3 is negative"):
        fg.GpuCache(**kw)
    kw[arg] = 2.5
    with pytest.raises(ValueError, match=f"{arg}: 2.5 is not an integer"):
        fg.GpuCache(**kw)


def test_torch_tensors_are_read_through_dlpack():
    torch = need("torch")
    info = fg.dlpack_info(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert info["dtype"] == "bfloat16" and info["shape"] == [2, 3] and info["contiguous"]
    assert not fg.dlpack_info(torch.zeros(4, 5).T)["contiguous"]
    with pytest.raises(ValueError, match="q: must be a CUDA tensor; it is on the CPU"):
        fathom._fathom.check_cuda_tensor("q", torch.zeros(2, 3), [2, 3], ["float32"])
