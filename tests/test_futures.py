"""Futures at their edges: timeouts of computed values, exception() as concurrent.futures
has it, other work's callback errors kept out of continuations (host backend)."""

import _thread
import asyncio
import gc
import logging
import re
import signal
import sys
import threading
import time

import numpy as np
import pytest

import sharedmem as sm
from conftest import gc_collect_harder
from host_kernels import fill, inc, slow_fill


def test_an_applied_value_honours_result_timeout_and_await_does_not_block(host):
    """result(timeout) of an apply() future whose function still runs raises TimeoutError
    in time (api.md); awaiting it leaves the event loop running meanwhile."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    started = threading.Event()

    def slow(_):
        started.set()
        time.sleep(1.0)
        return 42

    fut = sm.op(fill, 1, 1, b, 1.0).apply(slow).submit()
    assert started.wait(5)  # computed eagerly, in the thread that retired the work
    assert not fut.done()  # (done once the value is)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^the value of .* was not computed within 0.1 s$"):
        fut.result(timeout=0.1)
    with pytest.raises(TimeoutError):
        fut.exception(timeout=0.1)
    assert time.monotonic() - t0 < 0.9
    ticks = []

    async def ticker():
        for _ in range(20):
            ticks.append(time.monotonic())
            await asyncio.sleep(0.02)

    async def main():
        t = asyncio.create_task(ticker())
        v = await fut
        await t
        return v

    assert asyncio.run(main()) == 42
    assert np.diff(ticks).max() < 0.3  # the loop ran while the value was computed
    assert fut.done() and fut.result(0) == 42 and fut.exception(0) is None
    assert fut.then(lambda v: v + 1).result(5) == 43


def test_exception_returns_the_futures_own_exception_whatever_its_type(host):
    b = sm.Buffer.zeros(4, "float32", device=host)

    def fn(_):
        raise TimeoutError("socket timed out")

    h = sm.launch(fill, 1, 1, b, 1.0).then(fn)
    e = h.exception(5)  # (a stored TimeoutError is the outcome, not a timeout of the wait)
    assert h.done()
    assert type(e) is TimeoutError and str(e) == "socket timed out"
    a = sm.op(fill, 1, 1, b, 1.0).apply(fn).submit()
    e = a.exception(5)
    assert type(e) is TimeoutError and str(e) == "socket timed out"


def test_an_interrupt_while_exception_waits_propagates(host):
    b = sm.Buffer.zeros(4, "float32", device=host)
    f = sm.launch(slow_fill, 1, 1, b, 1.0, 1.0)
    # (a process a shell without job control started in the background -- `make test &`,
    # nohup -- inherits SIGINT ignored, and interrupt_main() then does nothing)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.2, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            f.exception()  # Ctrl-C while waiting is not the future's exception
    finally:
        signal.signal(signal.SIGINT, old)
    assert f.exception() is None


def test_other_works_callback_errors_are_raised_not_returned_and_not_in_continuations(host):
    """An error raised in one submission's callback is re-raised at the next call of a user
    thread (model.md) -- raised by exception(), not returned as this future's outcome -- and
    a continuation on a callback worker does not receive it as its own."""
    a = sm.Buffer.zeros(4, "float32", device=host)
    b = sm.Buffer.zeros(4, "float32", device=host)
    c = sm.Buffer.zeros(4, "float32", device=host)
    g = sm.launch(fill, 1, 1, c, 1.0, stream=host.create_stream())
    g.result()
    f1 = sm.launch(slow_fill, 1, 1, a, 1.0, 0.1, stream=host.create_stream())
    ran = threading.Event()

    def bad(_f):
        ran.set()
        raise ValueError("callback of other work")

    f1.add_done_callback(bad)
    f2 = sm.launch(slow_fill, 1, 1, b, 1.0, 0.3, stream=host.create_stream())
    h = f2.then(lambda _: g.result())  # g succeeded: the continuation returns None
    assert ran.wait(5)
    deadline = time.monotonic() + 5
    while not h.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert h.done() and h._error is None  # (read directly: not an API call)
    with pytest.raises(ValueError, match="^callback of other work$"):
        g.exception()  # the deferred error, re-raised here
    assert g.exception() is None and h.exception() is None and h.result() is None


@sm.host_kernel
def _fails_after_writing(x):
    x[:] = 7
    raise ValueError("bad input")


def test_a_failed_host_kernels_exception_keeps_no_view_of_freed_memory(host):
    """The future keeps the kernel's exception (HostKernelError's __cause__); its frames'
    locals -- NumPy views of pool memory that is reused once the work retired -- are cleared,
    while the traceback still shows where it raised."""
    import traceback
    b = sm.Buffer.zeros(1024, "float32", device=host)
    f = sm.launch(_fails_after_writing, 1, 1, b)
    cause = f.exception(5).__cause__
    assert type(cause) is ValueError and str(cause) == "bad input"
    del b
    sm.synchronize()
    c = sm.Buffer.zeros(1024, "float32", device=host)
    tb = cause.__traceback__
    while tb.tb_next:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "_fails_after_writing"
    assert "x" not in tb.tb_frame.f_locals  # (a debugger finds no view of c's bytes)
    assert 'raise ValueError("bad input")' in "".join(traceback.format_tb(cause.__traceback__))
    np.testing.assert_array_equal(c.to_host(), np.zeros(1024, np.float32))


def _check_row(x):
    row = x[:8]  # noqa: F841  (a NumPy view of the kernel's argument, in a helper's frame)
    raise KeyError("inner")


@sm.host_kernel
def _fails_with_a_cause(x):
    try:
        _check_row(x)
    except KeyError as e:
        raise ValueError("bad input") from e


def test_the_exceptions_chained_to_a_failed_kernels_keep_no_view_either(host):
    b = sm.Buffer.zeros(1024, "float32", device=host)
    err = sm.launch(_fails_with_a_cause, 1, 1, b).exception(5).__cause__
    assert type(err) is ValueError and type(err.__cause__) is KeyError
    tb = err.__cause__.__traceback__
    while tb.tb_next:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "_check_row"
    assert "row" not in tb.tb_frame.f_locals and "x" not in tb.tb_frame.f_locals


@sm.host_kernel
def _raises_its_argument(x):
    x[:] = 7
    raise AssertionError("not negative", x[:4], {"kept": x})  # (what `assert ok, x` gives)


def test_views_in_a_failed_kernels_exception_args_are_copies(host):
    """An exception whose args hold the kernel's view (``assert ok, x``) holds a copy of it:
    the values the kernel saw, no alias of memory the pool hands out again."""
    b = sm.Buffer.zeros(1024, "float32", device=host)
    ptr = b.ptr
    err = sm.launch(_raises_its_argument, 1, 1, b).exception(5).__cause__
    b.release()
    del b
    sm.synchronize()
    gc.collect()
    c = sm.Buffer.zeros(1024, "float32", device=host)
    sm.synchronize()  # (its zeros written)
    assert c.ptr == ptr  # (the pool gave the block out again: what the exception showed)
    assert err.args[0] == "not negative" and err.args[1].tolist() == [7.0] * 4
    assert err.args[2]["kept"] is not None  # (a dict inside args: not walked, see model.md)
    err.args[1][:] = -1  # a reporter writing what the exception shows
    np.testing.assert_array_equal(c.to_host(), np.zeros(1024, np.float32))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="ExceptionGroup is Python 3.11+")
def test_the_members_of_a_failed_kernels_exception_group_keep_no_view(host):
    def check(row):
        raise ValueError("bad row")

    @sm.host_kernel
    def k(x):
        errors = []
        for i in range(2):
            try:
                check(x[4 * i:4 * i + 4])
            except ValueError as e:
                errors.append(e)
        raise ExceptionGroup("rows failed", errors)  # noqa: F821  (3.11+)

    b = sm.Buffer.zeros(64, "float32", device=host)
    err = sm.launch(k, 1, 1, b).exception(5).__cause__
    assert [str(e) for e in err.exceptions] == ["bad row", "bad row"]
    tb = err.exceptions[0].__traceback__
    while tb.tb_next:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "check" and "row" not in tb.tb_frame.f_locals


def _chain(fut):
    later = []
    h1 = fut.then(lambda v: later[0].result(timeout=3))  # waits for the continuation after it
    h2 = fut.then(lambda v: "second")
    later.append(h2)
    return h1, h2


def test_a_continuation_may_wait_for_a_later_one_of_an_applied_value_too(host):
    """As for a launch's future: a continuation that waits hands the ones after it to
    another worker (they ran one after another, and the wait timed out)."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    for f in (sm.launch(slow_fill, 1, 1, b, 1.0, 0.3),
              sm.op(slow_fill, 1, 1, b, 1.0, 0.3).apply(lambda v: 1).submit()):
        h1, _ = _chain(f)
        assert h1.result(10) == "second"


