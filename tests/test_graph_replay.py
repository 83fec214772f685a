"""Graph replay as the executable's Work: host backend and fake CUDA (cuGraphLaunch through
its address and not), launch errors, and no escaped-capture warning for a replay."""
import gc
import os
import sys
import warnings

import numpy as np
import pytest

import sharedmem as sm
from sharedmem.runtime import graph as G
from sharedmem.runtime import submission as S
from host_kernels import inc, fill


@pytest.fixture
def host():
    return sm.Device.host()


def test_host_replay_and_destroy(host, monkeypatch):
    destroyed = []
    orig = type(host.backend).destroy_graph
    monkeypatch.setattr(type(host.backend), "destroy_graph",
                        lambda self, h: (destroyed.append(h), orig(self, h))[1])
    s = host.create_stream()
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        sm.launch(inc, 1, 1, x, stream=s)
    ex = g._exec
    assert isinstance(ex, S.Work) and type(ex).__del__ is G._Executable.__del__
    futs = [g.replay(s) for _ in range(10)]
    assert all("replay of graph" in repr(f) for f in futs)
    futs[-1].result(5)
    np.testing.assert_array_equal(x.to_host(), np.full(4, 10))
    del futs, ex
    g.release()
    del g
    sm.synchronize()
    for _ in range(4):
        gc.collect()
    assert len(destroyed) == 1


def test_replay_into_a_capture_is_refused(host):
    s, c = host.create_stream(), host.create_stream()
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        sm.launch(inc, 1, 1, x, stream=s)
    with sm.capture(c) as g2:
        with pytest.raises(sm.CaptureError, match="cannot replay graph"):
            g.replay(c)
    g.replay(s).result(5)
    np.testing.assert_array_equal(x.to_host(), np.full(4, 1))


def test_replay_while_capturing_elsewhere_does_not_warn(host):
    # before c93b5c8 a replay went through submit() (plan None): escaped_capture never ran.
    # Now it is submit_plan(...): it warns, with advice ("launch on <s>") that a replay cannot
    # follow -- replaying into a capture raises CaptureError.
    s, c = host.create_stream(), host.create_stream()
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    y = sm.Buffer.zeros(4, "int64", device=host, stream=c)
    sm.synchronize()
    with sm.capture(s) as g:
        sm.launch(inc, 1, 1, x, stream=s)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with sm.capture(c) as g2:
            sm.launch(inc, 1, 1, y, stream=c)
            g.replay(s).result(5)
    msgs = [str(w.message) for w in seen if issubclass(w.category, sm.SharedMemWarning)]
    assert msgs == [], msgs


@pytest.mark.parametrize("hot", [True, False])
def test_fake_cuda_replay_and_launch_error(monkeypatch, hot):
    from fake_cuda import install_fake_devices, CUresult
    (dev,), drv = install_fake_devices(monkeypatch, hot)
    s = dev.create_stream()
    b = sm.Buffer.zeros(8, "float64", device=dev, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        b.copy_from(np.full(8, 3.0), stream=s)
    assert (dev.backend.graph_launch_addr != 0) == hot
    g.replay(s).result()
    np.testing.assert_array_equal(b.to_host(), np.full(8, 3.0))
    before = sm.stats().submitted
    monkeypatch.setattr(drv, "cuGraphLaunch", lambda e, st: (CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(Exception, match="cuGraphLaunch"):
        g.replay(s)
    assert sm.stats().submitted == before  # a failed launch takes no lease
    monkeypatch.undo()
