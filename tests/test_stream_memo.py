"""Stream.from_external's memo of the last borrowed foreign stream object, on the fake CUDA
driver: the same Stream while the object names the same handle, a new borrow when its handle
changes, an explicit device, threads, and nothing kept alive. The default device is patched
to the fake device (so these tests neither depend on nor pin the process default)."""
import os
import sys
import threading

import pytest

import sharedmem as sm  # noqa: E402
import sharedmem.device as smdev  # noqa: E402
from conftest import gc_collect_harder  # noqa: E402


@pytest.fixture
def fake2(monkeypatch):
    from fake_cuda import install_fake_devices
    devs, drv = install_fake_devices(monkeypatch, True, 2)
    monkeypatch.setattr(smdev, "_default", devs[0])
    yield devs, drv
    sm.synchronize()
    del devs
    gc_collect_harder()


class CupyStyle:
    def __init__(self, ptr):
        self.ptr = ptr


class Protocol:
    """An object whose __cuda_stream__ names whatever stream it stands for now."""
    def __init__(self, h):
        self.h = h

    def __cuda_stream__(self):
        return (0, self.h)


@pytest.mark.parametrize("make, rename", [
    (lambda: CupyStyle(0x7A11), lambda o: setattr(o, "ptr", 0x7A12)),  # .ptr re-set
    (lambda: Protocol(0x7A11), lambda o: setattr(o, "h", 0x7A12)),  # __cuda_stream__ changes
])
def test_a_changed_handle_is_read_again(fake2, make, rename):
    obj = make()
    s1 = sm.Stream.from_external(obj)
    assert s1.handle == 0x7A11
    rename(obj)
    s2 = sm.Stream.from_external(obj)
    assert s2.handle == 0x7A12, f"got the Stream of the old handle {s2.handle:#x}"


def test_device_argument_bypasses_and_does_not_poison(fake2):
    (d0, d1), _ = fake2
    obj = CupyStyle(0x6601)
    s0 = sm.Stream.from_external(obj)
    assert s0.device is d0
    s1 = sm.Stream.from_external(obj, device=d1)
    assert s1.device is d1 and s1 is not s0
    assert sm.Stream.from_external(obj) is s0
    assert sm.Stream.from_external(obj, d1) is s1
    assert sm.Stream.from_external(obj, 0) is s0 or sm.Stream.from_external(obj, 0).device.key != d0.key


def test_threads_alternating_objects(fake2):
    objs = [CupyStyle(0x9000 + i) for i in range(4)]
    keep = [sm.Stream.from_external(o) for o in objs]
    bad = []

    def run(k):
        for j in range(3000):
            o = objs[(j + k) % 4]
            st = sm.Stream.from_external(o)
            if st.handle != o.ptr or st._external is not o:
                bad.append((st.handle, o.ptr))

    ths = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not bad


def test_memo_keeps_nothing_alive(fake2):
    import weakref
    obj = CupyStyle(0x7B00)
    s = sm.Stream.from_external(obj)
    ws, wo = weakref.ref(s), weakref.ref(obj)
    del s, obj
    gc_collect_harder()
    assert ws() is None and wo() is None
