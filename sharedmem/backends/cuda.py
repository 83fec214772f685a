"""The CUDA backend: streams, events, copies and foreign-pointer queries through
``cuda.bindings`` (the driver API); memory from CuPy's pool.

Imported only when a CUDA device is asked for; raises
:class:`~sharedmem.errors.BackendUnavailableError` with an install hint when
``cuda-bindings`` or CuPy is missing or no GPU is usable.

* Context: the device *borrows* its GPU's primary context (retained once,
  never destroyed). Every call that needs it makes it current first
  (``ensure_context``): with one device in use, a thread-local record of the context this
  module last made current; once several are, the driver is asked (another library may
  have switched devices meanwhile: CuPy's ``Device(1).use()``, torch's ``set_device``).
* Several devices: peer access is turned on explicitly (``enable_peer_access``); copies
  between devices are ``cuMemcpyPeerAsync``; a stream may wait on another device's event.
* Memory: ``cupy.cuda.alloc`` -- shared with the user's CuPy code. A block
  goes back to CuPy's pool when its owning allocation dies, which happens only
  after every submission that leased it has retired (see runtime/submission).
  That is what closes the reuse hazard of cupy/cupy#8068 for our memory.
* Completion: pooled events, recorded *lazily* and shared by consecutive
  submissions of a stream. A submission joins its stream's open marker; the
  marker's event is recorded (``cuEventRecord``, about half a microsecond)
  when someone needs it -- a retirement sweep's query, a wait, a cross-stream
  order -- or when MARKER_BATCH submissions have joined. Recording later than
  the work is always safe: an event marks everything enqueued before it, so
  completion is only ever reported late, never early -- on streams sharedmem
  owns and the device's default stream; on a borrowed stream, which its owner
  may destroy or capture at any time, each submission's event is recorded at
  once. Joining and recording
  both happen under core_lock, so no work joins a marker after its event was
  recorded. The retirer queries; there are no host callbacks per launch.
  A query that fails with anything but ``CUDA_ERROR_NOT_READY`` (a sticky
  error after a fault) means *completion unknown*: the work's memory is kept.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import threading
import time
import weakref

import numpy as np

from ..runtime.retirer import on_retirer_thread
from ..runtime.state import (LockMark, enter_marked, enter_or_stage_marked, fork_safe,
                             leave_marked, locked)
from ..stream import borrowed_handle
from ..errors import BackendUnavailableError, CaptureError, CompletionUnknownError, CudaError
from . import COMPLETE, DONE, PENDING, UNKNOWN, copy_pieces

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from .. import _cython as cython


# The driver module (cuda.bindings.driver), imported by the first CudaBackend -- never by
# importing this module, which modules compiled against it import with them (tests put a fake
# driver here before they make a backend).
cu = None
_SUCCESS = None
_CAPTURE_IMPLICIT = 906  # CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
_CAPTURE_UNSUPPORTED = 900  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED


def _load_driver():
    global cu, _SUCCESS
    if cu is None:
        try:  # (cuda-bindings >= 12.6, as pyproject.toml requires: no older layout)
            from cuda.bindings import driver
        except Exception:  # pragma: no cover - not installed, or cannot load: as none
            return None
        cu = driver
    if _SUCCESS is None:
        _SUCCESS = cu.CUresult.CUDA_SUCCESS
    return cu


class _HotDriver:
    """The driver calls on the per-launch path, called through ctypes on
    libcuda itself: cuda.bindings' Python wrappers cost several microseconds a
    call (measured: ``cuLaunchKernel`` through them 4.6 us against a whole CuPy
    launch of 5.8 us on an H200). Handles and pointers are plain ints. The
    calls keep the GIL (``PyDLL``): they return in microseconds, and releasing
    the GIL around each one let the retirer thread interleave with every launch
    (measured: 54 us a launch instead of 25). Everything else uses cuda.bindings.

    ``launch`` has no ``argtypes``: its pointer arguments are ``ctypes.c_void_p`` objects the
    caller made once (a plan's function and parameter array, a stream's ``c_handle``), its
    ints plain ints -- converting eleven arguments through ``argtypes`` cost 1.4 us of an
    interpreted launch's 11 (measured on the benchmark's C no-op)."""

    def __init__(self):
        lib = ctypes.PyDLL("libcuda.so.1")
        vp, ui = ctypes.c_void_p, ctypes.c_uint
        # for the compiled paths (launch plans, ensure_context): the C entry points themselves
        self.addresses = {}
        # (attribute, entry point, argtypes: None for launch, see above); all return an int
        for attr, name, argtypes in (
                ("launch", "cuLaunchKernel", None), ("record", "cuEventRecord", [vp, vp]),
                ("query", "cuEventQuery", [vp]), ("graph_launch", "cuGraphLaunch", [vp, vp]),
                ("wait", "cuStreamWaitEvent", [vp, vp, ui]),  # the handoffs between streams
                ("_is_capturing", "cuStreamIsCapturing", [vp, ctypes.POINTER(ctypes.c_int)]),
                ("_exchange", "cuThreadExchangeStreamCaptureMode", [ctypes.POINTER(ctypes.c_int)]),
                ("_ctx_get", "cuCtxGetCurrent", [ctypes.POINTER(vp)]),
                ("_attributes", "cuPointerGetAttributes", [ui, vp, vp, ctypes.c_ulonglong])):
            fn = getattr(lib, name)
            if argtypes is not None:
                fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            setattr(self, attr, fn)
            self.addresses[name] = ctypes.cast(fn, vp).value

    def current_context(self) -> int:
        """The calling thread's current context (0: none)."""
        out = getattr(_ctx_out, "v", None)  # (made once per thread: asked on every launch)
        if out is None:
            out = _ctx_out.v = ctypes.c_void_p()
        if self._ctx_get(out):  # (a failed call may leave out as it was: none known current)
            return 0
        return out.value or 0

    def exchange_capture_mode(self, mode: int) -> int:
        """Set the calling thread's stream-capture interaction mode to ``mode``
        (``cuThreadExchangeStreamCaptureMode``); its mode before, or -1 where the driver
        refused (nothing changed)."""
        m = ctypes.c_int(mode)
        return -1 if self._exchange(m) else m.value

    def pointer_info(self, ptr):
        """:meth:`CudaBackend.pointer_info` (the context made current): every import and
        every torch tensor new to a launch asks it."""
        start, size = ctypes.c_ulonglong(), ctypes.c_size_t()
        ordinal, memtype = ctypes.c_int(), ctypes.c_uint()
        data = (ctypes.c_void_p * 4)(*[ctypes.addressof(x) for x in (start, size, ordinal,
                                                                        memtype)])
        err = self._attributes(4, _POINTER_ATTRIBUTES, data, ptr)
        if err:
            raise _error(err, "cuPointerGetAttributes")
        if memtype.value != 2:
            return None  # (not device memory: CU_MEMORYTYPE_DEVICE is 2)
        return start.value, size.value, ordinal.value


#: cuPointerGetAttributes' attributes, as pointer_info reads them: RANGE_START_ADDR,
#: RANGE_SIZE, DEVICE_ORDINAL, MEMORY_TYPE (the values of CUpointer_attribute)
_POINTER_ATTRIBUTES = (ctypes.c_int * 4)(11, 12, 9, 2)
_PTR_END = 1 << 64  # (a CUdeviceptr is 64 bits: past it, ctypes' conversion, as before)


