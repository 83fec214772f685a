# Declarations for the compiled build of buffer.py (Cython pure-Python mode).
cimport cython
from sharedmem.allocation cimport View, ViewToken

cdef class Buffer(View):
    cdef public Py_ssize_t _length

@cython.locals(self=Buffer)
cpdef Buffer new_buffer(ViewToken token, object dtype, Py_ssize_t length)
