"""Regression tests for what an adversarial review broke (issue 15), one case each.

Each test fails on the code before its fix: a silent wrong value, a hang, a leak or a crash
became a clear error of a documented type that leaves nothing half-done."""

import ctypes
import gc
import os
import sys
import threading
import time

import numpy as np
import pytest

import sharedmem as sm
import interop.dlpack as dl
from conftest import gc_collect_harder, run_threads


# -- malformed input is refused, not guessed at --------------------------------------------
def test_dtype_none_is_refused_not_float64(host):
    with pytest.raises(TypeError, match=r"^a dtype is required \(None is not one: NumPy would "
                                        r"take it for float64\); pass e.g. 'float32'$"):
        sm.Buffer.zeros(4, None, device=host)
    with pytest.raises(TypeError, match=r"^a dtype is required"):
        sm.Tensor.empty((2, 2), None, device=host)


def test_device_box_takes_one_number(host):
    box = sm.DeviceBox(2.5, "float32", device=host)
    for bad in (None, "1.5", b"1", [1.0], np.ones(2)):
        with pytest.raises(TypeError, match=r"^a DeviceBox holds one number, got "):
            box.set(bad)
    assert box.get() == 2.5  # nothing was written
    with pytest.raises(TypeError, match=r"^a DeviceBox holds one number, got None$"):
        sm.DeviceBox(None, device=host)
    box.set(np.float64(4.0)).result(5)
    assert box.get() == 4.0


def test_shapes_must_be_ints_and_at_most_64_dimensions(host):
    for bad in ("34", (2.9, 2.1), (True, 2), 3.0, {2: 3}, {4}):
        with pytest.raises(TypeError, match=r"^shape must be an int or a sequence of ints"):
            sm.Tensor.empty(bad, "float32", device=host)
    b = sm.Buffer.zeros(4, "float32", device=host)
    for bad in ({4: 1}, frozenset([4])):  # (a dict's keys, a set's unordered items)
        with pytest.raises(TypeError, match=r"^shape must be an int or a sequence of ints"):
            sm.Tensor.from_buffer(b, bad)
        assert b.is_live  # refused before the move
    with pytest.raises(TypeError, match=r"^strides must be a sequence of ints \(elements\)"):
        sm.Tensor.from_buffer(b, (2, 2), {2: 0, 1: 0})
    with pytest.raises(sm.LayoutError, match=r"^a tensor has at most 64 dimensions \(as in "
                                             r"NumPy\), got a shape of 65$"):
        sm.Tensor.empty((1,) * 65, "float32", device=host)
    with pytest.raises(sm.LayoutError, match=r"^a tensor has at most 64 dimensions"):
        sm.Tensor.from_buffer(sm.Buffer.zeros(1, "float32", device=host), (1,) * 65)
    assert sm.Tensor.empty((1,) * 64, "float32", device=host).ndim == 64


def test_a_move_to_a_shape_equal_to_the_last_one_is_still_checked(host):
    """from_buffer remembers the last shape it laid out; a shape that merely compares equal
    to it ((2.0, 3) == (2, 3)) is refused all the same, and a list is laid out as a tuple."""
    b = sm.Buffer.zeros(6, "float32", device=host)
    t = sm.Tensor.from_buffer(b, (2, 3))  # remembered
    b = t.into_buffer()
    for bad in ((2.0, 3), (True, 6), (np.float32(2), 3)):
        with pytest.raises(TypeError, match=r"^shape must be an int or a sequence of ints"):
            sm.Tensor.from_buffer(b, bad)
        assert b.is_live  # refused before the move
    t = sm.Tensor.from_buffer(b, [3, 2])
    assert t.shape == (3, 2) and t.strides == (2, 1)
    b = t.into_buffer()
    shape = (2, 3)
    for _ in range(2):  # the same tuple again: found by identity
        t = sm.Tensor.from_buffer(b, shape)
        assert t.shape == (2, 3) and t.strides == (3, 1) and t.size == 6
        b = t.into_buffer()
    with pytest.raises(sm.LayoutError, match=r"^shape \(2, 2\) holds 4 elements but "):
        sm.Tensor.from_buffer(b, (2, 2))
    with pytest.raises(sm.LayoutError, match=r"^shape \(4294967296, 4294967296\) holds "
                                             r"18446744073709551616 elements but "):
        sm.Tensor.from_buffer(b, (2**32, 2**32))  # (more than a C ssize_t: compiled alike)
    assert b.is_live


# -- byte order -------------------------------------------------------------------------------
def test_non_native_byte_order_is_converted_on_the_way_in_and_never_exported_as_native(host):
    big = np.arange(5, dtype=">f4")
    t = sm.Tensor.from_host(big, device=host)
    assert t.dtype == np.dtype("float32") and t.dtype.isnative
    np.testing.assert_array_equal(np.from_dlpack(t), [0.0, 1.0, 2.0, 3.0, 4.0])
    b = sm.Buffer.from_host(np.arange(3, dtype=">i8"), device=host)
    assert b.dtype == np.dtype("int64") and list(b.to_host()) == [0, 1, 2]
    with pytest.raises(TypeError, match=r"^dtype '>f4' is not in native byte order: kernels read "
                                        r"native values; use 'float32' \(from_host converts "
                                        r"arrays\)$"):
        sm.Buffer.zeros(3, ">f4", device=host)
    # the exporter refuses a non-native dtype outright (DLPack cannot say byte order)
    with pytest.raises(BufferError, match=r"^dtype '>f4' is not in native byte order, which DLPack "
                                          r"cannot say; copy to 'float32' first$"):
        dl._dl_dtype(np.dtype(">f4"))


# -- writes through read-only views -------------------------------------------------------------
def test_fill_zero_and_copy_from_refuse_read_only_views(host):
    b = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=host)
    ro = b.as_readonly()
    with pytest.raises(sm.ReadOnlyError, match=r"^cannot fill read-only <Buffer read-only float32 "
                                               r"x 4 .*> with zeros; fill a writable view"):
        ro.fill_zero()
    with pytest.raises(sm.ReadOnlyError, match=r"^cannot copy into read-only <Buffer read-only"):
        ro.copy_from(np.zeros(4, np.float32))
    assert issubclass(sm.ReadOnlyError, ValueError)
    assert list(b.to_host()) == [0.0, 1.0, 2.0, 3.0]  # nothing ran
    box = sm.DeviceBox(1.0, device=host)
    rbox = sm.DeviceBox.__new__(sm.DeviceBox)
    rbox.buffer = box.buffer.as_readonly()
    with pytest.raises(sm.ReadOnlyError):
        rbox.set(2.0)
    assert box.get() == 1.0


def test_copy_from_refuses_what_from_host_refuses(host):
    """copy_from(None) wrote nan (NumPy's float of None), copy_from("2.5") parsed the string:
    values from_host and DeviceBox.set refuse with a TypeError."""
    b = sm.Buffer.from_host(np.arange(1, dtype=np.float32), device=host)
    with pytest.raises(TypeError, match=r"^copy_from takes numbers \(a NumPy array, a sequence "
                                        r"of numbers, a number\), got NoneType None: dtype object "
                                        r"cannot live in device memory; use a numeric or bool "
                                        r"dtype$"):
        b.copy_from(None)
    with pytest.raises(TypeError, match=r"^copy_from takes numbers .*, got str '2.5': dtype <U3 "
                                        r"cannot live in device memory"):
        b.copy_from("2.5")
    for make, what in ((sm.Buffer.from_host, "Buffer.from_host"),
                       (sm.Tensor.from_host, "Tensor.from_host")):
        with pytest.raises(TypeError, match=rf"^{what} takes numbers .*, got NoneType None: "
                                            rf"dtype object cannot live in device memory"):
            make(None, device=host)
        with pytest.raises(TypeError, match=rf"^{what} takes numbers .*, got list \[<object "
                                            rf"object at .*: dtype object cannot live"):
            make([object()], device=host)
    b.copy_from(np.array([7], ">i8")).result(5)  # (another byte order, another dtype: cast)
    assert b.to_host().tolist() == [7.0]


# -- graphs ---------------------------------------------------------------------------------------
def test_the_host_default_stream_cannot_be_captured(host):
    s = host.default_stream
    with pytest.raises(sm.CaptureError, match=r"^the default stream cannot be captured \(<Stream "
                                              r"default on <Device host> \(borrowed\)>: other "
                                              r"threads' work there would be recorded, not run\)"):
        with sm.capture(s):
            pass
    # nothing was left capturing: other threads' default-stream work still runs
    b = sm.Buffer.zeros(4, "int32", device=host)
    done = []
    th = threading.Thread(target=lambda: done.append(b.fill_zero().result(5)))
    th.start()
    th.join(10)
    assert done and s._capture is None


# -- a move racing a slice -------------------------------------------------------------------------
def test_a_moved_handle_never_yields_a_live_slice(host):
    """Slicing checked liveness, then added its token later: a move in between left a live
    slice of bytes the moved-from handle no longer owned (8,520 in 5 s in the review)."""
    holder = [sm.Buffer.zeros(64, "float32", device=host)]
    stop = threading.Event()
    bad = []

    def mover():
        while not stop.is_set():
            b = holder[0]
            try:
                t = sm.Tensor.from_buffer(b, (64,))
            except (sm.AliasError, sm.ReleasedError):
                continue
            holder[0] = t.into_buffer()

    def slicer():
        while not stop.is_set():
            b = holder[0]
            try:
                sl = b[0:8]
            except sm.ReleasedError:  # (MovedError is one)
                continue
            if sl.is_live and not b.is_live:
                bad.append(1)  # b was moved before the slice was made (a live slice is an
                # alias: a move after it would have raised AliasError)
            sl.release()

    run_threads([threading.Thread(target=mover), threading.Thread(target=slicer),
                 threading.Thread(target=slicer)], stop, 1.0)
    assert bad == []


# -- DLPack imports of malformed tensors -----------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("data", None, r"^DLPack tensor of shape \(3,\) has a NULL data pointer$"),
    ("byte_offset", 2 ** 63, r"^DLPack tensor at 0x[0-9a-f]+ \+ byte_offset 9223372036854775808 "
                             r"\(12 bytes\) lies beyond user-space addresses$"),
    ("ndim", 65, r"^DLPack tensor with ndim=65; sharedmem takes 0 to 64 dimensions$"),
    ("ndim", -1, r"^DLPack tensor with ndim=-1"),
])
def test_malformed_dlpack_tensors_are_refused_and_left_unconsumed(host, field, value, message):
    t = sm.Tensor.from_host(np.arange(3, dtype=np.float32), device=host)
    alloc = t.allocation
    cap = t.__dlpack__(max_version=(1, 0))
    m = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned"))
    setattr(m.dl_tensor, field, value)
    with pytest.raises(BufferError, match=message):
        sm.from_dlpack(cap)
    assert dl._is_valid(cap, b"dltensor_versioned")  # not consumed: its deleter still runs
    assert alloc.live_views == 2
    del cap, m
    gc_collect_harder()
    assert alloc.live_views == 1


@pytest.mark.parametrize("strides", [False, True])
def test_an_empty_dlpack_tensor_spanning_2_63_elements_is_refused_and_left_unconsumed(host,
                                                                                       strides):
    """A capsule of shape (0, 2**62, 2**62) (sizes each an int64; the empty size aside they
    multiply to 2**124) was imported: a Tensor that sharedmem's own constructors refuse
    (LayoutError: "spans 2**63 elements or more"), with C strides of 2**124 elements where the
    capsule had none -- its ``__dlpack__`` then failed with struct.error interpreted, an
    OverflowError compiled. A malformed tensor: BufferError, the capsule left unconsumed."""
    t = sm.Tensor.from_host(np.zeros((0, 1, 1), np.float32), device=host)
    alloc = t.allocation
    cap = t.__dlpack__(max_version=(1, 0))
    m = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned"))
    m.dl_tensor.shape[1] = m.dl_tensor.shape[2] = 1 << 62
    if not strides:
        m.dl_tensor.strides = None
    with pytest.raises(BufferError, match=r"^DLPack tensor of shape \(0, 4611686018427387904, "
                                          r"4611686018427387904\) spans 2\*\*63 elements or "
                                          r"more, its zero sizes left out \(as NumPy counts "
                                          r"it\)$"):
        sm.from_dlpack(cap)
    assert dl._is_valid(cap, b"dltensor_versioned")  # not consumed: its deleter still runs
    del cap, m
    gc_collect_harder()
    assert alloc.live_views == 1


