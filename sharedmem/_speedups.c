/* sharedmem._speedups: the compiled launch path (optional).
 *
 * One function, fast_launch(kernel, grid, block, args, stream, shared_mem),
 * does what sharedmem.launch does for the common case of a CUDA kernel whose
 * plan Python already made (interop.cupy registers a LaunchPlan per kernel
 * that packs parameters for cuLaunchKernel; interop.cutile one that calls
 * ct.launch with the views' cached descriptors: a "call plan") -- and nothing
 * else: whenever anything is uncommon (an unknown kernel or argument type, a
 * dead view, another device, a capturing stream, a conflict with work of
 * unknown completion or under policy "reject", staged releases, deferred
 * warnings, a driver error) it returns None *before any side effect* (a failed
 * cuLaunchKernel may follow device-side waits, which are harmless to repeat)
 * and sharedmem.launch runs its Python path, which handles (and reports) it.
 * (Plans are for CUDA streams, which have no per-stream fault to check.)
 *
 * What it does is, step for step, the common path of
 * sharedmem.launch.resolve_args and sharedmem.runtime.submission.submit:
 *   resolve and validate every argument; take core_lock; check every token
 *   live; for the leases whose memory other streams have unfinished work on
 *   (AccessTracker.elsewhere_locked), find the conflicts and make the stream
 *   wait for each other stream's newest (order_after_others); launch; join
 *   the stream's open completion marker; bump the stream's sequence number;
 *   record each lease (AccessTracker.record_locked's same-range fast path,
 *   else the Python method); file the launch (into the stream's newest
 *   Submission when it shares marker, leases and keep, else a new one); count;
 *   sweep every SWEEP_EVERY-th submission; release the lock; wake the retirer
 *   as submit() does. A change to those Python functions must be mirrored here
 *   (tests run both paths: SHAREDMEM_PURE_PYTHON=1, and tests/test_compiled_path.py).
 *
 * Object fields are read through the __slots__ offsets of the exact Python
 * classes (checked by type identity before use); the GIL is held throughout,
 * except while core_lock.acquire() blocks and inside the Python calls made
 * under core_lock (ct.launch, wait_marker, submit_marker, record_locked), which
 * cannot change trackers or FIFOs: those change only under core_lock, and a
 * destructor run meanwhile stages its release.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define MAX_PARAMS 64
#define MAX_ARGS 64
#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*ctx_get_fn)(void **);

/* ---- configuration (set once by configure()) ------------------------------------ */
static int configured = 0;
static int enabled = 1;  /* set_enabled(): benchmarks compare against the Python path */
static PyObject *lock_acquire, *lock_release;          /* core_lock's bound methods */
static PyObject *staged, *pending_warnings, *deferred_errors;  /* deques */
static PyObject *active_set, *counters, *retirer_running, *retirer_idle;
static PyObject *submission_globals;                   /* module dict of runtime.submission */
static PyTypeObject *SubmissionType, *FutureType, *StreamType, *TokenType, *AllocationType;
static PyTypeObject *TrackerType, *StreamUseType;
static PyTypeObject *InType, *OutType, *InOutType, *AtomicType;
static long sweep_every;
static PyObject *str_record_locked;
static Py_ssize_t off_cnt_in_flight, off_cnt_submitted;  /* submission._Counters */
static PyObject *str_sweep_locked, *str_finish, *str_retirer_ensure, *str_retirer_wake;

static Py_ssize_t off_intent_obj, off_view_token, off_view_state, off_view_derived,
    off_buffer_length;
static Py_ssize_t off_tok_alloc, off_tok_start, off_tok_stop, off_tok_writable, off_tok_keep,
    off_tok_live;
static Py_ssize_t off_alloc_device, off_alloc_ptr, off_alloc_tracker, off_tracker_uses;
static Py_ssize_t off_use_reads, off_use_writes;
static Py_ssize_t off_stream_cached_uses, off_stream_cached_seq;
static Py_ssize_t off_stream_device, off_stream_impl, off_stream_pending, off_stream_seq,
    off_stream_capture;
static Py_ssize_t off_sub_stream, off_sub_seq, off_sub_marker, off_sub_keep, off_sub_uses,
    off_sub_state, off_sub_callbacks, off_sub_value, off_sub_label, off_sub_count, off_future_s;

static PyObject *deque_append;  /* collections.deque.append (every Stream._pending is a deque) */
static PyObject *plans;  /* kernel -> LaunchPlan */
static PyObject *one;
#define MAX_PLANS 1024

