"""The compiled and the interpreted core are one source: the same program must give the same
transcript (values, error types and messages, counters) in both. Skipped where the compiled
modules were not built."""

import os
import subprocess
import sys

import pytest

import sharedmem as sm

PROGRAM = r'''
import random, numpy as np, sharedmem as sm
rng = random.Random(7)
h = sm.Device.host()
streams = [h.create_stream(f"s{i}") for i in range(3)]
out = []
def note(tag, fn):
    try:
        r = fn()
        out.append((tag, "ok", repr(r)[:80] if not isinstance(r, np.ndarray) else r.tolist()))
    except Exception as e:
        out.append((tag, type(e).__name__, str(e).split(" at 0x")[0][:160]))
add = sm.host_kernel(lambda x, v: x.__iadd__(v))
bufs = [sm.Buffer.from_host(np.arange(8, dtype=np.int64) * i, device=h) for i in range(4)]
views = []
for step in range(300):
    op = rng.randrange(8)
    i = rng.randrange(len(bufs))
    b = bufs[i]
    if op == 0:
        note("launch", lambda: sm.launch(add, 1, 1, sm.InOut(b), rng.randrange(5),
                                           stream=rng.choice(streams)).result(5))
    elif op == 1:
        note("slice", lambda: views.append(b[rng.randrange(4):rng.randrange(4, 9)]))
    elif op == 2:
        def mv():
            t = sm.Tensor.from_buffer(b, (2, 4))
            bufs[i] = t.into_buffer()
            return bufs[i].to_host()
        note("move", mv)
    elif op == 3 and views:
        v = views.pop(rng.randrange(len(views)))
        note("release", v.release)
    elif op == 4:
        note("read", lambda: b.to_host())
    elif op == 5:
        note("bad", lambda: sm.launch(add, 1, 1, sm.Out(b.as_readonly()), 1))
    elif op == 6:
        note("dead", lambda: views[0].to_host() if views and not views[0].is_live else b[0:1].nbytes)
    else:
        note("copy", lambda: bufs[(i + 1) % 4].copy_from(b).result(5))
sm.synchronize()
st = sm.stats()
out.append(("stats", st.in_flight, st.leaked, st.live_views))
for line in out:
    print(line)
'''


def _run(pure: bool) -> str:
    env = dict(os.environ)
    env.pop("SHAREDMEM_PURE_PYTHON", None)
    if pure:
        env["SHAREDMEM_PURE_PYTHON"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(not __import__("sharedmem").config.compiled() and
                    not __import__("sharedmem").config.pure_python_requested(),
                    reason="the compiled core is not built here")
def test_the_compiled_and_the_interpreted_core_give_the_same_transcript():
    compiled, interpreted = _run(False), _run(True)
    assert compiled.count("\n") > 300
    assert "MovedError" in compiled or "AliasError" in compiled  # the program hits the rules
    assert compiled == interpreted
