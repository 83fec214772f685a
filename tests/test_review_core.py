"""The core's promises under bad inputs (from a review): each test is one defect,
asserting what docs/errors.md and docs/api.md promise (the error type, the key part of the
message, and nothing left half-done afterwards)."""

import numpy as np
import pytest

import sharedmem as sm


def _kernel():
    seen = []

    @sm.host_kernel
    def k(a):
        seen.append(1)
        a[:] += 1
    return k, seen


# -- 1. the first launch of a kernel with grid=None, block=None, shared_mem=None ------------------
def test_the_first_launch_of_a_kernel_validates_grid_block_and_shared_mem(host):
    """errors.md, KernelError: "a bad grid / block / shared_mem ... No lease was taken". A
    plan remembers the (grid, block, shared_mem) objects of its last launch to skip their
    validation, and started out remembering (None, None, None) with config None: the first
    launch of every kernel with ``grid=None, block=None, shared_mem=None`` was taken as
    validated -- and ran (the host kernel wrote its buffer; a CUDA plan's enqueue would read
    config None)."""
    k, seen = _kernel()
    b = sm.Buffer.zeros(4, "float32", device=host)
    sm.synchronize()
    before = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^grid must be a positive int or a tuple of 1 to 3 "
                                             r"positive ints, got None$"):
        sm.launch(k, None, None, b, shared_mem=None)
    with pytest.raises(sm.KernelError, match=r"^grid must be a positive int"):
        sm.op(k, None, None, b, shared_mem=None).submit()
    sm.synchronize()
    assert sm.stats().submitted == before  # nothing submitted
    assert seen == []
    np.testing.assert_array_equal(b.to_host(), np.zeros(4, np.float32))
    sm.launch(k, 1, 1, b).result()  # (the kernel still launches with a valid grid)
    np.testing.assert_array_equal(b.to_host(), np.ones(4, np.float32))


# -- 2. Tensor.empty / zeros of dimensions whose product is beyond memory -----------------------
def test_a_tensor_shape_whose_size_is_beyond_memory_is_a_memory_error(host):
    """errors.md, LayoutError: "a dimension of 2**63 or more (...; dimensions whose product is
    beyond memory are a MemoryError)". ``Tensor.empty((2**40, 2**40))`` -- every dimension
    valid, 2**80 elements -- raised LayoutError "a buffer length must be below 2**63", naming
    a buffer length the caller never gave (the tensor's size handed to Buffer.empty)."""
    before = sm.stats().live_allocations
    for make in (sm.Tensor.empty, sm.Tensor.zeros):
        for shape in ((2**40, 2**40), (2**62, 4), (np.uint64(2**40), np.int64(2**40))):
            with pytest.raises(MemoryError, match=r"^cannot allocate a tensor of shape \(\d+, \d+\): "
                                                  r"its \d+ elements are more than any device "
                                                  r"memory can hold$"):
                make(shape, "int8", device=host)
    with pytest.raises(sm.LayoutError, match=r"shape sizes must be below 2\*\*63"):
        sm.Tensor.empty((2**63, 1), "int8", device=host)  # (one dimension too large: LayoutError)
    assert sm.stats().live_allocations == before
    assert sm.Tensor.zeros((2, 3), "int8", device=host).shape == (2, 3)


# -- 3. a DeviceBox subclass as a launch argument --------------------------------------------------
def test_a_device_box_subclass_is_leased_like_a_device_box(host):
    """api.md: a DeviceBox is passed "like a buffer (Out(box))". resolve_args recognised a
    DeviceBox by ``type(obj) is DeviceBox`` only: an instance of a subclass passed bare went to
    the kernel as a scalar -- the box object itself, no lease on its memory -- and as
    ``Out(box)`` was refused with "Out() takes a Buffer, Tensor, DeviceBox or array, got
    MyBox"."""
    import threading

    class MyBox(sm.DeviceBox):
        __slots__ = ()

    got = []
    gate = threading.Event()

    @sm.host_kernel
    def k(a):
        got.append(type(a))
        gate.wait(5)
        a[0] += 1

    box = MyBox(1.0, device=host)
    s1, s2 = host.create_stream(), host.create_stream()
    f = sm.launch(k, 1, 1, box, stream=s1)  # a write lease on the box's memory...
    with pytest.raises(sm.AccessConflictError, match=r"would write bytes \[0, 8\) of allocation"):
        sm.launch(k, 1, 1, sm.Out(box), stream=s2, policy="reject")  # ...seen by another stream
    gate.set()
    f.result(5)
    sm.launch(k, 1, 1, sm.Out(box), stream=s2).result(5)
    assert got == [np.ndarray, np.ndarray]
    assert box.get() == 3.0
    assert sm.op(k, 1, 1, box)._device() is host


