"""The CUDA backend under adversarial use, over the fake driver (tests/fake_cuda.py): running
out of device memory, and driver error codes the bindings do not know."""

import contextlib
import re
import sys
import threading
import warnings
import weakref

import numpy as np
import pytest

import sharedmem as sm

from conftest import gc_collect_harder


@pytest.fixture(params=["bindings", "hot"])
def fake(monkeypatch, request):
    """A CUDA device over the fake driver (as test_cuda_backend_fake's fixture)."""
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, request.param == "hot")
    yield dev, drv
    sm.synchronize()
    del dev
    gc_collect_harder()


def _retirer_sweeps_nothing(monkeypatch):
    """Only the test's own calls retire work (the retirer's passes do nothing)."""
    from sharedmem.runtime import retirer
    monkeypatch.setattr(retirer, "_pass", lambda rt, last: ({}, True))


def _quiet_stream_and_buffer(dev, monkeypatch):
    """A stream of ``dev`` only the test's own calls retire on, a buffer made there and
    settled, and the stats then: ``(stream, buffer, stats)``."""
    _retirer_sweeps_nothing(monkeypatch)
    s = dev.create_stream("s")
    b = sm.Buffer.zeros(8, "float32", device=dev, stream=s)
    sm.synchronize()
    return s, b, sm.stats()


@contextlib.contextmanager
def _global_capture(drv, where="another thread"):
    """Another library's capture in global mode (torch.cuda.graph's default) of a stream of
    its own, begun in another thread or in this one, around the block; yields the list that
    its end's answer goes to (0, or CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)."""
    theirs = drv.cuStreamCreate(1)[1]
    began, go_on, ended = threading.Event(), threading.Event(), []

    def capture():
        assert drv.cuStreamBeginCapture(theirs, 0)[0] == 0  # CU_STREAM_CAPTURE_MODE_GLOBAL
        began.set()
        go_on.wait(10)
        ended.append(drv.cuStreamEndCapture(theirs)[0])

    if where == "another thread":
        t = threading.Thread(target=capture)
        t.start()
        assert began.wait(10)
    else:
        assert drv.cuStreamBeginCapture(theirs, 0)[0] == 0
    try:
        yield ended
    finally:
        if where == "another thread":
            go_on.set()
            t.join(10)
        else:
            ended.append(drv.cuStreamEndCapture(theirs)[0])


class OutOfMemoryError(MemoryError):
    """As ``cupy.cuda.memory.OutOfMemoryError`` (a MemoryError), with CuPy's words."""


def _device_of(monkeypatch, capacity):
    """Make the fake CuPy pool's device hold ``capacity`` bytes: an allocation beyond what
    is alive raises OutOfMemoryError, as CuPy's pool does once it freed its cached blocks.
    Returns a list holding the bytes alive."""
    import fake_cuda
    live = [0]

    def freed(n):
        live[0] -= n

    def alloc(n):
        if live[0] + n > capacity:
            raise OutOfMemoryError(f"Out of memory allocating {n:,} bytes (allocated so far: "
                                   f"{live[0]:,} bytes).")
        block = fake_cuda._FakeBlock(n)
        live[0] += n
        weakref.finalize(block, freed, n)
        return block

    monkeypatch.setattr(sys.modules["cupy"].cuda, "alloc", alloc)
    return live


def test_an_allocation_that_finds_the_device_full_retires_finished_work_first(
        fake, monkeypatch):
    """Memory whose last view is gone stays leased by the work that used it until that work is
    retired (a sweep every SWEEP_EVERY submissions, or the retirer's next pass). An allocation
    that finds the device full retires what has finished -- its blocks go back to the pool --
    and tries again: a loop that allocates, launches and drops must not fail while finished
    work still holds the memory it needs."""
    dev, drv = fake
    _retirer_sweeps_nothing(monkeypatch)
    s = dev.create_stream("s")
    sm.synchronize()
    live = _device_of(monkeypatch, 4096)
    a = sm.Buffer.empty(1024, "uint32", device=dev)
    a.fill_zero(stream=s)  # done at once (the fake runs it), not retired: nothing swept yet
    del a
    gc_collect_harder()
    assert live[0] == 4096 and s.pending == 1  # kept by the unretired fill
    b = sm.Buffer.empty(1024, "uint32", device=dev)
    assert b.nbytes == 4096 and s.pending == 0


