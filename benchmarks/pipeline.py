"""A mixed Tile/SIMT pipeline with a zero-copy handoff each way, through sharedmem and raw.

Per iteration, at 1024 x 1024 float32:

    stage 1  cuTile matmul Y = X @ W                 stream A
    handoff  Y.into_buffer()                         (sharedmem; raw: the same CuPy array)
    stage 2  CuPy RawKernel y = relu(y + bias[col])  stream B, after stage 1
    handoff  Tensor.from_buffer(y, (M, N))
    stage 3  cuTile row normalization Z              stream A, after stage 2

The raw version calls ``ct.launch`` and the CuPy kernel on CuPy arrays and orders the two
streams with events placed by hand. sharedmem's version leases every argument, orders the
streams itself and moves the storage between a Tensor and a Buffer twice an iteration.
Printed: time per iteration end to end (GPU-bound, alternating rounds) and the host's own
time per iteration (10 iterations issued after a sync: the calls alone), each as a ratio
against raw measured in the same run -- the host time as the median of ``--host-rounds``
paired rounds (raw, then ours). ``--breakdown`` adds the host time of each call of a step,
ours and raw; a cuTile launch alone, raw and ours, and ours with ``ct.launch`` stubbed (what
sharedmem adds on this host); and the host time with the retirer thread parked. Uses the
kernels of examples/mixed_pipeline.py (written in the style of cuTile's samples) at this size.

Run on a GPU with cuTile: ``PYTHONPATH=. python3 benchmarks/pipeline.py [--iters N] [--breakdown]``
"""

