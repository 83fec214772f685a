"""DLPack on the host backend, checked against NumPy's own implementation."""

import gc
import re

import numpy as np
import pytest

import sharedmem as sm
from interop import dlpack as dl

from conftest import gc_collect_harder


def test_numpy_consumes_our_tensor_zero_copy(host):
    t = sm.Tensor.from_host(np.arange(12, dtype=np.float32).reshape(3, 4), device=host)
    alloc = t.allocation
    assert t.__dlpack_device__() == (dl.kDLCPU, 0)
    a = np.from_dlpack(t)
    assert a.ctypes.data == t.ptr and a.shape == (3, 4) and a.dtype == np.float32
    np.testing.assert_array_equal(a, np.arange(12).reshape(3, 4))
    assert alloc.live_views == 2  # the tensor and the export
    with pytest.raises(sm.AliasError, match=r"  - DLPack export, bytes \[0, 48\)"):
        t.into_buffer()
    a[0, 0] = 42  # writes through: same memory
    assert t.to_host()[0, 0] == 42
    del a
    gc_collect_harder()
    assert alloc.live_views == 1
    assert t.into_buffer().ptr == alloc.ptr  # the consumer is gone: the move succeeds


def test_export_waits_for_pending_host_writes(host):
    import threading
    gate = threading.Event()

    @sm.host_kernel
    def slow_fill(x):
        gate.wait(5)
        x[:] = 7

    s = host.create_stream()
    t = sm.Tensor.from_host(np.zeros(8, np.int32), device=host, stream=s)
    sm.launch(slow_fill, 1, 1, sm.Out(t), stream=s)
    threading.Timer(0.2, gate.set).start()
    a = np.from_dlpack(t)  # must not return before the slow write ran
    assert a.tolist() == [7] * 8


def test_read_only_export(host):
    t = sm.Tensor.from_host(np.ones(4, np.int16), device=host).as_readonly()
    a = np.from_dlpack(t)  # NumPy asks for a versioned capsule
    assert not a.flags.writeable
    with pytest.raises(BufferError, match=r"^cannot export read-only <Tensor read-only int16 .* as a legacy DLPack capsule"):
        t.__dlpack__()


def test_versioned_and_legacy_capsules(host):
    t = sm.Tensor.from_host(np.arange(3, dtype=np.int64), device=host)
    for kwargs, name in [({}, b"dltensor"), ({"max_version": (0, 8)}, b"dltensor"),
                         ({"max_version": (1, 0)}, b"dltensor_versioned"),
                         ({"max_version": (1, 3)}, b"dltensor_versioned")]:
        cap = t.__dlpack__(**kwargs)
        assert dl._get_name(cap) == name
        assert t.allocation.live_views == 2
        del cap  # an unused capsule releases its token
        gc.collect()
        assert t.allocation.live_views == 1
    cap = t.__dlpack__(max_version=(1, 0))
    m = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned"))
    assert (m.version.major, m.version.minor) == (1, 0) and m.flags == 0
    assert m.dl_tensor.ndim == 1 and m.dl_tensor.shape[0] == 3 and m.dl_tensor.strides[0] == 1
    assert (m.dl_tensor.dtype.code, m.dl_tensor.dtype.bits) == (dl.kDLInt, 64)
    assert m.dl_tensor.data == t.ptr


def test_stream_and_device_arguments_on_host(host):
    t = sm.Tensor.from_host(np.zeros(2), device=host)
    with pytest.raises(BufferError, match=r"^stream=1 is not valid for a host-device export; only None$"):
        t.__dlpack__(stream=1)
    with pytest.raises(BufferError, match=r"^cannot export <Tensor float64 .* to device "
                                          r"\(2, 0\) with copy=False: it lives on \(1, 0\) "
                                          r"\(copy=None or copy=True makes a copy there\)$"):
        t.__dlpack__(dl_device=(dl.kDLCUDA, 0), copy=False)
    for bad in (1, ()):  # (the device is refused first, whatever max_version says)
        with pytest.raises(BufferError, match=r"^cannot export .* with copy=False"):
            t.__dlpack__(max_version=bad, dl_device=(dl.kDLCUDA, 0), copy=False)
    assert t.allocation.live_views == 1  # failed exports take no token


def test_copy_true_copies_and_says_so(host):
    t = sm.Tensor.from_host(np.arange(4, dtype=np.float32), device=host)
    a = np.from_dlpack(t, copy=True)
    assert a.ctypes.data != t.ptr
    np.testing.assert_array_equal(a, np.arange(4))
    cap = t.__dlpack__(max_version=(1, 0), copy=True)
    m = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned"))
    assert m.flags & dl.FLAG_IS_COPIED and m.dl_tensor.data != t.ptr


def test_import_numpy_zero_copy(host):
    a = np.arange(20, dtype=np.float64).reshape(4, 5)
    t = sm.from_dlpack(a)
    assert t.ptr == a.ctypes.data and t.shape == (4, 5) and t.strides == (5, 1)
    assert t.device is host and t.allocation.source == "dlpack"
    np.testing.assert_array_equal(t.to_host(), a)
    # the same bytes imported twice are one allocation
    t2 = sm.Tensor.from_dlpack(a[1:3])
    assert t2.allocation is t.allocation and t2.ptr == a.ctypes.data + 40
    assert t.allocation.live_views == 4  # two imports, each with its producer as an alias
    del t2
    gc_collect_harder()
    # the producer can still write these bytes: a move out of the import is refused
    with pytest.raises(sm.AliasError, match=r"(?s)cannot move Tensor.*:\n  - producer "
                       r"numpy\.ndarray \(it can still reach these bytes\), bytes \[0, 160\) of "
                       r"allocation #\d+\n"):
        t.into_buffer()
    assert t.is_live and t.allocation.live_views == 2
    a[0, 0] = 7.0  # ... because it can
    assert t.to_host()[0, 0] == 7.0


