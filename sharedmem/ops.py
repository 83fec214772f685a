"""Device operations: launches described once, composed, then submitted.

``op(kernel, grid, block, *args)`` describes a launch without submitting it.
Ops compose:

* ``a.and_then(b)`` -- ``b`` after ``a``, on the same stream;
* ``zip(a, b, ...)`` -- independent: the first runs on the submission stream,
  the others on streams of a per-device pool; the submission stream then waits
  for them on the device, so whatever follows the zip runs after all of them
  (under policy "reject" a later part that uses a branch's bytes is still refused
  while that branch's work is unfinished: "reject" refuses any conflict with
  unfinished work; chain such parts under "order"); its value is the tuple of
  their values. Captured into a graph, the branches
  are recorded one after another on the capturing stream;
* ``a.apply(fn)`` -- ``fn(value of a)`` on the host once ``a`` completed.

``op.submit(stream=None)`` returns the same :class:`~sharedmem.DeviceFuture`
as :func:`~sharedmem.launch` (``op(k, g, b, *args).submit(s)`` does exactly
``launch(k, g, b, *args, stream=s)``); with ``stream=None`` a stream of the
device's pool is used. A CuPy RawKernel op and a cuTile op compose in one
chain like any two launches: every launch takes its own leases.
"""

from __future__ import annotations

import builtins
import itertools
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from .launch import (Intent, _as_view, adapter_for, default_device_for, entered_stream,
                     launch_submission, resolve_args, submit_planned)
from .errors import CaptureError, KernelError, SharedMemError
from .runtime import callbacks as _callbacks
from .runtime import submission as _sub
from .runtime.future import DeviceFuture, HostFuture, _composing, _outcome, peek_quietly
from .runtime.state import OwnedLock, fork_safe
from .stream import Stream, as_stream_or_default, streams_entered

__all__ = ["DeviceOp", "op", "zip"]

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Literal

_T_co = TypeVar("_T_co", covariant=True)  # the value of an op (None for a launch)
_U = TypeVar("_U")
_A = TypeVar("_A")
_B = TypeVar("_B")
_C = TypeVar("_C")

POOL_SIZE = 4
# device key -> (list of Streams, count of the turns taken: the next is count % POOL_SIZE);
# guarded by _pool_lock
_pools: dict = {}
_pool_lock = fork_safe(OwnedLock("the creation of a device's stream pool"))


def pool_stream(device, avoid=None) -> Stream:
    """A stream of ``device``'s pool (round robin), other than ``avoid`` and not one that
    captures a graph (work given to it would be recorded, not run); a new stream when every
    pool stream is one of those. A faulted host stream (it runs nothing more) is replaced in
    the pool by a new one."""
    with _pool_lock:
        pool = _pools.get(device.key)
        if pool is None:
            pool = _pools[device.key] = ([device.create_stream(f"sharedmem-pool-{i}")
                                          for i in range(POOL_SIZE)], itertools.count())
        streams, turns = pool
        for _ in range(POOL_SIZE):
            i = next(turns) % POOL_SIZE
            st = streams[i]
            if st._checks and st._impl.fault is not None:  # (a faulted host stream runs
                st = streams[i] = device.create_stream(f"sharedmem-pool-{i}")  # nothing more)
            if st is not avoid and st._capture is None:
                return st
    return device.create_stream("sharedmem-pool-extra")


