"""Allocations, view tokens, the process-wide allocation registry, and the View base.

An :class:`Allocation` is the identity of a range of device memory. Every
user-visible handle on it (a :class:`~sharedmem.Buffer`, a slice, a
:class:`~sharedmem.Tensor`, a borrow, a DLPack export, a CuPy array made by
``as_cupy``) holds one :class:`ViewToken`. The live tokens are what a zero-copy
move checks for aliases; completion leases (see :mod:`sharedmem.access`) are
kept apart and never count as aliases.

What keeps memory valid:

* An allocation made by sharedmem **owns** its memory (``Allocation.owner``, a
  pool block); the memory returns to the pool when the last reference to the
  allocation is gone. Views hold the allocation; so does every submission
  until the GPU has finished it. Hence: holding a view means its bytes stay
  valid, and a lease keeps its allocation until its completion is known.
* A foreign allocation (memory imported from CuPy, DLPack, CAI, NumPy)
  **borrows** its memory: each view and each lease keeps the producer object
  alive through its ``keep`` reference; the allocation itself is only the
  identity used to see aliases across wrappers.
"""

from __future__ import annotations

import bisect
import collections
import importlib
from typing import TYPE_CHECKING
import itertools
import operator
import os
import sys
import threading
import weakref

import numpy as np

if TYPE_CHECKING:
    from typing import TypeVar

    from .device import Device

    _V = TypeVar("_V", bound="View")

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from . import _cython as cython

from .access import AccessTracker
from .config import _flag
from .errors import AliasError, BackendUnavailableError, MovedError, ReleasedError
from .runtime.state import (RUNTIME, LockMark, at_fork_hold, enter_marked, enter_or_stage_marked,
                             fork_holds, fork_safe, leaf_lock, leave_marked, locked)

__all__ = ["Allocation", "ViewToken", "View", "lookup_allocation", "TRACK_ORIGINS"]

#: Record the ``file:line`` that created each view, for AliasError messages.
#: Read from ``SHAREDMEM_TRACK_ORIGINS`` at import, as every switch is read (1, true, yes or
#: on; 0, false, no or off -- "false" turned it on: anything but "" and "0" did); tests may set
#: it directly.
TRACK_ORIGINS = _flag("SHAREDMEM_TRACK_ORIGINS")

_PACKAGE_DIRS = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (__file__, os.path.join(os.path.dirname(__file__), "..", "interop", "x"))
)


def _origin():
    """Where the view is being created: the first frame outside sharedmem and interop, with
    its path relative to the working directory when it lies below it (None unless
    ``TRACK_ORIGINS``)."""
    if not TRACK_ORIGINS:
        return None
    f = sys._getframe(0)  # (compiled code has no frames: start at the innermost Python one)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if not fn.startswith(_PACKAGE_DIRS):
            rel = os.path.relpath(fn)
            return f"{fn if rel.startswith('..') else rel}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return None


_ids = itertools.count(1)  # next() on a count is atomic under the GIL


@cython.freelist(16)
@cython.cclass
class ViewToken:
    """One live view of bytes ``[start, stop)`` of an allocation.

    Owns nothing but its place in ``allocation._views``; it keeps the allocation (and,
    through ``keep``, a foreign producer) alive. Released exactly once: by ``release()``,
    by the handle's destructor, or by a consumer's DLPack deleter. Moves re-label it instead
    of releasing it. A token that is never made live (``live`` stays False) only names a
    range -- a lease of a foreign array argument, a declared use.
    """

    __slots__ = ("allocation", "kind", "start", "stop", "writable", "origin", "keep", "live",
                 "consumers", "use_r", "use_w")

    def __init__(self, allocation, kind, start, stop, writable, keep, origin=None):
        # (as the compiled fields take them: integer offsets, a bool, a str)
        if type(kind) is not str:
            raise TypeError(f"ViewToken: kind must be a str, got {type(kind).__name__}")
        _init_token(self, allocation, kind, operator.index(start), operator.index(stop),
                    True if writable else False, keep, origin)

    def use(self, writes):
        """``(self, writes)``: this token as a lease of ``submit()``'s ``uses``, made once."""
        if writes:
            u = self.use_w
            if u is None:
                u = self.use_w = (self, True)
        else:
            u = self.use_r
            if u is None:
                u = self.use_r = (self, False)
        return u

    def describe(self) -> str:
        """One line naming the view: kind, byte range, allocation, and where it was made."""
        where = f" (created at {self.origin})" if self.origin else ""
        ro = "" if self.writable or "read-only" in self.kind else "read-only "
        return (f"{ro}{self.kind}, bytes [{self.start}, {self.stop}) of allocation "
                f"#{self.allocation.id}{where}")

    def release(self) -> None:
        """Release this token; idempotent, never blocks (see ``runtime.state``). A hold's
        release that finds the lock busy in another thread marks the point its consumers'
        borrowed streams have reached first (``hold_ending``): its end is filed later, by
        the holder, but the consumer may destroy its stream as soon as this returns."""
        if self.live:
            rt = RUNTIME
            if rt.enter_or_stage(_release_locked, self,  # (else staged: run by the holder)
                                 self.consumers is not None):
                try:
                    _release_locked(self)
                finally:
                    rt.release()


