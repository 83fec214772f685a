"""sm.launch on the host backend: intents, validation, futures."""

import asyncio
import collections
import threading

import numpy as np
import pytest

import sharedmem as sm
import sharedmem.device as sm_device
from sharedmem.launch import Intent


@sm.host_kernel
def saxpy(a, x, y, out):
    out[:] = a * x + y


@sm.host_kernel
def record_flags(x, y, seen):
    seen.append((x.flags.writeable, y.flags.writeable, type(x), x.shape, y.shape))


def test_launch_exact_result(host):
    s = host.create_stream()
    x = sm.Buffer.from_host(np.arange(100, dtype=np.float32), device=host, stream=s)
    y = sm.Buffer.from_host(np.ones(100, np.float32), device=host, stream=s)
    out = sm.Buffer.empty(100, "float32", device=host)
    fut = sm.launch(saxpy, 1, 1, np.float32(2), sm.In(x), sm.In(y), sm.Out(out), stream=s)
    assert isinstance(fut, sm.DeviceFuture) and fut.stream is s
    assert fut.result(timeout=5) is None and fut.done()
    np.testing.assert_array_equal(out.to_host(), 2 * np.arange(100, dtype=np.float32) + 1)


def test_in_views_are_read_only_and_tensors_keep_shape(host):
    seen = []
    t = sm.Tensor.from_host(np.zeros((2, 3), np.int16), device=host)
    b = sm.Buffer.empty(5, "int16", device=host)
    sm.launch(record_flags, 1, 1, sm.In(t), b, seen).result(5)
    assert seen == [(False, True, np.ndarray, (2, 3), (5,))]


def test_validation_failures_take_no_leases(host):
    s = host.create_stream()
    b = sm.Buffer.zeros(4, device=host, stream=s)
    s.synchronize()
    before = sm.stats()
    ro = b.as_readonly()
    with pytest.raises(sm.KernelError, match=r"^argument 1: Out\(<Buffer read-only float32 x 4 .*\) would write through a read-only view; pass it as In\(\.\.\.\) or copy it first$"):
        sm.launch(saxpy, 1, 1, 1.0, sm.Out(ro), b, b, stream=s)
    with pytest.raises(sm.KernelError, match=r"^argument 0: Atomic\(.*\) would write through a read-only view"):
        sm.launch(saxpy, 1, 1, sm.Atomic(ro), stream=s)
    with pytest.raises(sm.KernelError, match=r"^argument 0: In\(\) takes a Buffer, Tensor, DeviceBox or array, got int$"):
        sm.launch(saxpy, 1, 1, sm.In(3), stream=s)

    class CudaArray:  # (a JAX or torch array on a GPU, as DLPack names its device)
        device, dtype = "cuda:0", "float32"

        def __dlpack__(self, stream=None):
            raise AssertionError("not exported")

        def __dlpack_device__(self):
            return (2, 0)
    with pytest.raises(sm.KernelError, match=r"^argument 0: In\(\) takes a Buffer, Tensor, DeviceBox "
                       r"or array, got test_launch.CudaArray on cuda:0 \(dtype float32\); it is "
                       r"in device memory, which a host kernel cannot reach: pass a host copy "
                       r"\(np.asarray\(...\), .cpu\(\), jax.device_get\(...\)\)$"):
        sm.launch(saxpy, 1, 1, sm.In(CudaArray()), stream=s)
    with pytest.raises(sm.KernelError, match=r"^grid must be a positive int or a tuple of 1 to 3 positive ints, got \(0,\)$"):
        sm.launch(saxpy, (0,), 1, b, stream=s)
    with pytest.raises(sm.KernelError, match=r"^launch\(\) does not know how to launch a builtins.function"):
        sm.launch(lambda: None, 1, 1, b, stream=s)
    with pytest.raises(sm.SharedMemError, match=r"^unknown access policy 'fifo'; expected one of 'order', 'reject'$"):
        sm.launch(saxpy, 1, 1, b, stream=s, policy="fifo")
    with pytest.raises(sm.KernelError, match="shared_mem must be an int >= 0"):
        sm.launch(saxpy, 1, 1, b, stream=s, shared_mem=-1)
    for bad in (True, 2.0, [2], (1, 1, 1, 1), np.int64(0)):
        with pytest.raises(sm.KernelError, match=r"^grid must be a positive int or a tuple of 1 "
                                                 r"to 3 positive ints, got "):
            sm.launch(saxpy, bad, 1, b, stream=s)
    released = b[0:1]
    released.release()
    with pytest.raises(sm.ReleasedError):
        sm.launch(saxpy, 1, 1, released, stream=s)
    after = sm.stats()
    assert after.submitted == before.submitted and after.in_flight == 0
    assert b.allocation.tracker.streams_locked() == []


def test_device_mismatch():
    class FakeDev:  # a second device only needs an identity for this check
        pass
    host = sm.Device.host()
    b = sm.Buffer.empty(4, device=host)
    # a view whose allocation claims another device
    fake = sm.Buffer.empty(4, device=host)
    fake._token.allocation.device = FakeDev()
    try:
        # (no peer access advised: the host device has none -- enable_peer_access would
        # raise PeerAccessError; see test_review_core)
        with pytest.raises(sm.DeviceMismatchError, match=r"^argument 1 \(.*\) is on .*FakeDev.*, but the launch runs on <Device host>; copy it there first \(view\.to_device\(\.\.\.\)\)$"):
            sm.launch(saxpy, 1, 1, b, fake)
    finally:
        fake._token.allocation.device = host


def test_atomic_is_tracked_as_write(host):
    a, b = host.create_stream(), host.create_stream()
    gate = threading.Event()

    @sm.host_kernel
    def slow_atomic(x):
        gate.wait(5)
        x[0] += 1

    buf = sm.Buffer.zeros(2, "int64", device=host, stream=a)
    fa = sm.launch(slow_atomic, 1, 1, sm.Atomic(buf), stream=a)
    # a reader on another stream conflicts with an atomic as with a write
    with pytest.raises(sm.AccessConflictError, match=r"while unfinished work on <Stream .*> writes them"):
        sm.launch(sm.host_kernel(lambda x: None), 1, 1, sm.In(buf), stream=b, policy="reject")
    gate.set()
    fa.result(5)
    assert buf.to_host()[0] == 1


