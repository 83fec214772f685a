"""sharedmem.ipc over the fake driver: the importer is simulated in this process (a handle
whose exporter pid is the parent's, mappings of fresh memory), so what is tested is the slot
bookkeeping -- who may end an export or an import, and when -- not shared bytes."""

import gc
import os
import pickle
import time

import numpy as np
import pytest

import sharedmem as sm
import sharedmem.ipc as ipc
from conftest import gc_collect_harder


@pytest.fixture
def fake(monkeypatch):
    import collections

    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, False)
    monkeypatch.setattr(ipc, "_by_uuid", {dev.uuid: dev})
    monkeypatch.setattr(ipc, "_recent", collections.OrderedDict())
    monkeypatch.setattr(ipc, "_events", collections.OrderedDict())
    monkeypatch.setattr(ipc, "_opened", {})  # (each test's "exporter" is another process)
    yield dev, drv
    sm.synchronize()
    gc_collect_harder()


def _exported(dev, drv, n=256):
    b = sm.Buffer.from_host(np.arange(n, dtype=np.float32), device=dev)
    alloc = b.allocation
    drv.ranges[alloc.ptr] = alloc.nbytes  # (the driver knows it as an allocation)
    return b, ipc.export(b)


def _as_received(handle):
    """The handle as the importing process gets it: pickled, from another process (the
    parent of this one: alive)."""
    h = pickle.loads(pickle.dumps(handle))
    h.exporter_pid = os.getppid()
    return h


def _state_after_polls(ex):
    time.sleep(ipc.POLL * 5)
    return ex.state


def _released(ex) -> bool:
    """Whether ``ex`` ends once the import's views (dropped by the caller) are collected and
    their work is done."""
    gc_collect_harder()
    sm.synchronize()
    return ex.wait_released(5) and ex.state == "released"


def test_an_import_ends_the_export_once_its_views_and_work_are_done(fake):
    dev, drv = fake
    b, ex = _exported(dev, drv)
    v = ipc.open(_as_received(ex.handle))
    assert isinstance(v, sm.Buffer) and len(v) == 256 and v.dtype == np.float32
    assert _state_after_polls(ex) == "open" and not ex.wait_released(0)
    assert [c[0] for c in drv.calls if c[0] == "ipc_open"] == ["ipc_open"]
    del v
    assert _released(ex) and ipc.exports() == 0


def test_an_open_that_failed_does_not_end_the_open_that_succeeded_after_it(fake):
    """An open that fails after it made its import record, whose error is kept (logged,
    stored in a future) while the caller opens the handle again: dropping the error later
    must not release the second, successful import -- the exporter would let its memory go
    while this process maps it."""
    dev, drv = fake
    b, ex = _exported(dev, drv)
    h = _as_received(ex.handle)
    with pytest.raises(TypeError) as failed:
        ipc.open(h, stream="not a stream")
    v = ipc.open(h)  # the retry succeeds
    assert _state_after_polls(ex) == "open"
    del failed  # (its traceback held the first attempt's frame)
    gc_collect_harder()
    assert _state_after_polls(ex) == "open" and v.is_live
    del v
    assert _released(ex)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_dropping_an_imported_view_does_not_end_the_parents_import(fake):
    dev, drv = fake
    b, ex = _exported(dev, drv)
    held = [ipc.open(_as_received(ex.handle))]
    assert _state_after_polls(ex) == "open"
    pid = os.fork()
    if pid == 0:  # the child drops the view it inherited
        held.clear()
        gc.collect()
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert _state_after_polls(ex) == "open" and held[0].is_live
    held.clear()
    assert _released(ex)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_an_export_is_revoked_or_waited_for_only_in_the_process_that_made_it(fake):
    dev, drv = fake
    b, ex = _exported(dev, drv)
    pid = os.fork()
    if pid == 0:
        code = 0
        for call in (ex.revoke, lambda: ex.wait_released(0)):
            try:
                call()
                code = 3
            except sm.SharedMemError as e:
                if "the export belongs to process" not in str(e):
                    code = 4
        os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert ex.state == "exported"  # the child changed nothing: the export still opens
    v = ipc.open(_as_received(ex.handle))
    assert _state_after_polls(ex) == "open"
    del v
    assert _released(ex)


def test_revoke_ends_an_export_nobody_opened(fake):
    dev, drv = fake
    b, ex = _exported(dev, drv)
    assert ex.revoke() and ex.state == "revoked" and ex.wait_released(0)
    with pytest.raises(sm.SharedMemError, match="the export ended"):
        ipc.open(_as_received(ex.handle))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_an_importer_closes_the_slot_file_of_an_exporter_seen_gone(fake, monkeypatch):
    """The importer keeps each exporter's slot file open while it lives; once the exporter is
    gone and no import of its slots is left, the descriptor and the mapping are closed (they
    were kept for good: one descriptor per exporter ever seen)."""
    dev, drv = fake
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # (a pid that is gone: the exporter, as this importer sees it)
    b, ex = _exported(dev, drv)
    h = _as_received(ex.handle)
    h.exporter_pid = pid
    v = ipc.open(h)
    fd = v._live_token().keep.file.fd  # (the import's slot file)
    monkeypatch.setattr(ipc, "_swept", [0.0])
    with ipc._opened_lock:
        ipc._forget_dead_exporters_locked()  # forgotten: its import still keeps it open
    assert h.slots not in ipc._opened
    os.fstat(fd)
    del v
    assert _released(ex)  # the import wrote its release before the file closed
    with pytest.raises(OSError):
        os.fstat(fd)
