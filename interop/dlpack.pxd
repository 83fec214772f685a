# Declarations for the compiled build of dlpack.py (Cython pure-Python mode), and the two C
# entry points DLPack needs that ctypes cannot give: a capsule destructor and a managed
# tensor deleter that keep the caller's pending exception (CPython calls a capsule's
# destructor with whatever exception its caller has set: a consumer dropping a capsule on
# its error path). Both hand the address to dlpack.py's _delete -- the one implementation.
from cpython.exc cimport PyErr_Fetch, PyErr_Restore
from cpython.pycapsule cimport PyCapsule_Destructor, PyCapsule_New
from cpython.ref cimport PyObject

cdef extern from "Python.h":
    # (PyObject* forms: the capsule being destroyed has no references left to take)
    int _capsule_is_valid "PyCapsule_IsValid" (PyObject* o, const char* name)
    void* _capsule_pointer "PyCapsule_GetPointer" (PyObject* o, const char* name)


cdef object _end_export_fn  # dlpack.py's _delete (set there, after its definition)


cdef inline void _end_export(size_t addr) noexcept:
    # called with the GIL held; the pending exception is set aside around the Python call
    cdef PyObject* et
    cdef PyObject* ev
    cdef PyObject* tb
    PyErr_Fetch(&et, &ev, &tb)
    try:
        _end_export_fn(addr)
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


cdef inline object _c_capsule(size_t addr, bint versioned):
    if versioned:
        return PyCapsule_New(<void*>addr, b"dltensor_versioned",
                             <PyCapsule_Destructor>_c_capsule_destructor)
    return PyCapsule_New(<void*>addr, b"dltensor", <PyCapsule_Destructor>_c_capsule_destructor)