def test_future_then_and_callbacks(host):
    s = host.create_stream()
    gate = threading.Event()

    @sm.host_kernel
    def slow(x):
        gate.wait(5)
        x[:] = 7

    b = sm.Buffer.empty(3, "int32", device=host)
    fut = sm.launch(slow, 1, 1, sm.Out(b), stream=s)
    called = []
    fut.add_done_callback(lambda f: called.append(f is fut))
    chained = fut.then(lambda v: ("done", v))
    assert not fut.done() and not chained.done() and called == []
    with pytest.raises(TimeoutError, match="did not finish within 0.01 s"):
        fut.result(timeout=0.01)
    gate.set()
    assert chained.result(5) == ("done", None)
    assert called == [True]
    assert chained.then(lambda v: v[0] + "!").result(5) == "done!"
    failing = fut.then(lambda v: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    assert isinstance(failing.exception(5), ZeroDivisionError)


def test_await_future(host):
    s = host.create_stream()

    @sm.host_kernel
    def fill(x):
        x[:] = 3

    b = sm.Buffer.empty(4, "int32", device=host)

    async def main():
        fut = sm.launch(fill, 1, 1, sm.Out(b), stream=s)
        return await fut

    assert asyncio.run(main()) is None
    np.testing.assert_array_equal(b.to_host(), [3, 3, 3, 3])


def test_scalars_and_foreign_objects_pass_through(host):
    got = []

    @sm.host_kernel
    def k(*args):
        got.append(args)

    obj = object()
    sm.launch(k, 1, 1, 1, 2.5, "s", obj).result(5)
    assert got == [(1, 2.5, "s", obj)]


@pytest.mark.parametrize("make", [
    lambda b: [1, b], lambda b: (2.5, [None, sm.In(b)]), lambda b: {"x": b},
    lambda b: {"k": (1, sm.Out(b))}, lambda b: {("k", b)}])
def test_views_inside_a_container_argument_of_a_host_kernel_are_refused(host, make):
    """A launch leases only its arguments themselves: a view inside a list, tuple, dict or set
    would reach the function unleased -- refused before anything is leased, naming where it
    is; the buffer stays usable and unleased."""
    ran = []

    @sm.host_kernel
    def k(x, box):
        ran.append(box)

    b = sm.Buffer.from_host(np.arange(4, dtype=np.int32), device=host)
    arg = make(b)
    with pytest.raises(sm.KernelError, match=rf"^argument 1: a (Buffer|In|Out) inside a "
                                             rf"{type(arg).__name__}; a launch leases only the "
                                             rf"arrays passed as arguments themselves"):
        sm.launch(k, 1, 1, 0, arg).result(5)
    sm.synchronize()
    assert ran == [] and sm.Tensor.from_buffer(b, (2, 2)).to_host().tolist() == [[0, 1], [2, 3]]


def test_containers_without_views_pass_to_a_host_kernel_as_they_are(host):
    got = []

    @sm.host_kernel
    def k(*args):
        got.append(args)

    loop = [1, "s", None]
    loop.append(loop)  # (a container holding itself: walked once)
    nested = ({"a": [1.5, (2, frozenset({3}))]}, np.arange(2))
    sm.launch(k, 1, 1, loop, nested).result(5)
    assert len(got) == 1 and got[0][0] is loop and got[0][1] is nested


def _k():
    ran = []

    @sm.host_kernel
    def k(x, box):
        ran.append(box)
    return k, ran


def test_a_view_in_the_third_entry_of_a_dict_is_refused(host):
    """_no_views_inside walks dict.items(): the (key, value) tuples are temporaries, recycled
    by the dict iterator (and by the tuple free list) at the same address; their ids are put in
    ``seen``, so a later pair at a reused address is taken as walked -- skipped."""
    k, ran = _k()
    b = sm.Buffer.from_host(np.arange(4, dtype=np.int32), device=host)
    arg = {"a": 1, "b": 2, "c": b, "d": b}
    with pytest.raises(sm.KernelError, match=r"^argument 1: a Buffer inside a dict"):
        sm.launch(k, 1, 1, 0, arg).result(5)
    sm.synchronize()


Args = collections.namedtuple("Args", "x y")


class MyList(list):
    pass


@pytest.mark.parametrize("make", [lambda b: Args(1, b), lambda b: MyList([b]),
                                  lambda b: [Args(1, b)], lambda b: collections.OrderedDict(x=b)])
def test_a_view_inside_a_container_subclass_is_refused(host, make):
    """type(x) is list/tuple/dict misses subclasses: a namedtuple of arrays (a common way to
    pass a kernel's arguments) reaches the function unleased."""
    k, ran = _k()
    b = sm.Buffer.from_host(np.arange(4, dtype=np.int32), device=host)
    with pytest.raises(sm.KernelError, match=r"^argument 1: a Buffer inside a"):
        sm.launch(k, 1, 1, 0, make(b)).result(5)
    sm.synchronize()


def test_a_deeply_nested_container_is_passed_not_a_recursion_error(host):
    """A cons list (1, (2, (3, ...))) deeper than the recursion limit passed before the
    change; the walk raises RecursionError from launch()."""
    got = []

    @sm.host_kernel
    def k(x):
        got.append(x)
    deep = None
    for i in range(5000):
        deep = (i, deep)
    sm.launch(k, 1, 1, deep).result(5)
    assert got and got[0] is deep


def test_a_foreign_dtype_whose_str_raises_still_names_the_type(host):
    """_described guards device/dtype attribute access, but formats ``dt`` outside the try."""
    class BadDt:
        def __format__(self, spec):
            raise ValueError("boom")
        __str__ = __repr__ = lambda self: (_ for _ in ()).throw(ValueError("boom"))
    cls = type("Arr", (), {"__module__": "mylib", "dtype": BadDt()})
    k = sm.host_kernel(lambda x: None)
    with pytest.raises(sm.KernelError, match=r"got mylib.Arr"):
        sm.launch(k, 1, 1, sm.In(cls()))


def test_missing_cutile_says_how_to_install(monkeypatch):
    import sys
    import interop.cutile as icut
    monkeypatch.setitem(sys.modules, "cuda.tile", None)  # import cuda.tile now fails
    with pytest.raises(sm.BackendUnavailableError, match=r"^cuTile is not installed: pip install 'cuda-tile\[tileiras\]'.*Hopper GPUs \(sm_90\) need the CUDA 13.3\+") as e:
        icut._cutile()
    # the extra is on the PyPI project sharedmem-gpu (README, interop-cutile.md): `sharedmem` there
    # is an unrelated project, which the hint named
    assert "'sharedmem-gpu[cutile]'" in str(e.value) and "'sharedmem[" not in str(e.value)
    assert issubclass(sm.BackendUnavailableError, ImportError)


def test_callback_errors_surface_at_the_next_call_not_in_other_futures(host):
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    gate = threading.Event()

    @sm.host_kernel
    def gated(x):
        gate.wait(5)

    f1 = sm.launch(gated, 1, 1, b, stream=s)
    f1.add_done_callback(lambda f: 1 / 0)  # raises in whichever thread retires f1
    chained = sm.launch(gated, 1, 1, b, stream=s).then(lambda v: "ok")
    gate.set()
    assert chained.result(5) == "ok"  # the other future is not poisoned
    with pytest.raises(ZeroDivisionError):
        sm.stats()  # the callback's error, re-raised in the user thread
    sm.stats()  # reported once


def test_views_an_adapter_makes_of_foreign_arrays_live_through_the_launch(host):
    """An adapter's coerced view (a CuPy array argument, say) is referenced by
    nothing but the launch: it must stay live until the leases are taken."""
    from host_kernels import Foreign, ForeignKernel
    b = sm.Buffer.zeros(4, "int32", device=host)
    sm.launch(ForeignKernel(), 1, 1, sm.Out(Foreign(b))).result(5)
    np.testing.assert_array_equal(b.to_host(), np.full(4, 7))
    assert b.allocation.live_views == 1


def test_a_lease_an_adapter_makes_without_a_token_is_refused_in_both_builds(host):
    """What a coerce returns is checked as a view is: a ForeignArray whose token was never
    set, or a view released already, is refused before anything is leased (compiled, the
    token used to be read through unchecked). A LaunchArg is checked where it is made."""
    from sharedmem.launch import ForeignArray, KernelAdapter, LaunchArg

    class Kernel:
        pass

    made = {}

    class Adapter(KernelAdapter):
        name = "test kernel"
        device_kinds = ("host",)

        def coerce(self, obj, device):
            return made["lease"]

        def prepare(self, kernel, grid, block, args, shared_mem, stream):
            return (lambda: stream._impl.submit(lambda: None, True)), ()

    sm.register_kernel_adapter(Kernel, Adapter())
    fa = ForeignArray()
    assert (fa.token, fa.offset, fa.ref, fa.keep) == (None, 0, None, None)
    gone = sm.Buffer.empty(4, device=host)
    gone.release()
    before = sm.stats().submitted
    for lease, error, message in (
            (fa, sm.KernelError, r"^argument 0: the ForeignArray the adapter made of object "
                                 r"has no lease token \(its coerce must set token\)$"),
            (gone, sm.ReleasedError, r"^this Buffer \(allocation #\d+\) was released")):
        made["lease"] = lease
        with pytest.raises(error, match=message):
            sm.launch(Kernel(), 1, 1, sm.In(object()), stream=host.default_stream)
    assert sm.stats().submitted == before
    # LaunchArg: a view or None, a ViewToken, a mode by number or name (None: write), an
    # integer offset -- the same refusals in both builds
    b = sm.Buffer.zeros(4, device=host)
    tok = b._token
    assert LaunchArg(None, object(), tok, "read", None).mode == "read"
    assert LaunchArg(None, object(), tok, None, None, offset=np.int64(8)).mode == "write"
    assert LaunchArg(b, b, tok, 2, None).mode == "atomic"
    assert LaunchArg(b, b, tok, True, None).mode == "write"  # (numbers: 0 to 2, as indexes)
    assert LaunchArg(b, b, tok, np.int32(0), None).mode == "read"
    with pytest.raises(ValueError, match=r"^mode 3 is not one of"):
        LaunchArg(b, b, tok, 3, None)
    with pytest.raises(TypeError, match=r"^LaunchArg: view must be a sharedmem view or None "
                                        r"and token a ViewToken, got NoneType and NoneType$"):
        LaunchArg(None, object(), None, "write", None)
    with pytest.raises(TypeError, match=r"got ndarray and ViewToken$"):
        LaunchArg(np.zeros(2), object(), tok, "write", None)
    with pytest.raises(ValueError, match=r"^mode 'rw' is not one of 'read', 'write', 'atomic' "
                                         r"\(or None: write\)$"):
        LaunchArg(None, object(), tok, "rw", None)
    with pytest.raises(TypeError):
        LaunchArg(None, object(), tok, "read", None, offset=1.5)


def test_intents_wrap_one_argument_once(host):
    b = sm.Buffer.zeros(4, device=host)
    for cls in (sm.In, sm.Out, sm.InOut, sm.Atomic):
        w = cls(b)
        assert w.obj is b and w.mode == ("read" if cls is sm.In else "atomic" if cls is sm.Atomic else "write")
        assert repr(cls(5)) == f"{cls.__name__}(5)"
        with pytest.raises(sm.KernelError, match=rf"^{cls.__name__}\(In\(<Buffer .*\)\): an "
                                                 rf"argument takes one intent$"):
            cls(sm.In(b))
    with pytest.raises(TypeError):  # (Python and Cython word a missing argument differently)
        sm.In()
    with pytest.raises(TypeError):
        sm.Out(b, b, b)
    with pytest.raises(TypeError):
        sm.In(b, with_lenght=True)
    # a subclass states its base's mode (the bases have one __init__ between them)
    modes = {sm.In: "read", sm.Out: "write", sm.InOut: "write", sm.Atomic: "atomic",
             Intent: "write"}
    for base, mode in modes.items():
        sub = type("My" + base.__name__, (base,), {})
        assert sub(b).mode == mode and sub(b, with_length=True).with_length
    # under both In and Atomic, in either order: read, in both builds
    for bases in ((sm.Atomic, sm.In), (sm.In, sm.Atomic)):
        assert type("Both", bases, {"__slots__": ()})(b).mode == "read"
    w = sm.InOut(b, with_length=True)
    assert w.with_length and repr(w) == f"InOut({b!r}, with_length=True)"

    class Read(sm.In):  # a subclass is made the same way
        pass
    r = Read(b)
    assert type(r) is Read and r.obj is b and r.mode == "read"

    import copy
    import pickle
    for w in (sm.In(b, with_length=True), sm.Out(5), sm.InOut("x"), sm.Atomic(7), Read(3)):
        pickled = [] if type(w) is Read else [pickle.loads(pickle.dumps(w))]  # (a local class)
        for again in (*pickled, copy.copy(w), copy.deepcopy(w)):
            assert type(again) is type(w) and again.mode == w.mode
            assert again.with_length == w.with_length and type(again.obj) is type(w.obj)

    class OwnInit(sm.Atomic):  # one that skips Intent.__init__ keeps its base's mode
        def __init__(self, obj):
            self.obj, self.with_length = obj, False
    assert OwnInit(b).mode == "atomic"
    written = []
    sm.launch(sm.host_kernel(lambda x: written.append(x.flags.writeable)), 1, 1,
              OwnInit(b)).result()
    assert written == [True]  # (leased as a write: compiled, not the zeroed mode, a read)


def test_launch_is_the_same_function_on_either_path(host):
    import inspect
    assert list(inspect.signature(sm.launch).parameters) == [
        "kernel", "grid", "block", "args", "stream", "shared_mem", "policy"]
    assert sm.launch.__name__ == "launch" and "leases on every array argument" in sm.launch.__doc__
    b = sm.Buffer.zeros(4, device=host)

    @sm.host_kernel
    def fill(x, v):
        x[:] = v

    with pytest.raises(TypeError, match="unexpected keyword argument 'strem'"):
        sm.launch(fill, 1, 1, sm.Out(b), 1.0, strem=None)
    # (interpreted and compiled, Python and Cython word it differently)
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'block'|"
                                        r"takes at least 3 positional arguments \(2 given\)"):
        sm.launch(fill, 1)
    sm.launch(fill, (1,), 1, sm.Out(b), 2.0, stream=None, shared_mem=0, policy="reject").result()
    np.testing.assert_array_equal(b.to_host(), np.full(4, 2.0))



