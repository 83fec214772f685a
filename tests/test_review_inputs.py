"""Review of bad inputs to public calls: each test is one defect, asserting what
docs/errors.md and docs/api.md promise (the error type, the key part of the message, and
nothing left half-done afterwards)."""

import gc
import pickle
import re
import sys

import numpy as np
import pytest

import sharedmem as sm
from interop import dlpack as dl

from conftest import gc_collect_harder


@pytest.fixture
def fake(monkeypatch):
    """A CUDA device over the fake driver (as tests/test_cuda_backend_fake.py sets it up),
    registered as Device(0): imports probe Device(0)."""
    import sharedmem.device as sm_device
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, False)
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)
    yield dev, drv
    sm.synchronize()
    del dev
    gc_collect_harder()


# -- 1. from_dlpack(capsule, stream=<a stream of another device>) --------------------------------
def test_from_dlpack_of_a_capsule_refuses_a_stream_of_another_device(fake, host):
    """errors.md, DeviceMismatchError: "a foreign stream (..., stream=) of another device than
    the one asked for ... Nothing was leased." The same call with the producer object raises
    it; with the producer's bare capsule the stream's device is never compared with the
    capsule's: the CUDA memory is imported with its arrival recorded on a *host* stream, and a
    later use on the CUDA device makes a CUDA stream wait on a host marker (AttributeError:
    'HostMarker' object has no attribute '_open_on')."""
    dev, drv = fake
    b = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=dev)
    hs = host.create_stream()
    sm.synchronize()
    with pytest.raises(sm.DeviceMismatchError, match=r"from_dlpack: .* is on <Device host>"):
        sm.from_dlpack(b, stream=hs)  # (the producer object: refused, as documented)
    cap = b.__dlpack__(max_version=(1, 0))
    before = sm.stats().submitted
    with pytest.raises(sm.DeviceMismatchError, match=(
            r"^from_dlpack: <Stream .*> is on <Device host>, the memory of the capsule on "
            r"<Device cuda:0 .*>; use a stream of that device$")):
        sm.from_dlpack(cap, stream=hs)
    assert dl._is_valid(cap, b"dltensor_versioned")  # not consumed
    assert sm.stats().submitted == before  # nothing recorded on the host stream
    del cap
    gc_collect_harder()
    assert b.allocation.live_views == 1
    np.testing.assert_array_equal(b.to_host(), np.arange(4))


def test_from_dlpack_of_a_host_capsule_refuses_a_cuda_stream(fake, host):
    """The mirror case: a host capsule with a CUDA stream is accepted, the stream silently
    ignored, where the producer object raises DeviceMismatchError."""
    dev, drv = fake
    t = sm.Tensor.from_host(np.arange(3, dtype=np.float32), device=host)
    ds = dev.create_stream()
    with pytest.raises(sm.DeviceMismatchError):
        sm.from_dlpack(t, stream=ds)
    cap = t.__dlpack__(max_version=(1, 0))
    with pytest.raises(sm.DeviceMismatchError):
        sm.from_dlpack(cap, stream=ds)
    assert dl._is_valid(cap, b"dltensor_versioned")
    del cap
    gc_collect_harder()
    assert t.allocation.live_views == 1


# -- 2. a stream= that is no stream, on the host device --------------------------------------------
@pytest.mark.parametrize("bad", ["x", 1.5, sm.Device.host()], ids=["str", "float", "Device"])
def test_a_stream_argument_that_is_no_stream_is_a_type_error_on_the_host_too(host, bad):
    """On a CUDA device `stream="x"` raises TypeError("cannot use 'x' as a CUDA stream: give a
    sharedmem.Stream, ..."); on the host device the same argument raises DeviceMismatchError
    "Stream.from_external('x') needs a CUDA device; <Device host> has no foreign streams" --
    the wrong type and a misleading reason (DeviceMismatchError is for a stream *of another
    device*; 'x', 1.5 or a Device is no stream at all)."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    calls = [lambda: b.fill_zero(stream=bad), lambda: b.copy_from(np.ones(4), stream=bad),
             lambda: b.to_host(stream=bad), lambda: sm.Buffer.empty(4, device=host, stream=bad),
             lambda: sm.launch(sm.host_kernel(lambda x: None), 1, 1, b, stream=bad)]
    for call in calls:
        with pytest.raises(TypeError, match=r"stream"):
            call()
    sm.synchronize()
    assert b.allocation.live_views == 1 and sm.stats().in_flight == 0
    b.fill_zero().result()


# -- 3. Stream.from_external(obj, device=<not a Device>) --------------------------------------------
def test_stream_from_external_with_a_device_that_is_not_a_device_object(fake):
    """`Stream.from_external(5, device="host")` (the spelling every other `device=` takes)
    raises AttributeError: 'str' object has no attribute 'kind'; `device=1.5` too. Expected:
    the host device's refusal (DeviceMismatchError: no foreign streams) for "host", and
    Device()'s own ValueError for a value that names no device."""
    dev, drv = fake
    with pytest.raises(sm.DeviceMismatchError, match="no foreign streams"):
        sm.Stream.from_external(0x77, device="host")
    with pytest.raises(ValueError, match=r"1\.5"):
        sm.Stream.from_external(0x77, device=1.5)
    assert sm.Stream.from_external(0x77, device=dev).device is dev  # the next call works


