"""A stream that waited for another stream's work waits for it once (Stream._waited): the
cases where a wait must not count as ordering -- a marker whose record failed, one recorded
into a capture of the other stream, captured work's COMPLETE -- on the fake driver and on the
host backend (real data)."""
import threading
import time
import warnings

import numpy as np
import pytest

import sharedmem as sm
from test_cuda_backend_fake import fake, kernels  # noqa: F401  (fixtures)
from conftest import gc_collect_harder

HOST = sm.Device.host()


def test_a_stream_that_waited_for_work_does_not_wait_for_it_again(fake, kernels):
    """A pipeline's handoff back: B writes y, A reads it (one wait), then A writes y again --
    ordered after B's write by that wait already, so no second one. Newer work on B is waited
    for again."""
    dev, drv = fake
    saxpy, _ = kernels
    a, b = dev.create_stream("A"), dev.create_stream("B")
    x = sm.Buffer.from_host(np.ones(8, np.float32), device=dev)
    y = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()

    def waits_on(stream, fn):
        mark = len(drv.calls)
        fn()
        return [c for c in drv.calls[mark:] if c[0] == "wait" and c[1] == stream.handle]

    def write(stream):
        return lambda: sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(y), 8,
                                 stream=stream)

    def read(stream):
        return lambda: sm.launch(saxpy, 1, 8, 1.0, sm.In(y), sm.In(x), sm.Out(x), 8,
                                 stream=stream)
    drv.holding = True  # everything stays in flight
    try:
        assert waits_on(b, write(b)) == []
        assert len(waits_on(a, read(a))) == 1  # A after B's write
        assert waits_on(a, write(a)) == []  # B's write: waited for already; A's read: same stream
        assert len(waits_on(b, write(b))) == 1  # B after A's read and write
        assert len(waits_on(a, read(a))) == 1  # B's newer write: waited for again
        assert waits_on(a, read(a)) == []
    finally:
        drv.holding = False
        drv.finish_held()
    sm.synchronize()
    assert sm.stats().in_flight == 0


def _waits(drv, stream, mark):
    return [c for c in drv.calls[mark:] if c[0] == "wait" and c[1] == stream.handle]


def _park_retirer(monkeypatch):
    """The retirer sweeps nothing (else it may close -- record -- the open marker first) until
    ``parked[0]`` is set False. Its loop's pass is replaced: retirer.py is never compiled,
    while a patch of the sweep functions would not reach the compiled ones' C calls (there the
    retirer went on sweeping, and these tests passed only while it happened to sleep). A pass
    under way when this is called has ended when it returns."""
    from sharedmem.runtime import retirer
    real = retirer._pass
    parked = [True]
    entered = threading.Event()

    def parked_pass(rt, last):
        if parked[0]:
            entered.set()
            return {}, False
        return real(rt, last)
    monkeypatch.setattr(retirer, "_pass", parked_pass)
    retirer.ensure()
    retirer.wake()
    assert entered.wait(10), "the retirer did not come round to its parked pass"
    return parked


def _setup_failed_close(fake, kernels, monkeypatch):
    """B writes y (seq 1, marker M1 recorded by a sweep), then z (seq 2, open marker M2); the
    next cuEventRecord fails (B's handle destroyed by its owner, a sticky error, ...)."""
    from fake_cuda import CUresult
    from sharedmem.runtime.submission import sweep
    dev, drv = fake
    saxpy, _ = kernels
    a, b = dev.create_stream("A"), dev.create_stream("B")
    x = sm.Buffer.from_host(np.ones(8, np.float32), device=dev)
    y, z, w = (sm.Buffer.zeros(8, "float32", device=dev) for _ in range(3))
    sm.synchronize()
    parked = _park_retirer(monkeypatch)
    drv.holding = True
    sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(y), 8, stream=b)  # B seq 1 (M1)
    sweep(b)  # (any sweep asks M1: recorded now, still pending)
    sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(z), 8, stream=b)  # B seq 2 (M2 open)
    real = drv.cuEventRecord

    def fail_once(ev, stream):
        drv.cuEventRecord = real
        return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
    drv.cuEventRecord = fail_once
    return drv, saxpy, a, x, y, z, w, parked


