"""The price of safety: sharedmem against the raw libraries, measured in one process.

Each row is a ratio against the raw library measured in the same run (median
of several repetitions, raw times beside it), so machine noise cancels.
On a GPU: launch (vs CuPy RawKernel and the cuLaunchKernel floor), cuTile (vs
ct.launch), moves, DLPack (vs cupy.from_dlpack), retirement. On the host
backend: moves, launch and retirement of host kernels (absolute numbers).

Run: ``make bench`` (host) or ``make gpu-bench`` on the GPU machine.
Options: --quick (fewer iterations), --launches N (retirement row), --heap (import cuda.tile,
torch and jax first, as a real pipeline has them). Where the cyclic collector ran while a row
was timed, its time a call is listed after the table.
"""

# No `from __future__ import annotations`: cuTile evaluates kernel annotations.
import argparse
import ctypes
import gc
import os
import resource
import statistics
import sys
import time

import numpy as np

import sharedmem as sm

ROWS: list[tuple[str, str, str, str]] = []


class GcMeter:
    """Time the cyclic garbage collector takes while each timed function runs: what a loop's
    surviving objects cost it in a process with a large heap (see ``--heap``)."""

    def __init__(self):
        self.current = None
        self.by = {}  # function -> [gc seconds, calls, collections, full collections]
        self._t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase, info):
        if self.current is None:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        b = self.by.setdefault(self.current, [0.0, 0, 0, 0])
        b[0] += time.perf_counter() - self._t0
        b[2] += 1
        b[3] += info["generation"] == 2

    def run(self, fn, n):
        """Call ``fn`` n times, metered."""
        self.current = fn
        try:
            for _ in range(n):
                fn()
        finally:
            self.current = None
            self.by.setdefault(fn, [0.0, 0, 0, 0])[1] += n

    def note(self, fn) -> str:
        b = self.by.get(fn)
        if not b or not b[1]:
            return ""
        return f"gc {b[0] / b[1] * 1e6:.2f} us a call ({b[2] / b[1] * 1e4:.1f} collections, " \
               f"{b[3] / b[1] * 1e4:.2f} full, per 10k)"


GC = GcMeter()


def cupy_stream(stream):
    """CuPy's stream object for a sharedmem ``stream`` (same handle): CuPy 14's
    ``Stream.from_external`` (through ``__cuda_stream__``), ``ExternalStream`` before it."""
    import cupy as cp
    external = getattr(cp.cuda.Stream, "from_external", None)
    return external(stream) if external else cp.cuda.ExternalStream(stream.handle)


def per_call_us(fn, n, reps, sync=None, timed_sync=True):
    """Median over ``reps`` of the mean time of one call, in microseconds.
    ``timed_sync=False`` leaves the closing ``sync()`` out of the time (the
    calls only, for loops the GPU keeps up with)."""
    times = []
    for _ in range(reps):
        if sync:
            sync()
        t0 = time.perf_counter()
        GC.run(fn, n)
        if sync and timed_sync:
            sync()
        times.append((time.perf_counter() - t0) / n * 1e6)
        if sync and not timed_sync:
            sync()
    return statistics.median(times)


def quiesce(sync) -> None:
    """Finish everything and let the retirer fall idle (it lingers LINGER seconds
    after the last work), so no measurement pays for another's retirement."""
    from sharedmem.runtime import retirer
    sync()
    sm.synchronize()
    time.sleep(retirer.LINGER + 0.01)


