"""cuTile (``cuda.tile``) kernels launched through ``sharedmem.launch``.

``sharedmem.launch(tile_kernel, grid, None, t1, sm.In(t2), ..., stream=s)``
launches any ``@ct.kernel``. cuTile's own ``ct.launch`` keeps nothing alive:
it calls the DLPack deleter of every argument before the kernel has run
(NVIDIA/cutile-python#88). Here every array argument gets a lease (intent from
``In`` / ``Out`` / ``InOut`` / ``Atomic``, default ``InOut``) held by the
launch's submission until the device has finished -- whatever the caller
drops.

Arrays reach cuTile as small CUDA Array Interface descriptors of our views:
zero-copy, no DLPack capsule, no token churn. Constants and scalars pass
through (NumPy scalars as the equivalent Python scalars, which cuTile takes). Refused before launch, with a KernelError, because cuTile compiles
under these assumptions: negative strides (it assumes strides >= 0), and two
array arguments whose bytes overlap when either one is written (it assumes
distinct arrays do not alias).

Importing this module never fails; launching without cuTile installed raises
:class:`~sharedmem.errors.BackendUnavailableError` (an ImportError) saying how
to install it.
"""

from __future__ import annotations

import sys

import numpy as np

import sharedmem as sm
from sharedmem.errors import BackendUnavailableError, KernelError
from sharedmem.launch import KernelAdapter, LaunchArg, _check_dims, register_kernel_adapter

__all__ = ["TileKernelAdapter", "INSTALL_HINT"]

INSTALL_HINT = ("cuTile is not installed: pip install 'cuda-tile[tileiras]' (or "
                "'sharedmem[cutile]'). Hopper GPUs (sm_90) need the CUDA 13.3+ tile compiler "
                "tools (tileiras, ptxas, libnvvm) on PATH.")


def _cutile():
    try:
        import cuda.tile as ct
    except ImportError as e:
        raise BackendUnavailableError(f"{INSTALL_HINT} ({e})") from None
    return ct


