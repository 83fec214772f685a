"""Tile and SIMT stages handing one allocation back and forth, with no copies.

    stage 1  cuTile,  stream A   Y = X @ W                      -> Tensor Y (M, N)
    handoff  Y.into_buffer()                                     -> Buffer y, same pointer
    stage 2  CuPy RawKernel (SIMT), stream B   y = relu(y + bias[col]), in place
    handoff  Tensor.from_buffer(y, (M, N))                       -> Tensor, same pointer
    stage 3  cuTile,  stream A   Z = (Y - mean_row) / std_row   -> Tensor Z (M, N)

Stage 2 runs on another stream than stages 1 and 3; sharedmem orders each
stage after the one whose output it reads, on the device. The result is
checked against a float64 NumPy reference. On a machine without a GPU (or
without cuTile) the same file runs the stages as ``sm.host_kernel`` functions.

Run: ``PYTHONPATH=. python3 examples/mixed_pipeline.py`` (``--trace run.json`` records a
timeline of the run with ``sm.trace``: open it in https://ui.perfetto.dev)
"""

# No `from __future__ import annotations`: cuTile evaluates kernel annotations.
import gc
import sys

import numpy as np

import sharedmem as sm

M, K, N = 256, 128, 256
TM, TN, TK = 64, 64, 32
EPS = 1e-5

SIMT_SOURCE = r"""
extern "C" __global__ void bias_relu(float* y, const float* bias, int rows, int cols) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) {
        float v = y[i] + bias[i % cols];
        y[i] = v > 0.0f ? v : 0.0f;
    }
}
"""