def test_continuations_of_a_value_computed_in_result_get_no_other_callbacks_error(host):
    b = sm.Buffer.zeros(4, "float32", device=host)
    c = sm.Buffer.zeros(4, "float32", device=host)
    g = sm.launch(fill, 1, 1, c, 1.0, stream=host.create_stream())
    g.result()
    gate = threading.Event()
    f = sm.op(fill, 1, 1, b, 1.0).apply(lambda v: gate.wait(5) and 1) \
        .apply(lambda v: v + 1).submit()

    def bad(_f):
        raise ValueError("callback of other work")

    f.add_done_callback(bad)
    h = f.then(lambda _: g.result())  # runs after bad; g's result is None
    threading.Timer(0.3, gate.set).start()
    seen = []
    for _ in range(3):  # (bad's error is re-raised at a call of this user thread, once)
        try:
            assert f.result(5) == 2
            assert h.result(5) is None and h.exception() is None
            break
        except ValueError as e:
            seen.append(str(e))
    if not seen:  # (h ran after bad: bad's error is deferred by now)
        try:
            g.result()
        except ValueError as e:
            seen.append(str(e))
    assert seen == ["callback of other work"]


def _callbacks_left(fut) -> int:
    """The callbacks ``fut`` holds that have not run (read directly: no API call)."""
    if isinstance(fut, sm.HostFuture):
        return len(fut._callbacks or ())
    return len(fut._s.callbacks or ()) + len(getattr(fut, "_waiters", None) or ())


