"""A consumer's work captured into a graph through a hold opened before the capture."""

import pytest

import sharedmem as sm


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
