"""Consumers' streams at the boundary, on the fake CUDA driver: per-thread default streams of
two threads are ordered with each other, and a hold's end on a borrowed stream is recorded
at once (its owner may destroy the stream right after). Found by review of the session that
made default-stream exports and holds' ends cheaper; each test failed on that version."""
import threading

import numpy as np
import pytest

import sharedmem as sm
from test_cuda_backend_fake import fake  # noqa: F401  (the fixture)
from conftest import gc_collect_harder


def _in_thread(fn):
    out = []
    th = threading.Thread(target=lambda: out.append(fn()))
    th.start()
    th.join()
    return out[0]


def test_two_ptds_consumers_on_different_threads_are_ordered(fake):
    """stream=2 is the *calling thread's* per-thread default stream. Consumer A (thread A) may
    write through its export; consumer B (thread B) then exports with stream=2. Two per-thread
    default streams do not synchronize with each other (only with the legacy stream), so B's
    stream must be made to wait, although both map to dev.default_stream."""
    dev, drv = fake
    t = sm.Tensor.from_host(np.ones(16, np.float32), device=dev)
    sm.synchronize()
    cap_a = _in_thread(lambda: t.__dlpack__(stream=2, max_version=(1, 0)))  # A: open hold
    mark = len(drv.calls)
    cap_b = _in_thread(lambda: t.__dlpack__(stream=2, max_version=(1, 0)))  # B
    waits = [c for c in drv.calls[mark:] if c[0] == "wait" and c[1] == 2]
    del cap_a, cap_b
    gc_collect_harder()
    assert waits, "consumer B's per-thread stream was not ordered after consumer A's hold"


def test_ptds_consumer_after_another_threads_ended_hold(fake):
    """Same, with A's hold already ended (its bytes leased on the default stream until the
    stream passes that point): B on another thread's per-thread stream is not ordered."""
    dev, drv = fake
    t = sm.Tensor.from_host(np.ones(16, np.float32), device=dev)
    sm.synchronize()
    drv.holding = True  # A's work "in flight": events recorded from now on stay pending
    try:
        cap_a = _in_thread(lambda: t.__dlpack__(stream=2, max_version=(1, 0)))
        del cap_a
        gc_collect_harder()  # A's hold ends: a lease on dev.default_stream
        mark = len(drv.calls)
        cap_b = _in_thread(lambda: t.__dlpack__(stream=2, max_version=(1, 0)))
        waits = [c for c in drv.calls[mark:] if c[0] == "wait" and c[1] == 2]
        del cap_b
    finally:
        drv.holding = False
        drv.finish_held()
    gc_collect_harder()
    assert waits, "consumer B's per-thread stream was not ordered after A's ended hold"


def test_hold_end_lease_outlives_the_consumer_stream(fake, monkeypatch):
    """A consumer on its own stream h (a CuPy stream in a `with` block) drops its array -- the
    hold ends -- and then drops the stream (cuStreamDestroy returns at once; its work may still
    run). Were the hold's end only to *join* h's open marker, the event would be recorded
    later (the retirer's next sweep), on the destroyed handle. Modelled here: the driver hands
    the freed handle out again to a new, idle stream (handles are driver heap pointers): the
    late record lands on the new stream, completes at once, and the allocation is freed while
    the old stream's kernel still uses it."""
    import types, weakref
    import sharedmem.runtime.retirer as ret
    import sharedmem.runtime.submission as sub
    # the retirer thread sweeps nothing during the test (its next pass comes at a time of
    # its choosing; the test makes that moment "after the consumer destroyed its stream")
    monkeypatch.setattr(ret, "_sub", types.SimpleNamespace(
        SWEEP_EVERY=sub.SWEEP_EVERY, sweep_each=lambda streams, seen=None: None))
    dev, drv = fake
    busy = set()          # streams with work in flight (the old h until "finish")
    real_record = drv.cuEventRecord

    def record(ev, stream):  # events recorded on a busy stream stay pending
        r = real_record(ev, stream)
        if int(stream) in busy:
            drv.held.add(int(ev))
        return r
    drv.cuEventRecord = record
    ok, h = drv.cuStreamCreate(1)
    h = int(h)
    t = sm.Tensor.from_host(np.ones(16, np.float32), device=dev)
    sm.synchronize()
    alloc = weakref.ref(t.allocation)
    cap = t.__dlpack__(stream=h, max_version=(1, 0))
    busy.add(h)           # the consumer's kernel on h reads the bytes
    t.release()
    del t, cap            # the consumer drops its array: the hold ends (the only view left)
    gc_collect_harder()
    busy.discard(h)       # the consumer destroys h; the driver reuses the handle for a new,
    #                       idle stream (the old stream's kernel is still running)
    from sharedmem.runtime.submission import sweep_all
    sweep_all()           # a retirement sweep (the retirer's next pass, ~0.2 ms later)
    gc_collect_harder()
    freed = alloc() is None
    drv.finish_held()
    assert not freed, "the allocation was freed while the consumer's kernel still used it"


