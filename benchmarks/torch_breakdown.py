"""Where a launch with torch tensors as arguments spends its time, on a GPU.

Times, in one process (best of 5 rounds, microseconds a call): a raw CuPy launch of CuPy
arrays; ``sm.launch`` of CuPy arrays, of torch tensors on a sharedmem stream (ordered after
torch's current stream: one device-side wait a launch) and on torch's current stream (no
wait), and with a fresh torch tensor each launch; the parts of the torch path (torch's current
stream handle, ``untyped_storage()``, the layout reads, ``pointer_info``, the order after a
foreign stream); imports (``torch.__dlpack__``, ``sm.from_dlpack``, ``cupy.from_dlpack``); and
cuTile launches of torch tensors against ``ct.launch`` where cuda.tile is installed.

Run on the GPU machine, with torch: ``python benchmarks/torch_breakdown.py``.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharedmem as sm  # noqa: E402
from benchmarks.run import LAUNCH_SRC, cupy_stream  # noqa: E402


def main() -> int:
    import cupy as cp
    import torch
    dev = sm.default_device()
    s = dev.create_stream("torch-breakdown")
    on_torch = sm.Stream.from_external(torch.cuda.current_stream(dev.ordinal))
    k = cp.RawKernel(LAUNCH_SRC, "k4")
    ta, tb, tc, td = (torch.ones(32, device=f"cuda:{dev.ordinal}") for _ in range(4))
    ca, cb, cc, cd = (cp.ones(32, cp.float32) for _ in range(4))
    nn = np.int32(32)
    In, Out = sm.In, sm.Out
    torch.cuda.synchronize()

    def row(name, fn, n=2000):
        for _ in range(100):
            fn()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        s.synchronize()
        torch.cuda.synchronize()
        print(f"{name:64s} {best:8.2f} us", flush=True)

    cps = cupy_stream(s)
    row("raw CuPy launch of CuPy arrays", lambda: k((1,), (32,), (ca, cb, cc, cd, nn), stream=cps))
    with cps:  # (CuPy's current stream: a launch of CuPy arrays there waits for nothing)
        row("sm.launch, CuPy arrays, CuPy's current stream (no wait)",
            lambda: sm.launch(k, 1, 32, In(ca), In(cb), Out(cc), Out(cd), nn, stream=s))
    row("sm.launch, torch tensors, a sharedmem stream (a wait a launch)",
        lambda: sm.launch(k, 1, 32, In(ta), In(tb), Out(tc), Out(td), nn, stream=s))
    row("sm.launch, torch tensors, torch's current stream (no wait)",
        lambda: sm.launch(k, 1, 32, In(ta), In(tb), Out(tc), Out(td), nn, stream=on_torch))

    def fresh():
        x = torch.empty(32, device=ta.device)
        sm.launch(k, 1, 32, In(ta), In(tb), Out(x), Out(td), nn, stream=on_torch)
    row("torch.empty(32) alone", lambda: torch.empty(32, device=ta.device))
    row("sm.launch, a fresh torch tensor each launch (torch's stream)", fresh)

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        row("torch._C._cuda_getCurrentRawStream", lambda: raw(dev.ordinal))
    row("torch.cuda.current_stream", lambda: torch.cuda.current_stream(dev.ordinal))
    row("tensor.untyped_storage()", lambda: ta.untyped_storage())
    row("tensor.data_ptr(), .shape, .stride(), .dtype",
        lambda: (ta.data_ptr(), ta.shape, ta.stride(), ta.dtype))
    row("tensor.is_conj(), .is_neg()", lambda: (ta.is_conj(), ta.is_neg()))
    row("isinstance(tensor, torch.Tensor)", lambda: isinstance(ta, torch.Tensor))
    # the launch path's own parts, one tensor (or the 4) at a time, warm (facts known)
    from interop import cupy_launch as cl
    sl = sys.modules["sharedmem.launch"]  # (the module: sharedmem.launch is the function)
    row("interop.cupy_launch.torch_facts(tensor), known", lambda: cl.torch_facts(ta))
    row("interop.cupy_launch.coerce(tensor), known", lambda: cl.coerce(ta, dev))
    adapter, args = sl.adapter_for(k), (In(ta), In(tb), Out(tc), Out(td), nn)
    row("resolve_args, 4 torch tensors + a scalar", lambda: sl.resolve_args(adapter, args, None))
    row("order_after_libraries, torch's stream (no wait)",
        lambda: cl.order_after_libraries(on_torch, dev, None))
    row("order_after_libraries, a sharedmem stream (a wait)",
        lambda: cl.order_after_libraries(s, dev, None))
    backend, p = dev.backend, ta.data_ptr()
    row("backend.pointer_info", lambda: backend.pointer_info(p))
    h = torch.cuda.current_stream(dev.ordinal).cuda_stream
    row("backend.order_after_handle (torch's stream)",
        lambda: backend.order_after_handle(s._impl, h))
    row("torch __dlpack__(stream=1)", lambda: ta.__dlpack__(stream=1), 500)
    row("sm.from_dlpack(torch tensor)", lambda: sm.from_dlpack(ta), 500)
    row("sm.from_dlpack(torch tensor, stream=torch's)",
        lambda: sm.from_dlpack(ta, stream=on_torch), 500)
    row("cupy.from_dlpack(torch tensor)", lambda: cp.from_dlpack(ta), 500)
    try:
        import cuda.tile as ct
    except ImportError:
        print("cuda.tile not installed: no cuTile rows")
        return 0

    @ct.kernel
    def vadd(a, b, c, TT: ct.Constant[int]):
        i = ct.bid(0)
        ct.store(c, index=(i,), tile=ct.load(a, index=(i,), shape=(TT,)) +
                 ct.load(b, index=(i,), shape=(TT,)))
    xa, xb, xc = (torch.ones(256 * 64, device=ta.device) for _ in range(3))
    sh = s.handle
    row("raw ct.launch of torch tensors",
        lambda: ct.launch(sh, (64, 1, 1), vadd, (xa, xb, xc, 256)))
    row("sm.launch cuTile, torch tensors, a sharedmem stream",
        lambda: sm.launch(vadd, (64,), None, In(xa), In(xb), Out(xc), 256, stream=s))
    row("sm.launch cuTile, torch tensors, torch's current stream",
        lambda: sm.launch(vadd, (64,), None, In(xa), In(xb), Out(xc), 256, stream=on_torch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
