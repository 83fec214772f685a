"""Buffer: a typed, contiguous, 1-D view of device memory; DeviceBox: one scalar."""

from __future__ import annotations

import math
from collections import deque
from functools import partial

import numpy as np

from .allocation import Allocation, View
from .device import Device, as_device
from .errors import CaptureError, DeviceMismatchError, LayoutError, ReadOnlyError
from .runtime.future import DeviceFuture
from .runtime.submission import deferring, raise_deferred, settle, submit, wait, wait_before
from .stream import Stream, resolve_stream

__all__ = ["Buffer", "DeviceBox", "as_dtype"]


def as_dtype(dtype) -> np.dtype:
    """``dtype`` as a NumPy dtype that device memory can hold: numeric or bool, native byte
    order. TypeError otherwise (``None`` too: NumPy would read it as float64)."""
    if dtype is None:
        raise TypeError("a dtype is required (None is not one: NumPy would take it for "
                        "float64); pass e.g. 'float32'")
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{dtype!r} is not a dtype NumPy understands") from e
    if (dt.hasobject or (dt.kind in "OUSVMm" and not _is_bfloat16(dt)) or dt.fields is not None
            or dt.subdtype is not None):
        raise TypeError(f"dtype {dt} cannot live in device memory; use a numeric or bool dtype")
    if not dt.isnative:
        raise TypeError(f"dtype {dt.str!r} is not in native byte order: kernels read native "
                        f"values; use {dt.newbyteorder('=').name!r} (from_host converts arrays)")
    return dt


def _is_bfloat16(dt: np.dtype) -> bool:
    """Whether ``dt`` is ml_dtypes' bfloat16 (a NumPy dtype of kind "V"): the dtype a DLPack
    import of a torch or JAX bfloat16 tensor has, so its copies must be able to have it too."""
    return dt.name == "bfloat16" and dt.itemsize == 2 and dt.fields is None


def host_values(src, what: str) -> np.ndarray:
    """``np.asarray(src)`` for ``what``, a call that copies host values into device memory:
    TypeError, naming ``src``, where those are no values device memory holds (None, a string,
    Python objects: NumPy would make nan of None, or parse the string)."""
    a = np.asarray(src)
    try:
        as_dtype(a.dtype.newbyteorder("="))
    except TypeError as e:
        raise TypeError(f"{what} takes numbers (a NumPy array, a sequence of numbers, a number), "
                        f"got {type(src).__name__} {src!r:.60}: {e}") from None
    return a


def native(a: np.ndarray) -> np.ndarray:
    """``a``, converted to native byte order if it is not (a copy only then)."""
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def _scalar(value, dtype):
    """``value`` as a 1-element array of ``dtype``: a number, bool or 0-d array -- never
    None or a string, which NumPy would turn into nan or parse."""
    v = value
    if isinstance(v, (np.generic, np.ndarray)) and np.ndim(v) == 0:  # (as a Python number:
        v = v.item()  # NumPy casts its own values of another dtype C-style; checked below as
        # one: a 0-d array of None or of a string holds no number either)
    if v is None or isinstance(v, (str, bytes)) or np.ndim(v) != 0:
        raise TypeError(f"a DeviceBox holds one number, got {value!r}")
    try:
        with np.errstate(over="ignore"):  # (a finite value cast to an infinity: refused below)
            a = np.array([v], dtype=dtype)
    except (OverflowError, ValueError, TypeError) as e:  # (300 as int8, nan as an int, 1j as
        # a float: NumPy's words)
        raise type(e)(f"a DeviceBox of {dtype} cannot hold {v!r}: {e}") from None
    if a.dtype.kind in "iub" and a.item(0) != v:
        # (NumPy truncates a float toward zero, 1.5 as an int32 is 1, and makes any nonzero
        # number True: the box would silently hold another value than the one given)
        what, fix = (("True, False, 0 or 1", "a bool (bool(v)) or use an integer dtype")
                     if a.dtype.kind == "b" else
                     ("a whole number", "an int (round(v), math.floor(v)) or use a float dtype"))
        raise ValueError(f"a DeviceBox of {dtype} cannot hold {v!r}: it is not {what} and "
                         f"would be stored as {a.item(0)!r}; pass {fix}")
    if (a.dtype.kind in "fc" or _is_bfloat16(a.dtype)) and not np.isfinite(a[0]):
        # (a complex value part by part: a finite part beyond the range beside a NaN or an
        # infinite one is refused too -- the value as a whole is not finite)
        if (_finite(v) if a.dtype.kind != "c" else
                (not np.isfinite(a.real[0]) and _finite(getattr(v, "real", v))) or
                (not np.isfinite(a.imag[0]) and _finite(getattr(v, "imag", 0)))):
            raise OverflowError(f"a DeviceBox of {dtype} cannot hold {v!r}: it is beyond the "
                                f"range of {dtype}")
    return a


