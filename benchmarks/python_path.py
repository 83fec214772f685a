"""The launch path's own Python, with the CUDA driver stubbed out.

Runs the real CudaBackend and CuPy adapter against the fake driver of the
test suite (tests/fake_cuda.py) with the three hot driver calls replaced by
no-ops (and cuTile's ``ct.launch`` by a no-op), so what is timed is sharedmem's own
work alone. Runs anywhere:
``python benchmarks/python_path.py``. Compare machines by running it on both.
"""
import statistics
import sys
import time

sys.path[:0] = ["tests"]

import sharedmem as sm  # noqa: E402
import sharedmem.backends.cuda as bc  # noqa: E402
from fake_cuda import CUresult, FakeDriver, RawKernel, fake_cupy  # noqa: E402


_STUBS = r"""
int launch_stub(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g,
                unsigned h, void *s, void **p, void **x) { return 0; }
int ctx_get_stub(void **out) { *out = (void *)0xC0; return 0; }
"""


def _c_stubs():
    """C no-ops for the compiled launch path's driver entry points, or None
    without a C compiler (the compiled rows are then left out)."""
    import ctypes
    import os
    import subprocess
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
    so = ctypes.CDLL(lib)
    return so, {"cuLaunchKernel": ctypes.cast(so.launch_stub, ctypes.c_void_p).value,
                "cuCtxGetCurrent": ctypes.cast(so.ctx_get_stub, ctypes.c_void_p).value}


class _NullHot:
    stubs = _c_stubs()
    addresses = stubs[1] if stubs else None

    def launch(self, *a):
        return 0

    def record(self, *a):
        return 0

    def query(self, *a):
        return 0


def main():
    drv = FakeDriver()
    bc.cu = drv
    bc._SUCCESS, bc._NOT_READY = CUresult.CUDA_SUCCESS, CUresult.CUDA_ERROR_NOT_READY
    bc._hot_driver = _NullHot
    sys.modules["cupy"] = fake_cupy()
    backend = bc.CudaBackend(0)
    dev = object.__new__(sm.Device)
    dev._setup("cuda", 0, backend.name, ("fake-cuda", 1), backend)
    k = RawKernel(drv, "k4", ["Q", "Q", "Q", "Q", "i"], lambda *a: None)
    import numpy as np
    nn = np.int32(1024)  # as the GPU benchmark passes it
    s = dev.create_stream("s")
    a, b, c, d = (sm.Buffer.empty(1024, "float32", device=dev) for _ in range(4))
    o = sm.op(k, 8, 128, sm.In(a), sm.In(b), sm.Out(c), sm.Out(d), 1024)
    In, Out = sm.In, sm.Out

    def launch():
        sm.launch(k, 8, 128, In(a), In(b), Out(c), Out(d), nn, stream=s)

    def submit():
        o.submit(s)

    from sharedmem._accel import fast_launch
    from sharedmem._accel import set_compiled

    def python_path(fn):
        def run():
            set_compiled(False)
            fn()
        return run

    # a cuTile kernel, with cuda.tile stood in for by a module whose launch does nothing
    import types
    from fake_cuda import TileKernel
    ct = types.ModuleType("cuda.tile")
    ct.launch = lambda stream, grid, kernel, args: None
    sys.modules.setdefault("cuda", types.ModuleType("cuda")).tile = ct
    sys.modules["cuda.tile"] = ct
    tk = TileKernel(lambda *a: None)
    ta, tb, tc = (sm.Tensor.zeros((1024,), "float32", device=dev) for _ in range(3))

    def tile():
        sm.launch(tk, (4,), None, In(ta), In(tb), Out(tc), 256, stream=s)

    rows = [("sm.launch", launch), ("op.submit", submit), ("cuTile sm.launch", tile)]
    if fast_launch is not None and _NullHot.addresses:
        rows = [("sm.launch, compiled path", launch),
                ("sm.launch, Python path", python_path(launch)), ("op.submit", submit),
                ("cuTile sm.launch, compiled path", tile),
                ("cuTile sm.launch, Python path", python_path(tile))]
    for name, fn in rows:
        for _ in range(2000):
            fn()
        times = []
        for _ in range(25):
            t0 = time.perf_counter()
            for _ in range(4000):
                fn()
            times.append((time.perf_counter() - t0) / 4000 * 1e6)
        sm.synchronize()
        set_compiled(True)
        print(f"{name}, driver stubbed: min {min(times):.2f} us, median "
              f"{statistics.median(times):.2f} us a call")


if __name__ == "__main__":
    main()
