"""Where callbacks of retired work run (``then`` continuations, ``add_done_callback``).

They run in whichever thread retires the work -- a user thread blocked in ``result()``, a host
stream's worker -- except the retirer thread: the submissions it retires with callbacks are
handed to the callback workers (``sharedmem-callbacks-N``), so a continuation that blocks (on
another continuation's result, on I/O) never stops retirement for everyone else.

A continuation may wait for another one queued behind it. A callback that waits on a future
says so (:func:`waiting`): the callbacks after it go to the workers, wherever it runs; when
every worker is waiting and work is queued, another worker starts (as a fork-join pool
compensates a blocked thread), so the queue always drains and a waiter's timeout is its own.
Workers beyond the first leave after ``IDLE_EXIT`` idle seconds. The callbacks of one
submission run in the order they were added: a callback added while the others are queued
joins them (see ``submission.add_callback``).
"""

from __future__ import annotations

import atexit
import collections
import sys
import threading
import time

from ..errors import LeakWarning
from .state import RUNTIME, WORKER, at_fork_child, fork_safe, locked, log

__all__ = ["run", "hand_off", "waiting", "on_worker", "retirer_ident"]

#: Seconds an extra worker (beyond the first) stays idle before it leaves.
IDLE_EXIT = 10.0
#: Seconds the interpreter's exit waits, in all, for handed-off callbacks to run.
EXIT_TIMEOUT = 10.0

_lock = fork_safe(threading.Lock())
_cond = threading.Condition(_lock)
# Guarded by _lock: what waits for a worker -- submissions whose callbacks to take, and lists
# of callbacks (those after one that waits: see waiting) -- and the worker counts.
_queue = collections.deque()
_workers = 0  # live workers
_blocked = 0  # workers waiting on a future inside a callback
_running = 0  # workers running callbacks (blocked ones included)
_local = threading.local()  # .worker: True on a callback worker
_fork_dropped = []  # a forked child: the parent's queue and callback lists (see _after_fork_child)
#: The retirer thread's ident (set by runtime.retirer when it starts); 0 before.
retirer_ident = [0]
#: Retired submissions whose callbacks are not taken yet, by id: (the ident of the thread
#: that retired them -- which runs them, or hands them off --, the submission). Filed by
#: submission._sweep_locked for each that has callbacks; run_of (and discard_callback, which
#: empties them) take it out. Guarded by the core lock. A forked child drops the callbacks of
#: those another thread of the parent retired (_after_fork_child): no thread there runs them.
retiring = {}


def hand_off(sub) -> None:
    """Queue ``sub``'s callbacks for the workers (the retirer calls this; it never blocks on
    a callback: the lock is held only to queue)."""
    _fork_dropped.clear()  # (a forked child's first hand-off: what the parent had queued goes)
    with _lock:
        _queue.append(sub)
        if _workers == _blocked:  # no worker, or every one waits inside a callback
            try:
                _start_locked()
            except RuntimeError:
                # The interpreter exits (the retirer retiring work that finished in an exit
                # hook), and Python 3.12 starts no thread then: drain_at_exit runs the queue
                # in the exiting thread. Any other time it is an error of its own.
                if threading.main_thread().is_alive():
                    raise
        _cond.notify()


def _start_locked() -> None:
    global _workers
    t = threading.Thread(target=_work, args=(_workers == 0,),
                         name=f"sharedmem-callbacks-{_workers + 1}", daemon=True)
    t.start()
    _workers += 1
    log.debug("callback worker %d started", _workers)


def _work(first: bool) -> None:
    global _workers, _running
    _local.worker = True
    while not sys.is_finalizing():
        with _lock:
            while not _queue:
                # (the first worker waits with no timeout: wait() is never False for it)
                if not _cond.wait(None if first else IDLE_EXIT) and not _queue:
                    _workers -= 1  # an idle extra worker leaves
                    return
            sub = _queue.popleft()
            _running += 1
        try:
            if type(sub) is list:
                run(sub)
            else:
                run_of(sub)
        except BaseException as e:  # (run_of taking the lock applies staged releases, which
            RUNTIME.errors.append(e)  # may raise): re-raised in a user thread, as a callback's
            # error is -- the worker lives on (dead, it was still counted, and nothing handed
            # off after would ever run)
        finally:
            # (nothing of the batch stays referenced while this worker waits for the next:
            # a callback's closure may keep views alive, and moves of them would be refused)
            sub = None
            with _lock:
                _running -= 1
                _cond.notify_all()  # (an exit drain waits for the queue to empty)


