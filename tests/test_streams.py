"""Cross-stream rules: read+read overlaps, conflicts are ordered or refused."""

import re
import threading
import time

import numpy as np
import pytest

import sharedmem as sm


@sm.host_kernel
def slow_write(x, value, delay):
    time.sleep(delay)
    x[:] = value


@sm.host_kernel
def copy(src, dst):
    dst[:] = src


def test_read_read_runs_concurrently(host):
    a, b = host.create_stream(), host.create_stream()
    buf = sm.Buffer.from_host(np.arange(8, dtype=np.int32), device=host, stream=a)
    a.synchronize()
    barrier = threading.Barrier(2, timeout=5)

    @sm.host_kernel
    def reader(x):
        barrier.wait()  # both readers must be running at once, or this times out

    fa = sm.launch(reader, 1, 1, sm.In(buf), stream=a, policy="reject")
    fb = sm.launch(reader, 1, 1, sm.In(buf), stream=b, policy="reject")
    fa.result(10)
    fb.result(10)
    assert not barrier.broken


@pytest.mark.parametrize("writer_first", [True, False])
def test_order_policy_orders_conflicts(host, writer_first):
    a, b = host.create_stream(), host.create_stream()
    n = 1000
    buf = sm.Buffer.zeros(n, "float64", device=host, stream=a)
    out = sm.Buffer.zeros(n, "float64", device=host, stream=b)
    if writer_first:  # reader on b must wait for the slow writer on a
        sm.launch(slow_write, 1, 1, sm.Out(buf), 42.0, 0.2, stream=a)
        sm.launch(copy, 1, 1, sm.In(buf), sm.Out(out), stream=b).result(10)
        np.testing.assert_array_equal(out.to_host(), np.full(n, 42.0))
    else:  # writer on b must wait for the slow reader on a
        gate = threading.Event()

        @sm.host_kernel
        def slow_copy(src, dst):
            gate.wait(0.2)
            dst[:] = src

        sm.launch(slow_copy, 1, 1, sm.In(buf), sm.Out(out), stream=a)
        sm.launch(slow_write, 1, 1, sm.Out(buf), 7.0, 0.0, stream=b).result(10)
        np.testing.assert_array_equal(out.to_host(), np.zeros(n))
        np.testing.assert_array_equal(buf.to_host(), np.full(n, 7.0))


def test_reject_policy_names_the_other_stream(host):
    a, b = host.create_stream("writer-stream"), host.create_stream("reader-stream")
    buf = sm.Buffer.zeros(64, "float32", device=host, stream=a)
    out = sm.Buffer.zeros(64, "float32", device=host, stream=b)
    b.synchronize()
    gate = threading.Event()

    @sm.host_kernel
    def gated_write(x):
        gate.wait(5)
        x[:] = 1

    fa = sm.launch(gated_write, 1, 1, sm.Out(buf), stream=a)
    sm.set_access_policy("reject")
    before = sm.stats().submitted
    with pytest.raises(sm.AccessConflictError, match=(
            r"^host kernel .*copy on <Stream reader-stream on <Device host> \(owned\)> would read "
            r"bytes \[0, 256\) of allocation #\d+ while unfinished work on <Stream writer-stream on "
            r"<Device host> \(owned\)> writes them \(policy 'reject'\)\. Wait for that work")):
        sm.launch(copy, 1, 1, sm.In(buf), sm.Out(out), stream=b)
    assert sm.stats().submitted == before  # refused: nothing submitted, no lease taken
    assert b not in buf.allocation.tracker.streams_locked()
    assert out.allocation.tracker.streams_locked() == []
    # same stream needs no ordering and is never refused
    sm.launch(copy, 1, 1, sm.In(buf), sm.Out(out), stream=a)
    # disjoint byte ranges do not conflict
    other_half = buf[32:64]
    gate.set()
    fa.result(5)
    sm.synchronize()
    fw = sm.launch(slow_write, 1, 1, sm.Out(buf[0:32]), 2.0, 0.1, stream=a)
    sm.launch(copy, 1, 1, sm.In(other_half), sm.Out(out[0:32]), stream=b).result(5)
    fw.result(5)
    np.testing.assert_array_equal(out.to_host()[:32], np.ones(32))
    assert sm.get_access_policy() == "reject"


