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
list of disjoint byte ranges (:class:`Span`), each tagged with the sequence
number and completion marker of the newest submission that touched it.
Repeated launches over the same range keep that list at length one.

Retirement does not visit trackers: a span whose sequence number is at most
its stream's ``_done`` (the newest retired submission there) is finished, and
is dropped the next time the tracker looks at that stream. Holds (open leases
of exports, see ``ViewToken.consumers``) are removed explicitly when they end.
A tracker holds its streams weakly (by ``_uid``): a stream the user dropped is
gone once its work retired -- its submissions keep it until then, its holds'
tokens while they are open -- and a stream that is gone has nothing unfinished.
"""

from __future__ import annotations

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from . import _cython as cython

import weakref
from typing import TYPE_CHECKING

from .errors import SharedMemError
from .runtime.state import RUNTIME

if TYPE_CHECKING:
    from .allocation import ViewToken  # (compiled: cimported; allocation imports this module)

__all__ = ["READ", "WRITE", "ATOMIC", "AccessTracker", "set_access_policy",
           "get_access_policy", "POLICIES", "HOLD_SEQ"]

READ = "read"
WRITE = "write"
ATOMIC = "atomic"

POLICIES = ("order", "reject")

#: The ``seq`` reported for a conflict with an open hold: newer than any submission, because
#: the marker made for it (recorded on the consumer's stream when the conflict is found) covers
#: everything that stream has been given so far.
HOLD_SEQ = 1 << 62
#: Disjoint byte ranges one stream's unfinished reads (or writes) of an allocation are kept
#: as, at the most; beyond, they merge into one (see _add_range).
MAX_SPANS = 32


def set_access_policy(policy: str) -> None:
    """Set the process-wide cross-stream policy: ``"order"`` (the later launch
    waits on the GPU for conflicting work on other streams) or ``"reject"``
    (such a launch raises :class:`~sharedmem.errors.AccessConflictError`).
    ``launch(..., policy=...)`` overrides it for one launch."""
    RUNTIME.policy = check_policy(policy)


def get_access_policy() -> str:
    """The process-wide cross-stream policy (``"order"`` or ``"reject"``)."""
    return RUNTIME.policy


def check_policy(policy) -> str:
    """``policy`` if it is one of :data:`POLICIES`; else SharedMemError saying which are."""
    if type(policy) is not str or policy not in POLICIES:  # (an array: no truth value asked)
        raise SharedMemError(
            f"unknown access policy {policy!r}; expected one of {', '.join(map(repr, POLICIES))}")
    return policy


class Span:
    """Bytes ``[lo, hi)`` touched by submission ``seq`` of one stream (``marker``: its
    completion marker). guarded by core_lock."""

    __slots__ = ("lo", "hi", "seq", "marker")  # (made by _span below: no constructor call)


# The factory of the record made under the lock on the hot paths: the fields set directly
# (compiled, a constructor call parses its arguments: about 500 instructions more a record).
def _span(lo, hi, seq, marker):
    e = Span.__new__(Span)
    e.lo = lo
    e.hi = hi
    e.seq = seq
    e.marker = marker
    return e


def _hold_writes(tok, stream) -> bool:
    """Whether the consumer on ``stream`` may write through hold ``tok``: its entry in the
    token's ``consumers`` (a hold that is ending counts as writing: the safe answer)."""
    for c in tok.consumers or ():
        if c[0] is stream:
            return c[1]
    return True


class StreamUse:
    """One stream's unfinished accesses to one allocation: ``reads`` and ``writes``, lists of
    disjoint :class:`Span`; ``holds``, the view tokens open as holds for work on this stream
    (each once; bytes ``[tok.start, tok.stop)``, its mode its ``consumers`` entry for the
    stream: see :func:`_hold_writes`); ``newest``, the largest seq
    recorded (when it is finished, every span is). Each list is None until something is
    put in it (a launch new to an allocation makes one list, not three: a foreign array new
    to every launch made two empty lists more for the collector each time). guarded by
    core_lock."""

    __slots__ = ("reads", "writes", "holds", "newest", "ref")  # (made by _new_use)

    def prune(self, done) -> bool:
        """Drop the spans of submissions up to ``done`` (finished); True if nothing is left."""
        if self.newest <= done:
            self.reads = None
            self.writes = None
        else:  # (rebuilt only when a span finished: while the other work runs, no list is made)
            if self.reads and _any_done(self.reads, done):
                self.reads = [e for e in self.reads if e.seq > done]
            if self.writes and _any_done(self.writes, done):
                self.writes = [e for e in self.writes if e.seq > done]
        return not self.reads and not self.writes and not self.holds