static Py_ssize_t
slot_offset(PyObject *type, const char *name)
{
    PyObject *d = PyObject_GetAttrString(type, name);
    if (d == NULL)
        return -1;
    if (Py_TYPE(d) != &PyMemberDescr_Type) {
        PyErr_Format(PyExc_TypeError, "%R.%s is not a __slots__ member", type, name);
        Py_DECREF(d);
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    Py_ssize_t off = (m->type == T_OBJECT_EX || m->type == T_OBJECT) ? m->offset : -1;
    Py_DECREF(d);
    if (off < 0)
        PyErr_Format(PyExc_TypeError, "%R.%s is not an object slot", type, name);
    return off;
}

static void
slot_set(PyObject *o, Py_ssize_t off, PyObject *v)  /* steals nothing */
{
    PyObject *old = SLOT(o, off);
    Py_XINCREF(v);
    SLOT(o, off) = v;
    Py_XDECREF(old);
}

/* ---- LaunchPlan: what is constant about launching one kernel with one set of
 *      argument types on one device ------------------------------------------------- */
enum { C_PTR = 0, C_PTR_LEN = 1, C_INT = 2, C_BOOL = 3, C_F32 = 4, C_F64 = 5, C_NULL = 6,
       C_BYTES = 7,  /* a NumPy scalar: its bytes, through the buffer protocol */
       C_INLINE = 8, /* a NumPy scalar whose value sits right after its object header (checked
                        by interop.cupy on a live scalar of the type before it is used) */
       /* call plans (a kernel launched through a Python callable, interop.cutile): */
       C_OBJ = 9,    /* passed as it is (an int, float or bool of exactly the spec's type) */
       C_DESC = 10   /* an array: the view's cached descriptor (View._derived_value) */ };

typedef struct {
    PyTypeObject *type;  /* exact type of the argument (view class or scalar type) */
    int code;
    int size;            /* parameter size (for C_PTR_LEN: of the length parameter) */
    int offset;          /* byte offset of the parameter's slot */
    int offset2;         /* C_PTR_LEN: the length's slot */
    /* the last array argument's address: ptr_o + start_o (ints, held: compared by identity,
       as Python ints are immutable), so a repeated argument is not converted again */
    PyObject *ptr_o, *start_o;
    uint64_t addr;
} ArgSpec;

typedef struct {
    PyObject_HEAD
    PyObject *kernel, *device, *default_stream, *impl_type, *submit_marker, *label, *backend;
    PyObject *keep_kernel;  /* (kernel,): what a launch keeps when its tokens keep the rest */
    /* A call plan launches with call(stream_handle, (gx, gy, gz), kernel, args) -- cuTile's
       ct.launch -- instead of cuLaunchKernel: block must be None and shared_mem 0, array
       arguments pass as the descriptors cached on their views under key_rw / key_ro, and
       no two array arguments may overlap when either is written (Python raises for those). */
    PyObject *call, *key_rw, *key_ro;
    PyObject *grid3;  /* the last grid tuple passed to call, reused while the grid is the same */
    void *func, *ctx;
    launch_fn launch;
    ctx_get_fn ctx_get;
    Py_ssize_t off_impl_handle, off_impl_capturing, off_impl_open, off_impl_count;
    long marker_batch;
    int nargs, nparams, slots_bytes;
    int param_offsets[MAX_PARAMS];
    ArgSpec specs[MAX_ARGS];
} LaunchPlan;

static int
plan_traverse(LaunchPlan *p, visitproc visit, void *arg)
{
    Py_VISIT(p->kernel); Py_VISIT(p->device); Py_VISIT(p->default_stream);
    Py_VISIT(p->impl_type); Py_VISIT(p->submit_marker); Py_VISIT(p->label); Py_VISIT(p->backend);
    Py_VISIT(p->keep_kernel); Py_VISIT(p->call); Py_VISIT(p->key_rw); Py_VISIT(p->key_ro);
    Py_VISIT(p->grid3);
    for (int i = 0; i < p->nargs; i++)
        Py_VISIT((PyObject *)p->specs[i].type);
    return 0;
}

static int
plan_clear(LaunchPlan *p)
{
    Py_CLEAR(p->kernel); Py_CLEAR(p->device); Py_CLEAR(p->default_stream);
    Py_CLEAR(p->impl_type); Py_CLEAR(p->submit_marker); Py_CLEAR(p->label); Py_CLEAR(p->backend);
    Py_CLEAR(p->keep_kernel); Py_CLEAR(p->call); Py_CLEAR(p->key_rw); Py_CLEAR(p->key_ro);
    Py_CLEAR(p->grid3);
    for (int i = 0; i < p->nargs; i++) {
        Py_CLEAR(p->specs[i].type);
        Py_CLEAR(p->specs[i].ptr_o);
        Py_CLEAR(p->specs[i].start_o);
    }
    p->nargs = 0;
    return 0;
}

static void
plan_dealloc(LaunchPlan *p)
{
    PyObject_GC_UnTrack(p);
    plan_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static void *
as_address(PyObject *o)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    return (void *)(uintptr_t)v;
}

/* LaunchPlan(kernel, device, default_stream, impl_type, backend, submit_marker, label,
 *            func, ctx, launch_addr, ctx_get_addr, marker_batch, param_sizes, specs
 *            [, call, key_rw, key_ro])
 * specs: one (type, code, size, param_index, length_param_index_or_-1) per argument.
 * With `call` (a call plan): no parameters, func and launch_addr 0, codes C_OBJ / C_DESC. */
static PyObject *
plan_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    PyObject *kernel, *device, *dstream, *impl_type, *backend, *submit_marker, *label;
    PyObject *func, *ctx, *launch_addr, *ctx_get_addr, *sizes, *specs;
    PyObject *call = NULL, *key_rw = NULL, *key_ro = NULL;
    long batch;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOlO!O!|OUU", &kernel, &device, &dstream, &impl_type,
                          &backend, &submit_marker, &label, &func, &ctx, &launch_addr,
                          &ctx_get_addr, &batch, &PyTuple_Type, &sizes, &PyTuple_Type, &specs,
                          &call, &key_rw, &key_ro))
        return NULL;
    if (call != NULL && (key_ro == NULL || !PyCallable_Check(call) || PyTuple_GET_SIZE(sizes))) {
        PyErr_SetString(PyExc_ValueError, "a call plan takes call, key_rw and key_ro, and no "
                        "parameter sizes");
        return NULL;
    }
    Py_ssize_t np = PyTuple_GET_SIZE(sizes), na = PyTuple_GET_SIZE(specs);
    if (np > MAX_PARAMS || na > MAX_ARGS) {
        PyErr_SetString(PyExc_ValueError, "too many kernel parameters for the compiled path");
        return NULL;
    }
    LaunchPlan *p = (LaunchPlan *)type->tp_alloc(type, 0);
    if (p == NULL)
        return NULL;
    p->func = as_address(func);
    p->ctx = as_address(ctx);
    p->launch = (launch_fn)as_address(launch_addr);
    p->ctx_get = (ctx_get_fn)as_address(ctx_get_addr);
    if (PyErr_Occurred())
        goto fail;
    p->marker_batch = batch;
    int off = 0;
    for (Py_ssize_t i = 0; i < np; i++) {
        long sz = PyLong_AsLong(PyTuple_GET_ITEM(sizes, i));
        if (sz <= 0 || sz > 4096) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "bad parameter size");
            goto fail;
        }
        p->param_offsets[i] = off;
        off += (int)((sz + 7) / 8 * 8);
    }
    p->nparams = (int)np;
    p->slots_bytes = off;
    for (Py_ssize_t i = 0; i < na; i++) {
        PyObject *t, *code, *size, *pi, *li;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(specs, i), "O!OOOO", &PyType_Type, &t, &code,
                              &size, &pi, &li))
            goto fail;
        ArgSpec *s = &p->specs[i];
        s->code = (int)PyLong_AsLong(code);
        s->size = (int)PyLong_AsLong(size);
        long ip = PyLong_AsLong(pi), il = PyLong_AsLong(li);
        if (PyErr_Occurred())
            goto fail;
        int ok = call != NULL ? (s->code == C_OBJ || s->code == C_DESC) && ip == i && il < 0
                              : ip >= 0 && ip < np && il < np && s->code >= C_PTR &&
                                s->code <= C_INLINE;
        if (!ok) {
            PyErr_SetString(PyExc_ValueError, "bad argument spec");
            goto fail;
        }
        s->offset = call != NULL ? 0 : p->param_offsets[ip];
        s->offset2 = call == NULL && il >= 0 ? p->param_offsets[il] : -1;
        if (s->code == C_PTR_LEN && il < 0) {
            PyErr_SetString(PyExc_ValueError, "a pointer+length argument needs two parameters");
            goto fail;
        }
        Py_INCREF(t);
        s->type = (PyTypeObject *)t;
        p->nargs = (int)(i + 1);  /* (what plan_clear releases if a later spec fails) */
    }
    if ((p->off_impl_handle = slot_offset(impl_type, "handle")) < 0 ||
        (p->off_impl_capturing = slot_offset(impl_type, "capturing")) < 0 ||
        (p->off_impl_open = slot_offset(impl_type, "open_marker")) < 0 ||
        (p->off_impl_count = slot_offset(impl_type, "open_count")) < 0)
        goto fail;
    Py_INCREF(kernel); p->kernel = kernel;
    Py_INCREF(device); p->device = device;
    Py_INCREF(dstream); p->default_stream = dstream;
    Py_INCREF(impl_type); p->impl_type = impl_type;
    Py_INCREF(backend); p->backend = backend;
    Py_INCREF(submit_marker); p->submit_marker = submit_marker;
    Py_INCREF(label); p->label = label;
    if ((p->keep_kernel = PyTuple_Pack(1, kernel)) == NULL)
        goto fail;
    if (call != NULL) {
        Py_INCREF(call); p->call = call;
        Py_INCREF(key_rw); p->key_rw = key_rw;
        Py_INCREF(key_ro); p->key_ro = key_ro;
    }
    return (PyObject *)p;
fail:
    Py_DECREF(p);
    return NULL;
}

static PyTypeObject LaunchPlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sharedmem._speedups.LaunchPlan",
    .tp_doc = "What is constant about launching one kernel with one set of argument types on "
              "one device (made by interop.cupy and interop.cutile, used by fast_launch).",
    .tp_basicsize = sizeof(LaunchPlan),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = plan_new,
    .tp_dealloc = (destructor)plan_dealloc,
    .tp_traverse = (traverseproc)plan_traverse,
    .tp_clear = (inquiry)plan_clear,
};

/* ---- helpers -------------------------------------------------------------------------- */
static int
dims3(PyObject *v, unsigned out[3])  /* 1 ok, 0 not the common case */
{
    out[0] = out[1] = out[2] = 1;
    if (PyLong_CheckExact(v)) {
        long x = PyLong_AsLong(v);
        if (x < 1 || x > 0x7fffffffL) { PyErr_Clear(); return 0; }
        out[0] = (unsigned)x;
        return 1;
    }
    if (!PyTuple_CheckExact(v))
        return 0;
    Py_ssize_t n = PyTuple_GET_SIZE(v);
    if (n < 1 || n > 3)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(v, i);
        if (!PyLong_CheckExact(d))
            return 0;
        long x = PyLong_AsLong(d);
        if (x < 1 || x > 0x7fffffffL) { PyErr_Clear(); return 0; }
        out[i] = (unsigned)x;
    }
    return 1;
}

static int
pack_int(char *slot, PyObject *v, int size)  /* as struct's unsigned format of v % 2**(8*size) */
{
    if (!PyLong_CheckExact(v))
        return 0;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) { PyErr_Clear(); return 0; }
    if (size < 8) {
        long long lim = 1LL << (8 * size);
        if (x < -(lim >> 1) || x >= lim)
            return 0;  /* Python reports it */
    } else if (size != 8) {
        return 0;
    }
    uint64_t u = (uint64_t)x;
    memcpy(slot, &u, (size_t)size);  /* little-endian hosts only (x86-64, aarch64) */
    return 1;
}

static long
as_long(PyObject *o)
{
    return o != NULL && PyLong_CheckExact(o) ? PyLong_AsLong(o) : -1;
}

