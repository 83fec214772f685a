"""The one launch API, argument intents, and the kernel-adapter registry.

``launch(kernel, grid, block, *args, stream=None, shared_mem=0, policy=None)``
launches any kernel an adapter is registered for -- host kernels
(:func:`host_kernel`), CuPy ``RawKernel`` / ``RawModule`` functions
(``interop.cupy``), cuTile kernels (``interop.cutile``) -- and returns a
:class:`~sharedmem.DeviceFuture`.

Arguments state intent: ``In(x)`` (read), ``Out(x)`` / ``InOut(x)`` (write),
``Atomic(x)`` (tracked as a write); a bare buffer or tensor is ``InOut``.
Anything that is not an array is passed through as a scalar. All validation
happens before any lease is taken, so a launch that fails takes none.
"""

from __future__ import annotations

import importlib
import threading

from . import access as _access
from ._accel import speedups as _speedups
from .access import ATOMIC, READ, WRITE
from .allocation import View
from .errors import DeviceMismatchError, KernelError
from .runtime.future import DeviceFuture
from .runtime.submission import submit
from .stream import Stream

__all__ = ["launch", "In", "Out", "InOut", "Atomic", "Intent", "host_kernel", "HostKernel",
           "register_kernel_adapter", "KernelAdapter", "LaunchArg"]


class _PyIntentBase:
    """An intent's storage: ``obj``, the wrapped argument (``_speedups.IntentBase``
    is the same in C, about twice as fast to construct)."""

    __slots__ = ("obj",)

    def __init__(self, *args, **kwargs):
        name = type(self).__name__
        if kwargs:
            raise TypeError(f"{name}() takes no keyword arguments")
        if len(args) != 1:
            raise TypeError(f"{name} expected 1 argument, got {len(args)}")
        obj = args[0]
        if isinstance(obj, _PyIntentBase):
            self._refuse_nested(obj)
        self.obj = obj


class Intent(_speedups.IntentBase if _speedups is not None else _PyIntentBase):
    """Wraps a launch argument to state how the kernel uses it (``.obj``: the argument)."""

    __slots__ = ()
    mode = WRITE

    @classmethod
    def _refuse_nested(cls, obj):
        raise KernelError(f"{cls.__name__}({obj!r}): an argument takes one intent")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.obj!r})"


class In(Intent):
    """The kernel only reads this argument (a read lease)."""
    __slots__ = ()
    mode = READ


class Out(Intent):
    """The kernel writes this argument (a write lease)."""
    __slots__ = ()
    mode = WRITE


class InOut(Intent):
    """The kernel reads and writes this argument (a write lease); the default."""
    __slots__ = ()
    mode = WRITE


class Atomic(Intent):
    """The kernel updates this argument with atomics (tracked as a write)."""
    __slots__ = ()
    mode = ATOMIC


class LaunchArg:
    """One array argument of a launch, resolved: the view, its token, its mode
    (``"read"``, ``"write"`` or ``"atomic"``) and the Intent class written."""

    __slots__ = ("view", "token", "mode", "intent")

    def __init__(self, view, token, mode, intent):
        self.view = view
        self.token = token
        self.mode = mode
        self.intent = intent

    @property
    def writes(self) -> bool:
        return self.mode != READ


class KernelAdapter:
    """How one kind of kernel is launched. Interop modules register these.

    ``coerce(obj)`` may turn a foreign array (a CuPy array...) into a sharedmem
    view for the duration of the launch, or return None. ``prepare`` validates
    and packs arguments without side effects and returns ``(enqueue, keep)``:
    ``enqueue()`` puts the kernel on the stream and returns its completion
    marker; ``keep`` is a tuple of objects the work needs alive.
    """

    name = "kernel"
    device_kinds: tuple = ()

    def coerce(self, obj, device):
        """A view for a foreign array argument this adapter understands (made for this launch
        only), or None: the argument is then passed as a scalar."""
        return None

    def label(self, kernel) -> str:
        """How the kernel is named in messages."""
        return f"{self.name} {getattr(kernel, '__name__', '')}".strip()

    def prepare(self, kernel, grid, block, args, shared_mem, stream):  # pragma: no cover
        """Validate and pack, with no side effects; return ``(enqueue, keep)``.
        ``enqueue()`` runs under the core lock, puts the work on ``stream`` and
        returns its completion marker; it may be called again while the views
        in ``args`` live (ops reuse it). ``keep``: what the work needs alive."""
        raise NotImplementedError


