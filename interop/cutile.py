"""cuTile (``cuda.tile``) kernels launched through ``sharedmem.launch`` (next)."""
