"""sharedmem.ipc over the fake driver: the importer is simulated in this process (a handle
whose exporter pid is the parent's, mappings of fresh memory), so what is tested is the slot
bookkeeping -- who may end an export or an import, and when -- not shared bytes."""

import errno
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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_closes_its_copies_of_the_slot_files(fake):
    dev, drv = fake
    b, ex = _exported(dev, drv)
    path = ex.handle.slots

    def slot_fds():
        return [fd for fd in os.listdir("/proc/self/fd")
                if os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(path)]

    mine = len(slot_fds())  # (the exporter's descriptor and its mapping's, and the simulated
    r, w = os.pipe()        # importer's where an earlier test opened this file)
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, str(len(slot_fds())).encode())
        os._exit(0)
    os.close(w)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert int(os.read(r, 16)) == mine - 2  # the exporter's two, closed there
    os.close(r)
    assert len(slot_fds()) == mine and os.path.exists(path)  # the parent's are its own
    assert ex.revoke()


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
    alive = ipc._alive
    ipc._alive = lambda p, start: True  # (it was alive when opened: it died since)
    try:
        v = ipc.open(h)
    finally:
        ipc._alive = alive
    fd = v._live_token().keep.file.fd  # (the import's slot file)
    monkeypatch.setattr(ipc, "_swept", [0.0])
    with ipc._opened_lock:
        ipc._forget_dead_exporters_locked()  # forgotten: its import still keeps it open
    assert h.slots not in ipc._opened
    was = os.fstat(fd)
    del v
    assert _released(ex)  # the import wrote its release before the file closed
    # closed: the descriptor is gone -- or its number was given to a file another thread
    # opened since (the GPU machines' threads do: fstat then found some other file)
    try:
        now = os.fstat(fd)
    except OSError:
        return
    assert (now.st_dev, now.st_ino) != (was.st_dev, was.st_ino), "the slot file is still open"


def test_an_import_is_ordered_before_use_on_every_stream(fake):
    # (as DLPack and CAI imports: the arrival is a write on the opening stream, so a copy on
    # another stream waits for it -- and so for the exporter's writes)
    dev, drv = fake
    b, ex = _exported(dev, drv)
    a, other = dev.create_stream("open"), dev.create_stream("other")
    v = ipc.open(_as_received(ex.handle), stream=a)
    n = len(drv.calls)
    dst = sm.Buffer.empty(len(v), "float32", device=dev, stream=other)
    dst.copy_from(v, stream=other)
    assert any(c[0] == "wait" and c[1] == other.handle for c in drv.calls[n:])
    del v, dst
    assert _released(ex)


def test_revoke_after_a_release_and_a_failed_open_say_what_happened(fake):
    dev, drv = fake
    b, ex = _exported(dev, drv)
    h = _as_received(ex.handle)
    with pytest.raises(TypeError):
        ipc.open(h, stream="not a stream")  # an open that failed: the export is as it was
    assert _state_after_polls(ex) == "exported"
    v = ipc.open(h)
    assert _state_after_polls(ex) == "open" and ex.revoke() is False
    del v
    assert _released(ex)
    assert ex.revoke() is False and ex.state == "released"  # (it was opened, not revoked)
    b2, ex2 = _exported(dev, drv)
    assert ex2.revoke() is True and ex2.revoke() is True


