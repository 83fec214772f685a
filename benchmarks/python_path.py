"""The launch path's own Python, with the CUDA driver stubbed out.

Runs the real CudaBackend and CuPy adapter against the fake driver of the
test suite (tests/fake_cuda.py) with the three hot driver calls replaced by
no-ops, so what is timed is sharedmem's Python alone. Runs anywhere:
``python benchmarks/python_path.py``. Compare machines by running it on both.
"""
import statistics
import sys
import time

sys.path[:0] = ["tests"]

import sharedmem as sm  # noqa: E402
import sharedmem.backends.cuda as bc  # noqa: E402
from fake_cuda import CUresult, FakeDriver, RawKernel, fake_cupy  # noqa: E402


class _NullHot:
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
    s = dev.create_stream("s")
    a, b, c, d = (sm.Buffer.empty(1024, "float32", device=dev) for _ in range(4))
    o = sm.op(k, 8, 128, sm.In(a), sm.In(b), sm.Out(c), sm.Out(d), 1024)
    In, Out = sm.In, sm.Out

    def launch():
        sm.launch(k, 8, 128, In(a), In(b), Out(c), Out(d), 1024, stream=s)

    def submit():
        o.submit(s)

    for name, fn in (("sm.launch", launch), ("op.submit", submit)):
        for _ in range(2000):
            fn()
        times = []
        for _ in range(25):
            t0 = time.perf_counter()
            for _ in range(4000):
                fn()
            times.append((time.perf_counter() - t0) / 4000 * 1e6)
        sm.synchronize()
        print(f"{name}, driver stubbed: min {min(times):.2f} us, median "
              f"{statistics.median(times):.2f} us a call")


if __name__ == "__main__":
    main()
