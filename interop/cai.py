"""CUDA Array Interface v3, both ways.

Export (``view.__cuda_array_interface__``, CUDA devices only): ``data`` is
``(ptr, read_only)``; ``strides`` is None for C-contiguous views, else byte
strides; ``stream`` names a stream on which all our pending writes to these
bytes (and pending reads, for a writable view) are complete -- a per-device
export stream made to wait on them on the device -- or is None when nothing is
pending. CAI has no lifetime protocol: the consumer keeps the view object
alive, and with it a *hold* (made in one step with the ordering:
``runtime.submission.object_export_hold``): while the object lives the
view cannot be moved, and when it is collected the bytes stay leased on the
consumer's likely streams (the current streams of CuPy and torch, and the
legacy default stream: ``interop.streams.current_streams``) until they pass
that point.

Import (``from_cuda_array_interface(obj, *, stream=None)``): zero-copy; ``obj``
is kept alive as the producer; a producer ``stream`` is honoured with a wait
on the device (an event recorded on it), never a host synchronize.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np

from sharedmem.buffer import as_dtype
from sharedmem.device import Device
from sharedmem.runtime.state import OwnedLock, fork_safe
from sharedmem.runtime.submission import object_export_hold
from sharedmem.errors import CaptureError
from sharedmem.stream import Stream, resolve_stream
from sharedmem.tensor import MAX_NDIM, Tensor, c_strides, extent

from interop.dlpack import driver_region, import_tensor, uncapturable_import
from interop.streams import current_consumers

__all__ = ["cai_layout", "export_cai", "from_cuda_array_interface", "read_cai"]

_export_streams: dict = {}  # device key -> CudaStreamImpl; guarded by _lock
# (its section makes a stream on first use: a finalizer re-entering gets SharedMemError)
_lock = fork_safe(OwnedLock("the creation of a CAI export stream"))


_last_export = [None]  # (device, its export stream): the last one asked for, lock-free


def _export_stream(dev):
    last = _last_export[0]
    if last is not None and last[0] is dev:
        return last[1]
    impl = _export_streams.get(dev.key)  # (lock-free once made: it is never replaced)
    if impl is not None:
        _last_export[0] = (dev, impl)
        return impl
    with _lock:
        impl = _export_streams.get(dev.key)
        if impl is None:
            impl = _export_streams[dev.key] = dev.backend.create_stream("sharedmem-cai-export")
        return impl


#: ``dt.str``, remembered (NumPy formats a new one on every .str)
typestr = functools.cache(operator.attrgetter("str"))


def cai_layout(view, read_only: bool) -> dict:
    """The layout keys of a CAI v3 dict for ``view`` (a Buffer or a Tensor): ``shape``,
    ``typestr``, ``data`` (pointer, read-only flag), ``strides`` (None when C-contiguous),
    ``version``. No ordering, no stream: callers add what they promise."""
    tok = view._live_token()
    dt = view._dtype
    if isinstance(view, Tensor):
        shape = view._shape
        strides = None if view._contiguous else tuple([s * dt.itemsize for s in view._strides])
    else:
        shape, strides = (view._length,), None
    # (a zero-size array's pointer is 0, as the protocol asks)
    ptr = tok.allocation.ptr + view._offset if tok.stop > tok.start else 0
    return {"shape": shape, "typestr": typestr(dt), "data": (ptr, read_only), "strides": strides,
            "version": 3}


#: The kind of a CAI export's hold, as AliasError messages name it.
EXPORT_KIND = "CUDA Array Interface export (it lasts as long as the exported object)"


def export_cai(view) -> dict:
    """The CUDA Array Interface v3 dict of a CUDA view (TypeError for another; see the module
    docstring: ``stream`` names a stream made to wait for our pending work on
    these bytes, or is None when none is pending). The view keeps a hold on the
    consumers' likely streams (``interop.streams.current_streams``) until it is
    garbage collected."""
    tok = view._live_token()
    dev = tok.allocation.device
    if dev.kind != "cuda":  # (the property says AttributeError first: hasattr() is False)
        raise TypeError(f"export_cai({view!r}): the CUDA Array Interface describes CUDA "
                        f"memory, and this view is on {dev}; use np.from_dlpack(view) for a "
                        f"zero-copy host array")
    impl = _export_stream(dev)
    # (the layout first: a view released meanwhile raises with no hold made)
    cai = dict(view._derived_value("cai", _layout))  # (a dict of its own for each consumer)
    streams, ordered = current_consumers(dev)
    n = object_export_hold(view, EXPORT_KIND, [(s, tok.writable) for s in streams],
                           impl.wait_marker, ordered)
    cai["descr"] = [("", cai["typestr"])]
    cai["stream"] = impl.handle if n else None
    return cai


def _layout(view) -> dict:
    return cai_layout(view, not view._live_token().writable)


def _malformed(what) -> ValueError:
    return ValueError(f"malformed __cuda_array_interface__: {what}")


def _ints(value, key, what) -> tuple:
    """``value`` (a CAI entry) as a tuple of ints, or ValueError naming ``key``."""
    try:
        if isinstance(value, (str, bytes, bytearray)):  # (not read character by character)
            raise TypeError
        out = tuple(value)
        if any(isinstance(n, bool) for n in out):  # (True is an int to Python, not a size)
            raise TypeError
        return tuple([operator.index(n) for n in out])  # (a float is not truncated)
    except TypeError:
        raise _malformed(f"{key!r} must be {what}, got {value!r}") from None


def read_cai(obj) -> tuple:
    """The checked fields of ``obj.__cuda_array_interface__``: ``(desc, version, shape,
    dtype, ptr, read_only, strides)`` -- ``strides`` in bytes as given (None: C order), ``ptr``
    an int (0 for None). TypeError when there is no such dict, ValueError naming the entry
    that is malformed."""
    try:
        desc = obj.__cuda_array_interface__
    except AttributeError:
        raise TypeError(f"{type(obj).__name__} has no __cuda_array_interface__") from None
    if not isinstance(desc, dict):
        raise TypeError("__cuda_array_interface__ must be a dict")
    version = desc.get("version", 0)
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= 3:
        raise ValueError(f"CUDA Array Interface version {version!r} is not supported (0 to 3)")
    if desc.get("mask") is not None:
        raise ValueError("masked CUDA Array Interface arrays are not supported")
    for key in ("shape", "typestr", "data"):
        if key not in desc:
            raise _malformed(f"no {key!r}")
    shape = _ints(desc["shape"], "shape", "a tuple of ints")
    if any(n < 0 for n in shape):  # (DLPack's import refuses one too)
        raise _malformed(f"negative shape {shape}")
    if any(n >= 1 << 63 for n in shape):  # (sizes are int64s: NumPy's, CuPy's, DLPack's)
        raise _malformed(f"'shape' {shape} has a size of 2**63 or more")
    if 0 in shape and math.prod([n for n in shape if n]) >= 1 << 63:  # (as Tensor's shapes)
        raise _malformed(f"'shape' {shape} spans 2**63 elements or more, its zero sizes left "
                         f"out (as NumPy counts it)")
    if len(shape) > MAX_NDIM:  # (and this: no NumPy array could hold it)
        raise _malformed(f"{len(shape)} dimensions; sharedmem takes 0 to {MAX_NDIM}")
    try:
        if not isinstance(desc["typestr"], str):  # (not a NumPy type: the protocol says string)
            raise TypeError
        dtype = np.dtype(desc["typestr"])
    except (TypeError, ValueError):
        raise _malformed(f"'typestr' {desc['typestr']!r} is not a type string") from None
    data = desc["data"]
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise _malformed(f"'data' must be a (pointer, read_only) pair, got {data!r}")
    ptr, readonly = data
    if not (isinstance(readonly, (bool, np.bool_)) or (type(readonly) is int and readonly in (0, 1))):
        raise _malformed(f"the 'data' read_only flag must be a bool, got {readonly!r}")
    strides = desc.get("strides")
    if strides is not None:
        strides = _ints(strides, "strides", "None or a tuple of ints")
        if len(strides) != len(shape):
            raise ValueError(f"strides {strides} do not match shape {shape}")
        if any(not -(1 << 63) <= s < 1 << 63 for s in strides):  # (byte strides: int64s)
            raise _malformed(f"'strides' {strides} are not 64-bit byte strides")
    try:
        ptr = 0 if ptr is None else operator.index(ptr)
    except TypeError:
        raise _malformed(f"the 'data' pointer must be an int, got {ptr!r}") from None
    if not 0 <= ptr < 1 << 64:
        raise _malformed(f"the 'data' pointer {ptr} is not a 64-bit address")
    return desc, version, shape, dtype, ptr, readonly, strides


def from_cuda_array_interface(obj, *, stream=None):
    """Import an object exposing ``__cuda_array_interface__`` (v0-v3) as a
    :class:`~sharedmem.Tensor`, zero-copy, keeping ``obj`` alive.

    ``stream``: the sharedmem Stream the memory will be used on first (default:
    the device's default stream); if the producer names a stream, ours waits
    for it on the device."""
    desc, version, shape, dtype, ptr, readonly, raw = read_cai(obj)
    dtype = as_dtype(dtype)  # (TypeError for what device memory cannot hold, as everywhere)
    isz = dtype.itemsize
    if raw is None:
        strides = c_strides(shape)
    else:
        if any(s < 0 for s in raw):
            raise ValueError(f"negative strides {raw} are not supported")
        if any(s % isz for s in raw):
            raise ValueError(f"strides {raw} are not multiples of the item size {isz}")
        strides = tuple(s // isz for s in raw)
    lo, hi = extent(shape, strides)
    nbytes = (hi - lo) * isz
    if nbytes and not ptr:  # (DLPack's import refuses one too)
        raise _malformed(f"a NULL 'data' pointer for {nbytes} bytes")
    if nbytes:
        info = Device(0).backend.pointer_info(ptr)  # (any device's driver knows the pointer)
        if info is None:
            raise ValueError(f"0x{ptr:x} is not CUDA device memory")
        dev = Device(info[2])
        region = driver_region(info, ptr, nbytes, "__cuda_array_interface__ array", ValueError)
    else:  # (no bytes, no address to find them by: the device of the stream named, if any)
        dev, region = (stream.device if isinstance(stream, Stream) else Device(0)), None
    s = resolve_stream(stream, dev)
    if s._capture is not None:  # (the producer's order and the arrival would wait for replay)
        raise uncapturable_import(s)
    producer = desc.get("stream")
    if producer is not None and version >= 3:
        if isinstance(producer, bool) or not isinstance(producer, int):
            raise TypeError(f"__cuda_array_interface__ stream must be an int or None, got "
                            f"{type(producer).__name__}")
        if producer <= 0:
            raise ValueError(f"__cuda_array_interface__ stream {producer!r} is not valid (0 is "
                             f"disallowed by the protocol)")
        if producer >= 1 << 64:
            raise ValueError(f"__cuda_array_interface__ stream {producer} is not a stream handle "
                             f"(above 64 bits)")
        if nbytes:  # (no bytes, nothing to wait for: the producer's stream may even be
            # another device's, which this device's context cannot record an event on)
            theirs = Stream._find(dev, producer)
            if theirs is not None and theirs._capture is not None:  # (sharedmem's capture)
                raise CaptureError(
                    f"the producer's stream is {theirs}, which is capturing graph "
                    f"#{theirs._capture.id}: an import ordered after it would draw {s} into "
                    f"the capture; import before the capture begins or after it ends")
            e = dev.backend.foreign_capture_error(producer)  # (another library's capture)
            if e is not None:
                raise e
            dev.backend.order_after_handle(s._impl, producer)
    # the producer still reaches the bytes: an alias while the import lives (it keeps obj)
    return import_tensor(dev, ptr, nbytes, "cai", region, not readonly, obj, dtype, shape,
                         strides, s, obj)