def interleaved_us(fns, n, reps, sync):
    """Like per_call_us for several functions measured in alternating rounds
    (raw, ours, raw, ours, ...), each round from a quiet runtime: drift of the
    machine over the run falls on all of them alike. Medians, microseconds."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            quiesce(sync)
            t0 = time.perf_counter()
            GC.run(fn, n)
            sync()
            times[i].append((time.perf_counter() - t0) / n * 1e6)
    return [statistics.median(t) for t in times]


def row(name, ours, raw=None, raw_name="", note="", fns=()):
    """One result row; ``fns``: the timed (ours, raw) functions, whose collector time is
    printed beside it where the collector ran."""
    if raw:
        ROWS.append((name, f"{ours:8.2f} us", f"{raw:8.2f} us {raw_name}", f"{ours / raw:5.2f}x"))
    else:
        ROWS.append((name, f"{ours:8.2f} us", raw_name or "-", note or "-"))
    print(f"  {name}: {ROWS[-1][1]} | {ROWS[-1][2]} | {ROWS[-1][3]}", flush=True)
    notes = [f"{who}: {GC.note(fn)}" for who, fn in zip(("ours", "raw"), fns) if GC.note(fn)]
    if notes:
        GC_ROWS.append((name, "; ".join(notes)))


GC_ROWS: list[tuple[str, str]] = []


# -- moves ---------------------------------------------------------------------------------
def bench_moves(dev, quick):
    """Moves at 1 KiB and at 1 GiB, warmed up and measured in alternating
    rounds (so a warm-up or a clock change cannot favour one size)."""
    n = 1000 if quick else 10000
    big, big_label = (1 << 30), "1 GiB"
    if dev.kind == "host":
        big, big_label = 1 << 28, "256 MiB"
    sizes = (("1 KiB", 1 << 10), (big_label, big))
    boxes = {label: [sm.Buffer.empty(nbytes // 4, "float32", device=dev)] for label, nbytes in sizes}

    def mover(label, nbytes):
        box = boxes[label]

        def move():
            t = sm.Tensor.from_buffer(box[0], (nbytes // 4,))
            box[0] = t.into_buffer()

        def borrow():
            t = sm.Tensor.from_buffer(box[0], (nbytes // 4,))
            with t.as_buffer():
                pass
            box[0] = t.into_buffer()
        return move, borrow

    fns = {label: mover(label, nbytes) for label, nbytes in sizes}
    for move, borrow in fns.values():  # warm up
        per_call_us(move, n // 10, 1)
        per_call_us(borrow, n // 10, 1)
    times = {label: ([], []) for label, _ in sizes}
    for _ in range(11):  # (many short rounds: one slow stretch of the machine moves no median)
        for label, _ in sizes:
            move, borrow = fns[label]
            times[label][0].append(per_call_us(move, n, 1))
            times[label][1].append(per_call_us(borrow, n, 1))
    med = {label: (statistics.median(a), statistics.median(b)) for label, (a, b) in times.items()}
    small = med["1 KiB"]
    for label, _ in sizes:
        m, b = med[label]
        note = "zero-copy" if label == "1 KiB" else f"{m / small[0]:.2f}x the 1 KiB move"
        row(f"move from_buffer+into_buffer, {label}", m, note=note)
        note = "-" if label == "1 KiB" else f"{b / small[1]:.2f}x the 1 KiB borrow"
        row(f"move+as_buffer borrow+move back, {label}", b, note=note)
    boxes.clear()
    gc.collect()


# -- launches -----------------------------------------------------------------------------------
LAUNCH_SRC = r"""
extern "C" __global__ void k4(const float* a, const float* b, float* c, float* d, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { c[i] = a[i] + b[i]; d[i] = a[i] - b[i]; }
}
"""


K16_SRC = ('extern "C" __global__ void k16(' + ", ".join(f"float* p{i}" for i in range(16)) +
           ") { int i = threadIdx.x; if (i < 32) { p0[i] += p15[i]; } }")


def _cuda_core_floor(dev, stream, ptrs, n):
    """cuda.core's ``launch`` of the same kernel on the same memory, or None (and why)."""
    try:
        from cuda.core import Device as CDevice, LaunchConfig, Program, ProgramOptions, launch
        cdev = CDevice(dev.ordinal)
        cdev.set_current()
        cc = dev.compute_capability
        prog = Program(LAUNCH_SRC, code_type="c++", options=ProgramOptions(arch=f"sm_{cc[0]}{cc[1]}"))
        ker = prog.compile("cubin").get_kernel("k4")
        cs = cdev.create_stream(stream)
        cfg = LaunchConfig(grid=1, block=32)
        args = [np.uint64(p) for p in ptrs] + [np.int32(n)]  # (8-byte pointer slots)

        def floor_core():
            launch(cs, cfg, ker, *args)
        floor_core()
        return floor_core, None
    except Exception as e:  # not on this machine: the row says why
        return None, f"{type(e).__name__}: {e}"[:70]


