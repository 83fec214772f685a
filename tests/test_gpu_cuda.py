"""The CUDA backend and CuPy RawKernel launches, on a real GPU (marked gpu)."""

import contextlib
import gc
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import sharedmem as sm

from conftest import gc_collect_harder

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def K(gpu):
    import gpu_kernels
    return gpu_kernels


def test_device_identity(gpu):
    assert sm.Device(0) is gpu and gpu.kind == "cuda" and gpu.ordinal == 0
    assert gpu.uuid.startswith("GPU-") and len(gpu.uuid) == 40
    cc = gpu.compute_capability
    assert isinstance(cc, tuple) and cc >= (7, 0)
    assert sm.default_device() is gpu or os.environ.get("SHAREDMEM_BACKEND") == "host"


def test_pointer_info_answers_for_memory_the_driver_does_not_know(gpu):
    """The driver answers ``cuPointerGetAttributes`` for NULL, host memory and addresses it
    never gave with zeroed attributes, not an error: pointer_info says None for them (the imports' "not CUDA device
    memory"), on both paths; a CudaError is left for the driver call failing. Device memory:
    its whole driver allocation and ordinal."""
    b = sm.Buffer.empty(1000, "float32", device=gpu)
    host = np.zeros(16, np.float32)
    from sharedmem.backends.cuda import CudaBackend
    assert gpu.backend.hot is not None  # (libcuda through ctypes, as every GPU run has it)
    bindings = CudaBackend(gpu.ordinal)  # the cuda.bindings path: a backend of its own
    bindings.hot = None                  # without the ctypes entry points (no other user)
    bindings.attributes_addr = 0         # nor libcuda's through its address (compiled)
    assert gpu.backend.attributes_addr != 0
    # (the backend's: compiled, through libcuda's address; libcuda through ctypes; bindings)
    for info in (gpu.backend.pointer_info, gpu.backend.hot.pointer_info, bindings.pointer_info):
        for ptr in (0, 1, host.ctypes.data, 2**63):
            assert info(ptr) is None, (info, hex(ptr))
        start, size, ordinal = info(b.ptr + 8)
        assert start <= b.ptr and b.ptr + 4000 <= start + size and ordinal == gpu.ordinal


def test_use_after_free_prevented_across_streams(gpu, K):
    """Stream B reads a buffer allocated on A; the user drops it and the future at
    once; new allocations on A are written at once; B's result is exact."""
    n = 1 << 20
    a, b = gpu.create_stream("A"), gpu.create_stream("B")
    bad = 0
    for trial in range(5):
        src = sm.Buffer.from_host(np.arange(n, dtype=np.float32), device=gpu, stream=a)
        a.synchronize()
        out = sm.Buffer.empty(n, "float32", device=gpu, stream=b)
        src_ptr = src.ptr
        fut = sm.launch(K.kernel("slow_copy"), 256, 256, sm.In(src), sm.Out(out), np.int32(n),
                        np.int64(K.cycles(500)), stream=b)
        del src, fut  # (refcounting frees them at once: no gc.collect(), which can take long)
        fresh = [sm.Buffer.empty(n, "float32", device=gpu, stream=a) for _ in range(4)]
        for f in fresh:
            sm.launch(K.kernel("fill"), 256, 256, sm.Out(f), np.int32(n), np.float32(-1), stream=a)
        # only meaningful while the slow kernel still runs (a large process's gc.collect()
        # can take tens of ms): then its input must not have been handed out again
        assert out.allocation.tracker, "the slow kernel already finished: the pattern is not live"
        assert src_ptr not in [f.ptr for f in fresh]
        got = out.to_host(stream=b)
        bad += int(not np.array_equal(got, np.arange(n, dtype=np.float32)))
        del fresh, out
    assert bad == 0
    sm.synchronize()


