"""Exports after partial work: order_consumer's elsewhere check (a consumer that names no
stream), a hold end's lease (no cycle back to the released token) and its label."""
import gc
import re
import sys
import threading
import types
import weakref

import numpy as np
import pytest

import sharedmem as sm
from sharedmem.access import AccessTracker
from sharedmem.runtime.state import RUNTIME
from interop import dlpack as dl


def test_tracker_elsewhere_none_after_last_dropped():
    # A has unfinished work; B (recorded last) finished. Pruning B (from stream C's check)
    # resets _last to None; elsewhere_locked(None) must still see A's unfinished write.
    host = sm.Device.host()
    A, B, C = (host.create_stream(n) for n in "ABC")
    t = AccessTracker()
    with sm.runtime.state.locked():
        t.record_locked(A, True, 0, 16, A._seq + 1, "markerA")
        t.record_locked(B, True, 16, 32, B._seq + 1, "markerB")
        done_b = B._done
        B._done = B._seq + 1
        try:
            assert t.elsewhere_locked(C)  # prunes B: _last becomes None
            assert t.conflicts_locked(None, True, 0, 16, None)  # A still conflicts
            assert t.elsewhere_locked(None), "elsewhere_locked(None) misses A's unfinished write"
        finally:
            B._done = done_b


@pytest.fixture
def host():
    return sm.Device.host()


def test_host_export_waits_after_a_partial_export(host):
    gate = threading.Event()

    @sm.host_kernel
    def slow_fill(x):
        gate.wait(5)
        x[:] = 7

    @sm.host_kernel
    def quick_fill(x):
        x[:] = 9

    a, b = host.create_stream(), host.create_stream()
    t = sm.Tensor.from_host(np.zeros(8, np.int32), device=host)
    host.default_stream.synchronize()
    sm.launch(slow_fill, 1, 1, sm.Out(t[:4]), stream=a)   # pending on A
    sm.launch(quick_fill, 1, 1, sm.Out(t[4:]), stream=b)  # finished on B (recorded last)
    b.synchronize()
    first = np.from_dlpack(t[4:])  # disjoint from A: no wait; prunes B -> tracker._last 0
    assert first.tolist() == [9] * 4
    timer = threading.Timer(0.5, gate.set)
    timer.start()
    try:
        whole = np.from_dlpack(t)  # must wait for A's slow write
        got = whole.tolist()
    finally:
        gate.set()
        timer.cancel()
        a.synchronize()
    assert got == [7] * 4 + [9] * 4, got


def test_hold_end_leaves_no_cycle_on_released_token():
    from fake_cuda import install_fake_devices
    mp = pytest.MonkeyPatch()
    try:
        (dev,), drv = install_fake_devices(mp, True)
        t = sm.Tensor.from_buffer(sm.Buffer.empty(64, "float32", device=dev), (64,))
        cap = t.__dlpack__(stream=1, max_version=(1, 0))
        tok = dl._exports[dl._get_pointer(cap, b"dltensor_versioned")].token
        del cap  # the unconsumed capsule's destructor ends the export: a hold end is leased
        dev.default_stream.synchronize()
        assert not tok.live
        assert tok.use_r is None and tok.use_w is None, \
            f"released hold token refers to itself again: use_w={tok.use_w!r} use_r={tok.use_r!r}"
    finally:
        mp.undo()


def test_hold_end_label_in_stats_and_futures():
    from fake_cuda import install_fake_devices
    mp = pytest.MonkeyPatch()
    try:
        (dev,), drv = install_fake_devices(mp, True)
        drv.holding = True
        t = sm.Tensor.from_buffer(sm.Buffer.empty(64, "float32", device=dev), (64,))
        cap = t.__dlpack__(stream=1, max_version=(1, 0))
        del cap
        labels = [f.label for f in sm.inflight()] if hasattr(sm, "inflight") else []
        assert any(l == "end of a DLPack export hold" for l in labels), labels
        assert all(isinstance(l, str) for l in labels)
        drv.finish_held()
        dev.default_stream.synchronize()
    finally:
        mp.undo()


def test_hold_end_cycle_keeps_device_memory_until_gc():
    from fake_cuda import install_fake_devices
    mp = pytest.MonkeyPatch()
    gc.disable()
    try:
        (dev,), drv = install_fake_devices(mp, True)
        t = sm.Tensor.from_buffer(sm.Buffer.empty(64, "float32", device=dev), (64,))
        alloc = weakref.ref(t.allocation)
        cap = t.__dlpack__(stream=1, max_version=(1, 0))
        del cap
        t.release()
        del t
        dev.default_stream.synchronize()
        sm.synchronize() if hasattr(sm, "synchronize") else None
        assert alloc() is None, "allocation kept alive by the (tok, True) <-> tok cycle until gc"
    finally:
        gc.enable()
        gc.collect()
        mp.undo()


