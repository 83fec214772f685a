"""Submissions: one enqueued piece of GPU work and everything it keeps.

A :class:`Submission` holds, until the device has finished the work:

* ``keep``: the objects that keep its memory valid (allocations we own, and
  producers of foreign memory) and anything else the work needs alive
  (kernel objects, packed argument buffers, DLPack capsules);
* its leases: entries in the access trackers of the allocations it touches,
  tagged with ``(stream, seq)``.

Each stream keeps its unretired submissions in a FIFO (``Stream._pending``, a list).
Retirement pops a FIFO from the front while the front's completion marker says
*done*, advances the stream's ``_done`` (which ends its leases: see
:mod:`sharedmem.access`) and drops ``keep`` -- the only way memory used by GPU
work is given back. If the marker says *unknown* (a faulted kernel, a sticky
CUDA error, a failed query), the submission and every later one on that
stream are moved to ``Runtime.leaked`` and kept forever: leaked on purpose,
warned once per stream, counted by :func:`sharedmem.stats`.

Every state change here happens under the core lock (``RUNTIME``: ``with locked():``); what a
retired submission kept is dropped after it (:func:`finish`), never under it.
"""

from __future__ import annotations

import contextlib
import threading
from functools import partial
from threading import get_ident as _get_ident
from time import monotonic as _monotonic
from time import sleep as _sleep

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from .. import _cython as cython

from ..access import HOLD_SEQ, check_policy, leases_to_check_locked, record_leases_locked
from ..allocation import ViewToken, register_token_locked, unregistered_token
from ..backends import COMPLETE, CompleteMarker
from ..stream import left_by_its_owner
from ..errors import AccessConflictError, CaptureError, CompletionUnknownError, KernelError, \
    LeakWarning, ReleasedError, SharedMemWarning
from . import callbacks as _callbacks
from .state import CAPTURING, RUNTIME, Hooks, at_fork_child, locked, log, warn_user

#: Submission states (Submission.state).
PENDING, RETIRED, UNKNOWN = 0, 1, 2
# the same, and what markers' query() says, as C constants where compiled
_PENDING = cython.declare(cython.int, 0)
_RETIRED = cython.declare(cython.int, 1)
_UNKNOWN = cython.declare(cython.int, 2)
_M_PENDING = cython.declare(cython.int, 0)
_M_DONE = cython.declare(cython.int, 1)
_M_UNKNOWN = cython.declare(cython.int, 2)

#: Sweep the front of a stream's FIFO on every SWEEP_EVERY-th submission to it (the retirer
#: does the rest): keeps FIFOs short without a query per launch. A completion event's batch
#: (backends.cuda.MARKER_BATCH): at 128 a launch loop kept enough submissions pending to set
#: off a young collection every ~150 launches (stubbed cuTile launch 13.6k -> 12.9k
#: instructions, DLPack export 16.8k -> 15.8k, reused launch 13.4k -> 13.8k); at 64, with a
#: new CuPy array each launch, every ~65 launches (32: 150 -> 11 young collections in 10,000
#: stubbed launches, interpreted).
SWEEP_EVERY = 32
_sweep_every = cython.declare(cython.longlong, SWEEP_EVERY)

#: Unretired submissions a CUDA stream may hold before the next one waits -- holding no lock
#: -- for the older half to finish (:func:`wait_for_room`). The driver queues about 1,020
#: launches a stream (1,021 behind a busy kernel on an H200: benchmarks/queue_depth.py); the
#: one after that blocks inside cuLaunchKernel, which the core calls holding its lock and the
#: GIL -- every thread of the process would wait for the GPU. Half that, so that work queued
#: on the stream by others (a CuPy launch there) has room too.
MAX_PENDING = 512
_max_pending = cython.declare(cython.Py_ssize_t, MAX_PENDING)

# The marker classes an enqueue returned whose every instance has ``query`` (see
# _query_of_each; at most _MARKER_TYPES_MAX, the backends' few): a launch whose marker is of
# one skips hasattr(), an attribute lookup through the type's dicts (some 250 instructions a
# launch: a cuTile launch's enqueue is not native) -- kernels of several backends alternating
# too. (A C global where compiled; set operations are atomic under the GIL: a racing thread at
# worst checks one more marker.)
_marker_types = cython.declare(set, set())
_MARKER_TYPES_MAX = 8


@cython.freelist(64)
@cython.cclass
class Submission:
    """One piece of enqueued work; see the module docstring for what it keeps."""

    __slots__ = ("stream", "seq", "marker", "keep", "uses", "state", "callbacks", "value",
                 "_label", "t0")

    @property
    def nbytes(self) -> int:
        """Bytes leased (counted again for each lease of the same bytes)."""
        return sum(tok.stop - tok.start for tok, _ in self.uses or ())

    @property
    def label(self) -> str:
        """What the work is, for messages (computed only when needed)."""
        return label_text(self._label)


class Work:
    """What enqueues work of one kind (kernel plans subclass it): ``enqueue(stream, config,
    payload)`` puts one piece on ``stream`` and returns its completion marker (see
    :func:`submit_plan`)."""

    # native (compiled only, a C field: False unless a constructor sets it): whether enqueue
    # runs no Python code on a CUDA stream -- C through, so no interrupt can land inside it
    # and _submit need not guard it (see _lease_interrupted_locked)
    __slots__ = ("native",)
    #: Whether a capture on another stream of the thread should have recorded this work
    #: (submit warns that it escaped): launches yes; a graph replay, which cannot be
    #: captured, no.
    capturable = True
    #: A graph replay: refused, not recorded, where its stream captures (another thread's
    #: capture may begin after replay() looked: submit decides under the core lock)
    replays = False

    def enqueue(self, stream, config, payload):  # pragma: no cover - overridden
        raise NotImplementedError


class _Arrival(Work):
    """An import's arrival (:func:`record_arrival`): its stream's completion marker, nothing
    enqueued that takes a slot of the driver's queue -- so it never waits for room there (see
    MAX_PENDING; event records and stream waits take none, ``benchmarks/queue_depth.py``)."""

    __slots__ = ()
    capturable = False  # (as before it was a Work: no escaped-capture warning)

    def enqueue(self, stream, config, payload):
        return stream._impl.submit_marker()


_ARRIVAL = _Arrival()
if cython.compiled:
    _ARRIVAL.native = True


def _keep_list(keep) -> list:
    """``keep`` as a new list: an iterable's items, or the one object."""
    if type(keep) is list or type(keep) is tuple:
        return list(keep)
    return [keep]


def new_submission(stream, seq, marker, keep, uses, label):
    """A PENDING Submission: how every one is made (no ``__init__`` call's overhead)."""
    sub = Submission.__new__(Submission)
    sub.stream = stream
    sub.seq = seq
    sub.marker = marker
    sub.keep = keep
    # the (token, writes) pairs it leased; never mutated, but for the lists of hold ends
    # that later ends join while it is its stream's newest (_lease_hold_end_locked)
    sub.uses = uses
    sub.state = _PENDING  # written under core_lock
    sub.callbacks = None  # list of callables; guarded by core_lock
    sub.value = None
    sub._label = label
    # when it was submitted (time.monotonic(); sm.inflight ages). _now: submission.pxd
    sub.t0 = _now() if cython.compiled else _monotonic()
    return sub


