# Declarations for the compiled build of future.py (Cython pure-Python mode).
cimport cython

cdef class _FutureBase:
    cdef public object _s  # (DeviceFuture's: here, so a DeviceFuture fits the freelist)

cdef class DeviceFuture(_FutureBase):
    pass

@cython.locals(f=DeviceFuture)
cpdef DeviceFuture future_of(submission)
