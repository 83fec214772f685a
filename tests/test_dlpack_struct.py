"""DLPack export structs: the managed tensor (a C block when compiled, ctypes interpreted)
against dlpack.h's layout, read back field by field, round trips, deleters from threads."""
import ctypes
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

import sharedmem as sm
from interop import dlpack as dl

try:
    import cython
    COMPILED = dl.__file__.endswith(".so")
except ImportError:
    COMPILED = False

HEADER = r"""
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
typedef struct { int32_t device_type; int32_t device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;
typedef struct { void* data; DLDevice device; int32_t ndim; DLDataType dtype;
  int64_t* shape; int64_t* strides; uint64_t byte_offset; } DLTensor;
typedef struct DLManagedTensor { DLTensor dl_tensor; void* manager_ctx;
  void (*deleter)(struct DLManagedTensor*); } DLManagedTensor;
typedef struct { uint32_t major; uint32_t minor; } DLPackVersion;
typedef struct DLManagedTensorVersioned { DLPackVersion version; void* manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned*); uint64_t flags; DLTensor dl_tensor; }
  DLManagedTensorVersioned;
#define O(T, f) printf(#T "." #f " %zu\n", offsetof(T, f))
int main(void) {
  printf("DLTensor %zu\nDLManagedTensor %zu\nDLManagedTensorVersioned %zu\n",
         sizeof(DLTensor), sizeof(DLManagedTensor), sizeof(DLManagedTensorVersioned));
  O(DLTensor, data); O(DLTensor, device); O(DLTensor, ndim); O(DLTensor, dtype);
  O(DLTensor, shape); O(DLTensor, strides); O(DLTensor, byte_offset);
  O(DLManagedTensor, dl_tensor); O(DLManagedTensor, manager_ctx); O(DLManagedTensor, deleter);
  O(DLManagedTensorVersioned, version); O(DLManagedTensorVersioned, manager_ctx);
  O(DLManagedTensorVersioned, deleter); O(DLManagedTensorVersioned, flags);
  O(DLManagedTensorVersioned, dl_tensor);
  return 0; }
"""


@pytest.fixture
def host():
    return sm.Device.host()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")
def test_ctypes_layout_matches_dlpack_h():
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "l.c"), os.path.join(d, "l")
        with open(src, "w") as f:
            f.write(HEADER)
        subprocess.check_call(["gcc", src, "-o", exe])
        out = subprocess.check_output([exe]).decode().split("\n")
    c = dict(l.split() for l in out if l)
    for name, cls in [("DLTensor", dl.DLTensor), ("DLManagedTensor", dl.DLManagedTensor),
                      ("DLManagedTensorVersioned", dl.DLManagedTensorVersioned)]:
        assert ctypes.sizeof(cls) == int(c[name]), name
        for f, _ in cls._fields_:
            assert getattr(cls, f).offset == int(c[f"{name}.{f}"]), (name, f)
    assert dl._VERSIONED_FMT.size == int(c["DLManagedTensorVersioned"])
    assert dl._LEGACY_FMT.size == int(c["DLManagedTensor"])


CASES = [((), None), ((5,), None), ((3, 4), None), ((4, 3), (1, 4)), ((2, 0, 3), None),
         ((1, 1, 1, 1, 1, 1, 1, 2), None)]


def _case(host, shape, strides, dtype, versioned):
    """A Tensor of ``shape`` (``strides``) over a fresh host buffer, the capsule's name and
    the export's keyword arguments."""
    n = int(np.prod(shape)) if shape else 1
    size = 12 if strides else n
    buf = sm.Buffer.from_host(np.arange(size, dtype=dtype), device=host)
    t = sm.Tensor.from_buffer(buf, shape, strides=strides)
    name = b"dltensor_versioned" if versioned else b"dltensor"
    return t, name, ({"max_version": (1, 0)} if versioned else {})


