"""Where a graph replay call's host time goes on a GPU, next to a raw ``cuGraphLaunch``.

The graph is benchmarks/run.py's (32 captured launches of 4 buffers). Times, in one process
(medians of rounds, microseconds a call): the host's own cost of a replay call -- 40 calls
timed without waiting (run.py's row), and 400 -- for the raw CUDA graph and for ``g.replay``,
then the same with the retirer thread parked (its intervals patched to seconds). While each
row runs it counts the retirer's passes, the time they held the core lock, the streams with
pending work and the collector's runs. Then it counts what one replay asks of the driver.
``--after moves,launch_gpu,cutile,dlpack`` runs those stages of benchmarks/run.py first (the
state a whole run leaves). Run on the GPU machine: ``python benchmarks/graph_breakdown.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import statistics
import sys
import time

import numpy as np

import sharedmem as sm
from sharedmem.runtime import retirer
from sharedmem.runtime.state import RUNTIME

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
from dlpack_breakdown import _shim  # noqa: E402


def host_cost(fn, sync, calls, rounds):
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(times)


def main() -> int:
    import cupy as cp
    dev = sm.default_device()
    if "--after" in sys.argv:
        stages = sys.argv[sys.argv.index("--after") + 1]
        for stage in stages.split(","):
            getattr(run, "bench_" + stage)(dev, True)
        print(f"(after run.py stages: {stages}; {len(gc.get_objects())} tracked objects)")
    k = cp.RawKernel(run.LAUNCH_SRC, "k4")
    s = dev.create_stream("bench-graph")
    n = 32
    A, B, C, D = (sm.Buffer.from_host(np.ones(n, np.float32), device=dev) for _ in range(4))
    ca, cb, cc, cd = (cp.ones(n, cp.float32) for _ in range(4))
    dev.synchronize()
    with sm.capture(s) as g:
        for _ in range(32):
            sm.launch(k, 1, 32, sm.In(A), sm.In(B), sm.Out(C), sm.Out(D), np.int32(n), stream=s)
    cs = cp.cuda.Stream(non_blocking=True)
    cs.begin_capture()
    for _ in range(32):
        k((1,), (32,), (ca, cb, cc, cd, np.int32(n)), stream=cs)
    raw_graph = cs.end_capture()

    passes = {"n": 0, "locked": 0.0, "active": 0}
    real_locked = retirer.locked

    @contextlib.contextmanager
    def counted_locked():  # (the retirer's pass: what it holds the core lock for)
        passes["active"] += len(RUNTIME.active)
        t0 = time.perf_counter()
        with real_locked():
            yield
        passes["n"] += 1
        passes["locked"] += time.perf_counter() - t0

    collections = [0]

    def on_gc(phase, info):
        if phase == "start":
            collections[0] += 1

    rows = {
        "raw cuGraphLaunch, 40 calls": lambda: host_cost(lambda: raw_graph.launch(cs),
                                                         cs.synchronize, 40, 15),
        "g.replay, 40 calls": lambda: host_cost(lambda: g.replay(s), s.synchronize, 40, 15),
        "raw cuGraphLaunch, 400 calls": lambda: host_cost(lambda: raw_graph.launch(cs),
                                                          cs.synchronize, 400, 7),
        "g.replay, 400 calls": lambda: host_cost(lambda: g.replay(s), s.synchronize, 400, 7),
    }
    for fn in rows.values():
        fn()
    retirer.locked = counted_locked
    gc.callbacks.append(on_gc)
    saved = retirer.POLL_INTERVAL, retirer.BUSY_INTERVAL, retirer.LINGER
    print(f"{'row':44} | host us a call | retirer passes/s, lock held, streams seen a pass | gc runs")
    try:
        for parked in (False, True):
            if parked:
                retirer.POLL_INTERVAL = retirer.BUSY_INTERVAL = retirer.LINGER = 5.0
            retirer.wake()
            time.sleep(0.05)
            for name, fn in rows.items():
                passes.update(n=0, locked=0.0, active=0)
                collections[0] = 0
                t0 = time.perf_counter()
                v = statistics.median(fn() for _ in range(3))
                el = time.perf_counter() - t0
                p = passes["n"]
                print(f"{name + (', retirer parked' if parked else ''):44} | {v:8.2f} | "
                      f"{p / el:6.0f}/s, {passes['locked'] / el * 100:4.1f}%, "
                      f"{passes['active'] / max(p, 1):.1f} | {collections[0]}")
    finally:
        retirer.POLL_INTERVAL, retirer.BUSY_INTERVAL, retirer.LINGER = saved
        retirer.locked = real_locked
        gc.callbacks.remove(on_gc)
        retirer.wake()
    so = _shim(dev.backend)
    sm.synchronize()
    before = sm.stats().submitted
    m = 400
    for _ in range(m):
        g.replay(s)
    sm.synchronize()
    counts = {name: ctypes.c_long.in_dll(so, "n_" + name).value for name in
              ("record", "query", "wait", "ctx")}
    print(f"per replay, over {m} (with the retirer's share): " +
          ", ".join(f"{k} {v / m:.3f}" for k, v in counts.items()) +
          f"; submissions {(sm.stats().submitted - before) / m:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
