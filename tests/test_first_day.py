"""What a new user runs into on the first day (issue 16): each test fails on the code before."""

import threading
import weakref

import numpy as np
import pytest

import sharedmem as sm
from conftest import gc_collect_harder


# -- host kernels that raise ----------------------------------------------------------------------
def test_a_raising_host_kernel_fails_its_own_future_and_nothing_else(host):
    s = host.default_stream  # (a notebook's usual stream: it must stay usable)

    @sm.host_kernel
    def bad(x):
        x[0] = 1
        raise ValueError("bad input row 3")

    before = sm.stats()
    b = sm.Buffer.zeros(4, "int32", device=host)
    alloc = weakref.ref(b.allocation)
    fut = sm.launch(bad, 1, 1, sm.Out(b), stream=s)
    with pytest.raises(sm.HostKernelError, match=r"^host kernel .*bad on <Stream default on "
                                                 r"<Device host> \(borrowed\)> raised ValueError\("
                                                 r"'bad input row 3'\); its leases were released "
                                                 r"and the stream runs on$") as ei:
        fut.result(5)
    assert isinstance(ei.value.__cause__, ValueError)
    # a continuation of it fails with the same error, without running
    ran = []
    with pytest.raises(sm.HostKernelError):
        fut.then(ran.append).result(5)
    assert ran == []
    # the stream and the memory stay usable; what the kernel wrote before it raised stays
    assert b.to_host().tolist() == [1, 0, 0, 0]
    assert sm.Buffer.zeros(2, "int8", device=host).to_host().tolist() == [0, 0]
    sm.launch(sm.host_kernel(lambda x: x.__setitem__(slice(None), 9)), 1, 1, sm.Out(b),
              stream=s).result(5)
    assert b.to_host().tolist() == [9, 9, 9, 9]
    st = sm.stats()
    assert st.leaked == before.leaked and st.leaked_bytes == before.leaked_bytes
    del b, fut, ei
    gc_collect_harder()
    assert alloc() is None  # freed: nothing kept as leaked


def test_an_async_or_generator_host_kernel_is_refused_not_silently_skipped(host):
    # Calling one only makes a coroutine or generator: launched, it "succeeded" with its body
    # never run (a generator without a word; a coroutine with a RuntimeWarning at best)
    async def coro(x):
        x[:] = 7

    def gen(x):
        x[:] = 7
        yield

    async def agen(x):
        x[:] = 7
        yield

    for fn in (coro, gen, agen):
        with pytest.raises(TypeError, match=r"^host_kernel needs a plain function, got .*: "
                                            r"calling it only makes a coroutine or generator"):
            sm.host_kernel(fn)
    b = sm.Buffer.zeros(2, "int32", device=host)
    sm.launch(sm.host_kernel(lambda x: x.__setitem__(slice(None), 7)), 1, 1, b).result(5)
    assert b.to_host().tolist() == [7, 7]


# -- futures ---------------------------------------------------------------------------------------
def test_an_asyncio_timeout_leaves_nothing_behind_for_later_calls(host):
    import asyncio
    gate = threading.Event()
    b = sm.Buffer.zeros(2, "int8", device=host)
    fut = sm.launch(sm.host_kernel(lambda x: gate.wait(10)), 1, 1, sm.In(b),
                    stream=host.create_stream())

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(fut, 0.05)

    asyncio.run(main())  # the loop is closed when the work completes
    gate.set()
    assert fut.result(5) is None
    sm.synchronize()
    sm.stats()  # used to raise RuntimeError: Event loop is closed
    sm.launch(sm.host_kernel(lambda x: None), 1, 1, sm.In(b)).result(5)


def test_futures_speak_concurrent_futures(host):
    import asyncio
    import concurrent.futures as cf
    gate = threading.Event()
    b = sm.Buffer.zeros(2, "int8", device=host)
    fut = sm.launch(sm.host_kernel(lambda x: gate.wait(10)), 1, 1, sm.In(b),
                    stream=host.create_stream())
    assert fut.cancel() is False and not fut.cancelled() and fut.running()
    cfut = fut.to_concurrent()
    done, pending = cf.wait([cfut], timeout=0.05)
    assert not done
    gate.set()
    done, _ = cf.wait([cfut], timeout=5)
    assert done == {cfut} and cfut.result() is None and not fut.running()
    doubled = sm.launch(sm.host_kernel(lambda x: None), 1, 1, sm.In(b)).then(lambda _: 42)

    async def main():
        return await asyncio.wrap_future(doubled.to_concurrent())

    assert asyncio.run(main()) == 42
    failing = sm.launch(sm.host_kernel(lambda x: 1 / 0), 1, 1, sm.In(b))
    with pytest.raises(sm.HostKernelError):
        failing.to_concurrent().result(5)


