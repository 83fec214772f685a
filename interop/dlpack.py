"""DLPack, both ways, done by hand with ctypes (no dependency on any package).

Export -- ``__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None)``:

* ``max_version >= (1, 0)`` gets a versioned capsule (``"dltensor_versioned"``,
  DLPack 1.0, with ``READ_ONLY`` / ``IS_COPIED`` flags); otherwise a legacy
  ``"dltensor"`` capsule. A read-only view cannot be exported as a legacy
  capsule (it has no way to say read-only): ``BufferError``.
* The capsule holds a *view token* from creation until the consumer calls the
  deleter (or the unused capsule is destroyed): moving the memory meanwhile
  raises AliasError naming the "DLPack export".
* ``stream`` (CUDA): the consumer's stream is made to wait on the device for
  our pending writes to these bytes (and pending reads, for a writable view:
  the consumer may write). On the host device the consumer is the CPU, so the
  export itself waits for that work before returning the capsule. ``None`` means the legacy default stream, ``1`` the
  legacy default stream, ``2`` the per-thread default stream, ``-1`` no
  synchronization; ``0`` is ambiguous and refused (``ValueError``). On the
  host device only ``None`` is valid.
* ``dl_device`` other than ours: a copy on that device, flagged ``IS_COPIED``
  (``BufferError`` with ``copy=False``). ``copy=True`` always copies,
  ``copy=False`` never does.

Import -- ``from_dlpack(obj, *, stream=None, device=None)``: zero-copy; the
producer's managed tensor is owned by the returned view (and by every lease
on it) and its deleter runs when the last of them is gone. The memory is
looked up in the allocation registry, so one range imported twice (or our own
export imported back) is one allocation. ``READ_ONLY`` is honoured.
"""

from __future__ import annotations

import ctypes
import math
import operator
import struct
import sys
import threading
import weakref

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from sharedmem import _cython as cython

import numpy as np

from sharedmem.allocation import (Exporter, View, import_allocation, import_writable,
                                  lookup_allocation, register_dlpack_exporter)
from sharedmem.device import Device, as_device
from sharedmem.errors import CaptureError, DeviceMismatchError
from sharedmem.runtime.submission import export_hold, record_arrival
from sharedmem.runtime.state import fork_safe, locked
from sharedmem.stream import Stream, as_stream_or_default
from sharedmem.tensor import (MAX_NDIM, Tensor, c_strides, extent, new_tensor, numpy_region,
                              is_torch_tensor, torch_storage_region)

from interop.streams import consumer_stream, current_streams


__all__ = ["export", "from_dlpack", "DLPACK_VERSION", "kDLCPU", "kDLCUDA"]

kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged = 1, 2, 3, 13
kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLComplex, kDLBool = 0, 1, 2, 4, 5, 6  # (3: kDLOpaqueHandle)
FLAG_READ_ONLY, FLAG_IS_COPIED = 1, 2
DLPACK_VERSION = (1, 0)
# where user-space addresses end (x86-64 with 5-level paging: 2**56; aarch64: 2**52): a
# pointer plus byte_offset beyond it is garbage (or wrapped)
_ADDRESS_END = 1 << 56


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_LEGACY, _USED_LEGACY = b"dltensor", b"used_dltensor"
_VERSIONED, _USED_VERSIONED = b"dltensor_versioned", b"used_dltensor_versioned"

_api = ctypes.pythonapi
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_ptr, _obj, _str = ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p


def _c_api(name, restype, *argtypes):
    """The Python C API function ``name``, called with the GIL held."""
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, _api))


_capsule_new = _c_api("PyCapsule_New", _obj, _ptr, _str, _CAPSULE_DESTRUCTOR)
# raw PyObject* versions, for the destructor (the capsule is being freed: no refcounting)
_raw_is_valid = _c_api("PyCapsule_IsValid", ctypes.c_int, _ptr, _str)
_raw_get_pointer = _c_api("PyCapsule_GetPointer", _ptr, _ptr, _str)
_is_valid = _c_api("PyCapsule_IsValid", ctypes.c_int, _obj, _str)
_get_pointer = _c_api("PyCapsule_GetPointer", _ptr, _obj, _str)
_set_name = _c_api("PyCapsule_SetName", ctypes.c_int, _obj, _str)
_get_name = _c_api("PyCapsule_GetName", _str, _obj)


# -- dtypes ------------------------------------------------------------------------------
def _dl_dtype(dt: np.dtype) -> tuple:
    """DLPack's ``(code, bits)`` of ``dt`` (one lane)."""
    code = {"b": kDLBool, "i": kDLInt, "u": kDLUInt, "f": kDLFloat, "c": kDLComplex}.get(dt.kind)
    if dt.name == "bfloat16":
        code = kDLBfloat
    if code is None or dt.fields is not None:
        raise BufferError(f"dtype {dt} has no DLPack equivalent; use a bool, int, uint, float or "
                          f"complex dtype")
    if not dt.isnative:  # DLPack has no byte order: a consumer would read native values
        raise BufferError(f"dtype {dt.str!r} is not in native byte order, which DLPack cannot "
                          f"say; copy to {dt.newbyteorder('=').name!r} first")
    if dt.itemsize > (16 if dt.kind == "c" else 8):  # (long double: DLPack's 128-bit float is
        raise BufferError(f"dtype {dt} (the platform's long double) has no DLPack "  # IEEE's)
                          f"equivalent: DLPack's {dt.itemsize * 8}-bit floats are IEEE "
                          f"binary128; copy to float64 / complex128 first")
    if dt.kind == "f" and dt.type not in _IEEE_FLOATS:  # (ml_dtypes' float8_e5m2 says kind
        # "f": as (kDLFloat, 8 bits) it is a type DLPack does not have, which consumers refuse
        # -- torch, JAX -- only after the export took its hold)
        raise BufferError(f"dtype {dt} has no DLPack 1.0 equivalent: DLPack's floats "
                          f"(kDLFloat) are IEEE float16, float32 and float64; copy to "
                          f"float16 or float32 first")
    return code, dt.itemsize * 8


