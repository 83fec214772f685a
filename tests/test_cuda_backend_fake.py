"""The CUDA backend's code, run against a fake driver (tests/fake_cuda.py) in CI.

Checks the glue that otherwise only runs on a GPU: result unpacking, marker
ownership, stream identity, capture bookkeeping. The driver's semantics are
checked by the gpu-marked tests on a real device.
"""

import contextlib
import copy
import ctypes
import gc
import os
import re
import sys
import threading
import types
import weakref

import numpy as np
import pytest

import sharedmem as sm

from conftest import count_plans, gc_collect_harder, run_threads


@pytest.fixture(params=["bindings", "hot"])
def fake(monkeypatch, request):
    """A CUDA device over the fake driver; "bindings": every call through the
    driver module; "hot": the per-launch calls through ``backend.hot`` -- and
    so CuPy launches through the compiled path, when it is built."""
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, request.param == "hot")
    yield dev, drv
    sm.synchronize()
    del dev
    gc_collect_harder()  # fake handles die while the fake driver is still the driver


def test_identity_copies_and_markers(fake):
    dev, drv = fake
    assert dev.kind == "cuda" and dev.name == "Fake GPU" and dev.compute_capability == (9, 0)
    assert dev.uuid == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    s = dev.create_stream("s")
    b = sm.Buffer.from_host(np.arange(16, dtype=np.float32), device=dev, stream=s)
    np.testing.assert_array_equal(b.to_host(), np.arange(16))
    c = sm.Buffer.empty(16, "float32", device=dev)
    c.copy_from(b, stream=s)
    b.fill_zero(stream=s)
    np.testing.assert_array_equal(c.to_host(), np.arange(16))
    np.testing.assert_array_equal(b.to_host(), np.zeros(16))
    sm.synchronize()
    assert sm.stats().in_flight == 0


def test_events_own_their_cuevent(fake):
    dev, drv = fake
    a, b = dev.create_stream(), dev.create_stream()
    ev = a.record()
    assert ev.query() is True and ev.synchronize() is True
    b.wait(ev)
    assert ("wait", b.handle, ev._marker.handle) in drv.calls
    before = drv.destroyed_events
    del ev
    gc_collect_harder()
    assert drv.destroyed_events == before + 1  # a pooled submission marker is never destroyed


def test_foreign_streams_are_one_stream(fake):
    dev, drv = fake
    s1 = sm.Stream.from_external(0x77, device=dev)
    assert sm.Stream.from_external(0x77, device=dev) is s1 and not s1.owned
    assert sm.Stream.from_external(0, device=dev) is dev.default_stream
    assert s1.__cuda_stream__() == (0, 0x77)
    # the legacy stream (1) and the per-thread default stream (2, CuPy's Stream.ptds: another
    # stream in each thread) are the default stream, in every thread
    class Ptds:
        ptr = 2
    got = []
    t = threading.Thread(target=lambda: got.append(sm.Stream.from_external(Ptds(), device=dev)))
    t.start()
    t.join()
    assert got == [dev.default_stream]
    for h in (1, 2, Ptds()):
        assert sm.Stream.from_external(h, device=dev) is dev.default_stream
    assert sm.Stream.lookup(dev, 2) is None


def test_a_destroyed_borrowed_stream_is_not_found_for_its_reused_handle(fake):
    # cuda.core's Stream.close() destroys the stream; the driver may give its handle to the next
    # stream made, with other flags. The old Stream, still alive (an access record keeps it),
    # must not stand for the new stream.
    dev, drv = fake

    class CoreStream:  # like cuda.core's Stream: __cuda_stream__, and close()
        def __init__(self, h):
            self.h, self.closed = h, False

        def __cuda_stream__(self):
            if self.closed:
                raise RuntimeError("stream closed")
            return (0, self.h)

    h = 0x7A11
    a = CoreStream(h)
    b = sm.Buffer.from_host(np.ones(4, np.float32), device=dev)
    sa = sm.Stream.from_external(a, dev)
    b.fill_zero(stream=sa)
    sm.synchronize()
    assert sa._impl.syncs_with_legacy() is True  # (the fake's unknown handles: blocking)
    old = weakref.ref(sa)
    kept = [sa]  # (alive, as any object of the program may keep it)
    del sa
    a.closed = True
    assert old() is not None
    assert sm.Stream.lookup(dev, h) is None
    drv.stream_flags[h] = 1  # the handle reused for a non-blocking stream
    c = CoreStream(h)
    sc = sm.Stream.from_external(c, dev)
    assert sc is not old() and sc._external is c  # (the new object kept alive by its Stream)
    assert sc._impl.syncs_with_legacy() is False
    assert sm.Stream.from_external(c, dev) is sc and sm.Stream.lookup(dev, h) is sc
    del sc, kept
    gc_collect_harder()


def test_synchronize_of_a_borrowed_stream_waits_for_its_owners_work_too(fake):
    dev, drv = fake

    class CupyStream:  # a CuPy stream its owner enqueued kernels of their own on
        ptr = 0x5150
    st = sm.Stream.from_external(CupyStream(), dev)
    n = len(drv.calls)
    st.synchronize()
    assert ("stream_sync", 0x5150) in drv.calls[n:]
    n = len(drv.calls)
    dev.default_stream.synchronize()  # (sharedmem's own streams: its work is all there is)
    sm.synchronize()
    assert not any(c[0] == "stream_sync" for c in drv.calls[n:])


def test_cai_import_refuses_what_device_memory_cannot_hold_and_bad_streams(fake, monkeypatch):
    import sharedmem.device as sm_device
    dev, drv = fake
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)  # (an import probes Device(0))
    b = sm.Buffer.from_host(np.arange(4, dtype="f4"), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes  # (what cuPointerGetAttribute knows)

    class Producer:
        def __init__(self, **kw):
            self.__cuda_array_interface__ = {"shape": (2,), "typestr": "<f4",
                                             "data": (b.ptr, False), "version": 3, **kw}
    np.testing.assert_array_equal(sm.from_cuda_array_interface(Producer()).to_host(), [0, 1])
    for typestr, why in ((">f4", "is not in native byte order"), ("<U1", "cannot live in device"),
                         ("<M8[s]", "cannot live in device")):
        with pytest.raises(TypeError, match=why):
            sm.from_cuda_array_interface(Producer(typestr=typestr))
    with pytest.raises(TypeError, match=r"^__cuda_array_interface__ stream must be an int or "
                                        r"None, got str$"):
        sm.from_cuda_array_interface(Producer(stream="x"))
    with pytest.raises(ValueError, match=r"stream 0 is not valid \(0 is disallowed"):
        sm.from_cuda_array_interface(Producer(stream=0))
    # bytes past the driver allocation (another allocation's): refused, naming both ranges
    base, size = b.allocation.ptr, b.allocation.nbytes
    before = sm.stats().live_allocations
    with pytest.raises(ValueError, match=(
            rf"^__cuda_array_interface__ array of {size + 4} bytes at 0x{base:x} runs past the "
            rf"end of the CUDA allocation holding it \({size} bytes at 0x{base:x}, {size} of "
            rf"them from 0x{base:x}\); its shape, strides or offset claim memory the producer "
            rf"does not own$")):
        sm.from_cuda_array_interface(Producer(shape=(size // 4 + 1,), data=(base, False)))
    assert sm.stats().live_allocations == before
    sm.synchronize()
    assert b.allocation.live_views == 1  # (nothing refused was left imported)


def test_malformed_cai_is_refused_and_nothing_is_imported(fake, monkeypatch):
    """Each malformed ``__cuda_array_interface__`` is refused with the type errors.md names
    (TypeError: no protocol; ValueError: a malformed dict), before anything is imported; a
    negative shape is malformed too (it would make a view of a negative extent)."""
    import sharedmem.device as sm_device
    dev, drv = fake
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)  # (an import probes Device(0))
    b = sm.Buffer.from_host(np.arange(4, dtype="f4"), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    sm.synchronize()
    before = sm.stats()

    class Producer:
        def __init__(self, cai=None, **kw):
            self.__cuda_array_interface__ = cai if cai is not None else {
                "shape": (2,), "typestr": "<f4", "data": (b.ptr, False), "version": 3, **kw}
    with pytest.raises(TypeError, match=r"^int has no __cuda_array_interface__$"):
        sm.from_cuda_array_interface(3)
    with pytest.raises(TypeError, match=r"^__cuda_array_interface__ must be a dict$"):
        sm.from_cuda_array_interface(Producer([1]))
    with pytest.raises(ValueError, match=r"^malformed __cuda_array_interface__: no 'shape'$"):
        sm.from_cuda_array_interface(Producer({"typestr": "<f4", "data": (b.ptr, False)}))
    for kw, msg in (
            ({"version": 4}, r"CUDA Array Interface version 4 is not supported \(0 to 3\)"),
            ({"version": "3"}, r"CUDA Array Interface version '3' is not supported \(0 to 3\)"),
            ({"version": True}, r"CUDA Array Interface version True is not supported \(0 to 3\)"),
            ({"mask": object()}, r"masked CUDA Array Interface arrays are not supported"),
            ({"data": None}, r"malformed __cuda_array_interface__: 'data' must be a \(pointer, "
                             r"read_only\) pair, got None"),
            ({"strides": 4}, r"malformed __cuda_array_interface__: 'strides' must be None or a "
                             r"tuple of ints, got 4"),
            ({"shape": 2}, r"malformed __cuda_array_interface__: 'shape' must be a tuple of "
                           r"ints, got 2"),
            ({"typestr": "<q9"}, r"malformed __cuda_array_interface__: 'typestr' '<q9' is not "
                                 r"a type string"),
            ({"typestr": np.float32}, r"malformed __cuda_array_interface__: 'typestr' <class "
                                      r"'numpy\.float32'> is not a type string"),
            ({"strides": (4, 4)}, r"strides \(4, 4\) do not match shape \(2,\)"),
            ({"strides": (-4,)}, r"negative strides \(-4,\) are not supported"),
            ({"strides": (6,)}, r"strides \(6,\) are not multiples of the item size 4"),
            ({"shape": (-2,)}, r"malformed __cuda_array_interface__: negative shape \(-2,\)"),
            ({"shape": (True,)}, r"malformed __cuda_array_interface__: 'shape' must be a tuple of "
                                 r"ints, got \(True,\)"),
            ({"data": (b.ptr, None)}, r"malformed __cuda_array_interface__: the 'data' read_only "
                                      r"flag must be a bool, got None"),
            ({"shape": (2, -1), "strides": (4, 4)},
             r"malformed __cuda_array_interface__: negative shape \(2, -1\)"),
            # entries that are not integers: not truncated, nor read character by character
            ({"shape": (2.7,)}, r"malformed __cuda_array_interface__: 'shape' must be a tuple "
                                r"of ints, got \(2\.7,\)"),
            ({"shape": "2"}, r"malformed __cuda_array_interface__: 'shape' must be a tuple of "
                             r"ints, got '2'"),
            ({"strides": (4.0,)}, r"malformed __cuda_array_interface__: 'strides' must be None "
                                  r"or a tuple of ints, got \(4\.0,\)"),
            ({"strides": "4"}, r"malformed __cuda_array_interface__: 'strides' must be None or "
                               r"a tuple of ints, got '4'"),
            ({"data": ([1], False)}, r"malformed __cuda_array_interface__: the 'data' pointer "
                                     r"must be an int, got \[1\]"),
            ({"data": (float(b.ptr), False)}, r"malformed __cuda_array_interface__: the 'data' "
                                              r"pointer must be an int, got [0-9.e+]+"),
            # a NULL pointer for a non-empty array (DLPack's import refuses it too)
            ({"data": (None, False)}, r"malformed __cuda_array_interface__: a NULL 'data' "
                                      r"pointer for 8 bytes"),
            ({"data": (0, False)}, r"malformed __cuda_array_interface__: a NULL 'data' pointer "
                                   r"for 8 bytes"),
            ({"data": (b.ptr + (1 << 40), False)},
             rf"0x{b.ptr + (1 << 40):x} is not CUDA device memory")):
        with pytest.raises(ValueError, match="^" + msg + "$"):
            sm.from_cuda_array_interface(Producer(**kw))
    assert b.allocation.live_views == 1 and sm.stats() == before  # nothing imported, nothing done
    # byte strides become element strides; a zero-size array needs no pointer
    t = sm.from_cuda_array_interface(Producer(shape=(2,), strides=(8,)))
    assert t.shape == (2,) and t.strides == (2,) and t.allocation is b.allocation
    np.testing.assert_array_equal(t.to_host(), [0, 2])
    empty = sm.from_cuda_array_interface(Producer(shape=(0, 3), data=(0, False)))
    assert empty.shape == (0, 3) and empty.nbytes == 0 and empty.device is dev
    assert sm.from_cuda_array_interface(Producer(shape=(0,), data=(None, False))).nbytes == 0
    t = sm.from_cuda_array_interface(Producer(shape=(np.int64(2),), strides=[np.int64(4)]))
    assert t.shape == (2,) and t.allocation is b.allocation  # (NumPy ints are ints)
    # a producer's stream: ours waits on an event recorded on it, on the device
    n = len(drv.calls)
    sm.from_cuda_array_interface(Producer(stream=0x5150))
    recorded = [c[1] for c in drv.calls[n:] if c[0] == "record" and c[2] == 0x5150]
    assert len(recorded) == 1
    assert ("wait", dev.default_stream.handle, recorded[0]) in drv.calls[n:]
    sm.synchronize()


def test_record_use_of_a_cai_array_leases_its_bytes_or_says_why_not(fake, monkeypatch):
    """``record_use`` of a foreign array (``__cuda_array_interface__``) over sharedmem memory
    leases its bytes on the stream (later writes elsewhere are ordered after it); over memory sharedmem does not know it is a
    ValueError, and on a capturing stream a CaptureError -- neither leases anything."""
    dev, drv = fake
    t = sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=dev)
    s = dev.create_stream("consumer")
    sm.synchronize()

    class Foreign:  # a CuPy array over t's bytes 8..24, as cupy.asarray would make one
        def __init__(self, ptr, strides=None):
            self.__cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "strides": strides,
                                             "data": (ptr, False), "version": 3}
    before = sm.stats()
    with pytest.raises(ValueError, match=r"^record_use: the Foreign at 0x3039 is not memory "
                                         r"sharedmem knows on <Device cuda:0 Fake GPU>; "
                                         r"nothing to order$"):
        sm.record_use(Foreign(12345), s)
    # a malformed interface: the import's ValueError naming the entry, nothing leased
    for bad, msg in (({"typestr": None}, r"'typestr' None is not a type string"),
                     ({"shape": None}, r"no 'shape'"),
                     ({"data": (float(t.ptr), False)}, r"the 'data' pointer must be an int, "
                                                       r"got [0-9.e+]+"),
                     ({"strides": (4, 4)}, r"strides \(4, 4\) do not match shape \(2,\)")):
        f = Foreign(t.ptr)
        f.__cuda_array_interface__.update(bad)
        if bad == {"shape": None}:
            del f.__cuda_array_interface__["shape"]
        with pytest.raises(ValueError, match=r"^(malformed __cuda_array_interface__: )?" + msg
                           + "$"):
            sm.record_use(f, s)
    with sm.capture(s):
        with pytest.raises(sm.CaptureError, match=r"^record_use on <Stream consumer .*: it is "
                                                  r"capturing a graph, whose work runs only at "
                                                  r"replay; declare the use on the replaying stream$"):
            sm.record_use(Foreign(t.ptr + 8, strides=(8,)), s)
    assert sm.stats().submitted == before.submitted
    drv.holding = True  # the consumer's work stays in flight
    sm.record_use(Foreign(t.ptr + 8, strides=(8,)), s, writes=True)  # bytes [8, 20)
    assert sm.stats().submitted == before.submitted + 1
    n = len(drv.calls)
    t[3:4].fill_zero()  # bytes [12, 16) are in the declared range: ordered after s's use
    recorded = [c[1] for c in drv.calls[n:] if c[0] == "record" and c[2] == s.handle]
    assert len(recorded) == 1  # (the use's marker, recorded once something waits on it)
    assert ("wait", dev.default_stream.handle, recorded[0]) in drv.calls[n:]
    drv.holding = False
    drv.finish_held()
    sm.synchronize()


def test_record_use_of_a_cai_array_leases_every_byte_its_strides_reach_and_none_when_empty(fake):
    """CAI strides are bytes, not always a multiple of the item size: two float32 elements 6
    bytes apart at byte 8 reach bytes [8, 18), and the lease is of those. (The strides were
    divided by the item size, rounding down: the lease covered [8, 16) only, and a write of
    bytes 16 and 17 elsewhere was not ordered after the use.) An empty array -- pointer 0, as the
    protocol gives it -- uses no bytes: nothing is leased, and it is not refused as unknown
    memory."""
    dev, drv = fake
    t = sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=dev)
    s = dev.create_stream("consumer")
    sm.synchronize()

    class Foreign:
        def __init__(self, ptr, shape, strides):
            self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (ptr, False),
                                             "strides": strides, "version": 3}
    before = sm.stats()
    sm.record_use(Foreign(0, (0,), None), s)
    sm.record_use(Foreign(0, (3, 0), (24, 4)), s, writes=False)
    assert sm.stats().submitted == before.submitted
    drv.holding = True  # the consumer's work stays in flight
    sm.record_use(Foreign(t.ptr + 8, (2,), (6,)), s, writes=False)
    assert sm.stats().submitted == before.submitted + 1
    (lease, writes), = s._pending[-1].uses
    assert (lease.start, lease.stop, writes) == (8, 18, False)
    drv.holding = False
    drv.finish_held()
    sm.synchronize()


def test_protocol_edges_of_exports(fake):
    dev, drv = fake
    empty = sm.Tensor.empty((0, 3), "float32", device=dev)
    cai = empty.__cuda_array_interface__
    assert cai["data"] == (0, False) and cai["shape"] == (0, 3)  # (the protocol: 0 when empty)
    t = sm.Tensor.from_host(np.arange(6, dtype=np.float32), device=dev)
    assert t.__cuda_array_interface__["data"][0] == t.ptr
    for bad in (1 << 64, -2):
        with pytest.raises(ValueError, match=rf"^stream={bad} is not a valid stream handle$"):
            t.__dlpack__(stream=bad)
    sm.synchronize()


def test_graph_capture_and_replay(fake):
    dev, drv = fake
    s = dev.create_stream("capture")
    b = sm.Buffer.zeros(8, "float64", device=dev, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        n_calls = len(drv.calls)  # (from the capture's beginning: one is recorded just before it)
        fut = b.copy_from(np.full(8, 3.0), stream=s)
        assert fut.done()
    # nothing ran, and no event was recorded on the capturing stream
    assert not [c for c in drv.calls[n_calls:] if c[0] == "record" and c[2] == s.handle]
    np.testing.assert_array_equal(b.to_host(), np.zeros(8))
    assert len(drv.execs) == 1
    r = dev.create_stream("replay")
    g.replay(r).result()
    np.testing.assert_array_equal(b.to_host(), np.full(8, 3.0))
    with pytest.raises(sm.AliasError, match=rf"graph #{g.id}"):
        sm.Tensor.from_buffer(b, (8,))
    fut = g.replay(r)
    del g
    gc_collect_harder()
    sm.Tensor.from_buffer(b, (8,))  # the dropped graph is no alias
    fut.result()
    del fut
    sm.synchronize()
    gc_collect_harder()
    assert drv.execs == {} and drv.graphs == {}  # destroyed after its last replay
    with pytest.raises(sm.CaptureError, match="the default stream cannot be captured"):
        with sm.capture(dev.default_stream):
            pass


def test_failed_capture_leaves_no_graph(fake):
    dev, drv = fake
    s = dev.create_stream()
    b = sm.Buffer.zeros(4, device=dev, stream=s)
    s.synchronize()
    with pytest.raises(KeyError):
        with sm.capture(s) as g:
            b.fill_zero(stream=s)
            raise KeyError("boom")
    assert s._capture is None and drv.capturing == {}
    assert drv.execs == {} and drv.graphs == {}
    with pytest.raises(sm.CaptureError, match="is failed"):
        g.replay(s)


def test_dlpack_export_stream_rules(fake):
    dev, drv = fake
    t = sm.Tensor.from_host(np.ones((2, 3), np.float32), device=dev)
    sm.synchronize()
    assert t.__dlpack_device__() == (2, 0)
    with pytest.raises(ValueError, match="stream=0 is ambiguous"):
        t.__dlpack__(stream=0)
    cap = t.__dlpack__(stream=-1, max_version=(1, 0))
    assert t.allocation.live_views == 2
    del cap
    gc.collect()
    assert t.allocation.live_views == 1
    cai = t.__cuda_array_interface__
    assert cai["data"] == (t.ptr, False) and cai["shape"] == (2, 3) and cai["version"] == 3


@pytest.fixture
def kernels(fake, monkeypatch):
    from fake_cuda import RawKernel, array_at
    dev, drv = fake

    def saxpy(a, x, y, out, n):  # float a, const float* x, const float* y, float* out, int n
        array_at(out, n, np.float32)[:] = a * array_at(x, n, np.float32) + array_at(y, n, np.float32)

    def scale_len(x, n, factor):  # float* x, long long n, double factor
        v = array_at(x, n, np.float32)
        v[:] = v * factor

    code = """
    extern "C" __global__ void saxpy(float a, const float* __restrict__ x, const float* y,
                                     float* out, int n) { }
    extern "C" __global__ void scale_len(float* x, long long n, double factor) { }
    """
    return (RawKernel(drv, "saxpy", ["f", "Q", "Q", "Q", "i"], saxpy, code),
            RawKernel(drv, "scale_len", ["Q", "q", "d"], scale_len, code))


def test_a_launch_far_ahead_of_its_device_waits_for_room_holding_no_lock(fake, kernels,
                                                                         monkeypatch):
    """The driver queues about 1,020 launches a stream and blocks the next one inside
    cuLaunchKernel -- which the core calls under its lock, with the GIL: every thread would
    wait for the GPU. A launch onto a CUDA stream holding MAX_PENDING unretired submissions
    first waits, holding no lock, for the older half of them, then retires what finished."""
    from fake_cuda import OK
    from sharedmem.runtime.state import RUNTIME
    from sharedmem.runtime.submission import MAX_PENDING
    dev, drv = fake
    saxpy, _ = kernels
    s = dev.create_stream("ahead")
    x, out = sm.Buffer.zeros(4, device=dev), sm.Buffer.zeros(4, device=dev)
    sm.synchronize()
    waits = []

    def synchronize(ev):  # the device runs s in order: every event recorded up to ev is done
        waits.append((int(ev) in drv.held, RUNTIME.owner, len(s._pending)))
        order = [c[1] for c in drv.calls if c[0] == "record" and c[2] == s.handle]
        last = len(order) - 1 - order[::-1].index(int(ev))
        drv.held.difference_update(order[:last + 1])
        return (OK,)
    monkeypatch.setattr(drv, "cuEventSynchronize", synchronize)
    drv.holding = True  # from here on the device finishes nothing by itself
    peak = 0
    for _ in range(MAX_PENDING + 100):
        sm.launch(saxpy, 1, 32, 1.0, sm.In(x), sm.In(x), sm.Out(out), 4, stream=s)
        peak = max(peak, len(s._pending))
    # one wait, for an unfinished event, by a thread holding no lock, with the FIFO full
    assert waits == [(True, 0, MAX_PENDING)]
    assert peak == MAX_PENDING and len(s._pending) <= MAX_PENDING // 2 + 100
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    assert len(s._pending) == 0


def test_an_import_onto_a_stream_far_ahead_does_not_wait_for_room(fake, kernels, monkeypatch):
    """An import's arrival (DLPack, CAI, IPC) is a marker on its stream: it enqueues nothing
    that takes a slot of the driver's queue, so unlike a launch it does not wait for room
    when MAX_PENDING submissions are pending there -- it used to wait for the GPU."""
    import sharedmem.device as sm_device
    from sharedmem.runtime.submission import MAX_PENDING
    dev, drv = fake
    saxpy, _ = kernels
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)  # (an import probes Device(0))
    s = dev.create_stream("ahead")
    x, out = sm.Buffer.zeros(4, device=dev), sm.Buffer.zeros(4, device=dev)
    b = sm.Buffer.from_host(np.arange(4, dtype="f4"), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes  # (what cuPointerGetAttribute knows)
    sm.synchronize()
    waits = []
    real = drv.cuEventSynchronize

    def synchronize(ev):
        waits.append(int(ev) in drv.held)
        return real(ev)
    monkeypatch.setattr(drv, "cuEventSynchronize", synchronize)

    class Producer:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (b.ptr, False),
                                    "version": 3}
    drv.holding = True  # the device finishes nothing by itself
    while len(s._pending) < MAX_PENDING:
        sm.launch(saxpy, 1, 32, 1.0, sm.In(x), sm.In(x), sm.Out(out), 4, stream=s)
    t = sm.from_cuda_array_interface(Producer(), stream=s)
    assert waits == [] and len(s._pending) == MAX_PENDING + 1
    assert s._pending[-1].label == "import"
    drv.holding = False
    drv.finish_held()
    np.testing.assert_array_equal(t.to_host(stream=s), [0, 1])
    sm.synchronize()


def _no_pinned_memory(dev, monkeypatch):
    """Make CuPy's pinned pool refuse every allocation on ``dev``'s backend."""
    def refuse(n):
        raise MemoryError("out of pinned memory")
    monkeypatch.setattr(dev.backend._cupy.cuda, "alloc_pinned_memory", refuse)


@pytest.mark.parametrize("memory", ["pinned", "pageable"])
def test_to_host_waits_for_what_it_reads_after_before_it_takes_the_lock(fake, kernels,
                                                                        monkeypatch, memory):
    """A copy into pageable host memory runs synchronously in the driver: it waits for the
    stream's earlier work and for the writes it is ordered after -- under the core lock, every
    other thread would wait for the GPU with it. to_host copies into pinned memory (enqueued at
    once behind that work, waited for holding no lock, then copied out); without pinned memory
    it waits for that work first, holding no lock, and copies into the array."""
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    saxpy, _ = kernels
    if memory == "pageable":
        _no_pinned_memory(dev, monkeypatch)
    a, b = dev.create_stream("writer"), dev.create_stream("reader")
    x = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=dev)
    out, y = sm.Buffer.zeros(4, device=dev), sm.Buffer.zeros(4, device=dev)
    sm.synchronize()
    seen = []
    real_sync, real_copy = drv.cuEventSynchronize, drv.cuMemcpyDtoHAsync

    def synchronize(ev):
        seen.append(("wait", int(ev) in drv.held, RUNTIME.owner))
        return real_sync(ev)

    def copy(dst, src, n, stream):  # what the copy finds: everything it follows finished?
        seen.append(("copy", bool(drv.held), RUNTIME.owner != 0, int(dst)))
        return real_copy(dst, src, n, stream)
    monkeypatch.setattr(drv, "cuEventSynchronize", synchronize)
    monkeypatch.setattr(drv, "cuMemcpyDtoHAsync", copy)
    drv.holding = True  # the device is behind: nothing finishes by itself
    sm.launch(saxpy, 1, 32, 2.0, sm.In(x), sm.In(x), sm.Out(out), 4, stream=a)  # the writer
    sm.launch(saxpy, 1, 32, 1.0, sm.In(x), sm.In(x), sm.Out(y), 4, stream=b)  # b's own work
    got = out.to_host(stream=b)
    drv.holding = False
    np.testing.assert_array_equal(got, 3 * np.arange(4, dtype=np.float32))
    if memory == "pinned":
        # the copy enqueued under the lock behind the unfinished work, into pinned memory
        # (not the array returned); then its marker waited for by a thread holding no lock
        assert [e[:3] for e in seen] == [("copy", True, True), ("wait", True, 0)]
        assert seen[0][3] != got.ctypes.data
    else:
        # b's newest work and a's write, each waited for by a thread holding no lock; then the
        # copy (under the lock), with nothing left unfinished in front of it, into the array
        assert [e[:3] for e in seen[:3]] == [("wait", True, 0), ("wait", True, 0),
                                             ("copy", False, True)]
        assert seen[2][3] == got.ctypes.data
    sm.synchronize()


def test_an_upload_is_staged_in_pinned_memory_and_one_without_any_waits_first(fake, kernels,
                                                                              monkeypatch):
    """The driver copies pageable memory synchronously once its staging is full (behind a busy
    stream on an H200: a copy of 4 MiB, or the third of 256 KiB) -- under the core lock,
    every other thread would wait with it. An upload is staged in pinned memory (CuPy's
    pinned pool, back there once the copy retired) and the copy reads that -- one above
    STAGE_MAX in pieces of STAGE_MAX; one that finds no pinned memory first waits, holding no
    lock, for the work it follows."""
    import fake_cuda
    import sharedmem.backends.cuda as bc
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    saxpy, _ = kernels
    s = dev.create_stream("busy")
    x = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=dev)
    y = sm.Buffer.zeros(4, device=dev)
    sm.synchronize()
    lent = fake_cuda._PinnedBlock.lent
    seen = []
    real_copy, real_sync = drv.cuMemcpyHtoDAsync, drv.cuEventSynchronize

    def copy(dst, src, n, stream):
        seen.append(("copy", int(src), bool(drv.held), RUNTIME.owner != 0))
        return real_copy(dst, src, n, stream)

    def synchronize(ev):
        seen.append(("wait", int(ev) in drv.held, RUNTIME.owner))
        return real_sync(ev)
    monkeypatch.setattr(drv, "cuMemcpyHtoDAsync", copy)
    monkeypatch.setattr(drv, "cuEventSynchronize", synchronize)
    host = np.full(4, 7, np.float32)
    drv.holding = True  # s is busy: a kernel reading x, unfinished
    sm.launch(saxpy, 1, 32, 1.0, sm.In(x), sm.In(x), sm.Out(y), 4, stream=s)
    x.copy_from(host, stream=s)
    # no wait: the copy, from pinned memory (not the caller's array), enqueued behind it
    assert [c[0] for c in seen] == ["copy"] and seen[0][1] != host.ctypes.data
    assert fake_cuda._PinnedBlock.lent == lent + 1  # lent while the copy is in flight
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    gc.collect()
    assert fake_cuda._PinnedBlock.lent == lent  # given back once it retired
    np.testing.assert_array_equal(x.to_host(), host)
    monkeypatch.setattr(bc, "STAGE_MAX", 8)  # 16 bytes: two pieces
    seen.clear()
    drv.holding = True
    sm.launch(saxpy, 1, 32, 1.0, sm.In(x), sm.In(x), sm.Out(y), 4, stream=s)
    x.copy_from(3 * host, stream=s)
    # no wait: two copies of 8 bytes from two pinned blocks, enqueued behind the busy kernel
    assert [c[0] for c in seen] == ["copy", "copy"] and all(c[3] for c in seen)
    assert fake_cuda._PinnedBlock.lent == lent + 2 and host.ctypes.data not in (seen[0][1],
                                                                                seen[1][1])
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    gc.collect()
    assert fake_cuda._PinnedBlock.lent == lent
    np.testing.assert_array_equal(x.to_host(), 3 * host)
    monkeypatch.setattr(bc, "STAGE_MAX", 64 << 20)
    _no_pinned_memory(dev, monkeypatch)
    seen.clear()
    drv.holding = True
    sm.launch(saxpy, 1, 32, 1.0, sm.In(x), sm.In(x), sm.Out(y), 4, stream=s)
    x.copy_from(2 * host, stream=s)
    # the busy kernel waited for by a thread holding no lock; then the copy, with nothing
    # unfinished in front of it, from the caller's (pageable) array
    assert [c[:3] for c in seen] == [("wait", True, 0), ("copy", seen[1][1], False)]
    assert fake_cuda._PinnedBlock.lent == lent
    drv.holding = False
    drv.finish_held()
    np.testing.assert_array_equal(x.to_host(), 2 * host)


