"""Several CUDA devices in one process (#18), on the fake driver: peer access, cross-device
launches (the wait, the lease on the launching stream, the memory kept until both devices are
done), copies between devices, and the context each call runs in. The ordering itself is
checked on two real GPUs (test_gpu_multi.py)."""

import gc
import weakref

import numpy as np
import pytest

import sharedmem as sm

from conftest import gc_collect_harder



@pytest.fixture(params=["bindings", "hot"])
def two(monkeypatch, request):
    """Two fake CUDA devices: (dev0, dev1, driver)."""
    from fake_cuda import install_fake_devices
    devs, drv = install_fake_devices(monkeypatch, request.param == "hot", count=2)
    yield devs[0], devs[1], drv
    sm.synchronize()
    del devs
    gc_collect_harder()


@pytest.fixture
def saxpy(two):
    from fake_cuda import saxpy_kernel
    return saxpy_kernel(two[2])


def test_peer_access_is_explicit(two, saxpy):
    d0, d1, drv = two
    x = sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=d0)
    out = sm.Buffer.zeros(8, "float32", device=d1)
    s1 = d1.create_stream("s1")
    sm.synchronize()
    submitted = sm.stats().submitted
    with pytest.raises(sm.DeviceMismatchError,
                       match=r"argument 1 .* is on <Device cuda:0 Fake GPU>, but the launch runs "
                             r"on <Device cuda:1 Fake GPU>; copy it there first .*"
                             r"enable_peer_access\(<Device cuda:0 Fake GPU>\)"):
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(out), 8, stream=s1)
    # a failed launch took nothing (counted against this test's own start: earlier tests may
    # keep work whose completion is unknown)
    assert sm.stats().submitted == submitted and x.is_live
    assert not x.allocation.tracker and not out.allocation.tracker
    assert d1.peers == frozenset() and d1.can_access_peer(d0) and d1.can_access_peer(d1)
    d1.enable_peer_access(d0)
    d1.enable_peer_access(d0)  # idempotent
    assert d1.peers == {d0} and d0.peers == frozenset()  # one way
    assert [c for c in drv.calls if c[0] == "peer"] == [("peer", 0xC1, 0xC0)]  # in d1's context
    sm.launch(saxpy, 1, 8, 2.0, sm.In(x), sm.In(x), sm.Out(out), 8, stream=s1).result()
    np.testing.assert_array_equal(out.to_host(), 3 * np.arange(8))
    with pytest.raises(sm.DeviceMismatchError, match="runs on <Device cuda:0"):
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(out), 8)  # d0 cannot use d1's


def test_peer_access_refused_where_the_pair_cannot(two):
    d0, d1, drv = two
    drv.no_peer.add((1, 0))
    assert not d1.can_access_peer(d0)
    with pytest.raises(sm.PeerAccessError, match=r"cuda:1 Fake GPU> cannot access .*cuda:0.*"
                                                 r"cuDeviceCanAccessPeer says this pair cannot"):
        d1.enable_peer_access(d0)
    assert d1.peers == frozenset() and not [c for c in drv.calls if c[0] == "peer"]
    assert issubclass(sm.PeerAccessError, sm.DeviceMismatchError)
    with pytest.raises(sm.PeerAccessError, match="peer access joins two CUDA devices"):
        d1.enable_peer_access(sm.Device.host())
    assert not sm.Device.host().can_access_peer(d0)
    with pytest.raises(TypeError, match="expected a sharedmem.Device, got int"):
        d1.enable_peer_access(0)