def test_grid_block_and_shared_memory_take_numpy_ints(host):
    s = host.create_stream()
    b = sm.Buffer.zeros(4, device=host, stream=s)
    seen = []
    k = sm.host_kernel(lambda x: seen.append(1))
    sm.launch(k, np.int64(2), np.int32(1), b, stream=s, shared_mem=np.uint16(0)).result(5)
    sm.launch(k, (np.int64(1), 2), (np.int8(1),), b, stream=s).result(5)
    assert seen == [1, 1]


class _PreparedKernel:
    """A kernel type launched through _PreparingAdapter: ``act(args)`` runs in ``prepare``
    (given the LaunchArg list the adapter sees), the work itself does nothing; ``returns``,
    where given, is what ``prepare`` returns instead."""

    __name__ = "prepared"

    def __init__(self, act, *returns):
        self.act = act
        self.returns = returns


class _PreparingAdapter(sm.KernelAdapter):
    # no coerce and no label of its own: KernelAdapter's defaults
    name = "preparing kernel"
    device_kinds = ("host",)

    def prepare(self, kernel, grid, block, args, shared_mem, stream):
        kernel.act(args)
        if kernel.returns:
            return kernel.returns[0]
        return (lambda: stream._impl.submit(lambda: None, True)), ()


sm.register_kernel_adapter(_PreparedKernel, _PreparingAdapter())


