"""The one launch API, argument intents, kernel plans and the kernel-adapter registry.

``launch(kernel, grid, block, *args, stream=None, shared_mem=0, policy=None)``
launches any kernel an adapter is registered for -- host kernels
(:func:`host_kernel`), CuPy ``RawKernel`` / ``RawModule`` functions
(``interop.cupy``), cuTile kernels (``interop.cutile``) -- and returns a
:class:`~sharedmem.DeviceFuture`.

Arguments state intent: ``In(x)`` (read), ``Out(x)`` / ``InOut(x)`` (write),
``Atomic(x)`` (tracked as a write); a bare buffer or tensor is ``InOut``.
Anything that is not an array is passed through as a scalar. All validation
happens before any lease is taken, so a launch that fails takes none.

Planned first: what can be decided per kernel and device -- the parameter layout, the
driver entry point, how each kind of argument is packed -- is decided once, by the kernel's
adapter, into a :class:`KernelPlan` cached per kernel. A launch then only resolves its
arguments (a few field reads per view: fresh views, moved storage and foreign arrays cost the
same as reused views), packs them, and runs :func:`~sharedmem.runtime.submission.submit`.
"""

from __future__ import annotations

import importlib
import inspect
import operator
import sys
from functools import partial
from typing import TYPE_CHECKING, Generic, ParamSpec, TypeVar

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from . import _cython as cython

import numpy as np

from .access import ATOMIC, READ, WRITE, check_policy
from .allocation import View, ViewToken, _module, import_allocation, import_writable
from .buffer import Buffer, DeviceBox
from .device import Device, default_device
from .errors import DeviceMismatchError, KernelError
from .runtime.future import future_of
from .runtime.state import OwnedLock, fork_safe, locked
from .runtime.submission import Work, submit_plan, submit_plan_checked
from .stream import Stream, as_stream, as_stream_or_default, current_stream, streams_entered
from .tensor import Tensor, extent, is_torch_tensor, numpy_region, torch_storage_region

__all__ = ["launch", "In", "Out", "InOut", "Atomic", "Intent", "host_kernel", "HostKernel",
           "register_kernel_adapter", "KernelAdapter", "KernelPlan", "LaunchArg", "ForeignArray",
           "array_args"]

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Literal

    from .runtime.future import DeviceFuture

# A host kernel's parameters and return type (HostKernel[P, R] keeps the function's signature)
_P = ParamSpec("_P")
_R = TypeVar("_R")

# Intent modes, as stored (C constants when compiled); `Intent.mode` gives their names.
_READ = cython.declare(cython.int, 0)
_WRITE = cython.declare(cython.int, 1)
_ATOMIC = cython.declare(cython.int, 2)
_MODE_NAMES = (READ, WRITE, ATOMIC)


@cython.freelist(16)
@cython.cclass
class Intent:
    """Wraps a launch argument to state how the kernel uses it (``.obj``: the argument).

    ``with_length=True``: the kernel takes this buffer as two parameters, its pointer and its
    length in elements (``float* x, long long n``); without it, a Buffer is one pointer."""

    # ``_mode``, the intent's mode (``_READ``, ``_WRITE``, ``_ATOMIC``): a class attribute of
    # each intent class (a subclass's: its base's), which is what an instance reads
    # interpreted; compiled, a C field of each instance, set by __cinit__ from its class (which
    # runs for every instance, a subclass's that skips Intent.__init__ too)
    __slots__ = ("obj", "with_length")
    if not cython.compiled:
        _mode = _WRITE

        def __init_subclass__(cls, **kwargs):  # (a user's subclass: its mode as compiled)
            super().__init_subclass__(**kwargs)
            if cls.__module__ != __name__:
                cls._mode = _mode_of(cls)
    if TYPE_CHECKING:
        obj: object
        with_length: bool

    def __cinit__(self):  # (compiled only: see _mode above)
        c = type(self)
        self._mode = _READ if c is In else _WRITE if c is Out else _mode_of(c)

    def __reduce__(self):  # (compiled, __cinit__ turns Cython's own pickling off)
        return (_new_intent, (type(self), self.obj, self.with_length),
                getattr(self, "__dict__", None))

    def __init__(self, obj: object, with_length: bool = False) -> None:
        t = type(obj)
        if t is not _BUFFER and t is not _TENSOR and isinstance(obj, Intent):  # (views: no MRO walk)
            raise KernelError(f"{type(self).__name__}({obj!r}): an argument takes one intent")
        self.obj = obj
        self.with_length = True if with_length else False  # (a bool: compiled, a C bint)

    @property
    def mode(self) -> str:
        """``"read"``, ``"write"`` or ``"atomic"``."""
        return _MODE_NAMES[self._mode]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.obj!r}{', with_length=True' if self.with_length else ''})"


def _new_intent(cls, obj, with_length):
    """An intent of class ``cls`` unpickled or copied (its mode: from its class)."""
    it = cls.__new__(cls)
    it.obj = obj
    it.with_length = True if with_length else False
    return it


def _mode_given(mode) -> int:
    """A LaunchArg's mode: by name (``"read"``, ``"write"``, ``"atomic"``), by number (0 to 2:
    an int, a bool, a NumPy integer) or None (write); ValueError otherwise."""
    if mode is None:
        return _WRITE
    m = (_MODE_NAMES.index(mode) if mode in _MODE_NAMES else -1) if type(mode) is str else \
        operator.index(mode)
    if _READ <= m <= _ATOMIC:
        return m
    raise ValueError(f"mode {mode!r} is not one of 'read', 'write', 'atomic' (or None: write)")


def _mode_of(c) -> int:
    """The mode of intent class ``c``: its base's (a class under both In and Atomic reads)."""
    return _READ if issubclass(c, In) else _ATOMIC if issubclass(c, Atomic) else _WRITE


class In(Intent):
    """The kernel only reads this argument (a read lease)."""

    __slots__ = ()
    if not cython.compiled:
        _mode = _READ


class Out(Intent):
    """The kernel writes this argument (a write lease)."""

    __slots__ = ()


class InOut(Intent):
    """The kernel reads and writes this argument (a write lease); the default."""

    __slots__ = ()


class Atomic(Intent):
    """The kernel updates this argument with atomics (tracked as a write)."""

    __slots__ = ()
    if not cython.compiled:
        _mode = _ATOMIC


