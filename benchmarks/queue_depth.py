"""How many launches the CUDA driver queues behind a busy stream before ``cuLaunchKernel``
itself blocks, and whether sharedmem's launches stay clear of that point.

A spin kernel holds stream S for ``--spin-ms``; tiny launches follow on S, each timed. The
first launch call that takes over 2 ms marks the driver's queue depth (raw CuPy, and with
events interleaved as sharedmem records them). Then the same loop through ``sm.launch`` on
one thread while a second thread makes buffers and launches on another stream: with a
launch blocked in the driver under the core lock (and the GIL), the second thread stalls for
the whole spin; sharedmem waits for room before it takes any lock, so it must not. The
same for ``to_host`` and ``copy_from`` on the busy stream: a copy into or from pageable
memory is synchronous in the driver (the 1 GiB rows: its transfer under the core lock, as
before, against the pieces through pinned memory).

Run on a GPU: PYTHONPATH=. python3 benchmarks/queue_depth.py [--spin-ms 400] [--launches 4000]
"""
import sys
import threading
import time

import numpy as np

from sharedmem.backends.cuda import MARKER_BATCH

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
extern "C" __global__ void tiny(float* x, int n) { if (threadIdx.x == 0 && n < 0) x[0] = 1.f; }
"""


def _opt(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def _cycles(spin_ms):
    import cupy as cp
    rate = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0)  # kHz
    return int(spin_ms * rate)


def raw_depth(spin_ms, launches, events, streams=1, waits=False):
    """The index of the first raw CuPy launch call over 2 ms behind spin kernels (one on each
    of ``streams`` streams, the launches taking them in turn), or None."""
    import cupy as cp
    mod = cp.RawModule(code=SPIN)
    spin, tiny = mod.get_function("spin"), mod.get_function("tiny")
    ss = [cp.cuda.Stream(non_blocking=True) for _ in range(streams)]
    x = cp.zeros(1, cp.float32)
    evs = [cp.cuda.Event(disable_timing=True) for _ in range(64)]
    tiny((1,), (32,), (x, np.int32(1)))
    idle = cp.cuda.Stream(non_blocking=True)
    done = cp.cuda.Event(disable_timing=True)
    done.record(idle)
    cp.cuda.Device().synchronize()
    for s in ss:
        spin((1,), (1,), (np.int64(_cycles(spin_ms)),), stream=s)
    first = None
    for i in range(launches):
        s = ss[i % streams]
        t0 = time.perf_counter()
        if waits:  # (as sharedmem orders a launch after another stream's work)
            s.wait_event(done)
        tiny((1,), (32,), (x, np.int32(1)), stream=s)
        if events and i % MARKER_BATCH == MARKER_BATCH - 1:  # (as sharedmem records them)
            evs[(i // MARKER_BATCH) % 64].record(s)
        if time.perf_counter() - t0 > 2e-3:
            first = i
            break
    cp.cuda.Device().synchronize()
    return first


def stalls(spin_ms, busy_work):
    """``busy_work(sm, s, x, tiny)`` on one thread right after a spin kernel on stream s;
    meanwhile a second thread makes a buffer and launches on another stream, again and again.
    Returns (seconds busy_work took, the second thread's longest round, rounds)."""
    import cupy as cp

    import sharedmem as sm
    mod = cp.RawModule(code=SPIN)
    spin, tiny = mod.get_function("spin"), mod.get_function("tiny")
    dev = sm.Device(0)
    s, t = dev.create_stream("busy"), dev.create_stream("other")
    x, y = sm.Buffer.zeros(1 << 16, "float32", device=dev), sm.Buffer.empty(1, "float32", device=dev)
    sm.launch(tiny, 1, 32, sm.Out(x), np.int32(1), stream=s)
    sm.synchronize()
    done = threading.Event()
    rounds = []

    def other():
        while not done.is_set():
            t0 = time.perf_counter()
            b = sm.Buffer.empty(16, "float32", device=dev)
            sm.launch(tiny, 1, 32, sm.Out(y), np.int32(1), stream=t)
            del b
            rounds.append(time.perf_counter() - t0)
            time.sleep(1e-4)

    sm.launch(spin, 1, 1, np.int64(_cycles(spin_ms)), stream=s)
    th = threading.Thread(target=other)
    th.start()
    t0 = time.perf_counter()
    busy_work(sm, s, x, tiny)
    took = time.perf_counter() - t0
    done.set()
    th.join()
    sm.synchronize()
    return took, max(rounds), len(rounds)


def launch_loop(launches):
    def work(sm, s, x, tiny):
        for _ in range(launches):
            sm.launch(tiny, 1, 32, sm.Out(x), np.int32(1), stream=s)
    return work


def to_host(sm, s, x, tiny):
    x.to_host(stream=s)


def copy_from(n):
    def work(sm, s, x, tiny, src=np.ones(n, np.float32)):
        dst = x if src.nbytes == x.nbytes else sm.Buffer.empty(src.size, "float32",
                                                                  device=x.device)
        dst.copy_from(src, stream=s)
    return work


def to_host_under_the_lock(sm, s, x, tiny):
    """to_host as it was before wait_before_read: the copy enqueued (and, into pageable
    memory, performed) under the core lock at once."""
    return to_host_pageable(sm, x, s, wait_first=False)


def to_host_pageable(sm, x, s, wait_first=True):
    """to_host as it was before the pinned pieces: wait (no lock) for the work it follows,
    then the copy into pageable memory -- performed by the driver under the core lock."""
    from sharedmem.runtime.future import DeviceFuture
    from sharedmem.runtime.submission import submit, wait_before
    tok = x._live_token()
    if wait_first:
        wait_before(tok, s, False)
    raw = np.empty(tok.stop - tok.start, np.uint8)
    backend = x.device.backend
    sub = submit(s, [(tok, False)], lambda: backend.copy_dtoh(s._impl, raw, x.ptr),
                 keep=(raw,), policy="order", label="to_host")
    DeviceFuture(sub).result()
    return raw


def copy_from_pageable(sm, x, src, s):
    """copy_from as it was before the pinned pieces for a source above STAGE_MAX: wait (no
    lock), then the copy from pageable memory -- performed by the driver under the core lock."""
    from sharedmem.runtime.submission import submit, wait_before
    tok = x._live_token()
    wait_before(tok, s, True)
    backend = x.device.backend
    return submit(s, [(tok, True)], lambda: backend.copy_htod(s._impl, x.ptr, src),
                  keep=(src,), label="copy_from")


def big(n, how):
    """``how`` of ``n`` float32 on the busy stream: "to_host" / "copy_from", as now or as
    before ("... as before")."""
    def work(sm, s, x, tiny, cache={}):
        if n not in cache:
            cache[n] = (sm.Buffer.zeros(n, "float32", device=x.device), np.ones(n, np.float32))
        dst, src = cache[n]
        if how == "to_host":
            dst.to_host(stream=s)
        elif how == "to_host as before":
            to_host_pageable(sm, dst, s)
        elif how == "copy_from":
            dst.copy_from(src, stream=s).result()
        else:
            copy_from_pageable(sm, dst, src, s)
            s.synchronize()
    return work


def small_to_host(sm, reps=2000):
    """us a to_host of 1 KiB on an idle stream, now and as before (interleaved rounds)."""
    dev = sm.Device(0)
    s = dev.create_stream("small")
    x = sm.Buffer.zeros(256, "float32", device=dev)
    sm.synchronize()
    fns = (lambda: x.to_host(stream=s), lambda: to_host_pageable(sm, x, s))
    best = [float("inf")] * 2
    for _ in range(5):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / reps * 1e6)
    return best