def _finite(value) -> bool:
    """Whether the number ``value`` is finite in its own type (each of its parts, complex):
    an int of any size is, and so are a NumPy longdouble and a Decimal beyond a float's range
    (which cmath.isfinite would first convert to a float: inf)."""
    return all(p == p and p != math.inf and p != -math.inf
               for p in (getattr(value, "real", value), getattr(value, "imag", 0)))


#: The most bytes one allocation may ask for (what NumPy and CuPy sizes can express).
_MAX_BYTES = (1 << 63) - 1 - 512


def allocate(device: Device, nbytes: int, stream, kind: str):
    """A live view token of kind ``kind`` over the whole of a new allocation of ``nbytes``
    owned by sharedmem (pool memory), allocated in order on ``stream`` when given (a Stream
    or a foreign stream of ``device``)."""
    impl = resolve_stream(stream, device)._impl if stream is not None else None
    if nbytes > _MAX_BYTES:  # (NumPy would say ValueError, CuPy's size_t OverflowError)
        raise MemoryError(f"cannot allocate {nbytes} bytes on {device}: more than any device "
                          f"memory can hold ({_MAX_BYTES} bytes at most)")
    try:
        block = device.backend.allocate(nbytes, impl)
    except MemoryError:
        # The device may be full of memory that only finished work still leases: it goes
        # back to the pool when that work is retired -- at a sweep every SWEEP_EVERY
        # submissions to its stream, or at the retirer's next pass. Retire it now (never
        # waiting for the device) and try once more.
        settle()
        block = device.backend.allocate(nbytes, impl)
    alloc = Allocation(device, block.ptr, nbytes, owner=block, source="sharedmem")
    return alloc.new_token(kind, 0, nbytes, True, alloc)


def new_buffer(token, dtype, length):
    """A Buffer of ``length`` elements of ``dtype`` over view token ``token`` (which it
    takes over): how every Buffer is made."""
    self = Buffer.__new__(Buffer)
    self._init_view(token, token.start)
    self._dtype = dtype
    self._length = length
    return self