def run_of(sub) -> None:
    """Take ``sub``'s callbacks (``submission.add_callback`` appends under the core lock until
    they are taken) and :func:`run` them."""
    with locked():
        cbs, sub.callbacks = sub.callbacks, None
        retiring.pop(id(sub), None)
    if cbs:
        run(cbs)


def run(cbs) -> None:
    """Run callbacks in this thread, in order (a worker runs a submission's so too); their
    errors surface at the next API call of a user thread (``submission.raise_deferred``). One
    that waits on a future hands the ones after it to the workers (see :class:`waiting`)."""
    rest = collections.deque(cbs)
    cbs = None
    outer = getattr(_local, "rest", None)  # (a callback that retired work runs its callbacks)
    _local.rest = rest  # (waiting() hands what is left to a worker)
    errors = RUNTIME.errors
    try:
        while rest:
            cb = rest.popleft()
            try:
                cb()
            except BaseException as e:
                errors.append(e)
            cb = None
    except BaseException:
        # an interrupt between two callbacks (KeyboardInterrupt from a signal handler): the
        # ones left go to the workers -- run, never lost -- and it is re-raised
        if rest:
            hand_off(list(rest))
            rest.clear()
        raise
    finally:
        _local.rest = outer


def on_worker() -> bool:
    """True in a callback worker thread."""
    return getattr(_local, "worker", False)


def in_callback() -> bool:
    """True while a callback runs in this thread (on a worker, or inline in the thread that
    retired its work), and in a host stream's worker (a host kernel calling sharedmem): other
    work's deferred errors are not for it (see raise_deferred)."""
    return (on_worker() or getattr(_local, "rest", None) is not None or
            getattr(WORKER, "kernels", False))


class waiting:
    """``with waiting():`` around a blocking wait: inside a callback, the callbacks after it
    go to the workers (it may wait for one of them: a user thread or a host stream's worker
    that retired the work runs them inline); on a callback worker, another worker takes the
    queue meanwhile. Nothing elsewhere."""

    __slots__ = ("_on",)

    def __enter__(self) -> None:
        global _blocked
        self._on = on_worker()
        rest = getattr(_local, "rest", None)
        if self._on or rest:
            with _lock:
                if rest:  # the callbacks after this one must not wait for it
                    _queue.appendleft(list(rest))
                    rest.clear()
                    _cond.notify()
                if self._on:
                    _blocked += 1
                if _queue and _workers == _blocked:  # (no worker free to take them)
                    try:
                        _start_locked()
                    except RuntimeError:
                        # The interpreter exits, and starts no thread (see hand_off). A worker
                        # waits all the same: drain_at_exit runs the queue in the exiting
                        # thread -- what it waits for among it. Elsewhere (the exiting thread
                        # itself) nothing would run the queue while it waits: raised, as at
                        # any other time, and the count of waiting workers left as it was
                        if not (self._on and not threading.main_thread().is_alive()):
                            if self._on:
                                _blocked -= 1
                            raise

    def __exit__(self, *exc) -> None:
        global _blocked
        if self._on:
            with _lock:
                _blocked -= 1


#: When the exit's wait for the callback workers ends (set by the first drain_at_exit call)
_exit_deadline = None