class DeviceOp(Generic[_T_co]):
    """Device work described, not yet submitted (immutable; submit it any
    number of times). Build one with :func:`op`, :func:`zip`, ``and_then``
    and ``apply``."""

    __slots__ = ()

    def and_then(self, other: DeviceOp[_U]) -> DeviceOp[_U]:
        """``other`` after this op, on the same stream."""
        if not isinstance(other, DeviceOp):
            raise TypeError(f"and_then takes a DeviceOp, got {type(other).__name__}")
        return _Then(self, other)

    def apply(self, fn: Callable[[_T_co], _U]) -> DeviceOp[_U]:
        """An op whose value is ``fn(value of this op)``, computed on the host
        once this op's work completed."""
        if not callable(fn):
            raise TypeError(f"apply takes a callable, got {fn!r}")
        return _Apply(self, fn)

    def submit(self, stream: Stream | object | None = None) -> DeviceFuture[_T_co]:
        """Submit the work; returns a DeviceFuture (as :func:`launch` does).
        ``stream=None``: the current stream of the op's device (``with stream:``), else a
        stream of that device's pool. Its device: that of its first array argument; without
        any, the device :func:`launch` would choose for its first kernel."""
        if stream is None:
            device = self._device()
            current = entered_stream(device, self._adapter()) if streams_entered() else None
            stream = current or pool_stream(device or default_device_for(self._adapter()))
        elif not isinstance(stream, Stream):
            st = as_stream_or_default(stream)
            # (a default stream naming no device: the op's device's, as a launch borrows it)
            stream = st if st is not None else Stream._borrow(
                stream, self._device() or default_device_for(self._adapter()))
        if type(self) is not _LaunchOp:
            # A composite op submits its parts one after another: every part is first resolved,
            # planned and packed (_planned) -- raising what its launch would: an argument
            # moved, released, read-only for a write or on another device, a grid, block or
            # parameter that does not fit, an apply() onto a capturing stream -- so that such
            # an error leaves no part submitted: resubmitting the whole op must not run its
            # first parts twice. (A later part can still fail as it is submitted: a conflict
            # under "reject", a view another thread moves meanwhile.)
            go = self._planned(stream)
            _sub.raise_deferred()  # (before its first part: none between them)
            with _sub.deferring():
                return go()
        return self._submit_on(stream)

    # -- implemented by the node types; a composite's ``ops`` are its parts ---------------
    def _submit_on(self, stream) -> DeviceFuture:
        """Submit on ``stream`` (every part planned before the first is submitted)."""
        return self._planned(stream)()

    def _planned(self, stream):  # pragma: no cover
        """Every part resolved, planned and packed for ``stream``, nothing submitted (raising
        as a submission would); returns the call that submits them, which returns the op's
        DeviceFuture."""
        raise NotImplementedError

    def _adapter(self):
        """The adapter of its first kernel (whose kind of device an op with no array
        arguments runs on: see :meth:`submit`)."""
        return self.ops[0]._adapter()

    def _device(self):
        """The device of the first part whose arguments name one, or None."""
        for o in self.ops:
            d = o._device()
            if d is not None:
                return d
        return None


class _LaunchOp(DeviceOp):
    __slots__ = ("kernel", "grid", "block", "args", "shared_mem", "policy")

    def __init__(self, kernel, grid, block, args, shared_mem, policy):
        self.kernel, self.grid, self.block, self.args = kernel, grid, block, args
        self.shared_mem, self.policy = shared_mem, policy

    def __repr__(self) -> str:
        return f"<op {adapter_for(self.kernel).label(self.kernel)}>"

    def _submit_on(self, stream):
        # exactly launch(): the kernel's plan is cached, so an op submitted in a loop pays for
        # argument resolution, leases and the driver call only
        return DeviceFuture(launch_submission(self.kernel, self.grid, self.block, self.args,
                                              stream, self.shared_mem, self.policy))

    def _planned(self, stream):
        planned = launch_submission(self.kernel, self.grid, self.block, self.args, stream,
                                    self.shared_mem, self.policy, False)
        return lambda: DeviceFuture(submit_planned(planned))

    def _adapter(self):
        return adapter_for(self.kernel)

    def _device(self):
        adapter = None
        for a in self.args:
            obj = a.obj if isinstance(a, Intent) else a
            view = _as_view(obj)
            if view is not None:
                if view.is_live:
                    return view.device
                continue
            t = type(obj)
            if t is int or t is float or t is bool or obj is None:
                continue  # a scalar
            # a foreign array (a CuPy array, a torch tensor): on the device its adapter finds
            # for it, as launch() runs there (else an op of CuPy arrays alone ran on the
            # default device: DeviceMismatchError where they live on another)
            if adapter is None:
                adapter = adapter_for(self.kernel)
            try:
                device = resolve_args(adapter, (a,), None)[2]
            except Exception:  # (planning raises what it is)
                continue
            if device is not None:
                return device
        return None


class _Then(DeviceOp):
    __slots__ = ("ops",)  # (first, second)

    def __init__(self, first, second):
        self.ops = (first, second)

    def __repr__(self) -> str:
        return f"{self.ops[0]!r}.and_then({self.ops[1]!r})"

    def _planned(self, stream):
        first, second = self.ops[0]._planned(stream), self.ops[1]._planned(stream)

        def go():
            a, b = first(), second()
            # (its outcome: the first part's failure -- a host kernel that raised, after which
            # the stream ran the second -- else the second's; both looked at, as zip's branches)
            return ComputedFuture(b._s, partial(_last_value, (a, b)), (a, b))
        return go


class _Apply(DeviceOp):
    __slots__ = ("ops", "fn")  # ops: (the inner op,)

    def __init__(self, inner, fn):
        self.ops, self.fn = (inner,), fn

    def __repr__(self) -> str:
        return f"{self.ops[0]!r}.apply({getattr(self.fn, '__name__', self.fn)!r})"

    def _planned(self, stream):
        if stream._capture is not None:
            raise CaptureError("apply() cannot be captured into a graph: its host function would "
                               "run once at capture, not at each replay")
        inner, fn = self.ops[0]._planned(stream), self.fn

        def go():
            f = inner()
            # (the work completed: _peek is safe in the retiring thread)
            return ComputedFuture(f._s, partial(_applied, f, fn), (f,))
        return go