def test_adapter_defaults_hand_prepare_launch_args_and_pass_the_rest_as_scalars(host):
    from sharedmem.launch import LaunchArg
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    seen = []

    def act(args):
        seen.append([(a.mode, a.with_length, a.view is b, a.offset) if isinstance(a, LaunchArg)
                     else a for a in args])

    sm.launch(_PreparedKernel(act), 1, 1, sm.In(b, with_length=True), sm.Atomic(b[2:4]),
              "scalar", stream=s).result(5)
    # KernelAdapter.coerce (not overridden) makes nothing of a str: it is passed as it is. A
    # view resolved as itself carries only its lease: Atomic shows as a write (it is leased as
    # one), its intent is not kept
    assert seen == [[("read", True, True, 0), ("write", False, False, 8), "scalar"]]
    assert _PreparingAdapter().label(_PreparedKernel(act)) == "preparing kernel prepared"
    assert _PreparingAdapter().coerce("scalar", host) is None


def test_a_view_released_while_the_launch_packs_is_refused_with_no_lease(host):
    """A lease is checked live under the core lock: a view released after the arguments were
    resolved (here by the adapter's prepare) fails the launch, which then took nothing."""
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    s.synchronize()
    part = b[0:2]
    before = sm.stats()
    with pytest.raises(sm.ReleasedError, match=r"^a slice passed to preparing kernel prepared "
                                               r"was released before the launch$"):
        sm.launch(_PreparedKernel(lambda args: args[1].view.release()), 1, 1, sm.In(b), part,
                  stream=s)
    after = sm.stats()
    assert after.submitted == before.submitted and after.in_flight == 0
    assert b.allocation.tracker.streams_locked() == [] and s.pending == 0
    assert b.allocation.live_views == 1  # the slice is gone, b still usable
    sm.launch(_PreparedKernel(lambda args: None), 1, 1, b, stream=s).result(5)


def test_a_kernel_whose_adapter_does_not_run_on_the_device_is_refused(host):
    class CudaOnly(sm.KernelAdapter):
        name = "cuda-only kernel"
        device_kinds = ("cuda",)

    class Undeclared(sm.KernelAdapter):  # (device_kinds not set: it runs nowhere)
        name = "undeclared kernel"

    class K1:
        pass

    class K2:
        pass

    sm.register_kernel_adapter(K1, CudaOnly())
    sm.register_kernel_adapter(K2, Undeclared())
    b = sm.Buffer.zeros(4, device=host)
    sm.synchronize()
    before = sm.stats()
    with pytest.raises(sm.DeviceMismatchError, match=r"^a cuda-only kernel cannot run on "
                                                     r"<Device host>; it runs on cuda devices$"):
        sm.launch(K1(), 1, 1, b)
    with pytest.raises(sm.DeviceMismatchError, match=r"^a undeclared kernel cannot run on "
                                                     r"<Device host>; its adapter declares no "
                                                     r"device kinds \(set its device_kinds, "
                                                     r"e\.g\. \('host',\)\)$"):
        sm.launch(K2(), 1, 1, b)
    assert sm.stats().submitted == before.submitted
    assert not b.allocation.tracker


def test_host_kernel_block_none_with_length_and_construction(host):
    s = host.create_stream()
    b = sm.Buffer.from_host(np.arange(4, dtype=np.int32), device=host, stream=s)
    got = []

    @sm.host_kernel
    def k(x, y):
        got.append((x.tolist(), x.flags.writeable, y.tolist(), y.flags.writeable))
        y[:] = 9

    # block=None is accepted (as for cuTile); a with_length argument is still one array
    sm.launch(k, 1, None, sm.In(b[0:2], with_length=True), sm.Out(b[2:4], with_length=True),
              stream=s).result(5)
    assert got == [([0, 1], False, [2, 3], True)]
    np.testing.assert_array_equal(b.to_host(), [0, 1, 9, 9])
    with pytest.raises(TypeError, match=r"^host_kernel needs a callable, got 3$"):
        sm.host_kernel(3)
    assert repr(k) == f"<host_kernel {k.__qualname__}>" and k.__qualname__.endswith(".k")


