"""sharedmem launches on two Dask workers, with Tensors passed between them.

    stage 1 (worker A, chunk i):  x_i = i * N + arange(N)      -- a launch fills a new Tensor
    stage 2 (worker B):           y_i = 2 * x_i + 1            -- a launch on the received Tensor
    reduce  (worker A):           total = sum over i of sum(y_i) -- launches into a DeviceBox

A Tensor that a task returns stays on its worker until another worker needs it; it then
travels through distributed's "dask" serialization family (a host copy, taken after the
launch that writes it has finished) and arrives as a new allocation on the receiver's
default device. On a GPU the stages are CuPy RawKernels; without one, host kernels on the
host backend. Run: ``make dask-demo`` (installs the dask extra first).
"""

from __future__ import annotations

import os
import sys

import numpy as np

import sharedmem as sm

N, CHUNKS = 4096, 6

CUDA_SOURCE = r"""
extern "C" {
__global__ void iota(float* x, int n, float start) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = start + i;
}
__global__ void affine(const float* x, float* y, int n, float a, float b) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
__global__ void total(const float* y, double* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(out, (double)y[i]);
}
}
"""


@sm.host_kernel
def iota(x, n, start):
    x[:] = start + np.arange(n, dtype=x.dtype)


@sm.host_kernel
def affine(x, y, n, a, b):
    y[:] = a * x + b


@sm.host_kernel
def total(y, out, n):
    out[0] += y.sum(dtype=np.float64)


_kernels: dict = {}


def launch(name, n, *args):
    """Launch kernel ``name`` over ``n`` elements: CuPy on a GPU, else the host kernel."""
    if sm.default_device().kind == "host":
        k = {"iota": iota, "affine": affine, "total": total}[name]
    else:
        if not _kernels:
            import cupy
            mod = cupy.RawModule(code=CUDA_SOURCE)
            _kernels.update({k: mod.get_function(k) for k in ("iota", "affine", "total")})
        k = _kernels[name]
    return sm.launch(k, (n + 255) // 256, 256, *args)


# -- the tasks (they run in the worker processes) ---------------------------------------------
def make_chunk(i):
    x = sm.Tensor.empty((N,), "float32")
    launch("iota", N, sm.Out(x), N, float(i * N))  # returned while it may still run
    return x


def transform(x):
    y = sm.Tensor.empty(x.shape, x.dtype)
    launch("affine", N, sm.In(x), sm.Out(y), N, 2.0, 1.0)
    return y


def reduce_chunks(ys):
    box = sm.DeviceBox(0.0, "float64")
    for y in ys:
        launch("total", N, sm.In(y), sm.Atomic(box), N)
    return box.get(), os.getpid(), str(sm.default_device())


def main() -> int:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        xs = [client.submit(make_chunk, i, workers=[a], pure=False) for i in range(CHUNKS)]
        ys = [client.submit(transform, x, workers=[b], pure=False) for x in xs]
        got, pid, device = client.submit(reduce_chunks, ys, workers=[a], pure=False).result()
        first = ys[0].result()  # a Tensor gathered to this process: a new allocation here

    want = float(sum(2 * np.arange(N * CHUNKS, dtype=np.float64) + 1))
    first_ok = np.array_equal(first.to_host(), 2 * np.arange(N, dtype=np.float32) + 1)
    print(f"{CHUNKS} chunks of {N} float32: made on {a}, transformed on {b}, reduced in pid "
          f"{pid} on {device}")
    print(f"total = {got:.1f} (expected {want:.1f}); first chunk gathered here: "
          f"{first.shape} on {first.device}")
    ok = got == want and first_ok
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
