"""The boundary with other libraries: imports, adoption, and declared foreign use.

* :func:`from_dlpack`, :func:`from_cuda_array_interface`: zero-copy imports (the
  work is done by ``interop.dlpack`` / ``interop.cai``, imported lazily). The
  producer stays a live alias of the imported bytes while it can reach them.
* :func:`adopt`: an import that takes the memory over, where exclusivity can be shown.
* :func:`record_use`: declare that work on a stream uses memory -- for a consumer that
  uses an export on another stream than the one it named.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import TYPE_CHECKING

import numpy as np

from .runtime.state import locked
from .allocation import View, ViewToken, _module, add_consumer_locked, lookup_allocation
from .errors import AliasError, CaptureError

__all__ = ["from_dlpack", "from_cuda_array_interface", "adopt", "record_use"]

if TYPE_CHECKING:
    from typing import Any

    from .device import Device
    from .stream import Stream
    from .tensor import Tensor


def from_dlpack(obj: Any, *, stream: Stream | object | None = None,
                device: Device | int | str | None = None) -> Tensor:
    """Import any DLPack producer (NumPy, CuPy, torch, JAX...) as a
    :class:`~sharedmem.Tensor`, zero-copy. See :func:`interop.dlpack.from_dlpack`."""
    # (the bridge looked up, not imported: an import statement per call cost about 1 us)
    return _module("interop.dlpack").from_dlpack(obj, stream=stream, device=device)


def from_cuda_array_interface(obj: Any, *, stream: Stream | object | None = None) -> Tensor:
    """Import a ``__cuda_array_interface__`` producer as a :class:`~sharedmem.Tensor`,
    zero-copy. See :func:`interop.cai.from_cuda_array_interface`."""
    return _module("interop.cai").from_cuda_array_interface(obj, stream=stream)


def _getrefcount(x) -> int:
    return sys.getrefcount(x)


@functools.cache
def refs_held_once() -> int:
    """What ``sys.getrefcount(x)`` says inside a function ``f(x)`` whose caller holds one
    reference to ``x`` (measured once, on a probe passed the same way): an adopt()
    subtracts it from its argument's count to find the other references."""
    probe = object()
    return _getrefcount(probe)


def storage_uses(tensor, use_count) -> tuple:
    """``(uses, references)`` of torch ``tensor``'s storage: torch's use count of it
    (``use_count``, ``torch._C._storage_Use_Count``) and the references to its Python
    storage object, as an adopt() reads them."""
    storage = tensor.untyped_storage()
    return use_count(storage._cdata), sys.getrefcount(storage)


@functools.cache
def lone_storage_uses(use_count) -> tuple:
    """What :func:`storage_uses` says of a tensor whose storage nothing else shares (measured
    once, on a probe asked the same way): the storage object ``untyped_storage()`` gives
    holds a use of its own, so a lone tensor's count is 2, not 1."""
    return storage_uses(sys.modules["torch"].empty(1), use_count)


def refuse_references(obj, extra: int, name: str, share: str) -> None:
    """The AliasError of an adopt() of array ``obj`` (a ``name``) while ``extra`` other
    references to it exist (none when ``extra`` <= 0): ``share`` names what shares the memory
    instead."""
    if extra > 0:
        raise AliasError(
            f"cannot adopt {name} (shape {tuple(obj.shape)}, {obj.dtype}): {extra} other "
            f"reference{'s' if extra > 1 else ''} to it (names, containers, views or weak "
            f"references) "
            f"exist{'s' if extra == 1 else ''}. Drop them first, or use {share} to share "
            f"instead.", (f"{name} reference",) * extra)


def refuse_shared(t, obj, name: str, share: str) -> None:
    """The AliasError of an adopt() of array ``obj`` (a ``name``) whose Tensor ``t``, just
    made, is not the only live view of its bytes: sharedmem views reach that memory too (it
    is sharedmem's -- ``cupy.asarray(buf)``, ``cupy.from_dlpack(t)`` -- or was imported or
    wrapped before), so taking it over would leave them aliases of a Tensor said to be
    movable. ``t`` is released first: nothing imported. None raised where ``t`` is alone."""
    from .runtime.submission import settle
    tok = t._token
    alloc = tok.allocation
    for attempt in range(2):
        with locked():
            others = ([] if tok.start >= tok.stop else
                      alloc.conflicts_locked(tok.start, tok.stop, True, tok))
        if not others:
            return
        if not attempt:  # (a view kept only by finished work -- an as_cupy export a launch
            settle()     # kept -- is let go first, as a move does before it reports one)
    t.release()
    n = len(others)
    lines = "\n".join(f"  - {v.describe()}" for v in others)
    raise AliasError(
        f"cannot adopt {name} (shape {tuple(obj.shape)}, {obj.dtype}): {n} other live "
        f"view{'s' if n != 1 else ''} of its bytes exist{'s' if n == 1 else ''}:\n{lines}\n"
        f"Release {'them' if n != 1 else 'it'} first, or use {share} to share instead.",
        tuple(v.describe() for v in others))