def _pointer_info(addr, ptr):
    """Compiled only: :meth:`_HotDriver.pointer_info` through the entry point at ``addr``,
    its results written into C locals -- through ctypes, the four result objects and the
    pointer array made for every call cost about 5 us on an H100, where the driver's own
    work is a fraction of one. The same attributes, in the same order."""
    start = cython.declare(cython.ulonglong, 0)
    size = cython.declare(cython.size_t, 0)
    ordinal = cython.declare(cython.int, 0)
    memtype = cython.declare(cython.uint, 0)
    attrs = cython.declare(cython.int[4])
    data = cython.declare(cython.p_void[4])
    attrs[0], attrs[1], attrs[2], attrs[3] = 11, 12, 9, 2
    data[0] = cython.cast(cython.p_void, cython.address(start))
    data[1] = cython.cast(cython.p_void, cython.address(size))
    data[2] = cython.cast(cython.p_void, cython.address(ordinal))
    data[3] = cython.cast(cython.p_void, cython.address(memtype))
    err = cython.declare(cython.int, cython.cast(attributes_fn_t, addr)(4, attrs, data, ptr))
    if err:
        raise _error(err, "cuPointerGetAttributes")
    if memtype != 2:
        return None  # (not device memory: CU_MEMORYTYPE_DEVICE is 2)
    return start, size, ordinal


def _hot_driver():
    try:
        return _HotDriver()
    except (OSError, AttributeError):  # pragma: no cover - no libcuda.so.1
        return None


def _name(err) -> str:
    try:
        e, s = cu.cuGetErrorName(err)
        return s.decode() if e == _SUCCESS else str(err)
    except Exception:  # pragma: no cover
        return str(err)


def _error(err, what: str) -> CudaError:
    """The CudaError of driver call ``what`` that returned ``err`` (a CUresult, or the int an
    entry point called through ctypes returned: libcuda may answer a code newer than the
    bindings' CUresult knows -- named by its number then, never a ValueError raised where the
    error is being reported)."""
    code = int(err)
    try:
        err = cu.CUresult(code)
    except ValueError:
        return CudaError(f"{what} failed: CUresult {code} (an error code cuda-bindings does not "
                         f"know: a newer driver's)", code)
    return CudaError(f"{what} failed: {_name(err)} ({code}){_HINTS.get(code, '')}", code)


#: What a driver error means for a sharedmem user, where its name alone does not say.
_HINTS = {
    # work given to the legacy default stream (a launch with no stream, on a device whose
    # default is the legacy stream) while another library captures on a blocking stream
    906: ("; a blocking stream of this context is capturing a CUDA graph (another library's "
          "capture: cupy.cuda.Stream.begin_capture, torch.cuda.graph), and the legacy default "
          "stream cannot take work meanwhile -- the driver also invalidated that capture. "
          "Launch on a non-blocking stream (device.create_stream()), or after the capture "
          "ends"),
}


def check(result, what: str):
    """Unpack a cuda.bindings result tuple, raising CudaError on failure."""
    err = result[0]
    if err != _SUCCESS:
        raise _error(err, what)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


#: Submissions of one stream that share one completion event at most (see the
#: module docstring): one cuEventRecord per MARKER_BATCH launches in a tight loop. The
#: submissions of a batch retire together, at the first sweep that finds its event reached,
#: with what they keep: 32, where a launch with a new CuPy array keeps some 17 objects the
#: collector tracks (its facts, allocation, lease, submission... and CuPy's own), keeps a
#: batch below the 700 that start a young collection -- at 64 one ran every ~65 launches and
#: promoted the arrays in flight, and full collections followed (on an H100, 2.9 us of such a
#: launch's 18-23; see runtime.submission.SWEEP_EVERY).
MARKER_BATCH = 32
_marker_batch = cython.declare(cython.longlong, MARKER_BATCH)  # (compiled: a C constant to compare)

#: The largest piece of a host <-> device copy staged in pinned memory at once
#: (CudaBackend.pinned: larger copies go piece by piece), and the bytes of pinned memory
#: alive for copies on a device at most: CuPy's pinned pool keeps what it lends, so as much
#: as was ever in flight at once stays pinned -- and an upload loop far ahead of its stream
#: would pin all it uploads. Past the budget, a piece waits for the work it follows first.
#: Pieces are small because pinning memory is slow and stalls other threads' driver calls
#: (on an H200 a fresh 64 MiB cudaHostAlloc took 38.8 ms; with 64 MiB pieces another thread's
#: launch waited up to 61 ms during a 1 GiB to_host, with 8 MiB pieces 5.8 ms, the copy as
#: fast: RESULTS.md).
STAGE_MAX = 8 << 20
STAGE_BUDGET = 256 << 20
# guards CudaBackend._staged; nothing under it allocates a collected object (an int sum), so
# compiled no collection -- and no finalizer calling _unstage -- can start while it is held.
# Interpreted one still may (see runtime.state.LockMark): pinned() marks its thread
# (_in_stage), and an _unstage run under it is staged (_unstaged), done once it let it go.
_stage_lock = fork_safe(threading.Lock())
_in_stage = LockMark()
_unstaged = collections.deque()  # (backend, size) of the _unstage calls staged


def _unstage_staged(item) -> None:
    item[0]._unstage(item[1])


