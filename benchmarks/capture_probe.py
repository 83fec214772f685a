"""Which driver calls break another library's graph capture: a probe for the GPU machine.

While a stream captures a CUDA graph begun in global mode (``torch.cuda.graph``'s default),
the driver refuses "potentially unsafe" calls from threads in its default mode and
invalidates that capture; in relaxed mode it allows them. sharedmem makes its own such calls
in relaxed mode (``CudaBackend.relaxed``, and the event queries and waits: docs/model.md,
"Backends"), and relies on the others -- what its finalizers destroy, what a launch records
-- being allowed. This probe says which are which on the driver at hand: each call is made
once inside a fresh global-mode capture of a CuPy stream, from the capturing thread and from
another thread, and the table gives the call's answer and how the capture ended.

    python benchmarks/capture_probe.py

Seen on an H100 (2026-12-07, CUDA 13 driver): cuEventQuery, cuStreamQuery, cuMemAlloc and
cuMemFree refused (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, the capture invalidated); creating
and destroying events, streams and graphs, cuEventRecord and launches on other streams,
cuMemGetInfo, cuCtxGetCurrent, cuStreamGetFlags and cuPointerGetAttribute allowed.
"""
import threading

import cupy as cp
from cuda.bindings import driver as cu


def _calls(other, done_event, x, kernel):
    """``(name, call)`` of each call probed; what a call needs is made before its capture."""
    yield "cuEventCreate", lambda: cu.cuEventCreate(2)
    ev = cu.cuEventCreate(2)[1]
    yield "cuEventDestroy", lambda: cu.cuEventDestroy(ev)
    yield "cuStreamCreate", lambda: cu.cuStreamCreate(1)
    st = cu.cuStreamCreate(1)[1]
    yield "cuStreamDestroy (idle)", lambda: cu.cuStreamDestroy(st)
    ev2 = cu.cuEventCreate(2)[1]
    yield "cuEventRecord, other stream", lambda: cu.cuEventRecord(ev2, other.ptr)
    yield "cuEventQuery (done event)", lambda: cu.cuEventQuery(done_event)
    yield "cuEventSynchronize (done event)", lambda: cu.cuEventSynchronize(done_event)
    yield "cuLaunchKernel, other stream", lambda: (kernel((1,), (1,), (x,), stream=other), )
    yield "cuStreamQuery, other stream", lambda: cu.cuStreamQuery(other.ptr)
    yield "cuStreamSynchronize, other stream", lambda: cu.cuStreamSynchronize(other.ptr)
    yield "cuMemAlloc", lambda: cu.cuMemAlloc(1 << 20)
    p = cu.cuMemAlloc(1 << 20)[1]
    yield "cuMemFree", lambda: cu.cuMemFree(p)
    yield "cuMemAllocHost", lambda: cu.cuMemAllocHost(1 << 20)
    h = cu.cuMemAllocHost(1 << 20)[1]
    yield "cuMemFreeHost", lambda: cu.cuMemFreeHost(h)
    g = cu.cuGraphCreate(0)[1]
    yield "cuGraphDestroy (empty)", lambda: cu.cuGraphDestroy(g)
    g2 = cu.cuGraphCreate(0)[1]
    exe = cu.cuGraphInstantiate(g2, 0)[1]
    yield "cuGraphExecDestroy", lambda: cu.cuGraphExecDestroy(exe)
    yield "cuMemGetInfo", lambda: cu.cuMemGetInfo()
    yield "cuCtxGetCurrent", lambda: cu.cuCtxGetCurrent()
    yield "cuStreamGetFlags, other stream", lambda: cu.cuStreamGetFlags(other.ptr)
    yield "cuPointerGetAttribute", lambda: cu.cuPointerGetAttribute(
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_SIZE, x.data.ptr)


def main() -> None:
    dev = cp.cuda.Device(0)
    dev.use()
    theirs = cp.cuda.Stream(non_blocking=True)
    other = cp.cuda.Stream(non_blocking=True)
    y = cp.zeros(1 << 20, cp.uint8)
    x = cp.zeros(4, cp.float32)
    kernel = cp.RawKernel('extern "C" __global__ void f(float* x) { x[0] = 1; }', "f")
    done_event = cu.cuEventCreate(2)[1]
    cu.cuEventRecord(done_event, other.ptr)
    other.synchronize()
    global_mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    print(f"{'thread':13s} {'call':36s} {'its answer':45s} capture ended")
    for where in ("this thread", "other thread"):
        for name, call in _calls(other, done_event, x, kernel):
            answer = []

            def make():
                with dev:  # (another thread: the context current there too)
                    try:
                        r = call()
                        answer.append(r[0] if isinstance(r, tuple) else r)
                    except Exception as e:
                        answer.append(f"{type(e).__name__}: {e}")

            assert cu.cuStreamBeginCapture(theirs.ptr, global_mode)[0] == 0
            cu.cuMemsetD8Async(y.data.ptr, 3, y.nbytes, theirs.ptr)
            if where == "this thread":
                make()
            else:
                t = threading.Thread(target=make)
                t.start()
                t.join()
            err, graph = cu.cuStreamEndCapture(theirs.ptr)
            if err == cu.CUresult.CUDA_SUCCESS:
                cu.cuGraphDestroy(graph)
            print(f"{where:13s} {name:36s} {str(answer[0])[:45]:45s} {getattr(err, 'name', err)}")
            dev.synchronize()


if __name__ == "__main__":
    main()