_IEEE_FLOATS = (np.float16, np.float32, np.float64)


_DTYPES = {}  # (code, bits, lanes) -> the NumPy dtype of an import (those it took before)


def _np_dtype(code: int, bits: int, lanes: int) -> np.dtype:
    """The NumPy dtype of a DLPack data type; BufferError where it has none."""
    dt = _DTYPES.get((code, bits, lanes))
    if dt is None:
        dt = _DTYPES[(code, bits, lanes)] = _new_np_dtype(code, bits, lanes)
    return dt


def _new_np_dtype(code, bits, lanes):
    if lanes != 1:
        raise BufferError(f"DLPack dtype with {lanes} lanes (vector types) is not supported; "
                          f"{_TAKES}")
    if code == kDLBfloat and bits == 16:
        try:
            import ml_dtypes
            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            raise BufferError("bfloat16 tensors need the ml_dtypes package (pip install "
                              "ml-dtypes)") from None
    kind = {kDLBool: "b", kDLInt: "i", kDLUInt: "u", kDLFloat: "f", kDLComplex: "c"}.get(code)
    # (bools of one byte only: "b1"; floats up to 64 bits, complex up to 128: DLPack's wider
    # ones are IEEE binary128, not the platform's long double that NumPy's float128 is)
    if kind in ("b", "i", "u") or (kind == "f" and bits <= 64) or (kind == "c" and bits <= 128):
        try:
            if not bits % 8:
                return np.dtype(f"{kind}{bits // 8}")
        except TypeError:  # (no such size of that kind)
            pass
    raise BufferError(f"DLPack dtype (code {code}, {bits} bits) is not supported; {_TAKES}")


_TAKES = ("sharedmem imports bool (8 bits), int, uint, float (up to 64 bits), complex (up to "
          "128) and bfloat16: convert the array to one of those first")


# -- export --------------------------------------------------------------------------------
@cython.freelist(16)
@cython.cclass
class _Export:
    """Holds an exported managed tensor's view token until the consumer's deleter (or the
    unused capsule's destructor) runs, and keeps the managed tensor alive (``managed``: its
    ctypes buffer; None when compiled, where it is a C block freed by ``_delete``)."""

    __slots__ = ("managed", "token")


# Address of the managed struct -> _Export. No lock: a store and a pop(addr, None) are each
# one atomic dict operation (under the GIL; under the dict's own lock where there is none),
# so of a deleter and a capsule destructor racing for one export exactly one ends it.
_exports: dict = {}


def _delete(addr) -> None:
    exports = _exports  # (a typed local: a C dict call)
    ex = exports.pop(addr, None)
    if ex is not None:
        if ex.managed is None:
            _c_free_managed(addr)  # (dlpack.pxd; compiled exports only)
        ex.token.release()



# The C entry points: the deleter consumers call and the capsule's destructor. Both may be
# called with an exception set (a consumer dropping a capsule on its error path), which must
# survive the call. Compiled, they are C functions (dlpack.pxd) that set the exception aside
# around _delete. Interpreted, they are ctypes callbacks, where Python code cannot run with an
# exception set (every builtin call would turn it into a SystemError): the exception is taken
# first, the export ended, and the exception raised again -- ctypes reports an exception out of
# a callback as unraisable, so there it is printed rather than passed on to the consumer.
if sys.version_info >= (3, 12):
    _set_aside = _c_api("PyErr_GetRaisedException", _ptr)  # (the exception taken, or None)
    _give_error = _c_api("PyErr_SetRaisedException", None, _ptr)

    def _put_back(taken) -> None:
        if taken:
            _give_error(taken)  # (ctypes raises it here)
else:
    _fetch = _c_api("PyErr_Fetch", None)  # (no argtypes: see below)
    _restore = _c_api("PyErr_Restore", None, _ptr, _ptr, _ptr)
    # PyErr_Fetch's out parameters, made beforehand as ctypes references: before the fetch
    # nothing may be made or converted (an int argument's conversion checks for an error and
    # finds the pending one). Shared: two threads in this rare path at once could mix their
    # exceptions up.
    _fetched = (ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p())
    _fetched_refs = tuple(ctypes.byref(p) for p in _fetched)

    def _set_aside():
        _fetch(*_fetched_refs)
        return (_fetched[0].value, _fetched[1].value, _fetched[2].value)

    def _put_back(taken) -> None:
        if taken[0]:
            _restore(*taken)


def _delete_from_c(addr) -> None:
    taken = _set_aside()
    try:
        _delete(addr)
    finally:
        _put_back(taken)


def _capsule_destructor(capsule_ptr) -> None:
    # An unconsumed capsule still carries its original name: run the deleter.
    taken = _set_aside()
    try:
        for name in (_VERSIONED, _LEGACY):
            if _raw_is_valid(capsule_ptr, name):
                _delete(_raw_get_pointer(capsule_ptr, name))
                break
    except Exception:  # never raise from a destructor (interpreter shutdown)
        pass
    _put_back(taken)