def test_cross_device_launch_waits_leases_and_keeps_memory(two, saxpy):
    d0, d1, drv = two
    d1.enable_peer_access(d0)
    s0, s1 = d0.create_stream("s0"), d1.create_stream("s1")
    x = sm.Buffer.from_host(np.ones(8, np.float32), device=d0, stream=s0)
    y = sm.Buffer.zeros(8, "float32", device=d0, stream=s0)
    out = sm.Buffer.zeros(8, "float32", device=d1, stream=s1)
    sm.synchronize()
    drv.holding = True  # events recorded from now on stay pending: work "in flight"
    try:
        sm.launch(saxpy, 1, 8, 3.0, sm.In(x), sm.In(x), sm.Out(y), 8, stream=s0)  # d0 writes y
        mark = len(drv.calls)
        f = sm.launch(saxpy, 1, 8, 1.0, sm.In(y), sm.In(x), sm.Out(out), 8, stream=s1)
        calls = drv.calls[mark:]
        # s1 waits on an event recorded on s0 (in d0's context) after the write, then launches
        # in d1's context
        rec = [c for c in calls if c[0] == "record" and c[2] == s0.handle]
        wait = [c for c in calls if c[0] == "wait"]
        assert len(rec) == 1 and wait == [("wait", s1.handle, rec[0][1])]
        assert drv.ctx_of[rec[0][1]] == 0xC0
        launch = [c for c in calls if c[0] == "launch"]
        assert launch[0][2:] == (s1.handle, 0xC1)
        assert calls.index(wait[0]) < calls.index(launch[0])
        # the lease on d0's memory is recorded on d1's stream: y outlives its last handle
        # until the launch on d1 is done
        yalloc = weakref.ref(y._token.allocation)
        del y
        gc.collect()
        sm.stats()
        assert yalloc() is not None and not f.done()
        assert s1.pending == 1
    finally:
        drv.holding = False
        drv.finish_held()
    f.result()
    sm.synchronize()
    gc_collect_harder()
    assert yalloc() is None
    np.testing.assert_array_equal(out.to_host(), np.full(8, 5.0))  # y = 3x + x, out = y + x


def test_copies_between_devices(two):
    d0, d1, drv = two
    a = np.arange(32, dtype=np.int32)
    b0 = sm.Buffer.from_host(a, device=d0)
    b1 = b0.to_device(d1)  # no peer access needed for copies
    assert b1.device is d1 and b1._token.allocation is not b0._token.allocation
    np.testing.assert_array_equal(b1.to_host(), a)
    peer = [c for c in drv.calls if c[0] == "peer copy"]
    assert peer and peer[-1][1:3] == (0xC1, 0xC0)
    c0 = sm.Buffer.zeros(32, "int32", device=d0)
    c0.copy_from(b1, stream=d0.create_stream("on d0"))  # the source's device's stream
    np.testing.assert_array_equal(c0.to_host(), a)
    t = sm.Tensor.from_host(a.reshape(4, 8), device=d1)
    u = t[::2].to_device(d0)  # strided: made contiguous on d1 first
    assert u.device is d0 and u.is_contiguous()
    np.testing.assert_array_equal(u.to_host(), a.reshape(4, 8)[::2])
    h = t.to_device(sm.Device.host())
    np.testing.assert_array_equal(h.to_host(), a.reshape(4, 8))
    back = h.to_device(d0)
    np.testing.assert_array_equal(back.to_host(), a.reshape(4, 8))
    with pytest.raises(sm.DeviceMismatchError, match="runs on a stream of one of them"):
        b0.to_device(d1, stream=sm.Device.host().create_stream("h"))
    with pytest.raises(sm.DeviceMismatchError, match="go through the host"):
        c0.copy_from(h.into_buffer())


def test_a_foreign_context_switch_is_seen(two, saxpy):
    """With several devices, a thread whose current context another library switched still
    runs each call in the right context."""
    d0, d1, drv = two
    s0 = d0.create_stream("s0")
    x = sm.Buffer.from_host(np.ones(8, np.float32), device=d0, stream=s0)
    drv.cuCtxSetCurrent(0xC1)  # as cupy.cuda.Device(1).use() would
    sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(x), 8, stream=s0).result()
    drv.cuCtxSetCurrent(0xC1)
    np.testing.assert_array_equal(x.to_host(), np.full(8, 2.0))


def test_cross_device_event_waits(two):
    d0, d1, drv = two
    s0, s1 = d0.create_stream("s0"), d1.create_stream("s1")
    ev = s0.record()
    s1.wait(ev)
    assert drv.calls[-1] == ("wait", s1.handle, ev._marker.handle)
    with pytest.raises(sm.DeviceMismatchError, match="only CUDA devices wait on each other"):
        sm.Device.host().create_stream("h").wait(ev)
    # a refused wait for a stream records nothing on it (an event was recorded there first:
    # on a foreign stream its owner captures, that record would have gone into the capture)
    mark = len(drv.calls)
    with pytest.raises(sm.DeviceMismatchError, match="only CUDA devices wait on each other"):
        sm.Device.host().create_stream("h").wait(s0)
    assert drv.calls[mark:] == []


