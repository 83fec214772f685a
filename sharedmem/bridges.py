"""Top-level entry points of the interop bridges (imported lazily)."""

from __future__ import annotations

__all__ = ["from_dlpack", "from_cuda_array_interface"]


def from_dlpack(obj, *, stream=None, device=None):
    """Import any DLPack producer (NumPy, CuPy, torch, JAX...) as a
    :class:`~sharedmem.Tensor`, zero-copy. See :func:`interop.dlpack.from_dlpack`."""
    from interop.dlpack import from_dlpack as _impl
    return _impl(obj, stream=stream, device=device)


def from_cuda_array_interface(obj, *, stream=None):
    """Import a ``__cuda_array_interface__`` producer as a :class:`~sharedmem.Tensor`,
    zero-copy. See :func:`interop.cai.from_cuda_array_interface`."""
    from interop.cai import from_cuda_array_interface as _impl
    return _impl(obj, stream=stream)
