"""The host device against the real torch (CPU) and JAX (CPU), through DLPack: what the fakes
and the GPU machine did not exercise. Each test imports its library itself and skips where it
is absent."""

import gc
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import sharedmem as sm

from test_dlpack import _check_part_and_whole_are_one_allocation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_a_process(code: str) -> None:
    """Run ``code`` in an interpreter of its own, on these sources, interpreted: JAX starts
    threads when imported, and later tests of this process fork (a fork of a process running
    JAX's threads may deadlock)."""
    env = dict(os.environ, SHAREDMEM_PURE_PYTHON="1", JAX_PLATFORMS="cpu",  # (its arrays on
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))  # the CPU
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _needs_jax():
    if importlib.util.find_spec("jax") is None:
        pytest.skip("needs jax")


# -- export: torch, JAX and NumPy consumers of host views -------------------------------------
_EXPORT = """
import gc
import numpy as np
import pytest
import sharedmem as sm

def check(convert, ptr):
    # the consumer's array is the view's memory; while it lives, a move of the bytes is
    # refused naming the export, a release of the source does not free them, and when the
    # array dies the hold ends
    t = sm.Tensor.from_host(np.arange(12, dtype=np.float32).reshape(3, 4),
                            device=sm.Device.host())
    y = convert(t)
    assert ptr(y) == t.ptr and tuple(y.shape) == (3, 4)
    gc.collect()
    assert "DLPack export, bytes [0, 48)" in " ".join(t.allocation.views())
    with pytest.raises(sm.AliasError, match="DLPack export"):
        t.into_buffer()
    assert t.to_host().tolist() == np.arange(12).reshape(3, 4).tolist()  # (still usable)
    t.release()
    gc.collect()
    assert sm.stats().live_allocations == 1
    assert np.asarray(y).tolist() == np.arange(12).reshape(3, 4).tolist()
    del y
    gc.collect()
    sm.synchronize()
    assert sm.stats().live_allocations == 0
"""


@pytest.mark.parametrize("consumer", ["torch", "jax", "numpy"])
def test_export_is_zero_copy_and_its_hold_outlives_the_source(consumer):
    if consumer == "torch":
        pytest.importorskip("torch")
        call = "import torch; check(torch.from_dlpack, lambda y: y.data_ptr())"
    elif consumer == "jax":
        _needs_jax()
        call = ("import jax.numpy as jnp; "
                "check(jnp.from_dlpack, lambda y: y.unsafe_buffer_pointer())")
    else:
        call = "check(np.from_dlpack, lambda y: y.ctypes.data)"
    _in_a_process(_EXPORT + call + "\nprint('ok')\n")


# -- import: torch tensors ---------------------------------------------------------------------
@pytest.mark.parametrize("first", ["part", "whole"])
def test_imports_of_views_of_one_torch_tensor_are_one_allocation_in_any_order(host, first):
    """A view of a CPU tensor imported before its base was an allocation of its own (only
    NumPy arrays were filed under their base's memory): a writer of the whole on one stream
    and a reader of the part on another were not ordered, and the reader saw zeros."""
    torch = pytest.importorskip("torch")
    _check_part_and_whole_are_one_allocation(host, torch.zeros(16), first)


def test_import_of_a_torch_tensor_is_zero_copy_and_keeps_it_alive(host):
    torch = pytest.importorskip("torch")
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = sm.from_dlpack(x)
    assert t.ptr == x.data_ptr() and t.device is host and not t.readonly
    for v in (x.t(), x[1:, 1:]):  # (strided, storage offset)
        u = sm.from_dlpack(v)
        assert u.ptr == v.data_ptr() and u.allocation is t.allocation
        assert u.to_host().tolist() == v.numpy().tolist()
    del x, v
    gc.collect()
    assert t.to_host().tolist() == np.arange(12).reshape(3, 4).tolist()