_REFUSED_UNREAD = r"""
import ctypes, sys, numpy as np, sharedmem as sm, interop.dlpack as dl
t = sm.Tensor.from_host(np.arange(3.0), device=sm.Device.host())
cap = t.__dlpack__(max_version=(1, 0))
d = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned")).dl_tensor
good = d.shape
if sys.argv[1] == "device_type":
    d.device.device_type = 7  # (Vulkan)
else:
    d.dtype.lanes = 2
d.shape = ctypes.cast(ctypes.c_void_p(8), ctypes.POINTER(ctypes.c_int64))  # (nothing there)
try:
    sm.from_dlpack(cap)
except BufferError as e:
    print(e)
d.shape = good
print(bool(dl._is_valid(cap, b"dltensor_versioned")))
"""


@pytest.mark.parametrize("field, message", [
    ("device_type", "DLPack device type 7 (id 0) is not supported; sharedmem imports CPU and "
                    "CUDA memory"),
    ("lanes", "cannot import a DLPack capsule: DLPack dtype with 2 lanes (vector types) is not "
              "supported; sharedmem imports bool (8 bits), int, uint, float (up to 64 bits), "
              "complex (up to 128) and bfloat16: convert the array to one of those first")])
def test_a_capsule_refused_for_its_device_or_dtype_has_its_arrays_unread(field, message):
    """The shape and strides arrays are read only once the device, dtype and ndim are ones an
    import takes: a capsule refused for those, whose shape pointer points nowhere, is refused
    with its BufferError and left unconsumed -- not a crash (a fresh interpreter: a bad read
    is a SIGSEGV)."""
    import subprocess
    r = subprocess.run([sys.executable, "-c", _REFUSED_UNREAD, field], capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stdout.splitlines()) == (0, [message, "True"]), r.stderr[-2000:]


# -- the DLPack capsule destructor, run with an exception set ---------------------------------------
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_capsule_destructor_with_an_exception_set_still_ends_the_export(host):
    """A consumer that refuses a capsule drops it on its error path, with its exception set
    (NumPy does: "Unsupported device"). The destructor must still end the export, and the
    consumer's exception must reach the caller unchanged."""
    t = sm.Tensor.from_host(np.arange(3, dtype=np.float32), device=host)
    alloc = t.allocation

    class Producer:  # hands NumPy one of our capsules that claims to be CUDA memory
        def __init__(self):
            self.cap = t.__dlpack__(max_version=(1, 0))
            addr = dl._get_pointer(self.cap, b"dltensor_versioned")
            dl.DLManagedTensorVersioned.from_address(addr).dl_tensor.device.device_type = \
                dl.kDLCUDA

        def __dlpack_device__(self):
            return (dl.kDLCPU, 0)

        def __dlpack__(self, **kwargs):
            cap, self.cap = self.cap, None  # NumPy holds the only reference
            return cap

    p = Producer()
    assert alloc.live_views == 2
    if not dl.__file__.endswith(".py"):  # compiled
        with pytest.raises((BufferError, RuntimeError), match=r"^Unsupported device in DLTensor"):
            np.from_dlpack(p)
    else:  # a ctypes callback cannot pass an exception through: it is printed as unraisable
        with pytest.raises(SystemError):
            np.from_dlpack(p)
    gc_collect_harder()
    assert alloc.live_views == 1  # the export ended although NumPy's error was set


# -- fork -------------------------------------------------------------------------------------------
def _in_child(fn, timeout=20.0) -> str:
    """Run ``fn()`` in a forked child; its output (or why it failed) as text. The child
    exits with os._exit: it never runs the parent's pytest teardown."""
    import os
    import time
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(r)
        try:
            out = str(fn())
        except BaseException as e:
            out = f"child raised {type(e).__name__}: {e}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)
        return "child hung"
    with os.fdopen(r, "rb") as f:
        return f.read().decode()


fork_only = pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no os.fork")


@fork_only
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (3.12: fork of a threaded process)
def test_a_fork_waits_for_the_allocation_registry(host):
    """The registry's lock is held across a fork: a thread of the parent in the middle of an
    update (here: holding the lock) finishes it first, so the child's registry is whole."""
    import time

    from sharedmem.allocation import _registry
    b = sm.Buffer.zeros(8, "float32", device=host)
    held, go = threading.Event(), threading.Event()

    def updating():
        _registry._lock.acquire()
        held.set()
        go.wait(5)
        time.sleep(0.3)
        _registry._lock.release()
    t = threading.Thread(target=updating)
    t.start()
    held.wait(5)
    go.set()
    t0 = time.monotonic()
    out = _in_child(lambda: (_registry.lookup(host.key, b.allocation.ptr, 4) is b.allocation,
                             float(sm.Buffer.zeros(4, "float32", device=host).to_host().sum())))
    waited = time.monotonic() - t0
    t.join(5)
    assert out == str((True, 0.0)) and waited >= 0.2, (out, waited)


def test_the_registry_lock_is_a_lock_as_threading_locks_are():
    """The registry's leaf lock (compiled, a LeafLock over a pthread mutex) behaves as a
    threading.Lock from Python: releasing it while nobody holds it raises RuntimeError (a
    double release went unnoticed: an unlock of an unlocked mutex), and one made without its
    __init__ (``__new__``, a subclass's) is a lock, not a NULL mutex that crashes."""
    from sharedmem.allocation import _registry
    from sharedmem.runtime.state import leaf_lock
    lock = leaf_lock()
    with pytest.raises(RuntimeError):
        lock.release()
    assert not lock.locked() and lock.acquire(False) and lock.locked()
    assert not lock.acquire(False)
    lock.release()
    assert not lock.locked()
    with lock:
        assert lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()
    assert not _registry._lock.locked()
    if type(lock).__name__ == "LeafLock":
        bare = type(lock).__new__(type(lock))
        assert not bare.locked() and bare.acquire(False) and bare.locked()
        bare.release()


@fork_only
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (3.12: fork of a threaded process)
def test_a_fork_waits_for_the_host_pool(host):
    """The host pool's lock is held across a fork: a thread of the parent between taking a
    block off a free list and counting it finishes first, so the child's count is whole."""
    import time

    pool = host.backend.pool
    before = pool.bytes_in_use
    held = threading.Event()

    def allocating():  # (a section of HostPool's lock, half done when the fork comes)
        pool._lock.acquire()
        pool.bytes_in_use += 256
        held.set()
        time.sleep(0.3)
        pool.bytes_in_use -= 256
        pool._lock.release()
    t = threading.Thread(target=allocating)
    t.start()
    held.wait(5)
    t0 = time.monotonic()
    out = _in_child(lambda: pool.bytes_in_use - before)
    waited = time.monotonic() - t0
    t.join(5)
    assert out == "0" and waited >= 0.2, (out, waited)


@fork_only
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (3.12: fork of a threaded process)
def test_a_forked_child_runs_host_work_and_fails_work_cut_by_the_fork(host):
    s = host.create_stream()
    gate = threading.Event()

    @sm.host_kernel
    def slow(x):
        gate.wait(10)
        x[:] = 7

    b = sm.Buffer.zeros(4, "int32", device=host)
    fut = sm.launch(slow, 1, 1, sm.Out(b), stream=s)  # running when the process forks
    queued = sm.launch(sm.host_kernel(lambda x: None), 1, 1, sm.In(b), stream=s)
    import time
    while s._impl._q.running is None:
        time.sleep(0.001)

    def child():
        c = sm.Buffer.from_host(np.arange(4, dtype=np.int32), device=host)  # default stream
        got = [c.to_host().tolist()]
        for f in (fut, queued):  # cut by the fork: an error, not a hang
            try:
                f.result(5)
                got.append("done")
            except sm.CompletionUnknownError as e:
                got.append(type(e).__name__ + (": forked" if "forked" in str(e) else ""))
        s2 = host.create_stream()
        d = sm.Buffer.zeros(2, "int32", device=host, stream=s2)
        sm.launch(sm.host_kernel(lambda x: x.__setitem__(slice(None), 3)), 1, 1, sm.Out(d),
                  stream=s2).result(5)
        got.append(d.to_host().tolist())
        return got

    out = _in_child(child)
    gate.set()
    fut.result(10)
    queued.result(10)
    assert list(b.to_host()) == [7, 7, 7, 7]  # the parent's work ran
    assert out == str([[0, 1, 2, 3], "CompletionUnknownError: forked",
                       "CompletionUnknownError: forked", [3, 3]])


@fork_only
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (3.12: fork of a threaded process)
def test_a_forked_child_does_not_report_the_parents_unretrieved_failures(host):
    """A failed host kernel's exception the parent has not retrieved yet is the parent's to
    report (or retrieve): a child that drops its copy of the work logs nothing."""
    import logging

    @sm.host_kernel
    def boom(x):
        raise ValueError("the parent's")
    s = host.create_stream()
    held = [sm.Buffer.zeros(4, device=host)]
    held.append(sm.launch(boom, 1, 1, held[0], stream=s))
    s.synchronize()

    def child():
        seen = []
        handler = logging.Handler(logging.ERROR)
        handler.emit = lambda r: seen.append(r.getMessage())
        logging.getLogger("sharedmem").addHandler(handler)
        held.clear()
        gc_collect_harder()
        return [m for m in seen if "never retrieved" in m]

    assert _in_child(child) == "[]"
    assert isinstance(held[1].exception(5), sm.HostKernelError)  # (retrieved: nothing logged)


@fork_only
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fork_while_other_threads_launch_never_leaves_the_child_locked(host):
    stop = threading.Event()
    b = sm.Buffer.zeros(64, "float32", device=host)
    s = host.create_stream()

    def launcher():
        k = sm.host_kernel(lambda x: None)
        while not stop.is_set():
            sm.launch(k, 1, 1, sm.In(b), stream=s)
            sm.stats()

    threads = [threading.Thread(target=launcher) for _ in range(3)]
    for th in threads:
        th.start()
    try:
        outs = [_in_child(lambda: (sm.stats(), sm.Buffer.from_host(
            np.ones(2, np.int8), device=host).to_host().tolist())[1], timeout=10)
            for _ in range(10)]
    finally:
        stop.set()
        for th in threads:
            th.join(10)
    assert outs == ["[1, 1]"] * 10


# -- continuations ----------------------------------------------------------------------------------
def test_a_blocking_continuation_does_not_stall_retirement(host):
    """A then() continuation that waits on another continuation used to block the retirer
    thread: every unrelated then() stalled until some user thread swept."""
    s1, s2, s3 = (host.create_stream() for _ in range(3))
    gate, started, unrelated = threading.Event(), threading.Event(), threading.Event()
    b = sm.Buffer.zeros(4, "int32", device=host)
    c = sm.Buffer.zeros(4, "int32", device=host)
    nop = sm.host_kernel(lambda x: None)
    fa = sm.launch(sm.host_kernel(lambda x: gate.wait(10)), 1, 1, sm.In(b), stream=s1) \
        .then(lambda _: "a")

    def blocks(_):
        started.set()
        return fa.result(10)  # waits for a continuation that is not queued yet

    fb = sm.launch(nop, 1, 1, sm.In(c), stream=s2).then(blocks)
    assert started.wait(5)  # the retirer retired s2's launch and handed the continuation off
    gate.set()
    # unrelated work: its continuation runs although `blocks` is still waiting -- observed
    # through a plain Event, so no sharedmem wait of this thread sweeps for it
    sm.launch(nop, 1, 1, sm.In(c), stream=s3).then(lambda _: unrelated.set())
    assert unrelated.wait(5)
    assert fb.result(5) == "a"


# -- finalizers that call sharedmem -----------------------------------------------------------------
def test_a_finalizer_calling_sharedmem_inside_a_launch_never_deadlocks(host):
    """A user __del__ that calls any sharedmem API, run by a garbage collection that
    happens while the same thread holds the core lock (inside submit()), used to deadlock
    within 10k launches. It now raises SharedMemError in the finalizer (reported as
    unraisable) or runs normally; the launches complete."""
    import gc
    seen = []

    class Calls:
        def __init__(self):
            self.cycle = self

        def __del__(self):
            try:
                sm.stats()
                seen.append("ran")
            except sm.SharedMemError as e:
                seen.append("refused" if "called from a finalizer" in str(e) else repr(e))

    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int32", device=host)
    k = sm.host_kernel(lambda x: None)
    done = threading.Event()

    def run():
        old = gc.get_threshold()
        gc.set_threshold(1, 1, 1)
        try:
            for _ in range(3000):
                Calls()
                sm.launch(k, 1, 1, sm.In(b), stream=s)
        finally:
            gc.set_threshold(*old)
        done.set()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    assert done.wait(60), "deadlocked"
    s.synchronize()
    assert seen and set(seen) <= {"ran", "refused"}


