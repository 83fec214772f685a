# Declarations for the compiled build of dlpack.py (Cython pure-Python mode), and the two C
# entry points DLPack needs that ctypes cannot give: a capsule destructor and a managed
# tensor deleter that keep the caller's pending exception (CPython calls a capsule's
# destructor with whatever exception its caller has set: a consumer dropping a capsule on
# its error path). Both hand the address to dlpack.py's _delete -- the one implementation.
cimport cython
from cpython.exc cimport PyErr_Fetch, PyErr_Restore
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from cpython.pycapsule cimport (PyCapsule_Destructor, PyCapsule_GetPointer, PyCapsule_IsValid,
                                PyCapsule_New, PyCapsule_SetName)
from cpython.ref cimport PyObject
from sharedmem.allocation cimport Allocation, Exporter, View, ViewToken
from sharedmem.tensor cimport Tensor
from sharedmem.runtime.submission cimport export_hold

cdef extern from "Python.h":
    # (PyObject* forms: the capsule being destroyed has no references left to take)
    int _capsule_is_valid "PyCapsule_IsValid" (PyObject* o, const char* name)
    void* _capsule_pointer "PyCapsule_GetPointer" (PyObject* o, const char* name)


cdef class _Exporter(Exporter):
    cpdef export(self, View view, stream, max_version, dl_device, copy)
    cpdef dlpack_device(self, View view)

cdef class _Export:
    cdef public object managed
    cdef public ViewToken token

@cython.locals(exports=dict, ex=_Export)
cpdef _delete(addr)

cdef object _cuda_consumer(object stream)


cdef inline void _end_export(size_t addr) noexcept:
    # called with the GIL held; the pending exception is set aside around the call
    cdef PyObject* et
    cdef PyObject* ev
    cdef PyObject* tb
    PyErr_Fetch(&et, &ev, &tb)
    try:
        _delete(addr)
    except BaseException:  # (never raise out of a destructor; nothing else to report to)
        pass
    PyErr_Restore(et, ev, tb)


cdef inline void _c_capsule_destructor(PyObject* capsule) noexcept:
    # an unconsumed capsule still carries its original name: end the export
    if _capsule_is_valid(capsule, b"dltensor_versioned"):
        _end_export(<size_t>_capsule_pointer(capsule, b"dltensor_versioned"))
    elif _capsule_is_valid(capsule, b"dltensor"):
        _end_export(<size_t>_capsule_pointer(capsule, b"dltensor"))


cdef inline void _c_deleter(void* managed) noexcept with gil:
    # DLPack's deleter: called by the consumer from any thread, with or without the GIL
    _end_export(<size_t>managed)


cdef inline size_t _c_deleter_address() noexcept:
    return <size_t>_c_deleter


# The capsule calls of an import, through the C API (through ctypes, interpreted)
cdef inline bint _c_is_valid(object capsule, const char* name) noexcept:
    return PyCapsule_IsValid(capsule, name) == 1


cdef inline size_t _c_get_pointer(object capsule, const char* name) except? 0:
    return <size_t>PyCapsule_GetPointer(capsule, name)


cdef inline int _c_set_name(object capsule, const char* name) except -1:
    return PyCapsule_SetName(capsule, name)


cdef inline object _c_capsule(size_t addr, bint versioned):
    return PyCapsule_New(<void*>addr, b"dltensor_versioned" if versioned else b"dltensor",
                         <PyCapsule_Destructor>_c_capsule_destructor)


# The DLPack structs (dlpack.h, v1.0), for the compiled export: the managed tensor is made in
# one PyMem_Malloc block (header, then shape and strides) instead of through ctypes.
cdef struct _DLDevice:
    int32_t device_type
    int32_t device_id

cdef struct _DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

cdef struct _DLTensor:
    void* data
    _DLDevice device
    int32_t ndim
    _DLDataType dtype
    int64_t* shape
    int64_t* strides
    uint64_t byte_offset

ctypedef void (*_Deleter)(void*) noexcept

cdef struct _DLManagedTensor:
    _DLTensor dl_tensor
    void* manager_ctx
    _Deleter deleter

cdef struct _DLPackVersion:
    uint32_t major
    uint32_t minor

cdef struct _DLManagedTensorVersioned:
    _DLPackVersion version
    void* manager_ctx
    _Deleter deleter
    uint64_t flags
    _DLTensor dl_tensor


