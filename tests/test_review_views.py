"""From an adversarial review of Tensor views, moves, pickling and host kernels: each test
failed before its fix."""

import pickle

import numpy as np
import pytest

import sharedmem as sm


def test_a_step_slice_of_an_empty_tensor_keeps_its_parents_stride(host):
    """t[::2] of a tensor with another axis of size 0 multiplied its first stride by the step
    unchecked (no bytes bound it): from a stride of 2**62 bytes (from_buffer takes it) a view
    with byte strides (2**63, 8) -- a copy() then faulted the stream it ran on (NumPy's
    "Maximum allowed dimension exceeded" in the host worker: CompletionUnknownError for every
    later use of the default stream, its memory leaked), a host launch raised that ValueError,
    and a DLPack export gave NumPy a stride of -2**63. An empty view keeps its parent's
    stride, as a view of one row does."""
    b = sm.Buffer.zeros(4, "float64", device=host)
    t = sm.Tensor.from_buffer(b, (3, 0), (1 << 59, 1))
    assert t.byte_strides == (1 << 62, 8)
    u = t[::2]
    assert u.shape == (2, 0) and u.strides == (1 << 59, 1)
    assert u.copy().to_host().shape == (2, 0)
    seen = []
    sm.launch(sm.host_kernel(lambda x: seen.append(x.strides)), 1, 1, u).result(5)
    assert seen == [(1 << 62, 8)]
    assert np.from_dlpack(u).strides == (1 << 62, 8)
    # the default stream runs on
    assert sm.Buffer.from_host(np.arange(3.0), device=host).to_host().tolist() == [0.0, 1.0, 2.0]


def test_bfloat16_views_pickle(host):
    """A bfloat16 view (ml_dtypes' bfloat16: what a DLPack import of a torch or JAX bfloat16
    tensor is) pickled its dtype as its typestr, "<V2", which unpickling refused ("dtype |V2
    cannot live in device memory"): pickle.dumps succeeded, pickle.loads never did. The dtype
    travels as itself."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = np.dtype(ml_dtypes.bfloat16)
    a = np.array([1.5, -2.0, 0.25, 3.0, 1e30, -0.0], dtype=bf)
    b = sm.Buffer.from_host(a, device=host)
    t = sm.Tensor.from_host(a.reshape(2, 3), device=host)
    box = sm.DeviceBox(1.5, bf, device=host)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        rb, rt, rbox = pickle.loads(pickle.dumps((b, t[::1], box), protocol=protocol))
        assert rb.dtype == bf and rt.dtype == bf and rt.shape == (2, 3)
        assert rb.to_host().view(np.uint16).tolist() == a.view(np.uint16).tolist()
        assert rt.to_host().view(np.uint16).tolist() == a.reshape(2, 3).view(np.uint16).tolist()
        assert rbox.dtype == bf and rbox.get() == 1.5


def test_an_as_strided_view_leased_first_is_ordered_with_its_array(host):
    """np.lib.stride_tricks.as_strided makes an array over a stand-in object (NumPy's
    DummyArray, whose ``base`` is the array it views), not over that array: leased first, the
    view was an allocation of its own bytes, and the array leased next on another stream a
    second one -- the read of the array ran while the other stream still wrote the view (it
    read [0, 0, 0, 0, 0, 0, 0, 0]). Both are now ranges of the array's allocation."""
    import time
    from numpy.lib.stride_tricks import as_strided

    @sm.host_kernel
    def slow_fill(x, v):
        time.sleep(0.3)
        x[...] = v

    @sm.host_kernel
    def snap(x, out):
        out[:] = x

    x = np.zeros(8)
    v = as_strided(x[2:], shape=(4,), strides=(8,))
    s1, s2 = host.create_stream(), host.create_stream()
    out = np.full(8, -1.0)
    sm.launch(slow_fill, 1, 1, v, 1.0, stream=s1)
    sm.launch(snap, 1, 1, sm.In(x), out, stream=s2).result(5)
    assert out.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    s1.synchronize()