static int
call_lock(PyObject *m)
{
    PyObject *r = PyObject_CallNoArgs(m);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int
obj_len(PyObject *o)
{
    Py_ssize_t n = PyObject_Size(o);
    if (n < 0) { PyErr_Clear(); return 1; }
    return n > 0;
}

/* submit()'s cross-stream rule, for the leases whose allocations other streams have unfinished
 * work on (elsewhere[i]): every conflict found by AccessTracker.conflicts_locked, then the
 * stream made to wait for the newest conflicting submission of each other stream
 * (impl.wait_marker). Returns 1 when done, 0 to decline -- nothing was done: a marker of
 * unknown completion or policy "reject" (Python raises), anything unexpected -- and -1 with an
 * exception set when a wait failed (as in submit(), the error propagates). Caller holds
 * core_lock. */
static PyObject *access_globals, *str_conflicts_locked, *str_unknown, *str_policy_name,
    *str_wait_marker;

static int
order_after_others(PyObject *stream, PyObject *impl, PyObject *uses, const char *elsewhere,
                   Py_ssize_t nuses)
{
    PyObject *waits = NULL;  /* other stream -> (seq, marker), as submit() builds it */
    int rc = 0, policy_checked = 0;
    for (Py_ssize_t i = 0; i < nuses; i++) {
        if (!elsewhere[i])
            continue;
        PyObject *use = PyList_GET_ITEM(uses, i);
        PyObject *tok = PyTuple_GET_ITEM(use, 0);
        PyObject *tracker = SLOT(SLOT(tok, off_tok_alloc), off_alloc_tracker);
        PyObject *found = PyObject_CallMethodObjArgs(
            tracker, str_conflicts_locked, stream, PyTuple_GET_ITEM(use, 1),
            SLOT(tok, off_tok_start), SLOT(tok, off_tok_stop), NULL);
        if (found == NULL || !PyList_CheckExact(found)) {
            Py_XDECREF(found);
            goto decline;
        }
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(found); k++) {
            PyObject *c = PyList_GET_ITEM(found, k);  /* (other, marker, seq, other_writes) */
            if (!PyTuple_CheckExact(c) || PyTuple_GET_SIZE(c) != 4) {
                Py_DECREF(found);
                goto decline;
            }
            PyObject *other = PyTuple_GET_ITEM(c, 0), *marker = PyTuple_GET_ITEM(c, 1);
            PyObject *seq = PyTuple_GET_ITEM(c, 2);
            PyObject *unknown = PyObject_GetAttr(marker, str_unknown);
            int bad = unknown == NULL ? -1 : PyObject_IsTrue(unknown);
            Py_XDECREF(unknown);
            if (bad != 0) {  /* unknown completion (or a failed check): Python raises */
                Py_DECREF(found);
                goto decline;
            }
            if (!policy_checked) {
                PyObject *pol = PyDict_GetItemWithError(access_globals, str_policy_name);
                if (pol == NULL || !PyUnicode_Check(pol) ||
                    PyUnicode_CompareWithASCIIString(pol, "order") != 0) {
                    Py_DECREF(found);
                    goto decline;
                }
                policy_checked = 1;
            }
            if (waits == NULL && (waits = PyDict_New()) == NULL) {
                Py_DECREF(found);
                goto decline;
            }
            PyObject *w = PyDict_GetItemWithError(waits, other);
            int newer = w == NULL ? 1 : PyObject_RichCompareBool(seq, PyTuple_GET_ITEM(w, 0), Py_GT);
            if (newer < 0 || (w == NULL && PyErr_Occurred())) {
                Py_DECREF(found);
                goto decline;
            }
            if (newer) {
                PyObject *pair = PyTuple_Pack(2, seq, marker);
                if (pair == NULL || PyDict_SetItem(waits, other, pair) < 0) {
                    Py_XDECREF(pair);
                    Py_DECREF(found);
                    goto decline;
                }
                Py_DECREF(pair);
            }
        }
        Py_DECREF(found);
    }
    if (waits != NULL) {  /* from here on: side effects */
        Py_ssize_t pos = 0;
        PyObject *key, *pair;
        while (PyDict_Next(waits, &pos, &key, &pair)) {
            PyObject *r = PyObject_CallMethodOneArg(impl, str_wait_marker,
                                                    PyTuple_GET_ITEM(pair, 1));
            if (r == NULL) {
                Py_DECREF(waits);
                return -1;
            }
            Py_DECREF(r);
        }
    }
    rc = 1;
decline:
    Py_XDECREF(waits);
    if (rc == 0)
        PyErr_Clear();
    return rc;
}

