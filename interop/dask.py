"""dask.distributed: Buffer, Tensor and DeviceBox in distributed's serialization families.

Importing this module registers them (idempotent). You rarely need to: sharedmem does it by
itself in every process where both sharedmem and distributed are imported, whichever comes
first (:func:`sharedmem.pickling.hook_distributed`) -- so worker processes, which import
distributed and then sharedmem when a task or a Tensor arrives, always have the handlers.
Without any of it Tensors still travel: distributed falls back to pickle, which is a host
copy with out-of-band buffers (:mod:`sharedmem.pickling`).

* ``dask`` family (the default, ``serializers=["dask", "pickle"]``): a host copy. The header
  names the kind (Buffer, Tensor, DeviceBox), dtype and shape; one frame holds the values
  (``to_host()``: taken after every pending write to the bytes, in C order).
* ``cuda`` family (``serializers=["cuda", "dask", "pickle"]``, as dask-cuda uses with UCX):
  one *device frame* for memory on a CUDA device -- an object with
  ``__cuda_array_interface__`` over the sent bytes, never a copy (a strided Tensor is first
  copied to a contiguous one on the device). The frame holds a read-only view of the bytes,
  and exports it as a CAI export does (a read hold on the consumers' streams): while the
  comm keeps the frame, the sender's memory is never freed, reused or moved. Pending writes
  to the bytes are waited for (on the host) before the frame is handed over, because UCX
  sends without stream ordering. On Python >= 3.12 the frame also has the buffer protocol
  (PEP 688), read as a host copy, so the same frame goes over TCP; on older Pythons the frame
  is a host copy unless a UCX comm is loaded. Memory on the host device always goes as a host
  copy.

The receiver always makes a **new allocation**: from host frames on its
:func:`~sharedmem.default_device` (a copy from host memory), from device frames (received by
UCX into an RMM or Numba buffer) on that buffer's device by a device-to-device copy. Tensors
arrive C-contiguous; read-only views arrive writable (as with pickle).

What is not promised: a launch on the sending worker that *writes* the bytes while they are
in transit is not ordered after the comm's read (the comm is not stream-ordered; under the
``"reject"`` policy such a launch on another stream raises instead). Dask treats task results
as immutable: write into new tensors, not into a task's inputs.
"""

from __future__ import annotations

import math
import pickle
import sys
from types import SimpleNamespace

import numpy as np

from dask.sizeof import sizeof
from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
from distributed.protocol.serialize import dask_deserialize, dask_serialize

from sharedmem.buffer import Buffer, DeviceBox, new_buffer
from sharedmem.pickling import rebuild_box, rebuild_tensor, values_stream
from sharedmem.runtime.submission import order_consumer
from sharedmem.errors import LayoutError
from sharedmem.tensor import Tensor, c_strides

__all__ = ["DeviceFrame", "register"]

_KINDS = {Buffer: "Buffer", Tensor: "Tensor", DeviceBox: "DeviceBox"}
_U8 = np.dtype(np.uint8)


# -- headers and values -------------------------------------------------------------------------
def _header(x) -> tuple:
    """``(header, view)`` of a Buffer, Tensor or DeviceBox (``view``: the Buffer or Tensor whose
    bytes are sent). Raises MovedError / ReleasedError for a dead view."""
    kind = next(name for cls, name in _KINDS.items() if isinstance(x, cls))
    view = x.buffer if kind == "DeviceBox" else x
    view._live_token()
    return {"kind": kind, "dtype": _wire_dtype(view.dtype), "shape": list(view.shape)}, view


def _wire_dtype(dt: np.dtype):
    """``dt`` as a header holds it (msgpack: a string or bytes): its typestr, or -- where the
    typestr does not name it: ml_dtypes' bfloat16 is ``"<V2"``, raw bytes no view can hold --
    the pickled dtype (a reference to ml_dtypes' type), as :func:`sharedmem.pickling.wire_dtype`
    sends it."""
    return dt.str if np.dtype(dt.str) == dt else pickle.dumps(dt)