_deleter = _DELETER(_delete_from_c)  # lives as long as the module: consumers call it
_capsule_destructor_c = _CAPSULE_DESTRUCTOR(_capsule_destructor)


def _facts_of(alloc) -> tuple:
    """:func:`_device_facts` of Allocation ``alloc``'s device, kept in the allocation's
    ``bridge_facts`` (a field read on every export of its memory after the first)."""
    f = alloc.bridge_facts
    if f is None:
        f = alloc.bridge_facts = _device_facts(alloc.device)
    return f


def _device_facts(dev) -> tuple:
    """What an export reads of Device ``dev``: (whether it is the host, its default Stream (None
    for the host), its backend's wait_on_handle, its DLPack (type, id), and the consumers of an
    export to the default stream -- ``((default, True),)`` and ``((default, False),)`` -- made
    once). They never change: kept in the device's ``bridge_facts`` (a slot read, not a
    property call and four attribute lookups), so they live and die with it."""
    f = dev.bridge_facts
    if f is None:
        host = dev.kind == "host"
        default = None if host else dev.default_stream
        f = (host, default, getattr(dev.backend, "wait_on_handle", None), dev.dlpack_device,
             ((default, True),), ((default, False),))
        dev.bridge_facts = f  # (lock-free: a racing export stores equal facts)
    return f


def _export_hold(view, tok, stream, facts):
    """The export's token: a hold of ``tok``'s bytes for the consumer's stream (see module
    docstring), made in one step with the consumer's ordering after our pending work
    (``export_hold``). ``facts``: the token's allocation's :func:`_facts_of`."""
    if facts[0]:  # the host device
        if stream is not None:
            raise BufferError(f"stream={stream!r} is not valid for a host-device export; only None")
        # the consumer is the CPU itself and reads at once: wait for our work here
        return export_hold(tok, _KIND, view, (), _wait_host, True)
    stream = _cuda_consumer(stream)
    if stream == -1:  # the consumer orders itself, on a stream it does not name
        streams = current_streams(tok.allocation.device)
        return export_hold(tok, _KIND, view, tuple([(s, tok.writable) for s in streams]), None)
    # 1 and 2 are the driver's CU_STREAM_LEGACY and CU_STREAM_PER_THREAD handles; both map to
    # the device's (legacy) default stream. For 1, work already on it needs no wait: the
    # legacy stream orders itself (so cupy.from_dlpack in a loop enqueues no wait for the
    # previous export's hold). Not for 2: the per-thread default streams of two threads do
    # not order each other -- only each of them with the legacy stream -- so a consumer on
    # one thread's waits for what another thread's consumer was given.
    if stream == 1 or stream == 2:
        return export_hold(tok, _KIND, view, facts[4] if tok.writable else facts[5], facts[2],
                           False, facts[1] if stream == 1 else None, stream)
    consumer = consumer_stream(tok.allocation.device, stream)
    refuse_foreign_capture(tok, consumer, "", f"stream handle {stream:#x}",
                           "export before the capture begins or after it ends")
    return export_hold(tok, _KIND, view, ((consumer, tok.writable),), facts[2], False, consumer,
                       stream)


def _cuda_consumer(stream):
    """A CUDA consumer's ``stream`` argument, checked, as an int (None: 1, the legacy default
    stream); TypeError or ValueError naming what is wrong."""
    if stream is None:
        return 1
    if type(stream) is not int:
        if isinstance(stream, bool) or not isinstance(stream, int):
            raise TypeError(f"stream must be an int or None, got {type(stream).__name__}")
        stream = int(stream)
    if stream == 0:
        raise ValueError("stream=0 is ambiguous in DLPack and not allowed; use 1 for the legacy "
                         "default stream, 2 for the per-thread default stream, -1 for no "
                         "synchronization, or a stream handle")
    if stream < -1 or stream >= 1 << 64:
        raise ValueError(f"stream={stream} is not a valid stream handle")
    return stream


_KIND = "DLPack export"  # (the export token's kind: how AliasError names it)


def _wait_host(marker) -> None:
    marker.wait()


def export(view, *, stream=None, max_version=None, dl_device=None, copy=None):
    """A DLPack capsule for ``view`` (see the module docstring)."""
    return export_positional(view, stream, max_version, dl_device, copy)


def _version_major(max_version) -> int:
    """The major version of a ``max_version`` that is a pair of ints (NumPy ints too);
    TypeError otherwise."""
    try:
        if isinstance(max_version, (str, bytes, dict)) or len(max_version) != 2:
            raise TypeError
        major, _ = [operator.index(v) for v in max_version]
    except TypeError:
        raise TypeError(f"max_version must be None or a (major, minor) tuple of ints, got "
                        f"{max_version!r}") from None
    return major


def refuse_foreign_capture(tok, consumer, who, named, remedy) -> None:
    """CaptureError where an export of ``tok``'s bytes to ``consumer`` (``named`` so in the
    message, after the caller's prefix ``who``) finds that stream capturing a graph another
    library began (torch.cuda.graph, cupy.cuda.Stream.begin_capture): the wait for our pending
    work enqueued there is refused by the driver (which also breaks that capture), and the
    hold's end would be recorded into it, marking nothing that runs now -- refused before
    anything is waited for, as sharedmem's own capture is (export_hold refuses that by name)."""
    if consumer._capture is None and \
            tok.allocation.device.backend.foreign_capture_error(consumer.handle) is not None:
        raise CaptureError(
            f"{who}cannot export bytes [{tok.start}, {tok.stop}) of allocation "
            f"#{tok.allocation.id} to a consumer on {named}: it is capturing a CUDA graph that "
            f"sharedmem did not start, whose work runs only at replay (the export's ordering "
            f"and the end of its hold would be recorded there); {remedy}")


