"""``stats()``: the ownership state of the process as a frozen value."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from . import allocation as _allocation
from .runtime import submission as _submission
from .runtime.state import RUNTIME, locked
from .stream import lent

__all__ = ["Stats", "stats", "synchronize", "InFlight", "inflight"]

if TYPE_CHECKING:
    from .stream import Stream


@dataclass(frozen=True)
class Stats:
    """A snapshot of sharedmem's bookkeeping.

    ``in_flight``: submitted work (launches, copies) not yet retired.
    ``live_allocations``: live allocations, ours and foreign. ``live_views``:
    live view tokens. ``leaked``: work kept forever because its completion is unknown;
    ``leaked_bytes``: the bytes they lease. ``submitted`` / ``retired``: totals
    since the start of the process. Also readable as ``stats()["in_flight"]``.
    """

    in_flight: int
    live_allocations: int
    live_views: int
    leaked: int
    leaked_bytes: int
    submitted: int
    retired: int

    def __getitem__(self, key: str) -> int:
        if key not in _COUNTERS:  # (the counters only: not methods, not dunders)
            raise KeyError(key)
        return getattr(self, key)

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return asdict(self)


_COUNTERS = frozenset(f.name for f in fields(Stats))


def stats() -> Stats:
    """The current :class:`Stats` (retires what has finished first)."""
    _submission.sweep_all()
    _submission.raise_deferred()
    live = _allocation.live_allocation_count()
    with locked():
        c = _submission.counters_locked()
        views = RUNTIME.live_views
    # (counters_locked: in_flight, leaked, leaked_bytes, submitted, retired)
    return Stats(live_allocations=live, live_views=views, **c)


def synchronize() -> None:
    """Wait for all work sharedmem submitted, on every device, and retire it."""
    _submission.synchronize_device(None)


@dataclass(frozen=True)
class InFlight:
    """One piece of submitted work not yet retired (see :func:`inflight`).

    ``stream``: where it runs. ``label``: what it is (``"CuPy kernel k4"``, ``"copy_from"``,
    ``"end of a DLPack export hold"`` for a consumer's lease ...). ``leases``: ``(allocation id, start, stop,
    writes)`` for each byte range it leases. ``age``: seconds since it was submitted.
    ``state``: ``"pending"``, or ``"unknown"`` for work kept because its completion is
    unknown."""

    stream: Stream
    label: str
    leases: tuple[tuple[int, int, int, bool], ...]
    age: float
    state: str

    def __str__(self) -> str:
        ranges = ", ".join(f"#{a}[{lo}:{hi}]{' w' if w else ''}" for a, lo, hi, w in self.leases)
        return (f"{self.stream}: {self.label} ({self.state}, {self.age * 1e3:.1f} ms) leases "
                f"{ranges or 'nothing'}")


def inflight() -> list[InFlight]:
    """What is in flight now: an :class:`InFlight` for every submission not yet retired,
    oldest first per stream, and for the work kept forever because its completion is
    unknown. Retires what has finished first. ``print(*sm.inflight(), sep="\\n")``
    shows one line each."""
    _submission.sweep_all()
    _submission.raise_deferred()  # (as every API call: a leak just found is reported)
    now = time.monotonic()
    with locked():
        return [_entry(sub, now, "pending") for s in list(RUNTIME.active) for sub in s._pending] \
            + [_entry(sub, now, "unknown") for sub in RUNTIME.leaked]


def _entry(sub, now, state) -> InFlight:
    leases = tuple((tok.allocation.id, tok.start, tok.stop, bool(w)) for tok, w in sub.uses or ())
    # (the user has the Stream now, as from fut.stream: never let go as its owner's -- lent)
    return InFlight(lent(sub.stream), sub.label, leases, max(0.0, now - sub.t0), state)