def test_adopt_takes_the_memory_over(host):
    t = sm.adopt(np.arange(6, dtype=np.int32))  # a temporary: nothing else reaches it
    assert t.allocation.live_views == 1 and t.allocation.source == "dlpack (adopted)"
    b = t.into_buffer()
    np.testing.assert_array_equal(b.to_host(), np.arange(6))
    a = np.zeros(4)
    other = [a]
    with pytest.raises(sm.AliasError, match=r"^cannot adopt numpy\.ndarray \(shape \(4,\), "
                       r"float64\): 1 other reference to it \(names, containers, views or weak references\) exists"):
        sm.adopt(a)
    other.clear()
    t2 = sm.adopt(a)
    assert t2.ptr == a.ctypes.data
    base = np.zeros(8)
    with pytest.raises(sm.AliasError, match=r"^cannot adopt a view of another numpy\.ndarray"):
        sm.adopt(base[2:])
    with pytest.raises(sm.AliasError, match=r"^cannot adopt a builtins\.list: sharedmem can show"):
        sm.adopt([1, 2])
    # an array over memory an object that is not an array owns (bytes, an mmap)
    with pytest.raises(sm.AliasError, match=r"^cannot adopt a numpy\.ndarray over memory a bytes "
                                            r"owns: that object still reaches it\. Copy it"):
        sm.adopt(np.frombuffer(b"abcdefgh", "u1"))
    # objects of the array libraries that are not arrays: refused the same way
    for obj, name in ((np.float64(1), r"numpy\.float64"), (np.dtype("f4"), r"numpy\.\S*Float32DType")):
        with pytest.raises(sm.AliasError, match=rf"^cannot adopt a {name}: sharedmem can show"):
            sm.adopt(obj)


def test_producer_alias_ends_with_the_import(host):
    a = np.arange(8, dtype=np.float32)
    t = sm.from_dlpack(a)
    alloc = t.allocation
    assert [v.split(",")[0] for v in alloc.views()] == [
        "tensor", "producer numpy.ndarray (it can still reach these bytes)"]
    del t
    gc_collect_harder()
    assert alloc.live_views == 0  # the capsule's deleter ran, and the alias went with it


# A producer whose capsule keeps the array it holds, not the producer itself (as torch's keeps
# a tensor's storage, not the tensor object): source, run here and in fresh interpreters
_HOLDER = """
class Holder:
    def __init__(self):
        self.arr = np.arange(8, dtype=np.float32)

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()
"""


def test_producer_alias_ends_when_the_producer_is_collected_first(host):
    """A producer its capsule does not keep alive (torch's keeps the storage, not the tensor
    object) counts as an alias while it lives: a move of the import is refused, naming it,
    and leaves the import usable. Once the producer is garbage collected the alias is gone
    and the move goes through, zero-copy; the memory stays alive (the capsule's owner)."""

    ns = {"np": np, "__name__": "test_dlpack"}
    exec(_HOLDER, ns)
    Producer = ns["Holder"]
    p = Producer()
    t = sm.from_dlpack(p)
    ptr = t.ptr
    assert ptr == p.arr.ctypes.data
    assert [v.split(" (")[0] for v in t.allocation.views()] == [
        "tensor, bytes [0, 32) of allocation #%d" % t.allocation.id,
        f"producer test_dlpack.{Producer.__qualname__}"]
    named = rf"producer test_dlpack\.{re.escape(Producer.__qualname__)} "
    with pytest.raises(sm.AliasError, match=named + r"\(it can still reach these bytes\)"):
        t.into_buffer()
    assert t.allocation.live_views == 2 and t.to_host().tolist() == list(range(8))
    del p
    gc_collect_harder()
    assert t.allocation.live_views == 1
    b = t.into_buffer()
    assert b.ptr == ptr and b.to_host().tolist() == list(range(8))


def test_import_keeps_producer_alive(host):
    a = np.arange(1000, dtype=np.int32)
    t = sm.from_dlpack(a)
    del a
    gc_collect_harder()
    np.testing.assert_array_equal(t.to_host(), np.arange(1000))


def test_import_readonly_is_honoured(host):
    a = np.arange(4, dtype=np.int32)
    a.flags.writeable = False
    t = sm.from_dlpack(a)
    assert t.readonly
    with pytest.raises(sm.KernelError, match="would write through a read-only view"):
        sm.launch(sm.host_kernel(lambda x: None), 1, 1, sm.Out(t))


def test_an_import_of_bytes_only_read_only_views_reach_is_read_only(host):
    """A producer that cannot say read-only (CuPy: ``as_cupy`` or ``cupy.asarray`` of a
    read-only view gives a normal array; its capsule and CAI say writable) re-exporting the
    bytes of a read-only view: the import was a writable Tensor, which a launch wrote through
    (as_cupy's own array, passed to a launch, is refused as Out). Read-only now, as a launch
    takes such an array or a torch tensor -- writable only where a writable view reaches the
    bytes, or none does."""
    import ctypes
    t = sm.Tensor.from_host(np.arange(6, dtype=np.float32), device=host)
    ro = t.as_readonly()
    shape = (ctypes.c_int64 * 1)(6)

    def capsule():  # a producer's writable capsule of ro's bytes (a NULL deleter)
        m = dl.DLManagedTensorVersioned()
        m.version.major = 1
        d = m.dl_tensor
        d.data, d.device.device_type, d.ndim = ro.ptr, dl.kDLCPU, 1
        d.dtype.code, d.dtype.bits, d.dtype.lanes = dl.kDLFloat, 32, 1
        d.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        return dl._capsule_new(ctypes.addressof(m), b"dltensor_versioned",
                               dl._CAPSULE_DESTRUCTOR()), m

    cap, m = capsule()
    both = sm.from_dlpack(cap)  # t, writable, still reaches the bytes
    assert both.allocation is t.allocation and not both.readonly
    both.release()
    t.release()
    cap, m = capsule()
    imp = sm.from_dlpack(cap)
    assert imp.allocation is ro.allocation and imp.readonly
    with pytest.raises(sm.KernelError, match="would write through a read-only view"):
        sm.launch(sm.host_kernel(lambda x: x.fill(0)), 1, 1, sm.Out(imp))
    np.testing.assert_array_equal(ro.to_host(), np.arange(6))
    imp.release()
    ro.release()
    del cap, m


