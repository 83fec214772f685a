"""Pickling sharedmem views: a copy through host memory, as CuPy and torch do.

``pickle.dumps(x)`` of a :class:`~sharedmem.Buffer`, :class:`~sharedmem.Tensor` or
:class:`~sharedmem.DeviceBox` copies the values to the host (``x.to_host()``: taken after
every pending write to those bytes, on any stream) and pickles that copy. With protocol 5
the copy is a :class:`pickle.PickleBuffer`, so a ``buffer_callback`` receives it out of band
(no second copy into the pickle stream); with protocols 0 to 4 it is ``bytes`` in band.

Unpickling makes a **new allocation** on the receiving process's
:func:`~sharedmem.default_device` (a CUDA GPU when one is usable there, else the host device)
holding the same dtype, shape and values:

* a Buffer arrives as a Buffer, a slice as a Buffer of just its elements;
* a Tensor arrives as a C-contiguous Tensor with the same logical values: a strided
  (transposed, sliced) tensor becomes contiguous on arrival;
* a read-only view arrives as an ordinary, writable allocation (it is a copy nobody else
  holds; CuPy and torch have no read-only arrays to compare with);
* nothing of the sender's identity travels: not its allocation, pointer, stream, device or
  pending work. The copy to the new allocation runs on the receiver's current stream and is
  ordered before any later use of it, like every ``from_host``.

A released or moved view raises its :class:`~sharedmem.ReleasedError` /
:class:`~sharedmem.MovedError` when pickled. Streams, events, futures, graphs and
allocations cannot be pickled: they name work and memory of one process (TypeError saying
what to send instead). Devices pickle by ordinal (``Device.__reduce__``).

This module also hooks sharedmem into dask.distributed (``interop.dask``) in processes where
distributed is loaded -- see :func:`hook_distributed`. It is not compiled.
"""

from __future__ import annotations

import copyreg
import functools
import importlib.abc
import importlib.machinery
import pickle
import sys

import numpy as np

__all__ = ["reduce_buffer", "reduce_tensor", "reduce_box", "hook_distributed"]


# -- sending -----------------------------------------------------------------------------
def host_payload(values: np.ndarray, protocol: int):
    """The host copy ``values`` (a fresh C-contiguous array nobody else holds) as the pickled
    payload: a PickleBuffer (out-of-band capable) for protocol 5, else bytes."""
    flat = values.reshape(-1).view(np.uint8)
    if protocol is not None and protocol >= 5:
        return pickle.PickleBuffer(flat)
    return flat.tobytes()


def reduce_buffer(buf, protocol):
    """``Buffer.__reduce_ex__``: rebuilt by :func:`rebuild_buffer` from a host copy."""
    values = buf.to_host()  # raises MovedError / ReleasedError for a dead view
    hook_distributed()
    return rebuild_buffer, (wire_dtype(values.dtype), host_payload(values, protocol))


def reduce_tensor(t, protocol):
    """``Tensor.__reduce_ex__``: rebuilt by :func:`rebuild_tensor` from a host copy (C order)."""
    values = t.to_host()
    hook_distributed()
    return rebuild_tensor, (wire_dtype(values.dtype), tuple(values.shape),
                            host_payload(values, protocol))


def wire_dtype(dt: np.dtype):
    """``dt`` as pickled: its typestr (what earlier versions sent, read by any NumPy), but
    the dtype itself where the typestr does not name it -- ml_dtypes' bfloat16 is ``"<V2"``,
    raw bytes, which no view can hold (it pickles as a reference to ml_dtypes' type)."""
    return dt.str if np.dtype(dt.str) == dt else dt


def reduce_box(box, protocol):
    """``DeviceBox.__reduce_ex__``: its buffer, pickled as a Buffer."""
    return rebuild_box, (box.buffer,)


# -- receiving ---------------------------------------------------------------------------
def _values(dtype, shape, data) -> np.ndarray:
    """The payload ``data`` (bytes, bytearray, PickleBuffer, memoryview) as an array."""
    return np.frombuffer(memoryview(data).cast("B"), dtype=dtype).reshape(shape)


def values_stream(device):
    """The stream a received view's values are copied on: None (the current stream, as for
    any copy), unless that stream captures a graph -- the copy would be recorded, not run, and
    the new view would hold no values -- or faulted (a forked child's default stream, busy at
    the fork: it runs nothing more), then a stream of the device's pool."""
    from .ops import pool_stream
    from .stream import resolve_stream
    s = resolve_stream(None, device)
    if s._capture is not None or (s._checks and s._impl.fault is not None):
        return pool_stream(device)
    return None


