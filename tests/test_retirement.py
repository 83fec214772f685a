"""Submissions keep what they use until the work is done; faults leak on purpose."""

import threading
import time
import warnings

import numpy as np
import pytest

import sharedmem as sm
from sharedmem.backends.host import HostFault

from conftest import gc_collect_harder


def test_dropped_inputs_survive_until_the_slow_kernel_ran(host):
    """The use-after-free pattern: drop everything right after launch, write new memory."""
    s = host.create_stream()
    gate = threading.Event()
    results = []

    @sm.host_kernel
    def slow_sum(x, y, out):
        gate.wait(5)
        out[:] = x + y
        results.append(out.copy())

    n = 4096
    x = sm.Buffer.from_host(np.full(n, 1.0, np.float32), device=host, stream=s)
    y = sm.Buffer.from_host(np.full(n, 2.0, np.float32), device=host, stream=s)
    out = sm.Buffer.empty(n, "float32", device=host)
    xptr, yptr = x.ptr, y.ptr
    fut = sm.launch(slow_sum, 1, 1, sm.In(x), sm.In(y), sm.Out(out), stream=s)
    del x, y, out, fut
    gc_collect_harder()
    # new allocations of the same size, written at once on other streams: the host
    # pool hands freed blocks out again immediately, so an early free would show here
    other = host.create_stream()
    fresh = [sm.Buffer.from_host(np.full(n, -99.0, np.float32), device=host, stream=other)
             for _ in range(8)]
    other.synchronize()
    assert xptr not in {b.ptr for b in fresh} and yptr not in {b.ptr for b in fresh}
    assert sm.stats().in_flight >= 1
    gate.set()
    sm.synchronize()
    np.testing.assert_array_equal(results[0], np.full(n, 3.0, np.float32))
    # once retired, the memory really is returned and reused
    del fresh
    gc_collect_harder()
    again = [sm.Buffer.empty(n, "float32", device=host) for _ in range(12)]
    assert xptr in {b.ptr for b in again}


def test_destructors_never_wait(host):
    gate = threading.Event()

    @sm.host_kernel
    def blocked(x):
        gate.wait(10)

    s = host.create_stream()
    b = sm.Buffer.zeros(16, device=host, stream=s)
    fut = sm.launch(blocked, 1, 1, b, stream=s)
    t0 = time.monotonic()
    del b, fut, s  # buffer, future and stream all dropped while the work is blocked
    gc_collect_harder()
    assert time.monotonic() - t0 < 2.0  # would be >= 10 s if a destructor waited
    assert sm.stats().in_flight >= 1
    gate.set()
    sm.synchronize()
    assert sm.stats().in_flight == 0


def test_stream_dropped_with_work_pending_still_retires(host):
    gate = threading.Event()
    out_host = []

    @sm.host_kernel
    def k(x):
        gate.wait(5)
        out_host.append(int(x.sum()))

    s = host.create_stream()
    b = sm.Buffer.from_host(np.arange(10, dtype=np.int64), device=host, stream=s)
    sm.launch(k, 1, 1, sm.In(b), stream=s)
    alloc = b.allocation
    del s, b
    gc_collect_harder()
    assert alloc.live_views == 0 and alloc.tracker  # no views, but a lease
    gate.set()
    sm.synchronize()
    assert out_host == [45]
    assert not alloc.tracker