def test_a_foreign_stream_object_is_borrowed_once_and_not_kept_alive(fake, monkeypatch):
    """Stream.from_external remembers the object it borrowed last (a launch loop passing the
    same CuPy stream as stream=), through a weak reference: the same Stream comes back while
    it lives, and the memo keeps neither it nor the object alive."""
    import weakref

    import sharedmem.device as sm_device

    dev, drv = fake
    # from_external(obj) without a device borrows on the default device: the fake one here,
    # and only for this test (default_device() caches its answer)
    monkeypatch.setattr(sm_device, "_default", dev)

    class CupyStyleStream:  # what borrow_stream reads of a cupy.cuda.Stream
        def __init__(self, ptr):
            self.ptr = ptr

    obj = CupyStyleStream(0x7A11)
    s1 = sm.Stream.from_external(obj)
    assert sm.Stream.from_external(obj) is s1 and s1.handle == 0x7A11
    other = CupyStyleStream(0x7A12)
    s2 = sm.Stream.from_external(other)
    assert s2 is not s1 and s2.handle == 0x7A12
    assert sm.Stream.from_external(obj) is s1  # (found by its handle again)
    # an object that names another stream now is borrowed anew, not taken for the one it
    # named (as_stream, which launches use, and from_external alike)
    from sharedmem.stream import as_stream
    assert as_stream(obj) is s1 and as_stream(s1) is s1
    obj.ptr = 0x7A13
    s3 = as_stream(obj)
    assert s3 is not s1 and s3.handle == 0x7A13 and sm.Stream.from_external(obj) is s3
    obj.ptr = 0x7A11
    assert as_stream(obj) is s1
    del s3
    alive_stream, alive_obj = weakref.ref(s2), weakref.ref(other)
    del s2, other
    gc_collect_harder()
    assert alive_stream() is None and alive_obj() is None


def test_dlpack_export_to_a_stream_in_another_librarys_capture_is_refused(fake):
    """A DLPack consumer names its stream h while h is capturing a graph sharedmem did not
    start (``torch.cuda.graph``, ``cupy.cuda.Stream.begin_capture``). The export's wait for our
    pending write would be enqueued on h -- a wait on an event recorded outside the capture,
    which the driver refuses (and which invalidates the consumer's capture) -- and the hold's
    end would be an event recorded into the capture, which marks nothing that runs now. As for
    a stream sharedmem captures, and for a launch ordered after such a stream: CaptureError,
    nothing waited for on h, nothing exported (no hold left); after the capture, the export."""
    dev, drv = fake
    _an_export_to_a_foreign_capture_is_refused(
        dev, drv, lambda buf, h: buf.__dlpack__(stream=h, max_version=(1, 0)),
        r"is capturing a CUDA graph")


def test_a_copying_export_checks_its_stream_before_it_copies(fake):
    """``copy=True`` with a stream value DLPack refuses (0, a float) raises as an export
    without a copy does -- before the copy is made and the device synchronized, not after."""
    dev, drv = fake
    t = sm.Tensor.from_host(np.arange(8, dtype=np.float32), device=dev)
    sm.synchronize()
    mark = len(drv.calls)
    with pytest.raises(ValueError, match=r"^stream=0 is ambiguous in DLPack"):
        t.__dlpack__(stream=0, max_version=(1, 0), copy=True)
    with pytest.raises(TypeError, match=r"^stream must be an int or None, got float$"):
        t.__dlpack__(stream=1.0, max_version=(1, 0), copy=True)
    assert drv.calls[mark:] == [] and t.allocation.live_views == 1  # (no copy made: no event
    cap = t.__dlpack__(stream=1, max_version=(1, 0), copy=True)     # recorded to read it)
    assert drv.calls[mark:]
    del cap


