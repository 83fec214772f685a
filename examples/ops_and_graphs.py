"""Describe work once, compose it, capture it, replay it -- without giving up ownership.

    a, b = fill(x, 1.5), fill(y, 2.0)      two independent launches
    zip(a, b).and_then(add(x, y -> out))   run side by side on two streams, joined on the device
    sm.graph(chain)                        the same chain captured once ...
    g.replay() x 3                         ... replayed with fresh leases each time

The graph owns what it captured: the inputs are dropped before the replays, and the graph
keeps their memory valid (and refuses to let it be moved while it lives).
Host kernels here; on a GPU the same ops take CuPy RawKernels or cuTile kernels.
Run: ``PYTHONPATH=. python3 examples/ops_and_graphs.py``
"""

import sys

import numpy as np

import sharedmem as sm


@sm.host_kernel
def fill(x, value):
    x[:] = value


@sm.host_kernel
def add_into(x, y, out):
    out += x + y


def main() -> int:
    dev = sm.Device.host()
    x = sm.Buffer.zeros(1000, "float64", device=dev)
    y = sm.Buffer.zeros(1000, "float64", device=dev)
    out = sm.Buffer.zeros(1000, "float64", device=dev)
    dev.default_stream.synchronize()

    both = sm.zip(sm.op(fill, 1, 1, sm.Out(x), 1.5), sm.op(fill, 1, 1, sm.Out(y), 2.0))
    chain = both.and_then(sm.op(add_into, 1, 1, sm.In(x), sm.In(y), sm.InOut(out)))
    chain.apply(lambda _: print("zip + and_then done on", dev)).submit().result()
    first = out.to_host()[0]

    g = sm.graph(sm.op(fill, 1, 1, sm.Out(x), 1.0)
                 .and_then(sm.op(add_into, 1, 1, sm.In(x), sm.In(x), sm.InOut(out))))
    try:
        sm.Tensor.from_buffer(out, (10, 100))
    except sm.AliasError as e:
        print("moving captured memory is refused while the graph lives:\n  " + e.views[0])
    del x, y  # the graph keeps what it captured
    for _ in range(3):
        g.replay()
    sm.synchronize()
    result = out.to_host()
    ok = first == 3.5 and np.all(result == 3.5 + 3 * 2.0)
    print(f"out = {result[0]} after one chain and three replays (expected {3.5 + 6.0}): "
          f"{'OK' if ok else 'MISMATCH'}")
    g.release()
    t = sm.Tensor.from_buffer(out, (10, 100))  # released graph: the move succeeds
    print("after g.release(), the move succeeds:", t.shape)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
