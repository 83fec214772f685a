# Declarations for the compiled build of allocation.py (Cython pure-Python mode).
cimport cython
from sharedmem.access cimport AccessTracker
from sharedmem.runtime.state cimport LeafLock, Runtime, fork_holds

cdef class Allocation
cdef class View

cdef class ViewToken:
    cdef public Allocation allocation
    cdef public str kind
    cdef public Py_ssize_t start, stop
    cdef public bint writable
    cdef public object origin, keep
    cdef public bint live
    cdef public tuple consumers
    cdef public tuple use_r, use_w

    @cython.locals(rt=Runtime)
    cpdef release(self)

cdef class Allocation:
    cdef readonly long long id
    cdef public object device
    cdef public unsigned long long ptr
    cdef public Py_ssize_t nbytes
    cdef public object owner
    cdef public str source
    cdef public AccessTracker tracker
    cdef public dict _views
    cdef public object bridge_facts
    cdef object __weakref__

    # (every view's creation: slices, as_buffer borrows, exports -- paths users take per launch)
    @cython.locals(tok=ViewToken, rt=Runtime)
    cpdef ViewToken new_token(self, str kind, Py_ssize_t start, Py_ssize_t stop, bint writable,
                              keep, source=*)

cdef tuple _checked_range(ptr, nbytes)

cdef _fill(Allocation a, device, ptr, nbytes, owner, source)

cdef class _Class:
    cdef readonly list starts, refs
    cdef readonly unsigned long long span

cdef class _DeviceEntries:
    cdef readonly dict classes
    cdef readonly list walk
    cdef public object last

# (every search of a class: C compares of its ints)
@cython.locals(lo=Py_ssize_t, hi=Py_ssize_t, mid=Py_ssize_t, s=cython.ulonglong)
cdef Py_ssize_t _count_at_most(list starts, unsigned long long x) except -1

@cython.locals(c=cython.int)
cdef int _bit_length(unsigned long long n) noexcept

cdef class _Registry:
    cdef readonly object _lock
    cdef readonly dict _maps
    cdef object _gone
    cdef readonly Py_ssize_t _live
    cdef readonly long long _gen
    cdef object _staged

    # (every allocation made and every one that dies: typed containers, C compares)
    @cython.locals(lo=cython.ulonglong, n=Py_ssize_t, c=cython.int, last=cython.ulonglong,
                   fresh=_DeviceEntries, fresh_class=_Class, known=_DeviceEntries,
                   dev=_DeviceEntries, walk=list, cl=_Class, starts=list, i=Py_ssize_t,
                   j=Py_ssize_t, start=cython.ulonglong, a=Allocation, seen=list,
                   lock=LeafLock)
    cpdef bint register(self, Allocation alloc, long long gen) except -1

    @cython.locals(dev=_DeviceEntries, cl=_Class, starts=list, refs=list, i=Py_ssize_t,
                   ptr=cython.ulonglong, lock=LeafLock, held=bint)
    cpdef _remove(self, ref)

    # (every import and every foreign array new to a launch: C compares, typed containers)
    @cython.locals(p=cython.ulonglong, n=Py_ssize_t, start=cython.ulonglong, i=Py_ssize_t,
                   j=Py_ssize_t, a=Allocation, best=Allocation, seen=list, dev=_DeviceEntries,
                   walk=list, cl=_Class, starts=list, lock=LeafLock)
    cpdef lookup(self, dkey, ptr, nbytes)

@cython.locals(reg=_Registry, a=Allocation, gen=cython.longlong)
cpdef import_allocation(device, ptr, nbytes, source, region=*)

cdef class Exporter:
    cpdef export(self, View view, stream, max_version, dl_device, copy)
    cpdef dlpack_device(self, View view)

cdef Exporter _first_exporter()

cdef class View:
    cdef public ViewToken _token
    cdef public int _state
    cdef public object _moved_to, _derived
    cdef public long long _dead_id
    cdef public ViewToken _export
    cdef public Py_ssize_t _offset
    cdef public unsigned long long _ptr
    cdef public object _dtype
    cdef object __weakref__

    cpdef _init_view(self, ViewToken token, Py_ssize_t offset)
    cpdef ViewToken _live_token(self)

    @cython.locals(tok=ViewToken, rt=Runtime, others=list, settled=bint, alloc=Allocation)
    cpdef ViewToken _move_token(self, str target_kind, str target_name)

    @cython.locals(tok=ViewToken, hold=ViewToken)
    cpdef ViewToken _object_hold_locked(self, str kind, consumers)

cdef _init_token(ViewToken self, Allocation allocation, str kind, Py_ssize_t start,
                 Py_ssize_t stop, bint writable, keep, origin)

@cython.locals(rt=Runtime)
cpdef _release_locked(ViewToken tok)

@cython.locals(rt=Runtime)
cpdef ViewToken _add_locked(ViewToken tok)

@cython.locals(cons=tuple, c=tuple, i=Py_ssize_t)
cpdef add_consumer_locked(ViewToken tok, stream, bint writes)

@cython.locals(tok=ViewToken)
cpdef ViewToken unregistered_token(Allocation allocation, str kind, Py_ssize_t start,
                                   Py_ssize_t stop, bint writable, keep)

@cython.locals(src=View, c=tuple)
cpdef register_token_locked(ViewToken tok, source, tuple consumers)

cdef dict _imported

cpdef _module(str name)