def test_cuda_stream2_export_waits_after_a_partial_export(monkeypatch):
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, True)
    a, b = dev.create_stream("A"), dev.create_stream("B")
    buf = sm.Buffer.zeros(8, "float64", device=dev)
    dev.default_stream.synchronize()
    lo, hi = buf[:4], buf[4:]
    # (holding throughout: A's lazily recorded event is held whenever it is recorded; B's
    # is released by the synchronize)
    drv.holding = True
    lo.copy_from(np.full(4, 1.0), stream=a)  # A's write stays pending
    hi.copy_from(np.full(4, 2.0), stream=b)  # B's finishes
    b.synchronize()
    c1 = hi.__dlpack__(stream=2)  # disjoint from A: nothing to wait for; prunes B
    n = len(drv.calls)
    c2 = buf.__dlpack__(stream=2)  # overlaps A's pending write: stream 2 must wait for it
    waits = [c for c in drv.calls[n:] if c[0] == "wait"]
    drv.holding = False
    drv.finish_held()
    del c1, c2
    sm.synchronize()
    assert waits, "no cuStreamWaitEvent for A's pending write before the stream=2 export"


def _pending_a_finished_b_then_rejected(monkeypatch):
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, True)
    a, b, c = dev.create_stream("A"), dev.create_stream("B"), dev.create_stream("C")
    buf = sm.Buffer.zeros(8, "float64", device=dev)
    dev.default_stream.synchronize()
    lo, hi = buf[:4], buf[4:]
    drv.holding = True  # (throughout: see above)
    lo.copy_from(np.full(4, 1.0), stream=a)  # A's write stays pending
    hi.copy_from(np.full(4, 2.0), stream=b)  # B's finishes (B recorded last)
    b.synchronize()
    sm.set_access_policy("reject")
    try:
        with pytest.raises(sm.AccessConflictError):  # prunes B (tracker._last -> 0)
            buf.copy_from(np.zeros(8), stream=c)
    finally:
        sm.set_access_policy("order")
    return dev, drv, buf


@pytest.mark.parametrize("how", ["dlpack stream=2", "cai"])
def test_cuda_export_after_rejected_launch_orders_pending_write(monkeypatch, how):
    dev, drv, buf = _pending_a_finished_b_then_rejected(monkeypatch)
    n = len(drv.calls)
    if how == "cai":
        cai = buf.__cuda_array_interface__
        ordered = cai["stream"] is not None
    else:
        cap = buf.__dlpack__(stream=2)
        ordered = any(c[0] == "wait" for c in drv.calls[n:])
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    assert ordered, f"{how}: A's pending write to these bytes was not ordered before the consumer"


def test_hold_end_label_in_trace(tmp_path):
    import json
    from fake_cuda import install_fake_devices
    mp = pytest.MonkeyPatch()
    try:
        (dev,), drv = install_fake_devices(mp, True)
        t = sm.Tensor.from_buffer(sm.Buffer.empty(64, "float32", device=dev), (64,))
        p = tmp_path / "t.json"
        with sm.trace(str(p), nvtx=False):
            cap = t.__dlpack__(stream=1, max_version=(1, 0))
            del cap
            sm.synchronize()
        text = p.read_text()
        assert "end of a DLPack export hold" in text, text[:500]
    finally:
        mp.undo()


def _park_retirer(monkeypatch):
    """Only the exports' own sweeps retire anything until _unpark."""
    import time
    from sharedmem.runtime import retirer
    monkeypatch.setattr(retirer, "BUSY_INTERVAL", 60.0)
    monkeypatch.setattr(retirer, "POLL_INTERVAL", 60.0)
    monkeypatch.setattr(retirer, "LINGER", 0.0)
    monkeypatch.setattr(retirer, "IDLE_INTERVAL", 60.0)
    retirer.wake()
    time.sleep(0.05)


def _unpark(monkeypatch):
    from sharedmem.runtime import retirer
    monkeypatch.undo()  # (before the wake: else the retirer may sleep 60 s on)
    retirer.wake()


def _submissions() -> int:
    return sum(type(o).__name__ == "Submission" for o in gc.get_objects())


