"""Pickling views: a host copy (after pending writes) that arrives as a new allocation."""

import multiprocessing
import os
import pickle

import numpy as np
import pytest

import sharedmem as sm

from host_kernels import slow_fill

DTYPES = ["float32", "float64", "float16", "complex64", "complex128", "bool", "int8", "uint8",
          "int16", "int32", "int64", "uint64"]


def values(n, dtype):
    a = np.arange(1, n + 1)
    if np.dtype(dtype) == np.bool_:
        return a % 3 == 0
    a = a.astype(dtype)
    if np.dtype(dtype).kind == "c":
        a = a + 1j * a[::-1]
    return a.astype(dtype)


def roundtrip(x, protocol=pickle.HIGHEST_PROTOCOL):
    return pickle.loads(pickle.dumps(x, protocol=protocol))


@pytest.mark.parametrize("dtype", DTYPES)
def test_buffer_round_trip_exact(host, dtype):
    a = values(37, dtype)
    b = sm.Buffer.from_host(a, device=host)
    r = roundtrip(b)
    assert type(r) is sm.Buffer and r.dtype == a.dtype and len(r) == 37
    np.testing.assert_array_equal(r.to_host(), a)
    assert r.allocation is not b.allocation and r.allocation.id != b.allocation.id
    assert r.ptr != b.ptr and b.is_live and not r.readonly


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_every_protocol(host, protocol):
    t = sm.Tensor.from_host(values(12, "float64").reshape(3, 4), device=host)
    b = sm.Buffer.from_host(values(5, "int8"), device=host)
    box = sm.DeviceBox(-2.5, "float32", device=host)
    rt, rb, rbox = pickle.loads(pickle.dumps((t, b, box), protocol=protocol))
    np.testing.assert_array_equal(rt.to_host(), t.to_host())
    np.testing.assert_array_equal(rb.to_host(), b.to_host())
    assert rbox.get() == -2.5 and rbox.dtype == np.float32


def test_buffer_slice_arrives_as_its_elements(host):
    b = sm.Buffer.from_host(np.arange(100, dtype=np.int32), device=host)
    r = roundtrip(b[10:25])
    assert len(r) == 15 and r.allocation.nbytes >= 60
    np.testing.assert_array_equal(r.to_host(), np.arange(10, 25, dtype=np.int32))


def test_tensor_round_trip_and_read_only_arrives_writable(host):
    a = values(24, "float32").reshape(2, 3, 4)
    t = sm.Tensor.from_host(a, device=host)
    r = roundtrip(t)
    assert type(r) is sm.Tensor and r.shape == (2, 3, 4) and r.is_contiguous()
    np.testing.assert_array_equal(r.to_host(), a)
    ro = roundtrip(t.as_readonly())
    assert not ro.readonly  # a copy nobody else holds: an ordinary allocation
    np.testing.assert_array_equal(ro.to_host(), a)


def test_strided_tensor_arrives_contiguous(host):
    a = values(12, "int16")
    buf = sm.Buffer.from_host(a, device=host)
    t = sm.Tensor.from_buffer(buf, (4, 3), strides=(1, 4))  # the transpose of a 3x4
    assert not t.is_contiguous()
    r = roundtrip(t)
    assert r.shape == (4, 3) and r.strides == (3, 1) and r.is_contiguous()
    np.testing.assert_array_equal(r.to_host(), a.reshape(3, 4).T)


def test_zero_size_and_zero_d(host):
    for shape in [(0,), (3, 0), ()]:
        a = np.zeros(shape, np.float32) + 7
        r = roundtrip(sm.Tensor.from_buffer(sm.Buffer.from_host(a.reshape(-1), device=host),
                                            shape))
        assert r.shape == shape
        np.testing.assert_array_equal(r.to_host(), a)
    r = roundtrip(sm.Buffer.empty(0, "complex64", device=host))
    assert len(r) == 0 and r.dtype == np.complex64