@pytest.mark.parametrize("versioned", [True, False])
@pytest.mark.parametrize("shape,strides", CASES)
def test_capsule_fields_through_ctypes(host, versioned, shape, strides):
    t, name, kw = _case(host, shape, strides, np.float64, versioned)
    cap = t.__dlpack__(**kw)
    addr = dl._get_pointer(cap, name)
    cls = dl.DLManagedTensorVersioned if versioned else dl.DLManagedTensor
    m = cls.from_address(addr)
    d = m.dl_tensor
    if versioned:
        assert (m.version.major, m.version.minor, m.flags) == (1, 0, 0)
    assert m.manager_ctx is None
    assert ctypes.cast(m.deleter, ctypes.c_void_p).value == dl._DELETER_ADDR
    assert (d.data or 0) == t.ptr
    assert (d.device.device_type, d.device.device_id) == (dl.kDLCPU, 0)
    assert d.ndim == len(shape) and d.byte_offset == 0
    assert (d.dtype.code, d.dtype.bits, d.dtype.lanes) == (dl.kDLFloat, 64, 1)
    head = ctypes.sizeof(cls)
    sp = ctypes.cast(d.shape, ctypes.c_void_p).value
    stp = ctypes.cast(d.strides, ctypes.c_void_p).value
    assert sp == addr + head and stp == sp + 8 * len(shape)  # one block, shape then strides
    assert tuple(d.shape[i] for i in range(d.ndim)) == t.shape
    assert tuple(d.strides[i] for i in range(d.ndim)) == t.strides
    assert addr in dl._exports and (dl._exports[addr].managed is None) == COMPILED
    del m, d
    del cap
    gc.collect()
    assert addr not in dl._exports and t.allocation.live_views == 1


@pytest.mark.parametrize("versioned", [True, False])
@pytest.mark.parametrize("shape,strides", CASES)
def test_roundtrip_own_from_dlpack_and_numpy(host, versioned, shape, strides):
    t, name, kw = _case(host, shape, strides, np.int32, versioned)
    expect = t.to_host()
    # our own consumer, from a bare capsule
    cap = t.__dlpack__(**kw)
    addr = dl._get_pointer(cap, name)
    back = dl.from_dlpack(cap)
    assert dl._get_name(cap) == b"used_" + name
    del cap
    gc.collect()
    assert addr not in dl._exports  # our own export, consumed by us: ended at once (the
    assert back.allocation is t.allocation and back.shape == t.shape and back.strides == t.strides
    np.testing.assert_array_equal(back.to_host(), expect)
    back.release()  # import's token keeps the memory)
    del back
    gc.collect()
    assert t.allocation.live_views == 1
    # NumPy as consumer (legacy for numpy<2.1 or when it asks so; versioned otherwise)
    a = np.from_dlpack(t)
    np.testing.assert_array_equal(a, expect)
    del a
    gc.collect()
    assert t.allocation.live_views == 1


def test_many_threads_call_deleters(host):
    t = sm.Tensor.from_host(np.arange(64, dtype=np.float32), device=host)
    caps = [t.__dlpack__(max_version=(1, 0)) for _ in range(200)]
    addrs = [dl._get_pointer(c, b"dltensor_versioned") for c in caps]
    dels = []
    for c, a in zip(caps, addrs):
        m = dl.DLManagedTensorVersioned.from_address(a)
        # (a copy of the pointer: m.deleter reads the struct at call time, freed by then)
        dels.append((dl._DELETER(ctypes.cast(m.deleter, ctypes.c_void_p).value), a))
        dl._set_name(c, b"used_dltensor_versioned")
    del caps
    gc.collect()
    ths = [threading.Thread(target=lambda chunk=dels[i::8]: [f(a) for f, a in chunk])
           for i in range(8)]
    [th.start() for th in ths]
    [th.join() for th in ths]
    assert t.allocation.live_views == 1 and not any(a in dl._exports for a in addrs)
    # a consumer calling the deleter twice: the second call finds no export (no double free)
    cap = t.__dlpack__(max_version=(1, 0))
    a = dl._get_pointer(cap, b"dltensor_versioned")
    f = dl._DELETER(ctypes.cast(dl.DLManagedTensorVersioned.from_address(a).deleter,
                                ctypes.c_void_p).value)
    dl._set_name(cap, b"used_dltensor_versioned")
    del cap
    f(a)
    f(a)
    assert t.allocation.live_views == 1


def test_deleter_keeps_pending_exception(host):
    t = sm.Tensor.from_host(np.arange(4, dtype=np.float32), device=host)
    def drop():
        cap = t.__dlpack__(max_version=(1, 0))
        raise KeyError("mine")
    with pytest.raises(KeyError, match="mine"):
        drop()
    gc.collect()
    assert t.allocation.live_views == 1