class _Zip(DeviceOp):
    __slots__ = ("ops",)

    def __init__(self, ops):
        self.ops = ops

    def __repr__(self) -> str:
        return f"zip({', '.join(map(repr, self.ops))})"

    def _planned(self, stream):
        # Captured, the branches are recorded one after another on the capturing stream
        # (independent work may run in any order, so this is a valid schedule) and the graph
        # replays them in that order; else the first runs on ``stream``, the others on pool
        # streams that ``stream`` then waits for
        captured = stream._capture is not None
        streams = [stream] + [stream if captured else pool_stream(stream.device, avoid=stream)
                              for _ in self.ops[1:]]
        parts = [o._planned(s) for o, s in builtins.zip(self.ops, streams)]

        def go():
            futures = [p() for p in parts]
            if captured:
                return ComputedFuture(futures[-1]._s, partial(_values, futures), futures)
            for f in futures[1:]:
                stream.wait(f.stream)  # the join, on the device: no host block
            join = _sub.submit(stream, [], stream._impl.submit_marker, label="zip join")
            return ComputedFuture(join, partial(_values, futures), futures)
        return go


def _values(futures) -> tuple:
    """The values of a zip's branches, or the first one's error -- each branch's outcome
    looked at (a failed host kernel's is retrieved: see backends.host), as asyncio.gather
    retrieves every child's. (An interrupt while a branch's value is computed propagates at
    once: failed work raises Exceptions.)"""
    values, error = [], None
    for f in futures:
        try:
            values.append(peek_quietly(f))
        except Exception as e:
            if error is None:
                error = e
    if error is not None:
        raise error
    return tuple(values)


def _applied(inner, fn):
    """apply()'s value: ``fn`` of the inner op's value (read quietly; ``fn``, the user's
    function, runs as any user code)."""
    return fn(peek_quietly(inner))


def _last_value(futures):
    """The value of an ``and_then`` chain: its last part's (the first error raised, see
    :func:`_values`)."""
    return _values(futures)[-1]


def op(kernel: object, grid: int | tuple[int, ...], block: int | tuple[int, ...] | None,
       *args: object, shared_mem: int = 0,
       policy: Literal["order", "reject"] | None = None) -> DeviceOp[None]:
    """Describe ``launch(kernel, grid, block, *args, ...)`` without submitting
    it. The kernel type is checked now; the arguments when it is submitted."""
    adapter_for(kernel)
    if policy is not None:
        from .access import check_policy
        check_policy(policy)
    return _LaunchOp(kernel, grid, block, args, shared_mem, policy)


# (for type checkers: the value of a zip of up to three ops is the tuple of their value types)
@overload
def zip(a: DeviceOp[_A], /) -> DeviceOp[tuple[_A]]: ...  # noqa: A001


@overload
def zip(a: DeviceOp[_A], b: DeviceOp[_B], /) -> DeviceOp[tuple[_A, _B]]: ...  # noqa: A001


@overload
def zip(a: DeviceOp[_A], b: DeviceOp[_B],  # noqa: A001
        c: DeviceOp[_C], /) -> DeviceOp[tuple[_A, _B, _C]]: ...


@overload
def zip(*ops: DeviceOp[Any]) -> DeviceOp[tuple[Any, ...]]: ...  # noqa: A001


def zip(*ops: DeviceOp[Any]) -> DeviceOp[tuple[Any, ...]]:  # noqa: A001,F811 - the API's name
    """Independent ops that may run on several streams, joined afterwards."""
    if not ops:
        raise KernelError("zip() needs at least one op")
    for o in ops:
        if not isinstance(o, DeviceOp):
            raise TypeError(f"zip takes DeviceOps, got {type(o).__name__}")
    return _Zip(tuple(ops))


# -- values computed once after completion -----------------------------------------------
#: Thread ident -> the ComputedFuture whose value that thread waits for (dict operations are
#: atomic: no lock; each thread writes only its own entry).
_waiting: dict = {}


def _waits_for_itself(fut, me) -> bool:
    """Whether thread ``me``, about to wait for ``fut``'s value (being computed), would wait
    for itself: ``me`` computes it, or its computing thread waits for a value that ``me``
    computes, and so on (the wait-for chain of threads and values, as host.py's
    ``_waits_for`` walks stream queues). Read without locks, each link checked still pending
    after the next is read: a race can miss a cycle (the thread closing it later finds it) or
    find one that only a timeout would have broken, never one a finished value breaks."""
    seen = set()
    while True:
        owner = fut._owner
        if fut.done():  # (a wait for it ends: e.g. a thread's entry in _waiting
            return False  # that still names a value just computed -- it wakes soon)
        if owner == me:
            return True
        if owner in seen:  # (a cycle that does not pass through this thread)
            return False
        seen.add(owner)
        nxt = _waiting.get(owner)
        if nxt is None or fut.done():
            return False
        fut = nxt


