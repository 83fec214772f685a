"""The host backend: "device" memory in host RAM, every stream a worker thread.

It runs the same ownership core as the CUDA backend, with real asynchrony, so
every ownership, lease and retirement rule is exercised on machines without a
GPU. Pointers are real host addresses, so NumPy can consume exports by DLPack.

* Memory comes from :class:`HostPool`, which -- like CuPy's pool -- hands a
  freed block out again at once to the next request of the same size class.
  Freeing early would therefore corrupt results, which is what the tests
  would notice.
* A stream is a FIFO of tasks run by one daemon thread. A host kernel that raises an
  ``Exception`` *fails* its own work only: the task ended (its completion is known), its
  marker carries the exception as ``failure``, and the stream runs on. Anything else that
  raises -- a copy, a wait on work of unknown completion, a kernel interrupted by a
  ``BaseException`` such as :class:`HostFault` (a simulated device fault) --
  *faults* the stream, like a sticky CUDA error: that task and every later one on the
  stream have unknown completion (their markers say so), and the stream runs nothing more.
* Markers (:class:`HostMarker`) are set by the worker when a task has run.
* A stream queues at most ``MAX_QUEUED`` tasks: a submission beyond that
  waits (before taking any lock) for the worker to catch up, as a CUDA launch
  waits for room in the device's queue -- so fire-and-forget loops faster than
  their kernels cannot grow memory without bound.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import math
import ctypes
import sys
import threading
import traceback
import time
import weakref

import numpy as np

from ..errors import CaptureError, CompletionUnknownError, SharedMemError
from ..runtime.state import (RUNTIME, WORKER, Bell, LockMark, at_fork_child, at_fork_hold,
                             enter_marked, enter_or_stage_marked, fork_holds, fork_safe,
                             leave_marked, log)
from . import COMPLETE, DONE, PENDING, UNKNOWN

__all__ = ["HostBackend", "HostMarker", "HostStreamImpl", "HostPool", "host_array"]

_ALIGN = 256
#: Tasks a host stream queues before a submission waits for room (see throttle()).
MAX_QUEUED = 1024


def host_array(ptr: int, nbytes: int) -> np.ndarray:
    """A writable ``uint8`` NumPy array over host memory ``[ptr, ptr+nbytes)``.
    Keeps nothing alive: the caller must keep the memory valid."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.frombuffer((ctypes.c_ubyte * nbytes).from_address(ptr), dtype=np.uint8)


