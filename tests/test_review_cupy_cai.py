"""Review of interop/cupy_launch.py and interop/cai.py: values packed exactly, imports of
zero-size CAI arrays of another device."""

import numpy as np
import pytest

import sharedmem as sm
from test_cuda_backend_fake import fake  # noqa: F401  (the fixture: both launch paths)


def test_a_longdouble_for_a_float_or_half_is_rounded_once(fake):
    """An np.longdouble for a float or half parameter is rounded to its nearest value, as C's
    conversion rounds it. It went through float() first -- a double -- and was rounded again:
    a value just past the tie between two floats landed on the tie and rounded to even, the
    wrong neighbour (1 + 2**-24 + 2**-60 became 1.0, not 1 + 2**-23)."""
    from fake_cuda import RawKernel
    dev, drv = fake
    got = []
    code = 'extern "C" __global__ void f(float x, half h, double d) { }'
    k = RawKernel(drv, "f", ["4s", "2s", "8s"], lambda *v: got.append(v), code)
    one = np.longdouble(1)
    up = one + np.longdouble(2) ** -24 + np.longdouble(2) ** -60  # (past float's tie)
    hup = one + np.longdouble(2) ** -11 + np.longdouble(2) ** -60  # (past half's tie)
    down = -(one + np.longdouble(2) ** -24 - np.longdouble(2) ** -60)  # (short of it)
    s = dev.create_stream()  # (no array arguments: the stream names the device)
    sm.launch(k, 1, 1, up, hup, up, stream=s).result()
    sm.launch(k, 1, 1, down, -hup, np.longdouble(1.5), stream=s).result()
    assert got == [(bytes.fromhex("0100803f"), bytes.fromhex("013c"),
                    np.float64(up).tobytes()),
                   (bytes.fromhex("000080bf"), bytes.fromhex("01bc"),
                    np.float64(1.5).tobytes())]


def test_a_zero_size_cai_array_of_another_device_is_imported(monkeypatch):
    """A zero-size CUDA Array Interface array (its pointer 0: no address names its device)
    whose producer names a stream of device 1 -- ``cp.empty(0)`` under
    ``cp.cuda.Device(1)`` with a stream current. The import recorded an event on that
    stream from device 0's context (CUDA_ERROR_INVALID_CONTEXT, a CudaError), and refused
    ``stream=`` of device 1 (DeviceMismatchError: "the memory is on cuda:0"). No bytes:
    nothing to wait for; the stream named gives the device."""
    from fake_cuda import install_fake_devices
    from interop.cai import from_cuda_array_interface
    (d0, d1), drv = install_fake_devices(monkeypatch, True, 2)
    s1 = d1.create_stream("s1")

    class Obj:
        def __init__(self, stream):
            self.__cuda_array_interface__ = {"shape": (0,), "typestr": "<f4", "version": 3,
                                             "data": (0, False), "stream": stream}
    t = from_cuda_array_interface(Obj(s1.handle))
    assert t.shape == (0,) and t.device is d0
    t = from_cuda_array_interface(Obj(s1.handle), stream=s1)
    assert t.shape == (0,) and t.device is d1
    with pytest.raises(ValueError, match=r"stream 0 is not valid"):  # (still checked)
        from_cuda_array_interface(Obj(0), stream=s1)
    sm.synchronize()
