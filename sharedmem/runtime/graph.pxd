# Declarations for the compiled build of graph.py (Cython pure-Python mode).
from sharedmem.runtime.submission cimport Work, submit_plan
from sharedmem.runtime.future cimport future_of

cdef class _Executable(Work):
    cdef public object backend, handle, launch

    cpdef enqueue(self, stream, config, payload)
