"""Behaviour of the ownership core that mutation testing found unchecked: each test here
fails on one realistic bug (named in its docstring) of access.py, runtime/submission.py,
allocation.py or stream.py, and passes on the real code. Host streams with gated kernels
hold work in flight where the host backend shows the rule; the fake driver (events held
pending) where the rule is about which markers a stream waited on."""

import contextlib
import threading
import weakref

import numpy as np
import pytest

import sharedmem as sm
from sharedmem.runtime import submission as _sub
from sharedmem.runtime.state import locked

from conftest import gc_collect_harder
from test_boundary import fake as fake_boundary, read_only_export  # noqa: F401  (fixture)
from test_cuda_backend_fake import fake, kernels  # noqa: F401  (fixtures)
from test_waited import _park_retirer, _teardown

HOST = sm.Device.host()


@sm.host_kernel
def _gated(x, gate):
    gate.wait(10)


@sm.host_kernel
def _noop(x):
    pass


@contextlib.contextmanager
def _held_work(drv):
    """The fake driver's work held pending (events unreached) inside the block, then run."""
    drv.holding = True
    try:
        yield
    finally:
        drv.holding = False
        drv.finish_held()


def _records_on(drv, handle, since=0):
    """The events recorded on stream ``handle`` in the fake driver's call log since ``since``."""
    return [c[1] for c in drv.calls[since:] if c[0] == "record" and c[2] == handle]


def _waits_of(drv, handle, since=0):
    """The events stream ``handle`` was made to wait on since ``since``."""
    return [c[2] for c in drv.calls[since:] if c[0] == "wait" and c[1] == handle]


def _settled_buffer(n):
    b = sm.Buffer.zeros(n, "uint8", device=HOST)
    sm.synchronize()
    return b


def _spans(buf, stream, kind):
    """The (lo, hi, seq) spans ``stream`` has of ``buf``'s allocation (``kind``: "reads" or
    "writes"), sorted by lo."""
    with locked():
        use = buf.allocation.tracker.uses_locked().get(stream._uid)
        if use is None:
            return []
        return sorted((e.lo, e.hi, e.seq) for e in getattr(use, kind))


def test_a_range_inside_an_unfinished_one_leaves_both_ends_of_it_leased():
    """Mutant: ``_add_range`` keeps the head of an older span that a newer range overlaps but
    drops its tail. A write of bytes [0, 64) on S, then of [16, 32) on S, both in flight: the
    first still writes [0, 16) *and* [32, 64), so a read of [40, 48) on T conflicts with it."""
    s, t = HOST.create_stream("S"), HOST.create_stream("T")
    buf = _settled_buffer(64)
    gate = threading.Event()
    try:
        f1 = sm.launch(_gated, 1, 1, sm.Out(buf), gate, stream=s)
        f2 = sm.launch(_gated, 1, 1, sm.Out(buf[16:32]), gate, stream=s)
        for lo, hi in ((40, 48), (0, 8), (20, 24), (60, 64)):
            with pytest.raises(sm.AccessConflictError):
                sm.launch(_noop, 1, 1, sm.In(buf[lo:hi]), stream=t, policy="reject")
        # (the first launch's seq on what the second did not overwrite, the second's on its own)
        w = _spans(buf, s, "writes")
        assert [(lo, hi) for lo, hi, _ in w] == [(0, 16), (16, 32), (32, 64)]
        seqs = {(lo, hi): seq for lo, hi, seq in w}
        assert seqs[(0, 16)] == seqs[(32, 64)] == seqs[(16, 32)] - 1
    finally:
        gate.set()
    f1.result(10)
    f2.result(10)
    sm.launch(_noop, 1, 1, sm.In(buf[40:48]), stream=t, policy="reject").result(10)


def test_a_read_only_export_orders_writers(fake_boundary):
    """Mutant: a write checks only the holds whose consumer may write (``if hw`` for
    ``if writes or hw``). A read-only DLPack export's consumer reads the bytes on its stream
    until its hold ends: a later *write* on A must wait, on the device, for an event recorded
    on the consumer's stream (the counterpart of test_a_read_only_export_does_not_order_readers),
    and under policy "reject" it is refused naming the reading consumer."""
    dev, drv = fake_boundary
    consumer, a, t, cap = read_only_export(dev, drv)
    mark = len(drv.calls)
    with t.as_buffer() as b:
        b.fill_zero(stream=a)
    recorded = _records_on(drv, consumer, mark)
    assert len(recorded) == 1 and _waits_of(drv, a.handle, mark) == recorded
    with t.as_buffer() as b:
        tok = b._live_token()
        backend, impl, ptr, n = a.device.backend, a._impl, b.ptr, b.nbytes
        with pytest.raises(sm.AccessConflictError, match=r"a consumer on .* holds them \(reads\)"):
            _sub.submit(a, [(tok, True)], lambda: backend.memset(impl, ptr, 0, n),
                        policy="reject", label="fill_zero")
    del cap


