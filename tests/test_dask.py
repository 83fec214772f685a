"""dask.distributed: the dask and cuda serialization families, and a LocalCluster passing
Tensors between worker processes (host backend)."""

import gc
import os
import sys

import numpy as np
import pytest

import sharedmem as sm

distributed = pytest.importorskip("distributed")

from distributed.protocol import deserialize, serialize  # noqa: E402

import interop.dask as smdask  # noqa: E402  (registered already: this only names the module)


def test_registered_without_importing_interop_dask():
    # a fresh interpreter: sharedmem first, distributed later (a client script), and the
    # other order (a worker) -- both find the handlers without `import interop.dask`
    import subprocess
    code = ("import sys, {0}, {1}; from distributed.protocol.serialize import dask_serialize;"
            "import sharedmem as sm; print(dask_serialize.dispatch(sm.Tensor).__module__,"
            "'interop.dask' in sys.modules)")
    for first, second in [("sharedmem", "numpy"), ("distributed", "sharedmem")]:
        r = subprocess.run([sys.executable, "-c", code.format(first, second)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["interop.dask", "True"], r.stdout


@pytest.mark.parametrize("family", ["dask", "cuda"])
@pytest.mark.parametrize("kind", ["Buffer", "Tensor", "strided", "DeviceBox", "empty"])
def test_serialize_round_trip_exact(host, family, kind):
    a = np.arange(1, 25, dtype=np.float32) * 1.5
    if kind == "Buffer":
        x, want = sm.Buffer.from_host(a, device=host), a
    elif kind == "Tensor":
        x, want = sm.Tensor.from_host(a.reshape(4, 6), device=host), a.reshape(4, 6)
    elif kind == "strided":
        x = sm.Tensor.from_buffer(sm.Buffer.from_host(a, device=host), (6, 4), strides=(1, 6))
        want = a.reshape(4, 6).T
    elif kind == "DeviceBox":
        x, want = sm.DeviceBox(2 + 3j, "complex64", device=host), np.complex64(2 + 3j)
    else:
        x, want = sm.Tensor.empty((0, 3), "int8", device=host), np.zeros((0, 3), np.int8)
    header, frames = serialize(x, serializers=(family,), on_error="raise")
    assert header["serializer"] == family
    sub = header["sub-header"]
    assert sub["kind"] == ("Tensor" if kind in ("strided", "empty") else kind)
    assert sub["frame"] == "host"  # host memory: no device frame to give
    assert len(frames) == 1 and isinstance(frames[0], memoryview)
    y = deserialize(header, frames, deserializers=(family,))
    assert type(y) is type(x)
    if kind == "DeviceBox":
        assert y.get() == want and y.buffer.allocation is not x.buffer.allocation
        return
    assert y.dtype == want.dtype and tuple(y.shape) == want.shape
    np.testing.assert_array_equal(y.to_host(), want)
    assert y.allocation is not x.allocation


def test_dask_family_is_the_default_and_pickle_the_fallback(host):
    t = sm.Tensor.from_host(np.eye(3), device=host)
    header, frames = serialize(t)
    assert header["serializer"] == "dask"
    header, frames = serialize(t, serializers=("pickle",))
    assert header["serializer"] == "pickle" and len(frames) == 2  # the values out of band
    np.testing.assert_array_equal(deserialize(header, frames).to_host(), np.eye(3))


def test_serializing_a_moved_view_raises(host):
    b = sm.Buffer.from_host(np.arange(4.0), device=host)
    sm.Tensor.from_buffer(b, (2, 2))
    with pytest.raises(TypeError, match="Could not serialize") as e:
        serialize(b, serializers=("dask",), on_error="raise")
    assert isinstance(e.value.__cause__, sm.MovedError)


def test_device_frame_holds_the_bytes_until_dropped(host):
    """The cuda family's frame (here on the host device, where it is only built by hand): a
    read-only view of its own, so the source cannot be moved or freed while it lives."""
    b = sm.Buffer.from_host(np.arange(8, dtype=np.int32), device=host)
    alloc = b.allocation
    frame = smdask.device_frame(b)
    assert frame.nbytes == len(frame) == 32 and not hasattr(frame, "__cuda_array_interface__")
    assert alloc.live_views == 2
    with pytest.raises(sm.AliasError, match="dask device frame"):
        sm.Tensor.from_buffer(b, (2, 4))
    b.release()  # the sender drops its view: the frame still keeps the bytes
    assert alloc.live_views == 1
    np.testing.assert_array_equal(frame._view.to_host().view(np.int32), np.arange(8))
    del frame
    gc.collect()
    assert alloc.live_views == 0


def test_device_frame_of_a_strided_tensor_is_a_contiguous_copy(host):
    a = np.arange(12, dtype=np.float64)
    t = sm.Tensor.from_buffer(sm.Buffer.from_host(a, device=host), (4, 3), strides=(1, 4))
    frame = smdask.device_frame(t)
    assert frame._view.allocation is not t.allocation
    np.testing.assert_array_equal(frame._view.to_host().view(np.float64).reshape(4, 3),
                                  a.reshape(3, 4).T)
    assert t.allocation.live_views == 1


def test_sizeof_is_nbytes(host):
    from dask.sizeof import sizeof
    t = sm.Tensor.empty((100, 10), "float64", device=host)
    assert sizeof(t) == 8000 and sizeof(sm.DeviceBox(1, "int32", device=host)) == 4
    t.release()
    assert sizeof(t) == 0


# -- two worker processes ----------------------------------------------------------------------
def make_and_fill(n, value):
    """Task A: a new Tensor on this worker, written by a host launch."""
    from host_kernels import fill
    t = sm.Tensor.empty((n, 4), "float32")
    sm.launch(fill, 1, 1, sm.Out(t), value)  # returned while possibly still running
    return t


def add_and_scale(t, k):
    """Task B: on another worker, launch again on the received Tensor (a new allocation)."""
    @sm.host_kernel
    def axpb(x, out, k):
        out[:] = x * k + np.arange(out.shape[0], dtype=out.dtype)[:, None]

    out = sm.Tensor.empty(t.shape, t.dtype)
    sm.launch(axpb, 1, 1, sm.In(t), sm.Out(out), k)
    return out, os.getpid(), str(t.device), t.allocation.source, list(smdask.__dict__.get("SEEN", ()))


def spy_on_deserializers():
    """(On a worker) record which family each received Tensor came through."""
    from distributed.protocol.cuda import cuda_deserialize
    from distributed.protocol.serialize import dask_deserialize
    seen = smdask.SEEN = []
    for dispatch, family in ((dask_deserialize, "dask"), (cuda_deserialize, "cuda")):
        real = dispatch.dispatch(sm.Tensor)

        def spy(header, frames, real=real, family=family):
            seen.append(family)
            return real(header, frames)

        dispatch.register(sm.Tensor, spy)


@pytest.mark.parametrize("serializers", [None, ["cuda", "dask", "pickle"]])
def test_local_cluster_two_workers(serializers):
    from distributed import Client, LocalCluster
    env = {"SHAREDMEM_BACKEND": "host"}
    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                      dashboard_address=None, env=env,
                      serializers=serializers, deserializers=serializers) as cluster, \
            Client(cluster, serializers=serializers, deserializers=serializers) as client:
        w1, w2 = sorted(client.scheduler_info()["workers"])
        client.run(spy_on_deserializers, workers=[w2])
        a = client.submit(make_and_fill, 16, 2.5, workers=[w1], pure=False)
        b = client.submit(add_and_scale, a, 3.0, workers=[w2], pure=False)
        out, pid, dev, source, seen = b.result(timeout=60)
        assert seen == [(serializers or ["dask"])[0]]  # worker 2 got it through that family
        pids = client.run(os.getpid)
        assert pid == pids[w2] and pid != os.getpid() and pids[w1] != pid
        assert dev == "<Device host>" and source == "sharedmem"
        want = np.full((16, 4), 7.5, np.float32) + np.arange(16, dtype=np.float32)[:, None]
        assert isinstance(out, sm.Tensor)
        np.testing.assert_array_equal(out.to_host(), want)
        # the first result as well, fetched from worker 1
        np.testing.assert_array_equal(a.result(timeout=30).to_host(),
                                      np.full((16, 4), 2.5, np.float32))


def test_a_device_frame_is_refused_when_its_writer_faults_during_the_wait(host):
    """The frame waits for the pending write on the host; a write that faults meanwhile
    (completion unknown) gives no frame -- the bytes are not known to be written -- as the
    dask family (a host copy) refuses them too."""
    import threading
    import warnings
    from sharedmem.backends.host import HostFault
    gate = threading.Event()

    @sm.host_kernel
    def faulting_write(x):
        gate.wait(5)
        raise HostFault("illegal address (simulated)")

    b = sm.Buffer.zeros(8, "float32", device=host)
    sm.synchronize()
    f = sm.launch(faulting_write, 1, 1, sm.Out(b), stream=host.create_stream())
    threading.Timer(0.1, gate.set).start()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", sm.LeakWarning)
        with pytest.raises(sm.CompletionUnknownError,
                           match=r"^bytes \[0, 32\) of allocation #\d+ are touched by work whose "
                                 r"completion became unknown while waited for \(HostFault\("):
            smdask.device_frame(b)
        with pytest.raises(sm.CompletionUnknownError):
            f.result(5)  # (and the faulted work's LeakWarning, reported once: here, not later)
    assert [w.category for w in seen] == [sm.LeakWarning]
    assert b.allocation.live_views == 1  # the frame's own view went with it


def test_a_device_frame_smaller_than_its_header_says_is_refused(monkeypatch):
    """cuda_loads copies the header's dtype x shape from the device frame's address: a frame of
    fewer bytes (a corrupt or mismatched message) is a LayoutError naming both sizes -- never
    a copy that reads past the frame's end."""
    import types
    from fake_cuda import install_fake_devices
    import sharedmem.device as sm_device
    (dev,), drv = install_fake_devices(monkeypatch, False)
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)  # (an import probes Device(0))
    monkeypatch.setitem(sys.modules, "ucxx", types.ModuleType("ucxx"))  # (device frames)
    big = sm.Buffer.from_host(np.arange(64, dtype=np.float32), device=dev)
    drv.ranges[big.allocation.ptr] = big.allocation.nbytes
    header, frames = smdask.cuda_dumps(big[:4])
    assert header["frame"] == "device" and frames[0].nbytes == 16
    assert smdask.cuda_loads(dict(header), frames).to_host().tolist() == [0, 1, 2, 3]
    header["shape"] = [64]
    with pytest.raises(sm.LayoutError, match=r"^cannot load a Buffer of float32 x \(64,\) "
                                             r"\(256 bytes\) from a device frame of 16 bytes"):
        smdask.cuda_loads(header, frames)
    del frames
    sm.synchronize()
    gc.collect()
