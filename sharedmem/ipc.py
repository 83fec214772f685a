"""CUDA IPC: sharedmem memory shared with other processes of the host, ownership kept.

``ex = sm.ipc.export(view)`` shares a view's bytes; ``ex.handle`` (an :class:`IpcHandle`,
picklable: send it through ``multiprocessing``, a pipe or a socket) is opened once, in
another process, by ``sm.ipc.open(handle)``, which returns a Buffer or Tensor of the same
bytes (zero-copy) on the importer's device. What holds:

* **Ordered on arrival.** The export records an interprocess event after every write to the
  bytes pending then (on any stream; for a writable view, whose importer may write, every
  read too); the importer's stream waits for it on the device
  before its first use. Never a host synchronize.
* **Never freed under the importer.** Until the importer is done, the exporter holds a view
  of the bytes (``CUDA IPC export`` in AliasError messages): its memory is neither freed nor
  moved, whatever the exporter drops.
* **Released in stream order.** The importer is done when its last view *and* the last of
  its launches that used them have finished -- its retirement sees that with event queries,
  as for any memory, and only then writes "released" into a slot of a small shared-memory
  file the exporter polls (every ``POLL`` seconds, on a thread of its own). No host
  synchronize on either side.
* **A dead importer does not pin memory forever.** With the slot the importer writes its pid
  and start time; once that process is gone (or a zombie) for ``GRACE`` seconds, the exporter
  releases its hold. Bound: ``POLL + GRACE`` (0.52 s) after the kernel has torn the importer
  down (``kill -9`` included); tested.

Not guaranteed: ordering between the exporter's *later* work and the importer's (they share
the bytes: order them with events or a protocol of your own); an exporter that exits while an
importer still uses the memory (CUDA unmaps it: keep the exporter alive, as torch requires).
A handle opens once. The importer maps the whole driver allocation holding the bytes (CuPy's
pool puts several blocks in one): treat the processes as one trust domain.

Why legacy CUDA IPC over CuPy's pool blocks, not a cuda.core IPC pool or VMM with POSIX fds:
the memory users export is the memory sharedmem already has (CuPy's pool) -- exporting it
costs no copy and no second allocator; the handle is 64 bytes that pickle anywhere (no fd
passing over a Unix socket); it works on every driver CUDA 12 supports. The price: legacy IPC
maps whole allocations and needs the exporter alive; both are documented above.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import itertools
import io
import mmap
import operator
import os
import struct
import tempfile
import threading
import time
import weakref

import numpy as np

from .allocation import View
from .errors import BackendUnavailableError, CaptureError, CompletionUnknownError, SharedMemError
from .runtime.state import OwnedLock, at_fork_child, fork_safe, locked, log
from .runtime.submission import fresh_marker_locked, raise_deferred, record_arrival

__all__ = ["IpcExport", "IpcHandle", "export", "open", "exports", "POLL", "GRACE"]

#: Seconds between the exporter's looks at its slots.
POLL = 0.02
#: Seconds an importer must have been gone before its memory is released (the driver tears a
#: dead process's context down as its files close; this covers the rest).
GRACE = 0.5

# One slot per export, in files of SLOTS slots: state, generation, importer pid, importer
# start time (a reused pid is not the same process).
_SLOT = struct.Struct("<IIIIQ")
SLOTS = 128
FREE, EXPORTED, OPEN, RELEASED = 0, 1, 2, 3


class IpcHandle:
    """What an importer needs to open an export (picklable; holds no resource). Attributes:
    ``kind`` ("buffer" or "tensor"), ``dtype``, ``shape``, ``strides`` (elements),
    ``nbytes``, ``device_uuid``, ``exporter_pid``."""

    __slots__ = ("kind", "dtype", "shape", "strides", "nbytes", "first", "writable",
                 "device_uuid", "mem", "region", "offset", "event", "slots", "slot",
                 "generation", "exporter_pid")

    def __reduce__(self):
        return (_rebuild_handle, (tuple(getattr(self, k) for k in IpcHandle.__slots__),))

    def __repr__(self) -> str:  # (never raises: it names handles refused as corrupt)
        get = functools.partial(getattr, self)
        return (f"<IpcHandle {get('kind', '?')} {get('dtype', '?')} shape={get('shape', '?')} "
                f"from pid {get('exporter_pid', '?')}, {get('nbytes', '?')} bytes>")


def _new(cls, **fields):
    """A ``cls`` (a class of this module with slots) made without ``__init__``, ``fields`` set."""
    obj = cls.__new__(cls)
    for k, v in fields.items():
        setattr(obj, k, v)
    return obj


def _rebuild_handle(values):
    n = len(values) if isinstance(values, tuple) else "?"
    if n != len(IpcHandle.__slots__):  # (fields pickled by position: another layout misreads)
        raise SharedMemError(
            f"cannot unpickle a CUDA IPC handle of {n} fields (this sharedmem's have "
            f"{len(IpcHandle.__slots__)}): it was made by another version of sharedmem; run "
            f"the same version in the exporter and the importer")
    return _new(IpcHandle, **dict(zip(IpcHandle.__slots__, values)))


class IpcExport:
    """The exporter's side of one export: ``handle`` to send, ``state`` ("exported", "open",
    "released", "importer died", "revoked"), :meth:`revoke` and :meth:`wait_released`."""

    __slots__ = ("handle", "_token", "_slot", "_event", "_state", "_dead_since", "_done",
                 "__weakref__")

    def __repr__(self) -> str:
        return f"<IpcExport {self._state}: {self.handle!r}>"

    @property
    def state(self) -> str:
        return self._state

    def __reduce__(self):
        raise TypeError(f"cannot pickle {self!r}: an export stays with its exporter; send its "
                        f"handle (ex.handle), which sm.ipc.open opens in the other process")

    def _check_owner(self, what) -> None:
        if self.handle.exporter_pid != os.getpid():
            raise SharedMemError(
                f"{what} of {self!r} in process {os.getpid()}: the export belongs to process "
                f"{self.handle.exporter_pid}, which made it (a forked child shares none of its "
                f"parent's exports); call it there")

    def revoke(self) -> bool:
        """End an export nobody opened yet (its memory is released now); False when an
        importer already opened it (then it ends when the importer is done). SharedMemError
        in another process than the exporter (a forked child)."""
        self._check_owner("revoke()")
        with _lock:
            if self._done.is_set():  # (ended: revoked before, or opened and released)
                return self._state == "revoked"
            slot = self._slot
            with _SlotLock(slot[4], slot[1]):
                if _SLOT.unpack_from(slot[0], slot[1])[0] != EXPORTED:
                    return False
                _finish_locked(self, "revoked")
        return True

    def wait_released(self, timeout: float | None = None) -> bool:
        """Block until the export ended (importer done or gone, or revoked); False on timeout.
        SharedMemError in another process than the exporter (nothing there would end it)."""
        self._check_owner("wait_released()")
        return self._done.wait(timeout)


# -- slots ---------------------------------------------------------------------------------
# guards _files, _free, _exports, _thread. An OwnedLock: its sections allocate (a collection
# there may run a finalizer that calls revoke() or export() on this thread -- a user's wrapper
# that ends its export when dropped): that call raises SharedMemError instead of deadlocking
# this thread and, with it, the poller and every later export
_lock = fork_safe(OwnedLock("an IPC export's bookkeeping"))
_files: list = []  # (path, mmap, fd) of this process's slot files
_free: list = []  # (file index, slot index) not in use
_generation = itertools.count(1)
_exports: list = []  # live IpcExport objects (the poller's work)
_thread = None
_opened: dict = {}  # path -> _SlotFile, the importer's view of exporters' slot files
_opened_lock = fork_safe(OwnedLock("the opening of a CUDA IPC handle"))  # (as _lock)


def _dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _remove_dead_files(directory) -> None:
    """Unlink the slot files of exporters that are gone (killed: their exit never ran)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if name.startswith("sharedmem-ipc-") and len(parts) > 3 and parts[2].isdigit() and \
                not _alive(int(parts[2]), 0):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))