def test_to_host_always_waits_for_pending_writes(host):
    a = host.create_stream()
    buf = sm.Buffer.zeros(16, "int32", device=host, stream=a)
    sm.launch(slow_write, 1, 1, sm.Out(buf), 9, 0.1, stream=a)
    sm.set_access_policy("reject")
    np.testing.assert_array_equal(buf.to_host(), np.full(16, 9))  # default stream, ordered


def test_a_stream_use_makes_only_the_lists_it_fills(host):
    """A stream's record of unfinished work on an allocation makes its reads, writes and
    holds lists only when something goes in them (a foreign array new to every launch made
    two empty lists more for the collector each time), and drops them once all finished."""
    s = host.create_stream()
    buf = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    gate = threading.Event()

    @sm.host_kernel
    def hold(x):
        gate.wait(5)

    sm.launch(hold, 1, 1, sm.Out(buf), stream=s)
    use = buf.allocation.tracker.uses_locked()[s._uid]
    assert len(use.writes) == 1 and use.reads is None and use.holds is None
    sm.launch(hold, 1, 1, sm.In(buf), stream=s)
    assert len(use.writes) == 1 and len(use.reads) == 1 and use.holds is None
    gate.set()
    s.synchronize()
    assert buf.allocation.tracker.streams_locked() == []  # (pruned: nothing unfinished)
    assert use.reads is None and use.writes is None
    np.testing.assert_array_equal(buf.to_host(), np.zeros(4))


def test_an_allocation_used_on_one_stream_makes_no_dict_of_streams(host):
    """An allocation's tracker keeps the one stream it is used on without a dict (most are
    used on one; a foreign array new to every launch made one more dict for the collector
    each time), makes the dict when a second stream comes, and orders the second stream's
    work after the first's as before."""
    a, b = host.create_stream(), host.create_stream()
    buf = sm.Buffer.zeros(4, "int64", device=host, stream=a)
    gate = threading.Event()
    order = []

    @sm.host_kernel
    def slow_write(x):
        gate.wait(5)
        x += 1
        order.append("write")

    @sm.host_kernel
    def read(x, out):
        out[:] = x
        order.append("read")

    tracker = buf.allocation.tracker
    sm.launch(slow_write, 1, 1, sm.Out(buf), stream=a)
    assert tracker._uses is None and tracker._last == a._uid
    assert tracker.streams_locked() == [a]
    out = sm.Buffer.zeros(4, "int64", device=host, stream=b)
    sm.launch(read, 1, 1, sm.In(buf), sm.Out(out), stream=b)  # (waits for the write)
    assert set(tracker._uses) == {a._uid, b._uid}
    gate.set()
    b.synchronize()
    assert order == ["write", "read"]
    np.testing.assert_array_equal(out.to_host(), np.ones(4))


def test_many_launches_keep_tracker_small(host):
    s = host.create_stream()
    buf = sm.Buffer.zeros(4, "int64", device=host, stream=s)

    @sm.host_kernel
    def inc(x):
        x += 1

    gate = threading.Event()

    @sm.host_kernel
    def hold(x):
        gate.wait(5)

    sm.launch(hold, 1, 1, sm.In(buf), stream=s)
    for _ in range(500):
        sm.launch(inc, 1, 1, buf, stream=s)
    use = buf.allocation.tracker.uses_locked()[s._uid]
    assert len(use.writes) == 1 and len(use.reads) == 1  # coalesced, not 500 entries
    gate.set()
    s.synchronize()
    np.testing.assert_array_equal(buf.to_host(), np.full(4, 500))
    assert not buf.allocation.tracker


