"""Where a tracked launch's time goes on a GPU, next to raw CuPy and the cuLaunchKernel floor.

Each row is measured in alternating rounds in one process (medians, microseconds a launch):

* ``batch+sync``: N launches, then a stream synchronize (what benchmarks/run.py reports);
* ``host only``: 400 launches timed without the synchronize -- fewer than the driver's launch
  queue holds, so the host's own cost per launch, not the GPU's pace;
* the same tracked launch with the retirer thread parked (its intervals patched to seconds),
  to see what its GIL handoffs cost the launching thread.

Run on the GPU machine: ``python benchmarks/launch_breakdown.py``.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import numpy as np

import sharedmem as sm
from sharedmem.runtime import retirer

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from run import LAUNCH_SRC, cupy_stream  # noqa: E402


def timed(fn, n, sync):
    sync()
    sm.synchronize()
    time.sleep(retirer.LINGER + 0.01)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def main() -> None:
    import cupy as cp
    from cuda.bindings import driver as cu
    dev = sm.default_device()
    k = cp.RawKernel(LAUNCH_SRC, "k4")
    s = dev.create_stream("bench")
    cps = cupy_stream(s)
    n = 32
    A, B, C, D = (sm.Buffer.from_host(np.ones(n, np.float32), device=dev) for _ in range(4))
    ca, cb, cc, cd = (cp.ones(n, cp.float32) for _ in range(4))
    nn = np.int32(n)
    In, Out = sm.In, sm.Out
    box = [C]

    def raw():
        k((1,), (32,), (ca, cb, cc, cd, nn), stream=cps)

    def ours():
        sm.launch(k, 1, 32, In(A), In(B), Out(box[0]), Out(D), nn, stream=s)

    def arrays():  # CuPy arrays as arguments, on CuPy's current stream (made cps below)
        sm.launch(k, 1, 32, In(ca), In(cb), Out(cc), Out(cd), nn, stream=s)

    def fresh():
        t = sm.Tensor.from_buffer(box[0], (n,))
        sm.launch(k, 1, 32, In(A), In(B), Out(t), Out(D), nn, stream=s)
        box[0] = t.into_buffer()

    def move():
        t = sm.Tensor.from_buffer(box[0], (n,))
        box[0] = t.into_buffer()

    with cp.cuda.Device(dev.ordinal):
        func = int(k.kernel.ptr)
    vals = (ctypes.c_uint64 * 5)(ca.data.ptr, cb.data.ptr, cc.data.ptr, cd.data.ptr, n)
    ptrs = (ctypes.c_void_p * 5)(*[ctypes.addressof(vals) + 8 * i for i in range(5)])
    addr = ctypes.addressof(ptrs)
    cus = cu.CUstream(s.handle)

    def floor():
        cu.cuLaunchKernel(func, 1, 1, 1, 32, 1, 1, 0, cus, addr, 0)

    sync = s.synchronize
    rows = {"raw CuPy": raw, "cuLaunchKernel floor": floor, "sharedmem reused views": ours,
            "sharedmem CuPy arrays": arrays,
            "sharedmem fresh views (move between)": fresh, "move pair alone": move}
    cps.use()  # (CuPy's current stream: where raw launches, and arrays() with no wait)
    for fn in rows.values():
        for _ in range(300):
            fn()
    res = {name: ([], []) for name in rows}
    parked = {"sharedmem reused, retirer parked": ([], []),
              "sharedmem CuPy arrays, retirer parked": ([], []),
              "sharedmem fresh, retirer parked": ([], [])}
    saved = (retirer.POLL_INTERVAL, retirer.BUSY_INTERVAL, retirer.LINGER)
    for _ in range(7):
        for name, fn in rows.items():
            h, _ = timed(fn, 400, sync)
            _, b = timed(fn, 20000, sync)
            res[name][0].append(h)
            res[name][1].append(b)
        retirer.POLL_INTERVAL = retirer.BUSY_INTERVAL = 2.0
        retirer.LINGER = 0.0
        time.sleep(0.05)
        for name, fn in zip(parked, (ours, arrays, fresh)):
            h, _ = timed(fn, 400, sync)
            _, b = timed(fn, 20000, sync)
            parked[name][0].append(h)
            parked[name][1].append(b)
        retirer.POLL_INTERVAL, retirer.BUSY_INTERVAL, retirer.LINGER = saved
        retirer.wake()
    res.update(parked)
    print(f"launch breakdown on {dev}, {sm.show_config(open('/dev/null', 'w'))['core']}")
    print(f"{'row':44s} | host only | batch+sync")
    for name, (h, b) in res.items():
        print(f"{name:44s} | {statistics.median(h):6.2f} us | {statistics.median(b):6.2f} us")


if __name__ == "__main__":
    main()