def _exported_under(view, stream):
    """A CUDA Array Interface export of ``view`` with ``stream`` CuPy's current stream, the
    dict dropped at once (as ``cupy.asarray(view)`` under ``with stream:`` reads it)."""
    with stream:
        view.__cuda_array_interface__


def _consumer_handles(view):
    return [c[0].handle for c in view._export.consumers]


def test_a_long_lived_view_keeps_no_cupy_stream_its_user_let_go(fake):
    """A view exported through the CUDA Array Interface under a new CuPy stream per request
    (a served model's weights): its hold kept every such stream -- and its CUDA stream, which
    CuPy destroys when the object is collected -- alive as long as the view, and a launch
    writing the view waited on each. A stream only sharedmem keeps ends its hold entry when
    the next consumer comes: stream-ordered, as the hold's end would."""
    import gc
    import sys
    import weakref
    dev, drv = fake
    cp = sys.modules["cupy"]
    w = sm.Tensor.from_host(np.ones(16, np.float32), device=dev)
    sm.synchronize()
    refs = []
    for _ in range(50):
        s = cp.cuda.Stream(non_blocking=True)
        refs.append(weakref.ref(s))
        _exported_under(w, s)
        del s
    assert _consumer_handles(w) == [0, refs[-1]().ptr]  # (the default stream, the newest)
    sm.synchronize()
    gc.collect()
    assert [r for r in refs if r() is not None] == [refs[-1]]
    del w
    gc_collect_harder()
    sm.synchronize()
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_let_go_consumer_streams_hold_ends_stream_ordered(fake):
    """The ended entry is a lease until a marker recorded on that stream when it ended: a
    later write of the view on another stream waits for it on the device."""
    import sys
    dev, drv = fake
    cp = sys.modules["cupy"]
    w = sm.Buffer.from_host(np.ones(16, np.float32), device=dev)
    t = dev.create_stream("writer")
    sm.synchronize()
    drv.holding = True  # (the consumer's work "in flight": its marker stays pending)
    try:
        first = cp.cuda.Stream(non_blocking=True)
        h = first.ptr
        _exported_under(w, first)
        del first
        mark = len(drv.calls)
        _exported_under(w, cp.cuda.Stream(non_blocking=True))  # (the next consumer)
        # (recorded there twice: the new consumer's order after the open hold, then its end)
        recorded = [c[1] for c in drv.calls[mark:] if c[0] == "record" and c[2] == h]
        assert recorded and h not in _consumer_handles(w)
        mark = len(drv.calls)
        w.fill_zero(stream=t)
        assert ("wait", t.handle, recorded[-1]) in drv.calls[mark:]
    finally:
        drv.holding = False
        drv.finish_held()
    sm.synchronize()


def test_consumer_streams_their_user_keeps_or_does_not_own_stay_held(fake):
    """Only a CuPy-made stream nobody else keeps is let go: one the user still has, and an
    ExternalStream (its CUDA stream lives on: the user may wrap the handle again) stay held
    until the view is collected."""
    import sys
    dev, drv = fake
    cp = sys.modules["cupy"]
    w = sm.Tensor.from_host(np.ones(16, np.float32), device=dev)
    kept = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
    for s in kept:
        _exported_under(w, s)
    other = cp.cuda.Stream(non_blocking=True)  # (a CUDA stream that outlives its wrappers)
    _exported_under(w, cp.cuda.ExternalStream(other.ptr))
    _exported_under(w, cp.cuda.Stream(non_blocking=True))
    assert _consumer_handles(w)[:5] == [0] + [s.ptr for s in kept] + [other.ptr]
    sm.synchronize()


def test_record_use_lets_go_of_cupy_streams_their_user_dropped(fake):
    """sm.record_use on a new CuPy stream per call makes the view a hold for each; a stream
    its user dropped ends its entry when the next one is declared."""
    import gc
    import sys
    import weakref
    dev, drv = fake
    cp = sys.modules["cupy"]
    w = sm.Tensor.from_host(np.ones(16, np.float32), device=dev)
    refs = []
    for _ in range(10):
        s = cp.cuda.Stream(non_blocking=True)
        refs.append(weakref.ref(s))
        sm.record_use(w, s)
        del s
    assert [c[0].handle for c in w._live_token().consumers] == [refs[-1]().ptr]
    sm.synchronize()
    gc.collect()
    assert [r for r in refs if r() is not None] == [refs[-1]]