def test_awaits_that_time_out_leave_no_callback_behind(host):
    """asyncio.wait_for(fut, t) timing out, again and again on work that does not finish,
    leaves the future's callbacks as they were (each await takes back the one it added):
    for a launch's future, an apply() future and a then() future."""
    gate = threading.Event()

    @sm.host_kernel
    def blocked(x):
        gate.wait(30)

    s = host.create_stream()
    b = sm.Buffer.zeros(4, "float32", device=host)
    f = sm.launch(blocked, 1, 1, b, stream=s)
    a = sm.op(fill, 1, 1, b, 1.0).apply(lambda v: 7).submit(s)
    h = f.then(lambda v: 8)
    g = sm.launch(fill, 1, 1, b, 2.0, stream=s)  # (no callback but the awaits')
    futures = (f, a, h, g)
    before = [_callbacks_left(x) for x in futures]

    async def retry(fut):
        for _ in range(5):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(fut, 0.01)

    try:
        for x in futures:
            asyncio.run(retry(x))
        assert [_callbacks_left(x) for x in futures] == before
    finally:
        gate.set()
    assert f.result(5) is None and a.result(5) == 7 and h.result(5) == 8 and g.result(5) is None

    async def awaited():
        return await a, await h
    assert asyncio.run(awaited()) == (7, 8)
    ran = []
    for x in futures:  # (they run, also where every callback was taken back)
        x.add_done_callback(ran.append)
    deadline = time.monotonic() + 5  # (on a callback worker where the list awaits one)
    while len(ran) < len(futures) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(map(id, ran)) == sorted(map(id, futures))


@sm.host_kernel
def _nobody_looks(x):
    raise ValueError("nobody looks")


def _never_retrieved(caplog) -> list:
    return [r.getMessage() for r in caplog.records
            if r.name == "sharedmem" and r.levelno == logging.ERROR
            and "never retrieved" in r.getMessage()]


def _script_output(tmp_path, body, *argv) -> str:
    """What a script ``body`` prints, the sharedmem logger's ERROR lines included, when run
    to its end in its own interpreter (exit hooks and all)."""
    import os
    import subprocess
    script = tmp_path / "script.py"
    script.write_text(
        "import logging, sys, time, sharedmem as sm\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.ERROR, format='%(message)s')\n"
        "@sm.host_kernel\n"
        "def boom(x):\n"
        "    time.sleep(float(sys.argv[1]))\n"
        "    raise ValueError('forgotten')\n"
        "b = sm.Buffer.zeros(4, device=sm.Device.host())\n" + body)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=root), timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_failure_whose_work_lives_to_the_exit_is_reported_at_the_exit(tmp_path):
    """A script's typical case: the failed kernel's buffer (whose access record keeps the
    work's marker) lives until the interpreter exits. The exit reports the exception nobody
    retrieved, once; one that was retrieved is not reported -- nor one a callback chained
    after a kernel still running at the end looks at, through a then() (the exit finishes
    the kernel and runs the callbacks before it reports: before, the host exit hook,
    registered after the callbacks', ran first and reported it)."""
    body = ("f = sm.launch(boom, 1, 1, b)\n"
            "if sys.argv[2] == 'look':\n"
            "    assert isinstance(f.exception(5), sm.HostKernelError)\n"
            "if sys.argv[2] == 'then':\n"
            "    g = f.then(print)\n"
            "    g.add_done_callback(lambda h: h.exception())\n")
    for how, want in (("forget", 1), ("look", 0), ("then", 0)):
        out = _script_output(tmp_path, body, "0.5" if how == "then" else "0", how)
        lines = [ln for ln in out.splitlines() if "never retrieved" in ln]
        assert len(lines) == want, (how, out)
        if want:
            assert lines[0].startswith("the exception of host kernel boom on host stream ") \
                and "ValueError('forgotten')" in lines[0], lines[0]


