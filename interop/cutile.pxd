# Declarations for the compiled build of cutile.py (Cython pure-Python mode).
cimport cython
from sharedmem.allocation cimport View, ViewToken
from sharedmem.tensor cimport Tensor
from sharedmem.launch cimport ForeignArray, KernelPlan, LaunchArg
from sharedmem.backends.cuda cimport CudaBackend, CudaStreamImpl
from sharedmem.stream cimport Stream
from interop.cupy_launch cimport (ArrayFacts, coerce, merged_devices, order_after_libraries,
                                  torch_tensor_type)

@cython.locals(n=Py_ssize_t, p=Py_ssize_t, q=Py_ssize_t, up=tuple, uq=tuple, ta=ViewToken,
               tb=ViewToken)
cpdef bint _aliased(list uses)

@cython.locals(d=dict, tok=ViewToken, t=Tensor, key=tuple, by_layout=dict)
cpdef _view_descriptor(Py_ssize_t i, View view, bint writes)

cdef class TilePlan(KernelPlan):
    cdef public CudaBackend backend
    cdef public object ct_launch
    cdef public object modes
    cdef public dict warmed
    cdef public tuple last_args

    @cython.locals(n=Py_ssize_t, i=Py_ssize_t, j=Py_ssize_t, out=list,
                   call_args=tuple, seen=tuple, foreign=bint, torch_dev=object,
                   cupy_dev=object, t=type)
    cpdef pack(self, list args, list uses, config, stream)

    @cython.locals(st=Stream, impl=CudaStreamImpl)
    cpdef enqueue(self, stream, config, payload)

@cython.locals(n=Py_ssize_t, i=Py_ssize_t)
cdef bint _same_args(tuple a, tuple b)

cpdef tile_coerce(obj, device)

cdef object _c_tile_coerce(object obj, object device)
