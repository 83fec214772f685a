"""interop.cupy on a real GPU: wrap, adopt, as_cupy, identity across moves."""

import os

import numpy as np
import pytest

import sharedmem as sm

from conftest import cuda_device, gc_collect_harder

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    if cuda_device() is None:
        pytest.skip("no usable CUDA GPU")
    import cupy
    return cupy


@pytest.fixture(scope="module")
def ic():
    import interop.cupy as ic
    return ic


def test_zero_copy_identity_through_every_handoff(cp, ic):
    arr = cp.arange(64, dtype=cp.float32)
    ptr = arr.data.ptr
    t = ic.wrap(arr)
    assert t.ptr == ptr and t.shape == (64,) and t.dtype == np.float32
    with pytest.raises(sm.AliasError, match=r"  - CuPy array \(shape \(64,\), float32\), bytes \[\d+, \d+\)"):
        t.into_buffer()
    del arr
    gc_collect_harder()
    b = t.into_buffer()
    assert b.ptr == ptr
    t2 = sm.Tensor.from_buffer(b, (8, 8))
    assert t2.ptr == ptr
    view = ic.as_cupy(t2)
    assert view.data.ptr == ptr and view.shape == (8, 8)
    np.testing.assert_array_equal(cp.asnumpy(view).ravel(), np.arange(64))
    with pytest.raises(sm.AliasError, match=r"  - CuPy array \(as_cupy\), bytes"):
        t2.into_buffer()
    view2 = view[2:4]  # a CuPy view of the export keeps the token too
    del view
    gc_collect_harder()
    with pytest.raises(sm.AliasError):
        t2.into_buffer()
    del view2
    gc_collect_harder()
    assert t2.into_buffer().ptr == ptr


def test_wrap_twice_is_one_allocation(cp, ic):
    arr = cp.ones((4, 4), cp.float64)
    t1, t2 = ic.wrap(arr), ic.wrap(arr[1:])
    assert t1.allocation is t2.allocation
    assert t2.ptr == arr.data.ptr + 32 and t2.strides == (4, 1)
    assert t1.allocation.source == "cupy"


def test_adopt(cp, ic):
    t = ic.adopt(cp.full(10, 3, cp.int32))  # a temporary: nobody else holds it
    assert t.to_host().tolist() == [3] * 10
    b = t.into_buffer()  # no alias: the array was adopted, not shared
    arr = cp.zeros(5)
    other = arr
    with pytest.raises(sm.AliasError, match=r"^cannot adopt CuPy array \(shape \(5,\), float64\): 1 other reference"):
        ic.adopt(arr)
    del other
    t2 = ic.adopt(arr)
    assert t2.ptr == arr.data.ptr
    base = cp.zeros(8)
    with pytest.raises(sm.AliasError, match="cannot adopt a view of another CuPy array"):
        ic.adopt(base[2:])
    assert b.is_live


def test_as_cupy_read_only_refused_for_out(cp, ic):
    import gpu_kernels as K
    t = sm.Tensor.from_host(np.ones(16, np.float32), device=cuda_device()).as_readonly()
    arr = ic.as_cupy(t)
    with pytest.raises(sm.KernelError, match="would write through a read-only view"):
        sm.launch(K.kernel("fill"), 1, 16, sm.Out(arr), 16, 2.0)
    out = cp.zeros(16, cp.float32)
    sm.launch(K.kernel("slow_copy"), 1, 16, sm.In(arr), out, 16, np.int64(0)).result()
    assert cp.asnumpy(out).tolist() == [1.0] * 16


def test_cupy_arrays_as_launch_arguments_get_leases(cp, ic):
    import gpu_kernels as K
    dev = cuda_device()
    a, b = dev.create_stream(), dev.create_stream()
    x = cp.zeros(1 << 16, cp.float32)
    out = cp.empty_like(x)
    cp.cuda.Device(0).synchronize()
    sm.launch(K.kernel("slow_fill"), 64, 256, x, x.size, 5.0, np.int64(K.cycles(20)), stream=a)
    # x is a plain CuPy array: wrapped on the fly, leased, and the reader on b is ordered
    sm.launch(K.kernel("slow_copy"), 64, 256, sm.In(x), sm.Out(out), x.size, np.int64(0),
              stream=b).result()
    assert float(out.min()) == 5.0 and float(out.max()) == 5.0
    alloc = sm.lookup_allocation(dev, x.data.ptr, x.nbytes)
    assert alloc is None or alloc.live_views == 0  # no alias lingers after the launch