def _take_slot_locked():
    if not _free:
        if not _files:  # (a process's first export: what killed exporters left behind goes)
            _remove_dead_files(_dir())
        fd, path = tempfile.mkstemp(prefix=f"sharedmem-ipc-{os.getpid()}-", dir=_dir())
        try:
            mm = _map(fd, new=True)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        _files.append((path, mm, fd))  # (the fd stays open: its record locks are the slots')
        _free.extend((len(_files) - 1, i) for i in range(SLOTS - 1, -1, -1))
    f, i = _free.pop()
    path, mm, fd = _files[f]
    return (mm, i * _SLOT.size, f, i, fd), path, i, next(_generation) & 0xFFFFFFFF


def _map(fd, new=False) -> mmap.mmap:
    """The SLOTS slots of the file open as ``fd`` (``new``: the exporter's, written first),
    mapped; ``fd`` is closed when that fails. A new file is written, not truncated to its
    size: a sparse file's first store through the mapping, on a full /dev/shm, kills the
    process with SIGBUS -- a write raises OSError (ENOSPC) instead."""
    try:
        if new:
            data = bytes(SLOTS * _SLOT.size)
            while data:
                data = data[os.write(fd, data):]
        return mmap.mmap(fd, SLOTS * _SLOT.size)
    except BaseException:
        os.close(fd)
        raise


