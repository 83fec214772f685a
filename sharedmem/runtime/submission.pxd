# Declarations for the compiled build of submission.py (Cython pure-Python mode).
cimport cython
from sharedmem.access cimport AccessTracker, leases_to_check_locked, record_leases_locked
from sharedmem.allocation cimport Allocation, View, ViewToken, register_token_locked, unregistered_token
from sharedmem.runtime.state cimport Hooks, Runtime
from sharedmem.stream cimport Stream

from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

cdef class Submission:
    cdef public object stream, marker, keep, uses, callbacks, value, _label
    cdef public long long seq
    cdef public int state
    cdef public double t0


cdef inline double _now() noexcept nogil:
    # time.monotonic() without a Python call (the same clock on Linux)
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9

cdef class Work:
    cdef public bint native

    cpdef enqueue(self, stream, config, payload)

cpdef Submission submit_plan(Stream stream, list uses, Work plan, config, payload, keep, policy,
                             label)

@cython.locals(rt=Runtime, tok=ViewToken, sub=Submission,
               seq=cython.longlong, became_active=bint, keeps=list, waits=object,
               retired=list, impl=object, marker=object, u=tuple, check=list)
cdef Submission _submit(Stream stream, list uses, enqueue, Work plan, config, payload, keep,
                        policy, label, views)

@cython.locals(pending=list)
cdef bint _filed_locked(Runtime rt, Stream stream, Submission sub, waits) except -1

@cython.locals(waited=dict)
cdef note_waited_locked(Stream stream, Stream other, long long seq, marker)

@cython.locals(w=tuple, c=tuple, other=Stream, seq=cython.longlong, waited=dict)
cdef dict _conflicts_locked(AccessTracker tracker, Stream stream, ViewToken tok, bint writes,
                            policy, label, dict waits)

@cython.locals(rt=Runtime, seq=cython.longlong, tok=ViewToken, sub=Submission, u=tuple)
cpdef Submission lease_locked(Stream stream, uses, keep, label, marker)

@cython.locals(sub=Submission)
cpdef Submission new_submission(stream, long long seq, marker, keep, uses, label)

@cython.locals(n=Py_ssize_t, lo=Py_ssize_t, hi=Py_ssize_t, mid=Py_ssize_t, st=int)
cpdef Py_ssize_t _done_prefix_locked(list pending, bint record=*) except -2

@cython.locals(rt=Runtime, out=list, k=Py_ssize_t, sub=Submission, i=Py_ssize_t, st=int,
               pending=list)
cpdef list _sweep_locked(Stream stream, bint record=*)

@cython.locals(i=Py_ssize_t, sub=Submission, last=object)
cpdef _finish(list subs, bint hand_off=*)

@cython.locals(consumers=tuple, tracker=AccessTracker, c=tuple, stream=Stream, early=dict)
cpdef end_holds_locked(ViewToken tok)

cdef _end_hold_locked(ViewToken tok, Stream stream, bint writes)

@cython.locals(consumers=tuple, tracker=AccessTracker, c=tuple, left=list)
cpdef end_left_consumers_locked(ViewToken tok, named)

@cython.locals(last=Submission, label=object, seq=cython.longlong, rt=Runtime)
cdef _lease_hold_end_locked(Stream stream, ViewToken tok, bint writes, marker)

cpdef joined_marker_locked(Stream stream)

cdef class _Hooks(Hooks):
    cpdef end_holds(self, tok)
    cpdef hold_ending(self, tok)

cdef dict _early_ends

cpdef sweep_long(Stream stream)

@cython.locals(hold=ViewToken, rt=Runtime, markers=list, c=tuple, own=Stream)
cpdef ViewToken export_hold(ViewToken tok, str kind, source, tuple consumers, wait, bint blocking=*,
                            stream=*, handle=*)

@cython.locals(rt=Runtime, markers=list, tok=ViewToken, hold=ViewToken)
cpdef int object_export_hold(View view, str kind, consumers, wait, bint ordered) except? -1

@cython.locals(tracker=AccessTracker, c=tuple)
cdef _order_locked(ViewToken tok, wait, bint blocking, stream, handle, list markers,
                   exclude)
