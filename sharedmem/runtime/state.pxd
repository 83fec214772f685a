# Declarations for the compiled build of state.py (Cython pure-Python mode).

cdef class Runtime:
    cdef readonly object lock
    cdef public unsigned long owner
    cdef readonly object staged
    cdef readonly set active
    cdef readonly list leaked
    cdef public long long in_flight, submitted, retired, leaked_count, leaked_bytes
    cdef public long long unfinished, live_views
    cdef readonly object warnings, errors
    cdef public bint retirer_running, retirer_idle
    cdef public object ensure_retirer, wake_retirer, end_holds
    cdef public str policy
    cdef public long pid
    cdef object __weakref__

    cpdef acquire(self)
    cpdef release(self)
    cpdef drain_staged(self)
    cpdef run_or_stage(self, fn, arg)