class _SlotLock:
    """A slot's state changes under a record lock of its bytes (``fcntl.lockf``): the
    exporter's and the importer's transitions exclude each other across processes, and a
    process that dies holding it releases it. (Within one process, threads are kept apart by
    the module's locks.)"""

    __slots__ = ("fd", "off")

    def __init__(self, fd, off):
        self.fd, self.off = fd, off

    def __enter__(self):
        fcntl.lockf(self.fd, fcntl.LOCK_EX, _SLOT.size, self.off, os.SEEK_SET)

    def __exit__(self, *exc):
        fcntl.lockf(self.fd, fcntl.LOCK_UN, _SLOT.size, self.off, os.SEEK_SET)


def _cleanup_files() -> None:
    for path, _, _ in _files:
        with contextlib.suppress(OSError):
            os.unlink(path)


import atexit  # noqa: E402

atexit.register(_cleanup_files)


# -- the exporter ------------------------------------------------------------------------------
def export(view, stream=None) -> IpcExport:
    """Share ``view``'s bytes with another process (see the module docstring). ``stream``:
    where the export's event is recorded (default: the current stream of the view's device);
    it is ordered after every pending write to the bytes, on any stream."""
    from .runtime.submission import submit
    from .stream import resolve_stream
    if not isinstance(view, View):
        raise TypeError(f"sm.ipc.export takes a Buffer or Tensor, got {type(view).__name__}")
    tok = view._live_token()
    dev = tok.allocation.device
    if dev.kind != "cuda":
        raise BackendUnavailableError(f"CUDA IPC shares CUDA device memory; {view!r} is on {dev} "
                                      f"(pickle it instead: a copy through host memory)")
    backend = dev.backend
    ptr = tok.allocation.ptr + tok.start
    # (an empty view may end at its allocation's end: its address would name the next one)
    info = backend.pointer_info(ptr if tok.stop > tok.start else tok.allocation.ptr)
    if info is None:
        raise SharedMemError(f"cannot export {view!r} by CUDA IPC: the driver does not know "
                             f"its memory as a device allocation")
    base, size, _ = info
    mem = backend.ipc_mem_handle(base)
    s = resolve_stream(stream, dev)

    def refuse_capture():
        if s._capture is not None:  # (its event would be recorded into the graph: at replay)
            raise CaptureError(f"cannot export {view!r} by CUDA IPC on {s}: it is capturing a "
                               f"graph, whose work runs only at replay, so the export's event "
                               f"would mark nothing now; export before the capture begins")

    refuse_capture()
    impl = s._impl

    pair = backend.ipc_event()  # (pooled: creating one and its handle costs ~100 us)

    def enqueue():  # under the core lock, after the waits for pending writes
        # (again here, where a capture is decided: one begun since the check above would
        # take this work into its graph -- submit() records it there, calling this first)
        refuse_capture()
        if tok.writable:
            # the importer may write: ordered after the pending reads on other streams too, as
            # a DLPack export of a writable view is (the lease, a read, waited for the writes)
            _order_after_reads_locked(tok, s)
        backend.record_event(pair[0], impl)
        return impl.submit_marker()

    ex_tok = tok.allocation.new_token(f"CUDA IPC export from pid {os.getpid()}", tok.start,
                                      tok.stop, tok.writable, tok.keep, source=view)
    try:
        # (ordered whatever the policy, as every export)
        submit(s, [(tok, False)], enqueue, policy="order", label="CUDA IPC export")
        h = _new(IpcHandle, kind=view._kind, dtype=view.dtype.str, shape=tuple(view.shape),
                 strides=tuple(view.strides), nbytes=tok.stop - tok.start,
                 first=view._offset - tok.start,  # element 0, from the first byte shared
                 writable=tok.writable, device_uuid=dev.uuid, mem=mem, region=(0, size),
                 offset=ptr - base, event=pair[1], exporter_pid=os.getpid())
        ex = _new(IpcExport, handle=h, _token=ex_tok, _event=(backend, pair), _state="exported",
                  _dead_since=None, _done=threading.Event())
        with _lock:
            _ensure_poller_locked()  # (first: a failure below leaves no export filed)
            slot, path, index, gen = _take_slot_locked()
            _SLOT.pack_into(slot[0], slot[1], EXPORTED, gen, 0, 0, 0)
            h.slots, h.slot, h.generation = path, index, gen
            ex._slot = slot
            _exports.append(ex)
    except BaseException:
        ex_tok.release()
        backend.ipc_event_done(pair)
        raise
    log.debug("CUDA IPC export of %r: %s", view, h)
    return ex


