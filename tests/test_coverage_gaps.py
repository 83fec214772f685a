"""Paths a coverage run of the suite (interpreted, fake driver) found unexercised: error paths
that promise a typed error and an unchanged state, cleanup on failure, and the fallbacks a
machine without one piece or another takes. Each test says what it pins down."""

import asyncio
import collections
import contextlib
import ctypes
import decimal
import gc
import os
import pickle
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import sharedmem as sm
import sharedmem.ipc as ipc

from conftest import gc_collect_harder
from test_graph_fake import fake  # noqa: F401  (the fixture: one device, the driver module)

# (the sources imported here: a checkout's, or an installed wheel's)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sm.__file__)))


# -- the interpreted core without Cython installed ------------------------------------------------
def test_the_interpreted_sources_import_and_run_without_cython_installed():
    """Without Cython (an install whose compile failed, or SHAREDMEM_PURE_PYTHON=1 on a machine
    without it), every module runs on the stand-in sharedmem/_cython.py. interop.streams
    declares a module constant of ``cython.size_t``, which the stand-in did not define: every
    interop module but dask (cai, cupy, cupy_launch, cutile, dlpack, streams) failed to import
    with AttributeError, and so did sm.from_dlpack and every view's __dlpack__."""
    code = (
        "import sys; sys.modules['cython'] = None  # (import cython: ImportError, as uninstalled)\n"
        "import importlib, pkgutil, numpy as np, sharedmem as sm, interop\n"
        "for pkg in (sm, interop):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        try:\n"
        "            importlib.import_module(m.name)\n"
        "        except ModuleNotFoundError as e:  # (interop.dask without dask: not ours)\n"
        "            if e.name.split('.')[0] in ('sharedmem', 'interop'):\n"
        "                raise\n"
        "assert sm._cython is sys.modules['sharedmem.runtime.state'].cython\n"
        "b = sm.Buffer.from_host(np.arange(4, dtype='f4'), device=sm.Device.host())\n"
        "assert np.from_dlpack(b).tolist() == [0, 1, 2, 3]\n"
        "assert sm.from_dlpack(np.arange(3)).to_host().tolist() == [0, 1, 2]\n"
        "print('ok')\n")
    env = dict(os.environ, SHAREDMEM_PURE_PYTHON="1",
               PYTHONPATH=os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("SHAREDMEM_REQUIRE_EXTENSION", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


# -- DeviceBox: a finite value beyond its dtype's range --------------------------------------------
def test_a_devicebox_refuses_a_finite_longdouble_or_decimal_beyond_its_float_range(host):
    """errors.md: a value the box's dtype cannot hold is an OverflowError (1e300 as float32). A
    finite value wider than a Python float -- a NumPy longdouble of 1e400, a Decimal of 1e400
    -- was judged by cmath.isfinite, which converts it to a float first (inf) and so called it
    not finite: the box stored inf, silently. NaN and the infinities of those types stay what
    they are; a failed set() leaves the box's value."""
    values = [decimal.Decimal("1e400"), decimal.Decimal("-1e400")]
    if np.finfo(np.longdouble).max > np.finfo(np.float64).max:  # (x86-64, aarch64 Linux)
        values += [np.longdouble("1e400"), np.array(np.longdouble("-1e400")),
                   np.clongdouble(complex(0, 1)) * np.longdouble("1e400")]
    for value in values:
        dtype = "complex128" if np.iscomplexobj(value) else "float64"
        with pytest.raises(OverflowError, match=rf"^a DeviceBox of {dtype} cannot hold .*: it is "
                                                rf"beyond the range of {dtype}$"):
            sm.DeviceBox(value, dtype, device=host)
    box = sm.DeviceBox(1.5, "float64", device=host)
    with pytest.raises(OverflowError):
        box.set(decimal.Decimal("1e400"))
    assert box.get() == 1.5
    for value in (decimal.Decimal("Infinity"), decimal.Decimal("-Infinity"),
                  np.longdouble("inf"), decimal.Decimal("1e300")):
        box.set(value).result(5)
        assert box.get() == float(value)
    box.set(decimal.Decimal("NaN")).result(5)
    assert np.isnan(box.get())
    box.set(np.longdouble("nan")).result(5)
    assert np.isnan(box.get())


def test_a_complex_devicebox_refuses_a_part_beyond_its_range_beside_a_nan_or_inf(host):
    """A complex value is judged part by part: one whose real part is finite but beyond the
    dtype's range was stored as an infinity, silently, when its other part was NaN or infinite
    (the value as a whole not finite: let through). Each part that is finite must stay finite;
    a NaN or infinite part stays what it is."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no NumPy "overflow encountered in cast" either)
        for value in (complex(1e300, float("nan")), complex(float("inf"), -1e39),
                      np.complex128(complex(float("nan"), 1e300))):
            with pytest.raises(OverflowError, match=r"^a DeviceBox of complex64 cannot hold .*: "
                                                    r"it is beyond the range of complex64$"):
                sm.DeviceBox(value, "complex64", device=host)
        box = sm.DeviceBox(complex(1, 2), "complex64", device=host)
        box.set(complex(3.0, float("nan"))).result(5)
        got = box.get()
        assert got.real == 3.0 and np.isnan(got.imag)
        box.set(complex(float("-inf"), 1e38)).result(5)
        assert box.get() == complex(float("-inf"), np.float32(1e38))


def test_a_dtype_numpy_does_not_understand_is_a_typeerror_naming_it(host):
    """as_dtype: np.dtype's own TypeError, re-raised naming what was given, with NumPy's as its
    cause; nothing is allocated."""
    before = sm.stats().live_allocations
    for make in (lambda: sm.Buffer.zeros(4, "not a dtype", device=host),
                 lambda: sm.Tensor.empty((2, 2), "f5", device=host),
                 lambda: sm.DeviceBox(1, "no such type", device=host)):
        with pytest.raises(TypeError, match=r"^'[\w ]+' is not a dtype NumPy understands$") as ei:
            make()
        assert isinstance(ei.value.__cause__, TypeError)
    assert sm.stats().live_allocations == before


# -- DLPack -------------------------------------------------------------------------------------
def _capsule_name(capsule) -> bytes:
    get = ctypes.pythonapi.PyCapsule_GetName
    get.restype, get.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get(capsule)


def test_dlpack_max_version_of_numpy_ints_or_a_list_is_read_as_the_pair_it_is(host):
    """export(max_version=...): the fast path reads a tuple of two Python ints; any other pair
    (NumPy ints, a list) goes through _version_major, which no test reached: a versioned
    capsule for major >= 1, a legacy one for 0; anything else is a TypeError that names it and
    exports nothing."""
    b = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=host)
    for mv, name in (((np.int64(1), np.int32(0)), b"dltensor_versioned"),
                     ([1, 2], b"dltensor_versioned"), ((np.int8(0), 9), b"dltensor"),
                     (np.array([1, 0]), b"dltensor_versioned")):
        cap = b.__dlpack__(max_version=mv)
        assert _capsule_name(cap) == name, mv
        assert b.allocation.live_views == 2  # the export's hold
        del cap
        gc_collect_harder()
        assert b.allocation.live_views == 1  # dropped unconsumed: the export ended
    for mv in ((1,), (1, 0, 0), "10", (1.0, 0), {1: 0}, 3):
        with pytest.raises(TypeError, match=r"^max_version must be None or a \(major, minor\) "
                                            r"tuple of ints, got "):
            b.__dlpack__(max_version=mv)
    assert b.allocation.live_views == 1 and b.is_live


def test_an_export_whose_capsule_cannot_be_made_ends_its_hold_and_files_nothing(host,
                                                                              monkeypatch):
    """_make_capsule: the managed tensor filed in the export table, then the capsule refused
    (a MemoryError): the export is taken out of the table again and its hold ends -- nothing
    is left exporting the view, which exports again afterwards. (Interpreted: the compiled
    build makes the capsule through the C API.)"""
    import interop.dlpack as dl
    if not dl.__file__.endswith(".py"):
        pytest.skip("the interpreted build's capsule call (compiled: the C API)")
    b = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=host)
    exports = dict(dl._exports)

    def refused(*args):
        raise MemoryError("no capsule")
    monkeypatch.setattr(dl, "_capsule_new", refused)
    for mv in (None, (1, 0)):
        with pytest.raises(MemoryError, match=r"^no capsule$"):
            b.__dlpack__(max_version=mv)
        assert dl._exports == exports and b.allocation.live_views == 1
    monkeypatch.undo()
    assert np.from_dlpack(b).tolist() == [0, 1, 2, 3]


# -- fake CUDA devices ------------------------------------------------------------------------


def test_from_dlpack_onto_another_device_than_the_producers_is_refused_importing_nothing(fake):
    """``device=`` must be the producer's device (no copies on import): a host array asked for
    on a CUDA device is a BufferError naming both, and nothing is imported."""
    dev, drv = fake
    a = np.arange(6, dtype=np.float32)
    before = sm.stats().live_allocations
    with pytest.raises(BufferError, match=r"^the producer's memory is on <Device host>, not on "
                                          r"<Device cuda:0 Fake GPU>; sharedmem does not copy "
                                          r"on import$"):
        sm.from_dlpack(a, device=dev)
    assert sm.stats().live_allocations == before
    t = sm.from_dlpack(a, device="host")  # the producer's own device: imported
    assert t.to_host().tolist() == list(range(6))


def test_a_cai_import_whose_producer_stream_the_driver_refuses_keeps_its_pooled_event(
        fake, monkeypatch):
    """A CAI producer's stream is waited for through a pooled event recorded there
    (order_after_handle). When the driver refuses the record (a destroyed stream, one of
    another context), the import is a CudaError and imports nothing, and the event goes back
    to the pool -- neither leaked nor destroyed while the pool may still hand it out."""
    import sharedmem.device as sm_device
    from fake_cuda import CUresult
    dev, drv = fake
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)  # (an import probes Device(0))
    b = sm.Buffer.from_host(np.arange(4, dtype="f4"), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    sm.synchronize()

    class Producer:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (b.ptr, False),
                                    "version": 3, "stream": 0xBAD}
    record = drv.cuEventRecord

    def refusing(ev, stream):
        if int(stream) == 0xBAD:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        return record(ev, stream)
    monkeypatch.setattr(drv, "cuEventRecord", refusing)
    pool = dev.backend._events
    pooled, destroyed = list(pool), drv.destroyed_events
    live, views = sm.stats().live_allocations, b.allocation.live_views
    with pytest.raises(sm.CudaError, match=r"^cuEventRecord failed: CUDA_ERROR_INVALID_HANDLE"):
        sm.from_cuda_array_interface(Producer())
    assert drv.destroyed_events == destroyed
    assert len(pool) == max(len(pooled), 1) and set(pooled) <= set(pool)  # (back, or made anew)
    assert sm.stats().live_allocations == live and b.allocation.live_views == views
    # the pool's event records again where the driver accepts it
    Producer.__cuda_array_interface__ = dict(Producer.__cuda_array_interface__, stream=0x5150)
    n = len(drv.calls)
    t = sm.from_cuda_array_interface(Producer())
    assert t.to_host().tolist() == [0, 1, 2, 3]
    assert [c[1] for c in drv.calls[n:] if c[0] == "record" and c[2] == 0x5150] == [pool[-1]]


def test_a_result_with_a_timeout_on_a_cuda_stream_polls_and_changes_nothing(fake):
    """DeviceFuture.result(timeout) of CUDA work still running polls its event: a TimeoutError
    naming the work once the time is up -- the work stays in flight, its leases held -- and
    the value once the device finishes it."""
    dev, drv = fake
    s = dev.create_stream("s")
    b = sm.Buffer.zeros(64, "float32", device=dev, stream=s)
    sm.synchronize()
    drv.holding = True  # from here on, recorded events stay pending
    fut = b.fill_zero(stream=s)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r" on <Stream s on <Device cuda:0 Fake GPU>.* did not "
                                           r"finish within 0\.05 s$"):
        fut.result(0.05)
    assert time.monotonic() - t0 >= 0.05
    assert not fut.done() and sm.stats().in_flight >= 1
    assert b.allocation.tracker  # still leased on s
    drv.holding = False
    drv.finish_held()
    assert fut.result(5) is None and fut.done()


def test_a_cuda_bindings_stream_object_is_borrowed_by_its_int_handle(fake):
    """handle_reader: an object with getPtr (cuda.bindings' CUstream) names its handle by
    int(); Stream.from_external borrows it, and the handle finds that Stream again."""
    dev, drv = fake

    class CUstream:  # as cuda.bindings': int() is the handle, getPtr() the address of it
        def __init__(self, h):
            self.h = h

        def getPtr(self):
            return id(self)

        def __int__(self):
            return self.h
    obj = CUstream(0x5150)
    st = sm.Stream.from_external(obj, dev)
    assert st.handle == 0x5150 and not st.owned and sm.Stream.lookup(dev, 0x5150) is st
    b = sm.Buffer.from_host(np.arange(3, dtype="f4"), device=dev, stream=obj)
    assert b.to_host(stream=obj).tolist() == [0, 1, 2]


# -- CUDA IPC -----------------------------------------------------------------------------------
@pytest.fixture
def ipcfake(monkeypatch, fake):
    dev, drv = fake
    monkeypatch.setattr(ipc, "_by_uuid", {dev.uuid: dev})
    monkeypatch.setattr(ipc, "_recent", collections.OrderedDict())
    monkeypatch.setattr(ipc, "_events", collections.OrderedDict())
    monkeypatch.setattr(ipc, "_opened", {})  # (each test's "exporter" is another process)
    yield dev, drv


def _exported(dev, drv, n=256):
    b = sm.Buffer.from_host(np.arange(n, dtype=np.float32), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes  # (the driver knows it as an allocation)
    return b, ipc.export(b)


def _received(handle, **fields):
    """The handle as another process of this one's parent would get it, ``fields`` changed."""
    h = pickle.loads(pickle.dumps(handle))
    h.exporter_pid = os.getppid()
    for k, v in fields.items():
        setattr(h, k, v)
    return h


def _opens_after(ex, drv, maps):
    """The refused open mapped nothing and left the export as it was: it opens with its real
    handle, and ends once that import is dropped."""
    assert len(drv.ipc_maps) == maps and ex.state == "exported"
    time.sleep(ipc.POLL * 3)
    assert ex.state == "exported"
    v = ipc.open(_received(ex.handle))
    assert len(v) == 256 and v.to_host().size == 256  # (fake: a mapping of fresh memory)
    del v
    gc_collect_harder()
    sm.synchronize()
    assert ex.wait_released(5) and ex.state == "released"


@pytest.mark.parametrize("fields, why", [
    ({"dtype": "O"}, r"dtype object"),
    ({"dtype": "V0"}, r"dtype \|V0"),
    ({"kind": "tensor", "shape": (16, 16), "strides": (16,)},
     r"shape \(16, 16\) with strides \(16,\)"),
    ({"kind": "tensor", "shape": (-1, 4), "strides": (4, 1)}, r"shape \(-1, 4\) with strides"),
    ({"shape": (16, 16), "strides": (16, 1)}, r"a buffer of shape \(16, 16\) from byte 0"),
    ({"first": 4}, r"a buffer of shape \(256,\) from byte 4"),
    ({"mem": b"\0" * 63}, r"IPC handles not of 64 bytes"),
    ({"event": b"\0" * 65}, r"IPC handles not of 64 bytes"),
])
def test_more_corrupt_handles_are_refused_before_anything_is_opened(ipcfake, fields, why):
    """_checked_dtype's checks that test_ipc_fake's corrupt handles do not reach: an object or
    empty dtype, a shape and strides that disagree or a negative extent, a buffer that is not
    1-D from its first byte, IPC handles of another size. Each is a SharedMemError naming the
    field, raised before the slot is touched or anything mapped."""
    dev, drv = ipcfake
    b, ex = _exported(dev, drv)
    maps = len(drv.ipc_maps)
    with pytest.raises(sm.SharedMemError, match=rf"^cannot open <IpcHandle .*>: it is corrupt, or "
                                                rf"was made by another version of sharedmem "
                                                rf"\({why}.*\); nothing was opened$"):
        ipc.open(_received(ex.handle, **fields))
    _opens_after(ex, drv, maps)


def _open_files() -> set:
    """The paths this process has open (its descriptors' targets)."""
    out = set()
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        with contextlib.suppress(OSError):
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def test_a_handle_whose_slot_file_is_gone_or_not_a_slot_file_opens_nothing(ipcfake, tmp_path):
    """The exporter's slot file gone (the exporter exited): a SharedMemError saying so. A file
    of another size where it should be: a SharedMemError naming the sizes -- the file is never
    mapped nor written, and its descriptor is closed."""
    dev, drv = ipcfake
    b, ex = _exported(dev, drv)
    maps = len(drv.ipc_maps)
    gone = tmp_path / f"sharedmem-ipc-{os.getppid()}-gone"
    with pytest.raises(sm.SharedMemError, match=rf"^cannot open a CUDA IPC handle: its exporter's "
                                                rf"slot file {gone} is gone \(the exporter "
                                                rf"exited\?\)$"):
        ipc.open(_received(ex.handle, slots=str(gone)))
    other = tmp_path / f"sharedmem-ipc-{os.getppid()}-other"
    other.write_bytes(bytes(range(100)))
    size = ipc.SLOTS * ipc._SLOT.size
    with pytest.raises(sm.SharedMemError, match=rf"^cannot open a CUDA IPC handle: {other} is not "
                                                rf"a sharedmem slot file \(100 bytes, not "
                                                rf"{size}\)$"):
        ipc.open(_received(ex.handle, slots=str(other)))
    assert other.read_bytes() == bytes(range(100)) and str(other) not in _open_files()
    assert not ipc._opened  # neither file is kept open
    _opens_after(ex, drv, maps)


def test_a_handle_of_a_device_this_process_sees_by_another_uuid_only_is_refused(ipcfake,
                                                                                monkeypatch):
    """The importer finds the exporter's device by its UUID among the devices it sees (the
    first open looks at each, then remembers them): the fake GPU is found so; a UUID none of
    them has (CUDA_VISIBLE_DEVICES hid it) is a SharedMemError, the export left as it was."""
    dev, drv = ipcfake
    monkeypatch.setattr(ipc, "_by_uuid", {})
    b, ex = _exported(dev, drv)
    maps = len(drv.ipc_maps)
    with pytest.raises(sm.SharedMemError, match=r"^cannot open <IpcHandle .*>: its device "
                                                r"\(GPU-nope\) is not visible in this process "
                                                r"\(CUDA_VISIBLE_DEVICES\?\)$"):
        ipc.open(_received(ex.handle, device_uuid="GPU-nope"))
    assert ipc._by_uuid == {dev.uuid: dev}  # (looked at, and remembered)
    monkeypatch.setattr(ipc, "_by_uuid", {})
    _opens_after(ex, drv, maps)  # (found by its UUID again)


def test_an_importer_that_died_holding_an_export_has_it_released_after_the_grace(ipcfake,
                                                                                 monkeypatch):
    """ipc docstring: a dead importer does not pin memory forever. Once the importer's pid is
    gone for GRACE seconds the exporter ends the export ("importer died"), its hold on the
    bytes with it. The slot is reused by the next export; the dead import's end -- here its
    views, dropped late -- must not release that other export."""
    dev, drv = ipcfake
    monkeypatch.setattr(ipc, "GRACE", 0.05)
    b, ex = _exported(dev, drv)
    v = ipc.open(_received(ex.handle))
    t0 = time.monotonic()
    while ex.state != "open" and time.monotonic() - t0 < 5:
        time.sleep(ipc.POLL)
    assert ex.state == "open" and b.allocation.live_views == 2
    me = os.getpid()
    alive = ipc._alive
    monkeypatch.setattr(ipc, "_alive", lambda pid, start: pid != me and alive(pid, start))
    assert ex.wait_released(5) and ex.state == "importer died"
    assert ipc.exports() == 0 and b.allocation.live_views == 1  # the exporter's hold ended
    monkeypatch.setattr(ipc, "_alive", alive)
    b2, ex2 = _exported(dev, drv)
    assert (ex2.handle.slots, ex2.handle.slot) == (ex.handle.slots, ex.handle.slot)
    del v  # the dead import's end: its generation is not the slot's any more
    gc_collect_harder()
    sm.synchronize()
    time.sleep(ipc.POLL * 5)
    assert ex2.state == "exported" and ipc.exports() == 1
    assert ex2.revoke() and ipc.exports() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_whether_a_process_lives_is_asked_of_the_kernel_where_proc_says_nothing(monkeypatch):
    """_alive without /proc (_start_time 0: unknown): os.kill(pid, 0) -- a pid that exists
    lives, one that does not is gone, one this process may not signal (another user's) lives."""
    monkeypatch.setattr(ipc, "_start_time", lambda pid: 0)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert ipc._alive(os.getpid(), 12345) and not ipc._alive(pid, 0)

    def refused(pid, sig):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "kill", refused)
    assert ipc._alive(1, 0)


# -- host backend -------------------------------------------------------------------------------
def test_a_strided_copy_of_many_pieces_on_the_host_waits_first_and_copies_in_order(host):
    """Tensor.copy of a layout of more pieces than half a queue (a transposed matrix of 300
    rows) first waits, holding no lock, for the work it follows (wait_before) -- on a host
    stream for the last work given to the stream itself, and for the pending write of another
    stream. The copy holds the values that write left."""
    a_ = np.arange(8 * 300, dtype=np.int32)
    b = sm.Buffer.from_host(a_, device=host)
    tt = sm.Tensor.from_buffer(b, (300, 8), strides=(1, 300))  # a transposed (8, 300)
    assert not tt.is_contiguous()
    a, s = host.create_stream("a"), host.create_stream("b")
    gate = threading.Event()

    @sm.host_kernel
    def late_write(x):
        gate.wait(10)
        x[:] *= -1

    sm.launch(late_write, 1, 1, sm.InOut(tt), stream=a)
    sm.launch(sm.host_kernel(lambda x: None), 1, 1, sm.In(tt), stream=s)  # s's own work
    threading.Timer(0.1, gate.set).start()
    out = tt.copy(stream=s)
    assert out.is_contiguous() and out.shape == (300, 8)
    np.testing.assert_array_equal(out.to_host(stream=s), -a_.reshape(8, 300).T)


def test_an_await_whose_loop_closed_before_the_work_finished_leaves_no_error_behind(host):
    """An ``await fut`` suspended in a loop that was closed (not cancelled, not run again):
    when the work finishes, the wake-up finds the loop closed -- that RuntimeError is dropped
    (nobody awaits any more), not kept and raised by the next, unrelated sharedmem call."""
    gate = threading.Event()

    @sm.host_kernel
    def slow(x):
        gate.wait(10)
        x[0] = 1

    b = sm.Buffer.zeros(1, "int32", device=host)
    fut = sm.launch(slow, 1, 1, sm.Out(b), stream=host.create_stream())

    async def waiter():
        return await fut

    loop = asyncio.new_event_loop()
    task = loop.create_task(waiter())
    loop.run_until_complete(asyncio.sleep(0.05))
    assert not task.done()
    loop.close()
    after = threading.Event()
    fut.add_done_callback(lambda f: after.set())  # (runs after the await's wake-up)
    gate.set()
    assert after.wait(10) and fut.result(5) is None
    sm.stats()  # (raises an error kept from a callback: none)
    sm.synchronize()
    assert b.to_host().tolist() == [1]
    with contextlib.suppress(Exception):
        task._log_destroy_pending = False
    del task
    gc.collect()


# -- tracing ------------------------------------------------------------------------------------
def test_a_trace_whose_file_cannot_be_written_at_the_end_raises_and_ends_the_trace(host, tmp_path):
    """The directory of the trace's file gone by the end of the block (nothing else raised):
    the OSError is raised from the ``with``, the events are in ``.events``, and the trace has
    ended -- another can begin."""
    d = tmp_path / "sub"
    d.mkdir()
    tr = sm.trace(str(d / "run.json"))
    with pytest.raises(FileNotFoundError):
        with tr:
            sm.Buffer.zeros(4, "float32", device=host).to_host()
            d.rmdir()
    assert any(e.get("ph") == "X" for e in tr.events)
    with sm.trace(str(tmp_path / "again.json")):
        pass
    assert (tmp_path / "again.json").exists()