class Buffer(View):
    """A typed, contiguous, 1-D view of device memory.

    Holds one view token on its allocation: while the Buffer lives, its bytes
    stay valid. ``buf[a:b]`` is another view of the same allocation with a
    token of its own. ``Tensor.from_buffer(buf, shape)`` moves it (zero-copy).
    Release with ``buf.release()`` or ``with buf: ...``; work in flight keeps
    the memory anyway, through its leases.
    """

    __slots__ = ("_length",)
    _kind = "buffer"

    def __init__(self, *args, **kwargs):
        raise TypeError("Buffer cannot be constructed directly; use Buffer.empty(n, dtype), "
                        "Buffer.zeros, Buffer.from_host(array) or tensor.into_buffer()")

    # -- construction -------------------------------------------------------
    @classmethod
    def empty(cls, n: int, dtype: np.typing.DTypeLike = "float32",
              device: Device | int | str | None = None,
              stream: Stream | object | None = None) -> Buffer:
        """An uninitialized buffer of ``n`` elements of ``dtype`` on ``device``
        (default: :func:`~sharedmem.default_device`)."""
        dt = as_dtype(dtype)
        n = _length(n)
        return new_buffer(allocate(as_device(device), n * dt.itemsize, stream, "buffer"), dt, n)

    @classmethod
    def zeros(cls, n: int, dtype: np.typing.DTypeLike = "float32",
              device: Device | int | str | None = None,
              stream: Stream | object | None = None) -> Buffer:
        """A buffer of ``n`` zeros, written asynchronously on ``stream``."""
        buf = cls.empty(n, dtype, device, stream)
        buf.fill_zero(stream)
        return buf

    @classmethod
    def from_host(cls, array: np.typing.ArrayLike, device: Device | int | str | None = None,
                  stream: Stream | object | None = None) -> Buffer:
        """A new buffer holding a copy of ``array`` (flattened, C order). The
        copy runs on ``stream``; ``array`` may be reused at once."""
        a = native(host_values(array, "Buffer.from_host"))
        buf = cls.empty(a.size, a.dtype, device, stream)
        buf.copy_from(a, stream)
        return buf

    # -- properties (dtype, itemsize: View's) ------------------------------------
    def __len__(self) -> int:
        """The number of elements (``buf.size``)."""
        self._live_token()
        return self._length

    @property
    def size(self) -> int:
        """Number of elements."""
        return len(self)

    @property
    def shape(self) -> tuple[int]:
        """``(size,)``: a Buffer is 1-D."""
        return (len(self),)

    @property
    def strides(self) -> tuple[int]:
        """``(1,)``: strides in elements, as for a Tensor."""
        self._live_token()
        return (1,)

    @property
    def byte_strides(self) -> tuple[int]:
        """``(itemsize,)``: a Buffer is contiguous."""
        self._live_token()
        return (self._dtype.itemsize,)

    def __repr__(self) -> str:
        # (the token read once: another thread may release or move this view between a check
        # and a second read -- a repr never raises. A moved or released view has no token.)
        tok = self._token
        if tok is None:
            return f"<Buffer ({self._gone()})>"
        ro = " read-only" if not tok.writable else ""
        return (f"<Buffer{ro} {self._dtype} x {self._length} on {tok.allocation.device}, "
                f"bytes [{tok.start}, {tok.stop}) of allocation #{tok.allocation.id}>")

    def _describe_short(self) -> str:
        tok = self._token
        return (f"Buffer({self._dtype} x {self._length}, bytes [{tok.start}, {tok.stop}) of "
                f"allocation #{tok.allocation.id})")

    def __reduce_ex__(self, protocol):
        """Pickle as a host copy (after pending writes); unpickled as a new allocation on the
        receiver's default device (see :mod:`sharedmem.pickling`)."""
        from .pickling import reduce_buffer
        return reduce_buffer(self, protocol)

    def __copy__(self) -> "Buffer":
        """``copy.copy(buf)``: a new buffer of the same values on the same device (as NumPy
        and CuPy copy arrays; a second view of the same bytes is ``buf[:]``)."""
        return self.to_device(self._live_token().allocation.device)

    # -- views ----------------------------------------------------------------
    def __getitem__(self, key) -> "Buffer":
        """``buf[a:b]``: a view of elements ``a..b`` (same allocation, own token)."""
        if not isinstance(key, slice):
            raise TypeError(f"Buffer indexing takes a slice (buf[a:b]), got {type(key).__name__}; "
                            f"use to_host() to read elements")
        tok = self._live_token()
        if key.step is not None and key.step != 1:  # (before indices(): 0 raises there)
            step = key.step
            how = (f"; for a strided view, slice a Tensor of its bytes: sm.Tensor.from_buffer("
                   f"buf, (len(buf),))[::{step}] (from_buffer moves the buffer into the tensor: "
                   f"no other view of its bytes may be live)"
                   if isinstance(step, (int, np.integer)) and not isinstance(step, bool) and
                   step > 1 else "")
            raise LayoutError(f"Buffer slices must be contiguous (step 1), got step {step} "
                              f"(slicing {self!r}){how}")
        start, stop, _ = key.indices(self._length)
        stop = max(stop, start)
        isz = self._dtype.itemsize
        t = tok.allocation.new_token("slice", tok.start + start * isz, tok.start + stop * isz,
                                     tok.writable, tok.keep, source=self)
        return new_buffer(t, self._dtype, stop - start)

    def as_readonly(self) -> "Buffer":
        """A read-only view of the same bytes (it never blocks readers)."""
        return new_buffer(readonly_token(self), self._dtype, self._length)

    # -- data movement ----------------------------------------------------------
    def to_host(self, stream: Stream | object | None = None) -> np.ndarray:
        """A NumPy copy of the contents, taken after all pending writes to
        these bytes (on any stream; always ordered, whatever the policy)."""
        return self._read_bytes(stream).view(self._dtype)

    def copy_from(self, src: View | np.typing.ArrayLike,
                  stream: Stream | object | None = None) -> DeviceFuture[None]:
        """Copy ``src`` (a NumPy array of the same size, or a Buffer of the
        same byte size) into this buffer, asynchronously on ``stream``."""
        tok = self._live_token()
        if not tok.writable:
            raise ReadOnlyError(f"cannot copy into read-only {self!r}; copy into a writable "
                                f"view of the bytes")
        if isinstance(src, View):
            stok = src._live_token()
            if src.dtype != self._dtype:
                raise LayoutError(f"copy_from copies values of one dtype: {src!r} holds "
                                  f"{src.dtype}, {self!r} {self._dtype}; convert on the host "
                                  f"(copy_from(src.to_host().astype(...))) or in a kernel")
            if not isinstance(src, Buffer):  # (its values in order are its view's bytes)
                src._check_dense("copy_from")
            if stok.stop - stok.start != tok.stop - tok.start:
                raise LayoutError(f"copy_from needs the same byte size: {src!r} has "
                                  f"{stok.stop - stok.start}, {self!r} has {tok.stop - tok.start}")
            if stok.allocation is tok.allocation and stok.start < tok.stop and tok.start < stok.stop:
                raise LayoutError(f"copy_from between overlapping bytes of allocation "
                                  f"#{tok.allocation.id} ([{stok.start}, {stok.stop}) into "
                                  f"[{tok.start}, {tok.stop})) is undefined; copy through a "
                                  f"temporary buffer")
            return DeviceFuture(copy_bytes(tok, stok, stream, "copy_from"))
        s = resolve_stream(stream, tok.allocation.device)
        a = host_values(src, "copy_from")
        a = np.ascontiguousarray(a, dtype=self._dtype)
        if a.size != self._length:
            raise LayoutError(f"copy_from needs {self._length} elements, got an array of {a.size}")
        if s._capture is not None and (a is src or a.base is not None):
            # captured: the copy reads its source at each replay -- the values of now, as the
            # host backend's snapshot has them, not whatever the caller's array holds then
            a = a.copy()
        return DeviceFuture(upload(s, tok, a, "copy_from"))

    def fill_zero(self, stream: Stream | object | None = None) -> DeviceFuture[None]:
        """Set every byte to zero, asynchronously on ``stream``."""
        tok = self._live_token()
        if not tok.writable:
            raise ReadOnlyError(f"cannot fill read-only {self!r} with zeros; fill a writable "
                                f"view of the bytes")
        dev = tok.allocation.device
        s = resolve_stream(stream, dev)
        backend, impl = dev.backend, s._impl
        ptr = tok.allocation.ptr + tok.start
        n = tok.stop - tok.start
        sub = submit(s, [(tok, True)], lambda: backend.memset(impl, ptr, 0, n), label="fill_zero")
        return DeviceFuture(sub)

    def to_device(self, device, stream=None) -> "Buffer":
        """A copy of this buffer on ``device`` (always a new allocation). Between two CUDA
        devices a peer copy on ``stream`` (one of either device; None: the destination's
        current stream), ordered after pending writes to these bytes and leased on both
        devices until it is done; no peer access is needed. To or from the host device, the
        bytes go through host memory."""
        return new_buffer(to_device(self, device, stream), self._dtype, self._length)