def _order_after_reads_locked(tok, s) -> None:
    """Make ``s`` wait, on the device, for the unfinished reads of ``tok``'s bytes on other
    streams (and what consumers holding them read-only gave their streams so far): what a
    read lease does not wait for, and a writing importer must. Caller holds core_lock.
    CompletionUnknownError for reads of unknown completion (nothing waited for after it)."""
    tracker = tok.allocation.tracker
    if not tracker.elsewhere_locked(s):
        return
    waited = s._waited
    for c in tracker.conflicts_locked(s, True, tok.start, tok.stop, None):
        other, marker, seq, writes = c[0], c[1], c[2], c[3]
        if marker is None and writes:  # a hold that may write: the read lease waited for it
            continue
        if marker is not None and waited is not None and seq <= waited.get(other._uid, 0):
            continue  # (ordered already: the lease waited for that work, or later work)
        fresh = marker is None  # an open hold: whatever its stream was given so far
        if fresh:
            marker = fresh_marker_locked(other, True)
        try:
            if marker.error is not None:
                raise CompletionUnknownError(
                    f"cannot export bytes [{tok.start}, {tok.stop}) of allocation "
                    f"#{tok.allocation.id} by CUDA IPC: work of unknown completion on {other} "
                    f"reads them, and the importer may write them")
            s._impl.wait_marker(marker)
        finally:
            if fresh:
                marker.recycle()


def exports() -> int:
    """How many exports of this process have not ended."""
    with _lock:
        return len(_exports)


def _finish_locked(ex, state) -> None:
    """End ``ex``, once: its callers hold _lock and take it from _exports (every export not
    ended is there; none is put back)."""
    ex._state = state
    mm, off, f, i, _ = ex._slot  # (callers hold the slot's lock, or it is no longer EXPORTED)
    struct.pack_into("<II", mm, off, FREE, 0)
    _free.append((f, i))
    ex._token.release()  # the exporter's hold ends: the memory goes back once nothing uses it
    backend, pair = ex._event
    backend.ipc_event_done(pair)  # no importer waits for it: the next export may record it
    ex._slot = ex._token = ex._event = None
    _exports.remove(ex)
    ex._done.set()


def _ensure_poller_locked() -> None:
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_poll, name="sharedmem-ipc", daemon=True)
        _thread.start()


def _poll() -> None:
    global _thread
    while True:
        time.sleep(POLL)
        with _lock:
            if not _exports:
                _thread = None
                return
            now = time.monotonic()
            for ex in list(_exports):
                slot = ex._slot
                state, _, pid, _, start = _SLOT.unpack_from(slot[0], slot[1])
                if state == RELEASED:
                    _finish_locked(ex, "released")
                elif state == EXPORTED:  # (an open that failed put it back)
                    ex._state = "exported"
                    ex._dead_since = None
                elif state == OPEN:
                    ex._state = "open"
                    if _alive(pid, start):
                        ex._dead_since = None
                    elif ex._dead_since is None:
                        ex._dead_since = now
                    elif now - ex._dead_since >= GRACE:
                        log.warning("CUDA IPC importer pid %d died holding %r; its memory is "
                                    "released", pid, ex.handle)
                        _finish_locked(ex, "importer died")