def rebuild_buffer(dtype, data):
    """A new Buffer on the default device holding the pickled values."""
    from .buffer import Buffer
    from .device import default_device
    hook_distributed()
    dev = default_device()
    return Buffer.from_host(_values(dtype, -1, data), dev, values_stream(dev))


def rebuild_tensor(dtype, shape, data):
    """A new C-contiguous Tensor on the default device holding the pickled values."""
    from .tensor import Tensor
    hook_distributed()
    a = _values(dtype, shape, data)
    t = Tensor.empty(a.shape, a.dtype.newbyteorder("="))  # (0-d stays 0-d: no from_host)
    if a.size:
        with t.as_buffer() as b:
            b.copy_from(a.reshape(-1), values_stream(b.device))
    return t


def rebuild_box(buffer):
    """A DeviceBox around ``buffer`` (already rebuilt: a new allocation)."""
    from .buffer import DeviceBox
    box = DeviceBox.__new__(DeviceBox)
    box.buffer = buffer
    return box


# -- what cannot be pickled ----------------------------------------------------------------
def _refuse(why, obj):
    raise TypeError(
        f"cannot pickle a sharedmem {type(obj).__name__}: {why}. Send the data instead (Buffer, "
        f"Tensor and DeviceBox pickle as host copies, taken after their pending writes) and "
        f"make streams, events and futures in the receiving process")


def _register_refusals() -> None:
    """copyreg entries (exact types) for what names work and memory of this process."""
    from .allocation import Allocation, ViewToken
    from .ops import ComputedFuture
    from .runtime.future import DeviceFuture, HostFuture
    from .runtime.graph import Graph
    from .stream import Event, Stream
    future = "a future tracks work submitted in this process"
    for cls, why in ((Stream, "a stream is a queue of work on one device of this process"),
                     (Event, "an event is a point in a stream of this process"),
                     (DeviceFuture, future), (HostFuture, future), (ComputedFuture, future),
                     (Graph, "a graph records work and memory of this process"),
                     (Allocation, "an allocation is device memory of this process"),
                     # (copy.copy too: a copy of a live token says it is live while its
                     # allocation does not count it, and its release raised KeyError)
                     (ViewToken, "a view token is one live view's place in its allocation; "
                      "make another view with a slice (view[:]) or as_readonly()")):
        copyreg.pickle(cls, functools.partial(_refuse, why))


# -- dask.distributed -------------------------------------------------------------------------
def hook_distributed() -> None:
    """Register sharedmem's serializers with dask.distributed (``import interop.dask``) in
    this process, without ever importing distributed itself: at once when distributed is
    loaded, else as soon as it is (a one-shot import hook). Cheap after the first call.

    Why here: a worker receiving a Tensor through the ``dask`` or ``cuda`` family unpickles
    its type -- importing sharedmem -- and then looks up the deserializer; so the handlers
    must exist once sharedmem is imported in a process where distributed runs (a worker
    imports distributed first), and once distributed is imported where sharedmem came first
    (a client script)."""
    if _state["done"]:
        return
    if "distributed.protocol.cuda" in sys.modules:
        _register_now()
    elif not _state["hooked"]:
        _state["hooked"] = True
        sys.meta_path.insert(0, _DistributedHook)


_state = {"done": False, "hooked": False}


def _register_now() -> None:
    _state["done"] = True
    try:
        importlib.import_module("interop.dask")
    except Exception as e:  # (never break an import; pickling still works without it)
        import warnings
        warnings.warn(f"sharedmem: registering with dask.distributed failed ({e!r}); "
                      f"Tensors travel by pickle. `import interop.dask` shows the error",
                      RuntimeWarning, stacklevel=2)


class _DistributedHook(importlib.abc.MetaPathFinder):
    """Registers sharedmem with distributed right after ``distributed.protocol`` is imported
    (its package imports ``serialize`` and ``cuda``, which hold the dispatch tables)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "distributed.protocol":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if _DistributedHook in sys.meta_path:
            sys.meta_path.remove(_DistributedHook)
        if not _state["done"]:
            _register_now()

    def __getattr__(self, name):  # get_source, get_filename, is_package... for tools
        return getattr(self._loader, name)