def _foreign_capsule(mem, deleter, versioned=True):
    """A producer's (not ours) capsule of 1-D float32 host array ``mem``, with ``deleter``
    (a dl._DELETER); returns ``(capsule, managed tensor, keep)`` -- keep the last two alive
    while the capsule or its import may read them."""
    shape = (ctypes.c_int64 * 1)(mem.size)
    m = (dl.DLManagedTensorVersioned if versioned else dl.DLManagedTensor)()
    if versioned:
        m.version.major = 1
    m.deleter = deleter
    d = m.dl_tensor
    d.data, d.device.device_type, d.ndim = mem.ctypes.data, dl.kDLCPU, 1
    d.dtype.code, d.dtype.bits, d.dtype.lanes = dl.kDLFloat, 32, 1
    d.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    name = b"dltensor_versioned" if versioned else b"dltensor"
    return dl._capsule_new(ctypes.addressof(m), name, dl._CAPSULE_DESTRUCTOR()), m, shape


@pytest.mark.parametrize("versioned", [True, False])
def test_a_foreign_capsules_deleter_runs_once_when_its_import_is_gone(host, versioned):
    # a producer's managed tensor (not ours): its deleter runs once, with the address the
    # capsule held, when the last view and lease of the import are gone -- never before
    mem = np.arange(6, dtype=np.float32)
    calls = []
    deleter = dl._DELETER(lambda addr: calls.append((addr, threading.get_ident())))
    cap, m, shape = _foreign_capsule(mem, deleter, versioned)
    t = sm.from_dlpack(cap)
    part = t[2:]
    assert (t.ptr, part.to_host().tolist()) == (mem.ctypes.data, [2.0, 3.0, 4.0, 5.0])
    del cap
    t.release()
    gc.collect()
    assert calls == []  # `part` still reads the producer's memory
    part.release()
    gc.collect()
    assert calls == [(ctypes.addressof(m), threading.get_ident())]
    cap, m, shape = _foreign_capsule(mem, dl._DELETER(), versioned)  # a NULL deleter
    sm.from_dlpack(cap).release()
    gc.collect()
    assert len(calls) == 1


def test_a_producers_deleter_runs_outside_the_core_lock_and_may_call_sharedmem(host):
    # the import's release lets its token go under the core lock; the producer's deleter
    # (foreign code: it may block, or call sharedmem) runs only once the lock is let go
    from sharedmem.runtime.state import RUNTIME
    mem = np.arange(4, dtype=np.float32)
    seen = []

    def deleter(addr):
        seen.append(RUNTIME.owner)
        sm.synchronize()  # (raised SharedMemError when run under this thread's own lock)
        seen.append(sm.stats().live_views)

    deleter = dl._DELETER(deleter)
    cap, m, shape = _foreign_capsule(mem, deleter)
    before = sm.stats().live_views
    t = sm.from_dlpack(cap)
    del cap
    t.release()
    assert seen == [0, before]  # (at once: the release's own thread, the lock let go)
    assert RUNTIME.later is None


@pytest.mark.skipif(not COMPILED, reason="compiled export only")
def test_compiled_conversion_failure_frees_and_registers_nothing(host):
    t = sm.Tensor.from_host(np.arange(4, dtype=np.float32), device=host)
    tok = t._live_token()
    before = dict(dl._exports)
    ex_tok = tok.allocation.new_token("DLPack export", tok.start, tok.stop, True, None)
    for bad in [((4,), (1 << 64,)), ((1 << 63,), (1,)), ((4,), ("x",))]:
        with pytest.raises((OverflowError, TypeError)):
            dl._ctypes_capsule(ex_tok, t.ptr, 1, 0, 2, 32, bad[0], bad[1], True, 0)
    with pytest.raises(TypeError):  # shape must be a tuple in the compiled path
        dl._ctypes_capsule(ex_tok, t.ptr, 1, 0, 2, 32, [4], [1], True, 0)
    assert dl._exports == before
    ex_tok.release()
    assert t.allocation.live_views == 1


def test_cuda_fake_export_roundtrip(monkeypatch):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "."))
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, True)
    import sharedmem.device as smd
    # (from_dlpack resolves kDLCUDA id 0 through Device(0): make that the fake device, or it
    # builds and caches a second Device over the fake driver for the rest of the session)
    monkeypatch.setitem(smd._devices, ("cuda", 0), dev)
    t = sm.Tensor.from_host(np.arange(12, dtype=np.float32).reshape(3, 4), device=dev)
    for kw in [{}, {"max_version": (1, 0)}, {"stream": 2, "max_version": (1, 0)},
               {"stream": -1}]:
        cap = t.__dlpack__(**kw)
        name = dl._get_name(cap)
        m = (dl.DLManagedTensorVersioned if name == b"dltensor_versioned"
             else dl.DLManagedTensor).from_address(dl._get_pointer(cap, name))
        assert (m.dl_tensor.device.device_type, m.dl_tensor.device.device_id) == (dl.kDLCUDA, 0)
        back = dl.from_dlpack(cap)
        assert back.allocation is t.allocation
        np.testing.assert_array_equal(back.to_host(), np.arange(12).reshape(3, 4))
        back.release()
        del back, cap, m
        gc.collect()
        dev.default_stream.synchronize()
    assert t.allocation.live_views == 1