def _held_wait(drv, t, h, mark):
    """Whether a launch on ``t`` since ``mark`` waited for an event recorded on ``h`` after
    ``mark`` (the consumer's work enqueued so far)."""
    recorded = [c[1] for c in drv.calls[mark:] if c[0] == "record" and c[2] == h]
    return any(("wait", t.handle, ev) in drv.calls[mark:] for ev in recorded)


def test_a_cupy_stream_its_user_keeps_as_a_sharedmem_stream_stays_held(fake):
    """The user borrowed a CuPy stream (Stream.from_external: "the object is kept alive by
    the returned Stream") and kept only the sharedmem Stream: they can still give foreign
    work to it (its handle, __cuda_stream__: an ExternalStream, cuda.core, torch). Its
    consumer entries -- a record_use, a CAI export under a wrapper of its handle -- must stay
    held when the next consumer comes, and a later write waits for work given to it since."""
    import sys
    dev, drv = fake
    cp = sys.modules["cupy"]
    t = dev.create_stream("writer")
    for how in ("record_use", "cai", "lookup", "fut.stream"):
        w = sm.Buffer.from_host(np.ones(16, np.float32), device=dev)
        sm.synchronize()
        s = cp.cuda.Stream(non_blocking=True)
        if how == "lookup":  # (borrowed by an export, then found by its handle)
            _exported_under(w, s)
            mine = sm.Stream.lookup(dev, s.ptr)
        elif how == "fut.stream":  # (borrowed by a copy given the CuPy stream object)
            _exported_under(w, s)
            mine = sm.Buffer.empty(4, "float32", device=dev).fill_zero(stream=s).stream
        else:
            mine = sm.Stream.from_external(s, dev)  # (not the default device: it may be the host)
        del s  # (kept by `mine`)
        if how != "cai":
            sm.record_use(w, mine)
            sm.record_use(w, cp.cuda.Stream(non_blocking=True))  # (the next consumer)
            handles = [c[0].handle for c in w._live_token().consumers]
        else:
            _exported_under(w, cp.cuda.ExternalStream(mine.handle))
            _exported_under(w, cp.cuda.Stream(non_blocking=True))
            handles = _consumer_handles(w)
        assert mine.handle in handles, how
        mark = len(drv.calls)
        w.fill_zero(stream=t)  # (after foreign work given to `mine` meanwhile)
        assert _held_wait(drv, t, mine.handle, mark), how
        sm.synchronize()


class _CoreStream:
    """Stands in for a cuda.core Stream made from an object with __cuda_stream__: it keeps
    that object (its ``_owner``), not the CuPy stream beneath."""

    def __init__(self, owner):
        self._owner = owner
        self.handle = owner.__cuda_stream__()[1]

    def __cuda_stream__(self):
        return (0, self.handle)


def test_a_stream_kept_by_a_wrapper_of_its_sharedmem_stream_stays_held(fake):
    """Same, the user keeping only a foreign wrapper (cuda.core's) of the sharedmem Stream."""
    import sys
    dev, drv = fake
    cp = sys.modules["cupy"]
    t = dev.create_stream("writer")
    w = sm.Buffer.from_host(np.ones(16, np.float32), device=dev)
    sm.synchronize()
    core = _CoreStream(sm.Stream.from_external(cp.cuda.Stream(non_blocking=True), dev))
    h = core.handle
    sm.record_use(w, core)
    sm.record_use(w, cp.cuda.Stream(non_blocking=True))
    assert h in [c[0].handle for c in w._live_token().consumers]
    mark = len(drv.calls)
    w.fill_zero(stream=t)
    assert _held_wait(drv, t, h, mark)
    sm.synchronize()