def main():
    spin_ms = _opt("--spin-ms", 400)
    launches = _opt("--launches", 4000)
    print(f"raw CuPy: first launch call over 2 ms behind a {spin_ms} ms kernel: "
          f"#{raw_depth(spin_ms, launches, False)}")
    print(f"raw CuPy + an event every {MARKER_BATCH} launches: "
          f"#{raw_depth(spin_ms, launches, True)}")
    print(f"raw CuPy, 4 busy streams taken in turn: #{raw_depth(spin_ms, 4 * launches, False, 4)}")
    print(f"raw CuPy, a stream wait before each launch: "
          f"#{raw_depth(spin_ms, launches, False, 1, True)}")
    for name, work in ((f"{launches} launches", launch_loop(launches)),
                       ("to_host (256 KiB) on it", to_host),
                       ("to_host copied under the core lock (as before)", to_host_under_the_lock),
                       ("copy_from 256 KiB of pageable memory", copy_from(1 << 16)),
                       ("copy_from 64 MiB of pageable memory", copy_from(16 << 20)),
                       ("to_host 1 GiB", big(256 << 20, "to_host")),
                       ("to_host 1 GiB as before (pageable, under the lock)",
                        big(256 << 20, "to_host as before")),
                       ("copy_from 1 GiB", big(256 << 20, "copy_from")),
                       ("copy_from 1 GiB as before (pageable, under the lock)",
                        big(256 << 20, "copy_from as before"))):
        took, longest, n = stalls(spin_ms, work)
        print(f"sharedmem, {name} behind the busy stream: {took * 1e3:.1f} ms; another "
              f"thread's longest round {longest * 1e3:.1f} ms of {n}")
    import sharedmem as sm
    now, before = small_to_host(sm)
    print(f"to_host of 1 KiB on an idle stream: {now:.1f} us (as before: {before:.1f} us)")


if __name__ == "__main__":
    main()