def test_device_box(host):
    for value, dtype in [(3, "int64"), (1.5, "float16"), (True, "bool"), (2 - 1j, "complex64")]:
        box = sm.DeviceBox(value, dtype, device=host)
        r = roundtrip(box)
        assert type(r) is sm.DeviceBox and r.dtype == np.dtype(dtype) and r.get() == value
        assert r.buffer.allocation is not box.buffer.allocation


def test_protocol5_buffers_go_out_of_band(host):
    a = np.arange(100_000, dtype=np.float64)
    t = sm.Tensor.from_host(a.reshape(1000, 100), device=host)
    bufs = []
    payload = pickle.dumps(t, protocol=5, buffer_callback=bufs.append)
    assert len(bufs) == 1 and isinstance(bufs[0], pickle.PickleBuffer)
    assert bufs[0].raw().nbytes == a.nbytes
    assert len(payload) < 500  # the values are not in the stream
    r = pickle.loads(payload, buffers=bufs)
    np.testing.assert_array_equal(r.to_host(), a.reshape(1000, 100))
    # in band, the same payload holds them
    assert len(pickle.dumps(t, protocol=5)) > a.nbytes


def test_pending_writes_on_another_stream_are_waited_for(host, settled):
    s = host.create_stream()
    t = sm.Tensor.zeros((64, 8), "float32", device=host)
    sm.launch(slow_fill, 1, 1, sm.Out(t), 9.0, 0.3, stream=s)  # still writing when pickled
    r = roundtrip(t)
    np.testing.assert_array_equal(r.to_host(), np.full((64, 8), 9.0, np.float32))
    b = sm.Buffer.zeros(10, "int32", device=host)
    sm.launch(slow_fill, 1, 1, sm.Out(b), 4, 0.2, stream=s)
    data = pickle.dumps(b)
    np.testing.assert_array_equal(pickle.loads(data).to_host(), np.full(10, 4, np.int32))


def test_moved_and_released_views_raise(host):
    b = sm.Buffer.from_host(np.arange(6, dtype=np.float32), device=host)
    t = sm.Tensor.from_buffer(b, (2, 3))
    with pytest.raises(sm.MovedError):
        pickle.dumps(b)
    with pytest.raises(sm.MovedError):
        pickle.dumps(_box_of(b))  # a box whose buffer was moved
    t.release()
    with pytest.raises(sm.ReleasedError):
        pickle.dumps(t, protocol=2)


def _box_of(buf):
    box = sm.DeviceBox.__new__(sm.DeviceBox)
    box.buffer = buf
    return box


def test_streams_events_futures_refuse_with_advice(host):
    s = host.create_stream()
    b = sm.Buffer.zeros(4, device=host, stream=s)
    fut = b.fill_zero(s)
    for obj in [s, host.default_stream, s.record(), fut, fut.then(lambda _: 1), b.allocation]:
        with pytest.raises(TypeError, match=r"cannot pickle a sharedmem \w+: .*Send the data "
                                            r"instead \(Buffer, Tensor and DeviceBox pickle"):
            pickle.dumps(obj)
    assert pickle.loads(pickle.dumps(host)) is host  # devices pickle by ordinal
    # a copy of a stream or an event is itself (one Stream per stream), as a device's is
    import copy
    ev = s.record()
    for obj in (s, host.default_stream, ev, host):
        assert copy.copy(obj) is obj and copy.deepcopy(obj) is obj
    assert copy.deepcopy({"stream": s, "x": [1]})["stream"] is s
    fut.result(5)


def _child_sum(payload):
    # a fresh interpreter: imports sharedmem, unpickles on its own default device
    import sharedmem as sm_child
    t = pickle.loads(payload)
    assert isinstance(t, sm_child.Tensor)
    return t.shape, str(t.dtype), t.to_host().tolist(), str(t.device)


