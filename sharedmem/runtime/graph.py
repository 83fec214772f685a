"""Graphs that own what they captured.

``with sm.capture(stream) as g:`` records the launches and copies submitted
to ``stream`` into a graph instead of running them (CUDA: stream capture into
a CUDA graph; host backend: the recorded tasks). ``g.replay(stream=None)``
runs the whole graph and returns a :class:`~sharedmem.DeviceFuture`.

What a graph owns and keeps alive, for its whole lifetime:

* its backend graph (CUDA: the ``CUgraph`` and its ``CUgraphExec``), and
* one view token, of kind ``"graph #N"``, per byte range its captured work
  touches. The tokens keep those allocations alive -- so a replay after the
  user dropped every captured buffer still reads valid memory -- and count as
  aliases: moving captured memory raises AliasError naming the graph until
  the graph is released or collected.

While capturing, submissions take no leases and make no cross-stream waits
(nothing runs; a capture cannot depend on work outside it); launches return
futures that are already done. Each replay is one ordinary submission with
fresh leases over every captured range, so a replay that conflicts with other
work is ordered or refused like any launch (and ordered after what an adapter
asks for: see ``Graph.before_replays``), and the backend graph stays alive
until its last replay has finished. Replays keep the executable and the
memory, not the Graph: once the user drops (or releases) the Graph, it is no
alias any more, even while a replay runs -- the replay's leases protect that
memory. Leaving the ``with`` block ends the
capture on every path; a capture left by an exception gives no graph.
"""

from __future__ import annotations

import itertools
import sys
import threading
from typing import TYPE_CHECKING

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from .. import _cython as cython

from .state import CAPTURING, RUNTIME, locked, log
from ..access import _hold_writes, check_policy
from ..allocation import ViewToken, _add_locked
from ..backends import COMPLETE
from ..errors import CaptureError, ReleasedError, SharedMemError
from . import submission as _sub
from .submission import Work, submit_plan
from .future import DeviceFuture, future_of
from ..stream import Stream, resolve_stream

__all__ = ["Graph", "capture", "graph"]

if TYPE_CHECKING:
    from types import TracebackType
    from typing import Any, Literal

    from ..device import Device
    from ..ops import DeviceOp

_ids = itertools.count(1)


class _Executable(Work):
    """Owns a backend graph (CUDA: ``CUgraph`` + ``CUgraphExec``; host: the
    recorded tasks) and destroys it when collected: after the Graph is gone
    and every replay that keeps it has retired. As a Work, it launches the graph (a replay
    submits it, with nothing made per call)."""

    __slots__ = ("backend", "handle", "launch")
    capturable = False  # (a replay cannot be captured: no escaped-capture warning)
    replays = True

    def __init__(self, backend, handle):
        if cython.compiled:
            self.native = True  # (on a CUDA stream: the compiled backend's cuGraphLaunch)
        self.backend = backend
        self.handle = handle
        self.launch = backend.launch_graph  # (bound once: no method lookup a replay)

    def enqueue(self, stream, config, payload):
        return self.launch(self.handle, stream._impl)

    def __reduce__(self):
        # (no copies: a copy would destroy the backend graph under the live one when it dies)
        raise TypeError("a graph's executable cannot be copied or pickled")

    def __del__(self):
        try:
            if sys is not None and not sys.is_finalizing():
                self.backend.destroy_graph(self.handle)
        except Exception:  # never raise from a destructor
            pass