def test_kernel_fault_means_completion_unknown(host):
    s, other = host.create_stream(), host.create_stream()

    @sm.host_kernel
    def faulting(x):
        raise HostFault("illegal address (simulated)")

    @sm.host_kernel
    def fill(x):
        x[:] = 5

    before = sm.stats()
    b = sm.Buffer.zeros(32, "int32", device=host, stream=s)
    alloc_ref = b.allocation
    fut = sm.launch(faulting, 1, 1, b, stream=s)
    del b
    with pytest.warns(sm.LeakWarning, match=r"^completion of work on <Stream .*> \(stream #\d+\) is unknown \(HostFault\('illegal address \(simulated\)'\)\); its memory and leases are kept, never freed"):
        with pytest.raises(sm.CompletionUnknownError, match=r"^completion of host kernel .*faulting on <Stream .*> is unknown: HostFault") as ei:
            fut.result(5)
    assert isinstance(ei.value.__cause__, HostFault)
    st = sm.stats()
    assert st.leaked == before.leaked + 1 and st.leaked_bytes == before.leaked_bytes + 128
    gc_collect_harder()
    assert alloc_ref.tracker  # kept: its lease is never released
    # the faulted stream refuses more work, without taking leases
    c = sm.Buffer.zeros(4, "int32", device=host, stream=other)
    with pytest.raises(sm.CompletionUnknownError, match=r"faulted earlier .* Create a new stream"):
        sm.launch(fill, 1, 1, c, stream=s)
    # other streams keep working
    sm.launch(fill, 1, 1, c, stream=other).result(5)
    np.testing.assert_array_equal(c.to_host(), [5, 5, 5, 5])
    # reported once: a second faulted submission on the same stream adds no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", sm.LeakWarning)
        sm.stats()


def test_work_conflicting_with_unknown_completion_is_refused(host):
    s, other = host.create_stream(), host.create_stream()

    @sm.host_kernel
    def faulting(x):
        raise HostFault("boom")

    b = sm.Buffer.zeros(8, "int32", device=host, stream=s)
    with pytest.warns(sm.LeakWarning):
        with pytest.raises(sm.CompletionUnknownError):
            sm.launch(faulting, 1, 1, b, stream=s).result(5)
    with pytest.raises(sm.CompletionUnknownError, match=r"which work of unknown completion on <Stream .*> writes; that memory is kept but its contents cannot be trusted"):
        b.to_host(stream=other)


def test_stats_fields():
    st = sm.stats()
    assert isinstance(st, sm.Stats)
    assert st["in_flight"] == st.in_flight
    for key in ("nope", "as_dict", "__class__", 0):  # the counters only
        with pytest.raises(KeyError):
            st[key]
    with pytest.raises(Exception):
        st.in_flight = 3
    assert set(st.as_dict()) == {"in_flight", "live_allocations", "live_views", "leaked",
                                 "leaked_bytes", "submitted", "retired"}


class _CountingMarker:
    """A marker whose completion the test sets, counting the queries."""

    recorded = True

    def __init__(self, log):
        self.state, self.error, self.log = 0, None, log

    def query(self):
        self.log.append(self)
        return self.state


class _Sub:
    def __init__(self, marker):
        self.marker = marker


@pytest.mark.parametrize("n, done", [(1, 0), (1, 1), (64, 0), (64, 1), (64, 17), (64, 63),
                                     (64, 64), (1000, 999)])
def test_retirement_finds_the_finished_prefix_in_few_queries(n, done):
    """A stream finishes in order, so retiring n submissions costs at most
    2 + log2(n) event queries, not one per submission."""
    import math
    from sharedmem.runtime.submission import _done_prefix_locked
    log = []
    subs = [_Sub(_CountingMarker(log)) for _ in range(n)]  # (a stream's FIFO is a list)
    for s in subs[:done]:
        s.marker.state = 1
    assert _done_prefix_locked(subs) == done
    assert len(log) <= 2 + math.ceil(math.log2(n))
    if done in (0, n):
        assert len(log) <= 2  # a drained or an untouched FIFO: the newest, then the oldest


def test_retirement_walks_one_by_one_after_an_unknown_query():
    from sharedmem.runtime.submission import _done_prefix_locked
    log = []
    subs = [_Sub(_CountingMarker(log)) for _ in range(8)]
    for s in subs[:3]:
        s.marker.state = 1
    subs[-1].marker.state = 2  # the newest query failed: the caller must walk the FIFO
    assert _done_prefix_locked(subs) == -1