class _ArrayDescriptor:
    """What cuTile reads an array argument from: a CUDA Array Interface dict
    over one of our views. Holds no token; the launch's lease keeps the bytes."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, view, writable: bool):
        from interop.cai import cai_layout
        self.__cuda_array_interface__ = cai_layout(view, not writable)


_RW, _RO = "cutile-descriptor-rw", "cutile-descriptor-ro"


def _writable_descriptor(view):
    return _ArrayDescriptor(view, True)


def _readonly_descriptor(view):
    return _ArrayDescriptor(view, False)


def _check_no_aliasing(args) -> None:
    arrays = [(i, a) for i, a in enumerate(args) if isinstance(a, LaunchArg)]
    for i, a in arrays:
        if any(s < 0 for s in getattr(a.view, "strides", (1,))):
            raise KernelError(f"argument {i}: {a.view!r} has negative strides; cuTile assumes "
                              f"strides >= 0 -- pass a contiguous copy")
    for n, (i, a) in enumerate(arrays):
        ta = a.token
        for j, b in arrays[n + 1:]:
            tb = b.token
            if ta.allocation is tb.allocation and ta.start < tb.stop and tb.start < ta.stop \
                    and ta.start < ta.stop and tb.start < tb.stop and (a.writes or b.writes):
                raise KernelError(
                    f"arguments {i} and {j} overlap (bytes [{max(ta.start, tb.start)}, "
                    f"{min(ta.stop, tb.stop)}) of allocation #{ta.allocation.id}) and one of them "
                    f"is written; cuTile assumes distinct array arguments do not alias")


class TileKernelAdapter(KernelAdapter):
    """Launches ``@cuda.tile.kernel`` functions with leases until completion."""

    name = "cuTile kernel"
    device_kinds = ("cuda",)

    def label(self, kernel) -> str:
        fn = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "_pyfunc", None),
                                                          "__name__", "kernel")
        return f"cuTile kernel {fn}"

    def coerce(self, obj, device):
        cp = sys.modules.get("cupy")
        if cp is not None and isinstance(obj, cp.ndarray):
            from interop.cupy import _tensor_view
            return _tensor_view(obj, "CuPy array argument")
        if hasattr(obj, "__dlpack__") and not isinstance(obj, (int, float, complex)):
            return sm.from_dlpack(obj)
        return None

    def prepare(self, kernel, grid, block, args, shared_mem, stream):
        ct = _cutile()
        if block is not None:
            raise KernelError(f"cuTile kernels choose their own block shape: pass block=None, "
                              f"got {block!r}")
        if shared_mem:
            raise KernelError("cuTile kernels manage their own shared memory: pass shared_mem=0")
        g = _check_dims(grid, "grid")
        g = tuple(g) + (1,) * (3 - len(g))
        _check_no_aliasing(args)
        # arrays as CAI descriptors; NumPy scalars as Python scalars (cuTile takes those)
        # (descriptors are made once per view: its layout never changes while it lives)
        call_args = tuple(
            (a.view._derived_value(_RW, _writable_descriptor) if a.writes else
             a.view._derived_value(_RO, _readonly_descriptor)) if isinstance(a, LaunchArg) else
            (a.item() if isinstance(a, np.generic) else a) for a in args)
        impl = stream._impl
        backend = stream.device.backend
        handle = impl.handle
        launch = ct.launch
        if _speedups is not None:
            _compiled_plan(self, kernel, args, stream, launch)

        def enqueue():
            backend.ensure_context()
            launch(handle, g, kernel, call_args)
            return backend.submit_marker(impl)

        return enqueue, (kernel,)


# By name: importing this module must not import cuda.tile.
register_kernel_adapter("cuda.tile._execution.kernel", TileKernelAdapter())


from sharedmem._accel import speedups as _speedups  # noqa: E402  (None: pure Python)

# the compiled path's argument codes for a call plan (sharedmem/_speedups.c)
_C_OBJ, _C_DESC = 9, 10
_plans: dict = {}  # (kernel, device, argument types) -> LaunchPlan; lock-free (idempotent)


def _compiled_plan(adapter, kernel, args, stream, launch) -> None:
    """Hand this kernel's plan for these argument types to the compiled path,
    which then launches it by itself -- the same checks, the views' cached
    descriptors, ``ct.launch`` called from C -- while the types stay the same.
    Only Python ints, floats and bools as scalars, and arrays given as views
    (not CuPy arrays or DLPack producers, made into views per launch)."""
    hot = stream.device.backend.hot
    addresses = getattr(hot, "addresses", None)
    if not addresses:
        return
    types = []
    specs = []
    for i, a in enumerate(args):
        if isinstance(a, LaunchArg):
            t = type(a.view)
            specs.append((t, _C_DESC, 0, i, -1))
        elif type(a) in (int, float, bool):
            t = type(a)
            specs.append((t, _C_OBJ, 0, i, -1))
        else:
            return
        types.append(t)
    dev = stream.device
    key = (kernel, dev, tuple(types))
    try:
        lp = _plans.get(key)
    except TypeError:  # an unhashable kernel object
        return
    if lp is None:
        from sharedmem.backends.cuda import MARKER_BATCH
        backend = dev.backend
        lp = _speedups.LaunchPlan(
            kernel, dev, dev.default_stream, type(stream._impl), backend, backend.submit_marker,
            (adapter, kernel), 0, int(backend.context), 0, addresses["cuCtxGetCurrent"],
            MARKER_BATCH, (), tuple(specs), launch, _RW, _RO)
        if len(_plans) >= 256:  # bounded: each plan keeps its kernel alive
            _plans.clear()
        _plans[key] = lp
    if _speedups.lookup(kernel) is not lp:
        _speedups.remember(kernel, lp)
