"""CuPy interop: CuPy arrays as sharedmem views, our memory as CuPy arrays, and
CuPy ``RawKernel`` / ``RawModule`` kernels launched through ``sharedmem.launch``.

``import interop.cupy`` never imports CuPy; each call does, and raises
:class:`~sharedmem.errors.BackendUnavailableError` when it is missing.

* ``wrap(arr)``: a Tensor sharing a CuPy array's memory (zero-copy). The CuPy
  array stays a live alias of those bytes -- a move raises AliasError naming
  it -- until it (and every view of it) is garbage collected.
* ``adopt(arr)``: a Tensor that takes over the array's memory; refused while
  other references to the array (names, containers, views) exist, or other live views
  reach its bytes (``cupy.asarray(buf)`` while ``buf`` lives).
* ``as_cupy(x, stream=None)``: a ``cupy.ndarray`` over a view's memory. It holds
  a view token of its own until CuPy drops the memory (when the array and all its
  views are gone); that token is a hold on ``stream`` (default: CuPy's current
  stream), so the bytes stay leased there until the stream has passed the point
  where the array died. CuPy has no read-only arrays: the array of a read-only view
  is refused as ``Out`` / ``InOut`` / ``Atomic`` by ``sharedmem.launch``.
* Launch: the kernel runs through ``cuLaunchKernel`` with the parameter layout
  the driver reports (``cuFuncGetParamInfo``) and the parameter *types* read from
  the kernel's CUDA source (CuPy keeps it: ``RawKernel.code``), planned once per
  kernel (see :class:`RawKernelPlan`). Scalars are converted to the parameter's
  type (a Python int for a ``float`` becomes that float) or refused with an error
  naming the parameter; where the source is unknown (a cubin), Python scalars are
  refused and NumPy scalars of the parameter's size are passed as they are. A
  buffer passed as ``In(x, with_length=True)`` (or ``Out``, ``InOut``) fills two
  parameters, its pointer and its length in elements. Grid, block and shared
  memory are checked against the device's limits.
"""

from __future__ import annotations

import sys
import weakref

from sharedmem.bridges import refs_held_once, refuse_references, refuse_shared
from sharedmem.buffer import DeviceBox
from sharedmem.device import Device
from sharedmem.errors import AliasError, DeviceMismatchError, LayoutError
from sharedmem.launch import KernelAdapter, register_kernel_adapter
from sharedmem.runtime.submission import export_hold
from sharedmem.stream import Stream
from sharedmem.tensor import Tensor, extent, new_tensor

from interop.cupy_launch import (COERCE_ADDR, _ExportOwner, _allocation_of, _cupy, coerce,
                                 export_token, owner_writable, plan_kernel)
from interop.dlpack import ProducerAlias, refuse_foreign_capture
from sharedmem.allocation import import_writable

__all__ = ["wrap", "adopt", "as_cupy", "RawKernelAdapter"]


