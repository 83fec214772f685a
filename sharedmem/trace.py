"""``with sm.trace("run.json"):`` -- a timeline of what sharedmem ran, for Perfetto.

While the block runs, every submission (launch, copy, replay, a consumer's hold) is
recorded with its stream, label, leases and the cross-stream waits it was given; at the
end the file is written in the Chrome trace event format, which https://ui.perfetto.dev
and ``chrome://tracing`` open: one track per stream, one slice per submission from the
moment it was submitted to the moment sharedmem retired it (its leases' lifetime as the
host saw it -- not the kernel's run time on the device; a profiler such as Nsight Systems
shows that), an arrow-free marker for each wait on another stream's work, and the leased
byte ranges in each slice's arguments.

NVTX: where the ``nvtx`` package is installed (``pip install nvtx``), the same block also
emits NVTX ranges in the ``sharedmem`` domain -- one per submission, started when it is
submitted and ended when it retires, named by its label (the kernel, the copy, the hold) --
so Nsight Systems shows sharedmem's work beside the kernels it ran. ``sm.trace(nvtx=True)``
without a path records NVTX ranges only; ``nvtx=False`` turns them off.

Cost: nothing while no trace is active (one pointer test per submission); while one is,
a few microseconds per submission. One trace at a time per process.
"""

from __future__ import annotations

import json
import os
import time

from .errors import BackendUnavailableError, SharedMemError
from .runtime.state import RUNTIME, at_fork_child, locked, log

__all__ = ["trace"]


def _nvtx_module(want):
    """The ``nvtx`` module for ``trace(nvtx=want)``: None when not wanted, or not installed
    and not asked for explicitly."""
    if want is False:
        return None
    try:
        import nvtx
    except ImportError:
        if want:
            raise BackendUnavailableError("sm.trace(nvtx=True) needs the nvtx package: "
                                          "pip install nvtx (or leave nvtx=None: ranges "
                                          "where it is installed)") from None
        return None
    return nvtx