def _in_order_synchronize(drv):
    """A cuEventSynchronize for the fake driver that runs each stream in order: every event
    recorded on ``ev``'s stream up to ``ev`` -- sharedmem's or another library's -- is done."""
    from fake_cuda import OK

    def synchronize(ev):
        rec = [c for c in drv.calls if c[0] == "record"]
        stream = next(c[2] for c in reversed(rec) if c[1] == int(ev))
        order = [c[1] for c in rec if c[2] == stream]
        last = len(order) - 1 - order[::-1].index(int(ev))
        drv.held.difference_update(order[:last + 1])
        return (OK,)
    return synchronize


def _watch_dtoh(drv, monkeypatch, foreign):
    """Watch to_host's copies on the fake driver, which runs each stream in order: the list
    gets, for each cuMemcpyDtoHAsync, whether ``foreign`` (another library's event) was still
    unfinished in front of it, whether the core lock was held, and the driver calls so far;
    a cuEventSynchronize under the core lock fails the test."""
    from sharedmem.runtime.state import RUNTIME
    seen = []
    real_copy = drv.cuMemcpyDtoHAsync
    in_order = _in_order_synchronize(drv)

    def copy(dst, src, n, stream):  # what the copy finds in front of it on its stream
        seen.append((foreign in drv.held, RUNTIME.owner != 0, len(drv.calls)))
        return real_copy(dst, src, n, stream)

    def synchronize(ev):
        assert RUNTIME.owner == 0  # (no thread waits for the device holding the core lock)
        return in_order(ev)
    monkeypatch.setattr(drv, "cuEventSynchronize", synchronize)
    monkeypatch.setattr(drv, "cuMemcpyDtoHAsync", copy)
    return seen


@pytest.mark.parametrize("which", ["default", "borrowed"])
@pytest.mark.parametrize("memory", ["pinned", "pageable"])
def test_to_host_waits_for_other_libraries_work_on_its_stream_before_the_lock(fake, monkeypatch,
                                                                              which, memory):
    """The driver's copy into pageable memory waits for everything on the stream, not only
    what sharedmem enqueued there: CuPy's kernels on the legacy default stream (sharedmem's
    default stream too), a borrowed stream's owner's work. to_host must wait for that too
    before it takes the core lock -- here sharedmem has nothing pending on the stream at all
    -- or copy into pinned memory, and wait for that copy holding no lock."""
    dev, drv = fake
    if memory == "pageable":
        _no_pinned_memory(dev, monkeypatch)
    x = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=dev)
    sm.synchronize()
    if which == "default":
        s, handle = dev.default_stream, 0
    else:
        handle = int(drv.cuStreamCreate(1)[1])
        s = sm.Stream.from_external(handle, dev)
    foreign = int(drv.cuEventCreate(0)[1])
    seen = _watch_dtoh(drv, monkeypatch, foreign)
    drv.holding = True
    drv.cuEventRecord(foreign, handle)  # another library's long kernel on the stream, running
    got = x.to_host(stream=s)
    drv.holding = False
    np.testing.assert_array_equal(got, np.arange(4, dtype=np.float32))
    # pageable: the copy (under the lock) found nothing unfinished in front of it, waited for
    # first; pinned: enqueued at once behind it, then waited for without the lock
    assert [e[:2] for e in seen] == [(memory == "pinned", True)]
    drv.finish_held()


@pytest.mark.parametrize("memory", ["pinned", "pageable"])
def test_to_host_waits_for_a_consumers_work_on_the_bytes_before_the_lock(fake, monkeypatch,
                                                                         memory):
    """A consumer holding the bytes (a DLPack export to its stream, an as_cupy array) may be
    writing them there: to_host's copy is ordered after what that stream was given so far,
    and the driver's copy into pageable memory waits for it -- under the core lock, unless
    to_host waits for it first (or copies into pinned memory, ordered after it on the device)."""
    dev, drv = fake
    if memory == "pageable":
        _no_pinned_memory(dev, monkeypatch)
    t = sm.Tensor.from_host(np.arange(4, dtype=np.float32), device=dev)
    sm.synchronize()
    consumer = int(drv.cuStreamCreate(1)[1])
    cap = t.__dlpack__(stream=consumer)  # a hold, open: the consumer may write
    foreign = int(drv.cuEventCreate(0)[1])
    seen = _watch_dtoh(drv, monkeypatch, foreign)
    drv.holding = True
    drv.cuEventRecord(foreign, consumer)  # the consumer's kernel on the bytes, running
    got = t.to_host()
    drv.holding = False
    np.testing.assert_array_equal(got, np.arange(4, dtype=np.float32))
    assert [e[:2] for e in seen] == [(memory == "pinned", True)]
    if memory == "pinned":  # ordered on the device: the stream waited for the consumer's first
        waits = [c for c in drv.calls[:seen[0][2]] if c[0] == "wait" and c[1] == 0]
        recorded = {c[1] for c in drv.calls if c[0] == "record" and c[2] == consumer}
        assert waits and waits[-1][2] in recorded
    drv.finish_held()
    del cap


def test_a_strided_copy_of_many_pieces_waits_for_the_stream_before_the_lock(fake, monkeypatch):
    """The driver queues about 1,020 operations a stream and blocks the next one inside the
    call -- under the core lock, every thread waits for the GPU (what MAX_PENDING keeps
    launches from). Tensor.copy of a transposed tensor (a DLPack import of ``x.T``) enqueues
    one cuMemcpy2DAsync per row in one submission: with more rows than half the queue, it
    first waits, holding no lock, for the work in front of it (another library's included),
    so the driver takes the copies without waiting for the GPU."""
    from sharedmem.runtime.state import RUNTIME
    from sharedmem.runtime.submission import MAX_PENDING
    from sharedmem.tensor import new_tensor
    dev, drv = fake
    s = dev.create_stream("busy")
    real = drv.cuMemcpy2DAsync
    seen = []

    def copy2d(p, stream):  # what each 2-D copy finds in front of it on its stream
        seen.append((foreign in drv.held, RUNTIME.owner != 0))
        return real(p, stream)
    monkeypatch.setattr(drv, "cuEventSynchronize", _in_order_synchronize(drv))
    monkeypatch.setattr(drv, "cuMemcpy2DAsync", copy2d)
    for rows, waits in ((MAX_PENDING // 2, False), (4 * MAX_PENDING, True)):
        t = sm.Tensor.from_host(np.arange(4 * rows, dtype=np.float32).reshape(4, rows),
                                device=dev)
        tok = t._token
        view = new_tensor(tok.allocation.new_token("tensor view", tok.start, tok.stop, True,
                                                   tok.keep, source=t),
                          np.dtype("float32"), (rows, 4), (1, rows), tok.start)  # t's transpose
        sm.synchronize()
        foreign = int(drv.cuEventCreate(0)[1])
        seen.clear()
        drv.holding = True
        drv.cuEventRecord(foreign, s.handle)  # another library's long kernel on s, running
        c = view.copy(stream=s)
        drv.holding = False
        assert len(seen) == rows and all(locked for _, locked in seen)  # one a row, locked
        # up to half the queue's worth: enqueued at once; more: the kernel waited for first
        assert {busy for busy, _ in seen} == {not waits}
        drv.finish_held()
        np.testing.assert_array_equal(c.to_host(), np.arange(4 * rows, dtype=np.float32)
                                      .reshape(4, rows).T)
    syncs = []
    monkeypatch.setattr(drv, "cuEventSynchronize", lambda ev: syncs.append(ev) or (0,))
    drv.holding = True
    sm.Buffer.zeros(4, device=dev).fill_zero(stream=s)  # work in flight on s
    with sm.capture(s):  # captured: recorded, not run -- nothing to wait for
        view.copy(stream=s)
    assert syncs == []
    drv.holding = False
    drv.finish_held()


class _CupyLikePinnedPool:
    """CuPy's PinnedMemoryPool (cupy/cuda/pinned_memory.pyx), what cupy.cuda.alloc_pinned_memory
    lends from by default: sizes rounded up to 512 bytes; a free list per exact size, which a
    block joins as soon as its pointer dies; blocks never given back to the driver (unless a
    cudaHostAlloc fails). ``allocated``: the bytes it ever pinned."""

    def __init__(self):
        import collections
        self.free = collections.defaultdict(list)
        self.allocated = 0
        self.blocks = 0

    def malloc(self, n):
        size = -(-n // 512) * 512
        free = self.free[size]
        if free:
            raw = free.pop()
        else:
            raw = np.empty(size, np.uint8)
            self.allocated += size
            self.blocks += 1
        ptr = raw.view(_PooledPinned)
        ptr._back = (free, raw)
        return ptr


class _PooledPinned(np.ndarray):
    """A pointer into a block of _CupyLikePinnedPool: the block is back on its free list once
    the pointer dies (PooledPinnedMemory.__del__ = free)."""

    def __del__(self):
        back = getattr(self, "_back", None)
        if back is not None:
            back[0].append(back[1])


def test_staging_keeps_pinned_memory_bounded_over_uploads_of_many_sizes(fake, monkeypatch):
    """CuPy's pinned pool reuses a block only for an allocation of the same (512-byte rounded)
    size and never unpins one: staging each upload at its exact size pins a new block for
    every size ever uploaded -- a loader whose batches vary in length pins host memory without
    bound, one upload in flight at a time. Staged sizes must come from a few size classes."""
    dev, drv = fake
    pool = _CupyLikePinnedPool()
    monkeypatch.setattr(dev.backend._cupy.cuda, "alloc_pinned_memory", pool.malloc)
    b = sm.Buffer.empty(1 << 16, "uint8", device=dev)
    for k in range(64):
        n = 32768 + 512 * k
        b[:n].copy_from(np.full(n, k, np.uint8))
        sm.synchronize()  # each upload retired before the next: one block in flight at a time
    np.testing.assert_array_equal(b.to_host()[:32768], np.full(32768, 63, np.uint8))
    assert pool.blocks <= 8, (pool.blocks, pool.allocated)


def test_staged_uploads_in_flight_stay_within_the_budget(fake, monkeypatch):
    """An upload loop far ahead of its stream would pin everything it uploads (and CuPy's pool
    keeps it pinned): past STAGE_BUDGET bytes of staged uploads in flight on the device, an
    upload waits for the work it follows and copies from the caller's array. A staged block
    counts until the submission keeping it retired."""
    import fake_cuda
    import sharedmem.backends.cuda as bc
    dev, drv = fake
    monkeypatch.setattr(bc, "STAGE_BUDGET", 2048)
    syncs = []
    real = drv.cuEventSynchronize

    def synchronize(ev):
        syncs.append(dev.backend._staged)
        return real(ev)
    monkeypatch.setattr(drv, "cuEventSynchronize", synchronize)
    s = dev.create_stream("ahead")
    b = sm.Buffer.zeros(6 * 128, "float32", device=dev)
    sm.synchronize()
    lent = fake_cuda._PinnedBlock.lent
    syncs.clear()
    drv.holding = True  # the device is behind: nothing finishes by itself
    for k in range(6):  # 512 bytes each: four fit the budget
        b[128 * k:128 * (k + 1)].copy_from(np.full(128, k, np.float32), stream=s)
        assert dev.backend._staged == min(k + 1, 4) * 512
    # the last two waited first and were not staged
    assert fake_cuda._PinnedBlock.lent == lent + 4 and syncs == [2048, 2048]
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    gc.collect()
    assert dev.backend._staged == 0 and fake_cuda._PinnedBlock.lent == lent  # given back
    np.testing.assert_array_equal(b.to_host(), np.repeat(np.arange(6, dtype=np.float32), 128))


def test_an_upload_in_pieces_past_the_budget_waits_for_its_own_pieces(fake, monkeypatch):
    """An upload larger than STAGE_BUDGET goes in pieces of STAGE_MAX, each through pinned
    memory: once the budget is taken by its own pieces in flight, the next piece waits (no
    lock held) for the oldest of them -- back in the pool once retired -- rather than copy
    from pageable memory. Every byte arrives; nothing stays lent."""
    import fake_cuda
    import sharedmem.backends.cuda as bc
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    monkeypatch.setattr(bc, "STAGE_MAX", 512)
    monkeypatch.setattr(bc, "STAGE_BUDGET", 1024)  # two pieces in flight
    s = dev.create_stream("upload")
    b = sm.Buffer.zeros(1280, "float32", device=dev)  # 5,120 bytes: ten pieces
    sm.synchronize()
    lent = fake_cuda._PinnedBlock.lent
    seen = []
    real_copy, real_sync = drv.cuMemcpyHtoDAsync, drv.cuEventSynchronize

    def copy(dst, src, n, stream):
        seen.append(("copy", n, dev.backend._staged))
        return real_copy(dst, src, n, stream)

    def synchronize(ev):
        assert RUNTIME.owner == 0
        seen.append(("wait",))
        return real_sync(ev)
    monkeypatch.setattr(drv, "cuMemcpyHtoDAsync", copy)
    monkeypatch.setattr(drv, "cuEventSynchronize", synchronize)
    host = np.arange(1280, dtype=np.float32)
    drv.holding = True
    b.copy_from(host, stream=s)
    copies = [e for e in seen if e[0] == "copy"]
    assert [e[1] for e in copies] == [512] * 10 and max(e[2] for e in copies) <= 1024
    assert seen[:3] == [("copy", 512, 512), ("copy", 512, 1024), ("wait",)]
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    gc.collect()
    assert dev.backend._staged == 0 and fake_cuda._PinnedBlock.lent == lent
    np.testing.assert_array_equal(b.to_host(), host)


def test_to_host_goes_in_pinned_pieces_two_in_flight(fake, monkeypatch):
    """to_host larger than STAGE_MAX copies piece by piece through pinned memory: at most two
    pieces in flight (one copied out on the host while the next transfers), each waited for
    holding no lock; the result is every byte in order, and the pinned memory goes back."""
    import fake_cuda
    import sharedmem.backends.cuda as bc
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    monkeypatch.setattr(bc, "STAGE_MAX", 512)
    host = np.arange(1300, dtype=np.float32)  # 5,200 bytes: ten pieces and 80 bytes
    t = sm.Tensor.from_host(host.reshape(13, 100), device=dev)
    sm.synchronize()
    gc.collect()
    lent = fake_cuda._PinnedBlock.lent
    most = []
    real_copy, real_sync = drv.cuMemcpyDtoHAsync, drv.cuEventSynchronize

    def copy(dst, src, n, stream):
        most.append(fake_cuda._PinnedBlock.lent - lent)
        return real_copy(dst, src, n, stream)

    def synchronize(ev):
        assert RUNTIME.owner == 0
        return real_sync(ev)
    monkeypatch.setattr(drv, "cuMemcpyDtoHAsync", copy)
    monkeypatch.setattr(drv, "cuEventSynchronize", synchronize)
    got = t.to_host()
    np.testing.assert_array_equal(got, host.reshape(13, 100))
    assert len(most) == 11 and max(most) == 2
    gc.collect()
    assert fake_cuda._PinnedBlock.lent == lent and dev.backend._staged == 0
    # without pinned memory: one piece after another, straight into the array
    _no_pinned_memory(dev, monkeypatch)
    most.clear()
    np.testing.assert_array_equal(t.to_host(), host.reshape(13, 100))
    assert most == [0] * 11


def _pieces_each_wait_follows(drv, monkeypatch):
    """A list that gets, for each cuEventSynchronize, how many host <-> device copies the
    event waited for was recorded after: the pieces a wait waits for."""
    copies, waited = [], []
    real_h, real_d, real_sync = drv.cuMemcpyHtoDAsync, drv.cuMemcpyDtoHAsync, drv.cuEventSynchronize

    def htod(*a):
        copies.append(len(drv.calls))
        return real_h(*a)

    def dtoh(*a):
        copies.append(len(drv.calls))
        return real_d(*a)

    def synchronize(ev):
        rec = max(i for i, c in enumerate(drv.calls) if c[0] == "record" and c[1] == int(ev))
        waited.append(sum(1 for c in copies if c <= rec))
        return real_sync(ev)
    monkeypatch.setattr(drv, "cuMemcpyHtoDAsync", htod)
    monkeypatch.setattr(drv, "cuMemcpyDtoHAsync", dtoh)
    monkeypatch.setattr(drv, "cuEventSynchronize", synchronize)
    return copies, waited


def test_a_wait_for_one_piece_in_flight_waits_for_that_piece_alone(fake, monkeypatch):
    """A copy in pieces waits for its oldest piece in flight -- an upload whose pieces took
    the budget, to_host for the piece it copies out while the next transfers. The pieces
    join their stream's open marker, recorded when first waited for: behind every piece
    enqueued since, so that the wait was for all of them (an upload drained the budget's
    pieces each time, to_host copied out nothing while a piece transferred). Each piece's
    marker is recorded after it."""
    import sharedmem.backends.cuda as bc
    dev, drv = fake
    _retirer_sweeps_nothing(monkeypatch)  # (a pass records open markers: only waits here)
    monkeypatch.setattr(bc, "STAGE_MAX", 512)
    monkeypatch.setattr(bc, "STAGE_BUDGET", 2048)  # four pieces in flight
    s = dev.create_stream("s")
    b = sm.Buffer.zeros(1536, "float32", device=dev, stream=s)  # 6,144 bytes: twelve pieces
    sm.synchronize()
    copies, waited = _pieces_each_wait_follows(drv, monkeypatch)
    host = np.arange(1536, dtype=np.float32)
    drv.holding = True
    b.copy_from(host, stream=s)
    # the fifth piece waited for the first alone, the sixth for the second, ...
    assert len(copies) == 12 and waited == [1, 2, 3, 4, 5, 6, 7, 8]
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    copies.clear()
    waited.clear()
    drv.holding = True
    got = b.to_host(stream=s)
    # piece k waited for while piece k + 1 transfers (still held: not waited for)
    assert len(copies) == 12 and waited == list(range(1, 13))
    np.testing.assert_array_equal(got, host)
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    gc.collect()
    assert dev.backend._staged == 0


def test_an_interrupt_while_pinning_leaves_nothing_counted(fake, monkeypatch):
    """Pinning a fresh block takes milliseconds (38.8 ms for 64 MiB on an H200): a Ctrl-C
    then surfaces in pinned(), between counting the block against STAGE_BUDGET and filing
    what uncounts it. Counted forever, each such interrupt shrank the budget until every copy
    went pageable, under the core lock."""
    import sharedmem.backends.cuda as bc
    dev, drv = fake
    monkeypatch.setattr(bc, "STAGE_MAX", 512)
    b = sm.Buffer.zeros(256, "float32", device=dev)
    sm.synchronize()
    gc.collect()
    assert dev.backend._staged == 0

    def interrupted(n):
        raise KeyboardInterrupt
    cuda = dev.backend._cupy.cuda
    real = cuda.alloc_pinned_memory
    monkeypatch.setattr(cuda, "alloc_pinned_memory", interrupted)
    for call in (lambda: b.copy_from(np.ones(256, np.float32)), b.to_host):
        with pytest.raises(KeyboardInterrupt):
            call()
        assert dev.backend._staged == 0
    monkeypatch.setattr(cuda, "alloc_pinned_memory", real)
    b.copy_from(np.ones(256, np.float32))
    np.testing.assert_array_equal(b.to_host(), np.ones(256, np.float32))
    sm.synchronize()
    gc.collect()
    assert dev.backend._staged == 0


def test_an_upload_that_cannot_be_staged_is_copied_from_the_array_all_the_same(fake, monkeypatch):
    """Pinned memory can run out (cudaHostAlloc fails once CuPy's pool freed its free blocks
    and asked again) or be refused (a pinned allocation while a thread captures a graph in
    the global mode). copy_from did not allocate pinned memory before: it must not start
    failing with CuPy's error -- it copies from the caller's array, as for a large upload."""
    dev, drv = fake

    def no_pinned_memory(n):
        raise RuntimeError("cudaErrorMemoryAllocation: out of memory")
    monkeypatch.setattr(dev.backend._cupy.cuda, "alloc_pinned_memory", no_pinned_memory)
    x = sm.Buffer.zeros(4, device=dev)
    host = np.arange(4, dtype=np.float32)
    x.copy_from(host)
    np.testing.assert_array_equal(x.to_host(), host)
    y = sm.Buffer.from_host(2 * host, device=dev)
    np.testing.assert_array_equal(y.to_host(), 2 * host)


def test_cupy_kernel_arguments_are_packed_as_the_kernel_expects(fake, kernels):
    dev, drv = fake
    saxpy, scale_len = kernels
    n = 100
    x = sm.Buffer.from_host(np.arange(n, dtype=np.float32), device=dev)
    y = sm.Buffer.from_host(np.ones(n, np.float32), device=dev)
    out = sm.Buffer.empty(n, "float32", device=dev)
    # a Python float for a float parameter is a float32, a Python int for an int an int32
    sm.launch(saxpy, 1, 128, 2.5, sm.In(x), sm.In(y), sm.Out(out), n).result()
    np.testing.assert_array_equal(out.to_host(), 2.5 * np.arange(n, dtype=np.float32) + 1)
    sm.launch(saxpy, 1, 128, np.float32(-1), sm.In(x), sm.In(y), sm.Out(out), np.int32(n)).result()
    np.testing.assert_array_equal(out.to_host(), 1 - np.arange(n, dtype=np.float32))
    # the parameter types come from the kernel's source: a float64 for a float is its value
    sm.launch(saxpy, 1, 128, np.float64(0.5), sm.In(x), sm.In(y), sm.Out(out), n).result()
    np.testing.assert_array_equal(out.to_host(), 0.5 * np.arange(n, dtype=np.float32) + 1)
    with pytest.raises(sm.KernelError, match=r"^argument 4: 4294967296 does not fit parameter 'n' \(int\), "
                                             r"which takes -2147483648\.\.2147483647$"):
        sm.launch(saxpy, 1, 128, 1.0, sm.In(x), sm.In(y), sm.Out(out), 1 << 32)
    # a Buffer slice where the kernel takes a pointer and a length: said so, never guessed
    part = out[10:30]
    sm.launch(scale_len, 1, 32, sm.InOut(part, with_length=True), 2.0).result()
    got = out.to_host()
    np.testing.assert_array_equal(got[10:30], 2 * (0.5 * np.arange(10, 30, dtype=np.float32) + 1))
    np.testing.assert_array_equal(got[:10], 0.5 * np.arange(10, dtype=np.float32) + 1)
    # a strided tensor has no "pointer and count of consecutive elements": refused, no lease
    t = sm.Tensor.from_host(np.arange(8, dtype=np.float32), device=dev)
    leased = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^argument 0: with_length=True needs a contiguous "
                                             r"array \(a pointer and a count of consecutive "
                                             r"elements\), got a strided Tensor; pass a "
                                             r"contiguous copy \(tensor.contiguous\(\)\)$"):
        sm.launch(scale_len, 1, 32, sm.InOut(t[::2], with_length=True), 2.0)
    assert sm.stats().submitted == leased
    sm.launch(scale_len, 1, 32, sm.InOut(t[2:6], with_length=True), 2.0).result()
    np.testing.assert_array_equal(t.to_host(), [0, 1, 4, 6, 8, 10, 6, 7])


def test_kernel_parameter_types_are_read_past_comments():
    from interop.cupy_launch import param_types
    code = """
    // extern "C" __global__ void k(float* old_version) { }   (commented out)
    extern "C" __global__ void k(float* p,  // the output
                                 long long n /* element count */,
                                 /* a pointer */ const int* __restrict__ q,
                                 double f)  // a factor
    { /* body */ }
    """
    assert param_types(code, "k") == [("p", "float*", "p"), ("i", "long long", "n"),
                                      ("p", "int*", "q"), ("f", "double", "f")]


def test_comment_marks_inside_string_and_char_literals_are_not_comments():
    """A ``/*`` or ``//`` in a string or character literal starts no comment: read as one, it
    hid the source up to the next ``*/`` -- here the kernel's declaration."""
    from interop.cupy_launch import param_types
    code = r"""
    __device__ void note() { printf("/* start %c\"", '"'); char c = '/'; }
    extern "C" __global__ void k(float* p, int n) { printf("// %d */ done", n); }
    """
    assert param_types(code, "k") == [("p", "float*", "p"), ("i", "int", "n")]
    code = '__device__ const char* home = "http://x"; extern "C" __global__ void k(int n) {}'
    assert param_types(code, "k") == [("i", "int", "n")]


def test_a_digit_separator_starts_no_character_literal():
    """A C++14 digit separator (``1'024``) is no character literal: read as the opening quote
    of one, it ran to the next quote on its line -- an apostrophe in a comment there -- and
    kept that comment in the source, where an old declaration of the kernel it quotes (or a
    ``/*`` it holds, hiding the kernel's up to the next ``*/``) left the parameters unread."""
    from interop.cupy_launch import param_types
    code = """
    constexpr int N = 1'024;  // the kernel's old form: __global__ void k(double* p)
    extern "C" __global__ void k(float* p, int n) { }
    """
    assert param_types(code, "k") == [("p", "float*", "p"), ("i", "int", "n")]
    code = """
    constexpr unsigned M = 0xFF'FFu;  // don't /* read this
    extern "C" __global__ void k(float* p, int n) { char c = u8'a'; }
    // */
    """
    assert param_types(code, "k") == [("p", "float*", "p"), ("i", "int", "n")]


def test_floating_point_arguments_are_checked_before_anything_is_enqueued(fake, kernels):
    """half, float and double parameters take their values in both builds (a half as its two
    bytes); a finite value beyond the parameter's range is a KernelError raised before the
    launch waits for anything or takes a lease (C would have made it an infinity)."""
    from fake_cuda import RawKernel, array_at
    dev, drv = fake
    saxpy, _ = kernels

    def take(h, f, d, out):
        array_at(out, 3, np.float64)[:] = (h, f, d)

    code = 'extern "C" __global__ void take(half h, float f, double d, double* out) { }'
    k = RawKernel(drv, "take", ["e", "f", "d", "Q"], take, code)
    out = sm.Buffer.zeros(3, "float64", device=dev)
    for h, f, d in ((1.5, 2.5, 1e300), (65504.0, 3.4028234663852886e38, -0.0), (-2, 7, 3),
                    (np.float16(0.25), np.float64(0.75), np.float32(1.25))):
        sm.launch(k, 1, 1, h, f, d, sm.Out(out)).result()
        assert out.to_host().tolist() == [float(h), float(f), float(d)]
    sm.launch(k, 1, 1, float("inf"), float("nan"), float("-inf"), sm.Out(out)).result()
    got = out.to_host()
    assert got[0] == np.inf and np.isnan(got[1]) and got[2] == -np.inf
    # refused before the launch is ordered after unfinished work of another stream
    s1, s2 = dev.create_stream("s1"), dev.create_stream("s2")
    drv.holding = True
    sm.launch(k, 1, 1, 0.0, 0.0, 0.0, sm.Out(out), stream=s1)  # a write in flight on s1
    waits = [c for c in drv.calls if c[0] == "wait"]
    for args, message in (
            ((1e5, 0.0, 0.0), "argument 0: 100000.0 is out of range for parameter 'h' (half)"),
            ((0.0, 1e39, 0.0), "argument 1: 1e+39 is out of range for parameter 'f' (float)"),
            ((0.0, 3.4028235677973366e38, 0.0), "argument 1: 3.4028235677973366e+38 is out of "
                                                 "range for parameter 'f' (float)"),
            ((0.0, 0.0, 10 ** 400), f"argument 2: {10 ** 400} is out of range for parameter "
                                    f"'d' (double)"),
            ((0.0, "1", 0.0), "argument 1: parameter 'f' (float) takes a number, got str '1'"),
            ((True, 0.0, 0.0), "argument 0: parameter 'h' (half) takes a number, got bool "
                               "True")):
        with pytest.raises(sm.KernelError) as info:
            sm.launch(k, 1, 1, *args, sm.Out(out), stream=s2)
        assert str(info.value) == message
        assert [c for c in drv.calls if c[0] == "wait"] == waits  # nothing enqueued
        assert out.allocation.tracker.streams_locked() == [s1]  # no lease on s2
    del info
    drv.holding = False
    drv.finish_held()
    sm.synchronize()


def test_captured_cupy_launches_replay(fake, kernels):
    dev, drv = fake
    saxpy, _ = kernels
    s = dev.create_stream("capture")
    x = sm.Buffer.from_host(np.ones(8, np.float32), device=dev, stream=s)
    out = sm.Buffer.zeros(8, "float32", device=dev, stream=s)
    s.synchronize()
    g = sm.graph(sm.op(saxpy, 1, 8, 3.0, sm.In(x), sm.In(x), sm.Out(out), 8)
                 .and_then(sm.op(saxpy, 1, 8, 1.0, sm.In(out), sm.In(x), sm.Out(out), 8)), stream=s)
    np.testing.assert_array_equal(out.to_host(), np.zeros(8))
    g.replay().result()
    np.testing.assert_array_equal(out.to_host(), np.full(8, 5.0))


def test_kernel_plan_caches_are_bounded(fake, kernels, monkeypatch):
    import interop.cupy as ic
    import interop.cupy_launch as icl
    from fake_cuda import RawKernel, array_at
    L = sys.modules["sharedmem.launch"]  # (sharedmem.launch is the function)
    dev, drv = fake
    monkeypatch.setattr(icl, "_by_function", {})
    monkeypatch.setattr(icl, "_SIG_CACHE_MAX", 2)
    monkeypatch.setattr(L, "_plans", {})
    monkeypatch.setattr(L, "_PLANS_MAX", 2)

    def fill(x, v):
        array_at(x, 4, np.float32)[:] = v

    out = sm.Buffer.zeros(4, "float32", device=dev)
    for n in (1, 2, 3, 4):  # four kernels through caches of two
        k = RawKernel(drv, f"fill{n}", ["Q", "i"], fill,
                      f'extern "C" __global__ void fill{n}(float* x, int v) {{ }}')
        sm.launch(k, 1, 4, sm.Out(out), n).result()
        assert len(icl._by_function) <= 2 and len(L._plans) <= 2
        np.testing.assert_array_equal(out.to_host(), np.full(4, n, np.float32))


def test_submissions_share_a_lazily_recorded_marker(fake):
    import sharedmem.backends.cuda as bc
    from sharedmem.runtime.state import locked
    dev, drv = fake
    backend = dev.backend
    s = dev.create_stream("batch")
    impl = s._impl

    def records():
        return sum(1 for c in drv.calls if c[0] == "record" and c[2] == s.handle)

    n0 = records()
    with locked():
        first = [impl.submit_marker() for _ in range(bc.MARKER_BATCH - 1)]
        assert all(m is first[0] for m in first) and records() == n0  # joined, nothing recorded
        last = impl.submit_marker()  # the MARKER_BATCH-th joiner records it
        assert last is first[0] and records() == n0 + 1 and last.handle != 0
        fresh = impl.submit_marker()
        assert fresh is not last and records() == n0 + 1
        assert fresh.query() == bc.DONE and records() == n0 + 2  # a query records it first
        assert impl.submit_marker() is not fresh  # and closes it to later joiners
        impl.open_marker.close_locked()
        assert records() == n0 + 3
    ev = last.event
    first[0].recycle()
    first[0].recycle()  # every submission sharing it recycles it: the event goes back once
    assert last.event is None and backend._events.count(ev) == 1
    # a marker recycled meanwhile (by the retirer) is done: waiting and asking never touch the
    # event that went back to the pool
    n_calls = len(drv.calls)
    assert last.wait() is True and last.wait(0.01) is True and last.query() == bc.DONE
    assert len(drv.calls) == n_calls


def test_an_open_marker_is_recorded_after_all_the_work_that_joined_it(fake, kernels):
    dev, drv = fake
    saxpy, _ = kernels
    s, other = dev.create_stream("writer"), dev.create_stream("reader")
    x = sm.Buffer.from_host(np.ones(8, np.float32), device=dev, stream=s)
    out = sm.Buffer.zeros(8, "float32", device=dev, stream=s)
    s.synchronize()
    drv.holding = True  # events recorded from now on stay pending
    try:
        futs = [sm.launch(saxpy, 1, 8, float(i), sm.In(x), sm.In(x), sm.Out(out), 8, stream=s)
                for i in range(3)]
        assert not futs[-1].done()
        mark = len(drv.calls)
        # `out` is written by pending work on s: the reader waits for an event of s recorded
        # after the last launch on s that wrote it
        sm.launch(saxpy, 1, 8, 1.0, sm.In(out), sm.In(x), sm.Out(x), 8, stream=other)
        waits = [c for c in drv.calls[mark:] if c[0] == "wait" and c[1] == other.handle]
        assert len(waits) == 1
        rec = max(i for i, c in enumerate(drv.calls) if c[0] == "record" and c[1] == waits[0][2])
        last_launch = max(i for i, c in enumerate(drv.calls) if c[0] == "launch" and c[2] == s.handle)
        assert rec > last_launch and drv.calls[rec][2] == s.handle
    finally:
        drv.holding = False
        drv.finish_held()
    for f in futs:
        f.result()
    sm.synchronize()
    assert sm.stats().in_flight == 0


def test_cupy_launches_are_planned_once_per_kernel(fake, kernels, monkeypatch):
    import interop.cupy as ic
    from fake_cuda import RawKernel
    dev, drv = fake
    saxpy, scale_len = kernels
    planned = count_plans(monkeypatch, ic.RawKernelAdapter)
    n = 64
    x = sm.Buffer.from_host(np.arange(n, dtype=np.float32), device=dev)
    y = sm.Buffer.from_host(np.ones(n, np.float32), device=dev)
    out = sm.Buffer.empty(n, "float32", device=dev)
    s = dev.create_stream("planned")
    sm.synchronize()
    futs = [sm.launch(saxpy, 1, 64, float(i), sm.In(x), sm.In(y), sm.Out(out), n, stream=s)
            for i in range(40)]
    # fresh views every launch: the same plan
    for i in range(5):
        t = sm.Tensor.from_buffer(out, (n,))
        futs.append(sm.launch(saxpy, 1, 64, 39.0, sm.In(x), sm.In(y), sm.Out(t), n, stream=s))
        out = t.into_buffer()
    o = sm.op(saxpy, 1, 64, 39.0, sm.In(x), sm.In(y), sm.Out(out), n)
    futs += [o.submit(s) for _ in range(3)]  # an op is a launch
    assert planned == [saxpy]
    # another kernel object for the same CUfunction (RawModule.get_function makes one per
    # call) reuses the plan of that CUfunction
    twin = RawKernel(drv, "saxpy", [], None, saxpy.code)
    twin.kernel = saxpy.kernel
    futs.append(sm.launch(twin, 1, 64, 39.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s))
    assert len(planned) == 2 and planned[1] is twin
    assert ic.RawKernelAdapter().plan(twin, dev) is ic.RawKernelAdapter().plan(saxpy, dev)
    del o
    futs[-1].result()
    np.testing.assert_array_equal(out.to_host(), 39.0 * np.arange(n, dtype=np.float32) + 1)
    assert s.pending == 0 and sm.stats().in_flight == 0
    for v in (-1, 3):  # NumPy scalars: converted to the parameter's type
        sm.launch(saxpy, 1, 64, np.float64(v), sm.In(x), sm.In(y), sm.Out(out), np.int64(n),
                  stream=s)
    np.testing.assert_array_equal(out.to_host(), 3.0 * np.arange(n, dtype=np.float32) + 1)
    sm.launch(saxpy, 1, 64, 39, sm.In(x), sm.In(y), sm.Out(out), n, stream=s)  # int -> float
    part = out[8:24]  # a Buffer where the kernel takes a pointer and a length
    for _ in range(3):
        sm.launch(scale_len, (1,), (16, 1), sm.InOut(part, with_length=True), 0.5, stream=s)
    s.synchronize()
    got = out.to_host()
    np.testing.assert_array_equal(got[8:24], (39.0 * np.arange(8, 24, dtype=np.float32) + 1) / 8)
    np.testing.assert_array_equal(got[:8], 39.0 * np.arange(8, dtype=np.float32) + 1)
    assert sm.stats().in_flight == 0 and s.pending == 0

    # leases: work in flight keeps its memory after every handle is dropped
    z = sm.Buffer.empty(n, "float32", device=dev)
    drv.holding = True
    try:
        sm.launch(saxpy, 1, 64, 2.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s)
        other = dev.create_stream("other")
        sm.launch(saxpy, 1, 64, 1.0, sm.In(y), sm.In(y), sm.Out(z), n, stream=other)
        mark = len(drv.calls)
        # another stream reading `out` (and writing x, which s reads): ordered after the pending
        # work of s -- one wait, enqueued before the launch
        sm.launch(saxpy, 1, 64, 1.0, sm.In(out), sm.In(y), sm.Out(x), n, stream=other)
        ops = [c[0] for c in drv.calls[mark:] if c[0] in ("wait", "launch")]
        assert ops == ["wait", "launch"]
        for how in ("argument", "process-wide"):
            with pytest.raises(sm.AccessConflictError, match=r"policy 'reject'"):
                if how == "argument":
                    sm.launch(saxpy, 1, 64, 1.0, sm.In(y), sm.In(y), sm.Out(out), n,
                              stream=other, policy="reject")
                else:
                    sm.set_access_policy("reject")
                    try:
                        sm.launch(saxpy, 1, 64, 1.0, sm.In(y), sm.In(y), sm.Out(out), n,
                                  stream=other)
                    finally:
                        sm.set_access_policy("order")
        alloc = weakref.ref(out.allocation)
        del out, part, futs
        gc_collect_harder()
        assert alloc() is not None  # still leased by the pending launches
    finally:
        drv.holding = False
        drv.finish_held()
    sm.synchronize()
    gc_collect_harder()
    assert alloc() is None and sm.stats().in_flight == 0


def test_cupy_scalar_arguments_must_fit_their_parameters(fake, kernels):
    from fake_cuda import RawKernel
    dev, drv = fake
    saxpy, scale_len = kernels
    n = 8
    x = sm.Buffer.zeros(n, "float32", device=dev)
    out = sm.Buffer.zeros(n, "float32", device=dev)
    sm.synchronize()
    before = sm.stats()

    def refused(pattern, *args, kernel=saxpy, **kw):
        with pytest.raises(sm.KernelError, match=pattern):
            sm.launch(kernel, 1, 8, *args, **kw)

    refused(r"^argument 4: parameter 'n' \(int\) takes an int, got float 8\.5; convert it "
            r"with int\(\) if that is meant$", 1.0, sm.In(x), sm.In(x), sm.Out(out), 8.5)
    refused(r"^argument 0: parameter 'a' \(float\) takes a number, got str 'x'$",
            "x", sm.In(x), sm.In(x), sm.Out(out), n)
    refused(r"^argument 1: parameter 'x' \(float\*\) is a pointer, got int 5; pass the array",
            1.0, 5, sm.In(x), sm.Out(out), n)
    refused(r"^argument 0: parameter 'a' \(float\) is not a pointer, got an array \(Buffer\)$",
            sm.In(x), sm.In(x), sm.In(x), sm.Out(out), n)
    # one argument short: refused, not absorbed by a guessed pointer + length
    refused(r"^the kernel takes 5 parameters \(a, x, y, out, n\) but was given 4 arguments;",
            1.0, sm.In(x), sm.Out(out), n)
    refused(r"^the kernel takes 3 parameters \(x, n, factor\) but was given 3 arguments \(1 "
            r"with_length, each filling two\)", sm.InOut(x, with_length=True), n, 2.0,
            kernel=scale_len)
    # the count is the error even where an argument before the with_length one, or the
    # with_length one itself, does not fit its parameter
    for args in ((5.5, sm.InOut(x, with_length=True), 2.0),
                 (sm.In(x), sm.InOut(out, with_length=True), 2.0)):
        refused(r"^the kernel takes 3 parameters \(x, n, factor\) but was given 3 arguments "
                r"\(1 with_length, each filling two\)", *args, kernel=scale_len)
    # grid, block and shared memory within the device's limits (an H200's, on the fake)
    with pytest.raises(sm.KernelError, match=r"^block \(2048,\): dimension x is 2048, above this "
                                             r"device's limit of 1024$"):
        sm.launch(saxpy, 1, (2048,), 1.0, sm.In(x), sm.In(x), sm.Out(out), n)
    with pytest.raises(sm.KernelError, match=r"^block \(64, 64\) has 4096 threads, above this "
                                             r"device's limit of 1024 per block$"):
        sm.launch(saxpy, 1, (64, 64), 1.0, sm.In(x), sm.In(x), sm.Out(out), n)
    with pytest.raises(sm.KernelError, match=r"^grid \(1, 70000\): dimension y is 70000, above "
                                             r"this device's limit of 65535$"):
        sm.launch(saxpy, (1, 70000), 8, 1.0, sm.In(x), sm.In(x), sm.Out(out), n)
    with pytest.raises(sm.KernelError, match=r"^shared_mem=300000 bytes is above this device's "
                                             r"limit of 232448 bytes"):
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(out), n, shared_mem=300000)
    # without the source, the types are unknown: Python scalars refused, NumPy ones of the
    # parameter's size passed as they are
    from fake_cuda import array_at

    def fill(a, x, y, o, m):
        array_at(o, m, np.float32)[:] = a

    blind = RawKernel(drv, "blind", ["f", "Q", "Q", "Q", "i"], fill)  # no source
    with pytest.raises(sm.KernelError, match=r"^argument 0: a 4-byte parameter of unknown type "
                                             r"\(the kernel's source is not known, so neither is "
                                             r"the type\); got float 2\.0\. Pass a NumPy scalar"):
        sm.launch(blind, 1, 8, 2.0, sm.In(x), sm.In(x), sm.Out(out), n)
    sm.launch(blind, 1, 8, np.float32(2), sm.In(x), sm.In(x), sm.Out(out), np.int32(n)).result()
    np.testing.assert_array_equal(out.to_host(), np.full(n, 2, np.float32))
    assert sm.stats().submitted == before.submitted + 2  # (the launch and to_host's copy)


@pytest.fixture
def tile(fake, monkeypatch):
    """A stand-in for cuda.tile over the fake driver (tests/fake_cuda.fake_cutile)."""
    import types as _types

    from fake_cuda import fake_cutile
    dev, drv = fake
    fail = []
    mod = fake_cutile(drv, fail)
    if "cuda" in sys.modules:
        monkeypatch.setattr(sys.modules["cuda"], "tile", mod, raising=False)
    else:
        monkeypatch.setitem(sys.modules, "cuda", _types.ModuleType("cuda"))
        sys.modules["cuda"].tile = mod
    monkeypatch.setitem(sys.modules, "cuda.tile", mod)
    return mod, fail


def _vadd_operands(dev, n):
    """a = 0..n-1, b = ones, c = zeros (float32 tensors) and a stream, all settled."""
    a = sm.Tensor.from_host(np.arange(n, dtype=np.float32), device=dev)
    b = sm.Tensor.from_host(np.ones(n, np.float32), device=dev)
    c = sm.Tensor.zeros((n,), "float32", device=dev)
    s = dev.create_stream("tile")
    sm.synchronize()
    return a, b, c, s


def test_cutile_launches_are_planned_once_with_the_same_rules(fake, tile, monkeypatch):
    import interop.cutile as icu
    from fake_cuda import TileKernel
    dev, drv = fake
    _, fail = tile
    planned = count_plans(monkeypatch, icu.TileKernelAdapter)

    def vadd(a, b, c, k):  # c = a + k * b
        c[:] = a + k * b

    kern = TileKernel(vadd)
    n = 16
    a, b, c, s = _vadd_operands(dev, n)
    mark = len(drv.calls)
    for k in range(1, 6):
        f = sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c), k, stream=s)
    assert planned == [kern]
    f.result()
    np.testing.assert_array_equal(c.to_host(), np.arange(n, dtype=np.float32) + 5)
    tiles = [x for x in drv.calls[mark:] if x[0] == "tile" and x[1] == s.handle]
    assert tiles == [("tile", s.handle, (2, 1, 1))] * 5  # (and the warm-ups' elsewhere)
    assert sm.stats().in_flight == 0 and not c.allocation.tracker

    with pytest.raises(sm.KernelError, match=r"^arguments 1 and 2 overlap \(bytes \[0, 64\) of "
                                             r"allocation #\d+\) and one of them is written"):
        sm.launch(kern, (2,), None, sm.In(a), sm.In(c), sm.Out(c), 1, stream=s)
    with pytest.raises(sm.KernelError, match=r"^cuTile kernels choose their own block shape"):
        sm.launch(kern, (2,), 128, sm.In(a), sm.In(b), sm.Out(c), 1, stream=s)
    with pytest.raises(sm.KernelError, match=r"would write through a read-only view"):
        sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c.as_readonly()), 1, stream=s)
    gone = sm.Tensor.zeros((n,), "float32", device=dev)
    gone.release()
    with pytest.raises(sm.ReleasedError, match=r"this Tensor \(allocation #\d+\) was released"):
        sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(gone), 1, stream=s)
    with pytest.raises(sm.KernelError, match=r"^argument 2: with_length=True is for CuPy kernels"):
        sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c, with_length=True), 1, stream=s)
    rev, = _fake_cupy_arrays(monkeypatch, dev, n, 1)  # a CuPy array reversed: arr[::-1]
    rev.strides = (-4,)
    mem = rev.data  # (its memory unit: as CuPy's, where the pointer of element 0 moved)
    rev.data = types.SimpleNamespace(ptr=mem.ptr + 4 * (n - 1), mem=mem)
    with pytest.raises(sm.KernelError, match=r"^argument 0: a ndarray with negative strides; "
                                             r"cuTile assumes strides >= 0"):
        sm.launch(kern, (2,), None, sm.In(rev), sm.In(b), sm.Out(c), 1, stream=s)
    assert sm.stats().in_flight == 0 and not c.allocation.tracker
    # a NumPy scalar is passed to cuTile as a Python scalar
    sm.launch(kern, 2, None, sm.In(a), sm.In(b), sm.Out(c), np.float32(2), stream=s).result()
    np.testing.assert_array_equal(c.to_host(), np.arange(n, dtype=np.float32) + 2)
    assert sm.stats().in_flight == 0 and not c.allocation.tracker and planned == [kern]

    # ct.launch raising: the error as cuTile raised it, nothing leased, nothing enqueued
    sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c), 3, stream=s).result()
    mark = len(drv.calls)
    boom = RuntimeError("tile compiler failed")
    fail.append(boom)
    with pytest.raises(RuntimeError) as info:
        sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c), 4, stream=s)
    assert info.value is boom
    assert not c.allocation.tracker and sm.stats().in_flight == 0 and s.pending == 0
    assert not [x for x in drv.calls[mark:] if x[0] in ("tile", "record")]
    fail.clear()
    del info, boom  # (its traceback holds frames, and so the views)

    # leases: work in flight keeps its memory after every handle is dropped
    drv.holding = True
    try:
        f1 = sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c), 7, stream=s)
        f2 = sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c), 7, stream=s)
        assert s.pending == 2 and not f1.done()
        alloc = weakref.ref(c.allocation)
        del c, f1, f2
        gc_collect_harder()
        assert alloc() is not None  # still leased by the pending launches
    finally:
        drv.holding = False
        drv.finish_held()
    sm.synchronize()
    gc_collect_harder()
    assert alloc() is None and sm.stats().in_flight == 0