@pytest.mark.parametrize("how", ["dlpack", "cai"])
def test_hold_ends_of_an_export_loop_die_young(monkeypatch, how):
    """A loop of exports (cupy.from_dlpack's pattern; CAI exports of fresh views) is swept by
    the exports themselves: nothing else sweeps hold ends but the retirer, which a busy thread
    lets run only every GIL switch interval -- they piled up, outlived the collector's young
    generations and set off full collections (4 us an export on an H200 with cuTile)."""
    from fake_cuda import install_fake_devices
    from sharedmem.runtime.submission import SWEEP_EVERY
    (dev,), drv = install_fake_devices(monkeypatch, True)
    t = sm.Tensor.from_buffer(sm.Buffer.empty(64, "float32", device=dev), (64,))
    sm.synchronize()
    _park_retirer(monkeypatch)
    pending = dev.default_stream._pending
    gc.disable()
    try:
        before = _submissions()  # (earlier tests' may still be alive: only new ones count)
        peak = 0
        for _ in range(5 * SWEEP_EVERY):
            if how == "dlpack":
                cap = t.__dlpack__(stream=1, max_version=(1, 0))
                del cap  # released unconsumed: a hold end is leased on the default stream
            else:
                v = t[:]
                v.__cuda_array_interface__
                del v  # the view dies: its CAI hold ends
            peak = max(peak, len(pending))
        assert peak <= SWEEP_EVERY, f"{peak} hold ends pending on the default stream"
        assert _submissions() - before <= SWEEP_EVERY + 1
    finally:
        gc.enable()
        _unpark(monkeypatch)



def test_hold_ends_share_a_submission_and_keep_all_they_held(monkeypatch):
    """Hold ends that join their stream's open completion event one after another share one
    submission (a loop of cupy.from_dlpack files one per MARKER_BATCH exports), and it keeps
    what each of them kept -- here three allocations no view refers to any more -- until the
    device has passed that point. Other work on the stream between two ends starts a new one."""
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, False)
    ts = [sm.Tensor.from_buffer(sm.Buffer.empty(64, "float32", device=dev), (64,))
          for _ in range(4)]
    other = sm.Buffer.empty(64, "float32", device=dev)
    sm.synchronize()
    # The retirer thread sweeps nothing during the test: a pass of it records the open event,
    # and the next end then files a submission of its own -- as it should, but this test
    # counts them.
    import types
    import sharedmem.runtime.retirer as ret
    import sharedmem.runtime.submission as sub_mod
    monkeypatch.setattr(ret, "_sub", types.SimpleNamespace(
        SWEEP_EVERY=sub_mod.SWEEP_EVERY, sweep_each=lambda streams, seen=None: None))
    pending = dev.default_stream._pending
    gc.collect()  # (earlier tests' garbage: a collection below must find only this test's)
    live = sm.stats().live_allocations
    drv.holding = True  # the device is behind: nothing finishes until finish_held()
    try:
        n = len(pending)
        for t in ts[:3]:
            cap = t.__dlpack__(stream=1, max_version=(1, 0))
            del cap  # released unconsumed: its hold ends
        assert len(pending) == n + 1
        shared = pending[-1]
        assert shared.label == "end of a DLPack export hold"
        assert [(u[0].allocation.id, u[1]) for u in shared.uses] == \
            [(t.allocation.id, True) for t in ts[:3]]
        other.fill_zero()  # work between two ends: the next end files its own submission
        cap = ts[3].__dlpack__(stream=1, max_version=(1, 0))
        del cap
        assert len(pending) == n + 3 and pending[-1] is not shared
        ids = {t.allocation.id for t in ts}
        for t in ts:
            t.release()
        del t, ts
        gc.collect()
        assert sm.stats().live_allocations == live  # kept by the ends' leases, not freed
        leased = {lease[0] for e in sm.inflight() if e.stream is dev.default_stream
                  and e.label == "end of a DLPack export hold" for lease in e.leases}
        assert leased == ids
    finally:
        drv.holding = False
        drv.finish_held()
        sm.synchronize()  # (it sweeps every stream itself: the retirer is not needed)
    gc.collect()
    assert sm.stats().live_allocations == live - 4 and sm.stats().in_flight == 0

def test_export_loop_with_the_device_behind_sweeps_once_per_sweep_every(monkeypatch):
    """While nothing retires (the device behind), exports do not sweep every time: each
    sweep records the stream's open marker, and every export would cost an event record,
    queries and a new event."""
    from fake_cuda import install_fake_devices
    from sharedmem.backends.cuda import MARKER_BATCH
    from sharedmem.runtime.submission import SWEEP_EVERY
    (dev,), drv = install_fake_devices(monkeypatch, True)
    t = sm.Tensor.from_buffer(sm.Buffer.empty(64, "float32", device=dev), (64,))
    sm.synchronize()
    _park_retirer(monkeypatch)
    drv.holding = True
    try:
        n = 4 * SWEEP_EVERY
        records0, events0 = sum(c[0] == "record" for c in drv.calls), len(drv.events)
        for _ in range(n):
            cap = t.__dlpack__(stream=1, max_version=(1, 0))
            del cap
        records = sum(c[0] == "record" for c in drv.calls) - records0
        assert records <= n // MARKER_BATCH + n // SWEEP_EVERY + 2, records
        assert len(drv.events) - events0 <= n // MARKER_BATCH + n // SWEEP_EVERY + 2
    finally:
        drv.holding = False
        drv.finish_held()
        sm.synchronize()
        _unpark(monkeypatch)