def readonly_token(view):
    """A read-only view token of ``view``'s bytes (for ``as_readonly``; checked live in the
    same step as it is made)."""
    tok = view._live_token()
    return tok.allocation.new_token("read-only view", tok.start, tok.stop, False, tok.keep,
                                    source=view)


def copy_bytes(dst, src, stream, label, policy=None):
    """Enqueue a copy of view token ``src``'s bytes into ``dst``'s (the same size), leased on
    both sides, and return its Submission. Between two CUDA devices a peer copy
    (``stream``: a stream of either device; None: the destination's current stream), else a
    copy on one device; between kinds :class:`DeviceMismatchError`."""
    sdev, ddev = src.allocation.device, dst.allocation.device
    if sdev is not ddev and (sdev.kind != "cuda" or ddev.kind != "cuda"):
        raise DeviceMismatchError(f"cannot copy between {sdev} and {ddev} on the device; go "
                                  f"through the host (to_host(), then copy_from / from_host)")
    s = copy_stream(stream, sdev, ddev) or resolve_stream(None, ddev)
    impl, backend = s._impl, s.device.backend
    dptr = dst.allocation.ptr + dst.start
    sptr = src.allocation.ptr + src.start
    n = dst.stop - dst.start
    if sdev is ddev:
        enqueue = lambda: backend.copy_dtod(impl, dptr, sptr, n)  # noqa: E731
    else:
        enqueue = lambda: backend.copy_peer(impl, dptr, ddev.backend, sptr,  # noqa: E731
                                            sdev.backend, n)
    return submit(s, [(src, False), (dst, True)], enqueue, policy=policy, label=label)


