"""The public API is typed (issue 16): user code checks under ``mypy --strict``, with futures
generic in their value (``DeviceFuture[None]`` from a launch, ``HostFuture[T]`` from ``then``)
and ``launch`` never ``Any``.

mypy reads the sources (``.py``, and ``runtime/future.pyi`` for the futures, which are cdef
classes when compiled); errors inside the package are not the user's and are silenced
(``follow_imports = silent``), but any of them that leaked ``Any`` into the API would let the
wrong annotations of ``BAD`` through.
"""

import importlib.util
import inspect
import os
import pydoc
import re
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

import sharedmem as sm

# Where `import sharedmem` resolves from: the checkout, or an installed wheel's site-packages
# (where mypy finds it by itself: PEP 561, py.typed).
PKG_ROOT = Path(sm.__file__).resolve().parent.parent
INSTALLED = PKG_ROOT.name in ("site-packages", "dist-packages")

# A user's program: strict-clean with no `type: ignore`, and run below too (the annotations
# must be true). No `from __future__ import annotations`: module-level annotations run.
GOOD = '''\
"""A user's program, as a type checker sees it."""
import asyncio
import concurrent.futures

import numpy as np
import numpy.typing as npt

import sharedmem as sm

FINISHED: list[sm.DeviceFuture[None]] = []  # evaluated at import: the futures subscript
LATER: dict[str, sm.HostFuture[int]] = {}


@sm.host_kernel
def scale(x: npt.NDArray[np.float32], out: npt.NDArray[np.float32], k: float) -> None:
    out[:] = x * k


@sm.host_kernel
def bump(x: npt.NDArray[np.int64]) -> None:
    x += 1


async def wait_for(fut: sm.DeviceFuture[None]) -> None:
    await fut


def pipeline(dev: sm.Device) -> list[float]:
    s: sm.Stream = dev.create_stream("work")
    x: sm.Buffer = sm.Buffer.from_host(np.arange(8, dtype=np.float32), device=dev)
    y = sm.Buffer.zeros(8, "float32", device=dev, stream=s)
    f: sm.DeviceFuture[None] = sm.launch(scale, 1, 1, sm.In(x), sm.Out(y), 2.0, stream=s)
    f.result(timeout=10.0)
    FINISHED.append(f)
    h: sm.HostFuture[int] = f.then(lambda _: 1)
    LATER["h"] = h
    n: int = h.result(10.0)
    text: sm.HostFuture[str] = h.then(str)
    assert text.result(10.0) == "1" and n == 1
    assert f.done() and f.exception() is None and not f.cancel()
    cf: concurrent.futures.Future[None] = f.to_concurrent()
    assert cf.result(10.0) is None
    on: sm.Stream = f.stream
    assert on is s

    z = sm.Buffer.empty(8, np.float32, device=dev)
    with s:  # the current stream
        g = sm.launch(scale, (1,), (1, 1), sm.In(y), sm.InOut(z), 0.5)
        g.add_done_callback(FINISHED.append)
    asyncio.run(wait_for(g))
    ev: sm.Event = s.record()
    assert ev.synchronize(10.0) and ev.query()
    dev.default_stream.wait(ev)

    copied: sm.DeviceFuture[None] = y.copy_from(z, stream=s)
    copied.result(10.0)
    y.fill_zero(s).result(10.0)
    y.copy_from(np.full(8, 3.0, np.float32)).result(10.0)

    t: sm.Tensor = sm.Tensor.from_buffer(y, (2, 4))
    shape: tuple[int, ...] = t.shape
    assert shape == (2, 4)
    with t.as_buffer() as borrowed:
        borrowed.fill_zero(s).result(10.0)
    t2 = sm.Tensor.zeros((2, 4), "float32", device=dev)
    t3 = sm.Tensor.from_host(np.ones((2, 2), np.float32), device=dev)
    t4 = sm.Tensor.empty(3, np.int64, device=dev)
    assert t2.to_host().sum() == 0 and t3.to_host().sum() == 4 and t4.ndim == 1
    back: sm.Buffer = t.into_buffer()

    c = sm.Buffer.zeros(2, "int64", device=dev)
    d = sm.Buffer.zeros(2, "int64", device=dev)
    one: sm.DeviceOp[None] = sm.op(bump, 1, 1, sm.InOut(c))
    two: sm.DeviceOp[int] = sm.op(bump, 1, 1, sm.Atomic(d)).apply(lambda _: 2)
    both: sm.DeviceOp[tuple[None, int]] = sm.zip(one, two)
    pair: tuple[None, int] = both.submit(s).result(10.0)
    assert pair == (None, 2)
    chained: sm.DeviceFuture[None] = one.and_then(one).submit()
    chained.result(10.0)

    gs = dev.create_stream()
    with sm.capture(gs) as graph:
        sm.launch(bump, 1, 1, c)
    replay: sm.DeviceFuture[None] = graph.replay(gs)
    replay.result(10.0)
    graph.release()
    built: sm.Graph = sm.graph(one, gs)
    built.replay(gs).result(10.0)
    built.release()

    sm.synchronize()
    st: sm.Stats = sm.stats()
    assert st.in_flight >= 0
    pending: list[sm.InFlight] = sm.inflight()
    assert isinstance(pending, list)
    direct: None = bump(np.zeros(2, np.int64))  # a HostKernel calls its function
    assert direct is None
    values: npt.NDArray[np.float32] = back.to_host()
    return [float(v) for v in values] + [float(v) for v in c.to_host()]
'''