def test_an_export_of_a_dtype_dlpack_cannot_say_takes_no_lease_nor_wait(fake):
    """A view of the platform's long double (float128 / complex256: device memory holds them,
    DLPack cannot say them) is refused with BufferError -- but only after its hold was made:
    the consumer's stream was made to wait for our pending write, and the refusal ended the
    hold, a lease on the consumer's stream (a later write of the view waited for it). A failed
    export takes no lease and enqueues nothing; with ``copy=True`` it copies nothing either."""
    dev, drv = fake
    for dt in (np.longdouble, np.clongdouble):
        if np.dtype(dt).itemsize <= (16 if np.dtype(dt).kind == "c" else 8):
            continue  # (a long double that is a double: exported as one)
        w = dev.create_stream("writer")
        b = sm.Buffer.zeros(4, dt, device=dev)
        sm.synchronize()
        ok, h = drv.cuStreamCreate(1)  # (a consumer's stream, named by its handle)
        h = int(h)
        drv.holding = True  # (the write stays in flight)
        try:
            b.fill_zero(stream=w)
            before = sm.stats().submitted
            mark = len(drv.calls)
            for copy in (None, True):
                with pytest.raises(BufferError, match=r"has no DLPack equivalent"):
                    b.__dlpack__(stream=h, max_version=(1, 0), copy=copy)
            # (the writer's own batched event may be recorded meanwhile, by the retirer)
            assert [c for c in drv.calls[mark:] if c[0] == "wait" or
                    (c[0] == "record" and c[2] == h)] == []
            assert sm.stats().submitted == before, "a refused export took a lease"
            assert b.allocation.live_views == 1
        finally:
            drv.holding = False
            drv.finish_held()
        sm.synchronize()


def test_copy_numpy_false_to_another_device_is_refused(fake):
    """``copy`` takes NumPy's bools (``np.False_`` is False) -- but ``copy=np.False_`` with a
    ``dl_device`` other than the view's was checked before it was read as False: the export
    made a copy on that device, which the consumer had refused (the protocol: BufferError)."""
    dev, drv = fake
    t = sm.Tensor.from_host(np.arange(4, dtype=np.float32), device=dev)
    sm.synchronize()
    for copy in (False, np.False_):
        mark = len(drv.calls)
        with pytest.raises(BufferError, match=r"with copy=False: it lives on \(2, 0\)"):
            t.__dlpack__(max_version=(1, 0), dl_device=(1, 0), copy=copy)
        assert drv.calls[mark:] == [] and t.allocation.live_views == 1  # (no copy made)


def test_a_cupy_stream_reached_through_inflight_stays_held(fake):
    """``sm.inflight()`` hands the user each pending submission's sharedmem Stream: like
    ``fut.stream``, one the user may keep (not the CuPy object) and give foreign work to
    through its handle. It was not marked lent: the next consumer ended its hold entry, and a
    later write of the view did not wait for that work."""
    import sys
    dev, drv = fake
    cp = sys.modules["cupy"]
    t = dev.create_stream("writer")
    w = sm.Buffer.from_host(np.ones(16, np.float32), device=dev)
    sm.synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    _exported_under(w, s)
    drv.holding = True  # (a copy of sharedmem's on s stays in flight)
    try:
        sm.Buffer.empty(4, "float32", device=dev).fill_zero(stream=s)
        h = s.ptr
        del s  # (kept by its sharedmem Stream)
        mine = [e.stream for e in sm.inflight() if e.stream.handle == h][0]
    finally:
        drv.holding = False
        drv.finish_held()
    sm.synchronize()
    _exported_under(w, cp.cuda.Stream(non_blocking=True))  # (the next consumer)
    assert mine.handle in _consumer_handles(w)
    mark = len(drv.calls)
    w.fill_zero(stream=t)  # (after foreign work given to `mine` meanwhile)
    assert _held_wait(drv, t, mine.handle, mark)
    sm.synchronize()