def test_a_launch_of_cupy_arrays_is_ordered_after_cupys_current_stream(cp, ic):
    """CuPy writes an array on its current stream (the legacy default stream here, and then a
    non-blocking stream of its own), slowly; a launch reading it on a sharedmem stream
    (non-blocking: nothing orders the two but the launch's wait) sees what CuPy wrote; so does
    one on CuPy's current stream itself (ordered by the stream: no wait there, which
    test_cuda_backend_fake counts). Compiled, CuPy's current stream is read through CuPy's
    own C entry point (found in its ``__pyx_capi__``)."""
    import gpu_kernels as K
    import interop.streams as ist
    if sm.show_config(open(os.devnull, "w"))["core"].startswith("compiled"):
        assert ist.cupy_stream_entry(cp) != 0
    dev = cuda_device()
    s = dev.create_stream()
    n = 1 << 16
    x = cp.zeros(n, cp.float32)
    out = cp.zeros(n, cp.float32)
    cp.cuda.Device(0).synchronize()
    slow_fill = K.kernel("slow_fill")
    for value, theirs in ((3.0, None), (4.0, cp.cuda.Stream(non_blocking=True))):
        with theirs if theirs is not None else cp.cuda.Stream.null:
            slow_fill((64,), (256,), (x, np.int32(n), np.float32(value),
                                      np.int64(K.cycles(30))))  # CuPy's own launch
            sm.launch(K.kernel("slow_copy"), 64, 256, sm.In(x), sm.Out(out), n, np.int64(0),
                      stream=s).result()
        assert float(out.min()) == value and float(out.max()) == value
    on_theirs = sm.Stream.from_external(theirs, dev)
    with theirs:
        slow_fill((64,), (256,), (x, np.int32(n), np.float32(5.0), np.int64(K.cycles(30))))
        sm.launch(K.kernel("slow_copy"), 64, 256, sm.In(x), sm.Out(out), n, np.int64(0),
                  stream=on_theirs).result()  # (its own stream: ordered without a wait)
    assert float(out.min()) == 5.0 and float(out.max()) == 5.0


def test_a_replay_of_cupy_arrays_is_ordered_after_cupys_current_stream(cp, ic):
    """A graph captured a launch reading a CuPy array (on CuPy's current stream, as a capture
    of CuPy arrays must be); CuPy then writes the array on its current stream (a non-blocking
    stream of its own), slowly; a replay on a sharedmem stream sees what CuPy wrote: it is
    ordered after CuPy's current stream, as the launch itself would be."""
    import gpu_kernels as K
    dev = cuda_device()
    n = 1 << 16
    x = cp.zeros(n, cp.float32)
    out = cp.zeros(n, cp.float32)
    cp.cuda.Device(0).synchronize()
    cap, s = dev.create_stream(), dev.create_stream()
    from_external = getattr(cp.cuda.Stream, "from_external", None)  # (CuPy 13: ExternalStream)
    with from_external(cap) if from_external else cp.cuda.ExternalStream(cap.handle):
        with sm.capture(cap) as g:
            sm.launch(K.kernel("slow_copy"), 64, 256, sm.In(x), sm.Out(out), n, np.int64(0))
    theirs = cp.cuda.Stream(non_blocking=True)
    for value in (3.0, 4.0):
        with theirs:
            K.kernel("slow_fill")((64,), (256,), (x, np.int32(n), np.float32(value),
                                                  np.int64(K.cycles(30))))  # CuPy's own launch
            g.replay(s).result()
        assert float(out.min()) == value and float(out.max()) == value
    g.release()


