"""The CUDA backend (placeholder until the driver-API backend lands)."""

from ..errors import BackendUnavailableError


class CudaBackend:
    def __init__(self, ordinal: int):
        raise BackendUnavailableError("the CUDA backend is not available yet")
