"""Moves, borrows and aliases: from_buffer / into_buffer / as_buffer."""

import re

import numpy as np
import pytest

import sharedmem as sm
from sharedmem import allocation as _allocation

from conftest import gc_collect_harder


@pytest.fixture
def buf(device):
    b = sm.Buffer.from_host(np.arange(12, dtype=np.float32), device=device)
    return b


def test_from_buffer_into_buffer_zero_copy(buf):
    ptr, alloc = buf.ptr, buf.allocation
    assert alloc.live_views == 1
    t = sm.Tensor.from_buffer(buf, (3, 4))
    assert t.ptr == ptr and t.allocation is alloc
    assert (t.shape, t.strides, t.dtype) == ((3, 4), (4, 1), np.dtype(np.float32))
    assert alloc.live_views == 1  # the token moved, it was not duplicated
    b2 = t.into_buffer()
    assert b2.ptr == ptr and len(b2) == 12 and b2.allocation is alloc
    assert alloc.live_views == 1
    np.testing.assert_array_equal(b2.to_host(), np.arange(12, dtype=np.float32))


def test_moved_source_raises_on_every_use(buf):
    t = sm.Tensor.from_buffer(buf, (12,))
    msg = (rf"^this Buffer \(allocation #{t.allocation.id}\) was moved into a Tensor and can "
           rf"no longer be used; use the Tensor the move returned$")
    for use in (lambda: buf.ptr, lambda: len(buf), lambda: buf[0:2], lambda: buf.to_host(),
                lambda: buf.allocation, lambda: sm.Tensor.from_buffer(buf, (12,)),
                lambda: sm.launch(sm.host_kernel(lambda x: None), 1, 1, buf)):
        with pytest.raises(sm.MovedError, match=msg):
            use()
    assert isinstance(sm.MovedError("x"), sm.ReleasedError)
    b = t.into_buffer()
    with pytest.raises(sm.MovedError, match=r"^this Tensor \(allocation #\d+\) was moved into a Buffer"):
        t.shape
    b.release()
    with pytest.raises(sm.ReleasedError, match=r"^this Buffer \(allocation #\d+\) was released"):
        b.ptr


def test_alias_error_lists_each_live_view(buf):
    alloc = buf.allocation
    s1 = buf[0:4]
    s2 = buf[6:12].as_readonly()
    ptr = buf.ptr
    with pytest.raises(sm.AliasError) as ei:
        sm.Tensor.from_buffer(buf, (3, 4))
    msg = str(ei.value)
    # the temporary slice buf[6:12] died at once (refcounting): two views remain
    assert msg == (
        f"cannot move Buffer(float32 x 12, bytes [0, 48) of allocation #{alloc.id}) into a Tensor: "
        f"2 other live views of its bytes exist:\n"
        f"  - slice, bytes [0, 16) of allocation #{alloc.id}\n"
        f"  - read-only view, bytes [24, 48) of allocation #{alloc.id}\n"
        f"To move, release it (call .release(), leave its `with` block, or drop every "
        f"reference); or copy instead of moving.\n"
        f"(set SHAREDMEM_TRACK_ORIGINS=1 to see where each view was created)")
    assert len(ei.value.views) == 2
    # a failed move leaves the source fully usable
    assert buf.ptr == ptr and len(buf) == 12
    np.testing.assert_array_equal(buf.to_host(), np.arange(12, dtype=np.float32))
    s1.release()
    del s2
    gc_collect_harder()
    t = sm.Tensor.from_buffer(buf, (3, 4))
    assert t.ptr == ptr


def test_alias_released_by_gc(buf):
    s = buf[2:3]
    with pytest.raises(sm.AliasError):
        sm.Tensor.from_buffer(buf, (12,))
    del s
    gc_collect_harder()
    assert sm.Tensor.from_buffer(buf, (12,)).shape == (12,)


def test_only_overlapping_bytes_conflict(device):
    whole = sm.Buffer.zeros(16, "int32", device=device)
    left, right = whole[0:8], whole[8:16]
    whole.release()
    # left and right do not overlap: each can be moved while the other lives
    tl = sm.Tensor.from_buffer(left, (2, 4))
    tr = sm.Tensor.from_buffer(right, (8,))
    assert tr.ptr - tl.ptr == 32
    assert tl.allocation is tr.allocation and tl.allocation.live_views == 2