@cython.freelist(16)
@cython.cclass
class LaunchArg:
    """One array argument of a launch, resolved: ``view`` (a sharedmem view, or None for a
    foreign array an adapter leased directly), ``value`` (what the plan packs: the view, or
    the foreign array), ``token`` (what is leased), ``mode`` (``"read"``, ``"write"`` or
    ``"atomic"``), ``intent`` (the Intent class written; ``InOut`` for a bare argument),
    ``with_length``, ``offset`` (the byte offset of element 0 in the token's allocation).
    :func:`array_args` makes one of a view the launch resolved as itself from its lease
    alone: ``mode`` ``"read"`` or ``"write"`` (an ``Atomic`` one is leased, and reads, as a
    write), ``intent`` None."""

    __slots__ = ("view", "value", "token", "_mode", "intent", "with_length", "offset")

    def __init__(self, view, value, token, mode, intent, with_length=False, offset=0):
        # (checked as the compiled fields check them: the same TypeError in both builds)
        if view is not None and not isinstance(view, View) or not isinstance(token, ViewToken):
            raise TypeError(f"LaunchArg: view must be a sharedmem view or None and token a "
                            f"ViewToken, got {type(view).__name__} and {type(token).__name__}")
        self.view = view
        self.value = value
        self.token = token
        self._mode = mode if type(mode) is int and _READ <= mode <= _ATOMIC else _mode_given(mode)
        self.intent = intent
        self.with_length = True if with_length else False  # (a bool: compiled, a C bint)
        self.offset = operator.index(offset)

    @property
    def mode(self) -> str:
        return _MODE_NAMES[self._mode]

    @property
    def writes(self) -> bool:
        """True for a write or atomic lease."""
        return self._mode != _READ


@cython.cclass
class ForeignArray:
    """A foreign array's lease, prepared once per array by an adapter's ``coerce`` and shared
    by every launch that passes that array: ``token`` (its bytes' range in their allocation,
    a lease token -- never a live view -- which must not keep the array alive), ``offset``
    (of element 0 in the token's allocation), ``ref``, a weak reference to the array, and
    ``keep``: None, or a function of the array giving what each launch's work must keep
    besides it (a torch tensor's storage: torch can swap a tensor's storage in place, freeing
    the one a launch uses). Read-only to the launch: ``resolve_args`` puts it in ``resolved``
    as it is and keeps the array itself (and ``keep(array)``) until the work is done. A
    plan's ``pack`` reads it as it is (``RawKernelPlan``'s does); :func:`array_args` gives a
    plan that wants ``LaunchArg`` objects one with the array as ``value``. ``use_r`` and
    ``use_w``: the lease pairs ``(token, writes)`` launches take, made by the first -- kept
    here, not on the token (a lease token is never released: a pair on it would refer back to
    it, a cycle that kept it and its allocation until a collection)."""

    __slots__ = ("token", "offset", "ref", "keep", "use_r", "use_w")

    def __init__(self):
        # (what the adapter sets; unset, as the compiled fields start: refused by the launch)
        self.token = None
        self.offset = 0
        self.ref = None
        self.keep = None  # (an adapter's own ForeignArray need not set it)
        self.use_r = None  # (the launches' lease pairs, (token, writes): made by the first)
        self.use_w = None


# what KernelPlan._last holds before a plan's first launch: no grid, block or shared_mem is it
_NO_CONFIG = cython.declare(object, object())


class KernelPlan(Work):
    """What is constant about launching one kernel on one device, decided once by the
    kernel's adapter (``KernelAdapter.plan``) and cached: parameter layout, entry point,
    limits. Per launch, :func:`launch` calls ``configure`` and ``pack`` (validation, before
    any lease) and then ``enqueue`` under the core lock.

    ``configure(grid, block, shared_mem)`` -> a launch configuration (validated; plans cache
    it per value). ``pack(args, uses, config, stream)`` -> the payload ``enqueue`` needs;
    ``args`` and ``uses`` as :func:`resolve_args` makes them. ``enqueue(stream, config, payload)``
    puts the work on the stream and returns its completion marker."""

    __slots__ = ("kernel", "adapter", "device", "label", "_configs", "_last", "__weakref__")

    def __init__(self, kernel, adapter, device):
        self.kernel = kernel
        self.adapter = adapter
        self.device = device
        self.label = (adapter, kernel)  # formatted only when a message needs it
        self._configs = {}  # (grid, block, shared_mem) -> config; lock-free (idempotent writes)
        # (grid, block, shared_mem, config) of the last launch: the same objects again (a
        # literal grid or block is one constant object) need no lookup. Replaced whole: lock-free.
        # (Before the first launch: a marker no argument is -- (None, None, None) would take
        # grid=None, block=None, shared_mem=None for validated)
        self._last = (_NO_CONFIG, _NO_CONFIG, _NO_CONFIG, None)

    def configure(self, grid, block, shared_mem):
        """The validated launch configuration, cached per value (see ``make_config``)."""
        last = self._last
        if last[0] is grid and last[1] is block and last[2] is shared_mem:
            return last[3]
        if not (_plain_dims(grid) and _plain_dims(block) and type(shared_mem) is int):
            # (validated, never looked up: True == 1 and 2.0 == 2 would find another's config)
            return self.make_config(grid, block, shared_mem)
        key = (grid, block, shared_mem)
        config = self._configs.get(key)
        if config is None:
            config = self.make_config(grid, block, shared_mem)
            if len(self._configs) < 256:
                self._configs[key] = config
        self._last = (grid, block, shared_mem, config)
        return config

    def make_config(self, grid, block, shared_mem):
        """Validate grid, block and shared memory; return what enqueue needs of them."""
        return (check_dims(grid, "grid"), None if block is None else check_dims(block, "block"),
                check_shared_mem(shared_mem))

    def pack(self, args, uses, config, stream):  # pragma: no cover - overridden
        raise NotImplementedError

    def enqueue(self, stream, config, payload):  # pragma: no cover - overridden
        raise NotImplementedError


class KernelAdapter:
    """How one kind of kernel is launched. Interop modules register these.

    ``plan(kernel, device)`` returns a :class:`KernelPlan` (made once per kernel and device).
    Adapters written against the older interface instead implement ``prepare(kernel, grid,
    block, args, shared_mem, stream)`` -- validate and pack without side effects, return
    ``(enqueue, keep)``, ``keep`` a tuple or list of what the work keeps alive -- which the
    default ``plan`` calls on every launch.

    ``coerce(obj, device)`` may turn a foreign array (a CuPy array...) into a
    lease -- a :class:`LaunchArg` with ``view`` None, ``value`` (what the plan packs),
    ``token`` (a lease token, never a live view; it must not keep ``value`` alive -- the
    launch does) and ``offset`` (of element 0 in the token's allocation); ``resolve_args``
    fills in the rest -- or into a :class:`ForeignArray` prepared once per array, if this
    adapter's plans pack those -- or into a sharedmem view made for this launch only, or
    return None: the argument is then passed as a scalar.
    """

    name = "kernel"
    device_kinds: tuple = ()
    #: Private to sharedmem's own compiled adapters: the address of a C function that does
    #: exactly what this instance's ``coerce`` does (``coerce_fn_t`` in launch.pxd), which the
    #: compiled ``resolve_args`` calls without a Python call; 0: ``coerce`` is called. Set on
    #: the registered instance, never on the class (a subclass may override ``coerce``).
    _coerce_addr = 0

    def coerce(self, obj, device):
        """A lease for a foreign array argument this adapter understands, or None."""
        return None

    def label(self, kernel) -> str:
        """How the kernel is named in messages."""
        return f"{self.name} {getattr(kernel, '__name__', '')}".strip()

    def plan(self, kernel, device):
        """The :class:`KernelPlan` of ``kernel`` on ``device`` (default: one that calls
        ``prepare`` on every launch)."""
        return _PreparedPlan(kernel, self, device)

    def prepare(self, kernel, grid, block, args, shared_mem, stream):  # pragma: no cover
        """Validate and pack, with no side effects; return ``(enqueue, keep)``: ``enqueue()``
        enqueues the work and returns its completion marker, ``keep`` is a tuple or list of
        what the work keeps alive until it is done."""
        raise NotImplementedError