# -- resources running out ---------------------------------------------------------------------------
def test_a_failed_host_allocation_leaves_the_pool_accounting_alone(host):
    pool = host.backend.pool
    before = pool.bytes_in_use
    with pytest.raises(MemoryError):
        sm.Buffer.empty(2 ** 61, "uint8", device=host)
    assert pool.bytes_in_use == before


@pytest.mark.parametrize("make", [
    lambda d: sm.Buffer.empty(2 ** 62, "float32", device=d),
    # (a length of 2**63 or more is a LayoutError, as a tensor dimension is: errors.md)
    lambda d: sm.Buffer.empty(2 ** 63 - 1, "uint16", device=d),
    lambda d: sm.Tensor.empty((2 ** 31, 2 ** 31), "float32", device=d)])
def test_a_size_beyond_the_address_space_is_a_memory_error_naming_it(host, make):
    """(NumPy said ValueError 'Maximum allowed dimension exceeded', naming nothing.)"""
    before = sm.stats()
    with pytest.raises(MemoryError, match=r"^cannot allocate \d+ bytes on <Device host>: more "
                                          r"than any device memory can hold"):
        make(host)
    after = sm.stats()
    assert (after.live_allocations, after.live_views) == (before.live_allocations,
                                                          before.live_views)


def test_lookup_allocation_takes_a_range_of_ints(host):
    b = sm.Buffer.empty(64, "uint8", device=host)
    big = sm.Buffer.empty(1 << 20, "uint8", device=host)  # noqa: F841  (a long one widens the walk)
    assert sm.lookup_allocation(host, np.uint64(b.ptr), np.int32(64)) is b.allocation
    with pytest.raises(ValueError, match=r"^lookup_allocation: a range of -32 bytes at 0x"):
        sm.lookup_allocation(host, b.ptr + 80, -32)  # (found b's allocation, not containing it)
    with pytest.raises(TypeError, match=r"^lookup_allocation: nbytes must be an int, got 1.5$"):
        sm.lookup_allocation(host, b.ptr, 1.5)
    with pytest.raises(TypeError, match=r"^lookup_allocation: ptr must be an int, got True$"):
        sm.lookup_allocation(host, True)


_FIRST_EXPORTS = r"""
import threading, numpy as np, sharedmem as sm
bufs = [sm.Buffer.empty(16, "float32", device=sm.Device.host()) for _ in range(8)]
bar, errs = threading.Barrier(8), []
def go(b):
    bar.wait()
    try:
        np.from_dlpack(b)
    except Exception as e:
        errs.append(repr(e))
ts = [threading.Thread(target=go, args=(b,)) for b in bufs]
[t.start() for t in ts]; [t.join() for t in ts]
print(errs[0] if errs else "OK")
"""


def test_first_exports_from_several_threads_at_once():
    """The first export imports interop.dlpack; a second thread exporting meanwhile found
    the module half-executed in sys.modules (AttributeError). Fresh interpreters: the race
    is on first use only (it showed in about 1 run of 12)."""
    import subprocess
    for _ in range(6):
        out = subprocess.run([sys.executable, "-c", _FIRST_EXPORTS], capture_output=True,
                             text=True, timeout=120).stdout.strip()
        assert out == "OK"


def test_host_pool_frees_its_cache_and_retries_once_on_out_of_memory(host, monkeypatch):
    import sharedmem.backends.host as hb
    pool = host.backend.pool
    sm.Buffer.empty(1000, "uint8", device=host).release()  # one block cached
    gc_collect_harder()
    assert any(pool._free.values())
    real = np.empty
    calls = []

    def failing_once(*a, **k):
        calls.append(a)
        if len(calls) == 1:
            raise MemoryError("out of memory (test)")
        return real(*a, **k)

    monkeypatch.setattr(hb.np, "empty", failing_once)
    b = sm.Buffer.empty(5000, "uint8", device=host)  # a size class not cached
    assert len(calls) == 2 and not any(pool._free.values())  # cache dropped, then retried
    assert b.nbytes == 5000


def test_a_thread_that_cannot_start_fails_the_launch_before_anything_is_leased(host, monkeypatch):
    import sharedmem.runtime.retirer as ret
    from sharedmem.runtime.state import RUNTIME
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int32", device=host)
    ran = []
    k = sm.host_kernel(lambda x: ran.append(1))
    sm.synchronize()
    monkeypatch.setattr(ret, "_thread", None)
    monkeypatch.setattr(RUNTIME, "retirer_running", False)

    def no_threads(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_threads)
    before = sm.stats()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        sm.launch(k, 1, 1, sm.Out(b), stream=s)
    monkeypatch.undo()
    assert sm.stats().submitted == before.submitted and s.pending == 0
    t = sm.Tensor.from_buffer(b, (4,))  # no lease, no alias was left behind
    sm.launch(k, 1, 1, sm.Out(t), stream=s).result(5)  # and the retirer starts again
    assert ran == [1]


def test_continuations_keep_their_order_and_never_run_on_a_waiting_user_thread(host):
    import time
    s = host.create_stream()
    nap = sm.host_kernel(lambda t: time.sleep(t))
    f = sm.launch(nap, 1, 1, 0.2, stream=s)
    order, threads = [], []
    f.add_done_callback(lambda _: (order.append("A"), threads.append(
        threading.current_thread().name)))
    time.sleep(0.4)  # retired by the retirer: A is handed off, maybe not yet run
    f.add_done_callback(lambda _: order.append("B"))  # joins A (or runs after it)
    # two continuations of one future, the first waiting on the second: the second is handed
    # to another worker instead of waiting behind the first
    g = sm.launch(nap, 1, 1, 0.1, stream=s)
    box = {}
    first = g.then(lambda _: box["second"].result(5))
    box["second"] = g.then(lambda _: "second")
    assert first.result(5) == "second"
    # a user thread waiting on a future never runs somebody else's callbacks, and its
    # timeout is its own
    slow = sm.launch(nap, 1, 1, 0.3, stream=host.create_stream()).then(lambda _: 1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        slow.result(0.05)
    assert time.monotonic() - t0 < 0.25
    assert slow.result(5) == 1
    deadline = time.monotonic() + 5
    while len(order) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == ["A", "B"]
    assert threads and threads[0] != threading.current_thread().name


@fork_only
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_fork_inside_a_host_kernel_leaves_that_stream_working_in_the_child(host):
    import os
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int64", device=host)
    out = {}

    def child_exits_when(later):  # (in the child: only this stream's worker thread exists)
        code = 3
        try:
            later.result(5)
            code = 0
        finally:
            os._exit(code)

    @sm.host_kernel
    def forker(x):
        x += 1
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child; this thread is the stream's worker)
            later = sm.launch(sm.host_kernel(lambda y: None), 1, 1, sm.In(b), stream=s)
            threading.Thread(target=child_exits_when, args=(later,), daemon=True).start()
            return  # the worker goes on here and runs `later`: the child exits 0
        out["pid"] = pid

    sm.launch(forker, 1, 1, sm.InOut(b), stream=s).result(10)
    import time
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(out["pid"], os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(out["pid"], 9)
        os.waitpid(out["pid"], 0)
        pytest.fail("the child hung")
    assert os.waitstatus_to_exitcode(status) == 0  # no fault, no hang in the child
    assert b.to_host().tolist() == [1, 1, 1, 1]


_WORKER_FINALIZER_SCRIPT = r"""
import gc, threading
import sharedmem as sm
host = sm.Device.host()

class Cyc:
    def __init__(self):
        self.me = self  # garbage only a collection frees: its finalizer runs wherever one runs

    def __del__(self):
        try:
            sm.stats()  # needs the core lock; from a host stream's worker it waits for it
        except sm.SharedMemError:
            pass  # (a collection inside this thread's own sharedmem call: refused, never a hang)

@sm.host_kernel
def k(x):
    for _ in range(3):
        Cyc()

s = host.create_stream("victim")
bufs = [sm.Buffer.zeros(4, device=host) for _ in range(2)]
sm.synchronize()
gc.set_threshold(1, 1, 1)

def run(b):
    for _ in range(1500):
        Cyc()
        sm.launch(k, 1, 1, sm.InOut(b), stream=s)

ts = [threading.Thread(target=run, args=(b,)) for b in bufs]
for t in ts:
    t.start()
for t in ts:
    t.join()
sm.synchronize()
gc.set_threshold(700, 10, 10)
print("finished")
"""


def test_a_finalizer_on_a_host_worker_never_deadlocks_a_submitter():
    """A host stream's worker took its queue lock around code that allocates (setting a
    task's marker); a collection there ran a user finalizer that waited for the core lock,
    while a submitter holding the core lock waited for the queue lock: 2 runs in 3 hung
    before. Nothing under the queue lock allocates now. (Later it still hung about 1 run in
    20, interpreted: ``with lock:``'s exit call allocates its argument tuple when the tuple
    free list is empty -- with the lock still held. The worker uses acquire/release now.)"""
    import os
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _WORKER_FINALIZER_SCRIPT], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["finished"], r.stdout + r.stderr


@fork_only
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (3.12: fork of a threaded process)
def test_a_fork_while_a_worker_sets_a_marker_never_hangs_the_child(host, monkeypatch):
    """The worker sets a task's marker outside the task lock (nothing allocating runs under
    it); a fork inside that Event.set() -- the Event's own lock held by a thread the child
    does not have -- used to leave every wait on that marker hanging in the child. The
    window is widened with a sleep inside set()."""
    import time
    import types
    from sharedmem.backends import host as hostmod
    in_set = threading.Event()

    class SlowSetEvent(threading.Event):
        slow = False

        def set(self):
            with self._cond:
                self._flag = True
                if self.slow:
                    in_set.set()
                    time.sleep(0.5)
                self._cond.notify_all()

    fake = types.SimpleNamespace(**{k: getattr(threading, k) for k in dir(threading)
                                    if not k.startswith("__")})
    fake.Event = SlowSetEvent
    monkeypatch.setattr(hostmod, "threading", fake)
    s = host.create_stream("fork-in-set")
    b = sm.Buffer.zeros(4, "int32", device=host)
    sm.launch(sm.host_kernel(lambda x: None), 1, 1, sm.In(b), stream=s).result(5)
    time.sleep(0.1)  # (the retirer falls idle: nothing retires the next launch meanwhile)
    SlowSetEvent.slow = True
    fut = sm.launch(sm.host_kernel(lambda x: time.sleep(0.3)), 1, 1, sm.In(b), stream=s)
    assert in_set.wait(5)  # the worker is inside the marker's Event.set()

    def child():
        t0 = time.monotonic()
        fut.result(2.0)
        sm.synchronize()
        return f"done in {time.monotonic() - t0 < 1.0}"

    assert _in_child(child, timeout=10.0) == "done in True"
    SlowSetEvent.slow = False
    fut.result(5)


@fork_only
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (3.12: fork of a threaded process)
def test_a_fork_while_a_thread_enters_a_wait_on_a_marker_never_hangs_the_child(host, monkeypatch):
    """A thread waiting for a host task (``fut.result()``, another stream's wait) holds the
    marker's Event lock as it enters and leaves Event.wait(); a fork then -- that lock held by
    a thread the child does not have -- left the child's new worker hanging in set() for that
    queued task's marker, and every wait on it with it (found by a fork fuzzer: about 1 fork
    in 500 with a thread waiting in a loop). The window is widened with a sleep inside wait()."""
    import time
    import types
    from sharedmem.backends import host as hostmod
    in_wait = threading.Event()

    class SlowWaitEvent(threading.Event):
        slow = False

        def wait(self, timeout=None):
            if SlowWaitEvent.slow and not self.is_set():
                with self._cond:  # (as Event.wait holds it on entry)
                    in_wait.set()
                    time.sleep(0.5)
            return super().wait(timeout)

    fake = types.SimpleNamespace(**{k: getattr(threading, k) for k in dir(threading)
                                    if not k.startswith("__")})
    fake.Event = SlowWaitEvent
    monkeypatch.setattr(hostmod, "threading", fake)
    s = host.create_stream("fork-in-wait")
    gate = threading.Event()
    b = sm.Buffer.zeros(4, "int32", device=host)
    first = sm.launch(sm.host_kernel(lambda x: gate.wait(10)), 1, 1, sm.In(b), stream=s)
    fut = sm.launch(sm.host_kernel(lambda x: None), 1, 1, sm.In(b), stream=s)  # queued
    while s._impl._q.running is None:
        time.sleep(0.001)
    SlowWaitEvent.slow = True
    waiter = threading.Thread(target=fut.result, args=(10,))
    waiter.start()
    assert in_wait.wait(5)  # the waiter holds the queued task's marker's Event lock

    def child():
        SlowWaitEvent.slow = False
        t0 = time.monotonic()
        try:
            fut.result(2.0)
        except sm.CompletionUnknownError:  # (its stream was running a task at the fork)
            pass
        return f"done in {time.monotonic() - t0 < 1.0}"

    try:
        assert _in_child(child, timeout=6.0) == "done in True"
    finally:
        SlowWaitEvent.slow = False
        gate.set()
    waiter.join(10)
    first.result(5)
    fut.result(5)


_TASK_FREED_UNDER_LOCK_SCRIPT = r"""
import os, threading, time
import sharedmem as sm

def watchdog():
    time.sleep(20)
    print("hang", flush=True)
    os._exit(1)

host = sm.Device.host()
s = host.create_stream()
b = sm.Buffer.zeros(4, "int32", device=host)

class Holder:  # a plain launch argument: it reaches the task only through the task itself
    pass

h = Holder()
h.buf = sm.Buffer.zeros(4, "int32", device=host)
sm.record_use(h.buf, s)  # its token is a hold on s: its end submits to s
k = sm.host_kernel(lambda x, holder: time.sleep(0.1))
fut = sm.launch(k, 1, 1, sm.In(b), h, stream=s)
del h  # the task is now the Holder's only owner
threading.Thread(target=watchdog, daemon=True).start()
time.sleep(0.5)
fut.result(2)
s.synchronize()
print("finished", flush=True)
"""


def test_a_finished_task_is_freed_outside_its_queue_lock():
    """The worker dropped the last reference to a finished task (its arguments) while it held
    the queue lock: a Buffer among them whose release ends a hold on the same stream put work
    on that queue -- the worker waited for its own lock, holding the core lock. Found by
    review (hung before, in both builds)."""
    import os
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _TASK_FREED_UNDER_LOCK_SCRIPT],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["finished"], r.stdout + r.stderr


