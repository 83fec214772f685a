"""``with sm.trace("run.json"):`` -- a timeline of what sharedmem ran, for Perfetto.

While the block runs, every submission (launch, copy, replay, a consumer's hold) is
recorded with its stream, label, leases and the cross-stream waits it was given; at the
end the file is written in the Chrome trace event format, which https://ui.perfetto.dev
and ``chrome://tracing`` open: one track per stream, one slice per submission from the
moment it was submitted to the moment sharedmem retired it (its leases' lifetime as the
host saw it -- not the kernel's run time on the device; a profiler such as Nsight Systems
shows that), an arrow-free marker for each wait on another stream's work, and the leased
byte ranges in each slice's arguments.

Cost: nothing while no trace is active (one pointer test per submission); while one is,
a few microseconds per submission. One trace at a time per process.
"""

from __future__ import annotations

import json
import threading
import time

from .errors import SharedMemError
from .runtime.state import RUNTIME, locked, log

__all__ = ["trace"]


class trace:
    """Record a timeline while the ``with`` block runs and write it to ``path`` (Chrome
    trace JSON; open it in https://ui.perfetto.dev). ``events`` holds the recorded
    events once the block has ended. See the module docstring for what a slice means."""

    def __init__(self, path):
        self.path = path
        self.events = []
        self._subs = {}  # id(submission) -> event dict, until it retires
        self._tids = {}  # stream -> track id
        self._lock = threading.Lock()  # guards _subs, _tids, events (a leaf lock)
        self._t0 = 0.0

    def __enter__(self) -> "trace":
        with locked():
            if RUNTIME.tracer is not None:
                raise SharedMemError("a sharedmem.trace is already recording in this process; "
                                     "end it first (one trace at a time)")
            self._t0 = time.monotonic()
            RUNTIME.tracer = self
        log.debug("trace to %s begins", self.path)
        return self

    def __exit__(self, *exc) -> None:
        with locked():
            if RUNTIME.tracer is self:
                RUNTIME.tracer = None
        now = time.monotonic()
        with self._lock:
            for ev in self._subs.values():  # still in flight: ends at the trace's end
                ev["dur"] = max(0.0, self._us(now) - ev["ts"])
                ev["args"]["state"] = "in flight at the end of the trace"
                self.events.append(ev)
            self._subs.clear()
            meta = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tid,
                     "args": {"name": str(stream)}} for stream, tid in self._tids.items()]
            self._tids.clear()
            self.events = meta + sorted(self.events, key=lambda e: e["ts"])
        with open(self.path, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms",
                       "otherData": {"producer": "sharedmem.trace"}}, f)

    # -- called by the runtime -----------------------------------------------------------
    def _us(self, t) -> float:
        return round((t - self._t0) * 1e6, 3)

    def _tid(self, stream) -> int:
        tid = self._tids.get(stream)
        if tid is None:
            tid = self._tids[stream] = len(self._tids) + 1
        return tid

    def submitted(self, sub, waits) -> None:
        """A submission was made (core lock held)."""
        ts = self._us(sub.t0)
        leases = [f"allocation #{tok.allocation.id} bytes [{tok.start}, {tok.stop}) "
                  f"{'write' if w else 'read'}" for tok, w in sub.uses or ()]
        with self._lock:
            tid = self._tid(sub.stream)
            self._subs[id(sub)] = {"ph": "X", "name": sub.label, "cat": "submission", "pid": 0,
                                   "tid": tid, "ts": ts,
                                   "args": {"seq": sub.seq, "leases": leases}}
            if waits:
                for other, (seq, _marker) in waits.items():
                    self.events.append({"ph": "i", "s": "t", "cat": "wait", "pid": 0,
                                        "tid": tid, "ts": ts,
                                        "name": f"waits for {other} (up to #{seq})"})

    def retired(self, subs) -> None:
        """Submissions left their stream's FIFO (retired, or kept as of unknown completion)."""
        now = self._us(time.monotonic())
        with self._lock:
            for sub in subs:
                ev = self._subs.pop(id(sub), None)
                if ev is not None:
                    ev["dur"] = max(0.0, now - ev["ts"])
                    ev["args"]["state"] = ("pending", "retired", "completion unknown")[sub.state]
                    self.events.append(ev)
