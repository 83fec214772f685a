import gc
import os
import sys

# JAX would otherwise take most of the GPU's memory at its first use.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest

import sharedmem as sm


def gc_collect_harder():
    # As trio does: several passes so finalizers that free more garbage run too.
    for _ in range(4):
        gc.collect()


def cuda_device():
    """CUDA device 0, or None when no GPU is usable here."""
    try:
        return sm.Device(0)
    except sm.BackendUnavailableError:
        return None


@pytest.fixture(scope="module")
def gpu():
    """CUDA device 0; the test is skipped when no GPU is usable."""
    dev = cuda_device()
    if dev is None:
        pytest.skip("no usable CUDA GPU")
    return dev


@pytest.fixture
def host():
    return sm.Device.host()


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Both backends, where the behaviour is meant to be the same."""
    if request.param == "host":
        return sm.Device.host()
    dev = cuda_device()
    if dev is None:
        pytest.skip("no usable CUDA GPU")
    return dev


@pytest.fixture(autouse=True)
def _clean_policy():
    sm.set_access_policy("order")
    yield
    sm.set_access_policy("order")


@pytest.fixture
def settled():
    """Assert the test left nothing in flight (beyond what was leaked before)."""
    yield
    sm.synchronize()
    gc_collect_harder()
    assert sm.stats().in_flight == 0


def arange(n, dtype="float32"):
    return np.arange(n, dtype=dtype)


def count_plans(monkeypatch, adapter_cls) -> list:
    """The kernels ``adapter_cls`` plans from now on (a plan is made once per kernel and
    device; every later launch reuses it), as a list that grows."""
    calls = []
    real = adapter_cls.plan

    def counting(self, kernel, device):
        calls.append(kernel)
        return real(self, kernel, device)

    monkeypatch.setattr(adapter_cls, "plan", counting)
    return calls


def run_threads(threads, stop, seconds) -> None:
    """Start ``threads`` with the interpreter switching threads every microsecond (races
    show), let them run ``seconds``, then set ``stop`` and join them (the switch interval
    restored, whatever happened)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for th in threads:
            th.start()
        stop.wait(seconds)
    finally:
        stop.set()
        for th in threads:
            th.join(10)
        sys.setswitchinterval(interval)
