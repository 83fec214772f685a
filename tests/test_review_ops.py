"""Review of ops, DeviceBox values and conversions (host backend)."""

import threading
import time

import numpy as np
import pytest

import sharedmem as sm
import sharedmem.backends.host as host_backend
from host_kernels import fill


# -- DeviceBox: a value the dtype cannot hold exactly is refused, never truncated ----------
@pytest.mark.parametrize("value, dtype, stored", [
    (1.5, "int32", 1), (-0.5, "uint8", 0), (np.float64(2.75), "int64", 2),
    (np.array(1.5), "int16", 1)])
def test_box_refuses_fractional_value_for_int_dtype(host, value, dtype, stored):
    with pytest.raises(ValueError) as ei:
        sm.DeviceBox(value, dtype, device=host)
    v = value.item() if isinstance(value, (np.ndarray, np.generic)) else value
    assert str(ei.value) == (
        f"a DeviceBox of {dtype} cannot hold {v!r}: it is not a whole number and would be "
        f"stored as {stored!r}; pass an int (round(v), math.floor(v)) or use a float dtype")


@pytest.mark.parametrize("value", [2, 0.5, -1])
def test_box_refuses_non_bool_value_for_bool_dtype(host, value):
    with pytest.raises(ValueError) as ei:
        sm.DeviceBox(value, "bool", device=host)
    assert str(ei.value) == (
        f"a DeviceBox of bool cannot hold {value!r}: it is not True, False, 0 or 1 and would "
        f"be stored as True; pass a bool (bool(v)) or use an integer dtype")


def test_box_set_refuses_fractional_value_and_keeps_old_one(host):
    box = sm.DeviceBox(7, "int32", device=host)
    with pytest.raises(ValueError, match=r"cannot hold 2\.5: it is not a whole number"):
        box.set(2.5)
    assert box.get() == 7
    box.set(4.0).result(5)  # (a whole float is exact)
    assert box.get() == 4 and type(box.get()) is int


@pytest.mark.parametrize("value, dtype, expected", [
    (3.0, "int32", 3), (True, "int8", 1), (1.0, "bool", True), (0, "bool", False),
    (2**63 - 1, "int64", 2**63 - 1), (2**64 - 1, "uint64", 2**64 - 1), (-0.0, "uint8", 0),
    (1e18, "int64", 10**18), (1.5, "float32", 1.5)])
def test_box_keeps_values_its_dtype_holds(host, value, dtype, expected):
    box = sm.DeviceBox(value, dtype, device=host)
    got = box.get()
    assert got == expected and type(got) is type(expected)


# -- a composite op's part whose argument another thread moved after planning ------------
def test_and_then_part_moved_while_earlier_part_waits_raises_moved(host, monkeypatch):
    # The second part is planned with `b`, then waits for room on the stream (its queue is
    # full) while another thread moves `b` into a tensor: that part must raise MovedError, as
    # any use of a moved handle does -- not write the tensor's bytes
    monkeypatch.setattr(host_backend, "MAX_QUEUED", 1)
    s = host.create_stream("review-moved")
    gate = threading.Event()

    @sm.host_kernel
    def hold(x):
        gate.wait(10)

    b = sm.Buffer.zeros(8, "int64", device=host, stream=s)
    other = sm.Buffer.zeros(8, "int64", device=host, stream=s)
    s.synchronize()
    sm.launch(hold, 1, 1, sm.In(other), stream=s)  # (running: the queue is empty again)
    chain = sm.op(fill, 1, 1, sm.Out(other), 1).and_then(sm.op(fill, 1, 1, sm.Out(b), 9))
    out = {}

    def submit():
        try:
            out["future"] = chain.submit(s)
        except BaseException as e:
            out["error"] = e

    th = threading.Thread(target=submit)
    th.start()
    deadline = time.monotonic() + 10
    while s.pending < 2 and time.monotonic() < deadline:  # (hold, and the first part)
        time.sleep(0.001)
    assert s.pending == 2
    time.sleep(0.05)  # (the second part waits for room)
    t = sm.Tensor.from_buffer(b, (8,))
    gate.set()
    th.join(10)
    s.synchronize()
    assert isinstance(out.get("error"), sm.MovedError), out
    assert str(out["error"]) == ("this Buffer (allocation #%d) was moved into a Tensor and can "
                                 "no longer be used; use the Tensor the move returned"
                                 % t.allocation.id)
    np.testing.assert_array_equal(t.to_host(), np.zeros(8, "int64"))
    np.testing.assert_array_equal(other.to_host(), np.ones(8, "int64"))  # (the first part ran)