def upload(s, tok, a, label):
    """Submit the copy of C-contiguous host array ``a`` into the bytes of ``tok`` (leased for
    writing) on stream ``s``; returns the Submission of its last piece. Nothing waits for the
    device under the core lock: the driver copies pageable memory synchronously (behind a busy
    stream on an H200, a copy of 4 MiB or the third of 256 KiB waits for it: RESULTS.md), so
    ``a`` goes through pinned memory (``backend.pinned``), in pieces of ``backend.stage_max``
    bytes, each copied there on the host, then enqueued. A piece that finds no pinned memory
    -- once the pieces of this call in flight are done -- waits, holding no lock, for the work
    it follows and is copied from ``a``. The access policy is applied to the first piece; the
    others are ordered after whatever came meanwhile (a conflict does not stop a copy half
    done; a piece that raises -- the destination released meanwhile -- leaves those before it).
    While ``s`` captures, or where the backend does not stage, one copy from ``a`` itself."""
    backend, impl = s.device.backend, s._impl
    ptr = tok.allocation.ptr + tok.start
    step = 0 if s._capture is not None else backend.stage_max
    flat = a.reshape(-1).view(np.uint8)
    n = flat.nbytes
    if not step or not n:
        return submit(s, [(tok, True)], partial(backend.copy_htod, impl, ptr, a), keep=(a,),
                      label=label)
    subs = deque()  # this call's pieces in flight: their pinned memory counts against the budget
    policy = None
    copy = partial(_uncaptured, s, _capture_began,
                   backend.copy_htod if n <= step else partial(_recorded, backend.copy_htod))
    raise_deferred()  # (before the first piece: none between them)
    with deferring():
        for off in range(0, n, step):
            piece = flat[off:off + step]
            src = backend.pinned(piece.nbytes)
            while src is None and subs:
                wait(subs.popleft())  # (retired: its pinned memory back in the pool)
                src = backend.pinned(piece.nbytes)
            if src is None:
                wait_before(tok, s, True)
                src = piece
            else:
                src[:] = piece
            subs.append(submit(s, [(tok, True)], partial(copy, impl, ptr + off, src),
                               keep=(src,), policy=policy, label=label))
            src = None  # (kept by its submission alone: back in the pool once that retired)
            policy = "order"
    return subs[-1]


def _recorded(copy, impl, dst, src):
    """``copy(impl, dst, src)``, a piece of a copy in pieces, its marker then recorded (under
    the core lock: submit's enqueue). Left open, the marker would be joined by the pieces
    enqueued after it and recorded only when first waited for -- behind them: the wait for
    the oldest piece in flight would be a wait for all of them (no piece copied out while the
    next transfers, the budget's pieces drained at once)."""
    m = copy(impl, dst, src)
    if not m.recorded:
        m.query()  # (records an open marker first)
    return m


