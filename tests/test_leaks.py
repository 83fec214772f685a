"""A long-running process (a server, a training loop) repeats the same calls for days: what
sharedmem keeps per call must be let go once the objects are dropped and the work retired,
or stay within a bound. Each test repeats one pattern and checks a count stays put."""

import gc
import sys
import types
import weakref

import numpy as np
import pytest

import sharedmem as sm

from conftest import gc_collect_harder


from test_graph_fake import fake  # noqa: F401,E402 (a CUDA device over the fake driver)


def _cupy_array(n):
    """A CuPy-style array (of type ``cupy.ndarray`` itself) over fresh memory of CuPy's own
    pool: foreign memory, as a CuPy array's is."""
    from fake_cuda import _FakeBlock
    cp = sys.modules["cupy"]

    class ndarray(cp.ndarray):
        def __init__(self, n):
            self._block = _FakeBlock(4 * n)
            mem = types.SimpleNamespace(ptr=self._block.ptr, size=4 * n)
            self.data = types.SimpleNamespace(ptr=self._block.ptr, mem=mem)
            self.device = types.SimpleNamespace(id=0)
            self.base, self.dtype, self.size, self.shape = None, np.dtype(np.float32), n, (n,)
            self.strides, self.itemsize = (4,), 4

    cp.ndarray = ndarray
    return ndarray(n)


def test_wrapping_a_long_lived_cupy_array_in_a_loop_keeps_nothing_per_wrap(fake):
    """``interop.cupy.wrap(arr)`` of one long-lived CuPy array, the Tensor dropped each time (a
    step that wraps its model's CuPy array): every call left the array's alias -- a live view
    token of the allocation -- and a ``weakref.finalize`` on the array until the array died
    (9,300 wraps: 9,300 live views, 1.7 MB, and every move check of the allocation walking
    them). The alias now lives with the wrap (as an import's producer alias does): it ends
    when the wrap's last view and lease are gone, or earlier when the array dies."""
    import interop.cupy as ic
    dev, drv = fake
    arr = _cupy_array(16)
    t = ic.wrap(arr)
    alloc = weakref.ref(t.allocation)
    with pytest.raises(sm.AliasError, match=r"CuPy array \(shape \(16,\), float32\)"):
        t.into_buffer()  # the array is an alias of the wrap while both live
    del t
    gc_collect_harder()
    finalizers = len(weakref.finalize._registry)
    views = sm.stats().live_views
    for _ in range(300):
        t = ic.wrap(arr)
        s = t[2:4]  # (a view of the wrap: the alias lives as long as it, too)
        del t
        with pytest.raises(sm.AliasError, match=r"CuPy array \(shape \(16,\), float32\)"):
            s.into_buffer()
        del s
    gc_collect_harder()
    assert sm.stats().live_views <= views
    assert len(weakref.finalize._registry) <= finalizers
    assert alloc() is None or alloc().live_views == 0
    # the array dying ends the alias of a wrap that lives on (as before)
    t = ic.wrap(arr)
    del arr
    gc_collect_harder()
    b = t.into_buffer()
    assert b.allocation.live_views == 1