cdef inline size_t _c_managed(bint versioned, size_t ptr, int dev_type, int dev_id, int code,
                              int bits, tuple shape, tuple strides, uint64_t flags) except 0:
    # a managed tensor (versioned or legacy) describing the view; freed by _c_free_managed
    cdef Py_ssize_t ndim = len(shape), i
    cdef size_t head = sizeof(_DLManagedTensorVersioned) if versioned else sizeof(_DLManagedTensor)
    cdef char* raw = <char*>PyMem_Malloc(head + 16 * ndim)
    cdef int64_t* sh
    cdef int64_t* st
    cdef _DLTensor* t
    cdef _DLManagedTensorVersioned* mv
    cdef _DLManagedTensor* m
    if raw == NULL:
        raise MemoryError()
    sh = <int64_t*>(raw + head)
    st = sh + ndim
    try:
        for i in range(ndim):
            sh[i] = shape[i]
            st[i] = strides[i]
    except BaseException:
        PyMem_Free(raw)
        raise
    if versioned:
        mv = <_DLManagedTensorVersioned*>raw
        mv.version.major = 1
        mv.version.minor = 0
        mv.manager_ctx = NULL
        mv.deleter = <_Deleter>_c_deleter
        mv.flags = flags
        t = &mv.dl_tensor
    else:
        m = <_DLManagedTensor*>raw
        m.manager_ctx = NULL
        m.deleter = <_Deleter>_c_deleter
        t = &m.dl_tensor
    t.data = <void*>ptr
    t.device.device_type = dev_type
    t.device.device_id = dev_id
    t.ndim = <int32_t>ndim
    t.dtype.code = <uint8_t>code
    t.dtype.bits = <uint8_t>bits
    t.dtype.lanes = 1
    t.shape = sh
    t.strides = st
    t.byte_offset = 0
    return <size_t>raw


cdef inline void _c_free_managed(size_t addr) noexcept:
    PyMem_Free(<void*>addr)


cdef inline tuple _c_read_managed(size_t addr, bint versioned):
    # dlpack.py's _read_managed, from the C structs (interpreted: through ctypes)
    cdef _DLTensor* t
    cdef _DLManagedTensorVersioned* mv
    cdef _DLManagedTensor* m
    cdef size_t deleter
    cdef uint32_t major = 1
    cdef uint64_t flags = 0
    if versioned:
        mv = <_DLManagedTensorVersioned*>addr
        major = mv.version.major
        if major != 1:  # (the rest of the layout is unknown)
            return major, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        flags = mv.flags
        deleter = <size_t>mv.deleter
        t = &mv.dl_tensor
    else:
        m = <_DLManagedTensor*>addr
        deleter = <size_t>m.deleter
        t = &m.dl_tensor
    return (major, flags, deleter, <size_t>t.data, t.byte_offset, t.device.device_type,
            t.device.device_id, t.ndim, t.dtype.code, t.dtype.bits, t.dtype.lanes,
            <size_t>t.shape, <size_t>t.strides)


cdef inline void _c_call_deleter(size_t addr, bint versioned) noexcept:
    # a consumed tensor's own deleter, if any, called with the GIL held: DLPack's deleters
    # take it themselves (CuPy's are `with gil`, NumPy's PyGILState_Ensure), so holding it
    # costs nothing there, and one that assumes it is held works too. (Interpreted, a
    # ctypes call, which lets the GIL go around it.)
    cdef _Deleter deleter
    if versioned:
        deleter = (<_DLManagedTensorVersioned*>addr).deleter
    else:
        deleter = (<_DLManagedTensor*>addr).deleter
    if deleter != NULL:
        deleter(<void*>addr)


cdef inline tuple _c_read_dims(size_t shape, size_t strides, int ndim):
    # dlpack.py's _read_dims: called once the tensor is one an import takes (0 <= ndim <=
    # MAX_NDIM, shape not NULL unless ndim is 0), never before
    cdef int64_t* sh = <int64_t*>shape
    cdef int64_t* st = <int64_t*>strides
    cdef int i
    return (tuple([sh[i] for i in range(ndim)]),
            None if st == NULL else tuple([st[i] for i in range(ndim)]))


cdef tuple _code_bits(dt)

@cython.locals(t=Tensor)
cpdef _make_capsule(View view, ViewToken export_tok, bint versioned, int flags, tuple where,
                    tuple code_bits)

@cython.locals(ex=_Export, exports=dict)
cpdef _ctypes_capsule(ViewToken export_tok, size_t ptr, int dev_type, int dev_id, int code,
                      int bits, tuple shape, tuple strides, bint versioned, uint64_t flags)

@cython.locals(tok=ViewToken, facts=tuple, export_tok=ViewToken)
cpdef export_positional(View view, stream, max_version, dl_device, copy)

cdef tuple _facts_of(Allocation alloc)

cdef tuple _device_facts(dev)

cpdef ViewToken _export_hold(View view, ViewToken tok, stream, tuple facts)