def download(s, tok):
    """``tok``'s bytes copied into a new host ``uint8`` array on stream ``s`` after every
    pending write to them (ordered whatever the policy), returned once copied. As
    :func:`upload`, through pinned memory: pieces of ``backend.stage_max`` bytes, each enqueued
    under the core lock, waited for without it and copied out on the host, two in flight (one
    copied out while the next transfers); a copy into the pageable array itself would hold
    the lock for the whole transfer. A piece that finds no pinned memory waits first, holding
    no lock, then is copied into the array directly."""
    if s._capture is not None:
        raise uncapturable_read(s)
    backend, impl = s.device.backend, s._impl
    n = tok.stop - tok.start
    raw = np.empty(n, np.uint8)
    src = tok.allocation.ptr + tok.start
    step = backend.stage_max
    # (each piece checks again where a capture begins, under the core lock: one begun since
    # would record the copy into the graph -- run at replay -- and this read return stale bytes)
    copy = partial(_uncaptured, s, uncapturable_read, backend.copy_dtoh if n <= step or not step
                   else partial(_recorded, backend.copy_dtoh))
    if not step:
        DeviceFuture(submit(s, [(tok, False)], partial(copy, impl, raw, src),
                            keep=(raw,), policy="order", label="to_host")).result()
        return raw
    window = deque()  # (submission, pinned memory or None, offset) of the pieces in flight

    def copy_out():
        sub, pin, off = window.popleft()
        DeviceFuture(sub).result()
        if pin is not None:
            raw[off:off + pin.nbytes] = pin

    raise_deferred()  # (before the first piece: none between them)
    with deferring():
        for off in range(0, n, step):
            c = min(step, n - off)
            pin = backend.pinned(c)
            while pin is None and window:
                copy_out()
                pin = backend.pinned(c)
            if pin is None:
                wait_before(tok, s, False)
                dst, keep = raw[off:off + c], raw
            else:
                dst = keep = pin
            window.append((submit(s, [(tok, False)], partial(copy, impl, dst, src + off),
                                  keep=(keep,), policy="order", label="to_host"), pin, off))
            dst = keep = pin = None
            if len(window) > 1:
                copy_out()
        while window:
            copy_out()
    return raw


def uncapturable_read(s) -> CaptureError:
    """The error of a host read (``to_host``) on ``s`` while it captures."""
    return CaptureError(f"to_host() on {s} cannot be captured: it reads on the host now, while "
                        f"captured work only runs at replay")


def _uncaptured(s, refusal, copy, *args):
    """``copy(*args)``, a piece of a copy in pieces on ``s`` (a host read, an upload), enqueued
    -- ``refusal(s)`` raised where ``s`` began capturing since the copy was asked for: the
    rest would be recorded, to run at replay. Caller holds core_lock (where captures begin)."""
    if s._capture is not None:
        raise refusal(s)
    return copy(*args)


def _capture_began(s) -> CaptureError:
    return CaptureError(f"{s} began capturing a graph (another thread) during a copy onto it: "
                        f"what was enqueued before runs (a copy in pieces: its first pieces), the "
                        f"rest would run only at replay; copy before or inside the capture, not "
                        f"across its start")


def copy_stream(stream, a, b):
    """The Stream a copy between devices ``a`` and ``b`` (maybe one device) is given:
    ``stream`` -- a Stream, or a foreign one, borrowed on whichever of the two it lives on --
    when it is of either device; None stays None. DeviceMismatchError otherwise, before
    anything is done."""
    if stream is None:
        return None
    if a is b:
        return resolve_stream(stream, a)
    s = stream
    if not isinstance(s, Stream):
        for d in (b, a):  # (the destination's first)
            if d.kind == "cuda":
                try:
                    s = Stream._borrow(stream, d)
                    break
                except DeviceMismatchError:
                    pass
    if not isinstance(s, Stream) or (s.device is not a and s.device is not b):
        raise DeviceMismatchError(f"a copy between {a} and {b} runs on a stream of one of "
                                  f"them, not on {s!r}")
    return s


