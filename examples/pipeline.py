"""A small two-stream pipeline on one allocation, moved between views without copies.

    stage 1 (stream A): y = a * x + b                       -- writes a Buffer
    move:               Buffer -> Tensor (rows, cols)        -- zero-copy, same pointer
    stage 2 (stream B): center every row of the tensor       -- ordered after stage 1 on the device
    move:               Tensor -> Buffer                     -- zero-copy
    stage 3 (stream A): total = sum(y * y) with atomics      -- into a DeviceBox

On a GPU the stages are CuPy RawKernels; without one they are host kernels on the
host backend (same ownership rules, real asynchrony). Run: ``make demo``.
"""

from __future__ import annotations

import gc
import sys
import time

import numpy as np

import sharedmem as sm
from sharedmem.device import host_fallback_reason

ROWS, COLS = 256, 1024
N = ROWS * COLS


CUDA_SOURCE = r"""
extern "C" {
__global__ void saxpy(float a, const float* x, float* y, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
__global__ void center_rows(float* t, int rows, int cols) {     // one block per row
    __shared__ double s[256];
    float* row = t + (size_t)blockIdx.x * cols;
    double acc = 0.0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) acc += row[j];
    s[threadIdx.x] = acc;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    float mean = (float)(s[0] / cols);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) row[j] -= mean;
}
__global__ void total(const float* y, double* out, int n) {     // sum of squares
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(out, (double)y[i] * (double)y[i]);
}
}
"""


def cuda_stages():
    """The three stages as CuPy RawKernels, with their launch shapes."""
    import cupy
    mod = cupy.RawModule(code=CUDA_SOURCE)
    blocks = (N + 255) // 256
    return {"saxpy": (mod.get_function("saxpy"), blocks, 256),
            "center_rows": (mod.get_function("center_rows"), ROWS, 256),
            "total": (mod.get_function("total"), blocks, 256)}


def host_stages():
    """The same three stages as host kernels (NumPy, on the stream's worker)."""
    @sm.host_kernel
    def saxpy(a, x, y, b, n):
        time.sleep(0.05)  # slow enough that the later stages really overlap with it
        y[:] = a * x + b

    @sm.host_kernel
    def center_rows(t, rows, cols):
        t -= t.mean(axis=1, keepdims=True, dtype=np.float64).astype(np.float32)

    @sm.host_kernel
    def total(y, out, n):
        out[0] += np.square(y.astype(np.float64)).sum()

    return {"saxpy": (saxpy, 1, 1), "center_rows": (center_rows, 1, 1), "total": (total, 1, 1)}


def main() -> int:
    dev = sm.default_device()
    print(f"sharedmem {sm.__version__} on {dev}")
    why = host_fallback_reason()
    if why:
        print(f"  (no GPU used: {why})")
    stages = cuda_stages() if dev.kind == "cuda" else host_stages()
    a_stream, b_stream = dev.create_stream("A"), dev.create_stream("B")
    rng = np.random.default_rng(0)
    x_host = rng.standard_normal(N).astype(np.float32)

    x = sm.Buffer.from_host(x_host, device=dev, stream=a_stream)
    y = sm.Buffer.empty(N, "float32", device=dev)
    box = sm.DeviceBox(0.0, "float64", device=dev, stream=a_stream)
    y_ptr = y.ptr

    # stage 1 on stream A
    kernel, grid, block = stages["saxpy"]
    sm.launch(kernel, grid, block, np.float32(2.0), sm.In(x), sm.Out(y), np.float32(1.0),
              np.int32(N), stream=a_stream)

    # a stale view of y is still alive: the move is refused, and says why
    peek = y[0:4]
    try:
        sm.Tensor.from_buffer(y, (ROWS, COLS))
    except sm.AliasError as e:
        print("\nThe move is refused while a stale view is alive:\n" + str(e) + "\n")
    peek.release()

    # move, zero-copy: same pointer, y is moved-from afterwards
    t = sm.Tensor.from_buffer(y, (ROWS, COLS))
    assert t.ptr == y_ptr, "from_buffer copied"
    try:
        len(y)
    except sm.MovedError as e:
        print(f"using y after the move: MovedError: {e}")

    # stage 2 on stream B: reads what stream A is still writing -> ordered on the device
    kernel, grid, block = stages["center_rows"]
    sm.launch(kernel, grid, block, sm.InOut(t), np.int32(ROWS), np.int32(COLS), stream=b_stream)

    # move back and reduce on stream A (ordered after stage 2 on B)
    y2 = t.into_buffer()
    assert y2.ptr == y_ptr, "into_buffer copied"
    kernel, grid, block = stages["total"]
    sm.launch(kernel, grid, block, sm.In(y2), sm.Atomic(box), np.int32(N), stream=a_stream)

    # drop everything mid-flight: buffers, tensor, streams, futures (never held)
    in_flight = sm.stats().in_flight
    del x, t, y2, a_stream, b_stream
    gc.collect()
    print(f"dropped every buffer, tensor and stream with {in_flight} submissions in flight")

    result = box.get()  # waits for the pending atomic writes
    y_ref = 2.0 * x_host.astype(np.float64) + 1.0
    y_ref = y_ref.reshape(ROWS, COLS)
    y_ref -= y_ref.mean(axis=1, keepdims=True)
    expect = float(np.square(y_ref).sum())
    rel = abs(result - expect) / expect
    ok = rel < 1e-5
    print(f"sum of squares after the pipeline: {result:.4f} (NumPy float64 reference "
          f"{expect:.4f}, relative error {rel:.1e}) {'OK' if ok else 'MISMATCH'}")

    del box
    sm.synchronize()
    gc.collect()
    st = sm.stats()
    print(f"stats: {st}")
    clean = st.in_flight == 0 and st.leaked == 0
    print("nothing in flight, nothing leaked" if clean else "NOT CLEAN")
    return 0 if ok and clean else 1


if __name__ == "__main__":
    sys.exit(main())