def bench_launch_gpu(dev, quick):
    import cupy as cp
    from cuda.bindings import driver as cu
    n_launch = 5000 if quick else 20000
    k = cp.RawKernel(LAUNCH_SRC, "k4")
    k16 = cp.RawKernel(K16_SRC, "k16")
    s = dev.create_stream("bench")
    cps = cupy_stream(s)
    n = 32
    A, B, C, D = (sm.Buffer.from_host(np.ones(n, np.float32), device=dev) for _ in range(4))
    many = [sm.Buffer.from_host(np.ones(n, np.float32), device=dev) for _ in range(16)]
    ca, cb, cc, cd = (cp.ones(n, cp.float32) for _ in range(4))
    cmany = [cp.ones(n, cp.float32) for _ in range(16)]
    sync = s.synchronize
    nn = np.int32(n)
    In, Out = sm.In, sm.Out
    box = [C]

    def raw():
        k((1,), (32,), (ca, cb, cc, cd, nn), stream=cps)

    def ours():
        sm.launch(k, 1, 32, In(A), In(B), Out(box[0]), Out(D), nn, stream=s)

    def ours_fresh():  # a move between launches: new views every launch
        t = sm.Tensor.from_buffer(box[0], (n,))
        sm.launch(k, 1, 32, In(A), In(B), Out(t), Out(D), nn, stream=s)
        box[0] = t.into_buffer()

    def ours_cupy():  # CuPy arrays as arguments: leased for the launch, no view made; on
        # CuPy's current stream (made cps below, as raw runs there): no wait
        sm.launch(k, 1, 32, In(ca), In(cb), Out(cc), Out(cd), nn, stream=s)

    s_other = dev.create_stream("bench-other")

    def ours_cupy_other():  # the same on a stream other than CuPy's current: a wait a launch
        sm.launch(k, 1, 32, In(ca), In(cb), Out(cc), Out(cd), nn, stream=s_other)

    def raw_new_out():  # a new output array each launch (CuPy's pool gives its memory)
        k((1,), (32,), (ca, cb, cp.empty(n, cp.float32), cd, nn), stream=cps)

    def ours_new_out():  # the same through sharedmem: the array is new to every launch
        sm.launch(k, 1, 32, In(ca), In(cb), Out(cp.empty(n, cp.float32)), Out(cd), nn, stream=s)

    def raw16():
        k16((1,), (32,), tuple(cmany), stream=cps)

    def ours16():
        sm.launch(k16, 1, 32, *many, stream=s)

    prepared = sm.op(k, 1, 32, In(A), In(B), Out(D), Out(many[0]), nn)

    def ours_op():  # described once, submitted in a loop
        prepared.submit(s)

    # the floor: cuLaunchKernel through cuda.bindings with a pre-packed void**
    with cp.cuda.Device(dev.ordinal):
        func = int(k.kernel.ptr)
    vals = (ctypes.c_uint64 * 5)(ca.data.ptr, cb.data.ptr, cc.data.ptr, cd.data.ptr, n)
    ptrs = (ctypes.c_void_p * 5)(*[ctypes.addressof(vals) + 8 * i for i in range(5)])
    addr = ctypes.addressof(ptrs)
    cus = cu.CUstream(s.handle)
    launch = cu.cuLaunchKernel

    def floor():
        launch(func, 1, 1, 1, 32, 1, 1, 0, cus, addr, 0)

    floor_core, why = _cuda_core_floor(dev, s, [ca.data.ptr, cb.data.ptr, cc.data.ptr,
                                                cd.data.ptr], n)
    fns = [raw, ours, ours_fresh, ours_cupy, ours_op, floor, raw16, ours16, ours_cupy_other,
           raw_new_out, ours_new_out]
    if floor_core is not None:
        fns.append(floor_core)
    before = cp.cuda.get_current_stream()
    cps.use()  # (CuPy's current stream: where raw launches, and ours_cupy with no wait)
    try:
        for fn in fns:  # warm up
            for _ in range(200):
                fn()
        sync()
        t = interleaved_us(fns, n_launch, 7, lambda: (sync(), s_other.synchronize()))
    finally:
        before.use()
    (t_raw, t_ours, t_fresh, t_cupy, t_op, t_floor, t_raw16, t_ours16, t_cupy_other,
     t_raw_new, t_ours_new) = t[:11]
    sm.synchronize()
    core = sm.show_config(open(os.devnull, "w"))["core"].split(" (")[0]
    row(f"launch, 4 views reused + scalar, vs CuPy RawKernel call ({core})", t_ours, t_raw, "CuPy",
        fns=(ours, raw))
    if floor_core is not None:
        row("launch, same, vs cuda.core launch", t_ours, t[11], "cuda.core")
    else:
        ROWS.append(("launch, same, vs cuda.core launch", "n/a", why, "-"))
    row("launch, same, vs cuLaunchKernel floor (cuda.bindings)", t_ours, t_floor, "cuLaunchKernel")
    row("launch with fresh views (a move between launches) vs CuPy", t_fresh, t_raw, "CuPy",
        fns=(ours_fresh,))
    row("launch with CuPy arrays as arguments vs CuPy", t_cupy, t_raw, "CuPy", fns=(ours_cupy,))
    row("same, on a stream other than CuPy's current (a wait a launch)", t_cupy_other, t_raw,
        "CuPy")
    row("launch with a new CuPy output array each launch vs CuPy (cupy.empty in both)",
        t_ours_new, t_raw_new, "CuPy", fns=(ours_new_out, raw_new_out))
    row("launch, 16 buffers, vs CuPy with 16 arrays", t_ours16, t_raw16, "CuPy",
        fns=(ours16, raw16))
    row("op.submit of that launch vs CuPy", t_op, t_raw, "CuPy", fns=(ours_op,))
    return t_ours