def to_device(view, device, stream, policy=None):
    """A new allocation on ``device`` holding ``view``'s bytes (C order for tensors): the
    work of :meth:`Buffer.to_device` and :meth:`Tensor.to_device`. Returns the new token.
    ``policy``: of the copy between CUDA devices ("order" where ``view`` is private)."""
    tok = view._live_token()
    dev = as_device(device)
    sdev = tok.allocation.device
    stream = copy_stream(stream, sdev, dev)
    if sdev.kind != dev.kind or (sdev is not dev and dev.kind != "cuda"):
        raw = view._read_bytes(on_device(stream, sdev))  # (a dense view: its token's bytes)
        s = resolve_stream(on_device(stream, dev), dev)
        out = allocate(dev, raw.nbytes, s, view._kind)
        copy = partial(upload, s, out, raw, "to_device")
    else:
        out = allocate(dev, tok.stop - tok.start, on_device(stream, dev), view._kind)
        copy = partial(copy_bytes, out, tok, stream, "to_device", policy)
    try:
        copy()
    except BaseException:
        out.release()  # (no view holds it yet: a refused copy leaves no allocation behind)
        raise
    return out


def on_device(stream, device):
    """``stream`` (a Stream from :func:`copy_stream`, or None) when it is one of ``device``,
    else None: the stream of a copy's work on one side."""
    return stream if stream is not None and stream.device is device else None


def _length(n) -> int:
    """A buffer length as given, checked as a tensor's shape is: TypeError for what is not an
    int, LayoutError (a ValueError) for a negative one or one of 2**63 or more (DLPack and
    NumPy sizes are int64s)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"a buffer length must be an int >= 0, got {n!r}")
    if n < 0:
        raise LayoutError(f"a buffer length must be an int >= 0, got {n!r}")
    n = int(n)
    if n >= 1 << 63:
        raise LayoutError(f"a buffer length must be below 2**63, got {n}")
    return n


class DeviceBox:
    """One typed scalar in device memory (a 1-element :class:`Buffer`).

    Pass it to a launch like a buffer (``Out(box)``); read it with ``get()``
    (after pending writes), write it with ``set(value)``. ``buffer`` is that Buffer.
    """

    __slots__ = ("buffer",)

    def __init__(self, value=0, dtype="float64", device=None, stream=None):
        self.buffer = Buffer.from_host(_scalar(value, as_dtype(dtype)), device, stream)

    def get(self, stream=None):
        """The value, as a Python scalar, after all pending writes."""
        return self.buffer.to_host(stream)[0].item()

    def set(self, value, stream=None) -> DeviceFuture:
        """Write ``value`` asynchronously on ``stream``."""
        return self.buffer.copy_from(_scalar(value, self.buffer.dtype), stream)

    @property
    def dtype(self) -> np.dtype:
        """The element type of the boxed scalar."""
        return self.buffer.dtype

    @property
    def ptr(self) -> int:
        """Device address of the boxed scalar."""
        return self.buffer.ptr

    @property
    def device(self):
        """The Device the box is on."""
        return self.buffer.device

    def __reduce_ex__(self, protocol):
        """Pickle as a host copy of the value (see :mod:`sharedmem.pickling`)."""
        from .pickling import reduce_box
        return reduce_box(self, protocol)

    def __copy__(self) -> DeviceBox:
        """``copy.copy(box)``: a new box of the same value on the same device (a copy of its
        buffer, as for a Buffer; pickling would give the same, through the host)."""
        box = DeviceBox.__new__(DeviceBox)
        box.buffer = self.buffer.__copy__()
        return box

    def __deepcopy__(self, memo) -> DeviceBox:
        """``copy.deepcopy(box)``: as ``copy.copy``."""
        return self.__copy__()

    def release(self) -> None:
        """Release the box's buffer now (see View.release)."""
        self.buffer.release()

    def __enter__(self):
        """``with box:`` releases the box as the block ends."""
        self.buffer.__enter__()  # (ReleasedError or MovedError for a box no longer usable, as
        return self              # a view's `with` says)

    def __exit__(self, *exc):
        """:meth:`release`."""
        self.release()

    def __repr__(self) -> str:
        b = self.buffer
        tok = b._token  # (read once, as Buffer.__repr__ does: a repr never raises)
        if tok is None:
            return f"<DeviceBox ({b._gone()})>"
        return f"<DeviceBox {b._dtype} on {tok.allocation.device}>"
