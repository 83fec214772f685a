# Declarations for the compiled build of cupy_launch.py (Cython pure-Python mode).
cimport cython
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsUnsignedLongLongMask
from libc.string cimport memcpy
from sharedmem.allocation cimport (Allocation, View, ViewToken, import_allocation,
                                   unregistered_token)
from sharedmem.launch cimport ForeignArray, KernelPlan, LaunchArg
from sharedmem.backends.cuda cimport CudaStreamImpl, ctx_get_fn_t
from sharedmem.stream cimport Stream
from sharedmem.tensor cimport extent
from interop.streams cimport library_handle

ctypedef int (*launch_fn_t)(void*, unsigned int, unsigned int, unsigned int, unsigned int,
                            unsigned int, unsigned int, unsigned int, void*, void**,
                            void**) noexcept nogil

# Param.kcode values (C constants when compiled)
cdef int _K_PTR, _K_INT, _K_FLOAT, _K_ANY

cdef class Param:
    cdef public str kind
    cdef public int size
    cdef public object name, ctype
    cdef public int code, kcode
    cdef public bint address
    cdef public Py_ssize_t offset
    cdef public object lo, hi

cdef class LaunchConfig:
    cdef public unsigned int gx, gy, gz, bx, by, bz, shm

cdef class RawKernelPlan(KernelPlan):
    cdef public object func
    cdef readonly tuple params  # (set once: see __init__)
    cdef public object fmt, slots, ptrs, c_func, c_ptrs
    cdef public size_t ptrs_addr
    cdef public object backend
    cdef public size_t launch_addr, ctx_addr, context
    cdef public object limits, fn
    cdef public Py_ssize_t nbytes

    @cython.locals(params=tuple, n=Py_ssize_t, need=Py_ssize_t, extra=Py_ssize_t,
                   i=Py_ssize_t, par=Param, lp=Param, la=LaunchArg, kc=int, view=View,
                   fa=ArrayFacts, fv=cython.double, torch_dev=object,
                   cupy_dev=object, adev=object, lib=int)
    cpdef pack(self, list args, list uses, config, stream)

    @cython.locals(impl=CudaStreamImpl, c=LaunchConfig, err=int, st=Stream)
    cpdef enqueue(self, stream, config, payload)

@cython.locals(slot=cython.p_char, code=int)
cdef _emit(bytes out, Param par, v)

cdef void _emit_address(bytes out, Param par, unsigned long long ptr) noexcept

@cython.locals(params=tuple, n=Py_ssize_t, i=Py_ssize_t, p=Param, c=LaunchConfig,
               base=cython.p_char)
cdef int _launch_compiled(RawKernelPlan plan, CudaStreamImpl impl, config,
                          bytes packed) except? -1

cdef class ArrayFacts(ForeignArray):
    cdef public size_t addr
    cdef public bint dead
    cdef public object ptr, layout


@cython.locals(f=ArrayFacts, slot=Py_ssize_t, i=int)
cdef _forget(size_t key, ref)

cdef dict _facts

cpdef bint owner_writable(arr) except -1

# (every array new to a launch: C calls, no argument tuples)
@cython.locals(alloc=Allocation)
cpdef tuple _allocation_of(arr, dev)

@cython.locals(f=ArrayFacts, tok=ViewToken)
cdef ArrayFacts _remember(arr, str kind, Allocation alloc, Py_ssize_t lo, Py_ssize_t hi,
                          bint writable, ptr, layout, keep)

@cython.locals(f=ArrayFacts)
cpdef ArrayFacts array_facts(arr)

@cython.locals(f=ArrayFacts, slot=Py_ssize_t, addr=size_t)
cdef ArrayFacts _known(arr)

@cython.locals(other=ArrayFacts, slot=Py_ssize_t)
cdef _recall(ArrayFacts f)

@cython.locals(f=ArrayFacts, layout=tuple)
cpdef ArrayFacts torch_facts(t)

cpdef torch_tensor_type()

cpdef coerce(obj, device)

cdef object _c_coerce(object obj, object device)

cpdef order_after_libraries(Stream stream, torch_devs, cupy_devs, uses=*)

cpdef merged_devices(seen, devs)

@cython.locals(h=object)
cdef object _to_wait(Stream stream, devs, bint torch, todo)

cpdef int library_of(a) except -2