def test_events_and_stream_waits(host):
    a, b = host.create_stream(), host.create_stream()
    gate = threading.Event()
    order = []

    @sm.host_kernel
    def first(x):
        gate.wait(5)
        order.append("a")

    @sm.host_kernel
    def second(x):
        order.append("b")

    x = sm.Buffer.zeros(2, device=host)
    y = sm.Buffer.zeros(2, device=host)
    sm.launch(first, 1, 1, x, stream=a)
    ev = a.record()
    assert ev.query() is False
    b.wait(ev)  # device-side wait: b runs nothing until a reached the event
    fut = sm.launch(second, 1, 1, y, stream=b)  # y: no lease conflict, only the event orders it
    assert not fut.done()
    gate.set()
    fut.result(5)
    assert order == ["a", "b"] and ev.synchronize(1) and ev.query() is True
    with pytest.raises(TypeError, match=r"^Stream.wait takes an Event or a stream \(a sharedmem "
                                        r"Stream, or a foreign one: Stream\.from_external\), got "
                                        r"int$"):
        b.wait(3)


def test_foreign_streams_need_cuda(host):
    if sm.default_device().kind == "cuda":
        pytest.skip("this checks the message on machines without CUDA")
    with pytest.raises(sm.DeviceMismatchError, match=r"^Stream.from_external\(5\) needs a CUDA device; <Device host> has no foreign streams \(pass a Stream of it -- dev\.create_stream\(\), dev\.default_stream -- or stream=None\)$"):
        sm.Stream.from_external(5)
    with pytest.raises(AttributeError, match="host streams have no __cuda_stream__"):
        host.create_stream().__cuda_stream__()
    with pytest.raises(AttributeError):
        sm.Buffer.empty(2, device=host).__cuda_array_interface__


def test_a_full_host_stream_makes_submitters_wait(host, monkeypatch):
    """A host stream queues at most MAX_QUEUED tasks; a submission beyond that
    waits (holding no lock) until the worker catches up, as CUDA launches do.
    A task that submits to its own stream never waits for itself."""
    import sharedmem.backends.host as H
    monkeypatch.setattr(H, "MAX_QUEUED", 8)
    s = host.create_stream("bounded")
    gate = threading.Event()
    x = sm.Buffer.zeros(1, "int64", device=host, stream=s)
    s.synchronize()

    @sm.host_kernel
    def blocked(v):
        gate.wait(10)
        v += 1

    submitted = []

    def submitter():
        for _ in range(20):
            sm.launch(blocked, 1, 1, x, stream=s)
            submitted.append(1)

    t = threading.Thread(target=submitter)
    t.start()
    time.sleep(0.3)
    assert 8 <= len(submitted) <= 10 and t.is_alive()  # waiting for room
    sm.stats()  # other sharedmem calls go on meanwhile: no lock is held
    gate.set()
    t.join(10)
    assert not t.is_alive() and len(submitted) == 20
    s.synchronize()
    assert x.to_host()[0] == 20

    @sm.host_kernel
    def fan_out(v, stream):
        for _ in range(12):  # more than MAX_QUEUED, from the stream's own worker
            sm.launch(blocked, 1, 1, v, stream=stream)

    sm.launch(fan_out, 1, 1, x, s, stream=s).result(10)
    s.synchronize()
    assert x.to_host()[0] == 32


def test_a_host_kernel_filling_another_stream_with_work_ordered_after_itself_never_hangs(
        host, monkeypatch):
    """A kernel on stream a writes x and launches more readers of x on stream b than b
    queues: sharedmem ordered b after this very kernel, so b's queue frees room only once the
    kernel returns. Waiting for room there waited forever (both workers stuck); the kernel
    goes on instead, as it does when it fills its own stream."""
    import sharedmem.backends.host as H
    monkeypatch.setattr(H, "MAX_QUEUED", 8)
    a, b = host.create_stream("fan-a"), host.create_stream("fan-b")
    x, y = sm.Buffer.zeros(4, "int64", device=host), sm.Buffer.zeros(4, "int64", device=host)
    sm.synchronize()

    @sm.host_kernel
    def add_to(src, dst):
        dst += src

    @sm.host_kernel
    def produce(xv):
        xv[:] = 1
        for _ in range(20):  # more than MAX_QUEUED, each ordered after this kernel
            sm.launch(add_to, 1, 1, sm.In(x), sm.InOut(y), stream=b)

    sm.launch(produce, 1, 1, sm.Out(x), stream=a).result(timeout=10)
    b.synchronize()
    assert y.to_host().tolist() == [20] * 4