/* ---- fast_launch ------------------------------------------------------------------------ */
/* The launch itself: `argv[0:n]` are the kernel's arguments (borrowed). */
static PyObject *
launch_with_plan(LaunchPlan *p, PyObject *grid, PyObject *block, PyObject *const *argv,
                 Py_ssize_t n, PyObject *stream, PyObject *shmem_o)
{
    if (n != p->nargs)
        Py_RETURN_NONE;
    unsigned g[3], b[3] = {1, 1, 1};
    if (!dims3(grid, g) || !PyLong_CheckExact(shmem_o))
        Py_RETURN_NONE;
    if (p->call != NULL ? block != Py_None : !dims3(block, b))
        Py_RETURN_NONE;
    long shmem = PyLong_AsLong(shmem_o);
    if (shmem < 0 || shmem > 0x7fffffffL || (p->call != NULL && shmem != 0)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (stream == Py_None)
        stream = p->default_stream;
    else if (Py_TYPE(stream) != StreamType || SLOT(stream, off_stream_device) != p->device)
        Py_RETURN_NONE;
    PyObject *impl = SLOT(stream, off_stream_impl);
    if (impl == NULL || (PyObject *)Py_TYPE(impl) != p->impl_type)
        Py_RETURN_NONE;
    void *ctx = NULL;
    if (p->ctx_get(&ctx) != 0 || ctx != p->ctx)
        Py_RETURN_NONE;  /* Python makes the context current */

    /* resolve: every argument checked and packed; the leases' (token, writes) pairs built
       (they hold the tokens: a view released by another thread meanwhile keeps its token
       object alive, and the check under the lock sees it dead) */
    _Alignas(8) char slots[MAX_PARAMS * 8 + 64];
    void *params[MAX_PARAMS];
    if (p->slots_bytes > (int)sizeof(slots))
        Py_RETURN_NONE;
    memset(slots, 0, (size_t)p->slots_bytes);
    for (int i = 0; i < p->nparams; i++)
        params[i] = slots + p->param_offsets[i];
    PyObject *uses = NULL;
    PyObject *call_args = NULL;  /* a call plan's arguments */
    if (p->call != NULL && (call_args = PyTuple_New(n)) == NULL)
        return NULL;
    PyObject *toks[MAX_ARGS];  /* borrowed: the views in `args` hold them while no Python runs */
    int wrs[MAX_ARGS];
    Py_ssize_t nuses = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arg = argv[i];
        ArgSpec *s = &p->specs[i];
        PyTypeObject *t = Py_TYPE(arg);
        char *slot = slots + s->offset;
        switch (s->code) {
        case C_INT:
            if (t != s->type || !pack_int(slot, arg, s->size))
                goto fallback;
            continue;
        case C_BOOL:
            if (t != s->type)
                goto fallback;
            slot[0] = arg == Py_True;
            continue;
        case C_F32: {
            if (t != s->type)
                goto fallback;
            float f = (float)PyFloat_AS_DOUBLE(arg);
            memcpy(slot, &f, 4);
            continue;
        }
        case C_F64: {
            if (t != s->type)
                goto fallback;
            double d = PyFloat_AS_DOUBLE(arg);
            memcpy(slot, &d, 8);
            continue;
        }
        case C_NULL:
            if (arg != Py_None)
                goto fallback;
            continue;
        case C_OBJ:
            if (t != s->type)
                goto fallback;
            Py_INCREF(arg);
            PyTuple_SET_ITEM(call_args, i, arg);
            continue;
        case C_INLINE:
            if (t != s->type)
                goto fallback;
            memcpy(slot, (char *)arg + sizeof(PyObject), (size_t)s->size);
            continue;
        case C_BYTES: {
            Py_buffer buf;
            if (t != s->type || PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0) {
                PyErr_Clear();
                goto fallback;
            }
            int ok = buf.len == s->size;
            if (ok)
                memcpy(slot, buf.buf, (size_t)s->size);
            PyBuffer_Release(&buf);
            if (!ok)
                goto fallback;
            continue;
        }
        default:
            break;
        }
        /* an array argument: a view, bare (InOut) or in an intent */
        PyObject *view = arg;
        int writes = 1;
        if (t == InType || t == OutType || t == InOutType || t == AtomicType) {
            view = SLOT(arg, off_intent_obj);
            writes = t != InType;
        }
        if (view == NULL || Py_TYPE(view) != s->type || as_long(SLOT(view, off_view_state)) != 0)
            goto fallback;
        PyObject *tok = SLOT(view, off_view_token);
        if (tok == NULL || Py_TYPE(tok) != TokenType)
            goto fallback;
        PyObject *alloc = SLOT(tok, off_tok_alloc);
        if (alloc == NULL || Py_TYPE(alloc) != AllocationType ||
            SLOT(alloc, off_alloc_device) != p->device)
            goto fallback;
        if (writes && SLOT(tok, off_tok_writable) != Py_True)
            goto fallback;
        if (s->code == C_DESC) {
            PyObject *d = SLOT(view, off_view_derived), *desc;
            if (d == NULL || !PyDict_CheckExact(d) ||
                (desc = PyDict_GetItemWithError(d, writes ? p->key_rw : p->key_ro)) == NULL)
                goto fallback;  /* (made by the Python path, once per view) */
            Py_INCREF(desc);
            PyTuple_SET_ITEM(call_args, i, desc);
            toks[nuses] = tok;
            wrs[nuses] = writes;
            nuses++;
            continue;
        }
        PyObject *ptr_o = SLOT(alloc, off_alloc_ptr), *start_o = SLOT(tok, off_tok_start);
        if (s->ptr_o == NULL || ptr_o != s->ptr_o || start_o != s->start_o) {
            if (ptr_o == NULL || start_o == NULL || !PyLong_CheckExact(ptr_o) ||
                !PyLong_CheckExact(start_o))
                goto fallback;
            uint64_t a = PyLong_AsUnsignedLongLong(ptr_o) + (uint64_t)PyLong_AsLongLong(start_o);
            if (PyErr_Occurred()) { PyErr_Clear(); goto fallback; }
            Py_INCREF(ptr_o);
            Py_INCREF(start_o);
            Py_XSETREF(s->ptr_o, ptr_o);
            Py_XSETREF(s->start_o, start_o);
            s->addr = a;
        }
        memcpy(slot, &s->addr, 8);
        if (s->code == C_PTR_LEN) {
            PyObject *len_o = SLOT(view, off_buffer_length);
            if (len_o == NULL || !pack_int(slots + s->offset2, len_o, s->size))
                goto fallback;
        }
        toks[nuses] = tok;
        wrs[nuses] = writes;
        nuses++;
    }
    if (nuses == 0)
        goto fallback;  /* no array: Python picks the device */
    if (p->call != NULL) {  /* overlapping arrays, either written: Python raises */
        for (Py_ssize_t i = 0; i < nuses; i++)
            for (Py_ssize_t j = i + 1; j < nuses; j++) {
                if (SLOT(toks[i], off_tok_alloc) != SLOT(toks[j], off_tok_alloc) ||
                    !(wrs[i] || wrs[j]))
                    continue;
                long long a0 = PyLong_AsLongLong(SLOT(toks[i], off_tok_start));
                long long a1 = PyLong_AsLongLong(SLOT(toks[i], off_tok_stop));
                long long b0 = PyLong_AsLongLong(SLOT(toks[j], off_tok_start));
                long long b1 = PyLong_AsLongLong(SLOT(toks[j], off_tok_stop));
                if (PyErr_Occurred() || (a0 < b1 && b0 < a1 && a0 < a1 && b0 < b1))
                    goto fallback;
            }
    }
    /* The leases, as submit()'s `uses`: the stream's newest compiled submission's list when it
       names the same tokens the same way (lists of uses are never mutated; sharing one also
       lets retirement visit its trackers once), else a new one. */
    PyObject *cached = SLOT(stream, off_stream_cached_uses);
    if (cached != NULL && PyList_CheckExact(cached) && PyList_GET_SIZE(cached) == nuses) {
        Py_ssize_t i = 0;
        for (; i < nuses; i++) {
            PyObject *u = PyList_GET_ITEM(cached, i);
            if (PyTuple_GET_ITEM(u, 0) != toks[i] ||
                PyTuple_GET_ITEM(u, 1) != (wrs[i] ? Py_True : Py_False))
                break;
        }
        if (i == nuses) {
            Py_INCREF(cached);
            uses = cached;
        }
    }
    if (uses == NULL) {
        if ((uses = PyList_New(nuses)) == NULL)
            goto raise;
        for (Py_ssize_t i = 0; i < nuses; i++) {
            PyObject *use = PyTuple_Pack(2, toks[i], wrs[i] ? Py_True : Py_False);
            if (use == NULL)
                goto raise;
            PyList_SET_ITEM(uses, i, use);
        }
    }

    /* under core_lock, as submit() */
    if (obj_len(pending_warnings) || obj_len(deferred_errors))
        goto fallback;
    if (call_lock(lock_acquire) < 0)
        goto raise;
    if (obj_len(staged) || SLOT(stream, off_stream_capture) != Py_None ||
        SLOT(impl, p->off_impl_capturing) != Py_False)
        goto fallback_locked;
    PyObject *handle_o = SLOT(impl, p->off_impl_handle);
    if (handle_o == NULL || !PyLong_CheckExact(handle_o))
        goto fallback_locked;
    void *hstream = (void *)(uintptr_t)PyLong_AsUnsignedLongLong(handle_o);
    if (PyErr_Occurred()) { PyErr_Clear(); goto fallback_locked; }
    /* each lease's _StreamUse of this stream (borrowed: trackers change only under core_lock,
       which this thread holds until the leases are recorded; a destructor run meanwhile
       stages its release), or NULL when it has none yet */
    PyObject *sus[MAX_ARGS];
    char elsewhere[MAX_ARGS];  /* other streams have unfinished work on this lease's allocation */
    int any_elsewhere = 0;
    for (Py_ssize_t i = 0; i < nuses; i++) {
        PyObject *tok = PyTuple_GET_ITEM(PyList_GET_ITEM(uses, i), 0);
        if (SLOT(tok, off_tok_live) != Py_True)
            goto fallback_locked;
        PyObject *tracker = SLOT(SLOT(tok, off_tok_alloc), off_alloc_tracker);
        if (tracker == NULL || Py_TYPE(tracker) != TrackerType)
            goto fallback_locked;
        PyObject *held = SLOT(tracker, off_tracker_uses);
        if (held == NULL || !PyDict_CheckExact(held))
            goto fallback_locked;
        Py_ssize_t nh = PyDict_GET_SIZE(held);
        PyObject *su = nh ? PyDict_GetItemWithError(held, stream) : NULL;
        if (su == NULL && PyErr_Occurred()) {
            PyErr_Clear();
            goto fallback_locked;
        }
        sus[i] = su;
        elsewhere[i] = nh > (su != NULL);  /* AccessTracker.elsewhere_locked */
        any_elsewhere |= elsewhere[i];
    }
    if (any_elsewhere) {
        int r = order_after_others(stream, impl, uses, elsewhere, nuses);
        if (r == 0)
            goto fallback_locked;
        if (r < 0)
            goto raise_locked;
    }
    if (p->call != NULL) {
        PyObject *g3 = p->grid3;
        if (g3 == NULL || PyLong_AsUnsignedLong(PyTuple_GET_ITEM(g3, 0)) != g[0] ||
            PyLong_AsUnsignedLong(PyTuple_GET_ITEM(g3, 1)) != g[1] ||
            PyLong_AsUnsignedLong(PyTuple_GET_ITEM(g3, 2)) != g[2]) {
            if ((g3 = Py_BuildValue("(kkk)", (unsigned long)g[0], (unsigned long)g[1],
                                    (unsigned long)g[2])) == NULL)
                goto raise_locked;
            Py_XSETREF(p->grid3, g3);
        }
        Py_INCREF(g3);  /* (the call may run code that replaces p->grid3) */
        PyObject *cargs[4] = {handle_o, g3, p->kernel, call_args};
        PyObject *r = PyObject_Vectorcall(p->call, cargs, 4, NULL);
        Py_DECREF(g3);
        if (r == NULL)
            goto raise_locked;  /* as when submit()'s enqueue() raises: no lease taken */
        Py_DECREF(r);
        Py_CLEAR(call_args);
    } else if (p->launch(p->func, g[0], g[1], g[2], b[0], b[1], b[2], (unsigned)shmem, hstream,
                         params, NULL) != 0) {
        /* the kernel did not run; Python launches again and reports the error (waits made
           above for other streams are made again: waiting twice on an event changes nothing) */
        goto fallback_locked;
    }

    /* from here on the work is enqueued: no more fallbacks */
    PyObject *marker = NULL, *sub = NULL, *fut = NULL, *retired = NULL, *keeps = NULL;
    PyObject *open = SLOT(impl, p->off_impl_open);
    long count = as_long(SLOT(impl, p->off_impl_count));
    if (open != NULL && open != Py_None && count >= 1 && count + 1 < p->marker_batch) {
        PyObject *c = PyLong_FromLong(count + 1);  /* join the open marker */
        if (c == NULL)
            goto error_locked;
        slot_set(impl, p->off_impl_count, c);
        Py_DECREF(c);
        Py_INCREF(open);
        marker = open;
    } else {
        marker = PyObject_CallOneArg(p->submit_marker, impl);
        if (marker == NULL)
            goto error_locked;
    }
    long seq = as_long(SLOT(stream, off_stream_seq)) + 1;
    PyObject *seq_o = PyLong_FromLong(seq);
    if (seq_o == NULL)
        goto error_locked;
    slot_set(stream, off_stream_seq, seq_o);
    /* What the work keeps: the kernel, and each token's `keep` unless it is the token's own
       allocation (which the token, held by `uses` just as long, keeps anyway). */
    for (Py_ssize_t i = 0; i < nuses; i++) {
        PyObject *tok = PyTuple_GET_ITEM(PyList_GET_ITEM(uses, i), 0);
        PyObject *keep = SLOT(tok, off_tok_keep);
        if (keep != NULL && keep != Py_None && keep != SLOT(tok, off_tok_alloc)) {
            if (keeps == NULL) {
                keeps = PyList_New(1);
                if (keeps == NULL)
                    goto error_seq;
                Py_INCREF(p->kernel);
                PyList_SET_ITEM(keeps, 0, p->kernel);
            }
            if (PyList_Append(keeps, keep) < 0)
                goto error_keeps;
        }
    }
    if (keeps == NULL) {
        keeps = p->keep_kernel;
        Py_INCREF(keeps);
    }
    for (Py_ssize_t i = 0; i < nuses; i++) {
        PyObject *use = PyList_GET_ITEM(uses, i);
        PyObject *tok = PyTuple_GET_ITEM(use, 0);
        int writes = PyTuple_GET_ITEM(use, 1) == Py_True;
        /* AccessTracker.record_locked */
        PyObject *start_o = SLOT(tok, off_tok_start), *stop_o = SLOT(tok, off_tok_stop);
        long long lo = PyLong_AsLongLong(start_o), hi = PyLong_AsLongLong(stop_o);
        if (lo >= hi)
            continue;
        PyObject *tracker = SLOT(SLOT(tok, off_tok_alloc), off_alloc_tracker);
        PyObject *su = sus[i];
        if (su != NULL && Py_TYPE(su) == StreamUseType) {
            PyObject *entries = SLOT(su, writes ? off_use_writes : off_use_reads);
            if (entries != NULL && PyList_CheckExact(entries) && PyList_GET_SIZE(entries) == 1) {
                PyObject *e = PyList_GET_ITEM(entries, 0);
                if (PyList_CheckExact(e) && PyList_GET_SIZE(e) == 4) {
                    long long elo = PyLong_AsLongLong(PyList_GET_ITEM(e, 0));
                    long long ehi = PyLong_AsLongLong(PyList_GET_ITEM(e, 1));
                    if (!PyErr_Occurred() && elo <= lo && hi <= ehi) {
                        Py_INCREF(seq_o);
                        PyList_SetItem(e, 2, seq_o);
                        Py_INCREF(marker);
                        PyList_SetItem(e, 3, marker);
                        continue;
                    }
                    PyErr_Clear();
                }
            }
        }
        PyObject *r = PyObject_CallMethodObjArgs(tracker, str_record_locked, stream,
                                                 writes ? Py_True : Py_False, start_o, stop_o,
                                                 seq_o, marker, NULL);
        if (r == NULL)
            goto error_keeps;
        Py_DECREF(r);
    }
    /* File the launch: into the stream's newest submission when that one shares its marker,
       its lease list and its keep (Submission.count: they finish together, so they retire
       together -- and retiring a batch of launches costs what retiring one does), else into a
       new Submission(stream, seq, marker, keeps, uses, label), as its __init__. */
    PyObject *pending = SLOT(stream, off_stream_pending);
    int became_active = 0;
    Py_ssize_t npending = PyObject_Size(pending);
    if (npending < 0)
        goto error_keeps;
    if (npending > 0) {
        PyObject *last = PySequence_GetItem(pending, npending - 1);  /* deque: O(1) at the end */
        if (last == NULL)
            goto error_keeps;
        if (Py_TYPE(last) == SubmissionType && SLOT(last, off_sub_marker) == marker &&
            SLOT(last, off_sub_uses) == uses && SLOT(last, off_sub_keep) == keeps &&
            SLOT(last, off_sub_label) == p->label && as_long(SLOT(last, off_sub_state)) == 0) {
            long cnt = as_long(SLOT(last, off_sub_count));
            PyObject *c = cnt >= 1 ? PyLong_FromLong(cnt + 1) : NULL;
            if (c != NULL) {
                slot_set(last, off_sub_count, c);
                Py_DECREF(c);
                slot_set(last, off_sub_seq, seq_o);
                sub = last;  /* (the reference GetItem gave) */
            } else {
                PyErr_Clear();
            }
        }
        if (sub == NULL)
            Py_DECREF(last);
    }
    if (sub == NULL) {
        sub = SubmissionType->tp_alloc(SubmissionType, 0);
        if (sub == NULL)
            goto error_keeps;
        slot_set(sub, off_sub_stream, stream);
        slot_set(sub, off_sub_seq, seq_o);
        slot_set(sub, off_sub_marker, marker);
        slot_set(sub, off_sub_keep, keeps);
        slot_set(sub, off_sub_uses, uses);
        PyObject *zero = PyLong_FromLong(0);  /* PENDING */
        slot_set(sub, off_sub_state, zero);
        Py_XDECREF(zero);
        slot_set(sub, off_sub_callbacks, Py_None);
        slot_set(sub, off_sub_value, Py_None);
        slot_set(sub, off_sub_label, p->label);
        slot_set(sub, off_sub_count, one);
        PyObject *cargs[2] = {pending, sub};  /* deque.append(pending, sub) */
        PyObject *r = PyObject_Vectorcall(deque_append, cargs, 2, NULL);
        if (r == NULL)
            goto error_sub;
        Py_DECREF(r);
        became_active = npending == 0;
        if (became_active && PySet_Add(active_set, stream) < 0)
            goto error_sub;
    }
    Py_CLEAR(keeps);
    slot_set(stream, off_stream_cached_uses, uses);  /* cleared when this submission retires */
    slot_set(stream, off_stream_cached_seq, seq_o);
    Py_ssize_t counts[2] = {off_cnt_in_flight, off_cnt_submitted};  /* += 1 each */
    for (int k = 0; k < 2; k++) {
        PyObject *v = SLOT(counters, counts[k]);
        PyObject *v1 = v ? PyNumber_Add(v, one) : NULL;
        if (v1 == NULL)
            goto error_sub;
        slot_set(counters, counts[k], v1);
        Py_DECREF(v1);
    }
    if (sweep_every > 0 && seq % sweep_every == 0) {
        PyObject *fn = PyDict_GetItemWithError(submission_globals, str_sweep_locked);
        retired = fn ? PyObject_CallFunctionObjArgs(fn, stream, Py_False, NULL) : NULL;
        if (retired == NULL)
            goto error_sub;
    }
    Py_DECREF(seq_o);
    Py_DECREF(marker);
    Py_DECREF(uses);
    if (call_lock(lock_release) < 0) {
        Py_XDECREF(retired);
        Py_DECREF(sub);
        return NULL;
    }
    /* outside the lock, as submit() */
    if (retired != NULL) {
        if (PyObject_IsTrue(retired) == 1) {
            PyObject *fn = PyDict_GetItemWithError(submission_globals, str_finish);
            PyObject *r2 = fn ? PyObject_CallOneArg(fn, retired) : NULL;
            if (r2 == NULL) {
                Py_DECREF(retired);
                Py_DECREF(sub);
                return NULL;
            }
            Py_DECREF(r2);
        }
        Py_DECREF(retired);
    }
    PyObject *poke = NULL;
    if (PyList_GET_ITEM(retirer_running, 0) != Py_True)
        poke = str_retirer_ensure;
    else if (became_active && PyList_GET_ITEM(retirer_idle, 0) == Py_True)
        poke = str_retirer_wake;
    if (poke != NULL) {
        PyObject *fn = PyDict_GetItemWithError(submission_globals, poke);
        PyObject *r2 = fn ? PyObject_CallNoArgs(fn) : NULL;
        if (r2 == NULL) {
            Py_DECREF(sub);
            return NULL;
        }
        Py_DECREF(r2);
    }
    fut = FutureType->tp_alloc(FutureType, 0);
    if (fut != NULL)
        slot_set(fut, off_future_s, sub);
    Py_DECREF(sub);
    return fut;

error_sub:
    Py_DECREF(sub);
error_keeps:
    Py_XDECREF(keeps);
error_seq:
    Py_DECREF(seq_o);
error_locked:
    /* The work was enqueued but could not be tracked -- as when submit()'s enqueue() raises
       after launching (a failed marker). Only allocation failures get here. */
    Py_XDECREF(marker);
    Py_DECREF(uses);
    {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        call_lock(lock_release);
        PyErr_Restore(et, ev, tb);
    }
    return NULL;

raise_locked:
    {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        call_lock(lock_release);
        PyErr_Restore(et, ev, tb);
    }
raise:  /* before any side effect, an exception set */
    Py_XDECREF(uses);
    Py_XDECREF(call_args);
    return NULL;

fallback_locked:
    if (call_lock(lock_release) < 0) {
        Py_DECREF(uses);
        Py_XDECREF(call_args);
        return NULL;
    }
fallback:
    Py_XDECREF(uses);
    Py_XDECREF(call_args);
    PyErr_Clear();
    Py_RETURN_NONE;
}

