"""Memory handed to another library is never reused under that library's work (gpu).

Each route hands a Tensor to a consumer library on a non-blocking stream C, where a slow
kernel reads it; then every handle is dropped and new memory is allocated and written on
the producer's stream A. Before stream-ordered export release, the export's end gave the
block back to CuPy's pool at once and the churn overwrote it under C's kernel (11 to 20
rounds of 20). Now the bytes stay leased on C until C has passed the point where the
consumer's hold ended: 0 corrupted rounds, and the memory goes back once C is done.
"""

import numpy as np
import pytest

import sharedmem as sm

from conftest import cuda_device, gc_collect_harder

pytestmark = pytest.mark.gpu
ROUNDS = 50
N = 1 << 20  # 4 MiB of float32
SPIN_MS = 4


@pytest.fixture(scope="module")
def cp():
    if cuda_device() is None:
        pytest.skip("no usable CUDA GPU")
    import cupy
    return cupy


class LegacyOnly:
    """A producer wrapper that only speaks pre-1.0 DLPack (no max_version): the consumer
    falls back to a legacy ``dltensor`` capsule."""

    def __init__(self, t):
        self.t = t

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__(stream=stream)


def produce(dev, a, value):
    import gpu_kernels as K
    b = sm.Buffer.empty(N, "float32", device=dev, stream=a)
    sm.launch(K.kernel("fill"), 256, 256, sm.Out(b), N, float(value), stream=a)
    t = sm.Tensor.from_buffer(b, (N,))
    a.synchronize()  # retired: only the consumer's use can keep the memory now
    return t


def churn(dev, a):
    import gpu_kernels as K
    fresh = [sm.Buffer.empty(N, "float32", device=dev, stream=a) for _ in range(4)]
    for f in fresh:
        sm.launch(K.kernel("fill"), 256, 256, sm.Out(f), N, -1.0, stream=a)
    return fresh


def cupy_route(cp, how):
    import interop.cupy as ic

    def hand(t):
        if how == "dlpack-versioned":
            return cp.from_dlpack(t)
        if how == "dlpack-legacy":
            return cp.from_dlpack(LegacyOnly(t))
        if how == "cai":
            return cp.asarray(t)
        return ic.as_cupy(t)  # CuPy's current stream (C) is the consumer
    return hand


def baseline(cp):
    sm.synchronize()
    gc_collect_harder()
    return cp.get_default_memory_pool().used_bytes()


def settle_and_check_vram(cp, used0, *streams):
    for s in streams:
        s.synchronize()
    sm.synchronize()
    gc_collect_harder()
    sm.synchronize()
    assert sm.stats().in_flight == 0
    assert cp.get_default_memory_pool().used_bytes() == used0  # every block went back


@pytest.mark.parametrize("how", ["dlpack-versioned", "dlpack-legacy", "cai", "as_cupy"])
def test_cupy_consumer_is_never_overwritten(cp, how):
    import gpu_kernels as K
    dev = cuda_device()
    a = dev.create_stream("producer")
    c = cp.cuda.Stream(non_blocking=True)
    hand = cupy_route(cp, how)
    out = cp.empty(N, cp.float32)
    used0 = baseline(cp)
    bad = 0
    for r in range(ROUNDS):
        t = produce(dev, a, r + 1)
        with c:
            arr = hand(t)
            assert arr.data.ptr == t.ptr  # zero-copy
            K.kernel("slow_copy")((256,), (256,), (arr, out, np.int32(N),
                                                     np.int64(K.cycles(SPIN_MS))))
        del arr, t  # every handle gone while C still reads
        fresh = churn(dev, a)
        c.synchronize()
        got = cp.asnumpy(out)
        bad += int(not (got == r + 1).all())
        del fresh
    assert bad == 0, f"{how}: {bad} of {ROUNDS} rounds read memory reused under the consumer"
    settle_and_check_vram(cp, used0, a, c)


def test_torch_consumer_is_never_overwritten(cp):
    torch = pytest.importorskip("torch")
    dev = cuda_device()
    a = dev.create_stream("producer")
    ts = torch.cuda.Stream()
    out = torch.empty(N, dtype=torch.float32, device="cuda")
    used0 = baseline(cp)
    bad = 0
    for r in range(ROUNDS):
        t = produce(dev, a, r + 1)
        with torch.cuda.stream(ts):
            x = torch.from_dlpack(t)  # torch names ts as the consumer stream
            assert x.data_ptr() == t.ptr
            torch.cuda._sleep(int(2e6 * SPIN_MS))
            out.copy_(x)
        del x, t
        fresh = churn(dev, a)
        ts.synchronize()
        bad += int(not bool((out == r + 1).all()))
        del fresh
    assert bad == 0, f"torch: {bad} of {ROUNDS} rounds read memory reused under the consumer"
    settle_and_check_vram(cp, used0, a, ts)


def test_jax_consumer_is_never_overwritten(cp):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    dev = cuda_device()
    a = dev.create_stream("producer")
    loops = 2000

    @jax.jit
    def slow_sum(x):  # reads x `loops` times; exact in float32 for these values
        return jax.lax.fori_loop(0, loops, lambda i, acc: acc + x, jnp.zeros_like(x))

    used0 = baseline(cp)
    bad = zero_copy = 0
    for r in range(ROUNDS):
        t = produce(dev, a, r + 1)
        x = jnp.from_dlpack(t)
        zero_copy += int(x.unsafe_buffer_pointer() == t.ptr)
        y = slow_sum(x)
        del x, t
        fresh = churn(dev, a)
        got = np.asarray(y)
        bad += int(not (got == float(loops * (r + 1))).all())
        del fresh, y
    assert bad == 0, f"jax: {bad} of {ROUNDS} rounds read memory reused under the consumer " \
                     f"({zero_copy} imports were zero-copy)"
    settle_and_check_vram(cp, used0, a)
