"""The runtime: every piece of mutable ownership state, in one object, and its lock.

:class:`Runtime` is to sharedmem what trio's ``Runner`` is to trio: the counters, the set of
streams with work in flight, the work kept forever, the errors and warnings waiting for a user
thread, the retirer's flags -- and the one core lock (``acquire``/``release``, ``with
locked():``) that guards them and also

* the view tokens of every allocation (``Allocation._views``, ``ViewToken.live``),
* the access records of every ``AccessTracker``,
* each stream's FIFO of pending submissions and its sequence numbers.

Rules every caller keeps:

* Nothing that can block on the GPU or on another thread runs under the lock, except enqueueing
  work on a stream (a driver call that does not wait). Nor does foreign code: the last
  reference to a foreign producer's memory (an import's deleter) is handed to
  :meth:`Runtime.drop_later` and dropped when the lock is let go.
* Destructors may run in any thread at any time -- also inside a critical section of the same
  thread, when a garbage collection is triggered there. So a destructor never blocks on the
  lock: :meth:`Runtime.enter_or_stage` tries it and, when it is busy, stages the operation; the
  holder drains the stage as it lets the lock go, and whoever takes the lock next drains what
  is left before reading any state (``acquire`` does), so a view released before an operation
  is never seen as live by it.
* The lock knows its owner. An API call made by a finalizer that interrupted a critical section
  on the same thread would deadlock on it, or see half-updated state: it raises
  :class:`~sharedmem.errors.SharedMemError` instead (releases are staged, never refused).
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import sys
import threading
import warnings

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from .. import _cython as cython

from ..errors import SharedMemError

__all__ = ["Runtime", "Hooks", "RUNTIME", "Bell", "locked", "fork_safe", "at_fork_child",
           "at_fork_hold", "fork_holds", "leaf_lock", "LeafLock", "log"]

#: The ``sharedmem`` logger: rare events only (threads started, forks, captures, leaks, work
#: dropped at exit, host kernels that raised) -- never a line per launch.
log = logging.getLogger("sharedmem")
log.addHandler(logging.NullHandler())  # (a library's logger: silent until the app configures)

_get_ident = threading.get_ident


class Runtime:
    """The ownership core's state (see the module docstring). One per process: ``RUNTIME``."""

    __slots__ = ("_acquire", "_release", "_plock", "owner", "staged", "restaged", "later",
                 "active", "leaked", "in_flight", "submitted", "retired", "leaked_count",
                 "leaked_bytes", "unfinished", "live_views", "warnings", "errors",
                 "retirer_running", "retirer_idle", "ensure_retirer", "wake_retirer", "hooks",
                 "policy", "pid", "tracer", "captures", "__weakref__")

    def __init__(self):
        # the core lock, and `owner`: the thread holding it (0: none), written only by that thread
        self._new_lock()
        # Lock-free (deque.append and popleft are atomic under the GIL): (function, argument)
        # pairs to run under the lock, staged by destructors that found it busy.
        self.staged = collections.deque()
        # Set (lock-free) after a stage: release() drains before it lets the lock go. Cleared
        # by the holder before it drains; a stage it misses waits for the next acquire.
        self.restaged = False
        # What a release under the lock let go whose finalizer is not ours to run there (a
        # foreign producer's deleter, which may block or call sharedmem): dropped by release(),
        # after the lock is let go (see drop_later): None, or a list. guarded by lock
        self.later = None
        self.active = set()  # streams whose FIFO is not empty; guarded by lock
        self.leaked = []  # submissions whose completion is unknown, kept forever; guarded by lock
        # What sharedmem.stats() reports, counted in launches and copies. guarded by lock
        self.in_flight = self.submitted = self.retired = 0
        self.leaked_count = self.leaked_bytes = 0
        # Submissions a sweep took off their FIFO whose finish() has not yet dropped what they
        # kept (a sweep retires under the lock, finish() runs after it): settle() waits for 0.
        # guarded by lock
        self.unfinished = 0
        self.live_views = 0  # live view tokens, all allocations; guarded by lock
        # Lock-free: warnings and callback errors produced in whatever thread retired something,
        # surfaced in the next user-thread API call (submission.raise_deferred).
        self.warnings = collections.deque()
        self.errors = collections.deque()
        # The retirer thread's flags: running once started; idle while it sleeps its idle
        # interval (written by the retirer only; read lock-free).
        self.retirer_running = False
        self.retirer_idle = False
        self.ensure_retirer = _nothing  # installed by runtime.retirer
        self.wake_retirer = _nothing
        self.hooks = Hooks()  # runtime.submission installs its own (see Hooks); never None
        self.policy = "order"  # the process-wide cross-stream policy (access.set_access_policy)
        self.pid = os.getpid()
        self.tracer = None  # the active sharedmem.trace recorder, or None (see sharedmem.trace)
        # Captures in progress, every thread (runtime.graph); guarded by lock. Read lock-free by
        # launches: nonzero sends them to a check for launches that escape a capture.
        self.captures = 0

    # -- the lock -------------------------------------------------------------------------
    def _new_lock(self) -> None:
        """Make the core lock, not held (at start, and in a forked child). Compiled, a pthread
        mutex taken through C (state.pxd: no method call per launch, and no clock read per
        acquire as CPython's own lock makes); interpreted, a threading.Lock, of which only
        the bound acquire and release are kept (called on every launch)."""
        if cython.compiled:
            self._plock = sm_lock_new()  # (a child leaks its parent's: 1 lock)
            if not self._plock:
                raise MemoryError("cannot allocate sharedmem's core lock")
        else:
            lock = threading.Lock()
            self._acquire, self._release = lock.acquire, lock.release
        self.owner = 0

    def acquire(self) -> None:
        """Take the lock for an API call (blocking), then apply staged releases. Raises
        SharedMemError when this thread already holds it (see the module docstring)."""
        me = _thread_ident() if cython.compiled else _get_ident()  # (interpreted: no wrapper call)
        if self.owner == me:
            raise SharedMemError(
                "sharedmem was called from a finalizer (__del__ or a weakref callback) that "
                "interrupted a sharedmem operation on the same thread; that call would deadlock "
                "or see half-updated state. Do the work later (queue it for another thread) or "
                "use only release() in finalizers, which is always safe.")
        if cython.compiled:
            if not sm_lock_try(self._plock):
                with cython.nogil:  # (the holder may need the GIL to finish)
                    sm_lock_wait(self._plock)
        elif not self._acquire(False):  # (busy: another thread's, or this one's in a window)
            if self.turning_here(2):  # (above this call's own frame)
                raise SharedMemError(
                    "sharedmem was called from a finalizer (__del__ or a weakref callback) "
                    "that interrupted sharedmem taking or letting go its lock on the same "
                    "thread; that call would deadlock. Do the work later (queue it for "
                    "another thread) or use only release() in finalizers, which is always "
                    "safe.")
            self._acquire()
        self.owner = me
        if self.staged:
            try:
                self.drain_staged()
            except BaseException:  # (an interrupt, or a failed release: the caller's `try`
                self.release()     # is not entered yet -- the lock must not stay taken)
                raise

    def turning_here(self, depth=1) -> bool:
        """Interpreted: whether the calling thread is inside the core lock's own acquire,
        release or enter_or_stage -- a finalizer run by a collection there (Python 3.12 on
        runs one at the check after a call, the lock's acquire() included; a profile function
        at every builtin call), between taking the lock and setting ``owner`` or between
        clearing ``owner`` and letting it go: the lock is this thread's, though ``owner`` does
        not say so, and waiting for it would never end. Asked only where the lock was found
        busy, and only while ``owner`` is 0 (a holder that set it is past its window: the
        retirer's usual hold walks nothing), from the frame ``depth`` above this one: a frame
        walk, never on the uncontended path. Compiled: False -- those methods are C, with no
        Python code and so no collection between the two steps."""
        if cython.compiled or self.owner != 0:
            return False
        codes = _TURNING_CODES
        f = sys._getframe(depth)
        while f is not None:
            if f.f_code in codes and f.f_locals.get("self") is self:
                return True
            f = f.f_back
        return False

    def release(self) -> None:
        if self.restaged:  # releases staged while it was held: applied before it is let go
            self.restaged = False
            self._drain_at_release()
        later = self.later  # (None but where drop_later kept something: taken while held)
        if later is not None:
            self.later = None
        self.owner = 0
        if cython.compiled:
            sm_lock_release(self._plock)
        else:
            self._release()
        later = None  # what drop_later kept: its finalizers run now, outside the lock

    def drop_later(self, obj) -> None:
        """Keep ``obj`` until this thread lets the lock go, then drop it: for the last
        reference to an object whose finalizer may block or call sharedmem (a foreign
        producer's memory). Caller holds the lock."""
        if self.later is None:
            self.later = [obj]
        else:
            self.later.append(obj)

    # ``with RUNTIME:`` (what locked() returns): the lock held, staged releases applied
    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def drain_staged(self) -> None:
        """Run staged releases. Caller holds the lock."""
        staged = self.staged
        while staged:
            fn, arg = staged.popleft()
            fn(arg)

    def _drain_at_release(self) -> None:
        """Run staged releases as the lock is let go: a finalizer inside this thread's own
        critical section, or another thread's release that found the lock busy, staged them
        -- applied now rather than at the next acquire, which may be long after (and a hold's
        end recorded then may find its consumer's stream destroyed). Never raises (release
        runs in ``finally`` blocks): an error is raised at the next API call."""
        try:
            self.drain_staged()
        except BaseException as e:  # (the failed one is dropped, as acquire's drain drops it)
            self.errors.append(e)

    def enter_or_stage(self, fn, arg, hold=False) -> bool:
        """Take the lock if it is free now (never waits) and apply staged operations: True,
        and the caller runs ``fn(arg)`` and releases the lock. Else ``fn(arg)`` is staged
        (lock-free): False -- where another thread holds the lock and ``hold`` says ``arg`` is
        a hold's token being released, after ``hooks.hold_ending(arg)``. If an earlier staged
        operation raises while the stage is drained, ``fn(arg)`` is staged too (never lost)
        and the error raised. Safe from destructors, from any thread, and inside a critical
        section of the same thread (the lock is busy there: staged)."""
        if (sm_lock_try(self._plock) if cython.compiled else self._acquire(False)):
            self.owner = _thread_ident()
            try:
                if self.staged:
                    self.drain_staged()
            except BaseException:
                self.release()
                self.staged.append((fn, arg))
                raise
            return True
        if hold and self.owner != _thread_ident():  # (not a finalizer inside this thread's
            # own critical section: that one's release drains the stage before it returns)
            try:  # (before the stage: its holder may drain it at once)
                self.hooks.hold_ending(arg)
            except Exception:  # (the stage must happen: the hold's end is then recorded late)
                pass
        self.staged.append((fn, arg))
        self.restaged = True
        return False

    def install_hooks(self, hooks) -> None:
        """Make ``hooks`` (a :class:`Hooks`) what the core calls (runtime.submission does)."""
        if not isinstance(hooks, Hooks):
            raise TypeError(f"RUNTIME hooks must be a Hooks instance, got {type(hooks).__name__}")
        self.hooks = hooks


