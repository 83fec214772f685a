"""dask.distributed on a GPU: the cuda family's device frames, and Tensors passed between two
worker processes (TCP) with CuPy kernels launched through sharedmem on each side.

On the GPU machine distributed comes from the carried wheels (docs/gpu.md: `make gpu-wheels`);
without it these tests skip."""

import os
import sys

import numpy as np
import pytest

import sharedmem as sm

from conftest import gc_collect_harder

pytestmark = pytest.mark.gpu

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def cuda(gpu):
    """CUDA device 0 (conftest's ``gpu``: skipped without a usable GPU)."""
    return gpu


def test_cuda_family_round_trip_with_a_device_frame(cuda, monkeypatch):
    from distributed.protocol import deserialize, serialize
    import interop.dask as smdask
    import gpu_kernels as K
    monkeypatch.setattr(smdask, "_device_frames_ok", lambda view: True)  # as with UCX loaded
    n = 1 << 20
    t = sm.Tensor.empty((n // 1024, 1024), "float32", device=cuda)
    s = cuda.create_stream()
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(t), np.int32(n), np.float32(5.0),
              np.int64(K.cycles(30)), stream=s)  # still writing when serialized
    header, frames = serialize(t, serializers=("cuda",), on_error="raise")
    (frame,) = frames
    assert header["sub-header"]["frame"] == "device" and isinstance(frame, smdask.DeviceFrame)
    cai = frame.__cuda_array_interface__
    assert cai["data"] == (t.ptr, True) and cai["shape"] == (4 * n,)
    with pytest.raises(sm.AliasError, match="dask device frame"):
        t.into_buffer()  # the frame holds the bytes
    if sys.version_info >= (3, 12):  # what a TCP comm reads: a host copy (PEP 688)
        assert bytes(memoryview(frame)) == np.full(n, 5.0, np.float32).tobytes()
    y = deserialize(header, frames, deserializers=("cuda",))
    assert y.allocation is not t.allocation and y.device is cuda
    np.testing.assert_array_equal(y.to_host(), np.full(t.shape, 5.0, np.float32))
    del frame, frames
    gc_collect_harder()
    t.into_buffer()  # the frame is gone: nothing holds the bytes any more


def test_cuda_family_strided_tensor_goes_as_a_contiguous_device_copy(cuda, monkeypatch):
    from distributed.protocol import deserialize, serialize
    import interop.dask as smdask
    monkeypatch.setattr(smdask, "_device_frames_ok", lambda view: True)
    a = np.arange(24, dtype=np.float64)
    t = sm.Tensor.from_buffer(sm.Buffer.from_host(a, device=cuda), (6, 4), strides=(1, 6))
    header, frames = serialize(t, serializers=("cuda",), on_error="raise")
    assert frames[0].__cuda_array_interface__["data"][0] != t.ptr  # a copy, not the source
    assert t.allocation.live_views == 1  # the frame does not hold the source
    y = deserialize(header, frames, deserializers=("cuda",))
    assert y.shape == (6, 4) and y.is_contiguous() and y.device is cuda
    np.testing.assert_array_equal(y.to_host(), a.reshape(4, 6).T)


def make_on_gpu(n, value):
    """Task A: a new Tensor on this worker's GPU, written by a CuPy kernel (slowly)."""
    import gpu_kernels as K
    t = sm.Tensor.empty((n,), "float32")
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(t), np.int32(n), np.float32(value),
              np.int64(K.cycles(20)))
    return t


def saxpy_on_gpu(t, a):
    """Task B: on the other worker, a CuPy kernel on the received Tensor."""
    import gpu_kernels as K
    n = t.shape[0]
    y = sm.Tensor.from_host(np.arange(n, dtype=np.float32))
    out = sm.Tensor.empty((n,), "float32")
    sm.launch(K.kernel("saxpy"), (n + 255) // 256, 256, np.float32(a), sm.In(t), sm.In(y),
              sm.Out(out), np.int32(n))
    return out, os.getpid(), t.device.kind


def spy_on_cuda_serialize():
    """(On a worker) record the frame type of each Tensor sent through the cuda family."""
    from distributed.protocol.cuda import cuda_serialize
    import interop.dask as smdask
    sent = smdask.SENT = []
    real = cuda_serialize.dispatch(sm.Tensor)

    def spy(x):
        header, frames = real(x)
        sent.append(type(frames[0]).__name__)
        return header, frames

    cuda_serialize.register(sm.Tensor, spy)


def test_local_cluster_tcp_cuda_serializers(cuda):
    from distributed import Client, LocalCluster
    ser = ["cuda", "dask", "pickle"]
    here = os.path.dirname(os.path.abspath(__file__))
    env = {"PYTHONPATH": os.pathsep.join([here, os.path.dirname(here),
                                          os.environ.get("PYTHONPATH", "")])}
    with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, protocol="tcp",
                      dashboard_address=None, env=env, serializers=ser,
                      deserializers=ser) as cluster, \
            Client(cluster, serializers=ser, deserializers=ser) as client:
        w1, w2 = sorted(client.scheduler_info()["workers"])
        client.run(spy_on_cuda_serialize, workers=[w1])
        n = 1 << 16
        a = client.submit(make_on_gpu, n, 1.5, workers=[w1], pure=False)
        b = client.submit(saxpy_on_gpu, a, 2.0, workers=[w2], pure=False)
        out, pid, kind = b.result(timeout=120)
        assert kind == "cuda" and pid == client.run(os.getpid)[w2]
        sent = client.run(lambda: list(__import__("interop.dask").dask.SENT), workers=[w1])[w1]
        # worker 1 sent a device frame (read by TCP as a host copy on Python >= 3.12)
        assert sent == ["DeviceFrame" if sys.version_info >= (3, 12) else "memoryview"]
        np.testing.assert_array_equal(out.to_host(), 3.0 + np.arange(n, dtype=np.float32))
