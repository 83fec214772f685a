"""DLPack and CUDA Array Interface against real consumers and producers (gpu)."""


import numpy as np
import pytest

import sharedmem as sm

from conftest import gc_collect_harder

pytestmark = pytest.mark.gpu
N = 1 << 18


def slow_written(gpu, value, ms=30):
    """A buffer whose value is written by a slow kernel still running on its stream."""
    import gpu_kernels as K
    s = gpu.create_stream("producer")
    b = sm.Buffer.zeros(N, "float32", device=gpu, stream=s)
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(b), N, float(value),
              np.int64(K.cycles(ms)), stream=s)
    return sm.Tensor.from_buffer(b, (N,))


def test_cupy_from_dlpack(gpu):
    import cupy as cp
    t = slow_written(gpu, 3.0)
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        arr = cp.from_dlpack(t)
        total = float(arr.sum())  # immediate read on the consumer's stream
    assert total == 3.0 * N
    assert arr.data.ptr == t.ptr and arr.shape == (N,)
    assert t.allocation.live_views == 2
    with pytest.raises(sm.AliasError, match="DLPack export"):
        t.into_buffer()
    del arr
    gc_collect_harder()
    assert t.allocation.live_views == 1
    t.into_buffer()


def test_cupy_asarray_via_cai(gpu):
    import cupy as cp
    t = slow_written(gpu, 5.0)
    cai = t.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (t.ptr, False) and cai["strides"] is None
    assert cai["stream"] is not None  # a slow write is pending: a stream to wait on
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        arr = cp.asarray(t)
        total = float(arr.sum())
    assert total == 5.0 * N and arr.data.ptr == t.ptr
    ro = t.as_readonly()
    assert ro.__cuda_array_interface__["data"] == (t.ptr, True)


def test_torch_from_dlpack(gpu):
    torch = pytest.importorskip("torch")
    t = slow_written(gpu, 2.0)
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        x = torch.from_dlpack(t)
        total = x.sum().item()
    assert total == 2.0 * N and x.data_ptr() == t.ptr
    del x
    gc_collect_harder()
    assert t.allocation.live_views == 1


def test_jax_from_dlpack(gpu):
    jnp = pytest.importorskip("jax.numpy")
    t = slow_written(gpu, 6.0)
    x = jnp.from_dlpack(t)
    assert float(x.sum()) == 6.0 * N
    assert x.unsafe_buffer_pointer() == t.ptr


def test_cuda_core_strided_memory_view(gpu):
    pytest.importorskip("cuda.core")
    from cuda.core.utils import StridedMemoryView
    import cupy as cp
    t = slow_written(gpu, 9.0)
    consumer = cp.cuda.Stream(non_blocking=True)
    for make in ("dlpack", "cai"):
        if make == "dlpack":
            v = (StridedMemoryView.from_dlpack(t, consumer.ptr)
                 if hasattr(StridedMemoryView, "from_dlpack") else StridedMemoryView(t, consumer.ptr))
        else:
            if not hasattr(StridedMemoryView, "from_cuda_array_interface"):
                continue
            v = StridedMemoryView.from_cuda_array_interface(t, consumer.ptr)
        assert v.ptr == t.ptr and tuple(v.shape) == (N,) and np.dtype(v.dtype) == np.float32
        with consumer:
            total = float(cp.ndarray((N,), cp.float32,
                                     cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(v.ptr, N * 4, v), 0)).sum())
        assert total == 9.0 * N


def test_dlpack_stream_argument_errors(gpu):
    t = sm.Tensor.zeros((4,), device=gpu)
    with pytest.raises(ValueError, match=r"^stream=0 is ambiguous in DLPack and not allowed"):
        t.__dlpack__(stream=0)
    with pytest.raises(TypeError, match=r"^stream must be an int or None, got str$"):
        t.__dlpack__(stream="1")
    assert t.allocation.live_views == 1
    t.__dlpack__(stream=-1)  # no synchronization asked for: fine


def test_import_from_cupy_torch_jax(gpu):
    import cupy as cp
    a = cp.arange(100, dtype=cp.float32)
    t = sm.from_dlpack(a)
    assert t.ptr == a.data.ptr and t.device is gpu
    import interop.cupy as ic
    assert ic.wrap(a).allocation is t.allocation  # same bytes, one allocation
    np.testing.assert_array_equal(t.to_host(), np.arange(100))
    t2 = sm.from_cuda_array_interface(a)
    assert t2.allocation is t.allocation and t2.ptr == t.ptr
    del a
    gc_collect_harder()
    np.testing.assert_array_equal(t.to_host(), np.arange(100))  # the producer is kept alive

    torch = pytest.importorskip("torch")
    x = torch.arange(50, device="cuda", dtype=torch.int64)
    tt = sm.from_dlpack(x)
    assert tt.ptr == x.data_ptr() and tt.dtype == np.int64
    np.testing.assert_array_equal(tt.to_host(), np.arange(50))
    tc = sm.from_cuda_array_interface(x)
    assert tc.allocation is tt.allocation

    jnp = pytest.importorskip("jax.numpy")
    j = jnp.arange(30, dtype=jnp.float32)
    tj = sm.from_dlpack(j)
    assert tj.ptr == j.unsafe_buffer_pointer()
    np.testing.assert_array_equal(tj.to_host(), np.arange(30))


def test_cai_import_errors(gpu):
    class Fake:
        def __init__(self, **d):
            self.__cuda_array_interface__ = d
    import cupy as cp
    a = cp.zeros(8, cp.float32)
    base = dict(shape=(8,), typestr="<f4", data=(a.data.ptr, False), version=3)
    with pytest.raises(ValueError, match=r"^strides \(6,\) are not multiples of the item size 4$"):
        sm.from_cuda_array_interface(Fake(**dict(base, strides=(6,))))
    with pytest.raises(ValueError, match=r"^negative strides \(-4,\) are not supported$"):
        sm.from_cuda_array_interface(Fake(**dict(base, strides=(-4,))))
    with pytest.raises(ValueError, match=r"^CUDA Array Interface version 4 is not supported"):
        sm.from_cuda_array_interface(Fake(**dict(base, version=4)))
    with pytest.raises(ValueError, match=r"stream 0 is not valid"):
        sm.from_cuda_array_interface(Fake(**dict(base, stream=0)))
    host = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match=r"is not CUDA device memory$"):
        sm.from_cuda_array_interface(Fake(**dict(base, data=(host.ctypes.data, False))))