/* The plan is held for the whole launch: Python code that runs meanwhile (a finalizer, the
   marker's record) could drop it from `plans`. */
static PyObject *
launch_impl(PyObject *kernel, PyObject *grid, PyObject *block, PyObject *const *argv,
            Py_ssize_t n, PyObject *stream, PyObject *shmem_o)
{
    if (!configured || !enabled)
        Py_RETURN_NONE;
    PyObject *pl = PyDict_GetItemWithError(plans, kernel);  /* borrowed */
    if (pl == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_INCREF(pl);
    PyObject *r = launch_with_plan((LaunchPlan *)pl, grid, block, argv, n, stream, shmem_o);
    Py_DECREF(pl);
    return r;
}

static PyObject *
fast_launch(PyObject *mod, PyObject *const *a, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyTuple_Check(a[3])) {
        PyErr_SetString(PyExc_TypeError, "fast_launch(kernel, grid, block, args, stream, shared_mem)");
        return NULL;
    }
    return launch_impl(a[0], a[1], a[2], &PyTuple_GET_ITEM(a[3], 0), PyTuple_GET_SIZE(a[3]),
                       a[4], a[5]);
}

/* ---- LaunchEntry: sharedmem.launch itself, when the extension is built ------------------------
 * Calls fast_launch straight from the caller's arguments (no Python frame binding *args and
 * keywords), and the Python launch() with the very same arguments whenever fast_launch declines. */
