"""``stats()``: the ownership state of the process as a frozen value."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from . import allocation as _allocation
from .runtime import submission as _submission
from .runtime.state import RUNTIME, locked

__all__ = ["Stats", "stats", "synchronize"]


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

    def __getitem__(self, key: str):
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def as_dict(self) -> dict:
        """The counters as a plain dict."""
        return asdict(self)


def stats() -> Stats:
    """The current :class:`Stats` (retires what has finished first)."""
    _submission.sweep_all()
    _submission.raise_deferred()
    live = _allocation.live_allocation_count()
    with locked():
        c = _submission.counters_locked()
        views = RUNTIME.live_views
    return Stats(in_flight=c["in_flight"], live_allocations=live, live_views=views,
                 leaked=c["leaked"], leaked_bytes=c["leaked_bytes"], submitted=c["submitted"],
                 retired=c["retired"])


def synchronize() -> None:
    """Wait for all work sharedmem submitted, on every device, and retire it."""
    _submission.synchronize_all()
