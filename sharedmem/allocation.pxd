# Declarations for the compiled build of allocation.py (Cython pure-Python mode).
from sharedmem.access cimport AccessTracker

cdef class Allocation

cdef class ViewToken:
    cdef public Allocation allocation
    cdef public str kind
    cdef public Py_ssize_t start, stop
    cdef public bint writable
    cdef public object origin, keep
    cdef public bint live
    cdef public list consumers

cdef class Allocation:
    cdef readonly long long id
    cdef public object device
    cdef public object ptr
    cdef public Py_ssize_t nbytes
    cdef public object owner
    cdef public str source
    cdef public AccessTracker tracker
    cdef public dict _views
    cdef object __weakref__

    cpdef list live_tokens_locked(self, Py_ssize_t start, Py_ssize_t stop)
    cpdef list conflicts_locked(self, Py_ssize_t start, Py_ssize_t stop, bint writable, exclude)

cdef class View:
    cdef public ViewToken _token
    cdef public int _state
    cdef public object _moved_to, _derived
    cdef public ViewToken _export
    cdef public Py_ssize_t _offset
    cdef object __weakref__

cpdef _release_locked(ViewToken tok)
cpdef ViewToken _add_locked(ViewToken tok)
cpdef add_consumer_locked(ViewToken tok, stream, bint writes)