def test_cross_stream_order_and_reject(gpu, K):
    n = 1 << 16
    a, b = gpu.create_stream("writer"), gpu.create_stream("reader")
    x = sm.Buffer.zeros(n, "float32", device=gpu, stream=a)
    out = sm.Buffer.zeros(n, "float32", device=gpu, stream=b)
    gpu.synchronize()
    # order: the reader on b waits on the device for the slow writer on a
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(x), np.int32(n), np.float32(7.0),
              np.int64(K.cycles(30)), stream=a)
    sm.launch(K.kernel("slow_copy"), 64, 256, sm.In(x), sm.Out(out), np.int32(n), np.int64(0),
              stream=b)
    np.testing.assert_array_equal(out.to_host(stream=b), np.full(n, 7.0, np.float32))
    # reject: refused, naming the other stream; no lease taken
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(x), np.int32(n), np.float32(8.0),
              np.int64(K.cycles(30)), stream=a)
    before = sm.stats().submitted
    with pytest.raises(sm.AccessConflictError, match=r"on <Stream reader on <Device cuda:0 .*> would read bytes \[0, 262144\) of allocation #\d+ while unfinished work on <Stream writer on"):
        sm.launch(K.kernel("slow_copy"), 64, 256, sm.In(x), sm.Out(out), np.int32(n),
                  np.int64(0), stream=b, policy="reject")
    assert sm.stats().submitted == before
    a.synchronize()
    np.testing.assert_array_equal(x.to_host(), np.full(n, 8.0, np.float32))


@contextlib.contextmanager
def _calls_elsewhere(gpu, K):
    """Another thread making a buffer and launching on a stream of its own, again and again,
    while the block runs: yields the list of how long each round took (seconds)."""
    other = gpu.create_stream("other")
    y = sm.Buffer.zeros(32, "float32", device=gpu)
    done = threading.Event()
    calls = []

    def elsewhere():
        while not done.is_set():
            t0 = time.perf_counter()
            b = sm.Buffer.empty(16, "float32", device=gpu, stream=other)
            sm.launch(K.kernel("fill"), 1, 32, sm.Out(y), np.int32(32), np.float32(1),
                      stream=other)
            del b
            calls.append(time.perf_counter() - t0)
            time.sleep(1e-3)
    th = threading.Thread(target=elsewhere)
    th.start()
    try:
        yield calls
    finally:
        done.set()
        th.join()
    sm.synchronize()
    np.testing.assert_array_equal(y.to_host(), np.ones(32, np.float32))


def test_a_launch_loop_far_ahead_of_the_device_stalls_no_other_thread(gpu, K):
    """The driver queues about 1,020 launches a stream; the next cuLaunchKernel blocks until
    there is room (benchmarks/queue_depth.py). sharedmem's launch waits for room first --
    holding no lock, and not the GIL -- so another thread's allocations and launches on
    another stream go on while a loop runs far ahead of a busy stream."""
    busy = gpu.create_stream("busy")
    x = sm.Buffer.zeros(32, "float32", device=gpu)
    sm.synchronize()
    sm.launch(K.kernel("slow_fill"), 1, 32, sm.Out(x), np.int32(32), np.float32(2),
              np.int64(K.cycles(400)), stream=busy)
    with _calls_elsewhere(gpu, K) as calls:
        t0 = time.perf_counter()
        for _ in range(1500):
            sm.launch(K.kernel("fill"), 1, 32, sm.Out(x), np.int32(32), np.float32(3),
                      stream=busy)
        behind = time.perf_counter() - t0
    assert behind > 0.2  # the loop did wait for the device: the pattern is live
    assert len(calls) > 20 and max(calls) < 0.1, (len(calls), max(calls))
    np.testing.assert_array_equal(x.to_host(), np.full(32, 3, np.float32))


def test_to_host_behind_a_busy_stream_stalls_no_other_thread(gpu, K):
    """A copy into pageable host memory waits in the driver for the work it follows. to_host
    waits for that work first, holding no lock, so other threads' calls go on meanwhile."""
    busy = gpu.create_stream("busy")
    n = 1 << 16
    x = sm.Buffer.zeros(n, "float32", device=gpu)
    sm.synchronize()
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(x), np.int32(n), np.float32(2),
              np.int64(K.cycles(400)), stream=busy)
    with _calls_elsewhere(gpu, K) as calls:
        t0 = time.perf_counter()
        got = x.to_host(stream=busy)
        took = time.perf_counter() - t0
    assert took > 0.2  # it did wait for the slow kernel: the pattern is live
    assert len(calls) > 20 and max(calls) < 0.1, (len(calls), max(calls))
    np.testing.assert_array_equal(got, np.full(n, 2, np.float32))