def _new_use(stream):
    """A new StreamUse of ``stream`` (what ``StreamUse(stream)`` makes, without the
    constructor's call and argument parsing: one for every allocation new to a stream, a
    foreign array new to every launch among them)."""
    use = StreamUse.__new__(StreamUse)
    use.reads = None
    use.writes = None
    use.holds = None
    use.newest = 0
    use.ref = weakref.ref(stream)  # (its stream: None once gone, its work all retired)
    return use


def _any_done(entries: list, done) -> bool:
    for e in entries:
        if e.seq <= done:
            return True
    return False


def _add_range(entries: list, lo, hi, seq, marker, done) -> None:
    """Record ``[lo, hi)`` as touched by submission ``seq`` (newer than every entry's),
    dropping finished entries (seq up to ``done``). Invariant kept: the entries are disjoint.
    What ``[lo, hi)`` covers of an older entry now belongs to ``seq`` (work on one stream
    finishes in order: waiting for ``seq`` waits for the older one too); the older entry's
    parts outside it keep their own seq, so work on another stream that uses only those
    waits for no more than it must (chunk i of a buffer written, chunk i-1 read elsewhere).
    Above MAX_SPANS entries they are merged into their hull, tagged ``seq``: conservative,
    never a missed conflict, and the walks stay short."""
    if len(entries) < MAX_SPANS:  # (the usual: a new range beside unfinished ones, appended --
        for e in entries:         # no list rebuilt)
            if e.seq <= done or (e.lo < hi and lo < e.hi):
                break
        else:
            entries.append(_span(lo, hi, seq, marker))
            return
    keep = []
    for e in entries:
        if e.seq <= done:
            continue
        if e.lo < hi and lo < e.hi:  # overlapped: its parts outside [lo, hi) stay its own
            if e.lo < lo:
                keep.append(_span(e.lo, lo, e.seq, e.marker))
            if hi < e.hi:
                keep.append(_span(hi, e.hi, e.seq, e.marker))
        else:
            keep.append(e)
    if len(keep) >= MAX_SPANS:
        for e in keep:
            if e.lo < lo:
                lo = e.lo
            if e.hi > hi:
                hi = e.hi
        keep = []
    keep.append(_span(lo, hi, seq, marker))
    entries[:] = keep


def _newest_overlap(entries: list, lo, hi, best):
    if entries is None:
        return best
    for e in entries:
        if e.lo < hi and lo < e.hi and (best is None or e.seq > best.seq):
            best = e
    return best