def test_a_launch_conflicting_with_two_submissions_of_one_stream_waits_for_the_newer(
        fake, kernels, monkeypatch):
    """Mutant: of the conflicts one launch finds with one other stream, the first found is
    kept (``if w is None`` for ``if w is None or seq > w[0]``). B writes x (seq 1, its marker
    recorded by a sweep), then y (seq 2, the open marker); A reads x then y: its one wait is
    for B's newer write -- the event recorded on B as A's launch asks for it --, not for the
    older one's event, which would leave A reading y while B still writes it."""
    dev, drv = fake
    saxpy, _ = kernels
    a, b = dev.create_stream("A"), dev.create_stream("B")
    one = sm.Buffer.from_host(np.ones(8, np.float32), device=dev)
    x, y, w = (sm.Buffer.zeros(8, "float32", device=dev) for _ in range(3))
    sm.synchronize()
    parked = _park_retirer(monkeypatch)
    drv.holding = True
    try:
        mark = len(drv.calls)
        sm.launch(saxpy, 1, 8, 1.0, sm.In(one), sm.In(one), sm.Out(x), 8, stream=b)  # seq 1
        _sub.sweep(b)  # (asks seq 1's marker: recorded now, still pending)
        first = _records_on(drv, b.handle, mark)
        assert len(first) == 1  # (pending: its event is not back in the pool for reuse)
        sm.launch(saxpy, 1, 8, 1.0, sm.In(one), sm.In(one), sm.Out(y), 8, stream=b)  # seq 2
        mark = len(drv.calls)
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(y), sm.Out(w), 8, stream=a)
        newer = _records_on(drv, b.handle, mark)
        assert len(newer) == 1 and newer[0] not in first
        assert _waits_of(drv, a.handle, mark) == newer
    finally:
        _teardown(drv, parked)


def test_a_stream_declared_again_as_writing_makes_the_hold_a_writers(fake_boundary):
    """Mutant: ``add_consumer_locked`` keeps a stream's first mode (a read) when the stream is
    named again as writing. record_use(t, F, writes=False), then writes=True: t's hold on F is
    a writer's now, so -- once both declared leases retired -- a *read* of t on A is still
    ordered after what F was given (an event recorded on F, waited on by A)."""
    dev, drv = fake_boundary
    foreign = int(drv.cuStreamCreate(1)[1])
    a = dev.create_stream("A")
    t = sm.Tensor.from_host(np.arange(8, dtype=np.float32), device=dev)
    out = sm.Buffer.empty(8, "float32", device=dev)
    sm.synchronize()
    sm.record_use(t, foreign, writes=False)
    f = sm.Stream.from_external(foreign, device=dev)
    assert t._token.consumers == ((f, False),)
    sm.record_use(t, foreign, writes=True)
    assert t._token.consumers == ((f, True),)
    sm.synchronize()  # (the two declared uses' leases retire: the open hold is what is left)
    assert sm.stats().in_flight == 0
    drv.holding = True
    mark = len(drv.calls)
    with t.as_buffer() as b:
        out.copy_from(b, stream=a)  # reads t: the consumer on F may write it
    recorded = _records_on(drv, foreign, mark)
    assert len(recorded) == 1 and _waits_of(drv, a.handle, mark) == recorded


def test_hold_ends_on_a_borrowed_stream_each_last_until_their_own_event(fake_boundary):
    """Mutant: a hold's end joins the stream's newest submission, an earlier end's, whatever
    its marker (``last.marker is marker`` dropped). On a borrowed consumer stream each end is
    an event recorded then: the second export's bytes stay leased until the *second* event,
    which the consumer reaches after the first -- not freed once the first is reached."""
    dev, drv = fake_boundary
    consumer = int(drv.cuStreamCreate(1)[1])
    t1 = sm.Tensor.from_host(np.arange(8, dtype=np.float32), device=dev)
    t2 = sm.Tensor.from_host(np.arange(8, dtype=np.float32), device=dev)
    sm.synchronize()
    a1, a2 = weakref.ref(t1.allocation), weakref.ref(t2.allocation)
    cap1 = t1.__dlpack__(stream=consumer, max_version=(1, 0))
    cap2 = t2.__dlpack__(stream=consumer, max_version=(1, 0))
    del t1, t2
    drv.holding = True  # the consumer is still working
    mark = len(drv.calls)
    del cap1
    gc_collect_harder()
    (e1,) = _records_on(drv, consumer, mark)
    mark = len(drv.calls)
    del cap2
    gc_collect_harder()
    (e2,) = _records_on(drv, consumer, mark)
    assert e1 != e2
    f = sm.Stream.lookup(dev, consumer)
    with locked():
        filed = [[u[0].allocation.id for u in s.uses] for s in f._pending]
    assert filed == [[a1().id], [a2().id]]  # (two submissions: one per end, each its event)
    drv.held.discard(e1)  # the consumer passed the first end, not the second
    _sub.sweep(f)
    gc_collect_harder()
    assert a1() is None  # its lease ended: freed
    assert a2() is not None and sm.stats().in_flight == 1  # still leased until e2
    drv.finish_held()
    sm.synchronize()
    gc_collect_harder()
    assert a2() is None and sm.stats().in_flight == 0