def test_cutile_compiles_outside_the_core_lock(fake, tile, monkeypatch):
    """A first launch compiles (seconds, for cuTile) in a warm-up launch of an empty grid
    before the launch takes the core lock: other threads' sharedmem calls go on meanwhile,
    the kernel runs once, and a signature seen before is not warmed again."""
    import threading

    import interop.cutile as icu
    from fake_cuda import TileKernel
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    mod, fail = tile
    ran = []

    def vadd(a, b, c, k):
        ran.append(k)
        c[:] = a + k * b

    kern = TileKernel(vadd)
    n = 16
    a, b, c, s = _vadd_operands(dev, n)
    seen = []

    def compiling(kernel):  # what another thread can do while the kernel compiles
        other = []
        t = threading.Thread(target=lambda: other.append(
            sm.Buffer.zeros(4, "float32", device=dev).to_host().sum()))
        t.start()
        t.join(5)
        seen.append((RUNTIME.owner, other))
    mod.compile_hook = compiling
    mark = len(drv.calls)
    sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c), 2, stream=s).result()
    assert seen == [(0, [0.0])], seen  # compiled with the core lock free; the other thread ran
    assert ran == [2]  # the warm-up's launch was captured, never run
    np.testing.assert_array_equal(c.to_host(), np.arange(n, dtype=np.float32) + 2)
    tiles = [x for x in drv.calls[mark:] if x[0] == "tile"]
    assert tiles == [("tile", s.handle, (2, 1, 1))]  # (the warm-up's empty grid: refused)
    assert not drv.capturing and not drv.graphs

    # the same signature: no warm-up (fresh views of the same layout included)
    mark = len(drv.calls)
    c2 = sm.Tensor.from_buffer(c.into_buffer(), (n,))
    sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c2), 2, stream=s).result()
    assert [x for x in drv.calls[mark:] if x[0] == "tile"] == [("tile", s.handle, (2, 1, 1))]
    # a scalar of another type is another signature (cuTile specializes on it)
    sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c2), 2.0, stream=s).result()
    assert len(seen) == 2 and seen[1][0] == 0 and ran == [2, 2, 2.0]

    # a failing warm-up is left to the launch: its error, raised as always, no leases
    boom = RuntimeError("tile compiler failed")
    fail.append(boom)
    with pytest.raises(RuntimeError) as info:
        sm.launch(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c2), 5, stream=s)
    assert info.value is boom and s.pending == 0 and not c2.allocation.tracker
    fail.clear()
    del info, boom

    # at most WARM_MAX signatures a kernel are warmed; later ones compile at their launch
    monkeypatch.setattr(icu, "WARM_MAX", 0)
    kern2 = TileKernel(vadd)
    owners = []
    mod.compile_hook = lambda kernel: owners.append(RUNTIME.owner)
    sm.launch(kern2, (2,), None, sm.In(a), sm.In(b), sm.Out(c2), 3, stream=s).result()
    assert owners == [threading.get_ident()]  # compiled in the launch, under the lock
    mod.compile_hook = None


def test_a_marker_is_published_only_once_its_event_is_recorded(fake, monkeypatch):
    """wait() reads a marker without the lock: once `_open_on` is None, `event` must be the
    recorded event (an event not yet recorded reads as complete -- a result() that returned
    while a trapping kernel still ran). The record happens while the marker is still open."""
    dev, drv = fake
    s = dev.create_stream("s")
    b = sm.Buffer.zeros(8, "float32", device=dev, stream=s)
    m = b.fill_zero(stream=s)._s.marker
    assert m._open_on is not None and m.event is None
    seen = []
    real = drv.cuEventRecord

    def record(ev, stream):
        seen.append((m._open_on is not None, m.event))
        return real(ev, stream)
    monkeypatch.setattr(drv, "cuEventRecord", record)
    assert m.wait() is True
    assert seen == [(True, None)] and m._open_on is None  # (event: recycled by now, maybe)
    sm.synchronize()


def _fake_cupy_arrays(monkeypatch, dev, n, count):
    """CuPy-style arrays over fresh fake device memory, of type ``cupy.ndarray`` itself (as a
    launch sees real ones); each keeps its Buffer in ``_block``. ``Device(dev.ordinal)`` is
    ``dev`` meanwhile (a launch finds an array's device by its ordinal)."""
    import sharedmem.device as sm_device
    monkeypatch.setitem(sm_device._devices, ("cuda", dev.ordinal), dev)
    cp = sys.modules["cupy"]

    class _Mem:
        def __init__(self, ptr, size):
            self.ptr, self.size, self.mem = ptr, size, self

    class ndarray(cp.ndarray):
        def __init__(self, values):
            self._block = sm.Buffer.from_host(values, device=dev)
            self.data = _Mem(self._block.ptr, values.nbytes)
            self.device = types.SimpleNamespace(id=dev.ordinal)
            self.size, self.shape, self.strides, self.itemsize = n, (n,), (4,), 4

    cp.ndarray = ndarray
    return [ndarray(np.full(n, i, np.float32)) for i in range(count)]


def test_an_op_of_cupy_arrays_alone_runs_on_their_device(fake, kernels, monkeypatch):
    """op.submit() with no stream runs on the device of the op's first array argument -- a
    CuPy array's too, as launch() does: it took only sharedmem views into account, so an op
    whose arrays were all CuPy's ran on the default device (here the host) and was refused
    with DeviceMismatchError (on a machine of several GPUs: arrays on another GPU than the
    default one)."""
    dev, drv = fake
    saxpy, _ = kernels
    monkeypatch.setattr(sys.modules["sharedmem.device"], "_default", sm.Device.host())
    n = 16
    x, y, out = _fake_cupy_arrays(monkeypatch, dev, n, 3)
    sm.synchronize()
    assert sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n).result() is None
    o = sm.op(saxpy, 1, 16, 3.0, sm.In(y), sm.In(y), sm.Out(out), n)
    fut = o.submit()
    fut.result()
    assert fut.stream.device is dev and fut.stream.name.startswith("sharedmem-pool-")
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 4.0))  # 3 * 1 + 1
    chain = o.and_then(sm.op(saxpy, 1, 16, 2.0, sm.In(out), sm.In(x), sm.Out(out), n))
    fut = chain.submit()
    fut.result()
    assert fut.stream.device is dev
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 8.0))  # 2 * 4 + 0
    sm.synchronize()


def test_cupy_array_facts_are_found_again_and_forgotten_with_the_array(fake, kernels,
                                                                        monkeypatch):
    """A CuPy array argument's facts are learned once and found again (by address, compiled);
    when the array dies they are marked dead and leave every table, so a later array at the
    same address is learned anew."""
    import interop.cupy_launch as icl
    dev, drv = fake
    saxpy, _ = kernels
    n = 16
    x, y, out = _fake_cupy_arrays(monkeypatch, dev, n, 3)
    sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n).result()
    facts = icl.learned_facts()[id(out)]
    sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(y), sm.Out(out), np.int32(n)).result()
    assert icl.learned_facts()[id(out)] is facts and not facts.dead and facts.addr == id(out)
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 1.0))
    if sm.show_config(open(os.devnull, "w"))["core"].startswith("compiled"):
        assert facts in icl.recent_facts()
    sm.synchronize()
    del out
    gc_collect_harder()
    assert facts.dead and facts not in icl.learned_facts().values()
    assert facts not in icl.recent_facts()


def test_a_foreign_arrays_lease_token_goes_with_it_without_a_collection(fake, kernels,
                                                                        monkeypatch):
    """The lease pairs launches take of a foreign array are kept on its facts, not on its
    token: a pair on the token referred back to it, a cycle that kept the token -- and a
    foreign array's allocation, registered over memory its owner may reuse -- until the
    collector ran, for each array new to a launch (some dozen objects a launch to collect).
    Once the array dies and its launch is done, only the test refers to its tokens."""
    import gc

    import interop.cupy_launch as icl
    dev, drv = fake
    saxpy, _ = kernels
    n = 16
    x, out = _fake_cupy_arrays(monkeypatch, dev, n, 2)
    was = gc.isenabled()
    gc.disable()
    try:
        sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(x), sm.Out(out), n).result()
        sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(x), sm.Out(out), n).result()
        fx, fo = icl.learned_facts()[id(x)], icl.learned_facts()[id(out)]
        tx, to = fx.token, fo.token
        assert fx.use_r == (tx, False) and fo.use_w == (to, True)  # (made once, kept there)
        assert (tx.use_r, tx.use_w, to.use_r, to.use_w) == (None,) * 4
        sm.synchronize()
        del x, out, fx, fo
        assert sys.getrefcount(tx) == 2 and sys.getrefcount(to) == 2  # (tx, to; the call's)
    finally:
        if was:
            gc.enable()


def _cupy_arrays_and_a_stream(fake, kernels, monkeypatch):
    """The setup of the tests of CuPy ordering: ``(dev, drv, saxpy, n, x, y, out, cupy, s)``
    -- three CuPy-style arrays of ``n`` floats (0, 1 and 2), their uploads done (nothing to
    order after there), and a stream ``s``."""
    dev, drv = fake
    n = 16
    x, y, out = _fake_cupy_arrays(monkeypatch, dev, n, 3)
    s = dev.create_stream("s")
    sm.synchronize()
    return dev, drv, kernels[0], n, x, y, out, sys.modules["cupy"], s


def test_cupy_array_arguments_are_ordered_after_cupys_current_stream(fake, kernels, tile,
                                                                      monkeypatch):
    """A launch with CuPy arrays among its arguments is ordered after CuPy's current stream of
    their device (what CuPy's ``__dlpack__(stream=...)`` does for an import): one wait a
    launch where that stream is another, none where it is the launch's own -- for CuPy
    kernels and cuTile kernels alike, and for an array passed with_length. A launch whose
    arguments are refused waits for nothing; a capture cannot wait for CuPy's stream, and
    says what to do (nothing waited for then, not even for torch's stream beside it, and no
    part of a composite op captured)."""
    dev, drv, saxpy, n, x, y, out, cp, s = _cupy_arrays_and_a_stream(fake, kernels, monkeypatch)
    waits = _waits_seen(drv, monkeypatch)
    sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), out, n, stream=s).result()
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 1.0))  # 2 * 0 + 1
    assert waits == [s.handle]  # CuPy's current stream: the legacy default stream
    sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n).result()
    assert waits == [s.handle]  # on the legacy default stream itself: no wait
    with cp.cuda.ExternalStream(s.handle):  # CuPy's current stream is s: no wait
        sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s).result()
    assert waits == [s.handle]
    sm.launch(saxpy, 1, 16, 2.0, sm.In(y), sm.In(y), sm.Out(out), n, stream=s).result()
    assert waits == [s.handle] * 2  # (one wait for all three arrays of one device)

    from fake_cuda import TileKernel
    kern = TileKernel(lambda a, b: None)
    for a in (x, out):  # (what cuTile reads of an array beside its address)
        a.dtype = np.dtype(np.float32)
    sm.launch(kern, (1,), None, sm.In(x), sm.Out(out), stream=s).result()
    assert waits == [s.handle] * 3
    with cp.cuda.ExternalStream(s.handle):
        sm.launch(kern, (1,), None, sm.In(x), sm.Out(out), stream=s).result()
    assert waits == [s.handle] * 3

    _, scale_len = kernels  # a pointer and its length from one array: ordered as well
    sm.launch(scale_len, 1, 16, sm.InOut(x, with_length=True), 2.0, stream=s).result()
    assert waits == [s.handle] * 4
    np.testing.assert_array_equal(x._block.to_host(), np.full(n, 0.0))  # (x: zeros, doubled)

    leased = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^argument 4: parameter 'n' \(int\) is not a "
                                             r"pointer, got a CuPy array$"):
        sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(y), sm.Out(out), sm.In(x), stream=s)
    assert sm.stats().submitted == leased and waits == [s.handle] * 4
    cap = dev.create_stream("captured")
    with sm.capture(cap) as g:
        with pytest.raises(sm.CaptureError, match=r"is capturing a graph, and a launch with CuPy "
                                                  r"arrays among its arguments is ordered after "
                                                  r"CuPy's current stream of <Device cuda:0 .*> "
                                                  r"\(handle 0x0\), which a capture cannot wait "
                                                  r"for; capture on CuPy's current stream "
                                                  r"\(with cupy.cuda.Stream.from_external"):
            sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=cap)
        plain = sm.op(saxpy, 1, 16, 2.0, sm.In(x._block), sm.In(y._block),
                      sm.Out(out._block), n)
        with pytest.raises(sm.CaptureError, match=r"a launch with CuPy arrays"):  # no part
            plain.and_then(sm.op(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out),  # taken
                                 n)).submit(cap)
        assert ": 0 captured" in repr(g)
        torch = _fake_torch(monkeypatch, dev)  # torch's stream beside: not waited for either
        t = torch.Tensor(np.zeros(n, np.float32))
        with cp.cuda.ExternalStream(cap.handle):
            with pytest.raises(sm.CaptureError, match=r"a launch with CuPy arrays"):
                sm.launch(saxpy, 1, 16, 1.0, sm.In(t), sm.In(y), sm.Out(out), n, stream=s)
        with cp.cuda.ExternalStream(cap.handle):  # as that error advises: captured, no wait
            sm.launch(saxpy, 1, 16, 3.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=cap)
            with pytest.raises(sm.CaptureError, match=r"^CuPy's current stream of <Device "
                                                      r"cuda:0 .*> is <Stream .*captured.*>, "
                                                      r"which is capturing graph #\d+"):
                sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s)
    assert sm.stats().submitted == leased and waits == [s.handle] * 4  # (captured: not run)