def test_through_a_spawned_process(host):
    a = values(20, "float32").reshape(4, 5)
    t = sm.Tensor.from_host(a, device=host)
    ctx = multiprocessing.get_context("spawn")
    env_backup = os.environ.get("SHAREDMEM_BACKEND")
    os.environ["SHAREDMEM_BACKEND"] = "host"
    try:
        with ctx.Pool(1) as pool:
            shape, dtype, got, dev = pool.apply(_child_sum, (pickle.dumps(t, protocol=5),))
    finally:
        if env_backup is None:
            del os.environ["SHAREDMEM_BACKEND"]
        else:
            os.environ["SHAREDMEM_BACKEND"] = env_backup
    assert shape == (4, 5) and dtype == "float32" and dev == "<Device host>"
    np.testing.assert_array_equal(np.array(got, np.float32), a)


def test_a_pool_block_or_a_view_token_cannot_be_copied(host):
    """``allocation.owner`` (the host pool block) and a view's token are the ownership itself:
    copy.copy of a block shared its memory with a second block, which gave it back to the pool
    when it died -- while the buffer still used it -- so the next two allocations got the same
    bytes; a copied token said it was live, was counted nowhere, and its release raised
    KeyError. Both are refused (TypeError), as an Allocation is."""
    import copy
    import gc
    b = sm.Buffer.zeros(1000, "uint8", device=host)
    alloc = b.allocation
    for obj in (alloc.owner, b._token):
        for f in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match=r"cannot (copy or )?pickle (a sharedmem "
                                                r"ViewToken|the host pool block)"):
                f(obj)
    gc.collect()
    # nothing was given back: two new buffers of that size class have bytes of their own
    x = sm.Buffer.zeros(1000, "uint8", device=host)
    y = sm.Buffer.zeros(1000, "uint8", device=host)
    assert len({b.ptr, x.ptr, y.ptr}) == 3
    assert alloc.live_views == 1 and b._token.live
    b.release()
    assert alloc.live_views == 0


def test_copy_and_deepcopy_make_a_copy_on_the_same_device(monkeypatch):
    """copy.copy / copy.deepcopy of a view: a new allocation with the same values on the
    view's own device (as NumPy and CuPy copy arrays) -- not a pickle round trip, which lands
    on the default device (a GPU here) and goes through host memory."""
    import copy

    import sharedmem.device as sm_device
    from conftest import gc_collect_harder
    from fake_cuda import install_fake_devices
    (gpu,), drv = install_fake_devices(monkeypatch, False)
    monkeypatch.setattr(sm_device, "_default", gpu)  # (the default device: the fake GPU)
    for dev in (sm.Device.host(), gpu):
        b = sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=dev)
        t = sm.Tensor.from_host(np.arange(12, dtype=np.int16).reshape(3, 4), device=dev)[::2]
        for c in (copy.copy(b), copy.deepcopy(b), copy.copy(t), copy.deepcopy(t)):
            src = b if isinstance(c, sm.Buffer) else t
            assert type(c) is type(src) and c.device is dev and c.dtype == src.dtype
            assert c.shape == src.shape and c.allocation is not src.allocation
            np.testing.assert_array_equal(c.to_host(), src.to_host())
            assert b.allocation.live_views == 1  # (no alias of the source was made)
        ro = b.as_readonly()
        c = copy.deepcopy(ro)  # (a copy is new memory: writable, as NumPy's)
        assert ro.readonly and not c.readonly and c.device is dev
        box = sm.DeviceBox(1.5, "float32", device=dev)  # a box copies its value, too
        for c in (copy.copy(box), copy.deepcopy(box)):
            assert type(c) is sm.DeviceBox and c.device is dev and c.dtype == np.float32
            assert c.buffer.allocation is not box.buffer.allocation
            c.set(5.0)
            assert c.get() == 5.0 and box.get() == 1.5
            c.release()
            assert box.buffer.is_live
        del b, t, c, src, ro, box
    sm.synchronize()
    gc_collect_harder()