def test_an_export_pickles_not_but_says_to_send_its_handle(fake):
    dev, drv = fake
    b, ex = _exported(dev, drv)
    with pytest.raises(TypeError, match=r"^cannot pickle <IpcExport exported: .*>: an export "
                                        r"stays with its exporter; send its handle \(ex\.handle\)"):
        pickle.dumps(ex)
    assert ex.revoke()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_gone_exporters_handle_and_files(fake, tmp_path, monkeypatch):
    dev, drv = fake
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a pid that is gone
    b, ex = _exported(dev, drv)
    h = _as_received(ex.handle)
    h.exporter_pid = pid
    with pytest.raises(sm.SharedMemError, match=rf"^cannot open <IpcHandle .*>: its exporter "
                                                rf"\(pid {pid}\) is gone, and its memory with it$"):
        ipc.open(h)
    assert ex.revoke()  # (untouched by the refused open)
    # a killed exporter's slot files go when a process of the host next exports
    stale = tmp_path / f"sharedmem-ipc-{pid}-abc"
    live = tmp_path / f"sharedmem-ipc-{os.getpid()}-abc"
    other = tmp_path / "sharedmem-ipc-notes"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    ipc._remove_dead_files(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists()


def test_what_cannot_be_exported_or_opened_is_refused_with_nothing_made(fake):
    """An export of host memory is a BackendUnavailableError (pickle it instead), of memory
    the driver does not know as an allocation a SharedMemError -- neither takes a token or a
    slot. ``open`` takes an IpcHandle only (TypeError) and refuses one this process exported."""
    dev, drv = fake
    h = sm.Buffer.zeros(4, device=sm.Device.host())
    with pytest.raises(sm.BackendUnavailableError, match=r"^CUDA IPC shares CUDA device memory; "
                                                         r"<Buffer float32 x 4 on <Device host>.* "
                                                         r"is on <Device host> \(pickle it instead"):
        ipc.export(h)
    b = sm.Buffer.zeros(4, device=dev)
    with pytest.raises(sm.SharedMemError, match=r"^cannot export <Buffer float32 x 4 on <Device "
                                                r"cuda:0 Fake GPU>.* by CUDA IPC: the driver "
                                                r"does not know its memory as a device "
                                                r"allocation$"):
        ipc.export(b)
    assert ipc.exports() == 0 and h.allocation.live_views == 1 and b.allocation.live_views == 1
    with pytest.raises(TypeError, match=r"^sm\.ipc\.open takes an IpcHandle \(IpcExport\.handle\), "
                                        r"got int$"):
        ipc.open(5)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    ex = ipc.export(b)
    with pytest.raises(sm.SharedMemError, match=r"^<IpcHandle buffer <f4 shape=\(4,\) .* was "
                                                r"exported by this process: use the view itself"):
        ipc.open(ex.handle)
    assert ex.state == "exported" and not [c for c in drv.calls if c[0] == "ipc_open"]
    assert ex.revoke() is True and ipc.exports() == 0


def test_a_tensor_view_travels_as_a_tensor_of_its_own_layout(fake):
    """A strided Tensor view (every other row of an 8x8 tensor) is exported as a tensor: the
    import is a Tensor of the same dtype, shape and element strides, whose element 0 lies as
    far into the mapping as the view's lies into its allocation, leasing the view's bytes
    only; its end ends the export."""
    dev, drv = fake
    t = sm.Tensor.from_host(np.arange(64, dtype=np.float32).reshape(8, 8), device=dev)
    drv.ranges[t.allocation.ptr] = t.allocation.nbytes
    v = t[2:7:2]  # rows 2, 4 and 6: bytes [64, 224) of the allocation
    ex = ipc.export(v)
    h = ex.handle
    assert (h.kind, h.dtype, h.shape, h.strides) == ("tensor", "<f4", (3, 8), (16, 1))
    assert (h.nbytes, h.first, h.offset, h.region, h.writable) == (160, 0, 64, (0, 256), True)
    w = ipc.open(_as_received(h))
    assert type(w) is sm.Tensor and w.dtype == np.float32 and not w.readonly
    assert (w.shape, w.strides, w.is_contiguous()) == ((3, 8), (16, 1), False)
    a = w.allocation
    assert a is not t.allocation and a.device is dev and a.nbytes == 256
    assert w.ptr - a.ptr == 64 and a.ptr in drv.ipc_maps
    tok = w._live_token()
    assert (tok.start, tok.stop, a.live_views) == (64, 224, 1)
    assert _state_after_polls(ex) == "open" and t.allocation.live_views == 3  # t, v, the export
    del w, tok
    assert _released(ex) and ipc.exports() == 0 and t.allocation.live_views == 2


def test_an_export_whose_work_cannot_be_enqueued_leaves_nothing_behind(fake, monkeypatch):
    """An export whose ordering fails -- the driver refuses to record its event (CudaError)
    -- raises that error and leaves nothing: no export, no view token, no slot, no lease, no
    submission; its interprocess event goes back to the pool and serves the next export."""
    from fake_cuda import CUresult
    dev, drv = fake
    b = sm.Buffer.from_host(np.arange(16, dtype=np.float32), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    sm.synchronize()
    before, pooled = sm.stats(), list(dev.backend._ipc_events)
    record = drv.cuEventRecord
    monkeypatch.setattr(drv, "cuEventRecord",
                        lambda ev, s: (CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(sm.CudaError, match=r"^cuEventRecord failed: CUDA_ERROR_INVALID_VALUE "
                                           r"\(1\)$") as ei:
        ipc.export(b)
    assert ei.value.code == 1
    monkeypatch.setattr(drv, "cuEventRecord", record)
    assert ipc.exports() == 0 and b.allocation.live_views == 1 and not b.allocation.tracker
    assert sm.stats() == before
    (pair,) = [p for p in dev.backend._ipc_events if p not in pooled]  # back in the pool
    ex = ipc.export(b)  # the pooled event serves the next export
    assert ex.handle.event == pair[1] and pair not in dev.backend._ipc_events
    assert ex.revoke() is True and ipc.exports() == 0 and b.allocation.live_views == 1


def test_an_export_or_open_on_a_capturing_stream_is_a_capture_error(fake):
    """An export's event marks the writes pending at export, and an open's wait orders the
    importer after them: neither can be recorded into a graph (the event would be recorded
    only at replay -- each replay re-recording it, pooled for later exports -- and the
    import's arrival would order nothing now). CaptureError, with nothing exported, opened or
    captured: the capture goes on and the export / handle stays usable after it."""
    dev, drv = fake
    b, ex = _exported(dev, drv)
    h = _as_received(ex.handle)
    s = dev.create_stream("capturing")
    views = b.allocation.live_views
    with sm.capture(s) as g:
        with pytest.raises(sm.CaptureError, match=r"^cannot export <Buffer float32 x 256 .* by "
                                                  r"CUDA IPC on <Stream capturing .*>: it is "
                                                  r"capturing a graph"):
            ipc.export(b)
        with pytest.raises(sm.CaptureError, match=r"^cannot open <IpcHandle buffer .* on "
                                                  r"<Stream capturing .*>: it is capturing a "
                                                  r"graph"):
            ipc.open(h)
        assert g.launches == 0 and ipc.exports() == 1 and b.allocation.live_views == views
    assert g.launches == 0 and b.allocation.live_views == views
    assert _state_after_polls(ex) == "exported"
    g.release()
    v = ipc.open(h, stream=s)  # the capture over: the handle opens
    assert _state_after_polls(ex) == "open"
    del v
    assert _released(ex) and ipc.exports() == 0


def test_an_export_whose_stream_begins_capturing_meanwhile_is_a_capture_error(fake, monkeypatch):
    """The capture check is made again under the core lock, where the export's work is
    enqueued: a capture another thread begins on the stream after export() looked (here,
    while the export takes its interprocess event) does not get the export's event recorded
    into the graph -- CaptureError, nothing exported, the event back in the pool."""
    from sharedmem.config import compiled
    if compiled():  # (ipc.py itself is never compiled: the interpreted run tests it)
        pytest.skip("the compiled backend's methods cannot be patched on an instance")
    dev, drv = fake
    b = sm.Buffer.from_host(np.arange(16, dtype=np.float32), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    sm.synchronize()
    s = dev.create_stream("captured meanwhile")
    backend = dev.backend
    take = backend.ipc_event
    cm = sm.capture(s)
    got = []

    def take_then_capture():
        pair = take()
        got.append(pair)
        got.append(cm.__enter__())  # (as another thread would, between the check and submit)
        return pair

    monkeypatch.setattr(backend, "ipc_event", take_then_capture)
    views = b.allocation.live_views
    try:
        with pytest.raises(sm.CaptureError, match=r"^cannot export <Buffer float32 x 16 .* by "
                                                  r"CUDA IPC on <Stream captured meanwhile .*>: "
                                                  r"it is capturing a graph"):
            ipc.export(b, stream=s)
    finally:
        if len(got) == 2:
            cm.__exit__(None, None, None)
    pair, g = got
    assert g.launches == 0 and ipc.exports() == 0 and b.allocation.live_views == views
    assert pair in backend._ipc_events  # (back in the pool)
    g.release()


def test_an_open_whose_stream_begins_capturing_meanwhile_is_a_capture_error(fake, monkeypatch):
    """open() checks the capture again under the core lock, where it makes the stream wait for
    the exporter's writes: a capture begun on the stream after open() looked is refused
    (CaptureError) before the wait is made or the arrival recorded into the graph; the slot
    is put back and the handle opens after the capture."""
    dev, drv = fake
    b, ex = _exported(dev, drv)
    h = _as_received(ex.handle)
    s = dev.create_stream("captured meanwhile")
    cm = sm.capture(s)
    got = []
    real = ipc.locked

    def capture_then_lock():
        if not got:
            got.append(cm.__enter__())  # (as another thread would, after open() looked)
        return real()

    monkeypatch.setattr(ipc, "locked", capture_then_lock)
    n = len(drv.calls)
    try:
        with pytest.raises(sm.CaptureError, match=r"^cannot open <IpcHandle buffer .* on "
                                                  r"<Stream captured meanwhile .*>: it is "
                                                  r"capturing a graph"):
            ipc.open(h, stream=s)
    finally:
        if got:
            cm.__exit__(None, None, None)
    monkeypatch.setattr(ipc, "locked", real)
    (g,) = got
    assert g.launches == 0 and not [c for c in drv.calls[n:] if c[0] == "wait"]
    assert _state_after_polls(ex) == "exported"
    g.release()
    v = ipc.open(h, stream=s)
    assert _state_after_polls(ex) == "open"
    del v
    assert _released(ex) and ipc.exports() == 0


def test_an_export_orders_after_pending_writes_under_policy_reject_too(fake):
    """The export "is ordered after every pending write to the bytes, on any stream", as
    DLPack and CAI exports are whatever the policy: under the process policy "reject" an
    export while another stream still wrote the bytes raised AccessConflictError (errors.md:
    a launch's error). It is made, its stream waiting on the device for the write."""
    dev, drv = fake
    b = sm.Buffer.from_host(np.arange(256, dtype=np.float32), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    w = dev.create_stream()
    sm.synchronize()
    drv.holding = True
    b.fill_zero(stream=w)  # a write still running on w
    waits = sum(1 for c in drv.calls if c[0] == "wait")
    sm.set_access_policy("reject")
    try:
        ex = ipc.export(b)
    finally:
        sm.set_access_policy("order")
        drv.finish_held()
    assert ex.state == "exported"
    assert sum(1 for c in drv.calls if c[0] == "wait") == waits + 1  # ordered after the write
    assert ex.revoke()


def test_an_open_during_the_close_of_its_mapping_maps_the_handle_anew(fake):
    """The last import of a mapping ends on one thread (the mapping is closed: a driver call,
    the GIL let go) while another thread opens an export of the same driver allocation: the
    open must not take the mapping being closed (its import would use unmapped memory), but
    map the handle again."""
    import threading
    dev, drv = fake
    b, ex1 = _exported(dev, drv)
    ex2 = ipc.export(b)  # (the same driver allocation: the same mem handle)
    v1 = ipc.open(_as_received(ex1.handle))
    sm.synchronize()
    gc_collect_harder()
    ipc._recent.clear()  # (evicted from the cache: the import alone keeps the mapping)
    closing = threading.Event()
    close = drv.cuIpcCloseMemHandle

    def slow_close(base):
        closing.set()
        time.sleep(0.3)
        return close(base)

    drv.cuIpcCloseMemHandle = slow_close
    held = [v1]
    del v1

    def drop():
        held.clear()
        sm.synchronize()
        gc_collect_harder()

    t = threading.Thread(target=drop)
    t.start()
    try:
        assert closing.wait(5)
        v2 = ipc.open(_as_received(ex2.handle))  # during the close
    finally:
        t.join()
    assert v2.is_live and v2.allocation.ptr in drv.ipc_maps  # still mapped
    del v2
    assert _released(ex2) and _released(ex1)


def test_a_finalizer_calling_ipc_inside_its_locked_section_raises_instead_of_deadlocking(fake):
    """A collection inside an IPC locked section (they allocate) may run a user's finalizer
    that revokes, exports or opens on the same thread (a wrapper that ends its export when
    dropped): SharedMemError, the export unchanged -- never a deadlock of this thread, and
    with it of the poller and every later export, which wait for the same lock."""
    dev, drv = fake
    b, ex = _exported(dev, drv)
    finalizer = r"^sharedmem was called from a finalizer .* interrupted {} on the same thread"
    books, opening = "an IPC export's bookkeeping", "the opening of a CUDA IPC handle"
    with ipc._lock:  # (the section a collection interrupted, as the finalizer finds it)
        with pytest.raises(sm.SharedMemError, match=finalizer.format(books)):
            ex.revoke()
        with pytest.raises(sm.SharedMemError, match=finalizer.format(books)):
            ipc.export(b)
    assert ex.state == "exported" and ipc.exports() == 1
    with ipc._opened_lock:
        with pytest.raises(sm.SharedMemError, match=finalizer.format(opening)):
            ipc.open(_as_received(ex.handle))
    assert ex.state == "exported" and ex.revoke() and ipc.exports() == 0


def test_an_empty_view_at_the_end_of_its_allocation_exports_its_own_allocation(fake):
    """``b[n:]`` starts one past its allocation's last byte: the export asks the driver about
    the allocation's own address, not that one (unknown memory, or the next allocation's)."""
    dev, drv = fake
    b = sm.Buffer.from_host(np.arange(256, dtype=np.float32), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    drv.ranges[b.allocation.ptr + b.allocation.nbytes] = 4096  # the next driver allocation
    ex = ipc.export(b[256:])
    mine = ipc.export(b)
    assert ex.handle.mem == mine.handle.mem and ex.handle.nbytes == 0
    assert ex.handle.offset == b.allocation.nbytes
    v = ipc.open(_as_received(ex.handle))
    assert v.shape == (0,) and v.to_host().tolist() == []
    del v
    assert _released(ex) and mine.revoke()


def _with(handle, **fields):
    h = pickle.loads(pickle.dumps(handle))
    for k, v in fields.items():
        setattr(h, k, v)
    return h


@pytest.mark.parametrize("fields", [
    {"dtype": "not a dtype"},          # np.dtype raised TypeError after the import was armed
    {"dtype": "<f8"},                  # 256 doubles over 1024 shared bytes
    {"shape": (10**6,)},               # a Buffer of 4 MB over 1 KiB
    {"kind": "tensor", "shape": (16, 16), "strides": (64, 1)},  # rows far past the bytes
    {"nbytes": 1 << 20},               # past the end of the mapped region
    {"offset": 4096},                  # the shared bytes outside the region
    {"slot": ipc.SLOTS + 3},           # past the slot file (struct.error)
    {"kind": "array"},
])
def test_a_corrupt_handle_is_refused_before_anything_is_opened(fake, fields):
    """A handle whose layout does not fit the bytes it shares is a SharedMemError, raised
    before the slot is touched or anything mapped: no view reaches past the mapping (the
    copy below read and wrote outside it: a segfault on the fake driver, an illegal address
    on a GPU), and the export still opens with its real handle."""
    dev, drv = fake
    b, ex = _exported(dev, drv)
    good = _as_received(ex.handle)
    maps = len(drv.ipc_maps)
    with pytest.raises(sm.SharedMemError, match=r"^cannot open <IpcHandle .*>: it is corrupt"):
        ipc.open(_with(good, **fields))
    assert len(drv.ipc_maps) == maps and _state_after_polls(ex) == "exported"
    v = ipc.open(good)  # the export was left as it was
    assert len(v) == 256 and v.to_host().size == 256
    del v
    assert _released(ex)


def test_a_handle_naming_another_file_as_its_slots_leaves_that_file_alone(fake, tmp_path):
    dev, drv = fake
    b, ex = _exported(dev, drv)
    victim = tmp_path / "notes.bin"
    victim.write_bytes(bytes(range(256)) * 16)
    h = _with(_as_received(ex.handle), slots=str(victim), slot=0)
    with pytest.raises(sm.SharedMemError, match=r"^cannot open <IpcHandle .*>: it is corrupt"):
        ipc.open(h)
    assert victim.read_bytes() == bytes(range(256)) * 16
    assert ex.revoke()


def test_a_handle_of_another_layout_says_so_when_unpickled(fake):
    """A handle pickled by a sharedmem with other IpcHandle fields (fewer here) unpickled
    into a handle with attributes missing: its repr and open() raised AttributeError."""
    dev, drv = fake
    b, ex = _exported(dev, drv)
    fn, (values, *rest) = ex.handle.__reduce__()
    with pytest.raises(sm.SharedMemError, match=r"another version of sharedmem"):
        fn(values[:-2], *rest)
    assert ex.revoke()


def test_an_export_whose_slot_file_finds_no_space_raises_and_leaves_no_file(fake, monkeypatch,
                                                                             tmp_path):
    """/dev/shm full (a container's 64 MB, filled by other processes): the slot file was
    made with ftruncate -- a sparse tmpfs file -- and its first write through the mapping
    killed the process with SIGBUS. Simulated here by a file system that has no room for
    the file's blocks: writes raise ENOSPC."""
    dev, drv = fake
    monkeypatch.setattr(ipc, "_dir", lambda: str(tmp_path))
    monkeypatch.setattr(ipc, "_files", [])
    monkeypatch.setattr(ipc, "_free", [])
    real_write = os.write

    def full(fd, data):
        if os.fstat(fd).st_size == 0 and os.readlink(f"/proc/self/fd/{fd}").startswith(
                str(tmp_path)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    monkeypatch.setattr(os, "ftruncate", lambda fd, n: (_ for _ in ()).throw(
        AssertionError("a sparse slot file: its first store faults when the fs is full")))
    b = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=dev)
    drv.ranges[b.allocation.ptr] = b.allocation.nbytes
    with pytest.raises(OSError) as ei:
        ipc.export(b)
    assert ei.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == [] and ipc.exports() == 0 and b.allocation.live_views == 1


def test_an_open_raises_other_works_deferred_error_before_it_consumes_the_handle(fake):
    """An error a callback of other work raised is re-raised "as the next API call begins,
    never between its parts". open() re-raised it from its last part -- the arrival's
    submission, after the slot was opened and the import made: the import was dropped with
    the error, which ended the export (the exporter saw the handle opened and released) and
    the handle could not be opened again. Now it is raised before the slot is touched, and
    an open that fails at the arrival puts the slot back, as any failed open does."""
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    b, ex = _exported(dev, drv)
    h = _as_received(ex.handle)
    RUNTIME.errors.append(ZeroDivisionError("a then() function of other work"))
    with pytest.raises(ZeroDivisionError, match=r"^a then\(\) function of other work$"):
        ipc.open(h)
    gc_collect_harder()
    assert _state_after_polls(ex) == "exported" and not ex.wait_released(0)
    v = ipc.open(h)  # the handle opens: nothing of it was consumed
    assert v.is_live and _state_after_polls(ex) == "open"
    del v
    assert _released(ex) and ipc.exports() == 0


def test_an_open_whose_arrival_cannot_be_recorded_puts_the_slot_back(fake, monkeypatch):
    """The arrival is the last part of an open: when its submission fails (here the retirer
    thread cannot start), the open raises with nothing consumed -- the slot back to
    "exported", the import not armed -- and the handle opens again."""
    from sharedmem.runtime import retirer
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    b, ex = _exported(dev, drv)
    h = _as_received(ex.handle)
    sm.synchronize()

    def cannot_start():
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(RUNTIME, "retirer_running", False)
        m.setattr(RUNTIME, "ensure_retirer", cannot_start)
        with pytest.raises(RuntimeError, match=r"^can't start new thread$"):
            ipc.open(h)
    gc_collect_harder()
    assert _state_after_polls(ex) == "exported"
    v = ipc.open(h)
    assert v.is_live and _state_after_polls(ex) == "open"
    del v
    assert _released(ex) and ipc.exports() == 0


def test_a_writable_export_orders_after_pending_reads_too(fake):
    """The importer of a writable export may write the bytes at once (its stream waits only
    for the export's event): as a DLPack or CAI export of a writable view, the export must be
    ordered after the reads pending then, not only the writes -- else the importer's first
    write raced a read still running on another stream of the exporter. A read-only export
    waits for writes alone; a read of the exporter after the export is no conflict."""
    dev, drv = fake
    b, b2 = (sm.Buffer.from_host(np.arange(256, dtype=np.float32), device=dev) for _ in "ab")
    for x in (b, b2):
        drv.ranges[x.allocation.ptr] = x.allocation.nbytes
    w, w2 = dev.create_stream("reader"), dev.create_stream("writer then reader")
    sm.synchronize()

    def waits():
        return sum(1 for c in drv.calls if c[0] == "wait")
    drv.holding = True
    try:
        sm.Buffer.empty(256, "float32", device=dev).copy_from(b, stream=w)  # a read of b
        n = waits()
        ro = ipc.export(b.as_readonly())
        assert waits() == n  # (a read-only export: reads are no conflict)
        ex = ipc.export(b)
        assert ex.handle.writable and waits() == n + 1  # after the read
        # a write, then a read on one stream: the export waits for the write (its lease) and
        # for the read after it
        b2.fill_zero(stream=w2)
        sm.Buffer.empty(256, "float32", device=dev).copy_from(b2, stream=w2)
        n = waits()
        ex2 = ipc.export(b2)
        assert waits() == n + 2
        sm.set_access_policy("reject")
        sm.Buffer.empty(256, "float32", device=dev).copy_from(
            b, stream=dev.create_stream("another reader"))  # (the export is no write)
    finally:
        sm.set_access_policy("order")
        drv.finish_held()
    assert ex.revoke() and ex2.revoke() and ro.revoke()
