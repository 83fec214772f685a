# Declarations for the compiled build of submission.py (Cython pure-Python mode).

cdef class Submission:
    cdef public object stream, marker, keep, uses, callbacks, value, _label
    cdef public long long seq
    cdef public int state

cdef class Work:
    cpdef run(self)

cdef class FailedMarker:
    cdef public object error