class Hooks:
    """What the layers below runtime.submission (allocation tokens) call in it, which they
    cannot import: runtime.submission sets ``RUNTIME.hooks`` to its subclass. Compiled, a call
    is a C virtual call, not a Python one (it is on every DLPack export and release)."""

    __slots__ = ()

    def end_holds(self, tok) -> None:  # pragma: no cover - overridden
        """A hold ``tok`` was released: lease its bytes on its consumers' streams until they
        pass this point (submission.end_holds_locked). Caller holds the core lock."""
        raise NotImplementedError("sharedmem.runtime.submission is not imported")

    def hold_ending(self, tok) -> None:  # pragma: no cover - overridden
        """Hold ``tok`` is being released while another thread holds the core lock (its
        release staged): mark the point its consumers' borrowed streams have reached now,
        before the consumer can destroy them (submission.mark_hold_end). No lock held."""
        raise NotImplementedError("sharedmem.runtime.submission is not imported")


class Bell:
    """What wakes a sleeping thread (the retirer, a host stream's worker): a raw lock, held
    while nobody rang it. Ringing releases it, sleeping acquires it -- neither allocates, so
    ringing is safe from anywhere, a finalizer run by a collection inside another ring or
    sleep included (a threading.Event rings under its Condition's lock, whose exit call
    allocates). Rung twice before a sleep, it wakes that sleep once."""

    __slots__ = ("lock",)

    def __init__(self):
        self.lock = threading.Lock()
        self.lock.acquire()

    def ring(self) -> None:
        lock = self.lock
        if lock.locked():
            try:
                lock.release()
            except RuntimeError:  # (another ringer got there first)
                pass

    def sleep(self, timeout=-1) -> None:
        """Until rung (at once if it was) or ``timeout`` seconds (-1: no limit); then it is
        unrung."""
        self.lock.acquire(True, timeout)


