"""Where a DLPack export consumed by ``cupy.from_dlpack`` spends its time, on a GPU.

Times, in one process (medians of alternating rounds, microseconds a call):

* ``cupy.from_dlpack`` of a CuPy array (the raw row of benchmarks/run.py) and of a Tensor;
* the producer's side alone: ``__dlpack__(stream=1)`` and the capsule dropped unconsumed, for
  CuPy and for sharedmem, and sharedmem's with ``stream=-1`` (no ordering);
* the same, with the retirer thread parked (its intervals patched to seconds).

Then counts what one export + release asks of the driver (the hot entry points through
counting C shims, everything else through a counting proxy of cuda.bindings) and of the
core (submissions filed). Run on the GPU machine: ``python benchmarks/dlpack_breakdown.py``;
``--after moves,launch_gpu,cutile`` runs those stages of benchmarks/run.py first (the state a
whole benchmark run leaves: what it imported, the streams and work it made).
"""

from __future__ import annotations

import collections
import ctypes
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import sharedmem as sm
import sharedmem.backends.cuda as bc
from sharedmem.runtime import retirer

_SHIM = r"""
typedef int (*f2)(void *, void *); typedef int (*f1)(void *); typedef int (*f3)(void *, void *, unsigned);
static f2 real_record; static f1 real_query, real_ctx; static f3 real_wait;
long n_record, n_query, n_wait, n_ctx;
void shim_setup(void *r, void *q, void *w, void *c) { real_record = r; real_query = q; real_wait = w; real_ctx = c; }
int shim_record(void *e, void *s) { n_record++; return real_record(e, s); }
int shim_query(void *e) { n_query++; return real_query(e); }
int shim_wait(void *s, void *e, unsigned f) { n_wait++; return real_wait(s, e, f); }
int shim_ctx(void *out) { n_ctx++; return real_ctx(out); }
"""


def _shim(backend):
    """Point the backend's compiled driver calls at counting C shims; returns the library."""
    d = tempfile.mkdtemp()
    src, lib = os.path.join(d, "shim.c"), os.path.join(d, "shim.so")
    with open(src, "w") as f:
        f.write(_SHIM)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
    so = ctypes.CDLL(lib)
    vp = ctypes.c_void_p
    so.shim_setup.argtypes = [vp, vp, vp, vp]
    so.shim_setup(backend.record_addr, backend.query_addr, backend.wait_addr, backend.ctx_get_addr)
    addr = lambda name: ctypes.cast(getattr(so, name), vp).value  # noqa: E731
    backend.record_addr, backend.query_addr = addr("shim_record"), addr("shim_query")
    backend.wait_addr, backend.ctx_get_addr = addr("shim_wait"), addr("shim_ctx")
    return so


class _CountingDriver:
    """cuda.bindings' driver module with every call counted by name."""

    def __init__(self, real):
        self._real, self.counts = real, collections.Counter()

    def __getattr__(self, name):
        value = getattr(self._real, name)
        if not callable(value) or not name.startswith("cu"):
            return value
        counts = self.counts

        def counted(*a, **k):
            counts[name] += 1
            return value(*a, **k)
        return counted


def per_call(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    import cupy as cp
    dev = sm.Device(0)
    if "--after" in sys.argv:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import run
        for stage in sys.argv[sys.argv.index("--after") + 1].split(","):
            fn = getattr(run, "bench_" + stage)
            fn(dev, True) if stage != "launch_interpreted" else fn(True)
        print(f"(after run.py stages: {sys.argv[sys.argv.index('--after') + 1]})")
    t = sm.Tensor.from_host(np.ones((64, 64), np.float32), device=dev)
    c = cp.ones((64, 64), cp.float32)
    n = 20000
    rows = {
        "cupy.from_dlpack(CuPy array)": lambda: cp.from_dlpack(c),
        "cupy.from_dlpack(Tensor)": lambda: cp.from_dlpack(t),
        "CuPy __dlpack__(stream=1), dropped": lambda: c.__dlpack__(stream=1, max_version=(1, 0)),
        "Tensor __dlpack__(stream=1), dropped": lambda: t.__dlpack__(stream=1, max_version=(1, 0)),
        "Tensor __dlpack__(stream=-1), dropped": lambda: t.__dlpack__(stream=-1, max_version=(1, 0)),
        "Tensor __dlpack_device__()": t.__dlpack_device__,
    }
    for fn in rows.values():
        fn()
    times = {k: [] for k in rows}
    gc_time, gc_runs, gc_t0 = [0.0], collections.Counter(), [0.0]

    def on_gc(phase, info):  # time spent collecting while the rows ran
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_t0[0]
            gc_runs[info["generation"]] += 1
    gc.callbacks.append(on_gc)
    for _ in range(5):
        for k, fn in rows.items():
            cp.cuda.Device().synchronize()
            sm.synchronize()
            times[k].append(per_call(fn, n))
    gc.callbacks.remove(on_gc)
    calls = 5 * n * len(rows)
    print(f"gc while timing: {gc_time[0] / calls * 1e6:.3f} us a call, collections by generation "
          f"{dict(sorted(gc_runs.items()))}, {len(gc.get_objects())} tracked objects")
    parked = {}
    saved = retirer.POLL_INTERVAL, retirer.BUSY_INTERVAL, retirer.LINGER
    retirer.POLL_INTERVAL = retirer.BUSY_INTERVAL = retirer.LINGER = 5.0
    retirer.wake()
    time.sleep(0.05)
    for k in ("cupy.from_dlpack(Tensor)", "Tensor __dlpack__(stream=1), dropped"):
        parked[k] = statistics.median(per_call(rows[k], n) for _ in range(5))
    retirer.POLL_INTERVAL, retirer.BUSY_INTERVAL, retirer.LINGER = saved
    retirer.wake()
    print(f"{'row':48} | us a call")
    for k, v in times.items():
        print(f"{k:48} | {statistics.median(v):7.2f}   (rounds {min(v):.2f}-{max(v):.2f})")
    for k, v in parked.items():
        print(f"{k + ', retirer parked':48} | {v:7.2f}")

    # what one export + release asks of the driver and the core
    backend = dev.backend
    so = _shim(backend)
    real_cu = bc.cu
    bc.cu = counting = _CountingDriver(real_cu)
    try:
        sm.synchronize()
        before = sm.stats().submitted
        m = 2000
        for _ in range(m):
            cp.from_dlpack(t)
        sm.synchronize()
        filed = sm.stats().submitted - before
    finally:
        bc.cu = real_cu
    hot = {name: ctypes.c_long.in_dll(so, "n_" + name).value for name in ("record", "query", "wait", "ctx")}
    print(f"per cupy.from_dlpack(Tensor), over {m} calls (with the retirer's share):")
    print("  compiled driver calls: " + ", ".join(f"{k} {v / m:.3f}" for k, v in hot.items()))
    print("  cuda.bindings calls:   " + (", ".join(f"{k} {v / m:.3f}" for k, v in counting.counts.most_common())
                                        or "none"))
    print(f"  leases filed:          {filed / m:.3f}")


if __name__ == "__main__":
    sys.exit(main())