def tile_and_simt_stages():
    """cuTile kernels for stages 1 and 3, a CuPy RawKernel for stage 2."""
    import cupy
    import cuda.tile as ct

    ConstInt = ct.Constant[int]
    zero = ct.PaddingMode.ZERO

    @ct.kernel
    def matmul(A, B, C, tm: ConstInt, tn: ConstInt, tk: ConstInt):
        bx, by = ct.bid(0), ct.bid(1)
        acc = ct.full((tm, tn), 0, dtype=ct.float32)
        for k in range(ct.num_tiles(A, axis=1, shape=(tm, tk))):
            a = ct.load(A, index=(bx, k), shape=(tm, tk), padding_mode=zero)
            b = ct.load(B, index=(k, by), shape=(tk, tn), padding_mode=zero)
            acc = ct.mma(a, b, acc)
        ct.store(C, index=(bx, by), tile=ct.astype(acc, C.dtype))

    @ct.kernel
    def normalize_rows(X, Z, eps, TILE_N: ConstInt):
        row = ct.bid(0)
        n = X.shape[1]
        tiles = ct.num_tiles(X, axis=1, shape=(1, TILE_N))
        mean = ct.full((1, TILE_N), 0, dtype=ct.float32)
        for j in range(tiles):
            mean += ct.load(X, index=(row, j), shape=(1, TILE_N), padding_mode=zero)
        mean = ct.sum(mean, axis=1) / n
        var = ct.full((1, TILE_N), 0, dtype=ct.float32)
        for j in range(tiles):
            tx = ct.load(X, index=(row, j), shape=(1, TILE_N), padding_mode=zero)
            inside = (j * TILE_N + ct.arange(TILE_N, dtype=ct.int32)) < n
            d = ct.where(inside, tx - mean, 0)
            var += d * d
        rstd = 1 / ct.sqrt(ct.sum(var, axis=1) / n + eps)
        for j in range(tiles):
            tx = ct.load(X, index=(row, j), shape=(1, TILE_N), padding_mode=zero)
            ct.store(Z, index=(row, j), tile=((tx - mean) * rstd).astype(Z.dtype))

    bias_relu = cupy.RawKernel(SIMT_SOURCE, "bias_relu")
    return {
        "matmul": (matmul, (M // TM, N // TN), None, (TM, TN, TK)),
        "bias_relu": (bias_relu, (M * N + 255) // 256, 256, ()),
        "normalize_rows": (normalize_rows, (M,), None, (N,)),
    }


def host_stages():
    """The same three stages as host kernels (the reference path without a GPU)."""
    @sm.host_kernel
    def matmul(A, B, C, tm, tn, tk):
        C[:] = A @ B

    @sm.host_kernel
    def bias_relu(y, bias, rows, cols):
        v = y.reshape(rows, cols) + bias
        y[:] = np.maximum(v, 0).reshape(-1)

    @sm.host_kernel
    def normalize_rows(X, Z, eps, tile_n):
        x = X.astype(np.float64)
        mean = x.mean(axis=1, keepdims=True)
        Z[:] = (x - mean) / np.sqrt(x.var(axis=1, keepdims=True) + eps)

    return {"matmul": (matmul, 1, 1, (TM, TN, TK)), "bias_relu": (bias_relu, 1, 1, ()),
            "normalize_rows": (normalize_rows, 1, 1, (N,))}


def stale_view(buf, on_gpu):
    """A second view of the buffer that a user forgot about: a CuPy array on the
    GPU, a NumPy array (through DLPack) on the host."""
    if on_gpu:
        from interop.cupy import as_cupy
        return as_cupy(buf)
    return np.from_dlpack(buf)


def main() -> int:
    dev = sm.default_device()
    on_gpu = dev.kind == "cuda"
    if on_gpu:
        try:
            import cuda.tile  # noqa: F401
        except ImportError:
            on_gpu = False
            dev = sm.Device.host()
            print("cuda.tile is not installed: running the host reference stages")
    stages = tile_and_simt_stages() if on_gpu else host_stages()
    print(f"mixed Tile/SIMT pipeline on {dev} ({'cuTile + CuPy' if on_gpu else 'host kernels'})")
    a_stream, b_stream = dev.create_stream("tile"), dev.create_stream("simt")

    rng = np.random.default_rng(1)
    x_h = rng.standard_normal((M, K)).astype(np.float32)
    w_h = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    bias_h = rng.standard_normal(N).astype(np.float32) * 0.5

    X = sm.Tensor.from_host(x_h, device=dev, stream=a_stream)
    W = sm.Tensor.from_host(w_h, device=dev, stream=a_stream)
    bias = sm.Buffer.from_host(bias_h, device=dev, stream=b_stream)
    Y = sm.Tensor.empty((M, N), "float32", device=dev)
    Z = sm.Tensor.empty((M, N), "float32", device=dev)
    ptr = Y.ptr

    k, grid, block, consts = stages["matmul"]
    sm.launch(k, grid, block, sm.In(X), sm.In(W), sm.Out(Y), *consts, stream=a_stream)

    y = Y.into_buffer()                                   # Tile -> SIMT, zero-copy
    assert y.ptr == ptr, "into_buffer copied"
    k, grid, block, consts = stages["bias_relu"]
    sm.launch(k, grid, block, sm.InOut(y), sm.In(bias), np.int32(M), np.int32(N),
              stream=b_stream)                            # ordered after stage 1 on the device

    stale = stale_view(y, on_gpu)                         # somebody kept a second view
    try:
        sm.Tensor.from_buffer(y, (M, N))
        print("ERROR: the move should have been refused")
        return 1
    except sm.AliasError as e:
        print("handing the buffer back to the Tile stage is refused while a stale view lives:")
        print("  " + str(e).splitlines()[1].strip())
    del stale
    gc.collect()

    Y2 = sm.Tensor.from_buffer(y, (M, N))                 # SIMT -> Tile, zero-copy
    assert Y2.ptr == ptr, "from_buffer copied"
    k, grid, block, consts = stages["normalize_rows"]
    sm.launch(k, grid, block, sm.In(Y2), sm.Out(Z), np.float32(EPS), *consts, stream=a_stream)
    print(f"pointer identical across both handoffs: 0x{ptr:x}")

    z = Z.to_host()
    ref = x_h.astype(np.float64) @ w_h.astype(np.float64)
    ref = np.maximum(ref + bias_h, 0)
    ref = (ref - ref.mean(axis=1, keepdims=True)) / np.sqrt(ref.var(axis=1, keepdims=True) + EPS)
    err = float(np.linalg.norm(z - ref) / np.linalg.norm(ref))
    ok = err < 1e-4 and np.isfinite(z).all()
    print(f"relative error against the float64 NumPy reference: {err:.2e} {'OK' if ok else 'FAIL'}")

    del X, W, bias, Y2, Z, y, a_stream, b_stream
    sm.synchronize()
    gc.collect()
    st = sm.stats()
    clean = st.in_flight == 0 and st.leaked == 0
    print(f"stats: in_flight={st.in_flight} leaked={st.leaked} live_views={st.live_views} "
          f"-> {'clean' if clean else 'NOT CLEAN'}")
    return 0 if ok and clean else 1


if __name__ == "__main__":
    if "--trace" in sys.argv:
        if sys.argv.index("--trace") + 1 == len(sys.argv):
            sys.exit("usage: mixed_pipeline.py [--trace FILE.json]: --trace needs the file to "
                     "write the timeline to")
        with sm.trace(sys.argv[sys.argv.index("--trace") + 1]):
            rc = main()
        sys.exit(rc)
    sys.exit(main())
