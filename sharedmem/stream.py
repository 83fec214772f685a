"""Streams and events.

A :class:`Stream` runs work in order on one device. It is *owned* (created by
``Device.create_stream``; the underlying stream is destroyed once the Stream
object and all work on it are gone), or *borrowed* (``Stream.from_external``,
the default stream: the caller's object is kept alive and never destroyed).
Dropping a Stream never waits for its work: submissions keep the Stream alive
until the GPU has finished them.
"""

from __future__ import annotations

import contextvars
import itertools
import operator
import sys
import threading
import weakref
from typing import TYPE_CHECKING

from .errors import CaptureError, CompletionUnknownError, DeviceMismatchError, SharedMemError
from .runtime.state import fork_safe, locked

__all__ = ["Stream", "Event"]

if TYPE_CHECKING:
    from typing import Any

    from .device import Device


_uids = itertools.count(1)  # (next() is atomic under the GIL)


class Stream:
    """An in-order queue of work on one device.

    Made by ``device.create_stream(name=None)`` (owned), or borrowed: ``device.default_stream``,
    ``Stream.from_external(obj)``. Attributes: ``device``, ``name`` (a str or None),
    ``owned`` (False for a borrowed stream), ``handle``, ``pending``. ``with stream:`` makes it
    the current stream of its device.

    Fields used by the runtime, guarded by the core lock (``sharedmem.runtime.state``):
    ``_pending`` (FIFO of unretired submissions), ``_seq`` (sequence number of the newest
    submission), ``_done`` (that of the newest retired one: every lease of this stream with a
    sequence number up to it is finished), ``_capture`` (the Graph being captured),
    ``_holds`` and ``_nholds`` (the view tokens open as holds for a consumer's work here),
    ``_waited`` (what this stream is already ordered after: see ``note_waited_locked``).
    Set once: ``_ours`` (owned, or the device's default stream: not borrowed), ``_join`` (on
    those, the impl's ``submit_marker``, bound).
    """

    __slots__ = ("device", "_impl", "owned", "name", "_pending", "_seq", "_done", "_swept",
                 "_uid", "_ours", "_join", "_waited", "_leak_warned",
                 "_external", "_capture", "_joined", "_holds", "_nholds", "_checks",
                 "_lent", "__weakref__")
    if TYPE_CHECKING:  # (typed in stream.pxd for the compiled build)
        device: Device
        owned: bool
        name: str | None

    def __init__(self, *args, **kwargs):
        raise TypeError("Stream cannot be constructed directly; use device.create_stream(), "
                        "device.default_stream or Stream.from_external(obj)")

    @classmethod
    def _create(cls, device, impl, owned: bool, name=None, external=None) -> "Stream":
        self = Stream.__new__(cls)
        self.device = device
        self._impl = impl
        self.owned = owned
        self.name = name or getattr(impl, "name", None)
        # guarded by core_lock. A list: appended at the end, the finished front cut off in one
        # slice deletion by a sweep (compiled, C list operations; no per-entry method call)
        self._pending = []
        self._seq = 0  # guarded by core_lock
        self._done = 0  # guarded by core_lock
        self._swept = 0  # _seq at the last submission.sweep_long; guarded by core_lock
        self._uid = next(_uids)  # never reused (an id() may be, once a Stream is gone)
        # Owned, or the device's default stream (not borrowed): a stream that outlives what
        # sharedmem files on it and that no other library destroys or captures behind its back
        self._ours = owned or external is None
        # (bound once: a hold's end on such a stream joins its open marker through it --
        # submission.joined_marker_locked; a capture swaps the impl only while _capture is set)
        self._join = getattr(impl, "submit_marker", None) if self._ours else None
        # Other streams' _uid -> the newest of their sequence numbers this stream was made to
        # wait for on the device: everything enqueued here since is ordered after that work,
        # so a conflict with it needs no second wait. Guarded by core_lock. Kept only on
        # streams whose work sharedmem alone enqueues in order (owned ones, the default
        # stream); None on borrowed ones, which take no part either way: their owner may
        # capture them behind our back (a marker recorded there then orders nothing).
        self._waited = {} if self._ours else None
        self._leak_warned = False  # guarded by core_lock
        self._external = external  # the borrowed foreign stream object, kept alive
        # Whether this Stream was handed to the user (Stream.from_external, Stream.lookup):
        # they may keep it, not its foreign object, and give foreign work to its CUDA stream
        # (its handle, __cuda_stream__) -- never let go as its owner's (left_by_its_owner)
        self._lent = False
        self._capture = None  # the Graph being captured on this stream; guarded by core_lock
        # On a device's default (legacy) stream, while blocking streams' captures join it:
        # [a marker recorded as the first began, how many]; None otherwise. Guarded by core_lock
        self._joined = None
        # The view tokens open as holds for a consumer's work on this stream: _holds[:_nholds],
        # in no order (a list, None until the first; its entries past _nholds are None: it is
        # not shrunk and grown again on every export). AccessTracker.add_hold_locked and
        # drop_hold_locked keep it, as they keep each allocation's StreamUse.holds. A
        # capture's end files them into its graph, whose replays run what the consumer gave
        # the stream meanwhile. Guarded by core_lock
        self._holds = None
        self._nholds = 0
        # Whether submit() must ask the stream's impl for a fault or a full queue (host streams
        # do; a CUDA stream has neither: sticky errors surface in queries)
        self._checks = getattr(impl, "fault", None) is not None or \
            getattr(impl, "throttle", None) is not None or device.kind != "cuda"
        if owned and device.kind == "cuda":
            with _by_handle_lock:  # so that from_external(handle) finds this very Stream
                _keep_locked((device.key, impl.handle), self)
        return self

    @classmethod
    def from_external(cls, obj: object, device: Device | int | None = None) -> Stream:
        """Borrow a foreign stream: a CuPy, torch or cuda.core stream, any
        object with ``__cuda_stream__``, or a raw ``CUstream`` handle (an int, a NumPy
        integer too).
        The object is kept alive by the returned Stream and never destroyed.
        The same CUDA stream always gives the same Stream while one is alive
        (handles 0, 1 and 2 -- the legacy and the per-thread default streams -- give the
        device's default stream)."""
        return lent(cls._borrow(obj, device))

    @classmethod
    def _borrow(cls, obj, device=None):
        """:meth:`from_external` for sharedmem's own use: the Stream is not handed to the
        user (not marked lent; see ``left_by_its_owner``)."""
        if isinstance(obj, Stream):
            if device is not None:
                from .device import as_device
                if obj.device is not as_device(device):
                    raise DeviceMismatchError(f"{obj} is a stream of {obj.device}, not of "
                                              f"{as_device(device)}")
            return obj
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.integer):  # (a raw handle NumPy holds: an int)
            obj = int(obj)
        if device is None:  # the object borrowed last (a launch loop's stream=): no new borrow
            st = _borrowed_last(obj)
            if st is not None:
                return st
        from .device import Device, as_device
        memo = device is None  # (remembered for the next call only when it names no device)
        named = _device_named_by(obj)
        if device is None and named is not None:
            device = named
        dev = as_device(device)
        if dev.kind != "cuda":
            handle_reader(obj)  # (not a stream at all: a TypeError, whatever the device)
            raise DeviceMismatchError(
                f"Stream.from_external({obj!r}) needs a CUDA device; {dev} has no foreign streams "
                f"(pass a Stream of it -- dev.create_stream(), dev.default_stream -- or "
                f"stream=None)")
        if named is not None and named != dev.ordinal:
            raise DeviceMismatchError(f"{obj!r} is a stream of CUDA device {named}, not of {dev}; "
                                      f"use a stream of {dev}")
        impl = dev.backend.borrow_stream(obj)
        if impl.handle in (0, 1, 2):
            # 0: the legacy default stream; 1: CU_STREAM_LEGACY. 2, CU_STREAM_PER_THREAD (CuPy's
            # Stream.ptds), names a different stream in each thread that enqueues on it, and
            # the events of this Stream are recorded by whichever thread comes next (its
            # batched markers, the retirer): one Stream for it would order nothing. The legacy
            # stream stands in, as for a DLPack consumer on stream 2: work there is ordered
            # with every blocking stream, every thread's per-thread default stream included.
            return dev.default_stream
        # One Stream per CUDA stream: leases compare streams by identity, so two
        # wrappers of one stream would look like two streams to each other. A stream
        # sharedmem made is found too.
        key = (dev.key, impl.handle)
        st = _stream_at(key)
        stale = None
        if st is not None and st._external is not obj and not _names_its_stream(st):
            stale, st = st, None  # its object's stream was destroyed, the handle reused
        infer = device is None  # (neither the caller nor the object named it: the handle's)
        if st is None and infer:
            # a raw handle borrowed before on the device it lives on (handles are unique in
            # the process): found there, without asking the driver again
            with _by_handle_lock:
                found = [r() for (k, h), r in _by_handle.items() if h == impl.handle]
            for s in found:
                if s is not None and _names_its_stream(s):
                    _last_borrowed[0] = weakref.ref(s)
                    return s
        if st is None:
            home = dev.backend.stream_home(impl)  # (a raw handle does not say its device)
            if home is not None:
                ordinal, ctx = home
                if ordinal != dev.ordinal and infer:  # borrowed on the device it lives on
                    dev = Device(ordinal)
                    impl = dev.backend.borrow_stream(obj)
                    key, stale = (dev.key, impl.handle), None
                if ordinal != dev.ordinal or ctx != dev.backend.context_handle:
                    where = (f"CUDA device {ordinal}" if ordinal != dev.ordinal else
                             f"a CUDA context of {dev} other than its primary one")
                    raise DeviceMismatchError(
                        f"{obj!r} is a stream of {where}, not of {dev}'s primary context (the "
                        f"one sharedmem, CuPy and torch launch in); use a stream of {dev}")
            with _by_handle_lock:
                st = _stream_at(key)
                if st is None or st is stale:
                    st = cls._create(dev, impl, owned=False, external=obj)
                    _keep_locked(key, st)
        if memo and st._external is obj:
            _last_borrowed[0] = weakref.ref(st)
        return st

    @staticmethod
    def lookup(device: Device, handle: int) -> Stream | None:
        """The live Stream (made by sharedmem, or borrowed) of CUDA stream ``handle`` on
        ``device``, or None."""
        return lent(Stream._find(device, handle))

    @staticmethod
    def _find(device, handle):
        """:meth:`lookup` for sharedmem's own use (the Stream not marked lent)."""
        st = _stream_at((device.key, handle))
        return st if st is not None and _names_its_stream(st) else None

    def __enter__(self) -> Stream:
        """``with stream:`` makes this the current stream of its device in this thread (in
        this asyncio task, where one runs: the streams entered live in a context variable):
        ``launch``, ``op.submit``, allocations and copies given ``stream=None`` use it (as
        ``with cupy_stream:`` and ``with torch.cuda.stream(s):`` do for those libraries)."""
        global _entered
        _entered = True
        _entered_streams.set(_entered_streams.get() + (self,))
        return self

    def __exit__(self, *exc: object) -> None:
        """Ends the innermost ``with stream:`` of this stream (SharedMemError in another
        thread or task than it began in)."""
        stack = _entered_streams.get()
        for i in range(len(stack) - 1, -1, -1):  # the innermost entry of this stream
            if stack[i] is self:
                _entered_streams.set(stack[:i] + stack[i + 1:])
                return
        raise SharedMemError(f"{self} was not entered in this thread or task: a `with stream:` "
                             f"block begins and ends in the same one")

    def __copy__(self) -> Stream:
        return self  # (one Stream per stream: leases compare streams by identity)

    def __deepcopy__(self, memo) -> Stream:
        return self

    def __repr__(self) -> str:
        kind = "owned" if self.owned else "borrowed"
        return f"<Stream {self.name or hex(self.handle)} on {self.device} ({kind})>"

    @property
    def handle(self) -> int:
        """The raw stream handle (``CUstream`` as an int; an id on the host)."""
        return self._impl.handle

    def __cuda_stream__(self) -> tuple[int, int]:
        """``(0, handle)``: the CUDA stream protocol, for CuPy, torch and cuda.core (CUDA
        streams only: on a host stream an AttributeError)."""
        if self.device.kind != "cuda":
            raise AttributeError("host streams have no __cuda_stream__")
        return (0, self._impl.handle)

    def synchronize(self) -> None:
        """Block until all work on this stream has finished -- on a borrowed stream, its
        owner's too -- then retire it. (``sm.synchronize()`` and ``device.synchronize()``
        wait for sharedmem's work only: a borrowed stream's owner may be capturing it.)"""
        from .runtime.submission import deferring, raise_deferred, synchronize_stream
        self._refuse_foreign_capture("its work has not run and cannot be waited for (the "
                                     "driver refuses it, invalidating the capture); "
                                     "synchronize after that capture ends")
        with deferring():  # (deferred errors once it was all waited for: model.md)
            synchronize_stream(self, True)
            if not self._ours:
                self._impl.synchronize()
        raise_deferred()

    def record(self) -> Event:
        """An :class:`Event` marking the work submitted so far on this stream (CaptureError
        while it captures a graph -- sharedmem's, or on a borrowed stream another library's:
        that work has not run)."""
        self._refuse_foreign_capture("an event recorded on it now would mark nothing that "
                                     "runs now; record it after that capture ends")
        with locked():  # (where captures begin: one begun since the check would take the record)
            if self._capture is not None:
                raise CaptureError(f"{self} is capturing a graph: its work has not run, so an "
                                   f"event recorded now would mark nothing; record it after the "
                                   f"capture ends")
            return Event(self, self.device.backend.record_marker(self._impl))

    def wait(self, event_or_stream: Event | Stream) -> None:
        """Make later work on this stream wait (on the device, without blocking
        the host) for an :class:`Event` or for all current work of a stream (CaptureError
        where either captures a graph, sharedmem's or another library's;
        CompletionUnknownError, nothing waited for, where that work is known to be of
        unknown completion)."""
        ev = event_or_stream
        if not isinstance(ev, (Event, Stream, int)) and _names_a_stream(ev):  # (CuPy's, torch's:
            named = _device_named_by(ev)  # on the device it names, else on this stream's)
            ev = Stream._borrow(ev, self.device if named is None else None)
        if not isinstance(ev, (Event, Stream)):
            raise TypeError(f"Stream.wait takes an Event or a stream (a sharedmem Stream, or a "
                            f"foreign one: Stream.from_external), got {type(ev).__name__}")
        if self._capture is not None:
            raise self._uncapturable_wait()
        other = ev.device if isinstance(ev, Stream) else ev.stream.device
        if other is not self.device and (other.kind != "cuda" or self.device.kind != "cuda"):
            raise DeviceMismatchError(f"cannot make {self} wait for an event on {other} "
                                      f"(only CUDA devices wait on each other's events)")
        self._refuse_foreign_capture("a wait enqueued on it for work outside that capture is "
                                     "refused by the driver, which invalidates the capture; "
                                     "make the wait before the capture begins or after it ends")
        if isinstance(ev, Stream):  # (recorded once the wait is known to be made: a refused
            ev = ev.record()        # one leaves no marker on the other stream)
        if ev._marker.query() == 2:  # (known unknown: the stream would never be trusted again)
            raise ev._unknown()
        with locked():  # (where captures begin: the wait is made before one, or refused)
            if self._capture is not None:  # (again: one may have begun since)
                raise self._uncapturable_wait()
            self._impl.wait_marker(ev._marker)

    def _refuse_foreign_capture(self, why: str) -> None:
        """CaptureError where this borrowed stream is capturing a CUDA graph that another
        library began (torch.cuda.graph, cupy.cuda.Stream.begin_capture): ``why`` says what a
        record or wait there would do. Asked before anything is enqueued (one driver query);
        sharedmem's own captures are refused by name, and streams sharedmem owns (or the
        default stream, whose legacy joins the backend refuses) are captured by no other."""
        if self._ours or self._capture is not None:
            return
        e = self.device.backend.foreign_capture_error(self._impl.handle)
        if e is not None:
            raise CaptureError(f"{self} is capturing a CUDA graph that sharedmem did not start "
                               f"(torch.cuda.graph, cupy.cuda.Stream.begin_capture): {why}")

    def _uncapturable_wait(self) -> CaptureError:
        return CaptureError(f"{self} is capturing a graph: it cannot wait for work outside the "
                            f"capture; make the wait before the capture begins")

    @property
    def pending(self) -> int:
        """Number of this stream's launches and copies not yet retired."""
        with locked():
            return len(self._pending)