def label_text(label) -> str:
    """A submission label as text: a string, or ``(adapter, kernel)``, which is
    formatted only when a message needs it (never on the launch path)."""
    return label if isinstance(label, str) else label[0].label(label[1])


def submit(stream, uses, enqueue, keep=(), policy=None, label="work"):
    """Enqueue work on ``stream`` under the ownership rules; return its :class:`Submission`.

    ``uses`` lists ``(token, writes)`` pairs: the views the work touches (the caller validated
    devices and intents). ``enqueue``: a callable that puts the work on the stream and returns
    its completion marker. ``keep``: what the work needs alive besides the
    leases' memory (an iterable, or one object). Under the core lock, in order: every token is
    checked live and every conflict with unfinished work or open holds of other streams is
    found (policy ``reject`` raises here, having changed nothing); the stream is made to wait
    for the conflicting work; the work is enqueued; the leases are recorded. If anything
    raises, no lease is taken. This is the one algorithm every launch, copy and replay runs."""
    for u in uses:  # (the compiled core reads them unchecked: a wrong type is refused here)
        if type(u) is not tuple or len(u) != 2 or not isinstance(u[0], ViewToken):
            raise TypeError(f"submit() takes uses as (ViewToken, writes) pairs, got {u!r}")
    return _submit(stream, uses, enqueue, None, None, None, keep, policy, label, None)


def submit_plan(stream, uses, plan, config, payload, keep, policy, label):
    """:func:`submit` of one launch of a kernel plan (a :class:`Work`): ``plan.enqueue(stream,
    config, payload)`` is the work."""
    return _submit(stream, uses, None, plan, config, payload, keep, policy, label, None)


def submit_plan_checked(stream, uses, plan, config, payload, keep, policy, label, views):
    """:func:`submit_plan` of a launch planned earlier (a composite op's part), ``views`` its
    argument views: each is checked still usable under the core lock, as the leases are taken
    -- a move hands its token over live, so ``uses`` alone would not see a move made since
    the planning (by another thread, while an earlier part was submitted or this one waited
    for room on its stream): MovedError / ReleasedError, nothing leased or enqueued."""
    return _submit(stream, uses, None, plan, config, payload, keep, policy, label, views)


def escaped_capture(stream, label) -> None:
    """Warn about a launch onto ``stream`` (not capturing) while this thread captures on
    another stream of its device: it runs now and is not part of the graph -- as CUDA's
    thread-local capture mode allows, and almost never what was meant."""
    for s in getattr(CAPTURING, "streams", ()):
        if s.device is stream.device and s is not stream and s._capture is not None:
            warn_user(f"{label_text(label)} on {stream} runs now, outside graph "
                      f"#{s._capture.id} that this thread is capturing on {s}: launch on {s} "
                      f"(or without stream=) to record it, or launch outside the capture",
                      SharedMemWarning)
            return


@cython.boundscheck(False)  # (every index below its list's length by construction)
@cython.wraparound(False)
def _submit(stream, uses, enqueue, plan, config, payload, keep, policy, label, views):
    rt = RUNTIME
    if rt.warnings or rt.errors:
        raise_deferred()
    if policy is None:
        policy = rt.policy
    elif policy != "order" and policy != "reject":
        check_policy(policy)
    if not rt.retirer_running:  # (before anything is done: a thread that cannot start
        rt.ensure_retirer()     # fails the submission, which then changed nothing)
    if rt.captures and plan is not None and plan.capturable and stream._capture is None:
        escaped_capture(stream, label)
    impl = stream._impl
    if stream._checks:
        throttle = impl.throttle
        if throttle is not None:  # a bounded queue with no room waits here, holding no lock
            throttle()
    elif (len(stream._pending) >= _max_pending and stream._capture is None and
          plan is not _ARRIVAL):
        wait_for_room(stream)  # (a CUDA stream: the driver's queue is bounded, see MAX_PENDING)
    retired = None
    rt.acquire()
    try:
        if views is not None:
            for v in views:  # (moved or released by another thread since it was planned:
                v._live_token()  # MovedError / ReleasedError, as moves change state under
                # this lock -- before anything is recorded, waited for or leased)
        graph = stream._capture
        if graph is not None:  # recorded into a graph: no leases, no waits (see runtime/graph)
            if plan is not None and plan.replays:
                raise CaptureError(f"{label_text(label)} on {stream} refused: the stream began "
                                   f"capturing graph #{graph.id} (another thread), and a replay "
                                   f"cannot be captured; replay after the capture ends")
            if plan is not None:
                enqueue = partial(plan.enqueue, stream, config, payload)
            return graph._record_locked(uses, enqueue, _keep_list(keep), label)
        if stream._checks:
            fault = impl.fault
            if fault is not None:
                raise CompletionUnknownError(
                    f"{stream} faulted earlier ({fault!r}); the completion of its work is "
                    f"unknown, so nothing more can run on it. Create a new stream.")
        waits = None
        check = leases_to_check_locked(stream, uses)  # (usually None: nothing to look at)
        if check is not None:
            for u in check:
                tok = u[0]
                if not tok.live:
                    raise ReleasedError(f"a {tok.kind} passed to {label_text(label)} was "
                                        f"released before the launch")
                waits = _conflicts_locked(tok.allocation.tracker, stream, tok, u[1], policy,
                                          label, waits)
        if waits is not None:
            for other, (wseq, marker) in waits.items():
                if marker is None:  # an open hold: a marker recorded now (never noted)
                    marker = fresh_marker_locked(other, True)
                    try:
                        impl.wait_marker(marker)
                    finally:  # (the wait is enqueued: its event may be recorded again)
                        marker.recycle()
                else:
                    impl.wait_marker(marker)
                    note_waited_locked(stream, other, wseq, marker)
        if cython.compiled and plan is not None and plan.native and not stream._checks:
            marker = plan.enqueue(stream, config, payload)  # (C through: see Work.native)
        else:
            # Python code runs in it: an interrupt (KeyboardInterrupt from a signal handler)
            # landing there may leave the work on the stream already -- a host stream's task
            # queued, not yet returned -- with no lease. ``uses`` are then leased, keeping
            # ``keep``, until the stream passes this point (a marker recorded now), as the
            # work's would have been (a lease of work that was not enqueued only lasts until
            # the stream reaches here), and the interrupt re-raised. So is an error that says
            # part of the work was enqueued (``enqueued``: a later piece of a copy failed).
            # Any other Exception means the backend enqueued nothing: no lease.
            try:
                marker = plan.enqueue(stream, config, payload) if plan is not None else enqueue()
                if type(marker) not in _marker_types:  # (an adapter's enqueue: checked)
                    if marker is None or not hasattr(marker, "query"):
                        raise _no_marker(stream, label, marker)
                    if len(_marker_types) < _MARKER_TYPES_MAX and _query_of_each(type(marker)):
                        _marker_types.add(type(marker))  # (each of its markers has it)
            except BaseException as e:
                if not isinstance(e, Exception) or getattr(e, "enqueued", False):
                    _lease_interrupted_locked(stream, uses, keep, label)
                raise
        seq = stream._seq + 1
        stream._seq = seq
        # what the leases' memory needs beyond the tokens (foreign producers), or None
        keeps = record_leases_locked(stream, uses, seq, marker)
        if keeps is not None:
            keeps[:0] = _keep_list(keep)
        sub = new_submission(stream, seq, marker, keep if keeps is None else keeps, uses,
                             label)
        became_active = _filed_locked(rt, stream, sub, waits)
        if seq % _sweep_every == 0:
            # (opportunistic, after the work is enqueued and filed: a failing query must not
            # make a launch that ran look refused -- its future lost. Re-raised at the next
            # API call, as the retirer's failures are)
            try:
                retired = _sweep_locked(stream, False)
            except Exception as e:
                rt.errors.append(e)
    finally:
        rt.release()
    if retired:
        finish(retired)
    if became_active and rt.retirer_idle:
        rt.wake_retirer()  # it is sleeping its idle interval
    return sub