def test_our_export_imported_back_is_the_same_allocation(host):
    """Our own export imported back ends the export at once -- the import's token keeps the
    memory: kept, the export was an alias of the import itself, which could then never be
    moved (AliasError naming "DLPack export", the original released or not)."""
    t = sm.Tensor.from_host(np.arange(6, dtype=np.uint8), device=host)
    back = sm.from_dlpack(t)
    assert back.allocation is t.allocation and back.ptr == t.ptr
    assert t.allocation.live_views == 2  # t, back
    t.release()
    b = back.into_buffer()
    assert b.to_host().tolist() == list(range(6)) and b.allocation.live_views == 1
    # a bare capsule of ours: no "producer" alias either (our views count themselves)
    t = sm.Tensor.from_host(np.arange(6, dtype=np.uint8), device=host)
    back = sm.from_dlpack(t.__dlpack__(max_version=(1, 0)))
    assert back.allocation.views() == [f"tensor, bytes [0, 6) of allocation #{t.allocation.id}",
                                       f"tensor, bytes [0, 6) of allocation #{t.allocation.id}"]
    t.release()
    assert back.into_buffer().allocation.live_views == 1


def test_bad_input_errors():
    with pytest.raises(TypeError, match=r"^int does not support DLPack \(no __dlpack__\)$"):
        sm.from_dlpack(3)
    a = np.arange(3.0)
    cap = a.__dlpack__()
    sm.from_dlpack(cap)
    with pytest.raises(BufferError, match=r"^this DLPack capsule was already consumed"):
        sm.from_dlpack(cap)
    with pytest.raises(BufferError, match=r"^dtype \[\('a', '<i4'\)\] has no DLPack equivalent"):
        dl._dl_dtype(np.dtype([("a", "i4")]))
    with pytest.raises(BufferError, match=r"negative strides"):
        sm.from_dlpack(np.arange(6.0)[::-1])


def test_unknown_major_version_is_refused():
    t = sm.Tensor.from_host(np.arange(3.0), device=sm.Device.host())
    cap = t.__dlpack__(max_version=(1, 0))
    m = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned"))
    m.version.major = 2
    with pytest.raises(BufferError, match=r"^DLPack major version 2 is not supported"):
        sm.from_dlpack(cap)
    assert dl._is_valid(cap, b"dltensor_versioned")  # not consumed: its deleter still runs
    del cap
    gc_collect_harder()
    assert t.allocation.live_views == 1


def test_a_consumer_calls_the_deleter_from_any_thread(host):
    import threading
    # a 3x4 int32 tensor seen as 4x3 (strides in elements: 1, 4)
    buf = sm.Buffer.from_host(np.arange(12, dtype=np.int32), device=host)
    t = sm.Tensor.from_buffer(buf, (4, 3), strides=(1, 4))
    alloc = t.allocation
    ro = t.as_readonly()
    views = alloc.live_views
    for view, kwargs, name, struct_ in [
            (t, {}, b"dltensor", dl.DLManagedTensor),
            (ro, {"max_version": (1, 0)}, b"dltensor_versioned", dl.DLManagedTensorVersioned)]:
        cap = view.__dlpack__(**kwargs)
        addr = dl._get_pointer(cap, name)
        m = struct_.from_address(addr)
        d = m.dl_tensor
        assert (d.data, d.device.device_type, d.device.device_id, d.ndim) == (t.ptr, dl.kDLCPU, 0, 2)
        assert (d.dtype.code, d.dtype.bits, d.dtype.lanes, d.byte_offset) == (dl.kDLInt, 32, 1, 0)
        assert (d.shape[0], d.shape[1], d.strides[0], d.strides[1]) == (4, 3, 1, 4)
        if name == b"dltensor_versioned":
            assert m.flags == dl.FLAG_READ_ONLY
        assert alloc.live_views == views + 1
        # consume it as a library would: rename the capsule, call the deleter later -- here from
        # a thread of its own, without the GIL (ctypes drops it around a foreign call)
        assert dl._set_name(cap, b"used_" + name) == 0
        del cap
        gc_collect_harder()
        assert alloc.live_views == views + 1  # a consumed capsule leaves the deleter to its consumer
        deleter = m.deleter
        th = threading.Thread(target=deleter, args=(addr,))
        th.start()
        th.join()
        assert alloc.live_views == views


# (an unsupported dtype: what it was given, what is wrong, what sharedmem takes)
_DT = r"cannot import a DLPack capsule: DLPack dtype "
_TAKES = (r" is not supported; sharedmem imports bool \(8 bits\), int, uint, float \(up to 64 "
          r"bits\), complex \(up to 128\) and bfloat16: convert the array to one of those first")