def test_a_stream_of_another_device_is_refused_before_anything_is_imported(two, monkeypatch):
    import sharedmem.device as sm_device
    d0, d1, drv = two
    for d in (d0, d1):
        monkeypatch.setitem(sm_device._devices, ("cuda", d.ordinal), d)
    t = sm.Tensor.from_host(np.arange(4, dtype=np.float32), device=d0)
    sm.synchronize()
    before = sm.stats()
    for s, where in ((sm.Device.host().create_stream(), r"<Device host>"),
                     (d1.create_stream(), r"<Device cuda:1 .*>")):
        with pytest.raises(sm.DeviceMismatchError, match=rf"^from_dlpack: <Stream .*> is on "
                                                         rf"{where}, the memory of Tensor on "
                                                         rf"DLPack device \(2, 0\); use a stream"):
            sm.from_dlpack(t, stream=s)
        assert t.allocation.live_views == 1  # nothing imported, no hold
    # a CuPy-style stream object names its device: borrowed there, refused elsewhere
    class CupyStream:
        def __init__(self, ptr, device_id):
            self.ptr, self.device_id = ptr, device_id
    st = sm.Stream.from_external(CupyStream(0x5511, 1))
    assert st.device is d1
    with pytest.raises(sm.DeviceMismatchError, match=r"is a stream of CUDA device 1, not of "
                                                     r"<Device cuda:0"):
        sm.Stream.from_external(CupyStream(0x5512, 1), d0)
    with pytest.raises(sm.DeviceMismatchError):
        sm.from_dlpack(t, stream=CupyStream(0x5513, 1))
    # a raw handle says nothing: the driver says where its stream lives (cuStreamGetCtx)
    monkeypatch.setattr(sm_device, "_default", d0)  # (CUDA device 0 the default, as on a GPU)
    h1 = int(d1.create_stream()._impl.handle)
    st1 = sm.Stream.from_external(h1)
    assert st1.device is d1 and st1 is sm.Stream.from_external(h1, d1)
    assert drv.current == 0xC0 or drv.current == 0xC1  # (the push was popped)
    with pytest.raises(sm.DeviceMismatchError, match=rf"^{h1} is a stream of CUDA device 1, not "
                                                     rf"of <Device cuda:0 .*>'s primary context"):
        sm.Stream.from_external(h1, d0)
    with pytest.raises(sm.DeviceMismatchError, match=r"^from_dlpack: <Stream 0x[0-9a-f]+ on "
                                                     r"<Device cuda:1 .*> \(borrowed\)> is on "
                                                     r"<Device cuda:1 .*>, the memory of Tensor"):
        sm.from_dlpack(t, stream=h1)
    # a stream of a context other than the primary one (cuCtxCreate's): refused on its device
    h2 = int(drv.cuStreamCreate(0)[1])
    drv.ctx_of[h2] = 0xD00  # (a second context of device 0)
    current = drv.current
    for dev in (None, d0):
        with pytest.raises(sm.DeviceMismatchError, match=rf"^{h2} is a stream of a CUDA context "
                                                         rf"of <Device cuda:0 .*> other than its "
                                                         rf"primary one, not of <Device cuda:0 .*>'s "
                                                         rf"primary context \(the one sharedmem, "
                                                         rf"CuPy and torch launch in\); use a "
                                                         rf"stream of <Device cuda:0 "):
            sm.Stream.from_external(h2, dev)
    assert drv.current == current
    assert t.allocation.live_views == 1
    u = sm.from_dlpack(t, stream=d0.create_stream())  # (the right device: imported)
    assert u.allocation is t.allocation
    del u
    sm.synchronize()
    after = sm.stats()
    assert after.leaked == before.leaked