_STATS_IN_FINALIZERS_SCRIPT = r"""
import gc, threading
import sharedmem as sm
host = sm.Device.host()
keep = [sm.Buffer.zeros(4, device=host) for _ in range(20)]

class Cyc:
    def __init__(self):
        self.me = self

    def __del__(self):
        try:
            sm.stats()
        except sm.SharedMemError:
            pass

gc.set_threshold(1, 1, 1)

def run():
    for _ in range(3000):
        Cyc()
        sm.stats()

ts = [threading.Thread(target=run) for _ in range(2)]
for t in ts:
    t.start()
for t in ts:
    t.join()
gc.set_threshold(700, 10, 10)
print("finished")
"""


def test_stats_from_finalizers_never_deadlocks_on_the_registry():
    """sm.stats() counted live allocations with a generator under the registry's lock: a
    collection there ran a finalizer calling sm.stats() again, which waited for the lock its
    own thread held (1 run in 3 hung; the suite's finalizer test hung once in CI). The count
    is a counter now, and nothing under that lock allocates."""
    import os
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _STATS_IN_FINALIZERS_SCRIPT],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0 and r.stdout.split() == ["finished"], r.stdout + r.stderr


def test_a_release_is_never_lost_when_an_earlier_staged_release_raises(host):
    from sharedmem.runtime.state import RUNTIME
    b = sm.Buffer.zeros(16, device=host)
    v = b[0:4]
    tok = v._token
    views = RUNTIME.live_views

    def boom(arg):
        raise RuntimeError("boom")

    RUNTIME.staged.append((boom, None))  # (what a destructor stages while the lock is busy)
    with pytest.raises(RuntimeError, match="boom"):
        tok.release()
    assert tok.live  # not released yet: staged behind the failure, not dropped
    RUNTIME.acquire()  # the next API call drains the stage
    RUNTIME.release()
    assert not tok.live
    assert RUNTIME.live_views == views - 1
    b[0:4].release()  # the allocation is usable: a slice is made and released as usual


def test_the_core_hooks_are_never_unset(host):
    from sharedmem.runtime.state import RUNTIME
    before = RUNTIME.hooks
    with pytest.raises(TypeError, match="must be a Hooks instance, got NoneType"):
        RUNTIME.install_hooks(None)
    assert RUNTIME.hooks is before


