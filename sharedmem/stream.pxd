# Declarations for the compiled build of stream.py (Cython pure-Python mode).
cimport cython

cdef class Stream:
    cdef public object device, _impl
    cdef public bint owned, _ours
    cdef public object name
    cdef public list _pending
    cdef public object _join
    cdef public long long _seq, _done, _swept, _uid
    cdef public dict _waited
    cdef public bint _leak_warned, _checks, _lent
    cdef public object _external, _capture, _joined
    cdef public list _holds
    cdef public Py_ssize_t _nholds
    cdef object __weakref__

cpdef bint streams_entered()

@cython.locals(st=Stream)
cdef Stream _borrowed_last(obj)

cpdef Stream as_stream(obj)

cdef dict _by_handle

cdef object _stream_at(key)

cdef bint _names_its_stream(Stream st)