def _owns_memory(tensor) -> bool:
    """Whether torch ``tensor``'s storage holds memory torch allocated: not one over memory
    of another owner (``torch.from_numpy``, ``torch.frombuffer``, ``torch.from_dlpack``),
    whose storage torch cannot resize. (A function of its own: the storage object it asks is
    gone before ``storage_uses`` counts the storage's uses and references.)"""
    resizable = getattr(tensor.untyped_storage(), "resizable", None)
    return resizable is None or bool(resizable())


def _is_array(obj, root) -> bool:
    """Whether ``obj``, of a type from library ``root``, is one of its arrays (not a scalar,
    a dtype or another object of the library)."""
    if root == "numpy":
        return isinstance(obj, np.ndarray)
    if root == "torch":
        return isinstance(obj, sys.modules["torch"].Tensor)
    return type(obj).__name__ == "ndarray"  # cupy.ndarray


def adopt(obj: Any, *, stream: Stream | object | None = None) -> Tensor:
    """Import ``obj`` zero-copy and take its memory over: unlike :func:`from_dlpack`, the
    producer is not counted as an alias, so the returned Tensor can be moved.

    Exclusivity must be shown, so this is refused with :class:`~sharedmem.AliasError`
    (nothing imported) unless ``obj`` is a NumPy, CuPy or torch array that is not a view of
    another array and that nothing else references: pass it as a temporary, or drop every
    other name, container and view of it first -- and do not use ``obj`` afterwards. Refused
    too (nothing imported) while other live views reach its bytes (sharedmem memory:
    ``cupy.from_dlpack(t)`` while ``t`` lives).
    (``interop.cupy.adopt`` does the same for CuPy arrays without DLPack.)"""
    # (a weak reference reaches it too, and counts in no refcount)
    extra = sys.getrefcount(obj) - refs_held_once() + weakref.getweakrefcount(obj)
    t = type(obj)
    root = t.__module__.split(".")[0]
    name = f"{root}.{t.__qualname__}"
    if root not in ("numpy", "cupy", "torch") or not _is_array(obj, root):
        raise AliasError(
            f"cannot adopt a {name}: sharedmem can show that nothing else reaches the memory "
            f"only for NumPy, CuPy and torch arrays. Import it with sharedmem.from_dlpack (the "
            f"producer then stays an alias) or copy it.", (name,))
    if root == "torch":
        if obj._base is not None:
            raise AliasError(f"cannot adopt a view of another torch tensor: the base still "
                             f"reaches the memory. Adopt the base, or copy.", ("torch base tensor",))
        use_count = getattr(getattr(sys.modules.get("torch"), "_C", None), "_storage_Use_Count", None)
        if use_count is None:
            raise AliasError("cannot adopt a torch tensor with this torch: it cannot tell whether "
                             "other tensors share the storage. Copy it instead.", ("torch storage",))
        uses, refs = storage_uses(obj, use_count)
        lone_uses, lone_refs = lone_storage_uses(use_count)
        if uses > lone_uses or refs > lone_refs:  # (a storage object reaches the memory too)
            raise AliasError("cannot adopt a torch tensor whose storage other tensors (views, "
                             "NumPy arrays of it) or storage objects (untyped_storage()) share; "
                             "drop them first, or copy.", ("torch storage",))
        if not _owns_memory(obj):
            # a storage over memory torch did not allocate (torch.from_numpy, frombuffer,
            # from_dlpack): its owner -- the NumPy array, the buffer, the producer -- still
            # reaches the bytes, and no use count of torch's can tell. (torch marks a storage
            # so for good once x.numpy() was made of it: refused too, as it cannot be told apart)
            raise AliasError(f"cannot adopt a torch tensor (shape {tuple(obj.shape)}, "
                             f"{obj.dtype}) whose storage torch does not show it owns alone: "
                             f"one over another object's memory (torch.from_numpy, "
                             f"torch.frombuffer, torch.from_dlpack), whose owner still reaches "
                             f"it, or one given to NumPy once (x.numpy()). Use "
                             f"sharedmem.from_dlpack to share it, or adopt a copy "
                             f"(x.clone()).", ("owner of the torch tensor's memory",))
    elif (base := getattr(obj, "base", None)) is not None:
        if not hasattr(base, "shape"):  # (np.frombuffer of bytes, an mmap...)
            raise AliasError(f"cannot adopt a {name} over memory a {type(base).__name__} "
                             f"owns: that object still reaches it. Copy it instead.",
                             (f"{type(base).__name__} owning the memory",))
        raise AliasError(f"cannot adopt a view of another {name} (shape "
                         f"{tuple(base.shape)}): the base still owns the memory. Adopt the "
                         f"base array, or copy.", (f"{name} base array",))
    refuse_references(obj, extra, name, "sharedmem.from_dlpack")
    tensor = _module("interop.dlpack").from_dlpack(obj, stream=stream, _adopt=True)
    refuse_shared(tensor, obj, name, "sharedmem.from_dlpack")
    if tensor.allocation.source != "sharedmem":  # (sharedmem's own memory stays so named)
        tensor.allocation.source = f"{tensor.allocation.source} (adopted)"
    return tensor


