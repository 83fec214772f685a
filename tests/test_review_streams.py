"""Review of stream and device handling (fake driver, two devices)."""

import numpy as np
import pytest

import sharedmem as sm

from conftest import gc_collect_harder


@pytest.fixture(params=["bindings", "hot"])
def two(monkeypatch, request):
    """Two fake CUDA devices, the default device being CUDA device 0 (as on a GPU machine)."""
    import sharedmem.device as sm_device
    from fake_cuda import install_fake_devices
    devs, drv = install_fake_devices(monkeypatch, request.param == "hot", count=2)
    monkeypatch.setattr(sm_device, "_default", devs[0])
    yield devs[0], devs[1], drv
    sm.synchronize()
    del devs
    gc_collect_harder()


@pytest.fixture
def saxpy(two):
    from fake_cuda import saxpy_kernel
    return saxpy_kernel(two[2])


class _NullStream:
    """A stream object naming the legacy default stream and no device (CuPy's null stream)."""
    ptr = 0
    device_id = -1


def _default_handles():
    return [0, 1, 2, np.int64(1), _NullStream()]


def test_a_default_stream_handle_given_to_a_launch_is_the_arguments_devices(two, saxpy):
    """stream=0 / 1 / 2 (or a null stream object) names the default stream of no particular
    device: a launch on memory of device 1 runs on device 1's default stream -- as every other
    call given memory borrows it (copies, allocations, replays) -- not on the default device's,
    which refused the launch (or, with peer access, ran the kernel on the other GPU)."""
    d0, d1, drv = two
    x = sm.Buffer.from_host(np.ones(8, np.float32), device=d1)
    for s in _default_handles():
        f = sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(x), 8, stream=s)
        assert f.stream is d1.default_stream, s
        f.result()
        op = sm.op(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(x), 8)
        g = op.submit(stream=s)
        assert g.stream is d1.default_stream, s
        g.result()
    np.testing.assert_array_equal(x.to_host(), np.full(8, 2.0 ** 10, np.float32))
    d0.enable_peer_access(d1)  # (device 0 could run it: still not chosen silently)
    mark = len(drv.calls)
    f = sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(x), 8, stream=0)
    assert f.stream is d1.default_stream
    launches = [c for c in drv.calls[mark:] if c[0] == "launch"]
    assert [c[2:] for c in launches] == [(0, 0xC1)]  # legacy stream, device 1's context
    f.result()
    # with no array argument, the default device's default stream, as before
    assert sm.launch(saxpy, 1, 8, 1.0, None, None, None, 0, stream=1).stream is d0.default_stream


def test_from_dlpack_given_a_default_stream_handle_imports_on_the_producers_device(two):
    """from_dlpack(x_on_device_1, stream=1) -- DLPack's own name of the legacy default stream
    -- borrows device 1's default stream; it was refused as a stream of device 0."""
    d0, d1, drv = two
    t = sm.Tensor.from_host(np.arange(4, dtype=np.float32), device=d1)
    for s in _default_handles():
        u = sm.from_dlpack(t, stream=s)
        assert u.device is d1 and u.allocation is t.allocation, s
        del u
    # a stream that names its device is still refused on another one
    with pytest.raises(sm.DeviceMismatchError, match=r"^from_dlpack: <Stream .*cuda:0.* is on "
                                                     r"<Device cuda:0 .*>, the memory of Tensor "
                                                     r"on DLPack device \(2, 1\); use a stream"):
        sm.from_dlpack(t, stream=d0.create_stream())


class _ForeignStream:
    """Another library's stream object (``__cuda_stream__``, its device named)."""

    def __init__(self, handle, device_id=0):
        self.handle, self.device_id = handle, device_id

    def __cuda_stream__(self):
        return (0, self.handle)


def test_waits_and_records_on_a_stream_another_library_captures_are_refused(two):
    """Stream.wait and Stream.record on a borrowed stream that another library captures
    (torch.cuda.graph, cupy.cuda.Stream.begin_capture): an event recorded there goes into that
    capture (it marks nothing that runs now, and a stream waiting for it joins the capture:
    sharedmem's stream would then capture its later launches instead of running them); a wait
    enqueued there on an event recorded outside the capture is refused by the driver, which
    invalidates the capture. CaptureError, as for a capture sharedmem began, nothing recorded
    or waited for; once the capture ends, both work."""
    d0, d1, drv = two
    drv.cuCtxSetCurrent(0xC0)  # (another library's stream of device 0)
    h = int(drv.cuStreamCreate(1)[1])
    foreign = sm.Stream.from_external(_ForeignStream(h), d0)
    mine = d0.create_stream("mine")
    drv.cuStreamBeginCapture(h, 0)
    mark = len(drv.calls)
    with pytest.raises(sm.CaptureError, match=r"is capturing a CUDA graph that sharedmem did "
                                              r"not start"):
        mine.wait(foreign)  # (would record into the capture, and join `mine` to it)
    with pytest.raises(sm.CaptureError, match=r"is capturing a CUDA graph that sharedmem did "
                                              r"not start"):
        mine.wait(_ForeignStream(h))  # (a foreign object: borrowed, the same)
    with pytest.raises(sm.CaptureError, match=r"is capturing a CUDA graph that sharedmem did "
                                              r"not start"):
        foreign.record()
    ev = mine.record()
    with pytest.raises(sm.CaptureError, match=r"is capturing a CUDA graph that sharedmem did "
                                              r"not start"):
        foreign.wait(ev)  # (a wait on an event from outside the capture)
    with pytest.raises(sm.CaptureError, match=r"is capturing a CUDA graph that sharedmem did "
                                              r"not start"):
        foreign.wait(mine)
    with pytest.raises(sm.CaptureError, match=r"is capturing a CUDA graph that sharedmem did "
                                              r"not start"):
        foreign.synchronize()  # (the driver refuses it, invalidating the capture)
    on_h = [c for c in drv.calls[mark:] if (c[0] == "record" and c[2] == h) or
            (c[0] in ("wait", "stream_sync") and c[1] == h)]
    assert on_h == [], "recorded into, or waited on, a stream another library captures"
    assert not [c for c in drv.calls[mark:] if c[0] == "wait"], "a refused wait was made"
    drv.cuStreamEndCapture(h)
    mine.wait(foreign)
    foreign.wait(ev)
    assert foreign.record().query()
    foreign.synchronize()
    assert drv.calls[-1] == ("stream_sync", h)