# -- NumPy arrays on the host backend -----------------------------------------------------------------
def test_numpy_arrays_are_leased_by_host_launches_like_cupy_arrays_on_cuda(host):
    a, b = host.create_stream(), host.create_stream()
    gate = threading.Event()
    x = np.zeros(8, np.float32)

    @sm.host_kernel
    def slow_fill(arr, v):
        gate.wait(10)
        arr[:] = v

    @sm.host_kernel
    def copy(src, dst):
        assert not src.flags.writeable  # In(...) gives a read-only view
        dst[:] = src

    out = np.full(8, -1.0, np.float32)
    sm.launch(slow_fill, 1, 1, sm.Out(x), 5.0, stream=a)
    f = sm.launch(copy, 1, 1, sm.In(x), sm.Out(out), stream=b)  # ordered after the write on a
    gate.set()
    f.result(5)
    assert out.tolist() == [5.0] * 8
    # a bare array is an InOut argument (tracked), a read-only one cannot be written
    sm.launch(sm.host_kernel(lambda arr: arr.__setitem__(0, 1.0)), 1, 1, x).result(5)
    assert x[0] == 1.0
    ro = np.arange(3.0)
    ro.flags.writeable = False
    with pytest.raises(sm.KernelError, match=r"^argument 0: InOut\(array\(\[0\., 1\., 2\.\]\)\) would write through a "
                                             r"read-only view"):
        sm.launch(copy, 1, 1, ro, sm.Out(ro))


# -- exit --------------------------------------------------------------------------------------------
def _run_script(code: str, tmp_path):
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env, cwd=tmp_path)


def test_host_work_in_flight_at_exit_is_finished_or_reported(tmp_path):
    out = tmp_path / "written.txt"
    r = _run_script(f"""
import time, sharedmem as sm
h = sm.Device.host()
b = sm.Buffer.zeros(4, "int32", device=h)
def slow(x):
    time.sleep(0.3)
    open({str(out)!r}, "w").write("done")
sm.launch(sm.host_kernel(slow), 1, 1, sm.In(b), stream=h.create_stream())
""", tmp_path)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "done"  # the interpreter waited for it
    r = _run_script("""
import threading, sharedmem as sm
import sharedmem.backends.host as hb
hb.EXIT_TIMEOUT = 0.2
h = sm.Device.host()
b = sm.Buffer.zeros(4, "int32", device=h)
s = h.create_stream("stuck")
started = threading.Event()
sm.launch(sm.host_kernel(lambda x: (started.set(), threading.Event().wait())), 1, 1, sm.In(b),
          stream=s)
sm.launch(sm.host_kernel(lambda x: None), 1, 1, sm.In(b), stream=s)
started.wait(10)
""", tmp_path)
    assert r.returncode == 0, r.stderr
    import re
    assert re.search(r"RuntimeWarning: sharedmem: the interpreter exits with host work "
                     r"unfinished after 0\.2 s; dropped: stuck \(\d+ queued, 1 running\)\. "
                     r"Synchronize", r.stderr), r.stderr


# -- copies and conversions ----------------------------------------------------------------------------
def test_copy_from_copies_values_of_one_dtype_in_order(host):
    f = sm.Buffer.from_host(np.ones(4, np.float32), device=host)
    i = sm.Buffer.zeros(4, "int32", device=host)
    with pytest.raises(sm.LayoutError, match=r"^copy_from copies values of one dtype: <Buffer "
                                             r"float32 x 4 .*> holds float32, <Buffer int32 x 4 "
                                             r".*> int32; convert on the host"):
        i.copy_from(f)
    assert i.to_host().tolist() == [0, 0, 0, 0]  # (was 1065353216 each)
    base = sm.Buffer.from_host(np.arange(6, dtype=np.float32), device=host)
    t = sm.Tensor.from_buffer(base, (3, 2), strides=(1, 3))  # a transposed view
    with pytest.raises(sm.LayoutError, match=r"^copy_from needs a C-contiguous tensor; <Tensor "):
        sm.Buffer.zeros(6, "float32", device=host).copy_from(t)
    ok = sm.Buffer.zeros(4, "float32", device=host)
    ok.copy_from(f).result(5)
    assert ok.to_host().tolist() == [1.0] * 4