def test_launch_on_a_foreign_stream_the_host_cannot_borrow(host, monkeypatch):
    class ForeignStream:
        def __cuda_stream__(self):
            return (0, 5)  # (a made-up handle: never given to a driver)

    # the host as the default device, also where CUDA is usable (there a made-up handle would
    # be borrowed as a CUDA stream -- and crash the driver at its first use)
    monkeypatch.setattr(sm_device, "default_device", lambda: host)
    b = sm.Buffer.zeros(4, device=host)
    sm.synchronize()
    before = sm.stats()
    with pytest.raises(sm.DeviceMismatchError, match=r"^Stream\.from_external\(<.*ForeignStream "
                                                     r"object at .*>\) needs a CUDA device; "
                                                     r"<Device host> has no foreign streams \(pass a Stream "
                                                     r"of it -- dev\.create_stream\(\), "
                                                     r"dev\.default_stream -- or stream=None\)$"):
        sm.launch(saxpy, 1, 1, b, stream=ForeignStream())
    assert sm.stats().submitted == before.submitted and not b.allocation.tracker


def test_a_callback_error_raises_at_the_next_launch_before_it_submits(host):
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    ran = []

    @sm.host_kernel
    def mark(x):
        ran.append(1)

    f1 = sm.launch(mark, 1, 1, b, stream=s)
    f1.add_done_callback(lambda f: 1 / 0)
    assert sm.launch(mark, 1, 1, b, stream=s).then(lambda v: "ok").result(5) == "ok"
    from sharedmem.runtime.state import RUNTIME
    before = RUNTIME.submitted  # (sm.stats() would raise the callback's error itself)
    with pytest.raises(ZeroDivisionError):
        sm.launch(mark, 1, 1, b, stream=s)
    assert RUNTIME.submitted == before and ran == [1, 1]
    sm.launch(mark, 1, 1, b, stream=s).result(5)  # reported once
    assert ran == [1, 1, 1]


def test_kernels_without_arrays_or_stream_run_on_a_device_of_their_kind(monkeypatch):
    import sys
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, False)
    monkeypatch.setattr(sys.modules["sharedmem.device"], "_default", dev)
    assert sm.default_device() is dev
    seen = []
    k = sm.host_kernel(lambda: seen.append(threading.current_thread().name))
    fut = sm.launch(k, 1, 1)  # the default device is CUDA: a host kernel runs on the host
    fut.result(5)
    assert fut.stream is sm.Device.host().default_stream and len(seen) == 1


def test_a_kernel_finalizer_registering_an_adapter_is_refused_not_deadlocked(host):
    """register_kernel_adapter clears the plan caches under the registry's lock; a kernel
    that dies there and whose finalizer calls it again gets SharedMemError, not a deadlock."""
    from sharedmem.launch import _reg_lock
    seen = []

    class Dying(_PreparedKernel):
        def __del__(self):
            try:
                sm.register_kernel_adapter(_PreparedKernel, _PreparingAdapter())
            except sm.SharedMemError as e:
                seen.append(str(e))

    b = sm.Buffer.zeros(4, device=host)
    sm.launch(Dying(lambda args: None), 1, 1, b).result(5)
    sm.synchronize()
    sm.register_kernel_adapter(_PreparedKernel, _PreparingAdapter())  # the plan (and kernel) go
    assert seen == ["sharedmem was called from a finalizer (__del__ or a weakref callback) that "
                    "interrupted the kernel adapter registry on the same thread; that call would "
                    "deadlock. Do the work later (queue it for another thread)."]
    assert not _reg_lock.locked()
    sm.launch(_PreparedKernel(lambda args: None), 1, 1, b).result(5)  # the registry works on


class _InterruptedKernel:
    """A kernel whose enqueue is interrupted after it queued its work (as a signal handler's
    KeyboardInterrupt can land between a host stream queueing the task and returning)."""

    __name__ = "interrupted"

    def __init__(self, task):
        self.task = task


class _InterruptedAdapter(sm.KernelAdapter):
    name = "interrupted kernel"
    device_kinds = ("host",)

    def prepare(self, kernel, grid, block, args, shared_mem, stream):
        def enqueue():
            stream._impl.submit(kernel.task, True)  # queued...
            raise KeyboardInterrupt("simulated Ctrl-C")  # ...and interrupted before returning
        return enqueue, ()


sm.register_kernel_adapter(_InterruptedKernel, _InterruptedAdapter())


def test_an_interrupt_inside_the_enqueue_leaves_the_work_leased(host):
    """An interrupt inside a launch's enqueue, after the backend queued the work, raised with no
    lease taken: the work ran on memory the caller could drop and the pool hand out again (a
    review reproduced it on the host stream's queue, the zeroed buffer allocated next read
    666s). The launch still raises the interrupt, and the arguments are leased until the
    stream passes that point, as the work's would have been; a launch that fails with an
    Exception (the backend enqueued nothing) still takes no lease."""
    import threading
    import weakref

    from conftest import gc_collect_harder
    s = host.create_stream()
    b = sm.Buffer.zeros(1024, "int32", device=host, stream=s)
    s.synchronize()
    gate = threading.Event()
    arr = {}

    def task():
        gate.wait(10)
        arr["seen"] = True

    before = sm.stats().submitted
    with pytest.raises(KeyboardInterrupt, match="simulated"):
        sm.launch(_InterruptedKernel(task), 1, 1, sm.Out(b), stream=s)
    assert sm.stats().submitted == before + 1  # its lease, filed
    alloc = weakref.ref(b.allocation)
    del b
    gc_collect_harder()
    assert alloc() is not None  # kept while the work may run
    gate.set()
    s.synchronize()
    gc_collect_harder()
    assert arr == {"seen": True} and alloc() is None


def test_a_dropped_host_kernel_and_what_it_closes_over_are_not_kept(host):
    """The plan cache kept every launched kernel alive (up to 1024), and what its function
    closes over: a kernel closing over a view kept that view live, and the buffer could not
    be moved (AliasError) though the user held nothing. A host kernel keeps its own plan."""
    import weakref

    from conftest import gc_collect_harder
    buf = sm.Buffer.zeros(16, "float32", device=host)

    def make(view):
        @sm.host_kernel
        def k(x):
            x[:] = len(view)
        return k
    k = make(buf[:4])
    out = sm.Buffer.zeros(4, "float32", device=host)
    sm.launch(k, 1, 1, sm.Out(out)).result()
    assert out.to_host().tolist() == [4.0] * 4
    gone = weakref.ref(k.fn)
    del k
    sm.synchronize()
    gc_collect_harder()
    assert gone() is None
    sm.Tensor.from_buffer(buf, (4, 4))  # (no alias left)