def bench_multi_gpu(quick):
    """Two GPUs: a launch on cuda:1 whose inputs live on cuda:0 (peer access) against the same
    launch with every argument on cuda:1, and a write on cuda:0 followed by a read on cuda:1
    (a cross-device event wait each step) against the same pair of streams on one device."""
    import cupy as cp
    d0, d1 = sm.Device(0), sm.Device(1)
    d1.enable_peer_access(d0)
    n_launch = 3000 if quick else 20000
    n = 32
    k = cp.RawKernel(LAUNCH_SRC, "k4")
    s0, s1, s1b = d0.create_stream("b0"), d1.create_stream("b1"), d1.create_stream("b1b")
    A0, B0 = (sm.Buffer.from_host(np.ones(n, np.float32), device=d0) for _ in range(2))
    A1, B1, C1, D1 = (sm.Buffer.from_host(np.ones(n, np.float32), device=d1) for _ in range(4))
    W1 = sm.Buffer.from_host(np.ones(n, np.float32), device=d1)
    with cp.cuda.Device(1):
        ca, cb, cc, cd = (cp.ones(n, cp.float32) for _ in range(4))
        cps = cupy_stream(s1)
    nn = np.int32(n)
    In, Out = sm.In, sm.Out

    def sync():
        s0.synchronize()
        s1.synchronize()
        s1b.synchronize()

    def raw():
        with cp.cuda.Device(1):
            k((1,), (32,), (ca, cb, cc, cd, nn), stream=cps)

    def same():
        sm.launch(k, 1, 32, In(A1), In(B1), Out(C1), Out(D1), nn, stream=s1)

    def peer():
        sm.launch(k, 1, 32, In(A0), In(B0), Out(C1), Out(D1), nn, stream=s1)

    def handoff_same():  # write on one stream, read on another of the same device
        sm.launch(k, 1, 32, In(A1), In(B1), Out(W1), Out(D1), nn, stream=s1b)
        sm.launch(k, 1, 32, In(W1), In(B1), Out(C1), Out(D1), nn, stream=s1)

    def handoff_peer():  # write on cuda:0, read on cuda:1: a cross-device event wait
        sm.launch(k, 1, 32, In(B0), In(B0), Out(A0), Out(B0), nn, stream=s0)
        sm.launch(k, 1, 32, In(A0), In(B1), Out(C1), Out(D1), nn, stream=s1)

    fns = [raw, same, peer, handoff_same, handoff_peer]
    for fn in fns:
        for _ in range(200):
            fn()
    sync()
    t_raw, t_same, t_peer, t_hs, t_hp = interleaved_us(fns, n_launch, 7, sync)
    row("2 GPUs: launch on cuda:1, 4 views on cuda:1, vs CuPy on cuda:1", t_same, t_raw, "CuPy")
    row("2 GPUs: same launch, 2 inputs on cuda:0 (peer), vs all on cuda:1", t_peer, t_same,
        "same-device")
    row("2 GPUs: write on cuda:0 + read on cuda:1, vs 2 streams of cuda:1", t_hp, t_hs,
        "same-device")