# -- 4. a CAI import of more than 64 dimensions -----------------------------------------------------
def test_cai_import_refuses_more_than_64_dimensions(fake):
    """errors.md: LayoutError (a ValueError) for "more than 64 dimensions"; the DLPack import
    refuses ndim=65 (BufferError). The CAI import takes a 65-dimension shape and makes a
    Tensor NumPy cannot hold (to_host fails later)."""
    dev, drv = fake
    b = sm.Buffer.zeros(4, "float32", device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    sm.synchronize()

    class Producer:
        __cuda_array_interface__ = {"shape": (1,) * 65, "typestr": "<f4",
                                    "data": (b.ptr, False), "version": 3}
    with pytest.raises(ValueError, match=r"64"):
        sm.from_cuda_array_interface(Producer())
    gc_collect_harder()
    assert b.allocation.live_views == 1  # nothing imported


# -- 5. a DLPack capsule whose shape pointer is NULL ---------------------------------------------
def test_a_capsule_with_a_null_shape_pointer_is_a_buffer_error(host):
    """errors.md: BufferError for "an imported tensor that is malformed" (and the capsule is
    left unconsumed). A capsule with ndim=1 and shape=NULL raises ctypes' ValueError("NULL
    pointer access"), which names neither DLPack nor the field."""
    t = sm.Tensor.from_host(np.arange(3, dtype=np.float32), device=host)
    cap = t.__dlpack__(max_version=(1, 0))
    m = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned"))
    m.dl_tensor.shape = None
    with pytest.raises(BufferError, match=r"shape"):
        sm.from_dlpack(cap)
    assert dl._is_valid(cap, b"dltensor_versioned")
    del cap, m
    gc_collect_harder()
    assert t.allocation.live_views == 1


# -- 6. sm.ipc.export of something that is not a view --------------------------------------------
def test_ipc_export_of_a_non_view_is_a_type_error():
    """`sm.ipc.open(5)` says TypeError("sm.ipc.open takes an IpcHandle ..., got int");
    `sm.ipc.export(5)` raises AttributeError: 'int' object has no attribute '_live_token'."""
    for bad in (5, np.zeros(4), None):
        with pytest.raises(TypeError, match=r"ipc\.export"):
            sm.ipc.export(bad)


# -- 7. register_kernel_adapter with an adapter that is not one -------------------------------------
def test_register_kernel_adapter_refuses_a_non_adapter():
    """`sm.register_kernel_adapter(K, 5)` is accepted silently; every later launch of a K
    kernel then raises AttributeError ('int' object has no attribute 'device_kinds'). A bad
    argument should be refused when given (TypeError), the registry unchanged, so a launch of
    a K kernel is still the documented KernelError for an unknown kernel type."""
    class K:
        pass
    with pytest.raises(TypeError, match=r"KernelAdapter"):
        sm.register_kernel_adapter(K, 5)
    with pytest.raises(sm.KernelError, match=r"does not know how to launch"):
        sm.launch(K(), 1, 1)


# -- 8. fut.then(<not callable>) ------------------------------------------------------------------
def test_then_with_a_non_callable_is_refused_at_once(host):
    """`apply(5)` raises TypeError("apply takes a callable, got 5") and `add_done_callback(5)`
    raises TypeError at once; `then(5)` returns a HostFuture that later fails with "'int'
    object is not callable" (which object, what to do: not said)."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    f = sm.launch(sm.host_kernel(lambda x: None), 1, 1, b)
    with pytest.raises(TypeError, match=r"then takes a callable, got 5"):
        f.then(5)
    assert f.result(5) is None


# -- 9. a tensor dimension no NumPy array or DLPack tensor can express ---------------------------------
def test_a_dimension_beyond_int64_is_refused_at_construction(host):
    """`Tensor.empty((2**64, 0))` (0 bytes) is accepted; then `__dlpack__` raises
    struct.error("argument out of range"), `np.from_dlpack` the same, and pickling NumPy's
    ValueError("Maximum allowed dimension exceeded"). DLPack shapes are int64 and NumPy
    refuses such a dimension: a LayoutError at construction (docs: shape sizes are checked
    there) keeps every later call within the documented errors."""
    with pytest.raises(sm.LayoutError, match=r"18446744073709551616"):
        sm.Tensor.empty((2 ** 64, 0), device=host)
    b = sm.Buffer.zeros(0, "float32", device=host)
    with pytest.raises(sm.LayoutError):
        sm.Tensor.from_buffer(b, (2 ** 64, 0))
    assert b.is_live  # refused: not moved
    t = sm.Tensor.empty((2, 0), device=host)
    assert pickle.loads(pickle.dumps(t)).shape == (2, 0)


# -- 10. a NumPy integer as a device ordinal ---------------------------------------------------------
def test_a_numpy_integer_device_ordinal_is_taken_as_the_int(host):
    """Lengths, shapes, grids, pointers all take NumPy integers; `device=np.int64(0)` raises
    ValueError("Device(ordinal) takes a CUDA device number >= 0, got np.int64(0)") -- a message
    that contradicts itself. It should behave as `device=0` (here: the same error, or the same
    Device)."""
    try:
        want = sm.Device(0)
    except Exception as e:  # (no GPU here: BackendUnavailableError)
        with pytest.raises(type(e)):
            sm.Device(np.int64(0))
        with pytest.raises(type(e)):
            sm.Buffer.empty(2, device=np.int64(0))
    else:
        assert sm.Device(np.int64(0)) is want


# -- 11. __dlpack__ arguments of the wrong shape -------------------------------------------------
def test_dlpack_export_arguments_of_the_wrong_shape_are_type_errors(host):
    """``max_version=()`` raised IndexError and ``dl_device=5`` "'int' object is not
    subscriptable": neither names the argument. Both are TypeErrors naming it; nothing is
    exported (the view can still move)."""
    t = sm.Tensor.from_host(np.arange(3, dtype=np.float32), device=host)
    for bad in ((), "1", (None, 0)):
        with pytest.raises(TypeError, match=rf"^max_version must be None or a \(major, minor\) "
                                            rf"tuple of ints, got {re.escape(repr(bad))}$"):
            t.__dlpack__(max_version=bad)
    for bad in (5, (1,), (1, 0, 0), ("1", 0)):
        with pytest.raises(TypeError, match=rf"^dl_device must be None or a \(device_type, "
                                            rf"device_id\) pair of ints, got "
                                            rf"{re.escape(repr(bad))}$"):
            t.__dlpack__(dl_device=bad)
    assert t.allocation.live_views == 1
    np.testing.assert_array_equal(t.into_buffer().to_host(), [0, 1, 2])


# -- 12. a policy or a timeout of the wrong type ---------------------------------------------------
def test_a_policy_that_is_an_array_is_the_documented_error(host):
    """errors.md: SharedMemError "unknown access policy ..." for a policy that is not one of
    POLICIES. A NumPy array raised NumPy's ValueError ("The truth value of an array ... is
    ambiguous"), from ``policy not in POLICIES`` -- naming neither the policy nor the values
    it may take. Nothing is launched."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    k = sm.host_kernel(lambda x: None)
    before = sm.stats().submitted
    for call in (lambda: sm.launch(k, 1, 1, b, policy=np.array([1, 2])),
                 lambda: sm.set_access_policy(np.array(["order", "reject"]))):
        with pytest.raises(sm.SharedMemError, match=r"^unknown access policy array\(.*\); "
                                                    r"expected one of 'order', 'reject'$"):
            call()
    assert sm.stats().submitted == before
    assert sm.get_access_policy() == "order"


def test_result_with_a_timeout_that_is_no_number_is_a_type_error(host):
    """``fut.result(timeout="x")`` on a future that was done returned its value (the timeout was
    never looked at); on one that was not, the wait raised "'>' not supported between instances
    of 'str' and 'int'". Either way now a TypeError naming the argument, before any wait."""
    gate = __import__("threading").Event()
    k = sm.host_kernel(lambda x: gate.wait(10))
    b = sm.Buffer.zeros(4, "float32", device=host)
    fut = k and sm.launch(k, 1, 1, b)
    for call in (fut.result, fut.exception):
        with pytest.raises(TypeError, match=r"^timeout must be None or a number of seconds, "
                                            r"got 'x'$"):
            call(timeout="x")
    assert not fut.done()
    gate.set()
    assert fut.result(timeout=np.float64(10)) is None
    with pytest.raises(TypeError, match=r"got \[1\]$"):
        fut.result(timeout=[1])  # (done: refused all the same)
    assert fut.exception(timeout=1) is None


def test_an_infinite_or_huge_timeout_is_no_limit_and_nan_is_refused(fake, host):
    """``result(math.inf)`` raised OverflowError on the host (Event.wait's limit) and waited
    on CUDA; ``nan`` timed out at once on the host and never on CUDA. Now infinite, or past
    threading.TIMEOUT_MAX, is no limit on both, and NaN a ValueError before any wait -- for
    futures, HostFutures and events."""
    import math
    dev, drv = fake
    for d in (host, dev):
        s = d.create_stream()
        b = sm.Buffer.zeros(4, "float32", device=d, stream=s)
        f = b.fill_zero(stream=s)
        h = f.then(lambda v: 7)
        for wait in (f.result, f.exception, h.result, s.record().synchronize):
            for t in (math.inf, 1e300, 2 ** 70):
                wait(t)
            with pytest.raises(ValueError, match=r"^timeout must be None or a number of "
                                                 r"seconds, got nan$"):
                wait(math.nan)
        assert h.result(math.inf) == 7


# -- 13. an object array passed with an intent ------------------------------------------------------
def test_an_argument_no_adapter_takes_is_named_with_its_library_and_device(host):
    """A torch CPU tensor given to a launch was "got Tensor (dtype torch.float32)" -- read as
    sharedmem's Tensor. A foreign type is named by its library, with the device it says."""
    cls = type("Tensor", (), {"__module__": "torch", "device": "cpu", "dtype": "torch.float32"})
    odd = type("Odd", (), {"__module__": "mylib.arrays",
                           "device": property(lambda self: 1 / 0)})  # (raising: type alone)
    k = sm.host_kernel(lambda x: None)
    with pytest.raises(sm.KernelError, match=r"^argument 0: Out\(\) takes a Buffer, Tensor, "
                                             r"DeviceBox or array, got torch.Tensor on cpu "
                                             r"\(dtype torch.float32\)$"):
        sm.launch(k, 1, 1, sm.Out(cls()))
    with pytest.raises(sm.KernelError, match=r"got mylib.Odd$"):
        sm.launch(k, 1, 1, sm.In(odd()))
    with pytest.raises(sm.KernelError, match=r"got int$"):
        sm.launch(k, 1, 1, sm.In(3))


def test_an_intent_on_an_array_of_objects_names_its_dtype(host):
    """``In(np.array([None]))`` said "got ndarray": the one kind of array a host kernel takes,
    refused without saying why. The message names the dtype (object: no bytes to lease)."""
    k = sm.host_kernel(lambda x: None)
    with pytest.raises(sm.KernelError, match=r"^argument 0: In\(\) takes a Buffer, Tensor, "
                                             r"DeviceBox or array, got numpy.ndarray( on cpu)? "
                                             r"\(dtype object\)$"):
        sm.launch(k, 1, 1, sm.In(np.array([None])))


# -- 14. a host copy asked for with a stream -------------------------------------------------------
def test_a_dlpack_copy_to_the_host_refuses_a_stream(host, fake):
    """DLPack: a consumer on a device without streams passes ``stream=None``; an export of host
    memory refuses any other value (BufferError). ``__dlpack__(stream=5, copy=True)`` -- a copy
    to the host, of host or of CUDA memory -- ignored it and exported. Refused now, before any
    copy is made; the view stays usable."""
    dev, drv = fake
    t = sm.Tensor.from_host(np.arange(3, dtype=np.float32), device=host)
    g = sm.Tensor.from_host(np.arange(3, dtype=np.float32), device=dev)
    sm.synchronize()
    for view, kw in ((t, {}), (g, {"dl_device": (1, 0)})):
        with pytest.raises(BufferError, match=r"^stream=5 is not valid for a copy to the host; "
                                              r"only None$"):
            view.__dlpack__(stream=5, copy=True, max_version=(1, 0), **kw)
        cap = view.__dlpack__(copy=True, max_version=(1, 0), **kw)  # (None: the copy is made)
        assert dl._is_valid(cap, b"dltensor_versioned")
        np.testing.assert_array_equal(np.from_dlpack(_Holder(cap)), [0, 1, 2])
        assert view.allocation.live_views == 1
    np.testing.assert_array_equal(t.into_buffer().to_host(), [0, 1, 2])


class _Holder:
    """A producer handing out one capsule made beforehand (for ``np.from_dlpack``)."""

    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, **kw):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)


