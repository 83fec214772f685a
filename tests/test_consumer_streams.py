"""The consumers' streams of an export that names none (CAI, DLPack ``stream=-1``): CuPy's and
torch's current streams read as raw handles, their stream objects borrowed only where sharedmem
has no Stream of the handle; and the by-handle table of Streams (weak references, read without
the lock) that finds them (fake driver)."""
import gc
import sys
import threading
import types
import weakref

import pytest

import sharedmem as sm
import sharedmem.stream as sms
import interop.streams as ist


@pytest.fixture
def fake(monkeypatch):
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, True)
    yield dev, drv
    gc.collect()
    sm.synchronize()


def _torch(monkeypatch, handle, initialized=True, raw=True):
    cur = types.SimpleNamespace(cuda_stream=handle)
    m = types.ModuleType("torch")
    m.asked = []

    def current_stream(index=None):
        m.asked.append("object")
        if not m.cuda.is_initialized():
            raise AssertionError("torch's CUDA initialized by sharedmem")
        return m.cur

    def raw_stream(index):
        m.asked.append("raw")
        if not m.cuda.is_initialized():
            raise AssertionError("torch's CUDA initialized by sharedmem")
        return m.cur.cuda_stream

    m.cur = cur
    m.cuda = types.SimpleNamespace(is_initialized=lambda: initialized,
                                   current_stream=current_stream)
    if raw:
        m._C = types.SimpleNamespace(_cuda_getCurrentRawStream=raw_stream)
    monkeypatch.setitem(sys.modules, "torch", m)
    return m


def test_torch_imported_not_initialized_is_never_asked(fake, monkeypatch):
    """torch imported, its CUDA not initialized: neither its raw-stream entry nor
    torch.cuda.current_stream is asked (either would initialize it)."""
    dev, drv = fake
    t = _torch(monkeypatch, 0x7002, initialized=False)
    s = dev.create_stream("x")
    assert ist.current_streams(dev) == [dev.default_stream]
    assert ist.consumer_stream(dev, s.handle) is s
    assert ist.consumer_stream(dev, 0x7002).handle == 0x7002
    buf = sm.Buffer.zeros(8, "float64", device=dev)
    cap = buf.__dlpack__(stream=-1)
    buf.__cuda_array_interface__
    assert t.asked == []
    del cap, buf


def test_torch_without_raw_entry_and_modules_replaced_between_calls(fake, monkeypatch):
    """torch's current stream read through ``torch._C._cuda_getCurrentRawStream``, its
    stream object asked only to borrow a stream sharedmem has no Stream of; a torch without
    that entry (a stand-in) through the object; a module replaced between calls is seen."""
    dev, drv = fake
    a = _torch(monkeypatch, 0x7002)
    assert [s.handle for s in ist.current_streams(dev)] == [0, 0x7002]
    b = _torch(monkeypatch, 0x7003, raw=False)  # (a stand-in without torch._C)
    assert [s.handle for s in ist.current_streams(dev)] == [0, 0x7003]
    assert b.asked == ["object", "object"]  # (the handle through the object; a miss: again)
    c = _torch(monkeypatch, 0x7004)
    assert [s.handle for s in ist.current_streams(dev)] == [0, 0x7004]
    assert c.asked == ["raw", "object"]


def test_by_handle_stays_bounded_and_finds_live_streams(fake):
    """Streams made and dropped by the thousand: the table drops dead entries as it grows
    (within 64 or twice the live ones at the last drop), and live Streams stay findable."""
    dev, drv = fake
    if not hasattr(sms, "_by_handle"):
        pytest.skip("compiled: the table is a C global")
    keep = [dev.create_stream(f"k{i}") for i in range(10)]
    for _ in range(20):
        tmp = [dev.create_stream("t") for _ in range(50)]
        del tmp
        gc.collect()
        sm.synchronize()
    live = sum(1 for r in sms._by_handle.values() if r() is not None)
    assert len(sms._by_handle) <= max(64, 2 * (live + 50)) + 1
    for s in keep:
        assert sm.Stream.lookup(dev, s.handle) is s
        assert sm.Stream.from_external(s.handle, dev) is s


def test_a_dead_entry_and_a_reused_handle_give_a_new_stream(fake):
    """A borrowed Stream collected: its handle finds nothing; the handle reused by another
    stream object gives a new Stream, found by handle too."""
    dev, drv = fake
    x = types.SimpleNamespace(ptr=0x7100)
    st = sm.Stream.from_external(x, dev)
    r = weakref.ref(st)
    del st
    gc.collect()
    assert r() is None
    assert sm.Stream.lookup(dev, 0x7100) is None
    y = types.SimpleNamespace(ptr=0x7100)  # (the handle reused by another stream)
    st2 = sm.Stream.from_external(y, dev)
    assert st2._external is y and sm.Stream.lookup(dev, 0x7100) is st2
    assert sm.Stream.from_external(0x7100, dev) is st2


def test_a_stale_borrow_is_replaced_when_its_handle_is_reused(fake):
    """A live Stream whose object no longer names its handle (its stream destroyed) is
    replaced when another object brings that handle."""
    dev, drv = fake
    x = types.SimpleNamespace(ptr=0x7200)
    old = sm.Stream.from_external(x, dev)
    x.ptr = 0x7201  # (x's stream destroyed: it names another now)
    y = types.SimpleNamespace(ptr=0x7200)
    new = sm.Stream.from_external(y, dev)
    assert new is not old and new._external is y
    assert sm.Stream.lookup(dev, 0x7200) is new


def test_current_stream_changed_between_handle_and_object(fake, monkeypatch):
    """A library whose current stream changes between the handle read and the object fetch
    (a stand-in with one global current stream, or foreign code run in between: CuPy's and
    torch's are per thread): the object -- the library's current stream now -- is borrowed,
    not the stale handle bare (which would shadow the object when it is current again, and
    an export's hold would no longer keep the object, and so its handle, alive)."""
    dev, drv = fake
    cp = sys.modules["cupy"]
    x = types.SimpleNamespace(ptr=0x7301)
    y = types.SimpleNamespace(ptr=0x7302)
    seq = [x, y]
    monkeypatch.setattr(cp.cuda, "get_current_stream",
                        lambda device_id=-1: seq.pop(0) if seq else x)
    first = ist.current_streams(dev)  # (handle of x read, y fetched)
    assert first[1]._external is y
    again = ist.current_streams(dev)  # (x current throughout now)
    assert again[1]._external is x, again[1]._external


def test_threads_borrow_one_stream_per_handle(fake):
    """8 threads borrowing the same 200 stream objects (and looking them up by handle) at a
    one-microsecond switch interval: one Stream per stream."""
    dev, drv = fake
    objs = [types.SimpleNamespace(ptr=0x8000 + i) for i in range(200)]
    out = [[] for _ in range(8)]
    errs = []

    def work(k):
        try:
            for o in objs:
                out[k].append(sm.Stream.from_external(o, dev))
                sm.Stream.lookup(dev, o.ptr)
        except BaseException as e:  # pragma: no cover
            errs.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        ts = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errs
    for k in range(1, 8):
        assert all(a is b for a, b in zip(out[0], out[k]))
