"""Device operations: op / and_then / zip / apply / submit (host backend)."""

import importlib
import re
import sys
import threading
import time

import numpy as np
import pytest

import sharedmem as sm
from sharedmem.backends.host import HostFault
from host_kernels import fill, add, inc, total


def test_op_submit_is_launch(host):
    s = host.create_stream()
    b = sm.Buffer.zeros(8, "int64", device=host, stream=s)
    o = sm.op(fill, 1, 1, sm.Out(b), 5)
    assert isinstance(o, sm.DeviceOp)
    fut = o.submit(s)
    assert isinstance(fut, sm.DeviceFuture) and fut.stream is s and fut.result(5) is None
    np.testing.assert_array_equal(b.to_host(), np.full(8, 5))
    o.submit(s).result(5)  # an op can be submitted again


def test_and_then_orders_on_one_stream(host):
    a = sm.Buffer.zeros(100, "float64", device=host)
    b = sm.Buffer.zeros(100, "float64", device=host)
    out = sm.Buffer.zeros(100, "float64", device=host)
    box = sm.DeviceBox(0.0, device=host)
    chain = (sm.op(fill, 1, 1, sm.Out(a), 1.5)
             .and_then(sm.op(fill, 1, 1, sm.Out(b), 2.5))
             .and_then(sm.op(add, 1, 1, sm.In(a), sm.In(b), sm.Out(out)))
             .and_then(sm.op(total, 1, 1, sm.In(out), sm.Out(box))))
    fut = chain.submit()  # a stream of the device's pool
    fut.result(5)
    assert box.get() == 400.0
    assert fut.stream.name.startswith("sharedmem-pool-")


def test_zip_runs_branches_on_two_streams_and_joins(host):
    barrier = threading.Barrier(2, timeout=5)

    @sm.host_kernel
    def meet(x, v):
        barrier.wait()  # both branches must run at once, or this times out
        x[:] = v

    a = sm.Buffer.zeros(10, "int32", device=host)
    b = sm.Buffer.zeros(10, "int32", device=host)
    out = sm.Buffer.zeros(10, "int32", device=host)
    s = host.create_stream("main")
    z = sm.zip(sm.op(meet, 1, 1, sm.Out(a), 3), sm.op(meet, 1, 1, sm.Out(b), 4))
    fut = z.and_then(sm.op(add, 1, 1, sm.In(a), sm.In(b), sm.Out(out))).submit(s)
    fut.result(10)
    np.testing.assert_array_equal(out.to_host(), np.full(10, 7))
    assert not barrier.broken