def test_a_gpu_the_driver_cannot_use_falls_back_to_the_host(monkeypatch):
    """GPU 0 present but its primary context refused (an exclusive-process GPU busy
    elsewhere): the default device is the host, as for no CUDA at all, and says why;
    SHAREDMEM_BACKEND=cuda makes it an error. Unpickling lands on the default device."""
    import pickle
    import sharedmem.device as sm_device
    from fake_cuda import install_fake_devices
    (gpu,), drv = install_fake_devices(monkeypatch, False)
    monkeypatch.setattr(sm_device, "_devices",
                        {k: v for k, v in sm_device._devices.items() if k[0] != "cuda"})
    monkeypatch.setattr(sm_device, "_default", None)
    monkeypatch.setattr(sm_device, "_fallback", [None])
    monkeypatch.delenv("SHAREDMEM_BACKEND", raising=False)
    data = pickle.dumps(sm.Buffer.from_host(np.arange(3.0), device=sm.Device.host()))
    monkeypatch.setattr(drv, "cuDevicePrimaryCtxRetain", lambda dev: (46, None))
    monkeypatch.setenv("SHAREDMEM_BACKEND", "cuda")
    with pytest.raises(sm.BackendUnavailableError,
                       match=r"^SHAREDMEM_BACKEND=cuda: CUDA device 0 is not usable: "
                             r"cuDevicePrimaryCtxRetain failed"):
        sm.default_device()
    monkeypatch.delenv("SHAREDMEM_BACKEND")
    r = pickle.loads(data)
    assert r.device is sm.Device.host() and sm.default_device() is sm.Device.host()
    np.testing.assert_array_equal(r.to_host(), np.arange(3.0))
    assert sm.device.host_fallback_reason().startswith(
        "CUDA device 0 is not usable: cuDevicePrimaryCtxRetain failed")


def test_a_device_number_past_the_last_gpu_is_a_value_error(monkeypatch):
    import sharedmem.device as sm_device
    from fake_cuda import install_fake_devices
    install_fake_devices(monkeypatch, False)  # one (fake) GPU
    monkeypatch.setattr(sm_device, "_devices", {})
    with pytest.raises(ValueError, match=r"^CUDA device 5 does not exist; this machine has 1 "
                                         r"device\(s\), 0 to 0$") as ei:
        sm.Device(5)
    assert not isinstance(ei.value, sm.BackendUnavailableError)
    assert ("cuda", 5) not in sm_device._devices


class _CupyStream:  # a CuPy-style stream object: .ptr and .device_id
    def __init__(self, ptr, device_id):
        self.ptr, self.device_id = ptr, device_id


def _foreign_stream(drv, ordinal):
    h = int(drv.cuStreamCreate(0)[1])
    drv.ctx_of[h] = 0xC0 + ordinal
    return _CupyStream(h, ordinal)


def test_a_foreign_stream_object_naming_its_device_is_found_again_in_a_few_reads(two,
                                                                                monkeypatch):
    """A launch loop given the same CuPy or torch stream object each time finds its Stream
    from the memo of the last borrow (``as_stream``), as for an object that names no device.
    (The memo was never written for an object naming its device -- CuPy's ``device_id``,
    torch's ``device.index`` --, so every such launch borrowed the stream again in full.)"""
    import sharedmem.device as sm_device
    import sharedmem.stream as sm_stream
    d0, d1, drv = two
    monkeypatch.setitem(sm_device._devices, ("cuda", 1), d1)  # (the device the object names)
    fs = _foreign_stream(drv, 1)
    s = sm_stream.as_stream(fs)
    assert s.device is d1 and s._external is fs
    assert sm_stream._last_borrowed[0]() is s
    assert sm_stream.as_stream(fs) is s and sm.Stream.from_external(fs) is s
    # a device given by the caller is checked against the object on every call: no memo
    sm_stream._last_borrowed[0] = None
    assert sm.Stream.from_external(fs, d1) is s and sm_stream._last_borrowed[0] is None
    with pytest.raises(sm.DeviceMismatchError, match=r"is a stream of CUDA device 1, not of "):
        sm.Stream.from_external(fs, d0)


def test_a_strided_copy_to_another_device_is_not_refused_for_its_own_temporary(two):
    """Under "reject", the peer copy of the contiguous temporary a strided tensor is first
    made into is ordered after that making (both are private): no false conflict."""
    d0, d1, drv = two
    a = np.arange(32, dtype=np.float32).reshape(4, 8)
    t = sm.Tensor.from_host(a, device=d0)
    sm.synchronize()
    sm.set_access_policy("reject")
    try:
        drv.holding = True  # device work stays in flight, as on a busy GPU
        u = t[::2].to_device(d1)
        drv.holding = False
        drv.finish_held()
    finally:
        sm.set_access_policy("order")
    np.testing.assert_array_equal(u.to_host(), a[::2])