def _init_token(self, allocation, kind, start, stop, writable, keep, origin) -> None:
    self.allocation = allocation
    self.kind = kind  # guarded by core_lock (re-labelled by moves)
    self.start = start
    self.stop = stop
    self.writable = writable
    self.keep = keep
    self.origin = origin
    self.live = False  # guarded by core_lock
    # A *hold*: the streams (and whether each may write) whose work may use these bytes
    # while this token lives -- a consumer library's stream named at export, or one the
    # user declared with sharedmem.record_use. Each is an open lease in the allocation's
    # tracker while the token lives; when it is released, the bytes stay leased on each
    # stream until the stream passes that point (runtime.submission.end_holds_locked).
    # None or a tuple of (Stream, writes), replaced, never changed in place (an exporter may
    # give many tokens one tuple); guarded by core_lock.
    self.consumers = None
    # The lease pairs (self, False) and (self, True) a launch names (see use()): made once
    # per view, not per launch. They refer to this token, so release drops them.
    self.use_r = None
    self.use_w = None


def _release_view_locked(view) -> None:
    """``View.release()`` under the core lock: nothing if a move (or another release) got
    there first."""
    if view._state == _LIVE:
        tok = view._token
        view._state = _RELEASED
        view._dead_id = tok.allocation.id
        view._token = None
        _release_locked(tok)  # (nothing if the token is not live)


def _release_locked(tok) -> None:
    if tok.live:
        rt = RUNTIME
        tok.live = False
        tok.use_r = tok.use_w = None  # (they refer back to the token)
        del tok.allocation._views[tok]
        rt.live_views -= 1
        if tok.consumers is not None:  # a hold ends: stream-ordered, never at once
            rt.hooks.end_holds(tok)
        keep = tok.keep
        tok.keep = None
        if keep is not tok.allocation and keep is not None:  # (a foreign producer: its
            rt.drop_later(keep)  # deleter runs once the lock is let go, not under it)


def _add_locked(tok):
    rt = RUNTIME
    tok.live = True
    tok.allocation._views[tok] = tok  # (keyed by identity: no int made)
    rt.live_views += 1
    return tok


def add_consumer_locked(tok, stream, writes) -> None:
    """Make live token ``tok`` a hold for work on ``stream`` (see ViewToken.consumers).
    Caller holds core_lock. A stream named twice keeps the stronger mode."""
    cons = tok.consumers or ()
    for i in range(len(cons)):
        c = cons[i]
        if c[0] is stream:  # (held already: at most a stronger mode)
            if writes and not c[1]:
                tok.consumers = cons[:i] + ((stream, True),) + cons[i + 1:]
            return
    tok.consumers = cons + ((stream, writes),)
    tok.allocation.tracker.add_hold_locked(stream, tok, tok.start, tok.stop)


def unregistered_token(allocation, kind, start, stop, writable, keep):
    """A view token of bytes ``[start, stop)`` of ``allocation``, not live yet: what
    :meth:`Allocation.new_token` makes before :func:`register_token_locked` registers it."""
    tok = ViewToken.__new__(ViewToken)
    _init_token(tok, allocation, kind, start, stop, writable, keep,
                _origin() if TRACK_ORIGINS else None)
    return tok


def register_token_locked(tok, source, consumers) -> None:
    """Make new token ``tok`` live (a hold for ``consumers`` when given), after checking that
    ``source``, the View it derives from, is live: :meth:`Allocation.new_token`'s step under
    the core lock (the caller holds it)."""
    if source is not None:
        src = source  # (a typed local, not a cast: interpreted, a cast is a call)
        if src._state != _LIVE:
            src._raise_dead()
    _add_locked(tok)
    if consumers:  # (a tuple of ``(stream, writes)`` pairs)
        if len(consumers) == 1:  # (one pair: taken as it is)
            tok.consumers = consumers
            c = consumers[0]
            tok.allocation.tracker.add_hold_locked(c[0], tok, tok.start, tok.stop)
        else:
            for c in consumers:
                add_consumer_locked(tok, c[0], c[1])


class Allocation:
    """The identity of one range of device memory.

    Attributes: ``id`` (unique in the process), ``device``, ``ptr``,
    ``nbytes``, ``owner`` (the pool block this allocation owns, or ``None``
    when the memory is foreign and kept alive by its views' producers),
    ``source`` (a short word: ``"sharedmem"``, ``"cupy"``, ``"dlpack"``...),
    ``tracker`` (the :class:`~sharedmem.access.AccessTracker` of its leases),
    ``bridge_facts`` (for interop bridges: what is constant about exporting this memory,
    kept by the bridge on first use -- one field read an export, not a device lookup).
    """

    __slots__ = ("id", "device", "ptr", "nbytes", "owner", "source", "tracker",
                 "_views", "bridge_facts", "__weakref__")

    def __init__(self, device, ptr, nbytes, owner=None, source="sharedmem"):
        _fill(self, device, ptr, nbytes, owner, source)
        _registry.register(self, -1)

    def __repr__(self) -> str:
        return (f"<Allocation #{self.id} {self.source} on {self.device} ptr=0x{self.ptr:x} "
                f"nbytes={self.nbytes} live_views={self.live_views}>")

    @property
    def live_views(self) -> int:
        """Number of live view tokens (not counting completion leases)."""
        with locked():
            return len(self._views)

    def views(self) -> list:
        """A description of every live view, in creation order."""
        with locked():
            return [t.describe() for t in self._views.values()]

    # -- tokens ---------------------------------------------------------
    def new_token(self, kind, start, stop, writable, keep, source=None):
        """A new live view token of bytes ``[start, stop)`` of this allocation (its ``kind``
        names it in AliasError messages; ``keep`` is what it keeps alive). ``source``: the View it
        derives from (a slice, a borrow, an export), checked live in the same step -- a move
        or release of ``source`` on another thread between the caller's own check and this
        one raises its MovedError / ReleasedError here instead of leaving a live view of bytes
        the source no longer owns. (A hold for consumers' streams, made in the same step:
        ``runtime.submission.export_hold``.)"""
        if not cython.compiled:  # (as the compiled arguments convert them)
            start, stop = operator.index(start), operator.index(stop)
            writable = True if writable else False
            if source is not None and not isinstance(source, View):
                raise TypeError(f"new_token: source must be a View or None, got "
                                f"{type(source).__name__}")
        tok = unregistered_token(self, kind, start, stop, writable, keep)
        rt = RUNTIME
        rt.acquire()
        try:
            register_token_locked(tok, source, None)
        finally:
            rt.release()
        return tok

    def live_tokens_locked(self, start, stop) -> list:
        """The live tokens overlapping bytes ``[start, stop)``. Caller holds core_lock."""
        return [t for t in self._views.values() if t.start < stop and start < t.stop]

    def conflicts_locked(self, start, stop, writable, exclude) -> list:
        """The live views (other than ``exclude``) that alias bytes ``[start, stop)`` for a
        move that leaves the moved range ``writable`` (or read-only). Caller holds core_lock.
        One pass: the common case, ``exclude`` the only live view, and an empty moved range
        (it conflicts with nothing) are decided in O(1) before the call (View._move_token, the
        caller). Empty views conflict with nothing; read-only views do not conflict with a
        read-only move."""
        return [t for t in self._views.values() if t is not exclude and t.start < t.stop
                and t.start < stop and start < t.stop and (writable or t.writable)]