def _export_until_the_next_sweeps(t, stream) -> None:
    """Export ``t`` to ``stream`` (capsules dropped) until the next export's hold sweeps the
    stream (submission.sweep_long): SWEEP_EVERY seqs given out since the last sweep, and more
    than the newest submission pending. Hold ends share a submission per completion marker,
    so that takes more than SWEEP_EVERY exports."""
    from sharedmem.runtime.submission import SWEEP_EVERY
    n = 0
    while stream._seq - stream._swept < SWEEP_EVERY or len(stream._pending) < 2:
        cap = t.__dlpack__(stream=1, max_version=(1, 0))
        del cap
        n += 1
        assert n < 4 * SWEEP_EVERY, "no sweep came"
    ends = sum(len(s.uses) for s in stream._pending if isinstance(s.uses, list))
    assert ends >= SWEEP_EVERY - 1 and len(stream._pending) < ends  # (ends joined submissions)


def test_a_failing_sweep_fails_no_export_and_leaks_no_hold(monkeypatch):
    """The export's sweep meets a driver error: the export still succeeds (the error is
    re-raised at a later call), and once its capsule is gone nothing is left live."""
    import sharedmem.backends.cuda as bc
    from fake_cuda import CUresult, install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, False)
    t = sm.Tensor.from_buffer(sm.Buffer.empty(64, "float32", device=dev), (64,))
    sm.synchronize()
    _park_retirer(monkeypatch)
    drv.holding = True  # the device is behind: hold ends stay pending
    _export_until_the_next_sweeps(t, dev.default_stream)
    real = drv.cuCtxSetCurrent
    drv.cuCtxSetCurrent = lambda ctx: (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
    bc._current.ctx = None  # (the next driver call switches context: and fails)
    try:
        cap = t.__dlpack__(stream=1, max_version=(1, 0))
    finally:
        drv.cuCtxSetCurrent = real
    del cap
    drv.holding = False
    drv.finish_held()
    try:
        with pytest.raises(sm.CudaError, match="CUDA_ERROR_INVALID_CONTEXT"):
            sm.synchronize()  # (the sweep's error, deferred to the next call)
        sm.synchronize()
        gc.collect()
        assert t.allocation.views() == [t._token.describe()]
        t.into_buffer()  # no export is left to alias it
    finally:
        _unpark(monkeypatch)


def test_an_export_runs_no_callback_of_other_work(monkeypatch):
    """The export's sweep retires other work; its done-callbacks go to the callback workers,
    never run inside __dlpack__ (code that exports under a lock its callback takes would
    deadlock)."""
    import threading
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, True)
    t = sm.Tensor.from_buffer(sm.Buffer.empty(64, "float32", device=dev), (64,))
    b = sm.Buffer.empty(64, "float32", device=dev)
    sm.synchronize()
    _park_retirer(monkeypatch)
    lock = threading.Lock()
    ran = []

    def on_done(f):
        ok = lock.acquire(timeout=1.0)  # (a plain acquire would hang forever)
        ran.append((threading.get_ident(), ok))
        if ok:
            lock.release()
    try:
        b.fill_zero().add_done_callback(on_done)
        _export_until_the_next_sweeps(t, dev.default_stream)
        assert not ran
        with lock:  # e.g. a thread-safe wrapper handing its tensor to cupy.from_dlpack
            cap = t.__dlpack__(stream=1, max_version=(1, 0))
        del cap
        sm.synchronize()
        import time
        deadline = time.monotonic() + 5
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran and all(ok and ident != threading.get_ident() for ident, ok in ran), ran
    finally:
        sm.synchronize()
        _unpark(monkeypatch)


def test_a_failing_tracer_loses_no_retired_work(monkeypatch):
    """The tracer is told of retired work under the core lock, inside the sweep: an error
    there (an NVTX call failing) is re-raised at a later call, and the sweep's list still
    reaches finish() -- else what it kept stayed kept and every settle() (a move) waited out
    its timeout for it."""
    import types
    from sharedmem.runtime import submission
    fake = types.ModuleType("nvtx")
    calls = [0]

    def end_range(r):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("nvtx end_range failed")
    fake.start_range = lambda message=None, domain=None: object()
    fake.end_range = end_range
    monkeypatch.setitem(sys.modules, "nvtx", fake)

    @sm.host_kernel
    def inc(x):
        x += 1

    dev = sm.Device.host()
    buf = sm.Buffer.zeros(16, device=dev)
    raised = []
    with sm.trace(nvtx=True):
        for _ in range(3):
            try:
                sm.launch(inc, 1, 1, sm.InOut(buf)).result()
            except RuntimeError as e:
                raised.append(str(e))
        try:
            sm.synchronize()
        except RuntimeError as e:
            raised.append(str(e))
    assert raised == ["nvtx end_range failed"]
    assert RUNTIME.unfinished == 0
    import time
    t0 = time.monotonic()
    submission.settle()
    assert time.monotonic() - t0 < 0.5


