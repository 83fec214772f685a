"""Tensor views and copies (#16): first-axis indexing, reshape, copy() and contiguous().

Views share the allocation and hold their own token (moves see them as aliases); copies are
new allocations holding the values in logical order, on the host backend and through the CUDA
backend's 2-D copies (fake driver here; exact values on the H200 in test_gpu_cuda.py).
"""

import numpy as np
import pytest

import sharedmem as sm
from sharedmem.backends import copy_pieces
from sharedmem.errors import AliasError, LayoutError, MovedError

from test_cuda_backend_fake import fake  # noqa: F401  (the fake CUDA device fixture)


def _t(shape, dtype=np.float32, device=None):
    a = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    return a, sm.Tensor.from_host(a, device=device)


def test_first_axis_index_and_slices_are_views():
    a, t = _t((4, 6))
    row = t[2]
    assert row.shape == (6,) and row.ptr == t.ptr + 2 * 6 * 4
    np.testing.assert_array_equal(row.to_host(), a[2])
    np.testing.assert_array_equal(t[-1].to_host(), a[-1])
    np.testing.assert_array_equal(t[1:3].to_host(), a[1:3])
    every = t[::2]
    assert every.strides == (12, 1) and not every.is_contiguous()
    np.testing.assert_array_equal(every.to_host(), a[::2])
    assert t[4:].shape == (0, 6) and t[4:].to_host().shape == (0, 6)
    np.testing.assert_array_equal(t[1,].to_host(), a[1])
    assert every._token.allocation is t._token.allocation


def test_views_are_aliases_for_moves():
    _, t = _t((4, 6))
    row = t[1]
    with pytest.raises(AliasError, match=r"tensor view, bytes \[24, 48\) of allocation"):
        t.into_buffer()
    assert t.is_live and row.is_live  # nothing changed
    del row
    b = t.into_buffer()
    assert len(b) == 24
    with pytest.raises(MovedError):
        t[0]


def test_bad_indices():
    _, t = _t((4, 6))
    with pytest.raises(IndexError, match="index 4 is out of bounds for the first axis of size 4"):
        t[4]
    with pytest.raises(IndexError, match="out of bounds"):
        t[-5]
    with pytest.raises(LayoutError, match="positive step"):
        t[::-1]
    with pytest.raises(TypeError, match="an int or a slice of the first axis, got tuple"):
        t[1, 2]
    with pytest.raises(TypeError, match="got float"):
        t[1.0]
    with pytest.raises(TypeError, match="got bool"):
        t[True]
    with pytest.raises(IndexError, match="0-d tensor"):
        t.reshape(24)[3].reshape(())[0]


def test_reshape():
    a, t = _t((4, 6))
    r = t.reshape(2, -1, 3)
    assert r.shape == (2, 4, 3) and r.ptr == t.ptr and r.is_contiguous()
    np.testing.assert_array_equal(r.to_host(), a.reshape(2, 4, 3))
    assert t.reshape((3, 8)).shape == (3, 8) and t.reshape([24]).shape == (24,)
    assert t[1].reshape(2, 3).ptr == t.ptr + 24
    with pytest.raises(LayoutError, match=r"\(24 elements\) to \(5, 5\) \(25 elements\)"):
        t.reshape(5, 5)
    with pytest.raises(LayoutError, match="only one size can be -1"):
        t.reshape(-1, -1)
    with pytest.raises(LayoutError, match="cannot reshape"):
        t.reshape(-1, 5)
    with pytest.raises(LayoutError, match=r"reshape needs a C-contiguous tensor.*contiguous\(\)"):
        t[::2].reshape(12)
    with pytest.raises(TypeError, match="shape must be"):
        t.reshape(2.0, 12)


def test_copy_and_contiguous_host():
    a, t = _t((3, 4, 5), np.int16)
    s = t[::2]
    c = s.copy()
    assert c.is_contiguous() and c._token.allocation is not t._token.allocation
    np.testing.assert_array_equal(c.to_host(), a[::2])
    assert t.contiguous() is t
    d = s.contiguous()
    assert d is not s and d.strides == (20, 5, 1)
    np.testing.assert_array_equal(d.to_host(), a[::2])
    # the copy is a value copy: later writes to the source do not show
    with t.as_buffer() as b:
        b.fill_zero()
    np.testing.assert_array_equal(c.to_host(), a[::2])
    assert t[3:].copy().shape == (0, 4, 5)


def test_copy_waits_for_pending_writes_on_another_stream():
    import time
    from host_kernels import slow_fill
    s1, s2 = sm.Device.host().create_stream("w"), sm.Device.host().create_stream("r")
    t = sm.Tensor.zeros((8, 8), "float32", device=sm.Device.host())
    with t.as_buffer() as b:
        sm.launch(slow_fill, 1, 1, sm.Out(b), 3.0, 0.05, stream=s1)
    c = t[::2].copy(stream=s2)
    np.testing.assert_array_equal(c.to_host(), np.full((4, 8), 3.0))