class Graph:
    """Work captured once, replayed many times; see the module docstring for
    what it owns. Release it with ``release()`` (or ``with g:``); garbage
    collection does the same once no replay is in flight.

    Attributes: ``id``, ``device``, ``launches`` (the number of captured submissions)."""

    __slots__ = ("id", "device", "_uses", "_keep", "_exec", "_state", "launches",
                 "_lock", "_replay", "_before", "_steps", "_staged", "__weakref__")

    def __init__(self, device: Device) -> None:
        self.id = next(_ids)
        self.device = device
        # (allocation id, start, stop) -> [token, writes]; guarded by core_lock
        self._uses: dict = {}
        self._keep: list = []  # kernels and other objects the captured work needs
        self._exec = None
        self._state = "capturing"  # -> "ready" | "failed" | "released"; guarded by self._lock
        self._lock = threading.Lock()
        self.launches = 0  # submissions captured
        # (uses, keep, label) of every replay, fixed when the capture ends: replays then
        # build nothing. The uses hold the graph's own tokens, dead once it is released.
        self._replay = None
        # a marker recorded on the capturing stream as the capture began (see capture), until
        # it ends; guarded by core_lock
        self._before = None
        # key -> what each replay calls first (see before_replays); guarded by core_lock while
        # capturing (the steps too), fixed in _replay once the capture ended
        self._steps: dict = {}
        # id(uses) -> (uses, fn): what a launch's pack left for its record (see
        # after_recorded_locked), until it is recorded or the capture ends; guarded by core_lock
        self._staged = None

    def __repr__(self) -> str:
        n = len(self._uses)
        return (f"<Graph #{self.id} on {self.device}: {self.launches} captured, "
                f"{n} range{'' if n == 1 else 's'}, {self._state}>")

    # -- capture (called by submission.submit with core_lock held) ---------------
    def _record_locked(self, uses, enqueue, keep, label):
        # (this launch's, left by its pack: applied once it is recorded)
        staged = self._staged.pop(id(uses), None) if self._staged else None
        for tok, _ in uses:
            if not tok.live:
                raise ReleasedError(f"a {tok.kind} passed to {_sub.label_text(label)} was "
                                    f"released before the launch")
        try:
            marker = enqueue()  # recorded by the backend, not run
        except BaseException as e:
            # (part of the work recorded -- a later piece of a copy failed, or an interrupt:
            # the graph keeps what it touches, as _submit leases it, else every replay would
            # write into memory freed and reused meanwhile)
            if not isinstance(e, Exception) or getattr(e, "enqueued", False):
                self._file_uses_locked(uses, keep, staged)
            raise
        if marker is not None:
            marker.recycle()
        self.launches += 1  # (recorded: counted, and its memory kept, whatever staged raises)
        self._file_uses_locked(uses, keep, staged)
        sub = _sub.new_submission(None, 0, COMPLETE, None, None,
                                  f"{_sub.label_text(label)} (captured into graph #{self.id})")
        sub.state = _sub.RETIRED
        return sub

    def _file_uses_locked(self, uses, keep, staged=None) -> None:
        """Retain ``uses`` (and ``keep``) for the graph's lifetime, and apply what the
        launch's pack left for its record (``staged``: see :meth:`after_recorded_locked`);
        core_lock held. ``staged`` runs last: an error there leaves the work recorded with
        its memory kept, as every replay runs it."""
        kind = f"graph #{self.id}"
        for tok, writes in uses:
            key = (tok.allocation.id, tok.start, tok.stop)
            entry = self._uses.get(key)
            if entry is None:
                own = _add_locked(ViewToken(tok.allocation, kind, tok.start, tok.stop,
                                            tok.writable, tok.keep))
                self._uses[key] = [own, writes]
            else:
                if writes:
                    entry[1] = True
                if tok.writable:  # a later use through a writable view: as writable an alias
                    entry[0].writable = True  # (guarded by core_lock, as every token's fields)
        self._keep.extend(keep)
        if staged is not None and staged[0] is uses:  # (recorded, or part of it: every
            staged[1](self)                            # replay runs it)

    def before_replays(self, key, factory):
        """The step kept under ``key``, made by ``factory()`` the first time: every replay
        calls each step with its stream first, before its leases -- what an adapter orders a
        replay after that sharedmem does not track (interop's: the current streams of the
        libraries whose arrays a captured launch was given, as a launch of them is ordered).
        A step raises to refuse the replay. Called while capturing, with core_lock held (which
        guards the step's state too until the capture ends) -- by a plan's pack, through
        :meth:`after_recorded_locked`, so that a launch refused or failed after its pack adds
        no step."""
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = factory()
        return step

    def after_recorded_locked(self, uses, fn) -> None:
        """While capturing, core_lock held: ``fn(self)`` is called (core_lock held) once the
        launch whose leases are ``uses`` (the list its plan's ``pack`` is given) is recorded
        into this graph -- never where it is refused or fails after its pack, nor where it is
        not captured after all (the capture ended first: it ran)."""
        if self._staged is None:
            self._staged = {}
        self._staged[id(uses)] = (uses, fn)  # (uses kept: no other list gets its id meanwhile)

    # -- replay ----------------------------------------------------------------
    def replay(self, stream: Stream | object | None = None,
               policy: Literal["order", "reject"] | None = None) -> DeviceFuture[None]:
        """Run the graph on ``stream`` (default: the current stream of the graph's device,
        ``with stream:``, else its default stream -- on CUDA the legacy default stream) with
        fresh leases on everything it touches."""
        r = self._replay  # (one attribute read: set when the capture ends, dropped first thing
        # by release, under the graph's lock with the state)
        if r is None:
            raise self._unreplayable()
        uses, keep, label, executable, dev, steps = r
        if type(stream) is Stream and stream.device is dev:
            s = stream  # (the usual call: nothing to resolve)
        else:
            s = resolve_stream(stream, dev)
        if s._capture is not None:
            raise CaptureError(f"cannot replay graph #{self.id} into a capture on {s}")
        if steps is not None:
            if policy is not None:
                check_policy(policy)  # (as a launch does: refused before a step waits)
            for step in steps:
                step(s)
        # keeps the executable and (through the uses) the memory -- not this Graph. (A release
        # racing this replay makes submit() refuse it: its tokens are checked live there.)
        try:
            return future_of(submit_plan(s, uses, executable, None, None, keep, policy, label))
        except ReleasedError:  # (its own tokens: released by a release() racing this replay)
            raise self._unreplayable() from None

    def _unreplayable(self) -> CaptureError:
        return CaptureError(f"graph #{self.id} is {self._state}; only a finished capture can be "
                            f"replayed")

    # -- lifetime ----------------------------------------------------------------
    def release(self) -> None:
        """Give back the graph's view tokens now: captured memory can be moved
        again. Replays in flight keep their own leases; the backend graph is
        destroyed once none is left. Idempotent. CaptureError while it is being captured
        (what is captured so far would run without the memory it needs)."""
        with self._lock:
            if self._state == "released":
                return
            if self._state == "capturing":
                raise CaptureError(f"graph #{self.id} is being captured; release it after the "
                                   f"capture ends")
            if self._state != "failed":  # a failed capture keeps saying so
                self._state = "released"
            self._replay = None  # (first: replay() refuses from here on, whatever follows)
        with locked():
            toks = [e[0] for e in self._uses.values()]
            self._uses = {}
        # Drop everything the captured work needed: a released graph is never replayed
        # again, and its dead tokens would keep their allocations' memory. Replays in
        # flight hold what they need (executable, memory) by themselves.
        self._exec = None
        self._keep = []
        self._steps = {}
        for t in toks:
            t.release()

    def __enter__(self) -> Graph:
        """``with g:`` releases the graph as the block ends."""
        return self

    def __exit__(self, *exc: object) -> None:
        """:meth:`release`."""
        self.release()

    def __del__(self, _finalizing=sys.is_finalizing):
        try:  # the executable goes with the last replay that keeps it
            if not _finalizing():
                for entry in self._uses.values():
                    entry[0].release()
        except Exception:  # never raise from a destructor
            pass