def _query_of_each(cls) -> bool:
    """Whether every instance of ``cls`` (a marker's class) has ``query``: its class has it, not
    through a data descriptor -- a property, a slot: those may raise AttributeError for one
    instance --, and the default attribute lookup reads it (no __getattribute__ of its own).
    (Once per new marker class: what _marker_types may remember.)"""
    for k in cls.__mro__:
        d = k.__dict__
        if "query" in d:
            t = type(d["query"])
            return (not (hasattr(t, "__set__") or hasattr(t, "__delete__"))
                    and cls.__getattribute__ is object.__getattribute__)
    return False  # (a metaclass' attribute, or its __getattr__: not the instances')


def _no_marker(stream, label, got) -> KernelError:
    """The error of an enqueue that returned ``got``, not its work's completion marker: what
    it may have queued stays leased until the stream passes this point (``enqueued``)."""
    e = KernelError(f"{label_text(label)} on {stream}: its enqueue returned {got!r:.80}, not "
                    f"the completion marker of the work it queued (what stream._impl.submit() "
                    f"or a backend's enqueueing call returns); fix its adapter. The arguments "
                    f"stay leased until the stream passes this point")
    e.enqueued = True
    return e


def _lease_interrupted_locked(stream, uses, keep, label) -> None:
    """The lease of an enqueue an interrupt cut short (see :func:`_submit`)."""
    try:
        marker = fresh_marker_locked(stream)
    except (CompletionUnknownError, CaptureError) as e:  # (the enqueued work's lease must be
        marker = FailedMarker(e)                          # filed: kept, never freed early)
    keeps = _keep_list(keep)
    keeps.extend([u[0].keep for u in uses])  # (foreign producers: what _submit keeps)
    lease_locked(stream, list(uses), keeps, label, marker)


def _filed_locked(rt, stream, sub, waits) -> bool:
    """Put ``sub``, its leases recorded, on ``stream``'s FIFO, count it and tell the trace
    (``waits``: what its stream was made to wait for); True when the stream just became
    active. The trace call never raises: the work is enqueued and its leases taken, and what
    keeps its memory is the submission in its stream's FIFO (an NVTX call or an adapter's
    label that fails is re-raised at the next API call). Caller holds core_lock."""
    pending = stream._pending
    pending.append(sub)
    if rt.tracer is not None:
        try:
            rt.tracer.submitted(sub, waits)
        except Exception as e:
            rt.errors.append(e)
    rt.in_flight += 1
    rt.submitted += 1
    if len(pending) == 1:
        rt.active.add(stream)
        return True
    return False


def _conflicts_locked(tracker, stream, tok, writes, policy, label, waits):
    """submit()'s cross-stream rule for one lease: raise for work of unknown completion or
    under policy "reject"; else add the newest conflicting submission of each other stream to
    ``waits`` (other stream -> (seq, marker or None for an open hold)) -- unless ``stream``
    already waited for that submission or a later one of its stream (see
    :func:`note_waited_locked`)."""
    waited = stream._waited
    for c in tracker.conflicts_locked(stream, writes, tok.start, tok.stop, None):
        other, marker, seq, other_writes = c[0], c[1], c[2], c[3]
        if marker is not None and marker.error is not None:  # (unknown completion)
            raise CompletionUnknownError(
                f"{label_text(label)} on {stream} would {'write' if writes else 'read'} bytes "
                f"[{tok.start}, {tok.stop}) of allocation #{tok.allocation.id}, which work of "
                f"unknown completion on {other} {'writes' if other_writes else 'reads'}; "
                f"that memory is kept but its contents cannot be trusted; do further work "
                f"on new memory (a new buffer), on a new stream")
        if policy == "reject":
            who = (f"unfinished work on {other} {'writes' if other_writes else 'reads'} "
                   f"them" if marker is not None else
                   f"a consumer on {other} holds them ({'may write' if other_writes else 'reads'})")
            raise AccessConflictError(
                f"{label_text(label)} on {stream} would {'write' if writes else 'read'} bytes "
                f"[{tok.start}, {tok.stop}) of allocation #{tok.allocation.id} while "
                f"{who} (policy 'reject'). Wait for that work (future.result() or "
                f"stream.synchronize()), use one stream for both, or use policy 'order' "
                f"to order them on the device.")
        if marker is not None and waited is not None and seq <= waited.get(other._uid, 0):
            continue  # ordered already: this stream waited for that work or later work
        if waits is None:
            waits = {}
        w = waits.get(other)
        if w is None or seq > w[0]:
            waits[other] = (seq, marker)
    return waits


#: Entries of a Stream's ``_waited`` at most; past it the record starts over (then only a
#: wait that was not needed is made again).
WAITED_MAX = 64
_waited_max = cython.declare(cython.Py_ssize_t, WAITED_MAX)


def note_waited_locked(stream, other, seq, marker) -> None:
    """``stream`` was just made to wait (on the device) for ``marker``, that of ``other``'s
    submission ``seq``, and so for everything before it: its later work needs no wait for any
    of that (a pipeline's handoff back, whose memory the first handoff already ordered). Not
    noted where the wait may order after nothing that runs: a marker recorded into a capture
    of ``other`` (a live stream's wait on it is a no-op), COMPLETE (captured work's), one whose
    record failed, any marker of a borrowed ``other`` (its owner may be capturing it, unseen).
    An open hold's wait is never noted (the caller does not ask). Caller holds core_lock."""
    waited = stream._waited
    if waited is None or other._waited is None or other._capture is not None or \
            marker is COMPLETE or marker.error is not None:
        return
    if len(waited) >= _waited_max:
        waited.clear()
    key = other._uid
    if seq > waited.get(key, 0):
        waited[key] = seq


class FailedMarker(CompleteMarker):
    """The marker of work whose completion cannot be known because its marker could not be
    recorded (the consumer's stream is gone, a sticky error): what it leases is kept forever.
    (As COMPLETE's, nothing to wait for or recycle.)"""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error

    def query(self) -> int:
        return _M_UNKNOWN


def fresh_marker_locked(stream, pooled=False):
    """A marker recorded on ``stream`` now: reached once everything given to the stream so
    far has finished (for an open hold, the consumer's work of unknown extent). While
    sharedmem captures on the stream, the one recorded as the capture began (``Graph._before``):
    the work given to it since runs only at replay -- an event recorded into the capture would
    mark nothing that runs now. On the legacy default stream while a blocking stream's capture
    joins it, the one recorded as that capture began (``Stream._joined``): a record there
    fails then. Caller holds core_lock (recording enqueues; it never waits).
    Raises CompletionUnknownError when it cannot be recorded; CaptureError, as the backend
    raised it, when it cannot be recorded now -- the legacy default stream while another
    library's capture of a blocking stream joins it: the work there is pending, not unknown."""
    graph = stream._capture
    if graph is not None:
        return graph._before
    joined = stream._joined
    if joined is not None:  # (the legacy default stream while a blocking stream's capture
        return joined[0]    # joins it: nothing can be given to it meanwhile)
    try:
        return stream.device.backend.record_marker(stream._impl, pooled)
    except CaptureError:
        raise
    except Exception as e:
        raise _unrecordable(stream, e) from e


