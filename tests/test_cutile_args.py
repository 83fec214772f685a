"""cuTile launches: what the adapter accepts as an argument and what it refuses (against the
fake driver and the fake cuTile of tests/fake_cuda.py).

* Arrays inside a tuple or list argument are refused: cuTile reads them, but a launch leases
  only its arguments themselves -- they would run unleased, and the warm-up's signature
  would keep them alive.
* Two arguments are refused as aliases only when they share an element byte, not when their
  byte spans merely interleave (even and odd elements).
* A list constant changed in place between two launches is warmed up again: cuTile keys it by
  its items, and a compile inside the launch would run under the core lock.
"""

import gc
import weakref

import numpy as np
import pytest

import sharedmem as sm
from sharedmem.runtime.state import RUNTIME

from fake_cuda import TileKernel
from test_cuda_backend_fake import fake, tile  # noqa: F401  (fixtures)


def _noop_kernel():
    def k(*args):
        pass
    return TileKernel(k)


@pytest.mark.parametrize("wrap", [lambda a, b: (a, b), lambda a, b: [1, (sm.In(a),)],
                                  lambda a, b: (2.0, [b.into_buffer()])])
def test_arrays_inside_a_tuple_or_list_are_refused_before_any_lease(fake, tile, wrap):
    dev, drv = fake
    s = dev.create_stream("s")
    a = sm.Tensor.zeros((16,), "float32", device=dev)
    b = sm.Tensor.zeros((16,), "float32", device=dev)
    arg = wrap(a, b)
    sm.synchronize()
    with pytest.raises(sm.KernelError, match=r"^argument 1: a (Tensor|In|Buffer) inside a "
                                             r"(tuple|list); a launch leases only the arrays "
                                             r"passed as arguments themselves"):
        sm.launch(_noop_kernel(), (1,), None, sm.Out(a), arg, stream=s)
    assert [e for e in sm.inflight() if e.stream is s] == []  # nothing leased or enqueued
    t = sm.Tensor.from_buffer(a.into_buffer(), (16,))  # the argument is still movable
    assert t.shape == (16,)


def test_a_refused_tuple_keeps_nothing_alive(fake, tile):
    dev, drv = fake
    s = dev.create_stream("s")
    kern = _noop_kernel()
    a = sm.Tensor.zeros((16,), "float32", device=dev)
    with pytest.raises(sm.KernelError):
        sm.launch(kern, (1,), None, (a,), stream=s)
    alloc = weakref.ref(a.allocation)
    del a
    sm.synchronize()
    gc.collect()
    assert alloc() is None


def test_scalars_in_tuples_still_pass(fake, tile):
    dev, drv = fake
    mod, _ = tile
    seen = []
    orig = mod.launch

    def launch(stream, grid, kernel, args):
        seen.append(args[1])
        return orig(stream, grid, kernel, args)
    mod.launch = launch
    s = dev.create_stream("s")
    a = sm.Tensor.zeros((16,), "float32", device=dev)
    sm.launch(_noop_kernel(), (1,), None, sm.Out(a), (1, 2.5, (True, None, "x")), stream=s).result()
    assert seen[-1] == (1, 2.5, (True, None, "x"))


def test_interleaved_views_are_not_aliases(fake, tile):
    dev, drv = fake
    s = dev.create_stream("s")
    t = sm.Tensor.from_host(np.arange(16, dtype=np.float32), device=dev)
    calls = []

    def k(src, dst):
        calls.append(1)
    assert sm.launch(TileKernel(k), (1,), None, sm.In(t[0::2]), sm.Out(t[1::2]),
                     stream=s).result() is None
    assert calls == [1]
    # the same element read and written is still refused, as are the overlapping halves
    for x, y in ((t[0::2], t[2::2]), (t[0:10], t[5:16]), (t[::4], t[::2])):
        with pytest.raises(sm.KernelError, match=r"^arguments 0 and 1 overlap \(bytes \["):
            sm.launch(TileKernel(k), (1,), None, sm.In(x), sm.Out(y), stream=s)
    # 2-D: the even and the odd rows of a 4x4 share no element
    m = t.reshape((4, 4))
    sm.launch(TileKernel(k), (1,), None, sm.In(m[0::2]), sm.Out(m[1::2]), stream=s).result()
    assert calls == [1, 1]


