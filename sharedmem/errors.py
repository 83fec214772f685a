"""The error types of sharedmem: one hierarchy under :class:`SharedMemError`.

Every message says what was wrong, which object, and what to do. All errors are
picklable (they keep their message in ``args``).
"""

from __future__ import annotations

__all__ = [
    "SharedMemError", "ReleasedError", "MovedError", "AliasError", "AccessConflictError",
    "DeviceMismatchError", "PeerAccessError", "CompletionUnknownError",
    "BackendUnavailableError", "KernelError", "HostKernelError", "CudaError", "CaptureError",
    "LayoutError", "ReadOnlyError", "SharedMemWarning", "LeakWarning",
]


class SharedMemError(Exception):
    """Base class of every error sharedmem raises on purpose."""


class ReleasedError(SharedMemError, ValueError):
    """A handle (buffer, tensor, borrow) was used after ``release()``.

    Create a new view from a live handle instead.
    """


class MovedError(ReleasedError):
    """A handle was used after its storage was moved to another owner
    (``Tensor.from_buffer``, ``Tensor.into_buffer``, ``interop.cupy.adopt``).

    Use the object the move returned.
    """


class AliasError(SharedMemError):
    """A zero-copy move was refused because other live views of the moved bytes
    exist. The message lists each one (kind, byte range, and with
    ``SHAREDMEM_TRACK_ORIGINS=1`` the ``file:line`` that created it).

    ``views`` holds one description string per conflicting view.
    """

    def __init__(self, message: str, views: tuple[str, ...] = ()):
        super().__init__(message, tuple(views))
        self.views = tuple(views)

    def __str__(self) -> str:
        return self.args[0]


class AccessConflictError(SharedMemError):
    """Under the ``"reject"`` policy, a launch would race with unfinished work on
    another stream over the same bytes (at least one of the two writes)."""


class DeviceMismatchError(SharedMemError, ValueError):
    """Arguments of one operation live on different devices, or on a device
    other than the stream's (and the launch device has no peer access to theirs:
    :meth:`Device.enable_peer_access`)."""


class PeerAccessError(DeviceMismatchError):
    """Peer access between two devices was asked for where the pair does not support it
    (``cuDeviceCanAccessPeer`` says no), or between devices of different kinds."""


class CompletionUnknownError(SharedMemError):
    """Whether submitted work has finished cannot be known (a kernel faulted, a
    sticky CUDA error, a failed query). Its memory is kept, never freed, and
    counted in ``sharedmem.stats().leaked``."""


class BackendUnavailableError(SharedMemError, ImportError):
    """The requested backend (CUDA, CuPy, cuTile) cannot be used here; the
    message says what is missing and how to install it. An ImportError, so
    code with optional GPU paths can catch it as one."""


class LayoutError(SharedMemError, ValueError):
    """A shape, stride or dtype does not fit the operation (for example
    ``into_buffer`` of a non-contiguous tensor, or a shape whose size differs
    from the buffer's length)."""


class ReadOnlyError(LayoutError):
    """A host-side write (``copy_from``, ``fill_zero``, ``DeviceBox.set``) through a
    read-only view. Nothing was enqueued. A LayoutError (what ``copy_from`` raised for it
    before). (A launch that would write through one raises :class:`KernelError`, as every
    launch argument error does.)"""


class HostKernelError(SharedMemError, RuntimeError):
    """A host kernel raised. Its future fails with this error (``__cause__`` is the kernel's
    own exception); the kernel's leases were released as it ended, the stream runs on and
    nothing is leaked. What the kernel wrote before it raised stays written."""


class KernelError(SharedMemError, TypeError):
    """A kernel or its arguments cannot be launched: an unknown kernel type, a
    wrong number or type of arguments, an intent the view does not allow."""


class CaptureError(SharedMemError, RuntimeError):
    """A graph capture was misused: work that cannot be captured (a host
    read, ``apply``), a stream already capturing, the default stream, a capture that
    failed and left no graph, or waiting on a stream that is capturing."""


class CudaError(SharedMemError, RuntimeError):
    """A CUDA driver call failed; ``code`` is the ``CUresult`` value and the
    message names the call and the error."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message, code)
        self.code = code

    def __str__(self) -> str:
        return self.args[0]


class SharedMemWarning(UserWarning):
    """Base class of sharedmem's warnings."""


class LeakWarning(SharedMemWarning):
    """Resources were kept on purpose because their completion is unknown.
    Reported once per cause (per faulted stream)."""