class CudaMarker:
    """Completion marker: an event recorded after a submission's work.

    ``query()`` -> 0 pending, 1 done, 2 unknown (``error`` says why).
    Pooled markers return their event to the pool on ``recycle()``, which the
    runtime calls once the submissions sharing it have retired.

    A marker from :meth:`CudaStreamImpl.submit_marker` starts *open*: ``_open_on``
    is the stream impl whose later submissions may still join it, and no event
    is recorded yet. :meth:`close_locked` records it; ``query`` and
    ``wait_marker`` (called under core_lock) and ``wait`` close it first.
    """

    __slots__ = ("event", "handle", "error", "_backend", "_pooled", "_open_on")

    def __init__(self, event, backend, pooled):
        self.event = event
        self.handle = int(event) if event is not None else 0
        self.error = None
        self._backend = backend
        self._pooled = pooled
        self._open_on = None  # guarded by core_lock

    @property
    def recorded(self) -> bool:
        """False while the marker is open (no event recorded yet)."""
        return self._open_on is None

    def close_locked(self) -> None:
        """Record the event of an open marker now (after everything enqueued on
        its stream so far: every submission that joined it). Caller holds
        core_lock. A failed record makes the marker *unknown*."""
        impl = self._open_on
        if impl is None:
            return
        backend = self._backend
        try:  # (the context first: an event taken from the pool and not recorded would be lost)
            backend.ensure_context()  # (the legacy default stream is the current context's)
            if impl.handle == 0 and backend.legacy_joined():
                # The legacy default stream joined to a capture (another library's, of a
                # blocking stream: cupy.cuda.Stream().begin_capture()): a record there fails
                # and invalidates that capture. Left open -- its work pending, not unknown --
                # and recorded when asked after the capture ends (a host wait meanwhile:
                # CaptureError)
                return
            if impl.open_marker is self:
                impl.open_marker = None
            ev = backend._event()
        except Exception as e:  # (never raised: the work that joined it is enqueued already)
            if impl.open_marker is self:
                impl.open_marker = None
            self.error = e
            self._open_on = None
            return
        h = int(ev)
        err = _record(backend, ev, h, impl.handle)
        if err:  # (the event, not recorded, back to the pool: the marker keeps none)
            self.error = _error(err, "cuEventRecord")
            backend._events.append(ev)
        else:
            self.event, self.handle = ev, h
        # Published last: wait() reads _open_on without the lock, and once it is None the
        # event must be the recorded one (an event not recorded yet reads as complete).
        self._open_on = None

    def query(self) -> int:
        """Caller holds core_lock when the marker may be open (sweeps do)."""
        if self._open_on is not None:
            self.close_locked()
            if self._open_on is not None:  # (not recorded now: see close_locked)
                return PENDING
        if self.error is not None:
            return UNKNOWN
        # (read once: a sweep in another thread -- the retirer's -- may recycle the marker
        # meanwhile, synchronize_stream asking outside the lock, and a second read found None)
        ev = self.event
        if ev is None:  # recycled: only ever after its work was found done
            return DONE
        backend = self._backend
        backend.ensure_context()
        hot = backend.hot
        # Asked in relaxed capture mode, the thread's own given back after (see _relax)
        if cython.compiled and backend.query_addr:
            xaddr = cython.declare(cython.size_t, backend.exchange_addr)
            mode = cython.declare(cython.int, _RELAXED)
            relaxed = cython.declare(cython.bint, False)
            if xaddr:
                relaxed = cython.cast(exchange_fn_t, xaddr)(cython.address(mode)) == 0
            err = cython.cast(query_fn_t, cython.cast(cython.size_t, backend.query_addr))(
                cython.cast(cython.p_void, cython.cast(cython.size_t, self.handle)))
            if relaxed:
                cython.cast(exchange_fn_t, xaddr)(cython.address(mode))
        else:
            err = backend.relaxed(hot.query, self.handle) if hot is not None else \
                int(backend.relaxed(cu.cuEventQuery, ev)[0])
        if err == 0:
            return DONE
        if err == 600 or err == _CAPTURE_UNSUPPORTED:  # CUDA_ERROR_NOT_READY; or not asked:
            # another thread captures a graph in global mode (torch.cuda.graph's default),
            # and this thread's mode forbids it to ask meanwhile -- asked again later
            return PENDING
        self.error = _error(err, "cuEventQuery")
        return UNKNOWN

    def wait(self, timeout=None) -> bool:
        """Block until the work finished (or its completion became unknown);
        False on timeout. Polls with short sleeps when a timeout is given.
        Never called with core_lock held."""
        if self._open_on is not None:
            with locked():
                self.close_locked()
        if timeout is None:
            if self._open_on is not None:  # (not recorded now: see close_locked)
                raise _legacy_joined_error(self._backend, "wait for")
            ev = self.event  # None once recycled (by the retirer, meanwhile): the work is done
            if self.error is None and ev is not None:
                backend = self._backend
                backend.ensure_context()
                err = backend.relaxed(cu.cuEventSynchronize, ev)[0]  # (as a query is asked)
                if err != _SUCCESS:
                    if int(err) == _CAPTURE_UNSUPPORTED:  # (not waited: says nothing of the
                        raise _capture_refused("wait for")  # work, which stays pending)
                    self.error = _error(err, "cuEventSynchronize")
            return True
        deadline = time.monotonic() + timeout
        delay = 20e-6
        while True:
            if self._open_on is not None:  # (not recorded above: asked, and recorded, locked)
                with locked():
                    st = self.query()
            else:
                st = self.query()
            if st != PENDING:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def recycle(self) -> None:
        """Give a pooled event back (idempotent: the submissions sharing a
        marker each recycle it when they retire, all in the same sweep)."""
        if self._pooled and self.error is None and self.event is not None:
            ev, self.event = self.event, None
            self._backend._events.append(ev)

    def __del__(self):
        # A marker of its own (a user Event, a stream-to-stream wait) owns its event.
        # cuEventDestroy never blocks: waits already enqueued on it still complete.
        # Through the driver module the backend was built with, not the global:
        # a destructor may run long after (tests swap the module for a fake).
        if not self._pooled and self.event is not None:
            try:  # (at teardown ``sys`` itself may be None: inside the try)
                if not sys.is_finalizing():
                    self._backend.cu.cuEventDestroy(self.event)
            except Exception:
                pass


def _capture_refused(what: str) -> CaptureError:
    """The CaptureError of a host wait the driver refused with CUDA_ERROR_STREAM_CAPTURE_
    UNSUPPORTED: a graph capture in global mode is under way, and this thread's mode forbids
    it to wait meanwhile. Nothing is known of the work then -- it is not unknown."""
    return CaptureError(
        f"cannot {what} sharedmem's work on the host now: a CUDA graph capture in global mode "
        f"is under way (torch.cuda.graph's default; another thread's, or this one's), and "
        f"while it lasts the driver refuses this thread's waits (CUDA_ERROR_STREAM_CAPTURE_"
        f"UNSUPPORTED; the refusal also invalidates that capture). Wait once the capture has "
        f"ended, or capture in thread-local mode (torch.cuda.graph(..., capture_error_mode="
        f"'thread_local')) and wait in another thread. The work stays pending, not unknown")


def _legacy_joined_error(backend, what: str) -> CaptureError:
    """The CaptureError of a host wait, or of an order after, work on the legacy default
    stream of ``backend``'s device whose marker cannot be recorded now: the stream is joined
    to the capture of a blocking stream of its context (see CudaMarker.close_locked)."""
    return CaptureError(
        f"cannot {what} sharedmem's work on the legacy default stream of cuda:"
        f"{backend.ordinal} now: a blocking stream of its context is capturing a CUDA graph "
        f"(cupy.cuda.Stream.begin_capture on a stream made without non_blocking=True, a "
        f"borrowed blocking stream), which joins the legacy stream, and no event can be "
        f"recorded there until the capture ends. Wait once it has ended, or launch on a "
        f"stream of your own (device.create_stream()). The work stays pending, not unknown")


def _legacy_wait_error(backend) -> CaptureError:
    """The CaptureError of an order of the legacy default stream of ``backend``'s device (its
    default stream, or a consumer's stream handle 1) after other work while a blocking stream
    of its context captures a graph: the wait would be refused and end that capture."""
    return CaptureError(
        f"cannot make the legacy default stream of cuda:{backend.ordinal} wait for other "
        f"work now: a blocking stream of its context is capturing a CUDA graph "
        f"(cupy.cuda.Stream.begin_capture on a stream made without non_blocking=True, a "
        f"borrowed blocking stream), which joins the legacy stream, and nothing can be "
        f"enqueued there until the capture ends (the driver would refuse it and invalidate "
        f"that capture). Use a stream of your own (device.create_stream()), or do it once the "
        f"capture has ended; nothing was enqueued")


def _record(backend, ev, h, stream_handle) -> int:
    """``cuEventRecord`` of event ``ev`` (handle ``h``) on the stream of raw handle
    ``stream_handle``, through the fastest entry point there is; the driver's error code (0:
    recorded). The caller made the context current (handle 0 is its legacy default stream)."""
    if cython.compiled and backend.record_addr:
        return cython.cast(record_fn_t, cython.cast(cython.size_t, backend.record_addr))(
            cython.cast(cython.p_void, cython.cast(cython.size_t, h)),
            cython.cast(cython.p_void, cython.cast(cython.size_t, stream_handle)))
    hot = backend.hot
    if hot is not None:
        return hot.record(h, stream_handle)
    return int(backend.cu.cuEventRecord(ev, backend.cu.CUstream(stream_handle))[0])


def _stream_wait(backend, stream_handle, marker) -> None:
    """Make stream ``stream_handle`` of ``backend``'s device wait for ``marker`` (a
    CudaMarker of any device; recorded first if open: caller holds core_lock then)."""
    if (stream_handle == 0 or stream_handle == 1) and backend.legacy_joined():
        # (a wait enqueued on the legacy default stream while it is joined to a blocking
        # stream's capture is refused, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and invalidates
        # that capture: refused here first, nothing enqueued)
        raise _legacy_wait_error(backend)
    if marker._open_on is not None:
        marker.close_locked()
        if marker._open_on is not None:  # (not recorded now: see close_locked)
            raise _legacy_joined_error(marker._backend, "order after")
        if marker.error is not None:
            raise CompletionUnknownError(f"cannot order after work whose completion event could "
                                         f"not be recorded ({marker.error!r}); its memory is "
                                         f"kept") from marker.error
    backend.ensure_context()  # (a marker of another device: that one's context)
    hot = backend.hot
    if cython.compiled and backend.wait_addr:
        err = cython.cast(wait_fn_t, cython.cast(cython.size_t, backend.wait_addr))(
            cython.cast(cython.p_void, cython.cast(cython.size_t, stream_handle)),
            cython.cast(cython.p_void, cython.cast(cython.size_t, marker.handle)), 0)
    elif hot is not None:
        err = hot.wait(stream_handle, marker.handle, 0)
    else:
        err = int(cu.cuStreamWaitEvent(cu.CUstream(stream_handle), marker.event, 0)[0])
    if err:
        raise _error(err, "cuStreamWaitEvent")