def test_callbacks_handed_off_at_the_exit_run_where_no_thread_can_start(tmp_path):
    """Python 3.12 starts no thread once the interpreter exits (atexit hooks included): the
    retirer, sweeping a kernel that finished in the exit hook, could not start a callback
    worker for its then() -- the RuntimeError was reported as a callback's error, and the
    kernel's exception, which the then() would have looked at, as never retrieved. The exit
    now runs such callbacks itself. (3.12's refusal made here on every version: a hook
    registered after sharedmem's runs before them.)"""
    body = (_NO_THREADS_AT_EXIT +
            "atexit.register(setattr, threading.Thread, 'start', refuse)\n"
            "f = sm.launch(boom, 1, 1, b)\n"
            "g = f.then(print)\n"
            "g.add_done_callback(lambda h: print('looked:', type(h.exception()).__name__))\n")
    out = _script_output(tmp_path, body, "0.5", "then")
    assert "looked: HostKernelError" in out and "never" not in out, out


def test_callbacks_of_work_that_finished_by_the_exit_run_though_the_retirer_never_swept_it(
        tmp_path):
    """A then() and an add_done_callback of a kernel that succeeded run at the exit, also
    where the retirer had not swept the work yet (here it is never woken: as when it does not
    get the GIL before the exit): before, the exit swept only where a failure was
    unretrieved, and the callbacks' drain, which sees only what was handed off, dropped them
    without a word."""
    body = ("import sharedmem.runtime.retirer as retirer\n"
            "@sm.host_kernel\n"
            "def slow(x):\n"
            "    time.sleep(0.5)\n"
            "sm.Device.host().backend.on_progress = None\n"
            "retirer.IDLE_INTERVAL = 60\n"
            "f = sm.launch(slow, 1, 1, b)\n"
            "f.then(lambda v: print('then ran', flush=True))\n"
            "f.add_done_callback(lambda g: print('callback ran', flush=True))\n")
    out = _script_output(tmp_path, body)
    assert out.splitlines() == ["then ran", "callback ran"], out


def test_a_failure_nobody_retrieved_is_logged_once_when_its_work_is_gone(host, caplog):
    """A host kernel launched and forgotten that raises: once its future's state is
    garbage-collected with the exception never retrieved, the sharedmem logger says so at
    ERROR, once (as asyncio does for a future); retrieved in any public way, it says
    nothing."""
    caplog.set_level(logging.INFO, logger="sharedmem")
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "float32", device=host)
    sm.launch(_nobody_looks, 1, 1, b, stream=s)  # fire and forget
    s.synchronize()
    del b
    gc_collect_harder()
    msgs = _never_retrieved(caplog)
    assert len(msgs) == 1, msgs
    assert re.match(r"^the exception of host kernel _nobody_looks on host stream "
                    r"'sharedmem-host-stream-\d+' was never retrieved: ValueError\('nobody "
                    r"looks'\) \(no result\(\), exception\(\) or await of its future, or "
                    r"of a then\(\) or composite op future carrying it, looked at it\)$",
                    msgs[0]), msgs[0]

    def awaited(f):
        async def main():
            with pytest.raises(sm.HostKernelError):
                await f
        asyncio.run(main())

    def result(f):
        with pytest.raises(sm.HostKernelError):
            f.result(5)

    for retrieve in (result, lambda f: f.exception(5), lambda f: f.then(len).exception(5),
                     awaited, lambda f: f.to_concurrent().exception(5)):
        caplog.clear()
        b = sm.Buffer.zeros(4, "float32", device=host)
        f = sm.launch(_nobody_looks, 1, 1, b, stream=s)
        retrieve(f)
        del f, b
        s.synchronize()
        gc_collect_harder()
        assert _never_retrieved(caplog) == []


def test_a_zip_whose_branches_both_fail_leaves_no_never_retrieved_report(host, caplog):
    """zip() of two host kernels that both raise: the zip's future raises the first's
    HostKernelError, and its user retrieved it. The second branch's future is the zip's own
    (the user never had it): its exception is seen with the first, not logged at ERROR as
    a future "dropped before result() ... looked at it" (as asyncio.gather retrieves every
    child's). Before, the second branch's failure was logged as never retrieved."""
    caplog.set_level(logging.INFO, logger="sharedmem")
    b = sm.Buffer.zeros(4, "float32", device=host)
    c = sm.Buffer.zeros(4, "float32", device=host)
    z = sm.zip(sm.op(_nobody_looks, 1, 1, b), sm.op(_nobody_looks, 1, 1, c)).submit()
    assert type(z.exception(5)) is sm.HostKernelError
    del z, b, c
    sm.synchronize()
    gc_collect_harder()
    time.sleep(0.2)
    gc_collect_harder()
    assert _never_retrieved(caplog) == []

    def interrupted(v):
        raise KeyboardInterrupt
    b = sm.Buffer.zeros(4, "float32", device=host)
    c = sm.Buffer.zeros(4, "float32", device=host)
    z = sm.zip(sm.op(_nobody_looks, 1, 1, b), sm.op(fill, 1, 1, c, 1.0).apply(interrupted))
    with pytest.raises(KeyboardInterrupt):  # (never hidden behind an earlier branch's error)
        z.submit().result(5)