def test_cupy_array_arguments_are_learned_once_and_kept_alive_by_the_launch(cp, ic):
    import gc
    import weakref

    import gpu_kernels as K
    import interop.cupy_launch as icl
    dev = cuda_device()
    s = dev.create_stream()
    y = cp.zeros(1 << 16, cp.float32)
    cp.cuda.Device(0).synchronize()
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(y), y.size, 1.0, np.int64(0), stream=s)
    facts = icl.learned_facts()[id(y)]
    token = facts.token
    assert facts.ref() is y and token.stop - token.start == y.nbytes
    # what a launch needs of the array is learned once: the second launch reuses it
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(y), y.size, 7.0, np.int64(K.cycles(500)),
              stream=s)
    assert icl.learned_facts()[id(y)] is facts
    ref = weakref.ref(y)
    del y  # (no gc.collect() here: with torch and JAX loaded a full collection can outlast
    # the kernel; the array has no cycles, so `del` frees it unless something keeps it)
    # the launch keeps the array (and so CuPy's memory) until its work is done
    assert ref() is not None and not s.record().query()
    s.synchronize()
    sm.synchronize()
    gc.collect()
    assert ref() is None
    table = icl.learned_facts()
    assert all(f.ref() is not None for f in table.values())  # its entry went with it
    assert facts not in table.values() and facts.dead  # (never taken for a new array)
    # and so did the recent-lookup slot that found it (compiled: it would keep the allocation)
    recent = icl.recent_facts()
    assert facts not in recent
    assert all(f is None or f.ref() is not None for f in recent)


def test_a_new_cupy_output_array_each_launch(cp, ic):
    """The pattern of a pipeline step: a new CuPy output array each launch (its memory new to
    sharedmem, imported, then let go with the array once the launch is done). Every output
    holds what its launch wrote while the next launches run, and once they are done and the
    arrays dropped, no allocation or facts of theirs are left."""
    import gc

    import gpu_kernels as K
    import interop.cupy_launch as icl
    dev = cuda_device()
    s = dev.create_stream()
    cp.cuda.Device(0).synchronize()
    sm.synchronize()
    gc.collect()
    live = sm.allocation.live_allocation_count()
    facts = len(icl.learned_facts())
    outs = []
    for i in range(200):
        out = cp.empty(1 << 12, cp.float32)
        sm.launch(K.kernel("slow_fill"), 16, 256, sm.Out(out), out.size, float(i), np.int64(0),
                  stream=s)
        if i % 40 == 0:
            outs.append((i, out))  # (kept: the rest are dropped at once, in flight)
    s.synchronize()
    for i, out in outs:
        assert float(out.min()) == i and float(out.max()) == i
    del out, outs
    sm.synchronize()
    gc.collect()
    assert sm.allocation.live_allocation_count() == live
    assert len(icl.learned_facts()) == facts


def test_as_cupy_orders_the_consumer_stream(cp, ic):
    import gpu_kernels as K
    dev = cuda_device()
    s = dev.create_stream()
    n = 1 << 18
    t = sm.Buffer.zeros(n, "float32", device=dev, stream=s)
    sm.launch(K.kernel("slow_fill"), 64, 256, sm.Out(t), n, 4.0, np.int64(K.cycles(30)), stream=s)
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        arr = ic.as_cupy(t, stream=consumer)
        total = float(arr.sum())  # runs on the consumer stream right away
    assert total == 4.0 * n


def test_a_new_buffer_never_takes_the_block_a_cupy_array_just_freed(cp):
    """CuPy's pool gives a block a CuPy array freed to the next allocation on the current
    stream at once (its kernels there may still read it: ordered for CuPy's next kernel on
    that stream, not for sharedmem's on its own). sharedmem's buffers come from an arena of
    their own."""
    dev = cuda_device()
    s = dev.create_stream("arena")
    for stream in (None, cp.cuda.Stream(non_blocking=True)):
        with stream if stream is not None else cp.cuda.Device(dev.ordinal):
            x = cp.empty(1 << 18, dtype=cp.float32)  # (CuPy's current stream's arena)
            ptr = x.data.ptr
            del x
            b = sm.Buffer.empty(1 << 18, "float32", device=dev, stream=s)
            assert b.ptr != ptr
            y = cp.empty(1 << 18, dtype=cp.float32)
            assert y.data.ptr == ptr  # (CuPy itself takes it again, on its stream)
            del y
        b.release()
    sm.synchronize()
