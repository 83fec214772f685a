# Declarations for the compiled build of future.py (Cython pure-Python mode).
cimport cython

cdef class _FutureBase:
    pass

cdef class DeviceFuture(_FutureBase):
    cdef public object _s

@cython.locals(f=DeviceFuture)
cpdef DeviceFuture future_of(submission)