#: Streams this thread is capturing on (runtime.graph keeps the list), innermost last.
CAPTURING = threading.local()
#: ``.kernels``: True in a host stream's worker thread -- user code (host kernels) runs there,
#: but it is no user thread: other work's deferred errors wait for one (runtime.callbacks)
WORKER = threading.local()


def warn_user(message: str, category) -> None:
    """``warnings.warn`` attributed to the first frame outside sharedmem and interop (the
    user's line), compiled or interpreted (compiled functions have no frames)."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = (os.path.join(pkg, ""), os.path.join(os.path.dirname(pkg), "interop", ""))
    level, f = 1, sys._getframe(0)
    while f is not None and f.f_code.co_filename.startswith(roots):
        f = f.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


def _nothing() -> None:
    pass


def _thread_ident():
    """The calling thread's identifier (``threading.get_ident()``; a C call when compiled)."""
    if cython.compiled:
        return PyThread_get_thread_ident()
    return _get_ident()


#: The process's runtime.
RUNTIME = Runtime()
#: The core lock's methods in which its thread holds it while ``owner`` may not say so (see
#: Runtime.turning_here); interpreted only
_TURNING_CODES = () if cython.compiled else (
    Runtime.acquire.__code__, Runtime.release.__code__, Runtime.enter_or_stage.__code__)


