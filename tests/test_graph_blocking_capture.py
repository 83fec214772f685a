"""A capture of a blocking stream (one that synchronizes with the legacy default stream)."""

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