class ComputedFuture(DeviceFuture):
    """A DeviceFuture whose value is computed on the host, exactly once, after
    its submission completed: eagerly in the retiring thread, or at the first
    ``result()``, whichever comes first. It is done once the value is computed: its
    callbacks (``then``, ``await``, ``to_concurrent``) run after that.

    The function runs outside the lock: computing it may wait for other work,
    and that wait may retire this very submission and run its eager callback
    in the same thread -- which then finds the computation under way and
    returns (other threads wait for it, up to their timeout)."""

    __slots__ = ("_fn", "_owner", "_out", "_parts")

    def __init__(self, submission, fn, parts):
        super().__init__(submission)
        self._fn = fn
        # the futures of its parts: their failures are its user's to see -- retrieved when
        # its own outcome is, else logged as never retrieved once it is dropped with them
        self._parts = parts
        # the value or its error, set once computed, and the callbacks waiting for it (run
        # then as a submission's: each on its own, its error deferred to a user thread's next
        # call, and one that waits hands the rest to a worker)
        self._out = HostFuture()
        # the ident of the thread computing the value, None before; guarded by self._out._lock
        self._owner = None
        DeviceFuture._add_callback(self, self._eager)

    def _eager(self) -> None:
        self._compute(None, eager=True)

    def _compute(self, timeout, eager=False) -> bool:
        """Compute the value if nobody has yet; else wait up to ``timeout`` for whoever
        computes it (``eager``: never wait). Whether the value is ready. A wait that could
        only end by its timeout -- for a value this thread computes further up, or one whose
        computation waits for it (see _waits_for_itself) -- raises SharedMemError."""
        me = threading.get_ident()
        with self._out._lock:
            owner = self._owner
            if owner is None:
                self._owner = me
        if owner is not None:  # someone (maybe this very thread, further up) computes it
            if eager or timeout == 0 or self._out.done():
                return self._out.done()
            outer = _waiting.get(me)  # (a finalizer's wait inside another one: put back)
            _waiting[me] = self  # (before the cycle is looked for: see _waits_for_itself)
            try:
                if _waits_for_itself(self, me):
                    how = "" if self._owner == me else \
                        ", through a value another thread computes and waits for"
                    raise SharedMemError(
                        f"the value of {self._s.label} on {self._s.stream} (an apply() or zip() "
                        f"value) is waited for by a function it depends on, which cannot return "
                        f"before the value is computed{how}: it would wait forever. Wait for it "
                        f"outside apply()'s functions (chain then() after the future instead)")
                with _callbacks.waiting():
                    return self._out._event.wait(timeout)
            finally:
                if outer is None:
                    del _waiting[me]
                else:
                    _waiting[me] = outer
        fn, self._fn = self._fn, None
        self._out._set(*_outcome(fn))  # (the parts read quietly: see _values, _applied)
        return True

    def done(self) -> bool:
        """True once the value (or its error) is computed."""
        return self._out.done()

    def __repr__(self) -> str:
        out = self._out
        state = ("pending" if not out.done() else "done" if out._error is None else
                 f"failed: {out._error!r}")
        return f"<DeviceFuture (a composite op's value, last {self._s.label} on " \
               f"{self._s.stream}): {state}>"

    def _add_callback(self, cb) -> None:
        self._out._add_callback(cb)
        # and the computation, once the work retired: the one queued at creation may never
        # run (a forked child drops the parent's queue); a second one finds it done. Not
        # while the work is pending: the one queued at creation is still there
        if self._s.state != _sub.PENDING and not self._out.done():
            DeviceFuture._add_callback(self, self._eager)

    def _discard_callback(self, cb) -> None:
        self._out._discard_callback(cb)

    def _wait_done(self, timeout) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        DeviceFuture._wait_done(self, timeout)  # the work, then deferred errors
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._compute(left):
            raise TimeoutError(f"the value of {self._s.label} on {self._s.stream} was not "
                               f"computed within {timeout} s")

    def _peek(self):
        DeviceFuture._peek(self)  # the work's own outcome first
        self._compute(None)  # (computed already, or here)
        if not getattr(_composing, "on", False):  # (its user sees it: its parts' too)
            self._retrieved()
        return self._out._peek()

    def _retrieved(self) -> None:
        DeviceFuture._retrieved(self)
        for p in self._parts:
            p._retrieved()
