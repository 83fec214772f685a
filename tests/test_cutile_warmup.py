"""cuTile's first-launch compile happens before the launch takes the core lock
(interop.cutile.TilePlan.warm): a warmed signature never compiles again under the lock,
whatever its arguments (fresh tuples and strings at reused addresses, -0.0, runtime scalars,
two threads at once), and no capture is open meanwhile. The fake cuTile's own compile key
(tests/fake_cuda.fake_cutile) compares scalars by ==; where real cuTile keys differently
(float constants by bit pattern, non-Constant scalars by type only) a wrapper below models
cuTile's key from its cext/tile_kernel.cpp.
"""

import struct
import sys
import threading
import types

import numpy as np
import pytest

import sharedmem as sm

from test_cuda_backend_fake import fake, tile  # noqa: F401  (fixtures)


def _setup(dev):
    n = 16
    a = sm.Tensor.from_host(np.arange(n, dtype=np.float32), device=dev)
    c = sm.Tensor.zeros((n,), "float32", device=dev)
    s = dev.create_stream("tile")
    sm.synchronize()
    return a, c, s


def _owners(mod):
    """compile_hook recording RUNTIME.owner (0: core lock free) per compile."""
    from sharedmem.runtime.state import RUNTIME
    owners = []
    mod.compile_hook = lambda kernel: owners.append(RUNTIME.owner)
    return owners


def _cutile_keyed(mod, constant_params=None):
    """Replace the fake's compile key by real cuTile's (tile_kernel.cpp): float Constants by
    bit pattern (extract_float_constant), strings by interned value, tuples expanded
    (aggregates), non-Constant bool/int/float by type only (extract_py_long/_float: runtime
    arguments); arrays by dtype/ndim/specialization bits (approximated by the exact layout,
    finer than cuTile: fine for these tests)."""
    from sharedmem.runtime.state import RUNTIME
    orig = mod.launch
    seen, owners = set(), _Log()

    def key_of(i, a):
        if hasattr(a, "__cuda_array_interface__"):
            cai = a.__cuda_array_interface__
            return ("array", cai["typestr"], cai["shape"], cai["strides"], cai["data"][0] % 16)
        if type(a) is tuple:
            return ("tuple",) + tuple(key_of(i, x) for x in a)
        const = constant_params is None or i in constant_params
        if type(a) is float:
            return (float, struct.pack("<d", a) if const else None)
        if type(a) in (int, bool):
            return (type(a), a if const else None)
        if type(a) is str:
            return (str, a.encode())  # (the value, without keeping the object)
        return (type(a), a)

    def launch(stream, grid, kernel, args):
        if 0 in grid:
            owners.warmups += 1
        key = (id(kernel),) + tuple(key_of(i, a) for i, a in enumerate(args))
        if key not in seen:
            owners.append(RUNTIME.owner)
            seen.add(key)
        mod.compile_hook = None
        return orig(stream, grid, kernel, args)
    mod.launch = launch
    return owners


class _Log(list):
    warmups = 0


def _kernel():
    from fake_cuda import TileKernel

    def k(a, c, x):
        c[:] = a
    return TileKernel(k)


class _Sink(list):
    """The fake's own compile log, holding nothing (it would keep the argument alive)."""

    def __contains__(self, x):
        return True


def _at(addr, make):
    """``make()`` until CPython hands out an object at ``addr`` (its free lists: quickly)."""
    for _ in range(10000):
        x = make()
        if id(x) == addr:
            return x
        del x
    return make()  # (nothing freed it: then no collision to fear either)


def _settle():
    import gc
    sm.synchronize()
    gc.collect()


def _keyed(fake, tile, sink=False):
    """A keyed-compile case: ``(args a, c, stream s, kernel, owners)`` -- ``owners`` logs the
    core lock's owner at each compile (see _cutile_keyed); ``sink``: the fake's compile log
    keeps nothing alive (for cases that recycle an argument's address)."""
    dev, _ = fake
    mod, _ = tile
    a, c, s = _setup(dev)
    kern = _kernel()
    owners = _cutile_keyed(mod)
    if sink:
        mod.compiled = _Sink()
    return a, c, s, kern, owners


def test_a_fresh_tuple_at_a_reused_address_is_warmed(fake, tile):
    """A new tuple of other contents at a recycled address (the common case for a tuple made
    per call) is another signature: cuTile expands tuples and keys on their items."""
    a, c, s, kern, owners = _keyed(fake, tile, sink=True)
    t = tuple([1, 2])
    addr = id(t)
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), t, stream=s).result()
    _settle()
    del t
    t = _at(addr, lambda: tuple([3, 4]))
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), t, stream=s).result()
    assert owners == [0, 0], owners


