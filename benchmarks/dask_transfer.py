"""Dask transfer throughput: a sharedmem Tensor against a CuPy array, through the same cluster.

A LocalCluster of two worker processes (TCP). One round: worker A makes an array of SIZE
bytes (a task pinned to A, waited for), then a task pinned to worker B takes it as its input
and returns one element -- so the round's time is the transfer (serialize on A, the comm,
deserialize on B) plus two tiny tasks. The same is timed with a 4-byte array, which leaves the
fixed cost of a round; throughput is SIZE over the difference. Both kinds go through the
serializers distributed picks by default (sharedmem: its "dask" family, a host copy; CuPy:
distributed's own cupy handlers, also a host copy over TCP). Medians of ROUNDS rounds, the
two kinds alternated; ratio sharedmem / CuPy of the throughputs (higher is better).

Run: ``python benchmarks/dask_transfer.py [--mib 64] [--rounds 7]`` (GPU: CuPy and sharedmem
on the CUDA device; without a GPU: sharedmem's host backend against NumPy).
"""

from __future__ import annotations

import argparse
import statistics
import time


def make_sm(nbytes, cuda):
    import sharedmem as sm
    dev = sm.default_device() if cuda else sm.Device.host()
    t = sm.Tensor.empty((nbytes // 4,), "float32", device=dev)
    with t.as_buffer() as b:
        b.fill_zero()
    return t


def make_raw(nbytes, cuda):
    import numpy as np
    if cuda:
        import cupy
        return cupy.zeros(nbytes // 4, cupy.float32)
    return np.zeros(nbytes // 4, np.float32)


def first_sm(t):
    import sharedmem  # noqa: F401  (the worker's handlers)
    return float(t[0:1].to_host()[0]) if t.size else 0.0


def first_raw(a):
    return float(a[0:1].sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from distributed import Client, LocalCluster, wait
    try:
        import cupy
        cuda = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        cuda = False
    size = args.mib << 20
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      protocol="tcp") as cluster, Client(cluster) as client:
        a, b = list(client.scheduler_info()["workers"])

        def round_(make, first, nbytes):
            x = client.submit(make, nbytes, cuda, workers=[a], pure=False)
            wait(x)
            t0 = time.perf_counter()
            client.submit(first, x, workers=[b], pure=False).result()
            took = time.perf_counter() - t0
            del x
            return took

        kinds = {"sharedmem Tensor": (make_sm, first_sm),
                 ("CuPy array" if cuda else "NumPy array"): (make_raw, first_raw)}
        for make, first in kinds.values():  # warm both paths (imports, kernels, pools)
            round_(make, first, 4)
            round_(make, first, size)
        times = {k: ([], []) for k in kinds}
        for _ in range(args.rounds):
            for k, (make, first) in kinds.items():
                times[k][0].append(round_(make, first, 4))
                times[k][1].append(round_(make, first, size))
    rate = {}
    print(f"dask transfer, {args.mib} MiB, 2 worker processes over TCP, "
          f"{'CUDA' if cuda else 'host backend'}, medians of {args.rounds}")
    for k, (small, big) in times.items():
        fixed, full = statistics.median(small), statistics.median(big)
        rate[k] = size / max(full - fixed, 1e-9) / 1e9
        print(f"  {k:18s} round {full * 1e3:8.2f} ms (fixed {fixed * 1e3:6.2f} ms) "
              f"-> {rate[k]:6.2f} GB/s")
    sm_rate, raw_rate = rate.values()
    print(f"row dask transfer | {sm_rate:.2f} GB/s | {raw_rate:.2f} GB/s | "
          f"{sm_rate / raw_rate:.2f}x the raw array's throughput")


if __name__ == "__main__":
    main()
