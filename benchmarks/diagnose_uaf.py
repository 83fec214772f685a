"""Instrumented run of the cross-stream use-after-free pattern."""
import gc
import sys
import weakref

import numpy as np

import sharedmem as sm

sys.path.insert(0, "tests")
import gpu_kernels as K  # noqa: E402

dev = sm.Device(0)
a, b = dev.create_stream("A"), dev.create_stream("B")
n = 1 << 20
import cupy as cp  # noqa: E402
pool = cp.get_default_memory_pool()
for trial in range(3):
    src = sm.Buffer.from_host(np.arange(n, dtype=np.float32), device=dev, stream=a)
    a.synchronize()
    out = sm.Buffer.empty(n, "float32", device=dev, stream=b)
    src_ptr = src.ptr
    ref = weakref.ref(src.allocation)
    owner = src.allocation.owner
    fut = sm.launch(K.kernel("slow_copy"), 256, 256, sm.In(src), sm.Out(out), np.int32(n),
                    np.int64(K.cycles(20)), stream=b)
    sub = fut._s
    print(f"trial {trial}: src 0x{src_ptr:x} owner={type(owner).__name__} mem={type(owner.mem).__name__} "
          f"keep={[type(k).__name__ for k in sub.keep]}")
    del src, fut, owner
    gc.collect()
    print(f"  after del: alloc alive={ref() is not None} sub.state={sub.state} "
          f"pending={b.pending} pool used={pool.used_bytes()}")
    fresh = [sm.Buffer.empty(n, "float32", device=dev, stream=a) for _ in range(4)]
    print(f"  fresh ptrs={[hex(f.ptr) for f in fresh]} reused={src_ptr in [f.ptr for f in fresh]} "
          f"alloc alive={ref() is not None} sub.state={sub.state}")
    got = out.to_host(stream=b)
    print(f"  exact={np.array_equal(got, np.arange(n, dtype=np.float32))}")
    del fresh, out
    sm.synchronize()
