"""Backends: ``host`` (no GPU needed) and ``cuda`` (cuda.bindings + CuPy's pool).

What the ownership core asks of a backend is written down here as ``typing.Protocol``
classes -- :class:`Backend`, :class:`StreamImpl`, :class:`Marker` -- and checked against both
backends by ``tests/test_api.py``. A backend for another device implements them; nothing in
the core looks at a backend's own names. (CUDA adds foreign-stream calls for the interop
bridges -- ``wait_on_handle``, ``marker_on_handle``, ``order_after_handle``,
``foreign_capture_error``, ``pointer_info``, ``borrow_stream`` -- which only CUDA bridges
call.)
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

#: What ``Marker.query()`` returns.
PENDING, DONE, UNKNOWN = 0, 1, 2


@runtime_checkable
class Marker(Protocol):
    """A point in a stream's work. ``query()``: 0 pending, 1 done, 2 unknown (``error`` says
    why). ``recorded``: False while a lazily recorded marker is still open."""

    error: Any
    recorded: bool

    def query(self) -> int: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def recycle(self) -> None: ...


@runtime_checkable
class StreamImpl(Protocol):
    """A backend's stream. ``fault``: the error that made its completion unknown, or None;
    ``throttle``: a callable the core calls (holding no lock) before enqueueing, or None;
    ``submit_marker()``: a marker reached once everything enqueued so far has run (caller
    holds the core lock; the CUDA backend joins the stream's batched open marker)."""

    handle: int
    fault: Any
    throttle: Any

    def submit_marker(self) -> Marker: ...
    def wait_marker(self, marker: Marker) -> None: ...
    def synchronize(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """A device's memory, streams, copies and graphs. Every enqueueing call returns the
    :class:`Marker` of the work it enqueued and never waits for the device; the core holds
    its lock around them (``runtime.state``)."""

    kind: str
    needs_polling: bool  # True: the retirer must poll markers (False: the backend wakes it)
    stage_max: int  # host <-> device copies go through pinned() in pieces this large (0: not)

    def allocate(self, nbytes: int, stream_impl: Any = None) -> Any: ...
    def create_stream(self, name: str | None = None) -> StreamImpl: ...
    def default_stream(self) -> StreamImpl: ...
    def record_marker(self, impl: StreamImpl, pooled: bool = False) -> Marker: ...
    def pinned(self, n: int) -> Any: ...
    def copy_htod(self, impl: StreamImpl, dst_ptr: int, src: Any) -> Marker: ...
    def copy_dtoh(self, impl: StreamImpl, dst: Any, src_ptr: int) -> Marker: ...
    def copy_dtod(self, impl: StreamImpl, dst_ptr: int, src_ptr: int, nbytes: int) -> Marker: ...
    def copy_strided(self, impl: StreamImpl, dst_ptr: int, src_ptr: int, shape: tuple[int, ...],
                     byte_strides: tuple[int, ...], itemsize: int) -> Marker: ...
    def memset(self, impl: StreamImpl, dst_ptr: int, byte: int, nbytes: int) -> Marker: ...
    # A capture: begin_capture and end_capture under the core lock (fast, host-side only);
    # instantiate_graph without it (it may take long); its result is what launch_graph runs.
    def begin_capture(self, impl: StreamImpl) -> Any: ...
    def end_capture(self, recorder: Any) -> Any: ...
    def instantiate_graph(self, captured: Any) -> Any: ...
    def launch_graph(self, exec_: Any, impl: StreamImpl) -> Marker: ...
    def destroy_graph(self, exec_: Any) -> None: ...


class CompleteMarker:
    """The marker of work that will never run here (captured into a graph):
    complete at once, nothing to wait for, nothing to recycle."""

    __slots__ = ()
    error = None
    recorded = True
    handle = 0

    def query(self) -> int:
        return DONE

    def wait(self, timeout=None) -> bool:
        return True

    def recycle(self) -> None:
        pass


#: The one CompleteMarker (it has no state).
COMPLETE = CompleteMarker()


def copy_pieces(shape, byte_strides, itemsize):
    """How to copy a strided layout (non-negative byte strides) into a dense C-order one with
    2-D copies: ``(width, height, src_pitch, [(src_offset, dst_offset), ...])`` -- each piece
    copies ``height`` rows of ``width`` bytes, rows ``src_pitch`` bytes apart in the source
    and packed in the destination. The dense tail of the layout is one row; the dimension
    above it, when its pitch allows, the rows; every dimension above those, one piece per
    index (so a transposed matrix costs one piece per row: backends with a gather kernel
    may do better)."""
    dims = [(n, s) for n, s in zip(shape, byte_strides) if n != 1]
    if any(n == 0 for n, _ in dims):
        return itemsize, 0, itemsize, []
    width = itemsize
    while dims and dims[-1][1] == width:  # the dense tail: one row
        width *= dims.pop()[0]
    height, pitch = 1, width
    if dims and dims[-1][1] >= width:
        height, pitch = dims.pop()
    offsets = [0]
    for n, s in reversed(dims):  # one piece per index of the dimensions above, in C order
        offsets = [i * s + o for i in range(n) for o in offsets]
    step = width * height
    return width, height, pitch, [(o, k * step) for k, o in enumerate(offsets)]