def _refused_for_their_capture(theirs, replay=False):
    """``pytest.raises`` of the refusal of work ordered after CuPy stream ``theirs`` while it
    captures a graph CuPy began (``replay``: of a replay, said as such)."""
    said = (r"^a replay on <Stream .*> of a graph that captured launches of CuPy arrays or "
            r"torch tensors is .* and cannot be now: " if replay else "^")
    return pytest.raises(sm.CaptureError, match=rf"{said}the stream of handle {theirs.ptr:#x} "
                                                rf"on cuda:0 is capturing a CUDA graph that "
                                                rf"sharedmem did not start")


def test_a_replay_is_ordered_after_the_libraries_as_its_captured_launches_were(fake, kernels,
                                                                                monkeypatch):
    """A graph that captured launches of CuPy arrays and torch tensors (on the libraries'
    current streams: the only way) is replayed as a launch of them runs: after CuPy's and
    torch's current streams of their device -- one wait for both where they are one stream
    other than the replay's, none where it is the replay's own; refused where that stream
    captures another library's graph (CaptureError, nothing waited for or submitted). A graph
    of views alone asks no library; a composite op's pre-check alone orders no replay."""
    dev, drv, saxpy, n, x, y, out, cp, s = _cupy_arrays_and_a_stream(fake, kernels, monkeypatch)
    torch = _fake_torch(monkeypatch, dev)
    t = torch.Tensor(np.full(n, 1.0, np.float32))
    cap = dev.create_stream("captured")
    torch.current.cuda_stream = cap.handle
    with cp.cuda.ExternalStream(cap.handle):
        with sm.capture(cap) as g:
            sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(t), sm.Out(out), n)
        with sm.capture(cap) as plain:  # (views alone; and an op whose pre-check saw arrays
            sm.launch(saxpy, 1, 16, 2.0, sm.In(x._block), sm.In(y._block), sm.Out(out._block),
                      n)                           # but that was refused: no step left)
            with pytest.raises(sm.KernelError, match=r"^argument 4"):
                sm.op(saxpy, 1, 16, 2.0, sm.In(x._block), sm.In(y._block), sm.Out(out._block),
                      n).and_then(sm.op(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out),
                                        sm.In(x))).submit(cap)
    torch.current.cuda_stream = 0
    waits = _waits_seen(drv, monkeypatch)
    plain.replay(s).result()
    assert waits == []
    g.replay(s).result()
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 1.0))  # 2 * 0 + 1
    assert waits == [s.handle]  # (one wait: CuPy's and torch's stream, the legacy one)
    torch.current.cuda_stream = s.handle
    with cp.cuda.ExternalStream(s.handle):  # both current streams the replay's own: no wait
        g.replay(s).result()
    assert waits == [s.handle]
    theirs = cp.cuda.Stream(non_blocking=True)
    submitted = sm.stats().submitted
    with theirs:
        drv.cuStreamBeginCapture(theirs.ptr, 0)  # (CuPy's own capture)
        with _refused_for_their_capture(theirs, replay=True):
            g.replay(s)
        drv.cuStreamEndCapture(theirs.ptr)
    assert waits == [s.handle] and sm.stats().submitted == submitted
    cap2 = dev.create_stream("captured too")
    with cp.cuda.ExternalStream(cap2.handle), sm.capture(cap2) as g2:  # (CuPy's current
        with pytest.raises(sm.CaptureError, match=r"^a replay on <Stream .*> of a graph that "  # stream
                                                  r"captured launches of CuPy arrays or torch "  # is
                                                  r"tensors is ordered after those libraries' "  # sharedmem's,
                                                  r"current streams, as the launches were, and "  # capturing)
                                                  r"cannot be now: CuPy's current stream of "
                                                  r"<Device cuda:0 .*> is <Stream .*captured "
                                                  r"too.*>, which is capturing graph #\d+.* -- "
                                                  r"replay once that capture has ended$"):
            g.replay(s)
    assert waits == [s.handle] and sm.stats().submitted == submitted and g2.launches == 0
    g.release()
    plain.release()


@pytest.mark.parametrize("how", ["driver", "tile"])
def test_a_captured_launch_that_fails_after_its_pack_orders_no_replay(fake, kernels, tile,
                                                                        monkeypatch, how):
    """A launch of CuPy arrays captured on CuPy's current stream whose kernel launch then fails
    (the driver refuses it; cuTile raises) is not in the graph, and adds no replay step: a
    replay of the graph's other launches (views alone) waits for no library's stream, and is
    not refused while CuPy's current stream captures a graph of CuPy's own."""
    from fake_cuda import TileKernel
    dev, drv, saxpy, n, x, y, out, cp, s = _cupy_arrays_and_a_stream(fake, kernels, monkeypatch)
    mod, tile_fail = tile
    cap = dev.create_stream("captured")
    refuse = _refused_launches(drv, monkeypatch)
    kern = TileKernel(lambda a, b: None)
    for a in (x, out):
        a.dtype = np.dtype(np.float32)
    with cp.cuda.ExternalStream(cap.handle):
        with sm.capture(cap) as g:
            if how == "driver":
                refuse.append(True)
                with pytest.raises(sm.SharedMemError, match="CUDA_ERROR_INVALID_VALUE"):
                    sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n)
            else:
                tile_fail.append(RuntimeError("cuLaunchKernelEx failed"))
                with pytest.raises(RuntimeError, match="cuLaunchKernelEx failed"):
                    sm.launch(kern, (1,), None, sm.In(x), sm.Out(out))
                tile_fail.clear()
            sm.launch(saxpy, 1, 16, 2.0, sm.In(x._block), sm.In(y._block), sm.Out(out._block),
                      n)
    assert g.launches == 1
    waits = _waits_seen(drv, monkeypatch)
    g.replay(s).result()
    assert waits == []  # (CuPy's current stream, the legacy one: not waited for)
    theirs = cp.cuda.Stream(non_blocking=True)
    with theirs:
        drv.cuStreamBeginCapture(theirs.ptr, 0)  # (CuPy's own capture: nothing of it replayed)
        try:
            g.replay(s).result()
        finally:
            drv.cuStreamEndCapture(theirs.ptr)
    assert waits == []
    g.release()


def test_a_launch_packed_for_a_capture_that_ended_before_its_submission_orders_no_replay(
        fake, kernels, monkeypatch):
    """A launch of CuPy arrays packed while its stream captured (on CuPy's current stream),
    whose capture ended (another thread) before it was submitted, runs -- it is not in the
    graph, and adds no replay step to it: a replay waits for no library's stream. (The capture
    ends here where a submission reports a pending leak warning, between pack and record.)"""
    import warnings

    from sharedmem.runtime.state import RUNTIME
    dev, drv, saxpy, n, x, y, out, cp, s = _cupy_arrays_and_a_stream(fake, kernels, monkeypatch)
    cap = dev.create_stream("captured")
    c = sm.capture(cap)
    ended = []

    def show(*a, **k):
        if not ended:
            ended.append(c.__exit__(None, None, None))
    with cp.cuda.ExternalStream(cap.handle):
        g = c.__enter__()
        RUNTIME.warnings.append("a leak, reported by the next submission")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            monkeypatch.setattr(warnings, "showwarning", show)
            sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n).result()
    assert ended == [False] and g.launches == 0
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 1.0))  # (it ran)
    waits = _waits_seen(drv, monkeypatch)
    g.replay(s).result()
    assert waits == []
    g.release()


def test_a_captured_launch_whose_after_record_step_raises_keeps_its_memory_in_the_graph(
        fake, kernels, monkeypatch):
    """A launch recorded into a graph whose ``after_recorded_locked`` function then raises (a
    plan's step that cannot be made: here a MemoryError) raises that error, but the kernel is
    in the graph: the graph counts it and keeps the memory it touches (its three ranges), as
    for a launch recorded in part -- else every replay would run it on memory freed and
    reused meanwhile."""
    import interop.cupy_launch as icl
    dev, drv, saxpy, n, x, y, out, cp, s = _cupy_arrays_and_a_stream(fake, kernels, monkeypatch)
    cap = dev.create_stream("captured")

    def add(self, torch_devs, cupy_devs):
        raise MemoryError("no room for the step")
    monkeypatch.setattr(icl._ReplayOrder, "add", add)
    with cp.cuda.ExternalStream(cap.handle):
        with sm.capture(cap) as g:
            with pytest.raises(MemoryError, match="no room for the step"):
                sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n)
    assert g.launches == 1 and len(g._uses) == 3
    g.replay(s).result()
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 1.0))  # 2 * 0 + 1
    g.release()


@pytest.mark.parametrize("signature, cupys", [(b"intptr_t (int)", True),
                                               (b"intptr_t (void)", True),
                                               (b"intptr_t (int)", False)])
def test_cupys_current_stream_is_read_through_its_c_entry_point_where_found(
        fake, kernels, monkeypatch, signature, cupys):
    """Compiled, a launch of CuPy arrays asks CuPy's current stream of their device through the
    C function CuPy's own kernels ask (``cupy_backends.cuda.stream.get_stream_ptr``, found in
    that module's ``__pyx_capi__`` by its signature ``intptr_t (int)``): with the device's
    ordinal, and not ``cupy.cuda.get_current_stream``. With another signature, or a ``cupy``
    whose ``get_current_stream`` is not CuPy's (a stand-in), and interpreted: through
    ``cupy.cuda.get_current_stream``."""
    dev, drv, saxpy, n, x, y, out, cp, s = _cupy_arrays_and_a_stream(fake, kernels, monkeypatch)
    asked = []

    @ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)
    def entry(device_id):  # (says s is current; cupy.cuda.get_current_stream says legacy)
        asked.append(device_id)
        return s.handle

    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                   ctypes.c_void_p]
    name = ctypes.create_string_buffer(signature)  # (the capsule keeps its address)
    capi = types.ModuleType("cupy_backends.cuda.stream")
    capi.__pyx_capi__ = {"get_stream_ptr": new(ctypes.cast(entry, ctypes.c_void_p), name, None)}
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.stream", capi)
    python_level = cp.cuda.get_current_stream

    def get_current_stream(device_id=-1):
        return python_level(device_id)

    if cupys:
        get_current_stream.__module__ = "cupy.cuda.stream"
    monkeypatch.setattr(cp.cuda, "get_current_stream", get_current_stream)
    waits = _waits_seen(drv, monkeypatch)
    sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s).result()
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 1.0))
    compiled = sm.show_config(open(os.devnull, "w"))["core"].startswith("compiled")
    if compiled and cupys and signature == b"intptr_t (int)":
        assert asked == [dev.ordinal] and waits == []  # (CuPy's current: s itself)
    else:
        assert asked == [] and waits == [s.handle]  # (CuPy's current: the legacy stream)


def test_a_replay_given_an_unknown_policy_is_refused_before_it_waits(fake, kernels,
                                                                     monkeypatch):
    """``g.replay(s, policy=...)`` with an unknown policy raises SharedMemError before its
    steps order it after CuPy's current stream (as a launch checks its policy first): nothing
    waited for, nothing submitted."""
    dev, drv, saxpy, n, x, y, out, cp, s = _cupy_arrays_and_a_stream(fake, kernels, monkeypatch)
    cap = dev.create_stream("captured")
    with cp.cuda.ExternalStream(cap.handle):
        with sm.capture(cap) as g:
            sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n)
    waits = _waits_seen(drv, monkeypatch)
    submitted = sm.stats().submitted
    with pytest.raises(sm.SharedMemError, match=r"^unknown access policy 'bogus'"):
        g.replay(s, policy="bogus")
    assert waits == [] and sm.stats().submitted == submitted
    g.replay(s, policy="reject").result()
    assert waits == [s.handle]
    g.release()


def test_a_composite_op_whose_later_part_is_refused_at_its_plan_submits_no_part(fake, kernels):
    """A later part of a composite op whose grid or block is out of range, or whose scalar its
    kernel's parameter does not take, is refused before the first part is submitted: nothing
    leased, nothing run (every part is configured and packed first). The op submitted again
    with the part fixed runs each part once."""
    dev, drv = fake
    saxpy, _ = kernels
    n = 16
    x = sm.Buffer.from_host(np.arange(n, dtype=np.float32), device=dev)
    first, second = (sm.Buffer.zeros(n, "float32", device=dev) for _ in range(2))
    s = dev.create_stream("s")
    ok = sm.op(saxpy, 1, 16, 2.0, sm.In(x), sm.In(x), sm.Out(first), n)
    before = sm.stats().submitted
    bad_parts = [
        (sm.op(saxpy, 1, (16, 1, 1, 1), 1.0, sm.In(x), sm.In(x), sm.Out(second), n),
         r"block"),
        (sm.op(saxpy, 1, 16, 1.0, sm.In(x), sm.In(x), sm.Out(second), "n"),
         r"^argument 4: parameter 'n' \(int\)"),
        (sm.op(saxpy, 1, 16, 1.0, sm.In(x), sm.In(x), sm.Out(second)),
         r"takes 5 arguments|argument"),
    ]
    for bad, match in bad_parts:
        for composite in (ok.and_then(bad), sm.zip(ok, bad), ok.and_then(bad).apply(len)):
            with pytest.raises(sm.KernelError, match=match):
                composite.submit(s)
            assert sm.stats().submitted == before, composite
    sm.synchronize()
    fixed = sm.op(saxpy, 1, 16, 1.0, sm.In(x), sm.In(x), sm.Out(second), n)
    ok.and_then(fixed).submit(s).result()
    assert sm.stats().submitted == before + 2  # (each part once)
    np.testing.assert_array_equal(first.to_host(), 3 * np.arange(n))
    np.testing.assert_array_equal(second.to_host(), 2 * np.arange(n))


def test_one_op_twice_in_a_composite_with_cupy_arrays_runs_and_replays_each_part(
        fake, kernels, monkeypatch):
    """An op used twice in one composite (``a.and_then(a)``, ``zip(a, a)``, nested) has each
    part planned and packed on its own before the first is submitted: each runs, nothing is
    left in flight. Captured (on CuPy's current stream), both parts are recorded, and each
    replay is ordered after CuPy's stream once."""
    dev, drv, saxpy, n, x, y, out, cp, s = _cupy_arrays_and_a_stream(fake, kernels, monkeypatch)
    a = sm.op(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n)
    before = sm.stats().submitted
    a.and_then(a).submit(s).result()
    sm.zip(a, a).submit(s).result()
    sm.zip(a.and_then(a), sm.zip(a, a)).submit(s).result()
    # (each launch once, and a join a zip: 2, then 2 + 1, then 2 + (2 + 1) + 1)
    assert sm.stats().in_flight == 0 and sm.stats().submitted == before + 2 + 3 + 6
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 1.0))
    cap = dev.create_stream("captured")
    with cp.cuda.ExternalStream(cap.handle):
        g = sm.graph(a.and_then(a), stream=cap)
        g2 = sm.graph(sm.zip(a, a), stream=cap)
    assert g.launches == 2 and g2.launches == 2
    waits = _waits_seen(drv, monkeypatch)
    g.replay(s).result()
    g2.replay(s).result()
    assert waits == [s.handle, s.handle]


def test_a_captured_composite_whose_first_part_fails_records_nothing_of_the_second(
        fake, kernels, monkeypatch):
    """Captured, a composite op's second part (CuPy arrays: its pack stages the graph's
    replay ordering) is packed before the first is submitted; when the first part's launch
    fails, the second is never recorded -- its staged step is not applied, so replays of the
    graph are not ordered after CuPy's stream for a launch the graph does not hold."""
    dev, drv, saxpy, n, x, y, out, cp, s = _cupy_arrays_and_a_stream(fake, kernels, monkeypatch)
    cap = dev.create_stream("captured")
    refuse = _refused_launches(drv, monkeypatch)
    plain = sm.op(saxpy, 1, 16, 2.0, sm.In(x._block), sm.In(y._block), sm.Out(out._block), n)
    with_cupy = sm.op(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n)
    with cp.cuda.ExternalStream(cap.handle):
        with sm.capture(cap) as g:
            refuse.append(True)
            with pytest.raises(sm.SharedMemError):
                plain.and_then(with_cupy).submit(cap)
            plain.submit(cap)
    assert g.launches == 1
    waits = _waits_seen(drv, monkeypatch)
    g.replay(s).result()
    assert waits == []


def test_a_composite_of_one_cutile_kernel_with_two_signatures_runs_each_part_as_packed(
        fake, tile):
    """One cuTile kernel with two argument signatures in one composite: each part is packed
    (and its signature warmed) before the first is submitted, and each runs with its own
    arguments."""
    from fake_cuda import TileKernel
    dev, drv = fake

    def vadd(a, b, c, k):
        c[:] = a + k * b
    kern = TileKernel(vadd)
    n = 16
    a, a2 = (sm.Tensor.from_host(np.arange(m, dtype=np.float32), device=dev) for m in (n, 2 * n))
    b, b2 = (sm.Tensor.from_host(np.ones(m, np.float32), device=dev) for m in (n, 2 * n))
    c, c2 = (sm.Tensor.zeros((m,), "float32", device=dev) for m in (n, 2 * n))
    s = dev.create_stream("t")
    o1 = sm.op(kern, (2,), None, sm.In(a), sm.In(b), sm.Out(c), 1)
    o2 = sm.op(kern, (2,), None, sm.In(a2), sm.In(b2), sm.Out(c2), 3)
    o1.and_then(o2).and_then(o1).submit(s).result()
    sm.zip(o1, o2, o1).submit(s).result()
    np.testing.assert_array_equal(c.to_host(), np.arange(n) + 1)
    np.testing.assert_array_equal(c2.to_host(), np.arange(2 * n) + 3)


def test_a_launch_is_not_drawn_into_another_librarys_capture(fake, kernels, monkeypatch):
    """CuPy's current stream capturing a graph CuPy started (``begin_capture``: no sharedmem
    capture knows it): a launch of CuPy arrays on another stream, whose wait for that stream
    would draw it into the capture (its kernel recorded there, not run), is refused --
    CaptureError, nothing waited for (not even for torch's stream beside it) or leased, no
    part of a composite op submitted. Once the capture ended, the launch waits and runs. The
    legacy stream while a blocking stream captures: refused too, nothing recorded there."""
    dev, drv, saxpy, n, x, y, out, cp, s = _cupy_arrays_and_a_stream(fake, kernels, monkeypatch)
    theirs = cp.cuda.Stream(non_blocking=True)
    waits = _waits_seen(drv, monkeypatch)
    leased = sm.stats().submitted
    with theirs:
        drv.cuStreamBeginCapture(theirs.ptr, 0)  # (CuPy's own capture)
        with _refused_for_their_capture(theirs):
            sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s)
        assert waits == [] and sm.stats().submitted == leased
        torch = _fake_torch(monkeypatch, dev)  # torch's stream beside, not capturing: not
        t = torch.Tensor(np.zeros(n, np.float32))  # waited for either (every stream asked first)
        with pytest.raises(sm.CaptureError, match=r"is capturing a CUDA graph that sharedmem"):
            sm.launch(saxpy, 1, 16, 2.0, sm.In(t), sm.In(y), sm.Out(out), n, stream=s)
        plain = sm.op(saxpy, 1, 16, 2.0, sm.In(x._block), sm.In(y._block),
                      sm.Out(out._block), n)
        with pytest.raises(sm.CaptureError, match=r"is capturing a CUDA graph that sharedmem"):
            plain.and_then(sm.op(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out),
                                 n)).submit(s)  # (no part submitted)
        assert waits == [] and sm.stats().submitted == leased
        drv.cuStreamEndCapture(theirs.ptr)
        sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s).result()
    assert waits == [s.handle] and sm.stats().submitted == leased + 1
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 1.0))

    # A blocking stream captures and CuPy's current stream is the legacy one (begin_capture
    # without `with`): the driver answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT for the legacy
    # stream, and a record there would fail and invalidate that capture -- refused first
    blocking = cp.cuda.Stream()
    leased = sm.stats().submitted
    drv.cuStreamBeginCapture(blocking.ptr, 0)
    records = len([c for c in drv.calls if c[0] == "record"])
    legacy = (r"^the legacy default stream of cuda:0 \(handle 0x0\) is joined to a capture: a "
              r"blocking stream of its context is capturing a CUDA graph \(sm.capture of a "
              r"borrowed blocking stream, cupy.cuda.Stream.begin_capture, torch.cuda.graph\); "
              r"ordering work after the legacy stream would draw that work into the capture, "
              r"recorded there and not run. Make a non-blocking stream the library's current "
              r"one \(with cupy.cuda.Stream\(non_blocking=True\): ...\), or launch after the "
              r"capture ends$")
    with pytest.raises(sm.CaptureError, match=legacy):
        sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s)
    assert len([c for c in drv.calls if c[0] == "record"]) == records
    drv.cuStreamEndCapture(blocking.ptr)
    with sm.capture(sm.Stream.from_external(blocking.ptr, dev)):  # (sharedmem's capture of a
        with pytest.raises(sm.CaptureError, match=legacy):        # borrowed blocking stream)
            sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s)
    assert len([c for c in drv.calls if c[0] == "record"]) == records + 2  # (the capture's
    # markers of the work before it, on its stream and on the legacy one it joins, recorded
    # as it began: nothing of the launch)
    assert waits == [s.handle] and sm.stats().submitted == leased


def test_a_cai_import_after_a_stream_sharedmem_captures_on_names_that_capture(fake,
                                                                             monkeypatch):
    """A CUDA Array Interface producer naming a stream sharedmem is capturing on: the import,
    ordered after it, would draw its own stream into the capture -- refused, by the stream and
    graph (not as another library's capture)."""
    import sharedmem.device as sm_device
    dev, drv = fake
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)
    b = sm.Buffer.from_host(np.arange(4, dtype="f4"), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    cap, imp = dev.create_stream("cap"), dev.create_stream("imp")

    class Producer:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (b.ptr, False),
                                    "version": 3, "stream": cap.handle}
    with sm.capture(cap):
        with pytest.raises(sm.CaptureError, match=r"^the producer's stream is <Stream cap .*>, "
                                                  r"which is capturing graph #\d+: an import "
                                                  r"ordered after it would draw <Stream imp "):
            sm.from_cuda_array_interface(Producer(), stream=imp)


def test_a_composite_op_under_a_capture_raises_what_its_part_would_raise_first(
        fake, kernels, tile, monkeypatch):
    """A cuTile kernel refuses an array given with_length (KernelError), whatever the capture:
    a composite op's pre-check raises that, not the CaptureError of the CuPy array -- whose
    advice (capture on CuPy's stream) would then capture the first part before the second
    failed."""
    from fake_cuda import TileKernel
    dev, drv = fake
    saxpy, _ = kernels
    n = 16
    x, y, out = _fake_cupy_arrays(monkeypatch, dev, n, 3)
    cp = sys.modules["cupy"]
    for a in (x, out):
        a.dtype = np.dtype(np.float32)
    plain = sm.op(saxpy, 1, 16, 2.0, sm.In(x._block), sm.In(y._block), sm.Out(out._block), n)
    bad = sm.op(TileKernel(lambda a, b: None), (1,), None, sm.In(x, with_length=True),
                sm.Out(out))
    cap = dev.create_stream("cap")
    with sm.capture(cap) as g:
        for current in (None, cap.handle):  # (CuPy's current stream: another, then cap)
            with cp.cuda.ExternalStream(current) if current else contextlib.nullcontext():
                with pytest.raises(sm.KernelError, match=r"^argument 0: with_length=True is "
                                                         r"for CuPy kernels"):
                    plain.and_then(bad).submit(cap)
        assert ": 0 captured" in repr(g)


def test_two_cupy_arrays_whose_addresses_hash_alike_are_both_found_by_the_recent_table(
        fake, kernels, monkeypatch):
    """Compiled, a CuPy array argument's facts are found in a table indexed by a hash of the
    array's address before the dict. Two arrays of one launch that hash alike (objects 4 KiB
    apart) both stay in it, in the two slots of a pair: they evicted each other on every
    launch, so that launch's arrays were all looked up in the dict (about 2,100 instructions
    more a launch, depending on where the heap put the arrays)."""
    import interop.cupy_launch as icl
    from sharedmem.config import compiled
    if not compiled():
        pytest.skip("the recent table is the compiled build's (interpreted, the dict alone)")
    dev, drv = fake
    saxpy, _ = kernels
    n = 16
    gc_collect_harder()  # (arrays of earlier tests: dead, their facts too)
    arrays = _fake_cupy_arrays(monkeypatch, dev, n, 130)  # (130 objects, 64 slots)
    by_slot = {}
    for a in arrays:
        by_slot.setdefault((id(a) >> 6) % 64, []).append(a)
    table = icl.recent_facts()  # (a pair that holds another live array's facts would keep
    x, out = next(v for k, v in by_slot.items() if len(v) > 1 and all(  # one of these out)
        f is None or f.dead for f in (table[k], table[k ^ 1])))[:2]
    for _ in range(2):
        sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(x), sm.Out(out), n).result()
    recent = icl.recent_facts()
    assert icl.learned_facts()[id(x)] in recent and icl.learned_facts()[id(out)] in recent
    i = next(k for k, a in enumerate(arrays) if a is x)  # (x holds i everywhere)
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 3.0 * i))
    sm.synchronize()


def test_a_cupy_array_over_a_read_only_view_is_not_written_by_a_launch(fake, kernels,
                                                                        monkeypatch):
    # cupy.asarray(view) reads the CAI and keeps the view as its memory's owner; the
    # view's read-only flag holds for launches given the array, as for as_cupy's arrays
    dev, drv = fake
    saxpy, _ = kernels
    n = 8
    x, = _fake_cupy_arrays(monkeypatch, dev, n, 1)
    t = sm.Tensor.from_host(np.arange(n, dtype=np.float32), device=dev)
    ro = t.as_readonly()
    cp = sys.modules["cupy"]

    class Unowned:  # cupy.cuda.UnownedMemory(ptr, size, owner)
        def __init__(self, ptr, size, owner):
            self.ptr, self.size, self._owner = ptr, size, owner

    def asarray(view):
        arr = cp.ndarray.__new__(cp.ndarray)
        arr.data = types.SimpleNamespace(ptr=view.ptr, mem=Unowned(view.ptr, view.nbytes, view))
        arr.device = types.SimpleNamespace(id=dev.ordinal)
        arr.size, arr.shape, arr.strides, arr.itemsize = n, (n,), (4,), 4
        return arr
    arr_ro, arr_rw = asarray(ro), asarray(t)
    leased = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^argument 3: Out\(.*\) would write through a "
                                             r"read-only view"):
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(arr_ro), n)
    assert sm.stats().submitted == leased
    sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(arr_ro), sm.Out(arr_rw), n).result()
    np.testing.assert_array_equal(t.to_host(), np.arange(n, dtype=np.float32))  # 0 + t


def _cupy_asarray(monkeypatch, dev, view):
    """A CuPy-style array over sharedmem view ``view``'s memory as ``cupy.asarray(view)``
    makes one (CuPy's memory object names the view as its owner), of type ``cupy.ndarray``
    itself; like CuPy's, its DLPack capsule and CAI say writable (CuPy has no read-only
    arrays) and its capsule's deleter is CuPy's, not ours. ``Device(dev.ordinal)`` is
    ``dev`` meanwhile."""
    import sharedmem.device as sm_device
    from interop import dlpack as dl
    monkeypatch.setitem(sm_device._devices, ("cuda", dev.ordinal), dev)
    cp = sys.modules["cupy"]

    class Unowned:  # cupy.cuda.UnownedMemory(ptr, size, owner)
        def __init__(self, ptr, size, owner):
            self.ptr, self.size, self._owner = ptr, size, owner

    class ndarray(cp.ndarray):
        __module__, __qualname__ = "cupy", "ndarray"  # (as sm.adopt names a CuPy array)

        def __init__(self, v):
            n = v.nbytes // v.dtype.itemsize
            self.data = types.SimpleNamespace(ptr=v.ptr, mem=Unowned(v.ptr, v.nbytes, v))
            self.device = types.SimpleNamespace(id=dev.ordinal)
            self.base, self.dtype, self.size, self.shape = None, v.dtype, n, (n,)
            self.strides, self.itemsize = (v.dtype.itemsize,), v.dtype.itemsize
            self._dims = (ctypes.c_int64 * 1)(n)
            self._managed = []

        @property
        def __cuda_array_interface__(self):
            return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                    "data": (self.data.ptr, False), "strides": None}

        def __dlpack_device__(self):
            return (dl.kDLCUDA, dev.ordinal)

        def __dlpack__(self, stream=None, max_version=None):
            m = dl.DLManagedTensorVersioned()
            m.version.major = 1
            m.deleter = dl._DELETER()  # (CuPy's: not ours)
            d = m.dl_tensor
            d.data, d.device.device_type, d.device.device_id = self.data.ptr, dl.kDLCUDA, dev.ordinal
            d.ndim, d.dtype.code, d.dtype.bits, d.dtype.lanes = 1, dl.kDLFloat, 32, 1
            d.shape = ctypes.cast(self._dims, ctypes.POINTER(ctypes.c_int64))
            self._managed.append(m)
            return dl._capsule_new(ctypes.addressof(m), b"dltensor_versioned",
                                   dl._CAPSULE_DESTRUCTOR())

    cp.ndarray = ndarray
    alloc = view.allocation  # (the driver knows the pool block, as a CAI import asks it)
    monkeypatch.setitem(sys.modules["sharedmem.backends.cuda"].cu.ranges, alloc.ptr,
                        alloc.nbytes)
    return ndarray(view)


def test_imports_of_a_cupy_array_over_a_read_only_view_are_read_only(fake, monkeypatch):
    """``cupy.asarray(ro)`` of a read-only view gives a normal CuPy array (CuPy has none
    read-only); a launch refuses it as Out (above), but ``wrap`` of it, and its DLPack and CAI
    imports, were writable Tensors -- launches wrote through them into bytes only read-only
    views reach. Read-only now, whichever way it comes in, and a second import too (the
    first one's producer alias is read-only as well); writable where a writable view reaches
    the bytes."""
    import interop.cupy as ic
    from interop.cupy_launch import array_facts
    dev, drv = fake
    t = sm.Tensor.from_host(np.arange(8, dtype=np.float32), device=dev)
    ro = t.as_readonly()
    arr = _cupy_asarray(monkeypatch, dev, ro)
    assert not array_facts(arr).token.writable  # (a launch's view of it)
    w = ic.wrap(arr)  # the array is over ro, as a launch takes it
    assert w.allocation is t.allocation and w.readonly
    w.release()
    for imp in (sm.from_dlpack(arr), sm.from_cuda_array_interface(arr)):
        assert imp.allocation is t.allocation and not imp.readonly  # t still writes them
        imp.release()
        del imp
    t.release()
    sm.synchronize()
    gc_collect_harder()
    for _ in range(2):
        for imp in (ic.wrap(arr), sm.from_dlpack(arr), sm.from_cuda_array_interface(arr)):
            assert imp.allocation is ro.allocation and imp.readonly, imp
            with imp.as_buffer() as b, pytest.raises(sm.ReadOnlyError):
                b.fill_zero()
    np.testing.assert_array_equal(ro.to_host(), np.arange(8, dtype=np.float32))


