"""cuTile kernels through sharedmem.launch (marked gpu and cutile; skipped without cuda.tile)."""

import gc
import time
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import sharedmem as sm


pytestmark = [pytest.mark.gpu, pytest.mark.cutile]
TILE = 256


@pytest.fixture(scope="module")
def vadd(gpu):
    if importlib.util.find_spec("cuda.tile") is None:
        pytest.skip("cuda.tile is not installed")
    import cuda.tile as ct

    @ct.kernel
    def vec_add(a, b, c, T: ct.Constant[int]):
        i = ct.bid(0)
        ct.store(c, index=(i,), tile=ct.load(a, index=(i,), shape=(T,)) + ct.load(b, index=(i,), shape=(T,)))

    return vec_add


SPIN_MS = 1000


def test_cutile_88_pattern_is_safe(gpu, vadd):
    """Slow work ahead of a cuTile kernel; every argument and the future dropped at
    once; new memory allocated and written at once: the result is exact."""
    import gpu_kernels as K
    n = TILE * 4096
    s, other = gpu.create_stream("tile"), gpu.create_stream("other")
    warm = sm.Tensor.zeros((n,), "float32", device=gpu)
    sm.launch(vadd, (n // TILE,), None, sm.In(warm), sm.In(warm), sm.Out(sm.Tensor.empty((n,), device=gpu)),
              TILE).result()  # compile outside the measured pattern
    for trial in range(3):
        a = sm.Tensor.from_host(np.arange(n, dtype=np.float32), device=gpu, stream=s)
        b = sm.Tensor.from_host(np.full(n, 0.5, np.float32), device=gpu, stream=s)
        c = sm.Tensor.empty((n,), "float32", device=gpu)
        hold = sm.Buffer.empty(1, "float32", device=gpu)
        t0 = time.monotonic()
        sm.launch(K.kernel("slow_fill"), 1, 1, sm.Out(hold), 1, 0.0, np.int64(K.cycles(SPIN_MS)),
                  stream=s)
        fut = sm.launch(vadd, (n // TILE,), None, sm.In(a), sm.In(b), sm.Out(c), TILE, stream=s)
        ptrs = {a.ptr, b.ptr}
        del a, b, fut
        gc.collect()
        fresh = [sm.Buffer.empty(n, "float32", device=gpu) for _ in range(4)]
        for f in fresh:
            sm.launch(K.kernel("fill"), 256, 256, sm.Out(f), n, -7.0, stream=other)
        took = (time.monotonic() - t0) * 1e3
        # the cuTile kernel has not run yet: the pattern is live (unless the host was slower
        # than the spin -- a full gc with torch and JAX loaded can take a large part of it)
        assert c.allocation.tracker or took > SPIN_MS, f"lease gone after {took:.0f} ms"
        if took > SPIN_MS:
            print(f"the host took {took:.0f} ms, longer than the {SPIN_MS} ms spin")
        assert not ptrs & {f.ptr for f in fresh}
        np.testing.assert_array_equal(c.to_host(stream=s), np.arange(n, dtype=np.float32) + 0.5)
        del fresh


def test_simt_writer_and_tile_reader_on_two_streams(gpu, vadd):
    import gpu_kernels as K
    n = TILE * 256
    a_s, b_s = gpu.create_stream("simt-writer"), gpu.create_stream("tile-reader")
    x = sm.Tensor.zeros((n,), "float32", device=gpu, stream=a_s)
    zero = sm.Tensor.zeros((n,), "float32", device=gpu, stream=b_s)
    out = sm.Tensor.empty((n,), "float32", device=gpu)
    gpu.synchronize()
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(x), n, 3.0, np.int64(K.cycles(30)), stream=a_s)
    sm.launch(vadd, (n // TILE,), None, sm.In(x), sm.In(zero), sm.Out(out), TILE, stream=b_s)
    np.testing.assert_array_equal(out.to_host(), np.full(n, 3.0, np.float32))
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(x), n, 4.0, np.int64(K.cycles(30)), stream=a_s)
    with pytest.raises(sm.AccessConflictError, match=r"^cuTile kernel vec_add on <Stream tile-reader .* while unfinished work on <Stream simt-writer"):
        sm.launch(vadd, (n // TILE,), None, sm.In(x), sm.In(zero), sm.Out(out), TILE, stream=b_s,
                  policy="reject")


def test_refused_before_launch(gpu, vadd):
    import cupy as cp
    import interop.cupy as ic
    n = TILE * 4
    a = sm.Tensor.from_host(np.ones(n, np.float32), device=gpu)
    before = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^arguments 0 and 2 overlap \(bytes \[0, 4096\) of allocation #\d+\) and one of them is written; cuTile assumes"):
        sm.launch(vadd, (4,), None, sm.In(a), sm.In(a), sm.Out(a), TILE)
    rev = ic.wrap(cp.arange(n, dtype=cp.float32)[::-1])
    with pytest.raises(sm.KernelError, match=r"^argument 0: .* has negative strides; cuTile assumes strides >= 0"):
        sm.launch(vadd, (4,), None, sm.In(rev), sm.In(a), sm.Out(sm.Tensor.empty((n,), device=gpu)), TILE)
    with pytest.raises(sm.KernelError, match=r"^cuTile kernels choose their own block shape"):
        sm.launch(vadd, (4,), 128, sm.In(a), sm.In(a), sm.Out(sm.Tensor.empty((n,), device=gpu)), TILE)
    assert sm.stats().submitted == before


def test_read_read_alias_is_allowed(gpu, vadd):
    n = TILE * 4
    a = sm.Tensor.from_host(np.arange(n, dtype=np.float32), device=gpu)
    out = sm.Tensor.empty((n,), "float32", device=gpu)
    sm.launch(vadd, (4,), None, sm.In(a), sm.In(a), sm.Out(out), TILE)
    np.testing.assert_array_equal(out.to_host(), 2 * np.arange(n, dtype=np.float32))


def test_mixed_pipeline_example(gpu, vadd):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "mixed_pipeline.py")],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cuTile + CuPy" in r.stdout and "OK" in r.stdout and "clean" in r.stdout
    assert "CuPy array (as_cupy)" in r.stdout


def test_cupy_op_and_cutile_op_compose(gpu, vadd):
    import gpu_kernels as K
    n = TILE * 64
    x = sm.Tensor.empty((n,), "float32", device=gpu)
    y = sm.Tensor.empty((n,), "float32", device=gpu)
    out = sm.Tensor.empty((n,), "float32", device=gpu)
    chain = (sm.op(K.kernel("slow_fill"), 64, 256, sm.Out(x), n, 1.25, np.int64(K.cycles(20)))
             .and_then(sm.op(K.kernel("fill"), 64, 256, sm.Out(y), n, 2.0))
             .and_then(sm.op(vadd, (n // TILE,), None, sm.In(x), sm.In(y), sm.Out(out), TILE))
             .apply(lambda _: "done"))
    assert chain.submit().result() == "done"
    np.testing.assert_array_equal(out.to_host(), np.full(n, 3.25, np.float32))


def test_first_launch_compiles_outside_the_core_lock(gpu):
    """cuTile compiles a kernel on its first launch with a signature (seconds): sharedmem
    warms it up (a launch of an empty grid) before taking the core lock, so another thread's
    sharedmem calls go on meanwhile -- and the kernel still runs exactly once."""
    if importlib.util.find_spec("cuda.tile") is None:
        pytest.skip("cuda.tile is not installed")
    import threading

    import cuda.tile as ct
    from sharedmem.runtime.state import RUNTIME

    @ct.kernel
    def accumulate(a, c, T: ct.Constant[int]):  # c += a: a second run would show
        i = ct.bid(0)
        ct.store(c, index=(i,), tile=ct.load(c, index=(i,), shape=(T,))
                 + ct.load(a, index=(i,), shape=(T,)))

    seen = []
    real = accumulate._compile

    def compiling(*args, **kwargs):
        other = []
        t = threading.Thread(target=lambda: other.append(
            float(sm.Buffer.zeros(4, "float32", device=gpu).to_host().sum())))
        t.start()
        t.join(60)
        seen.append((RUNTIME.owner, other))
        return real(*args, **kwargs)
    accumulate._compile = compiling  # (cuTile's dispatcher looks it up on the kernel)
    n = TILE * 4
    a = sm.Tensor.from_host(np.arange(n, dtype=np.float32), device=gpu)
    c = sm.Tensor.zeros((n,), "float32", device=gpu)
    sm.launch(accumulate, (n // TILE,), None, sm.In(a), c, TILE).result()
    assert seen == [(0, [0.0])], seen  # the core lock was free; the other thread's call ran
    np.testing.assert_array_equal(c.to_host(), np.arange(n, dtype=np.float32))  # ran once
    sm.launch(accumulate, (n // TILE,), None, sm.In(a), c, TILE).result()
    assert len(seen) == 1  # compiled once
    np.testing.assert_array_equal(c.to_host(), 2 * np.arange(n, dtype=np.float32))


def test_torch_tensors_are_ordered_after_torch_work_for_cutile_and_cupy_kernels(gpu, vadd):
    """torch tensors passed to a cuTile kernel and to a CuPy kernel are imported for the
    launch: a launch on a sharedmem stream reading a tensor torch is still writing on its
    own stream (behind 200 ms of spinning) reads the written values, and the results land in
    torch's tensors."""
    torch = pytest.importorskip("torch")
    import gpu_kernels as K
    n = TILE * 1024
    dev = f"cuda:{gpu.ordinal}"
    s = gpu.create_stream("tile")
    a, b = torch.zeros(n, device=dev), torch.full((n,), 0.5, device=dev)
    c, d = torch.empty(n, device=dev), torch.empty(n, device=dev)
    values = torch.arange(n, dtype=torch.float32, device=dev)
    torch.cuda.synchronize()
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        torch.cuda._sleep(K.cycles(200))
        a.copy_(values)  # torch writes a on ts, behind the spin
        sm.launch(vadd, (n // TILE,), None, sm.In(a), sm.In(b), sm.Out(c), TILE, stream=s)
        sm.launch(K.kernel("saxpy"), n // 256, 256, 2.0, sm.In(a), sm.In(c), sm.Out(d), n,
                  stream=s).result()
    expected = np.arange(n, dtype=np.float32)
    np.testing.assert_array_equal(c.cpu().numpy(), expected + 0.5)
    np.testing.assert_array_equal(d.cpu().numpy(), 3 * expected + 0.5)
    sm.synchronize()
    assert sm.stats().in_flight == 0


def test_torch_tensors_with_a_lazy_conjugate_or_negative_bit_are_refused(gpu, vadd):
    """``z.conj()`` of a complex torch tensor and ``z.conj().imag`` are lazy views of ``z``'s
    memory (the conjugate, the negative bit): passed as they are, a kernel read ``z``'s values.
    A zero tensor (``torch._efficientzerotensor``, made by forward-mode AD) has no memory: a
    kernel got NULL. Refused before anything is leased, for cuTile and CuPy kernels alike."""
    torch = pytest.importorskip("torch")
    import gpu_kernels as K
    n = TILE
    dev = f"cuda:{gpu.ordinal}"
    z = torch.zeros(n, dtype=torch.complex64, device=dev)
    neg = z.conj().imag
    assert z.conj().is_conj() and neg.is_neg()
    a, c = torch.ones(n, device=dev), torch.empty(n, device=dev)
    sm.synchronize()
    before = sm.stats()
    with pytest.raises(sm.KernelError, match=r"^a torch tensor with the conjugate bit set "
                                             r"\(shape \(256,\), torch.complex64\)"):
        sm.launch(K.kernel("saxpy"), 1, n, 2.0, sm.In(z.conj()), sm.In(a), sm.Out(c), n)
    with pytest.raises(sm.KernelError, match=r"^a torch tensor with the negative bit set .* "
                                             r"pass x.resolve_neg\(\)"):
        sm.launch(vadd, (1,), None, sm.In(neg), sm.In(a), sm.Out(c), TILE)
    zt = torch._efficientzerotensor((n,), dtype=torch.float32, device=dev)  # (NULL memory)
    assert zt._is_zerotensor() and zt.data_ptr() == 0
    with pytest.raises(sm.KernelError, match=r"^a torch zero tensor \(shape \(256,\), "
                                             r"torch.float32\) cannot be a kernel argument"):
        sm.launch(vadd, (1,), None, sm.In(zt), sm.In(a), sm.Out(c), TILE)
    assert sm.stats().submitted == before.submitted
    sm.launch(vadd, (1,), None, sm.In(neg.resolve_neg().contiguous()), sm.In(a), sm.Out(c),
              TILE).result()
    assert c.cpu().tolist() == [1.0] * n  # (-0.0 + 1)