class trace:
    """Record a timeline while the ``with`` block runs and write it to ``path`` (Chrome
    trace JSON; open it in https://ui.perfetto.dev), and emit NVTX ranges for Nsight Systems
    where the ``nvtx`` package is installed (``nvtx``: None = where installed, True = required,
    False = off; a path of None with NVTX on writes no file). ``events`` holds the recorded
    events once the block has ended. See the module docstring for what a slice means."""

    def __init__(self, path=None, *, nvtx=None):
        if path is not None and not isinstance(path, (str, bytes, os.PathLike)):
            # (an int would be taken by open() as a file descriptor: written, and closed)
            raise TypeError(f"sm.trace takes the path of its JSON file (a str, bytes or "
                            f"os.PathLike) or None, got {path!r}")
        self._nvtx = _nvtx_module(nvtx)
        if path is None and self._nvtx is None:
            raise TypeError("sm.trace needs a path for its JSON timeline, or nvtx=True "
                            "(NVTX ranges only)")
        self.path = path
        self.events = []
        # Guarded by the core lock (submitted() and retired() are called under it): no lock of
        # its own, which a finalizer ending a hold -- and so filing a submission -- while this
        # thread held it would wait for forever.
        self._subs = {}  # id(submission) -> (event dict, NVTX range or None), until it retires
        self._tids = {}  # stream._uid -> (track id, its name): never the stream (kept alive)
        self._t0 = 0.0
        self._pid = 0  # the process recording (a forked child does not: see _after_fork_child)

    def __enter__(self) -> "trace":
        if self.path is not None:  # (a path that cannot be written fails now, before any work:
            self.path = os.path.abspath(self.path)  # at the end it hid the block's own error)
            why = ("it is a directory" if os.path.isdir(self.path) else
                   None if os.access(os.path.dirname(self.path), os.W_OK) else
                   "its directory is missing or not writable")
            if why is not None:
                raise OSError(f"sm.trace cannot write {self.path!r}: {why}")
        with locked():
            if RUNTIME.tracer is not None:
                raise SharedMemError("a sharedmem.trace is already recording in this process; "
                                     "end it first (one trace at a time)")
            self._t0 = time.monotonic()
            self._pid = os.getpid()
            self.events = []  # (a trace used again records anew)
            RUNTIME.tracer = self
        log.debug("trace to %s begins", self.path)
        return self

    def __exit__(self, *exc) -> None:
        if self._pid != os.getpid():  # a forked child leaving the block: the parent's trace
            return
        now = time.monotonic()
        with locked():
            if RUNTIME.tracer is self:
                RUNTIME.tracer = None
            left, self._subs = self._subs.values(), {}
            for ev, _ in left:  # still in flight: ends at the trace's end
                ev["dur"] = max(0.0, self._us(now) - ev["ts"])
                ev["args"]["state"] = "in flight at the end of the trace"
                self.events.append(ev)
            meta = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tid,
                     "args": {"name": name}} for tid, name in self._tids.values()]
            self._tids.clear()
            self.events = meta + sorted(self.events, key=lambda e: e["ts"])
        error = None
        for _, r in left:  # still in flight: the range ends with the trace (NVTX only)
            if r is not None:
                try:  # (the file is written all the same: raised after it)
                    self._nvtx.end_range(r)
                except Exception as e:
                    if error is None:
                        error = e
        if self.path is not None:
            try:
                with open(self.path, "w") as f:
                    json.dump({"traceEvents": self.events, "displayTimeUnit": "ms",
                               "otherData": {"producer": "sharedmem.trace"}}, f)
            except OSError as e:
                if exc[1] is None:
                    raise
                # (the block's own error goes on: this one would replace it; the events are
                # in .events)
                log.warning("sm.trace could not write %s: %r (its events are in .events)",
                            self.path, e)
        if error is not None and exc[1] is None:  # (the block's own error goes on)
            raise error

    # -- called by the runtime -----------------------------------------------------------
    def _us(self, t) -> float:
        return round((t - self._t0) * 1e6, 3)

    def submitted(self, sub, waits) -> None:
        """A submission was made (core lock held)."""
        ts = self._us(sub.t0)
        leases = [f"allocation #{tok.allocation.id} bytes [{tok.start}, {tok.stop}) "
                  f"{'write' if w else 'read'}" for tok, w in sub.uses or ()]
        track = self._tids.get(sub.stream._uid)
        if track is None:  # a new stream: a new track
            track = self._tids[sub.stream._uid] = (len(self._tids) + 1, str(sub.stream))
        tid = track[0]
        r = None if self._nvtx is None else self._nvtx.start_range(
            message=f"{sub.label} on {sub.stream}", domain="sharedmem")
        self._subs[id(sub)] = ({"ph": "X", "name": sub.label, "cat": "submission", "pid": 0,
                                "tid": tid, "ts": ts, "args": {"seq": sub.seq, "leases": leases}},
                               r)
        if waits:
            for other, (seq, marker) in waits.items():
                what = f"up to #{seq}" if marker is not None else "a consumer's open hold"
                self.events.append({"ph": "i", "s": "t", "cat": "wait", "pid": 0, "tid": tid,
                                    "ts": ts, "name": f"waits for {other} ({what})"})

    def retired(self, subs) -> None:
        """Submissions left their stream's FIFO (retired, or kept as of unknown completion;
        core lock held)."""
        now = self._us(time.monotonic())
        error = None
        for sub in subs:
            ev, r = self._subs.pop(id(sub), (None, None))
            if ev is not None:
                ev["dur"] = max(0.0, now - ev["ts"])
                ev["args"]["state"] = ("pending", "retired", "completion unknown")[sub.state]
                self.events.append(ev)
            if r is not None:  # (NVTX only: one that fails to end loses no slice and leaves
                try:           # the others' ranges ending; raised once all were seen)
                    self._nvtx.end_range(r)
                except Exception as e:
                    if error is None:
                        error = e
        if error is not None:
            raise error


def _after_fork_child() -> None:
    # A trace records the process that began it: a child starts untraced (and may trace).
    RUNTIME.tracer = None


at_fork_child(_after_fork_child, 0)