def test_adopting_a_cupy_array_over_memory_sharedmem_views_reach_is_refused(fake, monkeypatch):
    """``interop.cupy.adopt`` and ``sm.adopt`` take an array's memory over: refused while
    other live views reach it (DESIGN.md: adopting succeeds only when no other live view of
    those bytes exists, and says which do). ``cupy.asarray(buf)`` is such an array: adopted
    while ``buf`` lived -- the Tensor could not be moved (AliasError naming buf), and the
    allocation of sharedmem's own memory was relabelled "cupy (adopted)". Now AliasError
    naming ``buf``, nothing imported; once buf is released, the adoption goes through."""
    import interop.cupy as ic
    dev, drv = fake
    buf = sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=dev)
    alloc = buf.allocation
    for adopt, what in ((ic.adopt, "CuPy array"), (sm.adopt, r"cupy\.ndarray")):
        arr = _cupy_asarray(monkeypatch, dev, buf)
        with pytest.raises(sm.AliasError, match=(
                rf"^cannot adopt {what} \(shape \(8,\), float32\): 1 other live view of its "
                rf"bytes exists:\n  - buffer, bytes \[0, 32\) of allocation #{alloc.id}\n")) as e:
            adopt(arr)
        assert len(e.value.views) == 1
        del e
        assert alloc.source == "sharedmem" and alloc.live_views == 1
    buf.release()
    sm.synchronize()
    gc_collect_harder()
    t = ic.adopt(arr)
    assert t.allocation is alloc and t.into_buffer().ptr == arr.data.ptr
    assert alloc.source == "sharedmem"  # (sharedmem's memory still: not relabelled)


def test_integer_scalars_are_range_checked_whatever_their_type(fake, kernels):
    dev, drv = fake
    saxpy, scale_len = kernels
    n = 8
    x = sm.Buffer.from_host(np.arange(n, dtype=np.float32), device=dev)
    out = sm.Buffer.empty(n, "float32", device=dev)
    for count in (n, np.int32(n), np.int64(n), np.uint8(n), np.uint64(n), np.int16(n)):
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(out), count).result()
        np.testing.assert_array_equal(out.to_host(), 2 * np.arange(n, dtype=np.float32))
    for bad in (np.int64(1 << 31), np.uint64(1 << 40), -(1 << 31) - 1):
        with pytest.raises(sm.KernelError, match=r"^argument 4: -?\d+ does not fit parameter 'n' \(int\), "
                                                 r"which takes -2147483648\.\.2147483647$"):
            sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(out), bad)
    with pytest.raises(sm.KernelError, match=r"^argument 4: parameter 'n' \(int\) takes an int, got float 8\.0"):
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(out), 8.0)
    # a long long parameter takes a NumPy int64 and a bool; its range ends at 2**63
    sm.launch(scale_len, 1, 8, sm.InOut(x), np.int64(0), 1.0).result()
    sm.launch(scale_len, 1, 8, sm.InOut(x), True, 1.0).result()
    with pytest.raises(sm.KernelError, match=r"does not fit parameter 'n' \(long long\), which takes "
                                             r"-9223372036854775808\.\.9223372036854775807$"):
        sm.launch(scale_len, 1, 8, sm.InOut(x), 1 << 63, 1.0)


def test_a_plain_char_takes_a_byte_either_way(fake):
    """Plain ``char`` is signed or unsigned as the compiler chooses: it takes -128..255, as
    its byte in two's complement (200 and -56 are one byte); ``signed char`` takes -128..127
    and ``unsigned char`` 0..255. Out of range, the error names the range."""
    from fake_cuda import RawKernel
    dev, drv = fake
    got = []
    code = """extern "C" __global__ void bytes(char c, signed char s, unsigned char u) { }"""
    kern = RawKernel(drv, "bytes", ["B", "B", "B"], lambda c, s, u: got.append((c, s, u)), code)
    st = dev.create_stream("bytes")
    sm.launch(kern, 1, 1, 200, -56, 200, stream=st).result()
    sm.launch(kern, 1, 1, -56, np.int8(-1), np.uint8(255), stream=st).result()
    sm.launch(kern, 1, 1, np.uint8(255), -128, 0, stream=st).result()
    assert got == [(200, 200, 200), (200, 255, 255), (255, 128, 0)]
    for args, msg in (((256, 0, 0), "argument 0: 256 does not fit parameter 'c' (char), "
                                    "which takes -128..255"),
                      ((-129, 0, 0), "argument 0: -129 does not fit parameter 'c' (char), "
                                     "which takes -128..255"),
                      ((0, 200, 0), "argument 1: 200 does not fit parameter 's' (signed char), "
                                    "which takes -128..127"),
                      ((0, 0, -56), "argument 2: -56 does not fit parameter 'u' "
                                    "(unsigned char), which takes 0..255")):
        with pytest.raises(sm.KernelError, match="^" + re.escape(msg) + "$"):
            sm.launch(kern, 1, 1, *args, stream=st)


def test_cupy_array_arguments_are_their_facts_and_kept_alive_by_the_work(fake, kernels,
                                                                          monkeypatch):
    """A CuPy array argument reaches the plan as its facts (one object for every launch that
    passes that array: nothing made per launch), and the work keeps the array itself -- the
    facts do not -- until the device has passed it, when nothing keeps it any more. With
    ``with_length`` it still packs a pointer and a length; in a scalar slot it is refused
    by name, and nothing is leased."""
    import interop.cupy_launch as icl
    from sharedmem.launch import ForeignArray, adapter_for, resolve_args
    dev, drv = fake
    saxpy, scale_len = kernels
    n = 16
    x, y, out = _fake_cupy_arrays(monkeypatch, dev, n, 3)
    adapter = adapter_for(saxpy)
    args = (2.0, sm.In(x), sm.In(y), sm.Out(out), n)
    first = resolve_args(adapter, args, None)
    again = resolve_args(adapter, args, None)
    fx = icl.learned_facts()[id(x)]
    assert type(fx) is icl.ArrayFacts and isinstance(fx, ForeignArray)
    assert first[0][1] is fx and again[0][1] is fx and first[0][3] is icl.learned_facts()[id(out)]
    assert [u[1] for u in first[1]] == [False, False, True]
    assert first[3][1:] == [x, y, out] and first[2] is dev
    del first, again, args

    drv.holding = True  # from here on, the work stays in flight
    gone = weakref.ref(out)
    fut = sm.launch(saxpy, 1, 16, 3.0, sm.In(x), sm.In(y), sm.Out(out), n)
    facts = icl.learned_facts()[id(out)]
    del out
    gc_collect_harder()
    assert gone() is not None and not facts.dead and not fut.done()  # kept by the work alone
    drv.holding = False
    drv.finish_held()
    fut.result()
    sm.synchronize()
    gc_collect_harder()
    assert gone() is None and facts.dead

    x_dev = x._block.to_host()
    sm.launch(scale_len, 1, 16, sm.InOut(x, with_length=True), 2.0).result()
    np.testing.assert_array_equal(x._block.to_host(), 2 * x_dev)
    leased = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^argument 4: parameter 'n' \(int\) is not a "
                                             r"pointer, got a CuPy array$"):
        sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(y), sm.Out(y), sm.In(x))
    assert sm.stats().submitted == leased


class _Producer:
    """A DLPack producer on a CUDA device other than CuPy (a torch tensor, a JAX array): it
    hands out the memory of a sharedmem view as ``torch.from_dlpack(view)`` would, and
    counts the ``stream`` each export was asked to order its work before."""

    def __init__(self, view):
        self.view, self.streams = view, []

    def __dlpack_device__(self):
        return self.view.__dlpack_device__()

    def __dlpack__(self, stream=None, max_version=None, **kw):
        self.streams.append(stream)
        return self.view.__dlpack__(stream=stream, max_version=max_version)


def test_a_dlpack_producer_argument_of_a_cupy_kernel_is_imported_for_the_launch(fake, kernels,
                                                                              monkeypatch):
    """A torch tensor or JAX array passed to a CuPy kernel (as to a cuTile kernel) is imported
    for the launch: the producer is asked to order its pending work before the import, the
    import is ordered with sharedmem's own work on those bytes, the kernel writes the memory,
    and nothing of the import outlives the work. A refused launch leaves no import behind; a
    read-only export is refused as Out; a NumPy array (on the host) is not imported."""
    import sharedmem.device as sm_device
    dev, drv = fake
    monkeypatch.setitem(sm_device._devices, ("cuda", dev.ordinal), dev)  # (Device(0) is dev)
    saxpy, scale_len = kernels
    n = 8
    t = sm.Tensor.from_host(np.arange(n, dtype=np.float32), device=dev)
    x = _Producer(t[:])
    s = dev.create_stream("s")
    sm.launch(saxpy, 1, 8, 2.0, sm.In(x), x, sm.Out(x), n, stream=s).result()
    assert x.streams == [1, 1, 1]  # (the default stream: the import is recorded there)
    np.testing.assert_array_equal(t.to_host(), 3 * np.arange(n))
    sm.launch(scale_len, 1, 8, sm.InOut(x, with_length=True), 2.0, stream=s).result()
    np.testing.assert_array_equal(t.to_host(), 6 * np.arange(n))
    sm.synchronize()
    gc_collect_harder()
    views = t._token.allocation.live_views
    assert views == 2  # t and the producer's own view: no import left
    with pytest.raises(sm.KernelError, match=r"^argument 4: parameter 'n' \(int\) is not a "
                                             r"pointer, got an array \(Tensor\)$"):
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(x), sm.In(x), stream=s)
    ro = _Producer(t.as_readonly())
    with pytest.raises(sm.KernelError, match=r"^argument 3: Out\(.*\) would write through a "
                                             r"read-only view"):
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(ro), n, stream=s)
    with pytest.raises(sm.KernelError, match=r"^argument 1: In\(\) takes a Buffer, Tensor, "
                                             r"DeviceBox or array, got numpy.ndarray( on cpu)? "
                                             r"\(dtype float32\)$"):
        sm.launch(saxpy, 1, 8, 1.0, sm.In(np.zeros(n, np.float32)), x, x, n, stream=s)
    sm.synchronize()
    gc_collect_harder()  # (the imports' own arrivals were recorded; nothing else is left)
    assert t._token.allocation.live_views == views + 1 and sm.stats().in_flight == 0


def _fake_torch(monkeypatch, dev, raw_stream=True):
    """A module standing in for torch (``sys.modules["torch"]``) whose ``Tensor`` is a CUDA
    tensor of ``dev`` over a NumPy array's memory (the fake driver's device memory is host
    memory): ``data_ptr``, ``shape``, ``stride`` (elements), ``untyped_storage``, and
    ``set_`` to another array, as torch's in-place change of a tensor's memory. Its current
    stream (``torch.cuda.current_stream``; ``raw_stream``: also its handle through
    ``torch._C._cuda_getCurrentRawStream``, as torch has it) is ``torch.current``: the legacy
    default stream until a test sets another."""
    import sharedmem.device as sm_device
    monkeypatch.setitem(sm_device._devices, ("cuda", dev.ordinal), dev)

    class Tensor:
        is_cuda = True
        device = types.SimpleNamespace(type="cuda", index=dev.ordinal)
        conj_bit = neg_bit = False  # (torch's lazy conjugation and negation: a view's flags)

        def __init__(self, host, base=None):
            self.set_(host, base)

        def set_(self, host, base=None):
            self.host, self.base = host, host if base is None else base
            self.shape, self.dtype = host.shape, f"torch.{host.dtype}"

        def data_ptr(self):
            return self.host.ctypes.data

        def stride(self):
            return tuple(st // self.host.itemsize for st in self.host.strides)

        def element_size(self):
            return self.host.itemsize

        def numel(self):
            return self.host.size

        def size(self):  # (torch: a method, the shape)
            return self.shape

        def is_contiguous(self):
            return self.host.flags.c_contiguous

        def untyped_storage(self):  # (one object a storage, here: it is what is kept alive)
            return _Storage.of(self.base)

        def is_conj(self):
            return self.conj_bit

        def is_neg(self):
            return self.neg_bit

        def _is_zerotensor(self):
            return False

    class _Storage:
        made = weakref.WeakValueDictionary()

        @classmethod
        def of(cls, base):
            st = cls.made.get(id(base))
            if st is None or st.base is not base:
                st = cls.made[id(base)] = cls()
                st.base = base
            return st

        def data_ptr(self):
            return self.base.ctypes.data

        def nbytes(self):
            return self.base.nbytes

    torch = types.ModuleType("torch")
    torch.Tensor = Tensor
    torch.current = types.SimpleNamespace(cuda_stream=0, device=Tensor.device)
    torch.cuda = types.SimpleNamespace(current_stream=lambda index=None: torch.current,
                                       is_initialized=lambda: True)
    if raw_stream:
        torch._C = types.SimpleNamespace(
            _cuda_getCurrentRawStream=lambda index: torch.current.cuda_stream)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def _refused_launches(drv, monkeypatch) -> list:
    """A list whose entries each make the driver refuse the next ``cuLaunchKernel``
    (CUDA_ERROR_INVALID_VALUE), one entry a launch."""
    real = drv.cuLaunchKernel
    refuse = []

    def launch(*args):
        if refuse:
            refuse.pop()
            from fake_cuda import CUresult
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return real(*args)
    monkeypatch.setattr(drv, "cuLaunchKernel", launch)
    return refuse


def _waits_seen(drv, monkeypatch) -> list:
    """The stream of every ``cuStreamWaitEvent`` from now on, in order."""
    waits = []
    real_wait = drv.cuStreamWaitEvent

    def wait(stream, ev, flags):
        waits.append(int(stream))
        return real_wait(stream, ev, flags)
    monkeypatch.setattr(drv, "cuStreamWaitEvent", wait)
    return waits


def test_torch_tensor_arguments_are_leased_as_cupy_arrays_are_and_ordered_after_torch(
        fake, kernels, monkeypatch):
    """A CUDA torch tensor given to a CuPy kernel is leased over its bytes (a foreign
    allocation over its storage) with facts learned on its first launch and found again, and
    the launch is ordered after torch's current stream (one wait a launch, none where that is
    the launch's stream). torch can change a tensor's memory in place (``set_``): the next
    launch learns it anew and writes the new memory. The work keeps the tensor alive.
    ``with_length`` packs its element count; a scalar slot refuses it by name; a CPU tensor
    is refused; a refused launch leases nothing and waits for nothing."""
    import interop.cupy_launch as icl
    dev, drv = fake
    saxpy, scale_len = kernels
    torch = _fake_torch(monkeypatch, dev)
    Tensor = torch.Tensor
    n = 16
    storage = np.zeros(3 * n, np.float32)  # one storage, three tensors over parts of it
    x, y, out = (Tensor(storage[k * n:(k + 1) * n], storage) for k in range(3))
    x.host[:], y.host[:] = np.arange(n), 10
    s = dev.create_stream("s")
    waits = _waits_seen(drv, monkeypatch)
    asked = []  # (the driver asked where a tensor's memory lies: once, by the first tensor)
    real_attributes = drv.cuPointerGetAttributes
    monkeypatch.setattr(drv, "cuPointerGetAttributes",
                        lambda *a: asked.append(a[-1]) or real_attributes(*a))
    sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), out, n, stream=s).result()
    np.testing.assert_array_equal(out.host, 2 * np.arange(n) + 10)
    assert waits == [s.handle]  # ordered after torch's stream (the legacy default stream)
    assert asked == [x.data_ptr()]  # (y and out: in the allocation x's facts hold)
    facts = icl.learned_facts()[id(out)]
    alloc = facts.token.allocation
    assert (alloc.ptr, alloc.nbytes, alloc.source) == (storage.ctypes.data, storage.nbytes, "torch")
    assert (facts.token.start, facts.token.stop, facts.token.writable) == (8 * n, 12 * n, True)
    assert icl.learned_facts()[id(x)].token.allocation is alloc  # (one storage: one allocation)
    torch.current = types.SimpleNamespace(cuda_stream=s.handle, device=Tensor.device)
    sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s).result()
    assert icl.learned_facts()[id(out)] is facts and facts.layout == ((n,), (1,), "torch.float32")
    assert waits == [s.handle]  # torch's current stream is s: no wait

    other = np.zeros(n, np.float32)
    out.set_(other)  # torch's in-place change of memory: learned anew, the new memory written
    sm.launch(saxpy, 1, 16, 3.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s).result()
    assert icl.learned_facts()[id(out)] is not facts and icl.learned_facts()[id(out)].offset == 0
    np.testing.assert_array_equal(other, 3 * np.arange(n) + 10)

    drv.holding = True  # the work keeps the tensor and the storage it used, not the facts
    gone = weakref.ref(out)
    fut = sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s)
    used = weakref.ref(out.untyped_storage())
    out.set_(np.zeros(n, np.float32))  # torch swaps the storage under the running kernel
    assert used() is not None  # (kept: torch cannot free it, nor hand its address out)
    del out, other
    gc_collect_harder()
    assert gone() is not None and used() is not None and not fut.done()
    drv.holding = False
    drv.finish_held()
    fut.result()
    sm.synchronize()
    gc_collect_harder()
    assert gone() is None and used() is None

    doubles = np.zeros(n, np.float64)  # `t.data = ...` of another dtype at the same address,
    t = Tensor(doubles.view(np.float32)[:n], doubles)  # shape and element strides: its
    sm.launch(saxpy, 1, 16, 1.0, sm.In(t), sm.In(t), sm.Out(y), n, stream=s).result()
    assert icl.torch_facts(t).token.stop - icl.torch_facts(t).token.start == 4 * n
    t.set_(doubles)  # 8-byte elements now: learned anew, all 8n bytes leased
    assert icl.torch_facts(t).token.stop - icl.torch_facts(t).token.start == 8 * n

    sm.launch(scale_len, 1, 16, sm.InOut(x, with_length=True), 2.0, stream=s).result()
    np.testing.assert_array_equal(x.host, 2 * np.arange(n))
    torch.current = types.SimpleNamespace(cuda_stream=0, device=Tensor.device)
    leased, waited = sm.stats().submitted, len(waits)
    with pytest.raises(sm.KernelError, match=r"^argument 4: parameter 'n' \(int\) is not a "
                                             r"pointer, got a torch tensor$"):
        sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(y), sm.Out(y), sm.In(x), stream=s)
    cpu = Tensor(np.zeros(n, np.float32))
    cpu.is_cuda = False
    with pytest.raises(sm.KernelError, match=r"^argument 3: Out\(\) takes a Buffer, Tensor, "
                                             r"DeviceBox or array, got "):
        sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(y), sm.Out(cpu), n, stream=s)
    assert sm.stats().submitted == leased and len(waits) == waited
    cap = dev.create_stream("captured")
    with sm.capture(cap):  # a capture cannot wait for torch's stream: said so, nothing leased
        with pytest.raises(sm.CaptureError, match=r"is capturing a graph, and a launch with torch "
                                                  r"tensors among its arguments is ordered after "
                                                  r"torch's current stream of <Device cuda:0 .*> "
                                                  r"\(handle 0x0\), which a capture cannot wait "
                                                  r"for; capture on torch's current stream"):
            sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(y), sm.Out(y), n, stream=cap)
        # torch's current stream captured (as that error advises), a launch on another
        # stream: a wait for it would draw that stream into the capture -- refused, no wait
        torch.current = types.SimpleNamespace(cuda_stream=cap.handle, device=Tensor.device)
        with pytest.raises(sm.CaptureError, match=r"^torch's current stream of <Device cuda:0 "
                                                  r".*> is <Stream .*captured.*>, which is "
                                                  r"capturing graph #\d+, and a launch with "
                                                  r"torch tensors among its arguments on "
                                                  r"<Stream s on .*> is ordered after it -- "
                                                  r"which would draw"):
            sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(y), sm.Out(y), n, stream=s)
    assert sm.stats().submitted == leased and len(waits) == waited


