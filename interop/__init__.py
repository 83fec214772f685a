"""Bridges between sharedmem and the ecosystem.

Each module imports its library lazily, so importing any of them never fails
and never pulls in a GPU library:

* :mod:`interop.dlpack` -- DLPack export and import (versioned and legacy)
* :mod:`interop.cai` -- CUDA Array Interface v3 export and import
* :mod:`interop.cupy` -- CuPy arrays and RawKernel / RawModule launches
* :mod:`interop.cutile` -- cuTile (``cuda.tile``) kernel launches

The exception is :mod:`interop.dask` (dask.distributed's serialization families): it imports
distributed, and sharedmem imports it only in processes where distributed is loaded.
"""

# sharedmem first: its build switch (SHAREDMEM_PURE_PYTHON) decides how the compiled modules
# here load too -- one of them imported first would load compiled next to an interpreted core
import sharedmem  # noqa: E402,F401
