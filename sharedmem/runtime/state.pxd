# Declarations for the compiled build of state.py (Cython pure-Python mode).
from cpython.pythread cimport (PyThread_get_thread_ident, PyThread_type_lock,
                               PyThread_allocate_lock, PyThread_acquire_lock,
                               PyThread_release_lock, WAIT_LOCK, NOWAIT_LOCK)

cdef class Hooks:
    cpdef end_holds(self, tok)
    cpdef sweep_long(self, stream)

cdef class Runtime:
    cdef readonly object lock, _acquire, _release
    cdef PyThread_type_lock _plock
    cdef public unsigned long owner
    cdef readonly object staged
    cdef readonly set active
    cdef readonly list leaked
    cdef public long long in_flight, submitted, retired, leaked_count, leaked_bytes
    cdef public long long unfinished, live_views
    cdef readonly object warnings, errors
    cdef public bint retirer_running, retirer_idle
    cdef public object ensure_retirer, wake_retirer, tracer
    cdef readonly Hooks hooks
    cdef public str policy
    cdef public long pid
    cdef public long captures
    cdef object __weakref__

    cpdef acquire(self)
    cpdef release(self)
    cpdef drain_staged(self)
    cpdef bint enter_or_stage(self, fn, arg) except -1
    cpdef install_hooks(self, Hooks hooks)
    cpdef run_or_stage(self, fn, arg)
    cdef bint _try_acquire(self)
    cpdef _new_lock(self)

cdef unsigned long _thread_ident()
