# Declarations for the compiled build of future.py (Cython pure-Python mode).

cdef class _FutureBase:
    pass

cdef class DeviceFuture(_FutureBase):
    cdef public object _s
