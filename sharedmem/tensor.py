"""Tensor: the Tile tensor -- a shaped, strided view of device memory.

Zero-copy ownership transfers between the two views of memory:

* ``Tensor.from_buffer(buf, shape)`` *moves* a buffer into a tensor,
* ``tensor.into_buffer()`` *moves* it back,
* ``tensor.as_buffer()`` *borrows* a buffer view; the tensor cannot be moved
  while the borrow lives.

A move succeeds only when no other live view of the moved bytes exists; else
it raises :class:`~sharedmem.errors.AliasError` listing each one and changes
nothing. The source of a successful move raises
:class:`~sharedmem.errors.MovedError` on every later use. Strides are in
elements (as in DLPack), ``byte_strides`` in bytes (as in NumPy).
"""

from __future__ import annotations

import math
import operator
import sys

import numpy as np

try:
    import cython
except ImportError:
    from . import _cython as cython

from .allocation import View, _module
from .buffer import (Buffer, copy_stream, host_values, new_buffer, on_device, readonly_token,
                     to_device)
from .device import as_device
from .errors import LayoutError
from .backends import copy_pieces
from .runtime.submission import MAX_PENDING, submit, wait_before
from .stream import Stream, resolve_stream

__all__ = ["Tensor", "c_strides", "extent"]