# Each line marked `# E` must be a mypy error (and no other line may be): had any of these
# calls returned Any, its line would pass.
BAD = '''\
import numpy as np
import numpy.typing as npt

import sharedmem as sm


@sm.host_kernel
def fill(x: npt.NDArray[np.float64], v: float) -> None:
    x[:] = v


buf = sm.Buffer.zeros(4, "float64")
fut: int = sm.launch(fill, 1, 1, buf, 1.0)  # E (names DeviceFuture)
value: str = sm.launch(fill, 1, 1, buf, 1.0).result()  # E
later: sm.HostFuture[str] = sm.launch(fill, 1, 1, buf, 1.0).then(lambda _: 1)  # E
fill(buf)  # E (a HostKernel keeps its function's signature)
sm.host_kernel(42)  # E
sm.launch(fill, 1.5, 1, buf, 1.0)  # E
sm.launch(fill, 1, 1, buf, 1.0, policy="fast")  # E
sm.launch(fill, 1, 1, buf, 1.0).result(timeout="1")  # E
op: sm.DeviceOp[int] = sm.op(fill, 1, 1, buf, 1.0)  # E
zipped: sm.DeviceFuture[int] = sm.zip(sm.op(fill, 1, 1, buf, 1.0)).submit()  # E
tensor: sm.Tensor = sm.Buffer.zeros(4)  # E
back: sm.Tensor = sm.Tensor.zeros((2, 2)).into_buffer()  # E
stream: int = sm.Device.host().create_stream()  # E
event: sm.Stream = sm.Device.host().create_stream().record()  # E
count: str = sm.stats().in_flight  # E
graph: int = sm.graph(sm.op(fill, 1, 1, buf, 1.0))  # E
captured: sm.Graph = sm.capture(sm.Device.host().create_stream())  # E
copy: int = buf.copy_from(np.zeros(4))  # E
fut_again = sm.launch(fill, 1, 1, buf, 1.0)
fut_again.add_done_callback(lambda f: f.no_such_attribute)  # E (f: the future's own type)
'''

MYPY_INI = """\
[mypy]
strict = True
warn_unused_configs = False
# as under the oldest Python supported: the stubs must hold there too (typing.Self is 3.11+)
python_version = 3.10
# the package's own errors are not the user's (see the module docstring)
[mypy-sharedmem.*]
follow_imports = silent
[mypy-interop.*]
follow_imports = silent
"""


@pytest.fixture(scope="module")
def mypy_env(tmp_path_factory):
    pytest.importorskip("mypy")
    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "MYPY_CACHE_DIR")}
    if not INSTALLED:
        env["MYPYPATH"] = str(PKG_ROOT)
    cache = tmp_path_factory.mktemp("mypy_cache")  # shared: the second run is warm
    return env, cache