class Event:
    """A point in a stream's work. ``query()`` says whether it was reached,
    ``synchronize()`` blocks until it is."""

    __slots__ = ("stream", "_marker")

    def __init__(self, stream: Stream, marker: Any) -> None:
        self.stream = stream
        self._marker = marker

    def __copy__(self) -> Event:
        return self  # (a point in a stream's work: the same point)

    def __deepcopy__(self, memo) -> Event:
        return self

    def __repr__(self) -> str:
        try:
            state = ("pending", "reached", "completion unknown")[self._marker.query()]
        except Exception as e:  # (a repr never raises)
            state = f"unknown ({type(e).__name__})"
        return f"<Event on {self.stream}: {state}>"

    def query(self) -> bool:
        """True once the work recorded before this event has finished (never blocks);
        CompletionUnknownError where that cannot be known (a kernel before it faulted)."""
        state = self._marker.query()
        if state == 2:
            raise self._unknown()
        return state == 1

    def synchronize(self, timeout: float | None = None) -> bool:
        """Block until that work finished; False if ``timeout`` passed first;
        CompletionUnknownError as for :meth:`query`."""
        from .runtime.future import check_timeout
        if not self._marker.wait(check_timeout(timeout)):
            return False
        if self._marker.query() == 2:
            raise self._unknown()
        return True

    def _unknown(self) -> CompletionUnknownError:
        return CompletionUnknownError(f"completion of work before this event on {self.stream} "
                                      f"is unknown: {self._marker.error!r}")


