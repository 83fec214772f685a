"""sm.graph of an op with no array arguments captures on the device the op runs on."""


import sharedmem as sm


def test_graph_of_a_host_kernel_op_without_arrays_on_a_gpu_machine_runs_on_the_host(
        monkeypatch):
    """sm.graph(op) captures on "a new stream of the op's device"; for an op with no array
    arguments that is the device op.submit() and launch() pick -- the host for a host
    kernel on a GPU machine -- not CUDA device 0, where the capture fails with a
    DeviceMismatchError."""
    import sharedmem.device as smd
    from fake_cuda import install_fake_devices
    (dev,), drv = install_fake_devices(monkeypatch, False)
    monkeypatch.setitem(smd._devices, ("cuda", 0), dev)
    monkeypatch.setattr(smd, "_default", dev)
    assert sm.default_device() is dev
    seen = []

    @sm.host_kernel
    def note(v):
        seen.append(v)

    o = sm.op(note, 1, 1, 7)
    assert o.submit().result(5) is None and seen == [7]  # runs on the host
    g = sm.graph(o)
    g.replay(sm.Device.host().create_stream()).result(5)
    assert seen == [7, 7] and g.device.kind == "host"
    g.release()