def _teardown(drv, parked):
    drv.holding = False
    drv.finish_held()
    parked[0] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sm.synchronize()


def test_a_wait_on_a_marker_whose_record_failed_raises_and_orders_nothing(fake, kernels,
                                                                         monkeypatch):
    """A reads y and z: one wait, for B's open marker (seq 2), whose record fails inside the
    wait. A wait on an event never recorded would wait for nothing (the driver says success):
    the launch raises CompletionUnknownError instead, takes no lease, and nothing counts as
    waited for -- A's next write of y waits for B's write of it (seq 1)."""
    drv, saxpy, a, x, y, z, w, parked = _setup_failed_close(fake, kernels, monkeypatch)
    try:
        mark = len(drv.calls)
        with pytest.raises(sm.CompletionUnknownError, match="could not be recorded"):
            sm.launch(saxpy, 1, 8, 1.0, sm.In(y), sm.In(z), sm.Out(w), 8, stream=a)
        assert _waits(drv, a, mark) == []  # (no wait on the unrecorded event)
        assert not [c for c in drv.calls[mark:] if c[0] == "launch"]
        mark = len(drv.calls)
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(y), 8, stream=a)  # WAW, B seq 1
        assert _waits(drv, a, mark) != [], "A writes y with no wait for B's pending write of y"
    finally:
        _teardown(drv, parked)


class _CaptureCase:
    """S wrote y (seq 1, pending: events stay pending) and a consumer on S holds q (a DLPack
    export naming S); events recorded on a capturing stream are listed in ``in_capture``."""

    def __init__(self, fake, kernels):
        dev, self.drv = fake
        self.saxpy, _ = kernels
        self.s, self.a = dev.create_stream("S"), dev.create_stream("A")
        self.x = sm.Buffer.from_host(np.ones(8, np.float32), device=dev)
        self.y, self.w = (sm.Buffer.zeros(8, "float32", device=dev) for _ in range(2))
        self.q = sm.Tensor.from_host(np.ones(8, np.float32), device=dev)
        sm.synchronize()
        self.in_capture = []
        drv, real = self.drv, self.drv.cuEventRecord
        self.real_record = real

        def record(ev, stream):
            if int(stream) in drv.capturing:
                self.in_capture.append(int(ev))
            return real(ev, stream)
        drv.cuEventRecord = record
        drv.holding = True
        self.launch(self.x, self.y, self.s)  # S seq 1
        self.cap = self.q.__dlpack__(stream=self.s.handle, max_version=(1, 0))

    def launch(self, src, dst, stream):
        return sm.launch(self.saxpy, 1, 8, 1.0, sm.In(src), sm.In(self.x), sm.Out(dst), 8,
                         stream=stream)

    def write_q_on_a_elsewhere(self, graph):
        """A writes q from another thread (A is not capturing: no escaped-capture warning);
        returns A's waits, which must be on the marker recorded on S as ``graph``'s capture
        began -- none on an event recorded into the capture (it would mark nothing that runs)."""
        mark = len(self.drv.calls)
        th = threading.Thread(target=lambda: self.launch(self.x, self.q, self.a))
        th.start()
        th.join()
        waits = _waits(self.drv, self.a, mark)
        assert waits and all(wt[2] == graph._before.handle for wt in waits)
        assert not self.in_capture
        return waits

    def check_read_of_y_waits(self):
        mark = len(self.drv.calls)
        self.launch(self.y, self.w, self.a)  # RAW with S seq 1
        assert _waits(self.drv, self.a, mark) != [], \
            "A reads y with no wait for S's pending write of y"

    def close(self):
        self.cap = None
        self.drv.holding = False
        self.drv.finish_held()
        self.drv.cuEventRecord = self.real_record
        sm.synchronize()


