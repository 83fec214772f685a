# Declarations for the compiled build of state.py (Cython pure-Python mode).
cimport cython
from cpython.pythread cimport PyThread_get_thread_ident

# The core lock, compiled: a pthread mutex (POSIX only, as ipc.py is). CPython's PyThread lock (a
# semaphore) reads the monotonic clock on every acquire, a try included -- it computes a
# deadline before it looks -- which cost a launch ~130 instructions, an export and its release
# three times that. Locked and unlocked by one thread.
cdef extern from *:
    """
    #include <pthread.h>
    #include <stdlib.h>
    typedef pthread_mutex_t *sm_core_lock;
    static inline sm_core_lock sm_lock_new(void) {
        pthread_mutex_t *m = (pthread_mutex_t *)malloc(sizeof(pthread_mutex_t));
        if (m != NULL && pthread_mutex_init(m, NULL) != 0) { free(m); m = NULL; }
        return m;
    }
    static inline int sm_lock_try(sm_core_lock l) { return pthread_mutex_trylock(l) == 0; }
    static inline void sm_lock_wait(sm_core_lock l) { pthread_mutex_lock(l); }
    static inline void sm_lock_release(sm_core_lock l) { pthread_mutex_unlock(l); }
    """
    ctypedef void* sm_core_lock
    sm_core_lock sm_lock_new() nogil
    bint sm_lock_try(sm_core_lock lock) nogil
    void sm_lock_wait(sm_core_lock lock) nogil
    void sm_lock_release(sm_core_lock lock) nogil

cdef class Hooks:
    cpdef end_holds(self, tok)
    cpdef hold_ending(self, tok)

cdef class Runtime:
    cdef readonly object _acquire, _release
    cdef sm_core_lock _plock
    cdef public unsigned long owner
    cdef readonly object staged
    cdef public bint restaged
    cdef public list later
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
    @cython.locals(later=list)
    cpdef release(self)
    cpdef drop_later(self, obj)
    cpdef bint enter_or_stage(self, fn, arg, bint hold=*) except -1
    cdef _drain_at_release(self)

cdef unsigned long _thread_ident()

cdef class LeafLock:
    cdef sm_core_lock _m
    cdef _new(self)
    cdef void take(self) noexcept
    cdef void give(self) noexcept

cpdef bint fork_holds() except -1