def test_reprs_of_a_failed_continuation_and_of_an_event_whose_query_fails(host):
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    f = sm.launch(sm.host_kernel(lambda x: None), 1, 1, b, stream=s).then(lambda v: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        f.result(5)
    assert repr(f) == "<HostFuture failed: ZeroDivisionError('division by zero')>"
    ev = s.record()
    ev.synchronize(5)

    class Broken:
        def query(self):
            raise RuntimeError("gone")

    ev._marker = Broken()  # (a repr never raises)
    assert repr(ev) == f"<Event on {s}: unknown (RuntimeError)>"


def _defer_an_error(host, text):
    """A callback of other work raises: its error is deferred to the next API call. Returns
    once it is."""
    from sharedmem.runtime.state import RUNTIME
    s = host.create_stream("other")
    x = sm.Buffer.zeros(4, "float32", device=host, stream=s)

    def bug(f):
        raise ValueError(text)
    f = sm.launch(fill, 1, 1, x, 1.0, stream=s)
    f.add_done_callback(bug)  # (run at once if done: its error deferred all the same)
    deadline = time.monotonic() + 5
    while not RUNTIME.errors and time.monotonic() < deadline:
        time.sleep(0.001)
    assert RUNTIME.errors


def test_other_work_s_callback_error_does_not_cut_a_composite_op_between_its_parts(
        host, monkeypatch):
    """A deferred error arriving while a composite op submits its parts waits for the next
    call: raised between them it left the first part submitted, no future to wait on, and a
    resubmission ran that part twice (api.md: every part runs once)."""
    import sharedmem.ops as sm_ops
    from host_kernels import Foreign, ForeignKernel
    a = sm.Buffer.zeros(4, "float32", device=host)
    c = sm.Buffer.zeros(4, "float32", device=host)
    submitted = []
    real = sm_ops.submit_planned

    def submit_planned(planned):  # (the error arrives once the first part is submitted)
        sub = real(planned)
        submitted.append(sub)
        if len(submitted) == 1:
            _defer_an_error(host, "other work's bug")
        return sub
    monkeypatch.setattr(sm_ops, "submit_planned", submit_planned)
    o = sm.op(inc, 1, 1, a).and_then(sm.op(ForeignKernel(), 1, 1, Foreign(c)))
    fut = o.submit()  # (both parts submitted: a future to wait on)
    assert len(submitted) == 2
    with pytest.raises(ValueError, match="other work's bug"):
        fut.result()  # (the next call: the error surfaces there)
    fut.result()
    assert a.to_host().tolist() == [1.0] * 4 and c.to_host().tolist() == [7.0] * 4


def test_synchronize_waits_for_every_stream_before_raising_a_deferred_error(host):
    """sm.synchronize() with an error deferred waits for the work of every stream, then
    raises it: raised after the first stream, the others were neither waited for nor
    retired."""
    streams = [host.create_stream(f"s{i}") for i in range(6)]
    bufs = [sm.Buffer.zeros(4, "float32", device=host, stream=s) for s in streams]
    sm.synchronize()
    # (of different lengths: whichever stream is waited for first, one is still running then)
    futs = [sm.launch(slow_fill, 1, 1, b, 2.0, 0.1 * (i + 1), stream=s)
            for i, (b, s) in enumerate(zip(bufs, streams))]
    _defer_an_error(host, "deferred")
    with pytest.raises(ValueError, match="deferred"):
        sm.synchronize()
    assert [f.done() for f in futs] == [True] * 6
    assert sm.stats().in_flight == 0


def test_a_callback_added_to_done_work_defers_its_error_as_any_callback(host):
    """add_done_callback on a done future runs the callback at once; its exception is
    deferred to the next API call, as for a callback that ran later (model.md) -- raised out
    of add_done_callback, a loop adding callbacks broke or not by which work was done."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    f = sm.launch(fill, 1, 1, b, 1.0)
    f.result()
    ran = []

    def bug(fut):
        ran.append(fut)
        raise ValueError("callback bug")
    f.add_done_callback(bug)  # (no raise here)
    assert ran == [f]
    with pytest.raises(ValueError, match="callback bug"):
        sm.synchronize()
    h = sm.op(fill, 1, 1, b, 2.0).apply(lambda v: 5).submit()  # (a HostFuture's too)
    assert h.result() == 5
    h.add_done_callback(bug)
    with pytest.raises(ValueError, match="callback bug"):
        sm.stats()


def test_a_failed_part_of_a_forgotten_composite_op_is_logged_as_never_retrieved(host, caplog):
    """A composite op's future computes its value from its parts' outcomes as soon as they
    retire (then() its HostFuture's): that look is sharedmem's, not its user's. A part that
    raised, in a composite submitted and dropped, is logged as never retrieved (it was
    silent); one whose composite's outcome was seen is not."""
    caplog.set_level(logging.INFO, logger="sharedmem")
    s = host.create_stream()
    composites = [lambda b, c: sm.op(_nobody_looks, 1, 1, b).and_then(sm.op(fill, 1, 1, c, 1.0)),
                  lambda b, c: sm.op(fill, 1, 1, c, 1.0).and_then(sm.op(_nobody_looks, 1, 1, b)),
                  lambda b, c: sm.zip(sm.op(_nobody_looks, 1, 1, b), sm.op(fill, 1, 1, c, 1.0)),
                  lambda b, c: sm.op(_nobody_looks, 1, 1, b).apply(len)]

    class _Then:  # launch(...).then(fn): its failure is the HostFuture's error
        def __init__(self, b, c):
            self.b = b

        def submit(self, s):
            return sm.launch(_nobody_looks, 1, 1, self.b, stream=s).then(len)
    composites.append(_Then)
    for make in composites:
        for look in (False, True):
            caplog.clear()
            b = sm.Buffer.zeros(4, "float32", device=host, stream=s)
            c = sm.Buffer.zeros(4, "float32", device=host, stream=s)
            f = make(b, c).submit(s)
            s.synchronize()
            time.sleep(0.05)  # (its value computed eagerly, in the retiring thread)
            if look:
                assert type(f.exception(5)) is sm.HostKernelError
            del f, b, c
            gc_collect_harder()
            msgs = _never_retrieved(caplog)
            assert len(msgs) == (0 if look else 1), (make, look, msgs)


def test_a_then_function_waiting_for_its_own_future_raises_instead_of_hanging(host):
    """then(fn) where fn waits for the HostFuture then() returned: that future is set only
    once fn returns, so the wait hung its thread (a callback worker, or the thread that
    retired the work) forever. It raises SharedMemError, which becomes that future's error,
    as apply() does for its values."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    box = {}
    gate = threading.Event()

    def fn(v):
        assert gate.wait(5)
        return box["h"].result(1)
    box["h"] = sm.launch(fill, 1, 1, b, 1.0).then(fn)
    gate.set()
    with pytest.raises(sm.SharedMemError, match=r"^a then\(\) function waits for the "
                                                r"HostFuture that then\(\) returned"):
        box["h"].result(5)


def test_a_then_function_waiting_for_a_then_of_its_own_future_raises_instead_of_hanging(host):
    """As above, through a then() of the HostFuture then() returned (or a then() of that): the
    future waited for follows the function's own, set only once it returns."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    box, seen = {}, []
    gate = threading.Event()

    def fn(v):
        assert gate.wait(5)
        for derived in (box["h"].then(lambda v: v), box["h"].then(lambda v: v).then(int)):
            t0 = time.monotonic()
            with pytest.raises(sm.SharedMemError, match=r"^a then\(\) function waits for the "
                                                        r"HostFuture that then\(\) returned "
                                                        r"\(through a then\(\) of it\)"):
                derived.result(3)
            seen.append(time.monotonic() - t0)
        return 7
    box["h"] = sm.launch(fill, 1, 1, b, 1.0).then(fn)
    gate.set()
    assert box["h"].result(10) == 7
    assert len(seen) == 2 and max(seen) < 1  # raised at once, not after the timeout
    # outside the function, a then() of a then() waits as before
    assert box["h"].then(lambda v: v + 1).then(lambda v: v * 2).result(5) == 16


def test_a_then_chain_after_a_failure_raises_the_failure_and_counts_it_retrieved(host, caplog):
    """launch(bad).then(f).then(g): the last future raised AttributeError ('HostFuture' has
    no '_retrieved') instead of the kernel's failure, and the failure was still logged as never
    retrieved. It raises HostKernelError, and looking counts."""
    caplog.set_level(logging.INFO, logger="sharedmem")
    b = sm.Buffer.zeros(4, "float32", device=host)
    f = sm.launch(_nobody_looks, 1, 1, b).then(len).then(str)
    assert type(f.exception(5)) is sm.HostKernelError
    with pytest.raises(sm.HostKernelError):
        f.result(5)
    del f, b
    sm.synchronize()
    gc_collect_harder()
    assert _never_retrieved(caplog) == []


def test_a_failure_an_apply_function_looks_at_counts_as_retrieved(host, caplog):
    """What a user's apply() function retrieves, it retrieves: the quiet look at an op's parts
    covered the user's function too, and a failure it saw was logged as never retrieved."""
    caplog.set_level(logging.INFO, logger="sharedmem")
    b, c = (sm.Buffer.zeros(4, "float32", device=host) for _ in range(2))
    other = sm.launch(_nobody_looks, 1, 1, b)
    seen = sm.op(fill, 1, 1, c, 1.0).apply(lambda v: type(other.exception(5))).submit()
    assert seen.result(5) is sm.HostKernelError
    del other, seen, b, c
    sm.synchronize()
    gc_collect_harder()
    assert _never_retrieved(caplog) == []


def test_an_apply_function_waiting_for_a_then_of_its_own_value_raises_instead_of_hanging(host):
    """apply(fn) where fn waits for a then() of the value it computes (or a then() of that):
    the HostFuture follows the value, set only once fn returns, so the wait hung fn's thread
    for ever (without a timeout; with one it ran out: TimeoutError). It raises SharedMemError
    at once, as a wait for the value itself does (api.md), and fn's future fails with it."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    for chain in (lambda f: f.then(lambda v: v), lambda f: f.then(lambda v: v).then(str)):
        box, took = {}, []
        gate = threading.Event()

        def fn(v):
            assert gate.wait(5)
            t0 = time.monotonic()
            try:
                return chain(box["f"]).result(3)
            finally:
                took.append(time.monotonic() - t0)
        box["f"] = sm.op(fill, 1, 1, b, 1.0).apply(fn).submit()
        gate.set()
        e = box["f"].exception(10)
        assert type(e) is sm.SharedMemError, e
        assert re.match(r"^a function computing the value of host kernel fill on <Stream .*> "
                        r"\(an apply\(\) or zip\(\) value\) waits for a then\(\) of that "
                        r"value, which is set only once the function returns: it would wait "
                        r"forever\. Wait for it outside apply\(\)'s functions \(chain then\(\) "
                        r"after the future instead\)$", str(e)), str(e)
        assert took[0] < 1  # raised at once, not after the timeout
    # outside the function, a then() of the value waits as before
    f = sm.op(fill, 1, 1, b, 1.0).apply(lambda v: 5).submit()
    assert f.then(lambda v: v + 1).then(lambda v: v * 2).result(5) == 12


@pytest.mark.parametrize("timeout", [-10**400, -10**309], ids=["-10**400", "-10**309"])
def test_a_huge_negative_timeout_waits_for_nothing(host, timeout):
    """result(timeout=) / exception(timeout=) / Event.synchronize(timeout=) of an int below
    what a float holds: OverflowError ('int too large to convert to float', from adding it to
    the clock), no documented error and nothing said about the timeout. A negative timeout
    waits for nothing, as 0 does: TimeoutError (False for an event) while the work runs."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    s = host.create_stream()
    f = sm.launch(slow_fill, 1, 1, b, 1.0, 0.5, stream=s)
    a = sm.op(fill, 1, 1, b, 2.0).apply(lambda v: 7).submit(s)
    ev = s.record()
    for wait in (f.result, f.exception, a.result):
        with pytest.raises(TimeoutError, match=r" within 0 s$"):
            wait(timeout)
    assert ev.synchronize(timeout) is False
    assert f.result(5) is None and a.result(5) == 7 and ev.synchronize(5) is True


def test_add_done_callback_of_something_not_callable_says_so(host):
    """add_done_callback(5) raised functools.partial's TypeError ('the first argument must be
    callable'), naming neither the call nor the value; as then() does, it names both, and
    nothing is added."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    f = sm.launch(slow_fill, 1, 1, b, 1.0, 0.2)
    h = f.then(lambda v: v)
    for fut in (f, h):
        with pytest.raises(TypeError, match=r"^add_done_callback takes a callable, got 5$"):
            fut.add_done_callback(5)
    assert h.result(5) is None and f.result(5) is None
    sm.synchronize()  # (no deferred error: nothing was added)


#: The start of a script whose exit starts no thread (Python 3.12's): ``refuse`` replaces
#: Thread.start in an atexit hook the script registers last; ``nap`` sleeps on the host
_NO_THREADS_AT_EXIT = ("import atexit, threading\n"
                       "def refuse(self):\n"
                       "    raise RuntimeError(\"can't create new thread at interpreter "
                       "shutdown\")\n")
_EXIT_PRELUDE = (_NO_THREADS_AT_EXIT +
                 "import sharedmem.runtime.callbacks as cbs\n"
                 "cbs.EXIT_TIMEOUT = 3.0\n"
                 "@sm.host_kernel\n"
                 "def nap(x, s):\n"
                 "    time.sleep(s)\n"
                 "host = sm.Device.host()\n")


def test_callbacks_handed_off_at_the_exit_run_where_every_worker_waits(tmp_path):
    """Where no thread can start at the exit (Python 3.12), a callback handed off while every
    worker waits inside a callback -- here for a then() of work that finishes in the exit --
    is run by the exit itself: the exit waited out its whole timeout for a worker that would
    never come, then dropped it, and the waiting callback never got its value."""
    body = (_EXIT_PRELUDE +
            "late = host.create_stream('late')\n"
            "c, d = sm.Buffer.zeros(4, device=host), sm.Buffer.zeros(4, device=host)\n"
            "t = sm.launch(nap, 1, 1, c, 1.0, stream=late).then(lambda r: 'late value')\n"
            "sm.launch(nap, 1, 1, d, 0.5, stream=late)\n"
            "f = sm.launch(nap, 1, 1, b, 0.0)\n"
            "f.add_done_callback(lambda _: print('waited:', t.result(20), flush=True))\n"
            "time.sleep(0.3)  # (the callback waits on a worker: the retirer handed it off)\n"
            "atexit.register(setattr, threading.Thread, 'start', refuse)\n")
    import time
    start = time.monotonic()
    out = _script_output(tmp_path, body, "0", "-")
    assert "waited: late value" in out and "dropped" not in out, out
    assert time.monotonic() - start < 20


def test_a_worker_waiting_in_a_callback_at_the_exit_waits_where_no_thread_can_start(tmp_path):
    """A callback on a worker that waits (on a then() of work finishing in the exit) while
    callbacks are queued asks for another worker to take them; where no thread can start
    (Python 3.12's exit) that RuntimeError came out of the wait, into the callback -- and the
    worker stayed counted as waiting. It waits; the exit runs the queue (what it waits for)."""
    body = (_EXIT_PRELUDE +
            "one, two = host.create_stream('one'), host.create_stream('two')\n"
            "c, d, e = (sm.Buffer.zeros(4, device=host) for _ in range(3))\n"
            "sm.launch(nap, 1, 1, b, 0.0).add_done_callback(lambda _: None)  # (a worker)\n"
            "def looks(_):\n"
            "    time.sleep(0.3)  # (meanwhile t's work is retired: its then() is queued)\n"
            "    print('waited:', t.result(20), flush=True)\n"
            "sm.launch(nap, 1, 1, c, 1.0, stream=one).add_done_callback(looks)\n"
            "t = sm.launch(nap, 1, 1, d, 1.1, stream=two).then(lambda r: 'late value')\n"
            "sm.launch(nap, 1, 1, e, 0.6, stream=two)\n"
            "time.sleep(0.3)\n"
            "atexit.register(setattr, threading.Thread, 'start', refuse)\n")
    out = _script_output(tmp_path, body, "0", "-")
    assert "waited: late value" in out and "never re-raised" not in out, out


def test_the_exit_waits_for_busy_callback_workers_once_and_says_what_it_dropped_once(tmp_path):
    """The exit waits EXIT_TIMEOUT for the callback workers, from the host backend's exit hook
    and again from its own atexit hook. With a worker busy past the bound and a callback
    queued behind it, the second call waited the whole bound again and said the same dropped
    callback a second time. The bound is the exit's, and what was dropped is said once."""
    import time
    body = ("import logging\n"
            "import sharedmem.runtime.callbacks as cbs\n"
            "logging.getLogger('sharedmem').setLevel(logging.WARNING)\n"
            "cbs.EXIT_TIMEOUT = 4.0\n"
            "@sm.host_kernel\n"
            "def nap(x, s):\n"
            "    time.sleep(s)\n"
            "host = sm.Device.host()\n"
            "c = sm.Buffer.zeros(4, device=host)\n"
            "sm.launch(nap, 1, 1, b, 0.1).add_done_callback(lambda _: time.sleep(60))\n"
            "sm.launch(nap, 1, 1, c, 0.3, stream=host.create_stream()).add_done_callback(\n"
            "    lambda _: print('ran', flush=True))\n"
            "time.sleep(0.6)  # (the first callback busy on a worker, the second queued)\n")
    start = time.monotonic()
    out = _script_output(tmp_path, body, "0")
    took = time.monotonic() - start
    assert out.count("exit: callbacks of 1 retired submissions dropped after 4.0 s") == 1, out
    assert "ran" not in out and took < 8.0, (took, out)
