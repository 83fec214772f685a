"""Several GPUs in one process (#18), on a machine with two (nvidia-h200-x2; skipped with
fewer): peer access is explicit, a launch on device 1 reading device 0's memory is ordered
after device 0's pending writes and keeps that memory until it is done, copies between
devices are exact, and imports from cuda:1 land on sm.Device(1)."""

import numpy as np
import pytest

import sharedmem as sm

from conftest import cuda_device, gc_collect_harder

pytestmark = pytest.mark.gpu
ROUNDS = 50
N = 1 << 20


@pytest.fixture(scope="module")
def two():
    if cuda_device() is None:
        pytest.skip("no usable CUDA GPU")
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs (nvidia-h200-x2)")
    d0, d1 = sm.Device(0), sm.Device(1)
    if not d1.can_access_peer(d0):
        pytest.skip(f"{d1} cannot access {d0}'s memory on this machine")
    return d0, d1


@pytest.fixture(scope="module")
def K():
    import gpu_kernels
    return gpu_kernels


def test_access_refused_until_enabled_then_ordered(two, K):
    """A slow kernel on device 0 writes; a launch on device 1 reads the same memory at once:
    it waits on device 0's work (a cross-device event wait) and reads the written values."""
    d0, d1 = two
    s0, s1 = d0.create_stream("writer"), d1.create_stream("reader")
    x = sm.Buffer.zeros(N, "float32", device=d0, stream=s0)
    out = sm.Buffer.zeros(N, "float32", device=d1, stream=s1)
    sm.synchronize()
    if d0 not in d1.peers:
        with pytest.raises(sm.DeviceMismatchError, match="enable_peer_access"):
            sm.launch(K.raw_kernel("slow_copy"), 256, 256, sm.In(x), sm.Out(out), N,
                      K.cycles(1), stream=s1)
        assert sm.stats().in_flight == 0
    d1.enable_peer_access(d0)
    for value in (3.0, 4.0, 5.0):
        sm.launch(K.raw_kernel("slow_fill"), 256, 256, sm.Out(x), N, value, K.cycles(20),
                  stream=s0)
        sm.launch(K.raw_kernel("slow_copy"), 256, 256, sm.In(x), sm.Out(out), N, 0, stream=s1)
        np.testing.assert_array_equal(out.to_host(stream=s1), np.full(N, value, np.float32))


def test_memory_is_kept_under_a_cross_device_kernel(two, K):
    """Churn as in the single-GPU reuse test: device 1's slow kernel reads device 0's memory;
    every handle is dropped and device 0 allocates and writes at once. 0 corrupted rounds."""
    import cupy
    d0, d1 = two
    d1.enable_peer_access(d0)
    s0, s1 = d0.create_stream("producer"), d1.create_stream("consumer")
    out = sm.Buffer.zeros(N, "float32", device=d1, stream=s1)
    with cupy.cuda.Device(0):
        pool = cupy.get_default_memory_pool()
    sm.synchronize()
    gc_collect_harder()
    used0 = pool.used_bytes()
    bad = 0
    for r in range(ROUNDS):
        src = sm.Buffer.empty(N, "float32", device=d0, stream=s0)
        sm.launch(K.raw_kernel("fill"), 256, 256, sm.Out(src), N, float(r + 1), stream=s0)
        s0.synchronize()  # the write is done: only device 1's read can keep the memory now
        ptr = src.ptr
        sm.launch(K.raw_kernel("slow_copy"), 256, 256, sm.In(src), sm.Out(out), N,
                  K.cycles(4), stream=s1)
        del src  # the last handle, while device 1 still reads
        fresh = [sm.Buffer.empty(N, "float32", device=d0, stream=s0) for _ in range(4)]
        for f in fresh:
            sm.launch(K.raw_kernel("fill"), 256, 256, sm.Out(f), N, -1.0, stream=s0)
        reused = ptr in [f.ptr for f in fresh]
        got = out.to_host(stream=s1)
        bad += int(reused or not (got == r + 1).all())
        del fresh
    assert bad == 0, f"{bad} of {ROUNDS} rounds read memory reused under device 1's kernel"
    sm.synchronize()
    gc_collect_harder()
    sm.synchronize()
    assert sm.stats().in_flight == 0 and pool.used_bytes() == used0


def test_copies_between_devices_are_exact(two):
    d0, d1 = two
    rng = np.random.default_rng(18)
    for n, dtype in ((1, np.int8), (12345, np.float32), (1 << 20, np.float64), (0, np.int32)):
        a = rng.integers(-100, 100, n).astype(dtype)
        b0 = sm.Buffer.from_host(a, device=d0)
        b1 = b0.to_device(d1)
        assert b1.device is d1 and (n == 0 or b1.ptr != b0.ptr)
        np.testing.assert_array_equal(b1.to_host(), a)
        c0 = sm.Buffer.empty(n, a.dtype, device=d0)
        c0.copy_from(b1, stream=d0.create_stream())
        np.testing.assert_array_equal(c0.to_host(), a)
    m = rng.standard_normal((64, 48)).astype(np.float32)
    t = sm.Tensor.from_host(m, device=d0)
    np.testing.assert_array_equal(t[1::3].to_device(d1).to_host(), m[1::3])
    np.testing.assert_array_equal(t.to_device(d1).to_device(d0).to_host(), m)
    sm.synchronize()


def test_imports_from_cuda_1_land_on_device_1(two):
    import cupy
    d0, d1 = two
    with cupy.cuda.Device(1):
        arr = cupy.arange(16, dtype=cupy.float32)
    t = sm.from_dlpack(arr)
    assert t.device is d1 and t.ptr == arr.data.ptr
    assert sm.from_cuda_array_interface(arr).device is d1
    try:
        import torch
    except ImportError:
        return
    tt = torch.arange(8, device="cuda:1", dtype=torch.float32)
    u = sm.from_dlpack(tt)
    assert u.device is d1 and u.ptr == tt.data_ptr()
    np.testing.assert_array_equal(u.to_host(), np.arange(8))