def _start_time(pid: int) -> int:
    """The process's start time (clock ticks since boot), 0 when unknown; -1 when it is gone
    or a zombie."""
    try:
        with io.open(f"/proc/{pid}/stat", "rb") as f:  # (this module's open is sm.ipc.open)
            fields = f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return -1
    except OSError:
        return 0
    return -1 if fields[0] in (b"Z", b"X") else int(fields[19])


def _alive(pid: int, start: int) -> bool:
    t = _start_time(pid)
    if t == 0:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return t != -1 and (start == 0 or t == start)


# -- the importer ------------------------------------------------------------------------------

class _Mapping:
    """An exporter's allocation mapped into this process; unmapped when the last import of it
    is gone (every view and every launch that used one finished).

    Unmapped by a weakref callback (:func:`_new_mapping`), not ``__del__``: a dying object's
    ``__del__`` runs while weak references still return it, so an open() on another thread,
    during the close (a driver call: the GIL is let go), took the mapping being closed from
    ``_mappings`` -- an import of unmapped memory. Callbacks run after every weak reference
    is cleared: that open() maps the handle anew (the driver counts the opens)."""

    __slots__ = ("backend", "base", "__weakref__")


def _close_mapping(backend, base) -> None:
    try:
        backend.ipc_close_mem(base)
    except Exception:  # pragma: no cover - interpreter teardown
        pass


def _new_mapping(backend, base) -> _Mapping:
    mapping = _new(_Mapping, backend=backend, base=base)
    weakref.finalize(mapping, _close_mapping, backend, base).atexit = False
    return mapping


_mappings: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # (device, mem) -> _Mapping

#: Mappings and opened events kept for the next import of the same exporter allocation (CuPy's
#: pool hands out blocks of a few long-lived chunks: most imports hit). Opening a mapping costs
#: hundreds of microseconds, and so does closing it. A cached mapping keeps the exporter's
#: chunk mapped here -- not its blocks reserved: only exports hold those -- until evicted, or
#: until its exporter is seen gone. Guarded by _opened_lock.
CACHED_MAPPINGS = 32
CACHED_EVENTS = 64
_recent = collections.OrderedDict()  # (device key, mem handle) -> (_Mapping, exporter pid)
_events = collections.OrderedDict()  # (device key, event handle) -> (marker, exporter pid)
_by_uuid: dict = {}
_swept = [0.0]
_born: dict = {}  # pid -> its start time (this process's, cached; a fork has a new pid)


def _forget_dead_exporters_locked() -> None:
    now = time.monotonic()
    if now - _swept[0] < 1.0:
        return
    _swept[0] = now
    for cache in (_recent, _events):
        for key, (_, pid) in list(cache.items()):
            if not _alive(pid, 0):
                del cache[key]
    for path, f in list(_opened.items()):  # (closed once its imports are gone too)
        if not _alive(f.pid, 0):
            del _opened[path]


def _remember_locked(cache, key, value, pid, limit) -> None:
    cache[key] = (value, pid)
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


class _SlotFile:
    """An exporter's slot file, mapped in this importer: its descriptor and mapping are
    closed when nothing uses them -- neither the cache of files (``_opened``, which forgets
    a dead exporter's) nor an import of a slot in it."""

    __slots__ = ("mm", "fd", "pid")

    def __del__(self):
        try:
            self.mm.close()
        except Exception:  # pragma: no cover - interpreter teardown
            pass
        try:
            os.close(self.fd)
        except Exception:  # pragma: no cover
            pass


class _Import:
    """Kept by the imported views' tokens and by every lease of them: when it dies, the
    importer is done and the exporter's slot says so."""

    __slots__ = ("mapping", "file", "off", "generation", "pid", "__weakref__")

    def __del__(self):
        # Only the process that opened the slot releases it (a forked child that drops the
        # views it inherited must not end its parent's import: the file is shared), and only
        # an import that was made (one whose open failed is disarmed: generation None)
        if self.generation is None or self.pid != os.getpid():
            return
        try:
            f = self.file
            with _SlotLock(f.fd, self.off):
                state, gen, pid = _SLOT.unpack_from(f.mm, self.off)[:3]
                if (state, gen, pid) == (OPEN, self.generation, self.pid):
                    struct.pack_into("<I", f.mm, self.off, RELEASED)
        except Exception:  # pragma: no cover - interpreter teardown
            pass