def export_positional(view, stream, max_version, dl_device, copy):
    """:func:`export` with positional arguments (what ``View.__dlpack__`` calls: a call
    without keywords is cheaper)."""
    tok = view._live_token()
    facts = _facts_of(tok.allocation)
    ours = facts[3]
    if dl_device is not None:
        given = dl_device
        try:
            dl_device = tuple([operator.index(d) for d in given])
        except TypeError:
            dl_device = ()
        if len(dl_device) != 2:
            raise TypeError(f"dl_device must be None or a (device_type, device_id) pair of ints, "
                            f"got {given!r}")
    if copy is not None and copy is not True and copy is not False:
        if not isinstance(copy, np.bool_):  # (np.True_ is a bool; 1, "yes" are not)
            raise TypeError(f"copy must be None, True or False, got {copy!r}")
        copy = bool(copy)  # (before it is read: np.False_ refuses a copy as False does)
    elsewhere = dl_device is not None and dl_device != ours
    if elsewhere and copy is False:  # (None: a copy where one is needed, as the protocol says)
        raise BufferError(f"cannot export {view!r} to device {dl_device} with copy=False: it "
                          f"lives on {ours} (copy=None or copy=True makes a copy there)")
    if max_version is None:
        versioned = False
    elif (type(max_version) is tuple and len(max_version) == 2  # (the hot path: two ints)
          and type(max_version[0]) is int and type(max_version[1]) is int):
        versioned = max_version[0] >= 1
    else:
        versioned = _version_major(max_version) >= 1
    # (the dtype before the hold or a copy is made: a refusal then takes no lease, enqueues
    # no wait on the consumer's stream and copies nothing -- BufferError, the view as it was)
    code_bits = _code_bits(view._dtype)
    if copy is True or elsewhere:
        return _export_copy(view, stream, versioned, dl_device or ours)
    if not versioned and not tok.writable:
        raise BufferError(f"cannot export read-only {view!r} as a legacy DLPack capsule (it cannot "
                          f"say read-only); the consumer must ask for max_version >= (1, 0)")
    export_tok = _export_hold(view, tok, stream, facts)
    return _make_capsule(view, export_tok, versioned, 0 if tok.writable else FLAG_READ_ONLY, ours,
                         code_bits)


@cython.cclass
class _Exporter(Exporter):
    """View.__dlpack__'s exporter (:func:`export_positional`) and __dlpack_device__'s."""

    __slots__ = ()

    def export(self, view, stream, max_version, dl_device, copy):
        return export_positional(view, stream, max_version, dl_device, copy)

    def dlpack_device(self, view):
        return _facts_of(view._live_token().allocation)[3]


# Byte layouts of the structs above (x86-64 / aarch64 LP64), packed in one call:
# DLManagedTensorVersioned = version (2 x u32), manager_ctx, deleter, flags (u64), DLTensor;
# DLManagedTensor = DLTensor, manager_ctx, deleter. DLTensor = data, device (2 x i32),
# ndim (i32), dtype (u8, u8, u16), shape, strides, byte_offset.
_DLTENSOR = "QiiiBBHQQQ"
_VERSIONED_FMT = struct.Struct("<IIQQQ" + _DLTENSOR)
_LEGACY_FMT = struct.Struct("<" + _DLTENSOR + "QQ")
assert _VERSIONED_FMT.size == ctypes.sizeof(DLManagedTensorVersioned)
assert _LEGACY_FMT.size == ctypes.sizeof(DLManagedTensor)
if cython.compiled:
    _DELETER_ADDR = _c_deleter_address()  # (dlpack.pxd)
else:
    _DELETER_ADDR = ctypes.cast(_deleter, ctypes.c_void_p).value
_dtype_cache = cython.declare(dict, {})  # np.dtype -> (code, bits); lock-free (idempotent writes)


def _code_bits(dt) -> tuple:
    """:func:`_dl_dtype` of ``dt``, made once per dtype (BufferError where it has none)."""
    code_bits = _dtype_cache.get(dt)  # (compiled: a C global, a C dict lookup)
    if code_bits is None:
        code_bits = _dtype_cache[dt] = _dl_dtype(dt)
    return code_bits


def _make_capsule(view, export_tok, versioned: bool, flags: int, where, code_bits):
    """The capsule of ``view``, which owns ``export_tok`` (its hold: see :func:`_export_hold`;
    released here if the capsule cannot be made). ``where``: the token's device, as DLPack's
    ``(device_type, device_id)``; ``code_bits``: the view's dtype's (:func:`_code_bits`)."""
    try:  # (a view released meanwhile -- the hold keeps its bytes -- raises from its properties)
        if type(view) is Tensor:  # (its fields: no property calls)
            t = view
            shape, strides = t._shape, t._strides
        else:
            shape, strides = view.shape, view.strides
        return _ctypes_capsule(export_tok, export_tok.allocation.ptr + view._offset, where[0],
                               where[1], code_bits[0], code_bits[1], shape, strides, versioned,
                               flags)
    except BaseException:
        export_tok.release()  # (idempotent)
        raise