def test_a_negated_torch_view_is_refused_not_read_with_the_wrong_sign(host):
    """torch refuses to export a tensor with the conjugate bit, but exports one with the
    negative bit (the imaginary part of a conjugated tensor) as its memory: the import read
    [0, 1, 2, 3] for [-0, -1, -2, -3]."""
    torch = pytest.importorskip("torch")
    c = torch.arange(4, dtype=torch.float32) * (1 + 1j)
    neg = c.conj().imag
    assert neg.is_neg()
    with pytest.raises(BufferError, match=r"^cannot import a torch tensor with the negative bit "
                                          r"set \(shape \(4,\), torch.float32\).*resolve_neg"):
        sm.from_dlpack(neg)
    assert sm.from_dlpack(neg.resolve_neg()).to_host().tolist() == [0.0, -1.0, -2.0, -3.0]
    with pytest.raises(BufferError, match="conjugate bit"):  # (torch's own refusal)
        sm.from_dlpack(c.conj())


def test_adopt_takes_a_lone_torch_tensor_over(host):
    """The storage object ``untyped_storage()`` returns holds a use of the storage itself: a
    tensor nothing else shared counted 2 uses, and every torch adopt() was refused."""
    torch = pytest.importorskip("torch")
    t = sm.adopt(torch.arange(4.0))
    assert t.allocation.source == "dlpack (adopted)"
    assert t.into_buffer().to_host().tolist() == [0.0, 1.0, 2.0, 3.0]
    x = torch.arange(4.0)
    # (x.numpy() too, but torch then marks the storage as not its own for good: adopt() stays
    # refused after the array is dropped -- test_review_torch_jax)
    for other in (lambda: x[1:], lambda: x.untyped_storage()):
        keep = other()
        with pytest.raises(sm.AliasError, match="storage other tensors"):
            sm.adopt(x)
        del keep
    u = sm.adopt(x)
    del x
    assert u.into_buffer().to_host().tolist() == [0.0, 1.0, 2.0, 3.0]


# -- import: JAX arrays ------------------------------------------------------------------------
def test_a_jax_array_is_imported_read_only():
    """JAX arrays are immutable, but JAX exports legacy capsules, which cannot say read-only:
    the import was writable, and a launch wrote into the JAX array."""
    _needs_jax()
    _in_a_process("""
import jax.numpy as jnp
import numpy as np
import pytest
import sharedmem as sm
j = jnp.arange(6, dtype=jnp.float32)
t = sm.from_dlpack(j)
assert t.ptr == j.unsafe_buffer_pointer() and t.readonly
with pytest.raises(sm.KernelError, match="would write through a read-only view"):
    sm.launch(sm.host_kernel(lambda x: x.fill(42)), 1, 1, sm.Out(t))
sm.synchronize()
assert np.asarray(j).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
assert t.to_host().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # (still usable)
print("ok")
""")


