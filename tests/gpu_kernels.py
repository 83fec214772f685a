"""CuPy RawKernels used by the GPU tests (compiled lazily, cached)."""

import functools

SOURCE = r"""
extern "C" {
__device__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
__global__ void slow_copy(const float* src, float* dst, int n, long long cycles) {
    spin(cycles);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        dst[i] = src[i];
}
__global__ void slow_fill(float* x, int n, float value, long long cycles) {
    spin(cycles);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = value;
}
__global__ void fill(float* x, int n, float value) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        x[i] = value;
}
__global__ void saxpy(float a, const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + y[i];
}
__global__ void scale_len(float* x, long long n, double factor) {   // pointer + length
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) x[i] = (float)(x[i] * factor);
}
__global__ void sum_atomic(const float* x, int n, float* total) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(total, x[i]);
}
// Read x, and wait (bounded) for *flag to become 1; seen[0] = 1 if it did.
__global__ void wait_flag(const float* x, unsigned long long flag_addr, int* seen, long long cycles) {
    volatile int* flag = (volatile int*)flag_addr;
    long long t0 = clock64();
    while (*flag == 0 && clock64() - t0 < cycles) { }
    seen[0] = *flag;
}
__global__ void set_flag(const float* x, unsigned long long flag_addr) {
    *(volatile int*)flag_addr = 1;
    __threadfence_system();
}
__global__ void trap(float* x) {
    *(volatile float*)0 = x[0];   // illegal address
    __trap();
}
}
"""

NAMES = ("slow_copy", "slow_fill", "fill", "saxpy", "scale_len", "sum_atomic", "wait_flag",
         "set_flag", "trap")


@functools.lru_cache(maxsize=None)
def module():
    import cupy
    return cupy.RawModule(code=SOURCE)


def kernel(name):
    return module().get_function(name)


def cycles(ms: float) -> int:
    """Approximate clock64() cycles for ``ms`` milliseconds (H200: about 2 GHz)."""
    return int(ms * 2.0e6)


@functools.lru_cache(maxsize=None)
def raw_kernel(name):
    """``name`` as a ``cupy.RawKernel``: unlike a RawModule's Function (loaded for the device
    current when it was asked for), a RawKernel loads itself on each device it launches on --
    what the tests with several GPUs need."""
    import cupy
    return cupy.RawKernel(SOURCE, name)
