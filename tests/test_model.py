"""A hypothesis state machine: create / slice / move / borrow / launch / chunks on one
stream / drop / complete / capture / replay / drop a graph, checked against a simple
reference model of views and leases (a graph's token is a view; a replay is a lease; a
stream's leases finish in order).

Every allocation is filled with its own tag value and kernels only ever write
that tag back, so a kernel that reads anything else proves memory was freed
and reused early. The machine runs under policy "reject", each launch on a
stream of its own, so the model also predicts every AccessConflictError.
"""

import gc
import os
import threading
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import sharedmem as sm

HOST = sm.Device.host()


class Handle:
    def __init__(self, obj, alloc_key, start, stop, writable, kind):
        self.obj, self.alloc_key = obj, alloc_key
        self.start, self.stop, self.writable, self.kind = start, stop, writable, kind
        self.state = "live"


class Lease:
    def __init__(self, fut, gate, alloc_key, start, stop, writes, stream=None):
        self.fut, self.gate, self.stream = fut, gate, stream
        self.alloc_key, self.start, self.stop, self.writes = alloc_key, start, stop, writes


class OpEntry:
    """An op over one handle, submitted again and again to one stream."""

    def __init__(self, op, gate, handle, writes, stream):
        self.op, self.gate, self.handle, self.writes, self.stream = op, gate, handle, writes, stream


class GraphEntry:
    def __init__(self, graph, gate, handle, writes):
        self.graph, self.gate, self.handle, self.writes = graph, gate, handle, writes


def overlap(a0, a1, b0, b1):
    return a0 < a1 and b0 < b1 and a0 < b1 and b0 < a1


class OwnershipMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.handles: list[Handle] = []
        self.leases: list[Lease] = []
        self.graphs: list[GraphEntry] = []
        self.ops: list[OpEntry] = []
        self.allocs: dict[int, weakref.ref] = {}
        self.tags: dict[int, int] = {}
        self.corrupt: list = []
        self.next_tag = 1

    # -- helpers ------------------------------------------------------------
    def live(self):
        return [h for h in self.handles if h.state == "live"]

    def pick(self, i, kind=None):
        cands = [h for h in self.views() if kind is None or h.kind == kind]
        return cands[i % len(cands)] if cands else None

    def views(self):
        return [h for h in self.live() if h.kind not in ("graph", "export")]

    def exportable(self):
        """Views no unfinished lease overlaps: a host export waits for the work on its bytes
        (the CPU reads at once), which the model's gated kernels never finish by themselves."""
        return [h for h in self.views() if not any(
            l.alloc_key == h.alloc_key and overlap(l.start, l.stop, h.start, h.stop)
            for l in self.leases)]

    def move_conflicts(self, h):
        return [o for o in self.live() if o is not h and o.alloc_key == h.alloc_key
                and overlap(h.start, h.stop, o.start, o.stop) and (h.writable or o.writable)]

    # -- rules --------------------------------------------------------------
    @rule(n=st.integers(0, 64))
    def create(self, n):
        tag = self.next_tag
        self.next_tag += 1
        b = sm.Buffer.from_host(np.full(n, tag, np.int32), device=HOST)
        HOST.default_stream.synchronize()
        key = b.allocation.id
        self.allocs[key] = weakref.ref(b.allocation)
        self.tags[key] = tag
        self.handles.append(Handle(b, key, 0, 4 * n, True, "buffer"))

    @precondition(lambda self: any(h.kind == "buffer" for h in self.live()))
    @rule(i=st.integers(0, 99), a=st.integers(0, 64), b=st.integers(0, 64))
    def slice(self, i, a, b):
        h = self.pick(i, "buffer")
        n = (h.stop - h.start) // 4
        a, b = min(a, n), min(max(a, b), n)
        s = h.obj[a:b]
        assert s.ptr == h.obj.ptr + 4 * a and len(s) == b - a
        self.handles.append(Handle(s, h.alloc_key, h.start + 4 * a, h.start + 4 * b, h.writable, "buffer"))

    @precondition(lambda self: bool(self.views()))
    @rule(i=st.integers(0, 99))
    def readonly(self, i):
        h = self.pick(i)
        r = h.obj.as_readonly()
        kind = h.kind
        self.handles.append(Handle(r, h.alloc_key, h.start, h.stop, False, kind))

    @precondition(lambda self: any(h.kind == "buffer" for h in self.live()))
    @rule(i=st.integers(0, 99))
    def move_to_tensor(self, i):
        h = self.pick(i, "buffer")
        expected = self.move_conflicts(h)
        ptr = h.obj.ptr
        try:
            t = sm.Tensor.from_buffer(h.obj, ((h.stop - h.start) // 4,))
        except sm.AliasError as e:
            assert len(e.views) == len(expected), (e, len(expected))
            assert h.obj.ptr == ptr  # source still usable
            return
        assert not expected, f"missed aliases: {len(expected)}"
        assert t.ptr == ptr
        h.state = "moved"
        with pytest.raises(sm.MovedError):
            h.obj.ptr
        self.handles.append(Handle(t, h.alloc_key, h.start, h.stop, h.writable, "tensor"))

    @precondition(lambda self: any(h.kind == "tensor" for h in self.live()))
    @rule(i=st.integers(0, 99))
    def move_to_buffer(self, i):
        h = self.pick(i, "tensor")
        expected = self.move_conflicts(h)
        ptr = h.obj.ptr
        try:
            b = h.obj.into_buffer()
        except sm.AliasError as e:
            assert len(e.views) == len(expected)
            assert h.obj.ptr == ptr
            return
        assert not expected
        assert b.ptr == ptr
        h.state = "moved"
        self.handles.append(Handle(b, h.alloc_key, h.start, h.stop, h.writable, "buffer"))

    @precondition(lambda self: any(h.kind == "tensor" for h in self.live()))
    @rule(i=st.integers(0, 99))
    def borrow(self, i):
        h = self.pick(i, "tensor")
        b = h.obj.as_buffer()
        assert b.ptr == h.obj.ptr
        self.handles.append(Handle(b, h.alloc_key, h.start, h.stop, h.writable, "buffer"))

    @precondition(lambda self: bool(self.exportable()))
    @rule(i=st.integers(0, 99))
    def export(self, i):
        """``np.from_dlpack(view)``: a zero-copy NumPy array over the view's bytes, read-only
        for a read-only view. Until it is dropped it is one more live view of those bytes: a
        move over them is refused naming it, and the allocation stays (the source view may
        go first)."""
        cands = self.exportable()
        h = cands[i % len(cands)]
        a = np.from_dlpack(h.obj)
        assert a.nbytes == h.stop - h.start and a.flags.writeable == h.writable
        if a.size:
            assert a.ctypes.data == h.obj.ptr  # zero-copy
            assert (a.view(np.int32) == self.tags[h.alloc_key]).all()
        self.handles.append(Handle(a, h.alloc_key, h.start, h.stop, h.writable, "export"))

    @precondition(lambda self: any(h.kind == "export" for h in self.live()))
    @rule(i=st.integers(0, 99))
    def drop_export(self, i):
        live = [h for h in self.live() if h.kind == "export"]
        h = live[i % len(live)]
        h.state = "released"
        h.obj = None  # (the consumer's array: its DLPack deleter ends the export)
        gc.collect()

    @precondition(lambda self: bool(self.views()))
    @rule(i=st.integers(0, 99), explicit=st.booleans())
    def drop(self, i, explicit):
        h = self.pick(i)
        if any(e.handle is h for e in self.ops):
            explicit = True  # an op references the view: only release() ends it
        if explicit:
            h.obj.release()
            with pytest.raises(sm.ReleasedError):
                h.obj.ptr
        h.state = "released"
        h.obj = None
        gc.collect()

    @precondition(lambda self: bool(self.views()))
    @rule(i=st.integers(0, 99), mode=st.sampled_from(["in", "out", "atomic"]),
          again=st.integers(0, 99) | st.none())
    def launch(self, i, mode, again):
        """On a new stream, or (``again``) on one whose earlier work is still pending: the
        stream then holds several unfinished leases, overlapping or not, and the tracker must
        keep every byte of each leased for the other streams until it is done."""
        h = self.pick(i)
        writes = mode != "in"
        if writes and not h.writable:
            with pytest.raises(sm.KernelError):
                sm.launch(_checker, 1, 1, sm.Out(h.obj), 0, self.corrupt, threading.Event())
            return
        busy = [l.stream for l in self.leases if l.stream is not None]
        stream = busy[again % len(busy)] if again is not None and busy else \
            HOST.create_stream()
        expect_conflict = self._conflicts(h, writes, stream)
        gate = threading.Event()
        intent = {"in": sm.In, "out": sm.Out, "atomic": sm.Atomic}[mode]
        try:
            fut = sm.launch(_checker, 1, 1, intent(h.obj), self.tags[h.alloc_key], self.corrupt,
                            gate, stream=stream, policy="reject")
        except sm.AccessConflictError:
            assert expect_conflict
            return
        assert not expect_conflict
        self.leases.append(Lease(fut, gate, h.alloc_key, h.start, h.stop, writes, stream))

    @precondition(lambda self: bool(self.views()))
    @rule(i=st.integers(0, 99), j=st.integers(0, 99), k=st.integers(0, 99),
          modes=st.tuples(*[st.sampled_from(["in", "out"])] * 3))
    def chunks_on_one_stream(self, i, j, k, modes):
        """A chunked pipeline: two views of one allocation used one after the other on one
        stream, the first finishes, then a third view of it is used on another stream. The
        tracker keeps the two ranges apart, so what conflicts is exactly what the model says
        (merged into one span tagged with the newer work, the first's range would still
        conflict after it finished)."""
        h1 = self.pick(i)
        same = [h for h in self.views() if h.alloc_key == h1.alloc_key]
        h2, h3 = same[j % len(same)], same[k % len(same)]
        s = HOST.create_stream()
        first = None
        for h, mode in ((h1, modes[0]), (h2, modes[1])):
            writes = mode == "out"
            if writes and not h.writable:
                continue
            expect_conflict = self._conflicts(h, writes, s)
            gate = threading.Event()
            try:
                fut = sm.launch(_checker, 1, 1, (sm.Out if writes else sm.In)(h.obj),
                                self.tags[h.alloc_key], self.corrupt, gate, stream=s,
                                policy="reject")
            except sm.AccessConflictError:
                assert expect_conflict
                continue
            assert not expect_conflict
            lease = Lease(fut, gate, h.alloc_key, h.start, h.stop, writes, s)
            self.leases.append(lease)
            first = first or lease
        if first is not None:  # the first finishes (what came before it on s: nothing)
            first.gate.set()
            first.fut.result(10)
            self.leases.remove(first)
        writes = modes[2] == "out"
        if writes and not h3.writable:
            return
        expect_conflict = self._conflicts(h3, writes)
        gate = threading.Event()
        try:
            fut = sm.launch(_checker, 1, 1, (sm.Out if writes else sm.In)(h3.obj),
                            self.tags[h3.alloc_key], self.corrupt, gate,
                            stream=HOST.create_stream(), policy="reject")
        except sm.AccessConflictError:
            assert expect_conflict
            return
        assert not expect_conflict
        self.leases.append(Lease(fut, gate, h3.alloc_key, h3.start, h3.stop, writes))

    def _conflicts(self, h, writes, stream=None):
        return any(l.alloc_key == h.alloc_key and overlap(l.start, l.stop, h.start, h.stop)
                   and (writes or l.writes) and (stream is None or l.stream is not stream)
                   for l in self.leases)

    @precondition(lambda self: bool(self.views()))
    @rule(i=st.integers(0, 99), mode=st.sampled_from(["in", "out"]))
    def make_op(self, i, mode):
        h = self.pick(i)
        writes = mode != "in"
        if writes and not h.writable:
            return
        gate = threading.Event()
        o = sm.op(_checker, 1, 1, (sm.Out if writes else sm.In)(h.obj), self.tags[h.alloc_key],
                  self.corrupt, gate, policy="reject")
        self.ops.append(OpEntry(o, gate, h, writes, HOST.create_stream()))

    @precondition(lambda self: bool(self.ops))
    @rule(i=st.integers(0, 99))
    def submit_op(self, i):
        """Submitted again, an op reuses its preparation while its view lives."""
        e = self.ops[i % len(self.ops)]
        h = e.handle
        if h.state != "live":
            with pytest.raises((sm.MovedError, sm.ReleasedError)):
                e.op.submit(e.stream)
            return
        expect_conflict = self._conflicts(h, e.writes, e.stream)
        try:
            fut = e.op.submit(e.stream)
        except sm.AccessConflictError:
            assert expect_conflict
            return
        assert not expect_conflict
        gate = e.gate
        if gate.is_set():  # completed before: this submission runs once the work before it on
            # its stream has (a launch there meanwhile: it finishes when the last one does)
            before = [l for l in self.leases if l.stream is e.stream]
            if not before:
                fut.result(10)
                return
            gate = before[-1].gate
        self.leases.append(Lease(fut, gate, h.alloc_key, h.start, h.stop, e.writes, e.stream))

    @precondition(lambda self: bool(self.leases))
    @rule(i=st.integers(0, 99))
    def complete(self, i):
        k = i % len(self.leases)
        gates = [self.leases[k].gate]
        # Replays of one graph share its gate, and so do the submissions of one op: they all
        # finish. A stream runs in order: what came before each of them on it, too -- and
        # that work's gate finishes what shares it (an op's submissions on either side of a
        # launch on its stream: the later one waits for that launch)
        grown = True
        while grown:
            grown = False
            for j, lease in enumerate(self.leases):
                if any(lease.gate is g for g in gates) and lease.stream is not None:
                    for l in self.leases[:j]:
                        if l.stream is lease.stream and not any(l.gate is g for g in gates):
                            gates.append(l.gate)
                            grown = True
        for g in gates:
            g.set()
        for done in [l for l in self.leases if any(l.gate is g for g in gates)]:
            self.leases.remove(done)
            done.fut.result(10)

    @precondition(lambda self: bool(self.views()))
    @rule(i=st.integers(0, 99), mode=st.sampled_from(["in", "out"]))
    def capture(self, i, mode):
        h = self.pick(i)
        writes = mode != "in"
        if writes and not h.writable:
            return
        gate = threading.Event()
        s = HOST.create_stream()
        with sm.capture(s) as g:
            f = sm.launch(_checker, 1, 1, (sm.Out if writes else sm.In)(h.obj),
                          self.tags[h.alloc_key], self.corrupt, gate, stream=s)
            assert f.done()  # captured, not run
        gh = Handle(g, h.alloc_key, h.start, h.stop, h.writable, "graph")
        self.handles.append(gh)
        self.graphs.append(GraphEntry(g, gate, gh, writes))

    @precondition(lambda self: any(e.handle.state == "live" for e in self.graphs))
    @rule(i=st.integers(0, 99))
    def replay(self, i):
        live = [e for e in self.graphs if e.handle.state == "live"]
        e = live[i % len(live)]
        h = e.handle
        expect_conflict = any(
            l.alloc_key == h.alloc_key and overlap(l.start, l.stop, h.start, h.stop)
            and (e.writes or l.writes) for l in self.leases)
        try:
            fut = e.graph.replay(HOST.create_stream(), policy="reject")
        except sm.AccessConflictError:
            assert expect_conflict
            return
        assert not expect_conflict
        if e.gate.is_set():  # this graph's gate was opened before: the replay just runs
            fut.result(10)
        else:
            self.leases.append(Lease(fut, e.gate, h.alloc_key, h.start, h.stop, e.writes))

    @precondition(lambda self: any(e.handle.state == "live" for e in self.graphs))
    @rule(i=st.integers(0, 99), explicit=st.booleans())
    def drop_graph(self, i, explicit):
        live = [e for e in self.graphs if e.handle.state == "live"]
        e = live[i % len(live)]
        if explicit:
            e.graph.release()
        e.handle.state = "released"
        e.handle.obj = None
        e.graph = None  # in-flight replays keep it alive by themselves
        gc.collect()

    # -- invariants ----------------------------------------------------------
    @invariant()
    def views_and_leases_match_the_model(self):
        assert not self.corrupt, self.corrupt
        for key, ref in self.allocs.items():
            handles = [h for h in self.live() if h.alloc_key == key]
            leases = [l for l in self.leases if l.alloc_key == key]
            alloc = ref()
            if alloc is None:
                assert not handles and not leases, "allocation freed while in use"
                continue
            assert alloc.live_views == len(handles)
            assert bool(alloc.tracker) == any(l.start < l.stop for l in leases)  # empty: no lease

    def teardown(self):
        for lease in self.leases:
            lease.gate.set()
        for e in self.graphs:
            e.gate.set()
        for e in self.ops:
            e.gate.set()
        sm.synchronize()
        assert not self.corrupt, self.corrupt


@sm.host_kernel
def _checker(x, tag, corrupt, gate):
    gate.wait(10)
    if x.size and not (x == tag).all():
        corrupt.append((tag, np.unique(x)[:5].tolist()))
    if x.flags.writeable:
        x[:] = tag


def test_an_op_resubmitted_behind_open_work_on_its_stream_stays_a_lease():
    """An op whose gate was opened, submitted again on its stream behind a launch still
    gated there, does not just run: the model keeps it a lease (it waited for the launch,
    whose gate then timed out and finished it behind the model's back: the tracker was
    empty where the model said leased, or result() timed out)."""
    s = OwnershipMachine()
    try:
        s.create(n=2)
        s.make_op(i=0, mode="in")
        s.submit_op(i=0)
        s.launch(again=0, i=0, mode="in")  # on the op's stream, behind its submission
        s.complete(i=0)  # the op's gate: its submission finishes, the launch stays
        s.submit_op(i=0)  # behind the launch
        s.views_and_leases_match_the_model()
        assert len(s.leases) == 2
        s.complete(i=1)  # the new submission: the launch ahead of it finishes too
        assert not s.leases
        s.views_and_leases_match_the_model()
        s.make_op(i=0, mode="in")  # the same again, the launch completed this time
        s.submit_op(i=1)
        s.launch(again=0, i=0, mode="in")
        s.complete(i=0)
        s.submit_op(i=1)  # (its gate is open: only the launch holds it)
        assert len(s.leases) == 2
        s.complete(i=0)  # the launch: the submission behind it finishes with it
        assert not s.leases
        s.views_and_leases_match_the_model()
    finally:
        s.teardown()


# How many random programs: the "quick" profile by default (make test, CI: a few seconds),
# "full" for a thorough run (SHAREDMEM_MODEL=full make test; make stress sets it too), or a
# number (SHAREDMEM_MODEL=1000).
MODEL_PROFILES = {"quick": 40, "full": 300}
_model = os.environ.get("SHAREDMEM_MODEL", "quick")
MODEL_EXAMPLES = MODEL_PROFILES[_model] if _model in MODEL_PROFILES else int(_model)

TestOwnershipModel = OwnershipMachine.TestCase
TestOwnershipModel.settings = settings(max_examples=MODEL_EXAMPLES, stateful_step_count=40,
                                       deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


# The launch path checks and records a submission's leases in one call each
# (access.leases_to_check_locked, access.record_leases_locked), with the tracker's common cases
# done without a call to AccessTracker.elsewhere_locked or record_locked. Both ways must give
# the same answers and leave the same spans.
_range = st.tuples(st.integers(0, 64), st.integers(0, 64)).map(sorted)
_batch = st.tuples(st.integers(0, 1), st.lists(st.tuples(_range, st.booleans()), max_size=4))


@pytest.mark.parametrize("foreign", [False, True])
def test_leases_recorded_at_once_leave_the_spans_recording_each_leaves(foreign):
    from hypothesis import given

    from sharedmem.access import leases_to_check_locked, record_leases_locked
    from sharedmem.allocation import unregistered_token
    from sharedmem.runtime.state import locked

    @settings(max_examples=MODEL_EXAMPLES * 5, deadline=None)
    @given(st.lists(_batch, max_size=12))
    def check(batches):
        a, b = (sm.Buffer.empty(64, "uint8", device=HOST) for _ in range(2))
        ta, tb = a._token.allocation.tracker, b._token.allocation.tracker
        streams = [HOST.create_stream(), HOST.create_stream()]
        producer = object()  # (a foreign producer the tokens keep, or their allocation)
        keep = producer if foreign else a._token.allocation
        for seq, (which, leases) in enumerate(batches, 1):
            s, marker = streams[which], object()
            uses = [(unregistered_token(a._token.allocation, "t", lo, hi, True, keep), w)
                    for (lo, hi), w in leases]
            for i, (tok, _) in enumerate(uses):
                tok.live = i % 3 != 2  # (a released token among them: to be looked at)
            with locked():
                # the leases to look at before the enqueue: those elsewhere_locked names, and
                # the released ones, in order
                want = [u for u in uses if not u[0].live or ta.elsewhere_locked(s)]
                assert leases_to_check_locked(s, uses) == (want or None)
                keeps = record_leases_locked(s, uses, seq, marker)
                for (lo, hi), w in leases:
                    tb.record_locked(s, w, lo, hi, seq, marker)
            assert keeps == ([producer] * len(leases) if foreign and leases else None)
            for s2 in streams:
                ua, ub = ta.uses_locked().get(s2._uid), tb.uses_locked().get(s2._uid)
                assert (ua is None) == (ub is None)
                if ua is not None:
                    assert ua.newest == ub.newest
                    for x, y in ((ua.reads, ub.reads), (ua.writes, ub.writes)):
                        assert [(e.lo, e.hi, e.seq, e.marker) for e in x or ()] == \
                               [(e.lo, e.hi, e.seq, e.marker) for e in y or ()]
    check()
