"""CUDA graphs through sharedmem (marked gpu)."""

import gc

import numpy as np
import pytest

import sharedmem as sm

from conftest import gc_collect_harder

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def K(gpu):
    import gpu_kernels
    return gpu_kernels


def test_cuda_replay_after_dropping_every_buffer(gpu, K):
    n = 1 << 16
    s = gpu.create_stream("capture")
    x = sm.Buffer.zeros(n, "float32", device=gpu, stream=s)
    y = sm.Buffer.zeros(n, "float32", device=gpu, stream=s)
    out = sm.Buffer.zeros(n, "float32", device=gpu, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        sm.launch(K.kernel("fill"), 64, 256, sm.Out(x), n, 2.0, stream=s)
        sm.launch(K.kernel("fill"), 64, 256, sm.Out(y), n, 0.5, stream=s)
        sm.launch(K.kernel("saxpy"), n // 256, 256, 3.0, sm.In(x), sm.In(y), sm.Out(out), n, stream=s)
    np.testing.assert_array_equal(out.to_host(), np.zeros(n, np.float32))
    import interop.cupy as ic
    keep = ic.as_cupy(out)  # to read the result after dropping every sharedmem handle
    del x, y, out
    gc_collect_harder()
    fresh = [sm.Buffer.empty(n, "float32", device=gpu) for _ in range(6)]
    for f in fresh:
        sm.launch(K.kernel("fill"), 64, 256, sm.Out(f), n, -1.0)
    r = gpu.create_stream("replay")
    g.replay(r).result()
    g.replay(r).result()
    np.testing.assert_array_equal(keep.get(), np.full(n, 6.5, np.float32))


def test_cuda_replay_ordered_or_refused(gpu, K):
    n = 1 << 16
    cap, writer, rep = (gpu.create_stream(x) for x in ("cap", "writer", "replay"))
    x = sm.Buffer.zeros(n, "float32", device=gpu, stream=cap)
    out = sm.Buffer.zeros(n, "float32", device=gpu, stream=cap)
    cap.synchronize()
    with sm.capture(cap) as g:
        sm.launch(K.kernel("slow_copy"), 64, 256, sm.In(x), sm.Out(out), n, np.int64(0), stream=cap)
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(x), n, 5.0, np.int64(K.cycles(30)), stream=writer)
    g.replay(rep).result()
    np.testing.assert_array_equal(out.to_host(), np.full(n, 5.0, np.float32))
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(x), n, 6.0, np.int64(K.cycles(30)), stream=writer)
    with pytest.raises(sm.AccessConflictError, match=r"^replay of graph #\d+ on <Stream replay"):
        g.replay(rep, policy="reject")
    with pytest.raises(sm.AliasError, match=rf"graph #{g.id}"):
        sm.Tensor.from_buffer(x, (n,))
    del g
    gc.collect()
    writer.synchronize()
    sm.Tensor.from_buffer(x, (n,))


def test_default_stream_cannot_capture(gpu):
    with pytest.raises(sm.CaptureError, match="the default stream cannot be captured"):
        with sm.capture(gpu.default_stream):
            pass


def test_cuda_graph_of_a_zip_and_a_chain(gpu, K):
    """zip branches captured one after another, then a dependent launch; the
    graph replays exactly, twice, on another stream."""
    n = 1 << 14
    s = gpu.create_stream("capture-zip")
    a = sm.Buffer.zeros(n, "float32", device=gpu, stream=s)
    b = sm.Buffer.zeros(n, "float32", device=gpu, stream=s)
    out = sm.Buffer.zeros(n, "float32", device=gpu, stream=s)
    s.synchronize()
    fill, saxpy = K.kernel("fill"), K.kernel("saxpy")
    z = sm.zip(sm.op(fill, 16, 256, sm.Out(a), n, 1.5), sm.op(fill, 16, 256, sm.Out(b), n, 0.25))
    g = sm.graph(z.and_then(sm.op(saxpy, n // 256, 256, 2.0, sm.In(a), sm.In(b), sm.Out(out), n)),
                 stream=s)
    assert g.launches == 3
    np.testing.assert_array_equal(out.to_host(), np.zeros(n, np.float32))
    r = gpu.create_stream("replay-zip")
    g.replay(r).result()
    g.replay(r).result()
    np.testing.assert_array_equal(out.to_host(), np.full(n, 3.25, np.float32))