def _open_marker(impl):
    """A new open pooled marker on ``impl`` (what ``CudaMarker(None, backend, True)`` with
    ``_open_on`` set makes, without the constructor call: made on most cross-stream waits)."""
    m = CudaMarker.__new__(CudaMarker)
    m.event = None
    m.handle = 0
    m.error = None
    m._backend = impl._backend
    m._pooled = True
    m._open_on = impl
    return m


class CudaStreamImpl:
    """A CUDA stream handle; owned streams are destroyed when dropped (the
    driver defers destruction until their work is done: this never blocks)."""

    __slots__ = ("handle", "cu_stream", "c_handle", "owned", "name", "_backend", "external",
                 "capturing", "open_marker", "open_count", "_blocking", "_read_handle",
                 "__weakref__")

    def __init__(self, backend, handle, owned, name=None, external=None):
        self.capturing = False  # set by begin_capture / end_capture
        # The marker later submissions join, and how many have (see CudaMarker); guarded by
        # core_lock
        self.open_marker = None
        self.open_count = 0
        self._backend = backend
        self.handle = handle
        self.cu_stream = cu.CUstream(handle)
        self.c_handle = ctypes.c_void_p(handle)  # (for backend.hot.launch: see _HotDriver)
        self.owned = owned
        self.name = name
        self.external = external  # a borrowed foreign stream object, kept alive
        # Whether the stream is ordered with the legacy default stream (None: not asked yet).
        # Streams made here are non-blocking; a borrowed one is asked (see syncs_with_legacy).
        self._blocking = True if handle == 0 else (False if owned else None)
        self._read_handle = None  # (borrowed: how `external` names the handle, see named_by)

    fault = None  # a CUDA stream has no per-stream fault; sticky errors surface in queries
    throttle = None  # (submit() bounds the work queued per stream itself)

    def submit_marker(self):
        """The completion marker of work just enqueued here: this stream's open marker,
        joined (see CudaMarker). Every MARKER_BATCH-th joiner records it. Caller holds
        core_lock. Nothing is recorded on a capturing stream: the work was captured, not run.
        A record that fails is not raised here -- the work is enqueued already, and must be
        filed for its leases -- it makes the marker *unknown*: its submissions, this one too,
        are kept (leaked) when swept, as where the record fails when the marker is asked."""
        if self.capturing:
            return COMPLETE
        m = self.open_marker
        if m is None:
            m = _open_marker(self)
            if self.external is not None:
                # A borrowed stream: recorded now, as a hold's end there is. Its owner may
                # destroy it right after (legal: the work still runs) -- a later record
                # would go to a dead handle, or to another stream given that handle -- or
                # begin a capture on it, which would take the record in.
                m.close_locked()
                return m
            self.open_marker = m
            self.open_count = 1
            return m
        n = self.open_count + 1
        self.open_count = n
        if n >= _marker_batch:
            m.close_locked()
        return m

    def wait_marker(self, marker) -> None:
        """Make this stream wait for ``marker``, a CudaMarker of any device (caller holds
        core_lock when it may be open). CompletionUnknownError when the marker could not be
        recorded (a wait on an event never recorded would wait for nothing)."""
        _stream_wait(self._backend, self.handle, marker)

    def named_by(self, obj) -> bool:
        """Whether foreign stream object ``obj`` -- the one this stream was borrowed from --
        still names this stream, read the way it was when borrowed (no protocol search)."""
        read = self._read_handle
        return read is not None and read(obj) == self.handle

    def syncs_with_legacy(self) -> bool:
        """Whether work on this stream and on the legacy default stream is ordered both ways
        (the legacy default stream itself, or a stream made without CU_STREAM_NON_BLOCKING).
        False when the driver cannot say. Remembered when the stream was borrowed from an
        object that owns it (a CuPy, torch or cuda.core stream, kept alive here); asked each
        time of one borrowed as a bare handle, which may be destroyed and its handle reused."""
        b = self._blocking
        if b is None:
            self._backend.ensure_context()
            res = cu.cuStreamGetFlags(self.cu_stream)
            b = res[0] == _SUCCESS and \
                not int(res[1]) & int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
            ext = self.external
            if not isinstance(ext, int) and not hasattr(ext, "getPtr"):
                self._blocking = b  # (idempotent: a race writes the same answer)
        return b

    def synchronize(self) -> None:
        """``cuStreamSynchronize``: of a stream sharedmem made, or of its device's default
        stream (the legacy stream, which no library captures: sm.synchronize's fallback
        waits for it too), in relaxed capture mode, as its events are waited for; of a
        borrowed one, in the thread's own mode, as its owner's call would be. The legacy
        stream joined to a blocking stream's capture is refused first (CaptureError): the
        driver refuses that wait in every mode, and it would invalidate the capture."""
        backend = self._backend
        if self.owned or self.external is None:
            if not self.owned and backend.legacy_joined():
                raise _legacy_joined_error(backend, "wait for")
            backend.relaxed(backend.call, "cuStreamSynchronize", self.cu_stream)
        else:
            backend.call("cuStreamSynchronize", self.cu_stream)

    def __del__(self):
        if self.owned and self.handle:
            try:
                self._backend.cu.cuStreamDestroy(self.cu_stream)
            except Exception:
                pass


class Limits:
    """A device's launch limits: ``grid`` and ``block`` (maximum per dimension, x y z),
    ``threads`` per block, ``shared_mem`` bytes of dynamic shared memory per block (with the
    opt-in). 0 where the driver did not say; a limit of 0 is not checked."""

    __slots__ = ("grid", "block", "threads", "shared_mem")

    def __init__(self, grid, block, threads, shared_mem):
        self.grid = tuple(g or (1 << 62) for g in grid)
        self.block = tuple(b or (1 << 62) for b in block)
        self.threads = threads
        self.shared_mem = shared_mem


def device_count() -> int:
    """How many CUDA devices this process sees (0 without a usable driver)."""
    if _load_driver() is None or _init() is not None:
        return 0
    return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))


def _init():
    """``cuInit(0)``: None, or why the driver cannot be used -- its error, or what the call
    raised (cuda-bindings loads libcuda at its first call: without an NVIDIA driver that
    raises RuntimeError "Failed to dlopen libcuda.so")."""
    try:
        err = cu.cuInit(0)[0]
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    if err != _SUCCESS:
        return _name(err)
    driver = cu
    if not any(r() is driver for r in _relaxed):  # (once per driver module: tests swap a
        ref = weakref.ref(driver)                 # fake one in, and back)
        _relaxed.append(ref)
        on_retirer_thread(lambda: _relax_capture_mode(ref()))
    return None


# Weak references to the drivers whose mode the retirer thread sets. No lock: two threads
# making their first backends at once may both register one driver -- the setting is
# idempotent, so it is set twice, harmlessly.
_relaxed: list = []