def locked() -> Runtime:
    """The core lock as a context manager, ``with locked():`` (see :meth:`Runtime.acquire`)."""
    return RUNTIME


# -- fork -----------------------------------------------------------------------------------
# os.fork() copies only the forking thread. Whatever lock another thread held is held forever
# in the child, and no worker or retirer thread exists there. So: the core lock is taken before
# the fork (no core state is half-updated in the copy), and in the child it is made anew, as is
# every leaf lock registered with fork_safe(); modules whose threads do not survive register
# their own os.register_at_fork(after_in_child=...) hooks (they run after this one).
_leaf_locks = []  # threading locks re-initialized in a forked child (module-level, long-lived)
_child_hooks = []  # (order, function): run in a forked child after the locks, lowest first
_fork_held = [False]  # whether _before_fork took the core lock (the forking thread only)


_before_hooks = []  # (take, give back in the parent): leaf locks a fork takes after the core lock


def at_fork_hold(take, release) -> None:
    """Before a fork, call ``take()`` once the core lock is held (to take leaf locks in that
    order: a thread that holds the core lock may wait for them, never the other way); in
    the parent, ``release()`` before the core lock is given back. (In the child, hooks of
    :func:`at_fork_child` see them still held.)"""
    _before_hooks.append((take, release))


def at_fork_child(fn, order: int) -> None:
    """Run ``fn()`` in a forked child once the core and leaf locks are new: ``order`` 0 for
    the runtime's own threads and events (retirer, callbacks), 1 for backends (their workers
    may use those at once)."""
    _child_hooks.append((order, fn))
    _child_hooks.sort(key=lambda h: h[0])


