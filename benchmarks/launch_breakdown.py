"""Where the time of one launch goes, on the GPU, in one process.

Each line is the median per-call time of a loop that adds one piece of the
launch path to the previous line: the driver calls alone (through ctypes, as
the backend makes them), then sharedmem's submission with the retirer held
off, then with retirement as it runs normally. The differences are the
price of each piece. Run on a GPU: PYTHONPATH=. python3 benchmarks/launch_breakdown.py
"""
import ctypes
import sys
import time

import numpy as np

import sharedmem as sm
from sharedmem.runtime import submission as _sub

sys.path.insert(0, "benchmarks")
from run import LAUNCH_SRC, per_call_us  # noqa: E402


def per_call(fn, n=20000, reps=7, sync=None):
    return per_call_us(fn, n, reps, sync, timed_sync=False)  # the calls only: the GPU keeps up


def main():
    import cupy as cp
    dev = sm.Device(0)
    be = dev.backend
    hot = be.hot
    k = cp.RawKernel(LAUNCH_SRC, "k4")
    s = dev.create_stream("breakdown")
    sync = s.synchronize
    n = 32
    A, B, C, D = (sm.Buffer.from_host(np.ones(n, np.float32), device=dev) for _ in range(4))
    ca, cb, cc, cd = (cp.ones(n, cp.float32) for _ in range(4))
    cps = cp.cuda.ExternalStream(s.handle)
    nn = np.int32(n)
    with cp.cuda.Device(0):
        func = int(k.kernel.ptr)
    vals = (ctypes.c_uint64 * 5)(ca.data.ptr, cb.data.ptr, cc.data.ptr, cd.data.ptr, n)
    ptrs = (ctypes.c_void_p * 5)(*[ctypes.addressof(vals) + 8 * i for i in range(5)])
    addr = ctypes.addressof(ptrs)
    h = s.handle
    ev = be._event()
    evh = int(ev)
    launch, record, query = hot.launch, hot.record, hot.query
    o = sm.op(k, 1, 32, sm.In(A), sm.In(B), sm.Out(C), sm.Out(D), nn)

    rows = []

    def add(name, fn, **kw):
        for _ in range(500):
            fn()
        sync()
        t = per_call(fn, sync=sync, **kw)
        rows.append((name, t))
        print(f"{name:58s} {t:7.2f} us", flush=True)

    add("CuPy RawKernel call", lambda: k((1,), (32,), (ca, cb, cc, cd, nn), stream=cps))
    add("ctypes cuLaunchKernel, pre-packed", lambda: launch(func, 1, 1, 1, 32, 1, 1, 0, h, addr, None))

    def launch_record():
        launch(func, 1, 1, 1, 32, 1, 1, 0, h, addr, None)
        record(evh, h)
    add("  + cuEventRecord", launch_record)

    def launch_record_query():
        launch(func, 1, 1, 1, 32, 1, 1, 0, h, addr, None)
        record(evh, h)
        query(evh)
    add("  + cuEventQuery", launch_record_query)

    # sharedmem without the retirer and without sweeps in submit()
    every = _sub.SWEEP_EVERY
    _sub.SWEEP_EVERY = 1 << 40
    import sharedmem.runtime.retirer as R
    poll, busy = R.POLL_INTERVAL, R.BUSY_INTERVAL
    R.POLL_INTERVAL = R.BUSY_INTERVAL = 10.0  # the retirer sleeps through the loop
    time.sleep(0.05)
    add("op.submit, no retirement during the loop", lambda: o.submit(s), n=5000)
    add("sm.launch, no retirement during the loop",
        lambda: sm.launch(k, 1, 32, sm.In(A), sm.In(B), sm.Out(C), sm.Out(D), nn, stream=s), n=5000)
    _sub.SWEEP_EVERY = every
    add("op.submit, sweeps in submit() only (retirer asleep)", lambda: o.submit(s))
    R.POLL_INTERVAL, R.BUSY_INTERVAL = poll, busy
    R.wake()
    sm.synchronize()
    add("op.submit, as it runs", lambda: o.submit(s))
    add("sm.launch, as it runs",
        lambda: sm.launch(k, 1, 32, sm.In(A), sm.In(B), sm.Out(C), sm.Out(D), nn, stream=s))
    sm.synchronize()
    cutile(dev, s, add)


def cutile(dev, s, add):
    try:
        import cuda.tile as ct
    except ImportError:
        print("cuda.tile not installed: no cuTile lines")
        return
    import cupy as cp
    from interop.cutile import _ArrayDescriptor
    T = 256
    n = T * 64
    h = s.handle
    grid = (n // T, 1, 1)
    ca, cb, cc = (cp.ones(n, cp.float32) for _ in range(3))
    a, b, c = (sm.Tensor.from_host(np.ones(n, np.float32), device=dev) for _ in range(3))
    da, db, dc = _ArrayDescriptor(a, False), _ArrayDescriptor(b, False), _ArrayDescriptor(c, True)
    o = sm.op(_vadd(ct), (n // T,), None, sm.In(a), sm.In(b), sm.Out(c), T)
    k = _vadd(ct)
    add("ct.launch, CuPy arrays", lambda: ct.launch(h, grid, k, (ca, cb, cc, T)), n=5000)
    add("ct.launch, our CAI descriptors (made once)", lambda: ct.launch(h, grid, k, (da, db, dc, T)),
        n=5000)
    add("ct.launch, CAI descriptors made per call",
        lambda: ct.launch(h, grid, k, (_ArrayDescriptor(a, False), _ArrayDescriptor(b, False),
                                       _ArrayDescriptor(c, True), T)), n=5000)
    add("cuTile op.submit", lambda: o.submit(s), n=5000)
    add("cuTile sm.launch",
        lambda: sm.launch(k, (n // T,), None, sm.In(a), sm.In(b), sm.Out(c), T, stream=s), n=5000)
    sm.synchronize()


_kernel = []


def _vadd(ct):
    if not _kernel:
        @ct.kernel
        def vadd(a, b, c, TT: ct.Constant[int]):
            i = ct.bid(0)
            ct.store(c, index=(i,), tile=ct.load(a, index=(i,), shape=(TT,)) +
                     ct.load(b, index=(i,), shape=(TT,)))
        _kernel.append(vadd)
    return _kernel[0]


if __name__ == "__main__":
    main()