def c_strides(shape) -> tuple[int, ...]:
    """Row-major (C order) strides in elements."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def extent(shape, strides, itemsize=1) -> tuple[int, int]:
    """Offsets ``[lo, hi)`` relative to element 0 that the layout touches, ``(0, 0)`` when
    empty: in elements, or in bytes for strides in bytes and the ``itemsize``."""
    if 0 in shape:
        return 0, 0
    lo = hi = 0  # (an index loop, not zip or a generator: an array new to a launch asks, and
    for i in range(min(len(shape), len(strides))):  # compiled the zip was half the call)
        n = shape[i]
        s = strides[i]
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


def numpy_region(arr):
    """``(address, size)`` of the memory of NumPy array ``arr``'s outermost base, or None
    (empty): any view of one array, imported or leased, is a range of that one allocation --
    whichever view came first -- so that work on overlapping views is ordered."""
    root = arr
    while True:
        base = root.base
        if isinstance(base, np.ndarray):
            root = base
            continue
        # (np.lib.stride_tricks.as_strided: an array over a stand-in object whose `base` is
        # the array it was made of -- walked through where that array holds the bytes, else
        # an as_strided view leased first was an allocation of its own, and work on it and
        # on the array it views on another stream was not ordered)
        inner = getattr(base, "base", None) if base is not None and \
            hasattr(base, "__array_interface__") else None
        if isinstance(inner, np.ndarray) and _spans(inner, arr):
            root = inner
            continue
        break
    rlo, rhi = extent(root.shape, root.strides, root.itemsize)
    if not rhi:
        return None
    start, nbytes = root.ctypes.data + rlo, rhi - rlo
    base = root.base
    region = None
    if base is not None and is_torch_tensor(base):  # (t.numpy(), np.asarray(t): a torch
        # tensor's memory, filed under its storage as the tensor itself is -- else an array
        # of part of it leased before the tensor was an allocation of its own, and work on
        # the two was not ordered)
        try:
            region = torch_storage_region(base, start, nbytes)
        except Exception:  # (a tensor without storage of its own: the array's bytes)
            pass
    elif base is not None:  # (np.frombuffer, np.ndarray(buffer=...): over part of a buffer)
        region = _buffer_region(base, start, nbytes)
    return region if region is not None else (start, nbytes)


def _spans(outer, arr) -> bool:
    """Whether NumPy array ``outer``'s bytes hold all of ``arr``'s."""
    lo, hi = extent(arr.shape, arr.strides, arr.itemsize)
    olo, ohi = extent(outer.shape, outer.strides, outer.itemsize)
    start = arr.ctypes.data + lo
    return _containing((outer.ctypes.data + olo, ohi - olo), start, hi - lo) is not None


def _containing(region, start: int, nbytes: int):
    """``region`` (``(address, size)``) where it holds bytes ``[start, start + nbytes)``, else
    None."""
    return region if region[0] <= start and start + nbytes <= region[0] + region[1] else None


def _buffer_region(base, start: int, nbytes: int):
    """``(address, size)`` of the whole buffer that ``base`` -- the base of a NumPy array that
    is no array: a bytearray, an mmap, a memoryview of one (shared memory's ``buf``), a ctypes
    array -- exports, where it holds bytes ``[start, start + nbytes)``; else None. Arrays made
    over parts of one buffer are then ranges of one allocation, in any order, as views of one
    array are -- else two arrays over overlapping parts were two allocations, and work on them
    was not ordered."""
    if isinstance(base, memoryview):
        base = base.obj  # (a slice of a buffer names the whole buffer's exporter)
        if base is None:
            return None
    try:
        with memoryview(base) as m:
            if not m.contiguous or m.nbytes == 0:
                return None
            whole = np.frombuffer(m, np.uint8)
            region = (whole.ctypes.data, m.nbytes)
            del whole  # (before the memoryview is released: it exports m's buffer)
    except (TypeError, ValueError, BufferError):  # (no buffer, or not one NumPy can read)
        return None
    return _containing(region, start, nbytes)


def is_torch_tensor(obj) -> bool:
    """Whether ``obj`` is a torch tensor (a subclass of another module's too), asked only where
    torch is imported already (never imports it)."""
    tt = getattr(sys.modules.get("torch"), "Tensor", None)  # (torch's metaclass: not type)
    return isinstance(tt, type) and isinstance(obj, tt)


def torch_storage_region(t, start: int, nbytes: int):
    """``(address, size)`` of torch tensor ``t``'s storage where it holds bytes ``[start,
    start + nbytes)``, else None: as for NumPy arrays (:func:`numpy_region`), any view of one
    storage in host memory, imported or leased, is a range of that one allocation."""
    storage = t.untyped_storage()
    return _containing((storage.data_ptr(), storage.nbytes()), start, nbytes)


MAX_NDIM = 64  # NumPy's limit: to_host must be able to hold any tensor


def _ints(seq, what) -> tuple[int, ...]:
    """``seq`` as a tuple of Python ints; TypeError ``what`` (naming ``seq``) unless it is a
    sequence of ints (bools and strings are not, nor mappings and sets: their iteration gives
    keys, or no order)."""
    bad = isinstance(seq, (str, bytes, dict, set, frozenset)) or not hasattr(seq, "__iter__")
    try:
        out = () if bad else tuple(seq)
    except TypeError:  # (an __iter__ that refuses: a 0-d array's, "iteration over a 0-d array")
        bad, out = True, ()
    if bad or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) for n in out):
        raise TypeError(f"{what}, got {seq!r}")
    return tuple(int(n) for n in out)


def _shape(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    out = _ints(shape, "shape must be an int or a sequence of ints")
    if any(n < 0 for n in out):
        raise LayoutError(f"shape must not have negative sizes, got {out}")
    if any(n >= 1 << 63 for n in out):  # (DLPack's sizes are int64s, and NumPy's too)
        raise LayoutError(f"shape sizes must be below 2**63, got {out}")
    if 0 in out and math.prod([n for n in out if n]) >= 1 << 63:  # (empty: its strides would)
        raise LayoutError(f"shape {out} spans 2**63 elements or more, its zero sizes left out "
                          f"(as NumPy counts it)")
    if len(out) > MAX_NDIM:
        raise LayoutError(f"a tensor has at most {MAX_NDIM} dimensions (as in NumPy), got a shape "
                          f"of {len(out)}")
    return out


# shape as given -> (shape, C strides, size); lock-free (idempotent writes). C globals where
# compiled: no module dict lookups.
_layouts = cython.declare(dict, {})
# [(shape object, its layout)] of the last cached lookup: the same tuple again (a literal in
# the caller's code, or a tensor's .shape) is found by identity, without hashing it. Replaced
# whole: lock-free.
_last_layout = cython.declare(list, [None])
# [(dtype, its itemsize)] of the last dense check (a dtype's itemsize never changes)
_last_itemsize = cython.declare(list, [None])


def c_layout(shape):
    """``(shape, strides, size)`` of a C-order layout of ``shape`` (an int or a sequence of
    ints), validated; cached per shape, so a move to the same shape again is a lookup."""
    # Only tuples of exact ints are cached: (2.0, 3) and (True, 3) compare equal to
    # (2, 3) and must still be refused by _shape.
    cacheable = type(shape) is tuple
    if cacheable:
        for n in shape:  # (a loop, not all(...): no generator when compiled)
            if type(n) is not int:
                cacheable = False
                break
    if cacheable:
        last = _last_layout[0]
        if last is not None and (last[0] is shape or last[0] == shape):  # (no hashing)
            return last[1]
        hit = _layouts.get(shape)
        if hit is not None:
            _last_layout[0] = (shape, hit)
            return hit
    sh = _shape(shape)
    hit = (sh, c_strides(sh), math.prod(sh))
    if cacheable:
        layouts = _layouts
        if len(layouts) >= 1024:
            layouts.clear()
        layouts[shape] = hit
        _last_layout[0] = (shape, hit)
    return hit


def _check_size(shape, size) -> None:
    """MemoryError for a new tensor of ``shape`` (each size below 2**63, validated) whose
    ``size`` is 2**63 elements or more: more than any memory holds (errors.md) -- not the
    LayoutError of a *buffer length* the caller never gave."""
    if size >= 1 << 63:
        raise MemoryError(f"cannot allocate a tensor of shape {shape}: its {size} elements are "
                          f"more than any device memory can hold")


def _itemsize(dtype):
    """``dtype.itemsize``, found without an attribute lookup when ``dtype`` was the last."""
    last = _last_itemsize[0]
    if last is not None and last[0] is dtype:
        return last[1]
    n = dtype.itemsize
    _last_itemsize[0] = (dtype, n)
    return n


def _is_c_contiguous(shape, strides) -> bool:
    return all(n <= 1 or s == e for n, s, e in zip(shape, strides, c_strides(shape)))


def new_tensor(token, dtype, shape, strides, offset, size=-1, contiguous=-1):
    """A Tensor over view token ``token`` (which it takes over): how every Tensor is made.
    ``shape`` and ``strides`` (elements): validated tuples of ints; ``offset``: byte offset of
    element 0 from the allocation's start; ``size`` and ``contiguous`` (1 or 0): the
    layout's, where the caller knows them (-1: computed here)."""
    self = Tensor.__new__(Tensor)
    self._init_view(token, offset)
    self._dtype = dtype
    self._shape = shape
    self._strides = strides
    self._size = size if size >= 0 else math.prod(shape)
    self._contiguous = contiguous if contiguous >= 0 else _is_c_contiguous(shape, strides)
    return self


class Tensor(View):
    """A shaped, strided view of device memory; the argument type of Tile
    kernels. Holds one view token (like a Buffer): its bytes stay valid while
    it lives. Attributes: ``shape``, ``strides`` (elements), ``dtype``,
    ``ptr`` (address of element 0), ``ndim``, ``size``, ``nbytes``.
    """

    __slots__ = ("_shape", "_strides", "_size", "_contiguous")
    _kind = "tensor"

    def __init__(self, *args, **kwargs):
        raise TypeError("Tensor cannot be constructed directly; use Tensor.from_buffer(buf, shape), "
                        "Tensor.empty(shape, dtype), Tensor.from_host(array) or sharedmem.from_dlpack")


    # -- construction ---------------------------------------------------------
    @staticmethod  # (not a classmethod: no bound method made on each call of this hot path)
    def from_buffer(buf: Buffer, shape: int | tuple[int, ...] | list[int],
                    strides: tuple[int, ...] | list[int] | None = None) -> Tensor:
        """Move ``buf`` into a tensor of ``shape`` (C order unless ``strides``,
        in elements, non-negative, is given) without copying.

        Raises AliasError (nothing changed) if another live view of the
        buffer's bytes exists; afterwards ``buf`` raises MovedError."""
        if not isinstance(buf, Buffer):
            raise TypeError(f"Tensor.from_buffer takes a sharedmem.Buffer, got {type(buf).__name__}")
        b = cython.cast(Buffer, buf) if cython.compiled else buf  # (interpreted: no cast call)
        b._live_token()
        n = b._length
        if strides is None:
            shape, strides, size = c_layout(shape)
            if cython.compiled:  # (compared in C; no int made of n)
                try:
                    differs = cython.cast(cython.Py_ssize_t, size) != n
                except OverflowError:  # (more elements than any buffer holds)
                    differs = True
            else:
                differs = size != n
            if differs:
                raise LayoutError(f"shape {shape} holds {size} elements but {buf!r} "
                                  f"has {n}; pass a slice of the buffer or a matching shape")
            tok = b._move_token("tensor", "Tensor")
            return new_tensor(tok, b._dtype, shape, strides, tok.start, size, 1)
        shape = _shape(shape)
        strides = _ints(strides, "strides must be a sequence of ints (elements)")
        if len(strides) != len(shape):
            raise LayoutError(f"strides {strides} do not match shape {shape}")
        if any(s < 0 for s in strides):
            raise LayoutError(f"strides must be non-negative for from_buffer, got {strides}")
        # (DLPack's, NumPy's: int64; max, not a generator over b: a closure made every call)
        if max(strides, default=0) * _itemsize(b._dtype) >= 1 << 63:
            raise LayoutError(f"strides {strides} reach 2**63 bytes or more")
        reach = extent(shape, strides)[1]
        if reach > n:
            raise LayoutError(f"shape {shape} with strides {strides} reaches element "
                              f"{reach - 1}, beyond {buf!r}")
        size = math.prod(shape)  # (strides of 0 reach few elements: checked before the move)
        if size >= 1 << 63:
            raise LayoutError(f"shape {shape} holds {size} elements; a tensor holds fewer than "
                              f"2**63 (NumPy's and DLPack's sizes are int64s)")
        tok = b._move_token("tensor", "Tensor")
        return new_tensor(tok, b._dtype, shape, strides, tok.start)

    @classmethod
    def empty(cls, shape: int | tuple[int, ...] | list[int], dtype: np.typing.DTypeLike = "float32",
              device: object = None, stream: Stream | object | None = None) -> Tensor:
        """An uninitialized C-order tensor (a new :meth:`Buffer.empty`, moved in)."""
        shape, _, size = c_layout(shape)
        _check_size(shape, size)
        return cls.from_buffer(Buffer.empty(size, dtype, device, stream), shape)

    @classmethod
    def zeros(cls, shape: int | tuple[int, ...] | list[int], dtype: np.typing.DTypeLike = "float32",
              device: object = None, stream: Stream | object | None = None) -> Tensor:
        """A C-order tensor of zeros (a new :meth:`Buffer.zeros`, moved in)."""
        shape, _, size = c_layout(shape)
        _check_size(shape, size)
        return cls.from_buffer(Buffer.zeros(size, dtype, device, stream), shape)

    @classmethod
    def from_host(cls, array: np.typing.ArrayLike, device: object = None,
                  stream: Stream | object | None = None) -> Tensor:
        """A new C-order tensor holding a copy of ``array`` (a new :meth:`Buffer.from_host`,
        moved in)."""
        a = host_values(array, "Tensor.from_host")
        return cls.from_buffer(Buffer.from_host(a, device, stream), a.shape)

    @classmethod
    def from_dlpack(cls, obj, *, stream=None, device=None) -> "Tensor":
        """Import any DLPack producer zero-copy (see :func:`sharedmem.from_dlpack`)."""
        return _module("interop.dlpack").from_dlpack(obj, stream=stream, device=device)

    # -- properties -------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The shape (a tuple of ints)."""
        self._live_token()
        return self._shape

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements."""
        self._live_token()
        return self._strides

    @property
    def byte_strides(self) -> tuple[int, ...]:
        """Strides in bytes (``strides`` times the item size)."""
        return tuple(s * self._dtype.itemsize for s in self.strides)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        self._live_token()
        return self._size

    def is_contiguous(self) -> bool:
        """True for a C-order dense layout (sizes-1 dimensions ignored)."""
        self._live_token()
        return bool(self._contiguous)  # (interpreted, the field holds 0 or 1)

    def __len__(self) -> int:
        """The size of the first axis (as NumPy; a 0-d tensor: TypeError)."""
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __iter__(self):
        """The views ``t[0]``, ``t[1]``, ... (as NumPy iterates; a 0-d tensor: TypeError)."""
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        for i in range(self._shape[0]):
            yield self[i]

    def __contains__(self, value) -> bool:
        """Always a TypeError: ``x in t`` would compare elements on the device."""
        raise TypeError(f"`x in tensor` would compare the elements on the device; compare on the "
                        f"host (x in t.to_host()) or in a kernel")

    def __repr__(self) -> str:
        tok = self._token  # (read once: see Buffer.__repr__ -- a repr never raises)
        if tok is None:
            return f"<Tensor ({self._gone()})>"
        ro = " read-only" if not tok.writable else ""
        return (f"<Tensor{ro} {self._dtype} shape={self._shape} strides={self._strides} on "
                f"{tok.allocation.device}, allocation #{tok.allocation.id}>")

    def _describe_short(self) -> str:
        tok = self._token
        return (f"Tensor({self._dtype}, shape {self._shape}, bytes [{tok.start}, {tok.stop}) of "
                f"allocation #{tok.allocation.id})")

    def __reduce_ex__(self, protocol):
        """Pickle as a host copy in C order (after pending writes); unpickled as a new
        C-contiguous allocation on the receiver's default device (see
        :mod:`sharedmem.pickling`)."""
        from .pickling import reduce_tensor
        return reduce_tensor(self, protocol)

    def __copy__(self) -> "Tensor":
        """``copy.copy(t)``: :meth:`copy` -- a new C-contiguous tensor of the same values on
        the same device (as NumPy and CuPy copy arrays; a second view is ``t[:]``)."""
        return self.copy()

    # -- ownership transfers ------------------------------------------------------
    def _check_dense(self, what: str, whole: bool = True) -> int:
        """LayoutError naming ``what`` unless this tensor is C-contiguous and (``whole``) its
        bytes are its view's whole range; returns the end of its bytes (they start at
        ``_offset``)."""
        tok = self._live_token()
        if not self._contiguous:
            raise LayoutError(f"{what} needs a C-contiguous tensor; {self!r} is not. "
                              f"Copy it into a contiguous tensor first")
        start = self._offset
        nbytes = self._size * _itemsize(self._dtype)
        stop = start + nbytes
        # (an empty tensor matches only an empty view: one over a buffer's bytes would hand
        # them on as a 0-length Buffer that still reads and writes them)
        if whole and (start != tok.start or stop != tok.stop) and (nbytes or tok.stop > tok.start):
            raise LayoutError(f"{what}: {self!r} covers bytes [{start}, {stop}) but its view "
                              f"holds [{tok.start}, {tok.stop}) (a shape smaller than the "
                              f"buffer it was made from); t.copy() is a tensor of its own bytes")
        return stop

    def into_buffer(self) -> Buffer:
        """Move this tensor's storage into a 1-D Buffer, zero-copy.

        Raises AliasError (nothing changed) if another live view of its bytes
        exists, LayoutError if it is not C-contiguous; afterwards this tensor
        raises MovedError."""
        self._check_dense("into_buffer")
        return new_buffer(self._move_token("buffer", "Buffer"), self._dtype, self._size)

    def as_buffer(self) -> Buffer:
        """Borrow a Buffer view of this (C-contiguous) tensor's bytes.

        Use as ``with t.as_buffer() as b: ...`` (or release ``b`` yourself).
        While the borrow lives, moving the tensor raises AliasError naming it."""
        tok = self._live_token()  # (first: a move on another thread then raises MovedError below)
        stop = self._check_dense("as_buffer", False)  # (a borrow of its own bytes: a new token)
        t = tok.allocation.new_token("borrow", self._offset, stop, tok.writable, tok.keep,
                                     source=self)
        return new_buffer(t, self._dtype, self._size)

    def as_readonly(self) -> "Tensor":
        """A read-only view of the same bytes (it never blocks readers)."""
        return new_tensor(readonly_token(self), self._dtype, self._shape, self._strides,
                          self._offset, self._size, self._contiguous)

    # -- views --------------------------------------------------------------------------
    def __getitem__(self, key) -> "Tensor":
        """First-axis indexing: ``t[i]`` (the sub-tensor of index ``i``, one dimension less)
        or ``t[a:b:k]`` (``k`` > 0): a view of the same allocation with its own token, as
        Buffer slices are. Other indexing: copy to the host or use a kernel."""
        tok = self._live_token()
        if not self._shape:
            raise IndexError("a 0-d tensor cannot be indexed")
        n = self._shape[0]
        isz = self._dtype.itemsize
        if type(key) is tuple and len(key) == 1:
            key = key[0]  # t[i,] as t[i]
        if isinstance(key, slice):
            if key.step is not None:  # (before indices(): 0 raises there)
                try:
                    step = operator.index(key.step)
                except TypeError:
                    raise TypeError(f"tensor slice steps are ints, got {key.step!r}") from None
                if step <= 0:
                    raise LayoutError(f"tensor slices take a positive step (strides stay "
                                      f"non-negative: reverse on the host, t.to_host()[::-1], "
                                      f"or in a kernel); {self!r}: got step {key.step}")
            start, stop, step = key.indices(n)
            count = len(range(start, stop, step))
            shape = (count,) + self._shape[1:]
            # (one element or none -- an empty result, whatever its count: another axis of
            # size 0 -- any stride will do: the parent's, never one past int64. The stride
            # times the step is bounded by the bytes it spans only where there are some)
            strides = (self._strides[0] * step if count > 1 and 0 not in self._shape
                       else self._strides[0],) + self._strides[1:]
        elif isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            start = int(key)
            if start < 0:
                start += n
            if not 0 <= start < n:
                raise IndexError(f"index {int(key)} is out of bounds for the first axis of "
                                 f"size {n} of {self!r}")
            shape, strides = self._shape[1:], self._strides[1:]
        else:
            raise TypeError(f"Tensor indexing takes an int or a slice of the first axis, got "
                            f"{type(key).__name__}; copy to the host (to_host()) for other "
                            f"indexing")
        # (an empty result stays at this tensor's element 0: a start past the end would put
        # its pointer, and its token, outside the allocation)
        offset = self._offset if 0 in shape else self._offset + start * self._strides[0] * isz
        lo, hi = extent(shape, strides)
        t = tok.allocation.new_token("tensor view", offset + lo * isz, offset + hi * isz,
                                     tok.writable, tok.keep, source=self)
        return new_tensor(t, self._dtype, shape, strides, offset)

    def reshape(self, *shape) -> "Tensor":
        """A view of this C-contiguous tensor's elements in another C-order shape (one size
        may be -1: inferred). Same allocation, own token; refuses strided tensors
        (``t.contiguous().reshape(...)`` copies first)."""
        tok = self._live_token()
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = shape[0]  # reshape((2, 3)) as reshape(2, 3)
        if isinstance(shape, (list, tuple)):
            free = [i for i, n in enumerate(shape)
                    if (type(n) is int or isinstance(n, np.integer)) and n == -1]
            if len(free) > 1:
                raise LayoutError(f"reshape{tuple(shape)}: only one size can be -1")
            if free:
                try:  # (the others checked as sizes: a message naming the whole shape)
                    known = math.prod(_shape([n for i, n in enumerate(shape) if i != free[0]]))
                except TypeError:
                    raise TypeError(f"shape must be an int or a sequence of ints, got "
                                    f"{shape!r}") from None
                except LayoutError as e:  # (what it names is the shape less its -1)
                    raise LayoutError(f"reshape{tuple(shape)}: {e}") from None
                if known == 0 or self._size % known:
                    raise LayoutError(f"cannot reshape {self!r} ({self._size} elements) to "
                                      f"{tuple(shape)}")
                shape = tuple(self._size // known if i == free[0] else n
                              for i, n in enumerate(shape))
        sh, strides, size = c_layout(shape)
        if size != self._size:
            raise LayoutError(f"cannot reshape {self!r} ({self._size} elements) to {sh} "
                              f"({size} elements)")
        if not self._contiguous:
            raise LayoutError(f"reshape needs a C-contiguous tensor; {self!r} is strided. "
                              f"t.contiguous().reshape(...) copies it first")
        t = tok.allocation.new_token("tensor view", tok.start, tok.stop, tok.writable, tok.keep,
                                     source=self)
        return new_tensor(t, self._dtype, sh, strides, self._offset, size, 1)

    def copy(self, stream=None) -> "Tensor":
        """A new C-contiguous tensor (a new allocation on the same device) holding this
        tensor's values in logical order; asynchronous on ``stream``, ordered after pending
        writes and leased like a launch. Strided sources copy by 2-D pieces on CUDA (one per
        row of the outer dimensions: a kernel is faster for large transposes); with more
        pieces than half the driver's queue, the call first waits for the work it follows."""
        tok = self._live_token()
        dev = tok.allocation.device
        s = resolve_stream(stream, dev)
        out = Tensor.empty(self._shape, self._dtype, dev, s)
        otok = out._token
        isz = self._dtype.itemsize
        src = tok.allocation.ptr + self._offset
        dst = otok.allocation.ptr + otok.start
        backend, impl = dev.backend, s._impl
        if self._contiguous:
            n = self._size * isz
            enqueue = lambda: backend.copy_dtod(impl, dst, src, n)  # noqa: E731
        else:
            shape, bstrides = self._shape, tuple(k * isz for k in self._strides)
            if s._capture is None and len(copy_pieces(shape, bstrides, isz)[3]) > MAX_PENDING // 2:
                # one 2-D copy a piece, enqueued under the core lock: behind a busy stream the
                # driver's queue (about 1,020 a stream) fills and blocks it there -- so wait
                # first, holding no lock, for the work the copy follows (a transposed matrix
                # of over ~250 rows; a gather kernel would do it in one launch). Captured:
                # recorded, not run -- nothing to wait for
                wait_before(tok, s, False)
            enqueue = lambda: backend.copy_strided(impl, dst, src, shape, bstrides, isz)  # noqa: E731
        submit(s, [(tok, False), (otok, True)], enqueue, label="Tensor.copy")
        return out

    def contiguous(self, stream=None) -> "Tensor":
        """This tensor when it is C-contiguous, else :meth:`copy` (as in torch)."""
        self._live_token()
        return self if self._contiguous else self.copy(stream)

    def to_device(self, device, stream=None) -> "Tensor":
        """A C-contiguous copy of this tensor on ``device`` (always a new allocation; see
        :meth:`Buffer.to_device` for streams, ordering and leases). A strided tensor is first
        made contiguous on its own device."""
        tok = self._live_token()
        sdev, dev = tok.allocation.device, as_device(device)
        # (the stream checked first: a refused one leaves nothing enqueued)
        stream = copy_stream(stream, sdev, dev)
        nbytes = self._size * self._dtype.itemsize
        if nbytes == 0:  # (no bytes to copy, whatever bytes its view holds)
            return Tensor.empty(self._shape, self._dtype, dev, on_device(stream, dev))
        if self._contiguous and self._offset == tok.start and self._offset + nbytes == tok.stop:
            out = to_device(self, dev, stream)
        else:  # made contiguous on its own device first: a private temporary, so its copy
            # to another device is ordered after the making whatever the policy
            out = to_device(self.copy(on_device(stream, sdev)), dev, stream, "order")
        return new_tensor(out, self._dtype, self._shape, c_strides(self._shape), 0, self._size, 1)

    # -- data movement ---------------------------------------------------------------
    def to_host(self, stream: Stream | object | None = None) -> np.ndarray:
        """A NumPy copy (C order) taken after all pending writes to these bytes."""
        # The token read once, before the bytes: the one _read_bytes copies (a move re-labels
        # a token, never replaces it; a release before the copy raises ReleasedError there).
        # Once the bytes are read they are the answer, whatever another thread does to this
        # view meanwhile (read self._token again, a release or move then made it None:
        # AttributeError).
        tok = self._live_token()
        raw = self._read_bytes(stream)
        if self._size == 0:
            return np.empty(self._shape, self._dtype)
        isz = self._dtype.itemsize
        view = np.ndarray(self._shape, self._dtype, buffer=raw, offset=self._offset - tok.start,
                          strides=tuple([k * isz for k in self._strides]))
        return np.array(view, order="C")
