# Declarations for the compiled build of cuda.py (Cython pure-Python mode).

ctypedef int (*ctx_get_fn_t)(void**) noexcept nogil
ctypedef int (*record_fn_t)(void*, void*) noexcept nogil
ctypedef int (*query_fn_t)(void*) noexcept nogil
ctypedef int (*wait_fn_t)(void*, void*, unsigned int) noexcept nogil
ctypedef int (*graph_launch_fn_t)(void*, void*) noexcept nogil

cdef class CudaMarker:
    cdef public object event
    cdef public unsigned long long handle
    cdef public object error, _backend
    cdef public bint _pooled
    cdef public CudaStreamImpl _open_on

    cpdef close_locked(self)
    cpdef int query(self) except -1

cdef class CudaStreamImpl:
    cdef public object handle, cu_stream
    cdef public bint owned
    cdef public object name, _backend, external
    cdef public bint capturing
    cdef public CudaMarker open_marker
    cdef public long open_count
    cdef object __weakref__

    cpdef object submit_marker(self)
    cpdef wait_marker(self, marker)