_adapters: dict = {}  # type -> KernelAdapter; written under _reg_lock, read lock-free
# "module.QualName" -> KernelAdapter: lets interop modules register a library's kernel
# type without importing that library. Written under _reg_lock.
_adapters_by_name: dict = {}
_reg_lock = threading.Lock()
# Modules that register adapters, imported on first sight of a kernel whose
# type lives in the keyed package.
_LAZY = {"cupy": "interop.cupy", "cuda": "interop.cutile"}


def register_kernel_adapter(kernel_type, adapter: KernelAdapter) -> None:
    """Make ``launch`` accept kernels of ``kernel_type`` (a type, or its
    ``"module.QualName"`` so the library need not be imported) through ``adapter``."""
    with _reg_lock:
        if isinstance(kernel_type, str):
            _adapters_by_name[kernel_type] = adapter
        else:
            _adapters[kernel_type] = adapter


def _registered(t):
    a = _adapters.get(t)
    if a is None and _adapters_by_name:
        a = _adapters_by_name.get(f"{t.__module__}.{t.__qualname__}")
    return a


def _adapter_for(kernel) -> KernelAdapter:
    t = type(kernel)
    a = _adapters.get(t)
    if a is not None:
        return a
    for attempt in (0, 1):
        for base in t.__mro__:
            a = _registered(base)
            if a is not None:
                register_kernel_adapter(t, a)  # cache by type for the next launch
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


_dims_cache: dict = {}  # (value, what) -> normalized tuple; lock-free (idempotent writes)


def _check_dims(value, what: str, allow_none: bool = False):
    """``value`` as a tuple of 1 to 3 positive ints (cached per value)."""
    if value is None and allow_none:
        return None
    try:
        hit = _dims_cache.get((value, what))
    except TypeError:  # unhashable: validated below, and refused
        hit = None
    if hit is not None:
        return hit
    dims = (value,) if isinstance(value, int) else value
    ok = isinstance(dims, tuple) and 1 <= len(dims) <= 3 and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims)
    if not ok:
        raise KernelError(f"{what} must be a positive int or a tuple of 1 to 3 positive ints, "
                          f"got {value!r}")
    if len(_dims_cache) < 4096:
        _dims_cache[(value, what)] = dims
    return dims


def _as_view(obj):
    if isinstance(obj, View):
        return obj
    box = getattr(obj, "buffer", None)  # DeviceBox
    if isinstance(box, View) and type(obj).__name__ == "DeviceBox":
        return box
    return None


_INTENT_MODES = {In: READ, Out: WRITE, InOut: WRITE, Atomic: ATOMIC}
# Arguments that are scalars whatever the adapter: passed through without a lookup.
_PLAIN_SCALARS = frozenset({int, float, bool, type(None)})


def resolve_args(adapter, args, device):
    """Split launch arguments into LaunchArgs and scalars; returns
    ``(resolved, uses, device, coerced)``. Raises before anything is leased.
    ``coerced``: an adapter made a view for a foreign array, for this launch only."""
    resolved = []
    uses = []
    coerced = False
    for i, a in enumerate(args):
        cls = type(a)
        if cls in _PLAIN_SCALARS:
            resolved.append(a)
            continue
        mode = _INTENT_MODES.get(cls)
        if mode is not None:
            obj, intent = a.obj, cls
        elif isinstance(a, Intent):  # a subclass of an intent
            obj, mode, intent = a.obj, a.mode, cls
        else:
            obj, intent = a, None
        view = obj if isinstance(obj, View) else _as_view(obj)
        if view is None:
            view = adapter.coerce(obj, device)
            if view is None:
                if intent is not None:
                    raise KernelError(f"argument {i}: {intent.__name__}() takes a Buffer, Tensor, "
                                      f"DeviceBox or array, got {type(obj).__name__}")
                resolved.append(a)
                continue
            coerced = True
        if view._state:
            view._raise_dead()
        tok = view._token
        adev = tok.allocation.device
        if device is None:
            device = adev
        elif adev is not device:
            raise DeviceMismatchError(f"argument {i} ({view!r}) is on {adev}, but the launch runs "
                                      f"on {device}; copy it there first")
        if mode is None:
            mode, intent = WRITE, InOut
        if mode is not READ and not tok.writable:
            raise KernelError(f"argument {i}: {intent.__name__}({view!r}) would write through a "
                              f"read-only view; pass it as In(...) or copy it first")
        resolved.append(LaunchArg(view, tok, mode, intent))
        uses.append((tok, mode is not READ))
    return resolved, uses, device, coerced


