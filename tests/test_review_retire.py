"""Review of retirement under load and of the dask integration: each test failed before its fix."""

import gc
import sys

import numpy as np
import pytest

import sharedmem as sm


# -- dask: dtypes a typestr does not name ------------------------------------------------------
def test_bfloat16_travels_through_the_dask_families(host):
    """The dask and cuda families' headers named the dtype by its typestr, which is "<V2" for
    ml_dtypes' bfloat16 (raw bytes): serialize() succeeded and every receiver raised "dtype |V2
    cannot live in device memory" -- a bfloat16 task result could not reach another worker.
    The header now carries the dtype itself (pickled, where the typestr does not name it),
    through distributed's msgpack headers."""
    pytest.importorskip("distributed")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from distributed.protocol import deserialize, dumps, loads, serialize, to_serialize
    bf = np.dtype(ml_dtypes.bfloat16)
    a = np.array([1.5, -2.0, 0.25, 3.0, 1e30, -0.0], dtype=bf)
    for x in (sm.Tensor.from_host(a.reshape(2, 3), device=host),
              sm.Buffer.from_host(a, device=host), sm.DeviceBox(1.5, bf, device=host)):
        for family in ("dask", "cuda"):
            header, frames = serialize(x, serializers=(family,), on_error="raise")
            y = deserialize(header, frames, deserializers=(family,))
            assert type(y) is type(x) and y.dtype == bf
        # the whole message, headers packed by msgpack, as a comm sends it
        y = loads(dumps({"x": to_serialize(x)}))["x"]
        assert type(y) is type(x) and y.dtype == bf
        if isinstance(y, sm.DeviceBox):
            assert y.get() == 1.5
        else:
            want = a.reshape(2, 3) if isinstance(x, sm.Tensor) else a
            assert y.to_host().view(np.uint16).tolist() == want.view(np.uint16).tolist()


def test_bfloat16_device_frame_loads(monkeypatch):
    """cuda_loads imported the device frame under the header's typestr ("<V2" for bfloat16),
    which no view can hold: a bfloat16 device frame could not be received. The frame's bytes
    are now copied as bytes into a new tensor of the header's dtype."""
    pytest.importorskip("distributed")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import types
    from fake_cuda import install_fake_devices
    import sharedmem.device as sm_device
    import interop.dask as smdask
    (dev,), drv = install_fake_devices(monkeypatch, False)
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)
    monkeypatch.setitem(sys.modules, "ucxx", types.ModuleType("ucxx"))  # (device frames)
    bf = np.dtype(ml_dtypes.bfloat16)
    a = np.arange(12, dtype=np.float32).astype(bf)
    big = sm.Buffer.from_host(a, device=dev)
    drv.ranges[big.allocation.ptr] = big.allocation.nbytes
    header, frames = smdask.cuda_dumps(big[2:8])
    assert header["frame"] == "device" and frames[0].nbytes == 12
    y = smdask.cuda_loads(dict(header), frames)
    assert y.dtype == bf and y.device is dev
    assert y.to_host().view(np.uint16).tolist() == a[2:8].view(np.uint16).tolist()
    del frames, y
    sm.synchronize()
    gc.collect()


# -- retirement: one stream whose queries fail -------------------------------------------------
class _FailingMarker:
    """A completion marker: pending, then (``state`` "failing") its query raises -- a device
    whose context cannot be made current --, then ("done") done."""

    recorded = True
    error = None

    def __init__(self):
        self.state = "pending"

    def query(self):
        if self.state == "failing":
            raise RuntimeError("cuCtxSetCurrent failed (test)")
        return 1 if self.state == "done" else 0

    def wait(self, timeout=None):
        return self.state == "done"

    def recycle(self):
        pass