def _ctypes_capsule(export_tok, ptr, dev_type, dev_id, code, bits, shape, strides, versioned,
                    flags):
    ex = _Export.__new__(_Export)
    ex.token = export_tok
    if cython.compiled:  # the managed tensor in C (dlpack.pxd)
        ex.managed = None
        addr = _c_managed(versioned, ptr, dev_type, dev_id, code, bits, shape, strides, flags)
    else:
        ndim = len(shape)
        head = _VERSIONED_FMT if versioned else _LEGACY_FMT
        raw = ctypes.create_string_buffer(head.size + 16 * ndim)
        addr = ctypes.addressof(raw)
        shape_addr = addr + head.size
        strides_addr = shape_addr + 8 * ndim
        dl = (ptr, dev_type, dev_id, ndim, code, bits, 1, shape_addr, strides_addr, 0)
        if versioned:
            head.pack_into(raw, 0, DLPACK_VERSION[0], DLPACK_VERSION[1], 0, _DELETER_ADDR, flags,
                           *dl)
        else:
            head.pack_into(raw, 0, *dl, 0, _DELETER_ADDR)
        struct.pack_into(f"<{2 * ndim}q", raw, head.size, *shape, *strides)
        ex.managed = raw
    exports = _exports
    exports[addr] = ex
    try:
        if cython.compiled:
            return _c_capsule(addr, versioned)  # (dlpack.pxd)
        return _capsule_new(addr, _VERSIONED if versioned else _LEGACY, _capsule_destructor_c)
    except BaseException:
        _delete(addr)
        raise


def _export_copy(view, stream, versioned, target):
    if target[0] == kDLCPU:
        if target[1] != 0:  # (DLPack's one CPU device is (kDLCPU, 0))
            raise BufferError(f"cannot copy {view!r} to DLPack device {target}: there is no "
                              f"such CPU device; the host is (1, 0)")
        if stream is not None:  # (as for an export of host memory: CPU consumers name none)
            raise BufferError(f"stream={stream!r} is not valid for a copy to the host; only None")
        dev = Device.host()
    elif target[0] == kDLCUDA:
        try:  # (the view's own device where it is the target: not looked up again)
            dev = view.device if view.device.dlpack_device == target else Device(target[1])
        except (ValueError, ImportError) as e:  # (no such GPU, or CUDA unusable here)
            raise BufferError(f"cannot copy {view!r} to DLPack device {target}: {e}") from e
        if view.device is not dev and view.device.kind == "cuda":
            raise BufferError(f"copies between CUDA devices are not supported by __dlpack__ "
                              f"({view.device} -> {dev}); copy the view there first "
                              f"(view.to_device(device))")
        _cuda_consumer(stream)  # (checked before the copy is made, not after)
    else:
        raise BufferError(f"cannot copy to DLPack device {target}; only CPU and CUDA are supported")
    src = Tensor.from_host(view.to_host(), device=dev)
    dev.default_stream.synchronize()
    stok = src._live_token()
    facts = _facts_of(stok.allocation)
    export_tok = _export_hold(src, stok, stream, facts)  # (None for the host: refused above)
    capsule = _make_capsule(src, export_tok, versioned, FLAG_IS_COPIED if versioned else 0,
                            facts[3], _code_bits(src._dtype))
    src.release()  # the capsule's own token keeps the copy alive
    return capsule


# -- import ----------------------------------------------------------------------------------
def _named(obj, library) -> str:
    """What an import was given, for its messages: ``a torch.Tensor``, ``a DLPack capsule``."""
    if type(obj).__name__ == "PyCapsule":
        return "a DLPack capsule"
    return f"a {library}.{type(obj).__name__}"


def producer_kind(obj) -> str:
    """How an import's producer is named as an alias in AliasError messages."""
    if obj is None:
        return "producer of a DLPack capsule (it may still reach these bytes)"
    t = type(obj)
    return f"producer {t.__module__.split('.')[0]}.{t.__qualname__} (it can still reach these bytes)"


class ProducerAlias:
    """The producer of imported memory, counted as a live alias of the imported bytes while
    it may still reach them: its token is released when this object dies (it sits in the
    import's ``keep``, so: when the last view or lease of the import is gone) or, earlier,
    when the producer object itself is garbage collected -- never while the interpreter
    shuts down (see _producer_gone)."""

    __slots__ = ("token", "_ref", "__weakref__")

    def __init__(self, alloc, start: int, stop: int, producer, writable=True, kind=None):
        tok = self.token = alloc.new_token(producer_kind(producer) if kind is None else kind,
                                           start, stop, writable, None)
        self._ref = None
        if producer is not None:
            # (a weak reference that holds the token, not this object: it dies with this
            # object, its callback uncalled -- weakref.finalize, a Python class kept in a
            # registry until detached, cost an import about 2 us more)
            try:
                self._ref = ref = _AliasRef(producer, _alias_gone)
            except TypeError:  # no weak references: it lives as long as the import anyway
                pass
            else:
                ref.token = tok

    def __del__(self):
        try:
            self._ref = None  # (its callback not called after this)
            _producer_gone(self.token)
        except AttributeError:  # half-constructed
            pass


class _AliasRef(weakref.ref):
    """A producer alias's weak reference to its producer, holding the alias's token for its
    callback (one function for all: no closure an import)."""

    __slots__ = ("token",)


def _alias_gone(ref) -> None:
    """The callback of an :class:`_AliasRef`: its producer died first."""
    _producer_gone(ref.token)


def _producer_gone(tok) -> None:
    """Release a producer alias's token -- not while the interpreter shuts down (as
    ``View.__del__``): an import alive to the end (its producer a torch tensor its storage
    keeps, or held in a cycle) dies in the last collection, after the modules are torn down,
    where a release crashed the compiled build (``weakref.finalize`` had released every alias
    at exit, before that)."""
    if sys is not None and not sys.is_finalizing():
        tok.release()