def test_a_wait_for_a_hold_on_a_capturing_stream_takes_the_captures_start(fake, kernels):
    """While S captures a graph, a launch on A writes q: its conflict is the open hold, whose
    consumer's work on S is what runs now -- what S was given before the capture. A marker
    recorded on S now would go into the capture (a live stream's cuStreamWaitEvent on it
    returns success and orders after nothing, on an H200 with driver 580): A waits on the one
    recorded as the capture began. Not noted as waited for (S was capturing): A's next launch
    reads y and waits for S's seq 1 again."""
    case = _CaptureCase(fake, kernels)
    try:
        with sm.capture(case.s) as g:
            case.write_q_on_a_elsewhere(g)
        case.check_read_of_y_waits()
    finally:
        case.close()


def test_a_hold_ending_during_a_capture_is_leased_until_the_captures_start(fake, kernels):
    """The consumer's hold on S ends while S captures: its lease (S seq 2) takes the marker
    recorded on S as the capture began, not one recorded into the capture. A's write of q,
    during the capture, waits on it; not noted as waited for (S was capturing): A's later read
    of y waits for S's pending write."""
    case = _CaptureCase(fake, kernels)
    try:
        with sm.capture(case.s) as g:
            case.cap = None  # the consumer is done with q: the hold ends (S seq 2)
            gc_collect_harder()
            assert case.s._pending[-1].marker is g._before
            case.write_q_on_a_elsewhere(g)
        case.check_read_of_y_waits()
    finally:
        case.close()


@sm.host_kernel
def _copy(x, out):
    out[:] = x


@sm.host_kernel
def _touch(x):
    x[:] = 2


class _GatedWrite:
    """Stream S writes ones into ``y`` once the gate opens (until then its work is pending);
    ``check()`` opens it after A's copy of ``y`` into ``w`` was submitted, and asserts that the
    copy saw S's write."""

    def __init__(self, s, y, w):
        self.gate = threading.Event()
        self.y, self.w = y, w
        gate = self.gate

        @sm.host_kernel
        def gated_write(x):
            gate.wait(5)
            x[:] = 1
        sm.launch(gated_write, 1, 1, sm.Out(y), stream=s)  # S seq 1: running until the gate opens

    def check(self, a):
        sm.launch(_copy, 1, 1, sm.In(self.y), sm.Out(self.w), stream=a)  # RAW with S seq 1
        time.sleep(0.3)  # (S's kernel still waits on the gate)
        self.gate.set()
        sm.synchronize()
        np.testing.assert_array_equal(self.w.to_host(), np.ones(64, np.float32),
                                      err_msg="A copied y before S's pending write of y finished")


def test_host_a_hold_conflict_during_a_capture_orders_nothing_later():
    """S writes y (gated: still running). q is in use on S (record_use: a hold on S). While S
    captures a graph, A writes q: the hold's conflict records a fresh marker on S -- whose impl
    is the capture recorder, so the marker is COMPLETE -- which must not count as ordering A
    after S's work: A's next launch copies y after S's pending write (else zeros)."""
    s, a = HOST.create_stream("S"), HOST.create_stream("A")
    y, w, q = (sm.Buffer.zeros(64, "float32", device=HOST) for _ in range(3))
    sm.synchronize()
    gated = _GatedWrite(s, y, w)
    sm.record_use(q, s)  # q is used on S too: a hold on S while q lives
    with sm.capture(s):
        th = threading.Thread(target=lambda: sm.launch(_touch, 1, 1, sm.Out(q), stream=a))
        th.start()  # (another thread: A is not captured, and no escaped-capture warning)
        th.join()
    gated.check(a)


