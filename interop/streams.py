"""Which stream a consumer library works on: the streams an export's hold is ordered on.

When memory is handed to another library (DLPack, the CUDA Array Interface, ``as_cupy``),
the export is a *hold*: while it lives, the consumer may use the bytes on its stream, and
when it ends the bytes stay leased on that stream until the stream has passed the point where
the hold ended (see ``sharedmem.runtime.submission.end_holds_locked``). This module names
that stream:

* a raw handle (DLPack's ``stream`` argument) becomes the sharedmem Stream of that CUDA
  stream; where the handle is the current stream of CuPy or torch, that library's stream
  object is kept alive with it, so the handle cannot be reused for another stream while the
  hold lasts. ``1`` (legacy) and ``2`` (per-thread default) map to the device's legacy
  default stream: an event recorded there follows all earlier work of every blocking stream,
  the per-thread default streams included.
* when the consumer names no stream (CAI, a DLPack consumer passing ``-1``), the
  conservative rule: the current streams of CuPy and torch on that device (for the libraries
  that are imported and initialized) and the legacy default stream.

Nothing here imports CuPy or torch: only libraries already imported are asked.
"""

from __future__ import annotations

import sys

from sharedmem.stream import Stream

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from sharedmem import _cython as cython

__all__ = ["consumer_stream", "current_consumers", "current_streams", "library_handle",
           "ordered_among"]


def library_handle(device, torch) -> int:
    """The raw handle of torch's (``torch`` true) or CuPy's current stream of ``device``; the
    library is imported (and torch's CUDA initialized: asking torch would initialize it). Read
    through the library's own C entry point where there is one -- torch's
    ``_cuda_getCurrentRawStream``, which its compiled kernels call (3 us less than
    ``torch.cuda.current_stream``), CuPy's ``get_stream_ptr`` (compiled only: see
    :func:`cupy_stream_entry`) -- else through the stream object."""
    if torch:
        t = _modules.get("torch")
        if t is not _torch[0]:  # (first use, or a module replaced since: tests do)
            _torch[1] = getattr(getattr(t, "_C", None), "_cuda_getCurrentRawStream", None)
            _torch[0] = t
        raw = _torch[1]
        return raw(device.ordinal) if raw is not None else \
            t.cuda.current_stream(device.ordinal).cuda_stream
    cp = _modules.get("cupy")
    if cp is not _cupy[0]:
        global _cupy_fn
        _cupy_fn = cupy_stream_entry(cp)
        if _cupy_fn or getattr(getattr(cp, "cuda", None), "get_current_stream", None) is not None:
            _cupy[0] = cp  # (not while CuPy is half imported, in another thread: asked again)
    if cython.compiled and _cupy_fn:
        return cython.cast(stream_ptr_fn_t, _cupy_fn)(device.ordinal)
    return cp.cuda.get_current_stream(device.ordinal).ptr


def cupy_stream_entry(cp):
    """Compiled only: the address of the C function CuPy's kernels ask for the current stream
    of a device (``cupy_backends.cuda.stream.get_stream_ptr(int device_id)``, which CuPy's
    Cython modules import from one another through its ``__pyx_capi__``), or 0: interpreted,
    a module ``cp`` that is not CuPy's (tests install stand-ins), or another signature than
    the one known (then :func:`library_handle` asks ``cupy.cuda.get_current_stream``).
    It reads the stream CuPy's kernels are launched on, which is that stream object's."""
    if not cython.compiled:
        return 0
    mod = _modules.get("cupy_backends.cuda.stream")
    get = getattr(getattr(cp, "cuda", None), "get_current_stream", None)
    if mod is None or getattr(get, "__module__", None) != "cupy.cuda.stream":
        return 0
    cap = getattr(mod, "__pyx_capi__", {}).get("get_stream_ptr")
    if cap is None or not PyCapsule_CheckExact(cap):
        return 0
    name = PyCapsule_GetName(cap)
    if name == cython.NULL or strcmp(name, b"intptr_t (int)") != 0:
        return 0
    return cython.cast(cython.size_t, PyCapsule_GetPointer(cap, name))


