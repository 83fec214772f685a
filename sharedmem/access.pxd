# Declarations for the compiled build of access.py (Cython pure-Python mode).

cdef class Span:
    cdef public Py_ssize_t lo, hi
    cdef public long long seq
    cdef public object marker

cdef class Hold:
    cdef public Py_ssize_t lo, hi
    cdef public bint writes
    cdef public object token

cdef class StreamUse:
    cdef public list reads, writes, holds
    cdef public long long newest
    cpdef bint prune(self, long long done)

cdef class AccessTracker:
    cdef public dict _uses
    cpdef bint elsewhere_locked(self, stream)
    cpdef list conflicts_locked(self, stream, bint writes, Py_ssize_t lo, Py_ssize_t hi)
    cpdef record_locked(self, stream, bint writes, Py_ssize_t lo, Py_ssize_t hi, long long seq,
                        marker)
    cpdef add_hold_locked(self, stream, tok, bint writes)
    cpdef drop_hold_locked(self, stream, tok)
    cpdef list streams_locked(self)

cdef _add_range(list entries, Py_ssize_t lo, Py_ssize_t hi, long long seq, marker,
                long long done)
cdef Span _newest_overlap(list entries, Py_ssize_t lo, Py_ssize_t hi, Span best)