# -- bfloat16, which an import has ---------------------------------------------------------------
def test_an_imported_bfloat16_tensor_can_be_copied(host):
    """A bfloat16 tensor imported from torch (ml_dtypes' dtype) could be read, launched on
    and exported, but t.copy() said its dtype 'cannot live in device memory'."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    t = sm.from_dlpack(torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
    c = t.copy()
    assert c.dtype == t.dtype and c.to_host().astype(np.float32).tolist() == [[0, 1, 2], [3, 4, 5]]
    back = torch.from_dlpack(c)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == c.ptr


# -- torch tensors and JAX arrays as host-kernel arguments ----------------------------------------
def _slow_write_then_read(host, write, written, read):
    """What a host kernel reading ``In(read)`` on one stream gets -- ``(the object, its values
    as a NumPy array)`` -- after a slow kernel ``write``-ing ``Out(written)`` on another."""
    import time
    seen = []

    def writer(x):
        time.sleep(0.2)
        write(x)
    s1, s2 = host.create_stream("writer"), host.create_stream("reader")
    sm.launch(sm.host_kernel(writer), 1, 1, sm.Out(written), stream=s1)
    sm.launch(sm.host_kernel(lambda y: seen.append((y, np.array(y.tolist())))), 1, 1,
              sm.In(read), stream=s2)
    sm.synchronize()
    return seen[0]


@pytest.mark.parametrize("read", ["itself", "part", "its import", "a strided part"])
def test_host_kernels_on_a_torch_tensor_are_ordered_and_get_the_tensor(host, read):
    """A torch CPU tensor passed to a host kernel was passed through unleased (bare; In / Out
    of it were refused as no array): a slow writer of it on one stream and a reader of it, of
    a view of it or of the sharedmem view imported from it on another were not ordered."""
    torch = pytest.importorskip("torch")
    t = torch.zeros(16)
    other = {"itself": lambda: t, "part": lambda: t[4:8], "its import": lambda: sm.from_dlpack(t),
             "a strided part": lambda: t[1::4]}[read]()
    got, values = _slow_write_then_read(host, lambda x: x.fill_(3.0), t, other)
    assert values.tolist() == [3.0] * len(other)
    assert got is other if read != "its import" else type(got) is np.ndarray  # (a view: NumPy's)


def test_host_kernels_on_a_torch_tensor_over_a_host_view_are_ordered_with_the_view(host):
    """``torch.from_dlpack`` of a host view is sharedmem's memory: its lease is a range of the
    view's own allocation, so work on the two is ordered both ways."""
    torch = pytest.importorskip("torch")
    v = sm.Tensor.from_host(np.zeros(8, np.float32), device=host)
    x = torch.from_dlpack(v)
    got, values = _slow_write_then_read(host, lambda y: y.fill(5.0), v, x)
    assert got is x and values.tolist() == [5.0] * 8
    got, values = _slow_write_then_read(host, lambda y: y.fill_(6.0), x[2:6], v)
    assert values.tolist() == [5.0, 5.0, 6.0, 6.0, 6.0, 6.0, 5.0, 5.0]
    ro = torch.from_dlpack(v.as_readonly())  # (torch has no read-only tensors: the view says)
    del v, x, got  # (no writable view reaches the bytes now)
    gc.collect()
    with pytest.raises(sm.KernelError, match=r"^argument 0: Out\(tensor\(.*\)\) would write "
                                             r"through a read-only view"):
        sm.launch(sm.host_kernel(lambda y: None), 1, 1, sm.Out(ro))


def test_a_host_launch_keeps_a_torch_tensor_alive_and_leaves_lazy_bits_to_torch(host):
    import threading
    import weakref
    torch = pytest.importorskip("torch")
    gate = threading.Event()
    t = torch.zeros(4)
    alive = weakref.ref(t)
    f = sm.launch(sm.host_kernel(lambda x: (gate.wait(10), x.fill_(1.0))), 1, 1, sm.Out(t),
                  stream=host.create_stream())
    del t
    gc.collect()
    assert alive() is not None
    gate.set()
    f.result(5)
    sm.synchronize()
    gc.collect()
    assert alive() is None
    # a conjugated or negated view: the kernel gets the tensor, whose operations see the bits
    c = torch.arange(4, dtype=torch.float32) * (1 + 1j)
    seen = []
    sm.launch(sm.host_kernel(lambda z, n: seen.append((z.imag.tolist(), n.tolist()))), 1, 1,
              sm.In(c.conj()), sm.In(c.conj().imag)).result(5)
    assert seen == [([-0.0, -1.0, -2.0, -3.0], [-0.0, -1.0, -2.0, -3.0])]


def test_a_jax_array_passed_to_a_host_kernel_is_leased_read_only():
    """A JAX array passed to a host kernel was passed through unleased (In / Out of it were
    refused as no array): a reader of one made of a host view was not ordered after a writer
    of the view. Leased now, read-only: JAX arrays are immutable."""
    _needs_jax()
    _in_a_process("""
import time
import jax.numpy as jnp
import numpy as np
import pytest
import sharedmem as sm
host = sm.Device.host()
j = jnp.arange(6, dtype=jnp.float32)
k = sm.host_kernel(lambda x: None)
with pytest.raises(sm.KernelError, match=r"^argument 0: Out\\(.*\\) would write through a "
                                         r"read-only view; pass it as In"):
    sm.launch(k, 1, 1, sm.Out(j))
with pytest.raises(sm.KernelError, match="would write through a read-only view"):
    sm.launch(k, 1, 1, j)  # (bare: InOut)
v = sm.Tensor.from_host(np.zeros(8, np.float32), device=host)
x = jnp.from_dlpack(v)
seen = []
def writer(y):
    time.sleep(0.2)
    y.fill(7.0)
s1, s2 = host.create_stream(), host.create_stream()
sm.launch(sm.host_kernel(writer), 1, 1, sm.Out(v), stream=s1)
sm.launch(sm.host_kernel(lambda y: seen.append((y, np.array(y)))), 1, 1, sm.In(x), stream=s2)
sm.synchronize()
assert seen[0][0] is x and seen[0][1].tolist() == [7.0] * 8
print("ok")
""")