def _header_dtype(header) -> np.dtype:
    """The dtype a header names (see :func:`_wire_dtype`)."""
    dt = header["dtype"]
    return pickle.loads(dt) if isinstance(dt, (bytes, bytearray)) else np.dtype(dt)


def _dumps(header, view, device: bool) -> tuple:
    """``header`` and one frame of ``view``'s values: a :class:`DeviceFrame` when ``device``,
    else a host copy (after pending writes, C order)."""
    header["frame"] = "device" if device else "host"
    if device:
        return header, [device_frame(view)]
    return header, [memoryview(view.to_host().reshape(-1).view(np.uint8))]


def _rebuild(header, t):
    """The received object of ``header``'s kind around ``t``, the new Tensor holding the
    received values (a new allocation)."""
    kind = header["kind"]
    if kind == "Tensor":
        return t
    buf = t.into_buffer()  # (nothing else holds the new allocation: a move, no copy)
    return buf if kind == "Buffer" else rebuild_box(buf)


# -- the dask family: host copies ----------------------------------------------------------------
def dask_dumps(x):
    """Header and one host frame (a copy of the values, after pending writes)."""
    return _dumps(*_header(x), False)


def dask_loads(header, frames):
    """A new allocation on the default device holding the frame's values (as unpickling
    makes it: the frame is in the sender's dtype, converted to native byte order)."""
    (frame,) = frames
    return _rebuild(header, rebuild_tensor(_header_dtype(header), tuple(header["shape"]), frame))


# -- the cuda family: device frames ----------------------------------------------------------------
class DeviceFrame:
    """One device frame for distributed's comm: the sent bytes, zero-copy.

    Holds a read-only ``uint8`` view of the bytes -- its own view token: while the frame
    lives the allocation is neither freed nor reused, and cannot be moved (the frame is a
    live alias) -- and exports it through ``__cuda_array_interface__`` (memory on a CUDA
    device only; which also puts a read hold on the consumers' streams, as every CAI export
    does). The comm drops the frame when it is done with it; then the view is released.
    ``nbytes`` and ``len()`` give the size; on Python >= 3.12 the buffer protocol reads the
    bytes as a host copy (for a TCP comm)."""

    __slots__ = ("_view", "_cai", "__weakref__")

    def __init__(self, view):
        """``view``: a live, contiguous Buffer or Tensor (the frame takes a view of its bytes
        of its own; ``view`` may be released afterwards)."""
        self._view = _bytes_of(view, "dask device frame (read-only)", False)
        self._cai = None

    @property
    def nbytes(self) -> int:
        return self._view.nbytes

    def __len__(self) -> int:
        return self._view.nbytes

    @property
    def __cuda_array_interface__(self) -> dict:
        if self._view.device.kind != "cuda":
            raise AttributeError("__cuda_array_interface__: this frame is on the host device")
        if self._cai is None:  # one export per frame (its hold lasts as long as the frame)
            self._cai = self._view.__cuda_array_interface__
        return self._cai

    def __buffer__(self, flags):  # PEP 688 (Python >= 3.12): a TCP comm reads a host copy
        return memoryview(self._view.to_host())

    def __repr__(self) -> str:
        return f"<DeviceFrame {self.nbytes} bytes of {self._view!r}>"


def _device_frames_ok(view) -> bool:
    """Whether a device frame can go to whatever comm sends it: UCX takes it as device memory;
    TCP needs the buffer protocol (Python >= 3.12)."""
    return view.device.kind == "cuda" and (sys.version_info >= (3, 12) or
                                           "distributed_ucxx" in sys.modules or
                                           "ucxx" in sys.modules)