class capture:
    """``with sm.capture(stream) as g:`` -- record what is submitted to
    ``stream`` into the Graph ``g`` instead of running it. Inside the block ``stream`` is
    also the current stream (as ``with stream:``): launches, ops and copies given no
    ``stream=`` are captured too."""

    __slots__ = ("stream", "graph", "_mine", "_recorder", "_joins")

    def __init__(self, stream: Stream | object) -> None:
        self.stream = Stream.from_external(stream)  # (a Stream: itself)
        self.graph = None
        self._mine = None  # the entering thread's capturing streams (CAPTURING.streams)
        self._recorder = None  # the backend's capture while it runs (see __exit__)
        self._joins = None  # the legacy default Stream this capture joins (a blocking stream's)

    def __enter__(self) -> Graph:
        s = self.stream
        if s._impl is s.device.default_stream._impl:
            # on CUDA the driver refuses the legacy default stream; on the host the default
            # stream is every thread's implicit stream: capturing it would swallow their work
            raise CaptureError(f"the default stream cannot be captured ({s}: other threads' "
                               f"work there would be recorded, not run); capture on a stream "
                               f"of your own: device.create_stream()")
        g = Graph(s.device)
        with locked():
            if s._capture is not None:
                raise CaptureError(f"{s} is already capturing graph #{s._capture.id}")
            # (what the end of a hold on the stream during the capture leases until: the work
            # given to it so far -- see joined_marker_locked)
            g._before = s.device.backend.record_marker(s._impl)  # (CudaError: nothing begun)
            dflt = s.device.default_stream
            legacy = dflt._impl
            joins = before_legacy = None
            if hasattr(legacy, "open_marker") and s._impl.syncs_with_legacy():
                # a blocking stream's capture joins the legacy default stream: an event
                # recorded there while it runs fails (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) and
                # would make the completion of the work given to it before unknown -- its
                # open marker, of that work, is recorded now; and what a hold's end there
                # leases until meanwhile (no work can join it then): a marker recorded now
                # (Stream._joined, see fresh_marker_locked; set once the capture has begun)
                if legacy.open_marker is not None:
                    legacy.open_marker.close_locked()
                if dflt._joined is None:
                    before_legacy = s.device.backend.record_marker(legacy)
                joins = dflt
            self._recorder = s.device.backend.begin_capture(s._impl)
            if joins is not None:
                if before_legacy is not None:
                    joins._joined = [before_legacy, 1]
                else:
                    joins._joined[1] += 1
                self._joins = joins
            s._capture = g
            RUNTIME.captures += 1
        self.graph = g
        try:  # (begun: whatever raises from here on -- an interrupt, a logging handler --
            # ends it, since `with` never calls __exit__ when __enter__ raised)
            mine = getattr(CAPTURING, "streams", None)
            if mine is None:
                mine = CAPTURING.streams = []
            self._mine = mine
            mine.append(s)
            log.debug("capture of graph #%d on %s begins", g.id, s)
            s.__enter__()  # the current stream too (last: see _end)
        except BaseException:
            self._end(True, None, None)
            raise
        return g

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        s, g = self.stream, self.graph
        with locked():  # (this block's capture, still going: else nothing is touched -- a second
            # exit would end whatever capture the stream began since, or find no list)
            if g is None or s._capture is not g or self._recorder is None:
                raise CaptureError(f"this capture block on {s} is not capturing (exited twice, "
                                   f"or never entered); nothing was changed")
        ended = None
        try:  # (a block ended in another thread or asyncio task: the capture ends all the same)
            s.__exit__(exc_type, exc, tb)
        except SharedMemError as e:
            ended = e
        except BaseException as e:  # (an interrupt: the capture ends all the same, then it
            return self._end(exc_type is not None, None, e)  # is raised)
        return self._end(exc_type is not None, ended, None)

    def _end(self, failed, ended, interrupted) -> Literal[False]:
        """End the capture (``s.__exit__`` done, or never entered: ``__enter__`` failed after
        the backend began). ``failed``: the block raised. ``ended``: an error that fails the
        capture; ``interrupted``: a BaseException that is not an Exception (KeyboardInterrupt),
        caught here or by the steps below -- the capture ends, gives no graph, and it is
        re-raised."""
        s, g = self.stream, self.graph
        exec_ = captured = None
        mine = self._mine
        if mine is not None and s in mine:
            mine.remove(s)  # (the entering thread's list, whichever thread ends the block)
        backend = s.device.backend
        with locked():  # (the capture ends with the stream's: no launch of another thread
            try:        # is enqueued into it after its end, none runs while _capture is set)
                captured = backend.end_capture(self._recorder)
                holds = s._holds[:s._nholds] if s._nholds else None
                if holds:
                    # holds opened before the capture and open still (no export to a
                    # capturing stream opens one): what their consumers gave the stream during
                    # it runs at every replay, so the graph keeps and leases their bytes, as
                    # end_holds_locked files those ending during the capture
                    g._file_uses_locked([(tok, _hold_writes(tok, s)) for tok in holds],
                                        [tok.keep for tok in holds])
            except Exception as e:
                ended = ended or e
            except BaseException as e:  # (the stream's capture is ended below all the same)
                interrupted = interrupted or e
            s._capture = None
            dflt = self._joins
            if dflt is not None:  # (the last capture joining it ends: events record there again)
                self._joins = None
                dflt._joined[1] -= 1
                if dflt._joined[1] == 0:
                    dflt._joined = None
            g._before = None  # (the hold ends filed with it keep it)
            g._staged = None  # (launches packed for it but never recorded: no steps)
            RUNTIME.captures -= 1
            self._recorder = None
        if captured is not None:  # (instantiated even when the block failed: that frees it)
            try:
                exec_ = backend.instantiate_graph(captured)
            except Exception as e:
                ended = ended or e
            except BaseException as e:  # (instantiation can take long: an interrupt there)
                interrupted = interrupted or e
        if ended is not None or failed or interrupted is not None:  # no graph
            with g._lock:
                g._state = "failed"
            if exec_ is not None:
                backend.destroy_graph(exec_)
            g.release()
            if interrupted is not None:
                raise interrupted
            if not failed:
                raise CaptureError(f"capture of graph #{g.id} on {s} failed: {ended}") from ended
            return False
        g._exec = _Executable(backend, exec_)
        with locked():
            uses = [(tok, writes) for tok, writes in g._uses.values()]
        with g._lock:
            # (uses, keep, label, executable, device, steps): everything a replay reads, in
            # one tuple published with the state -- replay() reads it once, without the lock
            g._replay = (uses, (g._exec,) + tuple(g._keep), f"replay of graph #{g.id}", g._exec,
                         g.device, tuple(g._steps.values()) or None)
            g._state = "ready"
        return False


def graph(op: DeviceOp[Any], stream: Stream | None = None) -> Graph:
    """Capture an op chain (``sm.op(...).and_then(...)``) into a Graph.
    ``stream``: the capturing stream (default: a new stream of the op's device, so that no
    other thread's work is captured with it)."""
    from ..launch import default_device_for
    from ..ops import DeviceOp
    if not isinstance(op, DeviceOp):
        raise TypeError(f"sm.graph takes a DeviceOp (sm.op(...), and_then, zip), got "
                        f"{type(op).__name__}; to capture launches, use `with sm.capture(stream)`")
    # (with no array arguments, the device op.submit() and launch() pick: the host for host
    # kernels on a GPU machine)
    c = capture((op._device() or default_device_for(op._adapter())).create_stream(
        "sharedmem-graph") if stream is None else stream)
    with c as g:
        op._submit_on(c.stream)
    return g

