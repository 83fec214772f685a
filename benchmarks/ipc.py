"""CUDA IPC handoff latency: sharedmem.ipc against torch.multiprocessing, same size, same GPU.

One round: the producer hands a fresh 4 MiB device array to a consumer process (sharedmem:
``sm.ipc.export`` + the handle through a pipe; torch: the tensor through a
``torch.multiprocessing`` queue), the consumer opens it, reads one element on the device and
answers. Median microseconds per round over several repetitions, ratio against torch.

Run on the GPU machine: ``python benchmarks/ipc.py [--rounds N]``.
"""

import argparse
import statistics
import sys
import time

N = 1 << 20


def sm_consumer(conn):
    import sharedmem as sm
    while True:
        h = conn.recv()
        if h is None:
            return
        t = sm.ipc.open(h)
        conn.send(float(t[0:1].to_host()[0]) if t.ndim else 0.0)
        del t


def torch_consumer(q_in, q_out):
    import torch
    while True:
        t = q_in.get()
        if t is None:
            return
        q_out.put(float(t[0].item()))
        del t


def bench_sm(rounds):
    import multiprocessing as mp
    import numpy as np
    import sharedmem as sm
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=sm_consumer, args=(there,))
    p.start()
    dev = sm.Device(0)
    bufs = [sm.Tensor.from_host(np.full(N, i, np.float32), device=dev) for i in range(8)]
    sm.synchronize()
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        ex = sm.ipc.export(bufs[r % 8])
        here.send(ex.handle)
        v = here.recv()
        times.append(time.perf_counter() - t0)
        assert v == r % 8, v
        ex.wait_released(5.0)
    here.send(None)
    p.join()
    return times


def bench_torch(rounds):
    import torch
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=torch_consumer, args=(q_in, q_out))
    p.start()
    ts = [torch.full((N,), float(i), device="cuda:0") for i in range(8)]
    torch.cuda.synchronize()
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        q_in.put(ts[r % 8])
        v = q_out.get()
        times.append(time.perf_counter() - t0)
        assert v == r % 8, v
    q_in.put(None)
    p.join()
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=300)
    opts = ap.parse_args()
    warm = 20
    ours = bench_sm(opts.rounds + warm)[warm:]
    try:
        theirs = bench_torch(opts.rounds + warm)[warm:]
    except ImportError:
        theirs = None
    o = statistics.median(ours) * 1e6
    print(f"ipc handoff, 4 MiB, sharedmem.ipc: {o:.1f} us median (p90 "
          f"{statistics.quantiles(ours, n=10)[-1] * 1e6:.1f})")
    if theirs:
        t = statistics.median(theirs) * 1e6
        print(f"ipc handoff, 4 MiB, torch.multiprocessing: {t:.1f} us median (p90 "
              f"{statistics.quantiles(theirs, n=10)[-1] * 1e6:.1f})")
        print(f"row: ipc handoff vs torch.multiprocessing | {o:.1f} us | {t:.1f} us | {o / t:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