def _checked_range(ptr, nbytes) -> tuple:
    """``(ptr, nbytes)`` as ints, checked -- an allocation's or an import's, before the
    compiled fields convert them (a float is refused, not truncated): TypeError for what is
    no integer, ValueError for a range no allocation can have."""
    if type(ptr) is not int:
        ptr = operator.index(ptr)
    if type(nbytes) is not int:
        nbytes = operator.index(nbytes)
    if not (0 <= ptr < _PTR_END and 0 <= nbytes <= _SIZE_MAX and ptr + nbytes <= _PTR_END):
        raise _range_error(ptr, nbytes)
    return ptr, nbytes


def _range_error(ptr, nbytes) -> ValueError:
    """What a range no allocation can have raises (an allocation's, or an import's)."""
    return ValueError(f"Allocation: ptr must be an address (0 to 2**64 - 1) and nbytes a size "
                      f"(0 to 2**63 - 1) whose range ends at or below 2**64, got {ptr} and "
                      f"{nbytes}")


def _fill(a, device, ptr, nbytes, owner, source) -> None:
    """Set the fields of a new allocation ``a`` (not registered yet), its arguments checked --
    before the compiled fields convert them: a float is refused, not truncated."""
    ptr, nbytes = _checked_range(ptr, nbytes)
    if type(source) is not str:
        raise TypeError(f"Allocation: source must be a str, got {type(source).__name__}")
    a.id = next(_ids)
    a.device = device
    a.ptr = ptr
    a.nbytes = nbytes
    a.owner = owner
    a.source = source
    a.tracker = AccessTracker()
    a._views = {}  # live ViewToken -> itself (identity hash); guarded by core_lock
    a.bridge_facts = None  # (lock-free: a racing bridge stores equal facts)


# -- the registry -------------------------------------------------------------
_PTR_END = 1 << 64  # (past the last address: a device pointer is 64 bits)
_SIZE_MAX = (1 << 63) - 1  # (the longest allocation: nbytes is a Py_ssize_t)
_LAST_ADDRESS = cython.declare(cython.ulonglong, (1 << 64) - 1)  # (a C constant where compiled)


class _EntryRef(weakref.ref):
    """A registry entry: its weak reference to its allocation, and the allocation's place
    (``dkey``, ``ptr``, ``nbytes``: where the callback, one bound method for all, finds the
    entry -- no closure an allocation, whose function, defaults and cell the collector would
    visit while the allocation lives). ``overlapped``: whether a live allocation overlapped
    this one as either registered (written under the registry lock)."""

    __slots__ = ("dkey", "ptr", "nbytes", "overlapped")


class _Class:
    """One length class's entries on one device (allocations of ``bit_length(nbytes) == c``:
    shorter than ``span``, 2**c), sorted by start: ``starts[i]`` (an int) is the start of
    ``refs[i]`` (its _EntryRef; entries of one start in any order). Plain ints and the entries
    themselves: no tuple a registration, no tuple compare a step of a search. guarded by the
    registry lock"""

    __slots__ = ("starts", "refs", "span")

    def __init__(self, c):
        self.starts = []
        self.refs = []
        self.span = 1 << c


class _DeviceEntries:
    """One device's entries: ``classes`` by length class, ``walk`` the same in the order they
    were first used (a lookup's walk: no dict iteration), ``last`` the entry a lookup found
    last (or None). guarded by the registry lock"""

    __slots__ = ("classes", "walk", "last")

    def __init__(self):
        self.classes = {}
        self.walk = []
        self.last = None


