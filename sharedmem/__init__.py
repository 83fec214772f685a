"""sharedmem: one owner for GPU memory shared by CuPy (SIMT) and cuTile (Tile) kernels.

Typed buffers and Tile tensors share allocation tokens; zero-copy moves
(``Tensor.from_buffer`` / ``into_buffer`` / ``as_buffer``) reject live aliases;
every launch holds leases on its memory until the device is done. This module
only re-exports; each concept lives in its own module. Importing it imports no
GPU library.
"""

from .access import get_access_policy, set_access_policy
from .allocation import Allocation, lookup_allocation
from .bridges import adopt, from_cuda_array_interface, from_dlpack, record_use
from .buffer import Buffer, DeviceBox
from .device import Device, default_device
from .errors import (AccessConflictError, AliasError, BackendUnavailableError, CaptureError,
                     CompletionUnknownError, CudaError, DeviceMismatchError, KernelError, LayoutError,
                     LeakWarning, MovedError, ReleasedError, SharedMemError, SharedMemWarning)
from .launch import (Atomic, HostKernel, In, InOut, KernelAdapter, Out, host_kernel, launch,
                     register_kernel_adapter)
from .ops import DeviceOp, op, zip
from .runtime.future import DeviceFuture, HostFuture
from .runtime.graph import Graph, capture, graph
from .stats import Stats, stats, synchronize
from .stream import Event, Stream
from .tensor import Tensor

__version__ = "0.1.0"

__all__ = [
    "AccessConflictError", "AliasError", "Allocation", "Atomic", "BackendUnavailableError",
    "CaptureError", "Graph", "capture", "graph",
    "Buffer", "CompletionUnknownError", "CudaError", "Device", "DeviceBox", "DeviceFuture",
    "DeviceMismatchError", "DeviceOp", "Event", "HostFuture", "HostKernel", "In", "InOut", "KernelAdapter",
    "KernelError", "LayoutError", "LeakWarning", "MovedError", "Out", "ReleasedError",
    "SharedMemError", "SharedMemWarning", "Stats", "Stream", "Tensor", "default_device",
    "adopt", "from_cuda_array_interface", "from_dlpack", "record_use",
    "get_access_policy", "host_kernel", "launch", "lookup_allocation", "op", "register_kernel_adapter",
    "set_access_policy", "stats", "synchronize", "zip", "__version__",
]

from . import _accel as _accel  # noqa: E402  (reads the modules above)

_accel.configure()
launch = _accel.entry(launch)  # the same launch(), entered from C when the extension is built
