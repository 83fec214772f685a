"""Small host kernels shared by the host-backend tests."""

import sharedmem as sm


@sm.host_kernel
def fill(x, v):
    x[:] = v


@sm.host_kernel
def add(x, y, out):
    out[:] = x + y


@sm.host_kernel
def inc(x):
    x += 1


@sm.host_kernel
def total(x, box):
    box[0] = x.sum()


@sm.host_kernel
def slow_fill(x, v, seconds):
    import time
    time.sleep(seconds)
    x[:] = v


class Foreign:
    """A stand-in for another library's array over a sharedmem buffer."""

    def __init__(self, buf):
        self.buf = buf


class ForeignKernel:
    """A kernel type launched through the adapter below: it fills its first
    argument with 7 on the host."""

    __name__ = "foreign_fill"


class _ForeignAdapter(sm.KernelAdapter):
    """Makes a view of each Foreign argument per launch -- referenced by
    nothing but the launch, as interop.cupy does for CuPy arrays -- and
    records every view it made in ``made``."""

    name = "foreign kernel"
    device_kinds = ("host",)
    made: list = []

    def coerce(self, obj, device):
        if not isinstance(obj, Foreign):
            return None
        v = obj.buf[:]
        self.made.append(id(v))  # an id only: the view must stay unreferenced
        return v

    def prepare(self, kernel, grid, block, args, shared_mem, stream):
        from sharedmem.backends.host import ndarray_of
        arr = ndarray_of(args[0].view, True)
        return (lambda: stream._impl.submit(lambda: arr.fill(7))), ()


sm.register_kernel_adapter(ForeignKernel, _ForeignAdapter())