@pytest.mark.parametrize("field, value, msg", [
    ("lanes", 2, _DT + r"with 2 lanes \(vector types\)" + _TAKES),
    ("code", 99, _DT + r"\(code 99, 64 bits\)" + _TAKES),
    ("bits", 12, _DT + r"\(code 2, 12 bits\)" + _TAKES),
    ("bits", 24, _DT + r"\(code 2, 24 bits\)" + _TAKES),
    ("device_type", 7, r"DLPack device type 7 \(id 0\) is not supported; sharedmem imports CPU "
                       r"and CUDA memory"),
    ("shape", -3, r"DLPack tensor with negative shape \(-3,\)"),
    # a bool of 8 bytes, an IEEE binary128 float: neither is NumPy's bool or float128
    ("code", 6, _DT + r"\(code 6, 64 bits\)" + _TAKES),
    ("bits", 128, _DT + r"\(code 2, 128 bits\)" + _TAKES),
])
def test_a_malformed_capsule_is_refused_and_left_unconsumed(host, field, value, msg):
    """A capsule whose dtype, device or shape sharedmem cannot take is a BufferError; it is
    left unconsumed (its producer's deleter runs when it is dropped: the export's token goes)."""
    t = sm.Tensor.from_host(np.arange(3.0), device=host)
    cap = t.__dlpack__(max_version=(1, 0))
    d = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned")).dl_tensor
    if field in ("lanes", "code", "bits"):
        setattr(d.dtype, field, value)
    elif field == "device_type":
        d.device.device_type = value
    else:
        d.shape[0] = value
    with pytest.raises(BufferError, match="^" + msg + "$"):
        sm.from_dlpack(cap)
    assert dl._is_valid(cap, b"dltensor_versioned") and t.allocation.live_views == 2
    del cap
    gc_collect_harder()
    assert t.allocation.live_views == 1


def test_an_unsupported_dtype_names_the_producer(host):
    """The refusal of a dtype names what the import was given (its library and type), not
    only the DLPack codes -- and says what sharedmem takes."""
    t = sm.Tensor.from_host(np.arange(3.0), device=host)
    cap = t.__dlpack__(max_version=(1, 0))
    dl.DLManagedTensorVersioned.from_address(
        dl._get_pointer(cap, b"dltensor_versioned")).dl_tensor.dtype.code = 99

    class Producer:
        def __dlpack__(self, stream=None, max_version=None):
            return cap

        def __dlpack_device__(self):
            return (1, 0)
    with pytest.raises(BufferError, match=r"^cannot import a test_dlpack.Producer: DLPack dtype "
                                          r"\(code 99, 64 bits\)" + _TAKES + "$"):
        sm.from_dlpack(Producer())
    del cap
    gc_collect_harder()
    assert t.allocation.live_views == 1


def test_a_capsule_without_strides_is_c_contiguous(host):
    t = sm.Tensor.from_host(np.arange(6, dtype=np.int32).reshape(2, 3), device=host)
    cap = t.__dlpack__()
    dl.DLManagedTensor.from_address(dl._get_pointer(cap, b"dltensor")).dl_tensor.strides = None
    back = sm.from_dlpack(cap)
    assert back.shape == (2, 3) and back.strides == (3, 1) and back.ptr == t.ptr
    np.testing.assert_array_equal(back.to_host(), np.arange(6).reshape(2, 3))


def test_producers_old_and_odd(host):
    """A producer from before DLPack 1.0 (no ``max_version``) is asked again without it; one
    whose ``__dlpack__`` returns no capsule is a BufferError; ``device=`` must be the
    producer's; ``interop.dlpack.export`` is ``__dlpack__``; a copy to a device that is
    neither CPU nor CUDA is refused."""
    class Old:
        def __init__(self, a):
            self.a, self.asked = a, []

        def __dlpack__(self, stream=None):
            self.asked.append(stream)
            return self.a.__dlpack__()
    old = Old(np.arange(4.0))
    t = sm.from_dlpack(old)
    np.testing.assert_array_equal(t.to_host(), np.arange(4.0))
    assert old.asked == [None] and t.ptr == old.a.ctypes.data

    class NoCapsule:
        def __dlpack__(self, **kw):
            return 5
    with pytest.raises(BufferError, match=r"^not a DLPack capsule \(capsule name None\)$"):
        sm.from_dlpack(NoCapsule())
    a = np.arange(2.0)
    assert sm.from_dlpack(a, device="host").device is host
    assert sm.from_dlpack(a, device=host).ptr == a.ctypes.data
    x = sm.Tensor.from_host(np.arange(3.0), device=host)
    cap = dl.export(x, max_version=(1, 0))
    assert dl._is_valid(cap, b"dltensor_versioned") and x.allocation.live_views == 2
    del cap
    gc_collect_harder()
    with pytest.raises(BufferError, match=r"^cannot copy to DLPack device \(9, 0\); only CPU and "
                                          r"CUDA are supported$"):
        x.__dlpack__(dl_device=(9, 0), copy=True)
    assert x.allocation.live_views == 1


def test_a_long_double_is_not_exported_as_dlpack_s_ieee_binary128():
    """NumPy's float128 / complex256 are the platform's long double (x87's 80-bit format on
    x86), not the IEEE binary128 DLPack's 128-bit float means: a consumer read garbage (and a
    complex256 export failed with struct.error interpreted, a capsule of 0 bits compiled)."""
    for dt in (np.longdouble, np.clongdouble):
        if np.dtype(dt).itemsize <= (16 if np.dtype(dt).kind == "c" else 8):
            continue  # (a long double that is a double: exported as one)
        with pytest.raises(BufferError, match=r"the platform's long double\) has no DLPack "
                                              r"equivalent"):
            dl._dl_dtype(np.dtype(dt))
        t = sm.Tensor.from_host(np.zeros(2, dt), device=sm.Device.host())
        with pytest.raises(BufferError, match="has no DLPack equivalent"):
            t.__dlpack__()
        assert t.allocation.live_views == 1