def _device_of(handle):
    d = _by_uuid.get(handle.device_uuid)
    if d is not None:
        return d
    from .device import Device
    from .backends.cuda import device_count
    for i in range(device_count()):
        d = Device(i)
        _by_uuid[d.uuid] = d
        if d.uuid == handle.device_uuid:
            return d
    raise SharedMemError(f"cannot open {handle!r}: its device ({handle.device_uuid}) is not "
                         f"visible in this process (CUDA_VISIBLE_DEVICES?)")


def _checked_dtype(handle) -> np.dtype:
    """The dtype of ``handle``'s view, once every field is seen to describe a view inside the
    bytes it shares, those inside the region it maps, and a slot of its exporter's slot
    file. SharedMemError otherwise -- before a slot is written or anything mapped: a corrupt
    handle (or one of another sharedmem version) would make a view past the mapping, or
    consume the export and leave it unopenable."""
    from .tensor import extent
    try:
        dtype = np.dtype(handle.dtype)
        shape = tuple(operator.index(n) for n in handle.shape)
        strides = tuple(operator.index(n) for n in handle.strides)
        nbytes, first, offset, slot = (operator.index(x) for x in (
            handle.nbytes, handle.first, handle.offset, handle.slot))
        start, size = (operator.index(x) for x in handle.region)
        operator.index(handle.generation)
        item = dtype.itemsize
        if dtype.hasobject or not item:
            raise ValueError(f"dtype {dtype}")
        if handle.kind not in ("buffer", "tensor"):
            raise ValueError(f"kind {handle.kind!r}")
        if len(shape) != len(strides) or min(shape, default=0) < 0:
            raise ValueError(f"shape {shape} with strides {strides}")
        if handle.kind == "buffer" and (len(shape) != 1 or first != 0):
            raise ValueError(f"a buffer of shape {shape} from byte {first}")
        lo, hi = extent(shape, [s * item for s in strides], item)  # (bytes from `first`)
        lo, hi = first + lo, first + hi
        if not 0 <= lo <= hi <= nbytes:
            raise ValueError(f"its elements span bytes [{lo}, {hi}) of {nbytes} shared")
        if start != 0 or offset < 0 or offset + nbytes > size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) of a region of {size}")
        operator.index(handle.exporter_pid)
        if not 0 <= slot < SLOTS or not os.path.basename(handle.slots).startswith(
                "sharedmem-ipc-"):
            raise ValueError(f"slot {slot} of {handle.slots!r}")
        if len(handle.mem) != 64 or len(handle.event) != 64:
            raise ValueError("IPC handles not of 64 bytes")
    except (AttributeError, TypeError, ValueError, OverflowError) as e:
        raise SharedMemError(f"cannot open {handle!r}: it is corrupt, or was made by another "
                             f"version of sharedmem ({e}); nothing was opened") from None
    return dtype


def _slots_file(path: str, pid: int) -> _SlotFile:
    """Exporter ``pid``'s slot file at ``path`` (opened once per process while it lives)."""
    got = _opened.get(path)
    if got is None:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise SharedMemError(f"cannot open a CUDA IPC handle: its exporter's slot file "
                                 f"{path} is gone (the exporter exited?)") from None
        size = os.fstat(fd).st_size
        if size != SLOTS * _SLOT.size:  # (another file: never mapped, nor written)
            os.close(fd)
            raise SharedMemError(f"cannot open a CUDA IPC handle: {path} is not a sharedmem "
                                 f"slot file ({size} bytes, not {SLOTS * _SLOT.size})")
        got = _opened[path] = _new(_SlotFile, mm=_map(fd), fd=fd, pid=pid)
    return got