def _release_without_a_retirer(view, monkeypatch) -> int:
    """Release ``view`` while the retirer thread cannot start (filing a lease raises
    RuntimeError); returns how many times a start was tried."""
    from sharedmem.runtime.state import RUNTIME
    tries = []

    def cannot_start():
        tries.append(1)
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(RUNTIME, "retirer_running", False)
    monkeypatch.setattr(RUNTIME, "ensure_retirer", cannot_start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        view.release()
    monkeypatch.undo()
    return len(tries)


def test_a_hold_whose_end_cannot_be_leased_is_still_dropped(host, monkeypatch):
    """The end of a hold files a lease and then drops the hold. If filing raises (here the
    retirer thread cannot start), the hold must go all the same: nothing else could end it,
    and under policy "reject" every later write from another stream would be refused."""
    from host_kernels import fill
    s, other = host.create_stream("consumer"), host.create_stream("other")
    b = sm.Buffer.empty(16, "float32", device=host)
    c = b[:]
    sm.record_use(c, s)  # holds on b's and c's tokens for work on s
    later = b[:]  # a view made after: no hold of its own
    alloc = c.allocation
    _release_without_a_retirer(c, monkeypatch)
    b.release()
    s.synchronize()
    sm.synchronize()
    with sm.runtime.state.locked():
        holds = [h.kind for u in alloc.tracker.uses_locked().values() for h in u.holds or ()]
    assert holds == []
    sm.launch(fill, 1, 1, later, 1.0, stream=other, policy="reject").result()
    assert later.to_host().tolist() == [1.0] * 16



def test_a_host_stream_finalized_and_then_used_again_runs_its_work_in_order(host):
    """The collector may finalize a stream in the same collection as a view whose hold ends
    on it: the hold's end then files work on the stream whose worker its finalizer stopped
    (seen as ``sm.synchronize()`` hanging). That work runs, after what the stream was given
    before."""
    s = host.create_stream("revived")
    order = []
    gate = threading.Event()
    s._impl.submit(lambda: (gate.wait(5), order.append("before")))
    s._impl.__del__()  # (what the collector's finalization does; the object lives on)
    m = s._impl.submit(lambda: order.append("after"))
    gate.set()
    assert m.wait(5)
    assert order == ["before", "after"]
    s.synchronize()


def _host_workers(name):
    return [t for t in threading.enumerate() if t.name == name]


def test_a_host_stream_revived_in_a_collection_stops_its_worker_when_it_dies(host):
    """A real collection finalizes a stream's impl, then (same collection) a finalizer uses
    it. Its new worker is stopped once the impl really dies (its finalizer does not run
    twice), and while it lives it is among the streams fork and exit look after."""
    from sharedmem.backends import host as H
    ran, order = [], []

    class User:
        def __del__(self):
            order.append("user")
            self.impl.submit(lambda: ran.append(1)).wait(5)
            seen.append(self.impl in H._impls)

    class Impl(H.HostStreamImpl):
        def __del__(self):
            order.append("impl")
            H.HostStreamImpl.__del__(self)

    seen = []
    gc.collect()
    gc.disable()  # (the cycle is collected below, where the order is known)
    try:
        impl = Impl(host.backend, "revived-in-a-collection")
        user = User()
        impl.cycle, user.impl = user, impl  # the impl first in the collector's list
        del impl, user
        gc.collect()
    finally:
        gc.enable()
    assert order == ["impl", "user"] and ran == [1] and seen == [True]
    gc.collect()  # (the user's finalizer resurrected the impl: this collection frees it)
    deadline = time.monotonic() + 5
    while _host_workers("revived-in-a-collection") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _host_workers("revived-in-a-collection") == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_revived_host_stream_runs_its_work_in_a_forked_child(host):
    from sharedmem.backends import host as H
    impl = host.backend.create_stream("revived-then-forked")
    H._impls.discard(impl)  # (what the collector does before it finalizes the impl)
    impl.__del__()
    assert impl.submit(lambda: None).wait(5)  # (revived: a new worker)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if impl.submit(lambda: None).wait(5) else 3)
    assert os.WEXITSTATUS(os.waitpid(pid, 0)[1]) == 0
    impl._q.put(None)  # (its worker stops)


def test_a_hold_on_two_streams_whose_first_end_fails_ends_on_both(host, monkeypatch):
    """A read hold on two streams whose end cannot be leased on the first: the second's hold
    is ended too (it was left open, and -- its token's consumers cleared -- counted as a
    write hold: under "reject" every later read from another stream was refused)."""
    from host_kernels import total
    from sharedmem.runtime.state import locked
    s1, s2, other = (host.create_stream(n) for n in ("s1", "s2", "other"))
    b = sm.Buffer.zeros(16, "float32", device=host)
    c = b[:]
    sm.record_use(c, s1, writes=False)  # c's token: a read hold on s1 and on s2
    sm.record_use(c, s2, writes=False)
    sm.synchronize()
    held = c._live_token()
    # (both ends were filed: the first error raised after the second)
    assert _release_without_a_retirer(c, monkeypatch) == 2
    sm.synchronize()
    with locked():  # (b's own holds stay while b lives: read holds, which a read passes)
        assert not any(h is held for u in b.allocation.tracker.uses_locked().values() for h in u.holds or ())
    box = sm.DeviceBox(0.0, "float64", device=host)
    sm.synchronize()
    sm.launch(total, 1, 1, sm.In(b), sm.Out(box), stream=other, policy="reject").result()
    assert box.get() == 0.0
    assert sm.stats().in_flight == 0  # (the two leases filed stand, on active streams: retired)


def test_the_export_facts_cache_keeps_no_device_alive(monkeypatch):
    """interop.dlpack caches the facts of the last device it exported from; the device (its
    streams, backend and driver) still goes once nothing else refers to it."""
    import gc
    import weakref
    from fake_cuda import install_fake_devices
    mp = pytest.MonkeyPatch()
    try:
        (dev,), drv = install_fake_devices(mp, True)
        t = sm.Tensor.from_buffer(sm.Buffer.empty(64, "float32", device=dev), (64,))
        cap = t.__dlpack__(stream=1, max_version=(1, 0))
        del cap
        t.release()
        del t
        sm.synchronize()
        assert sm.stats().in_flight == 0
        ref = weakref.ref(dev)
        del dev, drv
    finally:
        mp.undo()
    gc_collect_harder()
    assert ref() is None

def _foreign_adapter(fill_value):
    """A host-kernel adapter that takes ``_Foreign`` objects (coerced to a view of their
    buffer) and fills its first argument with ``fill_value``; it counts its coerce calls."""
    from sharedmem.backends.host import ndarray_of

    class Adapter(sm.KernelAdapter):
        name = "foreign-filling"
        device_kinds = ("host",)

        def __init__(self):
            self.calls = 0

        def coerce(self, obj, device):
            self.calls += 1
            return obj.buf[:] if isinstance(obj, _Foreign) else None

        def prepare(self, kernel, grid, block, args, shared_mem, stream):
            arr = ndarray_of(args[0].view, True)
            return (lambda: stream._impl.submit(lambda: arr.fill(fill_value))), ()

    return Adapter


class _Foreign:
    def __init__(self, buf):
        self.buf = buf


def test_adapters_need_not_be_hashable_and_equal_ones_keep_their_own_coerce(host):
    import dataclasses
    b = sm.Buffer.empty(4, "float32", device=host)

    @dataclasses.dataclass  # eq=True: __hash__ is None
    class Unhashable(_foreign_adapter(7.0)):
        tag: str = "a"

        def __post_init__(self):
            self.calls = 0

    class Equal(_foreign_adapter(0.0)):  # every instance equal to every other, one hash
        def __init__(self, value):
            super().__init__()
            self.value = value

        def __eq__(self, other):
            return isinstance(other, Equal)

        def __hash__(self):
            return 1

        def prepare(self, kernel, grid, block, args, shared_mem, stream):
            arr = sm.backends.host.ndarray_of(args[0].view, True)
            v = self.value
            return (lambda: stream._impl.submit(lambda: arr.fill(v))), ()

    K1 = type("K1", (), {"__name__": "k1"})
    K2 = type("K2", (), {"__name__": "k2"})
    K3 = type("K3", (), {"__name__": "k3"})
    first, second = Equal(1.0), Equal(2.0)
    sm.register_kernel_adapter(K1, Unhashable())
    sm.register_kernel_adapter(K2, first)
    sm.register_kernel_adapter(K3, second)
    try:
        sm.launch(K1(), 1, 1, _Foreign(b)).result()
        assert b.to_host().tolist() == [7.0] * 4
        sm.launch(K2(), 1, 1, _Foreign(b)).result()
        assert b.to_host().tolist() == [1.0] * 4
        sm.launch(K3(), 1, 1, _Foreign(b)).result()
        assert b.to_host().tolist() == [2.0] * 4
        assert (first.calls, second.calls) == (1, 1)
    finally:
        from sharedmem import launch as _launch_module  # noqa: F401
        L = sys.modules["sharedmem.launch"]
        with L._reg_lock:
            for k in (K1, K2, K3):
                L._adapters.pop(k, None)


def test_submit_refuses_uses_that_are_not_view_token_pairs(host):
    from sharedmem.runtime.submission import submit
    b = sm.Buffer.empty(4, "float32", device=host)
    s = host.create_stream()
    for bad in ([(object(), True)], [b._token], [(b._token,)], [[b._token, True]]):
        with pytest.raises(TypeError, match=r"^submit\(\) takes uses as \(ViewToken, writes\) pairs, got "):
            submit(s, bad, lambda: None)
    assert sm.stats().in_flight == 0 and b.allocation.tracker.streams_locked() == []


def test_a_trace_hook_that_fails_leaves_the_launch_tracked(host, monkeypatch, tmp_path):
    """The trace hears of a submission after the work is enqueued: an NVTX call (or an
    adapter's label) that raises there left the launch running with no submission keeping
    its memory. Now the submission stands and the error comes at the next API call."""
    import types

    from host_kernels import slow_fill

    def broken(**kw):
        raise RuntimeError("nvtx broke")

    monkeypatch.setitem(sys.modules, "nvtx", types.SimpleNamespace(
        start_range=broken, end_range=lambda r: None))
    s = host.create_stream("traced")
    b = sm.Buffer.zeros(8, "float32", device=host)
    sm.synchronize()
    with sm.trace(None, nvtx=True):
        fut = sm.launch(slow_fill, 1, 1, sm.Out(b), 3.0, 0.2, stream=s)  # (does not raise)
        with pytest.raises(RuntimeError, match="^nvtx broke$"):
            sm.stats()  # (the next API call)
        assert sm.stats().in_flight == 1 and not fut.done()  # tracked while it runs
    fut.result(5)
    assert b.to_host().tolist() == [3.0] * 8
    sm.synchronize()


def test_a_host_future_callback_that_raises_changes_neither_it_nor_the_others(host):
    """A HostFuture's callbacks run each on its own: one that raises does not overwrite the
    future's value, nor keep the callbacks after it from running; its error comes at the
    next API call."""
    from host_kernels import fill
    f = sm.launch(fill, 1, 1, sm.Out(sm.Buffer.zeros(4, "float32", device=host)), 1.0)
    h = f.then(lambda _: 42)
    h.result(5)
    ran = []

    def boom(_f):
        raise ValueError("callback boom")

    h2 = f.then(lambda _: 7)
    h2.result(5)
    g = sm.HostFuture() if hasattr(sm, "HostFuture") else type(h)()
    g.add_done_callback(boom)
    g.add_done_callback(lambda fut: ran.append(fut.result()))
    g._set("value", None)
    g._set("second", None)  # (set once: ignored)
    assert g.result() == "value" and ran == ["value"] and h.result() == 42
    with pytest.raises(ValueError, match="^callback boom$"):
        sm.stats()  # (the next API call re-raises it)
    sm.synchronize()


def test_a_callback_worker_keeps_no_callback_alive_once_it_ran(host):
    """The callbacks a worker ran are dropped at once, not kept until the next batch: a view
    a callback captured can be moved as soon as the callback has run (nobody waits on the
    future: the retirer hands its callbacks to a worker)."""
    from host_kernels import slow_fill
    s = host.create_stream("handed off")
    buf = sm.Buffer.zeros(8, "float32", device=host)
    head = buf[0:4]
    ran = threading.Event()
    f = sm.launch(slow_fill, 1, 1, head, 1.0, 0.05, stream=s)
    f.add_done_callback(lambda _f, v=head: ran.set())
    del head, f
    assert ran.wait(5)
    time.sleep(0.2)  # (the worker unwinds the callback's frame)
    gc.collect()
    assert sm.Tensor.from_buffer(buf, (8,)).shape == (8,)  # (AliasError while kept)
    sm.synchronize()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_trace_belongs_to_the_process_that_began_it(host, tmp_path):
    """A child forked inside ``with sm.trace(path):`` starts untraced (it may trace), and
    leaving the block there writes nothing over the parent's file; a trace object used
    again records anew."""
    path = tmp_path / "t.json"
    tr = sm.trace(str(path))
    with tr:
        pid = os.fork()
        if pid == 0:
            try:
                with sm.trace(str(tmp_path / "child.json")):
                    pass
                tr.__exit__(None, None, None)
                os._exit(0 if not (tmp_path / "t.json").exists() else 3)
            except BaseException:
                os._exit(4)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert path.exists() and (tmp_path / "child.json").exists()
    with tr:  # (used again)
        pass
    assert path.exists()



def test_a_callback_error_no_api_call_re_raised_is_reported_at_exit(tmp_path):
    """An error a callback raised is re-raised at the next API call; when none comes, the
    interpreter's exit says so (it was dropped without a word)."""
    import subprocess
    script = tmp_path / "late_error.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r}]\n"
        "import sharedmem as sm\n"
        "from host_kernels import slow_fill\n"
        "dev = sm.Device.host()\n"
        "b = sm.Buffer.zeros(4, 'float32', device=dev)\n"
        "sm.synchronize()\n"
        "f = sm.launch(slow_fill, 1, 1, sm.Out(b), 1.0, 0.05, stream=dev.create_stream('x'))\n"
        "f.add_done_callback(lambda _f: 1 / 0)\n"
        "del f\n"
        "time.sleep(0.5)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ("RuntimeWarning: sharedmem: 1 error(s) raised in callbacks (then(), "
            "add_done_callback) or trace hooks were never re-raised, for no API call came "
            "after them: ZeroDivisionError('division by zero')") in r.stderr


def test_a_callback_run_inline_may_wait_for_one_queued_after_it(host):
    """A user thread (or a host stream's worker) that retires work runs its callbacks inline;
    one that waits for a future a later callback sets handed nothing on there and waited its
    whole timeout. It hands the rest to the callback workers, as a worker does."""
    from sharedmem.runtime import callbacks
    later = sm.HostFuture()
    got = []
    t0 = time.monotonic()
    callbacks.run([lambda: got.append(later.result(5)), lambda: later._set(7, None)])
    assert got == [7] and time.monotonic() - t0 < 2
    sm.stats()  # (no deferred error: nothing timed out)


def test_a_move_inside_a_callback_does_not_wait_for_its_own_batch(host):
    """A move that meets an alias first lets finished work drop what it kept (settle()); run
    inside a callback, it waited its whole second for the very batch whose callbacks it runs."""
    from host_kernels import fill
    s = host.create_stream("moves in callbacks")
    b = sm.Buffer.zeros(4, "float32", device=host)
    x = sm.Buffer.zeros(8, "float32", device=host)
    alias = x[0:2]
    took = []

    def cb(_f):
        t0 = time.monotonic()
        with pytest.raises(sm.AliasError):
            sm.Tensor.from_buffer(x, (8,))
        took.append(time.monotonic() - t0)

    for _ in range(3):
        f = sm.launch(fill, 1, 1, sm.Out(b), 1.0, stream=s)
        f.add_done_callback(cb)
        f.result(5)
    deadline = time.monotonic() + 10  # (a callback the retirer handed off runs on a worker)
    while len(took) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(took) == 3 and max(took) < 0.5, took
    del alias


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (fork with threads running)
def test_in_a_forked_child_a_callback_added_to_retired_work_runs_at_once(host):
    """Work retired in the parent, its callbacks queued for a busy callback worker when the
    process forks: the child drops the parent's queue (model.md) -- and a callback the child
    adds to that work runs at once, as for any retired work (it was joined to the dropped
    list, and a then() or await on it never finished)."""
    from host_kernels import fill
    a = sm.Buffer.zeros(4, "float32", device=host)
    b = sm.Buffer.zeros(4, "float32", device=host)
    gate, busy = threading.Event(), threading.Event()
    f1 = sm.launch(fill, 1, 1, a, 1.0, stream=host.create_stream())
    f1.add_done_callback(lambda _f: (busy.set(), gate.wait(10)))  # occupies the worker
    assert busy.wait(5)
    f2 = sm.launch(fill, 1, 1, b, 2.0, stream=host.create_stream())
    f2.add_done_callback(lambda _f: None)  # queued for the busy worker
    deadline = time.monotonic() + 5
    while f2._s.state == 0 and time.monotonic() < deadline:  # (retired)
        time.sleep(0.01)
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            hit = []
            f2.add_done_callback(lambda _f: hit.append(1))
            h = f2.then(lambda _: "cont")
            code = 10 * len(hit) + (h.done() and h.result(0) == "cont")
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    gate.set()
    assert os.waitstatus_to_exitcode(status) == 11  # the callback ran (10), then() done (1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (fork with threads running)
def test_a_fork_with_queued_callbacks_of_a_dropped_stream_does_not_hang_the_child(host):
    """Submissions whose callbacks wait for a busy callback worker when the process forks,
    their futures and streams kept by nothing else: the child's fork hook drops the parent's
    queue, and the child must start. (Since 1ffa5e2 it hangs in that hook: `item.callbacks =
    None` breaks the submission <-> callback cycle, so dropping the queue frees a stream
    inside the hook, and the stream's finalizer put()s on a task queue whose lock the fork
    still holds -- host.py's child hook, order 1, releases it after callbacks', order 0.)"""
    import signal
    from host_kernels import fill
    gate, busy = threading.Event(), threading.Event()
    for _ in range(3):  # the first occupies the worker, the others are queued behind it
        f = sm.launch(fill, 1, 1, sm.Buffer.zeros(4, "float32", device=host), 1.0,
                      stream=host.create_stream())
        f.add_done_callback(lambda _f: (busy.set(), gate.wait(10)))
    del f
    assert busy.wait(5)
    time.sleep(0.3)  # (all retired)
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    code = None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    gate.set()
    assert code == 7, "the forked child hung in its at-fork hook"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (fork with threads running)
def test_in_a_forked_child_then_on_an_applied_value_queued_in_the_parent_finishes(host):
    """As for a launch's future (above): the computation of an apply() value, queued for a
    busy callback worker when the process forked, is dropped in the child -- a then() the
    child adds computes it, and finishes."""
    from host_kernels import fill
    a = sm.Buffer.zeros(4, "float32", device=host)
    b = sm.Buffer.zeros(4, "float32", device=host)
    gate, busy, hold = threading.Event(), threading.Event(), threading.Event()

    @sm.host_kernel
    def held():
        hold.wait(5)

    f1 = sm.launch(fill, 1, 1, a, 1.0, stream=host.create_stream())
    f1.add_done_callback(lambda _f: (busy.set(), gate.wait(10)))  # occupies the worker
    assert busy.wait(5)
    s = host.create_stream()
    sm.launch(held, 1, 1, stream=s)  # (the op's work is pending when its future is made)
    f2 = sm.op(fill, 1, 1, b, 2.0).apply(lambda v: "value").submit(s)
    hold.set()
    deadline = time.monotonic() + 5
    while f2._s.state == 0 and time.monotonic() < deadline:  # (retired)
        time.sleep(0.01)
    time.sleep(0.05)
    computed_before = f2.done()
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            h = f2.then(lambda v: v + "-cont")
            try:
                code = 1 if h.result(2) == "value-cont" else 2
            except TimeoutError:
                code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    gate.set()
    assert os.waitstatus_to_exitcode(status) == 1  # 3: the then() never ran
    assert f2.result(5) == "value"


_FORK_GC = r"""
import gc, os
import sharedmem as sm
from sharedmem.runtime import state

host = sm.Device.host()
sm.Buffer.zeros(4, "float32", device=host)  # (the host pool exists: its fork hold is filed)
pool = host.backend.pool


class Cycle:
    pass


c = Cycle()
c.self, c.block = c, pool.allocate(64)  # a HostBlock in a reference cycle
holder = [c]
del c


def take():  # (after the pool's hold: the fork holds the pool's lock now)
    holder.clear()  # the cycle is garbage: the next allocation collects it (as one may in
    gc.set_threshold(1)  # any fork: the hooks and os.fork allocate)


state.at_fork_hold(take, lambda: None)
pid = os.fork()
if pid == 0:
    os._exit(7)
gc.set_threshold(700)
print("child", os.waitpid(pid, 0)[1] >> 8)
"""


@fork_only
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (3.12: fork of a threaded process)
def test_a_collection_while_a_fork_holds_the_host_pool_does_not_deadlock():
    """A garbage collection that comes while the fork holds the host pool's lock (an
    allocation in a fork hook starts it) finalizes a HostBlock, which gives its block back
    under that lock: the forking thread waited for itself -- parent and child hung (before,
    in _after_fork_parent's reversed(): HostBlock.__del__ -> _give_back). The collector is
    off while the fork holds sharedmem's locks."""
    import os
    import signal
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", _FORK_GC], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # (the parent and its hung child)
        p.communicate()
        pytest.fail("the fork deadlocked: a collection ran HostBlock.__del__ under the pool lock")
    assert p.returncode == 0 and out.strip() == "child 7", (out, err)


_FORK_TWO_THREADS = r"""
import gc, os, threading, time
import sharedmem as sm
from sharedmem.runtime import state

rt = state.RUNTIME
rt.acquire()  # (the core lock busy, as under an API call: both forks wait for it in the hook)
res = {}


def fork(name):
    pid = os.fork()
    if pid == 0:
        os._exit(10 + gc.isenabled())
    res[name] = os.waitpid(pid, 0)[1] >> 8


a = threading.Thread(target=fork, args=("a",))
a.start()
time.sleep(0.3)
b = threading.Thread(target=fork, args=("b",))
b.start()
time.sleep(0.3)
rt.release()
a.join()
b.join()
free = threading.Thread(target=lambda: (rt.acquire(), rt.release()), daemon=True)
free.start()  # (the core lock taken and given back by another thread: it is free)
free.join(5)
print(sorted(res.values()), gc.isenabled(), not free.is_alive(), flush=True)
os._exit(0)
"""


@fork_only
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (3.12: fork of a threaded process)
def test_two_threads_forking_at_once_leave_the_collector_on_and_the_core_lock_free():
    """Two threads fork at once (os.register_at_fork's before-hooks run before CPython's import
    lock, so both enter _before_fork): the second overwrote the first's "gc was on" with False
    (the first had turned it off) and its "core lock taken" while waiting for that lock --
    before, the collector stayed off in the parent and both children, and the second fork
    never gave the core lock back (every later API call hung). The flags are set once the
    core lock, which serializes the forks, is held."""
    import os
    import signal
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", _FORK_TWO_THREADS], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail("two concurrent forks hung")
    assert p.returncode == 0 and out.strip() == "[11, 11] True True", (out, err)


def test_a_finalized_host_stream_made_to_wait_waits_first_then_runs_its_later_work(host):
    """A wait filed on a host stream whose finalizer already stopped its worker (a hold's end
    in the same collection orders it after another stream) revives it: the new worker runs
    the wait before the work filed after it."""
    a, s = host.create_stream("waited for"), host.create_stream("revived by a wait")
    gate, order = threading.Event(), []
    m = a._impl.submit(lambda: (gate.wait(5), order.append("waited for")))
    s._impl.__del__()  # (what the collector's finalization does; the object lives on)
    s._impl.wait_marker(m)
    assert s._impl._finalized is False
    done = s._impl.submit(lambda: order.append("after the wait"))
    gate.set()
    assert done.wait(5) and order == ["waited for", "after the wait"]
    assert s._impl.fault is None
    s.synchronize()


def test_a_host_stream_impl_synchronizes_its_queue_and_refuses_while_capturing(host):
    """``HostStreamImpl.synchronize`` (the backend contract: ``Stream.synchronize`` asks the
    impl only of a borrowed stream, and host streams are never borrowed) waits for what was
    queued before it; on a capturing stream it is a CaptureError (nothing recorded)."""
    s = host.create_stream("impl synchronize")
    gate, ran = threading.Event(), []
    s._impl.submit(lambda: (gate.wait(5), ran.append(1)))
    threading.Timer(0.05, gate.set).start()
    s._impl.synchronize()
    assert ran == [1]
    with sm.capture(s) as g:
        with pytest.raises(sm.CaptureError, match=r"^a capturing stream cannot be "
                                                  r"synchronized$"):
            s._impl.synchronize()
        assert s._impl.recording == []
    assert g.launches == 0


@pytest.mark.parametrize("held", ["stream", "allocation", "pool block"])
def test_what_the_fork_itself_frees_does_not_hang_the_child(host, held):
    """A forked child frees what the parent's other threads held in their thread-locals before
    any at-fork hook runs -- while the fork still holds the host task queues', the allocation
    registry's and the host pool's locks. What was held only there is finalized at that moment
    on the forking thread: a stream's finalizer queued its worker's stop through its queue's
    lock, an allocation's removal from the registry took the registry's, a pool block's return
    the pool's -- each held by this very thread, and the child hung inside os.fork()."""
    local = threading.local()
    ready, leave = threading.Event(), threading.Event()

    def holder():  # (alive at the fork: its thread-locals are the child's to free)
        if held == "stream":
            local.x = host.create_stream("held by a thread-local")
            local.x.synchronize()
        elif held == "allocation":
            local.x = sm.Buffer.zeros(1000, device=host).allocation
        else:
            local.x = host.backend.pool.allocate(4096)
        sm.synchronize()
        ready.set()
        leave.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    assert ready.wait(10)
    try:  # (the child allocates, and reads back what it wrote)
        out = _in_child(lambda: sm.Buffer.zeros(10, device=host).to_host().tolist())
    finally:
        leave.set()
        t.join()
    assert out == str([0.0] * 10)


def test_registry_lookups_find_the_innermost_allocation_across_length_classes(host):
    """The registry keeps entries by length class (one walk bounded by the longest live
    allocation made a lookup among many small allocations beside one large one walk them
    all): the innermost containing allocation is still found, nested across classes, at a
    range's ends, for empty ranges, and nothing outside every allocation."""
    from sharedmem.allocation import Allocation
    arena = np.zeros(1 << 16, np.uint8)  # a foreign arena, allocations nested inside it
    base = arena.ctypes.data
    outer = Allocation(host, base, 1 << 16, None, "test arena")
    mid = Allocation(host, base + 4096, 4096, None, "test mid")
    small = [Allocation(host, base + 4096 + 64 * i, 64, None, "test small") for i in range(8)]
    assert sm.lookup_allocation(host, base + 4096 + 64 * 3 + 5, 10) is small[3]
    assert sm.lookup_allocation(host, base + 4096 + 64 * 3, 64) is small[3]
    assert sm.lookup_allocation(host, base + 4096 + 64 * 3, 65) is mid  # (spans two smalls)
    assert sm.lookup_allocation(host, base + 8192 - 1, 1) is mid
    assert sm.lookup_allocation(host, base + 8192, 1) is outer
    assert sm.lookup_allocation(host, base, 1 << 16) is outer
    assert sm.lookup_allocation(host, base + 4096 + 64 * 7 + 64, 0) is small[7]  # (empty, at
    assert sm.lookup_allocation(host, base + 4096 + 64 * 8 + 1, 0) is mid        # its end)
    assert sm.lookup_allocation(host, base + (1 << 16), 1) is None
    del small
    gc_collect_harder()  # (their entries removed: the mid one is found there again)
    assert sm.lookup_allocation(host, base + 4096 + 5, 10) is mid
    del mid, outer, arena


def test_registry_lookups_at_the_top_of_the_address_space(host):
    """Compiled, a lookup compares C integers: ranges ending at 2**64 (whose sums would wrap
    to 0 in 64 bits) are found or not as the arithmetic says, found last or walked, and
    ranges past the address space (or longer than an allocation can be) are in none."""
    from sharedmem.allocation import Allocation
    top = Allocation(host, (1 << 64) - 4096, 4096, None, "test top")  # (never dereferenced)
    end = 1 << 64
    for _ in range(2):  # (walked, then found as the one found last)
        assert sm.lookup_allocation(host, end - 8, 8) is top
        assert sm.lookup_allocation(host, end - 4096, 4096) is top
    assert sm.lookup_allocation(host, end - 4096, 4097) is None
    assert sm.lookup_allocation(host, end - 8, 9) is None
    assert sm.lookup_allocation(host, end, 0) is None
    assert sm.lookup_allocation(host, end + 8, 8) is None
    assert sm.lookup_allocation(host, end - 8, 1 << 63) is None
    assert sm.lookup_allocation(host, end - 4097, 8) is None  # (below it: nothing there)
    low = Allocation(host, end - 3 * 4096, 4096, None, "test low")
    assert sm.lookup_allocation(host, end - 2 * 4096 - 8, 8) is low
    assert sm.lookup_allocation(host, end - 100, 200) is None  # (its end would wrap to 100)
    assert sm.lookup_allocation(host, end - 8, 8) is top
    del top, low


def test_registry_lookups_inside_allocations_of_2_gib_or_more(host):
    """Compiled, a length class's span (``1 << c``) is a 64-bit shift: a C int shift is
    undefined from 31 (x86 shifts by c % 32), and a lookup walked inside an allocation of
    2 GiB or more (a torch segment, a CuPy arena of a large array) found nothing -- an import
    there then made a second allocation over the same memory."""
    from sharedmem.allocation import Allocation, import_allocation
    base = 1 << 44  # (never dereferenced)
    other = Allocation(host, 4096, 4096, None, "test other")
    for size in (1 << 30, (1 << 31) + 8, 1 << 32, 3 << 31, 1 << 40, 1 << 62):
        a = Allocation(host, base, size, None, "test big")
        for off in (size // 2, 4096, size - 8, 0):
            # (another found last first: the lookup walks, not the one found last tried)
            assert sm.lookup_allocation(host, 4096, 8) is other
            assert sm.lookup_allocation(host, base + off, 8) is a, (hex(size), hex(off))
        assert sm.lookup_allocation(host, 4096, 8) is other
        assert import_allocation(host, base + size // 2, 8, "test") is a
        del a
    del other


def test_an_import_that_races_a_registration_looks_again(host, monkeypatch):
    """import_allocation holds no lock across its lookup and its registration: the new
    allocation registers only if nothing registered since the lookup, else the lookup runs
    again -- here an import of the same range by another thread lands in between, and both
    get the one allocation."""
    import sharedmem.allocation as A
    reg = A._registry
    if not hasattr(reg, "__dict__"):
        pytest.skip("compiled: the registry's methods cannot be patched")
    arena = np.zeros(4096, np.uint8)
    base = arena.ctypes.data
    theirs = []
    real = reg.lookup

    def lookup(dkey, ptr, nbytes):
        found = real(dkey, ptr, nbytes)
        if found is None and not theirs:  # (the first miss: the other import lands now)
            theirs.append(None)
            theirs[0] = A.import_allocation(host, base + 64, 8, "test theirs",
                                            region=(base, 4096))
        return found

    monkeypatch.setattr(reg, "lookup", lookup, raising=False)
    gen = reg._gen
    live = A.live_allocation_count()
    mine = A.import_allocation(host, base + 128, 16, "test mine", region=(base, 4096))
    monkeypatch.undo()
    assert mine is theirs[0] and mine.source == "test theirs"
    assert A.live_allocation_count() == live + 1 and reg._gen == gen + 1
    assert sm.lookup_allocation(host, base + 128, 16) is mine
    del mine, theirs, arena


def test_imports_of_one_range_from_many_threads_make_one_allocation(host):
    """Threads importing ranges of one memory at once (and another registering allocations
    elsewhere, so that imports look again) all get one allocation a round."""
    from sharedmem.allocation import Allocation, import_allocation
    arena = np.zeros(1 << 16, np.uint8)
    base = arena.ctypes.data
    rounds, n = 60, 6
    barrier = threading.Barrier(n + 1)
    got = [[None] * n for _ in range(rounds)]
    same = [[None] * n for _ in range(rounds)]
    stop = threading.Event()
    errors = []

    def importer(k):
        try:
            for r in range(rounds):
                barrier.wait(10)
                lo = base + (r % 16) * 4096
                got[r][k] = import_allocation(host, lo + 8 * k, 8, "test", region=(lo, 4096))
                barrier.wait(10)
                same[r][k] = got[r][k] is got[r][0]  # (compared while all live)
                barrier.wait(10)
                got[r][k] = None
        except Exception as e:  # pragma: no cover (reported below)
            errors.append(e)
            barrier.abort()

    def other():
        while not stop.is_set():
            Allocation(host, 1 << 40, 64, None, "test other")  # (registered, then gone)

    ths = [threading.Thread(target=importer, args=(k,)) for k in range(n)]
    noise = threading.Thread(target=other)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        noise.start()
        for th in ths:
            th.start()
        for r in range(rounds):
            barrier.wait(10)
            barrier.wait(10)
            barrier.wait(10)
    finally:
        stop.set()
        for th in ths + [noise]:
            th.join(10)
        sys.setswitchinterval(interval)
    assert not errors
    assert all(all(row) for row in same)
    del arena


def test_the_allocation_a_lookup_found_last_is_tried_first_only_while_nothing_overlaps_it(
        host):
    """A lookup tries the allocation found last before the walk (a torch tensor new to a
    launch lies in the segment the one before did) -- only where no allocation overlapped it
    as either registered: one registered inside it later, or around it, is still found as
    the innermost."""
    from sharedmem.allocation import Allocation, _registry
    arena = np.zeros(1 << 16, np.uint8)
    base = arena.ctypes.data
    outer = Allocation(host, base, 1 << 16, None, "test arena")
    dev = _registry._maps[host.key]

    def entry(a):  # (the registry's entry of allocation a)
        return next(r for cl in dev.walk for r in cl.refs if r() is a)

    assert sm.lookup_allocation(host, base + 64, 8) is outer
    assert dev.last is entry(outer) and not dev.last.overlapped  # (tried first now)
    inner = Allocation(host, base + 4096, 64, None, "test inner")  # registered inside it
    assert entry(outer).overlapped and entry(inner).overlapped
    assert sm.lookup_allocation(host, base + 4096 + 8, 8) is inner
    assert sm.lookup_allocation(host, base + 64, 8) is outer
    # one registered around allocations found before: they are inner to it
    small = Allocation(host, base + (1 << 16) + 4096, 32, None, "test small")
    assert sm.lookup_allocation(host, base + (1 << 16) + 4096, 32) is small
    assert dev.last is entry(small) and not dev.last.overlapped
    around = Allocation(host, base + (1 << 16), 1 << 14, None, "test around")
    assert entry(small).overlapped and entry(around).overlapped
    assert sm.lookup_allocation(host, base + (1 << 16) + 4096 + 1, 4) is small
    assert sm.lookup_allocation(host, base + (1 << 16) + 8, 4) is around
    # adjacent allocations do not overlap: each is tried first alone
    beside = Allocation(host, base + (1 << 16) + (1 << 14), 128, None, "test beside")
    assert not entry(beside).overlapped
    assert sm.lookup_allocation(host, beside.ptr, 128) is beside
    assert dev.last is entry(beside)
    assert sm.lookup_allocation(host, beside.ptr + 4, 4) is beside
    # an empty allocation overlaps nothing, and nothing overlaps it
    empty = Allocation(host, beside.ptr + 8, 0, None, "test empty")
    assert not entry(empty).overlapped and not entry(beside).overlapped
    live = _registry._live
    inner_ref = entry(inner)
    del inner, small
    gc_collect_harder()  # (their entries gone; a lookup's remembered entry with them)
    assert _registry._live == live - 2
    assert all(r is not inner_ref for cl in dev.walk for r in cl.refs)
    assert sm.lookup_allocation(host, base + 4096 + 8, 8) is outer
    assert dev.last is entry(outer)
    assert all(len(cl.starts) == len(cl.refs) and cl.starts == sorted(cl.starts)
               and cl.starts == [r.ptr for r in cl.refs] for cl in dev.walk)
    del outer, around, beside, empty, arena


class _Counted:  # (an object the collector counts)
    pass


def _collections_under_the_registry_lock(run) -> list:
    """The generations of the collections that started while the registry lock was held,
    during ``run()``."""
    import gc
    from sharedmem.allocation import _registry
    under = []

    def cb(phase, info):
        if phase == "start" and _registry._lock.locked():
            under.append(info["generation"])

    gc.callbacks.append(cb)
    try:
        run()
    finally:
        gc.callbacks.remove(cb)
    return under


def test_no_collection_starts_while_the_registry_lock_is_held(host):
    """Nothing under the registry lock may allocate a GC-tracked object: a collection there
    runs finalizers that take the lock (an allocation dying in a cycle: its entry's
    removal), on the thread that holds it. Interpreted, ``a, b, c, d = x[0], x[1], x[2],
    x[3]`` builds a 4-tuple (CPython turns only 2 or 3 names into swaps): new, and so a
    possible collection, whenever no freed 4-tuple is at hand."""
    import gc
    from sharedmem.allocation import Allocation
    arena = np.zeros(1 << 12, np.uint8)
    base = arena.ctypes.data
    outer = Allocation(host, base, 1 << 12, None, "test arena")
    old = gc.get_threshold()

    def run():
        for k in range(12):
            for op in ("lookup", "register"):
                hold = [(i, i, i, i) for i in range(3000)]  # no freed 4-tuple left to reuse
                xs = [_Counted() for _ in range(k % 3)]  # (the collector's count, by phase)
                gc.set_threshold(1)
                try:
                    if op == "lookup":
                        sm.lookup_allocation(host, base + 8, 8)
                    else:
                        Allocation(host, base + 64, 64, None, "test inner")
                finally:
                    gc.set_threshold(*old)
                del hold, xs

    under = _collections_under_the_registry_lock(run)
    assert not under, f"{len(under)} collections started under the registry lock"
    del outer, arena


def test_no_collection_starts_under_the_registry_lock_while_a_trace_function_is_set(host):
    """A trace function (coverage's Python tracer, a debugger) runs at every Python call: a
    Python function called under the registry lock -- interpreted, a bisection helper --
    runs it there, and its allocations (the frame object, the tracer's own) may start a
    collection whose finalizers take the lock. Under the lock only C code runs."""
    import gc
    from sharedmem.allocation import Allocation, import_allocation
    arena = np.zeros(1 << 13, np.uint8)
    base = arena.ctypes.data
    outer = Allocation(host, base, 1 << 12, None, "test arena")

    def tracer(frame, event, arg):  # (allocates, as a tracer written in Python does)
        _Counted()

    old, old_trace = gc.get_threshold(), sys.gettrace()

    def run():
        for op in ("lookup", "register", "remove", "import"):
            keep = [Allocation(host, base + 128, 64, None, "test inner")] if op == "remove" \
                else []
            gc.set_threshold(1)
            sys.settrace(tracer)
            try:
                if op == "lookup":
                    sm.lookup_allocation(host, base + 8, 8)
                elif op == "register":
                    Allocation(host, base + 64, 64, None, "test inner")
                elif op == "remove":
                    keep.clear()  # (its allocation dies here: the entry's removal)
                else:
                    import_allocation(host, base + (1 << 12), 16, "test import")
            finally:
                sys.settrace(old_trace)
                gc.set_threshold(*old)

    under = _collections_under_the_registry_lock(run)
    assert not under, f"{len(under)} collections started under the registry lock"
    del outer, arena


def test_the_host_pool_keeps_at_most_its_cache_limit_of_free_blocks(host, monkeypatch):
    """Blocks of sizes that never come again were cached for good (random sizes of up to
    512 KiB: 554 MiB cached after 3,000). Past POOL_CACHE_MAX a block given back is freed;
    sizes that do come again are still reused."""
    import sharedmem.backends.host as hb
    pool = host.backend.pool
    pool.free_all_blocks()
    monkeypatch.setattr(hb, "POOL_CACHE_MAX", 1 << 20)
    for i in range(64):
        sm.Buffer.empty(16384 + 256 * i, "uint8", device=host).release()  # (64 size classes)
    gc_collect_harder()
    assert 0 < pool.cached <= 1 << 20
    ptr = sm.Buffer.empty(16384, "uint8", device=host).ptr
    gc_collect_harder()
    assert sm.Buffer.empty(16384, "uint8", device=host).ptr == ptr  # (reused at once)
    pool.free_all_blocks()
    assert pool.cached == 0


def test_a_trace_that_cannot_be_written_fails_at_once_and_never_hides_the_blocks_error(
        host, tmp_path):
    """sm.trace("/no/such/dir/run.json") failed only as the block ended -- its
    FileNotFoundError replacing the error the block raised. A path that cannot be written is
    an OSError as the block begins; a write failing at the end leaves the block's error."""
    with pytest.raises(OSError, match=r"^sm\.trace cannot write '.*run\.json': its directory "
                                      r"is missing or not writable$"):
        with sm.trace(str(tmp_path / "no" / "such" / "run.json")):
            pytest.fail("the block ran")
    with pytest.raises(OSError, match=r"it is a directory$"):
        with sm.trace(tmp_path):
            pass

    class StageFailed(Exception):
        pass
    path = tmp_path / "run.json"
    with pytest.raises(StageFailed):
        with sm.trace(path) as tr:
            sm.Buffer.zeros(4, "float32", device=host).fill_zero().result()
            path.mkdir()  # (the file cannot be written now)
            raise StageFailed
    assert tr.events


def test_reprs_say_when_a_future_failed_or_its_value_is_computing(host):
    """A DeviceFuture whose host kernel raised said "done"; a composite op's value said "done"
    while its function still ran and when it failed."""
    import threading
    b = sm.Buffer.zeros(4, "float32", device=host)

    @sm.host_kernel
    def bad(x):
        raise ValueError("row 3")
    f = sm.launch(bad, 1, 1, b)
    f.exception(5)
    assert repr(f).endswith(": failed: ValueError('row 3')>"), repr(f)
    gate = threading.Event()
    c = sm.op(sm.host_kernel(lambda x: None), 1, 1, b).apply(lambda v: gate.wait(5)).submit()
    assert repr(c).startswith("<DeviceFuture (a composite op's value, last host kernel ")
    assert repr(c).endswith(": pending>") and not c.done()
    gate.set()
    c.result(5)
    assert repr(c).endswith(": done>")


def test_an_inflight_entry_of_work_without_arrays_says_it_leases_nothing(host):
    """``str(InFlight)`` of work with no array arguments ended in "leases " and nothing."""
    import threading
    gate = threading.Event()
    f = sm.launch(sm.host_kernel(lambda: gate.wait(5)), 1, 1)
    try:
        (entry,) = [e for e in sm.inflight() if "lambda" in e.label]
        assert str(entry).endswith(" leases nothing"), str(entry)
    finally:
        gate.set()
    f.result(5)


def _work_the_retirer_finishes_slowly(host):
    """A host launch (50 ms) of an import whose producer -- dropped when the work retires --
    has a finalizer that, on the retirer thread, sets ``inside`` and waits for ``go``: the
    retirer is then in finish() for that work. Returns ``(inside, go, future)``."""
    inside, go = threading.Event(), threading.Event()

    class Producer(np.ndarray):
        def __del__(self):
            if threading.current_thread().name == "sharedmem-retirer":
                inside.set()
                go.wait(10)

    x = np.zeros(4, np.float32).view(Producer)
    t = sm.from_dlpack(x)  # (the import keeps x: dropped when the work that used it retires)
    del x
    s = host.create_stream()
    return inside, go, sm.launch(sm.host_kernel(lambda a: time.sleep(0.05)), 1, 1, sm.In(t),
                                 stream=s)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (3.12: fork of a threaded process)
def test_a_fork_while_the_retirer_finishes_work_leaves_the_child_nothing_unfinished(host):
    """The retirer retires work under the core lock and drops what it kept after it
    (finish()); RUNTIME.unfinished counts the retired work not finished yet, and settle()
    -- run by every move that finds an alias -- waits until it is 0. A fork while the
    retirer is in finish() (here: dropping an imported array's producer, whose finalizer
    is slow) copies the count into a child where no thread will ever finish that work: the
    count stayed above 0 for good, and every refused move in the child waited settle()'s
    whole second first."""
    from sharedmem.runtime.state import RUNTIME
    inside, go, f = _work_the_retirer_finishes_slowly(host)
    del f  # (dropped: the retirer finishes the work)
    try:
        assert inside.wait(10)  # the retirer is in finish(): the work is counted unfinished
        assert RUNTIME.unfinished >= 1

        def child():
            b = sm.Buffer.zeros(8, device=host)
            alias = b[0:2]
            t0 = time.monotonic()
            with pytest.raises(sm.AliasError):
                sm.Tensor.from_buffer(b, (8,))
            return RUNTIME.unfinished, time.monotonic() - t0 < 0.5, alias.is_live

        out = _in_child(child)
    finally:
        go.set()
    assert out == str((0, True, True)), out
    sm.synchronize()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (3.12: fork of a threaded process)
def test_in_a_child_forked_while_the_retirer_finishes_work_a_callback_added_to_it_runs(host):
    """A fork while the retirer is in finish() for work that has callbacks -- retired, what
    it kept being dropped (here: an imported array's producer, whose finalizer is slow), its
    callbacks not handed off yet: in the child no thread will ever run that list. The child
    drops it, as it drops what the parent had queued for its callback workers (model.md),
    so a callback the child adds to that work runs at once -- before, it joined the orphaned
    list, and never ran: a then() or to_concurrent() of it never finished."""
    ran = []
    inside, go, f = _work_the_retirer_finishes_slowly(host)
    f.add_done_callback(lambda _f: ran.append(os.getpid()))  # (the parent's: runs there)
    try:
        assert inside.wait(10)  # the retirer is in finish(), the callback not handed off yet

        def child():
            hit = []
            f.add_done_callback(lambda _f: hit.append(1))
            h = f.then(lambda _: "cont")
            return len(hit), h.result(2), ran

        out = _in_child(child)
    finally:
        go.set()
    assert out == str((1, "cont", [])), out
    f.result(5)
    deadline = time.monotonic() + 5
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == [os.getpid()]  # the parent ran its own callback


_ALIVE_TO_THE_END_SCRIPT = """
import collections
import numpy as np
import sharedmem as sm
from interop.cupy_launch import _ExportOwner

b = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=sm.Device.host())
view = b[1:3]
owner = _ExportOwner(b.allocation.new_token("as_cupy export", 0, 16, True, None))
cycle = [view, owner]
cycle.append(cycle)
collections._kept_to_the_end = cycle  # (a module's global: gone in the last collection)
del view, owner, cycle
print(b.allocation.live_views)
"""


def test_views_and_export_owners_alive_to_the_end_let_the_process_exit_cleanly():
    """Objects that hold a live token until the interpreter's last collection -- a view, and
    the owner of an ``as_cupy`` array's memory (CuPy's pointer keeps it), here in a cycle
    another module keeps -- die after the modules are torn down: they give nothing back
    then (there is nothing to give back at exit). The owner's release crashed the compiled
    build there (exit status 139)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    import subprocess
    r = subprocess.run([sys.executable, "-c", _ALIVE_TO_THE_END_SCRIPT], capture_output=True,
                       text=True, env=env, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (0, "3\n", "")


_COLLECTION_UNDER_THE_REGISTRY_LOCK = r"""
import bisect, gc, types
import numpy as np
import sharedmem as sm
import sharedmem.allocation as A

host = sm.Device.host()
reg = A._registry
arena = np.zeros(1 << 12, np.uint8)
base = arena.ctypes.data
outer = A.Allocation(host, base, 1 << 12, None, "test arena")
armed = []


def collecting(f):  # (a collection where Python 3.12 on starts one: at a call under the lock)
    def g(*args):
        if armed and reg._lock.locked():
            armed.clear()
            gc.collect()
        return f(*args)
    return g


A.bisect = types.SimpleNamespace(bisect_right=collecting(bisect.bisect_right))
gc.disable()
for op in ("lookup", "register", "remove"):
    victim = A.Allocation(host, base + 1024, 8, None, "test victim")
    cycle = [A.Allocation(host, base + 2048, 64, None, "test cycle")]
    cycle.append(cycle)
    live = A.live_allocation_count()
    del cycle  # (garbage: its allocation dies in the collection, its entry's removal there)
    armed.append(True)
    if op == "lookup":
        assert sm.lookup_allocation(host, base + 8, 0) is outer
    elif op == "register":
        inner = A.Allocation(host, base + 64, 64, None, "test inner")
        live += 1
    else:
        del victim  # (its removal, under the lock, starts the collection)
        live -= 1
    assert not armed and A.live_allocation_count() == live - 1 and not reg._staged, op
    assert all(r() is not None for d in reg._maps.values() for cl in d.walk for r in cl.refs)
    victim = inner = None
print("ok")
"""


def test_a_collection_under_the_registry_lock_removes_its_entries_after_it():
    """Interpreted, a collection may start under the registry lock (Python 3.12 on runs one at
    the next call or loop jump after the allocation that asked for it, made before the lock
    was taken or by another thread; a profile function runs at every call of a builtin). An
    allocation dying there ran its entry's removal, which waited for the lock its own thread
    held: a hang. It is staged, and done by that operation once it let the lock go. A fresh
    interpreter: a hang must not take the suite with it."""
    import subprocess
    import sharedmem.allocation as A
    if not hasattr(A._registry, "__dict__"):
        pytest.skip("compiled: no Python code runs under the registry lock")
    r = subprocess.run([sys.executable, "-c", _COLLECTION_UNDER_THE_REGISTRY_LOCK],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.split()) == (0, ["ok"]), r.stderr[-2000:]


# A profile function that starts one collection as ``lock.acquire()`` returns, the lock held:
# where Python 3.12 on runs a collection that an allocation made before (or by another thread)
# asked for -- at the check after the call -- and where a profile function runs on 3.11.
_COLLECT_AS_ACQUIRE_RETURNS = r"""
import gc, sys
armed = []


def collect_as_acquire_returns(lock, first_event=False):
    # (first_event: at the first event that finds the lock held -- where its acquire() is
    # called from compiled code, which reports no event, the return to Python code after it;
    # only for a lock no other thread takes meanwhile)
    def prof(frame, event, arg):
        if armed and lock.locked() and (first_event or (
                event == "c_return" and getattr(arg, "__self__", None) is lock and
                getattr(arg, "__name__", "") == "acquire")):
            armed.clear()
            gc.collect()
    return prof
"""

_COLLECTION_UNDER_THE_HOST_POOL_LOCK = _COLLECT_AS_ACQUIRE_RETURNS + r"""
import sharedmem as sm

pool = sm.Device.host().backend.pool
gc.disable()
for op in ("allocate", "free_all_blocks", "give back"):
    victim = pool.allocate(64)
    cycle = [pool.allocate(64)]
    cycle.append(cycle)
    used = pool.bytes_in_use
    del cycle  # (garbage: its block dies in the collection, and goes back to the pool there)
    armed.append(True)
    sys.setprofile(collect_as_acquire_returns(pool._lock, True))
    if op == "allocate":
        kept = pool.allocate(64)
        used += 256
    elif op == "free_all_blocks":
        pool.free_all_blocks()
    else:
        del victim  # (its own give-back takes the lock)
        used -= 256
    sys.setprofile(None)
    assert not armed and pool.bytes_in_use == used - 256 and not pool._staged, op
    victim = kept = None
print("ok")
"""


def test_a_collection_under_the_host_pool_lock_gives_its_blocks_back_after_it():
    """A collection may start under a host pool's lock (Python 3.12 on runs one at the check
    after a call -- the lock's acquire() included -- that an allocation made before the lock
    was taken, or by another thread, asked for; a profile function runs at every call of a
    builtin). A HostBlock dying there (an allocation in a garbage cycle) gave itself back,
    which waited for the lock its own thread held: a hang. It is staged, and given back by
    that operation once it let the lock go. host.py runs interpreted in either build. A fresh
    interpreter: a hang must not take the suite with it."""
    import subprocess
    r = subprocess.run([sys.executable, "-c", _COLLECTION_UNDER_THE_HOST_POOL_LOCK],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.split()) == (0, ["ok"]), r.stderr[-2000:]


_COLLECTION_UNDER_THE_STAGE_LOCK = _COLLECT_AS_ACQUIRE_RETURNS + r"""
sys.path.insert(0, sys.argv[1])
import pytest
import sharedmem.backends.cuda as bc
from fake_cuda import install_fake_devices

(dev,), drv = install_fake_devices(pytest.MonkeyPatch(), hot=False)
be = dev.backend
gc.disable()
for op in ("pinned", "unstage"):
    victim = be.pinned(1000)
    cycle = [be.pinned(1000)]
    cycle.append(cycle)
    staged = be._staged
    del cycle  # (garbage: its array dies in the collection, its _unstage called there)
    armed.append(True)
    sys.setprofile(collect_as_acquire_returns(bc._stage_lock))
    if op == "pinned":
        kept = be.pinned(1000)
        staged += 1024
    else:
        del victim  # (its own _unstage takes the lock)
        staged -= 1024
    sys.setprofile(None)
    assert not armed and be._staged == staged - 1024 and not bc._unstaged, op
    victim = kept = None
print("ok")
"""


def test_a_collection_under_the_pinned_staging_lock_unstages_after_it():
    """Interpreted, a collection may start under the CUDA backend's staging lock (as under
    the host pool's: see above). A pinned staging array dying there ran its finalizer,
    _unstage, which waited for the lock its own thread held in pinned(): a hang. It is
    staged, and done by that pinned() once it let the lock go. Compiled, no Python code runs
    under the lock."""
    import subprocess
    import sharedmem.backends.cuda as bc
    if not bc.__file__.endswith(".py"):
        pytest.skip("compiled: no Python code runs under the staging lock")
    r = subprocess.run([sys.executable, "-c", _COLLECTION_UNDER_THE_STAGE_LOCK,
                        os.path.dirname(os.path.abspath(__file__))],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.split()) == (0, ["ok"]), r.stderr[-2000:]


_COLLECTION_AS_AN_OWNED_LOCK_TURNS = _COLLECT_AS_ACQUIRE_RETURNS + r"""
import sharedmem as sm
from sharedmem.runtime.state import OwnedLock

lock = OwnedLock("a test's bookkeeping")
said = []


class Wrapper:  # a user's object whose finalizer calls sharedmem, which takes the lock
    def __del__(self):
        try:
            with lock:
                said.append("entered")
        except sm.SharedMemError:
            said.append("refused")


gc.disable()
w = Wrapper()
w.me = w
del w  # (garbage: finalized in the collection as acquire() returns)
armed.append(True)
sys.setprofile(collect_as_acquire_returns(lock._lock))
with lock:
    pass
sys.setprofile(None)
assert not armed and not lock.locked() and lock.owner == 0
with lock:  # (the thread is not left marked)
    pass
print(*said)
"""


def test_a_finalizer_between_an_owned_locks_acquire_and_its_owner_is_refused():
    """Interpreted, a collection may start between an OwnedLock's acquire() and the store of
    its owner (Python 3.12 on runs one at the check after the call; a profile function at
    its return). A finalizer there that called sharedmem, taking the same lock, found no
    owner and waited for the lock its own thread held -- a hang, where an OwnedLock promises
    SharedMemError. Compiled, no Python code runs there."""
    import subprocess
    import sharedmem.runtime.state as st
    if not st.__file__.endswith(".py"):
        pytest.skip("compiled: no Python code runs between acquire() and the owner's store")
    r = subprocess.run([sys.executable, "-c", _COLLECTION_AS_AN_OWNED_LOCK_TURNS],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.split()) == (0, ["refused"]), r.stderr[-2000:]


_COLLECTION_AS_THE_CORE_LOCK_TURNS = _COLLECT_AS_ACQUIRE_RETURNS + r"""
import sharedmem as sm
from sharedmem.runtime.state import RUNTIME

host = sm.Device.host()
lock = RUNTIME._acquire.__self__  # (interpreted: the core lock's threading.Lock)
done = []


class Releases:  # a user's object whose finalizer releases its buffer: always safe
    def __init__(self):
        self.buf, self.me = sm.Buffer.zeros(4, device=host), self

    def __del__(self):
        self.buf.release()
        done.append("released")


class Calls:  # one whose finalizer makes another sharedmem call: refused there
    def __init__(self):
        self.me = self

    def __del__(self):
        try:
            sm.Buffer.zeros(4, device=host)
        except sm.SharedMemError:
            done.append("refused")


gc.disable()
r = Releases()
tok = r.buf._token
del r  # (garbage: its finalizer runs in the collection)
armed.append(True)
sys.setprofile(collect_as_acquire_returns(lock))
kept = sm.Buffer.zeros(4, device=host)  # (takes the core lock: the collection as it does)
sys.setprofile(None)
assert not armed and done == ["released"] and not tok.live, (armed, done, tok.live)
c = Calls()
del c
armed.append(True)
sys.setprofile(collect_as_acquire_returns(lock))
kept = sm.Buffer.zeros(4, device=host)
sys.setprofile(None)
assert not armed and done == ["released", "refused"], done
print("ok")
"""


def test_a_finalizer_as_the_core_lock_is_taken_releases_or_is_refused_never_hangs():
    """Interpreted, a collection may start between the core lock's acquire() and the store of
    its owner (Python 3.12 on runs one at the check after the call; a profile function at its
    return). A user's finalizer there that released a view found the lock busy, with no owner
    saying whose, and waited for the lock its own thread held -- a hang, where release() is
    documented as always safe; any other call hung too. Now the release is staged and applied
    as the lock is taken, and another call raises SharedMemError. Compiled, no Python code runs
    there."""
    import subprocess
    import sharedmem.runtime.state as st
    if not st.__file__.endswith(".py"):
        pytest.skip("compiled: no Python code runs between acquire() and the owner's store")
    r = subprocess.run([sys.executable, "-c", _COLLECTION_AS_THE_CORE_LOCK_TURNS],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.split()) == (0, ["ok"]), r.stderr[-2000:]
