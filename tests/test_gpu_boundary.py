"""Memory handed to another library is never reused under that library's work (gpu).

Each route hands a Tensor to a consumer library on a non-blocking stream C, where a slow
kernel reads it; then every handle is dropped and new memory is allocated and written on
the producer's stream A. Before stream-ordered export release, the export's end gave the
block back to CuPy's pool at once and the churn overwrote it under C's kernel (11 to 20
rounds of 20). Now the bytes stay leased on C until C has passed the point where the
consumer's hold ended: 0 corrupted rounds, and the memory goes back once C is done.
"""

import contextlib
import sys

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


@pytest.mark.parametrize("second_non_blocking", [False, True])
def test_a_second_cai_consumer_on_another_stream_sees_the_first_ones_writes(cp,
                                                                           second_non_blocking):
    """Two ``cupy.asarray`` of one Tensor under two CuPy streams: the first consumer writes
    it slowly on X; the second, under Z, reads it. The second export is ordered after X's
    work (the view's own hold on X is waited for: Z is not ordered after X), whether Z is a
    blocking stream or not -- a read again under the same stream is not."""
    import gpu_kernels as K
    dev = cuda_device()
    x = cp.cuda.Stream(non_blocking=True)
    z = cp.cuda.Stream(non_blocking=second_non_blocking)
    src = cp.empty(N, cp.float32)
    bad = 0
    for r in range(ROUNDS // 5):
        t = sm.Tensor.from_buffer(sm.Buffer.zeros(N, "float32", device=dev), (N,))
        sm.synchronize()
        src.fill(r + 1)
        cp.cuda.Device().synchronize()
        with x:
            first = cp.asarray(t)
            K.kernel("slow_copy")((256,), (256,), (src, first, np.int32(N),
                                                     np.int64(K.cycles(SPIN_MS))))
        with z:
            second = cp.asarray(t)
            got = second.copy()
        z.synchronize()
        bad += int(not (cp.asnumpy(got) == r + 1).all())
        x.synchronize()
        del first, second, t
    assert bad == 0, f"{bad} of {ROUNDS // 5} rounds read before the first consumer's write"


def test_which_streams_follow_the_legacy_default_stream(cp):
    """``syncs_with_legacy``, asked of the driver: CuPy's streams are blocking unless made
    non-blocking; torch's and sharedmem's are non-blocking; the default stream is itself."""
    from interop.streams import ordered_among
    dev = cuda_device()
    blocking = sm.Stream.from_external(cp.cuda.Stream(), dev)
    non_blocking = sm.Stream.from_external(cp.cuda.Stream(non_blocking=True), dev)
    own = dev.create_stream("own")
    assert dev.default_stream._impl.syncs_with_legacy()
    assert blocking._impl.syncs_with_legacy()
    assert not non_blocking._impl.syncs_with_legacy()
    assert not own._impl.syncs_with_legacy()
    assert ordered_among([dev.default_stream, blocking])
    assert not ordered_among([dev.default_stream, non_blocking])
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        ts = sm.Stream.from_external(torch.cuda.Stream(), dev)
        assert not ts._impl.syncs_with_legacy()


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


# -- random programs across the boundary ------------------------------------------------------
STEPS = 150
THREADS = 8
M = 1 << 14  # floats per slot: small, so the pool hands blocks out again all the time



def _end_capture(cu, stream_ptr):
    """End another library's capture on ``stream_ptr``; the driver's answer (the graph, if
    any, destroyed): CUDA_SUCCESS where the capture stayed valid."""
    err, graph = cu.cuStreamEndCapture(stream_ptr)
    if err == cu.CUresult.CUDA_SUCCESS:
        cu.cuGraphDestroy(graph)
    return err


@contextlib.contextmanager
def _their_global_capture(cp, where):
    """Another library's graph capture in global mode (torch.cuda.graph's default) of a CuPy
    stream of its own, begun in another thread or in this one, around the block; yields the
    list that its end's answer goes to (CUDA_SUCCESS where the capture stayed valid)."""
    import threading
    from cuda.bindings import driver as cu
    theirs = cp.cuda.Stream(non_blocking=True)
    y = cp.zeros(1 << 20, cp.uint8)
    GLOBAL = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    began, go_on, ended = threading.Event(), threading.Event(), []

    def capture():
        with cp.cuda.Device(0):
            assert cu.cuStreamBeginCapture(theirs.ptr, GLOBAL)[0] == cu.CUresult.CUDA_SUCCESS
            assert cu.cuMemsetD8Async(y.data.ptr, 3, y.nbytes, theirs.ptr)[0] == 0
            began.set()
            go_on.wait(30)
            ended.append(_end_capture(cu, theirs.ptr))

    if where == "another thread":
        t = threading.Thread(target=capture)
        t.start()
        assert began.wait(30)
    else:
        assert cu.cuStreamBeginCapture(theirs.ptr, GLOBAL)[0] == cu.CUresult.CUDA_SUCCESS
    try:
        yield ended
    finally:
        if where == "another thread":
            go_on.set()
            t.join(30)
        else:
            ended.append(_end_capture(cu, theirs.ptr))


def _program(tid, dev, streams, cstreams, kernels, errors, counts):
    import cupy as cp
    import interop.cupy as ic
    fill, slow_copy = kernels
    rng = np.random.default_rng(1000 + tid)
    slots = []  # [handle, expected, movable]
    results = []  # (cupy array written by a consumer, what it must hold)
    spin = np.int64(K_CYCLES)
    try:
        for step in range(STEPS):
            op = rng.choice(["create", "fill", "copy", "export_read", "export_write", "import",
                             "move", "drop", "check"],
                            p=[.12, .14, .12, .16, .1, .08, .12, .08, .08])
            if op == "create" or not slots:
                v = rng.integers(0, 1000, M).astype(np.float32)
                s = streams[rng.integers(len(streams))]
                slots.append([sm.Buffer.from_host(v, device=dev, stream=s), v, True])
                continue
            i = int(rng.integers(len(slots)))
            x, exp, movable = slots[i]
            s = streams[rng.integers(len(streams))]
            c = cstreams[rng.integers(len(cstreams))]
            if op == "fill":
                val = float(rng.integers(1, 1000))
                sm.launch(fill, 64, 256, sm.Out(x), M, val, stream=s)
                exp[:] = val
            elif op == "copy" and len(slots) > 1:
                j = (i + 1 + int(rng.integers(len(slots) - 1))) % len(slots)
                y, yexp, _ = slots[j]
                sm.launch(slow_copy, 64, 256, sm.In(x), sm.Out(y), M, spin, stream=s)
                yexp[:] = exp
            elif op in ("export_read", "export_write"):
                route = rng.choice(["dlpack", "cai", "as_cupy"])
                with c:
                    arr = (cp.from_dlpack(x) if route == "dlpack" else
                           cp.asarray(x) if route == "cai" else ic.as_cupy(x))
                    if op == "export_read":
                        r = cp.empty(M, cp.float32)
                        slow_copy((64,), (256,), (arr, r, np.int32(M), spin))
                        results.append((r, exp.copy()))
                    else:
                        val = float(rng.integers(1, 1000))
                        fill((64,), (256,), (arr, np.int32(M), np.float32(val)))
                        exp[:] = val
                del arr
                if route == "cai":
                    slots[i][2] = False  # the object keeps a CAI hold for life
                if rng.random() < 0.5:  # and the producer's handle goes at once, too
                    del slots[i], x
            elif op == "import":
                val = float(rng.integers(1, 1000))
                with c:
                    z = cp.full(M, val, cp.float32)
                    t = sm.from_dlpack(z, stream=s)
                del z
                slots.append([t, np.full(M, val, np.float32), False])
            elif op == "move":
                try:
                    moved = (sm.Tensor.from_buffer(x, (M,)) if isinstance(x, sm.Buffer)
                             else x.into_buffer())
                except sm.AliasError as e:
                    if movable:
                        errors.append(f"thread {tid} step {step}: unexpected {e}")
                else:
                    if not movable:
                        errors.append(f"thread {tid} step {step}: moved an aliased {x!r}")
                    slots[i][0] = moved
            elif op == "drop":
                del slots[i], x
            elif op == "check":
                got = x.to_host()
                if not np.array_equal(got, exp):
                    errors.append(f"thread {tid} step {step}: {int((got != exp).sum())} of {M} "
                                  f"values differ in {x!r}")
            x = None
        for x, exp, _ in slots:
            if not np.array_equal(x.to_host(), exp):
                errors.append(f"thread {tid}: final contents differ in {x!r}")
        for c in cstreams:
            c.synchronize()
        bad = sum(int(not np.array_equal(cp.asnumpy(r), e)) for r, e in results)
        if bad:
            errors.append(f"thread {tid}: {bad} of {len(results)} consumer reads saw reused memory")
        counts[tid] = len(results)
    except Exception as e:  # reported by the main thread
        import traceback
        errors.append(f"thread {tid}: {type(e).__name__}: {e}\n{traceback.format_exc()}")


K_CYCLES = 200_000  # about 0.1 ms: consumers and copies still run when the next step comes


def test_random_programs_across_the_boundary(cp):
    """8 threads, 4 sharedmem streams, 4 CuPy consumer streams: creates, launches, exports
    read and written by CuPy, imports, moves and drops, checked against a NumPy model."""
    import threading
    import gpu_kernels as K
    dev = cuda_device()
    streams = [dev.create_stream(f"s{i}") for i in range(4)]
    cstreams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    kernels = (K.kernel("fill"), K.kernel("slow_copy"))
    used0 = baseline(cp)
    errors, counts = [], {}
    threads = [threading.Thread(target=_program, args=(i, dev, streams, cstreams, kernels,
                                                      errors, counts)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert errors == [], "\n".join(errors[:10])
    assert len(counts) == THREADS and sum(counts.values()) > THREADS * 10
    settle_and_check_vram(cp, used0, *streams, *cstreams)


def test_imports_of_one_vmm_reservation_share_an_allocation(cp):
    """Memory mapped with the VMM API -- chunks of the allocation granularity mapped back to
    back into one reserved range, as PyTorch's expandable segments are -- is one driver
    allocation per chunk to cuMemGetAddressRange, but the pointer attributes sharedmem reads
    (RANGE_START_ADDR / RANGE_SIZE) name the whole reservation (H200: a 2 MiB chunk each way,
    an 8 MiB range). So an array spanning two chunks and one inside the second are ranges of
    one allocation: their accesses and aliases are tracked against each other."""
    from cuda.bindings import driver as cu

    from interop.cai import from_cuda_array_interface

    def ok(r):
        assert int(r[0]) == 0, r
        return r[1] if len(r) > 1 else None
    cp.cuda.Device(0).use()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    gran = int(ok(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
    va = int(ok(cu.cuMemAddressReserve(4 * gran, 0, 0, 0)))
    handles = [ok(cu.cuMemCreate(gran, prop, 0)) for _ in range(2)]
    for k, h in enumerate(handles):
        ok(cu.cuMemMap(va + k * gran, gran, 0, h, 0))
    acc = cu.CUmemAccessDesc()
    acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = 0
    acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    ok(cu.cuMemSetAccess(va, 2 * gran, [acc], 1))

    class Cai:
        def __init__(self, ptr, n):
            self.__cuda_array_interface__ = {"version": 3, "shape": (n,), "typestr": "<f4",
                                             "data": (ptr, False), "strides": None,
                                             "stream": None}
    try:
        assert int(cu.cuMemGetAddressRange(va + gran)[2]) == gran  # (one chunk, to this call)
        a = from_cuda_array_interface(Cai(va + gran // 2, gran // 4))  # both chunks
        b = from_cuda_array_interface(Cai(va + gran + 64, 16))  # the second, inside a
        assert a.allocation is b.allocation
        assert (a._token.start, a._token.stop) == (a.ptr - a.allocation.ptr,
                                                   a.ptr - a.allocation.ptr + gran)
        assert a.ptr + gran <= a.allocation.ptr + a.allocation.nbytes
        del a, b
        sm.synchronize()
        gc_collect_harder()
    finally:
        ok(cu.cuMemUnmap(va, 2 * gran))
        for h in handles:
            ok(cu.cuMemRelease(h))
        ok(cu.cuMemAddressFree(va, 4 * gran))


def test_polling_beside_another_librarys_global_mode_capture_leaves_it_valid(cp):
    """The retirer polls sharedmem's events while work is pending, from its own thread. A
    capture another library began in global mode (torch.cuda.graph's default) forbids other
    threads in the driver's default mode to query events: the query was refused
    (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), which invalidated the capture, and the refusal
    was taken for unknown completion -- the work's memory leaked with a LeakWarning. The
    retirer's thread asks in relaxed mode: the capture ends valid and the work retires."""
    import warnings
    import gpu_kernels as K
    from cuda.bindings import driver as cu
    dev = sm.Device(0)
    x = sm.Buffer.zeros(N, "float32", device=dev)
    s = dev.create_stream("busy")
    theirs = cp.cuda.Stream(non_blocking=True)
    y = cp.zeros(1 << 20, cp.uint8)  # (before: no allocation while they capture)
    sm.launch(K.kernel("slow_fill"), 1, 32, sm.Out(x), 32, 1.0, np.int64(K.cycles(5)), stream=s)
    sm.synchronize()  # (the kernel loaded, the retirer thread started)
    before = sm.stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no LeakWarning)
        sm.launch(K.kernel("slow_fill"), 1, 32, sm.Out(x), 32, 2.0, np.int64(K.cycles(50)),
                  stream=s)
        err, = cu.cuStreamBeginCapture(theirs.ptr,
                                       cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        assert err == cu.CUresult.CUDA_SUCCESS
        try:  # (their work, captured: not run)
            assert cu.cuMemsetD8Async(y.data.ptr, 3, y.nbytes, theirs.ptr)[0] == 0
            import time
            time.sleep(0.02)  # (the retirer polls the pending launch meanwhile)
        finally:
            err = _end_capture(cu, theirs.ptr)
        assert err == cu.CUresult.CUDA_SUCCESS  # (not CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        sm.synchronize()
    assert sm.stats().leaked == before.leaked
    assert x.to_host()[:32].tolist() == [2.0] * 32


def test_default_stream_work_beside_a_blocking_streams_capture_leaves_it_valid(cp,
                                                                              monkeypatch):
    """The device's default stream is the legacy one, its markers recorded lazily. A capture
    of a blocking stream (cupy.cuda.Stream() without non_blocking=True) joins the legacy
    stream, where a record fails (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) and invalidates that
    capture: the retirer's record of work launched before it broke the capture and leaked
    the work. The marker stays open while the capture lasts (a host wait: CaptureError); the
    capture ends valid and the work retires after."""
    import time
    import warnings
    import gpu_kernels as K
    from cuda.bindings import driver as cu
    from sharedmem.runtime import retirer
    dev = sm.Device(0)
    x = sm.Buffer.zeros(N, "float32", device=dev)
    slow = K.kernel("slow_fill")
    sm.launch(slow, 1, 32, sm.Out(x), 32, 1.0, np.int64(K.cycles(5)))
    sm.synchronize()  # (the kernel loaded, the retirer thread started)
    before = sm.stats()
    theirs = cp.cuda.Stream()  # (blocking)
    y = cp.zeros(1 << 20, cp.uint8)
    cp.cuda.Device(0).synchronize()
    GLOBAL = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no LeakWarning)
        real, paused = retirer._pass, [True]  # (the retirer records nothing before the
        monkeypatch.setattr(retirer, "_pass",    # capture begins)
                            lambda rt, last: ({}, True) if paused[0] else real(rt, last))
        fut = sm.launch(slow, 1, 32, sm.Out(x), 32, 2.0, np.int64(K.cycles(20)))
        assert cu.cuStreamBeginCapture(theirs.ptr, GLOBAL)[0] == cu.CUresult.CUDA_SUCCESS
        assert not fut._s.marker.recorded
        paused[0] = False
        ended = []
        try:
            assert cu.cuMemsetD8Async(y.data.ptr, 3, y.nbytes, theirs.ptr)[0] == 0
            time.sleep(0.05)  # (the retirer polls the pending launch meanwhile)
            with pytest.raises(sm.CaptureError, match=r"^cannot wait for sharedmem's work on "
                                                      r"the legacy default stream of cuda:0"):
                fut.result()
            with pytest.raises(TimeoutError):
                fut.result(0.01)
        finally:
            ended.append(_end_capture(cu, theirs.ptr))
        assert ended == [cu.CUresult.CUDA_SUCCESS]  # (not ..._STREAM_CAPTURE_INVALIDATED)
        assert fut.result(30) is None
        sm.synchronize()
    assert sm.stats().leaked == before.leaked
    assert x.to_host()[:32].tolist() == [2.0] * 32


@pytest.mark.parametrize("where", ["another thread", "this thread"])
def test_a_user_threads_queries_and_waits_beside_a_global_mode_capture_leave_it_valid(
        cp, where):
    """As above, for sharedmem's calls from a user thread -- a launch's sweep of finished
    work, ``done()``, ``result()`` -- while another library captures in global mode, in
    another thread or in this one (torch.cuda.graph around sharedmem launches on other
    streams): in the driver's default mode they were refused and the capture invalidated.
    They ask in relaxed mode; the capture ends valid, the thread's mode is its own after."""
    import warnings
    import gpu_kernels as K
    from cuda.bindings import driver as cu
    from sharedmem.runtime.submission import SWEEP_EVERY
    dev = sm.Device(0)
    x = sm.Buffer.zeros(N, "float32", device=dev)
    s = dev.create_stream("busy")
    slow = K.kernel("slow_fill")
    sm.launch(slow, 1, 32, sm.Out(x), 32, 1.0, np.int64(K.cycles(5)), stream=s)
    sm.synchronize()
    before = sm.stats()
    GLOBAL = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no LeakWarning)
        fut = sm.launch(slow, 1, 32, sm.Out(x), 32, 2.0, np.int64(K.cycles(20)), stream=s)
        with _their_global_capture(cp, where) as ended:
            fut.done()  # (a query)
            for i in range(2 * SWEEP_EVERY):  # (every SWEEP_EVERY-th launch sweeps)
                sm.launch(slow, 1, 32, sm.Out(x), 32, 3.0, np.int64(0), stream=s)
            assert fut.result(30) is None  # (queries until done)
            sm.launch(slow, 1, 32, sm.Out(x), 32, 4.0, np.int64(0), stream=s).result()
        assert ended == [cu.CUresult.CUDA_SUCCESS]  # (not ..._STREAM_CAPTURE_INVALIDATED)
        sm.synchronize()
    err, mode = cu.cuThreadExchangeStreamCaptureMode(GLOBAL)
    assert err == cu.CUresult.CUDA_SUCCESS and mode == GLOBAL  # (this thread's, as it was)
    assert sm.stats().leaked == before.leaked
    assert x.to_host()[:32].tolist() == [4.0] * 32


@pytest.mark.parametrize("where", ["another thread", "this thread"])
def test_sharedmem_objects_collected_during_a_global_mode_capture_leave_it_valid(cp, where):
    """What sharedmem's objects own is destroyed when they die -- a stream of its own, a
    user event's CUDA event, a graph's executable -- from whichever thread the collector
    runs in, whenever it runs: here while another library captures in global mode
    (torch.cuda.graph's default), in another thread or in this one. None of it may be a
    call the driver refuses meanwhile, which would invalidate that capture: on an H100
    (2026-12-07) it refused queries (cuEventQuery, cuStreamQuery), cuMemAlloc and cuMemFree
    in the thread's default mode, and allowed creating and destroying events, streams and
    graphs, recording events and launching on other streams."""
    import gc
    import weakref
    import gpu_kernels as K
    from cuda.bindings import driver as cu
    dev = sm.Device(0)
    x = sm.Buffer.zeros(N, "float32", device=dev)
    GLOBAL = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL

    def doomed():
        """A stream of sharedmem's, an event recorded on it and a graph replayed there,
        each in a reference cycle: only the collector frees them."""
        s = dev.create_stream("doomed")
        sm.launch(K.kernel("fill"), 64, 256, sm.Out(x), N, 1.0, stream=s)
        with sm.capture(s) as g:
            sm.launch(K.kernel("fill"), 64, 256, sm.Out(x), N, 2.0, stream=s)
        g.replay(s).result()
        ev = s.record()
        ev.synchronize()
        cycle = [s, ev, g]
        cycle.append(cycle)
        return [weakref.ref(o) for o in (s, g, s._impl)]  # (the event: in the cycle)

    refs = doomed()
    sm.synchronize()
    gc.collect()  # (what earlier tests left: freed before the capture begins)
    refs = doomed()
    sm.synchronize()
    gc.disable()  # (the one collection below frees them, within the capture)
    try:
        with _their_global_capture(cp, where) as ended:
            gc.collect()
            assert [r() for r in refs] == [None] * len(refs)  # (destroyed meanwhile)
    finally:
        gc.enable()
    assert ended == [cu.CUresult.CUDA_SUCCESS]  # (not ..._STREAM_CAPTURE_INVALIDATED)
    err, mode = cu.cuThreadExchangeStreamCaptureMode(GLOBAL)
    assert err == cu.CUresult.CUDA_SUCCESS and mode == GLOBAL  # (this thread's, as it was)
    sm.synchronize()
    assert x.to_host()[:4].tolist() == [2.0] * 4


def test_cai_consumers_on_cupy_streams_their_user_dropped_are_let_go_in_order(cp):
    """A long-lived view read through ``cupy.asarray`` under a new CuPy stream per request,
    each stream dropped after its slow kernel was enqueued: sharedmem keeps only the newest
    stream (each let-go stream's part of the hold ends at an event recorded there), and a
    sharedmem write of the view after all of them still waits for every slow read."""
    import gc
    import weakref
    import gpu_kernels as K
    dev = sm.Device(0)
    w = sm.Buffer.from_host(np.full(N, 7.0, np.float32), device=dev)
    sm.synchronize()
    refs, outs = [], []
    for _ in range(8):
        s = cp.cuda.Stream(non_blocking=True)
        refs.append(weakref.ref(s))
        with s:
            a = cp.asarray(w)  # (the CUDA Array Interface: a hold on CuPy's current stream)
            out = cp.empty(N, cp.float32)
            K.kernel("slow_copy")((64,), (256,), (a, out, np.int32(N),
                                                  np.int64(K.cycles(SPIN_MS))))
            outs.append(out)
            del a
        del s
    writer = dev.create_stream("writer")
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(w), N, 1.0, np.int64(0),
              stream=writer).result()
    cp.cuda.Device(0).synchronize()
    sm.synchronize()
    gc.collect()
    assert [r for r in refs if r() is not None] == [refs[-1]]
    assert [(float(o[0]), float(o[-1])) for o in outs] == [(7.0, 7.0)] * 8
    assert float(w.to_host()[0]) == 1.0
