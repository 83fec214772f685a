"""Leases: what unfinished GPU work reads and writes, per allocation and byte range.

A launch takes one lease per array argument: ``read`` (``In``), ``write``
(``Out``, ``InOut``) or ``atomic`` (``Atomic``; tracked as a write even through
a read-only handle). A lease lives in the launch's submission until the GPU has
finished it -- independently of the future and of the argument objects -- and
is never counted as an alias by moves.

Cross-stream rule, per byte range: read + read on different streams is fine;
any pair with a write conflicts. Under the ``"order"`` policy (default) the
new launch's stream waits on the GPU for the conflicting work; under
``"reject"`` the launch raises :class:`~sharedmem.errors.AccessConflictError`.
Work on the same stream is ordered by the stream itself.

Because a stream runs its work in order, only the *newest* unfinished access
of another stream to a byte range matters: waiting for it waits for all older
ones. So each tracker keeps, per stream and per kind (reads / writes), a short
list of disjoint byte ranges, each tagged with the sequence number and
completion marker of the newest submission that touched it. Repeated launches
over the same range keep that list at length one.
"""

from __future__ import annotations

from .errors import SharedMemError

__all__ = ["READ", "WRITE", "ATOMIC", "AccessTracker", "set_access_policy",
           "get_access_policy", "POLICIES"]

READ = "read"
WRITE = "write"
ATOMIC = "atomic"
MODES = (READ, WRITE, ATOMIC)

POLICIES = ("order", "reject")
_policy = "order"


def set_access_policy(policy: str) -> None:
    """Set the process-wide cross-stream policy: ``"order"`` (the later launch
    waits on the GPU for conflicting work on other streams) or ``"reject"``
    (such a launch raises :class:`~sharedmem.errors.AccessConflictError`).
    ``launch(..., policy=...)`` overrides it for one launch."""
    global _policy
    _policy = check_policy(policy)


def get_access_policy() -> str:
    """The process-wide cross-stream policy (``"order"`` or ``"reject"``)."""
    return _policy


def check_policy(policy) -> str:
    if policy not in POLICIES:
        raise SharedMemError(
            f"unknown access policy {policy!r}; expected one of {', '.join(map(repr, POLICIES))}")
    return policy


#: The ``seq`` reported for a conflict with an open hold: newer than any submission, because
#: the marker made for it (recorded on the consumer's stream when the conflict is found) covers
#: everything that stream has been given so far.
HOLD_SEQ = 1 << 62


class _StreamUse:
    """One stream's unfinished accesses to one allocation.

    ``reads`` and ``writes`` are lists of ``[lo, hi, seq, marker]``: disjoint
    byte ranges, each with the newest submission (by per-stream sequence
    number) that touched it. ``holds`` lists ``[lo, hi, writes, token]``: the
    open holds of live tokens whose consumer works on this stream (see
    ``ViewToken.consumers``) -- work of unknown extent, ordered against by a
    marker recorded on this stream when a conflict is found. guarded by core_lock.
    """

    __slots__ = ("reads", "writes", "holds")

    def __init__(self):
        self.reads: list = []
        self.writes: list = []
        self.holds: list = []

    def __bool__(self) -> bool:
        return bool(self.reads or self.writes or self.holds)


def _add_range(entries: list, lo: int, hi: int, seq: int, marker) -> None:
    """Record ``[lo, hi)`` as touched by submission ``seq``, merging every
    entry it overlaps or touches (the merged entry carries the newest seq).
    Invariant kept: the entries are disjoint (a union of connected intervals
    is their hull, so one pass suffices)."""
    keep = []
    for e in entries:
        if e[0] <= hi and lo <= e[1]:
            if e[0] < lo:
                lo = e[0]
            if e[1] > hi:
                hi = e[1]
        else:
            keep.append(e)
    keep.append([lo, hi, seq, marker])
    entries[:] = keep