def test_hold_ends_sharing_a_submission_leave_no_lease_once_it_retired(monkeypatch):
    """Mutant: a hold end that joins the stream's newest submission records its bytes under a
    new seq but leaves the submission's seq as it was (``last.seq = seq`` dropped): the
    submission then retires up to its old seq only, and the later end's span looks unfinished
    for good -- a phantom conflict. Three ends share one submission; once it retired, no
    tracker has anything left and a write on another stream under policy "reject" runs."""
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, False)
    ts = [sm.Tensor.from_buffer(sm.Buffer.empty(64, "float32", device=dev), (64,))
          for _ in range(3)]
    sm.synchronize()
    parked = _park_retirer(monkeypatch)
    pending = dev.default_stream._pending
    with _held_work(drv):
        n = len(pending)
        for t in ts:
            cap = t.__dlpack__(stream=1, max_version=(1, 0))
            del cap  # released unconsumed: its hold ends on the default stream
        assert len(pending) == n + 1 and len(pending[-1].uses) == 3
        shared = pending[-1]
        assert shared.seq == dev.default_stream._seq  # (the newest seq its ends took)
        parked[0] = False
    sm.synchronize()
    assert sm.stats().in_flight == 0
    b = dev.create_stream("B")
    for t in ts:
        assert not t.allocation.tracker, t.allocation.tracker.streams_locked()
        with t.as_buffer() as buf:
            _reject_write(buf, b)
    sm.synchronize()


def _reject_write(b, stream):
    tok = b._live_token()
    backend, impl, ptr, n = stream.device.backend, stream._impl, b.ptr, b.nbytes
    return _sub.submit(stream, [(tok, True)], lambda: backend.memset(impl, ptr, 0, n),
                       policy="reject", label="fill_zero")


def test_a_launch_keeps_the_producer_of_foreign_memory_until_it_ran(host):
    """Mutant: a launch's submission keeps the allocations of its leases but not the foreign
    producers their tokens keep (``record_leases_locked`` returns no ``keeps``). A NumPy array
    imported by DLPack and read by a gated kernel: the user drops the view and the array, and
    the array stays alive -- kept by the launch -- until the kernel ran, then it is freed."""
    a = np.arange(16, dtype=np.int64)
    producer = weakref.ref(a)
    t = sm.from_dlpack(a)
    sm.synchronize()  # (the import's arrival retired: the launch alone keeps it below)
    s = HOST.create_stream()
    gate = threading.Event()
    seen = []

    @sm.host_kernel
    def gated_sum(x, gate):
        gate.wait(10)
        seen.append(int(x.sum()))

    try:
        fut = sm.launch(gated_sum, 1, 1, sm.In(t), gate, stream=s)
        t.release()
        del t, a
        gc_collect_harder()
        assert producer() is not None, "the producer was freed under a launch that reads it"
    finally:
        gate.set()
    fut.result(10)
    assert seen == [120]
    sm.synchronize()
    del fut
    gc_collect_harder()
    assert producer() is None