def test_uploads_behind_a_busy_stream_stall_no_other_thread(gpu, K):
    """The driver copies pageable memory synchronously once its staging is full: behind a busy
    stream a 64 MiB copy_from blocked for the whole kernel (411 ms), under the core lock, and
    every other thread with it. Uploads are staged in pinned memory: enqueued at once."""
    busy = gpu.create_stream("busy")
    n, m = 16 << 20, 1 << 16
    x, small = sm.Buffer.zeros(n, "float32", device=gpu), sm.Buffer.zeros(m, "float32", device=gpu)
    sm.synchronize()
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(small), np.int32(m), np.float32(2),
              np.int64(K.cycles(400)), stream=busy)
    with _calls_elsewhere(gpu, K) as calls:
        t0 = time.perf_counter()
        x.copy_from(np.full(n, 5, np.float32), stream=busy)
        for v in (6, 7, 8):  # (the third pageable copy of 256 KiB in a row blocked)
            small.copy_from(np.full(m, v, np.float32), stream=busy)
        took = time.perf_counter() - t0
        busy.synchronize()
    assert took < 0.2, took  # enqueued behind the kernel, not waited for
    assert len(calls) > 20 and max(calls) < 0.1, (len(calls), max(calls))
    np.testing.assert_array_equal(x.to_host(), np.full(n, 5, np.float32))
    np.testing.assert_array_equal(small.to_host(), np.full(m, 8, np.float32))


def test_large_copies_to_and_from_the_host_stall_no_other_thread(gpu, K):
    """A copy between the device and pageable host memory is performed by the driver inside
    the call: 1 GiB under the core lock held every other thread for the whole transfer. Such
    copies go through pinned memory in pieces of STAGE_MAX (enqueued under the lock, waited
    for and copied on the host without it)."""
    n = 256 << 20  # 1 GiB of float32
    x = sm.Buffer.zeros(n, "float32", device=gpu)
    src = np.arange(n, dtype=np.float32)
    sm.synchronize()
    with _calls_elsewhere(gpu, K) as calls:
        x.copy_from(src).result()
        got = x.to_host()
    assert len(calls) > 20 and max(calls) < 0.03, (len(calls), max(calls))
    assert got[0] == 0 and got[-1] == n - 1 and np.array_equal(got, src)


def test_a_strided_copy_behind_a_busy_stream_stalls_no_other_thread(gpu, K):
    """Tensor.copy of a transposed tensor enqueues one 2-D copy per row under the core lock;
    past the driver's queue (about 1,020 a stream) behind a busy stream it would block there.
    With more rows than half the queue it waits for the stream first, holding no lock."""
    import cupy as cp
    busy = gpu.create_stream("busy")
    base = cp.arange(64 * 2048, dtype=cp.float32).reshape(64, 2048)
    t = sm.from_dlpack(base.T)  # (2048, 64): one 2-D copy a row
    x = sm.Buffer.zeros(32, "float32", device=gpu)
    sm.synchronize()
    cp.cuda.Device(gpu.ordinal).synchronize()
    sm.launch(K.kernel("slow_fill"), 1, 32, sm.Out(x), np.int32(32), np.float32(2),
              np.int64(K.cycles(400)), stream=busy)
    with _calls_elsewhere(gpu, K) as calls:
        c = t.copy(stream=busy)
        busy.synchronize()
    assert len(calls) > 20 and max(calls) < 0.1, (len(calls), max(calls))
    np.testing.assert_array_equal(c.to_host(), cp.asnumpy(base.T))


def test_read_read_overlaps_on_the_device(gpu, K):
    """Two readers of one buffer on two streams run at the same time: the first
    spins until the second sets a flag (bounded); if sharedmem had ordered them,
    the first would time out and report 0."""
    import cupy
    a, b = gpu.create_stream(), gpu.create_stream()
    x = sm.Buffer.zeros(1024, "float32", device=gpu, stream=a)
    flag = cupy.zeros(1, cupy.int32)
    seen = sm.Buffer.zeros(1, "int32", device=gpu, stream=a)
    # CUDA loads kernels lazily at their first launch, and loading waits for running
    # kernels: launch both once before the real test so neither is loaded mid-spin.
    dummy = cupy.ones(1, cupy.int32)
    sm.launch(K.kernel("wait_flag"), 1, 1, sm.In(x), np.uint64(dummy.data.ptr), sm.Out(seen),
              np.int64(1), stream=a)
    sm.launch(K.kernel("set_flag"), 1, 1, sm.In(x), np.uint64(dummy.data.ptr), stream=b)
    gpu.synchronize()
    cupy.cuda.Device(0).synchronize()
    sm.launch(K.kernel("wait_flag"), 1, 1, sm.In(x), np.uint64(flag.data.ptr), sm.Out(seen),
              np.int64(K.cycles(2000)), stream=a, policy="reject")
    sm.launch(K.kernel("set_flag"), 1, 1, sm.In(x), np.uint64(flag.data.ptr), stream=b,
              policy="reject")
    assert seen.to_host()[0] == 1