@pytest.mark.parametrize("how", ["stream", "all", "result", "event"])
def test_a_host_kernel_waiting_for_work_behind_it_on_its_stream_is_refused(host, how):
    # (that work cannot start before the kernel returns: the wait would never end)
    s = host.create_stream("self-wait")
    other = host.create_stream("other")
    later = []

    @sm.host_kernel
    def inner(x):
        x[:] += 1

    @sm.host_kernel
    def outer(x):
        if how == "stream":
            s.synchronize()
        elif how == "all":
            sm.synchronize()
        elif how == "result":
            later.append(sm.launch(inner, 1, 1, sm.Buffer.zeros(4, device=host, stream=s),
                                   stream=s))
            later[-1].result()
        else:
            s.record().synchronize()

    x = sm.Buffer.zeros(4, device=host, stream=s)
    f = sm.launch(outer, 1, 1, x, stream=s)
    with pytest.raises(sm.HostKernelError) as ei:
        f.result(timeout=10)
    cause = ei.value.__cause__
    assert type(cause) is sm.SharedMemError
    assert str(cause) == (
        "a host kernel on host stream 'self-wait' waits for its own work or work queued "
        "behind it on its own stream, which cannot finish before the kernel returns: it would wait forever. Wait "
        "outside the kernel, or submit that work to another stream")
    # the stream goes on: the work behind ran, and a wait from another stream's kernel is fine
    assert all(g.result(timeout=10) is None for g in later)
    g = sm.launch(sm.host_kernel(lambda y: s.synchronize()), 1, 1, sm.Buffer.zeros(4, device=host),
                  stream=other)
    assert g.result(timeout=10) is None
    s.synchronize()


@pytest.mark.parametrize("hops", [1, 2])
def test_a_host_kernel_waiting_for_work_ordered_after_itself_raises(host, hops):
    """A kernel on stream a writes x, then launches a reader of x on b (and, with two hops, a
    reader of what that one writes on c) and waits for it: sharedmem ordered b after this
    very kernel, so the wait would never end. It raises instead, and every stream runs on."""
    a, b, c = (host.create_stream(n) for n in ("hop-a", "hop-b", "hop-c"))
    x, y, z = (sm.Buffer.zeros(4, device=host) for _ in range(3))
    sm.synchronize()
    copy = sm.host_kernel(lambda src, dst: dst.__setitem__(slice(None), src))
    started = []

    @sm.host_kernel
    def produce(xv):
        xv[:] = 1
        f = sm.launch(copy, 1, 1, sm.In(x), sm.Out(y), stream=b)  # waits for this kernel
        if hops == 2:
            f = sm.launch(copy, 1, 1, sm.In(y), sm.Out(z), stream=c)  # waits for b's copy
        started.append(f)
        f.result(timeout=10)

    fut = sm.launch(produce, 1, 1, sm.Out(x), stream=a)
    with pytest.raises(sm.HostKernelError) as ei:
        fut.result(timeout=20)
    assert type(ei.value.__cause__) is sm.SharedMemError
    assert str(ei.value.__cause__) == (
        "a host kernel on host stream 'hop-a' waits for its own work or work queued behind it "
        "on its own stream (through work on another stream that was ordered after it: it uses "
        "bytes this kernel has yet to finish with), which cannot finish before the kernel returns: it "
        "would wait forever. Wait outside the kernel, or submit that work to another stream")
    assert started[0].result(timeout=10) is None  # the work it launched ran after it
    assert z.to_host().tolist() == ([1.0] * 4 if hops == 2 else [0.0] * 4)