def bench_launch_interpreted(quick):
    """The launch row again in a process that runs the interpreted sources."""
    import subprocess
    env = dict(os.environ, SHAREDMEM_PURE_PYTHON="1")
    r = subprocess.run([sys.executable, __file__, "--only-launch"] + (["--quick"] if quick else []),
                       env=env, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("  launch, 4 views reused"):
            name, rest = line.strip().split(":", 1)
            ours, raw, ratio = (x.strip() for x in rest.split("|"))
            ROWS.append((name.replace("(compiled)", "").strip(), ours, raw, ratio))
            print("  " + " | ".join(ROWS[-1]), flush=True)
            return
    ROWS.append(("launch, interpreted", "failed", (r.stderr or r.stdout)[-60:], "-"))


def bench_cutile(dev, quick):
    try:
        import cuda.tile as ct
    except ImportError:
        ROWS.append(("cuTile launch vs ct.launch", "n/a", "cuda.tile not installed", "-"))
        return
    import cupy as cp
    T = 256
    n = T * 64

    @ct.kernel
    def vadd(a, b, c, TT: ct.Constant[int]):
        i = ct.bid(0)
        ct.store(c, index=(i,), tile=ct.load(a, index=(i,), shape=(TT,)) + ct.load(b, index=(i,), shape=(TT,)))

    s = dev.create_stream("bench-tile")
    a, b, c = (sm.Tensor.from_host(np.ones(n, np.float32), device=dev) for _ in range(3))
    ca, cb, cc = (cp.ones(n, cp.float32) for _ in range(3))
    h = s.handle
    grid = (n // T, 1, 1)

    def raw():
        ct.launch(h, grid, vadd, (ca, cb, cc, T))

    def ours():
        sm.launch(vadd, (n // T,), None, sm.In(a), sm.In(b), sm.Out(c), T, stream=s)

    for fn in (raw, ours):
        for _ in range(100):
            fn()
    s.synchronize()
    nl = 2000 if quick else 10000
    # alternating rounds (raw, ours, raw, ...): a machine's drift falls on both alike
    t_raw, t_ours = interleaved_us([raw, ours], nl, 7, s.synchronize)
    row("cuTile launch, 3 arrays, vs raw ct.launch", t_ours, t_raw, "ct.launch", fns=(ours, raw))


def bench_torch_args(dev, quick):
    """torch tensors as launch arguments (leased through cached facts, ordered after torch's
    current stream: interop.cupy_launch.coerce) of a CuPy kernel against CuPy's own launch of
    CuPy arrays, and of a cuTile kernel against ``ct.launch`` of the same tensors -- each on a
    stream other than torch's current one (a wait a launch), and on it. Run last:
    importing torch grows the heap every later row's collector would walk."""
    try:
        import torch
    except ImportError:
        ROWS.append(("launch with torch tensors as arguments", "n/a", "torch not installed", "-"))
        return
    import cupy as cp
    n, T = 32, 256
    s = dev.create_stream("bench-torch")
    cps = cupy_stream(s)
    k = cp.RawKernel(LAUNCH_SRC, "k4")
    ca, cb, cc, cd = (cp.ones(n, cp.float32) for _ in range(4))
    ta, tb, tc, td = (torch.ones(T * 64, device=f"cuda:{dev.ordinal}") for _ in range(4))
    nn = np.int32(n)
    In, Out = sm.In, sm.Out

    def raw():
        k((1,), (32,), (ca, cb, cc, cd, nn), stream=cps)

    def ours():
        sm.launch(k, 1, 32, In(ta), In(tb), Out(tc), Out(td), nn, stream=s)

    fns = [raw, ours]
    try:
        import cuda.tile as ct

        @ct.kernel
        def vadd(a, b, c, TT: ct.Constant[int]):
            i = ct.bid(0)
            ct.store(c, index=(i,), tile=ct.load(a, index=(i,), shape=(TT,)) +
                     ct.load(b, index=(i,), shape=(TT,)))
        h, grid = s.handle, (64, 1, 1)
        fns.append(lambda: ct.launch(h, grid, vadd, (ta, tb, tc, T)))
        fns.append(lambda: sm.launch(vadd, (64,), None, In(ta), In(tb), Out(tc), T, stream=s))
    except ImportError:
        pass
    for fn in fns:
        for _ in range(100):
            fn()
    torch.cuda.synchronize()
    t = interleaved_us(fns, 2000 if quick else 10000, 7, s.synchronize)
    row("launch with torch tensors as arguments vs CuPy (CuPy arrays)", t[1], t[0], "CuPy",
        fns=(fns[1], fns[0]))
    if len(t) == 4:  # (its collector note printed now: the rounds below meter these anew)
        row("cuTile launch, 3 torch tensors, vs raw ct.launch of them", t[3], t[2], "ct.launch",
            fns=(fns[3], fns[2]))
    for fn in fns:
        GC.by.pop(fn, None)
    # the same launch with torch's current stream the launch's own (what a pipeline that
    # launches on torch's stream has): no wait a launch, the tensors' own cost alone
    before = torch.cuda.current_stream()
    torch.cuda.set_stream(torch.cuda.ExternalStream(s.handle))
    try:
        same = interleaved_us(fns, 2000 if quick else 10000, 7, s.synchronize)
    finally:
        torch.cuda.set_stream(before)
    row("same, on torch's current stream (no wait a launch)", same[1], same[0], "CuPy",
        fns=(fns[1], fns[0]))
    if len(t) == 4:
        row("cuTile launch, on torch's current stream (no wait a launch)", same[3], same[2],
            "ct.launch", fns=(fns[3], fns[2]))
    # (torch now imported and its CUDA initialized: a CAI export also asks torch's stream)
    bench_cai(dev, quick, "same CAI export, torch imported and initialized")


def bench_graph(dev, quick):
    """Replay of a 32-launch graph through sharedmem vs the raw CUDA graph (CuPy capture)."""
    import cupy as cp
    k = cp.RawKernel(LAUNCH_SRC, "k4")
    s = dev.create_stream("bench-graph")
    n = 32
    A, B, C, D = (sm.Buffer.from_host(np.ones(n, np.float32), device=dev) for _ in range(4))
    ca, cb, cc, cd = (cp.ones(n, cp.float32) for _ in range(4))
    dev.synchronize()
    with sm.capture(s) as g:
        for _ in range(32):
            sm.launch(k, 1, 32, sm.In(A), sm.In(B), sm.Out(C), sm.Out(D), np.int32(n), stream=s)
    cs = cp.cuda.Stream(non_blocking=True)
    cs.begin_capture()
    for _ in range(32):
        k((1,), (32,), (ca, cb, cc, cd, np.int32(n)), stream=cs)
    raw_graph = cs.end_capture()
    nrep = 500 if quick else 2000
    t_raw = per_call_us(lambda: raw_graph.launch(cs), nrep, 5, cs.synchronize)
    t_ours = per_call_us(lambda: g.replay(s), nrep, 5, s.synchronize)
    row("graph replay, 32 launches, vs raw CUDA graph launch", t_ours, t_raw, "cuGraphLaunch")
    # The rows above are bound by the GPU (32 kernels a replay). The host's own cost of a
    # replay call: 40 calls timed without waiting (the device queue never fills), then a sync.
    def host_cost(fn, sync):
        times = []
        for _ in range(15):
            sync()
            t0 = time.perf_counter()
            for _ in range(40):
                fn()
            times.append((time.perf_counter() - t0) / 40 * 1e6)
            sync()
        return statistics.median(times)
    h_raw = host_cost(lambda: raw_graph.launch(cs), cs.synchronize)
    h_ours = host_cost(lambda: g.replay(s), s.synchronize)
    row("graph replay call, host time only", h_ours, h_raw, "cuGraphLaunch")


def bench_dlpack(dev, quick):
    import cupy as cp
    t = sm.Tensor.from_host(np.ones((64, 64), np.float32), device=dev)
    c = cp.ones((64, 64), cp.float32)
    n = 2000 if quick else 20000
    cp.from_dlpack(t)
    def raw():
        cp.from_dlpack(c)

    def ours():
        cp.from_dlpack(t)
    sync = cp.cuda.get_current_stream().synchronize
    # alternating rounds (raw, ours, raw, ...): a machine's drift falls on both alike
    t_raw, t_ours = interleaved_us([raw, ours], n, 7, sync)
    row("DLPack export consumed by cupy.from_dlpack", t_ours, t_raw, "CuPy->CuPy", fns=(ours, raw))

    bench_cai(dev, quick, "CUDA Array Interface export consumed by cupy.asarray")


class _FixedCAI:
    """The least a CUDA Array Interface producer can do: a property returning a fixed dict."""

    def __init__(self, a):
        d = dict(a.__cuda_array_interface__)
        d["stream"] = None
        self._d = d

    @property
    def __cuda_array_interface__(self):
        return self._d


def bench_cai(dev, quick, name):
    """cupy.asarray of a Tensor through the CUDA Array Interface (it reads the property more
    than once; each read orders and holds on the consumers' likely streams: CuPy's and
    torch's current ones, where imported) against a fixed-dict producer."""
    import cupy as cp
    t = sm.Tensor.from_host(np.ones((64, 64), np.float32), device=dev)
    p = _FixedCAI(cp.ones((64, 64), cp.float32))
    cp.asarray(t)

    def raw_cai():
        cp.asarray(p)

    def ours_cai():
        cp.asarray(t)
    sync = cp.cuda.get_current_stream().synchronize
    t_raw, t_ours = interleaved_us([raw_cai, ours_cai], 2000 if quick else 20000, 7, sync)
    row(name, t_ours, t_raw, "fixed dict", fns=(ours_cai, raw_cai))


def bench_host_launch(dev, quick):
    @sm.host_kernel
    def nop(a, b, c, d, n):
        pass

    s = dev.create_stream("bench")
    A, B, C, D = (sm.Buffer.zeros(32, device=dev) for _ in range(4))
    n = 2000 if quick else 10000
    us = per_call_us(lambda: sm.launch(nop, 1, 1, sm.In(A), sm.In(B), sm.Out(C), sm.Out(D), 32,
                                       stream=s), n, 5, s.synchronize)
    row("host-kernel launch, 4 buffers + scalar", us, note="host backend: no raw library")


# -- retirement -----------------------------------------------------------------------------------
def bench_retirement(dev, total, quick):
    if dev.kind == "cuda":
        import cupy as cp
        k = cp.RawKernel(LAUNCH_SRC, "k4")
        pool = cp.get_default_memory_pool()
        used = pool.used_bytes
        args = lambda A, B, C, D: (sm.In(A), sm.In(B), sm.Out(C), sm.Out(D), np.int32(32))  # noqa
        grid, block = 1, 32
    else:
        k = sm.host_kernel(lambda a, b, c, d, n: None)
        used = lambda: dev.backend.pool.bytes_in_use  # noqa: E731
        args = lambda A, B, C, D: (sm.In(A), sm.In(B), sm.Out(C), sm.Out(D), 32)  # noqa
        grid, block = 1, 1
    s = dev.create_stream("retire")
    sm.synchronize()
    gc.collect()
    base_used = used()
    from sharedmem.runtime.state import RUNTIME as counters
    peak = 0
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    bufs = None
    for i in range(total):
        if i % 1000 == 0:  # fresh buffers now and then, the old ones dropped while in flight
            bufs = [sm.Buffer.empty(32, "float32", device=dev) for _ in range(4)]
        sm.launch(k, grid, block, *args(*bufs), stream=s)  # future dropped
        if i % 1000 == 0:
            peak = max(peak, counters.in_flight)
    elapsed = time.perf_counter() - t0
    bufs = None
    sm.synchronize()
    gc.collect()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    back = used() == base_used
    ROWS.append((f"retirement: {total:,} fire-and-forget launches", f"{elapsed / total * 1e6:8.2f} us",
                 f"peak unretired {peak}, peak RSS +{(rss1 - rss0) / 1024:.0f} MiB",
                 f"memory back to baseline: {back}"))
    print("  " + " | ".join(ROWS[-1]), flush=True)
    # release delay: completion observed by polling the marker here vs retirement callback
    delays = []
    bufs = [sm.Buffer.empty(32, "float32", device=dev) for _ in range(4)]
    for _ in range(300 if quick else 1000):
        fut = sm.launch(k, grid, block, *args(*bufs), stream=s)
        sub = fut._s
        got = []
        fut.add_done_callback(lambda f, got=got: got.append(time.perf_counter()))
        while sub.marker.query() == 0:  # observe completion ourselves, without retiring
            pass
        t_done = time.perf_counter()
        while not got:
            time.sleep(0)
        delays.append(max(0.0, got[0] - t_done) * 1e6)
    delays.sort()
    med, p99 = delays[len(delays) // 2], delays[int(len(delays) * 0.99)]
    ROWS.append(("retirement: completion -> release delay", f"{med:8.1f} us median",
                 f"p99 {p99:.1f} us", "target p99 < 1000 us"))
    print("  " + " | ".join(ROWS[-1]), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--launches", type=int, default=None)
    ap.add_argument("--only-launch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--multi-gpu", action="store_true", help="only the rows for two GPUs")
    ap.add_argument("--heap", action="store_true",
                    help="import what a real pipeline has (cuda.tile, torch, jax) first: a large "
                         "heap makes the collector's full passes costly")
    opts = ap.parse_args()
    if opts.heap:
        for mod in ("cuda.tile", "torch", "jax"):
            try:
                __import__(mod)
            except Exception:  # (not installed here)
                pass
    dev = sm.default_device()
    if opts.only_launch:
        bench_launch_gpu(dev, True)
        return 0
    if opts.multi_gpu:
        bench_launch_gpu(dev, opts.quick)
        bench_multi_gpu(opts.quick)
        for r in ROWS:
            print(f"{r[0]} | {r[1]} | {r[2]} | {r[3]}")
        return 0
    print(f"sharedmem {sm.__version__} benchmarks on {dev}", flush=True)
    sm.show_config()
    bench_moves(dev, opts.quick)
    if dev.kind == "cuda":
        bench_launch_gpu(dev, opts.quick)
        if sm.config.compiled():
            bench_launch_interpreted(opts.quick)
        bench_cutile(dev, opts.quick)
        bench_dlpack(dev, opts.quick)
        try:
            bench_graph(dev, opts.quick)
        except Exception as e:  # a failure here must not hide the other rows
            ROWS.append(("graph replay vs raw CUDA graph", "failed", f"{type(e).__name__}: {e}"[:60], "-"))
        total = opts.launches or (100_000 if opts.quick else 1_000_000)
        bench_retirement(dev, total, opts.quick)
        bench_torch_args(dev, opts.quick)  # (last: it imports torch)
    else:
        bench_host_launch(dev, opts.quick)
        total = opts.launches or (10_000 if opts.quick else 100_000)
        bench_retirement(dev, total, opts.quick)
    if dev.kind == "host":
        ROWS.append(("graph replay", "n/a", "CUDA only", "-"))
    w = max(len(r[0]) for r in ROWS)
    print("\n" + "row".ljust(w) + " | sharedmem | raw | ratio / note")
    for r in ROWS:
        print(f"{r[0].ljust(w)} | {r[1]} | {r[2]} | {r[3]}")
    print(f"\ncollector time while timing ({len(gc.get_objects())} tracked objects"
          f"{', after --heap imports' if opts.heap else ''}):")
    for name, note in GC_ROWS or [("(none of the rows)", "no collection ran")]:
        print(f"  {name}: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