def test_a_capsule_of_a_cuda_device_that_cannot_be_used_is_a_buffer_error(host):
    """interop-dlpack.md: unknown devices are a BufferError; a CUDA device id that does not
    exist raised ValueError, and no CUDA backend here BackendUnavailableError. The capsule is
    left unconsumed."""
    t = sm.Tensor.from_host(np.arange(3.0), device=host)
    cap = t.__dlpack__(max_version=(1, 0))
    d = dl.DLManagedTensorVersioned.from_address(
        dl._get_pointer(cap, b"dltensor_versioned")).dl_tensor
    d.device.device_type, d.device.device_id = dl.kDLCUDA, 4096
    with pytest.raises(BufferError, match=r"^DLPack device \(CUDA, id 4096\) is not usable "
                                          r"here: "):
        sm.from_dlpack(cap)
    assert dl._is_valid(cap, b"dltensor_versioned")


def _read_after_a_slow_write(host, written, read):
    """What a host kernel reading ``read`` on one stream sees after a slow kernel writing 1.0
    into ``written`` on another: the write, where the two are one allocation (ordered)."""
    import time
    seen = []

    def writer(x):
        time.sleep(0.2)
        x[...] = 1.0
    s1, s2 = host.create_stream("writer"), host.create_stream("reader")
    sm.launch(sm.host_kernel(writer), 1, 1, sm.Out(written), stream=s1)
    sm.launch(sm.host_kernel(lambda y: seen.append(y.copy())), 1, 1, sm.In(read), stream=s2)
    sm.synchronize()
    return seen[0]


@pytest.mark.parametrize("first", ["part", "whole"])
def test_imports_of_views_of_one_numpy_array_are_one_allocation_in_any_order(host, first):
    """A part of an array imported before the whole was an allocation of its own, and the
    whole another: a writer of the whole on one stream and a reader of the part on another
    were not ordered (the reader saw zeros). Every view of one array is a range of its base's
    allocation."""
    _check_part_and_whole_are_one_allocation(host, np.zeros(16, np.float32), first)


def _check_part_and_whole_are_one_allocation(host, a, first):
    """``a[4:8]`` and ``a`` (16 zeros), imported in the order ``first`` says, are ranges of one
    allocation, and work on them is ordered."""
    if first == "part":
        part = sm.from_dlpack(a[4:8])
        whole = sm.from_dlpack(a)
    else:
        whole = sm.from_dlpack(a)
        part = sm.from_dlpack(a[4:8])
    assert part.allocation is whole.allocation
    assert _read_after_a_slow_write(host, whole, part).tolist() == [1.0] * 4


# -- the export's arguments, checked as documented (errors.md; from a review) ------------------
def _exported_nothing(t):
    gc.collect()
    assert t.allocation.live_views == 1 and sm.stats().live_allocations >= 1
    assert t.into_buffer().to_host().tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("bad", [(1,), (1, 0, 0), (1.5, 0), {0: 1}, (1, "0"), "10"])
def test_max_version_that_is_not_a_pair_of_ints_is_a_type_error(bad):
    """Only ``max_version[0] >= 1`` was read: these exported a versioned capsule."""
    t = sm.Tensor.from_host(np.arange(6, dtype=np.float32), device=sm.Device.host())
    with pytest.raises(TypeError, match=r"^max_version must be None or a \(major, minor\) tuple "
                                        r"of ints, got "):
        t.__dlpack__(max_version=bad)
    _exported_nothing(t)


def test_copy_takes_numpy_bools_and_refuses_other_truthy_values():
    """``copy is True`` was the test: ``copy=np.True_`` (or 1) exported the view's own bytes,
    a zero-copy capsule, to a consumer that asked for a copy."""
    t = sm.Tensor.from_host(np.arange(6, dtype=np.float32), device=sm.Device.host())
    for bad in (1, "yes", 0.0):
        with pytest.raises(TypeError, match=rf"^copy must be None, True or False, got {bad!r}$"):
            t.__dlpack__(copy=bad)
    cap = t.__dlpack__(max_version=(1, 0), copy=np.True_)
    m = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned"))
    assert m.flags & dl.FLAG_IS_COPIED and m.dl_tensor.data != t.ptr
    del cap, m
    cap = t.__dlpack__(max_version=(1, 0), copy=np.False_)
    m = dl.DLManagedTensorVersioned.from_address(dl._get_pointer(cap, b"dltensor_versioned"))
    assert not m.flags & dl.FLAG_IS_COPIED and m.dl_tensor.data == t.ptr
    del cap, m
    _exported_nothing(t)


@pytest.mark.parametrize("where", [(1, 7), (1, -1)])
def test_a_copy_to_a_cpu_device_that_does_not_exist_is_a_buffer_error(where):
    """DLPack's one CPU device is ``(kDLCPU, 0)``: another id was ignored (a host copy whose
    capsule said ``(1, 0)``)."""
    t = sm.Tensor.from_host(np.arange(6, dtype=np.float32), device=sm.Device.host())
    before = sm.stats().live_allocations
    with pytest.raises(BufferError, match=rf"^cannot copy .* to DLPack device \({where[0]}, "
                                          rf"{where[1]}\): there is no such CPU device; the host "
                                          rf"is \(1, 0\)$"):
        t.__dlpack__(dl_device=where)
    assert sm.stats().live_allocations == before  # (no copy left behind)
    _exported_nothing(t)