# No `from __future__ import annotations`: cuTile evaluates kernel annotations.
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sharedmem as sm  # noqa: E402
from run import cupy_stream  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--host-rounds", type=int, default=41)
    ap.add_argument("--breakdown", action="store_true",
                    help="also time each call of a step, ours and raw (host time)")
    ap.add_argument("--park-retirer", action="store_true",
                    help="diagnostic: the retirer thread sleeps seconds between passes (the "
                         "submitters' own sweeps retire the work)")
    opts = ap.parse_args()
    import cupy as cp
    import cuda.tile as ct

    import mixed_pipeline as mp
    if opts.park_retirer:
        from sharedmem.runtime import retirer
        retirer.POLL_INTERVAL = retirer.BUSY_INTERVAL = 2.0
        retirer.LINGER = 0.0
    mp.M = mp.K = mp.N = 1024
    mp.TM, mp.TN, mp.TK = 128, 128, 32
    M, K, N = mp.M, mp.K, mp.N
    stages = mp.tile_and_simt_stages()
    matmul, g_mm, _, c_mm = stages["matmul"]
    bias_relu, g_br, b_br, _ = stages["bias_relu"]
    norm, g_n, _, c_n = stages["normalize_rows"]
    eps = float(mp.EPS)

    dev = sm.default_device()
    a, b = dev.create_stream("tile"), dev.create_stream("simt")
    rng = np.random.default_rng(0)
    x_h = rng.standard_normal((M, K)).astype(np.float32)
    w_h = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    bias_h = rng.standard_normal(N).astype(np.float32)

    # sharedmem
    X = sm.Tensor.from_host(x_h, device=dev, stream=a)
    W = sm.Tensor.from_host(w_h, device=dev, stream=a)
    bias = sm.Buffer.from_host(bias_h, device=dev, stream=b)
    Z = sm.Tensor.empty((M, N), "float32", device=dev)
    box = [sm.Tensor.empty((M, N), "float32", device=dev)]
    In, Out, InOut = sm.In, sm.Out, sm.InOut
    mi, ni = np.int32(M), np.int32(N)

    def ours():
        Y = box[0]
        sm.launch(matmul, g_mm, None, In(X), In(W), Out(Y), *c_mm, stream=a)
        y = Y.into_buffer()
        sm.launch(bias_relu, g_br, b_br, InOut(y), In(bias), mi, ni, stream=b)
        Y = box[0] = sm.Tensor.from_buffer(y, (M, N))
        sm.launch(norm, g_n, None, In(Y), Out(Z), eps, *c_n, stream=a)

    # raw: the same kernels on CuPy arrays, events by hand
    ca, cb = cupy_stream(a), cupy_stream(b)
    xc, wc = cp.asarray(x_h), cp.asarray(w_h)
    biasc = cp.asarray(bias_h)
    yc, zc = cp.empty((M, N), cp.float32), cp.empty((M, N), cp.float32)
    ev_a, ev_b = cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True)
    ha = a.handle
    g_mm3 = tuple(g_mm) + (1,) * (3 - len(g_mm))
    g_n3 = tuple(g_n) + (1,) * (3 - len(g_n))

    def raw():
        ct.launch(ha, g_mm3, matmul, (xc, wc, yc, *c_mm))
        ev_a.record(ca)
        cb.wait_event(ev_a)
        bias_relu((g_br,), (b_br,), (yc, biasc, mi, ni), stream=cb)
        ev_b.record(cb)
        ca.wait_event(ev_b)
        ct.launch(ha, g_n3, norm, (yc, zc, eps, *c_n))

    def ours_parts():  # ours(), one call a part (the same calls, in the same order)
        st = {}

        def mm():
            st["Y"] = box[0]
            sm.launch(matmul, g_mm, None, In(X), In(W), Out(st["Y"]), *c_mm, stream=a)

        def into():
            st["y"] = st.pop("Y").into_buffer()

        def br():
            sm.launch(bias_relu, g_br, b_br, InOut(st["y"]), In(bias), mi, ni, stream=b)

        def frm():
            box[0] = sm.Tensor.from_buffer(st.pop("y"), (M, N))

        def nrm():
            sm.launch(norm, g_n, None, In(box[0]), Out(Z), eps, *c_n, stream=a)
        return [("cuTile matmul launch", mm), ("into_buffer", into), ("CuPy bias_relu launch", br),
                ("Tensor.from_buffer", frm), ("cuTile norm launch", nrm)]

    def raw_parts():
        def mm():
            ct.launch(ha, g_mm3, matmul, (xc, wc, yc, *c_mm))

        def h1():
            ev_a.record(ca)
            cb.wait_event(ev_a)

        def br():
            bias_relu((g_br,), (b_br,), (yc, biasc, mi, ni), stream=cb)

        def h2():
            ev_b.record(cb)
            ca.wait_event(ev_b)

        def nrm():
            ct.launch(ha, g_n3, norm, (yc, zc, eps, *c_n))
        return [("cuTile matmul launch", mm), ("record + wait_event", h1),
                ("CuPy bias_relu launch", br), ("record + wait_event", h2),
                ("cuTile norm launch", nrm)]

    def sync():
        a.synchronize()
        b.synchronize()
        cp.cuda.Device(dev.ordinal).synchronize()
        sm.synchronize()

    for fn in (raw, ours):  # warm up: compiles, plans, pools
        for _ in range(20):
            fn()
        sync()
    # results agree
    ours()
    raw()
    sync()
    diff = float(cp.abs(cp.asarray(Z.to_host()) - zc).max())

    n = opts.iters
    e2e = {raw: [], ours: []}
    for _ in range(opts.rounds):
        for fn in (raw, ours):
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            e2e[fn].append((time.perf_counter() - t0) / n * 1e6)
    # The host's own time: a few iterations issued after a sync (the device queue never
    # fills), raw and ours back to back in each of many rounds; the ratio is the median of the
    # rounds' ratios, so that a slow stretch of a noisy host weighs on both sides alike.
    from sharedmem.runtime import retirer
    saved = (retirer.POLL_INTERVAL, retirer.BUSY_INTERVAL, retirer.LINGER)

    def host_time(fn):
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        return (time.perf_counter() - t0) / 10 * 1e6

    host = {"raw": [], "ours": [], "parked": []}
    for _ in range(opts.host_rounds):
        host["raw"].append(host_time(raw))
        host["ours"].append(host_time(ours))
        if opts.breakdown:  # diagnostic: the same with the retirer thread asleep
            retirer.POLL_INTERVAL = retirer.BUSY_INTERVAL = 2.0
            retirer.LINGER = 0.0
            time.sleep(0.001)  # (its pass under way ends and sleeps the new interval)
            host["parked"].append(host_time(ours))
            retirer.POLL_INTERVAL, retirer.BUSY_INTERVAL, retirer.LINGER = saved
            retirer.wake()
    sync()
    if opts.breakdown:
        breakdown(ours_parts(), raw_parts(), sync)
        tile_rows(norm, g_n3, eps, c_n, box[0], Z, yc, zc, a, ha, sync)
    r_e, o_e = statistics.median(e2e[raw]), statistics.median(e2e[ours])
    r_h, o_h = statistics.median(host["raw"]), statistics.median(host["ours"])

    def paired(side):
        return statistics.median(o / r for o, r in zip(host[side], host["raw"]))
    print(f"pipeline {M}x{K}x{N} float32, matmul + bias_relu + row norm, 2 streams, "
          f"{n} iterations x {opts.rounds} rounds (max |ours - raw| = {diff:.2e})")
    print(f"row | sharedmem | raw | ratio")
    print(f"pipeline, end to end per iteration | {o_e:8.2f} us | {r_e:8.2f} us raw | {o_e / r_e:5.2f}x")
    print(f"pipeline, host time per iteration | {o_h:8.2f} us | {r_h:8.2f} us raw | "
          f"{paired('ours'):5.2f}x (median of {opts.host_rounds} paired rounds)")
    if host["parked"]:
        print(f"pipeline, host time, retirer parked (diagnostic) | "
              f"{statistics.median(host['parked']):8.2f} us | {r_h:8.2f} us raw | "
              f"{paired('parked'):5.2f}x")
    return 0