def test_a_refused_copy_to_another_device_leaves_no_allocation(two):
    """A peer copy refused under "reject" left the new allocation's token live with no view
    to release it: the destination's memory stayed allocated until a cyclic collection."""
    import gc
    from sharedmem.allocation import live_allocation_count
    d0, d1, drv = two
    b0 = sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=d0)
    sm.synchronize()
    before = live_allocation_count()
    gc.disable()
    sm.set_access_policy("reject")
    try:
        drv.holding = True
        b0.fill_zero(stream=d0.create_stream())  # a write in flight
        with pytest.raises(sm.AccessConflictError, match=r"^to_device on <Stream default on "
                                                         r"<Device cuda:1 Fake GPU>"):
            b0.to_device(d1)
        assert live_allocation_count() == before
    finally:
        gc.enable()
        sm.set_access_policy("order")
        drv.holding = False
        drv.finish_held()


def test_copies_between_devices_take_a_foreign_stream_of_either_device(two):
    d0, d1, drv = two
    a = np.arange(8, dtype=np.float32)
    b0 = sm.Buffer.from_host(a, device=d0)
    c1 = sm.Buffer.zeros(8, "float32", device=d1)
    fs0 = _foreign_stream(drv, 0)
    c1.copy_from(b0, stream=fs0).result()  # (a stream of the source device)
    np.testing.assert_array_equal(c1.to_host(), a)
    u = b0.to_device(d1, stream=_foreign_stream(drv, 0).ptr)  # (a raw handle of it)
    np.testing.assert_array_equal(u.to_host(), a)
    u = b0.to_device(d1, stream=_foreign_stream(drv, 1))
    np.testing.assert_array_equal(u.to_host(), a)
    # host <-> GPU: the foreign stream named is the one used; one of a third device refused
    hb = sm.Buffer.from_host(a, device=sm.Device.host())
    sm.synchronize()
    fs1 = _foreign_stream(drv, 1)
    drv.holding = True
    hb.to_device(d1, stream=fs1)
    assert [i.stream for i in sm.inflight() if i.label == "to_device"] == \
        [sm.Stream.from_external(fs1, d1)]
    drv.holding = False
    drv.finish_held()
    submitted = sm.stats().submitted
    for s in (d0.create_stream(), _foreign_stream(drv, 0)):
        with pytest.raises(sm.DeviceMismatchError, match=r"^a copy between <Device host> and "
                                                         r"<Device cuda:1 .*> runs on a stream "
                                                         r"of one of them, not on "):
            hb.to_device(d1, stream=s)
    # a strided tensor: the refused stream is found before its contiguous copy is made
    t = sm.Tensor.from_host(np.arange(32, dtype=np.float32).reshape(4, 8), device=d0)
    sm.synchronize()
    submitted = sm.stats().submitted
    with pytest.raises(sm.DeviceMismatchError, match=r"runs on a stream of one of them"):
        t[::2].to_device(d1, stream=sm.Device.host().create_stream("h"))
    assert sm.stats().submitted == submitted


@pytest.mark.parametrize("backend", ["host", "cuda"])
def test_a_captured_copy_from_a_host_array_replays_the_values_it_had(backend, monkeypatch):
    """Both backends replay the array's values at capture (the host backend snapshots them;
    on CUDA the captured copy read the caller's array at each replay)."""
    if backend == "host":
        dev = sm.Device.host()
    else:
        from fake_cuda import install_fake_devices
        dev = install_fake_devices(monkeypatch, False)[0][0]
    s = dev.create_stream()
    b = sm.Buffer.zeros(4, "float32", device=dev)
    arr = np.full(4, 1, np.float32)
    sm.synchronize()
    with sm.capture(s) as g:
        b.copy_from(arr)
    arr[:] = 2
    g.replay().result()
    np.testing.assert_array_equal(b.to_host(), [1, 1, 1, 1])
    sm.synchronize()


def test_an_empty_tensor_over_bytes_arrives_as_an_empty_contiguous_tensor(two):
    d0, d1, _ = two
    for src, dst in ((sm.Device.host(), sm.Device.host()), (d0, d1), (sm.Device.host(), d0)):
        buf = sm.Buffer.from_host(np.arange(10, dtype=np.float32), device=src)
        t = sm.Tensor.from_buffer(buf, (0,), (1,))
        u = t.to_device(dst)
        assert u.device is dst and u.shape == (0,) and u.is_contiguous() and u.nbytes == 0
        assert len(u.into_buffer()) == 0