@pytest.mark.parametrize("n_open", [1, 5, 40])
def test_a_submitter_sweep_leaves_the_unrecorded_tail_alone(n_open):
    """Submissions sharing a marker not yet recorded (the FIFO's tail) count as
    unfinished when the submitter sweeps (record=False): it is never asked --
    asking would record it just to hear "not yet". The retirer (record=True) asks."""
    from sharedmem.runtime.submission import _done_prefix_locked
    log = []
    closed = [_Sub(_CountingMarker(log)) for _ in range(10)]
    for s in closed[:7]:
        s.marker.state = 1
    shared = _CountingMarker(log)
    shared.recorded = False
    shared.state = 1  # (even if it were done)
    subs = closed + [_Sub(shared) for _ in range(n_open)]
    assert _done_prefix_locked(subs, record=False) == 7
    assert shared not in log
    log.clear()
    assert _done_prefix_locked(subs) == len(subs)  # the retirer asks the newest first
    assert log == [shared]
    only_open = [_Sub(shared) for _ in range(n_open)]
    assert _done_prefix_locked(only_open, record=False) == 0


def test_the_retirer_leaves_a_bursting_stream_to_its_submitters_and_retires_the_others(host):
    """While one thread launches in a tight loop on stream A (whose submissions sweep A
    themselves), finished work on stream B is still retired by the retirer -- without a
    call on B -- and so is A's tail once the burst ends."""
    a, b = host.create_stream("burst"), host.create_stream("quiet")
    x, y = sm.Buffer.zeros(4, device=host), sm.Buffer.zeros(4, device=host)
    nop = sm.host_kernel(lambda v: None)
    sm.synchronize()
    stop = threading.Event()

    def burst():
        while not stop.is_set():
            for _ in range(200):
                sm.launch(nop, 1, 1, sm.InOut(x), stream=a)

    t = threading.Thread(target=burst)
    t.start()
    try:
        time.sleep(0.05)
        sm.launch(nop, 1, 1, sm.InOut(y), stream=b)
        deadline = time.monotonic() + 5.0
        while b.pending and time.monotonic() < deadline:
            time.sleep(0.005)
        assert b.pending == 0  # retired during the burst, by the retirer
        assert t.is_alive()
    finally:
        stop.set()
        t.join()
    deadline = time.monotonic() + 5.0
    while a.pending and time.monotonic() < deadline:
        time.sleep(0.005)
    assert a.pending == 0 and not y.allocation.tracker  # the burst's tail too, unasked


def test_an_idle_retirer_keeps_no_borrowed_stream_alive(monkeypatch):
    """The retirer remembers each active stream's progress between passes by the stream's
    uid, and a pass's locals die with the pass: once the user drops a borrowed stream (and
    with it the foreign stream object it keeps), nothing of the retirer's keeps the object
    (or its device) alive while the retirer sleeps."""
    import weakref
    from fake_cuda import install_fake_devices
    from sharedmem.runtime import retirer
    from sharedmem.runtime.state import RUNTIME
    (dev,), drv = install_fake_devices(monkeypatch, True)

    class ForeignStream:  # (what a CuPy stream looks like to sharedmem: a ``ptr``)
        ptr = 0x7001

    obj = ForeignStream()
    st = sm.Stream.from_external(obj, dev)
    buf = sm.Buffer.empty(8, "float64", device=dev)
    drv.holding = True
    buf.copy_from(np.ones(8), stream=st)
    seen, poll = retirer._pass(RUNTIME, {})  # (a pass while the copy is pending)
    assert poll and st._uid in seen
    assert all(type(k) is int for k in seen)  # (uids: no stream kept)
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    ref = weakref.ref(obj)
    del st, obj, buf
    gc_collect_harder()
    assert ref() is None