class AccessTracker:
    """The unfinished accesses (leases) and open holds of one allocation, by stream.

    Holds the completion markers of work in flight, and its streams weakly (see the module
    docstring). Every method requires core_lock."""

    __slots__ = ("_uses", "_last", "_last_use")

    def __init__(self):
        # Stream._uid -> StreamUse, or None while there is at most one: made when a second
        # stream comes (most allocations are used on one; a foreign array new to every launch
        # made a dict more for the collector each time). guarded by core_lock
        self._uses = None
        # The _uid of the stream recorded last (0: none) and its StreamUse (or None): launches
        # on one stream find it without a dict lookup. Invariants: _uses is None and _last_use
        # is the only StreamUse (or None, and _last 0); or _last == 0 or _uses[_last] is
        # _last_use. guarded by core_lock
        self._last = 0
        self._last_use = None

    def __bool__(self) -> bool:
        return bool(self.streams_locked())

    def uses_locked(self) -> dict:
        """The StreamUse of each stream with unfinished work or open holds, by ``_uid`` (the
        dict, made here from the one use where there was none)."""
        uses = self._uses
        if uses is None:
            uses = self._uses = {}
            if self._last_use is not None:
                uses[self._last] = self._last_use
        return uses

    def _use_of(self, stream):
        """``stream``'s StreamUse, made if needed (and remembered as the last one)."""
        uid = stream._uid
        if self._last == uid:
            return self._last_use
        if self._uses is None and self._last_use is None:  # (the first: no dict)
            use = _new_use(stream)
        else:
            uses = self.uses_locked()
            use = uses.get(uid)
            if use is None:
                use = uses[uid] = _new_use(stream)
        self._last = uid
        self._last_use = use
        return use

    def _drop(self, uid) -> None:
        if self._uses is not None:
            del self._uses[uid]
        if self._last == uid:  # (where there is no dict, the only one: uid is _last)
            self._last = 0
            self._last_use = None

    def elsewhere_locked(self, stream) -> bool:
        """Whether streams other than ``stream`` have unfinished accesses or open holds (the
        launch path's test: usually there are none, and no range is looked at)."""
        uses = self._uses
        n = (0 if self._last_use is None else 1) if uses is None else len(uses)
        if n == 0:
            return False
        uid = 0  # (stream None: no stream is skipped -- uid 0 is no stream's)
        if stream is not None:
            uid = stream._uid
            if n == 1 and (self._last == uid or (uses is not None and uid in uses)):
                return False
        uses = self.uses_locked()  # (another stream's, or several: the walk)
        dead = None  # (streams whose work all finished: dropped after the walk, not in it)
        for k, use in uses.items():
            if k == uid:
                continue
            s = use.ref()
            if s is None or use.prune(s._done):  # (gone: its work all retired)
                if dead is None:
                    dead = []
                dead.append(k)
        if dead is not None:
            for k in dead:
                self._drop(k)
        return len(uses) > (1 if uid in uses else 0)

    def conflicts_locked(self, stream, writes, lo, hi, exclude) -> list:
        """For each *other* stream with unfinished work that conflicts with an access
        ``[lo, hi)`` (a write when ``writes``) on ``stream``: the tuple
        ``(other_stream, marker, seq, other_writes)`` of its newest conflicting submission --
        or, for an open hold (a consumer's work of unknown extent),
        ``(other_stream, None, HOLD_SEQ, hold_writes)``: the caller records a marker on that
        stream now. Empty ranges conflict with nothing. ``exclude``: None (every hold
        counts), or ``(hold, streams)``: that hold token conflicts with nothing on those
        streams. Called only after :meth:`elsewhere_locked` said True, under the same hold of
        the lock: it pruned every other stream, and each use left has something unfinished."""
        out = []
        if lo >= hi:
            return out
        uid = 0 if stream is None else stream._uid  # (None: every stream is another)
        for k, use in self.uses_locked().items():
            s = use.ref()
            if k == uid or s is None:  # (gone since the walk that pruned: nothing unfinished)
                continue
            held = None
            if use.holds:
                ex = exclude[0] if exclude is not None and s in exclude[1] else None
                for h in use.holds:
                    if h.start < hi and lo < h.stop and h is not ex:
                        hw = _hold_writes(h, s)
                        if writes or hw:
                            held = hw if held is None else (held or hw)
            if held is not None:
                out.append((s, None, HOLD_SEQ, held))
                continue
            best = _newest_overlap(use.writes, lo, hi, None)
            other_writes = best is not None
            if writes:
                best = _newest_overlap(use.reads, lo, hi, best)
            if best is not None:
                out.append((s, best.marker, best.seq, other_writes))
        return out

    def record_locked(self, stream, writes, lo, hi, seq, marker) -> None:
        """Record an access by submission ``seq`` on ``stream``."""
        if lo >= hi:
            return
        use = self._last_use if self._last == stream._uid else self._use_of(stream)  # (no call)
        use.newest = seq
        entries = use.writes if writes else use.reads
        if entries is None:  # (the first of its kind: the list is made now)
            if writes:
                use.writes = [_span(lo, hi, seq, marker)]
            else:
                use.reads = [_span(lo, hi, seq, marker)]
            return
        # the same range again (the common case; with several ranges -- slices of one buffer,
        # torch tensors of one segment -- one of them): this access is its newest, finished or
        # not (the entries stay disjoint)
        for e in entries:
            if e.lo == lo and e.hi == hi:
                e.seq = seq
                e.marker = marker
                return
        if len(entries) == 1:  # (another range: kept apart by _add_range, unless finished)
            e = cython.cast(Span, entries[0]) if cython.compiled else entries[0]  # (Spans only)
            if e.seq <= stream._done:  # finished: this access alone is unfinished now
                e.lo = lo
                e.hi = hi
                e.seq = seq
                e.marker = marker
                return
        _add_range(entries, lo, hi, seq, marker, stream._done)

    @cython.boundscheck(False)  # (Stream._holds' indices below: under its length)
    @cython.wraparound(False)
    def add_hold_locked(self, stream, tok, lo, hi) -> None:
        """Open a hold of ``tok``, bytes ``[lo, hi)`` (its range), for work on ``stream`` (see
        ``StreamUse.holds``; its mode is the token's consumer entry, set by the caller)."""
        if lo >= hi:
            return
        use = self._use_of(stream)
        holds = use.holds
        if holds is None:
            use.holds = [tok]
        else:
            for h in holds:
                if h is tok:  # (held already: a stronger mode is in its entry)
                    return
            holds.append(tok)
        on = stream._holds  # (see Stream._holds: a stack, its entries past _nholds None)
        n = stream._nholds
        if on is None:
            stream._holds = [tok]
        elif n < len(on):
            on[n] = tok
        else:
            on.append(tok)
        stream._nholds = n + 1

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def drop_hold_locked(self, stream, tok) -> None:
        """Close ``tok``'s hold on ``stream`` (its end is then leased by a submission)."""
        use = self._last_use if self._last == stream._uid else \
            None if self._uses is None else self._uses.get(stream._uid)
        if use is None:
            return
        holds = use.holds
        for i in range(0 if holds is None else len(holds)):
            if holds[i] is tok:  # (a token holds once per stream: see add_hold_locked)
                del holds[i]
                on = stream._holds  # (the top first: the usual, an export used, then dropped;
                n = stream._nholds - 1  # the last entry moves into its place)
                j = n
                while j >= 0 and on[j] is not tok:
                    j -= 1
                if j >= 0:
                    on[j] = on[n]
                    on[n] = None
                    stream._nholds = n
                break
        # (newest unfinished: a span of it is left, so the use stays -- as after the lease a
        # hold's end files there -- and is not pruned now)
        if use.newest <= stream._done and use.prune(stream._done):
            self._drop(stream._uid)

    def streams_locked(self) -> list:
        """Streams with unfinished accesses or open holds (for diagnostics and tests)."""
        self.elsewhere_locked(None)  # (prunes every stream)
        return [s for s in (u.ref() for u in self.uses_locked().values()) if s is not None]