typedef struct {
    PyObject_HEAD
    PyObject *python;  /* sharedmem.launch.launch */
    vectorcallfunc vectorcall;
} LaunchEntry;

static PyObject *str_stream, *str_shared_mem, *str_policy;

static PyObject *
entry_vectorcall(LaunchEntry *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n >= 3) {
        PyObject *stream = Py_None, *shmem = NULL, *policy = Py_None;
        int ok = 1;
        Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
        for (Py_ssize_t i = 0; i < nk && ok; i++) {
            PyObject *k = PyTuple_GET_ITEM(kwnames, i), *v = args[n + i];
            if (k == str_stream)
                stream = v;
            else if (k == str_shared_mem)
                shmem = v;
            else if (k == str_policy)
                policy = v;
            else
                ok = 0;  /* (a keyword not interned like ours, or unknown: Python sorts it out) */
        }
        if (ok && policy == Py_None) {
            PyObject *zero = NULL;
            if (shmem == NULL)
                shmem = zero = PyLong_FromLong(0);
            PyObject *fut = shmem ? launch_impl(args[0], args[1], args[2], args + 3, n - 3,
                                                stream, shmem) : NULL;
            Py_XDECREF(zero);
            if (fut == NULL)
                return NULL;
            if (fut != Py_None)
                return fut;
            Py_DECREF(fut);
        }
    }
    if (self->python == NULL) {  /* (cleared by the garbage collector at shutdown) */
        PyErr_SetString(PyExc_RuntimeError, "sharedmem.launch is being torn down");
        return NULL;
    }
    return PyObject_Vectorcall(self->python, args, nargsf, kwnames);
}

static PyObject *
entry_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    PyObject *python;
    if (!PyArg_ParseTuple(args, "O:LaunchEntry", &python))
        return NULL;
    LaunchEntry *self = (LaunchEntry *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(python);
    self->python = python;
    self->vectorcall = (vectorcallfunc)entry_vectorcall;
    return (PyObject *)self;
}

static int
entry_traverse(LaunchEntry *self, visitproc visit, void *arg)
{
    Py_VISIT(self->python);
    return 0;
}

static int
entry_clear(LaunchEntry *self)
{
    Py_CLEAR(self->python);
    return 0;
}

static void
entry_dealloc(LaunchEntry *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->python);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
entry_getattro(LaunchEntry *self, PyObject *name)
{
    /* __doc__, __name__, __qualname__, __module__, __wrapped__...: the Python function's */
    PyObject *r = PyObject_GenericGetAttr((PyObject *)self, name);
    if (r != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return r;
    PyErr_Clear();
    if (self->python == NULL) {
        PyErr_SetObject(PyExc_AttributeError, name);
        return NULL;
    }
    if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__wrapped__") == 0) {
        Py_INCREF(self->python);
        return self->python;
    }
    return PyObject_GetAttr(self->python, name);
}

static PyObject *
entry_repr(LaunchEntry *self)
{
    return self->python ? PyUnicode_FromFormat("<compiled %R>", self->python)
                        : PyUnicode_FromString("<compiled launch (cleared)>");
}

static PyObject *
entry_get_doc(LaunchEntry *self, void *c)
{
    if (self->python == NULL)
        Py_RETURN_NONE;
    return PyObject_GetAttrString(self->python, "__doc__");
}

static PyGetSetDef entry_getset[] = {
    {"__doc__", (getter)entry_get_doc, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LaunchEntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sharedmem._speedups.LaunchEntry",
    .tp_basicsize = sizeof(LaunchEntry),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(LaunchEntry, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = entry_new,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_traverse = (traverseproc)entry_traverse,
    .tp_clear = (inquiry)entry_clear,
    .tp_getattro = (getattrofunc)entry_getattro,
    .tp_repr = (reprfunc)entry_repr,
    .tp_getset = entry_getset,
};

/* ---- IntentBase: the storage of sharedmem.launch.Intent (In, Out, ...) ----------------------
 * A launch argument's wrapper is made on every launch: a C constructor makes it about half as
 * expensive as a Python __init__. Same behaviour as launch._PyIntentBase. */
typedef struct {
    PyObject_HEAD
    PyObject *obj;
} IntentObject;

static PyTypeObject IntentBaseType;
static PyObject *str_refuse_nested;

static PyObject *
intent_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    PyObject *obj;
    if (kw != NULL && PyDict_GET_SIZE(kw)) {
        PyErr_Format(PyExc_TypeError, "%s() takes no keyword arguments", type->tp_name);
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, type->tp_name, 1, 1, &obj))
        return NULL;
    if (PyObject_TypeCheck(obj, &IntentBaseType)) {  /* the class method raises KernelError */
        PyObject *r = PyObject_CallMethodOneArg((PyObject *)type, str_refuse_nested, obj);
        Py_XDECREF(r);
        if (r != NULL)
            PyErr_SetString(PyExc_TypeError, "an argument takes one intent");
        return NULL;
    }
    IntentObject *self = (IntentObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(obj);
    self->obj = obj;
    return (PyObject *)self;
}

/* In(x), Out(x), InOut(x), Atomic(x) called without an argument tuple: configure() installs
   this as those four classes' tp_vectorcall (never inherited by subclasses). */
static PyObject *
intent_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyTypeObject *t = (PyTypeObject *)type;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames)) {
        PyErr_Format(PyExc_TypeError, "%s() takes no keyword arguments", t->tp_name);
        return NULL;
    }
    if (n != 1 || PyObject_TypeCheck(args[0], &IntentBaseType)) {  /* the errors, as tp_new */
        PyObject *tuple = PyTuple_New(n);
        if (tuple == NULL)
            return NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_INCREF(args[i]);
            PyTuple_SET_ITEM(tuple, i, args[i]);
        }
        PyObject *r = intent_new(t, tuple, NULL);
        Py_DECREF(tuple);
        return r;
    }
    IntentObject *self = (IntentObject *)t->tp_alloc(t, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(args[0]);
    self->obj = args[0];
    return (PyObject *)self;
}