def test_a_torch_tensor_whose_layout_changes_at_the_same_pointer_is_learned_anew(
        fake, kernels, monkeypatch):
    """A torch tensor's facts serve while its data pointer, shape, strides and dtype are those
    they were learned from: ``resize_`` or ``as_strided_`` keep the pointer and change the
    layout, and the next launch leases the bytes the new layout reaches -- fewer, or more.
    Compiled, a known tensor's facts are found in the recent-lookup table, as a CuPy array's."""
    import interop.cupy_launch as icl
    from sharedmem.config import compiled
    dev, drv = fake
    saxpy, _ = kernels
    torch = _fake_torch(monkeypatch, dev)
    n = 16
    storage = np.zeros(4 * n, np.float32)
    x = torch.Tensor(np.arange(n, dtype=np.float32))
    t = torch.Tensor(storage[:n], storage)
    s = dev.create_stream("s")
    torch.current = types.SimpleNamespace(cuda_stream=s.handle, device=torch.Tensor.device)
    sm.launch(saxpy, 1, 16, 1.0, sm.In(x), sm.In(x), sm.Out(t), n, stream=s).result()
    facts = icl.torch_facts(t)
    assert (facts.token.start, facts.token.stop) == (0, 4 * n)
    assert icl.torch_facts(t) is facts  # (found again: nothing changed)
    if compiled():
        assert facts in icl.recent_facts()
    t.set_(storage[:n // 2], storage)  # a smaller shape at the same pointer (resize_)
    smaller = icl.torch_facts(t)
    assert smaller is not facts and facts.dead  # (the old facts no longer found, anywhere)
    assert icl.torch_facts(t) is smaller  # (the new ones found again: not learned each time)
    assert (smaller.token.start, smaller.token.stop) == (0, 2 * n)
    t.set_(storage[:2 * n:2], storage)  # the same shape and pointer, strides of 2 (as_strided_)
    strided = icl.torch_facts(t)
    assert strided.layout == ((n,), (2,), "torch.float32")
    assert (strided.token.start, strided.token.stop) == (0, 4 * (2 * n - 1))
    t.set_(storage[:4 * n:4], storage)  # strides of 4: the lease reaches further
    assert (icl.torch_facts(t).token.start, icl.torch_facts(t).token.stop) == (0, 4 * (4 * n - 3))
    sm.synchronize()


def test_a_torch_tensors_stale_facts_leave_the_recent_table_and_free_its_old_allocation(
        fake, kernels, monkeypatch):
    """A torch tensor set_ to other memory and asked again: its old facts are dead and in no
    table (compiled: not left in the recent-lookup pair's other slot), so the allocation they
    named is not kept alive (registered) until the tensor dies."""
    import interop.cupy_launch as icl
    dev, drv = fake
    torch = _fake_torch(monkeypatch, dev)
    n = 16
    home = lambda o: (id(o) >> 6) % 64  # noqa: E731  (the table's slot of an address)
    st1, st2, st3 = (np.zeros(n, np.float32) for _ in range(3))
    t = torch.Tensor(st1)
    pool = [torch.Tensor(st3) for _ in range(2000)]
    g = next(o for o in pool if home(o) == home(t))
    del pool
    icl.torch_facts(g)  # (g takes t's slot; t's facts then go to the pair's other one)
    old = icl.torch_facts(t)
    alloc = weakref.ref(old.token.allocation)
    del g
    gc_collect_harder()  # (g's callback empties its slot)
    t.set_(st2)
    new = icl.torch_facts(t)
    assert new is not old and old.dead and old not in icl.recent_facts()
    assert old not in icl.learned_facts().values()
    del old, new
    sm.synchronize()
    gc_collect_harder()
    assert alloc() is None


def test_foreign_array_lease_tokens_name_no_origin(fake, kernels, monkeypatch):
    """A CuPy array's or torch tensor's lease token names no place it was created, also with
    TRACK_ORIGINS (as ViewToken(...) made it: the place would be the first launch's)."""
    import interop.cupy_launch as icl
    import sharedmem.allocation as sm_allocation
    dev, drv = fake
    monkeypatch.setattr(sm_allocation, "TRACK_ORIGINS", True)
    torch = _fake_torch(monkeypatch, dev)
    x, = _fake_cupy_arrays(monkeypatch, dev, 16, 1)
    t = torch.Tensor(np.zeros(16, np.float32))
    assert icl.array_facts(x).token.origin is None and icl.torch_facts(t).token.origin is None
    sm.synchronize()


def test_foreign_array_facts_against_a_model_of_the_live_arrays(fake, kernels, monkeypatch):
    """A hypothesis state machine over the facts launches keep of foreign arrays (the dict, and
    compiled the recent-lookup table): CuPy arrays and torch tensors made, dropped (their
    addresses reused by later objects), torch tensors set_ to other memory and layouts, and
    looked up. The model is the live arrays themselves: every lookup's facts are the array's
    own (its weak reference, its address, not dead), a torch tensor's are its present pointer
    and layout with a lease of exactly the bytes it reaches, and a second lookup finds the same
    facts (not learned again)."""
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

    import interop.cupy_launch as icl
    from sharedmem.tensor import extent
    dev, drv = fake
    torch = _fake_torch(monkeypatch, dev)
    n = 16
    CupyArray = type(_fake_cupy_arrays(monkeypatch, dev, n, 1)[0])
    storages = [np.zeros(8 * n, np.float32) for _ in range(3)]

    class Facts(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.live = []

        @rule(which=st.integers(0, 2), size=st.integers(1, n), torch_tensor=st.booleans())
        def make(self, which, size, torch_tensor):
            st_ = storages[which]
            self.live.append(torch.Tensor(st_[:size], st_) if torch_tensor else
                             CupyArray(np.zeros(n, np.float32)))

        @rule(i=st.integers(0, 1 << 16), collect=st.booleans())
        def drop(self, i, collect):
            if self.live:
                del self.live[i % len(self.live)]
                if collect:
                    gc.collect()

        @rule(i=st.integers(0, 1 << 16), which=st.integers(0, 2), step=st.integers(1, 4),
              size=st.integers(1, n))
        def set_(self, i, which, step, size):  # (a CuPy array's memory and layout are fixed)
            if self.live and isinstance(self.live[i % len(self.live)], torch.Tensor):
                st_ = storages[which]
                self.live[i % len(self.live)].set_(st_[:step * size:step], st_)

        @rule(i=st.integers(0, 1 << 16))
        def look_up(self, i):
            if not self.live:
                return
            o = self.live[i % len(self.live)]
            if isinstance(o, torch.Tensor):
                f = icl.torch_facts(o)
                assert (f.ptr, f.layout) == (o.data_ptr(), (o.shape, o.stride(), o.dtype))
                lo, hi = extent(o.shape, [s * 4 for s in o.stride()], 4)
                base = f.token.allocation.ptr
                assert (base + f.token.start, base + f.token.stop) == (o.data_ptr() + lo,
                                                                       o.data_ptr() + hi)
                again = icl.torch_facts(o)
            else:
                f = icl.array_facts(o)
                again = icl.array_facts(o)
            assert f.ref() is o and f.addr == id(o) and not f.dead and again is f

    run_state_machine_as_test(Facts, settings=settings(
        max_examples=40, stateful_step_count=60, deadline=None,
        suppress_health_check=list(HealthCheck)))
    gc_collect_harder()
    sm.synchronize()


def test_torch_facts_stay_right_while_another_thread_sets_the_tensors(fake, kernels,
                                                                      monkeypatch):
    """Threads looking torch tensors' and CuPy arrays' facts up while another thread set_s the
    tensors: every lookup gives the object's own facts, and once the setter stops each
    tensor's facts are its present pointer and layout, found again."""
    import interop.cupy_launch as icl
    dev, drv = fake
    torch = _fake_torch(monkeypatch, dev)
    n = 16
    arrays = _fake_cupy_arrays(monkeypatch, dev, n, 4)
    storage = np.zeros(8 * n, np.float32)
    tensors = [torch.Tensor(storage[:n], storage) for _ in range(4)]
    stop = threading.Event()
    errors = []

    def look_up():
        try:
            while not stop.is_set():
                for t in tensors:
                    assert icl.torch_facts(t).ref() is t
                for a in arrays:
                    assert icl.array_facts(a).ref() is a
        except BaseException as e:  # (reported below)
            errors.append(e)

    def set_tensors():
        k = 0
        while not stop.is_set():
            k += 1
            step = 1 + k % 4
            tensors[k % 4].set_(storage[:step * (1 + k % n):step], storage)

    run_threads([threading.Thread(target=look_up) for _ in range(3)] +
                [threading.Thread(target=set_tensors)], stop, 0.5)
    assert not errors, errors[:3]
    for t in tensors:
        f = icl.torch_facts(t)
        assert (f.ptr, f.layout) == (t.data_ptr(), (t.shape, t.stride(), t.dtype))
        assert icl.torch_facts(t) is f
    sm.synchronize()


def test_two_threads_forgetting_a_set_tensors_facts_at_once_both_learn_it_anew(
        fake, kernels, monkeypatch):
    """Two threads that find a tensor's facts stale at once (it was ``set_``) both forget
    them: the second finds them gone from the table already -- not a KeyError (interpreted,
    a thread switch between the lookup and the removal did that, the race behind
    ``test_torch_facts_stay_right_while_another_thread_sets_the_tensors`` failing now and
    then). Here the table's lookups and removals meet at a barrier, so both threads are in
    that window. Interpreted only: compiled, the table is a C dict, its lookup and removal C
    calls between which no other thread runs."""
    import interop.cupy_launch as icl
    from sharedmem.config import compiled
    if compiled():
        pytest.skip("compiled: the table's lookup and removal have no thread switch between")
    dev, drv = fake
    torch = _fake_torch(monkeypatch, dev)
    storage = np.zeros(64, np.float32)
    t = torch.Tensor(storage[:16], storage)
    old = icl.torch_facts(t)
    t.set_(storage[:32:2], storage)
    meet = threading.Barrier(2, timeout=5)
    removed = [threading.Event(), threading.Event()]
    armed = [id(t)]  # (the key whose lookups meet; None once the threads are done)

    class Met(dict):  # (each thread finds the facts with the other; both remove them, in
        def get(self, key, default=None):  # turn, before either learns the tensor anew)
            if key == armed[0]:
                meet.wait()
            return dict.get(self, key, default)

        def __delitem__(self, key):
            if armed[0] is None:
                return dict.__delitem__(self, key)
            turn = meet.wait()
            if turn:
                removed[0].wait(5)
            try:
                dict.__delitem__(self, key)
            finally:
                removed[turn].set()
                removed[1].wait(5)
    table = icl.learned_facts()
    monkeypatch.setattr(icl, "_facts", Met(table))
    got, errors = [], []

    def look_up():
        try:
            got.append(icl.torch_facts(t))
        except BaseException as e:  # (reported below)
            errors.append(e)
    try:
        threads = [threading.Thread(target=look_up) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        assert not errors, errors
        assert old.dead and len(got) == 2
        for f in got:
            assert f.ref() is t and (f.ptr, f.layout) == (t.data_ptr(), (t.shape, t.stride(),
                                                                          t.dtype))
        sm.synchronize()
    finally:  # (the stand-in's entries become the table's: forgotten ones, t's old facts
        # among them, must not stay there -- each array's entry goes with it)
        armed[0] = None
        met = icl.learned_facts()
        del t, old, got
        gc_collect_harder()
        table.clear()
        table.update(met)
    assert all(f.ref() is not None for f in table.values())


def test_a_torch_tensor_over_sharedmem_memory_is_that_allocation_and_its_read_only_view_stays_so(
        fake, kernels, monkeypatch):
    """A torch tensor over sharedmem memory (``torch.from_dlpack`` of a view) is a lease of
    that allocation, so its launches are ordered with the view's own work; over memory that
    only read-only views reach, a launch that would write it is refused."""
    from fake_cuda import array_at
    import interop.cupy_launch as icl
    dev, drv = fake
    saxpy, _ = kernels
    Tensor = _fake_torch(monkeypatch, dev).Tensor
    n = 8
    t = sm.Tensor.from_host(np.arange(n, dtype=np.float32), device=dev)
    over = Tensor(array_at(t.ptr, n, np.float32))
    sm.launch(saxpy, 1, 8, 2.0, sm.In(over), sm.In(over), sm.Out(over), n).result()
    assert icl.learned_facts()[id(over)].token.allocation is t._token.allocation
    np.testing.assert_array_equal(t.to_host(), 3 * np.arange(n))  # 2x + x
    ro = sm.Tensor.from_host(np.arange(n, dtype=np.float32), device=dev).as_readonly()
    over_ro = Tensor(array_at(ro.ptr, n, np.float32))
    leased = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^argument 3: Out\(.*\) would write through a "
                                             r"read-only view"):
        sm.launch(saxpy, 1, 8, 1.0, sm.In(over), sm.In(over), sm.Out(over_ro), n)
    assert sm.stats().submitted == leased
    sm.launch(saxpy, 1, 8, 1.0, sm.In(over_ro), sm.In(over), sm.Out(over), n).result()
    np.testing.assert_array_equal(t.to_host(), np.arange(n) + 3 * np.arange(n))
    sm.synchronize()


def test_an_adapter_on_prepare_gets_cupy_arrays_themselves_and_launch_records_are_refused(
        fake, kernels, monkeypatch):
    """A CuPy adapter subclass on the ``prepare`` interface still sees each CuPy array as a
    LaunchArg whose value is the array (array_args finds it through the facts' weak
    reference). What a launch makes of an array -- its facts, a LaunchArg -- passed as an
    argument itself is refused, naming the argument, and nothing is leased."""
    import interop.cupy as ic
    import interop.cupy_launch as icl
    from sharedmem.launch import LaunchArg
    L = sys.modules["sharedmem.launch"]  # (sm.launch is the function)
    dev, drv = fake
    saxpy, _ = kernels
    n = 16
    x, y, out = _fake_cupy_arrays(monkeypatch, dev, n, 3)
    seen = []

    class Mine:
        __name__ = "mine"

    class OnPrepare(ic.RawKernelAdapter):
        name = "mine"

        def plan(self, kernel, device):
            return sm.KernelAdapter.plan(self, kernel, device)

        def prepare(self, kernel, grid, block, args, shared_mem, stream):
            seen.extend((a.value, a.writes) for a in args if type(a) is LaunchArg)
            return (lambda: stream._impl.submit_marker()), ()

    monkeypatch.setitem(L._adapters, Mine, OnPrepare())
    sm.launch(Mine(), 1, 1, sm.In(x), sm.Out(out)).result()
    assert seen == [(x, False), (out, True)]

    facts = icl.array_facts(out)
    la = LaunchArg(None, out, facts.token, 1, None)  # (as a launch makes one)
    leased = sm.stats().submitted
    for i, bad, name in ((3, facts, "ArrayFacts"), (1, la, "LaunchArg")):
        args = [2.0, sm.In(x), sm.In(y), sm.Out(out), n]
        args[i] = bad
        with pytest.raises(sm.KernelError, match=rf"^argument {i}: a {name} is what a launch "
                                                 rf"makes of an array argument; pass the array "
                                                 rf"itself$"):
            sm.launch(saxpy, 1, 16, *args)
    assert sm.stats().submitted == leased


@pytest.mark.parametrize("given", [True, False])
def test_buffers_come_from_an_arena_no_cupy_array_frees_into(fake, monkeypatch, given):
    """CuPy's pool hands a block a CuPy array freed -- its kernels on the current stream X
    maybe still reading it -- to the next allocation made while X is current. sharedmem
    uses its blocks on its own streams, unordered with X: it allocates while a stream of its
    own, never given work, is CuPy's current one (one for the device, made once)."""
    dev, drv = fake
    cp = dev.backend._cupy
    real, arenas = cp.cuda.alloc, []

    def alloc(n):
        arenas.append(cp.current.ptr)  # CuPy's pool: the arena of the current stream
        return real(n)
    monkeypatch.setattr(cp.cuda, "alloc", alloc)
    s = dev.create_stream()
    before = cp.current
    a = sm.Buffer.empty(1024, "float32", device=dev, stream=s if given else None)
    b = sm.Tensor.empty((4, 4), "float32", device=dev)
    arena = dev.backend._arena.ptr
    assert arenas == [arena, arena] and arena not in (0, s.handle)
    assert dev.backend._arena.non_blocking  # (unordered with the legacy default stream)
    assert cp.current is before  # (CuPy's current stream is back)
    assert a.nbytes == 4096 and b.nbytes == 64


def test_a_capture_the_driver_fails_to_end_or_instantiate_leaves_no_graph(fake, monkeypatch):
    from fake_cuda import CUresult
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    s = dev.create_stream("cap")
    b = sm.Buffer.zeros(4, device=dev, stream=s)
    s.synchronize()
    captures = RUNTIME.captures

    def invalidated(stream):  # as the driver does for a capture it invalidated
        drv.capturing.pop(int(stream), None)
        return (CUresult.CUDA_ERROR_INVALID_VALUE, None)

    graphs = []
    for name, bad in (("cuStreamEndCapture", invalidated),
                      ("cuGraphInstantiate", lambda g, f: (CUresult.CUDA_ERROR_INVALID_VALUE,
                                                           None))):
        with monkeypatch.context() as m:
            m.setattr(drv, name, bad)
            with pytest.raises(sm.CaptureError, match=rf"^capture of graph #\d+ on {re.escape(str(s))} "
                                                      rf"failed: .*CUDA_ERROR_INVALID_VALUE") as ei:
                with sm.capture(s) as g:
                    graphs.append(g)
                    b.fill_zero(stream=s)
        assert isinstance(ei.value.__cause__, sm.CudaError)
        assert s._capture is None and RUNTIME.captures == captures
        assert drv.capturing == {} and drv.graphs == {} and drv.execs == {}
        assert b.allocation.live_views == 1  # the failed graph holds nothing
        assert repr(g) == f"<Graph #{g.id} on {dev}: 1 captured, 0 ranges, failed>"
        with pytest.raises(sm.CaptureError, match=r"is failed; only a finished capture"):
            g.replay(s)
    b.copy_from(np.arange(4, dtype=np.float32), stream=s).result()  # the stream runs on
    np.testing.assert_array_equal(b.to_host(), np.arange(4))
    sm.Tensor.from_buffer(b, (2, 2))  # no graph is an alias


def test_device_memory_is_not_an_implicit_numpy_array_and_streams_stay_on_their_device(fake):
    dev, drv = fake
    host = sm.Device.host()
    b = sm.Buffer.zeros(4, device=dev)
    with pytest.raises(TypeError, match=rf"^implicit conversion of {re.escape(repr(b))} to a "
                                        rf"NumPy array is not allowed \(it is device memory\); "
                                        rf"use \.to_host\(\)$"):
        np.asarray(b)
    s = dev.create_stream("s")
    hs = host.create_stream("h")
    before = sm.stats()
    with pytest.raises(sm.DeviceMismatchError, match=rf"^{re.escape(str(s))} is on {dev}, but "
                                                     rf"the memory is on <Device host>$"):
        sm.Buffer.empty(4, device=host, stream=s)
    with pytest.raises(sm.DeviceMismatchError, match=rf"^{re.escape(str(hs))} is on <Device "
                                                     rf"host>, but the memory is on {dev}$"):
        b.to_host(stream=hs)
    st = sm.stats()
    assert st.submitted == before.submitted and st.live_allocations == before.live_allocations
    # a `with stream:` of another device is not the current stream of this one
    with hs:
        fut = b.fill_zero()
    assert fut.stream is dev.default_stream
    fut.result()


def test_device_synchronize_waits_for_that_device_only(fake):
    import threading
    dev, drv = fake
    host = sm.Device.host()
    hs = host.create_stream("h")
    gate = threading.Event()
    hf = sm.launch(sm.host_kernel(lambda: gate.wait(30)), 1, 1, stream=hs)
    s = dev.create_stream("s")
    b = sm.Buffer.empty(4, device=dev)
    drv.holding = True  # the device's work stays in flight until synchronized
    b.copy_from(np.arange(4, dtype=np.float32), stream=s)
    assert s.pending == 1
    dev.synchronize()
    assert s.pending == 0 and not hf.done()  # the host's work was not waited for
    drv.holding = False
    gate.set()
    host.synchronize()
    assert hf.done() and hs.pending == 0
    np.testing.assert_array_equal(b.to_host(), np.arange(4))


def test_a_failed_event_query_makes_completion_unknown_and_keeps_the_memory(fake, monkeypatch):
    """``cuEventQuery`` failing (not NOT_READY): the work's completion is unknown -- its future
    raises CompletionUnknownError with the CudaError as ``__cause__``, a LeakWarning is said,
    and the memory is kept, counted in ``stats().leaked``."""
    from fake_cuda import CUresult
    dev, drv = fake
    s = dev.create_stream("s")
    b = sm.Buffer.zeros(8, "float32", device=dev, stream=s)
    sm.synchronize()
    before = sm.stats()
    drv.holding = True
    fut = b.fill_zero(stream=s)
    drv.holding = False
    real = drv.cuEventQuery
    monkeypatch.setattr(drv, "cuEventQuery", lambda ev: (CUresult.CUDA_ERROR_INVALID_HANDLE,))
    with pytest.warns(sm.LeakWarning, match=r"is unknown \(CudaError\('cuEventQuery failed: "
                                            r"CUDA_ERROR_INVALID_HANDLE \(400\)'"):
        with pytest.raises(sm.CompletionUnknownError, match=r"^completion of fill_zero on "
                           r"<Stream s .* is unknown: CudaError\('cuEventQuery failed: "
                           r"CUDA_ERROR_INVALID_HANDLE \(400\)', 400\)\. Its memory is kept") as ei:
            fut.result()
    assert isinstance(ei.value.__cause__, sm.CudaError) and ei.value.__cause__.code == 400
    monkeypatch.setattr(drv, "cuEventQuery", real)
    drv.finish_held()
    after = sm.stats()
    assert after.leaked == before.leaked + 1 and after.leaked_bytes == before.leaked_bytes + 32


def test_a_failed_graph_instantiation_leaves_no_graph_and_no_hold(fake, monkeypatch):
    """``cuGraphInstantiate`` failing ends the capture as a failed graph: the CUgraph is
    destroyed, no exec is made, the stream is no longer capturing, and the captured buffer
    is held by no graph (it can be moved)."""
    from fake_cuda import CUresult
    dev, drv = fake
    s = dev.create_stream("s")
    b = sm.Buffer.zeros(8, "float32", device=dev, stream=s)
    s.synchronize()
    monkeypatch.setattr(drv, "cuGraphInstantiate",
                        lambda g, f: (CUresult.CUDA_ERROR_INVALID_VALUE, None))
    with pytest.raises(sm.CaptureError, match=r"^capture of graph #\d+ on <Stream s .* failed: "
                                              r"cuGraphInstantiate failed: "
                                              r"CUDA_ERROR_INVALID_VALUE \(1\)"):
        with sm.capture(s) as g:
            b.fill_zero(stream=s)
    assert s._capture is None and drv.capturing == {} and drv.graphs == {} and drv.execs == {}
    with pytest.raises(sm.CaptureError, match=r"^graph #\d+ is failed; only a finished capture "
                                              r"can be replayed$"):
        g.replay(s)
    assert b.allocation.live_views == 1
    sm.Tensor.from_buffer(b, (8,))  # no graph holds it


def test_a_non_int_dlpack_stream_is_a_type_error(fake):
    """DLPack's ``stream``: an int or None; a bool, a str, a float or a NumPy integer is a
    TypeError naming its type (no export made); an int subclass is taken as the int it is."""
    dev, drv = fake
    t = sm.Tensor.from_host(np.arange(4, dtype=np.float32), device=dev)
    sm.synchronize()
    for bad, name in ((True, "bool"), ("1", "str"), (1.0, "float"), (np.int64(5), "int64")):
        with pytest.raises(TypeError, match=rf"^stream must be an int or None, got {name}$"):
            t.__dlpack__(stream=bad)
    assert t.allocation.live_views == 1
    consumer = int(drv.cuStreamCreate(1)[1])
    class Handle(int):
        pass
    cap = t.__dlpack__(stream=Handle(consumer))
    assert t.allocation.live_views == 2
    del cap
    gc_collect_harder()
    assert t.allocation.live_views == 1


def test_a_failed_cupy_launch_takes_no_lease(fake, kernels, monkeypatch):
    """``cuLaunchKernel`` failing is a CudaError naming the call; nothing was submitted or
    leased, and the argument can be moved at once."""
    from fake_cuda import CUresult
    dev, drv = fake
    _, scale_len = kernels
    x = sm.Buffer.zeros(8, "float32", device=dev)
    s = dev.create_stream("s")
    sm.launch(scale_len, 1, 8, x, 8, 1.0, stream=s).result()  # (planned)
    sm.synchronize()
    before = sm.stats()
    monkeypatch.setattr(drv, "cuLaunchKernel", lambda *a: (CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(sm.CudaError, match=r"^cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE "
                                           r"\(1\)$") as ei:
        sm.launch(scale_len, 1, 8, x, 8, 1.0, stream=s)
    assert ei.value.code == 1
    assert sm.stats() == before and x.allocation.views() == [
        f"buffer, bytes [0, 32) of allocation #{x.allocation.id}"]
    sm.Tensor.from_buffer(x, (8,))


def test_cupy_pointer_and_untyped_parameters_take_none_and_raw_addresses(fake, kernels):
    """A pointer parameter takes None (NULL) and a NumPy uint64/int64 (a raw address, stated
    as such); a parameter of unknown type takes None where it is 8 bytes. ``with_length``
    before a float parameter is refused by name, with no lease."""
    from fake_cuda import RawKernel
    dev, drv = fake
    got = []
    code = 'extern "C" __global__ void ptrs(float* p, const int* q, long long n) { }'
    k = RawKernel(drv, "ptrs", ["Q", "Q", "q"], lambda p, q, n: got.append((p, q, n)), code)
    st = dev.create_stream("scalars")  # (no array argument names the device: the stream does)
    sm.launch(k, 1, 1, None, np.uint64(0x1000), 3, stream=st).result()
    sm.launch(k, 1, 1, None, np.int64(-1), 4, stream=st).result()
    blind = RawKernel(drv, "blind8", ["Q", "Q", "q"], lambda p, q, n: got.append((p, q, n)))
    sm.launch(blind, 1, 1, None, np.uint64(0x2000), np.int64(5), stream=st).result()
    assert got == [(0, 0x1000, 3), (0, (1 << 64) - 1, 4), (0, 0x2000, 5)]
    _, scale_len = kernels
    x = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()
    before = sm.stats()
    code2 = 'extern "C" __global__ void lenf(float* x, float n) { }'
    lenf = RawKernel(drv, "lenf", ["Q", "f"], lambda x, n: None, code2)
    with pytest.raises(sm.KernelError, match=r"^argument 0: with_length=True, but the next "
                                             r"parameter is parameter 'n' \(float\), not an int$"):
        sm.launch(lenf, 1, 1, sm.InOut(x, with_length=True))
    assert sm.stats() == before


def test_cupy_kernels_need_the_drivers_parameter_info(fake, monkeypatch):
    """Without ``cuFuncGetParamInfo`` (a driver before CUDA 12.4) a CuPy launch is a
    BackendUnavailableError saying so, and nothing is planned; ``cuFuncGetParamCount``, where
    the bindings have it, gives the count (and where it raises, the sizes are asked one by
    one)."""
    import interop.cupy_launch as icl
    from fake_cuda import RawKernel
    from sharedmem.launch import adapter_for
    dev, drv = fake
    got = []
    code = 'extern "C" __global__ void two(int a, double b) { }'
    k = RawKernel(drv, "two", ["i", "d"], lambda a, b: got.append((a, b)), code)
    real = drv.cuFuncGetParamInfo
    monkeypatch.setattr(drv, "cuFuncGetParamInfo", None, raising=False)
    with pytest.raises(sm.BackendUnavailableError, match=r"^launching CuPy kernels through "
                                                         r"sharedmem needs cuFuncGetParamInfo "
                                                         r"\(CUDA 12\.4\+ driver"):
        sm.launch(k, 1, 1, 1, 2.0, stream=dev.create_stream())
    assert (k.kernel.ptr, dev.key) not in icl._by_function
    monkeypatch.setattr(drv, "cuFuncGetParamInfo", real)
    from fake_cuda import CUresult
    counted = []
    monkeypatch.setattr(drv, "cuFuncGetParamCount",
                        lambda f: counted.append(int(f)) or (CUresult.CUDA_SUCCESS, 2),
                        raising=False)
    assert icl._param_sizes(k.kernel.ptr) == [4, 8] and counted == [k.kernel.ptr]

    def gone(f):
        raise RuntimeError("Function \"cuFuncGetParamCount\" not found")
    monkeypatch.setattr(drv, "cuFuncGetParamCount", gone, raising=False)
    assert icl._param_sizes(k.kernel.ptr) == [4, 8]
    plan = icl.plan_kernel(adapter_for(k), k, dev)
    assert [(p.kind, p.size, p.name) for p in plan.params] == [("i", 4, "a"), ("f", 8, "b")]


def test_kernel_sources_that_cannot_be_read_leave_the_types_unknown():
    """``param_types``: templates and parentheses inside a parameter's type do not split it;
    a kernel not in the source, an unbalanced parameter list, or an unnamed parameter give
    None (the types are then unknown: only NumPy scalars of the right size are taken);
    ``(void)`` is no parameter."""
    from interop.cupy_launch import param_types
    assert param_types('__global__ void k(Pair<int, float>* p, Arr<float, (2)> a, int n) {}',
                       "k") == [("p", "Pair<int, float>*", "p"), ("?", "Arr<float, (2)>", "a"),
                                ("i", "int", "n")]
    assert param_types("__global__ void other(int n) {}", "k") is None
    assert param_types("__global__ void k(int n", "k") is None
    assert param_types("__global__ void k(int) {}", "k") is None
    assert param_types("__global__ void k(void) {}", "k") == []


def test_a_cutile_launch_gets_a_cupy_array_itself_leased_and_kept(fake, tile, monkeypatch):
    """A CuPy array passed to a cuTile kernel reaches ct.launch as itself (cuTile reads it),
    leased through its ArrayFacts as for CuPy kernels -- a write to its bytes on another
    stream under policy 'reject' is refused while the launch is pending -- and kept alive by
    the launch until its work is done."""
    import interop.cutile  # noqa: F401 (its adapter)
    from fake_cuda import TileKernel
    dev, drv = fake
    seen = []
    kern = TileKernel(lambda x, c, q: seen.append((x, q)))
    a, b, c, s = _vadd_operands(dev, 16)
    (x,) = _fake_cupy_arrays(monkeypatch, dev, 16, 1)
    x.dtype = np.dtype(np.float32)
    drv.holding = True
    sm.launch(kern, 2, None, sm.In(x), sm.Out(c), 3, stream=s)
    assert len(seen) == 1 and seen[0][0] is x and seen[0][1] == 3
    block, ref = x._block, weakref.ref(x)
    del x, seen[:]
    gc_collect_harder()
    assert ref() is not None  # the launch keeps the array
    other = dev.create_stream("other")
    with pytest.raises(sm.AccessConflictError, match=r"policy 'reject'"):
        sm.launch(kern, 2, None, sm.Out(block), sm.In(c), 1, stream=other, policy="reject")
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    tile[0].compiled.clear()  # (the fake logs a signature of the array itself: it keeps it)
    gc_collect_harder()
    assert ref() is None  # let go once the work is done


def test_a_cutile_launch_of_the_same_cupy_array_signs_it_once_until_its_layout_changes(
        fake, tile, monkeypatch):
    """The launch before remembers a CuPy array argument by its facts' weak reference and its
    layout, not by the array (which it does not keep): the same array again computes no
    signature; a shape re-set in place (CuPy allows it) computes it again."""
    import interop.cutile as icu
    from fake_cuda import TileKernel
    dev, drv = fake
    signed = []
    real = icu._signature
    monkeypatch.setattr(icu, "_signature", lambda *a: signed.append(1) or real(*a))
    kern = TileKernel(lambda x, c: None)
    a, b, c, s = _vadd_operands(dev, 16)
    (x,) = _fake_cupy_arrays(monkeypatch, dev, 16, 1)
    x.dtype = np.dtype(np.float32)
    for _ in range(3):
        sm.launch(kern, 2, None, sm.In(x), sm.Out(c), stream=s).result()
    assert len(signed) == 1
    x.shape, x.strides = (4, 4), (16, 4)
    sm.launch(kern, 2, None, sm.In(x), sm.Out(c), stream=s).result()
    sm.launch(kern, 2, None, sm.In(x), sm.Out(c), stream=s).result()
    assert len(signed) == 2
    ref = weakref.ref(x)
    del x
    tile[0].compiled.clear()  # (the fake logs a signature of the array itself: it keeps it)
    gc_collect_harder()
    assert ref() is None  # (the plan remembers no array)


def test_cutile_launches_take_no_shared_mem_and_a_buffer_argument(fake, tile):
    """cuTile manages its own shared memory: ``shared_mem`` other than 0 is a KernelError and
    nothing is leased. A Buffer (not only a Tensor) is a cuTile array argument."""
    from fake_cuda import TileKernel
    dev, drv = fake
    a, b, c, s = _vadd_operands(dev, 8)

    def vadd(x, y, z):
        z[:] = x + y
    kern = TileKernel(vadd)
    before = sm.stats()
    with pytest.raises(sm.KernelError, match=r"^cuTile kernels manage their own shared memory: "
                                             r"pass shared_mem=0$"):
        sm.launch(kern, (1,), None, sm.In(a), sm.In(b), sm.Out(c), stream=s, shared_mem=128)
    assert sm.stats() == before
    out = sm.Buffer.zeros(8, "float32", device=dev)
    sm.launch(kern, (1,), None, sm.In(a), sm.In(b), sm.Out(out), stream=s).result()
    np.testing.assert_array_equal(out.to_host(), np.arange(8) + 1)


def _retirer_sweeps_nothing(monkeypatch):
    """The retirer's passes sweep nothing (a pass records a stream's open marker): only the
    test's own calls retire, record and query. Called before the test's stream is made, so no
    pass begun earlier can have it to sweep."""
    from sharedmem.runtime import retirer
    monkeypatch.setattr(retirer, "_pass", lambda rt, last: ({}, True))


def _quiet_stream(fake, monkeypatch):
    """``(dev, drv, s, b, before)``: the fake device and driver, a stream ``s`` the retirer
    leaves alone (see _retirer_sweeps_nothing), 32 zeroed bytes ``b`` written on it and
    settled, and ``sm.stats()`` then."""
    dev, drv = fake
    _retirer_sweeps_nothing(monkeypatch)
    s = dev.create_stream("s")
    b = sm.Buffer.zeros(8, "float32", device=dev, stream=s)
    sm.synchronize()
    return dev, drv, s, b, sm.stats()


def test_a_batch_marker_that_cannot_be_recorded_keeps_every_joiners_memory_the_last_too(
        fake, monkeypatch):
    """The MARKER_BATCH-th submission that joins a stream's open marker records it. A record
    that fails makes the completion of every joiner unknown -- of the last one too, whose work
    (here a memset) is enqueued by then: it is filed with the others, its future raises
    CompletionUnknownError, and its memory is kept and counted as leaked with theirs. (It
    raised the CudaError instead, after the memset was enqueued: that work ran with no lease,
    counted neither as submitted nor as leaked.)"""
    import sharedmem.backends.cuda as bc
    from fake_cuda import CUresult
    dev, drv, s, b, before = _quiet_stream(fake, monkeypatch)
    memsets = []
    real_memset = drv.cuMemsetD8Async
    monkeypatch.setattr(drv, "cuMemsetD8Async",
                        lambda *a: (memsets.append(int(a[3])), real_memset(*a))[1])
    real = drv.cuEventRecord
    monkeypatch.setattr(drv, "cuEventRecord", lambda ev, st: (CUresult.CUDA_ERROR_INVALID_VALUE,)
                        if int(st) == s.handle else real(ev, st))
    futs = [b.fill_zero(stream=s) for _ in range(bc.MARKER_BATCH)]
    assert memsets == [s.handle] * bc.MARKER_BATCH  # every one of them enqueued
    marker = futs[0]._s.marker
    assert all(f._s.marker is marker for f in futs) and marker.recorded
    assert s._impl.open_marker is None and isinstance(marker.error, sm.CudaError)
    with pytest.warns(sm.LeakWarning, match=r"is unknown \(CudaError\('cuEventRecord failed: "
                                            r"CUDA_ERROR_INVALID_VALUE \(1\)'"):
        with pytest.raises(sm.CompletionUnknownError, match=r"^completion of fill_zero on "
                           r"<Stream s .* is unknown: CudaError\('cuEventRecord failed: "
                           r"CUDA_ERROR_INVALID_VALUE \(1\)', 1\)\. Its memory is kept") as ei:
            futs[-1].result()
    assert ei.value.__cause__ is marker.error and marker.error.code == 1
    after = sm.stats()
    assert (after.submitted, after.retired, after.in_flight, after.leaked, after.leaked_bytes) \
        == (before.submitted + bc.MARKER_BATCH, before.retired, 0,
            before.leaked + bc.MARKER_BATCH, before.leaked_bytes + 32 * bc.MARKER_BATCH)
    assert all(f.done() for f in futs)
    monkeypatch.setattr(drv, "cuEventRecord", real)
    # the bytes stay leased by that work: read elsewhere, they are refused, not trusted
    with pytest.raises(sm.CompletionUnknownError, match=r"^to_host on .* would read bytes "
                                                        r"\[0, 32\) .*which work of unknown "
                                                        r"completion on <Stream s .* writes"):
        b.to_host()


def test_synchronize_waits_for_the_stream_itself_when_its_last_marker_is_unknown(
        fake, monkeypatch):
    """A marker that could not be recorded cannot be waited for (its wait returns at once):
    synchronizing a stream whose newest work has such a marker waits for the stream itself
    (cuStreamSynchronize), not for nothing. (It returned at once, while that work could still
    be running.) With a known marker it waits for the marker alone."""
    from fake_cuda import CUresult
    from sharedmem.runtime.state import locked
    dev, drv, s, b, before = _quiet_stream(fake, monkeypatch)
    b.fill_zero(stream=s)
    n = len(drv.calls)
    s.synchronize()
    assert ("stream_sync", s.handle) not in drv.calls[n:]
    real = drv.cuEventRecord
    monkeypatch.setattr(drv, "cuEventRecord", lambda ev, st: (CUresult.CUDA_ERROR_INVALID_VALUE,)
                        if int(st) == s.handle else real(ev, st))
    fut = b.fill_zero(stream=s)
    with locked():
        fut._s.marker.close_locked()  # (its record fails: the marker is unknown)
    assert isinstance(fut._s.marker.error, sm.CudaError)
    n = len(drv.calls)
    with pytest.warns(sm.LeakWarning, match=r"is unknown \(CudaError\('cuEventRecord failed"):
        s.synchronize()
    assert ("stream_sync", s.handle) in drv.calls[n:]
    monkeypatch.setattr(drv, "cuEventRecord", real)


def test_synchronize_after_a_sticky_error_reports_the_unknown_completion_not_a_raw_error(
        fake, monkeypatch):
    """After a sticky error (a kernel's illegal address) the newest marker's wait fails and
    makes it unknown; cuStreamSynchronize then fails with the same error. synchronize()
    reports the unknown completion as before (the sweep keeps the memory, a LeakWarning, the
    deferred CompletionUnknownError), not the raw CudaError of the stream's wait, which
    skipped the sweep and left the work filed as pending."""
    from fake_cuda import CUresult
    dev, drv, s, b, before = _quiet_stream(fake, monkeypatch)
    fut = b.fill_zero(stream=s)
    sticky = (CUresult.CUDA_ERROR_INVALID_VALUE,)  # (the fake's stand-in for error 700)
    monkeypatch.setattr(drv, "cuEventSynchronize", lambda ev: sticky)
    monkeypatch.setattr(drv, "cuEventQuery", lambda ev: sticky)
    monkeypatch.setattr(drv, "cuStreamSynchronize", lambda st: sticky)
    with pytest.warns(sm.LeakWarning, match=r"is unknown"):
        try:
            s.synchronize()
        except sm.CompletionUnknownError:
            pass
    assert s.pending == 0  # retired as unknown: kept, counted as leaked
    with pytest.raises(sm.CompletionUnknownError):
        fut.result()


def _held_submissions(drv, s, b, n):
    """``n`` fill_zero futures on ``s``, each with a marker of its own, recorded and pending
    (done() sweeps, and the sweep records the open marker: the next one opens another)."""
    drv.holding = True
    futs = []
    for _ in range(n):
        f = b.fill_zero(stream=s)
        assert f.done() is False
        futs.append(f)
    assert len({f._s.marker.handle for f in futs}) == n
    return futs


@pytest.mark.parametrize("failing", ["oldest", "middle"])
def test_a_query_failing_partway_through_a_fifo_retires_before_it_and_waits_after_it(
        fake, monkeypatch, failing):
    """A sweep asks the newest marker, the oldest, then bisects. A query that fails on the way
    (the oldest, or one the bisection asks) makes the sweep walk the FIFO one by one: what
    finished before it retires, it is kept (leaked, its future raises CompletionUnknownError),
    and the walk stops at the first one still running, which stays pending and retires later."""
    from fake_cuda import CUresult
    from sharedmem.runtime import submission as sub
    dev, drv, s, b, before = _quiet_stream(fake, monkeypatch)
    a, mid, c = _held_submissions(drv, s, b, 3)
    bad = a if failing == "oldest" else mid
    if failing == "middle":
        drv.held.discard(a._s.marker.handle)  # a finished
    real = drv.cuEventQuery
    monkeypatch.setattr(drv, "cuEventQuery", lambda ev: (CUresult.CUDA_ERROR_INVALID_HANDLE,)
                        if int(ev) == bad._s.marker.handle else real(ev))
    assert c.done() is False
    states = [f._s.state for f in (a, mid, c)]
    if failing == "oldest":  # the walk stops at mid, still running: c is not asked
        assert states == [sub.UNKNOWN, sub.PENDING, sub.PENDING] and s.pending == 2
    else:
        assert states == [sub.RETIRED, sub.UNKNOWN, sub.PENDING] and s.pending == 1
    with pytest.warns(sm.LeakWarning, match=r"is unknown \(CudaError\('cuEventQuery failed: "
                                            r"CUDA_ERROR_INVALID_HANDLE \(400\)'"):
        st = sm.stats()
    retired = 0 if failing == "oldest" else 1
    assert (st.submitted, st.retired, st.in_flight, st.leaked, st.leaked_bytes) == (
        before.submitted + 3, before.retired + retired, 2 - retired, before.leaked + 1,
        before.leaked_bytes + 32)
    with pytest.raises(sm.CompletionUnknownError, match=r"^completion of fill_zero on "
                       r"<Stream s .* is unknown: CudaError\('cuEventQuery failed: "
                       r"CUDA_ERROR_INVALID_HANDLE \(400\)', 400\)\. Its memory is kept"):
        bad.result()
    drv.holding = False
    drv.finish_held()
    c.result()  # what ran after it retires
    st = sm.stats()
    assert (st.retired, st.in_flight, st.leaked) == (before.retired + 2, 0, before.leaked + 1)
    assert [f._s.state for f in (a, mid, c)] == (
        [sub.UNKNOWN, sub.RETIRED, sub.RETIRED] if failing == "oldest" else
        [sub.RETIRED, sub.UNKNOWN, sub.RETIRED])


def test_a_submitters_sweep_that_finds_a_failed_query_leaves_the_open_marker_open(
        fake, monkeypatch):
    """submit() sweeps its stream every SWEEP_EVERY-th submission without recording the open
    marker. A failed query of an older marker makes it walk the FIFO: the work of unknown
    completion is kept (leaked), and the walk stops at the first submission of the open
    marker -- nothing recorded, those stay pending and retire once it is recorded."""
    from fake_cuda import CUresult
    from sharedmem.runtime import submission as sub
    dev, drv, s, b, before = _quiet_stream(fake, monkeypatch)
    (a,) = _held_submissions(drv, s, b, 1)
    real = drv.cuEventQuery
    monkeypatch.setattr(drv, "cuEventQuery", lambda ev: (CUresult.CUDA_ERROR_INVALID_HANDLE,)
                        if int(ev) == a._s.marker.handle else real(ev))
    records = sum(c[0] == "record" for c in drv.calls)
    futs = []
    while s._seq % sub.SWEEP_EVERY:  # (the last one's submit sweeps)
        futs.append(b.fill_zero(stream=s))
    marker = futs[0]._s.marker
    assert len(futs) == sub.SWEEP_EVERY - 2 and all(f._s.marker is marker for f in futs)
    assert a._s.state == sub.UNKNOWN and all(f._s.state == sub.PENDING for f in futs)
    assert not marker.recorded and s._impl.open_marker is marker
    assert sum(c[0] == "record" for c in drv.calls) == records and s.pending == len(futs)
    drv.holding = False
    with pytest.warns(sm.LeakWarning, match=r"is unknown \(CudaError\('cuEventQuery failed"):
        sm.synchronize()
    st = sm.stats()
    assert (st.submitted, st.retired, st.in_flight, st.leaked, st.leaked_bytes) == (
        before.submitted + 1 + len(futs), before.retired + len(futs), 0, before.leaked + 1,
        before.leaked_bytes + 32)
    assert all(f._s.state == sub.RETIRED for f in futs)


@pytest.mark.parametrize("call", ["cuEventCreate", "cuEventSynchronize"])
def test_a_marker_whose_event_cannot_be_made_or_waited_for_makes_completion_unknown(
        fake, monkeypatch, call):
    """No event for an open marker (the pool empty, cuEventCreate failing), or a
    cuEventSynchronize that fails while waited for: the work's completion is unknown -- its
    future raises CompletionUnknownError with the CudaError as ``__cause__``, and its memory
    is kept, counted once in ``stats().leaked``."""
    from fake_cuda import CUresult
    dev, drv, s, b, before = _quiet_stream(fake, monkeypatch)
    dev.backend._events.clear()
    fut = b.fill_zero(stream=s)
    m = fut._s.marker
    monkeypatch.setattr(drv, call, lambda *a: (CUresult.CUDA_ERROR_INVALID_VALUE, None)[
        :2 if call == "cuEventCreate" else 1])
    msg = rf"CudaError\('{call} failed: CUDA_ERROR_INVALID_VALUE \(1\)'"
    with pytest.warns(sm.LeakWarning, match=rf"is unknown \({msg}"):
        with pytest.raises(sm.CompletionUnknownError, match=rf"^completion of fill_zero on "
                           rf"<Stream s .* is unknown: {msg}, 1\)\. Its memory is kept") as ei:
            fut.result()
    assert ei.value.__cause__ is m.error and m.error.code == 1 and m.recorded
    if call == "cuEventCreate":
        assert m.event is None and s._impl.open_marker is None  # nothing was recorded
    else:
        assert m.event is not None  # (not back to the pool: its state is not known)
        assert dev.backend._events.count(m.event) == 0
    after = sm.stats()
    assert (after.submitted, after.in_flight, after.leaked, after.leaked_bytes) == (
        before.submitted + 1, 0, before.leaked + 1, before.leaked_bytes + 32)


def test_a_failed_cross_stream_wait_enqueues_nothing_and_takes_no_lease(fake, monkeypatch):
    """``cuStreamWaitEvent`` failing while a launch is ordered after another stream's write:
    a CudaError naming the call; the work is not enqueued, nothing is leased or counted, and
    the same work succeeds (ordered) once the driver does."""
    from fake_cuda import CUresult
    dev, drv = fake
    a, c = dev.create_stream("a"), dev.create_stream("c")
    b = sm.Buffer.zeros(8, "float32", device=dev, stream=a)
    drv.holding = True  # a's write stays in flight
    b.fill_zero(stream=a)
    before = sm.stats()
    memsets = []
    real_memset = drv.cuMemsetD8Async
    monkeypatch.setattr(drv, "cuMemsetD8Async",
                        lambda *x: (memsets.append(int(x[3])), real_memset(*x))[1])
    real_wait = drv.cuStreamWaitEvent
    monkeypatch.setattr(drv, "cuStreamWaitEvent", lambda *x: (CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(sm.CudaError, match=r"^cuStreamWaitEvent failed: "
                                           r"CUDA_ERROR_INVALID_VALUE \(1\)$") as ei:
        b.fill_zero(stream=c)
    assert ei.value.code == 1 and memsets == []
    after = sm.stats()
    assert (after.submitted, after.in_flight) == (before.submitted, before.in_flight)
    assert c.pending == 0 and c not in b.allocation.tracker.streams_locked()
    monkeypatch.setattr(drv, "cuStreamWaitEvent", real_wait)
    n = len(drv.calls)
    f = b.fill_zero(stream=c)  # ordered after a's write, on the device
    assert [x[:2] for x in drv.calls[n:] if x[0] == "wait"] == [("wait", c.handle)]
    assert memsets == [c.handle]
    drv.holding = False
    drv.finish_held()
    f.result()
    assert c.pending == 0 and sm.stats().in_flight == 0


def test_device_limits_the_driver_does_not_give_are_zero(fake, monkeypatch):
    """A limit whose attribute this cuda.bindings lacks, or whose query fails, is 0 (not
    known, not checked); the others are the driver's."""
    import sharedmem.backends.cuda as bc
    from fake_cuda import CUresult
    dev, drv = fake
    A = types.SimpleNamespace(**vars(drv.CUdevice_attribute))
    del A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    monkeypatch.setattr(drv, "CUdevice_attribute", A)
    real = drv.cuDeviceGetAttribute
    monkeypatch.setattr(drv, "cuDeviceGetAttribute", lambda a, d: (
        CUresult.CUDA_ERROR_INVALID_VALUE, 0) if a == A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK
        else real(a, d))
    lim = bc.CudaBackend(0).limits
    assert (lim.grid, lim.block, lim.threads, lim.shared_mem) == (
        (2**31 - 1, 65535, 65535), (1024, 1024, 64), 0, 0)


def test_memory_the_driver_cannot_describe_is_not_imported(fake, monkeypatch):
    """``cuPointerGetAttributes`` answering zeroed attributes (memory it does not know) is
    not device memory: a CAI import of it is the ValueError errors.md names. The call itself
    failing is the driver's CudaError, not an answer about the memory. Neither imports
    anything."""
    import sharedmem.device as sm_device
    from fake_cuda import CUresult
    dev, drv = fake
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)  # (an import probes Device(0))
    b = sm.Buffer.from_host(np.arange(4, dtype="f4"), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    sm.synchronize()
    assert dev.backend.pointer_info(b.ptr) == (b.ptr, 16, 0)
    if dev.backend.hot is not None:  # (not an int: refused by ctypes' conversion, in both
        with pytest.raises(ctypes.ArgumentError):  # builds -- never truncated to an address)
            dev.backend.pointer_info(float(b.ptr))
    before = sm.stats()

    class Producer:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (b.ptr, False),
                                    "version": 3}
    del drv.ranges[b.allocation.ptr]  # (the driver's answer for memory it does not know)
    assert dev.backend.pointer_info(b.ptr) is None
    with pytest.raises(ValueError, match=rf"^0x{b.ptr:x} is not CUDA device memory$"):
        sm.from_cuda_array_interface(Producer())
    assert sm.stats() == before and b.allocation.live_views == 1
    import interop.dlpack as dl
    cap, mem, deleted, m = _foreign_capsule(drv)  # (of memory no import knows yet)
    real, hot0, addr0 = drv.cuPointerGetAttributes, dev.backend.hot, dev.backend.attributes_addr
    # (every path: libcuda's entry point through its address (compiled), through ctypes,
    # cuda.bindings -- the last alone where the fake has no libcuda)
    paths = [(None, 0)]
    if hot0 is not None:
        assert addr0 == hot0.addresses["cuPointerGetAttributes"] != 0
        paths[:0] = [(hot0, addr0), (hot0, 0)]
    monkeypatch.setattr(drv, "cuPointerGetAttributes",
                        lambda n, attrs, p: (CUresult.CUDA_ERROR_INVALID_CONTEXT, None))
    for hot, addr in paths:
        monkeypatch.setattr(dev.backend, "hot", hot)
        monkeypatch.setattr(dev.backend, "attributes_addr", addr)
        with pytest.raises(sm.errors.CudaError, match=r"^cuPointerGetAttributes failed: "
                           r"CUDA_ERROR_INVALID_CONTEXT \(201\)$") as err:
            dev.backend.pointer_info(b.ptr)
        assert err.value.code == 201
        with pytest.raises(sm.errors.CudaError, match=r"^cuPointerGetAttributes failed"):
            sm.from_cuda_array_interface(Producer())
        with pytest.raises(sm.errors.CudaError, match=r"^cuPointerGetAttributes failed"):
            sm.from_dlpack(cap)  # (asked before the capsule is consumed)
        assert dl._is_valid(cap, b"dltensor_versioned") and deleted == []
        assert sm.stats() == before and b.allocation.live_views == 1
    monkeypatch.setattr(dev.backend, "hot", hot0)
    monkeypatch.setattr(dev.backend, "attributes_addr", addr0)
    monkeypatch.setattr(drv, "cuPointerGetAttributes", real)
    t = sm.from_dlpack(cap)  # (left usable: imported once the driver answers)
    assert (t.ptr, t.shape, t.device) == (mem.ctypes.data, (4,), dev)
    del t
    sm.synchronize()
    gc_collect_harder()
    assert deleted == [ctypes.addressof(m)]


def test_an_event_the_driver_cannot_record_is_destroyed_and_none_is_made(fake, monkeypatch):
    """``Stream.record()`` whose cuEventRecord fails: a CudaError naming the call; the event
    made for it is destroyed at once (none kept), no Event is returned, and the stream
    records again once the driver does."""
    from fake_cuda import CUresult
    dev, drv = fake
    s = dev.create_stream("s")
    made, destroyed = len(drv.events), drv.destroyed_events
    real = drv.cuEventRecord
    monkeypatch.setattr(drv, "cuEventRecord", lambda ev, st: (CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(sm.CudaError, match=r"^cuEventRecord failed: CUDA_ERROR_INVALID_VALUE "
                                           r"\(1\)$") as ei:
        s.record()
    assert ei.value.code == 1
    assert len(drv.events) == made + 1 and drv.destroyed_events == destroyed + 1
    monkeypatch.setattr(drv, "cuEventRecord", real)
    ev = s.record()
    assert ev.query() is True and drv.destroyed_events == destroyed + 1


def test_a_stream_object_that_cannot_say_its_device_is_borrowed_for_the_one_asked(fake):
    """A foreign stream object whose device attribute raises (a closed stream) names no
    device: it is borrowed for the device asked for; one that names another device is a
    DeviceMismatchError."""
    dev, drv = fake

    class Closed:
        ptr = 0x7C10

        @property
        def device_id(self):
            raise RuntimeError("stream closed")

    st = sm.Stream.from_external(Closed(), dev)
    assert st.device is dev and st.handle == 0x7C10 and not st.owned

    class Elsewhere:
        ptr = 0x7C11
        device_id = 3
    with pytest.raises(sm.DeviceMismatchError, match=r"is a stream of CUDA device 3, not of "
                                                     r"<Device cuda:0 Fake GPU>"):
        sm.Stream.from_external(Elsewhere(), dev)


def test_an_op_whose_only_array_is_a_device_box_runs_on_the_boxs_device(fake, kernels,
                                                                         monkeypatch):
    """An op picks its stream from its first live array argument -- a DeviceBox's buffer too:
    a pool stream of the box's device, not of the default device (the host here: no GPU)."""
    from sharedmem import ops
    dev, drv = fake
    _, scale_len = kernels
    pools = {}
    monkeypatch.setattr(ops, "_pools", pools)  # (the fake device's pool goes with the test)
    box = sm.DeviceBox(2.0, "float32", device=dev)
    fut = sm.op(scale_len, 1, 1, sm.InOut(box), 1, 3.0).submit()
    fut.result()
    assert fut.stream.device is dev and fut.stream.name.startswith("sharedmem-pool-")
    assert box.get() == 6.0 and list(pools) == [dev.key]
    sm.synchronize()
    del fut
    pools.clear()
    gc_collect_harder()


def test_record_use_again_on_a_holding_stream_keeps_the_stronger_mode(fake, kernels):
    """``record_use`` makes every live view of the bytes a hold for the stream; declared again
    on the same stream, the hold keeps one entry with the stronger mode: a read then a write
    is a write (a read elsewhere is then refused under "reject"), a later read keeps it."""
    dev, drv = fake
    saxpy, _ = kernels
    s, other = dev.create_stream("consumer"), dev.create_stream("other")
    b = sm.Buffer.zeros(8, "float32", device=dev)
    out = sm.Buffer.zeros(8, "float32", device=dev, stream=other)
    sm.synchronize()
    tok = b._token
    sm.record_use(b, s, writes=False)
    assert tok.consumers == ((s, False),)
    sm.launch(saxpy, 1, 8, 1.0, sm.In(b), sm.In(b), sm.Out(out), 8, stream=other,
              policy="reject").result()  # read + read: no conflict
    sm.record_use(b, s, writes=True)
    sm.record_use(b, s, writes=False)
    assert tok.consumers == ((s, True),)
    before = sm.stats()
    with pytest.raises(sm.AccessConflictError, match=rf" on <Stream other .* would read "
                       rf"bytes \[0, 32\) of allocation #{b.allocation.id} while a consumer on "
                       rf"<Stream consumer .* holds them \(may write\) \(policy 'reject'\)"):
        sm.launch(saxpy, 1, 8, 1.0, sm.In(b), sm.In(b), sm.Out(out), 8, stream=other,
                  policy="reject")
    assert sm.stats().submitted == before.submitted  # no lease taken


def test_a_dlpack_export_to_no_stream_holds_the_bytes_on_every_current_stream(fake):
    """``stream=-1``: the consumer orders itself on a stream it does not name -- the export
    holds the bytes for each current stream (CuPy's current one and the legacy default
    stream), and its end files a lease on each."""
    dev, drv = fake
    cupy = sys.modules["cupy"]
    s = dev.create_stream("cupy-current")
    t = sm.Tensor.from_host(np.arange(4, dtype=np.float32), device=dev)
    sm.synchronize()
    with cupy.cuda.ExternalStream(s.handle):
        cap = t.__dlpack__(stream=-1)
    (hold,) = [k for k in t.allocation._views if k is not t._token]
    assert sorted(hold.consumers, key=lambda c: c[0].handle) == [(dev.default_stream, True),
                                                                 (s, True)]
    before = sm.stats()
    del cap, hold
    gc_collect_harder()
    assert t.allocation.live_views == 1
    sm.synchronize()
    after = sm.stats()
    assert after.submitted == before.submitted + 2 and after.in_flight == 0


def test_a_marker_whose_context_cannot_be_made_current_is_unknown_not_raised(fake, monkeypatch):
    """Closing an open marker (recording its event) never raises: the work that joined it is
    enqueued already, and must stay filed for its leases. A failure to make the device's
    context current first makes the marker *unknown*, as a failed record does (it raised out of
    close_locked, and so out of the submission whose join recorded it), and takes no event
    from the pool (one was taken first, then lost)."""
    from sharedmem.config import compiled
    from sharedmem.runtime.state import locked
    if compiled():
        pytest.skip("the backend's methods cannot be patched on an instance in the compiled build")
    dev, drv, s, b, before = _quiet_stream(fake, monkeypatch)
    fut = b.fill_zero(stream=s)
    marker = fut._s.marker
    assert not marker.recorded
    err = sm.CudaError("cuCtxSetCurrent failed: CUDA_ERROR_INVALID_CONTEXT (201)", 201)

    def broken():
        raise err

    records = sum(1 for c in drv.calls if c[0] == "record")
    pool = list(dev.backend._events)
    assert pool  # (the settled submissions' events came back to it)
    dev.backend.ensure_context = broken  # (an instance attribute: deleted below)
    try:
        with locked():
            marker.close_locked()  # (no exception)
    finally:
        del dev.backend.ensure_context
    assert marker.recorded and marker.error is err and s._impl.open_marker is None
    assert sum(1 for c in drv.calls if c[0] == "record") == records  # nothing recorded
    assert dev.backend._events == pool  # no event taken from the pool and lost
    with pytest.warns(sm.LeakWarning, match=r"CUDA_ERROR_INVALID_CONTEXT"):
        with pytest.raises(sm.CompletionUnknownError, match=r"^completion of fill_zero on "
                                                            r"<Stream s .* is unknown"):
            fut.result()
    after = sm.stats()
    assert (after.leaked, after.leaked_bytes) == (before.leaked + 1, before.leaked_bytes + 32)


def test_parameters_a_review_found_packed_wrong(fake):
    """interop-cupy.md: scalars are converted to the parameter types read from the kernel's
    source and checked first. Three of them were not: a by-value ``float2`` / ``complex<float>``
    parameter (a type sharedmem does not convert, 8 bytes) took a view -- the buffer's address
    became the value's bits, and a write lease was taken; a finite ``np.longdouble`` beyond a
    float's or double's range became an infinity (``float()`` made it one before the range
    check); ``np.ulonglong`` / ``np.longlong`` were refused as raw addresses where ``np.uint64``
    is taken. No lease is taken by the refused launches."""
    from fake_cuda import RawKernel
    dev, drv = fake
    got = []
    code = """extern "C" __global__ void st(float2 v, float* p) { }
              extern "C" __global__ void fd(float f, double d) { }
              extern "C" __global__ void pp(float* a, float* b) { }"""
    st = RawKernel(drv, "st", ["Q", "Q"], lambda *v: got.append(v), code)
    fd = RawKernel(drv, "fd", ["f", "d"], lambda *v: got.append(v), code)
    pp = RawKernel(drv, "pp", ["Q", "Q"], lambda *v: got.append(v), code)
    x = sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=dev)
    sm.synchronize()
    before = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^argument 0: parameter 'v' \(float2\) is not a "
                                             r"pointer, got an array \(Buffer\)$"):
        sm.launch(st, 1, 1, x, x)
    with pytest.raises(sm.KernelError, match=r"^argument 0: parameter 'v' \(float2\) \(a type "
                                             r"sharedmem does not convert\); got complex"):
        sm.launch(st, 1, 1, 1 + 2j, x)
    big = np.longdouble("1e400")
    assert np.isfinite(big)
    for i, args in ((0, (big, 1.0)), (1, (1.0, big))):
        with pytest.raises(sm.KernelError, match=rf"^argument {i}: np\.longdouble\('1e\+400'\) "
                                                 rf"is out of range for parameter"):
            sm.launch(fd, 1, 1, *args, stream=dev.default_stream)
    assert sm.stats().submitted == before and not x.allocation.tracker
    sm.launch(fd, 1, 1, np.longdouble("inf"), -np.inf, stream=dev.default_stream).result()
    assert got[-1] == (np.inf, -np.inf)
    for raw in (np.uint64(5), np.ulonglong(5), np.longlong(5)):
        sm.launch(pp, 1, 1, raw, x).result()
        assert got[-1] == (5, x.ptr)
    sm.launch(st, 1, 1, np.complex64(1 + 2j), x).result()  # (by value: the scalar's bytes)


def test_an_upload_in_pieces_is_not_cut_by_another_work_s_deferred_error(fake, monkeypatch):
    """A callback error of other work, deferred while an upload goes in pieces, waits for
    the next call: raised by the next piece's submission, it left the destination part
    written and the caller with no future (each piece is a submission of its own)."""
    import sharedmem.backends.cuda as bc
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    monkeypatch.setattr(bc, "STAGE_MAX", 512)
    s = dev.create_stream("upload")
    b = sm.Buffer.zeros(512, "float32", device=dev)  # 2,048 bytes: four pieces
    sm.synchronize()
    real = drv.cuMemcpyHtoDAsync
    n = []

    def copy(*args):
        n.append(1)
        if len(n) == 2:  # (a callback of other work raised meanwhile, on another thread)
            RUNTIME.errors.append(ValueError("other work's callback"))
        return real(*args)
    monkeypatch.setattr(drv, "cuMemcpyHtoDAsync", copy)
    src = np.arange(512, dtype=np.float32)
    f = b.copy_from(src, stream=s)
    assert len(n) == 4
    with pytest.raises(ValueError, match="other work's callback"):
        f.result()
    np.testing.assert_array_equal(b.to_host(), src)


def test_a_context_another_library_made_current_is_seen_in_both_builds(monkeypatch):
    """One device, and another library (PyCUDA's make_context, a cuCtxCreate) makes its own
    context current on this thread between sharedmem's calls: with the hot driver, both
    builds ask the driver which context is current (interpreted, it used to trust its last
    own switch and launch in the other context: CUDA_ERROR_INVALID_CONTEXT, work of unknown
    completion) and make the device's primary context current again."""
    from fake_cuda import RawKernel, install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, True)
    kern = RawKernel(drv, "k", ["Q"], lambda p: None, 'extern "C" __global__ void k(float* x) {}')
    s = dev.create_stream("s")
    b = sm.Buffer.from_host(np.ones(4, np.float32), device=dev, stream=s)
    sm.launch(kern, 1, 1, b, stream=s).result()
    leaked = sm.stats().leaked
    for use in (lambda: sm.launch(kern, 1, 1, b, stream=s).result(),
                lambda: b.fill_zero(stream=s).result(), b.to_host, lambda: s.record().synchronize()):
        drv.cuCtxSetCurrent(0xF00D)  # the other library's context
        use()
        assert drv.current == dev.backend.context_handle
    np.testing.assert_array_equal(b.to_host(), np.zeros(4))
    sm.synchronize()
    assert sm.stats().leaked == leaked  # (no work of unknown completion)


def test_the_current_context_asked_through_ctypes_is_none_where_the_driver_call_fails():
    """``_HotDriver.current_context`` reuses one out parameter per thread: a failed
    ``cuCtxGetCurrent`` (after a fork, at driver teardown) may leave it as the last call left
    it, which must not be reported as current (compiled, the driver's answer starts NULL)."""
    import ctypes
    from sharedmem.backends.cuda import _HotDriver
    answer = {"ctx": 0x1234, "err": 0}

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
    def ctx_get(out):
        if not answer["err"]:
            out[0] = answer["ctx"]
        return answer["err"]

    hot = _HotDriver.__new__(_HotDriver)
    hot._ctx_get = ctx_get
    assert hot.current_context() == 0x1234
    answer["err"] = 3  # CUDA_ERROR_NOT_INITIALIZED, the out parameter untouched
    assert hot.current_context() == 0


def test_a_strided_copy_failing_after_its_first_pieces_leases_what_was_enqueued(fake, monkeypatch):
    """Tensor.copy of a strided tensor enqueues one 2-D copy a piece. A piece that fails after
    others were enqueued raises the CudaError, and the work already on the stream stays leased
    until the stream passes it (its destination was freed at once, under the running pieces)."""
    from fake_cuda import CUresult
    dev, drv = fake
    s = dev.create_stream("s")
    b = sm.Buffer.from_host(np.arange(16, dtype=np.float32), device=dev, stream=s)
    t = sm.Tensor.from_buffer(b, (4, 4), (1, 4))  # transposed: 4 pieces
    sm.synchronize()
    before = sm.stats()
    drv.holding = True
    real, n = drv.cuMemcpy2DAsync, []
    monkeypatch.setattr(drv, "cuMemcpy2DAsync", lambda p, st: (
        n.append(1), (CUresult.CUDA_ERROR_INVALID_VALUE,) if len(n) == 2 else real(p, st))[1])
    with pytest.raises(sm.CudaError, match=r"^cuMemcpy2DAsync failed: CUDA_ERROR_INVALID_VALUE "
                                           r"\(1\)$"):
        t.copy(stream=s)
    gc_collect_harder()
    after = sm.stats()
    assert (after.submitted, after.in_flight, after.live_allocations) == (
        before.submitted + 1, 1, before.live_allocations + 1)  # the destination kept
    drv.holding = False
    drv.finish_held()
    monkeypatch.setattr(drv, "cuMemcpy2DAsync", real)
    np.testing.assert_array_equal(t.copy(stream=s).to_host(), np.arange(16).reshape(4, 4).T)
    sm.synchronize()
    gc_collect_harder()
    assert sm.stats().live_allocations == before.live_allocations


def test_a_capture_whose_context_cannot_be_made_current_at_its_end_still_ends(fake, monkeypatch):
    """The end of a capture makes the device's context current first; where that fails the
    capture is ended all the same (cuStreamEndCapture takes the stream's own context). It was
    left capturing: every later launch on the stream was recorded into a graph nobody runs, its
    future done at once, and to_host returned what the copy never read."""
    import sharedmem.backends.cuda as bc
    from fake_cuda import CUresult
    dev, drv = fake
    s = dev.create_stream("s")
    b = sm.Buffer.zeros(4, "float32", device=dev, stream=s)
    sm.synchronize()
    real = drv.cuCtxSetCurrent
    with pytest.raises(sm.CaptureError, match=r"^capture of graph #\d+ on .* failed: "
                                              r"cuCtxSetCurrent failed: CUDA_ERROR_INVALID_VALUE"):
        with sm.capture(s):
            b.fill_zero(stream=s)
            drv.current = 0  # another library switched contexts; making ours current fails
            bc._current.ctx = None
            monkeypatch.setattr(drv, "cuCtxSetCurrent",
                                lambda c: (CUresult.CUDA_ERROR_INVALID_VALUE,))
    monkeypatch.setattr(drv, "cuCtxSetCurrent", real)
    assert not s._impl.capturing and drv.capturing == {} and drv.graphs == {}
    b.copy_from(np.arange(4, dtype=np.float32), stream=s)
    np.testing.assert_array_equal(b.to_host(stream=s), np.arange(4))


@pytest.mark.parametrize("call", ["cuEventCreate", "cuEventRecord"])
def test_a_capture_that_cannot_record_its_start_is_a_cuda_error_and_begins_nothing(
        fake, monkeypatch, call):
    """sm.capture records an event as it begins; where that fails: the CudaError of the call
    (it was a CompletionUnknownError asking whether a consumer's stream was destroyed), no
    capture begun, the stream usable."""
    from fake_cuda import CUresult
    dev, drv = fake
    s = dev.create_stream("s")
    b = sm.Buffer.zeros(4, "float32", device=dev, stream=s)
    sm.synchronize()
    real = getattr(drv, call)
    monkeypatch.setattr(drv, call, lambda *a: (CUresult.CUDA_ERROR_INVALID_VALUE, None))
    with pytest.raises(sm.CudaError, match=rf"^{call} failed: CUDA_ERROR_INVALID_VALUE \(1\)$"):
        with sm.capture(s):
            pass
    monkeypatch.setattr(drv, call, real)
    assert s._capture is None and not s._impl.capturing and drv.capturing == {}
    b.copy_from(np.arange(4, dtype=np.float32), stream=s)
    np.testing.assert_array_equal(b.to_host(stream=s), np.arange(4))


def test_an_open_marker_whose_record_fails_gives_its_event_back_to_the_pool(fake, monkeypatch):
    """An open marker's event comes from the pool; a cuEventRecord that fails makes the marker
    unknown and gives the event back (it was kept by the leaked marker, neither pooled nor
    destroyed: one CUevent lost a failed record), once."""
    from fake_cuda import CUresult
    from sharedmem.runtime.state import locked
    dev, drv, s, b, before = _quiet_stream(fake, monkeypatch)
    pool = dev.backend._events
    pooled, alive = list(pool), len(drv.events) - drv.destroyed_events
    assert pooled
    real = drv.cuEventRecord
    monkeypatch.setattr(drv, "cuEventRecord", lambda ev, st: (CUresult.CUDA_ERROR_INVALID_VALUE,))
    fut = b.fill_zero(stream=s)
    with pytest.warns(sm.LeakWarning, match=r"cuEventRecord failed"):
        with pytest.raises(sm.CompletionUnknownError):
            fut.result()
    monkeypatch.setattr(drv, "cuEventRecord", real)
    assert fut._s.marker.event is None and sorted(pool) == sorted(pooled)
    assert len(drv.events) - drv.destroyed_events == alive
    with pytest.raises(sm.CudaError, match=r"^cuEventRecord failed"):
        monkeypatch.setattr(drv, "cuEventRecord", lambda ev, st: (CUresult.CUDA_ERROR_INVALID_VALUE,))
        with locked():
            dev.backend.record_marker(s._impl, pooled=True)
    assert sorted(pool) == sorted(pooled)  # (not given back twice)


def test_a_strided_copy_failing_after_its_first_pieces_in_a_capture_is_kept_by_the_graph(
        fake, monkeypatch):
    """As above, into a capture: the pieces recorded before the failure are replayed by the
    graph, so the graph keeps what they touch (it kept nothing: the destination was freed at
    once, and each replay wrote into the memory of whatever was allocated there next)."""
    from fake_cuda import CUresult
    dev, drv = fake
    s = dev.create_stream("s")
    b = sm.Buffer.from_host(np.arange(16, dtype=np.float32), device=dev, stream=s)
    t = sm.Tensor.from_buffer(b, (4, 4), (1, 4))  # transposed: 4 pieces
    sm.synchronize()
    before = sm.stats().live_allocations
    real, n = drv.cuMemcpy2DAsync, []
    monkeypatch.setattr(drv, "cuMemcpy2DAsync", lambda p, st: (
        n.append(1), (CUresult.CUDA_ERROR_INVALID_VALUE,) if len(n) == 2 else real(p, st))[1])
    with sm.capture(s) as g:
        with pytest.raises(sm.CudaError, match=r"^cuMemcpy2DAsync failed: "
                                               r"CUDA_ERROR_INVALID_VALUE \(1\)$"):
            t.copy(stream=s)
    monkeypatch.setattr(drv, "cuMemcpy2DAsync", real)
    gc_collect_harder()
    assert g.launches == 0 and len(g._uses) == 2  # the source and the destination, kept
    assert sm.stats().live_allocations == before + 1
    other = sm.Buffer.from_host(np.full(16, -1, dtype=np.float32), device=dev, stream=s)
    g.replay(s).result(5)
    assert other.to_host(stream=s).tolist() == [-1.0] * 16  # not written by the replay
    g.release()
    sm.synchronize()
    gc_collect_harder()
    assert sm.stats().live_allocations == before + 1  # (other)


def _three_markers(dev, drv):
    """Three fills of one buffer on a new stream, each with its own recorded marker, all
    pending (the fake holds their events)."""
    from sharedmem.runtime.state import locked
    s = dev.create_stream("s")
    b = sm.Buffer.zeros(8, "float32", device=dev, stream=s)
    sm.synchronize()
    drv.holding = True
    futs = []
    for _ in range(3):
        futs.append(b.fill_zero(stream=s))
        with locked():
            futs[-1]._s.marker.close_locked()  # (a marker each)
    drv.holding = False
    return futs


def _unknown_ends_unaskable_middle(drv, futs, err, monkeypatch):
    """The first and the newest of ``futs``' work of unknown completion (``err``); the
    device's context no longer made current, so asking about the middle one raises. Under the
    core lock: the retirer sweeps too, and whichever sweep comes sees it all at once."""
    import sharedmem.backends.cuda as bc
    from fake_cuda import CUresult
    from sharedmem.runtime.state import locked
    with locked():
        futs[0]._s.marker.error = err
        futs[2]._s.marker.error = err
        drv.current = 0  # another library switched contexts; making ours current fails
        bc._current.ctx = None
        monkeypatch.setattr(drv, "cuCtxSetCurrent", lambda c: (CUresult.CUDA_ERROR_INVALID_VALUE,))


def test_a_sweep_that_cannot_ask_past_work_of_unknown_completion_still_finishes_that_work(
        fake, monkeypatch):
    """A sweep that met a marker of unknown completion walks the stream's work one by one;
    where the next query raised (the device's context could not be made current), the work
    it had taken off the stream already -- unknown, counted as leaked -- never reached
    finish(): its callbacks never ran (a then() chained on it hung). Now the sweep stops
    there, hands on what it took, and asks again next time."""
    from sharedmem.config import compiled
    from sharedmem.runtime.state import RUNTIME
    from sharedmem.runtime.submission import add_callback, sweep_all
    if compiled():
        pytest.skip("the fake's context check is not reached by the compiled query")
    dev, drv = fake
    futs = _three_markers(dev, drv)
    ran = threading.Event()
    add_callback(futs[0]._s, ran.set)
    real = drv.cuCtxSetCurrent
    before = sm.stats()
    err = sm.CudaError("cuEventQuery failed: CUDA_ERROR_LAUNCH_FAILED (719)", 719)
    with pytest.warns(sm.LeakWarning, match=r"CUDA_ERROR_LAUNCH_FAILED"):
        _unknown_ends_unaskable_middle(drv, futs, err, monkeypatch)
        with contextlib.suppress(sm.CudaError):  # (the sweep that takes the first -- this
            sweep_all()                           # one or the retirer's -- raises nothing)
        assert ran.wait(5) and futs[0].done()
        with pytest.raises(sm.CudaError):  # (nothing left to take: the error comes out)
            futs[1].done()
        monkeypatch.setattr(drv, "cuCtxSetCurrent", real)
        RUNTIME.errors.clear()  # (the retirer's sweeps' meanwhile)
        drv.held.clear()
        futs[1].result(5)
        with pytest.raises(sm.CompletionUnknownError):
            futs[2].result(5)
    assert sm.stats().leaked == before.leaked + 2  # (the first and the newest)


def test_waiting_for_work_behind_a_query_that_cannot_ask_raises_rather_than_hangs(
        fake, monkeypatch):
    """The walk of a stream's work after a marker of unknown completion stops where a query
    raises (the device's context cannot be made current). Where it took nothing, the error
    must come out as before: a wait for the newest (unknown) submission sweeps in a loop until
    that submission leaves the stream, and a sweep that neither progresses nor raises keeps it
    there forever -- result(timeout) never returned, its timeout not honoured."""
    from sharedmem.config import compiled
    from sharedmem.runtime.state import RUNTIME
    if compiled():
        pytest.skip("the fake's context check is not reached by the compiled query")
    dev, drv = fake
    futs = _three_markers(dev, drv)
    real = drv.cuCtxSetCurrent
    err = sm.CudaError("cuEventQuery failed: CUDA_ERROR_LAUNCH_FAILED (719)", 719)
    got = []

    def waiter():
        try:
            futs[2].result(1)
            got.append(None)
        except BaseException as e:  # noqa: BLE001
            got.append(e)

    t = threading.Thread(target=waiter, daemon=True)
    with pytest.warns(sm.LeakWarning):
        _unknown_ends_unaskable_middle(drv, futs, err, monkeypatch)
        t.start()
        t.join(5)
        hung = t.is_alive()
        monkeypatch.setattr(drv, "cuCtxSetCurrent", real)  # (lets a hung waiter end)
        drv.held.clear()
        t.join(5)
        RUNTIME.errors.clear()  # (the retirer's sweeps' meanwhile)
        with contextlib.suppress(Exception):
            sm.synchronize()
    assert not hung, "result(1) of work behind an unaskable query never returned"
    assert got and isinstance(got[0], (sm.CudaError, TimeoutError)), got


def test_a_view_given_as_stream_is_never_borrowed_as_one(fake, kernels, monkeypatch):
    """A sharedmem view has a ``ptr``, which is how a CuPy stream names its handle: given as
    ``stream=`` (or to ``Stream.from_external`` / ``stream.wait``) its device address was
    borrowed as a CUstream handle, and the launch went to the driver on that "stream". It is
    no stream: a TypeError, nothing borrowed, leased or launched."""
    import sharedmem.device as sm_device
    dev, drv = fake
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)  # (s.wait(x) asks Device(0),
    monkeypatch.setattr(sm_device, "_default", None)            # and the default device)
    saxpy, _ = kernels
    s = dev.create_stream("s")
    x, out = sm.Buffer.zeros(4, device=dev, stream=s), sm.Buffer.zeros(4, device=dev, stream=s)
    box = sm.DeviceBox(1.0, device=dev, stream=s)
    t = sm.Tensor.from_buffer(sm.Buffer.zeros(4, device=dev, stream=s), (4,))
    sm.synchronize()
    submitted, calls = sm.stats().submitted, len(drv.calls)
    for bad in (x, x[0:2], t, box):
        with pytest.raises(TypeError, match=r"^cannot use .* as a stream: it is an array, not a "
                                            r"stream"):
            sm.launch(saxpy, 1, 32, 1.0, sm.In(x), sm.In(x), sm.Out(out), 4, stream=bad)
        with pytest.raises(TypeError, match=r"it is an array, not a stream"):
            sm.Stream.from_external(bad, device=dev)
        with pytest.raises(TypeError, match=r"^Stream\.wait takes an Event or a stream"):
            s.wait(bad)
    assert sm.stats().submitted == submitted and not out.allocation.tracker
    # (no launch, and no driver call given a view's address as a stream)
    assert not [c for c in drv.calls[calls:] if c[0] == "launch" or x.ptr in c[1:]]


def test_array_parameters_are_pointers():
    """A parameter declared as an array (``long long x[]``, ``double y[4]``) is a pointer
    (C adjusts it so): read as an 8-byte scalar, it took a Python int or float as the
    address the kernel dereferences, and refused the array it should take."""
    from interop.cupy_launch import param_types
    code = 'extern "C" __global__ void arr(long long x[], const double y[4], float* z[2], int n) { }'
    assert param_types(code, "arr") == [("p", "long long*", "x"), ("p", "double*", "y"),
                                        ("p", "float**", "z"), ("i", "int", "n")]


def test_array_parameters_take_arrays(fake):
    from fake_cuda import RawKernel
    dev, drv = fake
    got = []
    code = 'extern "C" __global__ void arr(long long x[], double y[4], int n) { }'
    k = RawKernel(drv, "arr", ["Q", "Q", "i"], lambda *v: got.append(v), code)
    x = sm.Buffer.zeros(4, "int64", device=dev)
    y = sm.Buffer.zeros(4, "float64", device=dev)
    sm.launch(k, 1, 1, sm.InOut(x), sm.In(y), 4).result()
    assert got == [(x.ptr, y.ptr, 4)]
    before = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^argument 0: parameter 'x' \(long long\*\) is a "
                                             r"pointer, got int 5; pass the array"):
        sm.launch(k, 1, 1, 5, 1.0, 4, stream=dev.default_stream)
    assert sm.stats().submitted == before


def test_parameters_with_default_arguments_are_read_by_their_names(fake):
    """A default argument (``int n = 0``) is no part of the parameter's type or name: it was
    read as type 'int n =' named '0', and a Python int for it refused."""
    from fake_cuda import RawKernel
    from interop.cupy_launch import param_types
    dev, drv = fake
    got = []
    code = 'extern "C" __global__ void dflt(float* p = nullptr, int n = 0, double f = 1.5) { }'
    assert param_types(code, "dflt") == [("p", "float*", "p"), ("i", "int", "n"),
                                         ("f", "double", "f")]
    k = RawKernel(drv, "dflt", ["Q", "i", "d"], lambda *v: got.append(v), code)
    x = sm.Buffer.zeros(4, "float32", device=dev)
    sm.launch(k, 1, 1, x, 3, 2.5).result()
    assert got == [(x.ptr, 3, 2.5)]


def test_a_kernel_defined_twice_in_its_source_has_no_types_read(fake):
    """Two definitions of one kernel (``#if`` / ``#else``, or an old one left under ``#if
    0``) whose parameter types differ: which one is compiled is the preprocessor's, so
    neither is read (sizes only, as without the source). The first was taken: a Python int
    was packed as the int the first names where the compiled kernel takes a float (its bits,
    2.8e-45), with no error. A declaration and its definition agree: read."""
    from fake_cuda import RawKernel
    from interop.cupy_launch import param_types
    dev, drv = fake
    got = []
    code = """
    #ifndef USE_FLOAT
    extern "C" __global__ void two(int a, float* x) { }
    #else
    extern "C" __global__ void two(float a, float* x) { }
    #endif
    """
    k = RawKernel(drv, "two", ["f", "Q"], lambda *v: got.append(v), code)  # (-DUSE_FLOAT)
    x = sm.Buffer.zeros(4, "float32", device=dev)
    with pytest.raises(sm.KernelError, match=r"^argument 0: a 4-byte parameter of unknown type"):
        sm.launch(k, 1, 1, 2, x)
    assert param_types(code, "two") is None
    sm.launch(k, 1, 1, np.float32(2), x).result()
    assert got == [(2.0, x.ptr)]
    declared = """extern "C" __global__ void two(int n, float* x);
                  extern "C" __global__ void two(int count, float* out) { }"""
    assert param_types(declared, "two") == [("i", "int", "n"), ("p", "float*", "x")]


def test_a_half_parameter_refuses_a_longdouble_beyond_its_range(fake):
    """interop-cupy.md: a finite number beyond a half parameter's range (an np.longdouble
    can be) raises KernelError. A finite np.longdouble beyond a double's range became an
    infinity (float() made it one) and was packed as half's +inf."""
    from fake_cuda import RawKernel
    dev, drv = fake
    got = []
    code = 'extern "C" __global__ void h(half v) { }'
    k = RawKernel(drv, "h", ["e"], lambda v: got.append(v), code)
    big = np.longdouble("1e400")
    assert np.isfinite(big)
    st = dev.create_stream("half")
    for v in (big, -big):
        with pytest.raises(sm.KernelError, match=r"^argument 0: np\.longdouble\('-?1e\+400'\) "
                                                 r"is out of range for parameter 'v' \(half\)$"):
            sm.launch(k, 1, 1, v, stream=st)
    sm.launch(k, 1, 1, np.longdouble("inf"), stream=st).result()
    sm.launch(k, 1, 1, np.longdouble("0.5"), stream=st).result()
    assert got == [np.inf, 0.5]


def test_with_length_fills_no_parameter_of_a_type_sharedmem_does_not_convert(fake):
    """``with_length=True`` fills the pointer and the next, integer, parameter. A next one
    of a type known from the source but not converted (``float2``: 8 bytes) took the length's
    integer bytes as its value; it is refused by name, with no lease (without the source,
    only sizes are known, and a 4- or 8-byte parameter takes the length; so does one of a
    type that may be an int, a typedef)."""
    from fake_cuda import RawKernel
    dev, drv = fake
    got = []
    code = 'extern "C" __global__ void vec(float* x, float2 v) { }'
    k = RawKernel(drv, "vec", ["Q", "Q"], lambda *v: got.append(v), code)
    blind = RawKernel(drv, "vec", ["Q", "q"], lambda *v: got.append(v))  # (no source)
    x = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()
    before = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^argument 0: with_length=True, but the next "
                                             r"parameter is parameter 'v' \(float2\), not an "
                                             r"int$"):
        sm.launch(k, 1, 1, sm.InOut(x, with_length=True))
    assert sm.stats().submitted == before and got == []
    sm.launch(blind, 1, 1, sm.InOut(x, with_length=True)).result()
    assert got == [(x.ptr, 8)]
    # a type sharedmem does not convert that may be an int (a typedef of one) takes it, by size
    typed = RawKernel(drv, "typed", ["Q", "q"], lambda *v: got.append(v),
                      'typedef long long idx_t;\n'
                      'extern "C" __global__ void typed(float* x, idx_t n) { }')
    sm.launch(typed, 1, 1, sm.InOut(x, with_length=True)).result()
    assert got[-1] == (x.ptr, 8)
    for vec in ("double2", "int2", "cuFloatComplex", "__half2"):
        k2 = RawKernel(drv, "vec", ["Q", "Q"], lambda *v: got.append(v),
                       f'extern "C" __global__ void vec(float* x, {vec} v) {{ }}')
        with pytest.raises(sm.KernelError, match=rf"^argument 0: with_length=True, but the next "
                                                 rf"parameter is parameter 'v' \({vec}\), not "
                                                 rf"an int$"):
            sm.launch(k2, 1, 1, sm.InOut(x, with_length=True))


def test_with_length_beyond_a_4_byte_parameter_of_unknown_type_is_a_kernel_error(fake):
    """Without the source, a 4-byte parameter after a with_length array takes its length:
    one of 2**32 elements or more raised OverflowError from int.to_bytes (not KernelError,
    not naming the argument). (4 GiB of fake device memory, never touched.)"""
    from fake_cuda import RawKernel
    dev, drv = fake
    got = []
    blind = RawKernel(drv, "blind", ["Q", "i"], lambda *v: got.append(v))
    try:
        big = sm.Buffer.empty(1 << 32, "uint8", device=dev)
    except (MemoryError, sm.SharedMemError):
        pytest.skip("no 4 GiB of address space for the fake device memory")
    sm.synchronize()
    before = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^argument 0: with_length=True, but its length, "
                                             r"4294967296 elements, does not fit the next "
                                             r"parameter, a 4-byte parameter of unknown type, "
                                             r"which takes 0\.\.4294967295; launch it on fewer "
                                             r"elements$"):
        sm.launch(blind, 1, 1, sm.InOut(big, with_length=True))
    assert sm.stats().submitted == before and got == []
    sm.launch(blind, 1, 1, sm.InOut(big[:(1 << 32) - 1], with_length=True)).result()
    assert got == [(big.ptr, -1)]


def test_an_int_for_a_float_parameter_is_rounded_once(fake):
    """An int (Python or NumPy) for a ``float`` parameter is the float nearest it: past a
    double's 53 bits, float() rounded it to a double and packing rounded that again, which
    can land on the float below (2**54 + 2**30 + 1 became 2**54, not 2**54 + 2**31), and an
    int just below the float range's end (FLT_MAX plus half its last place, less 1) was
    refused as out of range."""
    from fake_cuda import RawKernel
    dev, drv = fake
    got = []
    code = 'extern "C" __global__ void f32(float f) { }'
    k = RawKernel(drv, "f32", ["f"], lambda f: got.append(f), code)
    st = dev.create_stream("f32")
    n = 2 ** 54 + 2 ** 30 + 1
    top = 2 ** 128 - 2 ** 103 - 1
    for v in (n, -n, np.int64(n), np.uint64(n), top, 2 ** 64 - 1, 2 ** 54 + 2 ** 30,
              2 ** 54 + 3 * 2 ** 30):
        sm.launch(k, 1, 1, v, stream=st).result()
    assert got == [2.0 ** 54 + 2 ** 31, -(2.0 ** 54 + 2 ** 31), 2.0 ** 54 + 2 ** 31,
                   2.0 ** 54 + 2 ** 31, float(np.finfo(np.float32).max), 2.0 ** 64,
                   2.0 ** 54, 2.0 ** 54 + 2 ** 32]
    with pytest.raises(sm.KernelError, match=rf"^argument 0: {top + 1} is out of range for "
                                             rf"parameter 'f' \(float\)$"):
        sm.launch(k, 1, 1, top + 1, stream=st)


def test_grid_constant_parameters_are_read(fake):
    """``const __grid_constant__ int n`` (CUDA 11.7+: any const kernel parameter may be one)
    is an int: read as type '__grid_constant__ int', which sharedmem does not convert, a
    Python int for it was refused."""
    from fake_cuda import RawKernel
    from interop.cupy_launch import param_types
    dev, drv = fake
    got = []
    code = 'extern "C" __global__ void gc(float* x, const __grid_constant__ int n) { }'
    assert param_types(code, "gc") == [("p", "float*", "x"), ("i", "int", "n")]
    k = RawKernel(drv, "gc", ["Q", "i"], lambda *v: got.append(v), code)
    x = sm.Buffer.zeros(4, "float32", device=dev)
    sm.launch(k, 1, 1, x, 4).result()
    assert got == [(x.ptr, 4)]


@pytest.mark.parametrize("bit", ["conjugate", "negative"])
def test_a_torch_tensor_with_a_lazy_conjugate_or_negative_bit_is_refused(fake, kernels,
                                                                          monkeypatch, bit):
    """torch conjugates and negates lazily: ``z.conj()`` and ``z.conj().imag`` are views of
    ``z``'s memory with a bit set, the values as they are in memory. A launch passed their
    pointer: the kernel read the values unconjugated (unnegated), silently wrong. Refused by
    name, with the call that resolves it; nothing leased, nothing launched."""
    dev, drv = fake
    saxpy, _ = kernels
    torch = _fake_torch(monkeypatch, dev)
    n = 16
    x, out = torch.Tensor(np.arange(n, dtype=np.float32)), torch.Tensor(np.zeros(n, np.float32))
    setattr(x, "conj_bit" if bit == "conjugate" else "neg_bit", True)
    s = dev.create_stream("s")
    sm.synchronize()
    before = sm.stats()
    fix = "resolve_conj" if bit == "conjugate" else "resolve_neg"
    with pytest.raises(sm.KernelError, match=rf"^a torch tensor with the {bit} bit set \(shape "
                                             rf"\(16,\), torch.float32\) cannot be a kernel "
                                             rf"argument: its memory holds the values without "
                                             rf"the {bit} applied, which the kernel would read "
                                             rf"as they are; pass x.{fix}\(\) \(a tensor that "
                                             rf"holds them\)$"):
        sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(x), out, n, stream=s)
    assert sm.stats().submitted == before.submitted and sm.stats().in_flight == 0
    x.conj_bit = x.neg_bit = False  # (resolved: the same memory, the bits clear)
    sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(x), out, n, stream=s).result()
    np.testing.assert_array_equal(out.host, 3 * np.arange(n))