# -- arrays -> views ------------------------------------------------------------------
def _tensor_view(arr):
    """A Tensor over CuPy array ``arr``'s memory (read-only where ``arr`` is an as_cupy
    array of a read-only view)."""
    cp = _cupy()
    if not isinstance(arr, cp.ndarray):
        raise TypeError(f"expected a cupy.ndarray, got {type(arr).__name__}")
    alloc, lo, hi = _allocation_of(arr, Device(arr.device.id))
    isz = arr.itemsize
    if any(s % isz for s in arr.strides):
        raise LayoutError(f"a CuPy array with strides {arr.strides} (not multiples of the "
                          f"item size {isz}) cannot be a Tensor")
    # (read-only where CuPy's memory is a read-only view's -- as_cupy or cupy.asarray of
    # one, as a launch takes the array -- or only read-only views reach the bytes)
    writable = import_writable(alloc, lo, hi, owner_writable(arr))
    # (a list: wrap() puts the array's alias last -- let go of first, before the memory)
    tok = alloc.new_token("tensor", lo, hi, writable, [alloc, arr.data, None])
    return new_tensor(tok, arr.dtype, tuple(arr.shape), tuple(s // isz for s in arr.strides),
                      arr.data.ptr - alloc.ptr)


def wrap(arr) -> Tensor:
    """A Tensor over the memory of CuPy array ``arr`` (zero-copy, same pointer).

    The CuPy array stays a live alias: moving that memory raises AliasError
    naming it until the array and every view of it are garbage collected."""
    t = _tensor_view(arr)
    root = arr
    while root.base is not None:
        root = root.base
    alloc = t.allocation
    if export_token(arr) is None:
        lo, hi = extent(root.shape, root.strides, root.itemsize)
        start = root.data.ptr + lo - alloc.ptr
        desc = f"CuPy array (shape {tuple(root.shape)}, {root.dtype})"
        # (read-only where the Tensor is: the array is then over a read-only view's bytes).
        # The alias lives in the Tensor's keep, as an import's producer alias does: it ends
        # when the array dies or when the wrap's last view and lease are gone, whichever is
        # first -- a finalizer on the array alone kept one token (and a finalizer) per wrap()
        # for as long as the array lived: wrapping a long-lived array in a loop grew its
        # allocation's views without bound
        t._token.keep[2] = ProducerAlias(alloc, start, start + hi - lo, root, not t.readonly,
                                         desc)
    return t


def adopt(arr) -> Tensor:
    """A Tensor that takes over CuPy array ``arr``'s memory (zero-copy).

    Refused with AliasError while other references to the array exist --
    further names or containers, or views of it -- or when ``arr`` is itself a
    view. Do not use ``arr`` afterwards."""
    cp = _cupy()
    if not isinstance(arr, cp.ndarray):
        raise TypeError(f"adopt takes a cupy.ndarray, got {type(arr).__name__}")
    if arr.base is not None:
        raise AliasError(
            f"cannot adopt a view of another CuPy array (shape {tuple(arr.base.shape)}): the base "
            f"still owns the memory. Adopt the base array, or copy.", ("CuPy base array",))
    extra = (sys.getrefcount(arr) - refs_held_once()  # (before arr is anyone's argument)
             + weakref.getweakrefcount(arr))
    refuse_references(arr, extra, "CuPy array", "wrap()")
    if export_token(arr) is not None:
        raise AliasError("cannot adopt an array made by as_cupy: its memory already belongs to "
                         "sharedmem; use the view it was made from", ("as_cupy export",))
    t = _tensor_view(arr)
    refuse_shared(t, arr, "CuPy array", "wrap()")
    if t.allocation.source != "sharedmem":  # (sharedmem's own memory stays so named)
        t.allocation.source = "cupy (adopted)"
    return t


# -- views -> arrays --------------------------------------------------------------------
def as_cupy(x, stream=None):
    """A ``cupy.ndarray`` over view ``x``'s memory, zero-copy.

    ``stream`` (a sharedmem or CuPy stream; default CuPy's current stream) is
    made to wait on the device for our pending writes to these bytes (and
    pending reads, for a writable view) before the array is returned. It is the
    stream the array is used on: when the array dies, its bytes stay leased there
    until the stream has passed that point. Used on another stream too? Declare
    it with :func:`sharedmem.record_use`."""
    cp = _cupy()
    if isinstance(x, DeviceBox):
        x = x.buffer
    tok = x._live_token()
    dev = tok.allocation.device
    if dev.kind != "cuda":
        raise DeviceMismatchError(f"as_cupy needs memory on a CUDA device; {x!r} is on {dev}")
    consumer = _consumer(stream, dev)
    if consumer is not dev.default_stream:  # (another library's capture of the stream)
        refuse_foreign_capture(tok, consumer, "as_cupy: ", str(consumer),
                               "make the array before the capture begins, or after it ends")
    export = export_hold(tok, "CuPy array (as_cupy)", x, ((consumer, tok.writable),),
                         dev.backend.wait_on_handle, False, consumer, consumer.handle)
    base = tok.allocation.ptr + tok.start
    mem = cp.cuda.UnownedMemory(base, max(tok.stop - tok.start, 1), _ExportOwner(export),
                                dev.ordinal)
    memptr = cp.cuda.MemoryPointer(mem, x.ptr - base)
    strides = getattr(x, "byte_strides", (x.dtype.itemsize,))
    return cp.ndarray(tuple(x.shape), x.dtype, memptr, strides=strides)


def _consumer(stream, dev):
    """The sharedmem Stream the array will be used on: ``stream``, or CuPy's current one
    (whose object is kept alive by the export's hold)."""
    if stream is None:
        stream = _cupy().cuda.get_current_stream(dev.ordinal)
        if stream.ptr == 0:
            return dev.default_stream
    if isinstance(stream, Stream):
        if stream.device is not dev:
            raise DeviceMismatchError(f"as_cupy: {stream} is on {stream.device}, the memory "
                                      f"on {dev}")
        return stream
    return Stream._borrow(stream, dev)


class RawKernelAdapter(KernelAdapter):
    """Launches ``cupy.RawKernel`` (and ``RawModule.get_function`` kernels): see
    :class:`interop.cupy_launch.RawKernelPlan`."""

    name = "CuPy RawKernel"
    device_kinds = ("cuda",)

    def label(self, kernel) -> str:
        return f"CuPy kernel {getattr(kernel, 'name', '?')}"

    coerce = staticmethod(coerce)

    def plan(self, kernel, device):
        return plan_kernel(self, kernel, device)


# By name: importing this module must not import CuPy. (Compiled, its coerce as a C function
# too: see KernelAdapter._coerce_addr.)
_adapter = RawKernelAdapter()
_adapter._coerce_addr = COERCE_ADDR
register_kernel_adapter("cupy._core.raw.RawKernel", _adapter)