# A bisection over a class's starts (ints in [0, 2**64)), compiled: C compares of the list's
# ints. Interpreted, the registry calls the standard library's bisect_right, the same search
# in C, directly: a Python call under the registry lock runs a trace or profile function
# (coverage, a debugger), whose frame object and allocations may start a collection there.
def _count_at_most(starts, x):
    """How many of the sorted ``starts`` are at most ``x`` (bisect_right)."""
    lo = 0
    hi = len(starts)
    while lo < hi:
        mid = (lo + hi) >> 1
        s = starts[mid]
        if x < s:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _bit_length(n):
    """``n.bit_length()`` of an int >= 0 (compiled: shifts of a C int, no int object made and
    no method called -- a registration and a removal each ask for one)."""
    c = 0
    while n:
        n >>= 1
        c += 1
    return c


_inside = LockMark()  # (interpreted: the threads in a registry operation; see _Registry)


@cython.cclass
class _Registry:
    """Maps live device address ranges to allocations (weakly).

    Ranges may nest: a foreign allocation over a whole driver allocation (a CuPy pool arena)
    can contain allocations of ours. A lookup returns the innermost live allocation that
    contains the range. Entries are kept by length class (lengths of one bit length: below
    2**c for class c), each class sorted by start: per class, a bisection, then a walk back
    over the entries that start less than 2**c before the range -- a few where ranges do not
    overlap, whatever the number of entries and however long the longest (one walk bounded
    by the longest made a lookup among 100,000 small allocations beside one large arena walk
    them all). Entries are removed when their allocation dies.

    The allocation a lookup found last is tried first (imports and new foreign arrays
    usually fall in the one found before: a torch tensor new to a launch in its caching
    allocator's segment) where no live allocation overlapped it as either registered: then
    it is the only one containing any non-empty range inside it (another would overlap it,
    and was registered while it lived or the other way round). Overlaps are found as an
    allocation registers and marked on both entries, until each dies (conservative after the
    other died: the full walk then).

    Its lock is a leaf: nothing else is called while it is held, so it may be taken under
    core_lock. Nothing under it allocates a garbage-collected object (entries and containers
    are made before it is taken; strong references a walk takes are dropped after it is let
    go): compiled, no collection, so no finalizer, can start while it is held -- a finalizer
    calling sharedmem there would wait for a lock its own thread holds. Interpreted, one still
    may: Python 3.12 on runs a collection at the next call or loop jump after the allocation
    that asked for it (made before the lock was taken, or by another thread), and a profile
    function runs at every call of a builtin. An entry's removal run there (its allocation
    died in that collection) finds the lock taken by its own thread's registry operation and
    is staged (``_staged``): that operation does it once it has let the lock go.
    ``live_allocation_count`` reads its counter without it.
    """

    def __init__(self):
        self._lock = fork_safe(leaf_lock())  # (compiled, taken through C: see LeafLock)
        self._maps = {}  # device key -> _DeviceEntries; guarded by self._lock
        self._gone = self._remove  # (bound once: every entry's weak reference calls it)
        self._live = 0  # entries registered and not removed; written under self._lock
        self._gen = 0  # registrations so far; written under self._lock (read without it)
        # Interpreted: entries whose removal found the lock taken by its own thread's registry
        # operation (a collection under it: see the class docstring), removed by that
        # operation once it let the lock go (runtime.state.leave_marked)
        self._staged = collections.deque()

    def register(self, alloc, gen) -> bool:
        """Register ``alloc``: always where ``gen`` is -1, else only if nothing registered
        since ``_gen`` read ``gen`` (an import's lookup missed: still a miss). Whether it
        did."""
        ref = _EntryRef(alloc, self._gone)
        dkey = ref.dkey = alloc.device.key
        lo = ref.ptr = alloc.ptr
        n = ref.nbytes = alloc.nbytes
        ref.overlapped = False
        c = _bit_length(n) if cython.compiled else n.bit_length()
        # the last byte (an empty range overlaps nothing; the end of the address space caps it)
        last = (lo + (n - 1) if n - 1 <= _LAST_ADDRESS - lo else _LAST_ADDRESS) if n else 0
        # (made here, where they may be needed: nothing is allocated under the lock. A device's
        # entries and a class, once made, stay: found here, they are there under it)
        fresh = fresh_class = None
        known = self._maps.get(dkey)
        if known is None:
            fresh = _DeviceEntries()
            fresh_class = _Class(c)
        elif known.classes.get(c) is None:
            fresh_class = _Class(c)
        seen = []  # strong references taken under the lock, dropped after it
        lock = self._lock
        if cython.compiled:
            lock.take()  # (not `with`: interpreted, its exit call allocates under the lock)
        else:  # (marked: see the class docstring)
            was = enter_marked(lock, _inside)
        try:
            if gen != -1 and gen != self._gen:
                return False
            dev = self._maps.get(dkey)
            if dev is None:
                dev = self._maps[dkey] = fresh
            # the live entries this one overlaps: per class, those starting at or below its
            # last byte and less than the class's span before lo (their lengths, from the
            # allocations: a dead one, whose removal waits for this lock, overlaps nothing)
            walk = dev.walk
            j = 0
            while j < len(walk) and n > 0:
                cl = walk[j]
                j += 1
                starts = cl.starts
                i = (_count_at_most(starts, last) if cython.compiled else
                     bisect.bisect_right(starts, last)) - 1
                while i >= 0:
                    start = starts[i]
                    if start < lo and lo - start >= cl.span:
                        break
                    other = cl.refs[i]
                    a = other()
                    if a is not None:
                        seen.append(a)  # (a death here would run _remove under our lock)
                        if a.nbytes and (start >= lo or lo - start < a.nbytes):
                            other.overlapped = True
                            ref.overlapped = True
                    i -= 1
            cl = dev.classes.get(c)
            if cl is None:  # (a class first seen: fresh_class was made, by this or a racing
                cl = dev.classes[c] = fresh_class  # thread's check above)
                dev.walk.append(cl)
            i = (_count_at_most(cl.starts, lo) if cython.compiled else
                 bisect.bisect_right(cl.starts, lo))
            cl.starts.insert(i, lo)
            cl.refs.insert(i, ref)
            self._live += 1
            self._gen += 1
        finally:
            if cython.compiled:
                lock.give()
            else:
                lock.release()
                leave_marked(_inside, was, self._staged, self._gone)
        a = None
        del seen
        return True

    def _remove(self, ref) -> None:
        # the weakref callback of every entry: runs once, wherever its allocation died; the
        # lock is a leaf. register() put the entry in its class under the lock, and only this
        # removes it: it is found (a device's entries and a class are never removed)
        held = fork_holds()  # (an allocation that died inside os.fork(): the fork holds it)
        lock = self._lock
        if not held:
            if cython.compiled:
                lock.take()
            else:  # (staged where this thread's own registry operation holds the lock)
                was = enter_or_stage_marked(lock, _inside, self._staged, ref)
                if was is None:
                    return
        try:
            dev = self._maps[ref.dkey]
            ptr = ref.ptr
            cl = dev.classes[_bit_length(ref.nbytes) if cython.compiled else
                             ref.nbytes.bit_length()]
            starts = cl.starts
            refs = cl.refs
            # (the last entry of its start; back to it)
            i = (_count_at_most(starts, ptr) if cython.compiled else
                 bisect.bisect_right(starts, ptr)) - 1
            while refs[i] is not ref:
                i -= 1
            del starts[i]
            del refs[i]
            if dev.last is ref:
                dev.last = None
            self._live -= 1
        finally:
            if not held:
                if cython.compiled:
                    lock.give()
                else:
                    lock.release()
                    leave_marked(_inside, was, self._staged, self._gone)

    def lookup(self, dkey, ptr, nbytes):
        """The innermost live allocation containing ``[ptr, ptr + nbytes)`` (ints) on the
        device whose ``key`` is ``dkey``."""
        if ptr < 0 or ptr >= _PTR_END or nbytes < 0 or nbytes > _SIZE_MAX:
            return None  # (no allocation holds such a range)
        p = ptr  # (compiled, C ints; no sums below, which could pass 64 bits)
        n = nbytes
        seen = []  # strong references taken under the lock, dropped after it
        best = None
        lock = self._lock
        if cython.compiled:
            lock.take()
        else:  # (marked: see the class docstring)
            was = enter_marked(lock, _inside)
        try:
            dev = self._maps.get(dkey)
            if dev is not None:
                last = dev.last
                if n > 0 and last is not None and not last.overlapped:
                    a = last()  # (the one found last: see the class docstring)
                    if a is not None:
                        seen.append(a)
                        if a.ptr <= p and n <= a.nbytes and p - a.ptr <= a.nbytes - n:
                            best = a
                best_ref = None
                walk = dev.walk
                j = 0 if best is None else len(walk)  # (found: no walk)
                while j < len(walk):  # (index loops: no iterator object is made here)
                    cl = walk[j]
                    j += 1
                    starts = cl.starts
                    i = (_count_at_most(starts, p) if cython.compiled else
                         bisect.bisect_right(starts, p)) - 1
                    while i >= 0:
                        start = starts[i]  # (at or below p: the bisection's)
                        if p - start >= cl.span:  # (every length of the class is below it)
                            break
                        a = cl.refs[i]()
                        if a is not None:
                            seen.append(a)  # (a death here would run _remove under our lock)
                            if a.ptr <= p and n <= a.nbytes and p - a.ptr <= a.nbytes - n:
                                if best is None or a.nbytes < best.nbytes:
                                    best = a
                                    best_ref = cl.refs[i]
                        i -= 1
                if best_ref is not None:
                    dev.last = best_ref
        finally:
            if cython.compiled:
                lock.give()
            else:
                lock.release()
                leave_marked(_inside, was, self._staged, self._gone)
        a = None
        del seen
        return best


