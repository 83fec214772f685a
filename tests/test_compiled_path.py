"""The compiled launch path (sharedmem/_speedups.c) against the Python path, differentially.

Random programs of CuPy launches on three streams over buffers and overlapping slices run twice
on the fake CUDA driver -- once with the compiled path, once without -- with all work held
pending between explicit completion steps (so nothing retires at a time the retirer picks).
Everything observable must be the same: kernel results, which launches made which streams wait,
the leases every allocation records (stream, kind, byte range, sequence number), the pending
submissions per stream and the counters. Skipped where the extension is not built.
"""

import contextlib
import itertools
import re
import sys
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedmem as sm
from sharedmem import _accel

from conftest import count_prepares, gc_collect_harder

pytestmark = pytest.mark.skipif(_accel.speedups is None, reason="the extension is not built")

_keys = itertools.count(1000)


@contextlib.contextmanager
def fake_device():
    import sharedmem.backends.cuda as bc
    from fake_cuda import CUresult, FakeDriver, FakeHot, fake_cupy, fake_cutile
    drv = FakeDriver()
    saved = (bc.cu, bc._SUCCESS, bc._NOT_READY, bc._hot_driver, sys.modules.get("cupy"))
    saved_tile = {k: sys.modules.get(k) for k in ("cuda", "cuda.tile")}
    saved_attr = getattr(sys.modules.get("cuda"), "tile", None)
    bc.cu, bc._SUCCESS, bc._NOT_READY = drv, CUresult.CUDA_SUCCESS, CUresult.CUDA_ERROR_NOT_READY
    bc._hot_driver = lambda: FakeHot(drv)
    sys.modules["cupy"] = fake_cupy()
    tile = fake_cutile(drv)
    sys.modules.setdefault("cuda", types.ModuleType("cuda")).tile = tile
    sys.modules["cuda.tile"] = tile
    try:
        backend = bc.CudaBackend(0)
        dev = object.__new__(sm.Device)
        dev._setup("cuda", 0, backend.name, ("fake-cuda-diff", next(_keys)), backend)
        yield dev, drv
        drv.holding = False
        drv.finish_held()
        sm.synchronize()
        del dev, backend
        gc_collect_harder()
    finally:
        bc.cu, bc._SUCCESS, bc._NOT_READY, bc._hot_driver = saved[:4]
        if saved[4] is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved[4]
        if saved_tile["cuda"] is not None and saved_attr is not None:
            saved_tile["cuda"].tile = saved_attr
        for k, m in saved_tile.items():
            if m is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = m


N = 8
# views: two whole buffers and overlapping slices of the first
VIEWS = [(0, None), (1, None), (0, (0, 4)), (0, (2, 6)), (0, (4, 8))]

step = st.one_of(
    st.tuples(st.sampled_from(["launch", "op"]), st.integers(0, 2), st.integers(0, len(VIEWS) - 1),
              st.integers(0, len(VIEWS) - 1), st.sampled_from(["acc", "touch", "tile"]),
              st.sampled_from([1, 2.0])),
    st.tuples(st.just("complete")),
    st.tuples(st.just("release"), st.integers(2, len(VIEWS) - 1)),  # a slice: later uses raise
)