def test_a_host_kernel_may_wait_for_unrelated_work_on_another_stream(host):
    a, b = host.create_stream("free-a"), host.create_stream("free-b")
    x, y = sm.Buffer.zeros(4, device=host), sm.Buffer.zeros(4, device=host)
    sm.synchronize()
    fill = sm.host_kernel(lambda v: v.__setitem__(slice(None), 3.0))

    @sm.host_kernel
    def outer(xv):
        xv[:] = 1
        sm.launch(fill, 1, 1, sm.Out(y), stream=b).result(timeout=10)  # other bytes: no order

    sm.launch(outer, 1, 1, sm.Out(x), stream=a).result(timeout=20)
    assert y.to_host().tolist() == [3.0] * 4


def test_with_stream_makes_it_current_for_launches_and_ops_in_this_thread_or_task(host):
    import asyncio

    from host_kernels import fill
    a, b = host.create_stream("a"), host.create_stream("b")
    x = sm.Buffer.zeros(4, "int64", device=host, stream=a)
    a.synchronize()
    o = sm.op(fill, 1, 1, sm.Out(x), 3)
    with a:
        assert sm.launch(fill, 1, 1, sm.Out(x), 1).stream is a
        assert o.submit().stream is a  # (as api.md says: `with stream:` covers op.submit)
        with b:
            assert sm.launch(fill, 1, 1, sm.Out(x), 2).stream is b and o.submit().stream is b
            seen = []
            t = threading.Thread(target=lambda: seen.append(o.submit().stream))
            t.start()
            t.join()
            assert seen[0] not in (a, b)  # another thread: its own (none entered)
        assert o.submit().stream is a
    assert o.submit().stream not in (a, b)

    async def task(s, out):  # each asyncio task has its own current stream across awaits
        with s:
            await asyncio.sleep(0.01)
            out.append(o.submit().stream)

    got_a, got_b = [], []

    async def both():
        await asyncio.gather(task(a, got_a), task(b, got_b))
    asyncio.run(both())
    assert got_a == [a] and got_b == [b]
    # a `with` that ends in another thread than it began in
    a.__enter__()
    err = []

    def leave():
        try:
            a.__exit__(None, None, None)
        except sm.SharedMemError as e:
            err.append(str(e))
    t = threading.Thread(target=leave)
    t.start()
    t.join()
    assert err == [f"{a!r} was not entered in this thread or task: a `with stream:` block "
                   f"begins and ends in the same one"]
    a.__exit__(None, None, None)
    sm.synchronize()
    np.testing.assert_array_equal(x.to_host(), [3, 3, 3, 3])


def _gated_writer_and_reader(host, n):
    """A writer and a reader stream; ``n`` gates; a host kernel writing its argument once its
    gate opens, and one reading nothing."""
    a, b = host.create_stream("writer"), host.create_stream("reader")
    gates = [threading.Event() for _ in range(n)]

    @sm.host_kernel
    def write(x, gate):
        gate.wait(5)
        x[:] = 1

    @sm.host_kernel
    def read(x):
        pass

    return a, b, gates, write, read


def test_a_chunk_written_on_one_stream_is_read_on_another_without_waiting_for_later_chunks(host):
    # (the tracker keeps adjacent chunks, and the parts of a range a smaller write left, apart:
    # a reader waits for the work that wrote its bytes, not for the stream's newest)
    from sharedmem.runtime.submission import sweep_all
    a, b, gates, write, read = _gated_writer_and_reader(host, 2)
    for first, second, probe in ((slice(0, 4), slice(4, 8), slice(0, 4)),  # adjacent chunks
                                 (slice(0, 16), slice(0, 1), slice(8, 12))):  # a part rewritten
        x = sm.Buffer.zeros(16, "int32", device=host)
        x.to_host()
        for g in gates:
            g.clear()
        f1 = sm.launch(write, 1, 1, sm.Out(x[first]), gates[0], stream=a)
        f2 = sm.launch(write, 1, 1, sm.Out(x[second]), gates[1], stream=a)
        gates[0].set()
        f1.result(5)
        sweep_all()
        # bytes only the finished write touched: no conflict under "reject", no wait
        sm.launch(read, 1, 1, sm.In(x[probe]), stream=b, policy="reject").result(5)
        assert not f2.done()
        # bytes the unfinished write touches: refused under "reject", ordered under "order"
        with pytest.raises(sm.AccessConflictError):
            sm.launch(read, 1, 1, sm.In(x[second]), stream=b, policy="reject")
        fb = sm.launch(read, 1, 1, sm.In(x[second]), stream=b)
        time.sleep(0.05)
        assert not fb.done()
        gates[1].set()
        fb.result(5)
    sm.synchronize()


