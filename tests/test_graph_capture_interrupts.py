"""A capture block ends on every path, an interrupt (KeyboardInterrupt) included."""
import logging

import numpy as np
import pytest

import sharedmem as sm
from sharedmem.runtime.state import RUNTIME
from host_kernels import inc


def _stream_and_buffer(host):
    s = host.create_stream("cap")
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    s.synchronize()
    return s, x


def test_an_interrupt_while_the_capture_ends_still_ends_it(host, monkeypatch):
    """KeyboardInterrupt inside the backend's end_capture (a signal landing in its Python
    code after the driver ended the capture): the stream must not stay 'capturing' in
    sharedmem's books, silently recording every later launch into a dead graph."""
    s, x = _stream_and_buffer(host)
    B = type(host.backend)
    real = B.end_capture

    def interrupted(self, rec):
        real(self, rec)
        raise KeyboardInterrupt
    monkeypatch.setattr(B, "end_capture", interrupted)
    captures = RUNTIME.captures
    with pytest.raises(KeyboardInterrupt):
        with sm.capture(s) as g:
            sm.launch(inc, 1, 1, x, stream=s)
    monkeypatch.undo()
    assert s._capture is None, "the stream still captures a graph nobody can end"
    assert RUNTIME.captures == captures
    sm.launch(inc, 1, 1, x, stream=s).result(5)  # runs, not recorded
    np.testing.assert_array_equal(x.to_host(), np.ones(4))
    g.release()  # no graph (failed), and it keeps nothing
    assert x.allocation.live_views == 1


def test_an_interrupt_while_the_graph_is_instantiated_leaves_no_graph_stuck_capturing(
        host, monkeypatch):
    """KeyboardInterrupt during instantiation (long for big CUDA graphs; no lock held): the
    Graph must not stay 'capturing' forever, keeping its memory aliased with release()
    refused."""
    s, x = _stream_and_buffer(host)
    B = type(host.backend)

    def interrupted(self, captured):
        raise KeyboardInterrupt
    monkeypatch.setattr(B, "instantiate_graph", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with sm.capture(s) as g:
            sm.launch(inc, 1, 1, x, stream=s)
    monkeypatch.undo()
    g.release()  # CaptureError "is being captured" before the fix
    assert x.allocation.live_views == 1
    sm.Tensor.from_buffer(x, (4,))  # no alias left


def test_an_interrupt_as_the_capture_block_is_entered_ends_the_capture(host, monkeypatch):
    """KeyboardInterrupt after the backend began capturing but before ``__enter__`` returned
    (here from a logging handler of the 'capture ... begins' line): ``with`` never calls
    ``__exit__``, so ``__enter__`` itself must end the capture."""
    s, x = _stream_and_buffer(host)

    class Interrupting(logging.Handler):
        def emit(self, record):
            if "begins" in record.getMessage():
                raise KeyboardInterrupt
    log = logging.getLogger("sharedmem")
    h = Interrupting(logging.DEBUG)
    old = log.level
    log.addHandler(h)
    log.setLevel(logging.DEBUG)
    try:
        with pytest.raises(KeyboardInterrupt):
            with sm.capture(s):
                pass
    finally:
        log.removeHandler(h)
        log.setLevel(old)
    assert s._capture is None, "the stream was left capturing"
    sm.launch(inc, 1, 1, x, stream=s).result(5)
    np.testing.assert_array_equal(x.to_host(), np.ones(4))