def test_out_of_device_memory_is_a_memory_error_naming_the_size_and_the_device(
        fake, monkeypatch):
    """docs/errors.md: MemoryError, its message naming the size and the device; nothing is
    left allocated."""
    dev, drv = fake
    live = _device_of(monkeypatch, 4096)
    before = sm.stats()
    with pytest.raises(MemoryError, match=r"8192 bytes on <Device cuda:0") as e:
        sm.Buffer.empty(2048, "uint32", device=dev)
    assert "Out of memory allocating 8,192 bytes" in str(e.value)  # (CuPy's own words kept)
    assert live[0] == 0 and sm.stats() == before


@pytest.fixture
def hot(monkeypatch):
    """A CUDA device over the fake driver, the per-launch calls through ``backend.hot`` (the
    driver's codes come back as ints, as libcuda returns them)."""
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, True)
    yield dev, drv
    sm.synchronize()
    del dev
    gc_collect_harder()


#: An error code the bindings' CUresult does not know (a driver newer than cuda-bindings: the
#: hot driver gets libcuda's return value itself)
NEW_CODE = 12345


def test_a_batch_record_failing_with_a_code_the_bindings_do_not_know_keeps_the_memory(
        hot, monkeypatch):
    """cuEventRecord through the hot driver answers an int; one the bindings' CUresult has no
    member for made the CudaError's construction raise ValueError -- out of the MARKER_BATCH-th
    submission's enqueue, after its work was on the stream: that work then ran with no lease
    (and the marker stayed open, raising again at each ask). It is a CudaError naming the code,
    and the completion of the work that joined the marker is unknown: its memory is kept."""
    import sharedmem.backends.cuda as bc
    dev, drv = hot
    s, b, before = _quiet_stream_and_buffer(dev, monkeypatch)
    real = drv.cuEventRecord
    monkeypatch.setattr(drv, "cuEventRecord",
                        lambda ev, st: (NEW_CODE,) if int(st) == s.handle else real(ev, st))
    futs = [b.fill_zero(stream=s) for _ in range(bc.MARKER_BATCH)]
    marker = futs[-1]._s.marker
    assert isinstance(marker.error, sm.CudaError) and marker.error.code == NEW_CODE
    assert str(NEW_CODE) in str(marker.error) and "cuEventRecord" in str(marker.error)
    with pytest.warns(sm.LeakWarning):
        with pytest.raises(sm.CompletionUnknownError):
            futs[-1].result()
    after = sm.stats()
    assert (after.submitted, after.leaked) == (before.submitted + bc.MARKER_BATCH,
                                              before.leaked + bc.MARKER_BATCH)


def test_a_query_failing_with_a_code_the_bindings_do_not_know_is_unknown_completion(
        hot, monkeypatch):
    """As above for cuEventQuery: the marker's completion is unknown (a CudaError), not a
    ValueError out of every sweep (the retirer's re-raised at each later API call) with the
    work never retired nor counted as leaked."""
    dev, drv = hot
    s, b, before = _quiet_stream_and_buffer(dev, monkeypatch)
    monkeypatch.setattr(drv, "cuEventQuery", lambda ev: (NEW_CODE,))
    fut = b.fill_zero(stream=s)
    with pytest.warns(sm.LeakWarning):
        with pytest.raises(sm.CompletionUnknownError) as e:
            fut.result(5)
    assert e.value.__cause__.code == NEW_CODE
    assert sm.stats().leaked == before.leaked + 1


def test_a_launch_failing_with_a_code_the_bindings_do_not_know_is_a_cuda_error(
        fake, monkeypatch):
    """cuLaunchKernel's code through the hot driver, or as the bindings return it: a code the
    bindings' CUresult does not know is a CudaError naming it (it was a ValueError), and the
    launch took no lease."""
    from fake_cuda import RawKernel
    dev, drv = fake
    code = 'extern "C" __global__ void k(float* x, int n) { }'
    k = RawKernel(drv, "k", ["Q", "i"], lambda x, n: None, code)
    x = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()
    before = sm.stats()
    monkeypatch.setattr(drv, "cuLaunchKernel", lambda *a: (NEW_CODE,))
    with pytest.raises(sm.CudaError, match=rf"^cuLaunchKernel failed: CUresult {NEW_CODE} ") as e:
        sm.launch(k, 1, 8, x, 8)
    assert e.value.code == NEW_CODE and sm.stats().submitted == before.submitted
    sm.Tensor.from_buffer(x, (8,))  # no lease, no alias left behind