def _unrecordable(stream, e) -> CompletionUnknownError:
    return CompletionUnknownError(
        f"cannot order after the work on {stream}: recording an event on it failed ({e!r}). "
        f"Was the consumer's stream destroyed while its hold was open?")


def lease_locked(stream, uses, keep, label, marker):
    """File ``uses`` -- ``(token, writes)`` pairs (a tuple or a list), live or not -- as leased
    on ``stream`` until ``marker`` is reached, keeping ``keep`` alive until then: the
    bookkeeping half of :func:`submit`, for work sharedmem did not enqueue itself (a
    consumer's, see :func:`end_holds_locked` and ``sharedmem.record_use``). Caller holds
    core_lock."""
    rt = RUNTIME
    seq = stream._seq + 1
    stream._seq = seq
    for u in uses:
        tok = u[0]
        tok.allocation.tracker.record_locked(stream, u[1], tok.start, tok.stop, seq, marker)
    sub = new_submission(stream, seq, marker, keep, uses, label)
    if _filed_locked(rt, stream, sub, None) and rt.retirer_idle:
        rt.wake_retirer()  # (as in submit: only a stream that just became active needs it)
    if not rt.retirer_running:
        # (last: the lease stands when it raises, and its stream is active -- a sweep retires
        # it; starting a thread waits for nothing that needs core_lock)
        rt.ensure_retirer()
    return sub


class _HoldEnd:
    """Names the lease of a hold's end, ``(_HOLD_END, kind)`` (see label_text)."""

    __slots__ = ()

    def label(self, kind) -> str:
        return f"end of a {kind} hold"


_HOLD_END = _HoldEnd()


def end_holds_locked(tok) -> None:
    """``tok``, a hold (``ViewToken.consumers``), was just released: its bytes stay leased on
    each consumer's stream until that stream passes this point -- a marker recorded there now,
    never a host synchronize. Caller holds core_lock; runs wherever the release happened (a
    DLPack deleter, a finalizer, any thread), so it never raises: a marker that cannot be
    recorded makes the lease's completion unknown, and the memory is kept (leaked on purpose,
    reported once). Filing a lease can still fail (the retirer thread cannot start): every
    hold is dropped all the same, and the first such error raised after the last."""
    consumers = tok.consumers
    tracker = tok.allocation.tracker
    error = None
    early = _early_ends.pop(tok, None) if _early_ends else None  # (see mark_hold_end)
    for c in consumers:
        stream = c[0]  # (a typed local: its fields are C reads)
        try:
            if early is not None and stream in early:
                _lease_hold_end_locked(stream, tok, c[1], early.pop(stream))
                continue
            _end_hold_locked(tok, stream, c[1])
        except BaseException as e:  # (the other streams' holds must end too)
            if error is None:
                error = e
        finally:
            # (after the lease: the stream's record in the tracker then stays, with the
            # lease's span, for the next export to that stream to find -- not dropped and made
            # again. Whatever the lease raised, the hold goes: nothing else could end it)
            tracker.drop_hold_locked(stream, tok)
    # (only now: while the holds are open their modes are read from it, access._hold_writes)
    tok.consumers = None
    if early:  # (marked on a stream whose entry ended before: end_left_consumers_locked)
        _recycle_marks(early)
    if error is not None:
        raise error


# The markers mark_hold_end recorded for a hold whose release was staged: ViewToken -> {its
# borrowed consumer Stream: marker}. Written lock-free (one store: atomic under the GIL), taken
# (popped) by end_holds_locked under the lock; almost always empty.
_early_ends = {}


def mark_hold_end(tok) -> None:
    """Hold ``tok`` is being released while another thread holds the core lock, so its end is
    filed later, by whoever drains the stage -- but its consumer may destroy a stream of its
    own as soon as the release returns (``cupy.from_dlpack`` under a ``cupy.cuda.Stream`` the
    user then drops), and a marker recorded then would go to a dead handle, or to another
    stream made on a reused one. So the point each borrowed consumer stream has reached is
    recorded now, without the lock (a pooled event and one cuEventRecord: lock-free), and
    end_holds_locked files the hold's end there. Streams that outlive the hold (sharedmem's own,
    the default stream) and streams whose marker is not recorded now (captured, or joined to a
    capture) are left to end_holds_locked, as is any stream whose record fails. Never raises
    (it runs in destructors)."""
    consumers = tok.consumers
    if consumers is None or not tok.live or tok.start >= tok.stop:
        return
    marks = None
    for c in consumers:
        stream = c[0]
        if stream._ours or stream._capture is not None or stream._joined is not None:
            continue
        on_handle = getattr(stream.device.backend, "marker_on_handle", None)
        if on_handle is None:  # (no foreign streams on its device: nothing can destroy it)
            continue
        try:
            m = on_handle(stream._impl.handle, True)
        except Exception:  # (end_holds_locked records it, or finds that it cannot)
            continue
        if marks is None:
            marks = {}
        marks[stream] = m
    if marks is None:
        return
    _early_ends[tok] = marks
    if not tok.live:  # (released meanwhile, through another path that may have missed them)
        _recycle_marks(_early_ends.pop(tok, None))


def _recycle_marks(marks) -> None:
    """Give back the events of markers mark_hold_end recorded and no lease took."""
    if marks:
        for m in marks.values():
            m.recycle()


def _end_hold_locked(tok, stream, writes) -> None:
    """File the lease that ends hold ``tok`` on consumer ``stream`` (``writes``: its mode)
    at a marker recorded there now. The caller drops the hold from the tracker after."""
    if tok.start < tok.stop:
        graph = stream._capture
        if graph is not None:
            # what the consumer gave its stream during the capture is recorded into
            # the graph and runs at every replay: the graph keeps these bytes, and
            # leases them at each replay, as for its own launches
            graph._file_uses_locked([(tok, writes)], [tok.keep])
        try:
            marker = joined_marker_locked(stream)
        except CompletionUnknownError as e:
            marker = FailedMarker(e)
        _lease_hold_end_locked(stream, tok, writes, marker)


def end_left_consumers_locked(tok, named) -> None:
    """End, now, hold ``tok``'s entries for consumer streams their owner has let go
    (:func:`sharedmem.stream.left_by_its_owner`: a ``cupy.cuda.Stream`` nothing but sharedmem
    keeps), each as the hold's end would (a lease until a marker recorded there now), except
    the streams in ``named`` -- the ones the caller is adding. Without this a long-lived view
    exported under a new CuPy stream per request kept every such stream, and its CUDA stream,
    alive as long as the view, and each conflicting launch waited on all of them. Caller
    holds core_lock. A lease that cannot be filed leaves that entry as it was (still held)."""
    consumers = tok.consumers
    if consumers is None or len(consumers) < 2:
        return
    left = [c for c in consumers if c[0] not in named and c[0]._capture is None and
            left_by_its_owner(c[0])]
    if not left:
        return
    tracker = tok.allocation.tracker
    for c in left:
        try:
            _end_hold_locked(tok, c[0], c[1])
        except Exception:  # (a lease not filed: the entry stays a hold, the safe side)
            continue
        tracker.drop_hold_locked(c[0], tok)  # (its mode is read from consumers until here)
        tok.consumers = tuple([k for k in tok.consumers if k is not c])