def run(program, compiled: bool, prepares=None):
    """The observable trace of ``program``; ``prepares`` (a list) collects the
    launches the Python path prepared."""
    import interop.cupy as ic
    from fake_cuda import RawKernel, TileKernel, array_at
    _accel.set_compiled(compiled)
    out = []
    real_prepare = ic.RawKernelAdapter.prepare

    def counting(self, *a):
        if prepares is not None:
            prepares.append(a[0].name)
        return real_prepare(self, *a)

    ic.RawKernelAdapter.prepare = counting
    try:
        with fake_device() as (dev, drv):
            def acc(x, y, n):  # y += x
                array_at(y, n, np.float32)[:] += array_at(x, n, np.float32)

            def touch(x, y, n):  # reads both
                pass

            def tile_acc(x, y, n):  # y += x (a cuTile kernel: arrays as arrays)
                y[:n] += x[:n]

            kernels = {"acc": RawKernel(drv, "acc", ["Q", "Q", "i"], acc),
                       "touch": RawKernel(drv, "touch", ["Q", "Q", "i"], touch),
                       "tile": TileKernel(tile_acc)}
            streams = [dev.create_stream(f"s{i}") for i in range(3)]
            bases = [sm.Buffer.from_host(np.arange(N, dtype=np.float32) + 10 * b, device=dev)
                     for b in range(2)]
            views = [bases[b] if r is None else bases[b][r[0]:r[1]] for b, r in VIEWS]
            sm.synchronize()
            drv.holding = True
            names = {s.handle: s.name for s in streams}

            def leases():
                rows = []
                for b in bases:
                    for s, use in b.allocation.tracker._uses.items():
                        for kind, entries in (("r", use.reads), ("w", use.writes)):
                            rows += [(s.name, kind, e[0], e[1], e[2]) for e in entries]
                return sorted(rows)

            for st_ in program:
                if st_[0] == "release":
                    views[st_[1]].release()
                    out.append(("released", st_[1], [b.allocation.live_views for b in bases]))
                    continue
                if st_[0] == "complete":
                    drv.finish_held()
                    sm.synchronize()
                    out.append(("results", [b.to_host().tolist() for b in bases]))
                    continue
                kind, si, ia, ib, kname, n_kind = st_
                x, y = views[ia], views[ib]
                n = min(len(x), len(y)) if x.is_live and y.is_live else N
                n = n if n_kind == 1 else np.int32(n)  # a Python int or a NumPy scalar
                mark = len(drv.calls)
                second = sm.In(y) if kname == "touch" else sm.Out(y)
                block = None if kname == "tile" else N
                try:
                    if st_[0] == "op":  # an op described once, submitted twice
                        o = sm.op(kernels[kname], 1, block, sm.In(x), second, n)
                        o.submit(streams[si])
                        fut = o.submit(streams[si])
                    else:
                        fut = sm.launch(kernels[kname], 1, block, sm.In(x), second, n,
                                        stream=streams[si])
                except sm.SharedMemError as e:  # (a released view, overlapping cuTile arrays)
                    msg = re.sub(r"#\d+", "#", str(e))  # (allocation ids differ between runs)
                    out.append(("error", type(e).__name__, msg, leases(),
                                [s.pending for s in streams]))
                    continue
                waits = sorted(names.get(c[1], "?") for c in drv.calls[mark:] if c[0] == "wait")
                launched = [names[c[2]] for c in drv.calls[mark:] if c[0] == "launch"] + \
                    [("tile", names[c[1]]) for c in drv.calls[mark:] if c[0] == "tile"]
                out.append(("launch", launched, waits, fut._s.seq, leases(),
                            [s.pending for s in streams], sm.stats().in_flight))
            drv.holding = False
            drv.finish_held()
            sm.synchronize()
            out.append(("end", [b.to_host().tolist() for b in bases], sm.stats().in_flight))
    finally:
        _accel.set_compiled(True)
        ic.RawKernelAdapter.prepare = real_prepare
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, min_size=1, max_size=25))
def test_compiled_and_python_paths_behave_the_same(program):
    assert run(program, compiled=True) == run(program, compiled=False)


def test_the_compiled_run_does_take_the_compiled_path():
    program = [("launch", 0, 0, 1, "acc", 1)] * 5 + [("launch", 1, 1, 0, "touch", 2.0)] * 3 + \
        [("complete",), ("launch", 2, 2, 3, "acc", 1), ("launch", 2, 2, 3, "acc", 1)]
    fast, slow = [], []
    assert run(program, True, fast) == run(program, False, slow)
    assert len(slow) == 10
    # in Python: only the first launch of each kernel (it makes the plan); the rest ran
    # compiled -- the `touch`es on stream 1 too, ordered after stream 0's pending writes to
    # their buffers (the run records the same waits both ways), and those on slices later
    assert fast == ["acc", "touch"]
    waits = [e[2] for e in run(program, True) if e[0] == "launch"]
    assert waits[5:8] == [["s1"]] * 3  # stream 1 waits (for s0's newest write) each time


def test_the_comparison_sees_a_difference():
    # the harness is not blind: a program whose two runs differ is told apart
    a = run([("launch", 0, 0, 1, "acc", 1), ("complete",)], compiled=True)
    b = run([("launch", 0, 0, 1, "touch", 1), ("complete",)], compiled=True)
    assert a != b


def test_the_compiled_run_takes_cutile_launches_too(monkeypatch):
    import interop.cutile as icu
    calls = count_prepares(monkeypatch, icu.TileKernelAdapter)
    program = [("launch", 0, 1, 0, "tile", 1)] * 4 + [("op", 0, 1, 0, "tile", 1), ("complete",)]
    fast = run(program, True)
    n_fast = len(calls)
    assert fast == run(program, False)
    # compiled: the first launch makes the plan, and the op's submissions use it too; Python:
    # every launch, and the op once (it reuses its preparation on its second submission)
    assert (n_fast, len(calls) - n_fast) == (1, 5)
    # buffer 0 += buffer 1, six times
    assert fast[-2] == ("results", [(np.arange(N) * 7 + 60).tolist(), (np.arange(N) + 10).tolist()])
