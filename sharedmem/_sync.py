"""The one lock of the ownership core, and the lock-free staging of releases.

``core_lock`` guards every piece of mutable ownership state:

* the view tokens of every allocation (``Allocation._views``, ``ViewToken.live``),
* the access records of every ``AccessTracker``,
* each stream's FIFO of pending submissions and its sequence counter,
* the global counters read by ``sharedmem.stats()``.

Nothing that can block on the GPU or on another thread runs while it is held,
except enqueueing work on a stream (a driver call that does not wait).

Destructors may run in any thread, at any time -- including inside a critical
section of the same thread, when a garbage collection is triggered there. So a
destructor never blocks on the lock: :func:`run_or_stage` tries it and, when it
is busy, stages the operation in ``_staged``; whoever takes the lock next
drains the stage before reading any state (``locked()`` does that), so a
view released before an operation is never seen as live by it.
"""

from __future__ import annotations

import collections
import threading

core_lock = threading.Lock()

# Lock-free: deque.append and deque.popleft are atomic under the GIL. Holds
# (function, argument) pairs to run under core_lock.
_staged: collections.deque = collections.deque()


def drain_staged() -> None:
    """Run staged releases. Caller holds ``core_lock``."""
    staged = _staged
    while staged:
        fn, arg = staged.popleft()
        fn(arg)


class _Locked:
    __slots__ = ()

    def __enter__(self) -> None:
        core_lock.acquire()
        if _staged:
            drain_staged()

    def __exit__(self, *exc) -> None:
        core_lock.release()


#: ``with locked(): ...`` -- hold the core lock with staged releases applied.
_LOCKED = _Locked()


def locked() -> _Locked:
    return _LOCKED


def run_or_stage(fn, arg) -> None:
    """Run ``fn(arg)`` under the core lock if it is free now, else stage it.

    Never blocks; safe from destructors and from any thread.
    """
    if core_lock.acquire(blocking=False):
        try:
            if _staged:
                drain_staged()
            fn(arg)
        finally:
            core_lock.release()
    else:
        _staged.append((fn, arg))