def test_work_on_a_borrowed_stream_has_its_completion_event_recorded_at_once(
        fake, monkeypatch):
    """On a stream sharedmem owns, a launch joins the stream's open event, recorded later
    (the MARKER_BATCH-th joiner, a sweep, a wait). On a borrowed stream it is recorded at
    once, as a hold's end is: its owner may destroy the stream right after (legal in CUDA:
    the work still runs; cuda.core's Stream.close()) -- a later record went to a dead handle,
    the work's completion became unknown and its memory leaked, or, the handle reused, to
    another stream -- or begin a capture on it, which would take the record in."""
    dev, drv = fake
    _retirer_sweeps_nothing(monkeypatch)
    h = int(drv.cuStreamCreate(1)[1])

    class CoreStream:  # (as cuda.core's Stream: __cuda_stream__, and close() destroys it)
        closed = False

        def __cuda_stream__(self):
            return (0, h)

        def close(self):
            self.closed = True

    cs = CoreStream()
    real = drv.cuEventRecord
    monkeypatch.setattr(drv, "cuEventRecord", lambda ev, st: (
        (drv.CUresult.CUDA_ERROR_INVALID_HANDLE,) if cs.closed and int(st) == h
        else real(ev, st)))
    x = sm.Buffer.zeros(8, "float32", device=dev)
    own = dev.create_stream("own")
    sm.synchronize()
    before = sm.stats()
    assert not x.fill_zero(stream=own)._s.marker.recorded  # (joined: recorded later)
    fut = x.fill_zero(stream=cs)
    assert fut._s.marker.recorded
    cs.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no LeakWarning)
        assert fut.result(5) is None
        sm.synchronize()
    assert sm.stats().leaked == before.leaked
    sm.Tensor.from_buffer(x, (8,))  # its bytes not kept: nothing leased them past the work


def test_a_query_refused_beside_a_global_mode_capture_is_pending_not_unknown(
        hot, monkeypatch):
    """cuEventQuery answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED to a thread whose mode
    forbids it to ask while another thread captures in global mode (torch.cuda.graph's
    default). That says nothing of the work: it was taken for unknown completion, and the
    memory leaked. It is pending -- asked again, it retires."""
    dev, drv = hot
    s, b, before = _quiet_stream_and_buffer(dev, monkeypatch)
    real, capturing = drv.cuEventQuery, [True]
    monkeypatch.setattr(drv, "cuEventQuery", lambda ev: (
        (drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,) if capturing[0] else real(ev)))
    fut = b.fill_zero(stream=s)
    assert not fut.done() and fut._s.marker.error is None
    capturing[0] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no LeakWarning)
        assert fut.result(5) is None
    assert sm.stats().leaked == before.leaked


def test_the_retirer_thread_asks_in_relaxed_capture_mode(fake):
    """What a backend registers with on_retirer_thread runs once on the retirer's own thread;
    the CUDA backend's sets the relaxed capture mode there (its queries beside another
    library's global-mode capture are then allowed, and leave that capture valid)."""
    import time
    import sharedmem.backends.cuda as bc
    from sharedmem.runtime import callbacks, retirer
    dev, drv = fake
    sm.Buffer.zeros(8, "float32", device=dev).fill_zero()  # (the retirer running, woken)
    retirer.wake()
    deadline = time.monotonic() + 5  # (this test's fake driver: its own registration)
    me = threading.get_ident()
    while (set(getattr(drv, "capture_modes", {})) <= {me} and
           time.monotonic() < deadline):
        time.sleep(0.01)
    # (the retirer's: CU_STREAM_CAPTURE_MODE_RELAXED; this thread's, its allocation made in
    # relaxed mode, given back: the default)
    assert drv.capture_modes == {callbacks.retirer_ident[0]: 2, me: 0}
    bc._relax_capture_mode(None)  # (a driver gone: nothing)
    ran = []
    retirer.on_retirer_thread(lambda: ran.append(threading.get_ident()))
    sm.Buffer.zeros(8, "float32", device=dev).fill_zero()  # (the retirer running, woken)
    retirer.wake()
    deadline = time.monotonic() + 5
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == [callbacks.retirer_ident[0]]