@pytest.mark.parametrize("export", ["DLPack", "CUDA Array Interface"])
def test_an_export_orders_its_consumer_and_makes_its_hold_in_one_step(monkeypatch, export):
    """No work can come between the consumer's ordering and the export's hold. A copy started
    on another thread while the export orders its consumer (from inside the wait it enqueues,
    under the core lock) runs after the export has its hold: under policy 'reject' it is
    refused because the consumer holds the bytes. In a gap it would have found only A's read
    (no conflict with a read), run, and raced the consumer, which may write."""
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, True)
    a, c = dev.create_stream("A"), dev.create_stream("C")
    buf, out, other = (sm.Buffer.zeros(8, "float64", device=dev) for _ in range(3))
    dev.default_stream.synchronize()
    drv.holding = True  # (throughout: A's read stays pending, so the export waits for it)
    out.copy_from(buf, stream=a)  # A reads buf
    consumer = dev.create_stream("consumer")
    outcome, threads = [], []

    def copy_on_c():
        try:
            other.copy_from(buf, stream=c)  # reads buf
            outcome.append("ran")
        except sm.AccessConflictError as e:
            outcome.append(str(e))

    real_wait = drv.cuStreamWaitEvent

    def wait(stream, ev, flags):
        if not threads:  # the export's wait, under the core lock: start the copy now
            t = threading.Thread(target=copy_on_c)
            threads.append(t)
            t.start()
            t.join(0.2)
            assert t.is_alive()  # (it cannot take the core lock while the export holds it)
        return real_wait(stream, ev, flags)

    monkeypatch.setattr(drv, "cuStreamWaitEvent", wait)
    sm.set_access_policy("reject")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (a gap after the ordering would let the copy in at once)
    try:
        if export == "DLPack":
            cap = buf.__dlpack__(stream=consumer.handle, max_version=(1, 0))
        else:
            cap = buf.__cuda_array_interface__
        threads[0].join(5)
    finally:
        sys.setswitchinterval(interval)
        sm.set_access_policy("order")
    assert len(outcome) == 1, outcome
    if export == "DLPack":
        assert f"a consumer on {consumer} holds them (may write)" in outcome[0], outcome
    else:  # (the consumer's likely streams: here the device's default stream)
        assert f"a consumer on {dev.default_stream} holds them (may write)" in outcome[0], \
            outcome
    del cap
    drv.holding = False
    drv.finish_held()
    sm.synchronize()


def test_a_view_released_while_its_export_waits_leaves_no_hold():
    """A host export waits for the pending write after its hold is made; a release of the
    Buffer meanwhile makes the export raise ReleasedError -- and the hold goes with it: the
    allocation is left with no live view (a hold left behind would make it unmovable)."""
    host = sm.Device.host()
    gate = threading.Event()

    @sm.host_kernel
    def slow_fill(x):
        gate.wait(5)
        x[:] = 7

    s = host.create_stream()
    buf = sm.Buffer.from_host(np.zeros(8, np.int32), device=host)
    whole = buf.allocation
    sm.launch(slow_fill, 1, 1, sm.Out(buf), stream=s)  # a pending write: the export waits
    seen = []

    def release_then_finish():
        for _ in range(500):  # (until the export's hold is there: it is waiting now)
            if len(whole.views()) == 2:
                break
            threading.Event().wait(0.01)
        seen.append(whole.views())
        buf.release()
        gate.set()

    t = threading.Thread(target=release_then_finish)
    t.start()
    with pytest.raises(sm.ReleasedError, match="this Buffer .* was released"):
        np.from_dlpack(buf)
    t.join()
    s.synchronize()
    assert seen == [[f"buffer, bytes [0, 32) of allocation #{whole.id}",
                     f"DLPack export, bytes [0, 32) of allocation #{whole.id}"]]
    assert whole.views() == []