def test_an_ndarray_subclass_whose_capsule_is_other_memory_is_not_imported_over_its_base(host):
    """An ndarray subclass whose ``__dlpack__`` gives another array's memory (one that copies,
    or hands out a buffer of its own) was imported as a range of the *subclass's* base:
    an allocation over the wrong bytes, with the import's token beyond its end, and the real
    memory's own import another allocation -- a writer of one and a reader of the other were
    not ordered. The region of an ndarray's base is used only where it holds the capsule's
    bytes."""
    other = np.zeros(8, np.float32)

    class Copying(np.ndarray):
        def __dlpack__(self, **kw):
            return other.__dlpack__(**kw)

    s = np.arange(4, dtype=np.float32).view(Copying)
    t = sm.from_dlpack(s)
    alloc, tok = t.allocation, t._live_token()
    assert t.ptr == other.ctypes.data and t.shape == (8,)
    assert 0 <= tok.start <= tok.stop <= alloc.nbytes  # the import's bytes lie in its allocation
    assert alloc.ptr <= t.ptr and t.ptr + t.nbytes <= alloc.ptr + alloc.nbytes
    whole = sm.from_dlpack(other)
    assert whole.allocation is alloc  # one memory, one allocation
    assert _read_after_a_slow_write(host, t, whole).tolist() == [1.0] * 8


def test_an_ndarray_subclass_owning_its_memory_whose_capsule_is_part_of_it_is_one_allocation(
        host):
    """An ndarray subclass that owns its memory (no base) and exports part of it (a padded
    buffer giving its inner window) is imported over the whole array, as a view of it is: its
    import and a later import of all of its bytes are ranges of one allocation -- over the
    capsule's bytes alone, the later import was a second allocation over the same memory, and
    work on the two was not ordered."""

    class Padded(np.ndarray):
        def __dlpack__(self, **kw):
            return np.ndarray.__dlpack__(self.view(np.ndarray)[1:-1], **kw)

    p = Padded((8,), np.float32)
    p[:] = np.arange(8)
    assert p.base is None and p.flags.owndata
    t = sm.from_dlpack(p)
    assert (t.ptr, t.shape) == (p.ctypes.data + 4, (6,))
    whole = sm.from_dlpack(p.view(np.ndarray))
    assert whole.allocation is t.allocation  # one memory, one allocation
    assert (t.allocation.ptr, t.allocation.nbytes) == (p.ctypes.data, 32)


def test_a_negated_view_of_a_torch_tensor_subclass_is_refused_too(host, monkeypatch):
    """The negative bit was refused only where the producer's class was defined in torch
    (its ``__module__``): a ``torch.Tensor`` subclass of the user's (or of another library)
    keeps the subclass through ``x.conj().imag`` and torch exports it, negative bit and all,
    as its memory -- imported with the wrong sign. Refused for every torch tensor."""
    _, tensor = _fake_torch(monkeypatch)  # (its class defined in this module)
    neg = tensor(np.arange(4, dtype=np.float32))
    neg.dtype, neg.is_neg = "torch.float32", lambda: True  # (x.conj().imag, as torch gives it)
    before = sm.stats().live_allocations
    with pytest.raises(BufferError, match=r"^cannot import a torch tensor with the negative bit "
                                          r"set \(shape \(4,\), torch.float32\).*resolve_neg"):
        sm.from_dlpack(neg)
    assert sm.stats().live_allocations == before


@pytest.mark.parametrize("first", ["part", "whole"])
def test_views_of_a_torch_tensor_subclass_are_one_allocation_too(host, monkeypatch, first):
    """Host memory of a torch tensor is filed under its storage (a view imported before its
    base is a range of the base's allocation) -- only where the producer's class was defined
    in torch: a ``torch.Tensor`` subclass of another module made a view an allocation of its
    own, and work on the part and on the whole was not ordered."""
    _, tensor = _fake_torch(monkeypatch)  # (its class defined in this module)
    _check_part_and_whole_are_one_allocation(host, tensor(np.zeros(16, np.float32)), first)


