"""A finalizer that ends a hold -- a view or DLPack capsule dropped in a garbage collection --
files a lease on the hold's stream (runtime.submission.end_holds_locked). It must never wait
for a lock its own thread holds: each case below starts a collection while the thread holds
one of the locks that path used to take (the tracer's, the retirer's start lock), with only
such a view or capsule in the garbage, and must finish. Each ran a deadlock before its fix.

The probe: a gc callback that, at the start of the first collection begun while the lock is
held inside the named function, wraps the victim in a fresh garbage cycle -- the collection
then runs its finalizer there, as an unlucky allocation would (gc.set_threshold(1): every
allocation under the lock is tried). Each case runs in its own interpreter, under a timeout,
in both builds."""

import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = r'''
import faulthandler, gc, os, sys, threading
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import sharedmem as sm
from sharedmem.runtime.state import RUNTIME

def probe(held, where, victims):
    """Plant ``victims.pop()`` in garbage once a collection starts while ``held()`` and the
    stack has a frame of (file, function) ``where``."""
    fired = []
    def hook(phase, info):
        if phase != "start" or fired or not victims or not held():
            return
        f = sys._getframe(1)
        while f is not None and (os.path.basename(f.f_code.co_filename),
                                 f.f_code.co_name) != where:
            f = f.f_back
        if f is None:
            return
        fired.append(1)
        c = [victims.pop()]
        c.append(c)  # a cycle: this collection frees it, and runs the victim's finalizer
        del c
    gc.callbacks.append(hook)
    faulthandler.dump_traceback_later(30, exit=True)  # (a deadlock: stacks, then exit 1)
    return fired
'''

_TRACE = _PROBE + r'''
import tempfile

@sm.host_kernel
def inc(x):
    x += 1

dev = sm.Device.host()
s = dev.create_stream()
held = sm.Buffer.zeros(16, device=dev)
sm.record_use(held, s)  # its token is a hold on s: its end files a submission (traced)
victims = [held]
del held

def held():  # what retired() runs under: the core lock (held by the thread the collection
    # starts on: it runs wherever a sweep does), or the tracer's own lock where it has one
    lock = getattr(RUNTIME.tracer, "_lock", None)
    return RUNTIME.owner == threading.get_ident() or (lock is not None and lock.locked())


fired = probe(held, ("trace.py", "retired"), victims)
with sm.trace(os.path.join(tempfile.mkdtemp(), "t.json")):
    gc.set_threshold(1)
    for i in range(300):
        sm.launch(inc, 1, 1, sm.InOut(sm.Buffer.zeros(16, device=dev))).result()
    gc.set_threshold(700)
assert fired, "the probe never fired"
sm.synchronize()
print("ok")
'''

_START = _PROBE + r'''
from _pytest.monkeypatch import MonkeyPatch
import fake_cuda
from sharedmem.runtime import retirer

(dev,), drv = fake_cuda.install_fake_devices(MonkeyPatch(), hot=False)
buf = sm.Buffer.empty(16, device=dev)  # no submission yet: the retirer is not running
cap = buf.__dlpack__(stream=1)  # an export: a hold on the default stream
assert not RUNTIME.retirer_running
victims = [cap]
del cap
fired = probe(retirer._start_lock.locked, ("retirer.py", "ensure"), victims)
gc.set_threshold(1)
buf.fill_zero()  # the first submission starts the retirer; the capsule dies in there
gc.set_threshold(700)
assert fired, "the probe never fired"
sm.synchronize()
print("ok")
'''


# A user's finalizer that calls sharedmem while this thread builds the host device (the
# device lock's section allocates: it imports, makes a backend and its worker): a clear
# SharedMemError in that finalizer, as the core lock gives, not a thread waiting for itself.
_DEVICE = _PROBE + r'''
from sharedmem import device as sm_device

class Calls:
    def __del__(self):
        sm.Device.host()

victims = [Calls()]
fired = probe(sm_device._lock.locked, ("device.py", "host"), victims)
gc.set_threshold(1)
dev = sm.Device.host()  # the first: made under the lock
gc.set_threshold(700)
assert fired, "the probe never fired"
print("ok")
'''

_CASES = {"tracer": _TRACE, "retirer start lock": _START, "device lock": _DEVICE}


@pytest.mark.parametrize("build", ["compiled", "interpreted"])
@pytest.mark.parametrize("case", list(_CASES))
def test_a_finalizer_run_by_a_collection_under_a_lock_does_not_deadlock(case, build):
    from sharedmem import config
    if build == "compiled" and not config.compiled():
        pytest.skip("the compiled core is switched off (SHAREDMEM_PURE_PYTHON)"
                    if config.pure_python_requested() else "the compiled core is not built here")
    env = dict(os.environ)
    env.pop("SHAREDMEM_PURE_PYTHON", None)
    if build == "interpreted":
        env["SHAREDMEM_PURE_PYTHON"] = "1"
    script = ("ROOT = %r\n" % _ROOT) + _CASES[case]
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    if case == "device lock":
        assert ("SharedMemError: sharedmem was called from a finalizer (__del__ or a weakref "
                "callback) that interrupted the creation of a device on the same thread"
                in r.stderr), r.stderr


def test_the_retirer_bell():
    """wake() before a sleep makes it return at once, once; a sleep unrung times out."""
    import time

    from sharedmem.runtime.state import Bell
    bell = Bell()
    t0 = time.monotonic()
    bell.sleep(0.05)
    assert time.monotonic() - t0 >= 0.04  # unrung: the timeout
    bell.ring()
    bell.ring()  # (rung twice: still one wake)
    t0 = time.monotonic()
    bell.sleep(5)
    assert time.monotonic() - t0 < 1  # rung: at once
    t0 = time.monotonic()
    bell.sleep(0.05)
    assert time.monotonic() - t0 >= 0.04  # the ring was used up


def test_a_staged_release_that_raises_leaves_the_core_lock_free(host):
    """A release staged while another thread held the core lock runs at the next acquire;
    when it raised (an interrupt, a release that failed) ``acquire`` left the lock taken --
    its callers' ``try`` begins after it returns -- and every later call of the thread said
    "called from a finalizer" while every other thread blocked for good. The error is raised
    to that call, the lock is free, and the releases staged after it still run."""
    import gc
    import threading

    import sharedmem as sm
    from sharedmem.runtime.state import RUNTIME
    done = []

    def boom(_):
        raise RuntimeError("a staged release failed")

    sm.synchronize()  # (the retirer idle: it takes the lock for nothing meanwhile)
    gc.disable()  # (no finalizer of this thread drains the stage first)
    try:
        RUNTIME.acquire()
        RUNTIME.staged.append((boom, None))
        RUNTIME.staged.append((done.append, "later"))
        RUNTIME.release()
        with pytest.raises(RuntimeError, match="a staged release failed"):
            RUNTIME.acquire()
    finally:
        gc.enable()
    assert RUNTIME.owner == 0
    got = []
    t = threading.Thread(target=lambda: got.append(sm.stats()))
    t.start()
    t.join(10)
    assert not t.is_alive() and got  # another thread is not blocked
    assert done == ["later"]  # (applied by that call)
    assert not RUNTIME.staged
    sm.stats()  # and this thread's next call works