static int
intent_init(PyObject *self, PyObject *args, PyObject *kw)
{
    return 0;  /* everything is done by tp_new */
}

static int
intent_traverse(IntentObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->obj);  /* (subtype_traverse visits a heap subclass itself) */
    return 0;
}

static int
intent_clear(IntentObject *self)
{
    Py_CLEAR(self->obj);
    return 0;
}

static void
intent_dealloc(IntentObject *self)
{
    /* instances are of heap subclasses: subtype_dealloc calls this, then releases the type */
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef intent_members[] = {
    {"obj", T_OBJECT_EX, offsetof(IntentObject, obj), 0, "The wrapped argument."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject IntentBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sharedmem._speedups.IntentBase",
    .tp_doc = "Storage of a launch argument's intent wrapper (see sharedmem.launch.Intent).",
    .tp_basicsize = sizeof(IntentObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = intent_new,
    .tp_init = intent_init,
    .tp_dealloc = (destructor)intent_dealloc,
    .tp_traverse = (traverseproc)intent_traverse,
    .tp_clear = (inquiry)intent_clear,
    .tp_members = intent_members,
};

/* ---- DLPack export capsules (interop.dlpack) ------------------------------------------------
 * One allocation: a hidden header (the view token the export holds), the managed tensor
 * (DLPack 1.0 versioned, or legacy), then shape and strides. The deleter -- called by the
 * consumer, from any thread, or by the capsule's destructor when nobody consumed it --
 * releases the token (ViewToken.release) and frees the block. */
typedef struct { PyObject *token; } DLHidden;
typedef struct { void *data; int32_t device_type, device_id; int32_t ndim; uint8_t code, bits;
                 uint16_t lanes; int64_t *shape, *strides; uint64_t byte_offset; } DLTensorC;
typedef struct { DLTensorC dl_tensor; void *manager_ctx; void (*deleter)(void *); } DLLegacyC;
typedef struct { uint32_t major, minor; void *manager_ctx; void (*deleter)(void *);
                 uint64_t flags; DLTensorC dl_tensor; } DLVersionedC;
#define DL_HIDDEN_SIZE ((sizeof(DLHidden) + 15) / 16 * 16)
static PyObject *str_release;

static void
dl_deleter(void *managed)
{
    if (managed == NULL)
        return;
    char *block = (char *)managed - DL_HIDDEN_SIZE;
    DLHidden *h = (DLHidden *)block;
    if (Py_IsInitialized()) {  /* (after interpreter shutdown: the token is gone anyway) */
        PyGILState_STATE st = PyGILState_Ensure();
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);  /* (a destructor may run while an error is set) */
        PyObject *r = PyObject_CallMethodNoArgs(h->token, str_release);
        if (r == NULL)
            PyErr_WriteUnraisable(h->token);
        Py_XDECREF(r);
        Py_DECREF(h->token);
        PyErr_Restore(et, ev, tb);
        PyGILState_Release(st);
    }
    PyMem_RawFree(block);
}

static void
dl_capsule_destructor(PyObject *cap)
{
    /* consumed capsules were renamed ("used_..."): the consumer owns the deleter call */
    const char *names[2] = {"dltensor_versioned", "dltensor"};
    for (int i = 0; i < 2; i++)
        if (PyCapsule_IsValid(cap, names[i])) {
            dl_deleter(PyCapsule_GetPointer(cap, names[i]));
            return;
        }
}

/* dlpack_capsule(token, data, device_type, device_id, code, bits, shape, strides, versioned,
 *                flags) -> a capsule holding `token` until its deleter runs */
static PyObject *
dlpack_capsule(PyObject *mod, PyObject *args)
{
    PyObject *token, *shape, *strides;
    unsigned long long data, flags;
    int dev_type, dev_id, code, bits, versioned;
    if (!PyArg_ParseTuple(args, "OKiiiiO!O!pK", &token, &data, &dev_type, &dev_id, &code,
                          &bits, &PyTuple_Type, &shape, &PyTuple_Type, &strides, &versioned,
                          &flags))
        return NULL;
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (PyTuple_GET_SIZE(strides) != ndim || ndim > 64) {
        PyErr_SetString(PyExc_ValueError, "dlpack_capsule: shape and strides differ in length");
        return NULL;
    }
    size_t head = versioned ? sizeof(DLVersionedC) : sizeof(DLLegacyC);
    head = (head + 15) / 16 * 16;
    char *block = PyMem_RawCalloc(1, DL_HIDDEN_SIZE + head + 16 * (size_t)(ndim ? ndim : 1));
    if (block == NULL)
        return PyErr_NoMemory();
    char *managed = block + DL_HIDDEN_SIZE;
    int64_t *sh = (int64_t *)(managed + head), *st = sh + ndim;
    for (Py_ssize_t i = 0; i < ndim; i++) {
        sh[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        st[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, i));
    }
    if (PyErr_Occurred()) {
        PyMem_RawFree(block);
        return NULL;
    }
    DLTensorC *t;
    if (versioned) {
        DLVersionedC *v = (DLVersionedC *)managed;
        v->major = 1; v->minor = 0;
        v->deleter = dl_deleter;
        v->flags = flags;
        t = &v->dl_tensor;
    } else {
        DLLegacyC *l = (DLLegacyC *)managed;
        l->deleter = dl_deleter;
        t = &l->dl_tensor;
    }
    t->data = (void *)(uintptr_t)data;
    t->device_type = dev_type; t->device_id = dev_id;
    t->ndim = (int32_t)ndim;
    t->code = (uint8_t)code; t->bits = (uint8_t)bits; t->lanes = 1;
    t->shape = sh; t->strides = st;
    t->byte_offset = 0;
    PyObject *cap = PyCapsule_New(managed, versioned ? "dltensor_versioned" : "dltensor",
                                  dl_capsule_destructor);
    if (cap == NULL) {
        PyMem_RawFree(block);
        return NULL;
    }
    Py_INCREF(token);
    ((DLHidden *)block)->token = token;
    return cap;
}

/* ---- module functions -------------------------------------------------------------------- */
static PyObject *
cfg_get(PyObject *cfg, const char *key)  /* new reference */
{
    PyObject *v = PyDict_GetItemString(cfg, key);
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "configure: missing %s", key);
        return NULL;
    }
    Py_INCREF(v);
    return v;
}

#define GET(var, key) do { if ((var = (void *)cfg_get(cfg, key)) == NULL) return NULL; } while (0)
#define OFF(var, type, name) \
    do { if ((var = slot_offset((PyObject *)(type), name)) < 0) return NULL; } while (0)