# -- foreign arrays as host-kernel arguments, without torch or JAX installed ---------------------
def _fake_torch(monkeypatch):
    """A module standing in for torch (``sys.modules["torch"]``) and a CPU tensor class of it
    over NumPy memory: what a host launch reads of a torch tensor (device, layout, data
    pointer, element size, shape, strides in elements, storage), and DLPack (for
    ``sm.from_dlpack``). Returns ``(torch, tensor)``, ``tensor(base)`` a tensor of all of
    NumPy array ``base``; a kernel reaches its memory as ``t.host``."""
    import sys
    import types
    torch = types.ModuleType("torch")
    torch.strided = object()

    class Tensor:  # (torch's: what isinstance is asked of)
        pass

    torch.Tensor = Tensor
    monkeypatch.setitem(sys.modules, "torch", torch)

    class Storage:
        def __init__(self, base):
            self.base = base

        def data_ptr(self):
            return self.base.ctypes.data

        def nbytes(self):
            return self.base.nbytes

    class Mine(Tensor):
        device = types.SimpleNamespace(type="cpu")
        layout = torch.strided

        def __init__(self, host, base):
            self.host, self.base, self.shape = host, base, host.shape

        def __getitem__(self, key):
            return Mine(self.host[key], self.base)

        def data_ptr(self):
            return self.host.ctypes.data

        def element_size(self):
            return self.host.itemsize

        def stride(self):
            return tuple(s // self.host.itemsize for s in self.host.strides)

        def untyped_storage(self):
            return Storage(self.base)

        def is_neg(self):
            return False

        def __dlpack_device__(self):
            return self.host.__dlpack_device__()

        def __dlpack__(self, **kw):
            return self.host.__dlpack__(**kw)

    return torch, lambda base: Mine(base, base)


def _race(host, written, read, fill=lambda x: x.host.fill(1.0), get=lambda y: y.host.copy()):
    """What a host kernel reading ``read`` (bare) on one stream gets after a slow kernel
    writing 1.0 into ``written`` (bare) on another: ``(the object it got, what it read)``."""
    import time
    seen = []

    def writer(x):
        assert x is written  # (the object passed, not an array made of it)
        time.sleep(0.2)
        fill(x)
    s1, s2 = host.create_stream("writer"), host.create_stream("reader")
    sm.launch(sm.host_kernel(writer), 1, 1, written, stream=s1)
    sm.launch(sm.host_kernel(lambda y: seen.append((y, get(y)))), 1, 1, read, stream=s2)
    sm.synchronize()
    return seen[0]


@pytest.mark.parametrize("read", ["itself", "part", "its import"])
def test_a_torch_cpu_tensor_passed_to_host_kernels_is_leased_over_its_storage(
        host, monkeypatch, read):
    """A torch CPU tensor passed to a host kernel was passed through, not leased: a slow
    writer of it on one stream and a reader of it -- of a view of it, of the sharedmem view
    imported from it -- on another were not ordered, and the reader saw zeros. Leased now as
    a NumPy array is, over its storage (one allocation with its views and its import); the
    kernel still gets the tensor itself."""
    torch, tensor = _fake_torch(monkeypatch)
    t = tensor(np.zeros(16, np.float32))
    other = {"itself": t, "part": t[4:8], "its import": None}[read]
    if other is None:
        other = sm.from_dlpack(t)
        got, values = _race(host, t, other, get=lambda y: y.copy())  # (a view: NumPy's)
        assert values.tolist() == [1.0] * 16
        return
    got, values = _race(host, t, other)
    assert got is other and values.tolist() == [1.0] * len(other.host)
    seen = []  # (In, Out: leased too, the kernel gets each tensor itself)
    sm.launch(sm.host_kernel(lambda a, b: seen.append((a, b))), 1, 1, sm.In(t), sm.Out(t[4:8]))
    sm.synchronize()
    assert seen[0][0] is t and seen[0][1].host.base is t.host


def test_a_host_launch_keeps_a_torch_tensor_alive_until_its_work_is_done(host, monkeypatch):
    import threading
    import weakref
    torch, tensor = _fake_torch(monkeypatch)
    gate = threading.Event()
    t = tensor(np.zeros(4, np.float32))
    alive = weakref.ref(t)
    f = sm.launch(sm.host_kernel(lambda x: gate.wait(10)), 1, 1, sm.In(t),
                  stream=host.create_stream())
    del t
    gc_collect_harder()
    assert alive() is not None
    gate.set()
    f.result(5)
    sm.synchronize()
    gc_collect_harder()
    assert alive() is None


class _Producer:
    """A DLPack producer on the CPU that is neither NumPy nor torch, over a NumPy array."""

    def __init__(self, arr):
        self.arr = arr

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


class _JaxArray(_Producer):
    __module__ = "jaxlib._jax"  # (what JAX arrays' class says: immutable)


def test_other_dlpack_producers_on_the_cpu_are_leased_read_only_where_immutable(host):
    """A DLPack producer on the CPU (a JAX array) passed to a host kernel was passed through
    unleased (writes to its memory on another stream raced), and Out(...) of it was refused
    as no array; leased now over its bytes, read-only where the producer says so or is JAX,
    which is immutable: Out(jax_array) is refused as a read-only NumPy array is."""
    base = np.zeros(16, np.float32)
    got, values = _race(host, _Producer(base), _Producer(base[4:8]),
                        fill=lambda x: x.arr.fill(1.0), get=lambda y: y.arr.copy())
    assert values.tolist() == [1.0] * 4 and type(got) is _Producer
    j = _JaxArray(np.arange(3, dtype=np.float32))
    k = sm.host_kernel(lambda x: None)
    with pytest.raises(sm.KernelError, match=r"^argument 0: Out\(<jaxlib._jax._JaxArray object "
                                             r"at 0x[0-9a-f]+>\) would write through a read-only "
                                             r"view; pass it as In\(\.\.\.\) or copy it first$"):
        sm.launch(k, 1, 1, sm.Out(j))
    ro = np.arange(3.0)
    ro.flags.writeable = False
    with pytest.raises(sm.KernelError, match="would write through a read-only view"):
        sm.launch(k, 1, 1, _Producer(ro))  # (bare: InOut; its versioned capsule says read-only)
    seen = []
    sm.launch(sm.host_kernel(seen.append), 1, 1, sm.In(j)).result(5)
    assert seen == [j]


class _UnexportableProducer(_Producer):
    """A DLPack producer on the CPU whose export fails (a JAX array of dtype int4: "XLA type S4
    has no DLPack equivalent")."""

    def __dlpack__(self, **kwargs):
        raise BufferError("XLA type S4 has no DLPack equivalent")


def test_a_cpu_producer_that_dlpack_cannot_export_says_what_to_pass_instead(host):
    """A DLPack producer on the CPU whose export fails, passed to a host kernel, raised a
    KernelError that said only that the import failed, not what to pass instead (such an array
    was passed as it was before host kernels leased DLPack producers)."""
    p = _UnexportableProducer(np.zeros(4, np.float32))
    before = sm.stats()
    with pytest.raises(sm.KernelError, match=r"_UnexportableProducer .*leased through DLPack, "
                                             r"whose import failed: XLA type S4 has no DLPack "
                                             r"equivalent; pass np\.asarray\(\.\.\.\) of it"):
        sm.launch(sm.host_kernel(lambda x: None), 1, 1, sm.In(p))
    assert sm.stats().in_flight == before.in_flight


def test_views_export_through_the_registered_exporter(host):
    """View.__dlpack__ and __dlpack_device__ call the Exporter interop.dlpack registered (a C
    method call where compiled): another one registered answers both, with the view itself;
    a non-Exporter is refused by name and changes nothing. The device's facts an export reads
    are kept on the allocation after its first export."""
    from sharedmem import allocation as al
    b = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=host)
    assert b.allocation.bridge_facts is None
    assert b.__dlpack_device__() == (1, 0)
    assert b.allocation.bridge_facts[3] == (1, 0) and b.allocation.bridge_facts[1] is None
    seen = []

    class Counting(al.Exporter):
        def export(self, view, stream, max_version, dl_device, copy):
            seen.append(("export", view, stream, max_version, dl_device, copy))
            return "capsule"

        def dlpack_device(self, view):
            seen.append(("device", view))
            return (7, 3)

    with pytest.raises(TypeError, match=r"^register_dlpack_exporter takes an Exporter, got "
                                        r"object$"):
        al.register_dlpack_exporter(object())
    assert np.from_dlpack(b).tolist() == [0, 1, 2, 3]  # (still interop.dlpack's)
    try:
        al.register_dlpack_exporter(Counting())
        assert b.__dlpack_device__() == (7, 3)
        assert b.__dlpack__(stream=None, max_version=(1, 0)) == "capsule"
    finally:
        al.register_dlpack_exporter(dl._Exporter())
    assert seen == [("device", b), ("export", b, None, (1, 0), None, None)]
    assert np.from_dlpack(b).tolist() == [0, 1, 2, 3]
    b.release()
    with pytest.raises(sm.errors.ReleasedError):
        b.__dlpack_device__()