# -- 15. a CAI pointer or stream outside 64 bits ---------------------------------------------------
@pytest.mark.parametrize("data, stream, match", [
    ((-16, False), None, r"the 'data' pointer -16 is not a 64-bit address"),
    ((1 << 64, False), None, r"the 'data' pointer 18446744073709551616 is not a 64-bit address"),
    (None, 1 << 64, r"stream 18446744073709551616 is not a stream handle \(above 64 bits\)"),
])
def test_a_cai_pointer_or_stream_outside_64_bits_is_refused(fake, data, stream, match):
    """A negative 'data' pointer was looked up as an address and refused as "0x-10 is not CUDA
    device memory"; a producer stream of 2**64 was passed on to the driver (a wait on a handle
    that cannot exist: ctypes' OverflowError there, or the fake's acceptance). Both are
    ValueErrors naming the entry; nothing is imported."""
    dev, drv = fake
    b = sm.Buffer.zeros(4, "float32", device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    sm.synchronize()

    class Producer:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "version": 3,
                                    "data": data or (b.ptr, False), "stream": stream}
    before = sm.stats().submitted
    with pytest.raises(ValueError, match=match):
        sm.from_cuda_array_interface(Producer())
    assert sm.stats().submitted == before
    gc_collect_harder()
    assert b.allocation.live_views == 1


# -- 16. a DeviceBox value its dtype cannot hold; a device that is an array -------------------------
def test_a_devicebox_value_out_of_its_dtypes_range_names_the_box(host):
    """``DeviceBox(300, "int8")`` raised NumPy's bare "Python integer 300 out of bounds for
    int8" (and ``set`` the same): the error type stays (OverflowError; ValueError for a NaN as
    an int), the message names the box, its dtype and the value. Nothing is written."""
    with pytest.raises(OverflowError, match=r"^a DeviceBox of int8 cannot hold 300: .*int8$"):
        sm.DeviceBox(300, "int8", device=host)
    with pytest.raises(ValueError, match=r"^a DeviceBox of int32 cannot hold nan: "):
        sm.DeviceBox(float("nan"), "int32", device=host)
    box = sm.DeviceBox(7, "int16", device=host)
    with pytest.raises(OverflowError, match=r"^a DeviceBox of int16 cannot hold 70000: "):
        box.set(70000)
    assert box.get() == 7


def test_a_device_that_is_an_array_is_refused_by_device(host):
    """``device=np.array([1, 2])`` raised NumPy's "truth value of an array ... is ambiguous"
    (from ``device == "host"``); now Device()'s own ValueError naming the value."""
    with pytest.raises(ValueError, match=r"^Device\(ordinal\) takes a CUDA device number >= 0, "
                                         r"got array\(\[1, 2\]\)"):
        sm.Buffer.empty(4, "float32", device=np.array([1, 2]))


def test_from_dlpack_with_a_device_that_is_an_array_is_refused_by_device(host):
    """``sm.from_dlpack(x, device=np.array([1, 2]))`` raised NumPy's "truth value ... is
    ambiguous" (``device == "host"``): Device()'s ValueError now, as everywhere a device is
    taken; the producer stays usable."""
    t = sm.Tensor.from_host(np.arange(3, dtype=np.float32), device=host)
    with pytest.raises(ValueError, match=r"^Device\(ordinal\) takes a CUDA device number"):
        sm.from_dlpack(t, device=np.array([1, 2]))
    assert sm.from_dlpack(t, device="host").shape == (3,)
    gc_collect_harder()
    assert t.allocation.live_views == 1


# -- 17. a host kernel's exception with an `exceptions` attribute of its own -------------------------
def test_a_host_kernel_error_with_an_exceptions_attribute_fails_only_its_work(host):
    """model.md: a host kernel that raises fails its own work only; its future raises
    HostKernelError and the stream runs on. An exception with an attribute named
    ``exceptions`` that is not a group's members (a list of messages) killed the stream's
    worker inside its error handling (``_detach`` took each entry for an exception): the
    future never completed, nothing more ran on the stream, and nothing was reported."""
    s = host.create_stream()

    class ValidationFailed(Exception):
        def __init__(self, problems):
            super().__init__(f"{len(problems)} problems")
            self.exceptions = problems

    @sm.host_kernel
    def validate(x):
        if (x < 1).any():
            raise ValidationFailed(["row 0: below 1"])

    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    with pytest.raises(sm.HostKernelError) as info:
        sm.launch(validate, 1, 1, b, stream=s).result(timeout=10)
    assert isinstance(info.value.__cause__, ValidationFailed)
    assert info.value.__cause__.exceptions == ["row 0: below 1"]
    ok = sm.Buffer.from_host(np.array([5, 5], dtype=np.int32), device=host, stream=s)
    assert sm.launch(validate, 1, 1, ok, stream=s).result(timeout=10) is None  # runs on
    s.synchronize()


# -- 18. sm.trace(<an int>) -------------------------------------------------------------------------
def test_trace_refuses_a_path_that_is_a_file_descriptor(host, tmp_path):
    """``sm.trace(5)`` was accepted: open(5, "w") wrote the timeline to file descriptor 5 --
    whatever the process had open there -- and closed it. A TypeError naming the argument;
    nothing is recorded."""
    with pytest.raises(TypeError, match=r"^sm\.trace takes the path of its JSON file \(a str, "
                                        r"bytes or os\.PathLike\) or None, got 5$"):
        sm.trace(5)
    with sm.trace(tmp_path / "t.json") as tr:  # (a PathLike: taken)
        sm.Buffer.zeros(4, "float32", device=host).to_host()
    assert (tmp_path / "t.json").exists() and tr.events


# -- 19. a host allocation beyond memory --------------------------------------------------------------
def test_a_host_allocation_beyond_memory_names_the_size(host):
    """errors.md: MemoryError when an allocation cannot be made, "the message names the size
    and the device". On the host it was NumPy's "Unable to allocate 8.00 TiB for an array with
    shape (8796093022464,) and data type uint8" -- the pool's block, not the allocation."""
    before = sm.stats().live_allocations
    # (1 EiB: past any machine's address space -- 8 TiB was allocated where memory overcommits)
    with pytest.raises(MemoryError, match=r"^cannot allocate 1152921504606846976 bytes on "
                                          r"<Device host>: out of host memory"):
        sm.Buffer.empty(2**57, "float64", device=host)
    assert sm.stats().live_allocations == before
    assert sm.Buffer.zeros(4, "float64", device=host).to_host().sum() == 0  # the pool works