def _aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``_ALIGN``."""
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class HostBlock:
    """A block of the host pool. Owns its memory: when the block is garbage
    collected it goes back to the pool (never at interpreter exit)."""

    __slots__ = ("ptr", "_raw", "_pool", "_size_class")

    def __init__(self, raw: np.ndarray, ptr: int, pool, size_class: int):
        self._raw = raw
        self.ptr = ptr
        self._pool = pool
        self._size_class = size_class

    def __del__(self, _finalizing=sys.is_finalizing):
        if self._raw is not None and not _finalizing():
            self._pool._give_back(self._size_class, self._raw)
            self._raw = None

    # Invariant: one HostBlock object per block handed out, so the memory goes back to the
    # pool once. A copy (copy.copy shares ``_raw``) would give it back a second time when it
    # died -- while the allocation's views still use it -- and the pool hand it to two
    # allocations; a pickle would carry memory of this process. Both are refused.
    def __reduce_ex__(self, protocol):
        raise TypeError(f"cannot copy or pickle the host pool block at {self.ptr:#x}: it owns "
                        f"memory of this process, which a copy would return to the pool twice. "
                        f"Copy the data instead (copy.copy(view) makes a new allocation)")

    def __copy__(self):
        return self.__reduce_ex__(2)

    def __deepcopy__(self, memo):
        return self.__reduce_ex__(2)


class HostFault(BaseException):
    """Raised in a host kernel, simulates a sticky device fault (an illegal address on a
    GPU): the kernel's completion, and that of everything after it on its stream, is
    unknown; the stream faults and its memory is kept, never freed. (An ordinary
    ``Exception`` fails only the kernel's own future: see the module docstring.)"""


# Marks the threads in a host pool operation (see HostPool: finalizers give blocks back)
_in_pool = LockMark()


#: The most bytes of free blocks a host pool keeps for reuse: a block given back past it is
#: freed (blocks of sizes that never come again would otherwise be kept for good).
POOL_CACHE_MAX = 256 << 20


class HostPool:
    """A size-class pool of 256-byte-aligned host blocks with immediate reuse.

    ``_free`` maps size class -> list of raw arrays, ``cached`` their bytes (at most
    POOL_CACHE_MAX); guarded by ``_lock`` (a leaf lock; ``_give_back`` is called from
    destructors, and only appends). ``_staged``: blocks given back while this thread's own
    pool operation held ``_lock`` (see _give_back); appended lock-free, given back by that
    operation once it let the lock go.
    """

    def __init__(self):
        self._lock = fork_safe(threading.Lock())
        # held across a fork (after the core lock and the task queues' locks): a thread of the
        # parent between a free list's pop and the count's update would leave the child's
        # bytes_in_use a block off
        at_fork_hold(self._lock.acquire, self._lock.release)
        self._free: dict[int, list] = {}  # guarded by self._lock
        self.bytes_in_use = 0  # guarded by self._lock
        self.cached = 0  # bytes of the blocks in _free; guarded by self._lock
        self._staged = collections.deque()  # (size class, raw array): see the class docstring
        self._apply = self._give_back_staged  # (bound once: made under the lock, it would be an
        # allocation there)

    # The pool's lock is a leaf taken by HostBlock finalizers (_give_back). Nothing under it
    # allocates a garbage-collected object (acquire()/release(), never `with`: its exit call
    # allocates its argument tuple while the lock is held; the free lists made before it is
    # taken) -- yet a collection, and a block's finalizer, can still run while it is held
    # (see runtime.state.LockMark; host.py is never compiled): each operation marks its thread
    # (_take, _let_go), and a give-back that finds the lock taken by its own thread's
    # operation is staged, done by that operation once it let the lock go.
    def _take(self) -> bool:
        return enter_marked(self._lock, _in_pool)

    def _let_go(self, was: bool) -> None:
        self._lock.release()
        leave_marked(_in_pool, was, self._staged, self._apply)

    def _give_back_staged(self, item) -> None:
        self._give_back(*item)

    def allocate(self, nbytes: int) -> HostBlock:
        sc = _aligned(max(nbytes, 1))  # the size class
        was = self._take()
        try:
            lst = self._free.get(sc)
            raw = lst.pop() if lst else None
            if raw is not None:
                self.bytes_in_use += sc
                self.cached -= sc
        finally:
            self._let_go(was)
        if raw is None:  # a new block, counted once it exists (a failure hands nothing out)
            raw = self._new_block(sc, nbytes)
            was = self._take()
            try:
                self.bytes_in_use += sc
            finally:
                self._let_go(was)
        return HostBlock(raw, _aligned(raw.ctypes.data), self, sc)

    def _new_block(self, sc: int, nbytes: int):
        """A new raw block of size class ``sc`` (for ``nbytes``); on MemoryError the cached
        free blocks are dropped and the allocation tried once more (as CuPy's pool does), then
        a MemoryError naming the size is raised."""
        try:
            return np.empty(sc + _ALIGN, np.uint8)
        except MemoryError:
            self.free_all_blocks()
        try:
            return np.empty(sc + _ALIGN, np.uint8)
        except MemoryError:  # (NumPy's words name an array of uint8, not the allocation)
            raise MemoryError(f"cannot allocate {nbytes} bytes on <Device host>: out of host "
                              f"memory (the pool's cached blocks were given back first)") from None

    def _give_back(self, size_class: int, raw) -> None:
        fresh = []  # (a free list made before the lock is taken, used if this size has none)
        held = fork_holds()  # (a block freed inside os.fork(): this thread holds the lock)
        if not held:
            was = enter_or_stage_marked(self._lock, _in_pool, self._staged, (size_class, raw))
            if was is None:  # (staged: under this thread's own pool operation)
                return
        try:
            if self.cached + size_class <= POOL_CACHE_MAX:
                self._free.setdefault(size_class, fresh).append(raw)
                self.cached += size_class
            self.bytes_in_use -= size_class
        finally:
            if not held:
                self._let_go(was)
        raw = None  # (one not kept is freed here, outside the lock)

    def free_all_blocks(self) -> None:
        """Drop every cached free block (like ``cupy``'s ``free_all_blocks``)."""
        empty = {}
        was = self._take()
        try:
            blocks, self._free = self._free, empty
            self.cached = 0
        finally:
            self._let_go(was)
        blocks.clear()  # (the blocks freed outside the lock)


class HostMarker:
    """Completion marker of one task on a host stream.

    ``query()`` returns 0 (pending), 1 (done) or 2 (unknown: the task, or an
    earlier one on its stream, raised; ``error`` holds why)."""

    __slots__ = ("_event", "error", "failure", "unretrieved", "isolated", "tasks")
    recorded = True  # (markers of other backends may be recorded lazily)

    def __init__(self, isolated=False, tasks=None):
        self._event = threading.Event()
        self.error = None  # why completion is unknown (the stream faulted)
        self.failure = None  # the exception an isolated task (a host kernel) ended with
        self.unretrieved = None  # with failure, until its future's user saw it (retrieved())
        self.isolated = isolated  # an exception fails this task only (see the module docstring)
        self.tasks = tasks  # the _Tasks of its stream: whose worker runs it

    def query(self) -> int:
        if not self._event.is_set():
            return PENDING
        return UNKNOWN if self.error is not None else DONE

    def wait(self, timeout=None) -> bool:
        """Block until the task ran (or failed); False on timeout. SharedMemError where the
        caller is the worker that would run it: a task waiting for one queued behind it on
        its own stream would wait forever."""
        ev = self._event
        if ev.is_set():  # (no Event lock taken: a forked child may have a copy of it held)
            return True
        if timeout != 0:
            mine = getattr(_current_worker, "q", None)  # (a worker's own queue, else None)
            if mine is not None and mine.worker == threading.get_ident() and \
                    _waits_for(self, mine):
                how = "" if self.tasks is mine else (
                    " (through work on another stream that was ordered after it: it uses bytes "
                    "this kernel has yet to finish with)")
                raise SharedMemError(
                    f"a host kernel on host stream {mine.name!r} waits for its own work or work "
                    f"queued behind it on its own stream{how}, which cannot finish before the "
                    f"kernel returns: it would wait forever. Wait outside the kernel, or submit "
                    f"that work to another stream")
        return ev.wait(timeout)

    def recycle(self) -> None:
        pass

    def retrieved(self) -> None:
        """``failure`` was seen (its future's ``result()``, ``exception()``, ``await``,
        ``then()``): nothing is reported when the marker goes."""
        u = self.unretrieved
        if u is not None:
            u.error = None
            self.unretrieved = None


class _Unretrieved:
    """A failed host kernel's exception, kept by its marker (``HostMarker.unretrieved``)
    until the future's user retrieves it. Garbage-collected before that -- the marker, the
    work's last trace, went -- it is logged at ERROR, once: the kernel was launched and
    forgotten (as asyncio logs a future's exception never retrieved)."""

    __slots__ = ("error", "label", "__weakref__")

    def __init__(self, error, label):
        self.error = error
        self.label = label
        _unretrieved.add(self)  # (what is left at exit is reported then: see _finish_at_exit)

    def __del__(self, _finalizing=sys.is_finalizing):
        if not _finalizing():  # (during finalization logging may be gone: exit reported it)
            if self.error is not None and RUNTIME.owner == threading.get_ident():
                # Dropped under the core lock (the access record of the work pruned, its
                # marker with it): the log's handlers are foreign code, which never runs
                # there -- one that calls sharedmem would get SharedMemError, one that blocks
                # would stall every thread. Reported once the lock is let go (drop_later).
                later = _Unretrieved.__new__(_Unretrieved)
                later.error, later.label = self.error, self.label
                self.error = None
                RUNTIME.drop_later(later)
            else:
                self.report()

    def report(self) -> None:
        e = self.error
        if e is not None:
            self.error = None
            log.error("the exception of %s was never retrieved: %r (no result(), exception() "
                      "or await of its future, or of a then() or composite op future carrying "
                      "it, looked at it)", self.label, e, exc_info=e)


_unretrieved = weakref.WeakSet()  # the _Unretrieved alive (reported or retrieved, or not yet)


def _unretrieved_now() -> list:
    """A copy of ``_unretrieved``, taken again where a worker added one meanwhile (iterating
    a WeakSet whose set changes size raises RuntimeError; at exit, a worker running past
    EXIT_TIMEOUT may still fail a kernel)."""
    while True:
        with contextlib.suppress(RuntimeError):
            return list(_unretrieved)


class _Tasks:
    """One host stream's FIFO of ``(fn, marker)`` tasks (None: stop), and the task its worker
    runs. ``put()`` appends to ``items`` and rings ``bell`` without a lock (a deque's append
    and popleft are atomic under the GIL; the worker sleeps on ``bell``, a
    :class:`~sharedmem.runtime.state.Bell`, rung after the append: no wake is lost) -- so a
    put allocates nothing under a lock, and a finalizer may put (the stop) from anywhere.
    ``lock`` guards the hand-over: a task leaves ``items`` and becomes ``running`` in one
    step, and stops being ``running`` only after its marker is set -- so a fork, which takes
    every ``lock`` first, sees each task exactly once: queued, running (its marker set: it is
    done), or done.

    Nothing under ``lock`` allocates a garbage-collected object, so no finalizer ever runs
    while it is held: ``lock`` is taken under the core lock (the fork), and a finalizer that
    waited for the core lock there would deadlock. That rules out ``with lock:`` too:
    interpreted, the statement's exit calls ``lock.__exit__(None, None, None)``, and that
    call builds its argument tuple while the lock is still held (a collection there hung the
    worker-finalizer test 1 run in 20); ``acquire()`` and ``release()`` allocate nothing."""

    __slots__ = ("lock", "bell", "items", "running", "worker", "name")

    def __init__(self, name):
        self.lock = threading.Lock()
        self.items = collections.deque()
        self.running = None  # the (fn, marker) the worker runs now; guarded by lock
        self.worker = None  # the worker thread's ident (set as it starts; a new one after a fork)
        self.name = name  # the stream's (for messages)
        self.bell = Bell()  # (a new one in a forked child: see HostStreamImpl._after_fork_child)

    def put(self, item) -> None:
        """Queue ``item`` (None: the worker's stop) and ring the bell. Lock-free: see above."""
        self.items.append(item)
        self.bell.ring()


class HostStreamImpl:
    """A FIFO of tasks run by one daemon thread (``sharedmem-host-stream-N``).

    The worker holds only the queue and its state, never the Stream object,
    so dropping the Stream is never blocked by its work.
    """

    _numbers = itertools.count(1)  # (next() is atomic under the GIL: no two streams share one)

    def __init__(self, backend: "HostBackend", name: str | None = None):
        self.name = name or f"sharedmem-host-stream-{next(HostStreamImpl._numbers)}"
        self.handle = id(self)
        self._q = _Tasks(self.name)
        self._state = {"fault": None}
        self._backend = backend
        self.recording = None  # while capturing: the tasks recorded (see begin_capture)
        self._start_worker()
        _impls.add(self)

    def _start_worker(self) -> None:
        t = threading.Thread(target=_worker, args=(self._q, self._state, self._backend),
                             name=self.name, daemon=True)
        t.start()
        self._worker = t
        self._q.worker = t.ident
        self._finalized = False  # (set by __del__: its worker was told to stop)

    def _after_fork_child(self) -> None:
        """In a forked child (the fork held this stream's task lock: see _Tasks): a new worker
        thread for the tasks that had not started. A task that was running when the process
        forked ran only partly in this copy: the stream faults (its completion is unknown),
        so waits on it raise CompletionUnknownError instead of hanging. A fork from inside
        one of this stream's own tasks is the worker itself, which goes on here."""
        q = self._q
        if q.worker == threading.get_ident():
            return
        q.bell = Bell()  # (the parent's worker may have been sleeping on the old one)
        running, q.running = q.running, None
        marker = running[1] if running is not None else None
        if marker is not None:
            # The parent's worker may have been inside this marker's Event.set() (it runs
            # outside the task lock), holding the Event's own lock, which no thread of the
            # child will ever release: the marker gets a new Event, set below (whatever
            # state it reached).
            if marker._event.is_set():  # its work had run: done, as in the parent
                running = None
            marker._event = threading.Event()
        if running is not None:
            if self._state["fault"] is None:
                self._state["fault"] = CompletionUnknownError(
                    f"{self.name} was running a task when the process forked; in the child its "
                    f"completion is unknown. Use a new stream in the child (or fork when no "
                    f"work is in flight, or use the 'spawn' start method)")
            if marker is not None and marker.error is None:
                marker.error = self._state["fault"]
        if marker is not None:
            marker._event.set()  # (done; unknown -- or failed by an earlier fault: never a hang)
        # The queued tasks' markers get new Events too: a thread of the parent entering or
        # leaving a wait on one (a user thread in result(), another stream's worker) held its
        # Event's lock, which no thread of the child will release -- the new worker's set()
        # and every wait would hang on it. (None of them is set: their tasks have not run.)
        for item in q.items:
            if item is not None and item[1] is not None:
                item[1]._event = threading.Event()
        self._start_worker()

    def throttle(self) -> None:
        """Wait while ``MAX_QUEUED`` tasks are queued on this stream (called by
        the runtime before it takes any lock). Never in the stream's own worker:
        a task that submits to its own stream must not wait for itself -- nor in another
        stream's worker while this stream's queue waits for that worker's work (a host kernel
        launching work that sharedmem ordered after the kernel itself): the room would come
        only once the kernel returned, so it would wait forever."""
        q = self._q
        if len(q.items) < MAX_QUEUED or threading.get_ident() == q.worker:
            return
        mine = getattr(_current_worker, "q", None)  # (a host kernel submitting: its queue)
        delay = 50e-6
        while len(q.items) >= MAX_QUEUED:
            if mine is not None and _queue_waits_for(q, mine):
                return
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    @property
    def fault(self):
        """The exception that faulted this stream, or None."""
        return self._state["fault"]

    def submit(self, fn, isolated=False) -> HostMarker:
        """Enqueue ``fn()``; returns its marker. Never blocks. ``isolated``: an exception of
        ``fn`` fails this task only (host kernels), instead of faulting the stream. While the
        stream captures a graph, ``fn`` is recorded instead (see ``begin_capture``)."""
        rec = self.recording
        if rec is not None:
            rec.append(fn)
            return COMPLETE
        return self.queued(fn, isolated)

    def queued(self, fn, isolated=False) -> HostMarker:
        """``fn`` queued to run, capturing or not (what the exit waits for: a marker recorded
        into another thread's capture would mark nothing); see :meth:`submit`. On a stream
        known faulted, the marker is unknown at once (a wait for it refuses, as for any
        marker of unknown completion, instead of faulting the waiter when it runs)."""
        m = HostMarker(isolated, self._q)
        fault = self._state["fault"]
        if fault is not None:  # (as its worker would: nothing more runs there)
            m.error = fault
            m._event.set()
            return m
        if self._finalized:
            self._revive()
        self._q.put((fn, m))
        return m

    def submit_marker(self) -> HostMarker:
        """A marker reached once everything enqueued so far ran (see StreamImpl)."""
        return self.submit(_noop)

    def wait_marker(self, marker: HostMarker) -> None:
        """Make later tasks wait for ``marker`` (a failed marker faults this
        stream too: what it waited for is unknown). Never while capturing: every caller
        refuses a capturing stream first (a capture cannot wait for work outside it)."""
        if self._finalized:
            self._revive()
        self._q.put((_WaitTask(marker), None))

    def synchronize(self) -> None:
        if self.recording is not None:
            raise CaptureError("a capturing stream cannot be synchronized")
        self.submit(_noop).wait()

    def __del__(self):
        try:
            self._finalized = True
            self._q.put(None)  # (its worker stops)
        except Exception:
            pass

    def _revive(self) -> None:
        """Work for a stream whose finalizer already stopped its worker: the garbage
        collector finalized it in the same collection as an object whose finalizer then
        used it (a view's hold ending on it files a lease here) and so brought it back. A
        new worker, which first waits for the old one to finish what it was given (FIFO).
        A finalizer runs once (PEP 442): the new worker is stopped when this object really
        dies by a weakref callback; and the collector took it out of ``_impls`` before
        finalizing it, so it is put back (fork restarts its worker, exit finishes its work)."""
        with _revive_lock:  # (two threads using it at once: one new worker)
            if not self._finalized:
                return
            old = self._worker
            q = self._q = _Tasks(self.name)
            q.put((old.join, None))
            self._start_worker()
            weakref.finalize(self, q.put, None).atexit = False  # (exit: see _finish_at_exit)
            _impls.add(self)


def _noop():
    pass


class _WaitTask:
    """A task that makes its stream wait for ``marker`` (of another stream)."""

    __slots__ = ("marker",)

    def __init__(self, marker):
        self.marker = marker

    def __call__(self):
        marker = self.marker
        marker.wait()
        if marker.error is not None:
            raise CompletionUnknownError(
                f"this stream waited for work whose completion is unknown: {marker.error!r}")


#: The task queue of the host stream whose worker is this thread (None elsewhere).
_current_worker = threading.local()


def _waits_for(marker, mine) -> bool:
    """Whether ``marker`` is reached only after a task of queue ``mine`` that has not run:
    it is one of its tasks, or queued behind a wait for one on another host stream (and so
    on, transitively). Read without the queues' locks (nothing may allocate under them): a
    race can only miss a dependency, never invent one."""
    todo, seen = [marker], set()
    while todo:
        m = todo.pop()
        q = getattr(m, "tasks", None)  # (markers of other kinds wait for no host task)
        if q is None or id(m) in seen or m._event.is_set():
            continue
        if q is mine:
            return True
        seen.add(id(m))
        ahead = []  # (the waits queued before m's task: counted only once it is found)
        # (one step under the GIL: the deque's iterator is made before it is read, and the
        # copy runs no Python code -- no thread, nor a finalizer, can change it meanwhile)
        for item in [q.running, *q.items]:
            if item is not None:
                if item[1] is m:
                    todo += ahead
                    break
                if type(item[0]) is _WaitTask:
                    ahead.append(item[0].marker)
    return False


def _queue_waits_for(q, mine) -> bool:
    """Whether a task queued (or running) on queue ``q`` waits for a task of queue ``mine``
    that has not run (see :func:`_waits_for`; read the same way, without the locks)."""
    for item in [q.running, *q.items]:  # (one step under the GIL: see _waits_for)
        if item is not None and type(item[0]) is _WaitTask and _waits_for(item[0].marker, mine):
            return True
    return False


_revive_lock = fork_safe(threading.Lock())


def _worker(q, state, backend) -> None:
    _current_worker.q = q
    WORKER.kernels = True  # (deferred errors wait for a user thread: see raise_deferred)
    lock, items = q.lock, q.items
    while True:
        lock.acquire()
        while not items:
            lock.release()
            q.bell.sleep()  # (until put() rings; at once if it rang while this ran tasks)
            lock.acquire()
        item = items.popleft()
        q.running = item  # (in the same step: see _Tasks)
        lock.release()
        if item is None:
            return
        fn, marker = item
        # `item` stays referenced until after the lock is let go below: clearing q.running
        # under the lock must not free the task (its arguments' finalizers may call sharedmem)
        fault = state["fault"]
        if fault is None:  # (a faulted stream runs nothing more: unknown completion)
            try:
                fn()
            except BaseException as e:
                if marker is not None and marker.isolated and isinstance(e, Exception):
                    # What it holds of the kernel's NumPy views goes: their memory is freed
                    # and reused once the work retires, and the future keeps the exception (a
                    # debugger or error reporter reading them would touch another view's bytes)
                    _detach(e, getattr(fn, "args", ()))
                    marker.failure = e  # this work failed; its completion is known
                    kernel = getattr(fn, "func", fn)  # (a host kernel's task: a partial)
                    marker.unretrieved = _Unretrieved(
                        e, f"host kernel {getattr(kernel, '__qualname__', kernel)} on host "
                           f"stream {q.name!r}")
                    log.info("a host kernel raised %r; its future fails, the stream runs on", e)
                else:  # the stream faulted: sticky, like a CUDA error
                    state["fault"] = e
        fn = None
        if marker is not None:
            marker.error = state["fault"]  # (None: it ran; else why its completion is unknown)
            marker._event.set()  # (outside lock: it allocates; see _Tasks)
        lock.acquire()  # (not `with lock:`, whose exit call allocates: see _Tasks)
        q.running = None
        lock.release()
        item = None  # (the task may be freed here: outside the lock)
        if marker is not None:
            marker = None
            hook = backend.on_progress
            if hook is not None and fault is None:  # (not for work never run: see above)
                hook()


def _detach(e, args) -> None:
    """Cut what ``e`` -- and the exceptions chained to it (``raise ... from``, or raised while
    handling one) or grouped in it (an ExceptionGroup's) -- holds of the NumPy arrays among a
    host kernel's arguments ``args``: its frames' locals are cleared, and an array or a
    memoryview in its ``args`` or attributes that may share memory with one of them is
    replaced by a copy (the values the kernel saw)."""
    views = [a for a in args if isinstance(a, np.ndarray)]

    def detached(x):
        if isinstance(x, memoryview):  # (`x.data`, `memoryview(x)`: the same bytes)
            a = np.asarray(x)
            return memoryview(a.copy()) if any(np.may_share_memory(a, v) for v in views) else x
        shared = isinstance(x, np.ndarray) and any(np.may_share_memory(x, v) for v in views)
        return x.copy() if shared else x
    todo, seen = [e], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        if views:
            # (an exception type whose args cannot be set: kept as it is)
            with contextlib.suppress(Exception):
                e.args = tuple([detached(a) for a in e.args])
                d = getattr(e, "__dict__", None)
                for k in list(d or ()):
                    d[k] = detached(d[k])
        todo += (e.__cause__, e.__context__)
        # an ExceptionGroup's members (not an attribute of that name that holds others)
        with contextlib.suppress(Exception):
            todo += [x for x in e.exceptions if isinstance(x, BaseException)]


_impls = weakref.WeakSet()  # every host stream's impl (fork restarts their workers)


_forking = []  # the task queues whose locks the fork holds (the forking thread only)


def _before_fork() -> None:
    for impl in list(_impls):  # (a consistent snapshot of every queue: see _Tasks)
        q = impl._q
        q.lock.acquire()
        _forking.append(q)


def _after_fork_parent() -> None:
    while _forking:
        _forking.pop().lock.release()


def _after_fork_child() -> None:
    _after_fork_parent()  # (held by this thread, which the child has)
    for u in list(_unretrieved):  # (the parent's failures: the parent reports them)
        u.error = None
    for impl in list(_impls):
        impl._after_fork_child()


at_fork_hold(_before_fork, _after_fork_parent)
at_fork_child(_after_fork_child, 1)


#: Seconds the interpreter's exit waits, in all, for host work still queued or running.
EXIT_TIMEOUT = 10.0


def _finish_at_exit() -> None:
    """At exit, finish the host work in flight (the workers are daemon threads: the
    interpreter would drop it silently), or say what was dropped."""
    deadline = time.monotonic() + EXIT_TIMEOUT
    dropped = []
    for impl in list(_impls):
        if impl._state["fault"] is not None:
            continue
        queued, running = len(impl._q.items), impl._q.running is not None
        if not queued and not running:
            continue
        if not impl.queued(_noop).wait(max(0.0, deadline - time.monotonic())):
            what = f"{queued} queued" + (", 1 running" if running else "")
            dropped.append(f"{impl.name} ({what})")
    if dropped:
        log.warning("exit: host work unfinished, dropped: %s", ", ".join(dropped))
        from ..runtime.callbacks import warn_at_exit
        warn_at_exit(f"sharedmem: the interpreter exits with host work unfinished after "
                      f"{EXIT_TIMEOUT} s; dropped: {', '.join(dropped)}. Synchronize "
                      f"(sm.synchronize()) before exit to keep it.", RuntimeWarning)
    # What finished is retired, and its callbacks run (this hook, registered once a host
    # stream exists, runs before the callbacks' own drain), whatever the retirer had swept
    # by now: a then() or add_done_callback of work that finished -- waited for above, or
    # before the exit -- runs, instead of being dropped unsaid (the drain sees only what was
    # handed off, and the retirer, woken by the last task, may not have swept it yet); a
    # then() chained after a failed kernel looks at the exception there -- it is retrieved,
    # not reported.
    from ..runtime import callbacks, submission
    try:
        submission.sweep_all()
    finally:
        callbacks.drain_at_exit()
    for u in _unretrieved_now():  # (failures whose trace lives to the exit: a buffer kept)
        u.report()


atexit.register(_finish_at_exit)


class HostBackend:
    """Memory, streams and copies for :meth:`sharedmem.Device.host`."""

    kind = name = "host"
    needs_polling = False  # workers wake the retirer themselves

    def __init__(self):
        self.pool = HostPool()
        self.on_progress = None  # set by the runtime: wakes the retirer

    def allocate(self, nbytes: int, stream_impl=None) -> HostBlock:
        return self.pool.allocate(nbytes)

    def create_stream(self, name=None) -> HostStreamImpl:
        return HostStreamImpl(self, name)

    def default_stream(self) -> HostStreamImpl:
        return HostStreamImpl(self, "sharedmem-host-default-stream")

    def record_marker(self, impl: HostStreamImpl, pooled: bool = False) -> HostMarker:
        """A marker reached once everything enqueued so far on ``impl`` ran."""
        return impl.submit(_noop)

    #: No pinned staging: copies run on the stream's worker thread, never under the core
    #: lock (copy_htod snapshots its source when enqueued).
    stage_max = 0

    def pinned(self, n: int) -> None:
        """None: nothing is staged here (see ``stage_max``)."""
        return None

    # Copies run as tasks on a stream (np.copyto into a view of the destination's bytes);
    # each returns the task's marker.

    def copy_htod(self, impl: HostStreamImpl, dst_ptr: int, src: np.ndarray) -> HostMarker:
        data = np.array(src, copy=True, order="C").view(np.uint8).reshape(-1)
        return impl.submit(lambda: np.copyto(host_array(dst_ptr, data.nbytes), data))

    def copy_dtoh(self, impl: HostStreamImpl, dst: np.ndarray, src_ptr: int) -> HostMarker:
        return impl.submit(lambda: np.copyto(dst.view(np.uint8).reshape(-1),
                                             host_array(src_ptr, dst.nbytes)))

    def copy_dtod(self, impl: HostStreamImpl, dst_ptr: int, src_ptr: int, nbytes: int) -> HostMarker:
        return impl.submit(lambda: np.copyto(host_array(dst_ptr, nbytes),
                                             host_array(src_ptr, nbytes)))

    def copy_strided(self, impl: HostStreamImpl, dst_ptr: int, src_ptr: int, shape,
                     byte_strides, itemsize: int) -> HostMarker:
        item = np.dtype((np.void, itemsize))
        n = math.prod(shape)
        span = sum((k - 1) * s for k, s in zip(shape, byte_strides)) + itemsize if n else 0
        return impl.submit(lambda: np.copyto(
            np.ndarray(shape, item, buffer=host_array(dst_ptr, n * itemsize)),
            np.ndarray(shape, item, buffer=host_array(src_ptr, span), strides=byte_strides)))

    def memset(self, impl: HostStreamImpl, dst_ptr: int, byte: int, nbytes: int) -> HostMarker:
        return impl.submit(lambda: host_array(dst_ptr, nbytes).fill(byte))

    # Graphs: a capture records the tasks submitted to the stream; a replay
    # submits them again, in order, to the replaying stream.
    def begin_capture(self, impl: HostStreamImpl) -> HostStreamImpl:
        """From here on ``impl`` records what is submitted to it (caller holds core_lock,
        as for ``end_capture``: the tasks of one submission are all recorded or all run)."""
        impl.recording = []
        return impl

    def end_capture(self, impl: HostStreamImpl) -> tuple:
        tasks, impl.recording = impl.recording, None
        return tuple(tasks)

    def instantiate_graph(self, tasks: tuple) -> tuple:
        return tasks

    def launch_graph(self, tasks: tuple, impl: HostStreamImpl) -> HostMarker:
        for fn in tasks:
            impl.submit(fn)
        return impl.submit(_noop)

    def destroy_graph(self, tasks) -> None:
        pass


def ndarray_of(view, writable: bool) -> np.ndarray:
    """A NumPy array over a host-device view's bytes (shape, strides, dtype of
    the view), read-only unless ``writable``. Keeps nothing alive."""
    tok = view._live_token()
    start = tok.allocation.ptr + tok.start
    base = host_array(start, tok.stop - tok.start)
    dt = view.dtype
    strides = getattr(view, "byte_strides", (dt.itemsize,))
    arr = np.ndarray(view.shape, dt, buffer=base, offset=view.ptr - start, strides=strides)
    if not writable:
        arr.flags.writeable = False
    return arr
