"""The retirer: one daemon thread that retires finished work.

Retirement also happens on every submission (the front of that stream's FIFO
is swept) and whenever a future is asked; the thread covers work nobody asks
about -- the fire-and-forget launch whose future was dropped. It runs while
work on a backend that must be polled (CUDA) is pending, sweeping every
``POLL_INTERVAL`` seconds, and otherwise sleeps on an event that backends set
when they know work completed (host streams do, after every task).

In the trio manner: one named daemon thread; its intervals are module
constants tests can patch; it drops references at once; it does nothing while
the interpreter finalizes; a failure inside it is re-raised at the next API
call (``submission.raise_deferred``) rather than printed.
"""

from __future__ import annotations

import sys
import threading

from . import callbacks as _callbacks
from . import submission as _sub
from .state import RUNTIME, Bell, at_fork_child, fork_safe, log

#: Seconds between sweeps while work is pending.
POLL_INTERVAL = 0.0002
#: Seconds the thread sleeps when nothing is pending (it is woken earlier).
IDLE_INTERVAL = 0.5
#: Seconds the thread keeps polling after it last saw pending device work, so
#: a burst of launches never has to wake it (a wake costs a GIL handoff).
LINGER = 0.02
#: Seconds between sweeps while threads submit fast enough to sweep for
#: themselves (submit() sweeps every SWEEP_EVERY-th submission to a stream):
#: polling then would only steal the GIL from them.
BUSY_INTERVAL = 0.005
#: Launches submitted since its last sweep that make the retirer take the threads as busy.
BURST = 32

_thread: threading.Thread | None = None
# Taken without waiting: whoever holds it is starting the thread already. (Starting one
# allocates; a collection there can run a finalizer that ends a hold, files a lease -- and
# calls ensure() on this thread again, with the lock held.)
_start_lock = fork_safe(threading.Lock())


_bell = Bell()  # what wakes the retirer

# What the retirer thread calls once, on itself, before its next pass (and again on a new
# thread after a fork): a backend's per-thread driver settings for the queries it makes
# there. Appended to, never changed otherwise (read lock-free by the thread).
_setups: list = []


def on_retirer_thread(fn) -> None:
    """Have the retirer thread call ``fn()`` once, before its next pass (a running one too);
    ``fn`` registered already: nothing. What it raises is re-raised at the next API call, as
    the retirer's errors are."""
    if fn not in _setups:
        _setups.append(fn)


def wake() -> None:
    """Make the retirer sweep now (lock-free; safe from any thread, and from finalizers)."""
    _bell.ring()


def ensure() -> None:
    """Start the retirer thread if it is not running (callers ask only while
    ``RUNTIME.retirer_running`` is unset)."""
    global _thread
    if not _start_lock.acquire(False):
        return  # (being started: by another thread, or by this one in a frame below)
    try:
        if _thread is None or not _thread.is_alive():
            t = threading.Thread(target=_run, name="sharedmem-retirer", daemon=True)
            t.start()  # (raises before anything is recorded: the caller's work stays valid)
            _thread = t
            log.debug("retirer thread started")
            RUNTIME.retirer_running = True
    finally:
        _start_lock.release()


def _run() -> None:
    import time
    _callbacks.retirer_ident[0] = threading.get_ident()
    rt = RUNTIME
    last_busy = 0.0
    last_submitted = 0
    # Each active stream's (newest seq, newest retired seq) at the last pass (this thread's
    # own; holds only streams that were active then). A stream that got SWEEP_EVERY
    # submissions or more since, and whose work was retired meanwhile, is being swept by its
    # submitters (submit() sweeps every SWEEP_EVERY-th): the retirer leaves it to them, so it
    # never contends with a thread launching in a tight loop -- measured on an H200, its
    # passes over such a stream cost that thread 2 us a launch (8.4 against 6.5 us with the
    # retirer parked). It sweeps the stream again once the burst ends, or when nobody else
    # retired any of its work (leases filed without a submission: holds' ends, which new
    # holds on the stream also sweep, see submission.sweep_long). Keyed by the streams' uids,
    # not the streams: an idle retirer keeps no stream (nor its device, nor a borrowed CuPy
    # or torch stream object) alive.
    seen = {}
    set_up = 0  # (how many of _setups this thread has called)
    while not sys.is_finalizing():
        try:
            while set_up < len(_setups):
                set_up += 1  # (first: one that raises is not called again at every pass)
                _setups[set_up - 1]()
            seen, poll = _pass(rt, seen)
        except BaseException as e:  # re-raised in a user thread (once while it repeats)
            if not _pending(rt.errors, e):
                rt.errors.append(e)
            seen, poll = {}, True
        now = time.monotonic()
        submitted = rt.submitted
        burst = submitted - last_submitted >= BURST
        last_submitted = submitted
        if poll:
            last_busy = now
        if burst:
            _bell.sleep(BUSY_INTERVAL)
        elif poll or now - last_busy < LINGER:
            _bell.sleep(POLL_INTERVAL)
        else:
            rt.retirer_idle = True  # submit() wakes us only while this is set
            # (looked at again once it is set: a stream to poll that became active after this
            # pass saw it unset and did not ring -- its work would wait the idle interval)
            if not _polled_active(rt):
                _bell.sleep(IDLE_INTERVAL)
            rt.retirer_idle = False


def _pending(errors, e) -> bool:
    """Whether an error like ``e`` (its type and message) waits in ``errors`` already: a
    failure at every pass (a device whose context cannot be made current: each pass every
    0.2 ms) is reported once until a user thread takes it, not queued without bound."""
    # (a copy: user threads take errors meanwhile)
    return any(type(x) is type(e) and str(x) == str(e) for x in list(errors))


def _pass(rt, last):
    """One pass of the retirer over the active streams: ``(seen, poll)``, ``seen`` to pass to
    the next one (see _run), ``poll`` whether work is still pending. A function of its own
    so that nothing it touched stays referenced from the loop while the retirer sleeps."""
    poll = False
    seen = {}
    todo = []
    for s in list(rt.active):  # (read without the lock: a stale view only delays)
        now_seen = (s._seq, s._done)
        seen[s._uid] = now_seen
        prev = last.get(s._uid)
        if prev is None or now_seen[0] - prev[0] < _sub.SWEEP_EVERY or now_seen[1] == prev[1]:
            todo.append(s)
        else:
            poll = True  # (still pending work: keep polling)
    if todo:
        # (each stream's entry in seen rewritten after its own sweep: what it retired is not
        # taken for the submitters' progress at the next pass)
        _sub.sweep_each(todo, seen)
        if _polled_active(rt):
            poll = True
    return seen, poll


def _polled_active(rt) -> bool:
    """Whether an active stream's backend must be polled (a copy of the set is walked: it is
    also read without the lock)."""
    return any(s.device.backend.needs_polling for s in list(rt.active))


def _after_fork_child() -> None:
    # the parent's retirer thread does not exist here; the next submission starts one
    global _thread, _bell
    _thread = None
    _bell = Bell()  # (the parent's may be in any state)


at_fork_child(_after_fork_child, 0)


def attach_backend(backend) -> None:
    """Let a backend wake the retirer when it knows work completed."""
    if hasattr(backend, "on_progress"):
        backend.on_progress = wake


RUNTIME.ensure_retirer = ensure
RUNTIME.wake_retirer = wake