def test_apply_and_zip_values(host):
    a = sm.Buffer.zeros(4, "int32", device=host)
    b = sm.Buffer.zeros(4, "int32", device=host)
    calls = []

    def summarize(_):
        calls.append(1)
        return int(a.to_host().sum())

    o = sm.op(fill, 1, 1, sm.Out(a), 2).apply(summarize)
    fut = o.submit()
    assert fut.result(5) == 8 and fut.result(5) == 8
    assert calls == [1]  # computed exactly once
    z = sm.zip(sm.op(fill, 1, 1, sm.Out(a), 1).apply(lambda _: "a"),
               sm.op(fill, 1, 1, sm.Out(b), 1).apply(lambda _: "b")).apply(lambda ab: ab[0] + ab[1])
    assert z.submit(host.create_stream()).result(5) == "ab"
    bad = sm.op(fill, 1, 1, sm.Out(a), 0).apply(lambda _: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.submit().result(5)


def test_apply_sees_unknown_completion(host):
    @sm.host_kernel
    def boom(x):
        raise HostFault("fault")

    x = sm.Buffer.zeros(2, device=host)
    fut = sm.op(boom, 1, 1, x).apply(lambda v: "never").submit(host.create_stream())
    with pytest.warns(sm.LeakWarning):
        with pytest.raises(sm.CompletionUnknownError):
            fut.result(5)


def test_op_validation():
    with pytest.raises(sm.KernelError, match="does not know how to launch"):
        sm.op(lambda: None, 1, 1)
    with pytest.raises(sm.KernelError, match=r"^zip\(\) needs at least one op$"):
        sm.zip()
    with pytest.raises(TypeError, match="and_then takes a DeviceOp"):
        sm.op(fill, 1, 1).and_then(3)
    with pytest.raises(sm.SharedMemError, match="unknown access policy"):
        sm.op(fill, 1, 1, policy="maybe")


def test_an_op_submitted_again_reuses_its_kernel_plan(host, monkeypatch):
    """The kernel is planned once; every submission still resolves its views, takes its own
    leases and sees moved or released views."""
    L = importlib.import_module("sharedmem.launch")
    from conftest import count_plans
    planned = count_plans(monkeypatch, type(L.adapter_for(inc)))
    monkeypatch.setattr(L, "_plans", {})
    monkeypatch.setattr(L, "_plans_by_device", {})
    monkeypatch.setattr(inc, "_plan", None)  # (a host kernel keeps its own)
    s, t = host.create_stream("s"), host.create_stream("t")
    b = sm.Buffer.zeros(8, "int64", device=host, stream=s)
    o = sm.op(inc, 1, 1, sm.InOut(b))
    futs = [o.submit(s) for _ in range(10)]
    o.submit(t).result(5)  # another stream: ordered after s's writes
    o.submit(s).result(5)
    assert planned == [inc]
    for f in futs:
        f.result(5)
    np.testing.assert_array_equal(b.to_host(), np.full(8, 12))
    tens = sm.Tensor.from_buffer(b, (2, 4))
    with pytest.raises(sm.MovedError, match=r"^this Buffer \(allocation #\d+\) was moved into a Tensor"):
        o.submit(s)
    assert tens.allocation.live_views == 1 and sm.stats().in_flight == 0


def test_an_op_over_foreign_arrays_is_prepared_each_time(host):
    """Views an adapter makes of foreign arrays live for one launch: they are
    never kept by the op (they would count as aliases)."""
    from host_kernels import Foreign, ForeignKernel, _ForeignAdapter
    b = sm.Buffer.zeros(8, "int64", device=host)
    o = sm.op(ForeignKernel(), 1, 1, sm.Out(Foreign(b)))
    s = host.create_stream()
    before = len(_ForeignAdapter.made)
    o.submit(s).result(5)
    o.submit(s).result(5)
    assert len(_ForeignAdapter.made) == before + 2
    np.testing.assert_array_equal(b.to_host(), np.full(8, 7))
    assert b.allocation.live_views == 1


def test_an_op_kept_around_does_not_keep_released_memory(host):
    """Its preparation holds no view tokens: once the user releases the view
    and the work is done, the allocation goes, though the op lives on."""
    import weakref
    from conftest import gc_collect_harder
    s = host.create_stream()
    b = sm.Buffer.zeros(8, "int64", device=host, stream=s)
    o = sm.op(inc, 1, 1, b)
    o.submit(s).result(5)
    alloc = weakref.ref(b.allocation)
    b.release()
    s.synchronize()
    gc_collect_harder()
    assert alloc() is None
    with pytest.raises(sm.ReleasedError):
        o.submit(s)


@pytest.mark.parametrize("compose", ["and_then", "zip", "apply"])
def test_a_composite_op_with_a_bad_argument_submits_no_part(host, compose):
    """An argument error in a later part is found before the first part is submitted:
    resubmitting the whole op after fixing it runs every part once."""
    s = host.create_stream()
    acc = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    x = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    moved = sm.Buffer.zeros(4, "int64", device=host, stream=s)
    t = sm.Tensor.from_buffer(moved, (4,))  # `moved` is moved: a later part names it
    first = sm.op(inc, 1, 1, sm.Out(acc))
    later = sm.op(fill, 1, 1, sm.Out(moved), 7)
    composite = {"and_then": lambda: first.and_then(later),
                 "zip": lambda: sm.zip(first, later),
                 "apply": lambda: sm.zip(first, later.apply(lambda v: v))}[compose]()
    s.synchronize()
    submitted = sm.stats().submitted
    with pytest.raises(sm.MovedError, match=r"^this Buffer \(allocation #\d+\) was moved into a Tensor"):
        composite.submit(s)
    assert sm.stats().submitted == submitted  # no part ran
    s.synchronize()
    np.testing.assert_array_equal(acc.to_host(), np.zeros(4))
    # a read-only view written by a later part: refused the same way
    ro = x.as_readonly()
    submitted = sm.stats().submitted
    with pytest.raises(sm.KernelError, match=r"^argument 0: Out\(.*\) would write through a "
                                             r"read-only view"):
        first.and_then(sm.op(fill, 1, 1, sm.Out(ro), 7)).submit(s)
    assert sm.stats().submitted == submitted
    moved = t.into_buffer()
    fixed = first.and_then(sm.op(fill, 1, 1, sm.Out(moved), 7))
    fixed.submit(s).result(5)
    np.testing.assert_array_equal(acc.to_host(), np.ones(4))  # the first part ran once
    np.testing.assert_array_equal(moved.to_host(), np.full(4, 7))


_SELF_WAIT = (r"^the value of (host kernel fill|zip join) on .+ \(an apply\(\) or zip\(\) "
              r"value\) is waited for by a function it depends on, which cannot return before "
              r"the value is computed(, through a value another thread computes and waits "
              r"for)?: it would wait forever\. Wait for it outside apply\(\)'s functions \(chain "
              r"then\(\) after the future instead\)$")


def test_an_applied_function_waiting_for_its_own_value_fails_instead_of_hanging(host):
    """apply(fn) where fn waits for the future apply() gives -- its own value, or that of an
    apply() or zip() after it, which needs fn's value -- would wait forever: the wait raises
    SharedMemError, which fails the value (before: each wait ran to its timeout)."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    later = []
    given = threading.Event()

    def waits(v):
        assert given.wait(5)
        return later[0].result(timeout=3)

    own = sm.op(fill, 1, 1, b, 1.0).apply(waits).submit()
    later.append(own)
    given.set()
    e = own.exception(10)
    assert type(e) is sm.SharedMemError
    assert re.match(_SELF_WAIT, str(e)), str(e)
    for compose in (lambda a: a.apply(lambda v: v), lambda a: sm.zip(a)):
        later.clear()
        given.clear()
        outer = compose(sm.op(fill, 1, 1, b, 1.0).apply(waits)).submit()
        later.append(outer)
        given.set()
        e = outer.exception(10)  # (fn's error, or the outer wait's: whichever closes it)
        assert type(e) is sm.SharedMemError and re.match(_SELF_WAIT, str(e)), str(e)


def test_a_self_wait_across_two_threads_is_found_too(host):
    """The outer value's computation claimed by another thread (here the test's, in
    result()) that waits for fn's value, while fn waits for the outer value: neither could
    finish. One of the waits raises SharedMemError (which one: whichever thread closes the
    cycle)."""
    b = sm.Buffer.zeros(4, "float32", device=host)
    started, go, later = threading.Event(), threading.Event(), []

    def waits(v):
        started.set()
        assert go.wait(5)
        return later[0].result(timeout=3)

    outer = sm.op(fill, 1, 1, b, 1.0).apply(waits).apply(lambda v: v).submit()
    later.append(outer)
    assert started.wait(5)  # fn runs on a callback worker (the retirer retired the work)
    threading.Timer(0.3, go.set).start()  # once this thread waits for fn's value
    t0 = time.monotonic()
    e = outer.exception(10)
    assert type(e) is sm.SharedMemError and re.match(_SELF_WAIT, str(e)), str(e)
    assert time.monotonic() - t0 < 2.5  # (not a timeout)


def test_a_wait_right_after_computing_a_value_another_thread_waits_for_is_no_self_wait(host):
    """Thread A computes x; thread B computes y, whose function waits for x. A finishes x
    and at once waits for y: no cycle (x is ready, B wakes and computes y). Before, B's
    entry in ops._waiting still named x (B had not got the GIL back yet), x's owner is A,
    and A's wait raised SharedMemError."""
    import sys

    from sharedmem.ops import ComputedFuture

    b = sm.Buffer.zeros(4, "float32", device=host)
    done = sm.launch(fill, 1, 1, b, 1.0)
    done.result(5)  # (retired: a ComputedFuture of it is computed at once, by its maker)
    x_runs, gx, in_y, box = threading.Event(), threading.Event(), threading.Event(), {}

    def fx():
        x_runs.set()
        assert gx.wait(5)
        return 1

    def fy():
        in_y.set()
        return box["x"].result(5) + 1

    def thread_a():
        x = box["x"] = ComputedFuture.__new__(ComputedFuture)
        x.__init__(done._s, fx, ())  # computed here, in A
        try:
            box["a"] = box["y"].result(5)
        except BaseException as e:
            box["a"] = e

    def thread_b():
        y = box["y"] = ComputedFuture.__new__(ComputedFuture)
        y.__init__(done._s, fy, ())  # computed here, in B: waits for x

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.5)  # (B wakes once A lets the GIL go: fails at 5 ms too)
    try:
        ta = threading.Thread(target=thread_a)
        ta.start()
        assert x_runs.wait(5)
        tb = threading.Thread(target=thread_b)
        tb.start()
        assert in_y.wait(5)
        time.sleep(0.1)  # (B waits for x)
        gx.set()
        ta.join(10)
        tb.join(10)
    finally:
        sys.setswitchinterval(old)
    assert box["a"] == 2, box["a"]