@pytest.mark.parametrize("bit", ["conjugate", "negative"])
def test_a_lazy_bit_set_after_the_tensors_facts_were_learned_is_refused(fake, kernels,
                                                                       monkeypatch, bit):
    """torch sets a tensor's lazy bits in place without moving its memory: ``t.data =
    t.conj()`` (``set_data`` copies the key set, the conjugate bit with it; ``_neg_view`` the
    negative one), data pointer, shape, strides and dtype unchanged. The facts learned by an
    earlier launch were found again by those alone: the kernel read the values without the
    bit, silently wrong. Refused as for a tensor first seen with it; nothing leased."""
    dev, drv = fake
    saxpy, _ = kernels
    torch = _fake_torch(monkeypatch, dev)
    n = 16
    x, out = torch.Tensor(np.arange(n, dtype=np.float32)), torch.Tensor(np.zeros(n, np.float32))
    s = dev.create_stream("s")
    sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(x), out, n, stream=s).result()
    setattr(x, "conj_bit" if bit == "conjugate" else "neg_bit", True)  # (in place: same memory)
    sm.synchronize()
    before = sm.stats()
    with pytest.raises(sm.KernelError, match=rf"^a torch tensor with the {bit} bit set"):
        sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(x), out, n, stream=s)
    assert sm.stats().submitted == before.submitted and sm.stats().in_flight == 0