def test_unpickling_inside_a_capture_block_gets_the_values(host):
    """The copy that fills an unpickled view runs -- it is not recorded into the graph being
    captured on the current stream (the view would hold no values, and every replay would
    write it) -- and the graph captures only what the block launched."""
    import pickle
    from host_kernels import fill
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = [pickle.dumps(x) for x in (sm.Tensor.from_host(a, device=host),
                                      sm.Buffer.from_host(a.ravel(), device=host),
                                      sm.DeviceBox(2.5, "float32", device=host))]
    out = sm.Buffer.zeros(4, "float32", device=host)
    s = host.create_stream()
    with sm.capture(s) as g:
        t, b, box = (pickle.loads(d) for d in data)
        sm.launch(fill, 1, 1, sm.Out(out), 7.0)
    np.testing.assert_array_equal(t.to_host(), a)
    np.testing.assert_array_equal(b.to_host(), a.ravel())
    assert box.get() == 2.5
    np.testing.assert_array_equal(out.to_host(), np.zeros(4))  # captured, not run
    g.replay(s).result(5)
    np.testing.assert_array_equal(out.to_host(), np.full(4, 7.0))
    np.testing.assert_array_equal(t.to_host(), a)  # the replay does not write t


def test_the_dask_hook_registers_once_and_never_breaks_an_import(monkeypatch, tmp_path):
    """``hook_distributed``: where distributed is loaded it registers at once, and a failure
    to (``import interop.dask`` raising) is a RuntimeWarning, never an error; otherwise one
    import hook waits for ``distributed.protocol``, lets it load, removes itself and
    registers. Either way it is done once."""
    import importlib.util
    import sys
    import types
    import warnings

    from sharedmem import pickling as P
    monkeypatch.setattr(P, "_state", {"done": False, "hooked": False})
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if f is not P._DistributedHook])
    # loaded already, registration failing
    monkeypatch.setitem(sys.modules, "distributed.protocol.cuda",
                        types.ModuleType("distributed.protocol.cuda"))
    monkeypatch.setitem(sys.modules, "interop.dask", None)  # (its import raises)
    with pytest.warns(RuntimeWarning, match=r"^sharedmem: registering with dask\.distributed "
                                            r"failed \(ModuleNotFoundError\('import of "
                                            r"interop\.dask halted; None in sys\.modules'\)\); "
                                            r"Tensors travel by pickle\. `import interop\.dask` "
                                            r"shows the error$"):
        P.hook_distributed()
    assert P._state == {"done": True, "hooked": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        P.hook_distributed()  # done: not tried again
    assert P._DistributedHook not in sys.meta_path
    # not loaded yet: one hook, for distributed.protocol only
    monkeypatch.setattr(P, "_state", {"done": False, "hooked": False})
    monkeypatch.delitem(sys.modules, "distributed.protocol.cuda")
    P.hook_distributed()
    P.hook_distributed()
    assert sys.meta_path.count(P._DistributedHook) == 1 and sys.meta_path[0] is P._DistributedHook
    assert P._state == {"done": False, "hooked": True}
    assert P._DistributedHook.find_spec("distributed.utils", None) is None
    assert P._DistributedHook.find_spec("distributed.protocol", [str(tmp_path)]) is None
    pkg = tmp_path / "distributed" / "protocol"  # (a stand-in for distributed's package)
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("LOADED = True\n")
    registered = []
    monkeypatch.setattr(P, "_register_now",
                        lambda: (registered.append(True), P._state.update(done=True)))
    spec = P._DistributedHook.find_spec("distributed.protocol", [str(tmp_path / "distributed")])
    assert isinstance(spec.loader, P._ThenRegister)
    assert spec.loader.get_filename("distributed.protocol") == str(pkg / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.LOADED is True and registered == [True]
    assert P._DistributedHook not in sys.meta_path  # it removed itself
    spec.loader.exec_module(mod)  # (loaded again: nothing to remove, registered already)
    assert registered == [True]