class _PreparedPlan(KernelPlan):
    """The plan of an adapter that implements ``prepare`` (the interface before plans)."""

    __slots__ = ()

    def make_config(self, grid, block, shared_mem):
        return (grid, block, check_shared_mem(shared_mem))

    def pack(self, args, uses, config, stream):
        got = self.adapter.prepare(self.kernel, config[0], config[1], array_args(args, uses),
                                   config[2], stream)
        if (type(got) is not tuple and type(got) is not list) or len(got) != 2 or \
                not callable(got[0]) or not isinstance(got[1], (tuple, list)):
            raise KernelError(f"the {self.adapter.name} adapter's prepare() returned "
                              f"{_shown(got)}; it must return (enqueue, keep): a callable that "
                              f"enqueues the work and returns its completion marker, and what "
                              f"the work keeps")
        return got

    def enqueue(self, stream, config, payload):
        return payload[0]()


# -- the registry -----------------------------------------------------------------------
_adapters = {}  # type -> KernelAdapter; written under _reg_lock, read lock-free
# "module.QualName" -> KernelAdapter: lets interop modules register a library's kernel
# type without importing that library. Written under _reg_lock.
_adapters_by_name = {}
# (clearing the plan caches under it may run kernels' finalizers, which may launch)
_reg_lock = fork_safe(OwnedLock("the kernel adapter registry"))
# Modules that register adapters, imported on first sight of a kernel whose type lives in the
# keyed package: adapters register by name, and sharedmem never imports interop at module level.
_LAZY = {"cupy": "interop.cupy", "cuda": "interop.cutile"}
# kernel -> the KernelPlan of its last launch (one device); lock-free: a racing writer stores an
# equivalent plan. Bounded: each plan keeps its kernel alive.
_plans = {}
# (id(kernel), device key) -> (kernel, plan) for kernels launched on several devices, and
# for unhashable kernels (by identity: not in _plans)
_plans_by_device = {}
_PLANS_MAX = 1024
# (adapter, its coerce method, its _coerce_addr) of the last launch with a foreign array
# argument: the next one with that adapter finds them without an attribute lookup. Identity,
# not hashing (adapters need not be hashable). Replaced whole: lock-free. Cleared with the plans.
_last_coerce = cython.declare(list, [None])


def register_kernel_adapter(kernel_type: type | str, adapter: KernelAdapter) -> None:
    """Make ``launch`` accept kernels of ``kernel_type`` (a type, or its
    ``"module.QualName"`` so the library need not be imported) through ``adapter``."""
    if not isinstance(adapter, KernelAdapter):
        raise TypeError(f"register_kernel_adapter takes a sharedmem.KernelAdapter (an instance "
                        f"of a subclass), got {type(adapter).__name__}")
    with _reg_lock:
        if isinstance(kernel_type, str):
            _adapters_by_name[kernel_type] = adapter
        else:
            _adapters[kernel_type] = adapter
        _plans.clear()
        _plans_by_device.clear()
        _last_coerce[0] = None


def adapter_for(kernel):
    """The KernelAdapter registered for ``kernel``'s type (or a base type); KernelError if
    none is."""
    t = type(kernel)
    a = _adapters.get(t)
    if a is not None:
        return a
    for attempt in (0, 1):
        for base in t.__mro__:
            a = _adapters.get(base)
            if a is None:
                a = _adapters_by_name.get(f"{base.__module__}.{base.__qualname__}")
            if a is not None:
                with _reg_lock:
                    _adapters[t] = a  # cached by type for the next launch
                return a
        mod = _LAZY.get((t.__module__ or "").split(".")[0])
        if attempt or mod is None:
            break
        importlib.import_module(mod)
    known = ", ".join(sorted({ad.name for ad in _adapters.values()})) or "none"
    raise KernelError(
        f"launch() does not know how to launch a {t.__module__}.{t.__qualname__}; it takes "
        f"{known} (CuPy RawKernels and cuTile kernels register themselves when their "
        f"library is installed). Wrap host Python functions with @sharedmem.host_kernel.")


def plan_for(adapter, kernel, device):
    """The cached KernelPlan of ``kernel`` on ``device`` (made by ``adapter.plan`` once). A
    host kernel keeps its own (it dies with the kernel, and what the kernel's function
    closes over with it); other kernels' plans are cached here, at most _PLANS_MAX."""
    if type(kernel) is _HOST_KERNEL:
        plan = kernel._plan
        # (its adapter too: one registered since drops the plans, as the cache's are dropped)
        if plan is None or plan.device is not device or plan.adapter is not adapter:
            check_device_kind(adapter, device)
            plan = kernel._plan = new_plan(adapter, kernel, device)
        return plan
    plans = _plans
    try:
        plan = plans.get(kernel)
    except TypeError:  # an unhashable kernel object: found by identity only, below
        plan = plans = None
    if plan is not None and plan.device is device:
        return plan
    key = (id(kernel), device.key)
    hit = _plans_by_device.get(key)
    if hit is not None and hit[0] is kernel:
        plan = hit[1]
    else:
        check_device_kind(adapter, device)
        plan = new_plan(adapter, kernel, device)
        if len(_plans_by_device) >= _PLANS_MAX:
            _plans_by_device.clear()
        _plans_by_device[key] = (kernel, plan)
    if plans is not None:
        if len(plans) >= _PLANS_MAX:
            plans.clear()
        plans[kernel] = plan
    return plan


def new_plan(adapter, kernel, device):
    """``adapter.plan(kernel, device)``, checked to be a KernelPlan made for ``device`` (once
    per kernel and device: a launch reads its fields unchecked)."""
    plan = adapter.plan(kernel, device)
    if not isinstance(plan, KernelPlan) or getattr(plan, "device", None) is not device:
        got = (f"a {type(plan).__name__} for {getattr(plan, 'device', None)}"
               if isinstance(plan, KernelPlan) else _shown(plan))
        raise KernelError(f"the {adapter.name} adapter's plan() returned {got}, not a "
                          f"sharedmem.launch.KernelPlan for {device} (one whose __init__ ran "
                          f"KernelPlan.__init__(self, kernel, adapter, device)); fix the adapter")
    return plan