def test_a_view_given_as_stream_is_no_stream(host):
    """A sharedmem view (or box) has a ``ptr``, which is how a CuPy stream names its handle:
    given as ``stream=`` it was borrowed as a foreign stream -- on CUDA its device address
    became a CUstream handle given to the driver; on the host a DeviceMismatchError said the
    host has no foreign streams. It is no stream at all: a TypeError, nothing leased."""
    s = host.create_stream()
    b = sm.Buffer.zeros(4, device=host, stream=s)
    s.synchronize()
    before = sm.stats().submitted
    for bad in (b, b[0:2], sm.Tensor.from_buffer(sm.Buffer.zeros(4, device=host), (4,)),
                sm.DeviceBox(1.0, device=host), np.zeros(3)):
        sm.synchronize()
        before = sm.stats().submitted
        with pytest.raises(TypeError, match=r"^cannot use .* as a stream: it is an array, not "
                                            r"a stream; give a sharedmem\.Stream"):
            sm.launch(saxpy, 1, 1, 1.0, b, b, b, stream=bad)
        assert sm.stats().submitted == before
        with pytest.raises(TypeError, match=r"it is an array, not a stream"):
            sm.Stream.from_external(bad)
        with pytest.raises(TypeError, match=r"^Stream\.wait takes an Event or a stream"):
            s.wait(bad)
    assert not b.allocation.tracker


class _PlannedKernel:
    """A kernel type whose adapter's plan() returns ``made[0]``."""

    __name__ = "planned"


class _PlanningAdapter(sm.KernelAdapter):
    name = "planning kernel"
    device_kinds = ("host",)
    made = [None]

    def plan(self, kernel, device):
        return self.made[0](kernel, self, device)


sm.register_kernel_adapter(_PlannedKernel, _PlanningAdapter())


def test_a_plan_that_is_no_kernel_plan_for_the_device_is_refused(host):
    """What an adapter's plan() returns is checked once, as it is made: None crashed the
    compiled build (a NULL read through its typed local), anything else not a KernelPlan was
    an AttributeError (interpreted) or Cython's "Cannot convert" (compiled), and a plan that
    skipped KernelPlan.__init__ (its device not the one asked) an AttributeError or a
    TypeError about NoneType. Nothing is leased."""
    from sharedmem.launch import KernelPlan

    class NoInit(KernelPlan):
        __slots__ = ()

        def __init__(self, kernel, adapter, device):
            pass  # (forgets KernelPlan.__init__)

    s = host.create_stream()
    b = sm.Buffer.zeros(4, device=host, stream=s)
    s.synchronize()
    before = sm.stats().submitted
    for made, got in ((lambda k, a, d: None, "None"),
                      (lambda k, a, d: object(), "a value of type object"),
                      (lambda k, a, d: 5, "a value of type int"), (NoInit, "a NoInit for None")):
        _PlanningAdapter.made[0] = made
        with pytest.raises(sm.KernelError, match=rf"^the planning kernel adapter's plan\(\) "
                                                 rf"returned {got}, not a sharedmem\.launch\."
                                                 rf"KernelPlan for <Device host>"):
            sm.launch(_PlannedKernel(), 1, 1, sm.In(b), stream=s)
    assert sm.stats().submitted == before and not b.allocation.tracker


class _CoercedKernel:
    """A kernel type whose adapter's coerce() returns ``made[0](obj)``."""

    __name__ = "coerced"


class _CoercingAdapter(sm.KernelAdapter):
    name = "coercing kernel"
    device_kinds = ("host",)
    made = [None]

    def coerce(self, obj, device):
        return self.made[0](obj)

    def prepare(self, kernel, grid, block, args, shared_mem, stream):
        return (lambda: stream._impl.submit(lambda: None, True)), ()


sm.register_kernel_adapter(_CoercedKernel, _CoercingAdapter())


def test_what_coerce_returns_is_a_lease_a_view_or_none(host):
    """An adapter's coerce() returning something else -- a string, an array, a DeviceBox --
    was taken for a view: compiled, Cython's "Cannot convert str to View"; interpreted, an
    AttributeError about _token. Both builds now say which argument, which adapter and what
    it may return; nothing is leased."""
    s = host.create_stream()
    b = sm.Buffer.zeros(4, device=host, stream=s)
    box = sm.DeviceBox(1.0, device=host)
    sm.synchronize()
    before = sm.stats().submitted

    class Foreign:
        pass
    for made, got in ((lambda o: "x", "str"), (lambda o: np.zeros(2), "ndarray"),
                      (lambda o: box, "DeviceBox"), (lambda o: (b,), "tuple")):
        _CoercingAdapter.made[0] = made
        with pytest.raises(sm.KernelError, match=rf"^argument 1: the coercing kernel adapter's "
                                                 rf"coerce\(\) returned a value of type {got} "
                                                 rf"for a test_launch.Foreign; it must return a LaunchArg, "
                                                 rf"a ForeignArray, a sharedmem view or None$"):
            sm.launch(_CoercedKernel(), 1, 1, sm.In(b), sm.In(Foreign()), stream=s)
    assert sm.stats().submitted == before and not b.allocation.tracker
    _CoercingAdapter.made[0] = lambda o: b[0:2]  # (a view: fine)
    sm.launch(_CoercedKernel(), 1, 1, sm.In(b), sm.In(Foreign()), stream=s).result(5)


def test_prepare_returns_enqueue_and_keep_and_enqueue_its_marker(host):
    """prepare() must return ``(enqueue, keep)``: None or a 1-tuple was a bare TypeError or
    IndexError from inside the launch. And enqueue() must return its work's completion marker:
    one returning None was filed as a submission with no marker -- the launch raised an
    AttributeError after its leases were taken, and every later sweep (sm.stats(),
    sm.synchronize(), the exit) raised one too, for good. Now a KernelError; the work enqueue
    may have put on the stream is leased until the stream passes that point, as for an
    interrupt (see test_an_interrupt_inside_the_enqueue_leaves_the_work_leased)."""
    import weakref

    from conftest import gc_collect_harder
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    s.synchronize()
    before = sm.stats().submitted
    # (a keep that is no tuple or list -- None -- raised TypeError "Value after * must be an
    # iterable" from inside launch)
    for bad, got in ((None, "None"), ((lambda: None,), "a value of type tuple"),
                     ((5, ()), "a value of type tuple"),
                     ((lambda: None, None), "a value of type tuple")):
        with pytest.raises(sm.KernelError, match=rf"^the preparing kernel adapter's prepare\(\) "
                                                 rf"returned {got}; it must return \(enqueue, "
                                                 rf"keep\): a callable that enqueues the work and "
                                                 rf"returns its completion marker, and what the "
                                                 rf"work keeps$"):
            sm.launch(_PreparedKernel(lambda args: None, bad), 1, 1, sm.Out(b), stream=s)
    assert sm.stats().submitted == before and not b.allocation.tracker
    ran = threading.Event()

    def enqueue_no_marker():
        s._impl.submit(ran.set, True)  # (the work is queued, its marker dropped)
    with pytest.raises(sm.KernelError, match=r"^preparing kernel prepared on <Stream .*>: its "
                                             r"enqueue returned None, not the completion marker "
                                             r"of the work"):
        sm.launch(_PreparedKernel(lambda args: None, (enqueue_no_marker, ())), 1, 1, sm.Out(b),
                  stream=s)
    assert ran.wait(5)
    alloc = weakref.ref(b.allocation)
    del b
    sm.synchronize()  # (raised AttributeError: the submission had no marker)
    gc_collect_harder()
    assert sm.stats().in_flight == 0 and alloc() is None