@pytest.mark.parametrize("sweeper", ["retirer pass", "sweep_all"])
def test_a_stream_whose_queries_fail_does_not_stall_the_others(host, sweeper, monkeypatch):
    """A retirer pass (and sweep_all) swept the active streams in one loop: the first stream
    whose query raised ended it, and every stream after it in the set's order kept its
    finished work -- fire-and-forget launches nobody asks about were never retired, their
    memory never freed, for as long as that stream had work. Every other stream is swept now;
    the failure is still raised (once the others are swept)."""
    from sharedmem.runtime import retirer
    from sharedmem.runtime import submission as sub
    from sharedmem.runtime.state import RUNTIME
    sm.synchronize()
    sm.stats()
    real_pass = retirer._pass
    # the retirer thread's passes sweep nothing meanwhile: this test makes its own
    monkeypatch.setattr(retirer, "_pass", lambda rt, last: ({}, False))
    bad_stream = host.create_stream("queries fail")
    bad = _FailingMarker()
    sub.submit(bad_stream, [], lambda: bad, label="failing work")
    good, subs = [], []
    # streams with finished work, until one comes after the failing one in the sweep's order
    while True:
        s = host.create_stream(f"good {len(good)}")
        b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
        f = sm.launch(_noop_kernel, 1, 1, sm.In(b), stream=s)
        f._s.marker.wait(5)
        good.append((s, b))
        subs.append(f._s)
        del f
        order = list(RUNTIME.active)
        assert all(g in order for g, _ in good)
        if any(order.index(g) > order.index(bad_stream) for g, _ in good):
            break
    try:
        bad.state = "failing"
        with pytest.raises(RuntimeError, match=r"^cuCtxSetCurrent failed \(test\)$"):
            if sweeper == "sweep_all":
                sub.sweep_all()
            else:
                real_pass(RUNTIME, {})
        assert [x.state for x in subs] == [sub.RETIRED] * len(subs)
        assert [g in RUNTIME.active for g, _ in good] == [False] * len(good)
        assert bad_stream in RUNTIME.active
    finally:
        bad.state = "done"
        sub.sweep(bad_stream)
        RUNTIME.errors.clear()
    assert bad_stream not in RUNTIME.active


@sm.host_kernel
def _noop_kernel(x):
    pass


def test_a_launch_whose_periodic_sweep_fails_still_returns_its_future(host, monkeypatch):
    """submit() sweeps its stream every SWEEP_EVERY-th submission, under the lock, after the
    work was enqueued and filed: a query failing there (a marker whose device's context cannot
    be made current) was raised out of the launch -- which had run, held its leases, and whose
    future the caller never got (nothing to wait for; a retry launched it twice). The sweep is
    opportunistic: its failure is re-raised at the next API call, as the retirer's are."""
    import threading
    from sharedmem.runtime import retirer
    from sharedmem.runtime import submission as sub
    from sharedmem.runtime.state import RUNTIME
    sm.synchronize()
    sm.stats()
    monkeypatch.setattr(retirer, "_pass", lambda rt, last: ({}, False))  # (no retirer sweeps)
    gate = threading.Event()

    @sm.host_kernel
    def gated(x):
        gate.wait(10)

    s = host.create_stream("sweep fails")
    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)  # (not submitted on s)
    start = s._seq
    bad = _FailingMarker()
    while s._seq < start + sub.SWEEP_EVERY - 2 or (s._seq + 2) % sub.SWEEP_EVERY:
        last = sm.launch(_noop_kernel, 1, 1, sm.In(b), stream=s)
    last._s.marker.wait(10)  # (the FIFO's front has finished: the sweep bisects towards `bad`)
    sub.submit(s, [], lambda: bad, label="failing work")
    bad.state = "failing"
    assert (s._seq + 1) % sub.SWEEP_EVERY == 0  # the next submission sweeps
    try:
        f = sm.launch(gated, 1, 1, sm.In(b), stream=s)  # pending: the sweep bisects, asks `bad`
        assert isinstance(f, sm.DeviceFuture) and f._s.seq % sub.SWEEP_EVERY == 0
        assert f._s in s._pending
        assert [type(e) for e in RUNTIME.errors] == [RuntimeError]
        deferred = RUNTIME.errors[0]
        with pytest.raises(RuntimeError, match=r"^cuCtxSetCurrent failed \(test\)$") as ei:
            sub.raise_deferred()  # (what the next API call does first: raised once)
        assert ei.value is deferred and not RUNTIME.errors
    finally:
        gate.set()
        bad.state = "done"
    f.result(10)
    assert f.done() and s not in RUNTIME.active