def device_frame(view) -> DeviceFrame:
    """A :class:`DeviceFrame` of ``view``'s values in C order, once the pending writes to
    them are done (waited for on the host: UCX reads the bytes without stream ordering). A
    strided Tensor is first copied to a contiguous one on its device."""
    if isinstance(view, Tensor) and not view.is_contiguous():
        view = view.copy()  # (a new allocation that only the frame keeps)
    frame = DeviceFrame(view)
    try:
        order_consumer(frame._view._token, lambda marker: marker.wait())
    except BaseException:
        frame._view.release()  # (no frame: its view of the bytes goes now, not at a collection)
        raise
    return frame


def cuda_dumps(x):
    """Header and one frame: a :class:`DeviceFrame` for memory on a CUDA device (when the
    comm can take one), else a host copy."""
    header, view = _header(x)
    return _dumps(header, view, _device_frames_ok(view))


def cuda_loads(header, frames):
    """A new allocation holding the received values: device frames (anything with
    ``__cuda_array_interface__``) are copied on their device, host frames from the host to
    the default device."""
    (frame,) = frames
    if not hasattr(frame, "__cuda_array_interface__"):
        return dask_loads(header, frames)
    dtype, shape = _header_dtype(header), tuple(header["shape"])
    if not math.prod(shape):
        return _rebuild(header, Tensor.empty(shape, dtype))
    from sharedmem.bridges import from_cuda_array_interface
    cai = frame.__cuda_array_interface__
    # (the header's shape is read from the frame's address on: a frame of other bytes -- a
    # corrupt or mismatched message -- would be read past its end, other memory copied in)
    item, want = np.dtype(cai["typestr"]).itemsize, math.prod(shape) * dtype.itemsize
    have, strides = math.prod(cai["shape"]) * item, cai.get("strides")
    if have != want or (strides is not None and
                        tuple(strides) != tuple(n * item for n in c_strides(cai["shape"]))):
        raise LayoutError(f"cannot load a {header['kind']} of {dtype} x {shape} ({want} bytes) "
                          f"from a device frame of {have} bytes (strides {strides}): the frame "
                          f"does not hold those values contiguously")
    # the frame seen as its bytes (the import keeps it alive, and the frame with it, as its
    # producer): copied byte for byte -- a typestr cannot name every dtype a view may hold
    # (ml_dtypes' bfloat16 is "<V2", which no view holds)
    src = from_cuda_array_interface(SimpleNamespace(frame=frame, __cuda_array_interface__={
        "shape": (want,), "typestr": "|u1", "data": (int(cai["data"][0]), False),
        "strides": None, "version": 3, "stream": cai.get("stream")}))
    t = Tensor.empty(shape, dtype, device=src.device)
    with t.as_buffer() as d, src.as_buffer() as s:
        d8 = _bytes_of(d, "dask received bytes", True)
        try:
            d8.copy_from(s, values_stream(d.device))
        finally:
            d8.release()
    src.release()
    return _rebuild(header, t)


def _bytes_of(view, kind: str, writable: bool):
    """A ``uint8`` Buffer of ``view``'s bytes, a view token of its own (``kind`` names it)."""
    tok = view._live_token()
    lo = view._offset
    t = tok.allocation.new_token(kind, lo, lo + view.nbytes, writable, tok.keep, source=view)
    return new_buffer(t, _U8, view.nbytes)


# -- registration ------------------------------------------------------------------------------
def _sizeof(x) -> int:
    view = x.buffer if isinstance(x, DeviceBox) else x
    return view.nbytes if view.is_live else 0


def register() -> None:
    """Register Buffer, Tensor and DeviceBox in distributed's ``dask`` and ``cuda``
    families, and their sizes (``nbytes``) with ``dask.sizeof``. Idempotent."""
    for cls in _KINDS:
        dask_serialize.register(cls, dask_dumps)
        dask_deserialize.register(cls, dask_loads)
        cuda_serialize.register(cls, cuda_dumps)
        cuda_deserialize.register(cls, cuda_loads)
        sizeof.register(cls, _sizeof)


register()
