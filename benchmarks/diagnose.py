"""Checks on the CUDA hot path: raw handles, and that sm.launch passes a kernel's
scalars so that a spinning kernel really takes as long as asked.
Run on a GPU: PYTHONPATH=. python3 benchmarks/diagnose.py"""
import sys
import time

import numpy as np

import sharedmem as sm

sys.path.insert(0, "tests")
import gpu_kernels as K  # noqa: E402

dev = sm.Device(0)
be = dev.backend
from cuda.bindings import driver as cu  # noqa: E402
try:
    from cuda.bindings.utils import get_cuda_native_handle
except ImportError:
    get_cuda_native_handle = None
ev = be._event()
print("int(CUevent) == native handle:",
      get_cuda_native_handle(ev) == int(ev) if get_cuda_native_handle else "n/a", int(ev))
s = dev.create_stream()
if get_cuda_native_handle:
    print("int(CUstream) == native handle:", get_cuda_native_handle(s._impl.cu_stream) == s.handle)
x = sm.Buffer.zeros(1024, "float32", device=dev)
dev.synchronize()
for ms in (20, 50):
    t0 = time.perf_counter()
    fut = sm.launch(K.kernel("slow_fill"), 1, 32, sm.Out(x), 1024, 1.0, np.int64(K.cycles(ms)), stream=s)
    m = fut._s.marker
    q_hot = be.hot.query(m.handle)
    q_bind = int(cu.cuEventQuery(m.event)[0])
    t_launch = time.perf_counter() - t0
    fut.result()
    t_done = time.perf_counter() - t0
    print(f"spin {ms} ms: launch {t_launch * 1e3:.2f} ms, first query hot={q_hot} bindings={q_bind}, "
          f"result after {t_done * 1e3:.1f} ms")
import cupy as cp  # noqa: E402
k = K.kernel("slow_fill")
c = cp.zeros(1024, cp.float32)
cp.cuda.Device(0).synchronize()
t0 = time.perf_counter()
k((1,), (32,), (c, np.int32(1024), np.float32(1), np.int64(K.cycles(20))))
cp.cuda.Device(0).synchronize()
print(f"raw CuPy spin 20 ms: {(time.perf_counter() - t0) * 1e3:.1f} ms")