def test_a_cai_read_again_is_not_ordered_after_its_own_hold(monkeypatch):
    """``cupy.asarray`` reads ``__cuda_array_interface__`` more than once. The view's own hold
    (its earlier reads' consumers, who reach the bytes through the same object) is not waited
    for: nothing pending, no event recorded, no wait, ``stream`` None each time. Work that is
    pending -- a write on another stream, or another consumer's hold -- still is, every read."""
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, True)
    buf = sm.Buffer.zeros(8, "float64", device=dev)
    dev.default_stream.synchronize()
    n = len(drv.calls)
    cais = [buf.__cuda_array_interface__ for _ in range(3)]
    assert [c["stream"] for c in cais] == [None, None, None]
    assert [c for c in drv.calls[n:] if c[0] in ("record", "wait")] == []
    assert cais[0] == cais[2] and cais[0] is not cais[2]  # (a dict of its own each time)
    assert cais[0]["descr"] is not cais[2]["descr"]
    # another consumer's hold, on another stream: ordered after, on every read
    other = dev.create_stream("other")
    cap = buf.__dlpack__(stream=other.handle, max_version=(1, 0))
    export_stream = cais[0]["stream"]
    for _ in range(2):
        n = len(drv.calls)
        cai = buf.__cuda_array_interface__
        assert cai["stream"] is not None
        records = [c for c in drv.calls[n:] if c[0] == "record"]
        assert [c[2] for c in records] == [other.handle]  # a marker of the other consumer's work
        assert ("wait", cai["stream"], records[0][1]) in drv.calls[n:]
    del cap
    # a pending write on another stream: ordered after, on every read
    a = dev.create_stream("A")
    drv.holding = True
    buf.copy_from(np.ones(8), stream=a)
    for _ in range(2):
        assert buf.__cuda_array_interface__["stream"] is not None
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    assert export_stream is None


def _records_and_waits(drv, n):
    return [c for c in drv.calls[n:] if c[0] in ("record", "wait")]


def test_a_cai_read_for_a_consumer_on_another_stream_is_ordered_after_the_first(monkeypatch):
    """The view's own hold is skipped only on streams this read's consumer is ordered after:
    CuPy's current stream X for the first consumer, Z for the second -- the second read is
    ordered after whatever X was given (a marker recorded on X, the export stream waits on
    it), and a read again under Z is not ordered after its own consumer."""
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, True)
    buf = sm.Buffer.zeros(8, "float64", device=dev)
    dev.default_stream.synchronize()
    cupy = sys.modules["cupy"]
    x, z = types.SimpleNamespace(ptr=0x7001), types.SimpleNamespace(ptr=0x7002)  # (blocking)
    cupy.current = x
    n = len(drv.calls)
    assert buf.__cuda_array_interface__["stream"] is None  # nothing pending
    assert buf.__cuda_array_interface__["stream"] is None  # (read again: its own consumer)
    assert _records_and_waits(drv, n) == []
    cupy.current = z
    n = len(drv.calls)
    cai = buf.__cuda_array_interface__
    assert cai["stream"] is not None
    records = [c for c in drv.calls[n:] if c[0] == "record"]
    assert [c[2] for c in records] == [x.ptr]  # (the default stream's hold: Z follows it)
    assert _records_and_waits(drv, n) == [records[0], ("wait", cai["stream"], records[0][1])]
    # read again under Z: X's consumer is still waited for, Z's own is not
    n = len(drv.calls)
    assert buf.__cuda_array_interface__["stream"] is not None
    assert [c[2] for c in drv.calls[n:] if c[0] == "record"] == [x.ptr]
    del cai, buf  # (the hold ends while the fake driver is installed)
    gc.collect()
    sm.synchronize()


def test_a_cai_read_under_a_non_blocking_stream_is_ordered_after_its_own_hold(monkeypatch):
    """With CuPy's current stream a non-blocking one (torch's and sharedmem's streams are),
    the consumer may be on it or on the legacy default stream, which are not ordered with
    each other: a read again waits for the hold on both."""
    from fake_cuda import install_fake_devices
    from interop.streams import ordered_among
    (dev,), drv = install_fake_devices(monkeypatch, True)
    buf = sm.Buffer.zeros(8, "float64", device=dev)
    dev.default_stream.synchronize()
    x = dev.create_stream("non-blocking")
    sys.modules["cupy"].current.ptr = x.handle
    assert not ordered_among([dev.default_stream, x])
    assert ordered_among([x]) and ordered_among([dev.default_stream])
    assert buf.__cuda_array_interface__["stream"] is None
    n = len(drv.calls)
    cai = buf.__cuda_array_interface__
    assert cai["stream"] is not None
    assert sorted(c[2] for c in drv.calls[n:] if c[0] == "record") == sorted([0, x.handle])
    del cai, buf  # (the hold ends while the fake driver is installed)
    gc.collect()
    sm.synchronize()


