"""The boundary rules, in CI: holds of exports end stream-ordered, imports keep their
producer as an alias, declared uses are leased, moves retire finished work first.

The CUDA side runs on the fake driver (tests/fake_cuda.py) with events held pending, so
"the consumer's stream has not passed that point yet" is a state the test controls; the
real-GPU versions are in test_gpu_boundary.py.
"""

import gc
import itertools
import sys
import threading
import weakref

import numpy as np
import pytest

import sharedmem as sm
from sharedmem.runtime import submission as _sub

from conftest import gc_collect_harder

_keys = itertools.count()


@pytest.fixture
def fake(monkeypatch):
    import sharedmem.backends.cuda as bc
    from fake_cuda import CUresult, FakeDriver, fake_cupy
    drv = FakeDriver()
    monkeypatch.setattr(bc, "cu", drv)
    monkeypatch.setattr(bc, "_SUCCESS", CUresult.CUDA_SUCCESS)
    monkeypatch.setattr(bc, "_hot_driver", lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(drv))
    backend = bc.CudaBackend(0)
    dev = object.__new__(sm.Device)
    dev._setup("cuda", 0, backend.name, ("fake-boundary", next(_keys)), backend)
    yield dev, drv
    drv.holding = False
    drv.finish_held()
    sm.synchronize()
    del dev
    gc_collect_harder()


def _records_on(drv, handle, since=0):
    return [ev for op, ev, s in drv.calls[since:] if op == "record" and s == handle]


def _waits_of(drv, handle, since=0):
    return [ev for op, s, ev in drv.calls[since:] if op == "wait" and s == handle]


def test_dlpack_export_ends_stream_ordered_on_the_consumer_stream(fake):
    dev, drv = fake
    consumer = int(drv.cuStreamCreate(1)[1])
    t = sm.Tensor.from_host(np.arange(16, dtype=np.float32), device=dev)
    sm.synchronize()
    alloc = weakref.ref(t.allocation)
    cap = t.__dlpack__(stream=consumer, max_version=(1, 0))
    assert t.allocation.views()[1].startswith("DLPack export, bytes [0, 64)")
    drv.holding = True  # from here on, events stay pending: the consumer is still working
    del t  # the producer's handle goes first: the capsule keeps the memory
    gc_collect_harder()
    assert alloc() is not None and alloc().live_views == 1
    mark = len(drv.calls)
    del cap  # the consumer's hold ends (an unconsumed capsule runs the deleter)
    gc_collect_harder()
    # an event recorded on the consumer's stream at that point leases the bytes there
    assert len(_records_on(drv, consumer, mark)) == 1
    assert alloc() is not None and alloc().live_views == 0
    assert sm.stats().in_flight == 1
    sm.stats()  # a sweep: the consumer has not passed the event, nothing is released
    gc_collect_harder()
    assert alloc() is not None
    drv.finish_held()  # the consumer's stream passed the point
    sm.synchronize()
    gc_collect_harder()
    assert alloc() is None and sm.stats().in_flight == 0


def test_an_open_export_orders_later_launches_and_exports(fake):
    dev, drv = fake
    consumer = int(drv.cuStreamCreate(1)[1])
    a = dev.create_stream("A")
    t = sm.Tensor.from_host(np.zeros(8, np.float32), device=dev)
    sm.synchronize()
    cap = t.__dlpack__(stream=consumer, max_version=(1, 0))  # the consumer may write
    mark = len(drv.calls)
    with t.as_buffer() as b:
        b.fill_zero(stream=a)
    # the fill on A waited, on the device, for an event recorded on the consumer's stream now
    recorded = _records_on(drv, consumer, mark)
    assert len(recorded) == 1 and _waits_of(drv, a.handle, mark) == recorded
    # a second consumer, on another stream, is ordered after the first one's hold too
    other = int(drv.cuStreamCreate(1)[1])
    mark = len(drv.calls)
    cap2 = t.__dlpack__(stream=other, max_version=(1, 0))
    assert len(_records_on(drv, consumer, mark)) == 1
    assert _records_on(drv, consumer, mark)[0] in _waits_of(drv, other, mark)
    # under policy "reject" the hold is a conflict like unfinished work
    with t.as_buffer() as b:
        with pytest.raises(sm.AccessConflictError, match=r"a consumer on .* holds them \(may write\) "
                                                         r"\(policy 'reject'\)"):
            _reject_fill(b, a)
    del cap, cap2