def test_np_asarray_of_a_host_view_gives_its_values(host):
    t = sm.Tensor.from_host(np.arange(6, dtype=np.int16).reshape(2, 3), device=host)
    a = np.asarray(t)
    assert a.dtype == np.int16 and a.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert np.asarray(t, dtype=np.float64).dtype == np.float64
    b = sm.Buffer.from_host(np.arange(3.0), device=host)
    assert np.array(b).tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match=r"copy=False\): its values are read through a copy; "
                                         r"use np.from_dlpack"):
        np.asarray(b, copy=False)


def test_a_launch_without_stream_inside_a_capture_is_captured(host):
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int32", device=host)
    k = sm.host_kernel(lambda x: x.__iadd__(1))
    with sm.capture(s) as g:
        sm.launch(k, 1, 1, sm.Out(b))  # no stream=: the capturing stream is the current one
    assert g.launches == 1
    assert b.to_host().tolist() == [0, 0, 0, 0]  # recorded, not run
    g.replay(s).result(5)
    g.replay(s).result(5)
    assert b.to_host().tolist() == [2, 2, 2, 2]
    g.release()


# -- seeing what runs ---------------------------------------------------------------------------------
def test_inflight_lists_pending_work_per_stream_with_its_leases(host):
    import time
    s = host.create_stream("worker-a")
    gate = threading.Event()
    b = sm.Buffer.zeros(4, "int32", device=host)
    c = sm.Buffer.zeros(8, "int32", device=host)

    @sm.host_kernel
    def waits(x, y):
        gate.wait(10)

    fut = sm.launch(waits, 1, 1, sm.In(b), sm.Out(c), stream=s)
    time.sleep(0.02)
    mine = [e for e in sm.inflight() if e.stream is s]
    assert len(mine) == 1
    e = mine[0]
    assert e.label.startswith("host kernel ") and e.label.endswith("waits")
    assert e.state == "pending" and 0.02 <= e.age < 5
    assert e.leases == ((b.allocation.id, 0, 16, False), (c.allocation.id, 0, 32, True))
    assert str(e).startswith("<Stream worker-a on <Device host> (owned)>: host kernel ")
    assert f"leases #{b.allocation.id}[0:16], #{c.allocation.id}[0:32] w" in str(e)
    # reprs say what they are
    then = fut.then(lambda _: "value")
    assert repr(then) == "<HostFuture pending>"
    ev = s.record()
    assert repr(ev) == "<Event on <Stream worker-a on <Device host> (owned)>: pending>"
    gate.set()
    assert then.result(5) == "value" and repr(then) == "<HostFuture done: 'value'>"
    ev.synchronize(5)
    assert repr(ev).endswith(": reached>")
    sm.synchronize()
    assert [e for e in sm.inflight() if e.stream is s] == []


def test_the_sharedmem_logger_tells_rare_events(host, caplog):
    import logging
    caplog.set_level(logging.DEBUG, logger="sharedmem")
    b = sm.Buffer.zeros(2, "int8", device=host)
    with pytest.raises(sm.HostKernelError):
        sm.launch(sm.host_kernel(lambda x: {}["k"]), 1, 1, sm.In(b)).result(5)
    s = host.create_stream()
    with sm.capture(s):
        pass
    msgs = [r.getMessage() for r in caplog.records if r.name == "sharedmem"]
    assert "a host kernel raised KeyError('k'); its future fails, the stream runs on" in msgs
    assert any(m.startswith("capture of graph #") and m.endswith(" begins") for m in msgs)


