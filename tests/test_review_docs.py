"""docs/api.md, docs/errors.md and the public docstrings say what the code does.

Each test checks one claim a user meets early (on the host device), with exact values or
messages: errors.md promises that a message says what was wrong, which object, and what to do.
"""

import importlib
import inspect
import io
import os
import re
import warnings

import numpy as np
import pytest

import sharedmem as sm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "docs", "api.md")) as _f:
    API = _f.read()

CLASSES = ["Buffer", "Tensor", "DeviceBox", "Stream", "Event", "Device", "DeviceFuture",
           "HostFuture", "DeviceOp", "Graph"]
#: Attributes of public classes that are interfaces between sharedmem's own modules (the
#: backend object and the per-device facts the bridges cache), not for applications.
INTERNAL = {"Device.backend", "Device.bridge_facts"}


def _public_members(cls):
    for name in dir(cls):
        if name.startswith("_"):
            continue
        yield name, inspect.getattr_static(cls, name)


def test_every_public_name_is_in_the_api_reference():
    missing = [n for n in sm.__all__ if n != "__version__"
               and not re.search(r"\b" + re.escape(n) + r"\b", API)]
    for c in CLASSES:
        for name, _ in _public_members(getattr(sm, c)):
            if f"{c}.{name}" not in INTERNAL and not re.search(r"\b" + re.escape(name) + r"\b",
                                                               API):
                missing.append(f"{c}.{name}")
    for m in ["cupy", "cutile", "dlpack", "cai", "streams", "dask"]:
        try:
            mod = importlib.import_module(f"interop.{m}")
        except ImportError:  # (interop.dask needs distributed)
            continue
        missing += [f"interop.{m}.{n}" for n in mod.__all__
                    if not re.search(r"\b" + re.escape(n) + r"\b", API)]
    assert missing == []


def test_public_methods_and_protocol_methods_have_docstrings():
    missing = []
    for c in CLASSES:
        cls = getattr(sm, c)
        if not (cls.__doc__ or "").strip():
            missing.append(c)
        for name, obj in _public_members(cls):
            if type(obj).__name__ in ("member_descriptor", "getset_descriptor"):
                continue  # (a slot: its class docstring names it)
            fn = obj.fget if isinstance(obj, property) else getattr(cls, name)
            if callable(fn) and not (getattr(fn, "__doc__", None) or "").strip():
                missing.append(f"{c}.{name}")
    for q in ["Buffer.__len__", "Tensor.__len__", "Tensor.__contains__", "Stream.__exit__",
              "Stream.__cuda_stream__", "DeviceBox.__enter__", "DeviceBox.__exit__",
              "Graph.__enter__", "Graph.__exit__"]:
        c, n = q.split(".")
        if not (getattr(getattr(sm, c), n).__doc__ or "").strip():
            missing.append(q)
    assert missing == []


def test_class_docstrings_name_their_public_attributes():
    for attr in ("``device``", "``name``", "``owned``"):
        assert attr in sm.Stream.__doc__
    for attr in ("``id``", "``device``", "``launches``"):
        assert attr in sm.Graph.__doc__
    assert "``buffer``" in sm.DeviceBox.__doc__


def test_a_tensor_slice_step_says_which_tensor_and_what_to_do():
    t = sm.Tensor.zeros(3, "float32", sm.Device.host())
    with pytest.raises(sm.LayoutError) as ei:
        t[::-1]
    assert str(ei.value) == (
        f"tensor slices take a positive step (strides stay non-negative: reverse on the host, "
        f"t.to_host()[::-1], or in a kernel); {t!r}: got step -1")


def test_work_on_bytes_of_unknown_completion_says_what_to_do():
    from sharedmem.backends.host import HostFault

    dev = sm.Device.host()
    faulty = dev.create_stream("faulty")
    b = sm.Buffer.zeros(4, "float32", dev)

    @sm.host_kernel
    def fault(x):
        raise HostFault("boom")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.LeakWarning)
        f = sm.launch(fault, 1, 1, b, stream=faulty)
        with pytest.raises(sm.CompletionUnknownError):
            f.result(timeout=10)
        aid = b.allocation.id
        with pytest.raises(sm.CompletionUnknownError) as ei:
            b.to_host()
    assert str(ei.value) == (
        f"to_host on {dev.default_stream} would read bytes [0, 16) of allocation #{aid}, which "
        f"work of unknown completion on {faulty} writes; that memory is kept but its contents "
        f"cannot be trusted; do further work on new memory (a new buffer), on a new stream")


def test_an_int_stream_on_the_host_device_is_a_device_mismatch():
    # api.md, sm.launch: int default streams name the arguments' CUDA device; the host has none
    dev = sm.Device.host()
    b = sm.Buffer.zeros(4, "float32", dev)
    k = sm.host_kernel(lambda x: None)
    for s in (0, 1, 2):
        with pytest.raises(sm.DeviceMismatchError) as ei:
            sm.launch(k, 1, 1, b, stream=s)
        assert str(ei.value) == (f"Stream.from_external({s}) needs a CUDA device; <Device host> "
                                 f"has no foreign streams (pass a Stream of it -- dev.create_stream(), "
                                 f"dev.default_stream -- or stream=None)")
    assert sm.launch(k, 1, 1, b, stream=None).result() is None


def test_with_length_gives_a_host_kernel_the_array_alone():
    dev = sm.Device.host()
    b = sm.Buffer.from_host(np.arange(4, dtype=np.float32), device=dev)
    got = []
    sm.launch(sm.host_kernel(lambda *a: got.append(a)), 1, 1, sm.In(b, with_length=True),
              stream=dev.default_stream).result()
    (args,) = got
    assert len(args) == 1 and args[0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_device_arguments_take_host_and_from_host_flattens():
    b = sm.Buffer.from_host(np.arange(6, dtype=np.int16).reshape(2, 3), device="host")
    assert b.device is sm.Device.host()
    assert (b.shape, b.size, len(b), b.itemsize, b.strides, b.byte_strides) == (
        (6,), 6, 6, 2, (1,), (2,))
    assert b.to_host().tolist() == [0, 1, 2, 3, 4, 5]
    t = sm.Tensor.from_host(np.arange(6, dtype=np.int16).reshape(2, 3), device="host")
    assert (t.shape, t.itemsize) == ((2, 3), 2)


def test_show_config_prints_and_returns_a_dict():
    out = io.StringIO()
    info = sm.show_config(file=out)
    assert list(info) == ["sharedmem", "core", "python", "numpy", "cython", "cupy",
                          "cuda-bindings", "cuda-tile", "default device"]
    assert info["sharedmem"] == sm.__version__
    for key in info:
        assert key in out.getvalue()


def test_stream_attributes_and_lookup():
    dev = sm.Device.host()
    s = dev.create_stream("mine")
    assert (s.device, s.name, s.owned) == (dev, "mine", True)
    assert (dev.default_stream.name, dev.default_stream.owned) == ("default", False)
    assert sm.Stream.lookup(dev, 12345) is None


def test_device_box_attributes():
    box = sm.DeviceBox(7, "int32", sm.Device.host())
    assert (box.get(), type(box.get()), box.dtype, box.device) == (
        7, int, np.dtype("int32"), sm.Device.host())
    assert isinstance(box.set(3), sm.DeviceFuture)
    assert box.get() == 3
    with box:
        pass
    with pytest.raises(sm.ReleasedError):
        box.get()