def test_a_fresh_string_at_a_reused_address_is_warmed(fake, tile):
    """Same with a str Constant, which cuTile keys by value: a "mode-b" at the address of a
    dead "mode-a" is another signature."""
    a, c, s, kern, owners = _keyed(fake, tile, sink=True)
    first = sys.intern("".join(["mode-", "a" * 600]))  # (kept, as cuTile's constant_refs do)
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), first, stream=s).result()
    m = "".join(["mode-", "a" * 600])  # equal, not interned, another object
    addr = id(m)
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), m, stream=s).result()
    assert owners == [0]  # (cuTile: the same kernel)
    _settle()
    del m
    m = _at(addr, lambda: "".join(["mode-", "b" * 600]))
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), m, stream=s).result()
    assert owners == [0, 0], owners


def test_negative_zero_float_constant_is_another_signature(fake, tile):
    """cuTile keys a float Constant by its bits (extract_float_constant), and -0.0 == 0.0."""
    a, c, s, kern, owners = _keyed(fake, tile)
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), 0.0, stream=s).result()
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), -0.0, stream=s).result()
    assert owners == [0, 0], owners


def test_runtime_scalars_do_not_use_up_the_warm_budget(fake, tile):
    """A non-Constant scalar (a step counter, a learning rate, a fresh NaN) is a runtime
    argument to cuTile: its value compiles nothing, so it makes no warm-up (else WARM_MAX
    launches with as many values would use up the budget, and the next new signature --
    another shape -- would compile under the lock)."""
    import interop.cutile as icu
    dev, drv = fake
    mod, _ = tile
    a, c, s = _setup(dev)
    kern = _kernel()
    # (x is not a Constant: as real cuTile kernels say, in _annotated_function)
    leaf = types.SimpleNamespace(constant=False)
    kern._annotated_function = types.SimpleNamespace(parameter_annotations=(leaf,) * 3)
    owners = _cutile_keyed(mod, constant_params=set())
    for step in range(icu.WARM_MAX):
        sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), float("nan"), stream=s).result()
    assert owners == [0]  # cuTile compiled once
    assert owners.warmups == 1, owners.warmups
    a2 = sm.Tensor.from_host(np.arange(32, dtype=np.float32), device=dev)
    c2 = sm.Tensor.zeros((32,), "float32", device=dev)
    sm.launch(kern, (1,), None, sm.In(a2), sm.Out(c2), 1.0, stream=s).result()
    assert owners == [0, 0], owners


def test_a_second_thread_with_the_same_new_signature_waits_for_its_compile(fake, tile):
    """A second thread launching a signature another thread is compiling waits for that
    compile (outside the lock) instead of skipping the warm-up: cuTile has no in-progress
    entry, and its launch would compile again there, under the core lock, for seconds."""
    from sharedmem.runtime.state import RUNTIME
    dev, drv = fake
    mod, _ = tile
    a, c, s = _setup(dev)
    c2 = sm.Tensor.zeros((16,), "float32", device=dev)
    s2 = dev.create_stream("tile2")
    kern = _kernel()
    compiles = []
    in_a = threading.Event()
    b_done = threading.Event()

    def hook(kernel):
        compiles.append((threading.current_thread().name, RUNTIME.owner))
        if threading.current_thread().name == "A":
            in_a.set()
            b_done.wait(1)  # (A's compile takes a while; B arrives meanwhile)
    mod.compile_hook = hook

    def run_a():
        sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), 2, stream=s).result()

    def run_b():
        in_a.wait(5)
        try:
            sm.launch(kern, (1,), None, sm.In(a), sm.Out(c2), 2, stream=s2).result()
        finally:
            b_done.set()
    ta = threading.Thread(target=run_a, name="A")
    tb = threading.Thread(target=run_b, name="B")
    ta.start(), tb.start()
    ta.join(10), tb.join(10)
    assert compiles == [("A", 0)], compiles


def test_no_capture_is_open_while_the_kernel_compiles(fake, tile):
    """No stream capture is open while the kernel compiles (seconds, with every other thread
    running on): CUDA forbids synchronizing 'a broader handle which encompasses an active
    stream capture, such as a device or context handle' (Programming Guide, Prohibited and
    Unhandled Operations), so another thread's torch.cuda.synchronize() would fail."""
    dev, drv = fake
    mod, _ = tile
    a, c, s = _setup(dev)
    kern = _kernel()
    open_during_compile = []
    mod.compile_hook = lambda kernel: open_during_compile.append(dict(drv.capturing))
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), 2, stream=s).result()
    assert open_during_compile == [{}], open_during_compile