def test_borrow_blocks_moves_until_released(device):
    t = sm.Tensor.from_host(np.ones((4, 4), np.float64), device=device)
    with t.as_buffer() as b:
        assert b.ptr == t.ptr and len(b) == 16
        with pytest.raises(sm.AliasError, match=r"  - borrow, bytes \[0, 128\)"):
            t.into_buffer()
        with pytest.raises(sm.AliasError, match=r"  - tensor, bytes \[0, 128\)"):
            sm.Tensor.from_buffer(b, (16,))  # the tensor aliases the borrow
        assert t.allocation.live_views == 2
    with pytest.raises(sm.ReleasedError):
        len(b)
    assert t.allocation.live_views == 1
    ptr = t.ptr
    assert t.into_buffer().ptr == ptr


def test_completion_leases_never_count_as_aliases(host):
    import threading
    gate = threading.Event()

    @sm.host_kernel
    def wait_then_read(x):
        gate.wait(5)

    s = host.create_stream()
    b = sm.Buffer.zeros(8, device=host, stream=s)
    fut = sm.launch(wait_then_read, 1, 1, sm.In(b), stream=s)
    assert not fut.done()
    # work in flight on b: still unique, the move succeeds
    t = sm.Tensor.from_buffer(b, (8,))
    assert t.allocation.live_views == 1
    gate.set()
    fut.result(5)


def test_read_only_and_empty_views_do_not_block_readers(device):
    b = sm.Buffer.from_host(np.arange(8, dtype=np.int64), device=device)
    ro = b.as_readonly()
    # moving the writable buffer is blocked by the read-only view ...
    with pytest.raises(sm.AliasError, match=r"  - read-only view, bytes \[0, 64\)"):
        sm.Tensor.from_buffer(b, (8,))
    # ... and a read-only move is blocked by the writable buffer ...
    ro2 = ro.as_readonly()
    with pytest.raises(sm.AliasError, match=r"^cannot move Buffer\(int64 x 8.*\n  - buffer, bytes \[0, 64\)"):
        sm.Tensor.from_buffer(ro2, (2, 4))
    # ... but not by other readers: with only read-only views left it succeeds
    b.release()
    t = sm.Tensor.from_buffer(ro2, (2, 4))
    assert t.readonly and t.ptr == ro.ptr
    np.testing.assert_array_equal(t.to_host(), np.arange(8).reshape(2, 4))
    # empty views conflict with nothing
    empty = t.allocation.new_token("slice", 24, 24, True, t.allocation)
    t3 = sm.Tensor.from_buffer(ro.as_readonly(), (8,))
    assert t3.allocation.live_views == 4 and empty.live
    # and a writable move is blocked by no empty view either
    w = sm.Buffer.empty(4, device=device)
    e = w[2:2]
    assert len(e) == 0
    assert sm.Tensor.from_buffer(w, (4,)).ptr == e.ptr - 8


def test_track_origins(monkeypatch, device):
    monkeypatch.setattr(_allocation, "TRACK_ORIGINS", True)
    b = sm.Buffer.empty(4, device=device)
    s = b[1:2]; line = __import__("inspect").currentframe().f_lineno  # noqa: E702
    with pytest.raises(sm.AliasError) as ei:
        sm.Tensor.from_buffer(b, (4,))
    assert re.search(rf"slice, bytes \[4, 8\) of allocation #\d+ \(created at tests/test_moves.py:{line} in test_track_origins\)",
                     str(ei.value)), str(ei.value)
    assert "SHAREDMEM_TRACK_ORIGINS" not in str(ei.value)
    s.release()
    # a moved view is named where the move made it, not where its source was
    b2 = sm.Buffer.empty(4, device=device)
    t = sm.Tensor.from_buffer(b2, (4,)); moved = __import__("inspect").currentframe().f_lineno  # noqa: E702
    u = t[0:2]
    with pytest.raises(sm.AliasError) as ei:
        u.into_buffer()
    assert re.search(rf"tensor, bytes \[0, 16\) of allocation #\d+ \(created at "
                     rf"tests/test_moves.py:{moved} in test_track_origins\)", str(ei.value)), \
        str(ei.value)