def test_host_a_hold_ending_during_a_capture_orders_nothing_later():
    """Host variant of the hold's end during a capture: the end's lease on S gets the capture
    recorder's marker, COMPLETE; A's later write of the bytes waits on it (a no-op), which must
    not count: A's next launch copies y only after S's pending write."""
    s, a = HOST.create_stream("S"), HOST.create_stream("A")
    y, w, q = (sm.Buffer.zeros(64, "float32", device=HOST) for _ in range(3))
    sm.synchronize()
    gated = _GatedWrite(s, y, w)
    v = q[0:64]
    sm.record_use(v, s)  # holds on S for the live tokens (q's, v's)
    later = q[0:64]      # a view made after: no hold of its own
    with sm.capture(s):
        v.release()
        q.release()       # the holds end during the capture
    sm.launch(_touch, 1, 1, sm.Out(later), stream=a)  # waits on the end's marker (COMPLETE)
    gated.check(a)


@sm.host_kernel
def _acc(src, dst, delay):
    time.sleep(delay)  # (long enough for the other streams' workers to run meanwhile)
    dst[:] = dst + src


@sm.host_kernel
def _twice(dst, delay):
    time.sleep(delay)
    dst[:] = dst * 2 + 1


from hypothesis import given, settings, strategies as st  # noqa: E402

_PROGRAM = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["acc", "twice"]),
                              st.integers(0, 3), st.integers(0, 3),
                              st.sampled_from([0.0, 0.0005, 0.002])), min_size=1, max_size=24)


@settings(max_examples=40, deadline=None)
@given(program=_PROGRAM)
def test_random_programs_on_reused_streams_under_policy_order_match_program_order(program):
    """Launches on three reused host streams under policy "order" (where waits are made, and
    skipped once made): each conflicting access must see the ones submitted before it, so the
    buffers end as the program run in order says -- with kernels that sleep, so that an
    ordering that was skipped wrongly shows in the data."""
    streams = [HOST.create_stream(f"w{i}") for i in range(3)]
    bufs = [sm.Buffer.from_host(np.arange(4, dtype=np.int64) + 10 * i, device=HOST)
            for i in range(4)]
    ref = [np.arange(4, dtype=np.int64) + 10 * i for i in range(4)]
    for si, kind, a, b, delay in program:
        s = streams[si]
        if kind == "acc" and a != b:
            sm.launch(_acc, 1, 1, sm.In(bufs[a]), sm.InOut(bufs[b]), delay, stream=s,
                      policy="order")
            ref[b] = ref[b] + ref[a]
        else:
            sm.launch(_twice, 1, 1, sm.InOut(bufs[b]), delay, stream=s, policy="order")
            ref[b] = ref[b] * 2 + 1
    for buf, want in zip(bufs, ref):
        np.testing.assert_array_equal(buf.to_host(), want)
    sm.synchronize()


def test_waits_for_a_borrowed_stream_are_made_every_time(fake, kernels):
    """A borrowed stream's owner may capture it unseen (a marker recorded there would then
    order nothing): a wait for its work never counts, and the handoff back waits again."""
    dev, drv = fake
    saxpy, _ = kernels
    a = dev.create_stream("A")
    b = sm.Stream.from_external(dev.backend.create_stream("foreign").handle, device=dev)
    assert not b.owned and b._waited is None
    x = sm.Buffer.from_host(np.ones(8, np.float32), device=dev)
    y = sm.Buffer.zeros(8, "float32", device=dev)
    sm.synchronize()
    drv.holding = True
    try:
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(y), 8, stream=b)
        mark = len(drv.calls)
        sm.launch(saxpy, 1, 8, 1.0, sm.In(y), sm.In(x), sm.Out(x), 8, stream=a)
        assert len(_waits(drv, a, mark)) == 1
        mark = len(drv.calls)
        sm.launch(saxpy, 1, 8, 1.0, sm.In(x), sm.In(x), sm.Out(y), 8, stream=a)
        assert len(_waits(drv, a, mark)) == 1  # (with an owned B: none, see the first test)
    finally:
        drv.holding = False
        drv.finish_held()
    sm.synchronize()