def test_an_import_refused_for_its_device_asks_the_producer_for_nothing(fake):
    """``sm.from_dlpack(x, device=d)`` with ``x`` on another device than ``d`` is refused --
    but only after ``x.__dlpack__`` was called: for a sharedmem view that export made a hold
    and enqueued the consumer's wait for the pending write on the legacy default stream (so
    every blocking stream waited for it), and the hold lived on with the capsule in the
    error's traceback. The producer says its device (``__dlpack_device__``) first."""
    dev, drv = fake
    b = sm.Buffer.from_host(np.ones(4, np.float32), device=dev)
    t = dev.create_stream("writer")
    sm.synchronize()
    drv.holding = True  # (the write stays in flight)
    try:
        b.fill_zero(stream=t)
        mark = len(drv.calls)
        with pytest.raises(BufferError, match=r"^the producer's memory is on <Device cuda:0 "
                                              r"Fake GPU>, not on <Device host>; sharedmem does "
                                              r"not copy on import$") as e:
            sm.from_dlpack(b, device=sm.Device.host())
        # (the writer's own batched event may be recorded meanwhile, by the retirer's sweep)
        assert [c for c in drv.calls[mark:] if c[0] == "wait" or
                (c[0] == "record" and c[2] in (0, 1))] == []
        assert b.allocation.live_views == 1, "the refused import left an export"
        del e
    finally:
        drv.holding = False
        drv.finish_held()
    sm.synchronize()


def test_as_cupy_on_a_stream_in_another_librarys_capture_is_refused(fake, monkeypatch):
    """As a DLPack export to a stream another library is capturing is refused: ``as_cupy(x,
    stream=h)`` -- or under ``with s:`` while ``s.begin_capture()`` runs, CuPy's current
    stream -- enqueued its wait for our pending write on h (an event recorded outside the
    capture: the driver refuses that wait and invalidates the capture) and opened a hold
    there, whose end would be an event recorded into the capture. CaptureError, nothing
    waited for on h, no hold; after the capture, the array."""
    import sys
    import types
    from interop.cupy import as_cupy
    dev, drv = fake
    cp = sys.modules["cupy"]

    class Unowned:  # cupy.cuda.UnownedMemory(ptr, size, owner, device_id)
        def __init__(self, ptr, size, owner, device_id=-1):
            self.ptr, self.size, self._owner = ptr, size, owner

    monkeypatch.setattr(cp.cuda, "UnownedMemory", Unowned, raising=False)
    monkeypatch.setattr(cp.cuda, "MemoryPointer", lambda mem, off: types.SimpleNamespace(
        mem=mem, ptr=mem.ptr + off), raising=False)
    monkeypatch.setattr(cp, "ndarray", lambda shape, dtype, memptr, strides=None:
                        types.SimpleNamespace(data=memptr, shape=shape), raising=False)
    _an_export_to_a_foreign_capture_is_refused(
        dev, drv, lambda buf, h: as_cupy(buf, stream=h),
        r"^as_cupy: cannot export bytes \[0, 64\) .* it is capturing a CUDA graph that "
        r"sharedmem did not start")


def _lock_held_elsewhere():
    """Hold sharedmem's core lock in another thread until the returned function is called (as
    the retirer or another user thread does for a moment at any time)."""
    from sharedmem.runtime.state import RUNTIME
    held, go = threading.Event(), threading.Event()

    def holder():
        RUNTIME.acquire()
        held.set()
        go.wait(10)
        RUNTIME.release()
    th = threading.Thread(target=holder)
    th.start()
    assert held.wait(10)

    def let_go():
        go.set()
        th.join()
    return let_go