def test_a_launch_past_the_default_shared_memory_limit_says_how_to_opt_in(fake, monkeypatch):
    """Dynamic shared memory is checked against the device's opt-in maximum (227 KiB on an
    H200); past 48 KiB the driver refuses a kernel that has not opted in with a bare
    CUDA_ERROR_INVALID_VALUE. The error says what to set; the launch took no lease."""
    from fake_cuda import RawKernel
    dev, drv = fake
    k = RawKernel(drv, "k", ["Q", "i"], lambda x, n: None,
                  'extern "C" __global__ void k(float* x, int n) { }')
    x = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()
    before = sm.stats()
    monkeypatch.setattr(drv, "cuLaunchKernel",
                        lambda *a: (drv.CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(sm.CudaError, match=r"^cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE "
                                           r"\(1\): the launch asks for 65536 bytes of dynamic "
                                           r"shared memory.*kernel\.max_dynamic_shared_size_"
                                           r"bytes = 65536") as e:
        sm.launch(k, 1, 8, x, 8, shared_mem=65536)
    assert e.value.code == 1 and sm.stats().submitted == before.submitted
    with pytest.raises(sm.CudaError, match=r"^cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE "
                                           r"\(1\)$"):  # (within the default limit: no hint)
        sm.launch(k, 1, 8, x, 8, shared_mem=1024)
    sm.Tensor.from_buffer(x, (8,))  # no lease left behind


@pytest.mark.parametrize("where", ["another thread", "this thread"])
def test_queries_and_waits_beside_another_librarys_global_mode_capture_leave_it_valid(
        fake, monkeypatch, where):
    """A capture another library began in global mode (torch.cuda.graph's default) forbids a
    thread in the driver's default mode to query or wait for events -- any thread while it
    lasts, the capturing thread itself too -- and a refused call invalidates the capture.
    sharedmem's own calls from a user thread (a launch's sweep of finished work, ``done()``,
    ``result()``) asked in the default mode: the other library's capture ended
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. They ask in relaxed mode (the events are
    sharedmem's, never recorded in that capture), and the thread's mode is given back."""
    from sharedmem.runtime.submission import SWEEP_EVERY
    dev, drv = fake
    s, b, before = _quiet_stream_and_buffer(dev, monkeypatch)
    with _global_capture(drv, where) as ended:
        drv.holding = True  # (the work in flight)
        fut = b.fill_zero(stream=s)
        assert not fut.done()
        for _ in range(2 * SWEEP_EVERY):  # (every SWEEP_EVERY-th launch sweeps its stream)
            b.fill_zero(stream=s)
        drv.holding = False
        drv.finish_held()
        assert fut.result(5) is None and fut.done()
        b.fill_zero(stream=s).result()  # (a wait with no timeout: cuEventSynchronize)
    assert ended == [0]  # (not CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    assert drv.capture_modes[threading.get_ident()] == 0  # (the thread's mode as it was)
    sm.synchronize()
    assert sm.stats().leaked == before.leaked


@pytest.mark.parametrize("where", ["another thread", "this thread"])
def test_memory_made_mapped_or_synchronized_beside_a_global_mode_capture_leaves_it_valid(
        fake, monkeypatch, where):
    """While another library captures in global mode (torch.cuda.graph's default), the driver
    refuses an allocation, a free, a stream synchronization -- and, we assume, an IPC mapping
    or unmapping -- from a thread in its default mode, any thread, the capturing one too, and
    invalidates the capture. sharedmem's own were made so: a Buffer's block from CuPy's pool
    (cudaMalloc where the pool grows), a pinned staging block (CuPy's pinned pool queries the
    events of its finished copies first), another process's memory mapped and unmapped (the
    unmapping from a finalizer, in whichever thread), a stream of its own synchronized
    (``sm.synchronize``'s fallback where a marker could not be recorded). They are made in
    relaxed mode: done, the capture valid, the thread's mode its own after."""
    dev, drv = fake
    s, b, before = _quiet_stream_and_buffer(dev, monkeypatch)
    backend = dev.backend
    exporter = np.zeros(4096, np.uint8)  # (an allocation of "another process", as the driver
    drv.ranges[exporter.ctypes.data] = exporter.nbytes  # knows it: see test_ipc_fake)
    handle = exporter.ctypes.data.to_bytes(8, "little") + bytes(56)
    with _global_capture(drv, where) as ended:
        x = sm.Buffer.empty(1024, "float32", device=dev, stream=s)
        staged = backend.pinned(4096)
        base = backend.ipc_open_mem(handle)
        backend.ipc_close_mem(base)
        s._impl.synchronize()
    assert ended == [0]  # (not CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    assert drv.capture_modes[threading.get_ident()] == 0  # (the thread's mode as it was)
    assert x.nbytes == 4096 and staged is not None and staged.nbytes == 4096  # (not pageable)
    assert ("ipc_open", base) in drv.calls and ("ipc_close", base) in drv.calls
    assert ("stream_sync", int(s.handle)) in drv.calls
    del x, staged
    sm.synchronize()
    assert sm.stats().leaked == before.leaked


def test_a_borrowed_stream_is_synchronized_in_its_threads_own_capture_mode(fake, monkeypatch):
    """Only a stream sharedmem made is synchronized in relaxed mode: a borrowed one is its
    owner's, who may be capturing it, and is waited for as that library's own call would --
    beside another thread's global-mode capture, refused (CudaError), as it would be."""
    dev, drv = fake
    borrowed = sm.Stream.from_external(int(drv.cuStreamCreate(1)[1]), device=dev)
    with _global_capture(drv) as ended:
        with pytest.raises(sm.CudaError, match="cuStreamSynchronize"):
            borrowed._impl.synchronize()
    assert ended == [drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED]


@pytest.mark.parametrize("which", ["a stream of its own", "the default stream"])
def test_synchronize_of_an_unknown_marker_beside_a_global_mode_capture_leaves_it_valid(
        fake, monkeypatch, which):
    """sm's synchronize of a stream whose newest marker could not be recorded waits for the
    stream itself: of the device's default stream too (not borrowed: no owner who could be
    capturing it -- the legacy stream cannot be captured). Beside another thread's
    global-mode capture that wait is made in relaxed mode, as for a stream of its own: it
    ran in the thread's mode for the default stream, refused, and invalidated the capture."""
    from fake_cuda import CUresult
    from sharedmem.runtime.state import locked
    dev, drv = fake
    _retirer_sweeps_nothing(monkeypatch)
    s = dev.create_stream("s") if which == "a stream of its own" else dev.default_stream
    b = sm.Buffer.zeros(8, "float32", device=dev, stream=s)
    sm.synchronize()
    real = drv.cuEventRecord
    monkeypatch.setattr(drv, "cuEventRecord", lambda ev, st: (
        (CUresult.CUDA_ERROR_INVALID_VALUE,) if int(st) == int(s.handle) else real(ev, st)))
    fut = b.fill_zero(stream=s)
    with locked():
        fut._s.marker.close_locked()  # (its record fails: the marker is unknown)
    n = len(drv.calls)
    try:
        with _global_capture(drv) as ended, pytest.warns(sm.LeakWarning, match="is unknown"):
            s.synchronize()
    finally:
        monkeypatch.setattr(drv, "cuEventRecord", real)
    assert ("stream_sync", int(s.handle)) in drv.calls[n:]
    assert ended == [0]  # (not CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    assert drv.capture_modes[threading.get_ident()] == 0


def test_the_default_streams_synchronize_is_refused_while_a_blocking_capture_joins_it(fake):
    """The legacy default stream joined to a blocking stream's capture cannot be waited for
    in any mode (the driver refuses it and invalidates the capture): refused first."""
    dev, drv = fake
    theirs = drv.cuStreamCreate(0)[1]  # (blocking: its capture joins the legacy stream)
    assert drv.cuStreamBeginCapture(theirs, 1)[0] == 0  # (thread-local: the thread's own)
    try:
        with pytest.raises(sm.CaptureError, match="legacy default stream"):
            dev.default_stream._impl.synchronize()
    finally:
        end = drv.cuStreamEndCapture(theirs)[0]
    assert end == 0


def test_a_stream_of_its_own_that_another_library_captures_is_not_synchronized_even_relaxed(
        fake):
    """Relaxed mode lifts the checks of potentially unsafe calls only: a synchronize of the
    capturing stream itself is refused in every mode and invalidates the capture (CUDA's
    programming guide: it is invalid to synchronize a stream being captured) -- a stream of
    sharedmem's whose handle the user gave to torch or CuPy, captured there, is no different
    in relaxed mode (the fake allowed it)."""
    dev, drv = fake
    s = dev.create_stream("s")
    assert drv.cuStreamBeginCapture(s.handle, 0)[0] == 0  # (as torch.cuda.graph on it)
    try:
        with pytest.raises(sm.CudaError, match="cuStreamSynchronize"):
            s._impl.synchronize()
    finally:
        end = drv.cuStreamEndCapture(s.handle)[0]
    assert end == drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED


def test_an_interrupted_wait_before_a_host_copy_gives_its_events_back(fake, monkeypatch):
    """A copy the driver performs synchronously first waits, holding no lock, for what it
    follows, on markers it records itself from the pool (wait_before). An interrupt of that
    wait (KeyboardInterrupt) skipped their return: each such interrupt lost a pooled event,
    never destroyed. They go back to the pool, as after a finished wait."""
    from sharedmem.runtime.submission import wait_before
    dev, drv = fake
    s, b, before = _quiet_stream_and_buffer(dev, monkeypatch)
    pool = dev.backend._events
    while len(pool) < 2:
        pool.append(drv.cuEventCreate(0)[1])
    n = len(pool)

    def interrupted(ev):
        raise KeyboardInterrupt

    real = drv.cuEventSynchronize
    monkeypatch.setattr(drv, "cuEventSynchronize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        wait_before(b._token, s, True)
    assert len(pool) == n
    monkeypatch.setattr(drv, "cuEventSynchronize", real)
    wait_before(b._token, s, True)
    assert len(pool) == n


def test_a_host_wait_refused_beside_a_global_mode_capture_is_a_capture_error_not_unknown(
        hot, monkeypatch):
    """cuEventSynchronize, as cuEventQuery, answers CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED to a
    thread whose mode forbids it to wait while a capture in global mode is under way
    (torch.cuda.graph's default) -- sharedmem's waits ask in relaxed mode, but where that mode
    cannot be set, the driver refuses. That says nothing of the work: the wait took it for unknown
    completion -- CompletionUnknownError, and the work's memory kept for good (LeakWarning).
    The wait is refused (CaptureError, saying why and what to do); the work is not unknown,
    and once the capture ended it retires."""
    dev, drv = hot
    s, b, before = _quiet_stream_and_buffer(dev, monkeypatch)
    capturing = [True]
    refused = (drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
    query, sync = drv.cuEventQuery, drv.cuEventSynchronize
    monkeypatch.setattr(drv, "cuEventQuery",
                        lambda ev: refused if capturing[0] else query(ev))
    monkeypatch.setattr(drv, "cuEventSynchronize",
                        lambda ev: refused if capturing[0] else sync(ev))
    fut = b.fill_zero(stream=s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no LeakWarning)
        with pytest.raises(sm.CaptureError, match=r"global mode.*capture_error_mode"):
            fut.result()
        assert fut._s.marker.error is None and not fut.done()
        capturing[0] = False
        assert fut.result() is None
    assert sm.stats().leaked == before.leaked


def test_the_shared_memory_opt_in_hint_follows_the_kernels_own_limit(fake, monkeypatch):
    """The opt-in hint is for a launch past the kernel's own limit of dynamic shared memory
    (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: 48 KiB less its static shared memory
    until it opts in). A kernel that opted in already, refused for another reason, was told
    to set what it had set; one whose static shared memory leaves less than 48 KiB, refused
    for a launch within 48 KiB, was told nothing. The error names the kernel."""
    import types
    from fake_cuda import RawKernel
    dev, drv = fake
    k = RawKernel(drv, "k", ["Q", "i"], lambda x, n: None,
                  'extern "C" __global__ void k(float* x, int n) { }')
    x = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()
    limit = {}  # CUfunction -> its max dynamic shared size (the driver's answer)
    monkeypatch.setattr(drv, "CUfunction_attribute", types.SimpleNamespace(
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8), raising=False)
    monkeypatch.setattr(drv, "cuFuncGetAttribute", lambda attr, f: (
        drv.CUresult.CUDA_SUCCESS, limit[int(f)]) if int(attr) == 8 else (
        drv.CUresult.CUDA_ERROR_INVALID_VALUE, 0), raising=False)
    monkeypatch.setattr(drv, "cuLaunchKernel",
                        lambda *a: (drv.CUresult.CUDA_ERROR_INVALID_VALUE,))
    func = k.kernel.ptr
    limit[func] = 65536  # (opted in: the refusal is something else's)
    with pytest.raises(sm.CudaError, match=r"^cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE "
                                           r"\(1\)$"):
        sm.launch(k, 1, 8, x, 8, shared_mem=65536)
    limit[func] = 16384  # (32 KiB of static shared memory: 16 KiB left without opting in)
    with pytest.raises(sm.CudaError, match=r"^cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE "
                                           r"\(1\): the launch asks for 20000 bytes of dynamic "
                                           r"shared memory, more than kernel 'k' takes "
                                           r"\(16384 bytes.*kernel\.max_dynamic_shared_size_"
                                           r"bytes = 20000"):
        sm.launch(k, 1, 8, x, 8, shared_mem=20000)
    sm.Tensor.from_buffer(x, (8,))  # no lease left behind


def test_default_stream_work_beside_a_blocking_streams_capture_stays_pending(fake):
    """Markers of the device's default stream (the legacy one) are recorded lazily -- at a
    sweep, a wait, or a later stream's order. A capture another library begins on a blocking
    stream (cupy.cuda.Stream() without non_blocking=True) joins the legacy stream: a record
    there failed (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT), invalidated that capture, and made the
    work unknown -- its memory leaked with a LeakWarning. The marker stays open while the
    capture lasts: the work is pending, a host wait is a CaptureError, a later stream's order
    after it a CaptureError taking no lease; once the capture ends it retires."""
    import time
    import warnings
    from sharedmem.runtime import retirer
    dev, drv = fake
    b = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()
    before = sm.stats()
    s = dev.create_stream("s")
    fut = b.fill_zero()  # (the device's default stream: the legacy stream, handle 0)
    assert fut._s.stream is dev.default_stream and not fut._s.marker.recorded
    theirs = drv.cuStreamCreate(0)[1]  # (blocking: flags 0)
    assert drv.cuStreamBeginCapture(theirs, 0)[0] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no LeakWarning)
        for _ in range(3):
            retirer.wake()
            time.sleep(0.01)
        assert not fut.done() and fut._s.marker.error is None
        with pytest.raises(sm.CaptureError, match=r"^cannot wait for sharedmem's work on the "
                                                  r"legacy default stream of cuda:0 now: a "
                                                  r"blocking stream of its context is "
                                                  r"capturing a CUDA graph .* The work stays "
                                                  r"pending, not unknown$"):
            fut.result()
        with pytest.raises(TimeoutError):
            fut.result(0.02)  # (a wait with a timeout: pending while the capture lasts)
        in_use = sm.stats()
        with pytest.raises(sm.CaptureError, match=r"^cannot order after sharedmem's work on "
                                                  r"the legacy default stream of cuda:0 now"):
            b.fill_zero(stream=s)  # (ordered after the default stream's write)
        assert sm.stats().submitted == in_use.submitted  # (nothing submitted, nothing leased)
        assert drv.cuStreamEndCapture(theirs)[0] == 0  # (not INVALIDATED)
        assert fut.result(5) is None
        b.fill_zero(stream=s).result()
        sm.synchronize()
    assert sm.stats().leaked == before.leaked


def _blocking_capture(drv):
    """Another library's capture of a blocking stream (cupy.cuda.Stream().begin_capture()):
    the legacy default stream is joined to it. Returns the capturing stream's handle."""
    theirs = drv.cuStreamCreate(0)[1]  # (blocking: flags 0)
    assert drv.cuStreamBeginCapture(theirs, 0)[0] == 0
    return theirs


def test_a_default_stream_marker_whose_context_cannot_be_made_current_is_unknown(
        fake, monkeypatch):
    """close_locked never raises: the work that joined the marker is enqueued already (a
    launch's MARKER_BATCH-th join records it; a sweep or a wait asks it). Whether the legacy
    default stream is joined to a capture is asked with the device's context current; where that
    context cannot be made current the marker is unknown -- as where the record itself
    fails --, not a CudaError raised out of every sweep and wait (the retirer's at each pass,
    the FIFO never moving)."""
    import sharedmem.backends.cuda as bc
    from fake_cuda import CUresult
    dev, drv = fake
    _retirer_sweeps_nothing(monkeypatch)
    b = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()
    before = sm.stats()
    fut = b.fill_zero()  # (the default stream: its marker left open)
    assert not fut._s.marker.recorded
    drv.cuCtxSetCurrent = lambda ctx: (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
    try:
        drv.current = 0  # (no context current in this thread, and none can be made current)
        bc._current.ctx = None
        with pytest.warns(sm.LeakWarning, match="is unknown"):
            sm.synchronize()
    finally:
        del drv.cuCtxSetCurrent
    assert fut._s.marker.error is not None
    assert sm.stats().leaked == before.leaked + 1


def test_an_order_after_a_default_stream_hold_beside_a_blocking_capture_is_a_capture_error(
        fake, monkeypatch):
    """A consumer on the legacy stream (``__dlpack__(stream=1)``) holds a view's bytes while
    another library captures a blocking stream: no event can be recorded on the legacy stream
    until that capture ends. A launch on another stream ordered after the hold, a use
    declared on the default stream (record_use), and the default stream's synchronize()
    cannot be done now -- a CaptureError, the work pending -- not a CompletionUnknownError
    saying a record failed and asking whether the consumer's stream was destroyed, nor a
    synchronize() that returns having waited for nothing; the capture stays valid."""
    dev, drv = fake
    _retirer_sweeps_nothing(monkeypatch)
    s = dev.create_stream("s")
    b = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()
    before = sm.stats()
    cap = b.__dlpack__(stream=1)  # (a consumer on the legacy default stream holds the bytes)
    theirs = _blocking_capture(drv)
    with pytest.raises(sm.CaptureError, match=r"^cannot order after .* on the legacy default "
                                              r"stream of cuda:0 now"):
        b.fill_zero(stream=s)
    with pytest.raises(sm.CaptureError, match=r"legacy default stream of cuda:0"):
        sm.record_use(b, dev.default_stream)
    with pytest.raises(sm.CaptureError, match=r"legacy default stream of cuda:0"):
        dev.default_stream.synchronize()  # (a host wait for everything given to it)
    assert sm.stats().submitted == before.submitted  # (nothing submitted, nothing leased)
    assert drv.cuStreamEndCapture(theirs)[0] == 0  # (not INVALIDATED)
    del cap  # (the hold ends on the legacy stream)
    b.fill_zero(stream=s).result()
    sm.synchronize()
    assert sm.stats().leaked == before.leaked


def test_a_dlpack_export_to_the_legacy_stream_beside_a_blocking_capture_is_refused(
        fake, monkeypatch):
    """``__dlpack__(stream=1)`` (CuPy's consumer on its null stream) orders the legacy default
    stream after pending writes on other streams: a wait enqueued there while a blocking
    stream captures is refused by the driver (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) and
    invalidates that capture. It is a CaptureError before anything is enqueued, nothing
    exported, the capture left valid -- as an export to a capturing stream's own handle is."""
    dev, drv = fake
    s, b, before = _quiet_stream_and_buffer(dev, monkeypatch)
    fut = b.fill_zero(stream=s)  # (pending: the export orders its consumer after it)
    theirs = _blocking_capture(drv)
    with pytest.raises(sm.CaptureError, match=r"^cannot make the legacy default stream of "
                                              r"cuda:0 wait for other work now"):
        b.__dlpack__(stream=1)
    assert drv.cuStreamEndCapture(theirs)[0] == 0  # (not INVALIDATED)
    cap = b.__dlpack__(stream=1)  # (once it ended: exported, ordered after the write)
    del cap
    fut.result()
    sm.synchronize()
    assert sm.stats().leaked == before.leaked


def test_an_event_on_the_default_stream_beside_a_blocking_capture_is_a_capture_error(fake):
    """``Stream.record()`` on the device's default stream (the legacy one) while a blocking
    stream captures: a record there is refused by the driver (CUDA_ERROR_STREAM_CAPTURE_
    IMPLICIT), which invalidates that capture. A CaptureError, nothing recorded, the capture
    left valid."""
    dev, drv = fake
    theirs = _blocking_capture(drv)
    with pytest.raises(sm.CaptureError, match=r"^cannot record an event after sharedmem's "
                                              r"work on the legacy default stream of cuda:0"):
        dev.default_stream.record()
    assert drv.cuStreamEndCapture(theirs)[0] == 0  # (not INVALIDATED)
    ev = dev.default_stream.record()
    ev.synchronize()


def test_a_launch_on_the_default_stream_beside_a_blocking_capture_takes_no_lease(
        fake, monkeypatch):
    """Work given to the legacy default stream while a blocking stream captures is refused by
    the driver (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT; the driver also invalidates that capture:
    the user's own launch there, as a CuPy kernel on the null stream would): the launch
    raises, nothing submitted or leased -- the buffer is free for the next writer at once."""
    dev, drv = fake
    s, b, before = _quiet_stream_and_buffer(dev, monkeypatch)
    theirs = _blocking_capture(drv)
    with pytest.raises(sm.CudaError) as err:
        b.fill_zero()
    assert err.value.code == 906
    assert re.search(r"failed: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT \(906\); a blocking stream of "
                     r"this context is capturing a CUDA graph \(another library's capture: "
                     r"cupy.cuda.Stream.begin_capture, torch.cuda.graph\), and the legacy "
                     r"default stream cannot take work meanwhile -- the driver also invalidated "
                     r"that capture. Launch on a non-blocking stream \(device.create_stream\(\)\), "
                     r"or after the capture ends$", str(err.value)), str(err.value)
    assert sm.stats().submitted == before.submitted
    drv.cuStreamEndCapture(theirs)
    waits = [c for c in drv.calls if c[0] == "wait"]
    b.fill_zero(stream=s).result()  # (no lease on the default stream to wait for)
    assert [c for c in drv.calls if c[0] == "wait"] == waits
    sm.synchronize()
    assert sm.stats().leaked == before.leaked
