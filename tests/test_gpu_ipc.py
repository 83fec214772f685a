"""CUDA IPC between two processes on one GPU (#17): the consumer opens the producer's memory
zero-copy, a slow kernel reads it while the producer drops every handle and churns its pool
(0 corrupted rounds of 50), and a consumer killed with -9 gives the memory back within the
documented bound."""

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import sharedmem as sm

from conftest import gc_collect_harder

pytestmark = pytest.mark.gpu
ROUNDS = 50
N = 1 << 20


@pytest.fixture(scope="module")
def dev(gpu):
    """CUDA device 0 (conftest's ``gpu``: skipped without a usable GPU)."""
    return gpu


def _pool_used():
    import cupy
    return cupy.get_default_memory_pool().used_bytes()


def _settle():
    sm.synchronize()
    gc_collect_harder()
    sm.synchronize()


def test_consumer_never_reads_reused_memory(dev):
    import ipc_consumer
    import gpu_kernels as K
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=ipc_consumer.consumer, args=(there, 4))
    p.start()
    try:
        s = dev.create_stream("producer")
        _settle()
        used0 = _pool_used()
        bad, exports = 0, []
        for r in range(ROUNDS):
            b = sm.Buffer.empty(N, "float32", device=dev, stream=s)
            # written by a slow kernel still running at the export: the consumer must wait
            sm.launch(K.kernel("slow_fill"), 256, 256, sm.Out(b), N, float(r + 1), K.cycles(1),
                      stream=s)
            ex = sm.ipc.export(b, stream=s)
            exports.append(ex)
            here.send((ex.handle, float(r + 1)))
            ptr = b.ptr
            del b  # only the export holds the memory now
            fresh = [sm.Buffer.empty(N, "float32", device=dev, stream=s) for _ in range(4)]
            for f in fresh:
                sm.launch(K.kernel("fill"), 256, 256, sm.Out(f), N, -1.0, stream=s)
            assert ptr not in [f.ptr for f in fresh]
            bad += int(not here.recv())
            del fresh, f
        here.send(None)
        assert here.recv() == "bye"
        assert bad == 0, f"{bad} of {ROUNDS} rounds read memory reused under the consumer"
        for ex in exports:
            assert ex.wait_released(5.0), ex
            assert ex.state == "released"
        assert sm.ipc.exports() == 0
        _settle()
        assert _pool_used() == used0  # every block went back once the consumer was done
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()


def test_refusals(dev):
    import ipc_consumer
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=ipc_consumer.opener, args=(there,))
    p.start()
    try:
        t = sm.Tensor.from_host(np.arange(12, dtype=np.float32).reshape(3, 4), device=dev)
        ex = sm.ipc.export(t[1:])
        with pytest.raises(sm.AliasError, match=r"CUDA IPC export from pid"):
            t.into_buffer()
        here.send(ex.handle)
        status, values, shown = here.recv()
        assert status == "ok" and values == np.arange(4, 12).reshape(2, 4).tolist(), (status, values)
        here.send(ex.handle)  # a handle opens once
        status, msg, _ = here.recv()
        assert status == "SharedMemError" and msg.startswith(f"cannot open {ex.handle!r}: ")
        assert "released already" in msg or "the export ended" in msg, msg
        assert ex.wait_released(5.0) and ex.state == "released"
        ex2 = sm.ipc.export(t)
        assert ex2.revoke() and ex2.state == "revoked"
        here.send(ex2.handle)
        status, msg, _ = here.recv()
        assert status == "SharedMemError" and "the export ended" in msg
        with pytest.raises(sm.SharedMemError, match="was exported by this process"):
            sm.ipc.open(ex2.handle)
        with pytest.raises(sm.BackendUnavailableError, match="pickle it instead"):
            sm.ipc.export(sm.Buffer.zeros(4, device=sm.Device.host()))
        t.into_buffer()  # every export ended: the move goes through
        here.send(None)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()


def test_killed_consumer_releases_within_the_bound(dev):
    import ipc_consumer
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=ipc_consumer.stuck, args=(there, 300))
    p.start()
    try:
        _settle()
        used0 = _pool_used()
        b = sm.Buffer.from_host(np.ones(N, np.float32), device=dev)
        ex = sm.ipc.export(b)
        del b
        here.send(ex.handle)
        assert here.recv() == "running"
        time.sleep(0.05)
        assert ex.state == "open" and _pool_used() > used0
        os.kill(p.pid, signal.SIGKILL)
        t0 = time.monotonic()
        p.join(10)
        assert ex.wait_released(10.0)
        took = time.monotonic() - t0
        assert ex.state == "importer died"
        bound = sm.ipc.POLL + sm.ipc.GRACE
        print(f"released {took:.3f} s after kill -9 (bound {bound} s after teardown)")
        assert took < bound + 2.0
        _settle()
        assert _pool_used() == used0
    finally:
        if p.is_alive():
            p.kill()