# -- 20. a host read racing the start of a capture on its stream -------------------------------------
def test_a_host_read_racing_the_start_of_a_capture_is_refused(fake, monkeypatch):
    """model.md: a capturing stream refuses ``to_host()`` (CaptureError). The refusal was
    checked before the copy's submission, not with it: a capture another thread began in
    between (here, while the read took its pinned memory) recorded the copy into the graph --
    to run at replay -- and ``to_host`` returned the staging memory's stale bytes (zeros on
    the fake; another copy's leftovers from the real pinned pool). Each piece now checks under
    the core lock, where captures begin; nothing is recorded, and the view reads right after."""
    import threading
    dev, drv = fake
    s = dev.create_stream()
    b = sm.Buffer.from_host(np.arange(8, dtype=np.float64), device=dev, stream=s)
    s.synchronize()
    ns = dev.backend._cupy.cuda
    orig = ns.alloc_pinned_memory
    began, done, graphs = threading.Event(), threading.Event(), []

    def capture_elsewhere():
        with sm.capture(s) as g:
            began.set()
            done.wait(10)
        graphs.append(g)

    other = threading.Thread(target=capture_elsewhere)

    def pinned(n):  # (the read has checked the stream already)
        if not other.is_alive() and not graphs:
            other.start()
            began.wait(10)
        return orig(n)
    monkeypatch.setattr(ns, "alloc_pinned_memory", pinned)
    with pytest.raises(sm.CaptureError, match=r"^to_host\(\) on <Stream .*> cannot be captured: "
                                              r"it reads on the host now"):
        b.to_host(stream=s)
    done.set()
    other.join(10)
    assert graphs and graphs[0].launches == 0  # nothing was recorded into the graph
    np.testing.assert_array_equal(b.to_host(stream=s), np.arange(8))


# -- 21. a replay racing the graph's release ----------------------------------------------------------
def test_a_replay_racing_the_graphs_release_is_the_documented_capture_error(fake, monkeypatch):
    """errors.md: CaptureError for "replaying a failed or released graph". A release() from
    another thread after replay() had read the graph as replayable made the submission refuse
    its released tokens: ReleasedError "a graph #1 passed to replay of graph #1 was released
    before the launch". Now the CaptureError of a replay after the release; nothing leased."""
    import threading

    from sharedmem.runtime import graph as graph_mod
    dev, drv = fake
    s = dev.create_stream()
    b = sm.Buffer.zeros(8, "float64", device=dev, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        b.copy_from(np.full(8, 3.0), stream=s)
    resolve = graph_mod.resolve_stream

    def racing(stream, device):  # (the other thread's release, between the check and submit)
        t = threading.Thread(target=g.release)
        t.start()
        t.join(10)
        return resolve(stream, device)
    monkeypatch.setattr(graph_mod, "resolve_stream", racing)
    before = sm.stats().submitted
    message = rf"^graph #{g.id} is released; only a finished capture can be replayed$"
    with pytest.raises(sm.CaptureError, match=message):
        g.replay(s.handle)  # (a raw handle: resolved)
    monkeypatch.undo()
    with pytest.raises(sm.CaptureError, match=message):
        g.replay(s)
    assert sm.stats().submitted == before


# -- 22. DLPack holds and exports on a stream sharedmem is capturing -------------------------------------
def test_a_hold_ending_during_a_capture_records_nothing_into_it(fake):
    """The end of a DLPack hold is leased on the consumer's stream until it passes that point.
    While sharedmem captured that stream, the marker was recorded *into* the capture (the
    backend never records into one: an event there marks nothing that runs now). It is now
    the marker recorded as the capture began: what the consumer gave the stream before --
    all that runs -- is covered, and the lease ends once that finished."""
    dev, drv = fake
    s, w = dev.create_stream(), dev.create_stream()
    x = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=dev, stream=w)
    cap = x.__dlpack__(stream=s.handle, max_version=(1, 0))  # a consumer working on s
    drv.holding = True  # (its work on s in flight)
    with sm.capture(s) as g:
        begun = len(drv.calls)
        before = g._before
        del cap  # the consumer drops its array: the hold ends
        gc_collect_harder()
        assert not [c for c in drv.calls[begun:] if c[0] == "record"]  # nothing into the capture
        assert s._pending[-1].marker is before and before.recorded
    assert x.allocation.tracker  # leased until the work before the capture finished
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    assert not x.allocation.tracker
    g.release()


def test_an_export_to_a_stream_being_captured_is_a_capture_error(fake):
    """errors.md: CaptureError for work that cannot be captured, "waiting on a capturing
    stream, recording an event on one or making one wait". A DLPack export naming a stream
    sharedmem captures was made: the stream was made to wait for outside work (the driver
    refuses such a wait inside a capture, and the capture is lost), and the consumer's
    captured work would run at replay, after the export may have ended. Refused under the core
    lock, nothing made; the same export after the capture works."""
    dev, drv = fake
    s, w = dev.create_stream(), dev.create_stream()
    x = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=dev, stream=w)
    with sm.capture(s) as g:
        with pytest.raises(sm.CaptureError, match=(
                rf"^cannot export bytes \[0, 16\) of allocation #{x.allocation.id} to a consumer "
                rf"on <Stream .*>: it is capturing graph #{g.id}, whose work runs only at "
                rf"replay")):
            x.__dlpack__(stream=s.handle, max_version=(1, 0))
    assert g.launches == 0
    assert x.allocation.live_views == 1
    cap = x.__dlpack__(stream=s.handle, max_version=(1, 0))
    assert dl._is_valid(cap, b"dltensor_versioned")
    del cap
    g.release()


def test_an_import_onto_a_stream_being_captured_is_a_capture_error(fake):
    """A DLPack or CAI import onto a capturing stream recorded the wait for the producer and
    the arrival into the graph -- run at replay only: use of the memory outside the graph was
    not ordered after the producer's work. Refused before the producer is asked or the capsule
    consumed; the same import after the capture works."""
    dev, drv = fake
    s = dev.create_stream()
    x = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=dev)
    drv.ranges[x.allocation.ptr] = x.allocation.nbytes
    sm.synchronize()

    class Producer:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "version": 3,
                                    "data": (x.ptr, False), "stream": 0x4444}
    cap = x.__dlpack__(max_version=(1, 0))
    with sm.capture(s) as g:
        for imp in (lambda: sm.from_cuda_array_interface(Producer(), stream=s),
                    lambda: sm.from_dlpack(cap, stream=s)):
            with pytest.raises(sm.CaptureError, match=r"^an import onto <Stream .*>, which is "
                                                      r"capturing a graph, would be ordered"):
                imp()
    assert g.launches == 0 and dl._is_valid(cap, b"dltensor_versioned")
    g.release()
    t = sm.from_dlpack(cap, stream=s)
    assert t.allocation is x.allocation


def test_synchronize_of_a_borrowed_stream_waits_for_its_owner_before_a_deferred_error(fake, host):
    """A callback error deferred before Stream.synchronize() of a borrowed stream was raised
    between its parts, before the owner's work was waited for (cuStreamSynchronize never
    called); it comes once everything was waited for (model.md)."""
    dev, drv = fake
    b = sm.Stream.from_external(0x77, device=dev)
    x = sm.Buffer.zeros(4, "int32", device=host)
    f = x.fill_zero()
    f.result()
    f.add_done_callback(lambda f: 1 / 0)  # (another work's callback: deferred)
    before = len([c for c in drv.calls if c[0] == "stream_sync"])
    with pytest.raises(ZeroDivisionError):
        b.synchronize()
    assert len([c for c in drv.calls if c[0] == "stream_sync"]) == before + 1