def test_layout_errors_leave_source_usable(device):
    b = sm.Buffer.empty(10, "float32", device=device)
    with pytest.raises(sm.LayoutError, match=r"^shape \(3, 4\) holds 12 elements but <Buffer float32 x 10"):
        sm.Tensor.from_buffer(b, (3, 4))
    with pytest.raises(sm.LayoutError, match="negative"):
        sm.Tensor.from_buffer(b, (2, 5), strides=(-5, 1))
    assert len(b) == 10 and b.is_live
    t = sm.Tensor.from_buffer(b, (5, 2), strides=(1, 5))  # column-major view of all 10
    assert not t.is_contiguous()
    with pytest.raises(sm.LayoutError, match="needs a C-contiguous tensor"):
        t.into_buffer()
    with pytest.raises(sm.LayoutError, match="needs a C-contiguous tensor"):
        t.as_buffer()
    assert t.is_live


def test_slices_and_views_share_allocation(device):
    b = sm.Buffer.from_host(np.arange(10, dtype=np.int32), device=device)
    s = b[2:7]
    assert s.allocation is b.allocation and s.ptr == b.ptr + 8 and len(s) == 5
    np.testing.assert_array_equal(s.to_host(), np.arange(2, 7))
    assert b.allocation.live_views == 2
    with pytest.raises(sm.LayoutError, match="step 1"):
        b[::2]
    with pytest.raises(TypeError, match="takes a slice"):
        b[3]
    with s:
        pass
    assert b.allocation.live_views == 1


def test_device_box(device):
    box = sm.DeviceBox(3.5, "float64", device=device)
    assert box.get() == 3.5
    box.set(1.0)
    assert box.get() == 1.0

    if device.kind == "host":
        @sm.host_kernel
        def incr(x):
            x[0] += 2
        sm.launch(incr, 1, 1, sm.InOut(box)).result()
        assert box.get() == 3.0


def test_derived_values_are_computed_once_per_live_view(host):
    """What interop modules cache per view (array descriptors) is computed once,
    never for a dead view, and never shared with the view a move returns."""
    b = sm.Buffer.zeros(8, "float32", device=host)
    calls = []

    def make(v):
        calls.append(v)
        return (v.ptr, len(v))

    assert b._derived_value("k", make) == (b.ptr, 8)
    assert b._derived_value("k", make) == (b.ptr, 8) and len(calls) == 1
    t = sm.Tensor.from_buffer(b, (2, 4))
    with pytest.raises(sm.MovedError):
        b._derived_value("other", make)
    assert t._derived_value("k", lambda v: ("tensor", v.shape)) == ("tensor", (2, 4))
    assert len(calls) == 1


def test_a_tensor_over_part_of_its_bytes_is_no_source_of_copies_or_buffers(host):
    b = sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=host)
    t = sm.Tensor.from_buffer(b, (4,), strides=(1,))  # contiguous, over half of the moved bytes
    for dst in (sm.Buffer.zeros(8, "float32", device=host),
                sm.Buffer.zeros(4, "float32", device=host)):
        with pytest.raises(sm.LayoutError, match=r"^copy_from: <Tensor .*> covers bytes \[0, 16\) "
                                                 r"but its view holds \[0, 32\) \(a shape "
                                                 r"smaller than the buffer it was made from\); "
                                                 r"t\.copy\(\) is a tensor of its own bytes$"):
            dst.copy_from(t)
        assert not dst.to_host().any()
    z = sm.Tensor.from_buffer(sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=host),
                              (0,), strides=(1,))  # empty, over 8 elements
    with pytest.raises(sm.LayoutError, match=r"^into_buffer: .* covers bytes \[0, 0\) but its "
                                             r"view holds \[0, 32\) \("):
        z.into_buffer()
    assert z.is_live
    e = sm.Tensor.empty((0, 3), "float32", device=host)
    assert len(e.into_buffer()) == 0  # (an empty tensor over no bytes moves)


def test_a_release_racing_a_move_has_one_winner(host):
    import threading
    for _ in range(200):
        b = sm.Buffer.zeros(4, "float32", device=host)
        got = []
        t = threading.Thread(target=b.release)
        t.start()
        try:
            got.append(sm.Tensor.from_buffer(b, (2, 2)))
        except sm.ReleasedError:
            pass
        t.join()
        assert not b.is_live
        if got:  # the move won: the tensor is whole, and the release did nothing to it
            x = got[0]
            assert x.is_live and x._token.live and x.allocation.live_views == 1
            with x.as_buffer() as bb:
                with pytest.raises(sm.AliasError):
                    x.into_buffer()
                assert bb.is_live
            assert len(x.into_buffer()) == 4


def test_a_released_device_box_has_a_repr():
    box = sm.DeviceBox(1.0, "float32", device=sm.Device.host())
    box.release()
    assert repr(box) == "<DeviceBox (released)>"