def test_a_raw_handle_is_asked_of_the_driver_once_and_an_old_driver_is_not_asked(two,
                                                                                 monkeypatch):
    import sharedmem.device as sm_device
    d0, d1, drv = two
    monkeypatch.setattr(sm_device, "_default", d0)
    for d in (d0, d1):
        monkeypatch.setitem(sm_device._devices, ("cuda", d.ordinal), d)
    h = 0x7777
    drv.ctx_of[h] = 0xC1
    asked = []
    orig = drv.cuStreamGetCtx
    monkeypatch.setattr(drv, "cuStreamGetCtx", lambda s: (asked.append(int(s)), orig(s))[1],
                        raising=False)
    st = sm.Stream.from_external(h)
    assert st.device is d1
    for v in (h, int(str(h))):  # (the same int object, and an equal one)
        assert sm.Stream.from_external(v) is st
    assert asked == [h]
    # cuda-bindings newer than the driver: cuStreamGetCtx_v2 is "not found"; cuStreamGetCtx
    # answers instead
    def missing(stream):
        raise RuntimeError('Function "cuStreamGetCtx_v2" not found')
    monkeypatch.setattr(drv, "cuStreamGetCtx_v2", missing, raising=False)
    h2 = 0x7778
    drv.ctx_of[h2] = 0xC0
    st2 = sm.Stream.from_external(h2)
    assert st2.device is d0 and st2.handle == h2