def run_mypy(mypy_env, tmp_path, name, source):
    env, cache = mypy_env
    script = tmp_path / name
    script.write_text(source)
    ini = tmp_path / "mypy.ini"
    ini.write_text(MYPY_INI)
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ini),
                        "--cache-dir", str(cache), "--no-error-summary", "--hide-error-context",
                        "--show-error-codes", str(script)],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    return r, script


# -- at runtime ------------------------------------------------------------------------------------
def test_the_generic_types_subscript_at_runtime():
    for alias, origin in [(sm.DeviceFuture[None], sm.DeviceFuture),
                          (sm.HostFuture[int], sm.HostFuture),
                          (sm.DeviceOp[int], sm.DeviceOp),
                          (sm.HostKernel[[int], None], sm.HostKernel)]:
        assert typing.get_origin(alias) is origin
    assert typing.get_args(sm.HostFuture[int]) == (int,)


def test_launch_keeps_its_signature():
    sig = inspect.signature(sm.launch)
    params = sig.parameters
    assert list(params)[:4] == ["kernel", "grid", "block", "args"]
    assert params["args"].kind is inspect.Parameter.VAR_POSITIONAL
    for name, default in [("stream", None), ("shared_mem", 0), ("policy", None)]:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default == default
    assert "DeviceFuture[None]" in str(sig.return_annotation)
    assert "Literal['order', 'reject']" in str(params["policy"].annotation).replace('"', "'")
    assert "policy" in pydoc.render_doc(sm.launch)  # help(sm.launch), compiled or not


def test_the_host_kernel_decorator_keeps_the_function():
    @sm.host_kernel
    def k(x, v):
        return v + 1

    assert isinstance(k, sm.HostKernel) and k.__name__ == "k" and k(None, 1) == 2


def test_the_typed_program_runs(host, tmp_path):
    path = tmp_path / "user_program.py"
    path.write_text(GOOD)
    spec = importlib.util.spec_from_file_location("user_program", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.pipeline(host)
    # the borrowed buffer zeroed y's bytes; bump ran on c five times (the op once in the zip,
    # twice chained, and one replay of each graph)
    assert out == [0.0] * 8 + [5.0, 5.0]
    assert mod.FINISHED[0].done() and mod.LATER["h"].result(0) == 1


# -- as mypy sees it ---------------------------------------------------------------------------------
def test_user_code_passes_mypy_strict(mypy_env, tmp_path):
    r, _ = run_mypy(mypy_env, tmp_path, "user_program.py", GOOD)
    assert r.returncode == 0, f"mypy --strict failed:\n{r.stdout}{r.stderr}"


def test_wrong_annotations_fail_mypy(mypy_env, tmp_path):
    r, script = run_mypy(mypy_env, tmp_path, "wrong.py", BAD)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    errors = {}
    for m in re.finditer(r"^(?:.*[/\\])?wrong\.py:(\d+): error: (.*)$", out, re.M):
        errors.setdefault(int(m.group(1)), []).append(m.group(2))
    lines = BAD.splitlines()
    expected = {i + 1 for i, line in enumerate(lines) if "# E" in line}
    assert set(errors) == expected, (
        f"lines with errors {sorted(errors)}, expected {sorted(expected)}:\n{out}")
    first = min(expected)
    assert any("DeviceFuture" in e for e in errors[first]), out  # launch is not Any


def test_the_future_stub_matches_the_module(mypy_env, tmp_path):
    """runtime/future.pyi (what type checkers see of the futures) against future.py, or the
    compiled module when that is what imports."""
    env, cache = mypy_env
    if not INSTALLED:
        env = dict(env, PYTHONPATH=os.pathsep.join([str(PKG_ROOT), env.get("PYTHONPATH", "")]))
    allow = tmp_path / "allowlist.txt"  # what Cython adds to cdef classes (pickling helpers)
    allow.write_text("sharedmem\\.runtime\\.future\\..*\\.__(reduce|setstate)_cython__\n")
    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "sharedmem.runtime.future",
                        "--allowlist", str(allow), "--ignore-unused-allowlist"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