def _fake_driver_allocation(monkeypatch):
    """A fake CUDA device and one "driver allocation" of 256 bytes over NumPy memory (the
    fake's device memory is host memory): ``(dev, drv, mem, base)``."""
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, False)
    import sharedmem.device as smd
    monkeypatch.setitem(smd._devices, ("cuda", 0), dev)
    mem = np.arange(64, dtype=np.float32)
    base = mem.ctypes.data
    drv.ranges[base] = mem.nbytes
    return dev, drv, mem, base


def _cuda_capsule(part):
    """NumPy array ``part``'s DLPack capsule relabelled as CUDA memory of device 0."""
    cap = part.__dlpack__(max_version=(1, 0))
    d = dl.DLManagedTensorVersioned.from_address(
        dl._get_pointer(cap, b"dltensor_versioned")).dl_tensor
    d.device.device_type, d.device.device_id = dl.kDLCUDA, 0
    return cap


def test_a_cuda_import_covers_the_driver_allocation_it_lies_in(monkeypatch):
    """A foreign CUDA capsule over part of a driver allocation sharedmem has not seen is
    imported as an allocation over the whole driver allocation (``cuPointerGetAttributes``'s
    range), leasing just the capsule's bytes: a second capsule over another part of it is the
    same allocation. (Fake device memory is host memory: NumPy's capsules, relabelled CUDA.)"""
    dev, drv, mem, base = _fake_driver_allocation(monkeypatch)

    before = sm.stats().live_allocations
    a = sm.from_dlpack(_cuda_capsule(mem[16:32]))
    alloc = a.allocation
    assert a.device is dev and (a.shape, a.strides, a.ptr) == ((16,), (1,), base + 64)
    assert (alloc.ptr, alloc.nbytes, alloc.source) == (base, 256, "dlpack")
    tok = a._live_token()
    assert (tok.start, tok.stop) == (64, 128)
    asked = []  # (a later import inside it finds it: the driver is not asked again)
    real = drv.cuPointerGetAttributes
    monkeypatch.setattr(drv, "cuPointerGetAttributes", lambda *a: asked.append(a) or real(*a))
    b = sm.from_dlpack(_cuda_capsule(mem[40:48]))
    assert asked == []
    assert b.allocation is alloc and (b._live_token().start, b._live_token().stop) == (160, 192)
    np.testing.assert_array_equal(b.to_host(), np.arange(40, 48, dtype=np.float32))
    assert sm.stats().live_allocations == before + 1
    del a, b, tok, alloc
    dev.default_stream.synchronize()
    gc.collect()
    assert sm.stats().live_allocations == before


def test_a_cuda_import_past_its_driver_allocation_is_refused_and_the_capsule_kept(monkeypatch):
    """A capsule whose shape claims bytes past the end of the driver allocation holding its
    data is refused (BufferError naming both), before it is consumed: the capsule is still the
    producer's, and imports once its shape is right. (Imported as claimed, the bytes past the
    end -- another allocation's -- were a range of this one: its accesses went unseen.)"""
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, False)
    import sharedmem.device as smd
    monkeypatch.setitem(smd._devices, ("cuda", 0), dev)
    mem = np.arange(64, dtype=np.float32)
    base = mem.ctypes.data
    drv.ranges[base] = mem.nbytes
    cap = mem[48:].__dlpack__(max_version=(1, 0))
    d = dl.DLManagedTensorVersioned.from_address(
        dl._get_pointer(cap, b"dltensor_versioned")).dl_tensor
    d.device.device_type, d.device.device_id = dl.kDLCUDA, 0
    d.shape[0] = 17  # 68 bytes from element 48: 4 past the end
    before = sm.stats().live_allocations
    with pytest.raises(BufferError, match=(
            rf"^DLPack tensor of 68 bytes at 0x{base + 192:x} runs past the end of the CUDA "
            rf"allocation holding it \(256 bytes at 0x{base:x}, 64 of them from "
            rf"0x{base + 192:x}\); its shape, strides or offset claim memory the producer does "
            rf"not own$")):
        sm.from_dlpack(cap)
    assert dl._is_valid(cap, b"dltensor_versioned")  # not consumed: the producer's still
    assert sm.stats().live_allocations == before
    d.shape[0] = 16
    t = sm.from_dlpack(cap)
    np.testing.assert_array_equal(t.to_host(), np.arange(48, 64, dtype=np.float32))
    assert (t.allocation.ptr, t.allocation.nbytes) == (base, 256)
    del t
    dev.default_stream.synchronize()
    gc.collect()
    assert sm.stats().live_allocations == before


