"""sharedmem's own host work per launch, with the CUDA driver stubbed out.

Runs the real CudaBackend and CuPy adapter against the fake driver of the test suite
(tests/fake_cuda.py) with the hot driver calls replaced by C no-ops, so what is timed is
sharedmem's own work alone, on the launch patterns users have: the same views reused, fresh
views (a move between launches), CuPy-style foreign arrays... Runs anywhere:

    python benchmarks/python_path.py            # both builds, each in its own process
    python benchmarks/python_path.py --this     # the build this process imports
    python benchmarks/python_path.py --this --only dlpack --calls 2000
                                                # one row, a fixed number of calls (for
                                                # callgrind: the difference of two counts)

Compare machines by running it on both; compare builds by the two tables.
"""
import os
import statistics
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(_ROOT, "tests"), _ROOT]

_STUBS = r"""
int launch_stub(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g,
                unsigned h, void *s, void **p, void **x) { return 0; }
int ctx_get_stub(void **out) { *out = (void *)0xC0; return 0; }
int record_stub(void *e, void *s) { return 0; }
int query_stub(void *e) { return 0; }
int wait_stub(void *s, void *e, unsigned f) { return 0; }
int graph_launch_stub(void *g, void *s) { return 0; }
int exchange_stub(int *mode) { *mode = 0; return 0; }
int capturing_stub(void *s, int *status) { *status = 0; return 0; }
long long cupy_current = 0;  /* CuPy's current stream, as its C entry point gives it */
long long get_stream_ptr_stub(int device_id) { return cupy_current; }
"""


def _c_stubs():
    """C no-ops for the driver entry points the launch path calls, or None without a C
    compiler (then ctypes-level no-ops: the numbers include ctypes' cost)."""
    import ctypes
    import tempfile
    d = tempfile.mkdtemp()
    src, lib = os.path.join(d, "stubs.c"), os.path.join(d, "stubs.so")
    with open(src, "w") as f:
        f.write(_STUBS)
    try:
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", src, "-o", lib], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return ctypes.CDLL(lib)


class _NullHot:
    """``backend.hot`` whose calls do nothing (C no-ops where a compiler is at hand)."""

    def __init__(self):
        import ctypes
        import types

        from sharedmem.backends.cuda import _HotDriver
        so = _c_stubs()
        self._so = so
        # (the real one, over the stub below: interpreted, asked on every launch)
        self.current_context = types.MethodType(_HotDriver.current_context, self)
        vp, ui = ctypes.c_void_p, ctypes.c_uint
        if so is not None:
            self.launch = so.launch_stub  # (no argtypes: as backend.hot's, see _HotDriver)
            self.record, self.query = so.record_stub, so.query_stub
            self.wait = so.wait_stub
            self.wait.argtypes = [vp, vp, ui]
            self._ctx_get = so.ctx_get_stub  # (for current_context: the real method's call)
            self._ctx_get.argtypes = [ctypes.POINTER(vp)]
            self.addresses = {n: ctypes.cast(getattr(so, s), vp).value for n, s in
                              (("cuLaunchKernel", "launch_stub"),
                               ("cuCtxGetCurrent", "ctx_get_stub"),
                               ("cuEventRecord", "record_stub"), ("cuEventQuery", "query_stub"),
                               ("cuStreamWaitEvent", "wait_stub"),
                               ("cuGraphLaunch", "graph_launch_stub"),
                               ("cuThreadExchangeStreamCaptureMode", "exchange_stub"),
                               ("cuStreamIsCapturing", "capturing_stub"))}
        else:
            self.launch = lambda *a: 0
            self.record = lambda *a: 0
            self.query = lambda *a: 0
            self.wait = lambda *a: 0
            self._ctx_get = lambda out: setattr(out, "value", 0xC0)
            self.addresses = {}

    def graph_launch(self, *a):
        return 0

    def exchange_capture_mode(self, mode):
        return 0