def _lease_hold_end_locked(stream, tok, writes, marker) -> None:
    """File the lease of the end of hold ``tok`` on ``stream`` until ``marker``. Ends given the
    same marker one after another -- ``cupy.from_dlpack`` in a loop: each export's end joins the
    stream's open marker -- share one submission. While it is the stream's newest and its marker
    is theirs, the next end of a hold of the same kind adds its pair to its ``uses`` and its
    ``keep`` (lists, made for this) and records its bytes under its seq: a list entry and a
    tracker record instead of a submission filed, swept and finished. What they keep is dropped
    together when that marker is reached, as separate submissions with that marker would be.
    Not while tracing: a trace shows every end. Caller holds core_lock."""
    pending = stream._pending
    rt = RUNTIME  # (a typed local: its tracer a C field read)
    if pending and rt.tracer is None:
        last = cython.cast(Submission, pending[-1]) if cython.compiled else pending[-1]
        label = last._label
        if last.marker is marker and type(label) is tuple and label[0] is _HOLD_END and \
                label[1] == tok.kind:
            # (a seq of its own, which the submission takes: seqs still grow along the FIFO,
            # and each end counts for sweep_long. Safe while the marker is open: nothing has
            # waited for it, so no stream noted an older seq of this submission as waited for)
            seq = stream._seq + 1
            stream._seq = seq
            last.seq = seq
            last.uses.append((tok, writes))
            last.keep.append(tok.keep)
            tok.allocation.tracker.record_locked(stream, writes, tok.start, tok.stop, seq, marker)
            return
    # (a new pair, not tok.use(): the released token keeps no lease pair, which would refer
    # back to it -- a cycle keeping its allocation until a collection; the label is formatted
    # only where a message needs it: see label_text)
    lease_locked(stream, [(tok, writes)], [tok.keep], (_HOLD_END, tok.kind), marker)


def joined_marker_locked(stream):
    """A marker reached once everything given to ``stream`` so far has finished, for work
    sharedmem did not enqueue (a hold's end). On a stream sharedmem owns, or the device's
    default stream -- streams that outlive the hold and that no other library destroys or
    captures behind sharedmem's back -- the stream's open marker where the backend batches
    them: recorded later, at the batch's end or when first asked, so after this point (the
    lease may last a little longer, never shorter), and a hold's end costs no driver call.
    While sharedmem captures on the stream, :func:`fresh_marker_locked`'s (the one recorded as
    the capture began). On a borrowed stream, one recorded now: its owner may destroy it (a
    later record would go to a dead handle) or begin a capture on it meanwhile.
    Caller holds core_lock. Raises CompletionUnknownError where recording failed."""
    # (stream._capture is set and cleared under core_lock with the impl's capture: a C field
    # read where compiled, not an attribute lookup on the impl; _join, its submit_marker bound)
    join = stream._join
    if join is None or stream._capture is not None or stream._joined is not None:
        return fresh_marker_locked(stream, True)
    try:
        return join()
    except Exception as e:
        raise _unrecordable(stream, e) from e



# -- retirement ------------------------------------------------------------------------------
def _done_prefix_locked(pending, record=True) -> int:
    """How many submissions at the front of ``pending`` have finished, in fewer queries than
    one per submission: a stream runs its work in order, so the finished ones are a prefix.
    The newest is asked first (one query retires a whole FIFO that has drained), then the
    oldest (one query when nothing has), then a bisection between them. Returns -1 when a
    query said *unknown*: the caller then walks the FIFO one by one.

    ``record=False`` (a submitter sweeping its own stream) leaves a marker that is not
    recorded yet alone: the submissions sharing it -- the FIFO's tail -- count as unfinished,
    and no event is recorded just to be asked at once."""
    n = len(pending)
    newest = pending[n - 1].marker
    if not record and not newest.recorded:
        lo, hi = -1, n - 1  # pending[hi] shares the open marker; pending[lo] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if pending[mid].marker is newest:
                hi = mid
            else:
                lo = mid
        n = hi
        if n == 0:
            return 0
    st = pending[n - 1].marker.query()
    if st == _M_DONE:
        return n
    if st == _M_UNKNOWN:
        return -1
    if n == 1:
        return 0
    st = pending[0].marker.query()
    if st == _M_PENDING:
        return 0
    if st == _M_UNKNOWN:
        return -1
    lo, hi = 0, n - 1  # pending[lo] is done, pending[hi] is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        st = pending[mid].marker.query()
        if st == _M_DONE:
            lo = mid
        elif st == _M_PENDING:
            hi = mid
        else:
            return -1
    return hi


def _sweep_locked(stream, record=True) -> list:
    """Retire the finished front of ``stream``'s FIFO. Caller holds core_lock. Returns the
    submissions that changed state, for :func:`finish` (every returned list must go through
    it exactly once). ``record``: see :func:`_done_prefix_locked`."""
    rt = RUNTIME
    pending = stream._pending
    if not pending:
        rt.active.discard(stream)
        return []
    k = _done_prefix_locked(pending, record)
    if k > 0:
        out = pending[:k]
        del pending[:k]
        for i in range(k):
            sub = cython.cast(Submission, out[i]) if cython.compiled else out[i]
            sub.state = _RETIRED
        stream._done = sub.seq  # ends every lease of this stream up to it (see access)
        rt.retired += k
        rt.in_flight -= k
    else:
        out = []
    if k < 0:  # a failed query: retire what finished, leak from the first unknown on
        while pending:
            sub = pending[0]
            if not record and not sub.marker.recorded:
                break
            try:
                st = sub.marker.query()
            except Exception:  # (the device's context cannot be made current: what this
                if not out:    # loop took still reaches finish(), and the next sweep asks
                    raise      # again; one that took nothing raises, as the first queries
                break          # do -- else a wait sweeping until its work leaves spins on)
            if st == _M_PENDING:
                break
            del pending[0]
            if st == _M_DONE:
                sub.state = _RETIRED
                stream._done = sub.seq
                rt.retired += 1
            else:
                sub.state = _UNKNOWN
                rt.leaked.append(sub)
                rt.leaked_count += 1
                rt.leaked_bytes += sub.nbytes
                if not stream._leak_warned:
                    stream._leak_warned = True
                    rt.warnings.append(  # (the stream's number: one text a stream, not
                        # deduplicated by Python's warning filter against another's)
                        f"completion of work on {stream} (stream #{stream._uid}) is unknown "
                        f"({sub.marker.error!r}); its "
                        f"memory and leases are kept, never freed (see sharedmem.stats().leaked). "
                        f"Create a new stream for further work.")
            rt.in_flight -= 1
            out.append(sub)
    if not pending:
        rt.active.discard(stream)
    rt.unfinished += len(out)
    for i in range(len(out)):
        sub = cython.cast(Submission, out[i]) if cython.compiled else out[i]
        if sub.callbacks is not None:  # (taken by callbacks.run_of: see callbacks.retiring)
            _callbacks.retiring[id(sub)] = (_get_ident(), sub)
    if out and rt.tracer is not None:
        # (under the lock, as submitted(): it guards the trace's state). Never raising: the
        # list must reach finish(), or what it keeps stays kept and settle() waits for it
        try:
            rt.tracer.retired(out)
        except Exception as e:  # (an NVTX call failing): re-raised at the next API call
            rt.errors.append(e)
    return out