@pytest.mark.parametrize("array", ["t[4:8].numpy()", "np.asarray(t[4:8])"])
def test_host_kernels_on_a_numpy_array_of_a_torch_tensor_are_ordered_with_the_tensor(host,
                                                                                      array):
    """A NumPy array of part of a torch tensor (``t[4:8].numpy()``, whose base is the tensor)
    was leased over its own bytes: leased before the tensor, it was an allocation of its own,
    and a reader of the tensor on another stream was not ordered after a writer of the array.
    Filed under the tensor's storage now, as the tensor is."""
    torch = pytest.importorskip("torch")
    t = torch.zeros(16)
    a = {"t[4:8].numpy()": lambda: t[4:8].numpy(),
         "np.asarray(t[4:8])": lambda: np.asarray(t[4:8])}[array]()
    got, values = _slow_write_then_read(host, lambda x: x.fill(3.0), a, t)
    assert got is t and values.tolist() == [0.0] * 4 + [3.0] * 4 + [0.0] * 8
    got, values = _slow_write_then_read(host, lambda x: x.fill_(5.0), t[6:10], a)
    assert values.tolist() == [3.0, 3.0, 5.0, 5.0]


def test_a_nested_torch_tensor_passed_to_a_host_kernel_is_passed_as_it_is(host):
    """A nested tensor (strided, on the CPU, but without one shape or strides) passed to a host
    kernel raised torch's RuntimeError ("NestedTensorImpl doesn't support sizes") from the
    lease; it is passed as it is, unleased, as sparse tensors are (and as it was before torch
    tensors were leased)."""
    torch = pytest.importorskip("torch")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (nested tensors are a prototype: torch warns)
        n = torch.nested.nested_tensor([torch.zeros(2), torch.ones(3)])
    seen = []
    sm.launch(sm.host_kernel(lambda x: seen.append(x)), 1, 1, n,
              stream=host.default_stream).result(5)
    assert seen[0] is n
    assert sm.stats().in_flight == 0


@pytest.mark.parametrize("change", ["set_", "resize_"])
def test_a_graph_replay_of_a_torch_tensor_whose_memory_changed_is_refused(host, change):
    """A host launch of a torch tensor captured into a graph leases the bytes the tensor had
    at the capture, but each replay runs the kernel on the tensor itself: after ``t.set_(...)``
    or a growing ``t.resize_(...)`` a replay wrote memory it did not lease, and a reader of
    that memory on another stream was not ordered after it (it saw zeros). Refused now, with
    a KernelError that says to capture again; an unchanged tensor replays, ordered."""
    import time
    torch = pytest.importorskip("torch")

    def writer(x):
        time.sleep(0.2)
        x.fill_(3.0)
    t = torch.zeros(8)
    s1, s2 = host.create_stream("writer"), host.create_stream("reader")
    with sm.capture(s1) as g:
        sm.launch(sm.host_kernel(writer), 1, 1, sm.Out(t))
    seen = []
    g.replay(s1)
    sm.launch(sm.host_kernel(lambda y: seen.append(y.tolist())), 1, 1, sm.In(t[2:4]),
              stream=s2)
    sm.synchronize()
    assert seen == [[3.0, 3.0]]
    u = torch.zeros(8)
    if change == "set_":
        t.set_(u.untyped_storage(), 0, (8,), (1,))
    else:
        t.resize_(1 << 16)  # (new memory: the old values copied, the rest uninitialized)
        u = None
    before = sm.stats()
    with pytest.raises(sm.KernelError, match=r"^a replay on .* of a graph that captured host "
                                             r"kernel .*writer of a torch tensor \(shape \(8,\), "
                                             r"torch.float32\): the tensor's memory changed "
                                             r"since the capture .*capture the graph again$"):
        g.replay(s1)
    sm.synchronize()
    assert sm.stats().submitted == before.submitted
    assert u is None or u.tolist() == [0.0] * 8  # (set_: the other storage not written)
