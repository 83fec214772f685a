"""Futures: ``DeviceFuture`` for submitted work, ``HostFuture`` for what follows it.

A future is only a window on its submission: dropping it changes nothing about
when the work's memory is released (the submission keeps that until the
device has finished). ``then(fn)`` and ``add_done_callback(fn)`` run ``fn``
in whichever thread retires the work (a thread blocked in ``result()``, a host
stream's worker) or, for work the retirer thread retired, on the callback thread
(see runtime.callbacks): a continuation may block without stalling retirement.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import numbers
import threading
import types
from functools import partial
from typing import TYPE_CHECKING

try:
    import cython
except ImportError:  # (interpreted without Cython: see sharedmem/_cython.py)
    from .. import _cython as cython

from ..errors import CompletionUnknownError, HostKernelError, SharedMemError
from . import callbacks as _callbacks
from . import submission as _sub

__all__ = ["DeviceFuture", "HostFuture"]

if TYPE_CHECKING:  # (type checkers read future.pyi, where both futures are Generic[T])
    from collections.abc import Callable, Generator
    from typing import Any, TypeVar

    from ..stream import Stream
    from .submission import Submission

    _T = TypeVar("_T")
    _U = TypeVar("_U")


def check_timeout(timeout):
    """A wait's ``timeout`` as the wait takes it: None (no limit) or seconds -- a real number,
    TypeError naming it otherwise, ValueError for NaN (checked before the wait, which would
    compare it only once it has to wait). Infinite, or past what a wait can take
    (``threading.TIMEOUT_MAX``), it is None; negative, 0 (no wait: an int below what a float
    holds overflowed where a wait adds it to the clock)."""
    if timeout is None:
        return None
    if not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be None or a number of seconds, got {timeout!r}")
    if timeout != timeout:
        raise ValueError(f"timeout must be None or a number of seconds, got {timeout!r}")
    return None if timeout >= threading.TIMEOUT_MAX else timeout if timeout > 0 else 0


@cython.freelist(16)  # (a launch makes a DeviceFuture: same size as this, compiled)
@cython.cclass
class _FutureBase:
    __slots__ = ("_s",)  # (DeviceFuture's submission; here, so that one fits the freelist)
    # DeviceFuture[None], HostFuture[int]: subscriptable at runtime, as their stubs are generic
    # (a cdef class cannot derive from typing.Generic)
    __class_getitem__ = classmethod(types.GenericAlias)

    def then(self, fn: Callable[[_T], _U]) -> HostFuture[_U]:
        """A :class:`HostFuture` of ``fn(result)``, called once this future
        completes (on the host, in the retiring thread). If this future fails,
        the returned one fails with the same exception and ``fn`` is not called."""
        if not callable(fn):
            raise TypeError(f"then takes a callable, got {fn!r}")
        out = HostFuture()
        if type(self) is not DeviceFuture:
            # a HostFuture, or a composite op's value (ops.ComputedFuture, the one subclass),
            # computed by a function whose thread each names (_owner): a wait for ``out``
            # inside that function would never end either (see HostFuture._wait_done) -- not
            # a plain DeviceFuture's (no attribute looked for and missed on each then())
            if not self.done():
                out._after = self
        self.add_done_callback(partial(_then, self, fn, out))
        return out

    def result(self, timeout: float | None = None) -> _T:
        """The value once done, blocking up to ``timeout`` seconds (then TimeoutError); raises
        the error it failed with (a DeviceFuture's: see its class docstring)."""
        self._wait_done(check_timeout(timeout))
        return self._peek()

    def add_done_callback(self, fn: Callable[[_FutureBase[_T]], object]) -> None:
        """Call ``fn(self)`` once this future is done -- its work finished, or its value or
        error set -- (at once if it is)."""
        if not callable(fn):
            raise TypeError(f"add_done_callback takes a callable, got {fn!r}")
        self._add_callback(partial(fn, self))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The exception the work ended with, or None (a TimeoutError when it has not ended
        within ``timeout``). A DeviceFuture's, as its ``result``, re-raises errors of other
        work's callbacks first (an API call); a HostFuture's, set by a callback, does not."""
        # (an interrupt while waiting propagates: not the outcome)
        self._wait_done(check_timeout(timeout))
        # (done: _peek does not wait) its own outcome, whatever its type (TimeoutError too)
        return _outcome(self._peek)[1]

    def __await__(self) -> Generator[Any, None, _T]:
        if not self.done():
            loop = asyncio.get_running_loop()
            fut = loop.create_future()

            def _wake(_f=None):
                def _set():
                    if not fut.done():  # (cancelled meanwhile: a wait_for timed out)
                        fut.set_result(None)
                try:
                    loop.call_soon_threadsafe(_set)
                except RuntimeError:  # the loop was closed since: nobody awaits any more
                    pass

            self._add_callback(_wake)
            try:
                yield from fut.__await__()
            except BaseException:  # cancelled (a wait_for timed out), or the coroutine closed:
                self._discard_callback(_wake)  # nothing of this await stays on the future
                raise
        return self.result(0)

    # -- concurrent.futures compatibility -------------------------------------------------
    def cancel(self) -> bool:
        """Submitted work cannot be cancelled (as ``concurrent.futures`` says of running
        work): always False."""
        return False

    def cancelled(self) -> bool:
        """Always False (see :meth:`cancel`)."""
        return False

    def running(self) -> bool:
        """True until the work is done (it was submitted: it may run at any time)."""
        return not self.done()

    def to_concurrent(self) -> concurrent.futures.Future[_T]:
        """A ``concurrent.futures.Future`` that completes with this one, for
        ``concurrent.futures.wait`` / ``as_completed`` and ``asyncio.wrap_future``."""
        out = concurrent.futures.Future()
        out.set_running_or_notify_cancel()

        def _done(_f):
            value, error = _outcome(self._peek)
            if error is not None:
                out.set_exception(error)
            else:
                out.set_result(value)

        self.add_done_callback(_done)
        return out


def _outcome(fn) -> tuple:
    """``(fn(), None)``, or ``(None, the exception fn raised)``, whatever its type."""
    try:
        return fn(), None
    except BaseException as e:
        return None, e


class DeviceFuture(_FutureBase):
    """The outcome of work submitted to a stream (a launch, a copy).

    ``done()`` never blocks; ``result(timeout=None)`` blocks until the device
    has finished, then returns the value (``None`` for a launch) or raises
    :class:`~sharedmem.errors.CompletionUnknownError` if completion cannot be
    known (:class:`~sharedmem.errors.HostKernelError` where a host kernel raised,
    ``TimeoutError`` where ``timeout`` passed first). ``await fut`` works in asyncio.
    Dropping the future is safe.
    """

    __slots__ = ()

    def __init__(self, submission: Submission) -> None:
        self._s = submission

    def __repr__(self) -> str:
        state = ("pending", "done", "completion unknown")[self._s.state]
        failure = getattr(self._s.marker, "failure", None)  # (a host kernel that raised)
        if failure is not None:
            state = f"failed: {failure!r}"
        return f"<DeviceFuture {self._s.label} on {self._s.stream}: {state}>"

    @property
    def stream(self) -> Stream:
        """The stream the work was submitted on (None for a launch captured into a graph: it
        runs where the graph is replayed)."""
        from ..stream import lent  # (the user has it now: see Stream._lent)
        return lent(self._s.stream)

    def done(self) -> bool:
        """True once the work finished (or its completion is known to be unknown)."""
        s = self._s
        if s.state == _sub.PENDING:
            _sub.sweep(s.stream)
        return s.state != _sub.PENDING

    def _wait_done(self, timeout) -> None:
        """Until the work finished (TimeoutError after ``timeout``), then other work's
        deferred warnings and errors (what every API call of a user thread re-raises)."""
        s = self._s
        if s.state == _sub.PENDING:
            with _callbacks.waiting():  # (a continuation waiting: another worker takes over)
                done = _sub.wait(s, timeout)
            if not done:
                raise TimeoutError(f"{s.label} on {s.stream} did not finish within {timeout} s")
        _sub.raise_deferred()

    def _add_callback(self, cb) -> None:
        """Call ``cb()`` once done (at once if it is): ``cb`` as given, for
        :meth:`_discard_callback` (each future type has the pair)."""
        _sub.add_callback(self._s, cb)

    def _discard_callback(self, cb) -> None:
        """Take back ``cb`` if it has not run (nothing if it has)."""
        _sub.discard_callback(self._s, cb)

    def _peek(self):
        """The value of completed work, or its own error (CompletionUnknownError; a
        HostKernelError when a host kernel raised: see backends.host); waits for the device
        if needed but never surfaces other work's deferred warnings or errors
        (safe in the retiring thread)."""
        s = self._s
        _sub.wait(s, None)
        if s.state == _sub.UNKNOWN:
            raise CompletionUnknownError(
                f"completion of {s.label} on {s.stream} is unknown: {s.marker.error!r}. Its "
                f"memory is kept, not freed (sharedmem.stats().leaked counts it).") from s.marker.error
        failure = getattr(s.marker, "failure", None)
        if failure is not None:
            if not getattr(_composing, "on", False):  # (its user sees it: see retrieved())
                s.marker.retrieved()  # (not logged as never retrieved: see backends.host)
            raise HostKernelError(f"{s.label} on {s.stream} raised {failure!r}; its leases were "
                                  f"released and the stream runs on") from failure
        return s.value


    def _retrieved(self) -> None:
        """Its work's failure, if any, seen by its user (a composite op's part: when the
        composite's outcome was seen, see ops.ComputedFuture)."""
        m = self._s.marker
        if getattr(m, "failure", None) is not None:
            m.retrieved()


#: Per thread: ``on`` while sharedmem computes a composite op's value from its parts' outcomes:
#: a part's failure seen then is not retrieved -- the composite's user has not seen it, and
#: is told if it is dropped unseen (see ops.ComputedFuture)
_composing = threading.local()


def _then(fut, fn, out, _f) -> None:
    """then()'s callback: ``out`` set to ``fn(fut's value)`` (_peek: no deferred warnings or
    errors, so any thread may run this; fn is not called when the work failed)."""
    out._owner = threading.get_ident()  # (a wait for ``out`` inside fn would never end)
    value, error = _outcome(partial(peek_quietly, fut))  # (seen once out's outcome is)
    if error is None:
        value, error = _outcome(lambda: fn(value))
    else:
        out._source = fut
    out._set(value, error)


def peek_quietly(fut):
    """``fut._peek()`` as sharedmem's own look at the outcome of work a continuation or a
    composite op's value follows: a failure found is not retrieved (see _composing). Only
    the look: a user's function runs outside it (what it retrieves, it retrieves)."""
    outer = getattr(_composing, "on", False)
    _composing.on = True
    try:
        return fut._peek()
    finally:
        _composing.on = outer


def future_of(submission: Submission) -> DeviceFuture[Any]:
    """The DeviceFuture of ``submission`` (what ``DeviceFuture(submission)`` makes, without
    the call's overhead: every launch returns one)."""
    f = DeviceFuture.__new__(DeviceFuture)
    f._s = submission
    return f


class HostFuture(_FutureBase):
    """The outcome of a host function run after device work (``then``)."""

    __slots__ = ("_event", "_value", "_error", "_callbacks", "_lock", "_owner", "_source",
                 "_after")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value = None
        self._error = None
        self._callbacks = []  # zero-argument callables; None once run; guarded by self._lock
        self._lock = threading.Lock()
        self._owner = None  # the ident of the thread computing its value (then()'s function)
        self._source = None  # the future whose failure is its error (then()'s), or None
        # the HostFuture -- or the composite op's value -- whose then() made this one, until
        # this one is set (None: another future's); a wait for this one waits for it too
        self._after = None

    def __repr__(self) -> str:
        if not self._event.is_set():
            return "<HostFuture pending>"
        if self._error is not None:
            return f"<HostFuture failed: {self._error!r}>"
        v = repr(self._value)
        return f"<HostFuture done: {v if len(v) <= 60 else v[:57] + '...'}>"

    def _set(self, value, error) -> None:
        """Set the value or the error, once (a second call does nothing), then run the
        callbacks in order, each on its own (as a submission's: see :func:`callbacks.run`): one
        that raises neither stops the others nor changes this future; its error is re-raised at
        the next API call."""
        with self._lock:
            if self._callbacks is None:
                return
            self._value, self._error = value, error
            self._after = None
            self._event.set()
            cbs, self._callbacks = self._callbacks, None
        if cbs:
            _callbacks.run(cbs)

    def done(self) -> bool:
        """True once the value (or the error) is set; never blocks."""
        return self._event.is_set()

    def _wait_done(self, timeout) -> None:
        if not self._event.is_set():
            me = threading.get_ident()
            f = self
            while f is not None:  # (this future, and the unset ones it follows by then())
                if f._owner == me:
                    if isinstance(f, DeviceFuture):  # (a composite op's value: see then())
                        raise SharedMemError(
                            f"a function computing the value of {f._s.label} on {f._s.stream} "
                            f"(an apply() or zip() value) waits for a then() of that value, which "
                            f"is set only once the function returns: it would wait forever. Wait "
                            f"for it outside apply()'s functions (chain then() after the "
                            f"future instead)")
                    raise SharedMemError(
                        f"a then() function waits for the HostFuture that then() returned"
                        f"{'' if f is self else ' (through a then() of it)'}, which is set only "
                        f"once that function returns: it would wait forever. Wait for it "
                        f"outside the function (chain another then() after it instead)")
                f = getattr(f, "_after", None)  # (a composite op's value follows nothing here)
                if f is not None and f.done():
                    break
            with _callbacks.waiting():  # (a continuation waiting: another worker takes over)
                done = self._event.wait(timeout)
            if not done:
                raise TimeoutError(f"the host function did not finish within {timeout} s")

    def _add_callback(self, cb) -> None:
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(cb)
                return
        _callbacks.run([cb])  # (as any callback: its error deferred to the next API call)

    def _discard_callback(self, cb) -> None:
        with self._lock:
            if self._callbacks is not None and cb in self._callbacks:
                self._callbacks.remove(cb)

    def _peek(self):
        """The value, or the error it failed with (the value or error is set)."""
        if self._error is not None:
            if not getattr(_composing, "on", False):
                self._retrieved()  # (its user sees the failure: see _then)
            raise self._error
        return self._value

    def _retrieved(self) -> None:
        """The failure it carries (then()'s source's), if any, seen by its user."""
        if self._source is not None:
            self._source._retrieved()