# -- 4. the "never retrieved" log of a failed host kernel, under the core lock ---------------------
def test_a_failed_kernels_never_retrieved_log_runs_outside_the_core_lock(host):
    """model.md, Thread safety: no foreign code runs under the core lock. A host kernel that
    raised, its future dropped unseen, is logged at ERROR ("... was never retrieved") when its
    marker goes -- and the last holder of that marker is the access record of its lease, which
    is pruned under the core lock (here: by a launch on another stream over the same bytes).
    The user's logging handlers then ran holding the lock: one that called sharedmem got
    SharedMemError ("called from a finalizer ... that interrupted a sharedmem operation")."""
    import gc
    import logging
    import threading

    from sharedmem.runtime.state import RUNTIME

    seen = []

    class Handler(logging.Handler):
        def emit(self, record):
            if "never retrieved" in record.getMessage():
                seen.append(RUNTIME.owner == threading.get_ident())
                seen.append(sm.stats().in_flight >= 0)  # (a sharedmem call: no SharedMemError)

    @sm.host_kernel
    def bad(a):
        raise ValueError("boom")

    @sm.host_kernel
    def ok(a):
        pass

    h = Handler()
    logging.getLogger("sharedmem").addHandler(h)
    try:
        b = sm.Buffer.zeros(4, "float32", device=host)
        s1, s2 = host.create_stream(), host.create_stream()
        sm.launch(bad, 1, 1, b, stream=s1)  # (its future dropped: never retrieved)
        s1.synchronize()
        sm.synchronize()
        gc.collect()
        assert seen == []  # (the write's access record on s1 keeps its marker)
        sm.launch(ok, 1, 1, b, stream=s2).result(5)  # prunes s1's record, under the core lock
        gc.collect()
    finally:
        logging.getLogger("sharedmem").removeHandler(h)
    assert seen == [False, True]  # logged once, outside the lock, and sharedmem was callable


# -- 5. a host and a CUDA view in one launch: the advice of the DeviceMismatchError -------------
def test_a_launch_mixing_host_and_cuda_memory_does_not_advise_peer_access(host, monkeypatch):
    """errors.md: messages say what to do; PeerAccessError: ``enable_peer_access`` "where the
    pair cannot (... or not two CUDA devices)". A launch mixing a host view and a CUDA view
    advised ``<Device host>.enable_peer_access(<Device cuda:0>)`` -- advice that can only
    raise PeerAccessError. Nothing is leased either way."""
    import sharedmem.device as sm_device
    from fake_cuda import install_fake_devices
    (dev,), _ = install_fake_devices(monkeypatch, False)
    monkeypatch.setitem(sm_device._devices, ("cuda", 0), dev)

    @sm.host_kernel
    def k(a, b):
        pass

    g = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=dev)
    h = sm.Buffer.zeros(4, "float32", device=host)
    sm.synchronize()
    before = sm.stats().submitted
    for args, on in (((h, g), "cuda:0"), ((g, h), "host")):
        with pytest.raises(sm.DeviceMismatchError) as info:
            sm.launch(k, 1, 1, *args)
        msg = str(info.value)
        assert msg.startswith(f"argument 1 (<Buffer float32 x 4 on <Device {on}")
        assert msg.endswith("; copy it there first (view.to_device(...))"), msg
        assert "enable_peer_access" not in msg
        with pytest.raises(sm.PeerAccessError):  # (what the old advice led to)
            args[0].device.enable_peer_access(args[1].device)
    assert sm.stats().submitted == before
    sm.synchronize()