def drain_at_exit() -> None:
    """At exit, let the workers run what was handed off (bounded) -- or run it here where no
    worker could be started --, or say what was dropped.
    Registered with atexit; the host backend's exit hook calls it earlier too (a second call
    finds nothing left to run or to say)."""
    global _exit_deadline
    if on_worker():
        return
    if _exit_deadline is None:  # (one bound for the exit: a second call waits no longer)
        _exit_deadline = time.monotonic() + EXIT_TIMEOUT
    deadline = _exit_deadline
    ran = False  # (once one batch ran here, the workers waiting in callbacks are waited for
    # too: what they wait for may be what it gave them)
    while True:
        with _lock:
            # (a queue while every worker waits inside a callback -- or there is none -- is
            # one no worker takes: hand_off could start none. Not waited for)
            while (_queue or _running - (0 if ran else _blocked) > 0) and _workers and \
                    not (_queue and _workers == _blocked):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                _cond.wait(left)
            # what no worker can take -- none could be started: Python 3.12 starts no thread
            # once the interpreter exits (see hand_off) -- runs here, one batch at a time (it
            # may be what a waiting worker waits for)
            sub = _queue.popleft() if _queue and _workers == _blocked else None
            dropped = len(_queue)
            if sub is None and dropped:  # (said once: a second call finds them gone)
                _queue.clear()
        if sub is None:
            break
        ran = True
        try:
            if type(sub) is list:
                run(sub)
            else:
                run_of(sub)
        except BaseException as e:  # (as a worker does: said below with the others)
            RUNTIME.errors.append(e)
        sub = None
    if dropped:
        log.warning("exit: callbacks of %d retired submissions dropped after %s s", dropped,
                    EXIT_TIMEOUT)
    # Leak warnings and errors deferred to an API call that never came (a callback's, a trace
    # hook's): said once here rather than lost
    leaks = list(RUNTIME.warnings)
    RUNTIME.warnings.clear()
    for msg in leaks:
        log.warning("%s", msg)
        warn_at_exit(msg, LeakWarning)
    errors = list(RUNTIME.errors)
    RUNTIME.errors.clear()
    if errors:
        shown = "; ".join(repr(e) for e in errors[:5]) + (" ..." if len(errors) > 5 else "")
        log.error("exit: %d error(s) raised in sharedmem callbacks were never re-raised: %s",
                  len(errors), shown)
        warn_at_exit(f"sharedmem: {len(errors)} error(s) raised in callbacks (then(), "
                      f"add_done_callback) or trace hooks were never re-raised, for no API call "
                      f"came after them: {shown}", RuntimeWarning)


def warn_at_exit(msg, category) -> None:
    """``warnings.warn`` at exit, never raising: with warnings made errors (``-W error``) one
    would end the exit hooks early, and what they report after it would go unsaid -- printed
    to stderr instead."""
    import warnings
    try:
        warnings.warn(msg, category, stacklevel=1)
    except Exception:
        print(f"{category.__name__}: {msg}", file=sys.stderr)


atexit.register(drain_at_exit)


def _after_fork_child() -> None:
    # The parent's workers do not exist here. What the parent had queued is the parent's to
    # run: dropping it here keeps side effects from happening twice.
    # Its work stays retired here: a callback the child adds to it runs at once (a list left
    # on it would be joined, and never run). What is dropped stays referenced until the
    # child next hands work off: freed here, it could free a host stream whose finalizer
    # takes a lock the fork still holds (host.py's hook runs after this one).
    global _cond, _queue, _workers, _blocked, _running
    for item in _queue:
        if type(item) is not list:
            _fork_dropped.append(item.callbacks)
            item.callbacks = None
    # So is what another thread of the parent had retired and was finishing (in finish(),
    # between the sweep and its hand-off or run): that thread does not exist here. The forking
    # thread's own (a fork from a callback that finish() runs) it runs when it returns.
    me = threading.get_ident()
    for key, (ident, sub) in list(retiring.items()):
        if ident != me or sub.callbacks is None:  # (None: its list was queued, dropped above)
            del retiring[key]
            if sub.callbacks is not None:
                _fork_dropped.append(sub.callbacks)
                sub.callbacks = None
    _fork_dropped.append(_queue)
    _cond = threading.Condition(_lock)  # (_lock itself is re-initialized by runtime.state)
    _queue = collections.deque()
    _workers = _blocked = _running = 0
    _local.__dict__.pop("worker", None)
    # the parent's deferred errors and leak warnings are the parent's to report (the exceptions
    # kept referenced, as the callbacks above: their tracebacks may hold what a finalizer frees)
    _fork_dropped.append((list(RUNTIME.errors), list(RUNTIME.warnings)))
    RUNTIME.errors.clear()
    RUNTIME.warnings.clear()


at_fork_child(_after_fork_child, 0)