def test_a_stream_waits_for_a_foreign_stream_object(fake):
    """Stream.wait(cupy_stream) said "takes an Event or a Stream, got Stream" (CuPy's class
    is named Stream): every other stream= takes foreign streams, and so does wait."""
    import cupy
    dev, drv = fake
    a = dev.create_stream("a")
    cs = cupy.cuda.Stream(non_blocking=True)
    a.wait(cs)
    assert ("wait", a.handle) in [c[:2] for c in drv.calls]
    with pytest.raises(TypeError, match=r"^Stream\.wait takes an Event or a stream \(a sharedmem "
                                        r"Stream, or a foreign one: Stream\.from_external\), got "
                                        r"str$"):
        a.wait("x")


# -- 23. a kernel with no array arguments inside `with <a stream of another kind of device>:` ----------
def test_a_host_kernel_without_arrays_ignores_an_entered_cuda_stream(fake, host):
    """api.md: ``with stream:`` makes ``stream`` the current stream *of its device*; a launch
    with no array arguments runs where its kind of kernel runs (the host, for a host kernel).
    Inside ``with cuda_stream:`` such a launch took the innermost entered stream whatever its
    device -- DeviceMismatchError "a host kernel cannot run on <Device cuda:0 ...>", even with
    a host stream entered around it. It runs on the host's current stream (else its default
    stream); an op the same."""
    dev, drv = fake
    hk = sm.host_kernel(lambda: None)
    s, hs = dev.create_stream(), host.create_stream()
    with s:
        assert sm.launch(hk, 1, 1).stream is host.default_stream
        assert sm.op(hk, 1, 1).submit().stream.device is host  # (a host pool stream)
    with hs:
        with s:
            assert sm.launch(hk, 1, 1).stream is hs
            assert sm.op(hk, 1, 1).submit().stream is hs
    sm.synchronize()


# -- 24. aliases that escaped a move (a review's findings) ----------------------------------------------
def test_a_view_made_reachable_again_by_a_finalizer_is_dead(host):
    """model.md: a move raises AliasError while any other live view overlaps the moved range.
    A slice in a collected cycle whose finalizer saved it gave its token back (``__del__``)
    but stayed ``is_live``: the move then succeeded, and ``np.from_dlpack(slice)`` made a
    second writable alias of the moved bytes. It is released like any released view now."""
    import gc
    saved = []

    class Keeper:
        def __del__(self):
            saved.append(self.items[0])

    b = sm.Buffer.zeros(4, "float32", device=host)

    def cycle():
        k = Keeper()
        k.items = [b[0:4], k]
    cycle()
    gc.collect()
    v = saved[0]
    assert not v.is_live
    t = sm.Tensor.from_buffer(b, (4,))  # (no alias left: moves)
    with pytest.raises(sm.ReleasedError):
        np.from_dlpack(v)
    with pytest.raises(sm.ReleasedError):
        v[0:2]
    assert t.allocation.live_views == 1


def test_adopt_counts_weak_references_as_references(host):
    """api.md: adopt takes an array "that nothing references but the one name passed ... else
    AliasError". A weak reference was not counted (refcounts do not include them): the array
    it reached stayed writable over the adopted -- movable -- memory."""
    import weakref
    a = np.zeros(4, np.float32)
    r = weakref.ref(a)
    with pytest.raises(sm.AliasError, match=r"1 other reference to it \(names, containers, "
                                            r"views or weak references\) exists"):
        sm.adopt(a)
    del a
    assert r() is None


def test_a_host_kernel_exception_holds_no_memoryview_of_its_arguments(host):
    """model.md: what a host kernel's exception holds of its arguments' memory is replaced by
    a copy -- the memory is freed and reused once the work retired. A ``memoryview`` in its
    args (``x.data``, ``memoryview(x)``) was kept: a write through it landed in the next
    buffer the pool handed out."""
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "float32", device=host, stream=s)
    lo, hi = b.ptr, b.ptr + 16

    @sm.host_kernel
    def bad(x):
        raise ValueError("bad", memoryview(x), x.data)

    with pytest.raises(sm.HostKernelError) as info:
        sm.launch(bad, 1, 1, b, stream=s).result(timeout=10)
    for mv in info.value.__cause__.args[1:]:
        assert isinstance(mv, memoryview) and mv.nbytes == 16
        addr = np.asarray(mv).ctypes.data
        assert not lo <= addr < hi  # a copy, not the buffer's bytes


# -- 25. retirement and reporting (a review's findings) ---------------------------------------------------
def test_a_wait_for_an_event_known_to_be_of_unknown_completion_is_refused(host):
    """model.md: work that would have to wait on work of unknown completion is refused; other
    streams keep working. ``d.wait(ev)`` for an event behind a faulted kernel -- ``ev.query()``
    already raising CompletionUnknownError -- was accepted, and everything launched on ``d``
    after it was then kept forever (a buffer written there was refused on every other stream
    for good). Refused now, nothing waited for: ``d`` keeps working."""
    import warnings

    from sharedmem.backends.host import HostFault
    fs, d = host.create_stream(), host.create_stream()

    @sm.host_kernel
    def faulting(x):
        raise HostFault("device fault")

    @sm.host_kernel
    def fill(x):
        x[:] = 5

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.LeakWarning)
        b = sm.Buffer.zeros(4, "int32", device=host, stream=fs)
        with pytest.raises(sm.CompletionUnknownError):
            sm.launch(faulting, 1, 1, b, stream=fs).result(10)
        ev = fs.record()
        with pytest.raises(sm.CompletionUnknownError):
            ev.synchronize(10)  # (known now: its query says so)
        with pytest.raises(sm.CompletionUnknownError, match=r"^completion of work before this "
                                                            r"event on <Stream .*> is unknown"):
            d.wait(ev)
        leaked = sm.stats().leaked
        y = sm.Buffer.zeros(4, "int32", device=host, stream=d)
        sm.launch(fill, 1, 1, y, stream=d).result(10)
        assert sm.stats().leaked == leaked
        np.testing.assert_array_equal(y.to_host(stream=host.create_stream()), [5] * 4)


def test_a_host_kernel_calling_sharedmem_leaves_deferred_errors_to_a_user_thread(host):
    """model.md: an exception a callback raises is re-raised at the next API call of a user
    thread. A host kernel calling sharedmem (here ``sm.stats()``) runs on its stream's worker,
    no user thread, yet it took such an error: the healthy kernel failed with it
    (HostKernelError), and the user's next call saw nothing."""
    import threading

    from sharedmem.runtime.state import RUNTIME
    s = host.create_stream()
    gate = threading.Event()

    @sm.host_kernel
    def counts(x):
        gate.wait(10)
        sm.stats()
        x[:] = 1

    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    fut = sm.launch(counts, 1, 1, b, stream=s)
    RUNTIME.errors.append(RuntimeError("a callback's error"))  # (as a failing then() leaves)
    gate.set()
    with pytest.raises(RuntimeError, match="^a callback's error$"):
        fut.result(10)  # (the user thread's call: the error is its)
    assert fut.exception(10) is None  # the kernel itself ran fine
    np.testing.assert_array_equal(b.to_host(stream=s), [1] * 4)


def test_stream_synchronize_waits_for_the_streams_waits(host):
    """api.md: ``stream.synchronize()`` waits for all work on the stream. On a stream sharedmem
    owns it waited for the last submission only: after ``c.wait(a.record())`` -- ``a`` still
    running -- it returned at once while ``c`` was still blocked in that wait."""
    import threading
    import time
    a, c = host.create_stream(), host.create_stream()
    gate = threading.Event()

    @sm.host_kernel
    def long(x):
        gate.wait(10)

    x = sm.Buffer.zeros(4, "int32", device=host, stream=a)
    sm.launch(long, 1, 1, x, stream=a)
    c.wait(a.record())
    threading.Timer(0.3, gate.set).start()
    t0 = time.monotonic()
    c.synchronize()
    assert gate.is_set() and time.monotonic() - t0 >= 0.25  # (it returned at once)


