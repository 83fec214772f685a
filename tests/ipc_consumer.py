"""The importing side of the CUDA IPC tests (run in processes started with `spawn`)."""

import numpy as np


def consumer(conn, spin_ms):
    """For each handle received: open it, copy it with a slow kernel into memory of our own,
    drop the imported view at once (the kernel still reads it), then check the copy and
    report whether it held the round's value. None ends the loop."""
    import sharedmem as sm
    import gpu_kernels as K
    dev = sm.Device(0)
    s = dev.create_stream("consumer")
    out = None
    while True:
        msg = conn.recv()
        if msg is None:
            break
        handle, value = msg
        t = sm.ipc.open(handle, stream=s)
        if out is None:
            out = sm.Buffer.empty(t.size, "float32", device=dev, stream=s)
        sm.launch(K.kernel("slow_copy"), 256, 256, sm.In(t), sm.Out(out), t.size,
                  K.cycles(spin_ms), stream=s)
        del t  # the last handle, while the kernel runs: the export must outlive it
        got = out.to_host(stream=s)
        conn.send(bool((got == value).all()))
    sm.synchronize()
    conn.send("bye")


def stuck(conn, spin_ms):
    """Open one handle, start a long kernel on it, say so, and wait to be killed."""
    import time
    import sharedmem as sm
    import gpu_kernels as K
    handle = conn.recv()
    t = sm.ipc.open(handle)
    out = sm.Buffer.empty(t.size, "float32", device=t.device)
    sm.launch(K.kernel("slow_copy"), 1, 32, sm.In(t), sm.Out(out), t.size, K.cycles(spin_ms))
    conn.send("running")
    time.sleep(600)


def opener(conn):
    """Open handles and answer with the values (or the error) -- for the refusals."""
    import sharedmem as sm
    while True:
        handle = conn.recv()
        if handle is None:
            return
        try:
            t = sm.ipc.open(handle)
            conn.send(("ok", t.to_host().tolist(), repr(t)))
            del t
        except Exception as e:
            conn.send((type(e).__name__, str(e), ""))