def test_op_combinators_check_their_arguments_and_read_back(host):
    b = sm.Buffer.zeros(4, "int64", device=host)
    o = sm.op(inc, 1, 1, b)
    with pytest.raises(TypeError, match=r"^apply takes a callable, got 3$"):
        o.apply(3)
    with pytest.raises(TypeError, match=r"^zip takes DeviceOps, got int$"):
        sm.zip(o, 3)

    class Fn:
        def __call__(self, v):
            return v

    assert repr(o) == "<op host kernel inc>"
    assert repr(o.and_then(o)) == "<op host kernel inc>.and_then(<op host kernel inc>)"
    assert repr(o.apply(len)) == "<op host kernel inc>.apply('len')"
    assert re.fullmatch(r"<op host kernel inc>\.apply\(<.*Fn object at 0x[0-9a-f]+>\)",
                        repr(o.apply(Fn())))
    assert repr(sm.zip(o, o.apply(len))) == ("zip(<op host kernel inc>, "
                                             "<op host kernel inc>.apply('len'))")
    np.testing.assert_array_equal(b.to_host(), np.zeros(4))  # none of these submitted


@pytest.mark.parametrize("default", ["host", "cuda"])
def test_a_composite_op_without_arrays_runs_where_launch_would(host, monkeypatch, default):
    # on the default device where its kernels run there; else (host kernels, a CUDA default
    # device: a GPU machine) on the host, as launch() chooses
    if default == "cuda":
        from fake_cuda import install_fake_devices
        (dev,), drv = install_fake_devices(monkeypatch, False)
        monkeypatch.setattr(sys.modules["sharedmem.device"], "_default", dev)
    else:
        monkeypatch.setattr(sys.modules["sharedmem.device"], "_default", host)
    ran = []
    k = sm.host_kernel(lambda tag: ran.append(tag))
    chain = sm.op(k, 1, 1, "a").and_then(sm.op(k, 1, 1, "b"))
    for o in (chain, sm.zip(chain, sm.op(k, 1, 1, "c")).apply(len)):
        fut = o.submit()
        fut.result(5)
        assert fut.stream.device is host and fut.stream.name.startswith("sharedmem-pool-")
    assert sorted(ran) == ["a", "a", "b", "b", "c"]