@pytest.mark.parametrize("shape,strides", [
    ((3, 4), (4, 1)), ((3, 4), (1, 3)), ((2, 3, 4), (24, 4, 1)), ((2, 3, 4), (12, 1, 3)),
    ((5,), (3,)), ((2, 1, 3), (6, 99, 2)), ((4, 0), (1, 1)), ((), ()),
])
def test_copy_pieces_match_numpy(shape, strides):
    src = np.arange(200, dtype=np.float64)
    view = np.lib.stride_tricks.as_strided(src, shape, tuple(8 * s for s in strides))
    width, height, pitch, pieces = copy_pieces(shape, tuple(8 * s for s in strides), 8)
    raw, out = src.view(np.uint8), np.zeros(view.size * 8, np.uint8)
    for so, do in pieces:
        for r in range(height):
            out[do + r * width: do + (r + 1) * width] = raw[so + r * pitch: so + r * pitch + width]
    np.testing.assert_array_equal(out.view(np.float64), view.ravel())


def test_copy_strided_fake_cuda(fake):  # noqa: F811
    dev, drv = fake
    a = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    b = sm.Buffer.from_host(a.ravel(), device=dev)
    t = sm.Tensor.from_buffer(b, (8, 6), strides=(1, 8))  # the transpose
    c = t.copy()
    np.testing.assert_array_equal(c.to_host(), a.T)
    d = t[1::3].contiguous()
    np.testing.assert_array_equal(d.to_host(), a.T[1::3])
    e = c[2:5].copy()
    np.testing.assert_array_equal(e.to_host(), a.T[2:5])
    sm.synchronize()


def test_an_empty_slice_stays_inside_its_allocation():
    buf = sm.Buffer.from_host(np.arange(18, dtype=np.int32), device=sm.Device.host())
    t = sm.Tensor.from_buffer(buf, (4, 3), strides=(5, 1))  # reaches element 17, the last
    for e in (t[4:], t[9:], t[2:2], t[3:1]):
        assert e.shape[0] == 0 and e.shape[1:] == (3,)
        assert e.ptr == t.ptr and e._token.start == e._token.stop == t._token.start
        assert e.to_host().shape == e.shape and e.copy().shape == e.shape
    assert t[3:].ptr == t.ptr + 3 * 5 * 4  # (a non-empty slice: where its first row is)


def test_moved_views_answer_no_property():
    b = sm.Buffer.zeros(4, "float32", device=sm.Device.host())
    t = sm.Tensor.from_buffer(b, (2, 2))
    for name in ("dtype", "itemsize", "strides", "byte_strides", "shape", "size"):
        with pytest.raises(MovedError):
            getattr(b, name)
    b2 = t.into_buffer()
    for name in ("dtype", "itemsize", "ndim", "strides", "byte_strides", "shape", "size"):
        with pytest.raises(MovedError):
            getattr(t, name)
    assert b2.dtype == np.float32 and b2.itemsize == 4


def test_strides_are_checked_as_a_shape_is():
    b = sm.Buffer.zeros(8, "float32", device=sm.Device.host())
    for bad in ((1.7, 1), (True, 1), "ab", 3, (None, 1)):
        with pytest.raises(TypeError, match=r"^strides must be a sequence of ints \(elements\), "
                                            r"got "):
            sm.Tensor.from_buffer(b, (2, 2), strides=bad)
        assert b.is_live  # (a refused move leaves the source as it was)
    t = sm.Tensor.from_buffer(b, (2, 2), strides=(np.int64(4), 1))
    assert t.strides == (4, 1)



def test_a_zero_step_is_a_layout_error():
    b = sm.Buffer.zeros(8, "float32", device=sm.Device.host())
    with pytest.raises(LayoutError, match=r"^Buffer slices must be contiguous \(step 1\), got "
                                          r"step 0 \(slicing <Buffer .*>\)$"):
        b[::0]
    with pytest.raises(LayoutError, match=r"^Buffer slices must be contiguous \(step 1\), got "
                                          r"step 2 \(slicing <Buffer .*>\); for a strided view, "
                                          r"slice a Tensor of its bytes: sm.Tensor.from_buffer\("
                                          r"buf, \(len\(buf\),\)\)\[::2\] \(from_buffer "
                                          r"moves the buffer into the tensor: no other view "
                                          r"of its bytes may be live\)$"):
        b[::2]
    with pytest.raises(LayoutError, match=r"got step 3 \(slicing <Buffer .*>\); for a strided "
                                          r"view, .*\[::3\]"):
        b[::np.int64(3)]  # (a NumPy step: the same hint)
    c = sm.Buffer.zeros(8, "float32", device=sm.Device.host())
    s = sm.Tensor.from_buffer(c, (len(c),))[::2]  # (what the message says works)
    assert s.shape == (4,) and s.strides == (2,) and not c.is_live  # (strides in elements)
    t = sm.Tensor.from_buffer(b, (2, 4))
    with pytest.raises(LayoutError, match=r"^tensor slices take a positive step .*got step 0$"):
        t[::0]