# -- a submission's leases, all at once (the launch path: one call, not one per lease) -----

@cython.boundscheck(False)  # (every index below its list's length by construction)
@cython.wraparound(False)
def leases_to_check_locked(stream, uses):
    """Of ``uses`` -- a submission's leases on ``stream``, ``(ViewToken, writes)`` pairs --
    those the submission must look at before it enqueues, in order: a token no longer live
    (refused), or one whose allocation another stream has unfinished work or open holds on
    (ordered after, or refused: see :meth:`AccessTracker.conflicts_locked`). None where there
    are none, the usual case. Caller holds core_lock."""
    uid = stream._uid
    out = None
    for u in uses:
        tok = cython.cast(ViewToken, u[0]) if cython.compiled else u[0]  # (a lease's token)
        tracker = tok.allocation.tracker
        by = tracker._uses
        n = (0 if tracker._last_use is None else 1) if by is None else len(by)
        # (elsewhere_locked's first answers without its call: no stream, or this one alone)
        if tok.live and (n == 0 or (n == 1 and tracker._last == uid) or
                         not tracker.elsewhere_locked(stream)):
            continue
        if out is None:
            out = [u]
        else:
            out.append(u)
    return out


@cython.boundscheck(False)
@cython.wraparound(False)
def record_leases_locked(stream, uses, seq, marker):
    """Record ``uses`` -- ``(ViewToken, writes)`` pairs -- as accesses by submission ``seq``
    on ``stream``, with completion ``marker`` (:meth:`AccessTracker.record_locked` of each
    token's bytes; its common case, the stream's last use of the allocation over the same
    range again, without the call). Returns what the leases' memory needs kept beyond the
    tokens: each token's ``keep`` that is not its allocation (a foreign producer), in a new
    list, or None where there is none. Caller holds core_lock."""
    uid = stream._uid
    keeps = None
    for u in uses:
        tok = cython.cast(ViewToken, u[0]) if cython.compiled else u[0]
        if tok.keep is not tok.allocation:  # (an allocation of ours is kept by its token)
            if keeps is None:
                keeps = [tok.keep]
            else:
                keeps.append(tok.keep)
        tracker = tok.allocation.tracker
        if tracker._last == uid:  # (an empty range matches no span: spans are never empty)
            use = tracker._last_use
            entries = use.writes if u[1] else use.reads
            if entries is not None and len(entries) == 1:
                e = cython.cast(Span, entries[0]) if cython.compiled else entries[0]
                if e.lo == tok.start and e.hi == tok.stop:  # the same range: its newest
                    use.newest = seq
                    e.seq = seq
                    e.marker = marker
                    continue
        tracker.record_locked(stream, u[1], tok.start, tok.stop, seq, marker)
    return keeps