def test_a_launch_from_inside_the_compile_does_not_wait_for_itself(fake, tile):
    """A launch of the same new signature on the thread that is compiling it (a finalizer run
    by a collection during the compile) goes on -- it compiles itself, as without the warm-up
    -- instead of waiting for its own compile forever."""
    dev, drv = fake
    mod, _ = tile
    a, c, s = _setup(dev)
    kern = _kernel()
    inner = []

    def hook(kernel):
        if not inner:
            inner.append(1)
            sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), 7, stream=s).result()
            inner.append(2)
    mod.compile_hook = hook
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), 7, stream=s).result()
    assert inner == [1, 2]
    mod.compile_hook = None


def test_an_unhashable_kernel_is_planned_and_warmed_once_per_signature(fake, tile, monkeypatch):
    """A kernel object that cannot be hashed (its class defines __eq__ only) keeps its plan,
    by identity, as a hashable one does: one plan, one warm-up per signature -- not a fresh
    plan, with an empty warm-up table, at every launch."""
    import interop.cutile as icu
    from conftest import count_plans
    from fake_cuda import TileKernel
    dev, _ = fake
    mod, _ = tile
    a, c, s = _setup(dev)

    class Unhashable(TileKernel):
        def __eq__(self, other):
            return self is other

    def k(a, c, x):
        c[:] = a
    kern = Unhashable(k)
    planned = count_plans(monkeypatch, icu.TileKernelAdapter)
    owners = _cutile_keyed(mod)
    for _ in range(3):
        sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), 7, stream=s).result()
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), 8, stream=s).result()
    assert owners == [0, 0], owners
    assert owners.warmups == 2, owners.warmups
    assert planned == [kern]


def test_a_signature_that_does_not_compile_fails_before_the_lock_at_every_launch(fake, tile):
    """A warm-up whose compile fails (cuTile's TileError) does not mark the signature warmed:
    cuTile keeps no failed compile, so the launch after it would compile again under the core
    lock -- at every launch. The error is raised by the warm-up, before any lease, and the
    next launch compiles (and fails) there again; once the kernel compiles, it runs."""
    from sharedmem.runtime.state import RUNTIME
    dev, _ = fake
    mod, _ = tile
    a, c, s = _setup(dev)
    kern = _kernel()
    mod.TileError = type("TileError", (Exception,), {})
    bad = type("TileTypeError", (mod.TileError,), {})
    owners = []

    def hook(kernel):
        owners.append(RUNTIME.owner)
        raise bad("cannot infer the type of x")
    mod.compile_hook = hook
    for _ in range(2):
        with pytest.raises(bad, match="cannot infer"):
            sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), 2, stream=s)
        assert sm.stats().in_flight == 0  # (no lease taken, nothing enqueued)
    assert owners == [0, 0], owners  # (each compile outside the lock: its owner none)
    mod.compile_hook = owners.append
    sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), 2, stream=s).result()
    assert np.array_equal(c.to_host(), np.arange(16, dtype=np.float32))
    assert len(owners) == 3  # (compiled once more, by the warm-up; the launch found it)


def test_threads_waiting_on_a_failed_compile_compile_it_themselves(fake, tile):
    """A thread that waited for another thread's compile of the same signature, which failed,
    compiles it itself (outside the lock) rather than launching into a compile under it."""
    from sharedmem.runtime.state import RUNTIME
    dev, _ = fake
    mod, _ = tile
    a, c, s = _setup(dev)
    c2 = sm.Tensor.zeros((16,), "float32", device=dev)
    s2 = dev.create_stream("tile2")
    kern = _kernel()
    mod.TileError = type("TileError", (Exception,), {})
    in_a, b_waits = threading.Event(), threading.Event()
    compiles, errors = [], []

    def hook(kernel):
        compiles.append((threading.current_thread().name, RUNTIME.owner))
        if threading.current_thread().name == "A":
            in_a.set()
            b_waits.wait(1)
        raise mod.TileError("no")
    mod.compile_hook = hook

    def run(name, out, stream):
        if name == "B":
            in_a.wait(5)
            threading.Timer(0.2, b_waits.set).start()  # (B is in its wait by then)
        try:
            sm.launch(kern, (1,), None, sm.In(a), sm.Out(out), 2, stream=stream)
        except mod.TileError as e:
            errors.append((name, str(e)))
    ts = [threading.Thread(target=run, args=("A", c, s), name="A"),
          threading.Thread(target=run, args=("B", c2, s2), name="B")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert sorted(errors) == [("A", "no"), ("B", "no")]
    assert sorted(compiles) == [("A", 0), ("B", 0)], compiles
    assert sm.stats().in_flight == 0


def test_runtime_tuples_do_not_use_up_the_warm_budget(fake, tile):
    """A tuple passed for a non-Constant parameter is keyed as cuTile keys it, item by item
    (its scalars by type): a tuple of changing offsets makes one warm-up, not one a value --
    which would use up WARM_MAX and leave the next new shape to compile under the lock."""
    import interop.cutile as icu
    dev, drv = fake
    mod, _ = tile
    a, c, s = _setup(dev)
    kern = _kernel()
    # (the arrays annotated: keyed by their exact layout, as the fake cuTile keys them)
    arr = types.SimpleNamespace(KIND="leaf", constant=False, array=object())
    leaf = types.SimpleNamespace(KIND="leaf", constant=False, array=None)
    kern._annotated_function = types.SimpleNamespace(parameter_annotations=(arr, arr, leaf))
    owners = _cutile_keyed(mod, constant_params=set())
    for step in range(icu.WARM_MAX + 2):
        sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), (step, step + 1), stream=s).result()
    assert owners == [0] and owners.warmups == 1, (owners, owners.warmups)
    a2 = sm.Tensor.from_host(np.arange(32, dtype=np.float32), device=dev)
    c2 = sm.Tensor.zeros((32,), "float32", device=dev)
    sm.launch(kern, (1,), None, sm.In(a2), sm.Out(c2), (0, 1), stream=s).result()
    assert owners == [0, 0], owners