# [the module seen, torch's raw-stream entry point (None: none)] and [the cupy module seen],
# and CuPy's C entry point (compiled: see cupy_stream_entry); sys.modules. C globals where
# compiled: no dict lookups. Lock-free: a racing thread stores the same entries. Kept while
# the module is the same object (torch never replaces its entry point; a launch kept it so
# before, too).
_torch = cython.declare(list, [None, None])
_cupy = cython.declare(list, [None])
_cupy_fn = cython.declare(cython.size_t, 0)
_modules = cython.declare(dict, sys.modules)


def _library_handles(dev) -> list:
    """``(torch, handle)`` of CuPy's and torch's current streams on ``dev``, of the libraries
    imported (torch: and initialized)."""
    out = []
    if _modules.get("cupy") is not None:
        try:
            out.append((False, library_handle(dev, False)))
        except Exception:  # a CuPy without that signature, or no CUDA: not a consumer here
            pass
    torch = _modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                out.append((True, library_handle(dev, True)))
        except Exception:
            pass
    return out


def _borrowed(dev, handle, torch, named=True) -> Stream:
    """The Stream of the library's current stream ``handle``, which sharedmem has none of
    (callers look it up first): borrowed from the library's stream object -- the Stream keeps
    that object alive, so the handle cannot be reused for another stream while a hold on it
    lasts. Where the object
    names another stream than the handle read just before (a stand-in library, or foreign
    code run in between: CuPy's and torch's current streams are per thread), the object's
    Stream -- the library's current stream now -- unless a consumer ``named`` the handle, or
    the object names a default stream: then the bare handle."""
    try:
        obj = (_modules["torch"].cuda.current_stream(dev.ordinal) if torch else
               _modules["cupy"].cuda.get_current_stream(dev.ordinal))
    except Exception:
        obj = None
    if obj is not None:
        h = _handle_of(obj)
        if h == handle or (not named and h is not None and h > 2):
            return Stream._borrow(obj, dev)
    return Stream._borrow(handle, dev)


def _handle_of(obj) -> int | None:
    h = getattr(obj, "ptr", None)  # cupy.cuda.Stream
    if h is None:
        h = getattr(obj, "cuda_stream", None)  # torch.cuda.Stream
    return h if isinstance(h, int) else None


def consumer_stream(dev, handle: int) -> Stream:
    """The sharedmem :class:`~sharedmem.Stream` of a consumer's raw CUDA stream ``handle`` on
    ``dev`` (see the module docstring): a stream's own handle, not a default stream's -- 1
    and 2 a DLPack export maps itself, 0 it refuses."""
    st = Stream._find(dev, handle)
    if st is not None:
        return st
    for torch, h in _library_handles(dev):
        if h == handle:
            return _borrowed(dev, handle, torch)
    return Stream._borrow(handle, dev)


def current_streams(dev) -> list:
    """The conservative set of consumer streams on ``dev`` when the consumer names none:
    CuPy's and torch's current streams (where imported and initialized) and the legacy
    default stream, each once."""
    return _current(dev)[0]


def current_consumers(dev) -> tuple:
    """``(current_streams(dev), ordered)``: ``ordered`` whether a consumer on any of those
    streams is ordered after earlier work on any of them (:func:`ordered_among`) -- never
    where a library's current stream is the per-thread default stream, which stands for a
    different stream in each thread."""
    out, per_thread = _current(dev)
    return out, not per_thread and ordered_among(out)


def _current(dev) -> tuple:
    out = [dev.default_stream]
    per_thread = False
    for torch, h in _library_handles(dev):
        if h == 0 or h == 1 or type(h) is not int:
            continue  # (no handle, or the legacy default stream: already in)
        if h == 2:  # the calling thread's default stream: ordered after by the legacy one
            per_thread = True
            continue
        st = Stream._find(dev, h)
        if st is None:
            st = _borrowed(dev, h, torch, False)  # (borrowed from the library's object)
        if st not in out:
            out.append(st)
    return out, per_thread


def ordered_among(streams) -> bool:
    """Whether work on any of ``streams`` follows earlier work on every other: one stream,
    or the legacy default stream and one stream that synchronizes with it (a blocking
    stream: CuPy's are made that way; torch's and sharedmem's are not). Two blocking streams
    are not ordered with each other. A consumer known only to be on one of them is then
    ordered after anything given to any of them."""
    n = len(streams)
    if n != 2:
        return n == 1
    a, b = streams[0], streams[1]
    if b is b.device.default_stream:
        a, b = b, a
    return a is a.device.default_stream and b._impl.syncs_with_legacy()