def check_device_kind(adapter, device) -> None:
    """DeviceMismatchError unless ``adapter``'s kernels run on ``device``'s kind (what a
    launch checks before its plan is made; a composite op before its first part)."""
    kinds = adapter.device_kinds
    if device.kind not in kinds:
        raise DeviceMismatchError(
            f"a {adapter.name} cannot run on {device}; " +
            (f"it runs on {' or '.join(kinds)} devices" if kinds else
             "its adapter declares no device kinds (set its device_kinds, e.g. ('host',))"))


# -- validation helpers ------------------------------------------------------------------
def _plain_dims(value) -> bool:
    """Whether grid or block ``value`` is None, an int or a tuple of ints (exactly those
    types: a key of ``KernelPlan._configs`` compares equal only to the same dims)."""
    if value is None or type(value) is int:
        return True
    if type(value) is not tuple:
        return False
    for d in value:
        if type(d) is not int:
            return False
    return True


def check_dims(value, what, limits=None):
    """``value`` as a tuple of 1 to 3 positive ints, each within ``limits`` (a 3-tuple of
    maxima, when given); KernelError naming ``what`` otherwise."""
    dims = (value,) if type(value) is int or isinstance(value, np.integer) else value
    ok = type(dims) is tuple and 1 <= len(dims) <= 3
    if ok:
        dims = tuple([int(d) if isinstance(d, np.integer) else d for d in dims])
        for d in dims:
            if type(d) is not int or d < 1:
                ok = False
                break
    if not ok:
        raise KernelError(f"{what} must be a positive int or a tuple of 1 to 3 positive ints, "
                          f"got {value!r}")
    if limits is not None:
        for i, d in enumerate(dims):
            if d > limits[i]:
                raise KernelError(f"{what} {value!r}: dimension {'xyz'[i]} is {d}, above this "
                                  f"device's limit of {limits[i]}")
    return dims


def check_shared_mem(shared_mem, limit=None) -> int:
    """``shared_mem`` as a validated int (bytes of dynamic shared memory)."""
    if isinstance(shared_mem, np.integer):
        shared_mem = int(shared_mem)
    if type(shared_mem) is not int or shared_mem < 0:
        raise KernelError(f"shared_mem must be an int >= 0, got {shared_mem!r}")
    if limit is not None and shared_mem > limit:
        raise KernelError(f"shared_mem={shared_mem} bytes is above this device's limit of "
                          f"{limit} bytes of dynamic shared memory per block")
    return shared_mem


# -- resolution ----------------------------------------------------------------------------


# (C globals where compiled: no dict lookups. _BOX and _NP_SCALAR: types, tested compiled with
# PyObject_TypeCheck -- a walk of the object's type's MRO -- where a foreign array is the common
# object: isinstance() also looks up obj.__class__ once the type says no, an attribute lookup
# through the instance that cost some 250 instructions a test)
_BOX = cython.declare(type, DeviceBox)
# the view types themselves: tested by identity before isinstance (a walk of the type's MRO)
_BUFFER = cython.declare(object, Buffer)
_TENSOR = cython.declare(object, Tensor)
_NP_SCALAR = cython.declare(type, np.generic)  # (np.int32(3), np.float32(1.5)...: never arrays)
# NumPy's scalar types themselves: interpreted, a NumPy scalar argument (np.int32(n), the usual
# way to pass a kernel's int) is known by one set lookup of its type, not after three isinstance
# and issubclass calls (a subclass of one takes the general tests below)
_NP_SCALARS = frozenset(t for t in np.sctypeDict.values() if issubclass(t, np.generic))


def _described(obj) -> str:
    """``obj``'s type for a message -- named by its library where it is not sharedmem's or
    Python's (``torch.Tensor``, not ``Tensor``) --, with the device it names (a torch tensor
    or NumPy array on the CPU) and its dtype where it has them (an array of Python objects,
    which no adapter leases: its elements are references, not data)."""
    t = type(obj)
    top = t.__module__.partition(".")[0]
    text = t.__name__ if top in ("builtins", "sharedmem") else f"{top}.{t.__name__}"
    try:  # (an arbitrary object's attributes, and their str: whatever raises, the type alone)
        dev = getattr(obj, "device", None)
        dt = getattr(obj, "dtype", None)
        dev = None if dev is None or callable(dev) else str(dev)
        on = "" if dev is None or len(dev) > 40 else f" on {dev}"
        return text + on if dt is None else f"{text}{on} (dtype {dt})"
    except Exception:
        return text


def _unreachable(adapter, obj) -> str:
    """The end of the message of an array argument ``adapter``'s kernels cannot take: where
    they run on the host only and ``obj`` is device memory (a JAX or torch CUDA array), what
    to do; else nothing."""
    if tuple(adapter.device_kinds) != ("host",):
        return ""
    try:
        where = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else None
    except Exception:
        where = None
    if where is None and not hasattr(obj, "__cuda_array_interface__"):
        return ""
    if where is not None and int(where) in _DL_HOST:
        return ""
    return ("; it is in device memory, which a host kernel cannot reach: pass a host copy "
            "(np.asarray(...), .cpu(), jax.device_get(...))")


def _shown(value) -> str:
    """What an adapter returned, for a message: None, or the type of the value."""
    return "None" if value is None else f"a value of type {type(value).__name__}"


def _as_view(obj):
    """The view ``obj`` stands for (itself, or a DeviceBox's buffer), or None."""
    if isinstance(obj, View):
        return obj
    if isinstance(obj, _BOX):
        return obj.buffer
    return None


def _coerce_addr_of(adapter):
    """``adapter``'s ``_coerce_addr`` where the compiled core may call it: an int set on the
    instance itself (see KernelAdapter), else 0."""
    if not cython.compiled:
        return 0
    addr = getattr(adapter, "__dict__", {}).get("_coerce_addr", 0)
    return addr if type(addr) is int and addr > 0 else 0


def _mismatch(i, shown, adev, device) -> DeviceMismatchError:
    """The error of argument ``i`` (``shown``), on ``adev``, in a launch on ``device``. Peer
    access is advised only between two CUDA devices: for any other pair (the host and a GPU)
    ``enable_peer_access`` raises PeerAccessError."""
    peer = (f", or let {device} use {adev}'s memory: {device!r}.enable_peer_access({adev!r})"
            if getattr(device, "kind", None) == "cuda" and getattr(adev, "kind", None) == "cuda"
            else "")
    return DeviceMismatchError(f"argument {i} ({shown!r}) is on {adev}, but the launch runs on "
                               f"{device}; copy it there first (view.to_device(...)){peer}")