_registry = _Registry()
# Held across a fork (after the core lock): a thread of the parent between the sorted keys'
# insort and the dict's store would leave the child a registry whose lookups fail
at_fork_hold(_registry._lock.acquire, _registry._lock.release)


def lookup_allocation(device, ptr, nbytes=1):
    """The live allocation (ours or foreign) containing ``[ptr, ptr+nbytes)`` on ``device``,
    or ``None``."""
    dkey = getattr(device, "key", None)
    if dkey is None:
        raise TypeError(f"lookup_allocation takes a sharedmem.Device, got {device!r}; use "
                        f"sharedmem.Device.host() or sharedmem.Device(0)")
    if type(ptr) is not int or type(nbytes) is not int:  # (ints, the usual: no walk)
        for name, v in (("ptr", ptr), ("nbytes", nbytes)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"lookup_allocation: {name} must be an int, got {v!r}")
        ptr, nbytes = int(ptr), int(nbytes)
    if nbytes < 0 or ptr < 0:
        raise ValueError(f"lookup_allocation: a range of {nbytes} bytes at {ptr:#x} is no "
                         f"range; pass a pointer and a length >= 0")
    return _registry.lookup(dkey, ptr, nbytes)


def import_writable(alloc, lo: int, hi: int, writable: bool) -> bool:
    """Whether an import of bytes ``[lo, hi)`` of ``alloc`` that its producer says are
    ``writable`` may write them. Not where the memory is sharedmem's and only read-only views
    reach those bytes: the producer is then an export of a read-only view that cannot say so
    (``as_cupy`` of one, ``cupy.asarray`` of one -- CuPy has no read-only arrays; their
    capsules and CAI say writable), and the import must not write where sharedmem's own views
    may not -- as a launch takes such a CuPy array or torch tensor (interop.cupy_launch), and
    a host kernel a torch tensor (launch.torch_lease). Writable where a writable view reaches
    the bytes, or none does."""
    if not writable or hi <= lo or alloc.source != "sharedmem":
        return writable
    with locked():
        views = alloc.live_tokens_locked(lo, hi)
    return not views or any([v.writable for v in views])