def test_an_event_after_a_fault_says_so_on_synchronize_as_on_query(host):
    s = host.create_stream("faults")
    gate = threading.Event()

    @sm.host_kernel
    def faulting(x):
        gate.wait(5)
        raise HostFault("illegal address (simulated)")

    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    fut = sm.launch(faulting, 1, 1, b, stream=s)
    ev = s.record()
    assert ev.synchronize(0) is False
    gate.set()
    msg = (r"^completion of work before this event on <Stream faults on <Device host> "
           r"\(owned\)> is unknown: HostFault\('illegal address \(simulated\)'\)$")
    with pytest.raises(sm.CompletionUnknownError, match=msg):
        ev.synchronize(5)
    with pytest.raises(sm.CompletionUnknownError, match=msg):
        ev.query()
    with pytest.warns(sm.LeakWarning) as warned:
        with pytest.raises(sm.CompletionUnknownError):
            fut.result(5)
    assert [w.filename for w in warned] == [__file__]  # (the user's line, not sharedmem's)


def test_a_failure_inside_the_retirer_is_raised_once_in_a_user_thread_and_it_runs_on(
        host, monkeypatch):
    """An exception in a retirer pass is not printed nor lost: the next sharedmem call of a
    user thread raises that very exception, once; the retirer thread goes on retiring work
    nobody asks about."""
    from sharedmem.runtime import retirer
    from sharedmem.runtime.state import RUNTIME
    sm.synchronize()
    sm.stats()  # (nothing deferred from earlier)
    boom = RuntimeError("a retirer pass failed (test)")
    real, failed = retirer._pass, []

    def failing_once(rt, last):
        if not failed:
            failed.append(True)
            raise boom
        return real(rt, last)

    monkeypatch.setattr(retirer, "_pass", failing_once)
    retirer.ensure()
    retirer.wake()
    deadline = time.monotonic() + 10
    while not RUNTIME.errors and time.monotonic() < deadline:
        time.sleep(0.005)
    assert list(RUNTIME.errors) == [boom]
    with pytest.raises(RuntimeError, match=r"^a retirer pass failed \(test\)$") as ei:
        sm.stats()
    assert ei.value is boom and not RUNTIME.errors
    sm.stats()  # raised once
    assert retirer._thread.is_alive()
    gate = threading.Event()

    @sm.host_kernel
    def waits(x):
        gate.wait(5)

    s = host.create_stream("after the failure")
    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    sm.launch(waits, 1, 1, b, stream=s)  # fire and forget: only the retirer retires it
    assert RUNTIME.in_flight >= 1
    gate.set()
    while RUNTIME.in_flight and time.monotonic() < deadline:
        time.sleep(0.005)
    assert RUNTIME.in_flight == 0 and not b.allocation.tracker


def test_a_stream_waiting_for_work_that_then_faults_faults_too(host):
    """Stream b is ordered after a kernel on a that has not run yet; that kernel then faults
    (HostFault): b's wait cannot know what it waited for, so b faults too -- its kernel never
    runs, its future and later launches on it raise CompletionUnknownError saying why, and
    the leases of both streams are kept (leaked), never freed."""
    a, b = host.create_stream("a"), host.create_stream("b")
    gate, ran = threading.Event(), []

    @sm.host_kernel
    def faulting(x):
        gate.wait(5)
        raise HostFault("illegal address (simulated)")

    @sm.host_kernel
    def reads(x, out):
        ran.append(True)
        out[:] = x

    buf = sm.Buffer.zeros(4, "int32", device=host, stream=a)
    out = sm.Buffer.zeros(4, "int32", device=host, stream=b)
    sm.synchronize()
    before = sm.stats()
    fa = sm.launch(faulting, 1, 1, buf, stream=a)
    fb = sm.launch(reads, 1, 1, sm.In(buf), sm.Out(out), stream=b)  # (b waits for a)
    gate.set()
    why = (r"this stream waited for work whose completion is unknown: "
           r"HostFault\('illegal address \(simulated\)'\)")
    with pytest.warns(sm.LeakWarning) as warned:
        with pytest.raises(sm.CompletionUnknownError,
                           match=r"^completion of host kernel .*reads on <Stream b on <Device "
                                 r"host> \(owned\)> is unknown: CompletionUnknownError\(\"" +
                                 why + r"\"\)\. Its memory is kept") as ei:
            fb.result(5)
        with pytest.raises(sm.CompletionUnknownError, match=r"^completion of host kernel "
                                                            r".*faulting on <Stream a .* is "
                                                            r"unknown: HostFault"):
            fa.result(5)
    assert sorted(str(w.message).split(" (")[0] for w in warned) == [
        "completion of work on <Stream a on <Device host>",
        "completion of work on <Stream b on <Device host>"]
    assert type(ei.value.__cause__) is sm.CompletionUnknownError
    assert str(ei.value.__cause__) == why.replace("\\", "")
    assert ran == [] and str(b._impl.fault) == why.replace("\\", "")
    st = sm.stats()
    assert (st.leaked, st.leaked_bytes) == (before.leaked + 2, before.leaked_bytes + 48)
    assert st.in_flight == before.in_flight
    with pytest.raises(sm.CompletionUnknownError, match=r"^<Stream b on <Device host> "
                                                        r"\(owned\)> faulted earlier "
                                                        r"\(CompletionUnknownError\(\"" + why):
        sm.launch(reads, 1, 1, sm.In(out), sm.Out(out), stream=b)