def test_a_range_used_again_among_others_is_its_newest_work(host):
    # (several ranges of one allocation in flight -- two chunks, as torch tensors of one
    # caching-allocator segment are -- and one used again: its span now names the newest
    # work, in place, and the spans stay two)
    from sharedmem.runtime.submission import sweep_all
    a, b, gates, write, read = _gated_writer_and_reader(host, 3)
    x = sm.Buffer.zeros(16, "int32", device=host)
    x.to_host()
    f1 = sm.launch(write, 1, 1, sm.Out(x[0:4]), gates[0], stream=a)
    sm.launch(write, 1, 1, sm.Out(x[4:8]), gates[1], stream=a)
    f3 = sm.launch(write, 1, 1, sm.Out(x[0:4]), gates[2], stream=a)
    writes = x.allocation.tracker.uses_locked()[a._uid].writes
    assert sorted((e.lo, e.hi) for e in writes) == [(0, 16), (16, 32)]
    gates[0].set()
    f1.result(5)
    sweep_all()
    with pytest.raises(sm.AccessConflictError):  # (the first write is done; the third is not)
        sm.launch(read, 1, 1, sm.In(x[0:4]), stream=b, policy="reject")
    fb = sm.launch(read, 1, 1, sm.In(x[0:4]), stream=b)
    gates[1].set()
    time.sleep(0.05)
    assert not fb.done() and not f3.done()
    gates[2].set()
    fb.result(5)
    assert f3.done()
    sm.synchronize()


def test_many_distinct_ranges_in_flight_merge_past_a_bound(host):
    from sharedmem.access import MAX_SPANS
    s = host.create_stream()
    gate = threading.Event()

    @sm.host_kernel
    def wait_then_write(x):
        gate.wait(5)

    x = sm.Buffer.zeros(4 * MAX_SPANS, "int32", device=host)
    x.to_host()
    for i in range(2 * MAX_SPANS):
        sm.launch(wait_then_write, 1, 1, sm.Out(x[(2 * i) % (4 * MAX_SPANS):][:1]), stream=s)
    writes = x.allocation.tracker.uses_locked()[s._uid].writes
    assert len(writes) <= MAX_SPANS
    gate.set()
    s.synchronize()
    assert not x.allocation.tracker


def test_overlapping_numpy_views_given_to_host_kernels_on_two_streams_are_ordered(host):
    a, b = host.create_stream("A"), host.create_stream("B")
    base = np.zeros(16, np.int64)
    order = []
    gate = threading.Event()

    @sm.host_kernel
    def first(x):
        order.append("A start")
        gate.wait(5)
        x[:] = 1
        order.append("A end")

    @sm.host_kernel
    def second(x):
        order.append("B")
        x[:] = 2

    fa = sm.launch(first, 1, 1, sm.Out(base[0:10]), stream=a)
    deadline = time.monotonic() + 5
    while not order and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(sm.AccessConflictError):  # (views of one array: one allocation)
        sm.launch(second, 1, 1, sm.Out(base[5:15]), stream=b, policy="reject")
    fb = sm.launch(second, 1, 1, sm.Out(base[5:15]), stream=b)
    time.sleep(0.05)
    assert order == ["A start"]
    gate.set()
    fb.result(5)
    assert fa.done() and order == ["A start", "A end", "B"]
    np.testing.assert_array_equal(base, [1] * 5 + [2] * 10 + [0])
    # disjoint views of it are not ordered: a launch on the other stream runs at once
    gate.clear()
    order.clear()
    fa = sm.launch(first, 1, 1, sm.Out(base[0:4]), stream=a)
    deadline = time.monotonic() + 5
    while not order and time.monotonic() < deadline:
        time.sleep(0.001)
    sm.launch(second, 1, 1, sm.Out(base[8:12]), stream=b, policy="reject").result(5)
    assert order == ["A start", "B"]
    gate.set()
    fa.result(5)