def _newest_overlap(entries: list, lo: int, hi: int, best):
    for e in entries:
        if e[0] < hi and lo < e[1] and (best is None or e[2] > best[2]):
            best = e
    return best


class AccessTracker:
    """The unfinished accesses (leases) of one allocation, by stream.

    Holds strong references to the streams and completion markers of work in
    flight, dropped when that work retires. Every method requires core_lock.
    """

    __slots__ = ("_uses",)

    def __init__(self):
        self._uses: dict = {}  # stream -> _StreamUse; guarded by core_lock

    def __bool__(self) -> bool:
        return bool(self._uses)

    def elsewhere_locked(self, stream) -> bool:
        """Whether streams other than ``stream`` have unfinished accesses (the
        launch path's test: usually there are none, and no range is looked at)."""
        held = self._uses
        return bool(held) and (len(held) > 1 or stream not in held)

    def conflicts_locked(self, stream, writes: bool, lo: int, hi: int) -> list:
        """For each *other* stream with unfinished work that conflicts with an
        access ``[lo, hi)`` (a write when ``writes``) on ``stream``: the tuple
        ``(other_stream, marker, seq, other_writes)`` of its newest conflicting
        submission -- or, for an open hold (a consumer's work of unknown extent),
        ``(other_stream, None, HOLD_SEQ, hold_writes)``: the caller records a
        marker on that stream now. Empty ranges conflict with nothing."""
        out = []
        if lo >= hi:
            return out
        for s, use in self._uses.items():
            if s is stream:
                continue
            held = None
            for h in use.holds:
                if h[0] < hi and lo < h[1] and (writes or h[2]):
                    held = h[2] if held is None else (held or h[2])
            if held is not None:
                out.append((s, None, HOLD_SEQ, held))
                continue
            best = _newest_overlap(use.writes, lo, hi, None)
            other_writes = best is not None
            if writes:
                best = _newest_overlap(use.reads, lo, hi, best)
            if best is not None:
                out.append((s, best[3], best[2], other_writes))
        return out

    def add_hold_locked(self, stream, tok, writes: bool) -> None:
        """Open a hold of ``tok``'s bytes for work on ``stream`` (see ``_StreamUse.holds``)."""
        if tok.start >= tok.stop:
            return
        use = self._uses.get(stream)
        if use is None:
            use = self._uses[stream] = _StreamUse()
        for h in use.holds:
            if h[3] is tok:
                h[2] = h[2] or writes
                return
        use.holds.append([tok.start, tok.stop, writes, tok])

    def drop_hold_locked(self, stream, tok) -> None:
        """Close ``tok``'s hold on ``stream`` (its end is then leased by a submission)."""
        use = self._uses.get(stream)
        if use is None:
            return
        use.holds = [h for h in use.holds if h[3] is not tok]
        if not use:
            del self._uses[stream]

    def record_locked(self, stream, writes: bool, lo: int, hi: int, seq: int, marker) -> None:
        """Record an access by submission ``seq`` on ``stream``."""
        if lo >= hi:
            return
        use = self._uses.get(stream)
        if use is None:
            use = self._uses[stream] = _StreamUse()
        entries = use.writes if writes else use.reads
        if len(entries) == 1:  # fast path: the same range again
            e = entries[0]
            if e[0] <= lo and hi <= e[1]:
                e[2] = seq
                e[3] = marker
                return
        _add_range(entries, lo, hi, seq, marker)

    def retire_locked(self, stream, seq: int) -> None:
        """Drop every access of ``stream`` by submissions up to ``seq``
        (they have completed: the stream runs in order)."""
        use = self._uses.get(stream)
        if use is None:
            return
        if use.reads:
            use.reads = [e for e in use.reads if e[2] > seq]
        if use.writes:
            use.writes = [e for e in use.writes if e[2] > seq]
        if not use:
            del self._uses[stream]

    def streams_locked(self) -> list:
        """Streams with unfinished accesses (for diagnostics)."""
        return list(self._uses)
