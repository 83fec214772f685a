"""Captures on the fake CUDA driver: a consumer's work captured through a hold opened before
the capture, and a capture of a blocking stream (one that synchronizes with the legacy
default stream)."""

import pytest

import sharedmem as sm
from sharedmem.runtime.state import RUNTIME


@pytest.fixture
def fake(monkeypatch):
    from fake_cuda import install_fake_devices
    from conftest import gc_collect_harder
    (dev,), drv = install_fake_devices(monkeypatch, False)
    yield dev, drv
    sm.synchronize()
    del dev
    gc_collect_harder()


def test_a_consumers_work_captured_through_an_open_hold_keeps_its_memory(fake):
    """An export made before the capture, to a consumer on the stream then captured (CuPy's
    current stream: the one sharedmem requires for launches of CuPy arrays in a capture).
    What the consumer enqueues there during the capture is recorded into the graph and runs
    at every replay; the graph must keep those bytes (and lease them at replay) as it does
    for its own launches -- not let them go back to the pool once the hold ends."""
    import weakref
    from conftest import gc_collect_harder
    dev, drv = fake
    s = dev.create_stream("s")
    x = sm.Buffer.zeros(64, "uint8", device=dev, stream=s)
    s.synchronize()
    capsule = x.__dlpack__(stream=s.handle)  # a consumer on s (e.g. cupy.from_dlpack)
    ptr, alloc = x.ptr, weakref.ref(x.allocation)
    with sm.capture(s) as g:
        drv.cuMemsetD8Async(ptr, 7, 64, s.handle)  # the consumer's kernel: captured
        del capsule  # the consumer is done with it (its deleter runs: the hold ends)
    assert drv.execs and len(next(iter(drv.execs.values()))) == 1  # the memset is in the graph
    del x
    sm.synchronize()
    gc_collect_harder()
    assert alloc() is not None, "the graph writes memory that went back to the pool"
    assert alloc().live_views == 1 and f"graph #{g.id}" in alloc().views()[0]
    r = dev.create_stream("r")
    g.replay(r).result()
    g.release()


def test_a_hold_still_open_when_the_capture_ends_is_kept_by_the_graph(fake):
    """As above, with the consumer done only after the capture ended: its work in the graph
    runs at every replay all the same, so the graph keeps the hold's bytes and leases them at
    each replay (the hold's end, later, is leased on the stream only up to then). (An export
    to the stream during the capture is refused: only holds opened before it are open at its
    end.)"""
    import weakref
    from conftest import gc_collect_harder
    dev, drv = fake
    s = dev.create_stream("s")
    x, y, z = (sm.Buffer.zeros(64, "uint8", device=dev, stream=s) for _ in range(3))
    s.synchronize()
    # held since before the capture: x's and z's until after it; y's (opened between them)
    # ends before it begins
    opened = [v.__dlpack__(stream=s.handle) for v in (x, y, z)]
    del opened[1]
    ptr, alloc = x.ptr, weakref.ref(x.allocation)
    others = weakref.ref(y.allocation), weakref.ref(z.allocation)
    with sm.capture(s) as g:
        drv.cuMemsetD8Async(ptr, 7, 64, s.handle)  # the consumer's kernel: captured
    del opened, x, y, z  # the consumer is done with them after the capture
    sm.synchronize()
    gc_collect_harder()
    assert alloc() is not None, "the graph writes memory that went back to the pool"
    assert alloc().live_views == 1 and f"graph #{g.id}" in alloc().views()[0]
    assert others[0]() is None and others[1]() is not None  # (z's: as x's, y's: not held)
    r = dev.create_stream("r")
    g.replay(r).result()
    g.release()
    gc_collect_harder()
    assert alloc() is None and others[1]() is None


def test_capturing_a_borrowed_blocking_stream_does_not_poison_the_default_streams_work(
        fake, monkeypatch):
    """A blocking stream (cupy.cuda.Stream()'s default) captured with sm.capture: the legacy
    default stream is joined to the capture, and an event recorded there fails
    (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and the driver invalidates the capture). Work given
    to the default stream before the capture whose completion marker is still open (batched,
    not recorded) must not be recorded during it -- by the retirer's sweep here -- else its
    completion turns unknown: its memory is leaked and every later use of it raises."""
    import sys
    from sharedmem.runtime import retirer, submission as S
    dev, drv = fake
    monkeypatch.setattr(retirer, "_pass", lambda rt, last: ({}, True))  # (the sweep: below)
    cp = sys.modules["cupy"]
    x = sm.Buffer.zeros(16, "float32", device=dev)  # a memset on the default stream
    blocking = sm.Stream.from_external(cp.cuda.Stream().ptr, dev)
    assert blocking._impl.syncs_with_legacy()
    leaked = RUNTIME.leaked_count  # (not sm.stats(): it sweeps, recording the marker now)
    with sm.capture(blocking) as g:
        sm.Buffer.zeros(16, "float32", device=dev, stream=blocking)
        S.sweep_all()  # (the retirer, meanwhile)
    assert sm.stats().leaked == leaked
    x.fill_zero(stream=dev.create_stream()).result()  # CompletionUnknownError before
    g.replay(blocking).result()
    g.release()


def test_a_hold_on_the_default_stream_ending_during_a_blocking_capture_is_not_leaked(
        fake, monkeypatch):
    """As above, with an export to a consumer on the legacy default stream (stream=1, as
    cupy.from_dlpack names it from CuPy's default stream) made before the capture and released
    during it: the hold's end must not be an event recorded on the legacy stream while the
    capture joins it (refused: the memory would be leaked, its completion unknown)."""
    import sys
    from sharedmem.runtime import retirer, submission as S
    dev, drv = fake
    monkeypatch.setattr(retirer, "_pass", lambda rt, last: ({}, True))  # (the sweep: below)
    cp = sys.modules["cupy"]
    x = sm.Buffer.zeros(16, "float32", device=dev)
    sm.synchronize()
    cap = x.__dlpack__(stream=1, max_version=(1, 0))  # a consumer on the legacy stream
    blocking = sm.Stream.from_external(cp.cuda.Stream().ptr, dev)
    leaked = RUNTIME.leaked_count
    with sm.capture(blocking) as g:
        sm.Buffer.zeros(16, "float32", device=dev, stream=blocking)
        del cap  # (the consumer is done: the hold ends)
        S.sweep_all()  # (the retirer, meanwhile)
    assert sm.stats().leaked == leaked and dev.default_stream._joined is None
    x.fill_zero(stream=dev.create_stream()).result()  # CompletionUnknownError if leaked
    g.replay(blocking).result()
    g.release()
    # a capture that could not begin joins nothing: later hold ends there are recorded anew
    # (not leased until the marker of its begin, long passed)
    from fake_cuda import CUresult
    monkeypatch.setattr(drv, "cuStreamBeginCapture",
                        lambda stream, mode: (CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(sm.CudaError):
        with sm.capture(blocking):
            pass
    assert dev.default_stream._joined is None
