"""Graphs that own what they captured (host backend; the same rules as CUDA graphs)."""

import gc
import re
import threading
import time

import numpy as np
import pytest

import sharedmem as sm
from host_kernels import fill, add, inc

from conftest import gc_collect_harder


def test_replay_after_every_captured_buffer_was_dropped(host):
    s = host.create_stream("capture")
    a = sm.Buffer.zeros(64, "float64", device=host, stream=s)
    b = sm.Buffer.zeros(64, "float64", device=host, stream=s)
    out = sm.Buffer.zeros(64, "float64", device=host, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        f = sm.launch(fill, 1, 1, sm.Out(a), 1.5, stream=s)
        sm.launch(fill, 1, 1, sm.Out(b), 2.0, stream=s)
        sm.launch(add, 1, 1, sm.In(a), sm.In(b), sm.Out(out), stream=s)
        assert f.done() and "captured into graph" in repr(f)  # nothing ran
    np.testing.assert_array_equal(out.to_host(), np.zeros(64))  # capture ran nothing
    assert g.launches == 3
    out_ptr = out.ptr
    del a, b, out, f
    gc_collect_harder()
    # the graph keeps its allocations: new memory does not land on them
    fresh = [sm.Buffer.from_host(np.full(64, -9.0), device=host) for _ in range(6)]
    host.default_stream.synchronize()
    r = host.create_stream("replay")
    g.replay(r).result(5)
    g.replay(r).result(5)
    # read the output through the allocation the graph holds
    alloc = sm.lookup_allocation(host, out_ptr, 64 * 8)
    assert alloc is not None and alloc.live_views == 1  # the graph's own token
    assert "graph #" in alloc.views()[0]
    tok = next(iter(alloc._views.values()))
    view = sm.buffer.new_buffer(alloc.new_token("slice", tok.start, tok.stop, False, tok.keep),
                           np.dtype(np.float64), 64)
    np.testing.assert_array_equal(view.to_host(), np.full(64, 3.5))
    del fresh


def test_each_replay_takes_fresh_leases(host):
    s = host.create_stream()
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        sm.launch(inc, 1, 1, x, stream=s)
    assert not x.allocation.tracker  # capturing took no lease
    for _ in range(5):
        g.replay(s)
    s.synchronize()
    np.testing.assert_array_equal(x.to_host(), np.full(4, 5))
    before = sm.stats().submitted
    g.replay(s).result(5)
    assert sm.stats().submitted == before + 1  # one submission per replay


def test_replay_conflicting_with_another_stream_is_ordered_or_refused(host):
    cap, writer, rep = (host.create_stream(n) for n in ("cap", "writer", "replay"))
    x = sm.Buffer.zeros(16, "float64", device=host, stream=cap)
    out = sm.Buffer.zeros(16, "float64", device=host, stream=cap)
    cap.synchronize()

    @sm.host_kernel
    def copy(src, dst):
        dst[:] = src

    with sm.capture(cap) as g:
        sm.launch(copy, 1, 1, sm.In(x), sm.Out(out), stream=cap)

    @sm.host_kernel
    def slow_fill(v, value):
        time.sleep(0.2)
        v[:] = value

    sm.launch(slow_fill, 1, 1, sm.Out(x), 7.0, stream=writer)
    g.replay(rep).result(5)  # order: waits for the slow writer
    np.testing.assert_array_equal(out.to_host(), np.full(16, 7.0))
    sm.launch(slow_fill, 1, 1, sm.Out(x), 8.0, stream=writer)
    with pytest.raises(sm.AccessConflictError, match=r"^replay of graph #\d+ on <Stream replay .*> would read bytes \[0, 128\) of allocation #\d+ while unfinished work on <Stream writer"):
        g.replay(rep, policy="reject")
    writer.synchronize()


def test_captured_buffer_is_an_alias_until_the_graph_is_dropped(host):
    s = host.create_stream()
    x = sm.Buffer.zeros(8, "int32", device=host, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        sm.launch(inc, 1, 1, x, stream=s)
    with pytest.raises(sm.AliasError, match=rf"  - graph #{g.id}, bytes \[0, 32\) of allocation #\d+"):
        sm.Tensor.from_buffer(x, (8,))
    assert x.is_live
    g.release()
    with pytest.raises(sm.CaptureError, match=rf"^graph #{g.id} is released"):
        g.replay(s)
    t = sm.Tensor.from_buffer(x, (8,))
    # and dropping (not releasing) a graph does the same
    with sm.capture(s) as g2:
        sm.launch(inc, 1, 1, t, stream=s)
    with pytest.raises(sm.AliasError, match=rf"graph #{g2.id}"):
        t.into_buffer()
    del g2
    gc_collect_harder()
    t.into_buffer()


def test_dropped_graph_is_no_alias_while_its_replay_holds_the_memory(host):
    s = host.create_stream()
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    gate = threading.Event()

    @sm.host_kernel
    def gated(v):
        gate.wait(5)
        v += 10

    s.synchronize()
    with sm.capture(s) as g:
        sm.launch(gated, 1, 1, x, stream=s)
    alloc = x.allocation
    fut = g.replay(s)
    del x, g  # dropped while its replay runs: no alias any more, but the lease holds the memory
    gc_collect_harder()
    assert alloc.live_views == 0 and alloc.tracker
    gate.set()
    fut.result(5)


def test_capture_errors_end_the_capture(host):
    s = host.create_stream()
    x = sm.Buffer.zeros(4, device=host, stream=s)
    s.synchronize()
    with pytest.raises(ZeroDivisionError):
        with sm.capture(s) as g:
            sm.launch(inc, 1, 1, x, stream=s)
            1 / 0
    assert s._capture is None
    with pytest.raises(sm.CaptureError, match=r"is failed; only a finished capture can be replayed"):
        g.replay(s)
    assert x.allocation.live_views == 1  # the failed graph kept nothing
    sm.launch(inc, 1, 1, x, stream=s).result(5)  # the stream works normally again
    with sm.capture(s):
        with pytest.raises(sm.CaptureError, match=r"is already capturing graph"):
            sm.capture(s).__enter__()
        with pytest.raises(sm.CaptureError, match=r"is capturing a graph: its work has not run"):
            s.synchronize()
        with pytest.raises(sm.CaptureError, match=r"^to_host\(\) on .* cannot be captured"):
            x.to_host(stream=s)
        with pytest.raises(sm.CaptureError, match=r"^apply\(\) cannot be captured"):
            sm.op(inc, 1, 1, x).apply(print).submit(s)
        # events: none recorded into a capture, no wait into one or on one
        other = host.create_stream("other")
        before = other.record()
        with pytest.raises(sm.CaptureError, match=r"^<Stream .*> is capturing a graph: its work "
                                                  r"has not run, so an event recorded now would "
                                                  r"mark nothing; record it after the capture ends$"):
            s.record()
        with pytest.raises(sm.CaptureError, match=r"is capturing a graph: its work has not run"):
            other.wait(s)
        with pytest.raises(sm.CaptureError, match=r"^<Stream .*> is capturing a graph: it cannot "
                                                  r"wait for work outside the capture; make the "
                                                  r"wait before the capture begins$"):
            s.wait(before)
    assert s._capture is None
    s.wait(before)
    assert s.record().synchronize(5) is True


def test_a_capture_ended_in_another_thread_still_ends(host):
    s = host.create_stream()
    x = sm.Buffer.zeros(4, device=host, stream=s)
    s.synchronize()
    cap = sm.capture(s)
    g = cap.__enter__()
    sm.launch(inc, 1, 1, x, stream=s)
    errors = []

    def end():
        try:
            cap.__exit__(None, None, None)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=end)
    t.start()
    t.join()
    s.__exit__(None, None, None)  # (the `with stream:` the capture entered, in this thread)
    [e] = errors
    assert type(e) is sm.CaptureError
    assert re.match(rf"^capture of graph #{g.id} on <Stream .*> failed: <Stream .*> was not "
                    rf"entered in this thread or task", str(e))
    assert s._capture is None  # the capture ended: the stream runs work again
    # this thread no longer counts it among its captures (a launch of this thread elsewhere
    # during another thread's capture on s would warn that it escaped a capture of its own)
    from sharedmem.runtime.state import CAPTURING
    assert s not in CAPTURING.streams
    assert x.allocation.live_views == 1  # the failed graph kept nothing
    sm.launch(inc, 1, 1, x, stream=s).result(5)
    np.testing.assert_array_equal(x.to_host(), np.ones(4))
    with sm.capture(s) as g2:  # and captures again
        sm.launch(inc, 1, 1, x, stream=s)
    g2.replay(s).result(5)
    np.testing.assert_array_equal(x.to_host(), np.full(4, 2.0))


def test_graph_of_an_op_chain(host):
    a = sm.Buffer.zeros(10, "float32", device=host)
    b = sm.Buffer.zeros(10, "float32", device=host)
    out = sm.Buffer.zeros(10, "float32", device=host)
    host.default_stream.synchronize()
    chain = (sm.op(fill, 1, 1, sm.Out(a), 1.0).and_then(sm.op(fill, 1, 1, sm.Out(b), 2.0))
             .and_then(sm.op(add, 1, 1, sm.In(a), sm.In(b), sm.Out(out))))
    g = sm.graph(chain)
    assert isinstance(g, sm.Graph) and g.launches == 3
    np.testing.assert_array_equal(out.to_host(), np.zeros(10))
    g.replay().result(5)
    np.testing.assert_array_equal(out.to_host(), np.full(10, 3.0))
    g.release()
    gc.collect()


def test_graph_of_a_zip(host):
    """A captured zip records its branches in order on the capturing stream;
    each replay runs all of them, then what follows the zip."""
    a = sm.Buffer.zeros(10, "float32", device=host)
    b = sm.Buffer.zeros(10, "float32", device=host)
    out = sm.Buffer.zeros(10, "float32", device=host)
    host.default_stream.synchronize()
    z = sm.zip(sm.op(inc, 1, 1, a), sm.op(inc, 1, 1, b), sm.op(inc, 1, 1, b))
    g = sm.graph(z.and_then(sm.op(add, 1, 1, sm.In(a), sm.In(b), sm.Out(out))))
    assert g.launches == 4
    np.testing.assert_array_equal(out.to_host(), np.zeros(10))
    g.replay().result(5)
    g.replay().result(5)
    np.testing.assert_array_equal(a.to_host(), np.full(10, 2.0))
    np.testing.assert_array_equal(out.to_host(), np.full(10, 6.0))


def test_an_op_submitted_before_and_inside_a_capture(host):
    """An op prepared on a stream and then submitted inside a capture on that
    stream is recorded, not run (the host stream records while capturing)."""
    s = host.create_stream("s")
    x = sm.Buffer.zeros(4, "float32", device=host, stream=s)
    o = sm.op(inc, 1, 1, x)
    o.submit(s).result(5)
    np.testing.assert_array_equal(x.to_host(), np.ones(4))
    with sm.capture(s) as g:
        o.submit(s)
        o.submit(s)
    np.testing.assert_array_equal(x.to_host(), np.ones(4))
    g.replay(s).result(5)
    np.testing.assert_array_equal(x.to_host(), np.full(4, 3.0))
    o.submit(s).result(5)  # after the capture: runs again
    np.testing.assert_array_equal(x.to_host(), np.full(4, 4.0))


def test_a_released_graph_keeps_no_memory(host):
    """Released, a graph gives its tokens back and drops them: memory whose
    every handle is gone is freed though the Graph object lives on."""
    import weakref
    from conftest import gc_collect_harder
    s = host.create_stream()
    x = sm.Buffer.zeros(4, "float32", device=host, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        sm.launch(inc, 1, 1, x, stream=s)
    g.replay(s).result(5)
    alloc = weakref.ref(x.allocation)
    del x
    gc_collect_harder()
    assert alloc() is not None and alloc().live_views == 1  # the graph's own token
    g.release()
    gc_collect_harder()
    assert alloc() is None
    with pytest.raises(sm.CaptureError, match=r"is released; only a finished capture"):
        g.replay(s)


def test_launch_escaping_a_capture_warns(host):
    """#16: inside `with sm.capture(s1)`, a launch onto another (non-capturing) stream of the
    device runs at once and is not in the graph: a SharedMemWarning says so, at the user's
    line. Launches onto the capturing stream, and other threads' launches, do not warn."""
    import warnings
    s1, s2 = host.create_stream("cap"), host.create_stream("other")
    x = sm.Buffer.zeros(4, "float32", device=host)
    y = sm.Buffer.zeros(4, "float32", device=host)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with sm.capture(s1) as g:
            sm.launch(inc, 1, 1, x)  # the capturing stream: recorded
            sm.launch(inc, 1, 1, x, stream=s1)
            t = threading.Thread(target=lambda: sm.launch(inc, 1, 1, y, stream=s2).result())
            t.start()
            t.join()
            sm.launch(fill, 1, 1, sm.Out(y), 5.0, stream=s2).result()  # runs now: warned
        sm.launch(inc, 1, 1, y, stream=s2).result()  # after the capture: no warning
    escaped = [w for w in seen if issubclass(w.category, sm.SharedMemWarning)]
    assert len(escaped) == 1, [str(w.message) for w in seen]
    msg = str(escaped[0].message)
    assert f"on {s2} runs now, outside graph #{g.id} that this thread is capturing on {s1}" in msg
    assert escaped[0].filename == __file__
    np.testing.assert_array_equal(y.to_host(), [6, 6, 6, 6])  # 1 (thread), then 5, then +1
    np.testing.assert_array_equal(x.to_host(), [0, 0, 0, 0])  # captured, not run
    g.replay(stream=s1).result()
    np.testing.assert_array_equal(x.to_host(), [2, 2, 2, 2])


def test_a_graph_cannot_be_released_while_it_is_captured(host):
    # (what was captured so far would replay without the memory it needs)
    s = host.create_stream("cap")
    a = sm.Buffer.zeros(16, "int64", device=host, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        sm.launch(inc, 1, 1, sm.Out(a), stream=s)
        with pytest.raises(sm.CaptureError, match=rf"^graph #{g.id} is being captured; release it "
                                                  rf"after the capture ends$"):
            g.release()
    assert a.allocation.live_views == 2  # the graph's alias, kept
    with pytest.raises(sm.AliasError, match=rf"graph #{g.id}"):
        sm.Tensor.from_buffer(a, (4, 4))
    g.replay(s).result(5)
    np.testing.assert_array_equal(a.to_host(), np.ones(16))
    g.release()
    assert a.allocation.live_views == 1


def test_a_graph_that_writes_bytes_it_first_read_read_only_holds_a_writable_alias(host):
    s = host.create_stream("cap")
    buf = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    s.synchronize()
    ro = buf.as_readonly()

    @sm.host_kernel
    def read(x):
        pass

    with sm.capture(s) as g:
        sm.launch(read, 1, 1, sm.In(ro), stream=s)  # the range's first use: a read-only view
        sm.launch(inc, 1, 1, sm.Out(buf), stream=s)  # then written
    buf.release()
    # a read-only move of bytes the graph writes is refused, as in the other order
    with pytest.raises(sm.AliasError, match=rf"graph #{g.id}"):
        sm.Tensor.from_buffer(ro, (2, 2))
    g.release()
    t = sm.Tensor.from_buffer(ro, (2, 2))
    assert t.readonly


def test_submissions_without_a_stream_are_never_captured_by_another_threads_graph(host):
    x = sm.Buffer.zeros(1, "int64", device=host)
    y = sm.Buffer.zeros(1, "int64", device=host)
    host.default_stream.synchronize()
    op = sm.op(inc, 1, 1, sm.Out(x))
    # a pool stream that another thread captures on is skipped by op.submit() (its work would
    # be recorded); in the capturing thread, op.submit() is captured (the current stream)
    p = op.submit().stream
    began, done, graphs = threading.Event(), threading.Event(), []

    def capture_on_p():
        with sm.capture(p) as g:
            graphs.append(g)
            op.submit()
            began.set()
            done.wait(5)
    t = threading.Thread(target=capture_on_p)
    t.start()
    began.wait(5)
    try:
        assert all(op.submit().stream is not p for _ in range(8))
    finally:
        done.set()
        t.join()
    assert graphs[0].launches == 1
    graphs[0].release()
    # sm.graph captures on a stream of its own: no op.submit() of another thread lands in it
    chain = sm.op(inc, 1, 1, sm.Out(y))
    for _ in range(50):
        chain = chain.and_then(sm.op(inc, 1, 1, sm.Out(y)))
    stop = threading.Event()

    def capturer():
        while not stop.is_set():
            sm.graph(chain).release()
    t = threading.Thread(target=capturer)
    t.start()
    try:
        futures = [op.submit() for _ in range(300)]
    finally:
        stop.set()
        t.join()
    assert all(f.stream is not None for f in futures)  # (a captured submission has none)
    sm.synchronize()
    assert x.to_host()[0] == 1 + 8 + 300
    assert y.to_host()[0] == 0  # (the graphs were captured, never replayed)


def test_graph_of_something_else_than_an_op_is_a_type_error(host):
    with pytest.raises(TypeError, match=r"^sm.graph takes a DeviceOp \(sm.op\(...\), and_then, "
                                        r"zip\), got function; to capture launches, use `with "
                                        r"sm.capture\(stream\)`$"):
        sm.graph(lambda: None)


def test_graph_lifetime_protocol_and_replay_policy_check(host):
    s = host.create_stream()
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        sm.launch(inc, 1, 1, x, stream=s)
    assert repr(g) == f"<Graph #{g.id} on <Device host>: 1 captured, 1 range, ready>"
    before = sm.stats()
    with pytest.raises(sm.SharedMemError, match=r"^unknown access policy 'fifo'; expected one of "
                                                r"'order', 'reject'$"):
        g.replay(s, policy="fifo")
    assert sm.stats().submitted == before.submitted and not x.allocation.tracker
    g.replay(s, policy="reject").result(5)
    with g as entered:
        assert entered is g
    assert repr(g) == f"<Graph #{g.id} on <Device host>: 1 captured, 0 ranges, released>"
    g.release()  # idempotent
    assert x.allocation.live_views == 1
    np.testing.assert_array_equal(x.to_host(), np.ones(4))


def test_a_view_released_while_a_captured_launch_packs_is_not_captured(host):
    from test_launch import _PreparedKernel
    s = host.create_stream()
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    s.synchronize()
    part = x[0:2]
    with pytest.raises(sm.ReleasedError, match=r"^a slice passed to preparing kernel prepared "
                                               r"was released before the launch$"):
        with sm.capture(s) as g:
            sm.launch(_PreparedKernel(lambda args: args[0].view.release()), 1, 1, part,
                      stream=s)
    assert g.launches == 0 and s._capture is None
    assert x.allocation.live_views == 1  # the failed graph holds nothing
    with pytest.raises(sm.CaptureError, match=r"is failed"):
        g.replay(s)
    sm.launch(inc, 1, 1, x, stream=s).result(5)  # the stream runs on


def test_a_capture_block_exited_twice_or_never_entered_is_refused_and_changes_nothing(host):
    s = host.create_stream("cap")
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    s.synchronize()
    with pytest.raises(sm.CaptureError, match=r"is not capturing \(exited twice, or never "
                                              r"entered\); nothing was changed$"):
        sm.capture(s).__exit__(None, None, None)
    c1 = sm.capture(s)
    with c1 as g1:
        sm.launch(inc, 1, 1, x, stream=s)
    with sm.capture(s) as g2:  # a stale exit of c1 inside another capture on the same stream
        with pytest.raises(sm.CaptureError, match=r"is not capturing"):
            c1.__exit__(None, None, None)
        assert s._capture is g2
        sm.launch(inc, 1, 1, x, stream=s)
    assert s._capture is None and s._impl.recording is None
    g1.replay(s).result(5)  # g1 was not failed by the stale exit
    g2.replay(s).result(5)
    sm.launch(inc, 1, 1, x, stream=s).result(5)  # the stream runs work again
    np.testing.assert_array_equal(x.to_host(), np.full(4, 3))
    g1.release()
    g2.release()


def test_an_event_recorded_as_another_thread_begins_a_capture_marks_the_work_before_it(
        host, monkeypatch):
    """Stream.record() decides under the core lock, where captures begin: a capture begun
    after its check can no longer take the record (the Event said "reached" while the
    stream's earlier work still ran). The window is widened by a delay in record_marker."""
    s = host.create_stream("s")
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    s.synchronize()
    gate = threading.Event()

    @sm.host_kernel
    def slow(v):
        gate.wait(5)
        v += 1
    sm.launch(slow, 1, 1, x, stream=s)
    real = type(host.backend).record_marker
    in_record = threading.Event()

    def delayed(self, impl, pooled=False):
        if threading.current_thread().name == "recorder":
            in_record.set()
            time.sleep(0.2)  # (a capture that begins now waits for the lock, held here)
        return real(self, impl, pooled)
    monkeypatch.setattr(type(host.backend), "record_marker", delayed)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("ev", s.record()), name="recorder")
    t.start()
    assert in_record.wait(5)
    with sm.capture(s):  # (open while the record runs: an empty block ended before it)
        t.join(5)
    monkeypatch.undo()
    assert "ev" in out  # (the record was not refused: it came first)
    assert out["ev"].query() is False  # slow() has not run: the event is not reached
    gate.set()
    assert out["ev"].synchronize(5) is True
    np.testing.assert_array_equal(x.to_host(), np.ones(4))