#: Per thread: how many retired submissions this thread is finishing now (settle() does not
#: wait for those: a move inside a callback they run would wait for itself).
_finishing = threading.local()


def _after_fork_child() -> None:
    # Work another thread of the parent had retired but not finished (between its sweep and
    # finish()) is finished by nobody here: that thread does not exist in the child. What it
    # kept stays kept (a leak of the child's copy), but it is not counted unfinished, or
    # settle() would wait its whole timeout on every move that finds an alias. The forking
    # thread's own (a fork from a callback run by finish()) it finishes when it returns.
    RUNTIME.unfinished = getattr(_finishing, "n", 0)


at_fork_child(_after_fork_child, 0)


def finish(subs, hand_off=False) -> None:
    """Outside the lock: drop what retired work kept, run its callbacks (``hand_off``: give
    them to the callback workers instead). Every list a sweep returned goes through here
    exactly once (settle() counts on it)."""
    n = len(subs)
    mine = getattr(_finishing, "n", 0)
    _finishing.n = mine + n
    try:
        _finish(subs, hand_off)
    except BaseException:
        # An interrupt (KeyboardInterrupt from a signal handler, landing in a Python call
        # here: a host marker's recycle(), callbacks.run_of) or an error cut it short: what
        # the submissions after that point kept is dropped all the same, and their callbacks
        # go to the workers -- never lost (a then() of them would never finish) -- before it
        # is re-raised
        _finish_rest(subs)
        raise
    finally:
        _finishing.n = mine
        with locked():
            RUNTIME.unfinished -= n


def _finish(subs, hand_off=False) -> None:
    last = None
    for i in range(len(subs)):
        sub = subs[i]
        if sub.state == _RETIRED:
            sub.keep = None
            sub.uses = None
            m = sub.marker
            if m is not last:  # consecutive submissions often share one marker
                last = m
                m.recycle()
        if sub.callbacks:
            if hand_off or _get_ident() == _callbacks.retirer_ident[0]:
                _callbacks.hand_off(sub)  # (user code never runs on the retirer)
            else:
                _callbacks.run_of(sub)  # (errors surface at the next API call)


def _finish_rest(subs) -> None:
    """What :func:`_finish` left undone when it was cut short (each step is idempotent:
    dropping twice, a marker's recycle, handing off callbacks that are taken already --
    ``run_of`` finds None)."""
    for i in range(len(subs)):
        sub = subs[i]
        if sub.state == _RETIRED:
            sub.keep = None
            sub.uses = None
            with contextlib.suppress(Exception):
                sub.marker.recycle()
        if sub.callbacks:
            _callbacks.hand_off(sub)


def settle(timeout=1.0) -> None:
    """Retire what has finished, and wait (up to ``timeout``) until every retired submission
    has dropped what it kept -- so that a decision that counts live views (a move) never sees
    a view kept only by work that is done. Never waits for the device."""
    sweep_all()
    mine = getattr(_finishing, "n", 0)  # (this thread's: finished after the caller returns)
    if RUNTIME.unfinished <= mine:  # (a plain read of an int written under the lock; and
        return                      # nothing to wait for: ``timeout`` is not looked at)
    deadline = _monotonic() + timeout
    while RUNTIME.unfinished > mine and _monotonic() < deadline:
        _sleep(20e-6)


def sweep(stream, record=True) -> None:
    """Retire what has finished on ``stream`` (never blocks on the device). ``record``: see
    :func:`_done_prefix_locked`."""
    with locked():
        done = _sweep_locked(stream, record)
    if done:
        finish(done)


def wait_for_room(stream) -> None:
    """Wait until no more than half of ``MAX_PENDING`` submissions on ``stream`` are
    unfinished, then retire the finished ones: what a launch onto a CUDA stream that far ahead
    of its device does before it takes any lock (as CUDA's own launch waits for room in the
    driver's queue, but holding nothing other threads need). Caller holds no lock."""
    with locked():
        pending = stream._pending
        k = len(pending) - _max_pending // 2
        marker = pending[k].marker if k >= 0 else None
    if marker is not None:
        marker.wait(None)  # (an unknown completion ends the wait too: the sweep reports it)
    sweep(stream, False)  # (the open marker stays open: see sweep_long)


def wait_before(tok, stream, writes) -> None:
    """Wait on the host -- holding no lock -- for the unfinished work that an access of
    ``tok``'s bytes on ``stream`` (a write when ``writes``) will be ordered after: everything
    ``stream`` was given so far (on a CUDA stream a marker recorded now: other libraries' work
    there included), the newest conflicting access on each other stream, and what a consumer
    holding those bytes gave its stream so far. A copy between the device and pageable host
    memory calls it before it takes the core lock where the driver performs that copy
    synchronously, waiting for all of it (a piece of ``to_host`` or of an upload that found no
    pinned memory: ``buffer.download`` / ``buffer.upload``): under the lock every
    other thread would wait too. Best effort: work enqueued in between is still ordered by the
    copy's own submission. Not while ``stream`` captures (nothing there runs now)."""
    rt = RUNTIME
    fresh = []  # markers recorded here (pooled): back to the pool once waited for
    rt.acquire()
    try:
        pending = stream._pending
        if stream._checks:  # (a host stream: sharedmem alone gives it work)
            markers = [pending[-1].marker] if pending else []
        else:
            # A CUDA stream: what the driver's copy waits for is everything on it -- the work
            # other libraries enqueued there too (CuPy's on the legacy default stream, which
            # is sharedmem's default stream; a borrowed stream's owner's), not only sharedmem's
            # (unknown: the copy's own submission meets that error)
            with contextlib.suppress(CompletionUnknownError, CaptureError):
                fresh.append(fresh_marker_locked(stream, True))
            markers = list(fresh)
        tracker = tok.allocation.tracker
        if tracker.elsewhere_locked(stream):
            for c in tracker.conflicts_locked(stream, writes, tok.start, tok.stop, None):
                m = c[1]
                if m is None:  # an open hold: what its consumer's stream was given so far
                    try:       # (the submission makes the copy wait for as much)
                        m = fresh_marker_locked(c[0], True)
                    except (CompletionUnknownError, CaptureError):
                        continue  # (the submission meets that error)
                    fresh.append(m)
                markers.append(m)
    finally:
        rt.release()
    try:
        for m in markers:
            m.wait(None)  # (an unknown completion ends the wait: the submission reports it)
    finally:  # (an interrupt, or a wait refused -- CaptureError --: no event out of the pool)
        for m in fresh:
            m.recycle()  # (nothing else has seen these markers)


def sweep_long(stream) -> None:
    """What a new hold does for its consumer's stream (Allocation.new_token,
    object_export_hold), as submit() sweeps its own: once SWEEP_EVERY seqs were given out there
    since the last such sweep (each hold's end takes one, also where it joins a submission:
    see _lease_hold_end_locked), and only while something older than the newest submission is
    pending -- the one thing a sweep that leaves the open marker unrecorded can retire (as
    submit()'s: recording it here would close it after every SWEEP_EVERY exports, and make
    the next end file a submission of its own). Nothing else sweeps leases filed without a
    launch (a hold's end) but the retirer, which in a busy process gets the GIL only every
    switch interval (5 ms): a loop of cupy.from_dlpack piled up ~600 hold ends between its
    passes, they outlived the collector's young generations, and the full collections they
    set off cost 4 us an export on an H200 with cuTile imported (230k objects).

    Opportunistic, inside an export: it never raises (an error is re-raised at the next API
    call, as the retirer's are) and runs no user code (callbacks go to the callback
    workers). Caller does not hold core_lock."""
    if stream._seq - stream._swept < _sweep_every or len(stream._pending) < 2:
        return
    try:
        with locked():
            stream._swept = stream._seq
            done = _sweep_locked(stream, False)
        if done:
            finish(done, True)
    except Exception as e:
        RUNTIME.errors.append(e)