def test_a_leak_found_with_no_api_call_after_it_is_reported_at_exit(tmp_path):
    """errors.md: a LeakWarning is reported once per faulted stream, in the next API call of a
    user thread. A process whose fault was found (by the retirer, or ``sm.inflight()``) after
    its last API call exited without a word of it: the warning is given at exit then, as
    errors deferred to a call that never came are."""
    script = tmp_path / "leak.py"
    script.write_text(
        "import time\n"
        "import sharedmem as sm\n"
        "from sharedmem.backends.host import HostFault\n"
        "dev = sm.Device.host()\n"
        "s = dev.create_stream('fs')\n"
        "@sm.host_kernel\n"
        "def flt(x):\n"
        "    raise HostFault('device fault')\n"
        "b = sm.Buffer.zeros(4, 'int32', device=dev, stream=s)\n"
        "sm.launch(flt, 1, 1, b, stream=s)\n"
        "time.sleep(1.0)  # (the retirer finds the fault; no API call comes after)\n")
    out = _run_script(script, "-W", "always")
    assert re.search(r"LeakWarning: completion of work on <Stream fs on <Device host> \(owned\)> "
                     r"\(stream #\d+\) is unknown \(HostFault\('device fault'\)\)", out.stderr)
    assert out.stderr.count("LeakWarning: completion") == 1


# -- 26. a differential fuzz's and an asyncio/streams review's findings ------------------------------------
def test_from_buffer_refuses_2_to_the_63_elements_before_the_move(host):
    """errors.md: an AliasError or LayoutError leaves "nothing changed". A stride-0 shape of
    2**63 elements or more (few bytes) was moved first and then failed: compiled, with
    OverflowError from the tensor's size field -- the buffer lost --; interpreted, it made a
    Tensor nothing could read. LayoutError now, the buffer untouched."""
    b = sm.Buffer.zeros(8, "int64", device=host)
    with pytest.raises(sm.LayoutError, match=r"^shape \(4611686018427387904, 2\) holds "
                                             r"9223372036854775808 elements; a tensor holds "
                                             r"fewer than 2\*\*63"):
        sm.Tensor.from_buffer(b, (2**62, 2), (0, 0))
    assert b.is_live
    assert sm.Tensor.from_buffer(b, (2**40, 8), (0, 1)).size == 2**43  # (below: taken)


def test_with_length_is_a_bool_in_both_builds(host):
    """``In(b, with_length=2).with_length`` was True compiled (a C bint) and 2 interpreted; an
    array raised at construction compiled and at the launch interpreted. A bool in both."""
    b = sm.Buffer.zeros(4, "int32", device=host)
    assert sm.In(b, with_length=2).with_length is True
    assert sm.Out(b, with_length=0).with_length is False
    with pytest.raises(ValueError, match="truth value"):
        sm.In(b, with_length=np.array([1, 2]))


def test_a_faulted_pool_stream_is_replaced(host):
    """api.md: an op submitted without a stream runs on a pool stream of its device. A pool
    stream that faulted (a host kernel raising HostFault) stayed in the pool: every fourth op
    and zip branch after it failed with CompletionUnknownError for the rest of the process.
    It is replaced by a new stream the next time its turn comes."""
    import warnings

    from sharedmem.backends.host import HostFault
    from sharedmem.ops import POOL_SIZE

    @sm.host_kernel
    def boom(x):
        raise HostFault("illegal address (simulated)")

    @sm.host_kernel
    def fill(x):
        x[:] = 1

    b = sm.Buffer.zeros(4, "int32", device=host)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.LeakWarning)
        with pytest.raises(sm.CompletionUnknownError):
            sm.op(boom, 1, 1, b).submit().result(10)
        for _ in range(2 * POOL_SIZE):
            c = sm.Buffer.zeros(4, "int32", device=host)
            sm.op(fill, 1, 1, c).submit().result(10)
            np.testing.assert_array_equal(c.to_host(), [1] * 4)


def test_stream_from_external_checks_the_protocol_the_handle_and_the_device(fake):
    """api.md: ``Stream.from_external`` borrows anything with ``__cuda_stream__`` -- a method
    returning ``(0, handle)`` -- or a raw handle; DeviceMismatchError for a stream of another
    device than ``device``. A wrong version, a 3-tuple, a float handle (truncated: another
    stream), a negative or 65-bit handle were borrowed as streams; a malformed return raised
    bare IndexError/ValueError; a sharedmem Stream of another device was returned as it is."""
    dev, drv = fake

    class P:
        def __init__(self, v):
            self.v = v

        def __cuda_stream__(self):
            return self.v
    for bad in ((1, 0x7B01), ("x", 0x7B02), (0, 0x7B03, 99), 0x7B04, [0, 0x7B05], (0,),
                (0, True)):
        with pytest.raises(TypeError, match=r"__cuda_stream__\(\) returned .*; the protocol is "
                                            r"\(0, handle\)"):
            sm.Stream.from_external(P(bad), device=dev)
    with pytest.raises(TypeError):
        sm.Stream.from_external(P((0, 3.7)), device=dev)
    for bad in (P((0, -5)), -5, 2**64):
        with pytest.raises(ValueError, match=r"names stream handle .*, which is no CUstream"):
            sm.Stream.from_external(bad, device=dev)
    assert sm.Stream.from_external(P((0, 0x7C01)), device=dev).handle == 0x7C01
    s = dev.create_stream()
    with pytest.raises(sm.DeviceMismatchError, match=r"is a stream of <Device cuda:0 .*>, not "
                                                     r"of <Device host>"):
        sm.Stream.from_external(s, device="host")
    assert sm.Stream.from_external(s, device=dev) is s