def _relax_capture_mode(driver) -> None:
    """Run on the retirer thread, once: its event queries run beside other libraries' graph
    captures. In the driver's default mode a thread may not query while another thread
    captures in global mode (torch.cuda.graph's default): refused (CUDA_ERROR_STREAM_CAPTURE_
    UNSUPPORTED), and that capture is invalidated -- sharedmem's own background polling would
    break a capture the user began after launching. In relaxed mode it may: the events it
    asks about are sharedmem's, never recorded inside a capture. (Its queries exchange modes
    per call, as every thread's do; this standing mode covers its other calls too: events
    made and destroyed, finished work's memory and IPC imports released.) Never raises: where
    the driver refuses (a forked child, whose CUDA is unusable) or is gone, the retirer asks
    in the default mode, as before. ``driver``: cuda.bindings' driver module (None: gone)."""
    if driver is None:
        return
    try:
        driver.cuThreadExchangeStreamCaptureMode(
            driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    except Exception:
        pass


#: CU_STREAM_CAPTURE_MODE_RELAXED, the value of CUstreamCaptureMode
_RELAXED = cython.declare(cython.int, 2)


def _relax(hot):
    """Put the calling thread in relaxed stream-capture mode for one event query or wait of
    sharedmem's; returns what :func:`_unrelax` gives back (None: nothing changed). In the
    driver's default mode a thread may not query or wait for an event while another thread
    captures a graph in global mode (torch.cuda.graph's default), nor while it captures one
    itself: the call is refused and invalidates that capture -- a launch's sweep of finished
    work, ``done()`` or ``result()`` in a user thread would break another library's capture.
    In relaxed mode it may: the events asked about are sharedmem's, never recorded inside a
    capture (nothing is recorded on a capturing stream). The mode is the thread's own (the
    capture checks of the user's own calls), so it is given back after each call, as torch's
    allocator does around its own queries. ``hot``: the backend's hot driver, or None."""
    if hot is not None:
        old = hot.exchange_capture_mode(_RELAXED)
        return None if old < 0 else old
    try:
        res = cu.cuThreadExchangeStreamCaptureMode(
            cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    except Exception:  # (a driver without the call: asked in the thread's mode, as before)
        return None
    return res[1] if res[0] == _SUCCESS else None


def _unrelax(hot, old) -> None:
    """Give the calling thread back the capture mode :func:`_relax` returned. Never raises."""
    if old is None:
        return
    try:
        if hot is not None:
            hot.exchange_capture_mode(old)
        else:
            cu.cuThreadExchangeStreamCaptureMode(old)
    except Exception:
        pass


#: The context this module last made current, per thread (every device's backend shares it;
#: with a hot driver, ensure_context asks the driver instead).
_current = threading.local()
_ctx_out = threading.local()  # (_HotDriver.current_context's out parameter, per thread)
#: How many devices have a backend. With one and no hot driver, ``_current`` is the truth for
#: our own calls; with several, ensure_context asks the driver (written under device.py's
#: lock).
_backends = [0]


_arena_lock = fork_safe(threading.Lock())  # (makes each device's allocation arena once)


class CudaBackend:
    """Memory, streams, events and copies for one CUDA device."""

    kind = "cuda"
    needs_polling = True  # the retirer polls event queries while work is pending

    def __init__(self, ordinal: int):
        if _load_driver() is None:
            raise BackendUnavailableError(
                "the CUDA backend needs cuda-bindings (cuda-python) and CuPy: "
                "pip install 'sharedmem-gpu[cuda13]' (or '[cuda12]' for CUDA 12 drivers)")
        try:
            import cupy
        except ImportError:
            raise BackendUnavailableError(
                "the CUDA backend takes its memory from CuPy's pool, and CuPy is not installed: "
                "pip install 'sharedmem-gpu[cuda13]' (or '[cuda12]')") from None
        except Exception as e:  # (an install that cannot load: no driver, a broken CUDA)
            raise BackendUnavailableError(
                f"the CUDA backend takes its memory from CuPy's pool, and CuPy does not import "
                f"here ({type(e).__name__}: {e})") from e
        self._cupy = cupy
        self.cu = cu  # the driver module, for destructors that run late
        why = _init()
        if why is not None:
            raise BackendUnavailableError(f"no usable CUDA driver or GPU here (cuInit: {why})")
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if count == 0:
            raise BackendUnavailableError("no CUDA device here (cuDeviceGetCount: 0)")
        if ordinal >= count:  # (a bad argument, as a negative one: errors.md)
            raise ValueError(f"CUDA device {ordinal} does not exist; this machine has {count} "
                             f"device(s), 0 to {count - 1}")
        self.ordinal = ordinal
        self.cu_device = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.name = check(cu.cuDeviceGetName(256, self.cu_device), "cuDeviceGetName") \
            .split(b"\0")[0].decode()
        h = bytes(check(cu.cuDeviceGetUuid(self.cu_device), "cuDeviceGetUuid").bytes).hex()
        self.uuid = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
        A = cu.CUdevice_attribute
        self.compute_capability = tuple(check(cu.cuDeviceGetAttribute(
            getattr(A, f"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_{m}"), self.cu_device),
            "cuDeviceGetAttribute") for m in ("MAJOR", "MINOR"))

        def attr(name):  # CU_DEVICE_ATTRIBUTE_<name>, 0 where the driver does not say
            a = getattr(A, "CU_DEVICE_ATTRIBUTE_" + name, None)
            if a is None:
                return 0
            try:
                return int(check(cu.cuDeviceGetAttribute(a, self.cu_device), "cuDeviceGetAttribute"))
            except CudaError:
                return 0
        # What a launch may ask for (0: not known, not checked).
        self.limits = Limits(tuple(attr("MAX_GRID_DIM_" + d) for d in "XYZ"),
                             tuple(attr("MAX_BLOCK_DIM_" + d) for d in "XYZ"),
                             attr("MAX_THREADS_PER_BLOCK"),
                             attr("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"))
        # Borrowed: the primary context is retained once and never released.
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.cu_device), "cuDevicePrimaryCtxRetain")
        self.context_handle = int(self.context)
        self.hot = _hot_driver()
        _backends[0] += 1
        # The driver entry points the compiled code calls through their addresses (0: not
        # known -- then through self.hot, or cuda.bindings); they live as long as self.hot
        addresses = self.hot.addresses if self.hot is not None else {}
        self.ctx_get_addr = addresses.get("cuCtxGetCurrent", 0)
        self.record_addr = addresses.get("cuEventRecord", 0)
        self.query_addr = addresses.get("cuEventQuery", 0)
        self.wait_addr = addresses.get("cuStreamWaitEvent", 0)
        self.graph_launch_addr = addresses.get("cuGraphLaunch", 0)
        self.capturing_addr = addresses.get("cuStreamIsCapturing", 0)
        self.exchange_addr = addresses.get("cuThreadExchangeStreamCaptureMode", 0)
        self.attributes_addr = addresses.get("cuPointerGetAttributes", 0)
        self.ensure_context()
        # Pooled events, and interprocess ones (ipc_event). list.append / list.pop are atomic
        # under the GIL.
        self._events = []
        self._ipc_events = []
        self._cupy_device = cupy.cuda.Device(ordinal)
        self._arena = None  # the CuPy stream whose pool arena sharedmem allocates from
        self._staged = 0  # bytes of pinned() memory alive; guarded by _stage_lock

    # -- context ------------------------------------------------------------
    def ensure_context(self) -> None:
        """Make this device's primary context current in the calling thread, if it is not.
        The driver is asked (``cuCtxGetCurrent``: compiled, through its address, a few
        nanoseconds; interpreted, through ctypes, 0.2-0.3 us), so a context another library
        made current is always seen, in both builds. Only without the hot driver (libcuda
        not loadable through ctypes) and with one device is the thread's last own switch
        trusted."""
        if cython.compiled:
            addr = cython.declare(cython.size_t, self.ctx_get_addr)
            if addr:
                ctx = cython.declare(cython.p_void, cython.NULL)
                cython.cast(ctx_get_fn_t, addr)(cython.address(ctx))
                if cython.cast(cython.size_t, ctx) != self.context_handle:
                    self.force_context()
                return
        hot = self.hot
        if hot is not None:  # (asked, as above: interpreted, through ctypes)
            if hot.current_context() == self.context_handle:
                return
        elif _backends[0] == 1:
            if getattr(_current, "ctx", None) is self.context:
                return
        elif int(check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")) == self.context_handle:
            _current.ctx = self.context
            return
        self.force_context()

    def call(self, name: str, *args):
        """``cu.<name>(*args)`` with this device's context current, checked (CudaError on
        failure) and unpacked as :func:`check` does."""
        self.ensure_context()
        return check(getattr(cu, name)(*args), name)

    def relaxed(self, fn, *args):
        """``fn(*args)`` in the driver's relaxed stream-capture mode, the calling thread's own
        mode given back after (as :func:`_relax` for queries): how sharedmem allocates,
        stages, maps and unmaps memory and synchronizes a stream of its own. While another
        library captures a graph in global mode (torch.cuda.graph's default) -- in any
        thread, this one too -- the driver refuses such a call from a thread in its default
        mode and invalidates that capture (probed on an H100: cuMemAlloc, cuMemFree,
        cuStreamQuery); what sharedmem touches this way is never part of that capture. As
        torch's caching allocator makes its cudaMalloc during a capture."""
        if cython.compiled:
            xaddr = cython.declare(cython.size_t, self.exchange_addr)
            if xaddr:  # (through its address: no Python call around an allocation)
                mode = cython.declare(cython.int, _RELAXED)
                relaxed = cython.declare(
                    cython.bint, cython.cast(exchange_fn_t, xaddr)(cython.address(mode)) == 0)
                try:
                    return fn(*args)
                finally:
                    if relaxed:
                        cython.cast(exchange_fn_t, xaddr)(cython.address(mode))
        hot = self.hot
        old = _relax(hot)
        try:
            return fn(*args)
        finally:
            _unrelax(hot, old)

    def force_context(self) -> None:
        """Make the context current without asking (a caller found another one current)."""
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        _current.ctx = self.context

    # -- peers --------------------------------------------------------------------------
    def can_access_peer(self, peer: "CudaBackend") -> bool:
        """Whether kernels on this device can read and write ``peer``'s memory
        (``cuDeviceCanAccessPeer``)."""
        return bool(check(cu.cuDeviceCanAccessPeer(self.cu_device, peer.cu_device),
                          "cuDeviceCanAccessPeer"))

    def enable_peer_access(self, peer: "CudaBackend") -> None:
        """Let this device's kernels reach ``peer``'s memory (``cuCtxEnablePeerAccess``, with
        this device's context current; already enabled is no error)."""
        self.ensure_context()
        err = cu.cuCtxEnablePeerAccess(peer.context, 0)[0]
        if err != _SUCCESS and int(err) != 704:  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            check((err,), "cuCtxEnablePeerAccess")

    # -- memory ---------------------------------------------------------------
    def allocate(self, nbytes: int, stream_impl=None):
        """A block of CuPy's pool (a ``cupy.cuda.MemoryPointer``, ``.ptr``), from an arena of
        sharedmem's own. CuPy's pool keeps a free list per stream and hands a block that a
        CuPy array freed out again at once to the next allocation made while that stream is
        current -- ordered only for work on that stream, while CuPy's kernels there may still
        read it. sharedmem uses its blocks on any stream, so it allocates while a stream of
        its own is CuPy's current one (made once, never given work): that arena holds only
        sharedmem's blocks, each returned only once every submission that leased it has
        finished. (Blocks CuPy frees elsewhere come to sharedmem only through CuPy's own
        free-and-retry when memory runs out.)"""
        with self._cupy_device:
            arena = self._arena
            if arena is None:
                with _arena_lock:  # (a leaf lock: creating a stream waits for no device work)
                    if self._arena is None:  # (CuPy's current device: this one)
                        self._arena = self._cupy.cuda.Stream(non_blocking=True)
                    arena = self._arena
            with arena:
                try:
                    # (relaxed: a pool that grows calls cudaMalloc, see relaxed())
                    return self.relaxed(self._cupy.cuda.alloc, max(nbytes, 1))
                except MemoryError as e:  # (CuPy's OutOfMemoryError: its words name no device)
                    raise MemoryError(
                        f"cannot allocate {nbytes} bytes on <Device cuda:{self.ordinal} "
                        f"{self.name}>: out of device memory ({e}; CuPy's pool gave back its "
                        f"cached blocks first). Release views no longer needed, wait for work "
                        f"in flight (its memory is freed once it finished: sm.synchronize()), "
                        f"or allocate less") from e

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory (``cuMemGetInfo``)."""
        free, total = self.call("cuMemGetInfo")
        return int(free), int(total)

    def pointer_info(self, ptr: int):
        """``(range_start, range_size, device_ordinal)`` of device memory at
        ``ptr`` (the driver allocation containing it), or None if the pointer
        is not device memory the driver knows (host memory, NULL, an address it never gave:
        the driver answers those with zeroed attributes). CudaError when the driver call
        itself fails (no usable context, a driver shut down): nothing can be said then."""
        self.ensure_context()
        if cython.compiled and self.attributes_addr and type(ptr) is int and 0 <= ptr < _PTR_END:
            return _pointer_info(self.attributes_addr, ptr)  # (C locals: no ctypes objects;
            # anything else converted by ctypes, as before)
        if self.hot is not None:
            return self.hot.pointer_info(ptr)
        P = cu.CUpointer_attribute
        attrs = [P.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, P.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                 P.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, P.CU_POINTER_ATTRIBUTE_MEMORY_TYPE]
        start, size, ordinal, memtype = check(cu.cuPointerGetAttributes(len(attrs), attrs, ptr),
                                              "cuPointerGetAttributes")
        if not memtype or int(memtype) != int(cu.CUmemorytype.CU_MEMORYTYPE_DEVICE):
            return None
        return int(start), int(size), int(ordinal)

    # -- streams and events -------------------------------------------------------
    def create_stream(self, name=None) -> CudaStreamImpl:
        h = self.call("cuStreamCreate", cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        return CudaStreamImpl(self, int(h), True, name)

    def default_stream(self) -> CudaStreamImpl:
        """The legacy default stream (handle 0), as CuPy's default stream."""
        return CudaStreamImpl(self, 0, False, "default")

    def borrow_stream(self, obj) -> CudaStreamImpl:
        """A CudaStreamImpl over a foreign stream (kept alive, never destroyed)."""
        read, handle = borrowed_handle(obj)
        impl = CudaStreamImpl(self, handle, False, None, external=obj)
        impl._read_handle = read
        return impl

    def stream_home(self, impl: CudaStreamImpl):
        """Where the CUDA stream of ``impl`` lives: ``(ordinal, context)``, its context (as an
        int) and that context's device; None where the driver cannot say. A raw handle says
        nothing else about its device (asked when a stream is first borrowed)."""
        # (_v2, CUDA 12.5: a green context's stream answers its device's primary context)
        for name in ("cuStreamGetCtx_v2", "cuStreamGetCtx"):
            try:
                r = getattr(cu, name)(impl.cu_stream)
            except (AttributeError, RuntimeError):  # (an older binding; an older driver: the
                continue                            # binding raises 'Function ... not found')
            if r[0] == _SUCCESS:
                ctx = r[1]
                break
        else:  # (neither says)
            return None
        if int(ctx) == self.context_handle:
            return self.ordinal, self.context_handle
        # another context: its device, asked with that context current for a moment (the
        # pop makes the calling thread's context the one it had, as _current says)
        check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            return int(check(cu.cuCtxGetDevice(), "cuCtxGetDevice")), int(ctx)
        finally:
            cu.cuCtxPopCurrent()

    def _event(self):
        """A pooled event, or a new one when the pool is empty."""
        events = self._events
        if events:  # (asked first: an empty pool then costs no raised and caught IndexError)
            try:
                return events.pop()
            except IndexError:  # another thread took the last one
                pass
        return self.call("cuEventCreate", cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)

    def record_marker(self, impl: CudaStreamImpl, pooled: bool = False) -> CudaMarker:
        """A marker recorded on ``impl`` now. ``pooled``: its event goes back to the pool when
        the marker is recycled; else the marker owns it. Raises CudaError (keeping no event)."""
        if pooled:  # (recorded as an open marker is: the pool, and the driver's entry point)
            m = _open_marker(impl)
            m.close_locked()
            if m._open_on is not None:  # (not recorded now: see close_locked)
                raise _legacy_joined_error(self, "order after")
            if m.error is not None:  # (its event back in the pool: close_locked)
                raise m.error
            return m
        if impl.handle == 0 and self.legacy_joined():  # (a record there: refused, and the
            raise _legacy_joined_error(self, "record an event after")  # capture invalidated)
        return self.marker_on_handle(impl.handle)

    def wait_on_handle(self, stream_handle: int, marker: CudaMarker) -> None:
        """Make a foreign stream (raw handle) wait for ``marker`` (caller holds
        core_lock when it may be open; CompletionUnknownError as in wait_marker)."""
        _stream_wait(self, stream_handle, marker)

    def marker_on_handle(self, stream_handle: int, pooled: bool = False) -> CudaMarker:
        """A marker recorded now on a stream of this device named by its raw handle (a
        foreign stream's too). ``pooled``: its event is the pool's, given back when the marker
        is recycled; else the marker owns it. Raises CudaError (keeping no event)."""
        self.ensure_context()
        ev = self._event() if pooled else \
            self.call("cuEventCreate", cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        try:
            err = _record(self, ev, int(ev), stream_handle)
            if err:
                raise _error(err, "cuEventRecord")
        except BaseException:  # (a handle the record refuses too: the event is not lost)
            if pooled:
                self._events.append(ev)
            else:
                self.cu.cuEventDestroy(ev)
            raise
        return CudaMarker(ev, self, pooled)

    def _capture_status(self, stream_handle: int):
        """``cuStreamIsCapturing`` of the stream of this device named by raw handle
        ``stream_handle``: ``(error code, status)`` (status 0: not capturing). Asking never
        invalidates a capture."""
        self.ensure_context()
        if cython.compiled and self.capturing_addr:  # (asked on every DLPack export to a
            # stream handle: through its address, not cuda.bindings' wrapper)
            c_status = cython.declare(cython.int, 0)
            err = cython.cast(capturing_fn_t, self.capturing_addr)(
                cython.cast(cython.p_void, cython.cast(cython.size_t, stream_handle)),
                cython.address(c_status))
            return err, c_status
        driver = self.cu  # (the module the backend was built with: see CudaMarker.__del__)
        err, status = driver.cuStreamIsCapturing(driver.CUstream(stream_handle))
        return int(err), int(status) if int(err) == 0 else 0

    def legacy_joined(self) -> bool:
        """Whether the legacy default stream of this device is joined to a capture now: a
        blocking stream of its context captures a graph (the driver answers
        CUDA_ERROR_STREAM_CAPTURE_IMPLICIT), and no event can be recorded there meanwhile."""
        return self._capture_status(0)[0] == _CAPTURE_IMPLICIT

    def foreign_capture_error(self, stream_handle: int):
        """The CaptureError a wait for the stream of this device named by raw handle
        ``stream_handle`` must raise, or None: that stream capturing a graph (a capture of
        another library's: sharedmem's own its callers refuse first, by name), or the legacy
        default stream (0, 1) while a blocking stream of this context captures -- the driver
        answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and a record there would fail and
        invalidate that capture. Another error: None (the record says it)."""
        err, status = self._capture_status(stream_handle)
        if err == 0:
            if int(status) == 0:
                return None
            return CaptureError(
                f"the stream of handle {stream_handle:#x} on cuda:{self.ordinal} is capturing a "
                f"CUDA graph that sharedmem did not start (cupy.cuda.Stream.begin_capture, "
                f"torch.cuda.graph); ordering work after it would draw that work into the "
                f"capture, recorded there and not run. Launch on that stream to capture the "
                f"work with it, or after its capture ends")
        if err != _CAPTURE_IMPLICIT:
            return None
        return CaptureError(  # (the capturing stream may be sharedmem's: one it borrowed)
            f"the legacy default stream of cuda:{self.ordinal} (handle {stream_handle:#x}) is "
            f"joined to a capture: a blocking stream of its context is capturing a CUDA graph "
            f"(sm.capture of a borrowed blocking stream, cupy.cuda.Stream.begin_capture, "
            f"torch.cuda.graph); ordering work after the legacy stream would draw that work "
            f"into the capture, recorded there and not run. Make a non-blocking stream the "
            f"library's current one (with cupy.cuda.Stream(non_blocking=True): ...), or "
            f"launch after the capture ends")

    def order_after_handle(self, impl, stream_handle: int) -> None:
        """Make stream ``impl`` (of any CUDA device) wait on the device for everything
        enqueued so far on a stream of this device named by its raw handle (a foreign
        producer's): a pooled event recorded there and waited for, given back at once (the
        wait is enqueued: a later record of the event changes nothing it waits for). Raises
        CudaError. Callers ask :meth:`foreign_capture_error` first (every handle of one
        launch before any wait)."""
        m = self.marker_on_handle(stream_handle, True)
        try:
            impl.wait_marker(m)
        finally:
            m.recycle()

    # -- copies: enqueue, then record the submission's marker -------------------------
    @property
    def stage_max(self) -> int:
        """The largest piece of a copy between the host and this device that goes through
        pinned memory at once (STAGE_MAX): larger copies go piece by piece (buffer.upload,
        buffer.download)."""
        return STAGE_MAX

    def pinned(self, n):
        """``n`` (1 to STAGE_MAX) bytes of pinned host memory, a NumPy ``uint8`` array: a copy
        between it and the device is enqueued without waiting, where the driver copies
        pageable memory synchronously. From CuPy's pinned pool, back there once the array
        died (kept by the submission of its copy until that retired: never freed to the
        driver, so no synchronization). None past STAGE_BUDGET bytes of it alive on this
        device, or where no pinned memory can be had."""
        # (a power of two: CuPy's pool lends a freed block again only for the same size and
        # never unpins one -- taken at their exact sizes, copies of varying lengths would
        # pin a new block for each length ever copied)
        size = 1 << max(n - 1, 511).bit_length()
        if cython.compiled:
            _stage_lock.acquire()
        else:  # (marked: see _stage_lock)
            was = enter_marked(_stage_lock, _in_stage)
        fits = self._staged + size <= STAGE_BUDGET
        if fits:
            self._staged += size
        _stage_lock.release()
        if not cython.compiled:
            leave_marked(_in_stage, was, _unstaged, _unstage_staged)
        if not fits:
            return None
        try:
            # (relaxed: CuPy's pinned pool first queries the events of its finished copies,
            # and a miss calls cudaHostAlloc -- see relaxed())
            out = np.ndarray((n,), np.uint8,
                             self.relaxed(self._cupy.cuda.alloc_pinned_memory, size))
            # (raises nothing once registered: finalize's __init__ has no interrupt check
            # after it filed the finalizer, and the caller's array is counted from there)
            weakref.finalize(out, self._unstage, size)
        except BaseException as e:  # not counted then -- also for an interrupt (a Ctrl-C
            self._unstage(size)     # while a fresh block is pinned): else counted forever
            if not isinstance(e, Exception):
                raise
            return None  # (pinned memory exhausted or refused: the caller copies pageable)
        return out

    def _unstage(self, size) -> None:
        if cython.compiled:
            _stage_lock.acquire()
        else:  # (staged where this thread's pinned() holds the lock: see _stage_lock)
            was = enter_or_stage_marked(_stage_lock, _in_stage, _unstaged, (self, size))
            if was is None:
                return
        self._staged -= size
        _stage_lock.release()
        if not cython.compiled:
            leave_marked(_in_stage, was, _unstaged, _unstage_staged)

    def _enqueue(self, impl, name: str, *args) -> CudaMarker:
        """``cu.<name>(*args, impl's stream)`` (checked, as :meth:`call`), then the marker."""
        self.call(name, *args, impl.cu_stream)
        return impl.submit_marker()

    def copy_htod(self, impl, dst_ptr: int, src) -> CudaMarker:
        return self._enqueue(impl, "cuMemcpyHtoDAsync", dst_ptr, src.ctypes.data, src.nbytes)

    def copy_dtoh(self, impl, dst, src_ptr: int) -> CudaMarker:
        return self._enqueue(impl, "cuMemcpyDtoHAsync", dst.ctypes.data, src_ptr, dst.nbytes)

    def copy_dtod(self, impl, dst_ptr: int, src_ptr: int, nbytes: int) -> CudaMarker:
        return self._enqueue(impl, "cuMemcpyDtoDAsync", dst_ptr, src_ptr, nbytes)

    def copy_strided(self, impl, dst_ptr: int, src_ptr: int, shape, byte_strides,
                     itemsize: int) -> CudaMarker:
        """Copy a strided layout into dense C order at ``dst_ptr``: 2-D copies, one per
        piece of :func:`copy_pieces` (enqueued in one call; the marker follows the last)."""
        width, height, pitch, pieces = copy_pieces(shape, byte_strides, itemsize)
        if pieces:
            p = cu.CUDA_MEMCPY2D()
            p.srcMemoryType = p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.srcPitch = pitch
            p.dstPitch = width
            p.WidthInBytes = width
            p.Height = height
            for i, (so, do) in enumerate(pieces):
                p.srcDevice = src_ptr + so
                p.dstDevice = dst_ptr + do
                try:
                    self.call("cuMemcpy2DAsync", p, impl.cu_stream)
                except CudaError as e:
                    e.enqueued = i > 0  # (the pieces before it run: submit leases them)
                    raise
        return impl.submit_marker()

    def copy_peer(self, impl, dst_ptr: int, dst_backend, src_ptr: int, src_backend,
                  nbytes: int) -> CudaMarker:
        """Copy between devices (``cuMemcpyPeerAsync``; no peer access needed) on ``impl``, a
        stream of either device."""
        return self._enqueue(impl, "cuMemcpyPeerAsync", dst_ptr, dst_backend.context, src_ptr,
                             src_backend.context, nbytes)

    def memset(self, impl, dst_ptr: int, byte: int, nbytes: int) -> CudaMarker:
        return self._enqueue(impl, "cuMemsetD8Async", dst_ptr, byte, nbytes)

    # -- CUDA IPC (sharedmem.ipc) -------------------------------------------------
    def ipc_mem_handle(self, base: int) -> bytes:
        """The 64-byte IPC handle of the driver allocation starting at ``base``."""
        return bytes(self.call("cuIpcGetMemHandle", base).reserved)

    def ipc_open_mem(self, handle: bytes) -> int:
        """Map another process's allocation here (peer access enabled lazily); its base."""
        h = cu.CUipcMemHandle()
        h.reserved = handle
        # (LAZY_ENABLE_PEER; relaxed as an allocation, see relaxed())
        return int(self.relaxed(self.call, "cuIpcOpenMemHandle", h, 1))

    def ipc_close_mem(self, base: int) -> None:
        """Unmap what :meth:`ipc_open_mem` mapped: from a finalizer, in whichever thread
        drops the mapping's last user (relaxed as a free, see :meth:`relaxed`)."""
        self.relaxed(self.call, "cuIpcCloseMemHandle", base)

    def ipc_event(self) -> tuple:
        """An interprocess event: ``(event, 64-byte handle)``; give it back with
        :meth:`ipc_event_done` once no importer can still be waiting for it."""
        try:
            return self._ipc_events.pop()
        except IndexError:
            pass
        F = cu.CUevent_flags
        ev = self.call("cuEventCreate",
                       int(F.CU_EVENT_DISABLE_TIMING) | int(F.CU_EVENT_INTERPROCESS))
        return ev, bytes(self.call("cuIpcGetEventHandle", ev).reserved)

    def ipc_event_done(self, pair) -> None:
        """Pool an interprocess event for the next export (list.append: atomic)."""
        self._ipc_events.append(pair)

    def record_event(self, ev, impl) -> None:
        """Record event ``ev`` on ``impl`` now (caller holds core_lock)."""
        self.call("cuEventRecord", ev, impl.cu_stream)

    def ipc_open_event(self, handle: bytes) -> CudaMarker:
        """Another process's interprocess event, as a marker that owns the opened event."""
        h = cu.CUipcEventHandle()
        h.reserved = handle
        return CudaMarker(self.call("cuIpcOpenEventHandle", h), self, False)

    # -- graphs: stream capture into a CUDA graph --------------------------------
    def begin_capture(self, impl: CudaStreamImpl) -> CudaStreamImpl:
        # (never the default stream: sm.capture refuses it first, and a Stream made for handle
        # 0, 1 or 2 is the default stream -- Stream.from_external)
        if impl.open_marker is not None:  # never record an event into the capture
            impl.open_marker.close_locked()
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self.call("cuStreamBeginCapture", impl.cu_stream, mode)
        impl.capturing = True
        return impl

    def end_capture(self, impl: CudaStreamImpl):
        """The CUgraph captured on ``impl`` (caller holds core_lock: a launch of another
        thread is either in the capture or after it, never enqueued into it after its end)."""
        impl.capturing = False
        try:  # (ended whatever the context: left capturing, the stream would record all later
            self.ensure_context()  # work into a graph that never runs, its futures done)
        except CudaError:
            pass
        return check(cu.cuStreamEndCapture(impl.cu_stream), "cuStreamEndCapture")

    def instantiate_graph(self, graph):
        """``(CUgraph, CUgraphExec, native exec handle)`` of a captured graph (no lock held:
        instantiation can take long)."""
        try:
            exec_ = self.call("cuGraphInstantiate", graph, 0)
        except Exception:
            cu.cuGraphDestroy(graph)
            raise
        return graph, exec_, int(exec_)

    def launch_graph(self, graph_exec, impl: CudaStreamImpl) -> CudaMarker:
        self.ensure_context()
        hot = self.hot
        if cython.compiled and self.graph_launch_addr:  # (through its address: no ctypes call)
            err = cython.cast(graph_launch_fn_t,
                              cython.cast(cython.size_t, self.graph_launch_addr))(
                cython.cast(cython.p_void, cython.cast(cython.size_t, graph_exec[2])),
                cython.cast(cython.p_void, cython.cast(cython.size_t, impl.handle)))
        elif hot is not None:
            err = hot.graph_launch(graph_exec[2], impl.handle)
        else:
            err = int(cu.cuGraphLaunch(graph_exec[1], impl.cu_stream)[0])
        if err:
            raise _error(err, "cuGraphLaunch")
        return impl.submit_marker()

    def destroy_graph(self, graph_exec) -> None:
        """Destroy a graph; never called while a replay of it is in flight
        (replays keep their Graph alive until they retire)."""
        self.cu.cuGraphExecDestroy(graph_exec[1])
        self.cu.cuGraphDestroy(graph_exec[0])



__all__ = ["CudaBackend", "CudaMarker", "CudaStreamImpl", "Limits", "check"]
