# Declarations for the compiled build of launch.py (Cython pure-Python mode).
from sharedmem.runtime.submission cimport Work

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
    cdef public object view, value, token
    cdef public int _mode
    cdef public object intent
    cdef public bint with_length

cdef class KernelPlan:
    cdef public object kernel, adapter, device, label
    cdef public dict _configs
    cdef object __weakref__

cdef class _Launch(Work):
    cdef public KernelPlan plan
    cdef public object stream, config, payload

cdef class ForeignArray:
    cdef public object token, value