def test_exit_reports_leaks_and_callback_errors_with_warnings_made_errors(tmp_path):
    """A leak warning given at exit (the test above) was the first warnings.warn of the exit
    hook: with warnings made errors (``-W error``) it raised out of the hook, and the callback
    errors deferred to the exit -- and the host kernel failures never retrieved -- went
    unreported. Each is said (on stderr, where the warning cannot be given)."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import time\n"
        "import sharedmem as sm\n"
        "from sharedmem.backends.host import HostFault\n"
        "dev = sm.Device.host()\n"
        "s, s2 = dev.create_stream('fs'), dev.create_stream('ok')\n"
        "@sm.host_kernel\n"
        "def flt(x):\n"
        "    raise HostFault('device fault')\n"
        "@sm.host_kernel\n"
        "def slow(x):\n"
        "    time.sleep(0.2)\n"
        "sm.launch(flt, 1, 1, sm.Buffer.zeros(4, 'int32', device=dev, stream=s), stream=s)\n"
        "f = sm.launch(slow, 1, 1, sm.Buffer.zeros(4, 'int32', device=dev, stream=s2), "
        "stream=s2)\n"
        "def cb(_):\n"
        "    raise RuntimeError('callback error for the exit')\n"
        "f.add_done_callback(cb)\n"
        "time.sleep(1.0)  # (no API call after)\n")
    out = _run_script(script, "-W", "error")
    assert "LeakWarning: completion of work on <Stream fs on <Device host> (owned)>" in out.stderr
    assert "RuntimeWarning: sharedmem: 1 error(s) raised in callbacks" in out.stderr
    assert "callback error for the exit" in out.stderr
    assert "Exception ignored" not in out.stderr


# -- 27. processes, fork and exit (a review's findings) -----------------------------------------------
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_inherit_the_parents_deferred_errors(host):
    """model.md, Fork: the parent's callbacks are the parent's. Its deferred errors and leak
    warnings stayed in a forked child: the child's first, unrelated call raised the parent's
    callback error (and each child said the parent's leak warning again at its exit). The
    parent still gets its own."""
    import os

    from sharedmem.runtime.state import RUNTIME
    sm.synchronize()
    RUNTIME.errors.append(ValueError("parent's callback failed"))
    RUNTIME.warnings.append("a parent's leak warning")
    pid = os.fork()
    if pid == 0:
        try:
            sm.Buffer.zeros(4, "int32", device=host)
            sm.stats()
            code = 0 if not RUNTIME.warnings else 4
        except BaseException:
            code = 3
        os._exit(code)
    assert os.WEXITSTATUS(os.waitpid(pid, 0)[1]) == 0
    with pytest.raises(ValueError, match="parent's callback failed"):
        with pytest.warns(sm.LeakWarning, match="a parent's leak warning"):
            sm.stats()


def test_a_view_unpickled_where_the_default_stream_faulted_uses_a_pool_stream(host, monkeypatch):
    """A child forked while its default host stream ran a kernel finds that stream faulted (it
    runs nothing more); unpickling a view copied its values there, and failed
    (CompletionUnknownError: a Pool worker died, and Pool.map hung). The copy takes a stream
    of the pool then, as it does where the current stream captures."""
    import pickle

    from sharedmem.pickling import values_stream
    # (unpickled on the default device: the host's here, as where there is no GPU)
    monkeypatch.setattr(sys.modules["sharedmem.device"], "_default", host)
    s = host.default_stream
    data = pickle.dumps(sm.Tensor.from_host(np.arange(4, dtype=np.float32), device=host))
    impl = s._impl
    before = impl._state["fault"]
    impl._state["fault"] = sm.CompletionUnknownError("the default stream was running a task "
                                                     "when the process forked")
    try:
        assert values_stream(host) is not None and values_stream(host) is not s
        t = pickle.loads(data)
        np.testing.assert_array_equal(t.to_host(stream=host.create_stream()), np.arange(4))
    finally:
        impl._state["fault"] = before


def test_exit_waits_for_host_work_on_a_stream_another_thread_captures(tmp_path):
    """model.md, Exit: at exit sharedmem waits for the host work in flight (or warns). With
    another thread capturing on the stream, the wait's marker was recorded into the capture
    (returned at once, and added a task to the user's graph): the work was dropped silently."""
    mark = tmp_path / "ran"
    script = tmp_path / "exit.py"
    script.write_text(
        "import threading, time\n"
        "import sharedmem as sm\n"
        "dev = sm.Device.host()\n"
        "s = dev.create_stream('s')\n"
        "@sm.host_kernel\n"
        "def slow(x):\n"
        "    time.sleep(0.8)\n"
        f"    open({str(mark)!r}, 'w').write('ran')\n"
        "sm.launch(slow, 1, 1, sm.Buffer.zeros(4, 'int32', device=dev, stream=s), stream=s)\n"
        "began = threading.Event()\n"
        "def capture():\n"
        "    with sm.capture(s):\n"
        "        began.set()\n"
        "        time.sleep(30)\n"
        "threading.Thread(target=capture, daemon=True).start()\n"
        "began.wait(10)\n")
    _run_script(script)
    assert mark.exists()


# -- 28. copies and graphs racing captures (a review's findings) ---------------------------------------
def test_a_replay_whose_stream_began_capturing_is_refused_not_recorded(host):
    """A replay checked its stream's capture before its submission, not with it: a capture
    another thread began in between recorded the replay into that thread's graph, and the
    replay's future said done while nothing ran. The submission refuses it under the core lock,
    where captures begin (here called as replay() calls it, the capture already begun)."""
    from sharedmem.runtime.submission import submit_plan

    @sm.host_kernel
    def add1(x):
        x[:] += 1

    x = sm.Buffer.zeros(4, "float64", device=host)
    with sm.capture(host.create_stream()) as inner:
        sm.launch(add1, 1, 1, sm.InOut(x))
    uses, keep, label, executable = inner._replay[:4]
    s = host.create_stream()
    with sm.capture(s) as outer:
        with pytest.raises(sm.CaptureError, match=rf"^replay of graph #{inner.id} on <Stream .*> "
                                                  rf"refused: the stream began capturing graph "
                                                  rf"#{outer.id} \(another thread\)"):
            submit_plan(s, uses, executable, None, None, keep, None, label)
    assert outer.launches == 0
    inner.replay(s).result(10)
    np.testing.assert_array_equal(x.to_host(), [1.0] * 4)


def test_a_copy_in_pieces_is_not_split_by_a_capture_begun_between_pieces(host, monkeypatch):
    """api.md: a copy in pieces may let other threads' work in between pieces. A capture another
    thread began between two pieces of ``copy_from(array)`` recorded the rest into its graph:
    the future said done with most of the destination unwritten. The pieces check under the
    core lock; the copy raises CaptureError, the pieces before it ran (the staging path is
    CUDA's: simulated on the host here)."""
    import threading
    be = host.backend
    monkeypatch.setattr(be, "stage_max", 8 * 1024, raising=False)
    s = host.create_stream()
    dst = sm.Buffer.zeros(8 * 1024, "float64", device=host, stream=s)  # 64 KiB: 8 pieces
    s.synchronize()
    began, done, calls, graphs = threading.Event(), threading.Event(), [], []

    def capture_elsewhere():
        with sm.capture(s) as g:
            began.set()
            done.wait(10)
        graphs.append(g)

    def pinned(n):  # (before each piece's submission, holding no lock)
        calls.append(n)
        if len(calls) == 2:
            threading.Thread(target=capture_elsewhere).start()
            began.wait(10)
        return np.empty(n, np.uint8)
    monkeypatch.setattr(be, "pinned", pinned, raising=False)
    with pytest.raises(sm.CaptureError, match=r"began capturing a graph \(another thread\) "
                                              r"during a copy onto it"):
        dst.copy_from(np.ones(8 * 1024), stream=s)
    done.set()
    while not graphs:
        began.wait(1)
    assert graphs[0].launches == 0  # nothing recorded
    h = dst.to_host(stream=host.create_stream())
    assert (h[:1024] == 1).all() and (h[1024:] == 0).all()  # the first piece ran, alone


def _run_script(script, *flags):
    """``script`` run by this Python (``flags`` before it) with this test run's import path;
    its CompletedProcess, which must have succeeded."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, *flags, str(script)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out


def test_a_view_made_without_its_constructor_is_refused_not_crashed():
    """``Buffer.__new__(Buffer)`` alone: compiled, its C fields start zeroed, and state 0 is
    released (a ReleasedError, never a read through its missing token); interpreted, its slots
    are unset (AttributeError)."""
    host = sm.Device.host()
    for cls in (sm.Buffer, sm.Tensor):
        v = cls.__new__(cls)
        uses = [lambda: v.ptr, lambda: v.allocation, lambda: v.readonly, lambda: v.to_host(),
                lambda: v.__dlpack__(), lambda: sm.launch(sm.host_kernel(lambda x: None), 1, 1, v),
                lambda: sm.Tensor.from_buffer(v, 0) if cls is sm.Buffer else v.into_buffer()]
        for use in uses:
            with pytest.raises((sm.ReleasedError, AttributeError)):
                use()
        if sm.config.compiled():
            assert not v.is_live and repr(v) == f"<{cls.__name__} (released)>"


def test_allocations_and_tokens_take_what_their_compiled_fields_take():
    """``sm.Allocation`` and ``ViewToken``, made directly (an adapter or backend of one's own):
    the same refusals in both builds -- a float address is refused, never truncated to an
    int (compiled, the C field converted it), an address outside 64 bits or a negative size
    is a ValueError, a source or kind that is not a str a TypeError; a token's offsets are
    integers and its writable flag a bool."""
    from sharedmem.allocation import ViewToken
    host = sm.Device.host()
    b = sm.Buffer.zeros(4, device=host)
    a = b.allocation
    for ptr, nbytes in ((1.5, 8), (16, 8.0)):
        with pytest.raises(TypeError, match=r"^'float' object cannot be interpreted as an "
                                            r"integer$"):
            sm.Allocation(host, ptr, nbytes)
    def range_error(ptr, nbytes):
        return rf"^Allocation: ptr must be an address \(0 to 2\*\*64 - 1\) and nbytes a " \
               rf"size \(0 to 2\*\*63 - 1\) whose range ends at or below 2\*\*64, got " \
               rf"{ptr} and {nbytes}$"

    # (the last: a range past the end of the address space)
    for ptr, nbytes in ((-1, 8), (1 << 64, 8), (16, -1), (16, 1 << 63), ((1 << 64) - 1, 16)):
        with pytest.raises(ValueError, match=range_error(ptr, nbytes)):
            sm.Allocation(host, ptr, nbytes)
    assert sm.Allocation(host, (1 << 64) - 16, 16).ptr == (1 << 64) - 16  # (ends at 2**64)
    # an import checks as a new allocation does, compiled or not (compiled, a float address
    # was truncated to an int)
    from sharedmem.allocation import import_allocation
    for ptr, nbytes in ((1.5, 8), (16, 8.0)):
        with pytest.raises(TypeError, match=r"^'float' object cannot be interpreted as an "
                                            r"integer$"):
            import_allocation(host, ptr, nbytes, "test")
    # ... and so does one whose lookup would hit: inside a live allocation (b's), a float
    # address or size was taken (the lookup's compares; compiled, an address truncated), and
    # a range no allocation holds, with a region, made an allocation over the region
    for ptr, nbytes in ((float(a.ptr + 4), 4), (a.ptr + 4, 4.0)):
        with pytest.raises(TypeError, match=r"^'float' object cannot be interpreted as an "
                                            r"integer$"):
            import_allocation(host, ptr, nbytes, "test", region=(a.ptr, a.nbytes))
    for ptr, nbytes in ((-1, 8), (a.ptr, -1), (a.ptr, 1 << 63), ((1 << 64) - 8, 16)):
        with pytest.raises(ValueError, match=range_error(ptr, nbytes)):
            import_allocation(host, ptr, nbytes, "test", region=(a.ptr, a.nbytes))
    # a region that does not hold the range (a CuPy array over UnownedMemory sized by its
    # shape, its strides reaching further): the allocation covers both, so a second import of
    # the range finds it (over the region alone, each import made another)
    arena = np.zeros(512, np.uint8)
    base = arena.ctypes.data
    for k, (ptr, nbytes, region, span) in enumerate((
            (base + 64, 16, (base, 64), (base, 80)), (base + 100, 16, (base + 108, 64),
                                                      (base + 100, 72)),
            (base + 300, 8, (base + 240, 64), (base + 240, 68)))):
        got = import_allocation(host, ptr, nbytes, "test", region=region)
        assert (got.ptr, got.nbytes) == span, k
        assert import_allocation(host, ptr, nbytes, "test", region=region) is got
        assert import_allocation(host, ptr, nbytes, "test") is got
        del got
    assert import_allocation(host, np.uint64(a.ptr + 4), np.int32(4), "test") is a
    with pytest.raises(TypeError, match=r"^Allocation: source must be a str, got bytes$"):
        sm.Allocation(host, 16, 8, source=b"x")
    assert sm.Allocation(host, np.uint64(16), np.int32(8)).ptr == 16
    tok = ViewToken(a, "t", np.int64(0), 4, "no", None)
    assert (tok.start, tok.stop, tok.writable) == (0, 4, True)
    with pytest.raises(TypeError, match=r"^'float' object cannot be interpreted as an integer$"):
        ViewToken(a, "t", 0.0, 4, True, None)
    with pytest.raises(TypeError, match=r"^ViewToken: kind must be a str, got bytes$"):
        ViewToken(a, b"t", 0, 4, True, None)
    with pytest.raises(TypeError):
        a.new_token("t", 0.0, 4, True, None)
    with pytest.raises(TypeError):
        a.new_token("t", 0, 4, True, None, source=42)
    t = a.new_token("t", 0, 4, 2, None)
    assert t.writable is True
    t.release()


def test_odd_shapes_steps_and_box_values_are_named_in_their_errors():
    """A reshape whose other sizes are not ints names the whole shape given (it named the
    rest without its -1); a slice step that is no int says so (it was Python's '<=' between
    str and int); a DeviceBox value its dtype cannot take names the dtype (it was NumPy's
    bare words)."""
    t = sm.Tensor.from_host(np.arange(12, dtype=np.float32))
    with pytest.raises(TypeError, match=r"^shape must be an int or a sequence of ints, got "
                                        r"\[-1, True\]$"):
        t.reshape([-1, True])
    # (a size the checks refuse beside the -1: the message names the shape given too -- it
    # named the rest alone, "(-2,)", a shape nobody passed)
    with pytest.raises(sm.LayoutError, match=r"^reshape\(-1, -2\): shape must not have negative "
                                             r"sizes, got \(-2,\)$"):
        t.reshape(-1, -2)
    with pytest.raises(TypeError, match=r"^tensor slice steps are ints, got 'a'$"):
        t[::"a"]
    assert t[::np.int64(2)].shape == (6,)
    with pytest.raises(TypeError, match=r"^a DeviceBox of float32 cannot hold 1j: "):
        sm.DeviceBox(1j, "float32")
    assert t.allocation.live_views == 1


def test_a_devicebox_refuses_a_0d_array_of_none_or_of_a_string(host):
    """api.md: a DeviceBox value is "one number, bool or 0-d array (TypeError for None,
    strings, sequences)". A 0-d array holding None or a string passed the check (its ndim is
    0) and was then converted as its item: ``DeviceBox(np.array(None))`` held nan, and
    ``np.array("7")`` or ``np.array(b"7")`` were parsed -- what the check refuses for the bare
    None and strings. Nothing is written by a refused set."""
    for bad in (np.array(None), np.array("7"), np.array(b"7"), np.array(None, dtype=object)):
        with pytest.raises(TypeError, match=r"^a DeviceBox holds one number, got array\("):
            sm.DeviceBox(bad, "float64", device=host)
    box = sm.DeviceBox(2.5, "float32", device=host)
    with pytest.raises(TypeError, match=r"^a DeviceBox holds one number, got array\(None, "
                                        r"dtype=object\)$"):
        box.set(np.array(None))
    assert box.get() == 2.5
    box.set(np.array(4.0)).result(5)  # (a 0-d array of a number is one)
    assert box.get() == 4.0


def test_a_0d_array_as_a_shape_or_strides_is_named_in_the_error(host):
    """A 0-d array has ``__iter__`` but cannot be iterated: ``Tensor.empty(np.array(5))``,
    ``t.reshape(np.array(6))`` and ``from_buffer(b, (6,), strides=np.array(1))`` raised
    NumPy's bare "iteration over a 0-d array" -- no word of a shape or strides. Now the
    TypeError every other non-sequence gets, naming the value; nothing is moved."""
    with pytest.raises(TypeError, match=r"^shape must be an int or a sequence of ints, got "
                                        r"array\(5\)$"):
        sm.Tensor.empty(np.array(5), "float32", device=host)
    t = sm.Tensor.from_host(np.arange(6, dtype=np.float32), device=host)
    with pytest.raises(TypeError, match=r"^shape must be an int or a sequence of ints, got "
                                        r"array\(6\)$"):
        t.reshape(np.array(6))
    b = t.into_buffer()
    with pytest.raises(TypeError, match=r"^strides must be a sequence of ints \(elements\), got "
                                        r"array\(1\)$"):
        sm.Tensor.from_buffer(b, (6,), strides=np.array(1))
    assert b.is_live and b.allocation.live_views == 1  # not moved
    assert sm.Tensor.from_buffer(b, (6,), strides=np.array([1])).shape == (6,)


# -- 17. CAI sizes and strides that no int64 holds ---------------------------------------------------
@pytest.mark.parametrize("shape, strides, match", [
    ((0, 1 << 64), None, r"'shape' \(0, 18446744073709551616\) has a size of 2\*\*63 or more"),
    ((0, 1 << 62, 1 << 62), None, r"'shape' \(0, 4611686018427387904, 4611686018427387904\) "
                                  r"spans 2\*\*63 elements or more"),
    ((1,), (1 << 70,), r"'strides' \(1180591620717411303424,\) are not 64-bit byte strides"),
])
def test_a_cai_shape_or_strides_beyond_int64_is_refused(fake, shape, strides, match):
    """A CAI producer's shape and strides are int64s (NumPy's, CuPy's, Numba's intp). An empty
    shape with a size of 2**64, or sizes multiplying to 2**124, and a size-1 dimension's stride
    of 2**70 bytes, were imported (each claims no bytes past the data): Tensors that
    sharedmem's own constructors refuse (LayoutError), whose ``__dlpack__`` then failed with
    struct.error interpreted and OverflowError compiled. ValueError naming the entry, as for
    the pointer; nothing imported."""
    dev, drv = fake
    b = sm.Buffer.zeros(4, "float32", device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    sm.synchronize()

    class Producer:
        __cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "version": 3,
                                    "data": (b.ptr, False), "strides": strides}
    with pytest.raises(ValueError, match=r"^malformed __cuda_array_interface__: " + match):
        sm.from_cuda_array_interface(Producer())
    gc_collect_harder()
    assert b.allocation.live_views == 1