def _fake_torch(monkeypatch, handle):
    """torch imported and initialized, its current stream ``handle``."""
    cur = types.SimpleNamespace(cuda_stream=handle)
    m = types.ModuleType("torch")
    m.cuda = types.SimpleNamespace(is_initialized=lambda: True,
                                   current_stream=lambda ordinal=None: cur)
    monkeypatch.setitem(sys.modules, "torch", m)
    return cur


def test_a_cai_read_under_two_blocking_current_streams_is_ordered_after_its_own_hold(
        monkeypatch):
    """CuPy's current stream X and torch's Y both blocking: each synchronizes with the legacy
    default stream, not with the other. A consumer on Y (torch.as_tensor) after one on X
    (cupy.asarray, writing) is ordered after X's work: the view's own hold is waited for."""
    from fake_cuda import install_fake_devices
    from interop.streams import current_consumers
    (dev,), drv = install_fake_devices(monkeypatch, True)
    buf = sm.Buffer.zeros(8, "float64", device=dev)
    dev.default_stream.synchronize()
    sys.modules["cupy"].current = types.SimpleNamespace(ptr=0x7001)  # (fake: blocking)
    _fake_torch(monkeypatch, 0x7002)
    streams, ordered = current_consumers(dev)
    assert [s.handle for s in streams] == [0, 0x7001, 0x7002] and not ordered
    assert buf.__cuda_array_interface__["stream"] is None
    n = len(drv.calls)
    cai = buf.__cuda_array_interface__
    assert cai["stream"] is not None
    assert sorted(c[2] for c in drv.calls[n:] if c[0] == "record") == [0, 0x7001, 0x7002]
    del cai, streams, buf
    gc.collect()
    sm.synchronize()


def test_a_cai_read_under_per_thread_default_streams_is_ordered_after_its_own_hold(
        monkeypatch):
    """CuPy's current stream the per-thread default stream (handle 2) in two threads: they are
    two streams, not ordered with each other. Thread B's read is ordered after thread A's
    consumer through the legacy default stream (a marker there follows every blocking
    stream's work, the per-thread ones included)."""
    from fake_cuda import install_fake_devices
    from interop.streams import current_consumers
    (dev,), drv = install_fake_devices(monkeypatch, True)
    buf = sm.Buffer.zeros(8, "float64", device=dev)
    dev.default_stream.synchronize()
    sys.modules["cupy"].current.ptr = 2
    assert current_consumers(dev) == ([dev.default_stream], False)
    out = {}

    def read(key):
        n = len(drv.calls)
        out[key] = (buf.__cuda_array_interface__["stream"],
                    [c[2] for c in drv.calls[n:] if c[0] == "record"])

    for key in ("A", "B"):
        t = threading.Thread(target=read, args=(key,))
        t.start()
        t.join()
    assert out["A"] == (None, [])
    assert out["B"][0] is not None and out["B"][1] == [0]
    del buf
    gc.collect()
    sm.synchronize()


def test_whether_a_stream_borrowed_as_a_bare_handle_is_blocking_is_asked_each_time(
        monkeypatch):
    """A stream borrowed from an object that owns it (a CuPy stream) is asked once whether it
    is blocking; one borrowed as a bare handle each time: the stream may be destroyed and a
    non-blocking one get its handle."""
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, True)

    class Owned:  # (a CuPy stream, to sharedmem)
        ptr = 0x7003

    bare = sm.Stream.from_external(0x7001, dev)
    owned_obj = Owned()
    owned = sm.Stream.from_external(owned_obj, dev)
    assert bare._impl.syncs_with_legacy() and owned._impl.syncs_with_legacy()
    drv.stream_flags[0x7001] = drv.stream_flags[0x7003] = 1  # (made non-blocking)
    assert not bare._impl.syncs_with_legacy()
    assert owned._impl.syncs_with_legacy()  # (its owner keeps that stream: remembered)


def test_a_view_released_while_its_cai_layout_is_made_raises(monkeypatch):
    """A release from another thread landing as the CAI layout is made (simulated with a
    profile hook, interpreted build) raises the documented error, not AttributeError, and
    leaves no hold behind."""
    from fake_cuda import install_fake_devices
    import interop.cai as cai_mod
    if not isinstance(cai_mod._layout, types.FunctionType):
        pytest.skip("compiled: no Python frame to hook")
    (dev,), drv = install_fake_devices(monkeypatch, True)
    buf = sm.Buffer.zeros(8, "float64", device=dev)
    dev.default_stream.synchronize()

    def prof(frame, event, arg):
        if event == "call" and frame.f_code is cai_mod._layout.__code__:
            buf.release()
    sys.setprofile(prof)
    try:
        with pytest.raises(sm.errors.ReleasedError):
            buf.__cuda_array_interface__
    finally:
        sys.setprofile(None)
    assert buf._export is None