class OwnedLock:
    """A leaf lock that knows which thread holds it (``with lock:``): taken again by that
    thread -- a finalizer, run by a collection inside the locked section, that calls
    sharedmem -- it raises SharedMemError instead of waiting for itself forever, as the core
    lock does. For leaf locks whose sections allocate (they build devices, allocations).

    Interpreted, a collection can also start between ``acquire()`` and the store of ``owner``
    (Python 3.12 on runs one at the check after a call, acquire()'s included; a profile
    function runs at the call and return of every builtin) or between the clearing of
    ``owner`` and ``release()`` (a profile function): ``_turning`` marks the thread there,
    so that a finalizer's ``with`` raises then too. Compiled, no Python code runs there."""

    __slots__ = ("_lock", "owner", "what", "_turning")

    def __init__(self, what: str):
        self._lock = threading.Lock()
        self.owner = 0
        self.what = what
        # (interpreted, per thread: taking or letting go this lock -- from before acquire()
        # to after owner is set, from before owner is cleared to after release())
        self._turning = LockMark()

    def __enter__(self):
        me = _get_ident()
        if self.owner == me or (not cython.compiled and self._turning.on):
            raise SharedMemError(
                f"sharedmem was called from a finalizer (__del__ or a weakref callback) that "
                f"interrupted {self.what} on the same thread; that call would deadlock. Do "
                f"the work later (queue it for another thread).")
        if cython.compiled:
            self._lock.acquire()
            self.owner = me
        else:
            turning = self._turning
            turning.on = True
            try:  # (an interrupt in acquire() must not leave the thread marked)
                self._lock.acquire()
                self.owner = me
            finally:
                turning.on = False
        return self

    def __exit__(self, *exc):
        if cython.compiled:
            self.owner = 0
            self._lock.release()
        else:
            turning = self._turning
            turning.on = True
            try:
                self.owner = 0
                self._lock.release()
            finally:
                turning.on = False

    def locked(self) -> bool:
        return self._lock.locked()

    def _at_fork_reinit(self) -> None:
        self._lock._at_fork_reinit()
        self.owner = 0


class LeafLock:
    """Compiled: a leaf lock that compiled code takes and lets go through C (``take()``,
    ``give()``) -- a pthread mutex, as the core lock: no method lookup, no argument parsing
    and no clock read per operation, each of which a ``threading.Lock``'s ``acquire()``
    costs when called from C. A thread waiting for it lets the GIL go. From Python it is a
    lock as ``threading.Lock`` (``acquire(blocking=True)``, ``release()``, ``locked()``,
    ``with``: fork hooks, tests), taken and let go by one thread. Made by
    :func:`leaf_lock`, which gives a ``threading.Lock`` interpreted: there, this class is
    never made."""

    def __cinit__(self):  # (not __init__: a LeafLock.__new__(LeafLock), or a subclass whose
        self._new()       # __init__ skips ours, would take a NULL mutex -- a crash)

    def _new(self) -> None:
        self._m = sm_lock_new()  # (a forked child's new one: the parent's is leaked, 1 lock)
        if not self._m:
            raise MemoryError("cannot allocate a sharedmem lock")

    def take(self) -> None:
        if not sm_lock_try(self._m):
            with cython.nogil:  # (its holder may need the GIL to let it go)
                sm_lock_wait(self._m)

    def give(self) -> None:
        sm_lock_release(self._m)

    def acquire(self, blocking=True) -> bool:
        if not blocking:
            return bool(sm_lock_try(self._m))
        self.take()
        return True

    def release(self) -> None:
        if sm_lock_try(self._m):  # (not held: an error, as threading.Lock's -- a double
            sm_lock_release(self._m)  # release would go unnoticed, an unlock of an unlocked
            raise RuntimeError("release unlocked lock")  # mutex undefined in POSIX)
        self.give()

    def locked(self) -> bool:
        if sm_lock_try(self._m):
            sm_lock_release(self._m)
            return False
        return True

    def __enter__(self):
        self.take()
        return self

    def __exit__(self, *exc) -> None:
        self.give()

    def _at_fork_reinit(self) -> None:
        self._new()


def leaf_lock():
    """A new leaf lock: a :class:`LeafLock` compiled, a ``threading.Lock`` interpreted."""
    return LeafLock() if cython.compiled else threading.Lock()


def fork_safe(lock):
    """Register a leaf lock (a ``threading.Lock`` or :class:`LeafLock`) to be re-initialized in
    a forked child; returns it."""
    _leaf_locks.append(lock)
    return lock


#: Whether _before_fork turned the collector off (the forking thread only): a collection while
#: the fork holds the core and leaf locks -- any allocation in the hooks, or in os.fork's own,
#: may start one -- would run finalizers that take them (a HostBlock's _give_back, a registry
#: entry's removal) on this very thread, which would wait for itself forever.
_gc_was_on = [False]
#: The thread whose fork holds the core lock and the at_fork_hold locks (0: none). Set in the
#: parent once it holds them, so that the child inherits it: a child frees its parent's other
#: threads' thread-locals and contexts inside os.fork(), before any at-fork hook runs, and a
#: finalizer run there, on this thread, must not wait for a lock the fork holds. Cleared in
#: the child once the leaf locks are new.
_fork_holder = [0]