def _reject_fill(b, stream):
    tok = b._live_token()
    backend, impl = stream.device.backend, stream._impl
    ptr, n = b.ptr, b.nbytes
    return _sub.submit(stream, [(tok, True)], lambda: backend.memset(impl, ptr, 0, n),
                       policy="reject", label="fill_zero")


def read_only_export(dev, drv):
    """A tensor of ``dev`` exported read-only through DLPack to a consumer on a stream of its
    own: ``(consumer stream handle, stream A, tensor, capsule)``."""
    consumer = int(drv.cuStreamCreate(1)[1])
    a = dev.create_stream("A")
    t = sm.Tensor.from_host(np.zeros(8, np.float32), device=dev)
    sm.synchronize()
    cap = t.as_readonly().__dlpack__(stream=consumer, max_version=(1, 0))
    return consumer, a, t, cap


def test_a_read_only_export_does_not_order_readers(fake):
    dev, drv = fake
    consumer, a, t, cap = read_only_export(dev, drv)
    out = sm.Buffer.empty(8, "float32", device=dev)
    mark = len(drv.calls)
    with t.as_buffer() as b:
        out.copy_from(b, stream=a)  # reads only: no order against a reading consumer
    assert _records_on(drv, consumer, mark) == []
    del cap


def test_cai_export_is_a_hold_until_the_object_dies(fake):
    dev, drv = fake
    t = sm.Tensor.from_host(np.arange(8, dtype=np.float32), device=dev)
    sm.synchronize()
    cai = t.__cuda_array_interface__
    assert cai["data"] == (t.ptr, False)
    with pytest.raises(sm.AliasError, match=r"  - CUDA Array Interface export \(it lasts as long "
                                            r"as the exported object\), bytes \[0, 32\)"):
        t.into_buffer()
    alloc = weakref.ref(t.allocation)
    t.release()  # a CAI consumer keeps the object, not the token: the hold stays
    assert alloc().live_views == 1
    drv.holding = True
    mark = len(drv.calls)
    del t
    gc_collect_harder()
    # conservative rule: the legacy default stream (no CuPy or torch stream is current here)
    assert len(_records_on(drv, 0, mark)) == 1
    assert alloc() is not None and alloc().live_views == 0
    drv.finish_held()
    sm.synchronize()
    gc_collect_harder()
    assert alloc() is None


def test_record_use_leases_now_and_orders_the_release(fake):
    dev, drv = fake
    foreign = int(drv.cuStreamCreate(1)[1])
    t = sm.Tensor.from_host(np.arange(8, dtype=np.float32), device=dev)
    sm.synchronize()
    alloc = weakref.ref(t.allocation)
    drv.holding = True
    mark = len(drv.calls)
    sm.record_use(t, foreign, writes=False)
    assert len(_records_on(drv, foreign, mark)) == 1  # leased until the foreign stream passes now
    assert sm.stats().in_flight == 1
    a = dev.create_stream("A")
    mark = len(drv.calls)
    with t.as_buffer() as b:
        b.fill_zero(stream=a)  # a write on A waits for the declared reader
    assert _waits_of(drv, a.handle, mark)
    mark = len(drv.calls)
    del t, b
    gc_collect_harder()
    assert len(_records_on(drv, foreign, mark)) == 1  # the release is ordered there too
    assert alloc() is not None
    drv.finish_held()
    sm.synchronize()
    gc_collect_harder()
    assert alloc() is None
    with pytest.raises(TypeError, match=r"^record_use takes a sharedmem view or an array with "
                                        r"__cuda_array_interface__, got int$"):
        sm.record_use(3, foreign)


def test_a_hold_whose_stream_cannot_record_keeps_the_memory(fake, monkeypatch):
    dev, drv = fake
    consumer = int(drv.cuStreamCreate(1)[1])
    t = sm.Tensor.from_host(np.arange(8, dtype=np.float32), device=dev)
    sm.synchronize()
    alloc = weakref.ref(t.allocation)
    cap = t.__dlpack__(stream=consumer, max_version=(1, 0))
    del t
    from fake_cuda import CUresult
    real = drv.cuEventRecord
    monkeypatch.setattr(drv, "cuEventRecord", lambda ev, s: (CUresult.CUDA_ERROR_INVALID_HANDLE,)
                        if int(s) == consumer else real(ev, s))
    before = sm.stats().leaked
    del cap  # the consumer's stream is gone: completion of its use cannot be known
    gc_collect_harder()
    with pytest.warns(sm.LeakWarning, match="is unknown"):
        st = sm.stats()
    assert st.leaked == before + 1 and st.leaked_bytes >= 32
    assert alloc() is not None  # kept, never freed