def _cupy_c_entry(cp):
    """Give stand-in CuPy ``cp`` the C entry point real CuPy exports for its current stream
    (``cupy_backends.cuda.stream.get_stream_ptr`` in its ``__pyx_capi__``, which the compiled
    build calls): a C stub returning a settable value. Returns that value (a ctypes
    c_longlong), or None without a C compiler (then the stand-in's Python call is timed)."""
    import ctypes
    import types
    so = _c_stubs()
    if so is None:
        return None
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                   ctypes.c_void_p]
    _cupy_c_entry.name = name = ctypes.create_string_buffer(b"intptr_t (int)")  # (kept)
    capi = types.ModuleType("cupy_backends.cuda.stream")
    capi.__pyx_capi__ = {"get_stream_ptr": new(ctypes.cast(so.get_stream_ptr_stub,
                                                           ctypes.c_void_p), name, None)}
    capi.so = so
    sys.modules["cupy_backends.cuda.stream"] = capi
    cp.cuda.get_current_stream.__module__ = "cupy.cuda.stream"  # (CuPy's own, as it says)
    return ctypes.c_longlong.in_dll(so, "cupy_current")


def per_call_us(fn, n=20000, reps=7):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def this_build():
    import numpy as np

    import sharedmem as sm
    import sharedmem.backends.cuda as bc
    from fake_cuda import CUresult, FakeDriver, RawKernel, fake_cupy
    drv = FakeDriver()
    bc.cu = drv
    bc._SUCCESS = CUresult.CUDA_SUCCESS
    bc._hot_driver = _NullHot
    sys.modules["cupy"] = fake_cupy()
    cupy_c = _cupy_c_entry(sys.modules["cupy"])
    backend = bc.CudaBackend(0)
    dev = object.__new__(sm.Device)
    dev._setup("cuda", 0, backend.name, ("fake-cuda", 1), backend)
    import sharedmem.device as sm_device
    sm_device._devices[("cuda", 0)] = dev  # (Device(0) is this one: CuPy-style arrays name it)
    code = 'extern "C" __global__ void k4(const float* a, const float* b, float* c, float* d, int n) { }\n' \
           'extern "C" __global__ void k16(' + ", ".join(f"float* p{i}" for i in range(16)) + ") { }\n"
    k = RawKernel(drv, "k4", ["Q", "Q", "Q", "Q", "i"], lambda *a: None, code)
    k16 = RawKernel(drv, "k16", ["Q"] * 16, lambda *a: None, code)
    n = 1024
    s = dev.create_stream("s")
    a, b, c, d, e = (sm.Buffer.empty(n, "float32", device=dev) for _ in range(5))
    many = [sm.Buffer.empty(n, "float32", device=dev) for _ in range(16)]
    o = sm.op(k, 8, 128, sm.In(a), sm.In(b), sm.Out(e), sm.Out(d), n)
    In, Out = sm.In, sm.Out
    state = {"c": c}

    def reused():
        sm.launch(k, 8, 128, In(a), In(b), Out(c), Out(d), n, stream=s)

    nn = np.int32(n)

    def reused_np():  # as run.py's launch rows pass the count: a NumPy scalar
        sm.launch(k, 8, 128, In(a), In(b), Out(c), Out(d), nn, stream=s)

    def fresh():  # a move between launches: new views every time
        t = sm.Tensor.from_buffer(state["c"], (n,))
        sm.launch(k, 8, 128, In(a), In(b), Out(t), Out(d), n, stream=s)
        state["c"] = t.into_buffer()

    def move_pair():
        t = sm.Tensor.from_buffer(state["c"], (n,))
        state["c"] = t.into_buffer()

    def submit_op():
        o.submit(s)

    def sixteen():
        sm.launch(k16, 8, 128, *many, stream=s)

    class _Mem:  # what a launch reads of a CuPy array's memory
        def __init__(self, ptr, size):
            self.ptr, self.size, self.mem = ptr, size, self

    class _Array(sys.modules["cupy"].ndarray):  # a CuPy-style array over fresh fake memory
        def __init__(self, nbytes):
            self._block = drv_block = sm.Buffer.empty(nbytes // 4, "float32", device=dev)
            self.data = _Mem(drv_block.ptr, nbytes)
            self.device = type("D", (), {"id": 0})()
            self.size, self.shape, self.strides, self.itemsize = nbytes // 4, (nbytes // 4,), (4,), 4

    sys.modules["cupy"].ndarray = _Array  # (their type is cupy.ndarray itself, as on a GPU)
    arrays = [_Array(4 * n) for _ in range(4)]

    class _ForeignStream:  # a CuPy-style stream object (cupy.cuda.Stream has .ptr)
        ptr = 0x5151

    foreign = _ForeignStream()

    def borrowed_stream():  # a foreign stream object passed as stream= on every launch
        sm.launch(k, 8, 128, In(a), In(b), Out(e), Out(d), n, stream=foreign)

    sys.modules["cupy"].current.ptr = s.handle  # (CuPy's current stream: a launch of CuPy
    # arrays on it waits for nothing, as run.py's row runs)
    if cupy_c is not None:
        cupy_c.value = s.handle

    def cupy_arrays():  # foreign arrays as arguments (learned on their first launch)
        sm.launch(k, 8, 128, In(arrays[0]), In(arrays[1]), Out(arrays[2]), Out(arrays[3]), n,
                  stream=s)

    # CuPy's pool: memory units of their own (CuPy allocates a block per new size class and
    # reuses freed ones; the fake driver's device memory is host memory)
    pool = np.zeros(1 << 20, np.float32)
    pool_base = pool.ctypes.data
    pool_at = [pool_base]

    class _Unit:  # CuPy's memory unit (its MemoryPointer and memory refer to no cycle)
        __slots__ = ("ptr", "size", "mem")

        def __init__(self, ptr, size, mem=None):
            self.ptr, self.size, self.mem = ptr, size, mem

    class _Chunk(_Array):  # an array in a memory unit of its own, as cupy.empty gives
        def __init__(self, ptr):
            self.data = _Unit(ptr, 4 * n, _Unit(ptr, 4 * n))
            self.device = arrays[0].device
            self.size, self.shape, self.strides, self.itemsize = n, (n,), (4,), 4

    def cupy_fresh():  # a new output array each launch: an import of its memory, let go
        p = pool_at[0] = pool_base + (pool_at[0] - pool_base + 4 * n) % (1 << 22)
        sm.launch(k, 8, 128, In(arrays[0]), In(arrays[1]), Out(_Chunk(p)), Out(arrays[3]), n,
                  stream=s)

    # A pipeline step as benchmarks/pipeline.py runs it on a GPU: a cuTile kernel on stream A,
    # a move, a CuPy kernel on stream B, a move back, a cuTile kernel on A (cuTile's launch a
    # no-op here: what is timed is sharedmem's work around it)
    import types
    tile_mod = types.ModuleType("cuda.tile")
    tile_mod.launch = lambda stream, grid, kernel, args: None
    cuda_mod = sys.modules.setdefault("cuda", types.ModuleType("cuda"))
    cuda_mod.tile = tile_mod
    sys.modules["cuda.tile"] = tile_mod
    from fake_cuda import TileKernel
    matmul, norm = TileKernel(lambda *a: None), TileKernel(lambda *a: None)
    sa, sb = dev.create_stream("A"), dev.create_stream("B")
    px, pw, pz = (sm.Tensor.from_buffer(sm.Buffer.empty(n, "float32", device=dev), (32, 32))
                  for _ in range(3))
    pipe = {"y": sm.Tensor.from_buffer(sm.Buffer.empty(n, "float32", device=dev), (32, 32))}
    bias = sm.Buffer.empty(n, "float32", device=dev)

    def pipeline_step():
        sm.launch(matmul, (4, 4, 1), None, In(px), In(pw), Out(pipe["y"]), stream=sa)
        yb = pipe["y"].into_buffer()
        sm.launch(k, 8, 128, In(bias), In(bias), Out(yb), Out(yb), n, stream=sb)
        pipe["y"] = y = sm.Tensor.from_buffer(yb, (32, 32))
        sm.launch(norm, (32, 1, 1), None, In(y), Out(pz), stream=sa)

    vadd = TileKernel(lambda *a: None)
    ta, tb, tc = (sm.Tensor.from_buffer(sm.Buffer.empty(n, "float32", device=dev), (n,))
                  for _ in range(3))

    def cutile():  # as run.py's cuTile row: 3 tensors and a constant
        sm.launch(vadd, (4,), None, In(ta), In(tb), Out(tc), 256, stream=sa)

    tensor = sm.Tensor.from_buffer(sm.Buffer.empty(n, "float32", device=dev), (32, 32))

    def dlpack():  # what cupy.from_dlpack asks of a producer; the capsule dropped at once
        tensor.__dlpack_device__()
        tensor.__dlpack__(stream=1, max_version=(1, 0))

    def cai():  # what cupy.asarray asks of a producer (it reads the property more than once)
        return tensor.__cuda_array_interface__

    gs = dev.create_stream("graph")
    ga, gb, gc, gd = (sm.Buffer.empty(n, "float32", device=dev) for _ in range(4))
    with sm.capture(gs) as g:
        for _ in range(4):
            sm.launch(k, 8, 128, In(ga), In(gb), Out(gc), Out(gd), n)

    def replay():  # the host time of one replay call (4 captured launches)
        g.replay(gs)

    # torch-style tensors: a stand-in module (sys.modules["torch"]) whose Tensor has torch's
    # accessors as plain methods, over one foreign segment as torch's caching allocator has
    # (imported once: what a tensor new to a launch finds); what is timed is sharedmem's work
    # around torch's accessors, which cost about as much as these here
    seg = np.zeros(1 << 20, np.float32)  # (the fake driver's device memory is host memory)
    base = seg.ctypes.data

    class _TorchTensor:
        __slots__ = ("_p", "shape", "_st", "__weakref__")
        is_cuda = True
        dtype = "torch.float32"
        device = types.SimpleNamespace(type="cuda", index=0)

        def __init__(self, i):
            self._p, self.shape, self._st = base + 512 * i, (32,), (1,)

        def data_ptr(self):
            return self._p

        def stride(self):
            return self._st

        def element_size(self):
            return 4

        def numel(self):
            return 32

        def untyped_storage(self):
            return self

        def is_conj(self):
            return False

        def is_neg(self):
            return False

        def _is_zerotensor(self):
            return False

    torch_mod = types.ModuleType("torch")
    torch_mod.Tensor = _TorchTensor
    torch_mod._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda index: s.handle)
    current = types.SimpleNamespace(cuda_stream=s.handle)  # (torch imported and initialized)
    torch_mod.cuda = types.SimpleNamespace(is_initialized=lambda: True,
                                           current_stream=lambda index=None: current)
    sys.modules["torch"] = torch_mod
    sm.from_dlpack  # (the import of a tensor new to a launch finds this segment)
    from sharedmem.allocation import import_allocation
    seg_alloc = import_allocation(dev, base, seg.nbytes, "torch")
    tt = [_TorchTensor(i) for i in range(4)]
    nxt = [4]

    def torch_tensors():  # the same 4 tensors each launch (on torch's current stream: no wait)
        sm.launch(k, 8, 128, In(tt[0]), In(tt[1]), Out(tt[2]), Out(tt[3]), n, stream=s)

    def torch_fresh():  # a new output tensor each launch, as torch.empty gives
        i = nxt[0] = 4 + (nxt[0] - 3) % 4000
        sm.launch(k, 8, 128, In(tt[0]), In(tt[1]), Out(_TorchTensor(i)), Out(tt[3]), n,
                  stream=s)

    def cutile_torch():  # as run.py's cuTile row, with torch-style tensors
        sm.launch(vadd, (4,), None, In(tt[0]), In(tt[1]), Out(tt[2]), 256, stream=s)

    rows = [("launch, 4 views reused", reused), ("same, the count an np.int32", reused_np),
            ("launch with a move (fresh views)", fresh),
            ("move pair (from_buffer + into_buffer)", move_pair), ("op.submit", submit_op),
            ("launch, 16 views", sixteen),
            ("launch, 4 CuPy-style arrays", cupy_arrays),
            ("launch, a fresh CuPy-style array", cupy_fresh),
            ("launch on a CuPy-style stream object", borrowed_stream),
            ("launch, 4 torch-style tensors", torch_tensors),
            ("launch, a fresh torch-style tensor", torch_fresh),
            ("pipeline step (3 launches, 2 moves, 2 streams)", pipeline_step),
            ("cuTile launch, 3 tensors + a constant", cutile),
            ("cuTile launch, 3 torch-style tensors", cutile_torch),
            ("DLPack export (stream=1) + release", dlpack),
            ("CUDA Array Interface export", cai),
            ("graph replay call", replay)]
    print(f"# {sm.show_config(open(os.devnull, 'w'))['core']}")
    only = _option("--only")
    calls = _option("--calls")
    for name, fn in rows:
        if only is not None and only.lower() not in name.lower():
            continue
        fn()
        sm.synchronize()
        if calls is not None:
            for _ in range(int(calls)):
                fn()
        else:
            print(f"{name:40s} {per_call_us(fn):7.2f} us")
        sm.synchronize()


def _option(name):
    """The value after ``name`` on the command line, or None."""
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def main():
    if "--this" in sys.argv:
        return this_build()
    for env in ({}, {"SHAREDMEM_PURE_PYTHON": "1"}):
        subprocess.run([sys.executable, __file__, "--this"], env={**os.environ, **env},
                       check=False)


if __name__ == "__main__":
    main()
