"""Backends: ``host`` (no GPU needed) and ``cuda`` (cuda.bindings + CuPy's pool)."""


class CompleteMarker:
    """The marker of work that will never run here (captured into a graph):
    complete at once, nothing to wait for, nothing to recycle."""

    __slots__ = ()
    error = None
    unknown = False
    recorded = True
    handle = 0

    def query(self) -> int:
        return 1  # done

    def wait(self, timeout=None) -> bool:
        return True

    def recycle(self) -> None:
        pass


#: The one CompleteMarker (it has no state).
COMPLETE = CompleteMarker()