def test_bytes_leased_by_work_of_unknown_completion_cannot_be_exported(fake, monkeypatch):
    dev, drv = fake
    consumer = int(drv.cuStreamCreate(1)[1])
    other = int(drv.cuStreamCreate(1)[1])
    t = sm.Tensor.from_host(np.arange(8, dtype=np.float32), device=dev)
    sm.synchronize()
    kept = t[0:8]  # a view that outlives the export
    cap = t.__dlpack__(stream=consumer, max_version=(1, 0))
    del t
    from fake_cuda import CUresult
    real = drv.cuEventRecord
    monkeypatch.setattr(drv, "cuEventRecord", lambda ev, s: (CUresult.CUDA_ERROR_INVALID_HANDLE,)
                        if int(s) == consumer else real(ev, s))
    del cap  # its end's lease on `consumer`: completion unknown
    gc_collect_harder()
    with pytest.warns(sm.LeakWarning, match="is unknown"):
        sm.stats()
    alloc = kept.allocation
    views = alloc.live_views
    with pytest.raises(sm.CompletionUnknownError,
                       match=rf"^bytes \[0, 32\) of allocation #{alloc.id} are touched by work "
                             rf"of unknown completion on <Stream .*>; they cannot be exported$"):
        kept.__dlpack__(stream=other, max_version=(1, 0))
    assert alloc.live_views == views and kept.is_live  # no hold was taken
    with pytest.raises(sm.CompletionUnknownError, match=r"^to_host on .* would read bytes "
                                                        r"\[0, 32\) .*which work of unknown "
                                                        r"completion on .* writes"):
        kept.to_host()  # (and its contents cannot be trusted)


# -- the host backend ------------------------------------------------------------------------
def test_record_use_on_the_host_keeps_memory_under_foreign_work(host):
    s = host.create_stream("foreign")
    t = sm.Tensor.from_host(np.arange(64, dtype=np.float32), device=host)
    sm.synchronize()
    ptr = t.ptr
    gate, seen = threading.Event(), []

    def foreign_read():  # work a foreign library put on the stream, reading t's bytes later
        gate.wait(10)
        from sharedmem.backends.host import host_array
        seen.append(host_array(ptr, 256).view(np.float32).copy())

    s._impl.submit(foreign_read)
    sm.record_use(t, s, writes=False)
    del t
    gc_collect_harder()
    fresh = [sm.Buffer.empty(64, "float32", device=host) for _ in range(4)]  # churn the pool
    assert all(f.ptr != ptr for f in fresh)  # not handed out again under the foreign read
    for f in fresh:
        f.copy_from(np.full(64, -1, np.float32))
    gate.set()
    s.synchronize()
    np.testing.assert_array_equal(seen[0], np.arange(64, dtype=np.float32))


def test_a_move_retires_finished_work_before_it_reports_an_alias(host, monkeypatch):
    monkeypatch.setattr(host.backend, "on_progress", None)  # the retirer is not woken by the end
    s = host.create_stream()
    t = sm.Tensor.from_host(np.arange(8, dtype=np.float32), device=host)
    sm.synchronize()
    back = sm.from_dlpack(t)  # its capsule's export token lives as long as `back`'s keep
    gate = threading.Event()
    fut = sm.launch(sm.host_kernel(lambda x: gate.wait(10)), 1, 1, sm.In(back), stream=s)
    del back
    import time
    time.sleep(0.05)  # the retirer, woken by the submission, found it pending and went idle
    gate.set()
    fut._s.marker.wait()  # the work is done, but nobody retired it (usually)
    b = t.into_buffer()  # no AliasError from a submission that is only done
    assert b.is_live and fut.done()


def test_a_host_view_has_no_cuda_array_interface(host):
    """The property is an AttributeError on the host (hasattr() is False); interop.cai's public
    export_cai(view) of a host view returned a CUDA Array Interface dict naming a host address
    as device memory, and took a hold. Now a TypeError, and nothing held."""
    from interop.cai import export_cai
    t = sm.Tensor.from_host(np.arange(4, dtype=np.float32), device=host)
    assert not hasattr(t, "__cuda_array_interface__")
    with pytest.raises(TypeError, match=r"^export_cai\(<Tensor .*\): the CUDA Array Interface "
                                        r"describes CUDA memory, and this view is on "
                                        r"<Device host>; use np.from_dlpack\(view\) for a "
                                        r"zero-copy host array$"):
        export_cai(t)
    assert t.allocation.live_views == 1
    b = t.into_buffer()  # (no hold was taken: the move goes through)
    assert b.allocation.live_views == 1
