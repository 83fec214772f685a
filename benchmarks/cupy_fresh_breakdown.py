"""Where a launch with a new CuPy array each call spends its time, on a GPU.

A pipeline step that makes its output with ``cupy.empty`` hands sharedmem an array it has not
seen: its memory is looked up and imported (an allocation over CuPy's memory unit), the array
learned (its facts and their weak reference), leased, and all of it let go when the array dies
once the launch is done. Times, in one process (microseconds a call, loops of 4,000, two
rounds): ``cupy.empty`` alone and with the attributes a launch reads; the import and the
learning of a new array, dropped at once and kept; an allocation made and dropped; a registry
lookup that misses; dropping learned arrays; launches of reused arrays, of a new output made
beforehand and made in the call (with the collector on and off), against a raw CuPy launch
with a new output. CuPy's current stream is the launch's (no wait).

Run on the GPU machine: ``python benchmarks/cupy_fresh_breakdown.py``.
"""

import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharedmem as sm  # noqa: E402
from benchmarks.run import LAUNCH_SRC  # noqa: E402


def main() -> int:
    import cupy as cp

    import interop.cupy_launch as icl
    from sharedmem.allocation import Allocation, _registry, import_allocation
    dev = sm.default_device()
    s = dev.create_stream("cupy-fresh-breakdown")
    k = cp.RawKernel(LAUNCH_SRC, "k4")
    n = 32
    ca, cb, cc, cd = (cp.ones(n, cp.float32) for _ in range(4))
    nn = np.int32(n)
    In, Out, empty, f32 = sm.In, sm.Out, cp.empty, cp.float32
    nowhere = 0x7F0000000000  # (an address no allocation holds: never dereferenced)

    def timed(fn, calls=4000):
        for _ in range(300):
            fn()
        s.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        s.synchronize()
        return (time.perf_counter() - t0) / calls * 1e6

    def attrs(a):
        return a.shape, a.strides, a.itemsize, a.data.ptr, a.data.mem.ptr, a.data.mem.size

    rows = [
        ("cupy.empty alone", lambda: empty(n, f32)),
        ("  with the attributes a launch reads", lambda: attrs(empty(n, f32))),
        ("  imported (_allocation_of), dropped", lambda: icl._allocation_of(empty(n, f32), dev)),
        ("  learned (array_facts), dropped", lambda: icl.array_facts(empty(n, f32))),
        ("import_allocation + drop, alone",
         lambda: import_allocation(dev, nowhere, 128, "cupy", region=(nowhere, 512))),
        ("Allocation + drop, alone", lambda: Allocation(dev, nowhere, 128, None, "cupy")),
        ("a registry lookup that misses", lambda: _registry.lookup(dev.key, nowhere, 128)),
        ("launch, 4 CuPy arrays reused",
         lambda: sm.launch(k, 1, 32, In(ca), In(cb), Out(cc), Out(cd), nn, stream=s)),
        ("launch, a new output made in the call",
         lambda: sm.launch(k, 1, 32, In(ca), In(cb), Out(empty(n, f32)), Out(cd), nn, stream=s)),
        ("raw CuPy launch, a new output made in the call",
         lambda: k((1,), (32,), (ca, cb, empty(n, f32), cd, nn))),
    ]
    with cp.cuda.ExternalStream(s.handle):  # (CuPy's current stream: no wait a launch)
        for r in range(2):
            print(f"round {r + 1}")
            for name, fn in rows:
                print(f"  {name:52s} {timed(fn):8.2f} us")
            made = [empty(n, f32) for _ in range(4300)]  # (kept: none dies in the loop)
            it = iter(made)
            us = timed(lambda: sm.launch(k, 1, 32, In(ca), In(cb), Out(next(it)), Out(cd), nn,
                                         stream=s))
            print(f"  {'launch, a new output made beforehand':52s} {us:8.2f} us")
            made = [empty(n, f32) for _ in range(4300)]
            it = iter(made)
            us = timed(lambda: icl.array_facts(next(it)))
            print(f"  {'learned (array_facts), kept':52s} {us:8.2f} us")
            del it
            t0 = time.perf_counter()
            del made
            print(f"  {'dropping a learned array':52s} "
                  f"{(time.perf_counter() - t0) / 4300 * 1e6:8.2f} us")
            gc.disable()
            try:
                us = timed(rows[8][1])
                print(f"  {'launch, a new output made in the call, gc off':52s} {us:8.2f} us")
            finally:
                gc.enable()
    print(f"tracked objects: {len(gc.get_objects())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