def test_scalars_typed_as_the_kernel_expects(gpu, K):
    n = 1000
    x = sm.Buffer.from_host(np.arange(n, dtype=np.float32), device=gpu)
    y = sm.Buffer.from_host(np.ones(n, np.float32), device=gpu)
    out = sm.Buffer.empty(n, "float32", device=gpu)
    # Python float -> float32 parameter, Python int -> int parameter
    sm.launch(K.kernel("saxpy"), (n + 255) // 256, 256, 2.5, sm.In(x), sm.In(y), sm.Out(out), n)
    np.testing.assert_array_equal(out.to_host(), 2.5 * np.arange(n, dtype=np.float32) + 1)
    # the types come from the kernel's source: a float64 for a float parameter is its value, an
    # int for a float its value, a float for an int refused
    sm.launch(K.kernel("saxpy"), (n + 255) // 256, 256, np.float64(0.5), sm.In(x), sm.In(y),
              sm.Out(out), n)
    np.testing.assert_array_equal(out.to_host(), 0.5 * np.arange(n, dtype=np.float32) + 1)
    sm.launch(K.kernel("saxpy"), (n + 255) // 256, 256, 3, sm.In(x), sm.In(y), sm.Out(out), n)
    np.testing.assert_array_equal(out.to_host(), 3 * np.arange(n, dtype=np.float32) + 1)
    with pytest.raises(sm.KernelError, match=r"^argument 4: parameter 'n' \(int\) takes an int, "
                                             r"got float 1000\.0"):
        sm.launch(K.kernel("saxpy"), 1, 1, 2.5, sm.In(x), sm.In(y), sm.Out(out), float(n))
    with pytest.raises(sm.KernelError, match=r"^the kernel takes 5 parameters \(a, x, y, out, n\) "
                                             r"but was given 4 arguments"):
        sm.launch(K.kernel("saxpy"), 1, 1, 2.5, sm.In(x), sm.In(y), sm.Out(out))
    assert sm.stats().in_flight >= 0


def test_buffer_slice_marshals_as_pointer_and_length(gpu, K):
    b = sm.Buffer.from_host(np.ones(100, np.float32), device=gpu)
    part = b[10:30]
    sm.launch(K.kernel("scale_len"), 1, 128, sm.InOut(part, with_length=True), 3.0)  # (float* x, long long n, double factor)
    got = b.to_host()
    assert got[:10].tolist() == [1.0] * 10 and got[10:30].tolist() == [3.0] * 20
    assert got[30:].tolist() == [1.0] * 70


def test_atomic_intent(gpu, K):
    n = 4096
    x = sm.Buffer.from_host(np.ones(n, np.float32), device=gpu)
    box = sm.DeviceBox(0.0, "float32", device=gpu)
    sm.launch(K.kernel("sum_atomic"), n // 256, 256, sm.In(x), n, sm.Atomic(box))
    assert box.get() == float(n)


def test_vram_returns_to_baseline(gpu, K):
    import cupy
    pool = cupy.get_default_memory_pool()
    n = 1 << 16
    s = gpu.create_stream()
    # (one launch before the baseline: the driver may take device memory once for a module
    # loaded lazily at its first launch, or for a stream's first work -- not a leak)
    warm = sm.Buffer.empty(n, "float32", device=gpu, stream=s)
    sm.launch(K.kernel("fill"), 64, 256, sm.Out(warm), np.int32(n), np.float32(-1), stream=s)
    del warm
    sm.synchronize()
    gc_collect_harder()
    pool.free_all_blocks()
    used0 = pool.used_bytes()
    free0, _ = gpu.backend.mem_info()
    for i in range(10_000):
        b = sm.Buffer.empty(n, "float32", device=gpu, stream=s)
        sm.launch(K.kernel("fill"), 64, 256, sm.Out(b), np.int32(n), np.float32(i), stream=s)
        del b  # the future is dropped unwaited
    assert sm.stats().in_flight < 10_000  # retired while running
    sm.synchronize()
    gc_collect_harder()
    assert sm.stats().in_flight == 0
    assert pool.used_bytes() == used0
    pool.free_all_blocks()
    free1, _ = gpu.backend.mem_info()
    assert free1 >= free0 - (2 << 20), (free0, free1)


@pytest.mark.faults  # an illegal address on purpose: left out of `make gpu-sanitize`
def test_trap_means_completion_unknown_and_memory_kept(gpu):
    script = textwrap.dedent("""
        import gc, os, sys, weakref, warnings
        import numpy as np
        import sharedmem as sm
        import gpu_kernels as K
        warnings.simplefilter("always")
        dev = sm.Device(0)
        s = dev.create_stream()
        b = sm.Buffer.from_host(np.ones(1024, np.float32), device=dev, stream=s)
        s.synchronize()  # only the trapping kernel is in flight
        ref = weakref.ref(b.allocation)
        fut = sm.launch(K.kernel("trap"), 1, 1, b, stream=s)
        del b
        gc.collect()
        try:
            fut.result()
        except sm.CompletionUnknownError as e:
            print("unknown:", type(e.__cause__).__name__, str(e.__cause__)[:60])
        st = sm.stats()
        print("leaked", st.leaked, "bytes", st.leaked_bytes, "kept", ref() is not None)
        sys.stdout.flush()
        os._exit(0)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.getcwd(),
                                                       os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       timeout=120)
    assert re.search(r"unknown: CudaError cuEvent(Synchronize|Query|Record) failed: CUDA_ERROR_", r.stdout), \
        r.stdout + r.stderr
    assert "leaked 1 bytes 4096 kept True" in r.stdout, r.stdout + r.stderr
    assert "LeakWarning" in r.stderr and "is unknown" in r.stderr


def test_a_raw_stream_handle_is_placed_by_its_context(gpu):
    """A raw handle says nothing about its device: the driver's answer (cuStreamGetCtx) puts
    it on its device, and a stream of another context than the primary one is refused before
    anything is enqueued on it."""
    import cupy as cp
    from cuda.bindings import driver as cu
    raw = cp.cuda.Stream(non_blocking=True)
    st = sm.Stream.from_external(int(raw.ptr))
    assert st.device is gpu and st.handle == raw.ptr
    # a second context of this device (cuCtxCreate pushes it: popped at once)
    err, dev = cu.cuDeviceGet(gpu.ordinal)
    try:
        err, ctx = cu.cuCtxCreate(None, 0, dev)  # (CUDA 13: the params first)
    except TypeError:
        err, ctx = cu.cuCtxCreate(0, dev)
    assert err == cu.CUresult.CUDA_SUCCESS
    try:
        err, stream = cu.cuStreamCreate(1)
        assert err == cu.CUresult.CUDA_SUCCESS
        cu.cuCtxPopCurrent()
        h = int(stream)
        for device in (None, gpu):
            with pytest.raises(sm.DeviceMismatchError,
                               match=rf"^{h} is a stream of a CUDA context of {re.escape(str(gpu))} "
                                     rf"other than its primary one"):
                sm.Stream.from_external(h, device)
        assert sm.Stream.lookup(gpu, h) is None
        assert int(cu.cuCtxGetCurrent()[1]) != int(ctx)  # (the check put back the context)
        cu.cuCtxPushCurrent(ctx)
        cu.cuStreamDestroy(stream)
        cu.cuCtxPopCurrent()
    finally:
        cu.cuCtxDestroy(ctx)
    x = sm.Buffer.zeros(16, "float32", device=gpu)  # (sharedmem's own context works on)
    assert x.to_host().sum() == 0


def test_foreign_streams_are_one_stream(gpu, K):
    import cupy as cp
    cs = cp.cuda.Stream(non_blocking=True)
    s1 = sm.Stream.from_external(cs)
    assert sm.Stream.from_external(cs.ptr) is s1 and s1.handle == cs.ptr and not s1.owned
    assert sm.Stream.from_external(0) is gpu.default_stream
    x = sm.Buffer.zeros(1 << 16, "float32", device=gpu)
    gpu.synchronize()
    # two launches through two wrappers of one CUDA stream: same stream, no conflict
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(x), 1 << 16, 2.0, np.int64(K.cycles(10)), stream=cs)
    sm.launch(K.kernel("fill"), 64, 256, sm.Out(x), 1 << 16, 3.0, stream=cs.ptr, policy="reject")
    np.testing.assert_array_equal(x.to_host(), np.full(1 << 16, 3.0, np.float32))