def driver_region(info, ptr: int, nbytes: int, what: str, error):
    """``(start, size)`` of the driver allocation ``info`` names (``pointer_info``'s answer),
    which must hold the ``nbytes`` an import claims at ``ptr``: else ``error`` (the protocol's
    type). Bytes past it belong to other allocations, whose accesses an import over them would
    not see."""
    start, size = info[0], info[1]
    if ptr + nbytes > start + size:
        raise error(f"{what} of {nbytes} bytes at 0x{ptr:x} runs past the end of the CUDA "
                    f"allocation holding it ({size} bytes at 0x{start:x}, "
                    f"{start + size - ptr} of them from 0x{ptr:x}); its shape, strides or "
                    f"offset claim memory the producer does not own")
    return start, size


def uncapturable_import(s) -> CaptureError:
    """The error of an import onto ``s`` while it captures (checked before the producer is
    asked): its ordering after the producer's work and the arrival would be recorded into
    the graph, run at replay only -- use of the memory outside the graph would not wait."""
    return CaptureError(f"an import onto {s}, which is capturing a graph, would be ordered "
                        f"after the producer's work only when the graph replays; import on a "
                        f"stream that is not capturing (before the capture begins)")


def import_tensor(dev, ptr: int, nbytes: int, source: str, region, writable: bool, owner,
                  dtype, shape, strides, stream, producer, aliased: bool = True):
    """The Tensor of an import (DLPack, CAI): ``nbytes`` at ``ptr`` on ``dev`` as a range of
    the allocation holding them (one imported before, else a new one over ``region``, made
    by ``source``), keeping ``owner``. ``producer`` (None: a bare capsule) counts as a live
    alias of the bytes unless not ``aliased`` (an adoption) or one of our views (they count
    anyway). On a CUDA device the import is recorded as a write on ``stream``."""
    alloc = import_allocation(dev, ptr, nbytes, source, region=region)
    lo, hi = ptr - alloc.ptr, ptr - alloc.ptr + nbytes
    said = writable
    writable = import_writable(alloc, lo, hi, writable)
    keep = [alloc, owner, None]  # (let go of last to first: the alias ends before the owner)
    tok = alloc.new_token("tensor", lo, hi, writable, keep)
    t = new_tensor(tok, dtype, shape, strides, lo)
    if aliased and not isinstance(producer, View):  # (over a read-only view's bytes: an
        # alias of that view, read-only as it is -- else a later import counted it writable)
        keep[2] = ProducerAlias(alloc, lo, hi, producer, writable or not said)
    if dev.kind == "cuda" and nbytes:
        record_arrival(tok, stream)
    return t


def _read_managed(addr: int, versioned: bool) -> tuple:
    """What an import reads of the managed tensor at ``addr``: ``(major, flags, deleter,
    data, byte_offset, device_type, device_id, ndim, code, bits, lanes, shape, strides)`` --
    addresses as ints (0: NULL), ``shape`` and ``strides`` the addresses of the arrays, not
    read here (see _read_dims); ``major`` 1 for a legacy one (and nothing else read where a
    versioned one's is not 1). Compiled: ``_c_read_managed`` (dlpack.pxd), from the C
    structs."""
    if versioned:
        m = DLManagedTensorVersioned.from_address(addr)
        if m.version.major != 1:
            return m.version.major, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        major, flags = 1, m.flags
    else:
        m = DLManagedTensor.from_address(addr)
        major, flags = 1, 0
    t = m.dl_tensor
    dtype = t.dtype
    return (major, flags, ctypes.cast(m.deleter, ctypes.c_void_p).value or 0, t.data or 0,
            t.byte_offset, t.device.device_type, t.device.device_id, t.ndim, dtype.code,
            dtype.bits, dtype.lanes, ctypes.cast(t.shape, ctypes.c_void_p).value or 0,
            ctypes.cast(t.strides, ctypes.c_void_p).value or 0)


def _read_dims(shape: int, strides: int, ndim: int) -> tuple:
    """``(shape, strides)`` of the tensor whose arrays are at those addresses: tuples of ints,
    ``strides`` None where its address is 0 (NULL). Called only once the tensor is one an
    import takes (``0 <= ndim <= MAX_NDIM``, ``shape`` not NULL unless ``ndim`` is 0): a
    capsule refused for its device or dtype has its arrays never read. Compiled:
    ``_c_read_dims`` (dlpack.pxd)."""
    if not ndim:
        return (), (() if strides else None)
    arr = ctypes.c_int64 * ndim
    return (tuple(arr.from_address(shape)),
            tuple(arr.from_address(strides)) if strides else None)


class _Imported:
    """Owns a consumed managed tensor: calls the producer's deleter when the
    last view or lease using it is gone."""

    __slots__ = ("addr", "versioned", "__weakref__")

    def __init__(self, addr: int, versioned: bool):
        self.addr = addr
        self.versioned = versioned

    def __del__(self):
        addr, self.addr = self.addr, 0
        if not addr:
            return
        if cython.compiled:
            _c_call_deleter(addr, self.versioned)  # (dlpack.pxd)
            return
        m = (DLManagedTensorVersioned if self.versioned else DLManagedTensor).from_address(addr)
        if m.deleter:
            m.deleter(addr)


def _device_of(t: int, i: int):
    if t in (kDLCPU, kDLCUDAHost):
        return Device.host()
    if t in (kDLCUDA, kDLCUDAManaged):
        try:
            return Device(i)
        except (ValueError, ImportError) as e:  # (no such device, no CUDA backend here)
            raise BufferError(f"DLPack device (CUDA, id {i}) is not usable here: {e}") from e
    raise BufferError(f"DLPack device type {t} (id {i}) is not supported; sharedmem imports CPU "
                      f"and CUDA memory")