def test_a_cuda_import_inside_a_foreign_allocation_whose_memory_was_freed_is_checked(
        monkeypatch):
    """A foreign allocation outlives its memory when something keeps the object but nothing
    keeps its producer (a user's ``t.allocation``; the torch facts of interop.cupy_launch
    keep a segment's allocation, not the segment): the producer frees the memory, the driver
    gives the address out again -- smaller. A capsule there that claims bytes past the new
    driver allocation's end lies inside that dead allocation: the driver must still be asked,
    and the claim refused (BufferError) as for memory never seen."""
    dev, drv, mem, base = _fake_driver_allocation(monkeypatch)

    a = sm.from_dlpack(_cuda_capsule(mem[16:32]))
    dead = a.allocation  # (the object kept; its producer is not)
    assert (dead.ptr, dead.nbytes) == (base, 256)
    a.release()
    del a
    dev.default_stream.synchronize()
    gc.collect()
    drv.ranges[base] = 64  # freed by its producer; given out again at the same address, smaller
    cap = _cuda_capsule(mem[0:32])  # 128 bytes: 64 past the new driver allocation's end
    with pytest.raises(BufferError, match="runs past the end of the CUDA allocation"):
        sm.from_dlpack(cap)
    del dead


def test_a_cuda_capsule_naming_another_device_than_the_driver_is_refused_unconsumed(
        monkeypatch):
    """A capsule whose dl_device says CUDA device 0 over memory the driver has on device 1
    was imported as device 0's (the driver's ordinal was not read): leases on the wrong
    device's streams, launches there. BufferError now, before the capsule is consumed."""
    from fake_cuda import install_fake_devices
    (d0, d1), drv = install_fake_devices(monkeypatch, False, count=2)
    import sharedmem.device as smd
    monkeypatch.setitem(smd._devices, ("cuda", 0), d0)
    monkeypatch.setitem(smd._devices, ("cuda", 1), d1)
    mem = np.arange(64, dtype=np.float32)
    drv.ranges[mem.ctypes.data] = mem.nbytes
    drv.range_device[mem.ctypes.data] = 1
    before = sm.stats().live_allocations
    cap = _cuda_capsule(mem[16:32])  # (labelled device 0)
    with pytest.raises(BufferError, match=r"^DLPack tensor at 0x[0-9a-f]+ says it is on "
                                          r"<Device cuda:0 .*>, but the driver has that "
                                          r"memory on CUDA device 1; the producer's dl_device "
                                          r"is wrong$"):
        sm.from_dlpack(cap)
    assert dl._is_valid(cap, b"dltensor_versioned")  # (not consumed: its deleter runs at GC)
    assert sm.stats().live_allocations == before


def test_one_capsule_imported_by_two_threads_at_once_is_consumed_once(host, monkeypatch):
    """The capsule's name was checked, then device, dtype, shape and region looked up (Python
    calls: another thread may run), then the capsule renamed: two threads importing one
    capsule both found it unconsumed, both took it, and the producer's deleter ran twice (a
    double free of its managed tensor). The check and the rename are one step: one import
    takes it, the other is refused as consumed ("already consumed"), the deleter runs once."""
    mem = np.arange(6, dtype=np.float32)
    calls = []
    deleter = dl._DELETER(lambda addr: calls.append(addr))
    cap, m, shape = _foreign_capsule(mem, deleter)
    both = threading.Barrier(2, timeout=2)
    real = dl._device_of

    def device_of(*a):  # (both threads past the name check before either renames)
        try:
            both.wait()
        except threading.BrokenBarrierError:
            pass
        return real(*a)
    monkeypatch.setattr(dl, "_device_of", device_of)
    out = []

    def imp():
        try:
            out.append(sm.from_dlpack(cap))
        except BufferError as e:
            out.append(e)
    ths = [threading.Thread(target=imp) for _ in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    errors = [x for x in out if isinstance(x, BufferError)]
    assert len(out) == 2 and len(errors) == 1, out
    assert str(errors[0]).startswith("this DLPack capsule was already consumed")
    out.clear()
    del errors, cap
    gc.collect()
    assert calls == [ctypes.addressof(m)]