def test_merged_ranges_cover_older_ranges_above_the_newest(host):
    """Past MAX_SPANS the ranges in flight merge into their hull: also over older ranges that
    lie above the newest one -- a reader of those on another stream still conflicts."""
    from sharedmem.access import MAX_SPANS
    s, other = host.create_stream(), host.create_stream()
    gate = threading.Event()

    @sm.host_kernel
    def wait_then_write(x):
        gate.wait(30)

    @sm.host_kernel
    def read(x):
        pass

    x = sm.Buffer.zeros(4 * MAX_SPANS, "int32", device=host)
    x.to_host()
    try:
        for i in range(MAX_SPANS + 1):  # downwards: each range below every older one
            j = 2 * (MAX_SPANS - i)
            sm.launch(wait_then_write, 1, 1, sm.Out(x[j:j + 1]), stream=s)
        writes = x.allocation.tracker.uses_locked()[s._uid].writes
        assert len(writes) < MAX_SPANS
        top = 2 * MAX_SPANS  # the first (oldest) range written: the highest
        with pytest.raises(sm.AccessConflictError, match=rf"would read bytes \[{4 * top}, "
                                                         rf"{4 * top + 4}\) of allocation "
                                                         rf"#{x.allocation.id} while unfinished "
                                                         rf"work on {re.escape(str(s))} writes"):
            sm.launch(read, 1, 1, sm.In(x[top:top + 1]), stream=other, policy="reject")
        sm.launch(read, 1, 1, sm.In(x[top + 1:]), stream=other, policy="reject").result(5)
    finally:
        gate.set()
    s.synchronize()
    assert not x.allocation.tracker


def test_finished_ranges_of_a_stream_are_dropped_as_it_records_more(host):
    s = host.create_stream()
    gate = threading.Event()

    @sm.host_kernel
    def wait_then_write(x):
        gate.wait(30)

    x = sm.Buffer.zeros(8, "int32", device=host)
    x.to_host()
    try:
        sm.launch(wait_then_write, 1, 1, sm.Out(x[0:1]), stream=s)
        sm.launch(wait_then_write, 1, 1, sm.Out(x[2:3]), stream=s)
        writes = x.allocation.tracker.uses_locked()[s._uid].writes
        assert [(e.lo, e.hi) for e in writes] == [(0, 4), (8, 12)]
    finally:
        gate.set()
    s.synchronize()
    sm.launch(wait_then_write, 1, 1, sm.Out(x[4:5]), stream=s).result(5)
    writes = x.allocation.tracker.uses_locked()[s._uid].writes
    assert [(e.lo, e.hi) for e in writes] == [(16, 20)]  # the finished two are gone
    assert not x.allocation.tracker


def test_device_synchronize_waits_for_the_devices_work_and_retires_it(host):
    gate = threading.Event()
    seen = []

    @sm.host_kernel
    def gated(x):
        gate.wait()
        x[:] = 5
        seen.append(True)

    s = host.create_stream("gated")
    b = sm.Buffer.zeros(4, "float32", device=host)
    fut = sm.launch(gated, 1, 1, b, stream=s)
    assert not fut.done() and sm.stats().in_flight >= 1
    gate.set()
    host.synchronize()
    assert seen == [True] and fut.done() and sm.stats().in_flight == 0
    np.testing.assert_array_equal(b.to_host(), np.full(4, 5))