def test_the_consumers_streams_are_found_without_borrowing_again(monkeypatch):
    """A CAI export's likely consumer streams: the default stream and CuPy's current one --
    a Stream sharedmem has for that CUDA stream is found by its handle (no new borrow)."""
    from fake_cuda import install_fake_devices
    from interop.streams import current_streams
    (dev,), drv = install_fake_devices(monkeypatch, True)
    s = dev.create_stream("consumer")
    cupy = sys.modules["cupy"]
    assert current_streams(dev) == [dev.default_stream]
    cupy.current.ptr = s.handle
    assert current_streams(dev) == [dev.default_stream, s]
    assert current_streams(dev)[1] is s
    cupy.current.ptr = 1  # (the legacy default stream's handle: no second entry)
    assert current_streams(dev) == [dev.default_stream]


def test_a_host_export_is_refused_when_the_write_it_waits_for_faults(host):
    """A host DLPack export waits for the pending write after its hold is made; a write that
    faults meanwhile (completion unknown) gives no array -- the bytes are not known to be
    written, as a dask frame (order_consumer) and to_host refuse them too -- and the hold goes
    with it. (np.from_dlpack returned the array, over bytes of unknown contents, and left
    the hold live: the allocation unmovable while the array lived.)"""
    import warnings
    from sharedmem.backends.host import HostFault
    gate = threading.Event()

    @sm.host_kernel
    def faulting_write(x):
        gate.wait(5)
        raise HostFault("illegal address (simulated)")

    s = host.create_stream()
    buf = sm.Buffer.zeros(8, "float32", device=host)
    sm.synchronize()
    whole = buf.allocation
    f = sm.launch(faulting_write, 1, 1, sm.Out(buf), stream=s)
    seen = []

    def fault_once_waited_for():
        for _ in range(500):  # (until the export's hold is there: it is waiting now)
            if len(whole.views()) == 2:
                break
            threading.Event().wait(0.01)
        seen.append(whole.views())
        gate.set()

    t = threading.Thread(target=fault_once_waited_for)
    t.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", sm.LeakWarning)
        try:
            with pytest.raises(sm.CompletionUnknownError,
                               match=rf"^bytes \[0, 32\) of allocation #{whole.id} are touched "
                                     rf"by work whose completion became unknown while waited "
                                     rf"for \(HostFault\('illegal address \(simulated\)'\)\); "
                                     rf"they cannot be exported$"):
                np.from_dlpack(buf)
        finally:
            gate.set()
            t.join()
        with pytest.raises(sm.CompletionUnknownError):
            f.result(5)
    assert [w.category for w in caught] == [sm.LeakWarning]
    assert seen == [[f"buffer, bytes [0, 32) of allocation #{whole.id}",
                     f"DLPack export, bytes [0, 32) of allocation #{whole.id}"]]
    assert whole.views() == [f"buffer, bytes [0, 32) of allocation #{whole.id}"]
    assert buf.is_live and sm.stats().leaked_bytes >= 32


def test_a_host_kernel_exporting_bytes_written_behind_it_is_refused_and_leaves_no_hold(host):
    """A host kernel that exports (np.from_dlpack) bytes a write queued behind it on its own
    stream has yet to make would wait forever: the export raises SharedMemError, and the hold
    it made before waiting goes with it (the allocation keeps its one view). The stream runs
    on: the write runs after the kernel."""
    gate = threading.Event()
    buf = sm.Buffer.zeros(4, "float32", device=host)
    sm.synchronize()
    whole = buf.allocation
    seen = []

    @sm.host_kernel
    def exporter():
        gate.wait(5)
        try:
            np.from_dlpack(buf)
        except sm.SharedMemError as e:
            seen.append(e)
        seen.append(whole.views())

    @sm.host_kernel
    def write(x):
        x[:] = 5

    s = host.create_stream("s")
    first = sm.launch(exporter, 1, 1, stream=s)
    second = sm.launch(write, 1, 1, sm.Out(buf), stream=s)  # queued behind the exporter
    gate.set()
    first.result(5)
    second.result(5)
    err, views = seen
    assert type(err) is sm.SharedMemError
    assert re.match(r"^a host kernel on host stream 's' waits for its own work or work queued "
                    r"behind it on its own stream, which cannot finish before the kernel "
                    r"returns: it would wait "
                    r"forever\. Wait outside the kernel, or submit that work to another stream$",
                    str(err)), str(err)
    assert views == [f"buffer, bytes [0, 16) of allocation #{whole.id}"]  # (in the kernel)
    assert whole.views() == [f"buffer, bytes [0, 16) of allocation #{whole.id}"]
    np.testing.assert_array_equal(buf.to_host(), np.full(4, 5, np.float32))