def _device_of_memory(ptr: int):
    """The CUDA device whose memory ``ptr`` is (as its driver says), else the default device."""
    from .device import Device, default_device
    try:
        info = Device(0).backend.pointer_info(ptr)  # (any device's driver knows the pointer)
    except ImportError:  # (no CUDA here: BackendUnavailableError)
        info = None
    return Device(info[2]) if info is not None else default_device()


def record_use(x: Any, stream: Stream | object, *, writes: bool = True) -> None:
    """Declare that work on ``stream`` uses the bytes of ``x`` -- for a consumer that uses an
    export on another stream than the one it named (or none).

    ``x``: a sharedmem view, or any array with ``__cuda_array_interface__`` over sharedmem
    memory (a CuPy array from ``cupy.from_dlpack``, ``as_cupy``...). ``writes``: whether that
    work may write them. From this call on the bytes are leased on ``stream`` until it has
    passed this point (later launches on other streams are ordered after it), and every hold
    on them that is live now -- ``x`` itself, the exports that reach them -- also ends
    stream-ordered on ``stream``. The limit: work given to ``stream`` after every such hold has
    ended is not covered (it uses memory no handle keeps).
    """
    from .stream import Stream, resolve_stream
    from .runtime.submission import end_left_consumers_locked, fresh_marker_locked, lease_locked
    if isinstance(x, View) or type(x).__name__ == "DeviceBox":
        view = x if isinstance(x, View) else x.buffer
        tok = view._live_token()
        alloc, lo, hi, keep = tok.allocation, tok.start, tok.stop, tok.keep
    else:
        cai = getattr(x, "__cuda_array_interface__", None)
        if not isinstance(cai, dict):
            raise TypeError(f"record_use takes a sharedmem view or an array with "
                            f"__cuda_array_interface__, got {type(x).__name__}")
        from .tensor import c_strides, extent
        # (ValueError for a malformed one; the bridge looked up by name, as the imports above)
        _, _, shape, dtype, ptr, _, strides = _module("interop.cai").read_cai(x)
        isz = dtype.itemsize
        if strides is None:  # (else in bytes: a multiple of the item size or not)
            strides = tuple(s * isz for s in c_strides(shape))
        e_lo, e_hi = extent(shape, strides, isz)
        if e_lo == e_hi:  # an empty array uses no bytes (its pointer may be 0): nothing to order
            return
        ptr += e_lo
        if not isinstance(stream, Stream):  # (borrowed on the memory's device, not the default)
            stream = Stream._borrow(stream, _device_of_memory(ptr))
        nbytes = e_hi - e_lo
        alloc = lookup_allocation(stream.device, ptr, nbytes)
        if alloc is None:
            raise ValueError(f"record_use: the {type(x).__name__} at 0x{ptr:x} is not memory "
                             f"sharedmem knows on {stream.device}; nothing to order")
        lo, hi, keep = ptr - alloc.ptr, ptr - alloc.ptr + nbytes, x
    stream = resolve_stream(stream, alloc.device)
    if stream._capture is not None:
        raise CaptureError(f"record_use on {stream}: it is capturing a graph, whose work runs "
                           f"only at replay; declare the use on the replaying stream")
    lease = ViewToken(alloc, "declared use", lo, hi, True, keep)  # never live: a lease's range
    with locked():
        marker = fresh_marker_locked(stream, pooled=True)
        lease_locked(stream, ((lease, bool(writes)),), keep, f"use declared on {stream}",
                     marker)
        for tok in alloc.live_tokens_locked(lo, hi):
            add_consumer_locked(tok, stream, bool(writes))
            end_left_consumers_locked(tok, (stream,))  # (streams a CuPy user let go)