def test_a_failure_at_every_retirer_pass_is_reported_once_until_taken(monkeypatch):
    """A pass that fails the same way every time (a device whose context cannot be made
    current) queued one error a pass -- every 0.2 ms, without bound -- each re-raised by the
    next user call in turn. It waits once now, until a user thread takes it; a failure that
    differs is queued beside it."""
    import time
    from sharedmem.runtime import retirer
    from sharedmem.runtime.state import RUNTIME
    calls = []

    def failing(rt, last):
        calls.append(1)
        raise sm.CudaError("cuCtxSetCurrent failed: CUDA_ERROR_INVALID_CONTEXT (201)", 201)

    RUNTIME.errors.clear()
    monkeypatch.setattr(retirer, "_pass", failing)
    try:
        retirer.ensure()
        retirer.wake()
        deadline = time.monotonic() + 5
        while len(calls) < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) >= 50  # (the retirer kept trying: it polls after a failure)
        assert [str(e) for e in RUNTIME.errors] == [
            "cuCtxSetCurrent failed: CUDA_ERROR_INVALID_CONTEXT (201)"]
        assert retirer._pending(RUNTIME.errors, sm.CudaError(
            "cuCtxSetCurrent failed: CUDA_ERROR_INVALID_CONTEXT (201)", 201))
        assert not retirer._pending(RUNTIME.errors, sm.CudaError("another", 1))
    finally:
        monkeypatch.undo()
        retirer.wake()
        time.sleep(0.05)
        RUNTIME.errors.clear()