#: Held while an import takes a capsule (checks its name and renames it "used_..."): two
#: threads importing one capsule must not both find it unconsumed.
_consume_lock = fork_safe(threading.Lock())


def _elsewhere(s, memory) -> DeviceMismatchError:
    return DeviceMismatchError(f"from_dlpack: {s} is on {s.device}, the memory of {memory}; use "
                               f"a stream of that device")


def _not_on(dev, want) -> BufferError:
    return BufferError(f"the producer's memory is on {dev}, not on {want}; sharedmem does not "
                       f"copy on import")


def from_dlpack(obj, *, stream=None, device=None, _adopt=False):
    """Import ``obj`` (anything with ``__dlpack__``, or a DLPack capsule) as a
    :class:`~sharedmem.Tensor`, zero-copy.

    ``stream``: the sharedmem Stream (or foreign stream) the memory will be
    used on first; the producer is asked to order its pending work before it
    (default: the device's default stream). The import is recorded as a write
    on that stream, so later use on any other stream is ordered after it too.
    ``device``: must be the producer's device (no copies on import).

    The producer can still reach the bytes, so it counts as a live alias: the
    Tensor cannot be moved while the producer lives (for NumPy and CuPy
    arrays, whose capsules keep them alive: while the import lives). Take the
    memory over with :func:`sharedmem.adopt` instead when nothing else holds it."""
    s = None if stream is None else as_stream_or_default(stream)  # (a Stream: itself)
    if s is not None and s._capture is not None:
        raise uncapturable_import(s)
    where = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else None
    on_cuda = where is not None and where[0] in (kDLCUDA, kDLCUDAManaged)
    unnamed = stream is not None and s is None  # (a default stream that names no device)
    if unnamed:  # (borrowed on the producer's device: every device has one)
        s = Stream._borrow(stream, int(where[1]) if on_cuda else None)
    if s is not None and where is not None:  # (before anything is imported)
        if (s.device.kind == "cuda") != on_cuda or (on_cuda and s.device.ordinal != where[1]):
            raise _elsewhere(s, f"{type(obj).__name__} on DLPack device "
                                f"{(int(where[0]), int(where[1]))}")
    if device is not None and where is not None and \
            int(where[0]) in (kDLCPU, kDLCUDAHost, kDLCUDA, kDLCUDAManaged):
        # (before the producer is asked: its export -- a hold, and its consumer's stream made
        # to wait for its pending writes -- would be made for an import refused here)
        have, want = _device_of(int(where[0]), int(where[1])), as_device(device)
        if want is not have:
            raise _not_on(have, want)
    library = type(obj).__module__.partition(".")[0]  # ("torch", "jaxlib", "numpy"...)
    if library != "torch" and is_torch_tensor(obj):  # (a subclass of another module's)
        library = "torch"
    if type(obj).__name__ == "PyCapsule":
        capsule = obj
    elif not hasattr(obj, "__dlpack__"):
        raise TypeError(f"{type(obj).__name__} does not support DLPack (no __dlpack__)")
    else:
        if library == "torch" and obj.is_neg():
            # torch refuses to export the conjugate bit but exports a lazily negated view
            # (conj().imag) as its memory, without the sign
            raise BufferError(f"cannot import a torch tensor with the negative bit set (shape "
                              f"{tuple(obj.shape)}, {obj.dtype}): DLPack cannot say it, and its "
                              f"values would be read with the wrong sign; import "
                              f"x.resolve_neg() instead")
        # a CUDA producer orders its pending work before our stream (the legacy default
        # stream, 1, for none or a default stream, whose handle is 0)
        kwargs = {"stream": (s.handle or 1) if s is not None else 1} if on_cuda else {}
        try:
            capsule = obj.__dlpack__(max_version=DLPACK_VERSION, **kwargs)
        except TypeError:
            capsule = obj.__dlpack__(**kwargs)  # a producer from before DLPack 1.0
    if cython.compiled:  # (dlpack.pxd: the C API, not ctypes)
        valid = 2 if _c_is_valid(capsule, _VERSIONED) else _c_is_valid(capsule, _LEGACY)
    else:
        valid = 2 if _is_valid(capsule, _VERSIONED) else _is_valid(capsule, _LEGACY)
    if valid == 2:
        versioned, name, used = True, _VERSIONED, _USED_VERSIONED
    elif valid:
        versioned, name, used = False, _LEGACY, _USED_LEGACY
    else:
        try:
            got = _get_name(capsule)
        except Exception:
            got = None
        if got in (_USED_LEGACY, _USED_VERSIONED):
            raise BufferError("this DLPack capsule was already consumed; a capsule can be "
                              "imported once -- ask the producer for a new one")
        raise BufferError(f"not a DLPack capsule (capsule name {got!r})")
    addr = _c_get_pointer(capsule, name) if cython.compiled else _get_pointer(capsule, name)
    (major, flags, deleter, data, byte_offset, dev_type, dev_id, ndim, code, bits, lanes,
     shape_at, strides_at) = (_c_read_managed(addr, versioned) if cython.compiled else
                              _read_managed(addr, versioned))
    if major != 1:
        raise BufferError(f"DLPack major version {major} is not supported (this consumer knows "
                          f"1.x)")
    dev = _device_of(dev_type, dev_id)
    if unnamed and s.device is not dev and dev.kind == "cuda":  # (a bare capsule)
        s = Stream._borrow(stream, dev)
    if s is not None and s.device is not dev:  # (a bare capsule: its device known only now)
        raise _elsewhere(s, f"the capsule on {dev}")
    if device is not None:
        want = as_device(device)  # (not None here: "host", a Device, an ordinal)
        if want is not dev:
            raise _not_on(dev, want)
    try:
        dtype = _np_dtype(code, bits, lanes)
    except BufferError as e:  # (the capsule left unconsumed: its deleter runs when dropped)
        raise BufferError(f"cannot import {_named(obj, library)}: {e}") from None
    if not 0 <= ndim <= MAX_NDIM:
        raise BufferError(f"DLPack tensor with ndim={ndim}; sharedmem takes 0 to {MAX_NDIM} "
                          f"dimensions")
    if ndim and not shape_at:
        raise BufferError(f"DLPack tensor with ndim={ndim} and a NULL shape pointer")
    # (read only now: a capsule refused above for its device or dtype has its arrays unread)
    shape, strides = (_c_read_dims(shape_at, strides_at, ndim) if cython.compiled else
                      _read_dims(shape_at, strides_at, ndim))
    if strides is None:
        strides = c_strides(shape)
    if any(n < 0 for n in shape):
        raise BufferError(f"DLPack tensor with negative shape {shape}")
    if 0 in shape and math.prod([n for n in shape if n]) >= 1 << 63:  # (as Tensor's own
        # shapes: NumPy cannot hold it, and C strides of it are past int64 -- no export)
        raise BufferError(f"DLPack tensor of shape {shape} spans 2**63 elements or more, its "
                          f"zero sizes left out (as NumPy counts it)")
    if any(st < 0 for st, n in zip(strides, shape) if n > 1):
        raise BufferError(f"DLPack tensor with negative strides {strides} is not supported; "
                          f"make it contiguous first")
    lo, hi = extent(shape, strides)
    nbytes = (hi - lo) * dtype.itemsize
    ptr = data + byte_offset
    if nbytes and not data:
        raise BufferError(f"DLPack tensor of shape {shape} has a NULL data pointer")
    if ptr + nbytes > _ADDRESS_END:
        raise BufferError(f"DLPack tensor at 0x{data:x} + byte_offset {byte_offset} "
                          f"({nbytes} bytes) lies beyond user-space addresses")
    region = None
    if dev.kind == "cuda" and nbytes:
        # (known: an allocation the bytes lie in, held until the import is made of it)
        known = lookup_allocation(dev, ptr, nbytes)  # (one imported before: its region was
        # asked and checked then; 5 us a call) -- where it cannot have outlived its memory:
        # ours (its pool block lives with it) or a foreign one a live view's producer keeps.
        # A foreign allocation without views may be kept past its producer (a user's
        # t.allocation, torch facts): the driver may have given its start out again, smaller
        if known is None or (known.owner is None and known.live_views == 0):
            info = dev.backend.pointer_info(ptr)
            if info is not None:
                if info[2] != dev.ordinal:  # (the capsule names another device than the driver)
                    raise BufferError(f"DLPack tensor at 0x{ptr:x} says it is on {dev}, but "
                                      f"the driver has that memory on CUDA device {info[2]}; "
                                      f"the producer's dl_device is wrong")
                region = driver_region(info, ptr, nbytes, "DLPack tensor", BufferError)
    elif isinstance(obj, np.ndarray) and nbytes and (obj.base is not None or
                                                     type(obj) is not np.ndarray):
        # (its base's memory: see numpy_region; a NumPy array owning its memory exports all of
        # it, the import's own range -- a subclass's __dlpack__ may give part of it)
        region = numpy_region(obj)
        if region is not None and not (region[0] <= ptr and
                                       ptr + nbytes <= region[0] + region[1]):
            region = None  # (a subclass's __dlpack__ giving other memory: not its base's)
    elif library == "torch" and nbytes:  # (host memory: its storage's, as NumPy's base's --
        # else a view imported before its base was an allocation of its own, and work on the
        # two was not ordered)
        region = torch_storage_region(obj, ptr, nbytes)
    # consume: from here on we own the managed tensor and must call its deleter. Checked
    # again and renamed in one step: another thread importing the same capsule may have
    # taken it since the check above (both took it: the deleter ran twice)
    with _consume_lock:
        if cython.compiled:
            taken = _c_is_valid(capsule, name) and _c_set_name(capsule, used) == 0
        else:
            taken = _is_valid(capsule, name) and _set_name(capsule, used) == 0
    if not taken:
        raise BufferError("this DLPack capsule was already consumed; a capsule can be "
                          "imported once -- ask the producer for a new one")
    ours = deleter == _DELETER_ADDR  # (our own export)
    owner = None if ours else _Imported(addr, versioned)
    try:
        # (JAX arrays are immutable, but JAX exports legacy capsules, which cannot say so:
        # a write through the import would change an array JAX assumes never changes)
        writable = not (flags & FLAG_READ_ONLY) and library not in ("jax", "jaxlib")
        return import_tensor(dev, ptr, nbytes, "dlpack", region, writable, owner, dtype,
                             shape, strides, s, None if obj is capsule else obj,
                             not (_adopt or ours))  # (our views count themselves)
    finally:
        if ours:  # the import's token keeps our memory: the export ends now (kept, it was
            _delete(addr)  # an alias of the import itself, which could never be moved)


# Registered last: another thread's View.__dlpack__ that sees it registered calls this module's
# functions at once (one that does not waits for the import to end: allocation._module); and an
# import that fails leaves none registered, so the next export imports this module again.
register_dlpack_exporter(_Exporter())