class LockMark(threading.local):
    """Per thread, for a leaf lock that finalizers take: whether the thread is in an operation
    on it, from just before it takes the lock to just after it lets it go. A collection can
    run a finalizer there even where nothing under the lock allocates -- Python 3.12 on runs
    one at the check after a call (the lock's own acquire() included) that an allocation made
    earlier, or by another thread, asked for, and a profile function runs at every builtin
    call -- and a finalizer that then waited for the lock would wait for its own thread. It
    stages its work instead (:func:`enter_or_stage_marked`), and the operation does it once it
    has let the lock go (:func:`leave_marked`). Compiled code under such a lock runs no Python
    code, and takes the lock itself."""

    on = False


def enter_marked(lock, mark) -> bool:
    """Take leaf ``lock`` for an operation, this thread marked (``mark``, a LockMark) first:
    whether it was marked already (an operation run by a finalizer inside another)."""
    was = mark.on
    mark.on = True
    lock.acquire()
    return was


def enter_or_stage_marked(lock, mark, staged, item):
    """A finalizer's :func:`enter_marked`: the lock taken (returns whether the thread was
    marked), or -- where it is taken and this thread's own operation on it is under way, or
    about to take it -- ``item`` appended to ``staged`` (a deque) for that operation to do:
    None."""
    was = mark.on
    mark.on = True
    if not lock.acquire(False):
        if was:
            staged.append(item)
            return None
        lock.acquire()  # (another thread's: it lets it go)
    return was


def leave_marked(mark, was, staged, apply) -> None:
    """After the lock was let go (by the caller: no Python code runs under it, a trace
    function's call included), restore ``mark`` (``was``: what :func:`enter_marked` returned);
    the outermost operation then applies what finalizers staged meanwhile, ``apply(item)``
    each (every item once: another thread may be draining too)."""
    mark.on = was
    if not was:
        while staged:
            try:
                item = staged.popleft()
            except IndexError:  # (another thread's drain took the last)
                return
            apply(item)


def fork_holds() -> bool:
    """Whether a fork of this thread holds the at_fork_hold locks now (see _fork_holder): a
    finalizer then does their work without taking them -- this thread holds them, and no
    other thread touches what they guard until the fork lets them go."""
    return _fork_holder[0] == _thread_ident()


def _before_fork() -> None:
    rt = RUNTIME
    # (a fork from a thread inside a sharedmem call -- a host kernel -- keeps what it holds)
    held = rt.owner != _thread_ident()
    if held:
        rt.acquire()
    # The flags only now: the core lock serializes forks (two threads may run this hook at
    # once -- CPython takes its import lock after it), so they are this fork's, not another
    # thread's still waiting above. (A collection before here is one of a critical section.)
    _fork_held[0] = held
    _gc_was_on[0] = gc.isenabled()
    gc.disable()
    for take, _release in _before_hooks:
        take()
    _fork_holder[0] = _thread_ident()


def _after_fork_parent() -> None:
    _fork_holder[0] = 0
    try:
        for _take, release in reversed(_before_hooks):
            release()
        if _fork_held[0]:
            _fork_held[0] = False
            RUNTIME.release()
    finally:
        if _gc_was_on[0]:
            _gc_was_on[0] = False
            gc.enable()


def _after_fork_child() -> None:
    rt = RUNTIME
    _fork_held[0] = False
    rt._new_lock()
    rt.retirer_running = False  # (no thread of the parent runs here)
    rt.retirer_idle = False
    rt.pid = os.getpid()
    for lock in _leaf_locks:
        lock._at_fork_reinit()
    _fork_holder[0] = 0  # (the leaf locks are new; the task queues' stay in _forking: host.py)
    log.debug("forked: pid %d has a new core lock and %d leaf locks; threads restart on use",
              rt.pid, len(_leaf_locks))
    try:
        for _order, fn in _child_hooks:  # (the backends' release what the fork still holds)
            fn()
    finally:
        if _gc_was_on[0]:
            _gc_was_on[0] = False
            gc.enable()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                    after_in_child=_after_fork_child)