def _read_only(i, intent, shown) -> KernelError:
    """The error of argument ``i`` (``shown``), read-only, passed to be written (``intent``:
    its Intent, or None for a bare argument)."""
    written = InOut if intent is None else type(intent)
    return KernelError(f"argument {i}: {written.__name__}({shown!r}) would write through a "
                       f"read-only view; pass it as In(...) or copy it first")


@cython.boundscheck(False)  # (every index below its list's length by construction)
@cython.wraparound(False)
def resolve_args(adapter, args, device):
    """Resolve launch arguments; returns ``(resolved, uses, device, foreign)``. Raises before
    anything is leased. ``uses``: the ``(token, writes)`` lease of each array argument, in
    order. ``resolved``: the arguments, each array argument as its view (the common case), as
    the :class:`ForeignArray` an adapter prepared for a foreign array, or as a
    :class:`LaunchArg` (a foreign array leased without a view, or ``with_length``); a plan
    walks it with ``uses`` beside it (see :func:`array_args`). ``foreign``: None, or a list
    whose first entry is free (the launch puts its own ``keep`` there) followed by the foreign
    arrays leased -- their lease tokens do not keep them; the work must. Views an adapter
    makes of foreign arrays are referenced by ``resolved`` (keep it until the leases are
    taken)."""
    resolved = list(args)  # (scalars stay as they are; an array argument's entry replaced)
    uses = []
    foreign = None
    coerce = None
    caddr = 0  # (compiled: the adapter's coerce as a C function, see KernelAdapter)
    for i, a in enumerate(args):
        if isinstance(a, Intent):
            ia = cython.cast(Intent, a) if cython.compiled else a  # (checked: no 2nd test)
            obj = ia.obj
            mode = ia._mode
            with_length = ia.with_length
            t = type(obj)
        else:  # a bare argument: InOut (ia None: what the checks of foreign arguments ask)
            t = type(a)
            if t is int or t is float or t is bool or a is None:
                continue  # a scalar: passed as it is
            if not cython.compiled and t in _NP_SCALARS:  # (compiled: the type test below)
                continue
            obj = a
            mode = _WRITE
            with_length = False
            ia = None
        if t is _BUFFER or t is _TENSOR or isinstance(obj, View):
            view = cython.cast(View, obj) if cython.compiled else obj
        elif t is _BOX or (PyObject_TypeCheck(obj, _BOX) if cython.compiled else
                           issubclass(t, _BOX)):  # (by the type alone in both builds)
            view = obj.buffer  # (a subclass of DeviceBox too: leased, never passed as a scalar)
        else:
            view = None
        if view is not None:  # the common case: few field reads, no call
            tok = view._token  # (None once moved or released: read once, then checked)
            if tok is None:
                view._raise_dead()
            adev = tok.allocation.device
            if adev is not device:
                if device is None:
                    device = adev
                elif adev not in device._peers:
                    raise _mismatch(i, view, adev, device)
            if mode == _READ:
                u = tok.use_r  # (tok.use() inlined)
            elif tok.writable:
                u = tok.use_w
            else:
                raise _read_only(i, ia, view)
            if u is None:
                u = tok.use(mode != _READ)
            if not with_length:
                resolved[i] = view  # the view itself stands for the argument
                uses.append(u)
                continue
            la = LaunchArg.__new__(LaunchArg)
            la.view = view
            la.value = view
            la.token = tok
            la.offset = view._offset
        else:
            if ia is None and (PyObject_TypeCheck(obj, _NP_SCALAR) if cython.compiled else
                               issubclass(t, _NP_SCALAR)):  # a NumPy scalar: passed as is
                continue
            if coerce is None:
                hit = _last_coerce[0]
                if hit is not None and hit[0] is adapter:
                    coerce = hit[1]
                    caddr = hit[2]
                else:  # (an attribute lookup through the adapter's class: once per adapter)
                    coerce = adapter.coerce
                    caddr = _coerce_addr_of(adapter)
                    _last_coerce[0] = (adapter, coerce, caddr)
            if cython.compiled and caddr:  # (its C function: no bound method called, no
                # arguments parsed -- a few hundred instructions a foreign array)
                got = cython.cast(coerce_fn_t, cython.cast(cython.p_void, caddr))(obj, device)
            else:
                got = coerce(obj, device)
            if got is None and _BOX.__instancecheck__(obj):  # (rare: its __class__ says
                got = obj.buffer  # DeviceBox, its type not -- a proxy, Mock(spec=DeviceBox):
                # leased as one, in both builds; isinstance() would be compiled by the type)
            if got is None:
                if isinstance(obj, (ForeignArray, LaunchArg)):  # (made by and for a launch)
                    raise KernelError(f"argument {i}: a {type(obj).__name__} is what a launch "
                                      f"makes of an array argument; pass the array itself")
                if ia is not None:
                    raise KernelError(f"argument {i}: {type(ia).__name__}() takes a Buffer, "
                                      f"Tensor, DeviceBox or array, got {_described(obj)}"
                                      f"{_unreachable(adapter, obj)}")
                continue
            if isinstance(got, ForeignArray):  # prepared once for this array: not written
                fa = got
                la = None
                tok = fa.token
                value = obj
            elif type(got) is LaunchArg:  # a foreign array leased without a view
                la = got
                fa = None
                tok = la.token
                value = la.value
            elif isinstance(got, View):  # a view made for this launch
                view = cython.cast(View, got) if cython.compiled else got  # (checked: no 2nd test)
                la = None
                fa = None
                tok = view._token
                value = view
                if tok is None:  # (released already)
                    view._raise_dead()
            else:
                raise KernelError(f"argument {i}: the {adapter.name} adapter's coerce() "
                                  f"returned {_shown(got)} for a {_described(obj)}; it must "
                                  f"return a LaunchArg, a ForeignArray, a sharedmem view or None")
            if tok is None:  # (compiled, read through: checked, as a view's is)
                raise KernelError(f"argument {i}: the {type(got).__name__} the adapter made of "
                                  f"{_described(obj)} has no lease token (its coerce must set "
                                  f"token)")
            adev = tok.allocation.device
            if adev is not device:
                if device is None:
                    device = adev
                elif adev not in device._peers:
                    raise _mismatch(i, view if view is not None else obj, adev, device)
            if mode != _READ and not tok.writable:
                raise _read_only(i, ia, view if view is not None else obj)
            if la is not None:  # (a token made for this launch: its pair not cached on it --
                u = (tok, mode != _READ)  # a cycle that kept it, and its allocation
                # registered over memory its owner may reuse, alive until a collection)
            elif fa is not None:
                # (its pairs cached on it, not on its token: a lease token is never released,
                # and a pair on it made the cycle above -- every array new to a launch kept
                # until a collection, and the collections that many objects set off)
                if cython.compiled:
                    u = fa.use_r if mode == _READ else fa.use_w
                else:  # (unset where a subclass's __init__ did not run ForeignArray's: None,
                    try:  # as the compiled fields start)
                        u = fa.use_r if mode == _READ else fa.use_w
                    except AttributeError:
                        u = None
                if u is None or u[0] is not tok:  # (not the token now: one its adapter re-set)
                    u = (tok, mode != _READ)
                    if mode == _READ:
                        fa.use_r = u
                    else:
                        fa.use_w = u
            else:  # (a view made for this launch: its release lets its pairs go)
                u = tok.use_r if mode == _READ else tok.use_w
                if u is None:
                    u = tok.use(mode != _READ)
            if view is not None and not with_length:  # (a view made for this launch)
                resolved[i] = view
                uses.append(u)
                continue
            if view is None:  # a foreign array: the work keeps it (its lease token does not)
                if foreign is None:
                    foreign = [None, value]
                else:
                    foreign.append(value)
                if fa is not None and fa.keep is not None:
                    foreign.append(fa.keep(obj))
                if fa is not None and not with_length:
                    resolved[i] = fa
                    uses.append(u)
                    continue
            if la is None:  # a view with_length, or a prepared foreign array (fa) with_length
                la = LaunchArg.__new__(LaunchArg)
                la.view = view
                la.value = value
                la.token = tok
                la.offset = view._offset if fa is None else fa.offset
        la._mode = mode
        la.intent = InOut if ia is None else type(ia)
        la.with_length = with_length
        resolved[i] = la
        uses.append(u)
    return resolved, uses, device, foreign