def test_a_0d_tensor_has_no_len_and_dead_tensors_say_why():
    t = sm.Tensor.from_host(np.array(5.0, np.float32), device=sm.Device.host())
    assert t.shape == () and t.size == 1
    with pytest.raises(TypeError, match=r"^len\(\) of a 0-d tensor$"):
        len(t)
    t.release()
    assert repr(t) == "<Tensor (released)>"
    with pytest.raises(sm.ReleasedError):
        len(t)
    m = sm.Tensor.from_host(np.zeros((2, 2), np.float32), device=sm.Device.host())
    b = m.into_buffer()
    assert repr(m) == "<Tensor (moved)>" and len(b) == 4


def test_the_layout_cache_stays_bounded():
    import sharedmem.tensor as smt
    if not hasattr(smt, "_layouts"):  # (compiled: a C global)
        pytest.skip("the cache is not visible from Python in the compiled build")
    for n in range(1, 1100):
        assert smt.c_layout((n, 2)) == ((n, 2), (2, 1), 2 * n)
    assert 0 < len(smt._layouts) <= 1024


def test_a_devicebox_refuses_a_numpy_value_its_dtype_cannot_hold(host):
    """errors.md: a value the box's dtype cannot hold is an OverflowError. Python ints were
    checked; NumPy scalars and 0-d arrays of another dtype were cast C-style: 300 became 44
    in an int8 box, -1 became 255 in a uint8 one."""
    for value, dtype in ((np.array(300), "int8"), (np.int8(-1), "uint32"),
                         (np.array(-1, np.int16), "uint8")):
        with pytest.raises(OverflowError, match=rf"^a DeviceBox of {dtype} cannot hold "):
            sm.DeviceBox(value, dtype, device=host)
    box = sm.DeviceBox(np.int16(7), "uint8", device=host)
    with pytest.raises(OverflowError):
        box.set(np.array(-1))
    assert box.get() == 7


def test_with_a_released_devicebox_raises_as_a_released_view_does(host):
    """``with view:`` of a released view raises ReleasedError; ``with box:`` of a released box
    entered silently (the body then failed on its first use of the box, or not at all)."""
    box = sm.DeviceBox(1.5, "float32", device=host)
    with box as b:
        assert b is box and box.get() == 1.5
    with pytest.raises(sm.ReleasedError, match=r"^this Buffer \(allocation #\d+\) was released"):
        with box:
            pass  # pragma: no cover - not entered