def import_allocation(device, ptr, nbytes, source, region=None):
    """The allocation for foreign memory ``[ptr, ptr+nbytes)``: an existing one that contains
    it (so one range imported twice is one allocation), else a new foreign allocation over
    ``region`` (``(start, size)`` of the enclosing driver allocation when known) or over the
    range itself. Never a second allocation over a range another holds: the new one registers
    only if no allocation did since the lookup, else the lookup runs again (no lock held
    across the two)."""
    # (checked as _fill checks them, before the lookup: one that hits must not take a float,
    # truncated compiled, or a range no allocation could hold, whose region would be made)
    ptr, nbytes = _checked_range(ptr, nbytes)
    start, size = region if region is not None else (ptr, nbytes)
    if nbytes and not (start <= ptr and ptr + nbytes <= start + size):
        # a region that does not hold the range (a CuPy array over UnownedMemory sized by its
        # shape, its strides reaching further): the allocation made covers both -- over the
        # region alone it would not hold the range, and a second import would make another
        end = max(start + size, ptr + nbytes)
        start = min(start, ptr)
        size = end - start
    reg = _registry
    dkey = device.key
    a = None
    while True:
        gen = reg._gen  # (read before the lookup: a registration after it redoes the lookup)
        found = reg.lookup(dkey, ptr, nbytes)
        if found is not None:
            return found
        if a is None:
            a = Allocation.__new__(Allocation)
            _fill(a, device, start, size, None, source)
        if reg.register(a, gen):
            return a


def live_allocation_count() -> int:
    """Live allocations (an int read: no lock, so any finalizer may ask)."""
    return _registry._live


# -- the handle base -----------------------------------------------------------
# A handle's state (View._state), as C constants where compiled: compared with a C field on
# every use of a view (as Python ints, each compare boxed the field and looked up the global).
# 0, what the compiled field holds before a constructor ran (a View made by ``__new__``
# alone), is released: such a view raises ReleasedError, as it has no token
_RELEASED = cython.declare(cython.int, 0)
_LIVE = cython.declare(cython.int, 1)
_MOVED = cython.declare(cython.int, 2)

#: Advice per alias kind, for AliasError messages: how to end that kind of view.
_ADVICE = (
    ("DLPack export", "drop the consumer's array (its DLPack deleter ends the export)"),
    ("as_cupy", "drop the CuPy array and every view of it"),
    ("CUDA Array Interface export", "a CUDA Array Interface export ends only when the exported "
     "object is garbage collected: give the consumer a view made for it (t.as_readonly(), or "
     "use DLPack / interop.cupy.as_cupy) when you mean to move afterwards"),
    ("graph #", "release the graph (g.release(), or leave its `with` block)"),
    ("producer", "the producer can still reach these bytes: drop it, or take the memory over "
     "with sharedmem.adopt(...) instead of importing it"),
    ("CuPy array (shape", "drop the CuPy array and every view of it"),
    # (any other kind: "" is in every kind, and the first match is taken)
    ("", "release it (call .release(), leave its `with` block, or drop every reference)"),
)


# Modules fully imported, by name (sys.modules holds a module from the start of its import:
# another thread may still be executing it). Lock-free: a racing thread stores the same module.
_imported = {}


def _module(name):
    """Module ``name``, imported on first use (an import statement costs thousands of
    instructions even when the module is loaded; this is a dict lookup). Never a module
    another thread is still executing: ``import_module`` waits for that import to end."""
    m = _imported.get(name)
    if m is None:
        m = importlib.import_module(name)
        if not getattr(m.__spec__, "_initializing", False):  # (not this thread's own import)
            _imported[name] = m
    return m


@cython.cclass
class Exporter:
    """How a bridge makes the capsule of :meth:`View.__dlpack__` and answers
    :meth:`View.__dlpack_device__`: ``interop.dlpack`` registers its subclass as its import
    ends (:func:`register_dlpack_exporter`). Compiled, its methods are called through the
    class's C method table, not as Python calls."""

    __slots__ = ()

    def export(self, view, stream, max_version, dl_device, copy):
        """The DLPack capsule of ``view`` (``__dlpack__``'s arguments, positional)."""
        raise NotImplementedError

    def dlpack_device(self, view):
        """``view.__dlpack_device__()``: DLPack's ``(device_type, device_id)`` of ``view``."""
        raise NotImplementedError


# The registered Exporter (None until interop.dlpack is imported; a C global where compiled)
_dlpack_exporter = cython.declare(Exporter, None)


def register_dlpack_exporter(exporter) -> None:
    """Make ``exporter`` (an :class:`Exporter`) the one :meth:`View.__dlpack__` and
    :meth:`View.__dlpack_device__` call; TypeError for anything else."""
    global _dlpack_exporter
    if not isinstance(exporter, Exporter):
        raise TypeError(f"register_dlpack_exporter takes an Exporter, got "
                        f"{type(exporter).__name__}")
    _dlpack_exporter = exporter