def array_args(resolved, uses):
    """The array arguments of a resolved launch as :class:`LaunchArg` objects (for plans and
    adapters that want them whole; the launch path itself avoids making them)."""
    out = []
    j = 0
    for a in resolved:
        if isinstance(a, View):
            tok, writes = uses[j]
            a = LaunchArg(a, a, tok, _WRITE if writes else _READ, None, False, a._offset)
        elif isinstance(a, ForeignArray):  # (its array: alive, the launch holds it)
            tok, writes = uses[j]
            a = LaunchArg(None, a.ref(), tok, _WRITE if writes else _READ, None, False, a.offset)
        elif type(a) is not LaunchArg:
            out.append(a)
            continue
        out.append(a)
        j += 1
    return out


def launch(kernel: object, grid: int | tuple[int, ...], block: int | tuple[int, ...] | None,
           *args: object, stream: Stream | object | None = None, shared_mem: int = 0,
           policy: Literal["order", "reject"] | None = None) -> DeviceFuture[None]:
    """Launch ``kernel`` on ``stream`` with leases on every array argument.

    ``grid`` and ``block``: an int or a tuple of up to three ints (``block``
    may be None for cuTile). ``stream``: a :class:`Stream`, a foreign stream,
    or None for the current stream (``with stream:``), else the default stream of the
    arguments' device. ``policy``: ``"order"`` or ``"reject"``, overriding
    :func:`set_access_policy`.

    Returns a :class:`DeviceFuture`. The arguments' memory stays valid until
    the device has finished, whatever the caller drops meanwhile.
    """
    return future_of(launch_submission(kernel, grid, block, args, stream, shared_mem, policy))


def default_device_for(adapter):
    """The device a launch with no array arguments and no stream runs on: the default device,
    or the host where only the host runs this kind of kernel (a host kernel on a GPU machine)."""
    device = default_device()
    if device.kind not in adapter.device_kinds and "host" in adapter.device_kinds:
        device = Device.host()
    return device


def entered_stream(device, adapter):
    """The innermost stream entered with ``with stream:`` on ``device`` -- with no device (no
    array arguments), the innermost on a device ``adapter``'s kernels run on, else the one on
    :func:`default_device_for` -- or None."""
    stream = current_stream(device)
    if stream is not None and device is None and stream.device.kind not in adapter.device_kinds:
        stream = current_stream(default_device_for(adapter))
    return stream


def launch_submission(kernel, grid, block, args, stream, shared_mem, policy, submit=True):
    """:func:`launch` up to its Submission (ops submit through here too). ``submit`` False:
    everything but the submission -- arguments resolved, plan found, configured and packed,
    nothing leased -- returned for :func:`submit_planned` (a composite op plans every part
    before it submits the first)."""
    adapters = _adapters  # (a typed local: a C dict lookup)
    adapter = adapters.get(type(kernel))
    if adapter is None:
        adapter = adapter_for(kernel)
    if policy is not None:
        check_policy(policy)
    device = None
    dflt = None  # (a default stream that names no device: borrowed below, once it is known)
    if stream is not None:
        if type(stream) is not Stream:
            st = as_stream_or_default(stream)
            if st is None:
                dflt = stream
            stream = st
        if stream is not None:
            st = stream
            device = st.device
    resolved, uses, device, foreign = resolve_args(adapter, args, device)
    if dflt is not None:
        # a default stream that names no device (0, 1, 2, CuPy's null stream): the one of the
        # arguments' device -- not the default device's, which would run the kernel elsewhere
        stream = Stream._borrow(dflt, device if device is not None else
                                default_device_for(adapter))
        device = stream.device
    elif stream is None and streams_entered():
        stream = entered_stream(device, adapter)
        if stream is not None:
            device = stream.device
    if device is None:  # no arrays and no stream: a device this kind of kernel runs on
        device = default_device_for(adapter)
    plan = plan_for(adapter, kernel, device)  # (made once, after checking the device's kind)
    if stream is None:
        stream = device.default_stream
    config = plan.configure(grid, block, shared_mem)
    payload = plan.pack(resolved, uses, config, stream)
    # the work keeps the plan (and so the kernel), each lease's `keep`, and the foreign arrays
    # leased (their lease tokens do not keep them)
    keep = plan if not isinstance(plan, _PreparedPlan) else [plan, *payload[1]]
    if foreign is not None:
        foreign[0] = keep
        keep = foreign
    # `resolved` stays referenced until the leases are taken: views an adapter made of
    # foreign arrays live only as long as it does
    if not submit:
        return (stream, uses, plan, config, payload, keep, policy, resolved)
    sub = submit_plan(stream, uses, plan, config, payload, keep, policy, plan.label)
    resolved = None
    return sub


def submit_planned(planned):
    """Submit a launch :func:`launch_submission` planned (``submit=False``); its Submission."""
    stream, uses, plan, config, payload, keep, policy, resolved = planned
    # the argument views: checked still live as the submission takes its leases (another
    # thread may have moved one since it was planned -- a move keeps its token live)
    views = []
    for r in resolved:
        if isinstance(r, View):
            views.append(r)
        elif isinstance(r, LaunchArg) and r.view is not None:
            views.append(r.view)
    sub = submit_plan_checked(stream, uses, plan, config, payload, keep, policy, plan.label,
                              views)
    resolved = None  # (referenced until the leases are taken: see launch_submission)
    return sub