def test_from_buffer_layout_errors_name_the_layout_and_move_nothing(host):
    b = sm.Buffer.from_host(np.arange(6, dtype=np.int32), device=host)
    cases = [
        (((2, -3), None), r"^shape must not have negative sizes, got \(2, -3\)$"),
        (((2, 3), (3,)), r"^strides \(3,\) do not match shape \(2, 3\)$"),
        (((2, 3), (4, 1)), r"^shape \(2, 3\) with strides \(4, 1\) reaches element 6, beyond "
                           r"<Buffer int32 x 6 on <Device host>, bytes \[0, 24\) of allocation "
                           rf"#{b.allocation.id}>$"),
    ]
    for (shape, strides), msg in cases:
        with pytest.raises(sm.LayoutError, match=msg):
            sm.Tensor.from_buffer(b, shape, strides)
        assert b.is_live and b.allocation.live_views == 1  # not moved
    with pytest.raises(TypeError, match=r"^Tensor\.from_buffer takes a sharedmem\.Buffer, got "
                                        r"Allocation$"):
        sm.Tensor.from_buffer(b.allocation, (6,))
    np.testing.assert_array_equal(b.to_host(), np.arange(6))
    t = sm.Tensor.from_buffer(b, (2, 3), (3, 1))  # the same layout, valid: moves
    assert not b.is_live and t.shape == (2, 3)


def test_copy_from_a_view_of_another_byte_size_enqueues_nothing(host):
    s = host.create_stream()
    dst = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    src = sm.Buffer.from_host(np.arange(6, dtype=np.int32), device=host, stream=s)
    s.synchronize()
    before = sm.stats()
    for part, n in ((src, 24), (src[0:2], 8)):
        with pytest.raises(sm.LayoutError, match=rf"^copy_from needs the same byte size: "
                                                 rf"<Buffer int32 x {n // 4} .*> has {n}, "
                                                 rf"<Buffer int32 x 4 .*> has 16$"):
            dst.copy_from(part, stream=s)
    assert sm.stats().submitted == before.submitted and s.pending == 0
    assert not dst.allocation.tracker and not src.allocation.tracker
    np.testing.assert_array_equal(dst.to_host(), np.zeros(4))
    dst.copy_from(src[2:6], stream=s).result(5)
    np.testing.assert_array_equal(dst.to_host(), [2, 3, 4, 5])


def test_device_box_protocol_and_a_host_device_named_by_string(host):
    b = sm.Buffer.empty(3, "int16", device="host")
    assert b.device is host and len(b) == 3
    box = sm.DeviceBox(7, "int64", device="host")
    assert box.ptr == box.buffer.ptr and box.device is host
    assert repr(box) == "<DeviceBox int64 on <Device host>>"
    with box as entered:
        assert entered is box and box.get() == 7
    assert repr(box) == "<DeviceBox (released)>"
    with pytest.raises(sm.ReleasedError):
        box.ptr


def test_release_is_idempotent_and_lookup_needs_a_device(host):
    b = sm.Buffer.zeros(4, "int32", device=host)
    alloc = b.allocation
    assert repr(alloc) == (f"<Allocation #{alloc.id} sharedmem on <Device host> "
                           f"ptr=0x{alloc.ptr:x} nbytes=16 live_views=1>")
    part = b[0:2]
    assert alloc.live_views == 2
    part.release()
    part.release()  # a second release gives back nothing more
    assert alloc.live_views == 1 and repr(part) == "<Buffer (released)>"
    for bad in ("host", 0, None):
        with pytest.raises(TypeError, match=rf"^lookup_allocation takes a sharedmem\.Device, "
                                            rf"got {bad!r}; use sharedmem\.Device\.host\(\) or "
                                            rf"sharedmem\.Device\(0\)$"):
            sm.lookup_allocation(bad, alloc.ptr)
    assert sm.lookup_allocation(host, alloc.ptr) is alloc


def test_an_empty_slice_moves_while_the_rest_of_the_buffer_is_live(host):
    """An empty view aliases no byte: moving it is not refused for the live buffer it was
    sliced from, which stays live and usable."""
    b = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=host)
    e = b[2:2]
    t = sm.Tensor.from_buffer(e, (0,))
    assert t.shape == (0,) and t.nbytes == 0
    with pytest.raises(sm.MovedError):
        e.to_host()
    assert b.is_live and b.allocation.live_views == 2
    np.testing.assert_array_equal(b.to_host(), np.arange(4))