def test_tuple_annotations_key_each_item_by_its_own_annotation(fake, tile):
    """``tuple[ct.Constant[int], int]``: the constant item by value, the other by type."""
    from interop.cutile import _key
    const = types.SimpleNamespace(KIND="leaf", constant=True, array=None)
    rt = types.SimpleNamespace(KIND="leaf", constant=False, array=None)
    node = types.SimpleNamespace(KIND="heterogeneous_tuple", items=(const, rt))
    kern = types.SimpleNamespace(_annotated_function=types.SimpleNamespace(
        parameter_annotations=(node, types.SimpleNamespace(KIND="homogeneous_tuple", each=rt))))
    from interop.cutile import _param_modes
    modes = _param_modes(kern)
    assert modes == (("items", ("const", "runtime")), ("each", "runtime"))
    assert _key((4, 7), modes[0]) == _key((4, 9), modes[0]) != _key((5, 7), modes[0])
    assert _key((1, 2, 3), modes[1]) == _key((4, 5, 6), modes[1]) != _key((1, 2), modes[1])
    assert _key((1.0, 2), modes[1]) != _key((1, 2), modes[1])  # (the types still count)


def test_numpy_scalars_inside_a_tuple_reach_cutile_as_python_scalars(fake, tile):
    """As at the top level (cuTile takes Python scalars only), and keyed by value: the same
    values again are the same signature, not a new warm-up each launch."""
    dev, drv = fake
    mod, _ = tile
    a, c, s = _setup(dev)
    kern = _kernel()
    owners = _cutile_keyed(mod)
    got = []
    inner = mod.launch

    def launch(stream, grid, kernel, args):
        got.append(args[2])
        return inner(stream, grid, kernel, args)
    mod.launch = launch
    for _ in range(3):
        sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), (np.float64(0.5), (np.int32(4),)),
                  stream=s).result()
    assert got[-1] == (0.5, (4,)) and type(got[-1][0]) is float and type(got[-1][1][0]) is int
    assert owners.warmups == 1, owners.warmups


def test_the_disjoint_bit_counts_dimensions_of_extent_one():
    """cuTile's disjointness (compute_array_specialization_bits) sorts every dimension by
    stride, extent 1 too: a zero stride there (a broadcast axis) makes the elements not
    disjoint -- another specialization, so another signature."""
    from interop.cutile import _array_keys
    _, x = _array_keys("<f4", 4, (3, 1), (8, 32), 0)
    _, y = _array_keys("<f4", 4, (3, 1), (8, 0), 0)
    assert x[3] is True and y[3] is False
    assert _array_keys("<f4", 4, (), (), 0)[1][3] is True  # (0-d: disjoint)
    assert _array_keys("<f4", 4, (4, 4), (4, 8), 0)[1][3] is False  # (rows overlap)


def test_cutile_grid_and_shared_mem_are_checked_as_cutile_launches_them(fake, tile):
    """cuTile launches at most 2**24 - 1 blocks a dimension (its validate_grid), below the
    device's limit: KernelError before the launch, as for any bad grid; shared_mem is
    checked as for CuPy kernels (an int), then must be 0."""
    dev, _ = fake
    a, c, s = _setup(dev)
    kern = _kernel()
    with pytest.raises(sm.KernelError, match=r"dimension x is 16777216, above this device's "
                                            r"limit of 16777215"):
        sm.launch(kern, (1 << 24,), None, sm.In(a), sm.Out(c), 2, stream=s)
    for bad in (None, 0.0, False):
        with pytest.raises(sm.KernelError, match="shared_mem must be an int >= 0"):
            sm.launch(kern, (1,), None, sm.In(a), sm.Out(c), 2, stream=s, shared_mem=bad)
    assert sm.stats().in_flight == 0
