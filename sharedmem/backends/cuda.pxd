# Declarations for the compiled build of cuda.py (Cython pure-Python mode).
cimport cython

ctypedef int (*ctx_get_fn_t)(void**) noexcept nogil
ctypedef int (*record_fn_t)(void*, void*) noexcept nogil
ctypedef int (*query_fn_t)(void*) noexcept nogil
ctypedef int (*wait_fn_t)(void*, void*, unsigned int) noexcept nogil
ctypedef int (*graph_launch_fn_t)(void*, void*) noexcept nogil
ctypedef int (*capturing_fn_t)(void*, int*) noexcept nogil
ctypedef int (*exchange_fn_t)(int*) noexcept nogil
ctypedef int (*attributes_fn_t)(unsigned int, int*, void**, unsigned long long) noexcept nogil

cdef class CudaBackend

cdef class CudaMarker:
    cdef public object event
    cdef public unsigned long long handle
    cdef public object error
    cdef readonly CudaBackend _backend
    cdef public bint _pooled
    cdef public CudaStreamImpl _open_on

    cpdef close_locked(self)
    cpdef int query(self) except -1

cdef class CudaStreamImpl:
    cdef public object handle, cu_stream, c_handle
    cdef public bint owned
    cdef public object name, external
    cdef readonly CudaBackend _backend
    cdef public bint capturing
    cdef public CudaMarker open_marker
    cdef public long open_count
    cdef object _blocking, _read_handle
    cdef object __weakref__

    cpdef object submit_marker(self)
    cpdef wait_marker(self, CudaMarker marker)
    cpdef bint named_by(self, obj) except -1

cdef class CudaBackend:
    cdef public object _cupy, cu, ordinal, cu_device, name, uuid, compute_capability, limits
    cdef public object context, hot, _cupy_device, _arena
    cdef public Py_ssize_t _staged
    cdef public size_t context_handle
    # driver entry points called through their addresses (0: not known)
    cdef public size_t ctx_get_addr, record_addr, query_addr, wait_addr, graph_launch_addr
    cdef public size_t capturing_addr, exchange_addr, attributes_addr
    cdef public list _events, _ipc_events
    cdef object __weakref__

    cpdef ensure_context(self)
    cpdef _event(self)

@cython.locals(m=CudaMarker)
cdef CudaMarker _open_marker(CudaStreamImpl impl)

cdef _stream_wait(CudaBackend backend, stream_handle, CudaMarker marker)

cdef int _record(CudaBackend backend, ev, size_t h, size_t stream_handle) except? -1

cdef object _pointer_info(size_t addr, unsigned long long ptr)