def test_a_foreign_stream_the_host_cannot_borrow_submits_nothing(host, monkeypatch):
    class ForeignStream:
        def __cuda_stream__(self):
            return (0, 5)  # (a made-up handle: never given to a driver)

    # the host as the default device, also where CUDA is usable (a made-up handle borrowed as
    # a CUDA stream would crash the driver)
    monkeypatch.setattr(sys.modules["sharedmem.device"], "_default", host)

    b = sm.Buffer.zeros(4, "int64", device=host)
    sm.synchronize()
    before = sm.stats()
    for o in (sm.op(inc, 1, 1, b), sm.op(inc, 1, 1, b).and_then(sm.op(inc, 1, 1, b))):
        with pytest.raises(sm.DeviceMismatchError, match=r"^Stream\.from_external\(.*\) needs a "
                                                         r"CUDA device; <Device host> has no "
                                                         r"foreign streams \(pass a Stream of it -- "
                                                         r"dev\.create_stream\(\), dev\.default_stream "
                                                         r"-- or stream=None\)$"):
            o.submit(ForeignStream())
    assert sm.stats().submitted == before.submitted
    np.testing.assert_array_equal(b.to_host(), np.zeros(4))


def test_a_zip_given_every_pool_stream_gets_a_stream_of_its_own(host, monkeypatch):
    import sharedmem.ops as smo
    s = smo.pool_stream(host)  # (makes the host pool, if no test did)
    monkeypatch.setattr(smo, "POOL_SIZE", 1)  # round robin over one pool stream
    s = smo.pool_stream(host)
    extra = smo.pool_stream(host, avoid=s)
    assert extra is not s and extra.name == "sharedmem-pool-extra"
    x = sm.Buffer.zeros(4, "int64", device=host)
    y = sm.Buffer.zeros(4, "int64", device=host)
    fut = sm.zip(sm.op(inc, 1, 1, x), sm.op(inc, 1, 1, y)).submit(s)
    assert fut.result(5) == (None, None)
    np.testing.assert_array_equal(x.to_host() + y.to_host(), np.full(4, 2))


