"""Where callbacks of retired work run (``then`` continuations, ``add_done_callback``).

They run in whichever thread retires the work -- a user thread blocked in ``result()``, a host
stream's worker -- except the retirer thread: what it retires is handed to the callback thread
(``sharedmem-callbacks``), so a continuation that blocks (on another continuation's result, on
I/O) never stops retirement for everyone else.

A continuation may wait for another continuation still queued here behind it, on this one
thread: every wait on a :class:`~sharedmem.HostFuture` therefore *helps*, running queued
callbacks while its own is not done (:func:`wait_helping`), so the queue always drains.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

from .state import RUNTIME, fork_safe, log

__all__ = ["run", "hand_off", "wait_helping", "retirer_ident"]

# Batches of callbacks handed off by the retirer; lock-free (deque.append and popleft are
# atomic under the GIL), so the retirer never blocks here.
_queue = collections.deque()
_wake = threading.Event()
_thread = None  # the callback thread, started on the first hand-off
_start_lock = fork_safe(threading.Lock())
#: The retirer thread's ident (set by runtime.retirer when it starts); 0 before.
retirer_ident = [0]


def run(cbs) -> None:
    """Run callbacks in this thread; their errors surface at the next API call of a user
    thread (``submission.raise_deferred``)."""
    errors = RUNTIME.errors
    for cb in cbs:
        try:
            cb()
        except BaseException as e:
            errors.append(e)


def hand_off(cbs) -> None:
    """Queue callbacks for the callback thread (the retirer calls this; never blocks)."""
    _queue.append(cbs)
    t = _thread
    if t is None or not t.is_alive():
        _ensure()
    _wake.set()


def _ensure() -> None:
    global _thread
    with _start_lock:
        if _thread is None or not _thread.is_alive():
            t = threading.Thread(target=_run, name="sharedmem-callbacks", daemon=True)
            t.start()
            _thread = t
            log.debug("callback thread started")


def _run_one() -> bool:
    try:
        cbs = _queue.popleft()
    except IndexError:
        return False
    run(cbs)
    return True


def _run() -> None:
    while not sys.is_finalizing():
        _wake.wait()
        _wake.clear()
        while _run_one():
            pass


def wait_helping(event, timeout) -> bool:
    """``event.wait(timeout)``, running queued callbacks meanwhile (see the module docstring).
    True once the event is set."""
    if event.is_set():
        return True
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        while not event.is_set() and _run_one():
            pass
        step = 0.002  # (how soon a callback queued meanwhile is noticed)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return event.is_set()
            step = min(step, left)
        if event.wait(step):
            return True


def _after_fork_child() -> None:
    global _thread, _wake
    _thread = None
    _wake = threading.Event()
    if _queue:  # (handed off in the parent, not yet run: the child runs its copy)
        _ensure()
        _wake.set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_child)
