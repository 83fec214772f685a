"""A graph's executable as a C Work class (graph.py/graph.pxd): destroyed exactly once, also when
the Graph is dropped while replays are in flight and at interpreter exit; copies of the private
executable (the escaped-capture warning of a replay: test_graph_replay.py)."""
import copy
import gc
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest

import sharedmem as sm  # noqa: E402
from host_kernels import inc  # noqa: E402


def collect():
    for _ in range(4):
        gc.collect()


@pytest.fixture
def counted(monkeypatch):
    host = sm.Device.host()
    destroyed = []
    orig = type(host.backend).destroy_graph
    monkeypatch.setattr(type(host.backend), "destroy_graph",
                        lambda self, h: (destroyed.append(id(h)), orig(self, h))[1])
    return host, destroyed


gate = threading.Event()


@sm.host_kernel
def blocked_inc(x):
    gate.wait(10)
    x += 1


def test_graph_dropped_with_replays_in_flight(counted):
    host, destroyed = counted
    s = host.create_stream()
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    s.synchronize()
    gate.set()
    with sm.capture(s) as g:
        sm.launch(blocked_inc, 1, 1, x, stream=s)
    gate.clear()
    futs = [g.replay(s) for _ in range(3)]
    del g
    collect()
    assert destroyed == []  # replays in flight keep the executable
    gate.set()
    futs[-1].result(10)
    del futs
    sm.synchronize()
    collect()
    assert len(destroyed) == 1
    np.testing.assert_array_equal(x.to_host(), np.full(4, 3))


def test_copy_of_the_executable_destroys_the_graph_under_the_live_graph(counted):
    """copy.copy(g._exec) makes a second owner of the same backend handle (Cython's automatic
    pickling of the cdef class, or object.__reduce_ex__ interpreted): when the copy dies the
    graph is destroyed while g still replays it, and again when g goes."""
    host, destroyed = counted
    s = host.create_stream()
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    s.synchronize()
    with sm.capture(s) as g:
        sm.launch(inc, 1, 1, x, stream=s)
    try:
        dup = copy.copy(g._exec)
    except TypeError:
        return  # refused: fine
    del dup
    collect()
    assert destroyed == [], "destroyed while the Graph that owns it is alive"
    g.release()
    del g
    sm.synchronize()
    collect()
    assert len(destroyed) == 1


def test_interpreter_exit_with_live_graph_and_replay(tmp_path):
    root = os.path.join(os.path.dirname(__file__), "..")
    script = textwrap.dedent("""
        import sys; sys.path.insert(0, "tests")
        import sharedmem as sm
        from host_kernels import inc
        host = sm.Device.host()
        B = type(host.backend); orig = B.destroy_graph
        def d(self, h):
            print("DESTROY", flush=True); orig(self, h)
        B.destroy_graph = d
        s = host.create_stream()
        x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
        s.synchronize()
        with sm.capture(s) as g:
            sm.launch(inc, 1, 1, x, stream=s)
        f = g.replay(s)
        g2 = g  # a module global: cleared at shutdown
        print("END", flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.count("DESTROY") <= 1, r.stdout
