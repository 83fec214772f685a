"""sharedmem: one owner for GPU memory shared by CuPy (SIMT) and cuTile (Tile) kernels.

Typed buffers and Tile tensors share allocation tokens; zero-copy moves
(``Tensor.from_buffer`` / ``into_buffer`` / ``as_buffer``) reject live aliases;
every launch holds leases on its memory until the device is done. This module
only re-exports; each concept lives in its own module. Importing it imports no
GPU library.
"""

from . import config as _config

# before any core module is imported: interpreted where asked for, or where the compiled
# core cannot run as one (partly built, older than its sources: check_required says so)
if _config.pure_python_requested() or _config.unusable_build():
    _config.install_source_finder()

from .access import get_access_policy, set_access_policy  # noqa: E402
from .allocation import Allocation, lookup_allocation  # noqa: E402
from .bridges import adopt, from_cuda_array_interface, from_dlpack, record_use  # noqa: E402
from .buffer import Buffer, DeviceBox  # noqa: E402
from .device import Device, default_device  # noqa: E402
from .errors import (AccessConflictError, AliasError, BackendUnavailableError,  # noqa: E402
                     CaptureError, CompletionUnknownError, CudaError, DeviceMismatchError,
                     HostKernelError, KernelError, LayoutError, LeakWarning, MovedError,
                     PeerAccessError, ReadOnlyError, ReleasedError, SharedMemError,
                     SharedMemWarning)
from .launch import (Atomic, HostKernel, In, InOut, KernelAdapter, Out,  # noqa: E402
                     host_kernel, launch, register_kernel_adapter)
# sm.zip: not in __all__ (`from sharedmem import *` would shadow the builtin); `zip as zip`
# exports it to type checkers all the same
from .ops import DeviceOp, op, zip as zip  # noqa: E402,A004
from .runtime.future import DeviceFuture, HostFuture  # noqa: E402
from .runtime.graph import Graph, capture, graph  # noqa: E402
from .stats import InFlight, Stats, inflight, stats, synchronize  # noqa: E402
from .trace import trace  # noqa: E402
from . import ipc  # noqa: E402  (sm.ipc.export / sm.ipc.open)
from .stream import Event, Stream  # noqa: E402
from .tensor import Tensor  # noqa: E402
from .config import show_config  # noqa: E402

__version__ = "0.1.0"

_config.check_required()

from . import pickling as _pickling  # noqa: E402  (pickle support; not compiled)

_pickling._register_refusals()  # streams, events, futures...: a TypeError saying what to send
_pickling.hook_distributed()  # sharedmem's dask.distributed serializers, once distributed is loaded

__all__ = [
    "AccessConflictError", "AliasError", "Allocation", "Atomic", "BackendUnavailableError",
    "CaptureError", "Graph", "capture", "graph", "Buffer", "CompletionUnknownError", "CudaError",
    "Device", "DeviceBox", "DeviceFuture", "DeviceMismatchError", "DeviceOp", "Event", "HostFuture",
    "HostKernel", "HostKernelError", "In", "InOut", "KernelAdapter", "KernelError", "LayoutError",
    "LeakWarning", "MovedError", "Out", "PeerAccessError", "ReadOnlyError", "ReleasedError",
    "SharedMemError", "SharedMemWarning", "Stats", "Stream", "Tensor", "default_device", "adopt",
    "from_cuda_array_interface", "from_dlpack", "record_use", "get_access_policy", "host_kernel",
    "launch", "lookup_allocation", "op", "register_kernel_adapter", "set_access_policy",
    "show_config", "stats", "synchronize", "__version__", "InFlight", "inflight", "trace",
]

