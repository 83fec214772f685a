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

__all__ = ["consumer_stream", "current_consumers", "current_streams", "ordered_among"]


def _library_streams(dev) -> list:
    """The current stream objects on ``dev`` of CuPy and torch, of those imported (torch:
    and initialized)."""
    out = []
    cp, torch = sys.modules.get("cupy"), sys.modules.get("torch")
    if cp is not None:
        try:
            out.append(cp.cuda.get_current_stream(dev.ordinal))
        except Exception:  # a CuPy without that signature, or no CUDA: not a consumer here
            pass
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                out.append(torch.cuda.current_stream(dev.ordinal))
        except Exception:
            pass
    return out


def _handle_of(obj) -> int | None:
    h = getattr(obj, "ptr", None)  # cupy.cuda.Stream
    if h is None:
        h = getattr(obj, "cuda_stream", None)  # torch.cuda.Stream
    return h if isinstance(h, int) else None


def consumer_stream(dev, handle: int) -> Stream:
    """The sharedmem :class:`~sharedmem.Stream` of a consumer's raw CUDA stream ``handle`` on
    ``dev`` (see the module docstring): a stream's own handle, not a default stream's -- 1
    and 2 a DLPack export maps itself, 0 it refuses."""
    st = Stream.lookup(dev, handle)
    if st is not None:
        return st
    for obj in _library_streams(dev):
        if _handle_of(obj) == handle:
            return Stream.from_external(obj, dev)
    return Stream.from_external(handle, dev)


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
    for obj in _library_streams(dev):
        h = _handle_of(obj)
        if h is None or h == 0 or h == 1:
            continue  # (no handle, or the legacy default stream: already in)
        if h == 2:  # the calling thread's default stream: ordered after by the legacy one
            per_thread = True
            continue
        # (a Stream of that stream is alive: it keeps the object)
        st = Stream.lookup(dev, h) or Stream.from_external(obj, dev)
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