class _Hooks(Hooks):
    """``RUNTIME.hooks``: what allocation tokens call here (see runtime.state.Hooks)."""

    __slots__ = ()

    def end_holds(self, tok) -> None:
        end_holds_locked(tok)

    def hold_ending(self, tok) -> None:
        mark_hold_end(tok)


RUNTIME.install_hooks(_Hooks())


def sweep_all() -> None:
    """Retire what has finished on every stream with work in flight."""
    sweep_each(list(RUNTIME.active))


def sweep_each(streams, seen=None) -> None:
    """Retire what has finished on each of ``streams``. Every one is swept even where
    another's queries fail (its device's context cannot be made current: that must not stall
    the retirement of the others' work); the first failure is raised after, once what the
    others gave is finished. ``seen``: None, or a dict given ``(seq, done)`` of each stream by
    its uid after its own sweep (the retirer's record of the submitters' progress)."""
    done = []
    error = None
    try:
        with locked():
            for s in streams:
                try:
                    done.extend(_sweep_locked(s))
                except Exception as e:
                    if error is None:
                        error = e
                    continue
                if seen is not None:
                    seen[s._uid] = (s._seq, s._done)
        if error is not None:
            raise error
    finally:  # (what the streams before a failing one gave must still be finished)
        error = None
        if done:
            finish(done)


def add_callback(sub, cb) -> None:
    """Run ``cb()`` once ``sub`` has retired (or is known unknown); at once if it has."""
    with locked():
        if sub.state == _PENDING or sub.callbacks is not None:  # (retired, its callbacks
            if sub.callbacks is None:                           # not yet taken: join them)
                sub.callbacks = [cb]
            else:
                sub.callbacks.append(cb)
            return
    _callbacks.run([cb])  # (as any callback: its error deferred to the next API call)


def discard_callback(sub, cb) -> None:
    """Take ``cb`` back from ``sub``'s callbacks if it has not run (an await given up)."""
    with locked():
        cbs = sub.callbacks
        if cbs and cb in cbs:  # (identity: callbacks are functions, or partials of them)
            cbs.remove(cb)
            if not cbs:  # (none left: as before any was added -- a later one starts a list)
                sub.callbacks = None
                _callbacks.retiring.pop(id(sub), None)  # (retired: nothing left to run)


def wait(sub, timeout=None) -> bool:
    """Block until ``sub`` retired -- finished, or its completion known unknown -- (True) or
    ``timeout`` passed (False)."""
    if sub.state == _PENDING:
        deadline = None if timeout is None else _monotonic() + timeout
        if not sub.marker.wait(timeout):
            return False
        sweep(sub.stream)
        delay = 1e-5
        # (a sweep on another thread is retiring it: finish. Or its marker is known but work
        # ahead of it on its stream is not -- a marker whose record failed is unknown at once
        # --: it leaves the FIFO only once that work does, which ``timeout`` bounds too)
        while sub.state == _PENDING:
            if deadline is not None and _monotonic() >= deadline:
                return False
            _sleep(delay)
            delay = min(delay * 2, 1e-3)
            sweep(sub.stream)
    return True


def record_arrival(tok, stream) -> None:
    """Record an import's arrival as a write of ``tok``'s bytes on ``stream`` (a marker, no
    work; None: the device's default stream), made to wait for the producer's writes already:
    later use on any other stream is ordered after it (DLPack, CAI and IPC imports)."""
    s = stream if stream is not None else tok.allocation.device.default_stream
    # (a part of an import, after what cannot be undone -- a DLPack capsule consumed, an IPC
    # slot opened: another work's deferred error waits for the next call, see deferring)
    with deferring():
        submit_plan(s, [(tok, True)], _ARRIVAL, None, None, (), "order", "import")


def synchronize_stream(stream, everything=False) -> None:
    """Wait for everything submitted to ``stream`` -- ``everything`` (``Stream.synchronize``),
    on a stream sharedmem owns, everything given to it: its waits (``Stream.wait``) and other
    libraries' work there too --, retire it, surface deferred errors."""
    fresh = None
    with locked():
        if stream._capture is not None:
            raise CaptureError(f"{stream} is capturing a graph: its work has not run and cannot "
                               f"be waited for; end the capture first")
        last = stream._pending[-1] if stream._pending else None
        if everything and stream._ours:  # (no owner who could be capturing it: a marker now)
            # (unknown: the sweep below reports what made the stream's completion unknown)
            with contextlib.suppress(CompletionUnknownError):
                fresh = fresh_marker_locked(stream, True)
    if fresh is not None:
        try:
            fresh.wait(None)
        finally:  # (a wait refused -- CaptureError -- leaves no event out of the pool)
            fresh.recycle()
    if last is not None:
        marker = last.marker
        marker.wait(None)
        if marker.query() == _M_UNKNOWN and stream._ours:
            # (its end cannot be known from its marker -- a record failed --, so the marker
            # does not wait for it: the stream itself is waited for. A borrowed stream is its
            # owner's, who may be capturing it: Stream.synchronize waits for it). Its failure
            # -- the sticky error that made the marker unknown -- is no news: the sweep below
            # reports the unknown completion and keeps the memory, as for any unknown marker
            with contextlib.suppress(Exception):
                stream._impl.synchronize()
    sweep(stream)
    raise_deferred()


def synchronize_device(device) -> None:
    """:func:`synchronize_stream` of every stream with work in flight on ``device`` (None:
    on every device), then deferred errors surfaced: each stream waited for first."""
    with locked():
        streams = [s for s in RUNTIME.active if device is None or s.device is device]
    refused = None  # (a stream another thread captures: said once every other one is waited for)
    with deferring():
        for s in streams:
            try:
                synchronize_stream(s)
            except CaptureError as e:
                refused = refused or e
    raise_deferred()
    if refused is not None:
        raise refused


#: Per thread: how many calls made of several submissions are running (see deferring)
_parts = threading.local()


class deferring:
    """``with deferring():`` around the parts of one call -- a composite op's launches, a
    copy's pieces, the streams sm.synchronize waits for: no deferred error (another work's
    callback's) is raised between them, which would leave the call half done; it waits for
    the next call. The caller raises what was deferred before (or after) the whole."""

    __slots__ = ()

    def __enter__(self) -> None:
        _parts.depth = getattr(_parts, "depth", 0) + 1

    def __exit__(self, *exc) -> None:
        _parts.depth -= 1


def raise_deferred() -> None:
    """Emit pending leak warnings and re-raise a deferred failure, in the calling (user)
    thread -- not inside a callback, whose caller would take another callback's error for
    the outcome of what it called (they wait for the next call of a user thread), nor
    between the parts of one call (see :class:`deferring`)."""
    rt = RUNTIME
    if _callbacks.in_callback() or getattr(_parts, "depth", 0):
        return
    while rt.warnings:
        try:
            msg = rt.warnings.popleft()
        except IndexError:
            break
        log.warning("%s", msg)
        warn_user(msg, LeakWarning)  # (attributed to the user's line, compiled or not)
    if rt.errors:
        try:
            e = rt.errors.popleft()
        except IndexError:
            return
        raise e