def _first_exporter():
    """The registered Exporter, after importing interop.dlpack (which registers its own as its
    import ends). Refused where that import is still under way in this thread (a call made while
    it executes): its exporter is not registered yet -- and compiled, a method call on None
    would read through a NULL method table. BackendUnavailableError (an ImportError) then."""
    _module("interop.dlpack")
    exporter = _dlpack_exporter
    if exporter is None:
        raise BackendUnavailableError(
            "cannot export a view through DLPack while interop.dlpack is being imported in "
            "this thread: it registers its exporter when its import ends")
    return exporter


class View:
    """Base of user-visible handles: one view token on an allocation.

    A handle *borrows* its bytes from its allocation and keeps them valid while
    it lives. ``release()`` (or leaving ``with``) gives the token back at once;
    garbage collection does the same later. Any use after that raises
    :class:`~sharedmem.errors.ReleasedError`, or :class:`MovedError` when the
    storage was moved to another handle.

    ``_offset``: byte offset of element 0 from the start of the allocation; ``_ptr``: the
    device address of element 0, ``allocation.ptr + _offset`` (what a launch packs: an
    allocation never moves, and a view never changes its token's allocation); ``_dtype``: the
    element type (set by the subclass's constructor).
    """

    # _moved_to: the kind a MOVED handle was moved into ("Tensor", "Buffer"); _dead_id: the
    # allocation number of a moved or released handle, for its errors (0: unknown)
    __slots__ = ("_token", "_state", "_moved_to", "_dead_id", "_derived", "_export", "_offset",
                 "_ptr", "_dtype", "__weakref__")

    _kind = "view"

    def _init_view(self, token, offset) -> None:
        self._token = token
        self._state = _LIVE
        self._moved_to = None
        self._dead_id = 0
        self._derived = None  # see _derived_value
        self._export = None  # see _object_hold_locked; guarded by core_lock
        self._offset = offset
        self._ptr = token.allocation.ptr + offset

    def _object_hold_locked(self, kind, consumers):
        """The hold this view keeps for consumers that keep *the view object itself* as their
        reference to the memory (the CUDA Array Interface: the protocol has no end of use,
        the consumer just keeps the object). One token, made on first use and a hold for
        every ``(stream, writes)`` in ``consumers`` given since; it lasts until this object
        is garbage collected -- ``release()`` does not end it, because the consumer may still
        reach the bytes through the object. Meanwhile it is an alias: the view cannot be moved.
        Caller holds core_lock (the export's ordering is made in the same step: see
        runtime.submission.object_export_hold), and sweeps the consumers' streams after it
        (runtime.submission.sweep_long)."""
        tok = self._live_token()
        hold = self._export
        if hold is None:
            hold = _add_locked(ViewToken(tok.allocation, kind, tok.start, tok.stop,
                                         tok.writable, tok.keep, _origin()))
            self._export = hold
        for stream, writes in consumers:
            add_consumer_locked(hold, stream, writes)
        return hold

    def _derived_value(self, key, make):
        """``make(self)``, computed once per view and key. For facts that cannot
        change while the view lives -- its address, shape, strides and dtype do
        not -- such as the array descriptors interop modules hand to other
        libraries on every launch. Lock-free: a racing thread computes an equal value."""
        d = self._derived
        if d is None:
            d = self._derived = {}
        v = d.get(key)
        if v is None:
            self._live_token()
            v = d[key] = make(self)
        return v

    # -- state --------------------------------------------------------------
    def _live_token(self):
        tok = self._token
        if self._state != _LIVE:
            self._raise_dead()
        return tok

    def _raise_dead(self):
        name = type(self).__name__
        which = f" (allocation #{self._dead_id})" if self._dead_id else ""
        if self._state == _MOVED:
            raise MovedError(
                f"this {name}{which} was moved into a {self._moved_to} and can no longer be "
                f"used; use the {self._moved_to} the move returned")
        raise ReleasedError(
            f"this {name}{which} was released and can no longer be used; keep a live view "
            f"(or make a new one) instead")

    @property
    def is_live(self) -> bool:
        """False once released or moved."""
        return self._state == _LIVE

    def _gone(self) -> str:
        """Why a view that is not live is not: "moved" or "released" (for reprs)."""
        return "moved" if self._state == _MOVED else "released"

    @property
    def allocation(self) -> Allocation:
        """The :class:`Allocation` these bytes belong to."""
        return self._live_token().allocation

    @property
    def device(self) -> Device:
        """The Device these bytes are on."""
        return self._live_token().allocation.device

    @property
    def ptr(self) -> int:
        """Device address of element 0."""
        self._live_token()
        return self._ptr

    @property
    def readonly(self) -> bool:
        """True for a read-only view: launches may only read it (``In``)."""
        return not self._live_token().writable

    @property
    def dtype(self) -> np.dtype:
        """The element type (a NumPy dtype)."""
        self._live_token()
        return self._dtype

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        self._live_token()
        return self._dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes spanned by the elements (``size * itemsize``)."""
        return self.size * self._dtype.itemsize

    def __deepcopy__(self, memo):
        """``copy.deepcopy(view)``: as ``copy.copy`` (a view holds no Python objects)."""
        return self.__copy__()

    def release(self) -> None:
        """Give this view's token back now. Idempotent; never waits for the
        GPU (work in flight keeps the memory through its own leases). Under the core lock, so
        that a move of this view in another thread happens wholly before or after it."""
        if self._state != _LIVE:
            return
        rt = RUNTIME
        if rt.enter_or_stage(_release_view_locked, self):
            try:
                _release_view_locked(self)
            finally:
                rt.release()
        elif rt.owner != threading.get_ident() and not rt.turning_here():
            # the lock was busy in another thread: wait for it, which applies the staged
            # release (a finalizer inside this thread's own sharedmem call -- or inside its
            # taking or letting go the lock, where owner does not say so yet: turning_here --
            # leaves it staged, applied when that call next takes or lets go the lock)
            rt.acquire()
            rt.release()

    def __enter__(self: _V) -> _V:
        self._live_token()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        # Never blocks, never waits for the GPU; nothing to do at interpreter exit.
        try:
            tok = self._token
            hold = self._export
        except AttributeError:  # half-constructed (interpreted: its slots were never set)
            return
        # (moved or released: nothing to give back)
        if (tok is None and hold is None) or sys is None or sys.is_finalizing():
            return
        if self._state == _LIVE and tok is not None:
            # (dead first, as release() leaves a view: a finalizer of another object of the
            # same collected cycle may make this one reachable again, and it must not stay
            # usable -- exported, sliced -- over bytes no token of it holds any more)
            self._state = _RELEASED
            self._dead_id = tok.allocation.id
            self._token = None
            tok.release()
        if hold is not None:
            self._export = None
            hold.release()

    def __array__(self, dtype=None, copy=None):
        """``np.asarray(view)``: on the host device, the values (``to_host()``: a copy taken
        after pending writes); for device memory a TypeError, as CuPy does."""
        if self._live_token().allocation.device.kind != "host":
            raise TypeError(f"implicit conversion of {self!r} to a NumPy array is not allowed "
                            f"(it is device memory); use .to_host()")
        if copy is False:
            raise ValueError(f"np.asarray({self!r}, copy=False): its values are read through a "
                             f"copy; use np.from_dlpack(view) for a zero-copy host array")
        a = self.to_host()
        return a if dtype is None else a.astype(dtype, copy=False)

    def _read_bytes(self, stream):
        """This view's token range copied to a new host ``uint8`` array, after
        every pending write to those bytes (ordered whatever the policy)."""
        from .buffer import download
        from .stream import resolve_stream
        tok = self._live_token()
        return download(resolve_stream(stream, tok.allocation.device), tok)

    # -- protocols -----------------------------------------------------------
    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export as a DLPack capsule (see :mod:`interop.dlpack` for the stream
        rules). The capsule holds a view token until the consumer deletes it."""
        exporter = _dlpack_exporter
        if exporter is None:  # (interop.dlpack registers its exporter as it is imported)
            exporter = _first_exporter()
        return exporter.export(self, stream, max_version, dl_device, copy)

    def __dlpack_device__(self):
        """``(kDLCPU, 0)`` on the host device, ``(kDLCUDA, ordinal)`` on CUDA."""
        exporter = _dlpack_exporter
        if exporter is None:  # (interop.dlpack registers its exporter as it is imported)
            exporter = _first_exporter()
        return exporter.dlpack_device(self)

    @property
    def __cuda_array_interface__(self):
        """CUDA Array Interface v3 (CUDA devices only; AttributeError on the host)."""
        tok = self._live_token()
        if tok.allocation.device.kind != "cuda":
            raise AttributeError("__cuda_array_interface__: this view is on the host device")
        return _module("interop.cai").export_cai(self)

    # -- moves --------------------------------------------------------------
    def _move_token(self, target_kind, target_name):
        """Check that no other live view aliases this handle's bytes and hand its token
        over (re-labelled ``target_kind``). On failure nothing changes and
        :class:`AliasError` lists the aliases."""
        tok = self._live_token()
        rt = RUNTIME
        settled = False
        while True:
            rt.acquire()
            try:
                if self._state != _LIVE:
                    self._raise_dead()
                alloc = tok.allocation
                # (tok is live, so it is among the allocation's views: the only one, or an
                # empty range, means no alias -- decided without a call or a list)
                if tok.start >= tok.stop or len(alloc._views) == 1:
                    others = None
                else:
                    others = alloc.conflicts_locked(tok.start, tok.stop, tok.writable, tok)
                if not others:
                    tok.kind = target_kind
                    if TRACK_ORIGINS:  # (the view it now backs was made here)
                        tok.origin = _origin()
                    self._state = _MOVED
                    self._moved_to = target_name
                    self._dead_id = alloc.id
                    self._token = None  # a moved-from handle keeps nothing alive
                    return tok
                if settled:
                    raise self._alias_error(target_name, others)
            finally:
                rt.release()
            # Before reporting an alias: a view may be kept only by work that has finished but
            # is not retired yet (a CuPy array argument keeps its as_cupy export alive).
            from .runtime.submission import settle
            settle()
            settled = True

    def _alias_error(self, target_name, others):
        lines = "\n".join(f"  - {t.describe()}" for t in others)
        hint = "" if TRACK_ORIGINS else (
            "\n(set SHAREDMEM_TRACK_ORIGINS=1 to see where each view was created)")
        n = len(others)
        advice = dict.fromkeys(next(text for key, text in _ADVICE if key in t.kind)
                               for t in others)  # (each piece of advice once, in order)
        return AliasError(
            f"cannot move {self._describe_short()} into a {target_name}: {n} other live "
            f"view{'s' if n != 1 else ''} of its bytes exist{'s' if n == 1 else ''}:\n{lines}\n"
            f"To move, {'; '.join(advice)}; or copy instead of moving.{hint}",
            tuple(t.describe() for t in others))
