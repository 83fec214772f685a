# Declarations for the compiled build of streams.py (Cython pure-Python mode).
cimport cython
from cpython.pycapsule cimport PyCapsule_CheckExact, PyCapsule_GetName, PyCapsule_GetPointer
from libc.stdint cimport intptr_t
from libc.string cimport strcmp

# CuPy's cupy_backends.cuda.stream.get_stream_ptr (see cupy_stream_entry); errors are asked
# for after every call, as CuPy's modules built by Cython 3 and by 0.29 differ in the clause
ctypedef intptr_t (*stream_ptr_fn_t)(int) except *

cdef list _torch, _cupy
cdef size_t _cupy_fn
cdef dict _modules

cpdef object library_handle(device, bint torch)

@cython.locals(name=cython.p_const_char)
cpdef size_t cupy_stream_entry(cp) except? 0

cdef list _library_handles(dev)

cdef object _borrowed(dev, handle, bint torch, bint named=*)

cdef object _handle_of(obj)

cpdef object consumer_stream(dev, handle)

cpdef list current_streams(dev)

cpdef tuple current_consumers(dev)

cdef tuple _current(dev)

cpdef bint ordered_among(streams) except -1