# -- host kernels ---------------------------------------------------------------------
class HostKernel(Generic[_P, _R]):
    """A Python function launched by :func:`launch` on the host backend.

    It is called on the stream's worker thread with NumPy views of the array
    arguments -- writable for Out / InOut / Atomic, read-only for In --, the
    NumPy arrays, torch CPU tensors and other DLPack CPU arrays (JAX) passed
    as themselves (leased as views are: see :func:`foreign_host_lease`; a
    NumPy array read-only for In), and the scalars as given. ``grid`` and
    ``block`` are validated, not passed. Calling the HostKernel directly calls
    the function.
    """

    __slots__ = ("fn", "__name__", "__qualname__", "__wrapped__", "_plan")

    def __init__(self, fn: Callable[_P, _R]) -> None:
        if not callable(fn):
            raise TypeError(f"host_kernel needs a callable, got {fn!r}")
        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or \
                inspect.isasyncgenfunction(fn):
            # (its call only makes a coroutine or generator, which nothing would run: the
            # launch would succeed with the kernel's body never run)
            raise TypeError(f"host_kernel needs a plain function, got {fn!r}: calling it "
                            f"only makes a coroutine or generator, so the kernel's body would "
                            f"never run; define it with `def` (not `async def`), without `yield`")
        self._plan = None  # (its KernelPlan, made at its first launch: see plan_for)
        self.fn = fn
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "host_kernel")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<host_kernel {self.__qualname__}>"


_HOST_KERNEL = cython.declare(object, HostKernel)  # (a C global where compiled: no dict lookup)


def numpy_lease(arr):
    """A NumPy array as a host-kernel argument: a lease of the bytes it spans (the host
    device's memory is host RAM), without a view -- the launch keeps the array alive until
    its work is done, and conflicting work on other streams is ordered as for any view."""
    lo, hi = extent(arr.shape, arr.strides, arr.itemsize)
    nbytes = hi - lo
    ptr = arr.ctypes.data
    alloc = import_allocation(Device.host(), ptr + lo, nbytes, "numpy", region=numpy_region(arr))
    start = ptr + lo - alloc.ptr
    return _host_lease(arr, alloc, "NumPy array argument", start, start + nbytes,
                       bool(arr.flags.writeable), ptr - alloc.ptr)


def _host_lease(value, alloc, label, start, stop, writable, offset):
    """The LaunchArg of a host-kernel argument leased without a view: a token over bytes
    ``[start, stop)`` of ``alloc`` that is a lease's range, never a live view (not in the
    allocation's views); its mode is set by resolve_args."""
    tok = ViewToken(alloc, label, start, stop, writable, alloc)
    tok.live = True
    return LaunchArg(None, value, tok, _WRITE, None, False, offset)


# sys.modules (a C global where compiled): torch is looked up there, never imported
_modules = cython.declare(dict, sys.modules)
_NDARRAY = cython.declare(object, np.ndarray)
# DLPack device types of host memory (kDLCPU, kDLCUDAHost): what a host kernel can reach
_DL_HOST = (1, 3)


def foreign_host_lease(obj):
    """A host-kernel argument that is neither a view nor a NumPy array, leased where it is an
    array in host memory -- as :func:`numpy_lease` leases a NumPy array -- else None (passed
    as it is). A torch CPU tensor: :func:`torch_lease` (read from the tensor, no DLPack
    export). Any other DLPack producer on the CPU (a JAX array...): imported for the launch
    (``interop.dlpack.from_dlpack``, imported only then), its lease made of the import's
    range and writability -- read-only where the producer says so or is JAX (immutable) --,
    the import itself dropped at once. The kernel gets ``obj`` itself either way; the launch
    keeps it alive until its work is done."""
    if is_torch_tensor(obj):
        return torch_lease(obj, _modules["torch"])
    where = getattr(obj, "__dlpack_device__", None)
    if where is None or isinstance(obj, type) or not hasattr(obj, "__dlpack__"):
        return None
    try:  # (a producer that cannot say its device: passed as it is, as before DLPack)
        dev = where()
        on_host = int(dev[0]) in _DL_HOST
    except Exception:
        return None
    if not on_host:
        return None  # (a CUDA array: no host kernel reaches it)
    try:
        t = _module("interop.dlpack").from_dlpack(obj)
    except Exception as e:
        raise KernelError(f"a {_described(obj)} passed to a host kernel is leased through "
                          f"DLPack, whose import failed: {e}; pass np.asarray(...) of it (a "
                          f"NumPy array, leased as itself) or a sharedmem view of its values "
                          f"instead") from e
    tok = t._token
    alloc = tok.allocation
    arg = _host_lease(obj, alloc, f"{type(obj).__name__} argument", tok.start, tok.stop,
                      tok.writable, t._offset)
    t.release()  # (the producer, which the launch keeps, keeps its memory)
    return arg


def torch_lease(t, torch):
    """A torch tensor (``torch``: its module) as a host-kernel argument: a lease of the bytes
    it spans, filed under its storage (a view and its base are ranges of one allocation, in
    any order; memory sharedmem owns -- ``torch.from_dlpack`` of a host view -- is found as
    that allocation, writable only where a writable view reaches it), or None for a tensor
    not in host memory (CUDA, meta), not strided (sparse) or nested: passed as it is. The
    kernel gets the tensor itself, whose operations respect torch's lazy conjugate and
    negative bits, so those are not refused (as they are for CUDA kernels, which get
    pointers: interop.cupy_launch)."""
    if t.device.type != "cpu" or t.layout is not torch.strided or getattr(t, "is_nested", False):
        return None  # (a nested tensor is strided, but has no one shape or strides to read)
    ptr = t.data_ptr()
    item = t.element_size()
    lo, hi = extent(tuple(t.shape), [st * item for st in t.stride()], item)
    nbytes = hi - lo if ptr else 0  # (a zero tensor: no memory, a NULL data pointer)
    region = torch_storage_region(t, ptr + lo, nbytes) if nbytes else None
    alloc = import_allocation(Device.host(), ptr + lo, nbytes, "torch", region=region)
    start = ptr + lo - alloc.ptr
    writable = import_writable(alloc, start, start + nbytes, True)  # (torch: no read-only ones)
    return _host_lease(t, alloc, "torch tensor argument", start, start + nbytes, writable,
                       ptr - alloc.ptr)


def host_kernel(fn: Callable[_P, _R]) -> HostKernel[_P, _R]:
    """Decorator: make ``fn`` launchable with :func:`launch` on the host device."""
    return HostKernel(fn)


