"""The use-after-free anchor: the same cross-stream pattern with raw CuPy and with sharedmem.

Stream B runs a slow kernel that reads `src`, allocated on stream A. The user
drops `src` at once and allocates and writes new arrays on A at once. Raw CuPy
returns src's block to A's pool immediately (cupy/cupy#8068), so the new
writes land in memory B has not read yet. sharedmem keeps the block leased
until B's kernel has finished. Prints how many trials were corrupted.

Run on a GPU: PYTHONPATH=. python3 benchmarks/use_after_free.py [trials]
"""

import gc
import sys

import numpy as np

SOURCE = r"""
extern "C" {
__global__ void slow_copy(const float* src, float* dst, int n, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        dst[i] = src[i];
}
__global__ void fill(float* x, int n, float value) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = value;
}
}
"""
N = 1 << 20
CYCLES = 40_000_000  # about 20 ms on an H200


def raw_cupy(trials: int) -> int:
    import cupy as cp
    mod = cp.RawModule(code=SOURCE)
    slow_copy, fill = mod.get_function("slow_copy"), mod.get_function("fill")
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    expect = np.arange(N, dtype=np.float32)
    bad = 0
    for _ in range(trials):
        with a:
            src = cp.asarray(expect)
        a.synchronize()
        with b:
            out = cp.empty(N, cp.float32)
            slow_copy((256,), (256,), (src, out, np.int32(N), np.int64(CYCLES)))
        del src  # back to A's pool at once
        with a:
            fresh = [cp.empty(N, cp.float32) for _ in range(4)]
            for f in fresh:
                fill((256,), (256,), (f, np.int32(N), np.float32(-1)))
        b.synchronize()
        bad += int(not np.array_equal(cp.asnumpy(out), expect))
        a.synchronize()
        del fresh, out
    return bad


def with_sharedmem(trials: int) -> int:
    import cupy as cp
    import sharedmem as sm
    mod = cp.RawModule(code=SOURCE)
    slow_copy, fill = mod.get_function("slow_copy"), mod.get_function("fill")
    dev = sm.Device(0)
    a, b = dev.create_stream("A"), dev.create_stream("B")
    expect = np.arange(N, dtype=np.float32)
    bad = 0
    for _ in range(trials):
        src = sm.Buffer.from_host(expect, device=dev, stream=a)
        a.synchronize()
        out = sm.Buffer.empty(N, "float32", device=dev, stream=b)
        sm.launch(slow_copy, 256, 256, sm.In(src), sm.Out(out), N, np.int64(CYCLES), stream=b)
        del src  # the launch's lease keeps it
        gc.collect()
        fresh = [sm.Buffer.empty(N, "float32", device=dev, stream=a) for _ in range(4)]
        for f in fresh:
            sm.launch(fill, 256, 256, sm.Out(f), N, -1.0, stream=a)
        bad += int(not np.array_equal(out.to_host(stream=b), expect))
        del fresh, out
    sm.synchronize()
    return bad


if __name__ == "__main__":
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    raw = raw_cupy(trials)
    ours = with_sharedmem(trials)
    print(f"use-after-free pattern, {trials} trials: raw CuPy corrupted {raw}/{trials}, "
          f"sharedmem corrupted {ours}/{trials}")
    sys.exit(0 if ours == 0 else 1)