def test_a_list_changed_in_place_is_warmed_again_off_the_lock(fake, tile):
    dev, drv = fake
    mod, _ = tile
    s = dev.create_stream("s")
    a = sm.Tensor.zeros((16,), "float32", device=dev)
    sm.synchronize()
    owners, seen = [], set()
    orig = mod.launch

    def key(x):  # cuTile's key: arrays by layout, lists and tuples item by item
        if hasattr(x, "__cuda_array_interface__"):
            c = x.__cuda_array_interface__
            return (c["typestr"], c["shape"], c["strides"])
        if isinstance(x, (list, tuple)):
            return (type(x),) + tuple(key(e) for e in x)
        return (type(x), x)

    def launch(stream, grid, kernel, args):
        sig = tuple(key(x) for x in args)
        if sig not in seen:  # a compile: who holds the core lock (0: nobody)
            seen.add(sig)
            owners.append(RUNTIME.owner)
        mod.compiled = []
        return orig(stream, grid, kernel, [tuple(x) if type(x) is list else x for x in args])
    mod.launch = launch
    kern = _noop_kernel()
    cfg = [16, 1]
    nested = (3, [4])
    sm.launch(kern, (1,), None, sm.Out(a), cfg, nested, stream=s).result()
    cfg[0] = 32  # the same list object, other contents: another signature for cuTile
    sm.launch(kern, (1,), None, sm.Out(a), cfg, nested, stream=s).result()
    nested[1][0] = 5  # a list inside the same tuple
    sm.launch(kern, (1,), None, sm.Out(a), cfg, nested, stream=s).result()
    assert owners == [0, 0, 0]


def test_torch_tensors_are_leased_keyed_by_layout_and_ordered_after_torch(fake, tile,
                                                                          monkeypatch):
    """torch tensors given to a cuTile kernel reach it as themselves (cuTile reads torch
    tensors), leased through their facts as for CuPy kernels, the launch ordered after
    torch's current stream; a tensor's part of the signature is its layout (dtype, shape,
    strides, alignment), not its identity -- a new tensor each launch warms nothing again;
    the same tensors again compute no signature (their facts stand for them), until torch
    changes one in place. (torch here has no ``torch._C._cuda_getCurrentRawStream``: its
    current stream is asked through ``torch.cuda.current_stream``.)"""
    import interop.cutile as icu
    from interop.cutile import _signature
    from test_cuda_backend_fake import _fake_torch, _waits_seen
    dev, drv = fake
    torch = _fake_torch(monkeypatch, dev, raw_stream=False)
    s = dev.create_stream("s")
    waits = _waits_seen(drv, monkeypatch)
    signed = []
    monkeypatch.setattr(icu, "_signature", lambda *a: signed.append(1) or _signature(*a))

    def double(a, b):
        b.host[...] = (2 * a.host).reshape(b.host.shape)

    kern = TileKernel(double)
    a = torch.Tensor(np.arange(16, dtype=np.float32))
    for _ in range(2):  # a new output tensor each launch
        b = torch.Tensor(np.zeros(16, np.float32))
        sm.launch(kern, (1,), None, sm.In(a), sm.Out(b), stream=s).result()
        np.testing.assert_array_equal(b.host, 2 * np.arange(16))
    assert waits == [s.handle, s.handle] and len(signed) == 2
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(b), stream=s).result()
    assert len(signed) == 2 and waits == [s.handle] * 3  # (the same tensors: no signature)
    d = torch.Tensor(np.zeros(16, np.float32))
    d.set_(np.zeros((4, 4), np.float32))  # torch changes d's layout in place: signed again
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(d), stream=s).result()
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(d), stream=s).result()
    d.set_(np.zeros((2, 8), np.float32))
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(d), stream=s).result()
    assert len(signed) == 4
    c = torch.Tensor(np.zeros(16, np.float32))
    assert _signature((a, b), None) == _signature((a, c), None) != _signature(
        (a, torch.Tensor(np.zeros(8, np.float32))), None)