# (device key, handle) -> a weak reference to the Stream of that CUDA stream, made or borrowed
# (a Stream lives only while used). Written under _by_handle_lock (a check and a store: one
# Stream per stream); read without it (one dict lookup, atomic). A dead reference reads as
# none; dead ones are dropped as the dict grows (_keep_locked): it stays within 64 entries or
# twice those live at the last drop (Streams that die since stay until the next one) -- no
# weakref callback, which would need the lock from wherever the collector runs, the thread
# holding it included.
_by_handle: dict = {}
_prune_at = [64]


def _stream_at(key):
    """The live Stream stored at ``key`` in ``_by_handle``, or None."""
    r = _by_handle.get(key)
    return r() if r is not None else None


def _keep_locked(key, st) -> None:
    """Store Stream ``st`` at ``key`` (caller holds _by_handle_lock)."""
    if len(_by_handle) >= _prune_at[0]:
        for k in [k for k, r in _by_handle.items() if r() is None]:
            del _by_handle[k]
        _prune_at[0] = max(64, 2 * len(_by_handle))
    _by_handle[key] = weakref.ref(st)

# The Stream that Stream.from_external(obj) returned last for a foreign stream object (a
# CuPy or torch stream passed as stream= in a launch loop): found again without borrowing the
# object anew, while the object still names that Stream's handle. A weak
# reference: nothing is kept alive by it. Replaced whole: lock-free.
_last_borrowed = [None]