def test_trace_writes_a_perfetto_timeline_one_track_per_stream(host, tmp_path):
    import json
    a, b = host.create_stream("stage-a"), host.create_stream("stage-b")
    x = sm.Buffer.zeros(16, "float32", device=host)
    fill = sm.host_kernel(lambda v: v.__setitem__(slice(None), 2.0))
    read = sm.host_kernel(lambda v: None)
    path = tmp_path / "run.json"
    with sm.trace(path) as tr:
        sm.launch(fill, 1, 1, sm.Out(x), stream=a)
        sm.launch(read, 1, 1, sm.In(x), stream=b).result(5)  # waits for a's write
        sm.synchronize()
        with pytest.raises(sm.SharedMemError, match="already recording"):
            with sm.trace(tmp_path / "other.json"):
                pass
    data = json.loads(path.read_text())
    evs = data["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in evs if e["ph"] == "M"}
    assert "<Stream stage-a on <Device host> (owned)>" in names
    tid_a, tid_b = (names[f"<Stream stage-{c} on <Device host> (owned)>"] for c in "ab")
    slices = [e for e in evs if e["ph"] == "X"]
    fa = [e for e in slices if e["tid"] == tid_a and e["name"].endswith("<lambda>")]
    fb = [e for e in slices if e["tid"] == tid_b and e["name"].endswith("<lambda>")]
    assert len(fa) == 1 and len(fb) == 1
    assert fa[0]["args"]["leases"] == [f"allocation #{x.allocation.id} bytes [0, 64) write"]
    assert fb[0]["args"]["leases"] == [f"allocation #{x.allocation.id} bytes [0, 64) read"]
    assert fa[0]["args"]["state"] == "retired" and fa[0]["dur"] >= 0
    waits = [e for e in evs if e["ph"] == "i" and e["tid"] == tid_b]
    # (x's zero fill may still be in flight on the default stream: a wait for it too)
    assert [w for w in waits if w["name"].startswith("waits for <Stream stage-a")]
    assert tr.events == evs
    from sharedmem.runtime.state import RUNTIME
    assert RUNTIME.tracer is None


def test_a_trace_keeps_no_stream_alive(host, tmp_path):
    """A trace names each stream's track, and keeps no Stream: one dropped while the trace
    records is freed (on the host, its worker thread ends; on CUDA, its CUstream)."""
    import gc
    import json
    import weakref
    x = sm.Buffer.zeros(16, "float32", device=host)
    fill = sm.host_kernel(lambda v: v.__setitem__(slice(None), 1.0))
    with sm.trace(tmp_path / "t.json"):
        refs = []
        for i in range(4):
            s = host.create_stream(f"request-{i}")
            sm.launch(fill, 1, 1, sm.Out(x), stream=s).result(5)
            refs.append(weakref.ref(s))
            del s
        sm.synchronize()
        gc.collect()
        assert [r() for r in refs[:3]] == [None] * 3  # (the newest: a stream memo may keep it)
    names = [e["args"]["name"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]
             if e["ph"] == "M"]
    assert [f"<Stream request-{i} on <Device host> (owned)>" in names for i in range(4)] == [True] * 4


def test_trace_records_a_consumers_lease_and_the_logger_is_silent_by_default(host, tmp_path):
    import json
    import logging
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("sharedmem").handlers)
    t = sm.Tensor.from_host(np.arange(4.0), device=host)
    s = host.create_stream("consumer")
    path = tmp_path / "t.json"
    with sm.trace(path):
        sm.record_use(t, s, writes=False)
        sm.synchronize()
    names = [e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert any(n.startswith("use declared on <Stream consumer") for n in names), names


class _FakeNvtx:
    """Records what sm.trace asks of the nvtx package (start_range -> a handle, end_range)."""

    def __init__(self):
        self.calls = []

    def start_range(self, message=None, color=None, domain=None, category=None, payload=None):
        self.calls.append(("start", message, domain))
        return len(self.calls)

    def end_range(self, range_id):
        self.calls.append(("end", range_id))


def test_trace_emits_one_nvtx_range_per_submission_from_submit_to_retirement(host, monkeypatch,
                                                                             tmp_path):
    import sys
    fake = _FakeNvtx()
    monkeypatch.setitem(sys.modules, "nvtx", fake)
    s = host.create_stream("nv")
    x = sm.Buffer.zeros(8, "float32", device=host, stream=s)
    gate = threading.Event()
    def slow(v):
        gate.wait(5)
    slow = sm.host_kernel(slow)
    sm.synchronize()
    label = slow.__qualname__
    with sm.trace(nvtx=True) as tr:  # NVTX only: no file
        fut = sm.launch(slow, 1, 1, sm.In(x), stream=s)
        assert fake.calls == [("start", f"host kernel {label} on {s}", "sharedmem")]
        gate.set()
        fut.result(5)
        sm.synchronize()
        assert fake.calls == [("start", f"host kernel {label} on {s}", "sharedmem"), ("end", 1)]
        gate.clear()
        sm.launch(slow, 1, 1, sm.In(x), stream=s)  # still running when the block ends
    assert fake.calls[2:] == [("start", f"host kernel {label} on {s}", "sharedmem"), ("end", 3)]
    gate.set()
    sm.synchronize()
    assert len(fake.calls) == 4  # its retirement after the trace ended emits nothing more
    assert tr.path is None and not (tmp_path / "None").exists()
    # nvtx=None (the default): ranges where nvtx is installed, beside the JSON file
    with sm.trace(tmp_path / "both.json"):
        sm.launch(slow, 1, 1, sm.In(x), stream=s).result(5)
        sm.synchronize()
    assert [c[0] for c in fake.calls[4:]] == ["start", "end"]
    assert (tmp_path / "both.json").exists()
    with sm.trace(tmp_path / "json-only.json", nvtx=False):
        sm.launch(slow, 1, 1, sm.In(x), stream=s).result(5)
        sm.synchronize()
    assert len(fake.calls) == 6


def test_trace_without_nvtx_installed(host, monkeypatch, tmp_path):
    import sys
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx raises ImportError
    with pytest.raises(sm.BackendUnavailableError,
                       match=r"^sm\.trace\(nvtx=True\) needs the nvtx package: pip install nvtx"):
        sm.trace(nvtx=True)
    with pytest.raises(TypeError, match=r"^sm\.trace needs a path for its JSON timeline, or "
                                        r"nvtx=True \(NVTX ranges only\)$"):
        sm.trace()
    with sm.trace(tmp_path / "t.json"):  # nvtx=None without the package: the JSON file only
        sm.Buffer.zeros(4, device=host)
        sm.synchronize()
    assert (tmp_path / "t.json").exists()


def test_an_nvtx_range_that_fails_to_end_loses_no_slice_of_the_json_timeline(host, monkeypatch,
                                                                             tmp_path):
    """The JSON file is complete and its slices right whatever NVTX does: an ``end_range``
    that raised for one submission of a retired batch dropped that submission's slice and left
    the rest of the batch as "in flight at the end of the trace"; one that raised as the block
    ended (a range still open) wrote no file at all. The NVTX error still comes at the next API
    call (or from the block's end)."""
    import json
    import sys
    from host_kernels import inc

    class Failing(_FakeNvtx):
        fail = set()

        def end_range(self, range_id):
            super().end_range(range_id)
            if range_id in self.fail:
                raise RuntimeError(f"nvtx end_range({range_id}) failed")

    fake = Failing()
    fake.fail = {1}  # the first submission's range
    monkeypatch.setitem(sys.modules, "nvtx", fake)
    s = host.create_stream("nv")
    x = sm.Buffer.zeros(8, "int64", device=host, stream=s)
    gate = threading.Event()
    gated = sm.host_kernel(lambda v: gate.wait(5))
    sm.synchronize()
    path = tmp_path / "t.json"
    with sm.trace(path) as tr:
        sm.launch(gated, 1, 1, sm.In(x), stream=s)
        for _ in range(2):
            sm.launch(inc, 1, 1, x, stream=s)
        gate.set()
        with pytest.raises(RuntimeError, match=r"^nvtx end_range\(1\) failed$"):
            sm.synchronize()  # (one sweep retires the three)
    slices = [e for e in tr.events if e["ph"] == "X"]
    assert [e["args"]["state"] for e in slices] == ["retired"] * 3
    assert len({e["args"]["seq"] for e in slices}) == 3
    assert json.loads(path.read_text())["traceEvents"] == tr.events
    assert [c for c in fake.calls if c[0] == "end"] == [("end", 1), ("end", 2), ("end", 3)]
    # a range still open as the block ends that fails to end: the file is written all the same
    gate.clear()
    fake.fail = {len(fake.calls) + 1}  # (the next range: start_range returns len(calls))
    with pytest.raises(RuntimeError, match=r"^nvtx end_range\(\d+\) failed$"):
        with sm.trace(path) as tr:
            sm.launch(gated, 1, 1, sm.In(x), stream=s)
    gate.set()
    sm.synchronize()
    (ev,) = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert ev["args"]["state"] == "in flight at the end of the trace"
    assert tr.events[-1] == ev