def _run_script(code):
    """``code`` run in a fresh interpreter (one that has not imported interop.dlpack yet), in
    this run's build (SHAREDMEM_PURE_PYTHON passed on)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env, cwd=root)


# (interop.dlpack's import paused or failed at its struct layout check -- after the functions an
# export calls are defined only in part)
_AT_LAYOUT_CHECK = """
import ctypes, sys, threading
import numpy as np
import sharedmem as sm
real = ctypes.sizeof
def at_layout_check(t):
    if getattr(t, "__name__", "") == "DLManagedTensorVersioned":
        ctypes.sizeof = real
        reached()
    return real(t)
ctypes.sizeof = at_layout_check
b = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=sm.Device.host())
"""


def test_an_export_racing_the_first_import_of_interop_dlpack_waits_for_that_import():
    """A thread's first export imports interop.dlpack; another thread's export meanwhile waits
    for that import to end (allocation._module), as it did before the exporter was registered
    -- not an export through a module whose functions are not defined yet (NameError
    interpreted, AttributeError on None compiled, when the exporter registered mid-import)."""
    r = _run_script(_AT_LAYOUT_CHECK + """
paused, go = threading.Event(), threading.Event()
def reached():
    paused.set()
    go.wait(30)
t = threading.Thread(target=lambda: b.__dlpack__())  # the first export: imports interop.dlpack
t.start()
assert paused.wait(30)
threading.Timer(0.3, go.set).start()
try:
    print(np.from_dlpack(b).tolist())
finally:
    go.set()
    t.join()
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[0.0, 1.0, 2.0, 3.0]\n"


def test_an_import_of_interop_dlpack_that_failed_is_made_again_by_the_next_export():
    """An import of interop.dlpack that fails registers no exporter: the next export imports
    it again (and succeeds), rather than calling a half-executed module's exporter."""
    r = _run_script(_AT_LAYOUT_CHECK + """
def reached():
    raise MemoryError("the import failed")
try:
    b.__dlpack__()
except MemoryError as e:
    print(e)
print(np.from_dlpack(b).tolist(), b.__dlpack_device__())
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "the import failed\n[0.0, 1.0, 2.0, 3.0] (1, 0)\n"


def test_an_export_made_while_interop_dlpack_is_imported_in_the_same_thread_is_refused():
    """A view exported while interop.dlpack's own import is executing in that thread (no
    exporter registered yet) is refused with BackendUnavailableError (an ImportError) --
    compiled, not a method call on None (a crash); then exports work once the import ends."""
    r = _run_script(_AT_LAYOUT_CHECK + """
def reached():
    for f in (b.__dlpack__, b.__dlpack_device__):
        try:
            f()
        except ImportError as e:
            print(type(e).__name__, e)
import interop.dlpack
print(np.from_dlpack(b).tolist(), b.__dlpack_device__())
""")
    assert r.returncode == 0, r.stderr
    msg = ("BackendUnavailableError cannot export a view through DLPack while interop.dlpack "
           "is being imported in this thread: it registers its exporter when its import ends\n")
    assert r.stdout == msg * 2 + "[0.0, 1.0, 2.0, 3.0] (1, 0)\n"


def test_a_producer_outliving_the_modules_ends_the_process_cleanly():
    """An import whose producer dies only in the interpreter's last collection (a torch tensor
    its storage keeps; here one held in a cycle by another module) ends the process with
    status 0 and nothing printed: its alias is given back only while the runtime is there
    (the compiled build crashed in the alias's release from ``ProducerAlias.__del__`` in the
    last collection, after the modules were torn down -- the doc programs with torch, on a
    GPU)."""
    r = _run_script("""
import collections
import numpy as np
import sharedmem as sm
""" + _HOLDER + """
p = Holder()
v = sm.from_dlpack(p, device=sm.Device.host())
cycle = [p]
cycle.append(cycle)
collections._kept_to_the_end = cycle  # (a module's global: gone only at shutdown)
del p, cycle
print(v.to_host().tolist())
""")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{list(map(float, range(8)))}\n", "")