def prepare_launch(kernel, grid, block, args, stream, shared_mem, policy):
    """Everything :func:`launch` does before it takes leases: validation,
    argument resolution and packing. Raises with nothing leased. Returns
    ``(stream, uses, enqueue, keep, label, resolved, coerced)`` for
    :func:`~sharedmem.runtime.submission.submit`.

    ``enqueue`` may be called again (ops submit a prepared launch many times)
    while every view in ``resolved`` is still live: a view's token never
    changes while it lives, so the leases and packed pointers stay right --
    unless ``coerced``: an adapter then made views of foreign arrays for this
    launch only."""
    adapter = _adapters.get(type(kernel)) or _adapter_for(kernel)
    if policy is not None:
        _access.check_policy(policy)
    if stream is not None and type(stream) is not Stream:
        stream = Stream.from_external(stream)
    device = stream.device if stream is not None else None
    resolved, uses, device, coerced = resolve_args(adapter, args, device)
    if device is None:  # no arrays and no stream: a device this kind of kernel runs on
        from .device import Device, default_device
        device = default_device()
        if device.kind not in adapter.device_kinds and "host" in adapter.device_kinds:
            device = Device.host()
    if device.kind not in adapter.device_kinds:
        raise DeviceMismatchError(f"a {adapter.name} cannot run on {device}; it runs on "
                                  f"{' or '.join(adapter.device_kinds)} devices")
    if stream is None:
        stream = device.default_stream
    if shared_mem and (not isinstance(shared_mem, int) or shared_mem < 0):
        raise KernelError(f"shared_mem must be an int >= 0, got {shared_mem!r}")
    enqueue, keep = adapter.prepare(kernel, grid, block, resolved, shared_mem, stream)
    return stream, uses, enqueue, keep, (adapter, kernel), resolved, coerced


def launch(kernel, grid, block, *args, stream=None, shared_mem: int = 0, policy=None) -> DeviceFuture:
    """Launch ``kernel`` on ``stream`` with leases on every array argument.

    ``grid`` and ``block``: an int or a tuple of up to three ints (``block``
    may be None for cuTile). ``stream``: a :class:`Stream`, a foreign stream,
    or None for the default stream of the arguments' device. ``policy``:
    ``"order"`` or ``"reject"``, overriding :func:`set_access_policy`.

    Returns a :class:`DeviceFuture`. The arguments' memory stays valid until
    the device has finished, whatever the caller drops meanwhile.

    This is the Python path; ``sharedmem.launch`` enters the compiled one first
    when it is built (``sharedmem._accel.entry``).
    """
    # `resolved` is named (not `_`) so it stays referenced until the leases are taken:
    # views an adapter made of foreign arrays (CuPy arrays) live only as long as it does.
    stream, uses, enqueue, keep, label, resolved, coerced = prepare_launch(
        kernel, grid, block, args, stream, shared_mem, policy)
    return DeviceFuture(submit(stream, uses, enqueue, keep, policy, label))


# -- host kernels ---------------------------------------------------------------------
class HostKernel:
    """A Python function launched by :func:`launch` on the host backend.

    It is called on the stream's worker thread with NumPy views of the array
    arguments -- writable for Out / InOut / Atomic, read-only for In -- and
    the scalars as given. ``grid`` and ``block`` are validated, not passed.
    Calling the HostKernel directly calls the function.
    """

    __slots__ = ("fn", "__name__", "__qualname__", "__wrapped__")

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError(f"host_kernel needs a callable, got {fn!r}")
        self.fn = fn
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "host_kernel")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<host_kernel {self.__qualname__}>"


def host_kernel(fn) -> HostKernel:
    """Decorator: make ``fn`` launchable with :func:`launch` on the host device."""
    return HostKernel(fn)


class _HostAdapter(KernelAdapter):
    name = "host kernel"
    device_kinds = ("host",)

    def label(self, kernel) -> str:
        return f"host kernel {kernel.__qualname__}"

    def prepare(self, kernel, grid, block, args, shared_mem, stream):
        from .backends.host import ndarray_of
        _check_dims(grid, "grid")
        _check_dims(block, "block", allow_none=True)
        call_args = [ndarray_of(a.view, a.mode != READ) if isinstance(a, LaunchArg) else a
                     for a in args]
        fn = kernel.fn
        impl = stream._impl

        def enqueue():
            return impl.submit(lambda: fn(*call_args))

        return enqueue, (kernel,)


register_kernel_adapter(HostKernel, _HostAdapter())
