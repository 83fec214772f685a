"""cuTile (``cuda.tile``) kernels launched through ``sharedmem.launch``.

``sharedmem.launch(tile_kernel, grid, None, t1, In(t2), ..., stream=s)``
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

import importlib
import sys

import numpy as np

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from sharedmem import _cython as cython

from sharedmem.allocation import View, _module
from sharedmem.errors import BackendUnavailableError, KernelError
from sharedmem.runtime.state import RUNTIME, log
from sharedmem.launch import (KernelAdapter, KernelPlan, LaunchArg, array_args, check_dims,
                              register_kernel_adapter)
from sharedmem.tensor import Tensor

from interop.cai import cai_layout
from interop.cupy_launch import foreign_array

__all__ = ["TileKernelAdapter", "INSTALL_HINT"]

INSTALL_HINT = ("cuTile is not installed: pip install 'cuda-tile[tileiras]' (or "
                "'sharedmem[cutile]'). Hopper GPUs (sm_90) need the CUDA 13.3+ tile compiler "
                "tools (tileiras, ptxas, libnvvm) on PATH.")


def _cutile():
    ct = sys.modules.get("cuda.tile")
    if ct is not None:
        return ct
    try:  # (importlib, not an import statement: compiled code would take a None entry of
        # sys.modules -- an import blocked on purpose -- for the module)
        return importlib.import_module("cuda.tile")
    except ImportError as e:
        raise BackendUnavailableError(f"{INSTALL_HINT} ({e})") from None


class _ArrayDescriptor:
    """What cuTile reads an array argument from: a CUDA Array Interface dict
    over one of our views. Holds no token; the launch's lease keeps the bytes. ``sig``:
    what of it cuTile compiles for (see TilePlan.warm)."""

    __slots__ = ("__cuda_array_interface__", "sig")


_RW, _RO = "cutile-descriptor-rw", "cutile-descriptor-ro"


def _descriptor(view, writable):
    if isinstance(view, Tensor):
        for s in cython.cast(Tensor, view)._strides:
            if s < 0:
                raise KernelError(f"{view!r} has negative strides; cuTile assumes strides >= 0 "
                                  f"-- pass a contiguous copy")
    d = _ArrayDescriptor.__new__(_ArrayDescriptor)
    cai = d.__cuda_array_interface__ = cai_layout(view, not writable)
    d.sig = (cai["typestr"], cai["shape"], cai["strides"], cai["data"][0] % 16)
    return d


def _signature(call_args) -> tuple:
    """What cuTile compiles ``call_args`` for, at least as finely as it tells them apart: an
    array's dtype, shape, strides and pointer alignment; a scalar's type and value (1, 1.0
    and True differ); any other object by identity (its == may be anything)."""
    key = []
    for x in call_args:
        t = type(x)
        if t is _ArrayDescriptor:
            key.append(x.sig)
        elif t is int or t is float or t is bool or t is complex:
            key.append((t, x))
        elif hasattr(x, "__cuda_array_interface__"):  # a CuPy array
            key.append((x.dtype.str, x.shape, x.strides, x.data.ptr % 16))
        else:
            key.append((t, id(x)))
    return tuple(key)


def _same_args(a, b) -> bool:
    """Whether arguments ``a`` are ``b``: the same objects, or equal scalars of one type, at
    every place (a cheap check: no other object's == is called). A miss only means the
    signature is computed."""
    if b is None:
        return False
    n = len(a)
    if len(b) != n:
        return False
    for i in range(n):
        x = a[i]
        y = b[i]
        if x is y:
            continue
        t = type(x)
        if t is not type(y) or not (t is int or t is float or t is bool or t is complex) or \
                x != y:
            return False
    return True


def _writable_descriptor(view):
    return _descriptor(view, True)


def _readonly_descriptor(view):
    return _descriptor(view, False)


#: Descriptors by what they say -- (address, shape, strides, dtype, writable) -- for views
#: made anew each launch: a Tensor moved out of a Buffer and back every step has the same
#: layout every time, and its descriptor is found here instead of built (a descriptor is
#: plain data: any view with that layout may hand it to cuTile). Bounded: cleared when full.
#: Lock-free: a racing thread stores an equal value.
_by_layout: dict = {}
_BY_LAYOUT_MAX = 512


def _view_descriptor(i, view, writes):
    """The view's descriptor: cached on the view (its layout never changes while it lives),
    else by layout (see ``_by_layout``), else made -- or KernelError naming argument ``i``."""
    d = view._derived
    if d is not None:  # (the common case, inline: View._derived_value's dict)
        got = d.get(_RW if writes else _RO)
        if got is not None:
            return got
    tok = view._token
    if isinstance(view, Tensor):
        t = view  # (typed locals here and below, not casts: interpreted, a cast is a call)
        key = (tok.allocation.ptr + view._offset, t._shape, t._strides, t._dtype, writes)
    else:
        key = (tok.allocation.ptr + view._offset, view.shape, None, view.dtype, writes)
    by_layout = _by_layout  # (a typed local: a C dict lookup)
    got = by_layout.get(key)
    if got is not None:
        return got
    try:
        got = (view._derived_value(_RW, _writable_descriptor) if writes else
               view._derived_value(_RO, _readonly_descriptor))
    except KernelError as e:
        raise KernelError(f"argument {i}: {e}") from None
    if len(_by_layout) >= _BY_LAYOUT_MAX:
        _by_layout.clear()
    _by_layout[key] = got
    return got


def _aliased(uses) -> bool:
    """True when two leases of ``uses`` overlap and one of them writes (no argument numbers:
    :func:`_check_no_aliasing` finds them, on this rare path only)."""
    n = len(uses)
    for p in range(n):
        ta, wa = uses[p]
        for q in range(p + 1, n):
            tb, wb = uses[q]
            if (ta.allocation is tb.allocation and ta.start < tb.stop and tb.start < ta.stop
                    and ta.start < ta.stop and tb.start < tb.stop and (wa or wb)):
                return True
    return False


def _check_no_aliasing(args) -> None:
    arrays = [(i, a) for i, a in enumerate(args) if type(a) is LaunchArg]  # (from array_args)
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


#: Signatures a kernel is warmed up for (see TilePlan.warm); past it, a new one compiles
#: at its launch, under the core lock, as without the warm-up.
WARM_MAX = 16


class TilePlan(KernelPlan):
    """A cuTile kernel on one device: arrays reach ``ct.launch`` as the views' cached CAI
    descriptors (or the foreign arrays themselves), scalars as Python scalars.

    ``warmed``: the argument signatures launched once into a discarded capture (see
    :meth:`warm`); ``last_args``: the previous launch's arguments for cuTile when they held
    no foreign array (descriptors and scalars only: nothing large is kept alive), which a
    launch with the same ones skips the signature for. Both lock-free: a racing thread at
    worst computes one more signature."""

    __slots__ = ("backend", "ct_launch", "warmed", "last_args")

    def __init__(self, kernel, adapter, device, ct):
        KernelPlan.__init__(self, kernel, adapter, device)
        self.backend = device.backend
        self.ct_launch = ct.launch
        self.warmed = set()
        self.last_args = None

    def warm(self, grid, call_args) -> None:
        """Compile for this signature before the launch takes the core lock: cuTile compiles
        a kernel on its first launch with an argument signature (dtypes, layouts, pointer
        alignment, scalar types, constants), for seconds, and the launch holds the core lock
        -- every thread's sharedmem calls would wait. So a signature not seen yet is launched
        once with the same arguments into a capture on a private stream that is destroyed
        unlaunched (the kernel never runs; cuTile keeps what it compiled), without the lock.
        The signature (:func:`_signature`) tells them apart at least as finely as cuTile does
        (exact shapes, strides and scalar values), so a warmed one never compiles again. At
        most WARM_MAX a kernel; none during a capture. A failure here is left for the launch
        itself to meet (and report as it always has)."""
        key = _signature(call_args)
        warmed = self.warmed
        if key not in warmed and len(warmed) < WARM_MAX and not RUNTIME.captures:
            warmed.add(key)  # (first, so that a failure is not retried every launch)
            try:
                self.backend.discarded_capture(self.ct_launch, grid, self.kernel, call_args)
            except Exception as e:
                log.debug("warm-up of %s failed (its launch will compile it): %r",
                          self.label, e)

    def make_config(self, grid, block, shared_mem):
        if block is not None:
            raise KernelError(f"cuTile kernels choose their own block shape: pass block=None, "
                              f"got {block!r}")
        if shared_mem:
            raise KernelError("cuTile kernels manage their own shared memory: pass shared_mem=0")
        g = check_dims(grid, "grid", False, self.backend.limits.grid)
        return tuple(g) + (1,) * (3 - len(g))

    def pack(self, args, uses, config, stream):
        if len(uses) > 1 and _aliased(uses):
            _check_no_aliasing(array_args(args, uses))
        n = len(args)
        out = [None] * n
        foreign = False
        j = 0
        for i in range(n):
            a = args[i]
            if isinstance(a, View):
                out[i] = _view_descriptor(i, a, uses[j][1])
                j += 1
            elif type(a) is LaunchArg:
                j += 1
                la = a
                if la.view is None:
                    out[i] = la.value  # a foreign array: cuTile reads it itself
                    foreign = True
                else:
                    out[i] = _view_descriptor(i, la.view, la._mode != 0)
            elif isinstance(a, np.generic):
                out[i] = a.item()
            else:
                out[i] = a
        call_args = tuple(out)
        if foreign or not _same_args(call_args, self.last_args):
            self.warm(config, call_args)
            self.last_args = None if foreign else call_args
        return call_args

    def enqueue(self, stream, config, payload):  # (config: the grid; payload: the arguments)
        grid, call_args = config, payload
        st = stream
        impl = st._impl
        self.backend.ensure_context()
        self.ct_launch(impl.handle, grid, self.kernel, call_args)
        return impl.submit_marker()


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
            return foreign_array(obj)
        if hasattr(obj, "__dlpack__") and not isinstance(obj, (int, float, complex)):
            return _module("interop.dlpack").from_dlpack(obj)
        return None

    def plan(self, kernel, device):
        return TilePlan(kernel, self, device, _cutile())


# By name: importing this module must not import cuda.tile.
register_kernel_adapter("cuda.tile._execution.kernel", TileKernelAdapter())
