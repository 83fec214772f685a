# Declarations for the compiled build of tensor.py (Cython pure-Python mode).
cimport cython
from sharedmem.allocation cimport View, ViewToken
from sharedmem.buffer cimport Buffer, new_buffer

cdef class Tensor(View):
    cdef public tuple _shape, _strides
    cdef public Py_ssize_t _size
    cdef public bint _contiguous

    @cython.locals(tok=ViewToken, start=Py_ssize_t, stop=Py_ssize_t, nbytes=Py_ssize_t)
    cpdef Py_ssize_t _check_dense(self, str what, bint whole=*) except -1

@cython.locals(self=Tensor)
cpdef Tensor new_tensor(ViewToken token, object dtype, tuple shape, tuple strides,
                        Py_ssize_t offset, Py_ssize_t size=*, int contiguous=*)

@cython.locals(cacheable=bint, n=object, hit=tuple, layouts=dict, last=tuple)
cpdef tuple c_layout(object shape)

cdef Py_ssize_t _itemsize(dtype) except -1

# (every array new to a launch: an index loop, C indices)
@cython.locals(i=Py_ssize_t)
cpdef tuple extent(shape, strides, itemsize=*)