def test_a_failed_peer_enable_is_a_cuda_error_and_changes_nothing(two, monkeypatch):
    from fake_cuda import CUresult
    d0, d1, drv = two
    monkeypatch.setattr(drv, "cuCtxEnablePeerAccess",
                        lambda ctx, flags: (CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(sm.CudaError, match=r"^cuCtxEnablePeerAccess failed: "
                                           r"CUDA_ERROR_INVALID_VALUE \(1\)$"):
        d0.enable_peer_access(d1)
    assert d0.peers == frozenset()


def test_a_driver_without_a_usable_gpu_is_backend_unavailable(monkeypatch):
    """``cuInit`` failing, or no device: the CUDA backend cannot be made
    (BackendUnavailableError, saying which) and ``device_count()`` is 0."""
    import sharedmem.backends.cuda as bc
    from fake_cuda import CUresult, install_fake_devices
    _, drv = install_fake_devices(monkeypatch, False)
    monkeypatch.setattr(drv, "cuInit", lambda flags: (CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(sm.BackendUnavailableError, match=r"^no usable CUDA driver or GPU here "
                                                         r"\(cuInit: CUDA_ERROR_INVALID_VALUE\)$"):
        bc.CudaBackend(0)
    assert bc.device_count() == 0
    monkeypatch.setattr(drv, "cuInit", lambda flags: (CUresult.CUDA_SUCCESS,))
    monkeypatch.setattr(drv, "cuDeviceGetCount", lambda: (CUresult.CUDA_SUCCESS, 0))
    with pytest.raises(sm.BackendUnavailableError, match=r"^no CUDA device here "
                                                         r"\(cuDeviceGetCount: 0\)$"):
        bc.CudaBackend(0)
    assert bc.device_count() == 0


def test_a_dlpack_copy_to_a_cuda_device_is_made_there_or_refused(two, monkeypatch):
    """``__dlpack__(dl_device=(kDLCUDA, i), copy=True)``: from the host device (or the view's
    own CUDA device) a copy on device i, flagged IS_COPIED; from another CUDA device, and to
    a device that does not exist, BufferError (as the protocol names) -- with nothing
    allocated, no export left, and the view as it was."""
    import sharedmem.device as smd
    from interop import dlpack as dl
    d0, d1, drv = two
    monkeypatch.setitem(smd._devices, ("cuda", 0), d0)
    monkeypatch.setitem(smd._devices, ("cuda", 1), d1)
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = sm.Tensor.from_host(values, device=d0)
    sm.synchronize()
    before = sm.stats()
    with pytest.raises(BufferError, match=r"^copies between CUDA devices are not supported by "
                                          r"__dlpack__ \(<Device cuda:0 Fake GPU> -> <Device "
                                          r"cuda:1 Fake GPU>\); copy the view there first "
                                          r"\(view\.to_device\(device\)\)$"):
        t.__dlpack__(dl_device=(dl.kDLCUDA, 1), copy=True)
    with pytest.raises(BufferError, match=r"^cannot copy <Tensor float32 shape=\(2, 3\) .*> to "
                                          r"DLPack device \(2, 5\): CUDA device 5 does not "
                                          r"exist; this machine has 2 device\(s\), 0 to 1$"):
        t.__dlpack__(dl_device=(dl.kDLCUDA, 5), copy=True, max_version=(1, 0))
    assert ("cuda", 5) not in smd._devices
    assert sm.stats() == before and t.allocation.live_views == 1
    for src, dd in ((sm.Tensor.from_host(values, device=sm.Device.host()), 1), (t, 0)):
        cap = src.__dlpack__(dl_device=(dl.kDLCUDA, dd), copy=True, max_version=(1, 0))
        m = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned"))
        d = m.dl_tensor
        assert m.flags == dl.FLAG_IS_COPIED and (d.device.device_type, d.device.device_id) == \
            (dl.kDLCUDA, dd) and d.data != src.ptr
        back = sm.from_dlpack(cap)
        assert back.device is (d0, d1)[dd] and back.allocation is not src.allocation
        assert back.allocation.live_views == 1  # the import (the export ended; nothing else
        # reaches the copy: no producer alias)
        np.testing.assert_array_equal(back.to_host(), values)
        del cap, m, d, back
    # to the host with copy=None (NumPy's from_dlpack(x, device="cpu")): a copy, as the
    # protocol asks ("copy: If None, ... reuse the existing memory buffer if possible and copy
    # otherwise")
    np.testing.assert_array_equal(np.from_dlpack(t, device="cpu"), values)
    cap = t.__dlpack__(dl_device=(dl.kDLCPU, 0), max_version=(1, 0))
    m = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned"))
    assert m.flags == dl.FLAG_IS_COPIED and m.dl_tensor.device.device_type == dl.kDLCPU
    with pytest.raises(BufferError, match=r"^cannot export <Tensor float32 shape=\(2, 3\) .*> to "
                                          r"device \(1, 0\) with copy=False: it lives on "
                                          r"\(2, 0\) \(copy=None or copy=True makes a copy "
                                          r"there\)$"):
        t.__dlpack__(dl_device=(dl.kDLCPU, 0), copy=False)
    del cap, m
    gc_collect_harder()
    sm.synchronize()
    assert sm.stats().live_allocations == before.live_allocations and t.allocation.live_views == 1


class _CaiProducer:  # a foreign array: its CUDA Array Interface only
    def __init__(self, desc):
        self.__cuda_array_interface__ = desc


def test_a_cai_import_of_memory_on_another_device_lands_on_that_device(two, monkeypatch):
    """CAI names no device: the pointer's device (``cuPointerGetAttributes``) is the import's,
    also when it is not device 0. The memory is the allocation sharedmem has there; the
    producer's stream (of that device) is waited for on the importing stream; a stream of
    another device is a DeviceMismatchError before anything is imported."""
    import sharedmem.device as smd
    from interop.cai import from_cuda_array_interface
    d0, d1, drv = two
    monkeypatch.setitem(smd._devices, ("cuda", 0), d0)
    monkeypatch.setitem(smd._devices, ("cuda", 1), d1)
    b = sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=d1)
    base = b.allocation.ptr
    drv.ranges[base], drv.range_device[base] = b.allocation.nbytes, 1
    producer_stream = _foreign_stream(drv, 1)
    producer = _CaiProducer({"shape": (4,), "typestr": "<f4", "data": (base + 8, False),
                             "strides": None, "version": 3, "stream": producer_stream.ptr})
    s0, s1 = d0.create_stream("s0"), d1.create_stream("s1")
    sm.synchronize()
    before, n = sm.stats(), len(drv.calls)
    with pytest.raises(sm.DeviceMismatchError, match=r"^<Stream s0 on <Device cuda:0 Fake GPU> "
                                                     r"\(owned\)> is on <Device cuda:0 Fake "
                                                     r"GPU>, but the memory is on <Device "
                                                     r"cuda:1 Fake GPU>$"):
        from_cuda_array_interface(producer, stream=s0)
    assert sm.stats() == before and b.allocation.live_views == 1
    assert [c for c in drv.calls[n:] if c[0] in ("record", "wait")] == []
    t = from_cuda_array_interface(producer, stream=s1)
    assert t.device is d1 and t.allocation is b.allocation and not t.readonly
    assert (t.ptr, t.shape, t.strides) == (base + 8, (4,), (1,))
    tok = t._live_token()
    assert (tok.start, tok.stop) == (8, 24)
    (rec,) = [c for c in drv.calls[n:] if c[0] == "record" and c[2] == producer_stream.ptr]
    assert ("wait", s1.handle, rec[1]) in drv.calls[n:]  # s1 waits for the producer's stream
    assert b.allocation.live_views == 3  # b, t, and the producer (an alias while t lives)
    np.testing.assert_array_equal(t.to_host(stream=s1), [2, 3, 4, 5])
    del t, tok
    gc_collect_harder()
    sm.synchronize()
    assert b.allocation.live_views == 1 and sm.stats().live_allocations == before.live_allocations


def test_a_driver_or_cupy_that_raises_at_load_falls_back_to_the_host(monkeypatch):
    """cuda-bindings loads libcuda at its first call: on a machine with the GPU extras but no
    NVIDIA driver, cuInit raises RuntimeError("Failed to dlopen libcuda.so.1"); a CuPy may
    raise other than ImportError as it imports. The default device is then the host, as for
    no CUDA at all, saying why (it raised RuntimeError out of default_device())."""
    import sys

    import sharedmem.backends.cuda as bc
    import sharedmem.device as sm_device
    from fake_cuda import install_fake_devices
    (gpu,), drv = install_fake_devices(monkeypatch, False)
    monkeypatch.setattr(sm_device, "_devices",
                        {k: v for k, v in sm_device._devices.items() if k[0] != "cuda"})
    monkeypatch.delenv("SHAREDMEM_BACKEND", raising=False)

    def no_libcuda(flags):
        raise RuntimeError("Failed to dlopen libcuda.so.1")
    monkeypatch.setattr(drv, "cuInit", no_libcuda)
    for _ in range(2):
        monkeypatch.setattr(sm_device, "_default", None)
        monkeypatch.setattr(sm_device, "_fallback", [None])
        assert sm.default_device() is sm.Device.host()
    assert sm.device.host_fallback_reason() == (
        "no usable CUDA driver or GPU here (cuInit: RuntimeError: Failed to dlopen "
        "libcuda.so.1)")
    assert bc.device_count() == 0

    class BrokenCupy:  # (an import of cupy that raises RuntimeError)
        def find_spec(self, name, path=None, target=None):
            if name == "cupy":
                raise RuntimeError("CUDA driver version is insufficient")
    monkeypatch.delitem(sys.modules, "cupy")
    monkeypatch.setattr(sys, "meta_path", [BrokenCupy()] + sys.meta_path)
    monkeypatch.setattr(sm_device, "_default", None)
    monkeypatch.setattr(sm_device, "_fallback", [None])
    assert sm.default_device() is sm.Device.host()
    assert sm.device.host_fallback_reason() == (
        "the CUDA backend takes its memory from CuPy's pool, and CuPy does not import here "
        "(RuntimeError: CUDA driver version is insufficient)")


def test_record_use_of_a_foreign_array_borrows_the_stream_on_its_own_device(two, monkeypatch):
    """record_use(cai_array, raw_handle) borrowed the handle on the default device: memory
    and stream on device 1 raised "4097 is a stream of CUDA device 1, not of <Device cuda:0>;
    use a stream of <Device cuda:0>" -- the wrong advice. The stream names its device."""
    import sharedmem.device as sm_device
    d0, d1, drv = two
    for d in (d0, d1):  # (Device(n) is these: as on a GPU)
        monkeypatch.setitem(sm_device._devices, ("cuda", d.ordinal), d)
    t = sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=d1)
    drv.ranges[t.allocation.ptr], drv.range_device[t.allocation.ptr] = 32, 1
    sm.synchronize()

    class Foreign:  # another library's array over t's bytes, on device 1
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (t.ptr, False),
                                    "version": 3, "strides": None}
    drv.current = d1.backend.context_handle
    raw = int(drv.cuStreamCreate(1)[1])  # a stream another library made on device 1
    sm.record_use(Foreign(), raw)
    sm.synchronize()
    assert t.allocation.live_views == 1