class _LentMarker:
    """A marker's attributes, through the instance (``query`` of its class: none)."""

    def __init__(self, marker):
        self.marker = marker

    def __getattr__(self, name):
        if name == "query" and self.marker is None:
            raise AttributeError(name)
        return getattr(self.marker, name)

    def __repr__(self):
        return f"Lent({self.marker!r})"


class _PropertyMarker(_LentMarker):
    """As _LentMarker, but ``query`` a property of its class, which may find none."""

    @property
    def query(self):
        return self.marker.query


@pytest.mark.parametrize("lent", [_LentMarker, _PropertyMarker])
def test_a_marker_without_query_is_refused_after_markers_that_had_one(host, lent):
    """The check of an enqueue's marker remembers the last marker class whose every instance
    has ``query`` (a launch then skips the attribute lookup): a class that has it through its
    instances alone, or through a property (or a slot) of the class, is not remembered -- one
    of its markers may have none -- so such a marker is still refused at its launch (accepted,
    the stream's sweeps failed on it ever after: to_host, stats(), synchronize())."""
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    s.synchronize()
    for _ in range(2):  # (a marker of the backend's class: remembered)
        sm.launch(_PreparedKernel(lambda args: None), 1, 1, sm.Out(b), stream=s).result(5)
    for _ in range(2):  # (markers of the class under test that have query)
        sm.launch(_PreparedKernel(lambda args: None,
                                  (lambda: lent(s._impl.submit(lambda: None, True)), ())),
                  1, 1, sm.Out(b), stream=s).result(5)
    with pytest.raises(sm.KernelError, match=r"^preparing kernel prepared on <Stream .*>: its "
                                             r"enqueue returned Lent\(None\), not the "
                                             r"completion marker of the work"):
        sm.launch(_PreparedKernel(lambda args: None, (lambda: lent(None), ())), 1, 1,
                  sm.Out(b), stream=s)
    sm.synchronize()
    assert b.to_host().tolist() == [0, 0, 0, 0]


def test_an_object_whose_class_says_devicebox_is_leased_as_one_in_both_builds(host):
    """An object whose ``__class__`` is DeviceBox (a proxy, Mock(spec=DeviceBox)) passes
    isinstance(): interpreted, launch leased its buffer; compiled, the test by the type alone
    said no and the object went to the kernel as a scalar, unleased (bare) or was refused
    (In(...)). Both builds now treat it alike: as the DeviceBox it stands for."""
    from unittest import mock
    box = sm.DeviceBox(3, "int32", device=host)
    fake = mock.Mock(spec=sm.DeviceBox)
    fake.buffer = box.buffer
    assert isinstance(fake, sm.DeviceBox)
    got = []

    @sm.host_kernel
    def k(x):
        got.append(type(x))
    sm.launch(k, 1, 1, fake).result(5)
    sm.launch(k, 1, 1, sm.In(fake)).result(5)
    assert got == [np.ndarray, np.ndarray]


def test_host_kernel_arguments_that_do_not_fit_its_parameters_are_refused(host):
    """A host kernel launched with arguments its function cannot take (too few, too many, a
    keyword-only parameter launch cannot pass) was launched: its future failed later with
    HostKernelError, and in a composite op the parts before it ran. errors.md: a KernelError,
    no lease taken -- and an op submits none of its parts."""
    s = host.create_stream()
    b = sm.Buffer.zeros(4, device=host, stream=s)
    s.synchronize()
    ran = []

    @sm.host_kernel
    def two(x, y):
        ran.append(2)

    @sm.host_kernel
    def kw(x, *, n):
        ran.append(3)

    @sm.host_kernel
    def many(x, y=1, *rest):
        ran.append(len(rest))

    before = sm.stats().submitted
    for k, args, says in (
            (two, (b,), r"takes 2 arguments, got 1"),
            (two, (b, 1, 2), r"takes 2 arguments, got 3"),
            (many, (), r"takes at least 1 argument, got 0"),
            (kw, (b,), r"has keyword-only parameter 'n' without a default, which launch\(\) "
                       r"cannot pass")):
        with pytest.raises(sm.KernelError, match=rf"^host kernel .*\.{k.__name__}: it {says}; "
                                                 rf"launch\(\) passes the arguments after "
                                                 rf"block to the function, in order$"):
            sm.launch(k, 1, 1, *args, stream=s)
        with pytest.raises(sm.KernelError, match=says):
            sm.op(two, 1, 1, b, b).and_then(sm.op(k, 1, 1, *args)).submit(s)
    assert sm.stats().submitted == before and ran == [] and not b.allocation.tracker
    sm.launch(many, 1, 1, b, stream=s).result(5)
    sm.launch(many, 1, 1, b, 2, 3, 4, stream=s).result(5)
    sm.launch(sm.host_kernel(print), 1, 1, stream=s).result(5)  # (no signature to read: as is)
    assert ran == [0, 2]


def test_an_adapter_registered_again_plans_host_kernels_launched_before(host):
    """register_kernel_adapter drops every cached plan, so the next launch of any kernel of
    that type plans with the adapter now registered -- except host kernels, which keep their
    plan on themselves: one launched before went on with the old adapter's plan (a kernel
    first launched afterwards got the new one)."""
    from sharedmem.launch import _adapters
    old = _adapters[sm.HostKernel]
    planned = []

    class Counting(type(old)):
        def plan(self, kernel, device):
            planned.append(kernel)
            return super().plan(kernel, device)

    k = sm.host_kernel(lambda: None)
    sm.launch(k, 1, 1).result(5)
    try:
        sm.register_kernel_adapter(sm.HostKernel, Counting())
        sm.launch(k, 1, 1).result(5)
        assert planned == [k] and type(k._plan.adapter) is Counting
    finally:
        sm.register_kernel_adapter(sm.HostKernel, old)
    sm.launch(k, 1, 1).result(5)
    assert k._plan.adapter is old