def test_synchronize_waits_for_every_other_stream_before_refusing_a_captured_one(host):
    """sm.synchronize() while another thread captures on a stream: that stream's refusal
    (CaptureError) came as the loop met it, the streams after it neither waited for nor
    retired. It comes once every other stream was waited for."""
    import threading
    import time
    finished = set()

    @sm.host_kernel
    def slow(x, i, seconds):
        time.sleep(seconds)
        finished.add(i)
    c = host.create_stream("capturing")
    xc = sm.Buffer.zeros(4, "int32", device=host, stream=c)
    others = [host.create_stream(f"s{i}") for i in range(6)]
    bufs = [sm.Buffer.zeros(4, "int32", device=host, stream=s) for s in others]
    sm.synchronize()
    sm.launch(slow, 1, 1, xc, "c", 0.5, stream=c)  # (before the capture: pending)
    for i, (s, b) in enumerate(zip(others, bufs)):
        sm.launch(slow, 1, 1, b, i, 0.3 + 0.05 * i, stream=s)
    started, stop = threading.Event(), threading.Event()

    def capturer():
        with sm.capture(c):
            started.set()
            stop.wait(5)
    t = threading.Thread(target=capturer)
    t.start()
    assert started.wait(5)
    try:
        with pytest.raises(sm.CaptureError, match="is capturing a graph"):
            sm.synchronize()
        assert finished >= set(range(6))
    finally:
        stop.set()
        t.join()
    sm.synchronize()


def test_a_wait_for_a_faulted_host_stream_refuses_instead_of_faulting_the_waiter(host):
    """c.wait(a) on a host stream a known faulted: its marker was queued (pending), the
    wait went through, and c faulted when it ran -- every later launch on c refused. A
    marker of a faulted stream is unknown at once: the wait raises CompletionUnknownError,
    waiting for nothing, as Stream.wait says; c runs on."""
    from sharedmem.backends.host import HostFault

    @sm.host_kernel
    def fault(x):
        raise HostFault("boom")
    a, c = host.create_stream("a"), host.create_stream("c")
    buf = sm.Buffer.zeros(4, "int32", device=host, stream=a)
    with pytest.raises(sm.CompletionUnknownError), pytest.warns(sm.LeakWarning):
        sm.launch(fault, 1, 1, buf, stream=a).result(5)
    with pytest.raises(sm.CompletionUnknownError):
        c.wait(a)
    out = sm.Buffer.zeros(4, "int32", device=host, stream=c)
    sm.launch(sm.host_kernel(lambda x: x.fill(5)), 1, 1, out, stream=c).result(5)
    assert out.to_host().tolist() == [5] * 4


def test_a_dropped_stream_is_gone_once_its_work_retired_whatever_it_touched(host):
    """A stream per request writing a result the program keeps: the trackers of the results
    held each stream (strongly, until another stream touched that allocation), so none was
    destroyed -- on the host a worker thread each, on CUDA a CUstream each. They hold
    streams weakly: once its work retired, a dropped stream is gone."""
    import threading
    import weakref

    from conftest import gc_collect_harder
    weights = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=host)
    fill = sm.host_kernel(lambda w, out: out.__setitem__(slice(None), w))
    threads = threading.active_count()
    results, gone = [], []
    for i in range(20):
        s = host.create_stream(f"request {i}")
        out = sm.Buffer.zeros(4, "float32", device=host, stream=s)
        sm.launch(fill, 1, 1, sm.In(weights), sm.Out(out), stream=s)
        results.append(out)
        gone.append(weakref.ref(s))
        del s
    sm.synchronize()
    gc_collect_harder()
    assert [r() for r in gone] == [None] * 20
    deadline = __import__("time").monotonic() + 5
    while threading.active_count() > threads and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.01)
    assert threading.active_count() <= threads
    assert all(r.to_host().tolist() == [0.0, 1.0, 2.0, 3.0] for r in results)


def test_a_stream_name_is_a_str(host):
    """create_stream(name=5) made a stream whose name was the int (shown as such in reprs,
    traces and sm.inflight); it is a TypeError naming it, and no stream is made."""
    for bad in (5, b"s", ["s"]):
        with pytest.raises(TypeError, match=r"^create_stream\(name=\) takes a str or None, got "):
            host.create_stream(bad)
    assert host.create_stream("ok").name == "ok" and host.create_stream().name is not None
