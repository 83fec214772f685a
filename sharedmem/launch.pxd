# Declarations for the compiled build of launch.py (Cython pure-Python mode).
cimport cython
from sharedmem.allocation cimport View, ViewToken
from sharedmem.runtime.submission cimport Submission, Work, submit_plan
from sharedmem.runtime.future cimport future_of
from sharedmem.stream cimport Stream, as_stream, streams_entered

cdef extern from "Python.h":
    # (isinstance() by the type alone: no lookup of obj.__class__ when the type says no)
    bint PyObject_TypeCheck(object obj, type cls)

# A compiled adapter's coerce as a C function (KernelAdapter._coerce_addr): a new reference,
# or NULL with an exception set
ctypedef object (*coerce_fn_t)(object, object)

cdef int _mode_of(c) except -1

cdef class Intent:
    cdef public object obj
    cdef public int _mode
    cdef public bint with_length

cdef class In(Intent):
    pass

cdef class Out(Intent):
    pass

cdef class InOut(Intent):
    pass

cdef class Atomic(Intent):
    pass

cdef class LaunchArg:
    cdef public View view
    cdef public object value
    cdef public ViewToken token
    cdef public int _mode
    cdef public object intent
    cdef public bint with_length
    cdef public Py_ssize_t offset

cdef class ForeignArray:
    cdef public ViewToken token
    cdef public Py_ssize_t offset
    cdef public object ref, keep
    cdef public tuple use_r, use_w

cdef class KernelPlan(Work):
    cdef public object kernel, adapter, device, label
    cdef public dict _configs
    cdef public tuple _last
    cdef object __weakref__

    cpdef configure(self, grid, block, shared_mem)
    cpdef pack(self, list args, list uses, config, stream)
    cpdef enqueue(self, stream, config, payload)

cdef class _PreparedPlan(KernelPlan):
    pass

@cython.locals(resolved=list, uses=list, i=Py_ssize_t, mode=int, u=tuple,
               hit=tuple, with_length=bint, view=View, tok=ViewToken, ia=Intent, la=LaunchArg,
               fa=ForeignArray, foreign=list, caddr=cython.size_t)
cpdef tuple resolve_args(adapter, tuple args, device)

@cython.locals(plan=KernelPlan, sub=Submission, st=Stream, adapters=dict)
cpdef launch_submission(kernel, grid, block, tuple args, stream, shared_mem, policy,
                        bint submit=*)

@cython.locals(plan=KernelPlan, sub=Submission)
cpdef Submission submit_planned(tuple planned)

@cython.locals(plan=KernelPlan, plans=dict)
cpdef KernelPlan plan_for(adapter, kernel, device)