def test_memory_under_work_of_unknown_completion_is_never_freed(host):
    """Mutant: ``finish`` drops what every swept submission kept, also one whose completion
    is unknown (``if sub.state == _RETIRED`` lost). A kernel faults on S with the user's last
    view of a buffer already dropped: the allocation (and so its pool block) stays alive for
    good -- leaked on purpose, reported once -- while the same program without the fault
    frees it."""
    from sharedmem.backends.host import HostFault

    @sm.host_kernel
    def faulting(x):
        raise HostFault("illegal address (simulated)")

    @sm.host_kernel
    def fine(x):
        x[:] = 1

    for kernel, kept in ((fine, False), (faulting, True)):
        s = host.create_stream()
        b = sm.Buffer.zeros(32, "int32", device=host, stream=s)
        alloc = weakref.ref(b.allocation)
        fut = sm.launch(kernel, 1, 1, b, stream=s)
        del b
        if kept:
            with pytest.warns(sm.LeakWarning, match="is unknown"):
                with pytest.raises(sm.CompletionUnknownError):
                    fut.result(5)
        else:
            fut.result(5)
        del fut
        if not kept:
            sm.synchronize()
        gc_collect_harder()
        assert (alloc() is not None) == kept, (kernel, kept)
        del s  # (the stream dropped too: what its faulted work kept stays kept)
        gc_collect_harder()
        assert (alloc() is not None) == kept


def test_an_imports_arrival_is_a_write_that_later_readers_are_ordered_after(fake, kernels,
                                                                           monkeypatch):
    """Mutant: an import's arrival is recorded as a read (``record_arrival`` leasing
    ``(tok, False)``). Foreign device memory imported by the CUDA Array Interface onto stream
    A: its arrival there -- what later use of the bytes is ordered after, A having been made
    to wait for the producer -- is a write, so a kernel that only *reads* the import on B
    waits, on the device, for the arrival's event on A; under policy "reject" it is refused."""
    import sharedmem.device as sm_device
    dev, drv = fake
    saxpy, _ = kernels
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)  # (an import probes Device(0))
    mem = np.arange(8, dtype=np.float32)  # "device memory" another library owns
    drv.ranges[mem.ctypes.data] = mem.nbytes  # (what cuPointerGetAttribute knows)

    class Producer:
        __cuda_array_interface__ = {"shape": (8,), "typestr": "<f4", "version": 3,
                                    "data": (mem.ctypes.data, False), "stream": None}
    a, b = dev.create_stream("A"), dev.create_stream("B")
    w = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()
    with _held_work(drv):
        producer = Producer()
        imported = len(drv.calls)
        t = sm.from_cuda_array_interface(producer, stream=a)
        with pytest.raises(sm.AccessConflictError, match=r"unfinished work on <Stream A .*> "
                                                         r"writes them"):
            sm.launch(saxpy, 1, 8, 1.0, sm.In(t), sm.In(t), sm.Out(w), 8, stream=b,
                      policy="reject")
        mark = len(drv.calls)
        sm.launch(saxpy, 1, 8, 1.0, sm.In(t), sm.In(t), sm.Out(w), 8, stream=b)
        # (the arrival's event is recorded on A when first asked for: by this launch, or
        # before it by the retirer thread sweeping A -- so looked for since the import)
        arrival = _records_on(drv, a.handle, imported)
        assert len(arrival) == 1 and _waits_of(drv, b.handle, mark) == arrival
    sm.synchronize()
    np.testing.assert_array_equal(w.to_host(), 2 * np.arange(8, dtype=np.float32))
    del t, producer


def test_a_wait_for_an_open_hold_counts_as_waiting_for_nothing_later(fake, kernels):
    """Mutant: the wait made for an open hold is noted in the waiting stream's ``_waited``
    (as if it were a submission's, under a seq that is not the other stream's). A, far ahead
    in seqs, writes q, which a consumer on S holds: one wait, for an event recorded on S then.
    S then writes y (a later seq of S); A's read of y waits for that write -- the wait for
    the hold ordered A after nothing S was given since."""
    dev, drv = fake
    saxpy, _ = kernels
    a, s = dev.create_stream("A"), dev.create_stream("S")
    one = sm.Buffer.from_host(np.ones(8, np.float32), device=dev)
    x, y, q, w = (sm.Buffer.zeros(8, "float32", device=dev) for _ in range(4))
    sm.synchronize()
    for _ in range(6):  # (A's seqs run ahead of S's)
        sm.launch(saxpy, 1, 8, 1.0, sm.In(one), sm.In(one), sm.Out(x), 8, stream=a)
    sm.record_use(q, s)  # a consumer on S holds q (its declared use leased on S too)
    sm.synchronize()
    with _held_work(drv):
        mark = len(drv.calls)
        sm.launch(saxpy, 1, 8, 1.0, sm.In(one), sm.In(one), sm.Out(q), 8, stream=a)
        hold = _records_on(drv, s.handle, mark)
        assert len(hold) == 1 and _waits_of(drv, a.handle, mark) == hold
        sm.launch(saxpy, 1, 8, 1.0, sm.In(one), sm.In(one), sm.Out(y), 8, stream=s)
        assert s._seq < a._seq
        mark = len(drv.calls)
        sm.launch(saxpy, 1, 8, 1.0, sm.In(y), sm.In(one), sm.Out(w), 8, stream=a)
        write = _records_on(drv, s.handle, mark)
        assert len(write) == 1 and _waits_of(drv, a.handle, mark) == write
    sm.synchronize()
    del q