def test_an_interrupt_while_retired_work_is_finished_loses_none_of_its_callbacks(
        host, monkeypatch):
    """A KeyboardInterrupt (a signal handler's) that lands inside finish() -- here in the host
    marker's recycle(), a Python call there, before the work's callbacks were looked at -- is
    raised where it landed (or at the next API call, where another thread finished the work),
    and the callbacks of that work still run (on the callback workers): before, they were
    dropped, and the then() of the work never finished."""
    from sharedmem.backends.host import HostMarker
    gate = threading.Event()

    @sm.host_kernel
    def k(x):
        gate.wait(5)

    s = host.create_stream()
    b = sm.Buffer.zeros(4, device=host, stream=s)
    s.synchronize()
    f = sm.launch(k, 1, 1, b, stream=s)
    h = f.then(lambda _v: "ran")
    seen = []
    f.add_done_callback(lambda _f: seen.append(1))
    once = [True]

    def interrupted(self):
        if once[0]:
            once[0] = False
            raise KeyboardInterrupt

    monkeypatch.setattr(HostMarker, "recycle", interrupted)
    gate.set()
    with pytest.raises(KeyboardInterrupt):
        f.result(5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # (finished by the retirer: deferred to an API call)
            sm.stats()
            time.sleep(0.01)
    assert not once[0]
    assert h.result(5) == "ran"
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [1]
    sm.synchronize()
    assert sm.stats().in_flight == 0


def test_a_callback_worker_lives_on_after_an_error_taking_callbacks(host, monkeypatch):
    """A callback worker takes a submission's callbacks under the core lock, and taking the
    lock applies the releases finalizers staged, which may raise (a hold's end whose lease
    cannot be filed): the error is re-raised at the next API call of a user thread, as a
    callback's is, and the worker runs on. Before, it died of it, still counted as a worker:
    nothing the retirer handed off after ran again."""
    from sharedmem.runtime import retirer
    from sharedmem.runtime.state import RUNTIME
    monkeypatch.setattr(retirer, "IDLE_INTERVAL", 5.0)  # (the retirer takes no lock meanwhile)
    gate, busy = threading.Event(), threading.Event()
    a = sm.Buffer.zeros(4, device=host)
    sm.synchronize()
    f1 = sm.launch(sm.host_kernel(lambda x: None), 1, 1, a, stream=host.create_stream())
    f1.add_done_callback(lambda _f: (busy.set(), gate.wait(10)))  # occupies the worker
    assert busy.wait(5)
    f2 = sm.launch(sm.host_kernel(lambda x: None), 1, 1, a, stream=host.create_stream())
    f2.add_done_callback(lambda _f: None)  # queued for the busy worker
    deadline = time.monotonic() + 5
    while f2._s.state == 0 and time.monotonic() < deadline:  # (retired, handed off)
        time.sleep(0.01)
    assert f2._s.state != 0

    def failing(_arg):
        raise RuntimeError("a staged release failed")

    RUNTIME.staged.append((failing, None))
    gate.set()  # the worker goes on to f2's callbacks: taking the lock, it drains the stage
    deadline = time.monotonic() + 5
    while RUNTIME.staged and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    with pytest.raises(RuntimeError, match="a staged release failed"):
        sm.stats()
    go = threading.Event()
    f3 = sm.launch(sm.host_kernel(lambda x: go.wait(5)), 1, 1, a, stream=host.create_stream())
    ran = threading.Event()
    f3.add_done_callback(lambda _f: ran.set())
    go.set()
    assert ran.wait(5)  # run by the retirer's hand-off, on the worker
    sm.synchronize()


def test_result_honours_its_timeout_when_the_work_ahead_on_its_stream_is_still_running(host):
    """A submission whose marker is known at once -- its completion unknown, where recording
    the marker failed (a FailedMarker: a hold's end, an enqueue cut short, a CUDA event record
    that failed) -- behind work still running on its stream: it leaves the FIFO only once the
    work ahead does. result(timeout) raises TimeoutError at its timeout; before, it spun until
    the work ahead finished, however long."""
    from sharedmem.runtime import submission as _sub
    from sharedmem.runtime.future import DeviceFuture
    from sharedmem.runtime.state import locked
    gate = threading.Event()

    @sm.host_kernel
    def blocked(x):
        gate.wait(10)

    s = host.create_stream()
    b = sm.Buffer.zeros(4, device=host, stream=s)
    sm.launch(blocked, 1, 1, b, stream=s)
    with locked():
        sub = _sub.lease_locked(s, [], [], "failed record",
                                _sub.FailedMarker(RuntimeError("record failed")))
    fut = DeviceFuture(sub)
    threading.Timer(3.0, gate.set).start()  # (the work ahead ends: the test ends either way)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.2)
        assert time.monotonic() - t0 < 2.0
    finally:
        gate.set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.LeakWarning)
        with pytest.raises(sm.CompletionUnknownError):
            fut.result(5)  # (the walk reached it: kept, completion unknown)
        sm.synchronize()