def counters_locked() -> dict:
    """What stats() reports. Caller holds core_lock."""
    rt = RUNTIME
    return {"in_flight": rt.in_flight, "submitted": rt.submitted, "retired": rt.retired,
            "leaked": rt.leaked_count, "leaked_bytes": rt.leaked_bytes}


def order_consumer(tok, wait) -> int:
    """Order a consumer outside sharedmem that reads on the host after our unfinished work on
    the bytes of ``tok``: ``wait(marker)``, which may block, is called -- after the core lock
    is released -- for the newest conflicting submission of every stream (pending writes, and
    also pending reads when the view is writable: the consumer may write through it) and for
    the open holds of other consumers. Returns how many waits were made. An export that
    leaves its consumer a hold makes the hold in the same step as the ordering
    (:func:`export_hold`, :func:`object_export_hold`): a submission that came in between
    would be ordered neither before the consumer (the waits were made) nor after it (no hold
    yet)."""
    markers = []
    with locked():
        _order_locked(tok, wait, True, None, None, markers, None)
    _wait_on_host(tok, wait, markers)
    return len(markers)


def export_hold(tok, kind, source, consumers, wait, blocking=False, stream=None, handle=None):
    """An export's hold: a new live token ``kind`` of ``tok``'s bytes (its view ``source``
    checked live, as :meth:`Allocation.new_token` does) held for ``consumers`` (a tuple of
    ``(stream, writes)`` pairs: see ViewToken.consumers), made under the core lock in one
    step with the consumer's ordering after our unfinished work: ``wait(marker)`` for each
    marker to wait for (:func:`order_consumer`), ``wait(handle, marker)`` with ``handle``
    (the consumer's raw stream); device-side waits, made under the lock, unless
    ``blocking`` (then host waits, after it). Work on ``stream`` (the consumer's own, where
    known) is skipped: the stream orders it. ``wait`` None: no ordering (a consumer that
    orders itself)."""
    hold = unregistered_token(tok.allocation, kind, tok.start, tok.stop, tok.writable, tok.keep)
    markers = [] if blocking else None  # (device-side waits: nothing to keep of them)
    rt = RUNTIME
    rt.acquire()
    try:
        own = stream  # (compiled: a typed local -- its _capture a C field read)
        if own is not None and own._capture is not None:  # (where captures begin)
            raise CaptureError(
                f"cannot export bytes [{tok.start}, {tok.stop}) of allocation "
                f"#{tok.allocation.id} to a consumer on {stream}: it is capturing graph "
                f"#{stream._capture.id}, whose work runs only at replay, after the export may "
                f"have ended (and cannot wait for outside work); export before the capture")
        if wait is not None:
            _order_locked(tok, wait, blocking, stream, handle, markers, None)
        register_token_locked(hold, source, consumers)
    finally:
        rt.release()
    try:
        if blocking:
            _wait_on_host(tok, wait, markers)
        if consumers is not None:
            for c in consumers:  # (its end will file a lease on each consumer's stream)
                sweep_long(c[0])
    except BaseException:  # (the caller never gets the token)
        hold.release()
        raise
    return hold


def object_export_hold(view, kind, consumers, wait, ordered) -> int:
    """A CUDA Array Interface export's ordering and hold, in one step under the core lock:
    the ordering of :func:`export_hold` for ``view``'s bytes with ``wait`` (device-side), then
    ``view``'s object hold for ``consumers`` (``View._object_hold_locked``: it lasts as long
    as the view object). Returns how many waits were made.

    ``ordered``: whether the consumer's work, on whichever of ``consumers``' streams it runs,
    follows earlier work on any of them (one stream; or the legacy default stream and one
    stream that synchronizes with it: ``interop.streams.ordered_among``). Then the view's own
    hold on those streams -- its earlier exports' consumers, who reach the bytes through this
    same object -- is not waited for: a consumer that reads the dict again (``cupy.asarray``
    reads it more than once) would otherwise be told to synchronize with what it was given
    itself. Its hold on any other stream (an earlier consumer elsewhere) is waited for, as any
    hold is."""
    markers = []
    rt = RUNTIME
    rt.acquire()
    try:
        tok = view._live_token()
        own = view._export
        _order_locked(tok, wait, False, None, None, markers,
                      (own, [c[0] for c in consumers]) if ordered and own is not None else None)
        hold = view._object_hold_locked(kind, consumers)
        if len(hold.consumers) > len(consumers):  # (others than those named now: see there)
            end_left_consumers_locked(hold, [c[0] for c in consumers])
    finally:
        rt.release()
    for c in consumers:
        sweep_long(c[0])
    return len(markers)


def _wait_on_host(tok, wait, markers) -> None:
    """The waits of a ``blocking`` ordering, after the core lock is released: ``wait(m)`` for
    each marker :func:`_order_locked` put in ``markers``."""
    for m in markers:
        wait(m)
        if m.error is not None:  # (the wait found the writer faulted: unknown completion)
            raise _unexportable(tok, f"work whose completion became unknown while waited "
                                     f"for ({m.error!r})")


def _unexportable(tok, by) -> CompletionUnknownError:
    return CompletionUnknownError(f"bytes [{tok.start}, {tok.stop}) of allocation "
                                  f"#{tok.allocation.id} are touched by {by}; they cannot be "
                                  f"exported")


def _order_locked(tok, wait, blocking, stream, handle, markers, exclude) -> None:
    """order_consumer's step under the core lock: each marker to wait for after the lock is
    released (``blocking``) is appended to ``markers``; otherwise None for each wait made
    (``markers`` None: nothing appended).
    ``exclude``: as for ``AccessTracker.conflicts_locked``."""
    tracker = tok.allocation.tracker
    if not tracker.elsewhere_locked(stream):  # nothing on other streams: the usual case
        return
    for c in tracker.conflicts_locked(stream, tok.writable, tok.start, tok.stop, exclude):
        other, marker = c[0], c[1]
        fresh = marker is None
        if fresh:  # an open hold: whatever its stream was given so far
            # (pooled where only a device-side wait uses it: back to the pool once enqueued)
            marker = fresh_marker_locked(other, not blocking)
        if marker.error is not None:  # (unknown completion)
            raise _unexportable(tok, f"work of unknown completion on {other}")
        if blocking:
            markers.append(marker)
            continue
        try:
            if handle is not None:
                wait(handle, marker)
            else:
                wait(marker)
        finally:
            if fresh:
                marker.recycle()
        if markers is not None:
            markers.append(None)


# HOLD_SEQ is re-exported for adapters that read conflicts themselves
__all__ = ["Submission", "Work", "submit", "submit_plan", "record_arrival", "lease_locked",
           "end_holds_locked", "order_consumer", "wait_before", "export_hold",
           "object_export_hold", "end_left_consumers_locked", "settle", "sweep", "sweep_all",
           "finish", "wait",
           "raise_deferred", "deferring", "HOLD_SEQ", "FailedMarker", "fresh_marker_locked",
           "label_text", "PENDING", "RETIRED", "UNKNOWN"]