def test_a_torch_zero_tensor_is_refused_not_launched_with_a_null_pointer(fake, kernels,
                                                                        monkeypatch):
    """torch's efficient zero tensor (``torch._efficientzerotensor``, what forward-mode AD
    and some backward formulas make) is lazy too: its ZeroTensor key says every element is 0,
    and it has no memory -- its data pointer, and its storage's, are NULL whatever its shape.
    Its facts were learned over an allocation imported at address 0 (the driver names no
    memory there: the storage's region) and the kernel was given NULL to read, an illegal
    address that breaks the context for good. Refused by name, with the call that makes
    a tensor of its zeros; nothing leased, nothing launched."""
    dev, drv = fake
    saxpy, _ = kernels
    torch = _fake_torch(monkeypatch, dev)
    n = 16

    class ZeroTensor(torch.Tensor):
        def data_ptr(self):
            return 0

        def _is_zerotensor(self):
            return True

        def untyped_storage(self):  # (NULL too, of the tensor's size in bytes)
            return types.SimpleNamespace(data_ptr=lambda: 0, nbytes=lambda: self.host.nbytes)

    z, out = ZeroTensor(np.zeros(n, np.float32)), torch.Tensor(np.zeros(n, np.float32))
    refuse = _refused_launches(drv, monkeypatch)
    refuse.extend([True] * 4)  # (a launch that got through would not run NULL: refused)
    s = dev.create_stream("s")
    sm.synchronize()
    before = sm.stats()
    with pytest.raises(sm.KernelError, match=r"^a torch zero tensor \(shape \(16,\), "
                                             r"torch.float32\) cannot be a kernel argument: "
                                             r"it has no memory.*x.clone\(\)"):
        sm.launch(saxpy, 1, 16, 2.0, sm.In(z), sm.In(z), out, n, stream=s)
    assert len(refuse) == 4  # (no launch was tried)
    assert sm.stats().submitted == before.submitted and sm.stats().in_flight == 0


def test_a_raw_stream_handle_held_as_a_numpy_integer_is_borrowed_as_the_int(fake):
    """A raw CUstream handle NumPy holds (``handles[0]`` of an array of them) was a TypeError
    ("give ... an int"). It is the int it holds: the same Stream, on a launch's ``stream=``
    too; a NumPy bool is no handle."""
    dev, drv = fake
    handle = int(drv.cuStreamCreate(1)[1])
    s = sm.Stream.from_external(handle, dev)
    assert sm.Stream.from_external(np.int64(handle), dev) is s
    assert sm.Stream.from_external(np.uint64(handle), dev) is s
    x = sm.Buffer.zeros(4, "float32", device=dev)
    assert x.fill_zero(stream=np.array([handle], np.uint64)[0]).result() is None
    assert sm.Stream.from_external(np.int64(0), dev) is dev.default_stream
    with pytest.raises(TypeError, match=r"^cannot use np.True_ as a stream|"
                                        r"^cannot use True as a stream"):
        sm.Stream.from_external(np.bool_(True), dev)


def test_a_marker_recycled_while_it_is_asked_reads_done(fake, monkeypatch):
    """``sm.synchronize()`` asks a stream's newest marker outside the core lock, after
    waiting for it; the retirer thread may retire that submission meanwhile and recycle the
    marker's pooled event -- between ``query()``'s check that it still has one and the driver
    call, which was then given None: TypeError from the fake driver (the intermittent failure
    of test_a_long_lived_view_keeps_no_cupy_stream_its_user_let_go, interpreted), a query of
    the NULL event on a real one. A marker recycled is done: its work was found finished."""
    from sharedmem.runtime.state import locked
    dev, drv = fake
    if dev.backend.hot is not None:
        pytest.skip("the hot driver asks by the handle, which a recycle leaves")
    s = dev.create_stream("s")
    with locked():
        m = dev.backend.record_marker(s._impl, pooled=True)
    real = drv.cuThreadExchangeStreamCaptureMode

    def exchange(mode):  # (the driver call made between the check and the query)
        m.recycle()  # (the retirer, in another thread, retired the work and recycled it)
        return real(mode)

    monkeypatch.setattr(drv, "cuThreadExchangeStreamCaptureMode", exchange)
    assert m.query() == 1
    assert m.event is None


def test_an_import_never_raises_other_works_deferred_error_after_consuming_its_capsule(
        fake, monkeypatch):
    """An error a callback of other work raised is re-raised as the next API call begins,
    never between its parts. A DLPack import on a CUDA device re-raised it from its last
    part, the arrival's submission -- after the capsule was consumed: the tensor was dropped
    with the error (the producer's deleter ran) and the capsule could not be imported again.
    The import now succeeds and the error waits for the next call."""
    import sharedmem.device as sm_device
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)  # (an import probes Device(0))
    cap, mem, deleted, m = _foreign_capsule(drv)
    sm.synchronize()
    RUNTIME.errors.append(ZeroDivisionError("a then() function of other work"))
    t = sm.from_dlpack(cap)
    assert (t.ptr, t.shape, t.device) == (mem.ctypes.data, (4,), dev) and deleted == []
    with pytest.raises(ZeroDivisionError, match=r"^a then\(\) function of other work$"):
        sm.stats()  # (the next call)
    del t
    sm.synchronize()
    gc_collect_harder()
    assert deleted == [ctypes.addressof(m)]


def _foreign_capsule(drv):
    """A foreign producer's versioned DLPack capsule of 4 float32s of fake device memory:
    ``(capsule, the memory, the list its deleter appends the struct's address to, the
    DLManagedTensorVersioned)`` -- the struct keeps its deleter and shape alive."""
    import interop.dlpack as dl
    mem = np.zeros(64, np.uint8)
    drv.ranges[mem.ctypes.data] = mem.nbytes
    deleted = []
    deleter, shape = dl._DELETER(deleted.append), (ctypes.c_int64 * 1)(4)
    m = dl.DLManagedTensorVersioned()
    m.version.major, m.deleter = 1, deleter
    m._keep = (deleter, shape)
    d = m.dl_tensor
    d.data, d.device.device_type, d.ndim = mem.ctypes.data, dl.kDLCUDA, 1
    d.dtype.code, d.dtype.bits, d.dtype.lanes = dl.kDLFloat, 32, 1
    d.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    cap = dl._capsule_new(ctypes.addressof(m), b"dltensor_versioned", dl._CAPSULE_DESTRUCTOR())
    return cap, mem, deleted, m


def test_the_registered_adapters_coerce_as_c_functions_and_an_override_is_called(
        fake, kernels, monkeypatch):
    """Compiled, the registered CuPy and cuTile adapters give the launch path their coerce as a
    C function (``KernelAdapter._coerce_addr``, set on the instance; 0 interpreted). A launch
    of CuPy arrays leases them through it; what it raises reaches the caller with nothing
    leased. An adapter of a subclass that overrides ``coerce`` has its own called -- also
    where the subclass sets ``_coerce_addr`` on its class, which the launch path ignores."""
    import interop.cupy as icp
    import interop.cupy_launch as icl
    import interop.cutile as ict
    L = sys.modules["sharedmem.launch"]  # (the package's `launch` is the function)
    dev, drv = fake
    saxpy, _ = kernels
    compiled = sm.show_config(open(os.devnull, "w"))["core"].startswith("compiled")
    assert (icp._adapter._coerce_addr != 0) == compiled == (icl.COERCE_ADDR != 0)
    assert (ict._adapter._coerce_addr != 0) == compiled
    assert L.adapter_for(saxpy) is icp._adapter
    n = 16
    x, y, out = _fake_cupy_arrays(monkeypatch, dev, n, 3)
    sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(y), sm.Out(out), n).result()
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 1.0))  # 2 * 0 + 1

    class Broken(type(x)):
        @property
        def shape(self):
            raise RuntimeError("no shape today")

        @shape.setter
        def shape(self, value):
            pass

    bad = Broken(np.zeros(n, np.float32))
    sm.synchronize()
    before = sm.stats()
    with pytest.raises(RuntimeError, match="no shape today"):
        sm.launch(saxpy, 1, 16, 2.0, sm.In(x), sm.In(bad), sm.Out(out), n)
    assert sm.stats().in_flight == before.in_flight == 0 and sm.stats().submitted == \
        before.submitted

    seen = []

    class Mine(icp.RawKernelAdapter):
        _coerce_addr = icl.COERCE_ADDR  # (on the class: not the launch path's to call)

        def coerce(self, obj, device):
            seen.append(obj)
            return super().coerce(obj, device)

    class MyKernel(type(saxpy)):  # (a kernel type of its own: registered for this test only)
        pass

    mine = copy.copy(saxpy)
    mine.__class__ = MyKernel
    sm.register_kernel_adapter(MyKernel, Mine())
    sm.launch(mine, 1, 16, 3.0, sm.In(x), sm.In(y), sm.Out(out), n).result()
    assert seen == [x, y, out]
    np.testing.assert_array_equal(out._block.to_host(), np.full(n, 1.0))  # 3 * 0 + 1
    sm.synchronize()
