"""8 threads doing slices, moves, borrows, launches and drops on one shared
allocation: no false alias, no missed one.

The suite runs a short version; ``make stress`` (SHAREDMEM_STRESS_FULL=1) runs
1,000,000 uniqueness checks and 100,000 alias attempts.
"""

import os
import threading
import time

import numpy as np

import sharedmem as sm

FULL = os.environ.get("SHAREDMEM_STRESS_FULL") == "1"
THREADS = 8
UNIQUE = 1_000_000 if FULL else 16_000  # successful moves that must not see a false alias
ALIAS = 100_000 if FULL else 2_000  # moves attempted with a real alias alive


@sm.host_kernel
def touch(x, y):
    y[:] = x


def worker(tid, mine, host, counts, errors):
    try:
        stream = host.create_stream()
        scratch = sm.Buffer.empty(64, "float32", device=host)
        b = mine
        unique = alias = 0
        per = UNIQUE // THREADS
        i = 0
        while unique < per:
            t = sm.Tensor.from_buffer(b, (8, 8))  # must succeed: nothing else sees these bytes
            unique += 1
            if i % 50 == 0:
                with t.as_buffer() as borrowed:
                    sm.launch(touch, 1, 1, sm.In(borrowed), sm.Out(scratch), stream=stream)  # future dropped
            b = t.into_buffer()
            unique += 1
            i += 1
        for i in range(ALIAS // THREADS):
            k = i % 64
            alias_view = b[k:k + 1] if i % 3 else b.as_readonly()
            try:
                sm.Tensor.from_buffer(b, (64,))
            except sm.AliasError as e:
                if len(e.views) != 1:
                    errors.append(f"thread {tid}: expected one alias, got {e.views}")
            else:
                errors.append(f"thread {tid}: missed a live alias at attempt {i}")
                return
            alias += 1
            if i % 2:
                alias_view.release()
            else:
                del alias_view  # garbage collected, not released explicitly
            t = sm.Tensor.from_buffer(b, (64,))  # the alias is gone: must succeed
            unique += 1
            b = t.into_buffer()
        stream.synchronize()
        counts[tid] = (unique, alias)
    except Exception as e:  # reported by the main thread
        errors.append(f"thread {tid}: {type(e).__name__}: {e}")


def test_threads_find_no_false_alias_and_miss_none():
    host = sm.Device.host()
    parent = sm.Buffer.from_host(np.arange(THREADS * 64, dtype=np.float32), device=host)
    parts = [parent[i * 64:(i + 1) * 64] for i in range(THREADS)]
    alloc = parent.allocation
    parent.release()
    counts, errors = {}, []
    threads = [threading.Thread(target=worker, args=(i, parts[i], host, counts, errors))
               for i in range(THREADS)]
    parts = None
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    elapsed = time.perf_counter() - t0
    assert errors == []
    unique = sum(c[0] for c in counts.values())
    alias = sum(c[1] for c in counts.values())
    assert len(counts) == THREADS
    assert unique >= UNIQUE and alias == ALIAS // THREADS * THREADS
    if FULL:
        print(f"\nstress: {unique} uniqueness checks, {alias} alias attempts, {THREADS} threads, "
              f"{elapsed:.1f} s")
    sm.synchronize()
    assert alloc.live_views == 0
    assert not alloc.tracker