static PyObject *
configure(PyObject *mod, PyObject *cfg)
{
    if (!PyDict_Check(cfg)) {
        PyErr_SetString(PyExc_TypeError, "configure(dict)");
        return NULL;
    }
    if (configured) {
        PyErr_SetString(PyExc_RuntimeError, "sharedmem._speedups is configured once");
        return NULL;
    }
    PyObject *lock, *sweep;
    GET(lock, "core_lock");
    if ((lock_acquire = PyObject_GetAttrString(lock, "acquire")) == NULL ||
        (lock_release = PyObject_GetAttrString(lock, "release")) == NULL)
        return NULL;
    Py_DECREF(lock);
    GET(staged, "staged");
    GET(pending_warnings, "pending_warnings");
    GET(deferred_errors, "deferred_errors");
    GET(active_set, "active");
    GET(counters, "counters");
    GET(retirer_running, "retirer_running");
    GET(retirer_idle, "retirer_idle");
    GET(submission_globals, "submission_globals");
    GET(access_globals, "access_globals");
    GET(SubmissionType, "Submission");
    GET(FutureType, "DeviceFuture");
    GET(StreamType, "Stream");
    GET(TokenType, "ViewToken");
    GET(AllocationType, "Allocation");
    GET(TrackerType, "AccessTracker");
    GET(StreamUseType, "StreamUse");
    GET(InType, "In");
    GET(OutType, "Out");
    GET(InOutType, "InOut");
    GET(AtomicType, "Atomic");
    PyTypeObject *intents[4] = {InType, OutType, InOutType, AtomicType};
    for (int i = 0; i < 4; i++) {  /* made by tp_new alone: then calls may skip the tuple */
        PyTypeObject *t = intents[i];
        if (PyType_IsSubtype(t, &IntentBaseType) && t->tp_new == intent_new &&
            t->tp_init == intent_init)
            t->tp_vectorcall = intent_vectorcall;
    }
    PyObject *view, *buffer;
    GET(view, "View");
    GET(buffer, "Buffer");
    GET(sweep, "sweep_every");
    sweep_every = PyLong_AsLong(sweep);
    Py_DECREF(sweep);
    if (!PyList_CheckExact(retirer_running) || !PyList_CheckExact(retirer_idle) ||
        !PySet_CheckExact(active_set) || !PyDict_CheckExact(access_globals) ||
        !PyDict_CheckExact(submission_globals)) {
        PyErr_SetString(PyExc_TypeError, "configure: unexpected container types");
        return NULL;
    }
    if ((deque_append = PyObject_GetAttrString((PyObject *)Py_TYPE(staged), "append")) == NULL)
        return NULL;  /* (`staged` is a collections.deque, like every Stream._pending) */
    OFF(off_intent_obj, InType, "obj");
    OFF(off_cnt_in_flight, (PyObject *)Py_TYPE(counters), "in_flight");
    OFF(off_cnt_submitted, (PyObject *)Py_TYPE(counters), "submitted");
    OFF(off_view_token, view, "_token");
    OFF(off_view_state, view, "_state");
    OFF(off_view_derived, view, "_derived");
    OFF(off_buffer_length, buffer, "_length");
    OFF(off_tok_alloc, TokenType, "allocation");
    OFF(off_tok_start, TokenType, "start");
    OFF(off_tok_stop, TokenType, "stop");
    OFF(off_tok_writable, TokenType, "writable");
    OFF(off_tok_keep, TokenType, "keep");
    OFF(off_tok_live, TokenType, "live");
    OFF(off_alloc_device, AllocationType, "device");
    OFF(off_alloc_ptr, AllocationType, "ptr");
    OFF(off_alloc_tracker, AllocationType, "tracker");
    OFF(off_tracker_uses, TrackerType, "_uses");
    OFF(off_use_reads, StreamUseType, "reads");
    OFF(off_use_writes, StreamUseType, "writes");
    OFF(off_stream_device, StreamType, "device");
    OFF(off_stream_impl, StreamType, "_impl");
    OFF(off_stream_pending, StreamType, "_pending");
    OFF(off_stream_seq, StreamType, "_seq");
    OFF(off_stream_cached_uses, StreamType, "_cached_uses");
    OFF(off_stream_cached_seq, StreamType, "_cached_seq");
    OFF(off_stream_capture, StreamType, "_capture");
    OFF(off_sub_stream, SubmissionType, "stream");
    OFF(off_sub_seq, SubmissionType, "seq");
    OFF(off_sub_marker, SubmissionType, "marker");
    OFF(off_sub_keep, SubmissionType, "keep");
    OFF(off_sub_uses, SubmissionType, "uses");
    OFF(off_sub_state, SubmissionType, "state");
    OFF(off_sub_callbacks, SubmissionType, "callbacks");
    OFF(off_sub_value, SubmissionType, "value");
    OFF(off_sub_label, SubmissionType, "_label");
    OFF(off_sub_count, SubmissionType, "count");
    OFF(off_future_s, FutureType, "_s");
    Py_DECREF(view);
    Py_DECREF(buffer);
    configured = 1;
    Py_RETURN_NONE;
}

static PyObject *
remember(PyObject *mod, PyObject *const *a, Py_ssize_t n)
{
    if (n != 2 || Py_TYPE(a[1]) != &LaunchPlanType) {
        PyErr_SetString(PyExc_TypeError, "remember(kernel, plan)");
        return NULL;
    }
    if (PyDict_GET_SIZE(plans) >= MAX_PLANS)  /* bounded: each plan keeps its kernel alive */
        PyDict_Clear(plans);
    if (PyDict_SetItem(plans, a[0], a[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
lookup(PyObject *mod, PyObject *kernel)
{
    PyObject *p = PyDict_GetItemWithError(plans, kernel);
    if (p == NULL) {
        if (PyErr_Occurred())
            PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_INCREF(p);
    return p;
}

static PyObject *
set_enabled(PyObject *mod, PyObject *on)
{
    int v = PyObject_IsTrue(on);
    if (v < 0)
        return NULL;
    enabled = v;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fast_launch", (PyCFunction)(void (*)(void))fast_launch, METH_FASTCALL,
     "fast_launch(kernel, grid, block, args, stream, shared_mem) -> DeviceFuture or None "
     "(None: not the common case; nothing was done)."},
    {"configure", configure, METH_O, "configure(dict): the runtime's objects and classes (once)."},
    {"remember", (PyCFunction)(void (*)(void))remember, METH_FASTCALL,
     "remember(kernel, plan): launch kernel through plan from now on."},
    {"lookup", lookup, METH_O, "lookup(kernel) -> the kernel's LaunchPlan, or None."},
    {"dlpack_capsule", dlpack_capsule, METH_VARARGS,
     "dlpack_capsule(token, data, device_type, device_id, code, bits, shape, strides, versioned, "
     "flags) -> a DLPack capsule holding token until its deleter runs (interop.dlpack)."},
    {"set_enabled", set_enabled, METH_O,
     "set_enabled(bool): False makes fast_launch decline every launch (the Python path runs)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "sharedmem._speedups",
    "The compiled launch path of sharedmem (optional; see sharedmem/_accel.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    if (PyType_Ready(&LaunchPlanType) < 0 || PyType_Ready(&IntentBaseType) < 0 ||
        PyType_Ready(&LaunchEntryType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    plans = PyDict_New();
    one = PyLong_FromLong(1);
    str_record_locked = PyUnicode_InternFromString("record_locked");
    str_release = PyUnicode_InternFromString("release");
    str_conflicts_locked = PyUnicode_InternFromString("conflicts_locked");
    str_unknown = PyUnicode_InternFromString("unknown");
    str_policy_name = PyUnicode_InternFromString("_policy");
    str_wait_marker = PyUnicode_InternFromString("wait_marker");
    str_sweep_locked = PyUnicode_InternFromString("_sweep_locked");
    str_finish = PyUnicode_InternFromString("finish");
    str_retirer_ensure = PyUnicode_InternFromString("_retirer_ensure");
    str_retirer_wake = PyUnicode_InternFromString("_retirer_wake");
    if (plans == NULL || one == NULL || str_record_locked == NULL || str_retirer_wake == NULL ||
        str_release == NULL || str_conflicts_locked == NULL || str_unknown == NULL ||
        str_policy_name == NULL || str_wait_marker == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    str_stream = PyUnicode_InternFromString("stream");
    str_shared_mem = PyUnicode_InternFromString("shared_mem");
    str_policy = PyUnicode_InternFromString("policy");
    Py_INCREF(&LaunchEntryType);
    if (str_stream == NULL || str_shared_mem == NULL || str_policy == NULL ||
        PyModule_AddObject(m, "LaunchEntry", (PyObject *)&LaunchEntryType) < 0) {
        Py_DECREF(&LaunchEntryType);
        Py_DECREF(m);
        return NULL;
    }
    str_refuse_nested = PyUnicode_InternFromString("_refuse_nested");
    Py_INCREF(&IntentBaseType);
    if (str_refuse_nested == NULL ||
        PyModule_AddObject(m, "IntentBase", (PyObject *)&IntentBaseType) < 0) {
        Py_DECREF(&IntentBaseType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&LaunchPlanType);
    if (PyModule_AddObject(m, "LaunchPlan", (PyObject *)&LaunchPlanType) < 0) {
        Py_DECREF(&LaunchPlanType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