def test_a_composite_op_with_a_part_its_device_cannot_run_submits_nothing(host, monkeypatch):
    # a part whose kernel does not run on the op's device (a CUDA-only kernel after a host
    # kernel, with no arrays: the op runs on the host, where launch() puts its first kernel)
    # is refused before any part is submitted, as an argument on another device is
    monkeypatch.setattr(sys.modules["sharedmem.device"], "_default", host)

    class CudaOnly(sm.KernelAdapter):
        name = "cuda-only kernel"
        device_kinds = ("cuda",)

    class K:
        pass

    sm.register_kernel_adapter(K, CudaOnly())
    ran = []
    k = sm.host_kernel(lambda tag: ran.append(tag))
    b = sm.Buffer.zeros(4, "int64", device=host)
    sm.synchronize()
    before = sm.stats()
    for o in (sm.op(k, 1, 1, "a").and_then(sm.op(K(), 1, 1)),
              sm.zip(sm.op(k, 1, 1, "a"), sm.op(K(), 1, 1)),
              sm.op(inc, 1, 1, b).and_then(sm.op(K(), 1, 1)).apply(len)):
        with pytest.raises(sm.DeviceMismatchError, match=r"^a cuda-only kernel cannot run on "
                                                         r"<Device host>; it runs on cuda "
                                                         r"devices$"):
            o.submit()
    sm.synchronize()
    assert ran == [] and sm.stats().submitted == before.submitted
    np.testing.assert_array_equal(b.to_host(), np.zeros(4))


def test_and_then_fails_with_the_first_parts_error(host):
    """``a.and_then(b)`` returned ``b``'s future: where ``a``'s host kernel raised, ``result()``
    gave None and the failure surfaced only as a "never retrieved" ERROR log later. The
    chain's future now raises ``a``'s HostKernelError (``b`` ran: the stream runs on), and a
    chain whose parts succeed has ``b``'s value."""
    s = host.create_stream()
    b = sm.Buffer.zeros(4, "int32", device=host, stream=s)
    ran = []

    @sm.host_kernel
    def bad(x):
        raise ValueError("first part failed")

    @sm.host_kernel
    def second(x):
        ran.append(1)
        x[:] = 7

    fut = sm.op(bad, 1, 1, b).and_then(sm.op(second, 1, 1, b)).submit(stream=s)
    with pytest.raises(sm.HostKernelError) as info:
        fut.result(timeout=10)
    assert isinstance(info.value.__cause__, ValueError)
    assert str(info.value.__cause__) == "first part failed"
    assert isinstance(fut.exception(), sm.HostKernelError)
    assert ran == [1]
    np.testing.assert_array_equal(b.to_host(stream=s), [7, 7, 7, 7])
    ok = sm.op(second, 1, 1, b).and_then(sm.op(second, 1, 1, b).apply(lambda _: "done"))
    assert ok.submit(stream=s).result(timeout=10) == "done"
    assert ran == [1, 1, 1]


def test_an_apply_after_other_parts_onto_a_capturing_stream_records_nothing(host):
    """An apply() cannot be captured: a composite op whose apply() came after other parts
    recorded those parts into the graph before it raised -- each replay ran them."""
    x = sm.Buffer.zeros(4, "int64", device=host)
    s = host.create_stream("cap")
    msg = r"^apply\(\) cannot be captured into a graph: its host function would run once at " \
          r"capture, not at each replay$"
    with sm.capture(s) as g:
        with pytest.raises(sm.CaptureError, match=msg):
            sm.op(inc, 1, 1, x).and_then(sm.op(inc, 1, 1, x).apply(int)).submit(s)
        with pytest.raises(sm.CaptureError, match=msg):
            sm.zip(sm.op(inc, 1, 1, x), sm.op(inc, 1, 1, x).apply(int)).submit(s)
    assert g.launches == 0
    g.replay(s).result(10)
    np.testing.assert_array_equal(x.to_host(stream=s), [0, 0, 0, 0])
    # not capturing, a zip's apply() runs on a pool stream as before
    z = sm.zip(sm.op(inc, 1, 1, x), sm.op(inc, 1, 1, sm.Buffer.zeros(1, "int64", device=host))
               .apply(lambda _: "v"))
    assert z.submit(s).result(10) == (None, "v")