def open(handle: IpcHandle, stream=None):  # noqa: A001  (sm.ipc.open)
    """Open an export made by another process: a Buffer or Tensor of the same bytes,
    zero-copy, on the device with the exporter's UUID. ``stream``: the stream that waits for
    the exporter's writes (default: that device's current stream). Raises SharedMemError for
    a handle opened before, revoked, or whose exporter is gone."""
    from .allocation import import_allocation
    from .buffer import new_buffer
    from .stream import resolve_stream
    from .tensor import new_tensor
    if not isinstance(handle, IpcHandle):
        raise TypeError(f"sm.ipc.open takes an IpcHandle (IpcExport.handle), got "
                        f"{type(handle).__name__}")
    dtype = _checked_dtype(handle)
    raise_deferred()  # (as the call begins: never once the slot is opened, see deferring)
    if handle.exporter_pid == os.getpid():
        raise SharedMemError(f"{handle!r} was exported by this process: use the view itself "
                             f"(CUDA IPC handles open in other processes)")
    if not _alive(handle.exporter_pid, 0):
        raise SharedMemError(f"cannot open {handle!r}: its exporter (pid "
                             f"{handle.exporter_pid}) is gone, and its memory with it")
    dev = _device_of(handle)
    me = os.getpid()
    born = _born.get(me)
    if born is None:
        born = _born[me] = max(_start_time(me), 0)
    with _opened_lock:
        slots = _slots_file(handle.slots, handle.exporter_pid)
        mm, fd = slots.mm, slots.fd
        off = handle.slot * _SLOT.size
        with _SlotLock(fd, off):
            state, gen, *_ = _SLOT.unpack_from(mm, off)
            if gen != handle.generation or state != EXPORTED:
                why = {OPEN: "it was opened already (a handle opens once)",
                       RELEASED: "it was opened and released already"}.get(
                    state if gen == handle.generation else -1,
                    "the export ended (revoked, or released)")
                raise SharedMemError(f"cannot open {handle!r}: {why}")
            _SLOT.pack_into(mm, off, OPEN, gen, me, 0, born)
    try:
        backend = dev.backend
        pid = handle.exporter_pid
        with _opened_lock:
            _forget_dead_exporters_locked()
            key = (dev.key, handle.mem)
            mapping = _mappings.get(key)  # (one in _recent is here too: _recent keeps it alive)
            if mapping is None:
                mapping = _mappings[key] = _new_mapping(backend, backend.ipc_open_mem(handle.mem))
            _remember_locked(_recent, key, mapping, pid, CACHED_MAPPINGS)
            ekey = (dev.key, handle.event)
            hit = _events.get(ekey)
            marker = hit[0] if hit is not None else backend.ipc_open_event(handle.event)
            _remember_locked(_events, ekey, marker, pid, CACHED_EVENTS)
        imp = _new(_Import, mapping=mapping, off=off, pid=me,
                   file=slots,  # (its descriptor stays open while this import may write the slot)
                   generation=None)  # (armed below, once nothing can fail: see the except clause)
        ptr = mapping.base + handle.offset
        s = resolve_stream(stream, dev)
        # (the exporter pools its events: a cached one is re-recorded only for later exports,
        # after every import of the earlier one ended)
        with locked():
            if s._capture is not None:  # (a capture cannot wait for outside work; under the
                # lock, where a capture begins: one begun by now is seen)
                raise CaptureError(f"cannot open {handle!r} on {s}: it is capturing a graph, "
                                   f"which cannot wait for the exporter's writes; open it "
                                   f"before the capture begins")
            s._impl.wait_marker(marker)
        alloc = import_allocation(dev, ptr, handle.nbytes, "CUDA IPC",
                                  (mapping.base, handle.region[1]))
        start = ptr - alloc.ptr
        tok = alloc.new_token("CUDA IPC import", start, start + handle.nbytes, handle.writable,
                              imp)
        if handle.nbytes:  # the arrival, a write on `s`: other streams' use is ordered after it
            try:  # (before the import is armed: a failure -- a capture begun on `s` since it
                # was looked at -- puts the slot back, and the handle opens again)
                record_arrival(tok, s)
            except BaseException:
                tok.release()
                raise
        imp.generation = gen  # armed: its end releases the slot
    except BaseException:
        # (an _Import made before the failure is never armed: kept alive by the traceback,
        # its end must not release a later, successful open of the same handle)
        with _SlotLock(fd, off):
            _SLOT.pack_into(mm, off, EXPORTED, gen, 0, 0, 0)  # nothing changed: open it again
        raise
    if handle.kind == "tensor":
        view = new_tensor(tok, dtype, handle.shape, handle.strides, start + handle.first)
    else:
        view = new_buffer(tok, dtype, handle.shape[0])
    return view


def _after_fork_child() -> None:
    """A forked child shares none of its parent's exports (it did not make them): its copies
    of the slot files' mappings and descriptors are closed (the parent's record locks are
    the parent's: a child holds none to lose)."""
    global _thread
    for _path, mm, fd in _files:
        with contextlib.suppress(OSError, ValueError):
            mm.close()
            os.close(fd)
    for state in (_exports, _files, _free, _recent, _events):
        state.clear()
    _thread = None


at_fork_child(_after_fork_child, 1)
