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
import struct
import sys
import threading
from functools import cache, partial
from types import SimpleNamespace

import numpy as np

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from sharedmem import _cython as cython

from sharedmem.allocation import View, _module
from sharedmem.buffer import DeviceBox
from sharedmem.errors import BackendUnavailableError, KernelError
from sharedmem.runtime.state import RUNTIME, log
from sharedmem.launch import (ForeignArray, Intent, KernelAdapter, KernelPlan, LaunchArg,
                              array_args, check_dims, check_shared_mem,
                              register_kernel_adapter)
from sharedmem.tensor import Tensor, c_strides

from interop.cai import cai_layout
from interop.cupy_launch import (ArrayFacts, coerce, merged_devices,
                                 order_after_libraries, torch_tensor_type)

__all__ = ["TileKernelAdapter", "INSTALL_HINT"]

INSTALL_HINT = ("cuTile is not installed: pip install 'cuda-tile[tileiras]' (or "
                "'sharedmem-gpu[cutile]'). Hopper GPUs (sm_90) need the CUDA 13.3+ tile compiler "
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
    over one of our views. Holds no token; the launch's lease keeps the bytes. ``sig`` and
    ``bits``: what cuTile compiles it for (see _signature)."""

    __slots__ = ("__cuda_array_interface__", "sig", "bits")


_RW, _RO = "cutile-descriptor-rw", "cutile-descriptor-ro"


def _descriptor(view, writable):
    if isinstance(view, Tensor):
        for s in cython.cast(Tensor, view)._strides:  # (a loop: no generator per launch)
            if s < 0:
                raise KernelError(f"{view!r} has negative strides; cuTile assumes strides >= 0 "
                                  f"-- pass a contiguous copy")
    d = _ArrayDescriptor.__new__(_ArrayDescriptor)
    cai = d.__cuda_array_interface__ = cai_layout(view, not writable)
    d.sig, d.bits = _array_keys(cai["typestr"], int(cai["typestr"][2:]), cai["shape"],
                                cai["strides"], cai["data"][0])
    return d


_writable_descriptor = partial(_descriptor, writable=True)  # (View._derived_value's `make`)
_readonly_descriptor = partial(_descriptor, writable=False)


def _array_keys(dtype, itemsize, shape, strides, ptr) -> tuple:
    """An array argument's two keys (see _signature): ``(exact, bits)``. ``bits`` is what
    cuTile specializes an array on (cext/tile_kernel.cpp, compute_array_specialization_bits):
    its dtype and rank, the base pointer's 16-byte alignment, whether its elements are
    disjoint, and per dimension whether the shape is a multiple of 16 or 1 and the stride a
    multiple of 16 bytes or one element. ``exact`` adds the shape and strides themselves.
    ``dtype``: any key of the element type (a typestr, torch's dtype name); ``strides`` in
    bytes, or None (C-contiguous)."""
    ndim = len(shape)
    if strides is None:
        strides = tuple([s * itemsize for s in c_strides(shape)])
    dims = tuple((shape[k] % 16 == 0, shape[k] == 1, strides[k] % 16 == 0,
                  strides[k] == itemsize) for k in range(ndim))
    # disjoint, as cuTile has it: every dimension (extent 1 too) by increasing (stride,
    # extent), the first stride positive and each stride at least the span of the one before
    order = sorted(zip(strides, shape))
    disjoint = ndim == 0 or order[0][0] > 0
    for k in range(1, ndim):
        if not (order[k][0] > 0 and order[k][0] >= order[k - 1][0] * order[k - 1][1]):
            disjoint = False
            break
    bits = (dtype, ndim, ptr % 16 == 0, disjoint, dims)
    return (bits, tuple(shape), tuple(strides)), bits


class _Ident:
    """An object in a signature by identity (its == may be anything), kept alive there so
    that its id is not reused while the signature is remembered."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return type(other) is _Ident and other.obj is self.obj

    def __hash__(self):
        return id(self.obj)


def _scalar_key(x):
    """A constant's value as cuTile tells constants apart: floats by their bits (-0.0 is not
    0.0; a NaN equals itself), tuples and lists item by item (cuTile unpacks them)."""
    t = type(x)
    if t is float:
        return (t, struct.pack("<d", x))
    if t is int or t is bool or t is complex or t is str or x is None:
        return (t, x)
    if t is tuple or t is list:
        return (t, tuple([_scalar_key(e) for e in x]))
    return (t, _Ident(x))


def _param_modes(kernel):
    """How each parameter's argument is keyed, from cuTile's annotations of the kernel:
    "const" (``ct.Constant``: by value), "array" (an array annotation, which may fix
    dimensions: the exact layout), "runtime" (a scalar by its type; an array by its
    specialization bits), or for a tuple annotation ``("each", mode)`` / ``("items",
    modes)``: its items' -- or None where they cannot be read (cuTile's private structure
    changed, or not a cuTile kernel): then every argument by value or exact layout, finer
    than cuTile and never coarser."""
    try:
        return tuple([_mode(node) for node in kernel._annotated_function.parameter_annotations])
    except Exception:
        return None


def _mode(node):
    kind = node.KIND
    if kind == "leaf":
        return "const" if node.constant else "array" if node.array is not None else "runtime"
    if kind == "homogeneous_tuple":
        return ("each", _mode(node.each))
    if kind == "heterogeneous_tuple":
        return ("items", tuple([_mode(n) for n in node.items]))
    raise TypeError(kind)  # (an annotation this cuTile has and sharedmem does not know)


def _is_cupy_array(x) -> bool:
    cp = sys.modules.get("cupy")
    return cp is not None and isinstance(x, cp.ndarray)


def _signature(call_args, modes) -> tuple:
    """What cuTile compiles ``call_args`` for, at least as finely as it tells them apart (a
    warmed signature never compiles again; a coarser one would make a launch compile under
    the core lock): see _param_modes, _array_keys and _scalar_key."""
    return tuple([_key(x, modes[i] if modes is not None and i < len(modes) else None)
                  for i, x in enumerate(call_args)])


def _key(x, mode):
    """One argument's part of a signature (``mode``: see _param_modes). A tuple's items are
    keyed by their own annotations -- a tuple annotation's items, or the parameter's."""
    t = type(x)
    if t is _ArrayDescriptor:
        return x.bits if mode == "runtime" else x.sig
    if t is tuple and mode is not None and mode != "const":
        if type(mode) is tuple:
            sub = mode[1]
            return (t, tuple([_key(e, sub if mode[0] == "each" else
                                   sub[k] if k < len(sub) else None) for k, e in enumerate(x)]))
        return (t, tuple([_key(e, mode) for e in x]))
    if mode == "runtime" and (t is int or t is float or t is bool or t is complex):
        return t
    if _is_cupy_array(x):
        dt = x.dtype
        exact, bits = _array_keys(dt.str, dt.itemsize, x.shape, x.strides, x.data.ptr)
        return bits if mode == "runtime" else exact
    tt = torch_tensor_type()
    if tt is not None and isinstance(x, tt):
        item = x.element_size()
        exact, bits = _array_keys(_typestr_of(x.dtype), item, tuple(x.shape),
                                  tuple([st * item for st in x.stride()]), x.data_ptr())
        return bits if mode == "runtime" else exact
    return _scalar_key(x)


@cache
def _typestr_of(dtype) -> str:
    """A torch dtype as the typestr a view or CuPy array of its elements has (one signature
    for one layout, whoever holds it); its name where NumPy has no such type (bfloat16)."""
    name = str(dtype)
    try:
        return np.dtype(name[6:] if name.startswith("torch.") else name).str
    except TypeError:
        return name


def _same_args(a, b) -> bool:
    """Whether arguments ``a`` are ``b``: the same objects, or equal scalars of one type, at
    every place (a cheap check: no other object's == is called). A miss only means the
    signature is computed."""
    n = len(a)
    if b is None or len(b) != n:
        return False
    for i in range(n):
        x, y = a[i], b[i]
        t = type(x)
        if t is list:  # (changed in place, the same list is another constant for cuTile)
            return False
        if t is tuple:  # (the same tuple may hold a list)
            if type(y) is not tuple or not _same_args(x, y):
                return False
            continue
        if x is y:
            continue
        if t is not type(y) or not (t is int or t is float or t is bool or t is complex) or \
                x != y or (t is float and x == 0.0):  # (-0.0 == 0.0, as constants they differ)
            return False
    return True


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


@cython.boundscheck(False)  # (every index below the list's length)
@cython.wraparound(False)
def _aliased(uses) -> bool:
    """True when two leases of ``uses`` overlap and one of them writes (no argument numbers:
    :func:`_check_no_aliasing` finds them, on this rare path only)."""
    n = len(uses)
    for p in range(n):
        up = uses[p]
        ta = cython.cast(ViewToken, up[0]) if cython.compiled else up[0]  # (a lease's token)
        for q in range(p + 1, n):
            uq = uses[q]  # (its mode read only for two leases of one allocation: the rare case)
            tb = cython.cast(ViewToken, uq[0]) if cython.compiled else uq[0]
            if (ta.allocation is tb.allocation and ta.start < tb.stop and tb.start < ta.stop
                    and ta.start < ta.stop and tb.start < tb.stop and (up[1] or uq[1])):
                return True
    return False


def _check_no_aliasing(args) -> None:
    arrays = [(i, a) for i, a in enumerate(args) if type(a) is LaunchArg]  # (from array_args)
    for n, (i, a) in enumerate(arrays):
        ta = a.token
        for j, b in arrays[n + 1:]:
            tb = b.token
            if _aliased([(ta, a.writes), (tb, b.writes)]) and _share_elements(a, b):
                raise KernelError(
                    f"arguments {i} and {j} overlap (bytes [{max(ta.start, tb.start)}, "
                    f"{min(ta.stop, tb.stop)}) of allocation #{ta.allocation.id}) and one of them "
                    f"is written; cuTile assumes distinct array arguments do not alias")


def _share_elements(a, b) -> bool:
    """Whether array arguments ``a`` and ``b`` (LaunchArgs whose byte spans overlap) have an
    element byte in common: interleaved views (``t[0::2]``, ``t[1::2]``) share none. Exact
    (``np.shares_memory``); where that is too much work, assumed to (refused)."""
    try:
        return bool(np.shares_memory(_layout(a), _layout(b), max_work=1 << 16))
    except np.exceptions.TooHardError:
        return True


def _layout(la):
    v = la.view if la.view is not None else la.value
    if isinstance(v, Tensor):
        size = v._dtype.itemsize
        shape, strides = v._shape, tuple([s * size for s in v._strides])
    elif isinstance(v, View):  # a Buffer: contiguous
        size = v._dtype.itemsize
        shape, strides = (v._length,), (size,)
    else:  # a CuPy array
        size = v.itemsize
        shape, strides = tuple(v.shape), tuple(v.strides)
    # a NumPy array interface over the argument's device memory, read for its layout only
    # (np.shares_memory does arithmetic on it; nothing reads the bytes)
    return np.asarray(SimpleNamespace(__array_interface__={
        "data": (la.token.allocation.ptr + la.offset, True), "shape": shape,
        "strides": strides, "typestr": f"|V{size}", "version": 3}))


def _plain_items(i, seq):
    """Tuple or list argument ``i`` with the NumPy scalars in it, at any depth, as the Python
    scalars cuTile takes (``seq`` itself where there are none) -- or KernelError where it
    holds an array: cuTile reads the arrays in it, but a launch leases only the arguments
    themselves (and the warm-up's signature would keep them alive)."""
    out = None
    for k, x in enumerate(seq):
        t = type(x)
        if t is tuple or t is list:
            y = _plain_items(i, x)
        elif t is int or t is float or t is bool or t is complex or t is str or x is None:
            continue
        elif isinstance(x, (View, Intent, LaunchArg, DeviceBox)) or _is_cupy_array(x) or \
                hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__"):
            raise KernelError(f"argument {i}: a {t.__name__} inside a {type(seq).__name__}; a "
                              f"launch leases only the arrays passed as arguments themselves "
                              f"-- pass each array as its own argument")
        elif isinstance(x, _NP_GENERIC):
            y = x.item()
        else:
            continue
        if y is not x:
            if out is None:
                out = list(seq)
            out[k] = y
    return seq if out is None else type(seq)(out)


_NP_GENERIC = cython.declare(object, np.generic)

#: The largest grid dimension cuTile launches (its validate_grid: 2**24 - 1 blocks, whatever
#: the device allows)
_TILE_GRID_MAX = (1 << 24) - 1

#: Signatures a kernel is warmed up for (see TilePlan.warm); past it, a new one compiles
#: at its launch, under the core lock, as without the warm-up.
WARM_MAX = 64


class TilePlan(KernelPlan):
    """A cuTile kernel on one device: arrays reach ``ct.launch`` as the views' cached CAI
    descriptors (or the foreign arrays themselves: a CuPy array's lease is its
    :class:`~interop.cupy_launch.ArrayFacts`, as for CuPy kernels), scalars as Python scalars.

    ``modes``: how each parameter is keyed in a signature (:func:`_param_modes`);
    ``warmed``: signature -> Event, set once its compile is done (see :meth:`warm`);
    ``last_args``: the previous launch's arguments for cuTile once warmed -- descriptors and
    scalars, a CuPy array or torch tensor as its facts' weak reference (a CuPy array's with
    its layout), None where another foreign array was among them: nothing large is kept
    alive -- a launch with the same ones skips the signature. Lock-free: dict operations are
    atomic, and a racing thread at worst computes one more signature."""

    __slots__ = ("backend", "ct_launch", "modes", "warmed", "last_args")

    def __init__(self, kernel, adapter, device, ct):
        KernelPlan.__init__(self, kernel, adapter, device)
        self.backend = device.backend
        self.ct_launch = ct.launch
        self.modes = _param_modes(kernel)
        self.warmed = {}
        self.last_args = None

    def warm(self, call_args) -> bool:
        """Compile for these arguments' signature before the launch takes the core lock:
        cuTile compiles a kernel on its first launch with a signature, for seconds, and the
        launch holds the core lock -- every thread's sharedmem calls would wait. A signature
        not seen yet is first launched with the same arguments and a grid of zero blocks on
        a private stream: cuTile compiles and caches the kernel, then the driver refuses the
        empty grid (a launch error that leaves nothing behind), so nothing runs. (Were a
        cuTile to refuse that grid before compiling, the launch would compile as before.) A
        thread meeting a signature another thread is compiling waits for it, here. At most
        WARM_MAX a kernel; none during a capture (then False: try again next launch)."""
        key = _signature(call_args, self.modes)
        warmed = self.warmed
        ev = warmed.get(key)
        if ev is None:
            if RUNTIME.captures:
                return False
            if len(warmed) >= WARM_MAX:
                return True
            ev = threading.Event()
            ev.compiler = threading.get_ident()
            got = warmed.setdefault(key, ev)
            if got is ev:  # (else another thread's, just put there: maybe deleted since)
                try:
                    self._compile(call_args)
                except BaseException:  # not compiled (an interrupt too): not warmed
                    del warmed[key]
                    raise
                finally:
                    ev.set()
                return True
            ev = got
        if not ev.is_set() and ev.compiler == threading.get_ident():
            return True  # (this thread compiles it, frames below: a finalizer's launch; no wait)
        ev.wait()
        if warmed.get(key) is not ev:  # that compile failed: this launch compiles it, here
            return self.warm(call_args)
        return True

    def _compile(self, call_args) -> None:
        """The warm-up launch. A compile error (cuTile's ``TileError``) is raised: the launch
        fails here, before its leases, with the error cuTile's own launch raises -- and the
        next launch of that signature compiles again here, never under the core lock (cuTile
        keeps no failed compile). Anything else is what the empty grid meets: the driver's
        refusal ("Failed to launch cuTile kernel"), or what the launch itself will raise."""
        try:
            impl = self.backend.create_stream("cuTile warm-up")
            self.ct_launch(impl.handle, (0, 1, 1), self.kernel, call_args)
        except Exception as e:
            tile_error = getattr(_cutile(), "TileError", None)
            if tile_error is not None and isinstance(e, tile_error):
                raise
            log.debug("warm-up launch of %s: %r", self.label, e)

    def make_config(self, grid, block, shared_mem):
        if block is not None:
            raise KernelError(f"cuTile kernels choose their own block shape: pass block=None, "
                              f"got {block!r}")
        if check_shared_mem(shared_mem):
            raise KernelError("cuTile kernels manage their own shared memory: pass shared_mem=0")
        g = check_dims(grid, "grid", [min(n, _TILE_GRID_MAX) for n in self.backend.limits.grid])
        return tuple(g) + (1,) * (3 - len(g))

    @cython.boundscheck(False)  # (every index below its list's length by construction: a
    @cython.wraparound(False)   # use for each array argument, see resolve_args)
    def pack(self, args, uses, config, stream):
        if len(uses) > 1 and _aliased(uses):
            _check_no_aliasing(array_args(args, uses))
        n = len(args)
        out = [None] * n
        foreign = False  # (an argument whose signature must be computed each launch)
        known = None  # (index, what stands for a foreign array in last_args: see below)
        torch_dev = None  # (the devices of the torch tensors and of the CuPy arrays: see pack
        cupy_dev = None   # in interop.cupy_launch)
        j = 0
        for i in range(n):
            a = args[i]
            if isinstance(a, View):
                out[i] = _view_descriptor(i, a, uses[j][1])
                j += 1
            elif type(a) is LaunchArg or isinstance(a, ForeignArray):
                j += 1
                if type(a) is LaunchArg and a.with_length:  # (a view's LaunchArg: only then)
                    raise KernelError(f"argument {i}: with_length=True is for CuPy kernels (a "
                                      f"pointer and a length); a cuTile kernel takes the array "
                                      f"itself, with its shape")
                # a foreign array, which cuTile reads itself (a CuPy array's facts, see coerce,
                # give it back: alive, the launch holds it)
                v = out[i] = a.value if type(a) is LaunchArg else a.ref()
                if type(a) is ArrayFacts and a.layout is not None:
                    # a torch tensor's facts' weak reference stands for it in last_args
                    # (keeping neither the tensor nor the facts' allocation): they were checked
                    # against its pointer and layout just now (new facts, a new reference,
                    # where either changed); torch has no negative strides (nor `strides`:
                    # a getattr of it raised and caught an AttributeError a launch)
                    torch_dev = merged_devices(torch_dev, a.token.allocation.device)
                    stand_in = a.ref
                else:
                    for st in getattr(v, "strides", ()):
                        if st < 0:
                            raise KernelError(f"argument {i}: a {type(v).__name__} with "
                                              f"negative strides; cuTile assumes strides >= 0 "
                                              f"-- pass a contiguous copy")
                    if type(a) is not ArrayFacts:
                        foreign = True
                        continue
                    # a CuPy array: as a torch tensor's above, but its layout may be re-set
                    cupy_dev = merged_devices(cupy_dev, a.token.allocation.device)
                    stand_in = (a.ref, v.shape, v.strides, v.dtype)
                if known is None:
                    known = []
                known.append((i, stand_in))
            else:
                t = type(a)
                if t is tuple or t is list:
                    a = _plain_items(i, a)
                if t is int or t is float or t is bool or not isinstance(a, _NP_GENERIC):
                    out[i] = a
                else:
                    out[i] = a.item()  # a NumPy scalar: as the Python scalar cuTile takes
        call_args = tuple(out)
        if known is None:
            seen = call_args
        else:
            for i, k in known:
                out[i] = k
            seen = tuple(out)
        if foreign or not _same_args(seen, self.last_args):
            if self.warm(call_args):
                self.last_args = None if foreign else seen
        if torch_dev is not None or cupy_dev is not None:  # (see interop.cupy_launch)
            order_after_libraries(stream, torch_dev, cupy_dev, uses)
        return call_args

    def enqueue(self, stream, config, payload):  # (config: the grid; payload: the arguments)
        st = stream
        impl = st._impl
        self.backend.ensure_context()
        self.ct_launch(impl.handle, config, self.kernel, payload)
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
        """As CuPy kernels' (:func:`interop.cupy_launch.coerce`); a DLPack producer elsewhere
        (a NumPy array) is imported too, and refused as on another device."""
        return tile_coerce(obj, device)

    def plan(self, kernel, device):
        return TilePlan(kernel, self, device, _cutile())


def tile_coerce(obj, device):
    """:meth:`TileKernelAdapter.coerce`."""
    got = coerce(obj, device)
    if got is None and hasattr(obj, "__dlpack__") and not isinstance(obj, (int, float,
                                                                         complex)):
        return _module("interop.dlpack").from_dlpack(obj)
    return got


def _c_tile_coerce(obj, device):
    """Compiled: :func:`tile_coerce` as a C function (cutile.pxd), whose address the adapter
    gives the launch path (``KernelAdapter._coerce_addr``)."""
    return tile_coerce(obj, device)


# By name: importing this module must not import cuda.tile. (Compiled, its coerce as a C
# function too: see KernelAdapter._coerce_addr.)
_adapter = TileKernelAdapter()
_adapter._coerce_addr = cython.cast(cython.size_t, cython.cast(cython.p_void, _c_tile_coerce)) \
    if cython.compiled else 0
register_kernel_adapter("cuda.tile._execution.kernel", _adapter)