def test_a_devicebox_refuses_a_finite_value_beyond_its_float_range(host):
    """errors.md: a value the box's dtype cannot hold is an OverflowError. A finite number beyond
    a float dtype's range was stored as an infinity (1e300 in a float32 box read back inf, with
    only NumPy's RuntimeWarning), as CuPy scalar parameters refuse it (interop-cupy.md). NaN
    and the infinities stay what they are."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (and no NumPy "overflow encountered in cast")
        for value, dtype in ((1e300, "float32"), (np.float64(-1e39), "float32"),
                             (70000, "float16"), (complex(1e300, 0), "complex64"),
                             (10**39, "float32")):
            with pytest.raises(OverflowError, match=rf"^a DeviceBox of {dtype} cannot hold "):
                sm.DeviceBox(value, dtype, device=host)
        box = sm.DeviceBox(1.5, "float32", device=host)
        with pytest.raises(OverflowError):
            box.set(1e39)
        assert box.get() == 1.5
        for value in (float("inf"), float("-inf")):
            box.set(value).result(5)
            assert box.get() == value
        box.set(float("nan")).result(5)
        assert np.isnan(box.get())
        assert sm.DeviceBox(3.4e38, "float32", device=host).get() == np.float32(3.4e38)


def test_strides_past_int64_are_never_made(host):
    """t[::2**62] of a tensor gave a stride of 2**64 on its one row, from_buffer took a stride
    of 2**64 on an extent-1 dimension, and an empty shape (0, 2**62, 2**62) C strides up to
    2**124: to_host, launches and DLPack then failed with errors of undocumented types (and
    different ones compiled and interpreted). A one-element slice keeps its parent's stride;
    the others are a LayoutError when made."""
    t = sm.Tensor.from_host(np.arange(12.0).reshape(4, 3), device=host)
    row = t[::1 << 62]
    assert row.shape == (1, 3) and row.strides == (3, 1)
    np.testing.assert_array_equal(row.to_host(), [[0.0, 1.0, 2.0]])
    b = sm.Buffer.zeros(4, "float32", device=host)
    with pytest.raises(sm.LayoutError, match=r"^strides \(18446744073709551616, 1\) reach "
                                             r"2\*\*63 bytes or more$"):
        sm.Tensor.from_buffer(b, (1, 4), (1 << 64, 1))
    assert b.allocation.live_views == 1
    with pytest.raises(sm.LayoutError, match=r"spans 2\*\*63 elements or more"):
        sm.Tensor.empty((0, 1 << 62, 1 << 62), "float32", device=host)


def test_iteration_and_membership_as_numpy_has_them_or_refused(host):
    """`for row in t` gives the views t[i]; a 0-d tensor is a TypeError, as in NumPy (it was
    an empty iteration); `x in t` is a TypeError (it compared rows by identity: False)."""
    t = sm.Tensor.from_host(np.arange(6.0).reshape(3, 2), device=host)
    rows = list(t)
    assert [r.to_host().tolist() for r in rows] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    del rows
    with pytest.raises(TypeError, match=r"^iteration over a 0-d tensor$"):
        list(sm.Tensor.from_host(np.array(1.0), device=host))
    with pytest.raises(TypeError, match=r"^`x in tensor` would compare the elements"):
        3.0 in t  # noqa: B015
    assert t.allocation.live_views == 1


def test_a_tensor_over_part_of_its_buffer_borrows_its_own_bytes(host):
    """from_buffer(buf10, (3,), (1,)) is C-contiguous over part of its view's bytes:
    as_buffer was refused (its borrow is a new token: its own bytes will do); into_buffer
    still is -- its view's other bytes would go with it -- and says what to do."""
    b = sm.Buffer.from_host(np.arange(10.0), device=host)
    t = sm.Tensor.from_buffer(b, (3,), (1,))
    with t.as_buffer() as part:
        assert part.to_host().tolist() == [0.0, 1.0, 2.0] and part.ptr == t.ptr
    with pytest.raises(sm.LayoutError, match=r"\(a shape smaller than the buffer it was made "
                                             r"from\); t\.copy\(\) is a tensor of its own bytes$"):
        t.into_buffer()
    assert t.copy().into_buffer().to_host().tolist() == [0.0, 1.0, 2.0]


def test_to_host_and_reprs_race_a_release_in_another_thread(host):
    """A view released or moved by another thread while ``to_host`` or ``repr`` runs: the read
    returns the bytes it copied while the view was live (or raises ReleasedError), a repr
    never raises. Both read ``_token`` a second time after their check, None by then:
    AttributeError. (The other thread's release is made at that point by a profile hook: the
    interpreted build runs the window; compiled code makes no profile events.)"""
    import sys
    from sharedmem.allocation import View

    a, t = _t((3, 4))
    def code(prop):  # (compiled: a C getset descriptor, no code object -- the hook never fires)
        fget = getattr(prop, "fget", None)
        return getattr(fget, "__code__", None) if fget is not None else None

    size, is_live = code(sm.Tensor.size), code(View.is_live)

    def at(code, view):
        def prof(frame, event, arg):
            if event == "return" and code is not None and frame.f_code is code:
                view.release()
        return prof

    sys.setprofile(at(size, t))
    try:
        try:
            got = t.to_host()
        except sm.ReleasedError:
            got = None
    finally:
        sys.setprofile(None)
    if got is not None:
        np.testing.assert_array_equal(got, a)
    for view in (sm.Buffer.zeros(4, device=host), _t((2, 2))[1],
                 sm.DeviceBox(1.0, device=host)):
        sys.setprofile(at(is_live, view))
        try:
            text = repr(view)
        finally:
            sys.setprofile(None)
        assert text.startswith("<") and text.endswith(">")
        view.release()
        assert "(released)" in repr(view)


def test_extent_of_a_layout():
    """``extent``: the byte (or element) offsets a layout touches relative to element 0 --
    negative strides below it, an empty shape none, sequences of any kind, and sizes past 64
    bits exact (Python ints in both builds: a layout checked before it is refused)."""
    from sharedmem.tensor import extent
    assert extent((3, 4), (16, 4), 4) == (0, 48)
    assert extent((3, 4), (-16, 4), 4) == (-32, 16)
    assert extent([2, 3], [-3, -1]) == (-5, 1)
    assert extent((0, 4), (16, 4), 4) == (0, 0) and extent((4, 0), (0, 0)) == (0, 0)
    assert extent((), (), 8) == (0, 8)
    assert extent((1 << 40, 1 << 40), (1 << 40, 1), 2) == (0, ((1 << 40) - 1) * ((1 << 40) + 1) + 2)
    assert extent((2, 5), (0, 0), 4) == (0, 4)  # (broadcast: every element at element 0)