def host_arity(fn):
    """How many positional arguments ``fn`` takes: ``(least, most)`` (most -1: any number),
    a message where no call of launch() can fit it (a keyword-only parameter without a
    default), or None where it has no signature to read (the call itself then says)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    least = most = 0
    rest = False
    for p in sig.parameters.values():
        if p.kind is p.POSITIONAL_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD:
            most += 1
            if p.default is p.empty:
                least = most
        elif p.kind is p.VAR_POSITIONAL:
            rest = True
        elif p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            return (f"has keyword-only parameter {p.name!r} without a default, which launch() "
                    f"cannot pass")
    return (least, -1 if rest else most)


class _HostPlan(KernelPlan):
    __slots__ = ("arity",)

    def __init__(self, kernel, adapter, device):
        super().__init__(kernel, adapter, device)
        self.arity = host_arity(kernel.fn)  # (checked per launch: before any lease)

    def misfit(self, n) -> KernelError:
        """The error of a launch passing ``n`` arguments its function cannot take."""
        arity = self.arity
        if type(arity) is str:
            says = arity
        else:
            least, most = arity
            says = (f"takes at least {least} argument{'s' if least != 1 else ''}" if most < 0
                    else f"takes {most} argument{'s' if most != 1 else ''}" if least == most
                    else f"takes {least} to {most} arguments") + f", got {n}"
        return KernelError(f"{self.adapter.label(self.kernel)}: it {says}; launch() passes the "
                           f"arguments after block to the function, in order")

    def pack(self, args, uses, config, stream):
        arity = self.arity
        if arity is not None:
            n = len(args)
            if type(arity) is str or n < arity[0] or n > arity[1] >= 0:
                raise self.misfit(n)
        ndarray_of = _module("sharedmem.backends.host").ndarray_of
        out = []
        captured = None  # (torch tensors of a launch captured into a graph)
        j = 0
        for a in args:
            if isinstance(a, View):
                out.append(ndarray_of(a, uses[j][1]))
                j += 1
            elif type(a) is LaunchArg:
                if a.view is not None:
                    out.append(ndarray_of(a.view, a.writes))
                elif a.writes or not isinstance(a.value, _NDARRAY):  # (see _HostAdapter.coerce)
                    out.append(a.value)  # (a torch tensor, a JAX array...: itself, always)
                    if stream._capture is not None and is_torch_tensor(a.value):
                        if captured is None:
                            captured = []
                        captured.append(a.value)
                else:
                    ro = a.value.view()
                    ro.flags.writeable = False
                    out.append(ro)
                j += 1
            else:
                if isinstance(a, _CONTAINERS):  # (subclasses too: a namedtuple)
                    _no_views_inside(len(out), a)
                out.append(a)
        if captured is not None:
            _check_torch_at_replays(self, captured, uses, stream)
        return out

    def enqueue(self, stream, config, payload):
        return stream._impl.submit(partial(self.kernel.fn, *payload), True)


_CONTAINERS = (list, tuple, dict, set, frozenset)


def _check_torch_at_replays(plan, tensors, uses, stream) -> None:
    """A host launch of torch ``tensors`` captured into a graph: every replay runs the kernel
    on each tensor itself, so on the memory it has then, but leases the bytes it had at the
    capture. Each replay first checks that each still has them (not ``resize_``-d into new
    memory, ``set_`` to another storage, ``t.data = ...``), else it is refused (see
    :class:`_TorchReplayCheck`)."""
    label = plan.adapter.label(plan.kernel)
    facts = [(t, t.data_ptr(), tuple(t.shape), tuple(t.stride()), label) for t in tensors]
    with locked():
        g = stream._capture
        if g is not None:  # (once recorded: not a launch refused or failed after its pack)
            g.after_recorded_locked(uses, partial(_add_torch_check, facts))


def _add_torch_check(facts, g) -> None:
    """A captured host launch's part of graph ``g``'s :class:`_TorchReplayCheck`."""
    g.before_replays(_TorchReplayCheck, _TorchReplayCheck).tensors.extend(facts)


class _TorchReplayCheck:
    """A graph's replay step (``Graph.before_replays``): the torch tensors its host launches
    were given must still be the memory -- address, shape and strides -- they were at the
    capture, which is what each replay leases: a ``KernelError`` (nothing leased, nothing
    run) where one is not."""

    __slots__ = ("tensors",)

    def __init__(self):
        self.tensors = []

    def __call__(self, stream) -> None:
        for t, ptr, shape, strides, label in self.tensors:
            if t.data_ptr() != ptr or tuple(t.shape) != shape or tuple(t.stride()) != strides:
                raise KernelError(
                    f"a replay on {stream} of a graph that captured {label} of a torch tensor "
                    f"(shape {shape}, {t.dtype}): the tensor's memory changed since the capture "
                    f"(resize_, set_ or t.data = ...), and the replay would run the kernel on "
                    f"bytes the graph does not lease; capture the graph again")


def _no_views_inside(i, arg) -> None:
    """KernelError where host-kernel argument ``i``, a container, holds a sharedmem view, an
    Intent or a DeviceBox at any depth: a launch leases only the arrays passed as arguments
    themselves, and the function would read or write one inside unleased while other work
    uses it. Lists, tuples, dicts (keys and values) and sets -- their subclasses too, walked
    as the base type is (no user ``__iter__`` runs) -- are walked, without recursion (a cons
    list deeper than the recursion limit passes); other objects are passed as they are."""
    seen = set()  # (ids of containers inside ``arg``: alive throughout, so never reused)
    todo = [arg]
    while todo:
        seq = todo.pop()
        if id(seq) in seen:
            continue
        seen.add(id(seq))
        if isinstance(seq, dict):
            items = list(dict.keys(seq)) + list(dict.values(seq))
        elif isinstance(seq, (list, tuple)):
            items = list.__iter__(seq) if isinstance(seq, list) else tuple.__iter__(seq)
        else:
            items = set.__iter__(seq) if isinstance(seq, set) else frozenset.__iter__(seq)
        for x in items:
            t = type(x)
            if t is int or t is float or t is str or t is bool or x is None:
                continue  # (the common items, at no isinstance walk: a list is walked each launch)
            if isinstance(x, _CONTAINERS):
                todo.append(x)
            elif isinstance(x, (View, Intent, DeviceBox)):
                raise KernelError(f"argument {i}: a {t.__name__} inside a {type(arg).__name__}; "
                                  f"a launch leases only the arrays passed as arguments "
                                  f"themselves, so the kernel would use it unleased -- pass each "
                                  f"array as its own argument")


class _HostAdapter(KernelAdapter):
    name = "host kernel"
    device_kinds = ("host",)

    def coerce(self, obj, device):
        """NumPy arrays are leased as CuPy arrays are on CUDA (see :func:`numpy_lease`);
        torch CPU tensors and other DLPack producers on the CPU (JAX arrays) too (see
        :func:`foreign_host_lease`). The kernel gets each such argument itself."""
        if isinstance(obj, _NDARRAY):
            return numpy_lease(obj) if not obj.dtype.hasobject else None
        return foreign_host_lease(obj)

    def label(self, kernel) -> str:
        return f"host kernel {kernel.__qualname__}"

    def plan(self, kernel, device):
        return _HostPlan(kernel, self, device)


register_kernel_adapter(HostKernel, _HostAdapter())