@pytest.mark.parametrize("how", ["moved", "released"])
def test_a_token_derived_from_a_dead_view_is_refused_in_the_same_step(host, how):
    """Mutant: ``register_token_locked`` makes the new token live without checking its source
    view (``Allocation.new_token(..., source=view)``: the step that closes the race of a slice
    or an export with a move on another thread). A view moved into a Tensor, or released,
    gives no new view of the bytes it no longer owns: MovedError / ReleasedError, and the
    allocation's live views are as before."""
    b = sm.Buffer.zeros(16, "float32", device=host)
    sm.synchronize()
    alloc = b.allocation
    if how == "moved":
        t = sm.Tensor.from_buffer(b, (16,))
        err = sm.MovedError
    else:
        t = None
        b.release()
        err = sm.ReleasedError
    views = alloc.live_views
    with pytest.raises(err):
        alloc.new_token("slice", 0, 32, True, alloc, source=b)
    assert alloc.live_views == views
    if t is not None:  # (the move was not undone: the tensor alone holds the bytes)
        assert t.into_buffer().nbytes == 64


def test_an_interrupted_launch_keeps_the_producer_of_foreign_memory(host):
    """Mutant: the lease filed for an enqueue an interrupt cut short keeps the launch's
    ``keep`` but not the foreign producers of its arguments' memory
    (``_lease_interrupted_locked`` without ``keeps.extend(...)``). The work was queued before
    the KeyboardInterrupt: a NumPy array imported by DLPack, its view and the array dropped,
    stays alive until the stream passed that point."""
    from test_launch import _InterruptedKernel
    a = np.arange(16, dtype=np.int64)
    producer = weakref.ref(a)
    t = sm.from_dlpack(a)
    sm.synchronize()
    s = host.create_stream()
    gate = threading.Event()
    seen = []

    def task():
        gate.wait(10)
        seen.append(True)

    try:
        with pytest.raises(KeyboardInterrupt, match="simulated"):
            sm.launch(_InterruptedKernel(task), 1, 1, sm.In(t), stream=s)
        t.release()
        del t, a
        gc_collect_harder()
        assert producer() is not None, "the producer was freed under queued work"
    finally:
        gate.set()
    s.synchronize()
    gc_collect_harder()
    assert seen == [True] and producer() is None


def test_a_pageable_download_waits_for_other_streams_writes_holding_no_lock(fake, kernels,
                                                                            monkeypatch):
    """Mutant: ``wait_before`` waits only for the copy's own stream, not for the conflicting
    work of other streams. Where no pinned memory is left, a download copies into pageable
    memory, which the driver does synchronously -- under the core lock, if the copy's
    device-side wait for B's pending write of the bytes were all there was (every thread
    would then wait for B's kernel). So before it takes the lock the download waits on the
    host for B's write: a cuEventSynchronize of B's event, made with the core lock free."""
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    saxpy, _ = kernels
    b = dev.create_stream("B")
    one = sm.Buffer.from_host(np.ones(8, np.float32), device=dev)
    x = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()
    def refuse(n):  # (no pinned staging left: CuPy's pinned pool refuses; a compiled
        raise MemoryError("out of pinned memory")  # backend's methods cannot be replaced)
    monkeypatch.setattr(dev.backend._cupy.cuda, "alloc_pinned_memory", refuse)
    real_sync = drv.cuEventSynchronize

    def sync(ev):
        drv.calls.append(("sync", int(ev), RUNTIME.owner == threading.get_ident()))
        return real_sync(ev)
    monkeypatch.setattr(drv, "cuEventSynchronize", sync)
    parked = _park_retirer(monkeypatch)  # (its sweeps would record B's open marker first)
    drv.holding = True
    try:
        sm.launch(saxpy, 1, 8, 2.0, sm.In(one), sm.In(one), sm.Out(x), 8, stream=b)
        mark = len(drv.calls)
        np.testing.assert_array_equal(x.to_host(), np.full(8, 3, np.float32))
        calls = drv.calls[mark:]
        (write,) = _records_on(drv, b.handle, mark)  # (B's open marker, recorded when asked)
        # (events are pooled: a handle is recorded again for other markers, before and after)
        recorded = calls.index(("record", write, b.handle))
        ordered = calls.index(("wait", dev.default_stream.handle, write))
        assert ("sync", write, False) in calls[recorded:ordered]
    finally:
        _teardown(drv, parked)
