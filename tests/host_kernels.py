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
