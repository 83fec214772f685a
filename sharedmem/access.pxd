# Declarations for the compiled build of access.py (Cython pure-Python mode).
cimport cython
from sharedmem.stream cimport Stream
from sharedmem.allocation cimport ViewToken

cdef class Span:
    cdef public Py_ssize_t lo, hi
    cdef public long long seq
    cdef public object marker

@cython.locals(e=Span)
cdef Span _span(Py_ssize_t lo, Py_ssize_t hi, long long seq, marker)

cdef class StreamUse:
    cdef public list reads, writes, holds
    cdef public long long newest
    cdef public object ref

    @cython.locals(e=Span)
    cpdef bint prune(self, long long done)

@cython.locals(use=StreamUse)
cdef StreamUse _new_use(stream)

cdef class AccessTracker:
    cdef public dict _uses
    cdef public long long _last
    cdef public StreamUse _last_use

    @cython.locals(uses=dict)
    cpdef dict uses_locked(self)

    @cython.locals(use=StreamUse, uid=cython.longlong, uses=dict)
    cdef StreamUse _use_of(self, Stream stream)

    @cython.locals(uses=dict, n=Py_ssize_t, s=Stream, use=StreamUse, dead=list,
                   uid=cython.longlong)
    cpdef bint elsewhere_locked(self, Stream stream)

    @cython.locals(out=list, uses=dict, s=Stream, use=StreamUse, best=Span, hw=bint,
                   other_writes=bint, dead=list, uid=cython.longlong)
    cpdef list conflicts_locked(self, Stream stream, bint writes, Py_ssize_t lo, Py_ssize_t hi,
                                exclude)

    @cython.locals(use=StreamUse, entries=list, e=Span)
    cpdef record_locked(self, Stream stream, bint writes, Py_ssize_t lo, Py_ssize_t hi,
                        long long seq, marker)

    @cython.locals(use=StreamUse, holds=list, on=list, n=Py_ssize_t)
    cpdef add_hold_locked(self, Stream stream, tok, Py_ssize_t lo, Py_ssize_t hi)

    @cython.locals(use=StreamUse, holds=list, i=Py_ssize_t, on=list, n=Py_ssize_t,
                   j=Py_ssize_t)
    cpdef drop_hold_locked(self, Stream stream, tok)

@cython.locals(e=Span)
cdef bint _any_done(list entries, long long done)

@cython.locals(keep=list, e=Span)
cdef _add_range(list entries, Py_ssize_t lo, Py_ssize_t hi, long long seq, marker,
                long long done)

@cython.locals(e=Span)
cdef Span _newest_overlap(list entries, Py_ssize_t lo, Py_ssize_t hi, Span best)

@cython.locals(uid=cython.longlong, out=list, u=tuple, tok=ViewToken, tracker=AccessTracker,
               n=Py_ssize_t, by=dict)
cpdef list leases_to_check_locked(Stream stream, list uses)

@cython.locals(uid=cython.longlong, keeps=list, u=tuple, tok=ViewToken, tracker=AccessTracker,
               use=StreamUse, entries=list, e=Span)
cpdef list record_leases_locked(Stream stream, list uses, long long seq, marker)