@pytest.mark.parametrize("consumed", [False, True])
def test_a_holds_end_staged_behind_another_thread_is_marked_on_the_live_stream(fake, consumed):
    """A DLPack consumer done with an export while another thread holds the core lock: the
    release is staged, its hold's end filed by whoever drains the stage -- but the consumer may
    destroy its stream as soon as the deleter returns (``del arr`` and then the
    ``cupy.cuda.Stream`` it ran on), and an event recorded then would go to a dead handle, or
    to a new stream the driver made on the reused one (the consumer's kernel unordered: the
    memory reused under it). The point the consumer's stream has reached is recorded as the
    deleter runs, on its live handle, and the hold's end is leased there: a later write of the
    view waits for that event. Before, nothing was recorded until the drain."""
    from interop import dlpack as dl
    dev, drv = fake
    leaked = sm.stats().leaked  # (what tests before this one left)
    ok, h = drv.cuStreamCreate(1)
    h = int(h)
    real_record = drv.cuEventRecord

    def record(ev, stream):  # the consumer's kernel on h still reads: its events stay pending
        r = real_record(ev, stream)
        if int(stream) == h:
            drv.held.add(int(ev))
        return r
    drv.cuEventRecord = record
    t = sm.Buffer.from_host(np.ones(16, np.float32), device=dev)
    sm.synchronize()
    cap = t.__dlpack__(stream=h, max_version=(1, 0))
    if consumed:  # (a consumer renames the capsule and calls the deleter itself, later)
        addr = dl._get_pointer(cap, b"dltensor_versioned")
        deleter = dl.DLManagedTensorVersioned.from_address(addr).deleter
        assert dl._set_name(cap, b"used_dltensor_versioned") == 0
        del cap
    let_go = _lock_held_elsewhere()
    try:
        n = len(drv.calls)
        if consumed:
            deleter(addr)
        else:
            del cap  # (an unconsumed capsule's destructor calls the deleter)
        marked = [c[1] for c in drv.calls[n:] if c[0] == "record" and c[2] == h]
        assert len(marked) == 1  # recorded at the release, the handle still the consumer's
    finally:
        let_go()  # (the holder drains the stage as it lets the lock go)
    assert [c for c in drv.calls[n:] if c[0] == "record" and c[2] == h] == \
        [("record", marked[0], h)]  # (the drain recorded nothing more there)
    s = dev.create_stream()
    n = len(drv.calls)
    t.fill_zero(stream=s).result()  # a write orders after the consumer's reads: that event
    assert ("wait", s.handle, marked[0]) in drv.calls[n:]
    drv.finish_held()
    sm.synchronize()
    assert sm.stats().leaked == leaked


def test_a_release_staged_inside_this_threads_own_call_is_applied_as_the_lock_is_let_go(fake):
    """A finalizer that runs inside one of this thread's own sharedmem calls (a collection
    set off there) and ends a DLPack consumer's hold cannot take the core lock: its release is
    staged. It is applied as that call lets the lock go -- before control is back in user
    code, which may destroy the consumer's stream next -- not at whatever call takes the lock
    next, perhaps much later."""
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    leaked = sm.stats().leaked  # (what tests before this one left)
    ok, h = drv.cuStreamCreate(1)
    h = int(h)
    t = sm.Buffer.from_host(np.ones(16, np.float32), device=dev)
    sm.synchronize()
    cap = t.__dlpack__(stream=h, max_version=(1, 0))
    live = t.allocation.live_views
    n = len(drv.calls)
    RUNTIME.acquire()  # (this thread's own critical section, interrupted by the finalizer)
    try:
        del cap  # (the capsule's destructor calls the deleter: staged)
        assert len(RUNTIME.staged) == 1
        assert not [c for c in drv.calls[n:] if c[0] == "record" and c[2] == h]
    finally:
        RUNTIME.release()
    assert len(RUNTIME.staged) == 0  # applied as the lock was let go: the hold's end recorded
    assert len([c for c in drv.calls[n:] if c[0] == "record" and c[2] == h]) == 1
    assert t.allocation.live_views == live - 1
    sm.synchronize()
    assert sm.stats().leaked == leaked



def _an_export_to_a_foreign_capture_is_refused(dev, drv, export, match):
    """``export(buf, h)`` with a write of ``buf`` in flight on another stream, while another
    library captures on the consumer's stream ``h``: CaptureError (``match``), nothing waited
    for or recorded on h, no hold left; once the capture ends, the export, ordered after the
    write."""
    a = dev.create_stream("A")
    buf = sm.Buffer.zeros(16, "float32", device=dev)
    sm.synchronize()
    drv.holding = True  # A's write stays in flight
    try:
        buf.copy_from(np.full(16, 2, np.float32), stream=a)
        ok, h = drv.cuStreamCreate(1)
        h = int(h)
        drv.cuStreamBeginCapture(h, 0)
        views = buf.allocation.live_views
        mark = len(drv.calls)
        with pytest.raises(sm.CaptureError, match=match):
            export(buf, h)
        assert not [c for c in drv.calls[mark:] if (c[0] == "wait" and c[1] == h) or
                    (c[0] == "record" and c[2] == h)], \
            "enqueued on a stream another library captures"
        assert buf.allocation.live_views == views, "a refused export left its hold"
        drv.cuStreamEndCapture(h)
        out = export(buf, h)
        assert [c for c in drv.calls[mark:] if c[0] == "wait" and c[1] == h]
        del out
    finally:
        drv.holding = False
        drv.finish_held()
    gc_collect_harder()