_by_handle_lock = fork_safe(threading.Lock())


# The streams entered with `with stream:` in this thread or asyncio task, innermost last (a
# tuple: a task's context copy never shares it with another)
_entered_streams: "contextvars.ContextVar[tuple]" = contextvars.ContextVar(
    "sharedmem_entered_streams", default=())
_entered = False  # True once any thread entered a stream (until then no lookup is needed)


def handle_reader(obj):
    """How foreign stream object ``obj`` names its CUstream handle -- a function of the object
    that reads it -- or TypeError for an object that is not a stream. Found once per borrow: a
    launch given the same object again reads only that (see CudaStreamImpl.named_by)."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        return int
    if hasattr(obj, "__cuda_stream__"):
        return _protocol_handle
    if _is_array(obj):  # (a view has a ``ptr``, as a CuPy stream does: its address, no handle)
        raise TypeError(f"cannot use {obj!r} as a stream: it is an array, not a stream; give a "
                        f"sharedmem.Stream, a CuPy, torch or cuda.core stream, an object with "
                        f"__cuda_stream__, or an int (pass the array as a launch argument)")
    if hasattr(obj, "cuda_stream"):  # torch.cuda.Stream
        return _torch_handle
    if hasattr(obj, "ptr"):  # cupy.cuda.Stream
        return _ptr_handle
    if hasattr(obj, "getPtr"):  # cuda.bindings CUstream
        return int
    raise TypeError(f"cannot use {obj!r} as a stream: give a sharedmem.Stream, a CuPy, torch or "
                    f"cuda.core stream, an object with __cuda_stream__, or an int")


def _is_array(obj) -> bool:
    """Whether ``obj`` is memory rather than a stream: an array (DLPack or CUDA Array
    Interface: a sharedmem view, a CuPy or NumPy array) or a sharedmem DeviceBox."""
    t = type(obj)
    if hasattr(t, "__dlpack__") or hasattr(t, "__cuda_array_interface__"):
        return True
    buffers = sys.modules.get("sharedmem.buffer")  # (no box exists before it is imported)
    return buffers is not None and isinstance(obj, buffers.DeviceBox)


def _names_a_stream(obj) -> bool:
    """Whether ``obj`` is a foreign stream object (see :func:`handle_reader`)."""
    try:
        handle_reader(obj)
    except TypeError:
        return False
    return True


def borrowed_handle(obj) -> tuple:
    """``(read, handle)`` of foreign stream ``obj`` as it is first borrowed: how it names its
    CUstream (:func:`handle_reader`) and the handle, checked to be one (0 to 2**64 - 1;
    ValueError naming the object otherwise)."""
    read = handle_reader(obj)
    handle = read(obj)
    if not 0 <= handle < 1 << 64:
        raise ValueError(f"{obj!r} names stream handle {handle}, which is no CUstream (0 to "
                         f"2**64 - 1)")
    return read, handle


def _protocol_handle(obj) -> int:
    v = obj.__cuda_stream__()  # (the protocol: a version, 0, and the handle)
    if type(v) is not tuple or len(v) != 2 or v[0] != 0 or type(v[1]) is bool:
        raise TypeError(f"{type(obj).__name__}.__cuda_stream__() returned {v!r}; the protocol "
                        f"is (0, handle): version 0 and the CUstream as an int")
    return operator.index(v[1])  # (not a float: truncated, it would name another stream)


def _torch_handle(obj) -> int:
    return int(obj.cuda_stream)


def _ptr_handle(obj) -> int:
    return int(obj.ptr)


def _device_named_by(obj):
    """The CUDA device a foreign stream object says it belongs to (CuPy's ``device_id``,
    torch's ``device.index``, cuda.core's ``device.device_id``), or None where it says none
    (a raw handle, CuPy's null stream: the current device's)."""
    if isinstance(obj, int):
        return None
    try:
        d = getattr(obj, "device_id", None)
        if type(d) is not int:
            dev = getattr(obj, "device", None)
            d = getattr(dev, "index", None)
            if type(d) is not int:
                d = getattr(dev, "device_id", None)
    except Exception:  # (a closed or odd stream object: nothing learned)
        return None
    return d if type(d) is int and d >= 0 else None


def _names_its_stream(st) -> bool:
    """Whether Stream ``st``, found by its handle, still is that CUDA stream: one sharedmem
    made (or the default stream), or a borrowed one whose object still names the handle. The
    object's owner may have destroyed its stream (cuda.core's ``Stream.close()``; a raw
    handle cannot tell), and the driver may have given the handle to another stream since.
    Foreign code runs here: never call it under ``_by_handle_lock``."""
    ext = st._external
    if ext is None:
        return True
    try:
        return st._impl.named_by(ext)
    except Exception:  # (a closed stream object may raise when asked its handle)
        return False


def lent(st):
    """``st`` (a Stream or None), marked as handed to the user where it is borrowed (see
    ``Stream._lent``): what the public calls that give a Stream out return."""
    if st is not None and st._external is not None:
        st._lent = True
    return st


def left_by_its_owner(st) -> bool:
    """Whether borrowed Stream ``st`` wraps a foreign stream object that destroys its CUDA
    stream when collected -- a ``cupy.cuda.Stream`` CuPy made, not an ``ExternalStream`` nor
    one of torch's pooled streams -- and that nothing but ``st`` keeps any more. No foreign
    work can then be given to that stream again (only sharedmem's own, which it leases), and
    CuPy destroys the stream once ``st`` lets the object go: a hold's consumer entry for it
    can end now (``runtime.submission.end_left_consumers_locked``) instead of keeping the
    stream alive for as long as the view lives. Never a Stream handed to the user
    (``_lent``: from_external, lookup): they may keep it, not the object, and give foreign
    work to its stream through its handle or ``__cuda_stream__``. Caller holds core_lock (no
    foreign code runs)."""
    ext = st._external
    if ext is None or st._lent:  # (the user may keep the Stream: its handle names the stream)
        return False
    cp = sys.modules.get("cupy")
    owning = getattr(getattr(cp, "cuda", None), "Stream", None)
    if owning is None or not isinstance(ext, owning) or \
            getattr(ext, "_foreign_stream_ref", None) is not None:  # (CuPy's from_external)
        return False
    ext = None
    return _refs_of_external(st) <= _LEFT_REFS


def _refs_of_external(holder) -> int:
    """``sys.getrefcount`` of ``holder._external``, read here (the same temporaries in the
    call as the calibration's, in either build)."""
    return sys.getrefcount(holder._external)


class _Probe:
    __slots__ = ("_external",)


def _left_refs() -> int:
    """What :func:`_refs_of_external` answers for a borrowed stream object that only its
    Stream keeps: two stored references (``Stream._external`` and its impl's ``external``),
    measured on a probe that keeps an object in two places as well (the probe's slot and a
    local): the call's own temporaries differ between builds and Python versions."""
    probe = _Probe()
    obj = object()
    probe._external = obj
    return _refs_of_external(probe)


_LEFT_REFS = _left_refs()  # (measured once, at import)


def _borrowed_last(obj):
    """The Stream :meth:`Stream.from_external` borrowed last, if it was from ``obj`` and
    ``obj`` still names its stream; else None."""
    ref = _last_borrowed[0]
    if ref is not None:
        st = ref()
        if st is not None and st._external is obj and st._impl.named_by(obj):
            return st
    return None


def as_stream(obj) -> Stream:
    """``obj`` as a :class:`Stream`: itself, or the foreign stream it is, borrowed (see
    :meth:`Stream.from_external`). A launch loop given the same foreign stream object each
    time finds its Stream in a few field reads."""
    if type(obj) is Stream:
        return obj
    st = _borrowed_last(obj)
    return st if st is not None else Stream._borrow(obj)


def names_a_default_stream(obj) -> bool:
    """Whether foreign stream ``obj`` (not a :class:`Stream`) is a default stream that names no
    device: a raw handle 0 (the legacy default stream), 1 (``CU_STREAM_LEGACY``) or 2
    (``CU_STREAM_PER_THREAD``) -- an int, a NumPy integer -- or an object naming one of those
    handles and no device (CuPy's null stream). Every CUDA device has that stream: a call
    given memory borrows it on the memory's device (``Stream._borrow(obj, device)``), not on
    the default device."""
    if isinstance(obj, Stream) or isinstance(obj, bool):
        return False
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.integer):
        obj = int(obj)
    if isinstance(obj, int):
        return 0 <= obj <= 2
    try:
        return handle_reader(obj)(obj) in (0, 1, 2) and _device_named_by(obj) is None
    except Exception:  # (not a stream, or one that cannot say: borrowed as before, which says)
        return False


def as_stream_or_default(obj):
    """:func:`as_stream` for a call that picks its device from its memory (a launch, an
    ``op.submit``, an import): None where ``obj`` names a default stream and no device (see
    :func:`names_a_default_stream`) -- the caller borrows it on that device."""
    if type(obj) is Stream:
        return obj
    st = _borrowed_last(obj)
    if st is not None:
        return st
    if names_a_default_stream(obj):
        return None
    return Stream._borrow(obj)


def streams_entered() -> bool:
    """Whether any thread ever entered a stream with ``with stream:`` (lock-free read)."""
    return _entered


def current_stream(device=None):
    """The innermost stream entered with ``with stream:`` in this thread on ``device`` (on any
    device when None), or None."""
    for s in reversed(_entered_streams.get()):
        if device is None or s.device is device:
            return s
    return None


def resolve_stream(stream, device) -> Stream:
    """``stream`` as a :class:`Stream` on ``device``: None means the current stream of that
    device (``with stream:``), else its default stream; foreign streams are borrowed."""
    if stream is None:
        cur = current_stream(device)
        return cur if cur is not None else device.default_stream
    if not isinstance(stream, Stream):
        stream = Stream._borrow(stream, device)
    if stream.device is not device:
        raise DeviceMismatchError(f"{stream} is on {stream.device}, but the memory is on {device}")
    return stream
