"""The optional compiled launch path: ``sharedmem._speedups`` (``_speedups.c``).

``fast_launch`` is None when the extension was not built (no C compiler at
install time) or when ``SHAREDMEM_PURE_PYTHON=1`` is set; sharedmem then runs
its Python path everywhere, with the same behaviour. When present, it handles
only the common case of :func:`sharedmem.launch` for kernels whose adapter made
a launch plan (``interop.cupy``, ``interop.cutile``) and returns None for
everything else, having done nothing -- see the comment at the top of
``_speedups.c`` for which Python functions it mirrors.
"""

from __future__ import annotations

import os

__all__ = ["speedups", "fast_launch"]


def _import():
    if os.environ.get("SHAREDMEM_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from . import _speedups
    except ImportError:
        return None
    return _speedups


#: The extension module, or None (pure Python). Configured by :func:`configure`.
speedups = _import()
#: ``fast_launch(kernel, grid, block, args, stream, shared_mem)`` once configured, or None.
fast_launch = None


def configure():
    """Hand the extension the runtime's objects and classes; called once by
    ``sharedmem/__init__`` after every module it reads is imported."""
    global fast_launch
    if speedups is None or fast_launch is not None:
        return fast_launch
    from . import _sync, access, allocation
    from .buffer import Buffer
    from .launch import Atomic, In, InOut, Out
    from .runtime import future, submission
    from .stream import Stream
    speedups.configure({
        "core_lock": _sync.core_lock, "staged": _sync._staged,
        "pending_warnings": submission._pending_warnings,
        "deferred_errors": submission._deferred_errors,
        "active": submission._active, "counters": submission._counters,
        "retirer_running": submission._retirer_running,
        "retirer_idle": submission._retirer_idle,
        "submission_globals": vars(submission), "sweep_every": submission.SWEEP_EVERY,
        "access_globals": vars(access),
        "Submission": submission.Submission, "DeviceFuture": future.DeviceFuture,
        "Stream": Stream, "ViewToken": allocation.ViewToken, "Allocation": allocation.Allocation,
        "AccessTracker": access.AccessTracker, "StreamUse": access._StreamUse,
        "View": allocation.View, "Buffer": Buffer,
        "In": In, "Out": Out, "InOut": InOut, "Atomic": Atomic,
    })
    fast_launch = speedups.fast_launch
    return fast_launch


def entry(launch):
    """``launch`` as the public ``sharedmem.launch``: entered from C when the
    extension is configured (the same function, its arguments passed on
    untouched whenever the compiled path declines), else ``launch`` itself."""
    if fast_launch is None:
        return launch
    return speedups.LaunchEntry(launch)


def set_compiled(on: bool) -> None:
    """Switch the compiled path on or off at run time (benchmarks compare the
    two in one process; ``SHAREDMEM_PURE_PYTHON=1`` keeps it off from the start)."""
    if speedups is not None:
        speedups.set_enabled(bool(on))