def tile_rows(norm, grid, eps, consts, Y, Z, yc, zc, a, ha, sync, n=100, rounds=9):
    """One cuTile launch (the row norm) a call, host time: raw ``ct.launch`` on CuPy arrays and
    on our descriptors made once; sm.launch with reused views, with a fresh view (a move) each
    call, and with cuTile's launch stubbed (what sharedmem adds, on this host)."""
    import cuda.tile as ct
    from interop.cutile import _view_descriptor
    In, Out = sm.In, sm.Out
    shape = Y.shape
    dy, dz = _view_descriptor(0, Y, False), _view_descriptor(1, Z, True)
    Yt = sm.Tensor.from_buffer(Y.into_buffer(), shape)

    def raw_cupy():
        ct.launch(ha, grid, norm, (yc, zc, eps, *consts))

    def raw_desc():
        ct.launch(ha, grid, norm, (dy, dz, eps, *consts))

    state = [Yt]

    def reused():
        sm.launch(norm, grid, None, In(state[0]), Out(Z), eps, *consts, stream=a)

    def fresh():
        t = sm.Tensor.from_buffer(state[0].into_buffer(), shape)
        state[0] = t
        sm.launch(norm, grid, None, In(t), Out(Z), eps, *consts, stream=a)

    def move():
        state[0] = sm.Tensor.from_buffer(state[0].into_buffer(), shape)

    rows = [("raw ct.launch, CuPy arrays", raw_cupy), ("raw ct.launch, descriptors made once", raw_desc),
            ("sm.launch, reused views", reused), ("sm.launch, a move before it", fresh),
            ("move pair alone", move)]
    res = {name: [] for name, _ in rows}
    clock = time.perf_counter
    for _ in range(rounds):
        for name, fn in rows:
            sync()
            t0 = clock()
            for _ in range(n):
                fn()
            res[name].append((clock() - t0) / n * 1e6)
    # sharedmem's own work around cuTile's launch: the same calls with ct.launch a no-op
    from sharedmem.launch import _plans
    plans = [_plans[norm]]
    saved = [(p, p.ct_launch) for p in plans]
    for p in plans:
        p.ct_launch = lambda *args: None
    try:
        for label, fn in (("sm.launch, reused views, ct.launch stubbed", reused),
                          ("sm.launch, a move before it, ct.launch stubbed", fresh)):
            xs = []
            for _ in range(rounds):
                sync()
                t0 = clock()
                for _ in range(n):
                    fn()
                xs.append((clock() - t0) / n * 1e6)
            res[label] = xs
    finally:
        for p, f in saved:
            p.ct_launch = f
    sync()
    for name, xs in res.items():
        print(f"cutile row | {name} | {statistics.median(xs):7.2f} us")


def breakdown(ours, raw, sync, steps=10, rounds=40):
    """Host time of each call of a step, median over rounds of `steps` steps issued after a
    sync (as the host-time row), ours and raw side by side."""
    clock = time.perf_counter_ns
    for parts in (ours, raw):
        acc = [[] for _ in parts]
        for _ in range(rounds):
            sync()
            tot = [0] * len(parts)
            for _ in range(steps):
                for k, (_, fn) in enumerate(parts):
                    t0 = clock()
                    fn()
                    tot[k] += clock() - t0
            for k in range(len(parts)):
                acc[k].append(tot[k] / steps / 1e3)
        sync()
        side = "sharedmem" if parts is ours else "raw"
        meds = [statistics.median(x) for x in acc]
        for (name, _), m in zip(parts, meds):
            print(f"breakdown {side} | {name} | {m:7.2f} us")
        print(f"breakdown {side} | sum | {sum(meds):7.2f} us")


if __name__ == "__main__":
    sys.exit(main())