def test_a_host_leased_arrays_allocation_goes_with_its_launch(host):
    """A NumPy array passed to a host kernel is leased by a token made for the launch, which
    cached its ``(token, mode)`` pair on itself: a cycle that kept the lease's allocation
    registered over the array's bytes after the launch -- until a collection -- while the
    memory went on to other arrays. An array over those bytes and more then found that stale
    allocation, and its whole another: two allocations over one memory, work on them not
    ordered (a writer of ``whole[4:8]`` and a reader of ``whole`` on two streams)."""
    import gc
    import time
    from sharedmem.allocation import lookup_allocation
    buf = bytearray(64)
    first = np.frombuffer(memoryview(buf)[16:32], np.float32)
    addr = first.ctypes.data
    gc.disable()
    try:
        sm.launch(sm.host_kernel(lambda x: None), 1, 1, sm.Out(first),
                  stream=host.create_stream()).result(5)
        sm.synchronize()
        del first
        assert lookup_allocation(host, addr, 16) is None
        whole = np.frombuffer(buf, np.float32)
        seen = []

        def writer(x):
            time.sleep(0.1)
            x.fill(3.0)
        sm.launch(sm.host_kernel(writer), 1, 1, sm.Out(whole[4:8]), stream=host.create_stream())
        sm.launch(sm.host_kernel(lambda y: seen.append(y.tolist())), 1, 1, sm.In(whole),
                  stream=host.create_stream())
        sm.synchronize()
    finally:
        gc.enable()
    assert seen == [[0.0] * 4 + [3.0] * 4 + [0.0] * 8]


@pytest.mark.parametrize("buffer", ["bytearray", "mmap", "shared memory"])
def test_host_kernels_on_arrays_over_parts_of_one_buffer_are_ordered(host, buffer):
    """Two NumPy arrays made over overlapping parts of one buffer (``np.frombuffer``,
    ``np.ndarray(buffer=shm.buf)``: their base is the buffer, no array) were leased as two
    allocations, each over its own bytes: a slow writer of one on a stream and a reader of the
    other on another were not ordered (the reader saw zeros). Both are ranges of the buffer's
    one allocation now, as views of one array are."""
    import mmap
    import time
    if buffer == "shared memory":
        from multiprocessing import shared_memory
        shm = shared_memory.SharedMemory(create=True, size=64)
        buf = shm.buf
    else:
        buf = bytearray(64) if buffer == "bytearray" else mmap.mmap(-1, 64)
    try:
        part = np.frombuffer(memoryview(buf)[16:32], np.float32)
        whole = np.ndarray((16,), np.float32, buffer=buf)
        seen = []

        def writer(x):
            time.sleep(0.1)
            x.fill(3.0)
        sm.launch(sm.host_kernel(writer), 1, 1, sm.Out(part), stream=host.create_stream())
        sm.launch(sm.host_kernel(lambda y: seen.append(y.tolist())), 1, 1, sm.In(whole),
                  stream=host.create_stream())
        sm.synchronize()
        assert seen == [[0.0] * 4 + [3.0] * 4 + [0.0] * 8]
        del part, whole
    finally:
        if buffer == "shared memory":
            del buf
            shm.close()
            shm.unlink()


def test_a_foreign_arrays_cached_lease_pairs_follow_its_token_in_both_builds(host):
    """A ForeignArray caches the lease pairs launches take (``use_r``/``use_w``): a launch
    leases the token it holds now -- not the one a first launch cached, where its adapter
    re-set ``token`` since -- and, interpreted as compiled, a subclass whose ``__init__`` sets
    the documented fields without running ForeignArray's is leased (its pairs' slots unset)."""
    import weakref

    from sharedmem.launch import ForeignArray, KernelAdapter, resolve_args

    class Arr:
        pass

    class Kernel:
        pass

    class Adapter(KernelAdapter):
        name = "test kernel"
        device_kinds = ("host",)

        def coerce(self, obj, device):
            return obj.fa if isinstance(obj, Arr) else None

        def prepare(self, kernel, grid, block, args, shared_mem, stream):
            return (lambda: stream._impl.submit(lambda: None, True)), ()

    class OwnForeignArray(ForeignArray):
        def __init__(self, tok, arr):
            self.token, self.offset, self.ref, self.keep = tok, 0, weakref.ref(arr), None

    a, b = sm.Buffer.zeros(4, device=host), sm.Buffer.zeros(4, device=host)
    arr = Arr()
    arr.fa = fa = ForeignArray()
    fa.token = a._token
    fa.ref = weakref.ref(arr)
    adapter = Adapter()
    for intent in (sm.Out, sm.In):
        fa.token = a._token
        assert resolve_args(adapter, (intent(arr),), None)[1][0][0] is a._token
        fa.token = b._token  # (the array's bytes are b's now)
        assert resolve_args(adapter, (intent(arr),), None)[1][0] == (b._token,
                                                                     intent is sm.Out)
    arr.fa = OwnForeignArray(a._token, arr)
    assert resolve_args(adapter, (sm.Out(arr),), None)[1] == [(a._token, True)]
    sm.register_kernel_adapter(Kernel, adapter)
    sm.launch(Kernel(), 1, 1, sm.Out(arr), stream=host.default_stream).result(5)
    del arr, fa


def test_scalar_arguments_pass_through_resolution_as_they_are(host):
    """Python and NumPy scalars (every NumPy scalar type, and a subclass of one, which the
    interpreted build does not find by its type) are no array: resolve_args leaves them in
    place and leases nothing; a host kernel is given each one itself."""
    from sharedmem.launch import _adapters, resolve_args

    class MyInt(np.int32):
        pass

    scalars = [3, 2.5, True, None, MyInt(7)]
    for t in sorted(set(np.sctypeDict.values()), key=lambda t: t.__name__):
        if issubclass(t, np.generic) and t not in (np.object_, np.void):
            scalars.append(t(1) if not issubclass(t, (np.datetime64, np.timedelta64)) else
                           t(1, "s"))
    buf = sm.Buffer.zeros(4, device=host)
    args = (*scalars, sm.Out(buf))
    resolved, uses, device, foreign = resolve_args(_adapters[sm.HostKernel], args, None)
    assert resolved[:-1] == list(scalars) and all(r is s for r, s in zip(resolved, scalars))
    assert resolved[-1] is buf and uses == [(buf._token, True)]
    assert device is host and foreign is None
    seen = []
    k = sm.host_kernel(lambda *a: seen.append(a))
    sm.launch(k, 1, 1, MyInt(7), np.float32(1.5), sm.In(buf), stream=host.default_stream).result(5)
    got = seen[0]
    assert type(got[0]) is MyInt and got[0] == 7 and type(got[1]) is np.float32
    np.testing.assert_array_equal(got[2], np.zeros(4, np.float32))
