"""Devices: a physical CUDA GPU, or the host device (memory in host RAM).

``Device(i)`` is CUDA device ``i`` and ``Device.host()`` the host device; each
is a process-wide singleton. A CUDA device *borrows* the primary context of
its GPU (it never destroys it). ``default_device()`` picks CUDA device 0 when
it is usable and the host device otherwise; ``SHAREDMEM_BACKEND=host|cuda``
forces the choice.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .errors import BackendUnavailableError, CudaError, PeerAccessError
from .runtime.state import OwnedLock, fork_safe
from .stream import Stream

__all__ = ["Device", "default_device"]

_lock = fork_safe(OwnedLock("the creation of a device"))
_devices: dict = {}  # key -> Device; written under _lock, read lock-free (a dict get)


class Device:
    """A device that memory lives on and streams run on.

    Attributes: ``kind`` (``"cuda"`` or ``"host"``), ``ordinal`` (CUDA ordinal,
    ``-1`` for the host), ``name``, ``key`` (a hashable identity),
    ``default_stream``, ``dlpack_device`` (DLPack's ``(device_type, device_id)``); for CUDA
    also ``uuid`` and ``compute_capability``.
    """

    __slots__ = ("kind", "ordinal", "name", "key", "backend", "_default_stream", "_peers",
                 "dlpack_device", "bridge_facts", "__weakref__")
    kind: str
    ordinal: int
    name: str
    key: tuple[str, int]
    backend: Any
    dlpack_device: tuple[int, int]
    bridge_facts: Any

    def __new__(cls, ordinal: int | Device = 0) -> Device:
        if type(ordinal) is int:  # (the usual: a device made already, one dict read)
            dev = _devices.get(("cuda", ordinal))
            if dev is not None:
                return dev
        if isinstance(ordinal, Device):
            return ordinal
        if isinstance(ordinal, np.integer):  # (as every other int parameter is taken)
            ordinal = int(ordinal)
        if not isinstance(ordinal, int) or isinstance(ordinal, bool) or ordinal < 0:
            raise ValueError(f"Device(ordinal) takes a CUDA device number >= 0, got {ordinal!r}; "
                             f"use Device.host() for the host device")
        dev = _devices.get(("cuda", ordinal))  # (lock-free once made: a dict read)
        return dev if dev is not None else _make("cuda", ordinal)

    @classmethod
    def host(cls) -> "Device":
        """The host device: memory in host RAM, streams are worker threads."""
        dev = _devices.get(("host", -1))
        return dev if dev is not None else _make("host", -1)

    def _setup(self, kind, ordinal, name, key, backend):
        self.kind = kind
        self.ordinal = ordinal
        self.name = name
        self.key = key
        self.backend = backend
        # DLPack's (device_type, device_id): kDLCPU = 1 for the host, kDLCUDA = 2 for CUDA
        self.dlpack_device = (1, 0) if kind == "host" else (2, ordinal)
        self._default_stream = None
        # The devices whose memory this device's kernels may use (enable_peer_access); replaced
        # whole under _lock, read lock-free by launches (a frozenset: no torn reads)
        self._peers = frozenset()
        # For interop bridges: what is constant about exporting from this device, read on every
        # export (interop.dlpack keeps its facts here: a slot read, not a dict lookup), so it
        # lives and dies with the device. Lock-free: a racing writer stores equal facts.
        self.bridge_facts = None
        from .runtime.retirer import attach_backend
        attach_backend(backend)

    def __repr__(self) -> str:
        return "<Device host>" if self.kind == "host" else f"<Device cuda:{self.ordinal} {self.name}>"

    def __reduce__(self):
        return (Device.host, ()) if self.kind == "host" else (Device, (self.ordinal,))

    @property
    def uuid(self) -> str | None:
        """The GPU's UUID (``GPU-...``), or None for the host device."""
        return getattr(self.backend, "uuid", None)

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """``(major, minor)`` of a CUDA device, or None for the host device."""
        return getattr(self.backend, "compute_capability", None)

    @property
    def default_stream(self) -> Stream:
        """The device's default stream (for CUDA, the legacy default stream;
        for the host, one long-lived worker). Borrowed: never destroyed."""
        s = self._default_stream
        if s is None:
            with _lock:
                if self._default_stream is None:
                    self._default_stream = Stream._create(self, self.backend.default_stream(),
                                                          owned=False, name="default")
                s = self._default_stream
        return s

    def create_stream(self, name: str | None = None) -> Stream:
        """A new stream owned by the returned :class:`~sharedmem.Stream` (``name``: a str
        shown in reprs, traces and profilers, or None)."""
        if name is not None and not isinstance(name, str):
            raise TypeError(f"create_stream(name=) takes a str or None, got {name!r}")
        return Stream._create(self, self.backend.create_stream(name), owned=True, name=name)

    # -- peers --------------------------------------------------------------------------------
    def can_access_peer(self, peer: "Device") -> bool:
        """Whether kernels on this device could use ``peer``'s memory once
        :meth:`enable_peer_access` is called (True for the device itself; False between kinds
        and on the host device)."""
        peer = _as_device(peer)
        if peer is self:
            return True
        if self.kind != "cuda" or peer.kind != "cuda":
            return False
        return self.backend.can_access_peer(peer.backend)

    def enable_peer_access(self, peer: "Device") -> None:
        """Let kernels launched on this device read and write ``peer``'s memory (one way: call
        it on both devices for both ways). From then on a launch here may take arguments on
        ``peer``: it is ordered after ``peer``'s pending conflicting work by a cross-device
        event wait, its leases are recorded on this device's stream, and the memory is freed
        only once both devices are done with it. Idempotent. Raises
        :class:`~sharedmem.errors.PeerAccessError` where the pair cannot (and changes nothing)."""
        peer = _as_device(peer)
        if peer is self or peer in self._peers:
            return
        if not self.can_access_peer(peer):
            why = ("peer access joins two CUDA devices" if self.kind != "cuda" or peer.kind != "cuda"
                   else "cuDeviceCanAccessPeer says this pair cannot (no NVLink or PCIe P2P path)")
            raise PeerAccessError(f"{self} cannot access {peer}'s memory: {why}. Copy the data "
                                  f"instead: view.to_device({self!r})")
        self.backend.enable_peer_access(peer.backend)
        with _lock:
            self._peers = self._peers | {peer}

    @property
    def peers(self) -> frozenset:
        """The devices whose memory kernels launched here may use (see
        :meth:`enable_peer_access`)."""
        return self._peers

    def synchronize(self) -> None:
        """Wait for all work sharedmem submitted on this device, then retire it."""
        from .runtime.submission import synchronize_device
        synchronize_device(self)


def _make(kind: str, ordinal: int) -> Device:
    """The device ``(kind, ordinal)``, made (with its backend) unless another thread did."""
    key = (kind, ordinal)
    with _lock:
        dev = _devices.get(key)
        if dev is None:
            if kind == "cuda":
                from .backends.cuda import CudaBackend  # imports cuda.bindings lazily
                backend = CudaBackend(ordinal)
            else:
                from .backends.host import HostBackend
                backend = HostBackend()
            dev = object.__new__(Device)
            dev._setup(kind, ordinal, backend.name, key, backend)
            _devices[key] = dev
    return dev


def _as_device(d) -> Device:
    if not isinstance(d, Device):
        raise TypeError(f"expected a sharedmem.Device, got {type(d).__name__}")
    return d


_default = None


def as_device(device) -> Device:
    """``device`` as a Device: None is the default device, "host" the host device, a Device
    itself, an int that CUDA device (``Device(device)`` checks the rest)."""
    if device is None:
        return default_device()
    if type(device) is str and device == "host":  # (an array: no truth value asked)
        return Device.host()
    return Device(device)


def default_device() -> Device:
    """CUDA device 0 when usable, else the host device.

    ``SHAREDMEM_BACKEND=host`` or ``=cuda`` forces the choice (``cuda`` raises
    :class:`~sharedmem.errors.BackendUnavailableError` when CUDA is unusable).
    """
    global _default
    if _default is not None:
        return _default
    choice = os.environ.get("SHAREDMEM_BACKEND", "").strip().lower()
    if choice not in ("", "host", "cuda"):
        raise BackendUnavailableError(
            f"SHAREDMEM_BACKEND={choice!r} is not a backend; use 'host' or 'cuda' (or unset it)")
    why = None  # (the last choice's: a reason an earlier one -- show_config's -- gave is gone)
    if choice == "host":
        dev = Device.host()
    else:
        try:
            dev = Device(0)
        except (BackendUnavailableError, CudaError) as e:
            # CudaError: a GPU the driver sees but cannot use (its primary context refused:
            # an exclusive-process GPU busy elsewhere, out of memory)
            why = str(e) if isinstance(e, BackendUnavailableError) else \
                f"CUDA device 0 is not usable: {e}"
            if choice == "cuda":
                raise BackendUnavailableError(f"SHAREDMEM_BACKEND=cuda: {why}") from e
            dev = Device.host()
    _fallback[0] = why
    # (returned from the local: re-read, the global may be None again by then -- another
    # thread's show_config resets it, and the except clause's cleanup above can run finalizers)
    _default = dev
    return dev


_fallback = [None]  # why default_device() fell back to the host (BackendUnavailableError's text)


def host_fallback_reason() -> str | None:
    """Why :func:`default_device` chose the host device although no ``SHAREDMEM_BACKEND``
    asked for it (CUDA was unusable: the error's message), or None."""
    return _fallback[0]
