"""A fake CUDA driver (the cuda.bindings names sharedmem uses) and a fake CuPy pool.

It lets the real CudaBackend code run on machines without a GPU: "device"
memory is host RAM, every stream executes its operations at once (so events
are complete when recorded), and stream capture records the operations for a
graph launch to run later. It checks the glue -- names, argument order, result
unpacking, capture bookkeeping -- not the driver's semantics.
"""

import ctypes
import enum
import itertools
import threading
import types

import numpy as np


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906


class _Handle(int):
    def __new__(cls, value=0):
        return super().__new__(cls, int(value))


class CUstream(_Handle):
    pass


class CUevent(_Handle):
    pass


class CUgraph(_Handle):
    pass


class CUgraphExec(_Handle):
    pass


OK = CUresult.CUDA_SUCCESS


_handle_ids = itertools.count(0x1000)  # (see FakeDriver.__init__)


class FakeDriver:
    """The subset of ``cuda.bindings.driver`` that sharedmem calls."""

    CUresult = CUresult
    CUstream = CUstream
    CUevent = CUevent
    CUevent_flags = types.SimpleNamespace(CU_EVENT_DISABLE_TIMING=2, CU_EVENT_INTERPROCESS=4)
    CUstream_flags = types.SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    CUstreamCaptureMode = types.SimpleNamespace(CU_STREAM_CAPTURE_MODE_GLOBAL=0,
                                                CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1,
                                                CU_STREAM_CAPTURE_MODE_RELAXED=2)
    CUdevice_attribute = types.SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=75,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=76,
        CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK=1, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X=2,
        CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y=3, CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z=4,
        CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X=5, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y=6,
        CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z=7,
        CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN=97)
    # an H200's answers
    ATTRIBUTES = {75: 9, 76: 0, 1: 1024, 2: 1024, 3: 1024, 4: 64, 5: 2**31 - 1, 6: 65535,
                  7: 65535, 97: 232448}
    CUpointer_attribute = types.SimpleNamespace(
        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR=11, CU_POINTER_ATTRIBUTE_RANGE_SIZE=12,
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL=9, CU_POINTER_ATTRIBUTE_MEMORY_TYPE=2)
    CUmemorytype = types.SimpleNamespace(CU_MEMORYTYPE_DEVICE=2)
    CUDA_MEMCPY2D = types.SimpleNamespace

    def __init__(self):
        # (one count for every fake driver of the process: a handle names one object, as the
        # driver's live handles do -- a stream a test left alive is never another's stream)
        self._ids = _handle_ids
        self.capturing = {}  # stream handle -> list of recorded operations
        self.capture_info = {}  # stream handle -> (its capture's mode, the capturing thread)
        self.invalidated = set()  # capturing streams a refused unsafe call invalidated
        self.graphs = {}  # graph handle -> operations
        self.execs = {}  # exec handle -> operations
        self.events = set()
        self.stream_flags = {}  # stream handle -> the flags it was made with
        self.destroyed_events = 0
        self.calls = []
        # While `holding`, recorded events stay pending (work "in flight") until
        # finish_held() or a cuEventSynchronize on them.
        self.holding = False
        self.held = set()
        # Several devices: `count` devices, device d's primary context 0xC0 + d; streams and
        # events belong to the context current when they were made, and a call on a stream of
        # another context than the current one fails (as the driver's would), except waits.
        self.count = 1
        self.current = 0
        self.ctx_of = {}  # stream or event handle -> its context
        self.no_peer = set()  # (device, peer) pairs cuDeviceCanAccessPeer refuses
        self.peer_enabled = set()  # (context, peer context)
        # CUDA IPC, simulated in one process: the driver allocations a test declares
        # (base -> size: what cuPointerGetAttributes answers for them; others are unknown to
        # it), and the "other process's" mappings of them (fresh host memory: the bookkeeping
        # is what is tested, not shared bytes)
        self.ranges = {}
        self.range_device = {}  # base -> the ordinal of the device it lies on (default 0)
        self.ipc_maps = {}  # mapped base -> its memory

    def finish_held(self):
        self.held.clear()

    # -- helpers -------------------------------------------------------------
    def _run(self, stream, op):
        rec = self.capturing.get(int(stream))
        if rec is not None:
            rec.append(op)
        else:
            op()

    # -- device and context ----------------------------------------------------
    def cuInit(self, flags):
        return (OK,)

    def cuDeviceGetCount(self):
        return (OK, self.count)

    def cuDeviceGet(self, ordinal):
        return (OK, ordinal)

    def cuDeviceGetName(self, n, dev):
        return (OK, b"Fake GPU\0\0")

    def cuDeviceGetUuid(self, dev):
        return (OK, types.SimpleNamespace(bytes=bytes(range(16))))

    def cuDeviceGetAttribute(self, attr, dev):
        return (OK, self.ATTRIBUTES.get(int(attr), 0))

    def cuDevicePrimaryCtxRetain(self, dev):
        return (OK, 0xC0 + int(dev))

    def cuCtxSetCurrent(self, ctx):
        self.current = int(ctx)
        return (OK,)

    def cuCtxGetCurrent(self):
        return (OK, self.current)

    def cuCtxPushCurrent(self, ctx):
        self._ctx_stack = getattr(self, "_ctx_stack", []) + [self.current]
        self.current = int(ctx)
        return (OK,)

    def cuCtxPopCurrent(self):
        ctx, self.current = self.current, self._ctx_stack.pop()
        return (OK, ctx)

    def cuCtxGetDevice(self):
        """The current context's device (contexts 0xC0 + d are device d's primary ones; a
        test's other contexts of device d are 0xD00 + d)."""
        c = self.current
        return (OK, c - 0xD00 if c >= 0xD00 else c - 0xC0 if c >= 0xC0 else 0)

    def cuStreamGetCtx(self, stream):
        """The context a stream was made in (``ctx_of``: a test may name other contexts);
        a handle not made here (a foreign stream a test names by number) is not known."""
        ctx = self.ctx_of.get(int(stream))
        return (OK, ctx) if ctx is not None else (CUresult.CUDA_ERROR_INVALID_HANDLE, None)

    def cuDeviceCanAccessPeer(self, dev, peer):
        return (OK, int(int(dev) != int(peer) and (int(dev), int(peer)) not in self.no_peer))

    def cuCtxEnablePeerAccess(self, peer_ctx, flags):
        key = (self.current, int(peer_ctx))
        if key in self.peer_enabled:
            return (CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,)
        self.peer_enabled.add(key)
        self.calls.append(("peer", self.current, int(peer_ctx)))
        return (OK,)

    def _in_context(self, stream):
        """A call on ``stream`` is valid only with its context current (stream 0: the
        current context's legacy stream)."""
        return int(stream) == 0 or self.ctx_of.get(int(stream), self.current) == self.current

    def cuGetErrorName(self, err):
        return (OK, CUresult(int(err)).name.encode())

    def cuMemGetInfo(self):
        return (OK, 1 << 30, 1 << 31)

    def cuPointerGetAttributes(self, n, attrs, ptr):
        for base, size in self.ranges.items():
            if base <= int(ptr) < base + size:
                return (OK, [base, size, self.range_device.get(base, 0),
                             self.CUmemorytype.CU_MEMORYTYPE_DEVICE])
        return (OK, [0, 0, 0, 0])

    # -- CUDA IPC (handles: the base address or event, in the first 8 of 64 bytes) ----------
    CUipcMemHandle = CUipcEventHandle = types.SimpleNamespace

    def cuIpcGetMemHandle(self, base):
        return (OK, types.SimpleNamespace(reserved=int(base).to_bytes(8, "little") + bytes(56)))

    def cuIpcOpenMemHandle(self, handle, flags):
        if self._unsafe_call_refused():  # (a mapping, as cuMemAlloc: refused, we assume)
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, 0)
        size = self.ranges[int.from_bytes(handle.reserved[:8], "little")]
        mem = np.zeros(size + 256, np.uint8)
        base = (mem.ctypes.data + 255) // 256 * 256
        self.ipc_maps[base] = mem
        self.calls.append(("ipc_open", base))
        return (OK, base)

    def cuIpcCloseMemHandle(self, base):
        if self._unsafe_call_refused():  # (an unmapping, as cuMemFree: refused, we assume)
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
        del self.ipc_maps[int(base)]
        self.calls.append(("ipc_close", int(base)))
        return (OK,)

    def cuIpcGetEventHandle(self, ev):
        return (OK, types.SimpleNamespace(reserved=int(ev).to_bytes(8, "little") + bytes(56)))

    def cuIpcOpenEventHandle(self, handle):
        return self.cuEventCreate(0)

    # -- streams and events --------------------------------------------------------
    def cuStreamCreate(self, flags):
        h = CUstream(next(self._ids))
        self.ctx_of[int(h)] = self.current
        self.stream_flags[int(h)] = int(flags)
        return (OK, h)

    def cuStreamGetFlags(self, stream):
        """A stream made here: its flags; any other handle (a foreign stream a test names by
        number): 0, a blocking stream."""
        return (OK, self.stream_flags.get(int(stream), 0))

    def cuStreamDestroy(self, stream):
        return (OK,)

    def cuStreamSynchronize(self, stream):
        if int(stream) in self.capturing:  # (the capturing stream itself: refused in every
            self.invalidated.add(int(stream))  # mode, relaxed too -- its work is not run --,
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)  # and invalidated)
        if self._legacy_refused(stream):
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,)
        if self._unsafe_call_refused():
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
        self.calls.append(("stream_sync", int(stream)))
        return (OK,)

    def cuEventCreate(self, flags):
        ev = CUevent(next(self._ids))
        self.events.add(int(ev))
        self.ctx_of[int(ev)] = self.current
        return (OK, ev)

    def cuEventDestroy(self, ev):
        self.destroyed_events += 1
        return (OK,)

    def cuEventRecord(self, ev, stream):
        if not self._in_context(stream) or self.ctx_of.get(int(ev), self.current) != self.current:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if self._legacy_refused(stream):
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,)
        self.calls.append(("record", int(ev), int(stream)))
        if self.holding:
            self.held.add(int(ev))
        else:
            self.held.discard(int(ev))
        return (OK,)

    def cuThreadExchangeStreamCaptureMode(self, mode):
        """The calling thread's capture interaction mode (GLOBAL until set), swapped."""
        modes = self.__dict__.setdefault("capture_modes", {})
        me = threading.get_ident()
        old = modes.get(me, self.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        modes[me] = int(mode)
        return (OK, old)

    def _unsafe_call_refused(self) -> bool:
        """Whether the calling thread may not make a potentially unsafe call (an event or
        stream query or wait, an allocation or free -- cuMemAlloc, cuMemFree --, an IPC
        mapping or unmapping) now, as the driver decides by capture modes: in its mode
        GLOBAL (the default) while any thread captures in global mode or it captures itself
        (not relaxed); in THREAD_LOCAL while it captures itself; never in RELAXED. A refused
        call invalidates those captures (their end answers
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)."""
        me = threading.get_ident()
        mine = self.__dict__.get("capture_modes", {}).get(me, 0)
        if mine == 2 or not self.capturing:
            return False
        hit = [h for h, (mode, thread) in self.capture_info.items()
               if mode != 2 and (thread == me or (mine == 0 and mode == 0))]
        self.invalidated.update(hit)
        return bool(hit)

    def cuEventQuery(self, ev):
        if self._unsafe_call_refused():
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
        if int(ev) in self.held:
            return (CUresult.CUDA_ERROR_NOT_READY,)
        return (OK,) if int(ev) in self.events else (CUresult.CUDA_ERROR_INVALID_HANDLE,)

    def cuEventSynchronize(self, ev):
        if self._unsafe_call_refused():
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
        self.held.discard(int(ev))
        return (OK,)

    def cuStreamWaitEvent(self, stream, ev, flags):
        if self._legacy_refused(stream):
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,)
        self.calls.append(("wait", int(stream), int(ev)))
        return (OK,)

    # -- copies ------------------------------------------------------------------------
    def cuMemcpyPeerAsync(self, dst, dst_ctx, src, src_ctx, n, stream):
        if self._legacy_refused(stream):
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,)
        if not self._in_context(stream):
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        self.calls.append(("peer copy", int(dst_ctx), int(src_ctx), int(stream)))
        self._run(stream, lambda: ctypes.memmove(int(dst), int(src), n))
        return (OK,)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        if self._legacy_refused(stream):
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,)
        self._run(stream, lambda: ctypes.memmove(int(dst), int(src), n))
        return (OK,)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        if self._legacy_refused(stream):
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,)
        self._run(stream, lambda: ctypes.memmove(int(dst), int(src), n))
        return (OK,)

    def cuMemcpyDtoDAsync(self, dst, src, n, stream):
        if self._legacy_refused(stream):
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,)
        self._run(stream, lambda: ctypes.memmove(int(dst), int(src), n))
        return (OK,)

    def cuMemcpy2DAsync(self, p, stream):
        if self._legacy_refused(stream):
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,)
        if p.WidthInBytes > p.srcPitch or p.WidthInBytes > p.dstPitch:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        rows = [(int(p.dstDevice) + r * p.dstPitch, int(p.srcDevice) + r * p.srcPitch)
                for r in range(p.Height)]
        w = p.WidthInBytes
        self._run(stream, lambda: [ctypes.memmove(d, s, w) for d, s in rows])
        return (OK,)

    def cuMemsetD8Async(self, dst, byte, n, stream):
        if self._legacy_refused(stream):
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,)
        self._run(stream, lambda: ctypes.memset(int(dst), byte, n))
        return (OK,)

    # -- kernels: Python stand-ins launched with the driver's calling convention ------
    def register_kernel(self, formats, fn):
        """A fake CUfunction whose parameters have these struct formats; a launch
        unpacks them from the ``void**`` array and calls ``fn(*values)``."""
        h = next(self._ids)
        self.kernels = getattr(self, "kernels", {})
        self.kernels[h] = (list(formats), fn)
        return h

    def cuFuncGetParamInfo(self, func, index):
        formats = self.kernels[int(func)][0]
        if index >= len(formats):
            return (CUresult.CUDA_ERROR_INVALID_VALUE, 0, 0)
        import struct
        offset = sum(struct.calcsize(f) for f in formats[:index])
        return (OK, offset, struct.calcsize(formats[index]))

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        import struct
        formats, fn = self.kernels[int(func)]
        values = []
        for i, f in enumerate(formats):  # read now: the driver copies parameters at launch
            ptr = ctypes.c_void_p.from_address(int(params) + 8 * i).value
            raw = ctypes.string_at(ptr, struct.calcsize(f))
            values.append(struct.unpack("<" + f, raw)[0])
        if not self._in_context(stream):
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        if self._legacy_refused(stream):
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,)
        self.calls.append(("launch", int(func), int(stream), self.current))
        self._run(stream, lambda: fn(*values))
        return (OK,)

    # -- capture and graphs ------------------------------------------------------------
    def _legacy_joined(self, stream):
        """The legacy default stream (0, 1) while a blocking stream captures: the driver
        refuses it (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) and invalidates that capture."""
        return int(stream) in (0, 1) and any(
            not self.stream_flags.get(h, 0) & 1 for h in self.capturing)

    def _legacy_refused(self, stream) -> bool:
        """Whether work or an event given to ``stream`` is refused as the driver refuses it:
        the legacy default stream (0, 1) while a blocking stream captures. The refusal
        invalidates those captures (their end answers CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
        as the driver's does; asking (cuStreamIsCapturing) invalidates nothing."""
        if not self._legacy_joined(stream):
            return False
        self.invalidated.update(h for h in self.capturing if not self.stream_flags.get(h, 0) & 1)
        return True

    def cuStreamIsCapturing(self, stream):  # (status 1: CU_STREAM_CAPTURE_STATUS_ACTIVE)
        if self._legacy_joined(stream):
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, None)
        return (OK, 1 if int(stream) in self.capturing else 0)

    def cuStreamBeginCapture(self, stream, mode):
        if int(stream) in self.capturing:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.capturing[int(stream)] = []
        self.capture_info[int(stream)] = (int(mode), threading.get_ident())
        return (OK,)

    def cuStreamEndCapture(self, stream):
        ops = self.capturing.pop(int(stream), None)
        self.capture_info.pop(int(stream), None)
        if ops is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)
        if int(stream) in self.invalidated:
            self.invalidated.discard(int(stream))
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, None)
        g = CUgraph(next(self._ids))
        self.graphs[int(g)] = ops
        return (OK, g)

    def cuGraphInstantiate(self, graph, flags):
        e = CUgraphExec(next(self._ids))
        self.execs[int(e)] = list(self.graphs[int(graph)])
        return (OK, e)

    def cuGraphLaunch(self, exec_, stream):
        for op in self.execs[int(exec_)]:
            self._run(stream, op)
        return (OK,)

    def cuGraphExecDestroy(self, exec_):
        del self.execs[int(exec_)]
        return (OK,)

    def cuGraphDestroy(self, graph):
        del self.graphs[int(graph)]
        return (OK,)


class _FakeBlock:
    def __init__(self, n):
        self._raw = np.empty(n + 256, np.uint8)
        self.ptr = (self._raw.ctypes.data + 255) // 256 * 256


class _Ctx:
    def __init__(self, *a):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class RawKernel:
    """Stands in for ``cupy.RawKernel`` (registered with sharedmem by this name): ``code`` is
    its CUDA source (where sharedmem reads the parameter types), ``formats`` the struct
    formats the fake driver unpacks the parameters with."""

    def __init__(self, driver, name, formats, fn, code=None):
        self.name = name
        self.code = code
        self.kernel = types.SimpleNamespace(ptr=driver.register_kernel(formats, fn))


RawKernel.__module__ = "cupy._core.raw"


def array_at(ptr, n, dtype):
    """A NumPy array over ``n`` elements at address ``ptr`` (fake device memory)."""
    dt = np.dtype(dtype)
    return np.frombuffer((ctypes.c_ubyte * (n * dt.itemsize)).from_address(ptr), dtype=dt)


def saxpy_kernel(driver):
    """A fake ``saxpy(float a, const float* x, const float* y, float* out, int n)`` CuPy
    RawKernel on ``driver``: ``out = a * x + y`` over ``n`` floats."""
    def fn(a, x, y, out, n):
        array_at(out, n, np.float32)[:] = a * array_at(x, n, np.float32) + array_at(y, n, np.float32)

    code = """extern "C" __global__ void saxpy(float a, const float* x, const float* y, float* out,
                                              int n) { }"""
    return RawKernel(driver, "saxpy", ["f", "Q", "Q", "Q", "i"], fn, code)


_stream_handles = itertools.count(0xC0FFEE00)  # (handles of the streams fake CuPy makes)


class _PinnedBlock(bytearray):
    """What ``cupy.cuda.alloc_pinned_memory(n)`` lends: ``n`` bytes of host memory (the
    buffer protocol's), counted while lent (``_PinnedBlock.lent``)."""
    lent = 0

    def __init__(self, n):
        super().__init__(n)
        _PinnedBlock.lent += 1

    def __del__(self):
        _PinnedBlock.lent -= 1


class _CurrentStream:
    """What ``cupy.cuda.get_current_stream`` returns: an object whose ``ptr`` is the raw
    handle (0: the default stream, until a test sets another)."""

    def __init__(self):
        self.ptr = 0


def fake_cupy(drv=None):
    """A module standing in for CuPy: ``cuda.Device``, ``cuda.alloc`` and
    ``cuda.get_current_stream`` (one current stream for every device: ``m.current``); the
    streams it makes are known to fake driver ``drv`` with their flags, where given."""
    m = types.ModuleType("cupy")
    m.current = _CurrentStream()
    saved = threading.local()  # (per thread, as CuPy's own stack of current streams)

    class ExternalStream:  # makes its handle CuPy's current stream while entered
        def __init__(self, ptr, device_id=-1):
            self.ptr = ptr

        def __enter__(self):
            saved.__dict__.setdefault("stack", []).append(m.current)
            m.current = self
            return self

        def __exit__(self, *a):
            m.current = saved.stack.pop()
            return False
    class Stream(ExternalStream):  # a stream CuPy makes (and owns): a fresh handle
        def __init__(self, null=False, non_blocking=False):
            self.ptr = next(_stream_handles)
            self.non_blocking = non_blocking
            if drv is not None:  # (the driver knows its flags, as of a stream it made)
                drv.stream_flags[self.ptr] = 1 if non_blocking else 0

    def refused(make):  # (CuPy's pools: a block made is a cudaMalloc or cudaHostAlloc, and a
        # pinned one first queries the events of finished copies -- refused beside a capture,
        # as the driver refuses them; CuPy raises its CUDARuntimeError)
        def alloc(n):
            if drv is not None and drv._unsafe_call_refused():
                raise RuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted "
                                   "when stream is capturing")
            return make(n)
        return alloc
    m.cuda = types.SimpleNamespace(Device=_Ctx, alloc=refused(_FakeBlock),
                                   ExternalStream=ExternalStream, Stream=Stream,
                                   get_current_stream=lambda device_id=-1: m.current,
                                   alloc_pinned_memory=refused(_PinnedBlock))
    m.ndarray = type("ndarray", (), {})  # no fake arrays: nothing is one
    return m


class FakeHot:
    """``backend.hot`` over the fake driver: the per-launch entry points as
    Python callables, and for the compiled paths (``backend.*_addr``) C function
    pointers -- ctypes callbacks into the fake driver."""

    def __init__(self, drv):
        c = ctypes
        self._drv = drv
        LAUNCH = c.CFUNCTYPE(c.c_int, c.c_void_p, c.c_uint, c.c_uint, c.c_uint, c.c_uint, c.c_uint,
                             c.c_uint, c.c_uint, c.c_void_p, c.c_void_p, c.c_void_p)
        CTX_GET = c.CFUNCTYPE(c.c_int, c.POINTER(c.c_void_p))

        def ctx_get(out):
            out[0] = drv.current or None  # the fake current context
            return 0

        RECORD = c.CFUNCTYPE(c.c_int, c.c_void_p, c.c_void_p)
        QUERY = c.CFUNCTYPE(c.c_int, c.c_void_p)
        WAIT = c.CFUNCTYPE(c.c_int, c.c_void_p, c.c_void_p, c.c_uint)
        GRAPH_LAUNCH = c.CFUNCTYPE(c.c_int, c.c_void_p, c.c_void_p)
        EXCHANGE = c.CFUNCTYPE(c.c_int, c.POINTER(c.c_int))

        def exchange(mode):  # (libcuda's: the mode pointed to swapped with the thread's)
            old = self.exchange_capture_mode(mode[0])
            if old < 0:
                return 1
            mode[0] = old
            return 0

        self._callbacks = (LAUNCH(self._launch), CTX_GET(ctx_get),
                           RECORD(lambda e, s: self.record(e or 0, s or 0)),
                           QUERY(lambda e: self.query(e or 0)),
                           WAIT(lambda s, e, f: self.wait(s or 0, e or 0, f)),
                           GRAPH_LAUNCH(lambda g, s: self.graph_launch(g or 0, s or 0)),
                           EXCHANGE(exchange))
        self.addresses = {
            name: c.cast(cb, c.c_void_p).value for name, cb in zip(
                ("cuLaunchKernel", "cuCtxGetCurrent", "cuEventRecord", "cuEventQuery",
                 "cuStreamWaitEvent", "cuGraphLaunch", "cuThreadExchangeStreamCaptureMode"),
                self._callbacks)}
        # cuPointerGetAttributes as libcuda's, a C function writing through the pointers it
        # is given: the real pointer_info reads it (its ctypes marshalling is what is tested)
        from sharedmem.backends.cuda import _HotDriver
        self._attributes = c.CFUNCTYPE(c.c_int, c.c_uint, c.c_void_p, c.c_void_p,
                                       c.c_ulonglong)(self._pointer_attributes)
        self.pointer_info = types.MethodType(_HotDriver.pointer_info, self)
        # (and through its address, as the compiled backend calls libcuda's)
        self.addresses["cuPointerGetAttributes"] = c.cast(self._attributes, c.c_void_p).value

    def _pointer_attributes(self, n, attrs, data, ptr):
        c = ctypes
        res = self._drv.cuPointerGetAttributes(n, None, ptr)
        if int(res[0]):  # (the driver's error, returned as libcuda returns it)
            return int(res[0])
        base, size, ordinal, memtype = res[1]
        value = {11: (c.c_ulonglong, base), 12: (c.c_size_t, size), 9: (c.c_int, ordinal),
                 2: (c.c_uint, int(memtype))}  # (by CUpointer_attribute)
        for kind, out in zip((c.c_int * n).from_address(attrs),
                             (c.c_void_p * n).from_address(data)):
            ctype, v = value[kind]
            ctype.from_address(out).value = v
        return 0

    def launch(self, func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        """As libcuda's through ctypes with no ``argtypes`` (see _HotDriver): the pointers must
        come as ``c_void_p`` (a plain int would be passed as a 32-bit C int)."""
        for name, p in (("func", func), ("stream", stream), ("params", params)):
            if type(p) is not ctypes.c_void_p:
                raise ctypes.ArgumentError(f"launch(): {name} must be a c_void_p, got {p!r}")
        return self._launch(func.value, gx, gy, gz, bx, by, bz, shared, stream.value,
                            params.value, extra)

    def _launch(self, func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        return int(self._drv.cuLaunchKernel(func or 0, gx, gy, gz, bx, by, bz, shared,
                                            CUstream(stream or 0), params or 0, extra)[0])

    def record(self, ev, stream):
        return int(self._drv.cuEventRecord(CUevent(ev), CUstream(stream))[0])

    def wait(self, stream, ev, flags):
        return int(self._drv.cuStreamWaitEvent(CUstream(stream), CUevent(ev), flags)[0])

    def current_context(self):
        return self._drv.current

    def query(self, ev):
        return int(self._drv.cuEventQuery(CUevent(ev))[0])

    def exchange_capture_mode(self, mode):
        res = self._drv.cuThreadExchangeStreamCaptureMode(mode)
        return int(res[1]) if int(res[0]) == 0 else -1

    def graph_launch(self, exec_, stream):
        return int(self._drv.cuGraphLaunch(CUgraphExec(exec_), CUstream(stream))[0])


class TileKernel:
    """Stands in for a ``@cuda.tile.kernel`` (registered with sharedmem by this name):
    ``fn(*args)`` runs with NumPy arrays for the array arguments."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__


TileKernel.__module__ = "cuda.tile._execution"
TileKernel.__qualname__ = "kernel"


def fake_cutile(driver, fail=None):
    """A module standing in for ``cuda.tile``: ``launch(stream, grid, kernel, args)``
    reads array arguments through their CUDA Array Interface, as cuTile does, and
    runs the kernel on the fake driver's stream (logged as ("tile", stream, grid)).
    ``fail``: a list; while it holds an exception, launch raises it. As cuTile does, the
    first launch of a kernel with an argument signature (dtypes, layouts, pointer alignment,
    scalar types and values) compiles it: ``compile_hook(kernel)`` is called then, and the
    signature logged in ``compiled``."""
    m = types.ModuleType("cuda.tile")
    m.compiled = []
    m.compile_hook = None

    def launch(stream, grid, kernel, args):
        if fail:
            raise fail[0]
        assert type(grid) is tuple and len(grid) == 3, grid
        vals, sig = [], [id(kernel)]
        for a in args:
            cai = getattr(a, "__cuda_array_interface__", None)
            if cai is None:
                vals.append(a)
                sig.append((type(a), a))
                continue
            n = int(np.prod(cai["shape"]))
            vals.append(array_at(cai["data"][0], n, np.dtype(cai["typestr"])))
            sig.append((cai["typestr"], cai["shape"], cai["strides"], cai["data"][0] % 16))
        if tuple(sig) not in m.compiled:
            if m.compile_hook is not None:
                m.compile_hook(kernel)
            m.compiled.append(tuple(sig))
        if 0 in grid:  # (cuLaunchKernelEx refuses an empty grid, after the compile)
            raise RuntimeError("cuLaunchKernelEx failed: CUDA_ERROR_INVALID_VALUE")
        driver.calls.append(("tile", int(stream), grid))
        driver._run(stream, lambda: kernel.fn(*vals))

    m.launch = launch
    return m


_device_keys = __import__("itertools").count()


def install_fake_devices(monkeypatch, hot: bool, count: int = 1):
    """Make sharedmem's CUDA backend run over a new FakeDriver with ``count`` devices (the
    per-launch calls through ``backend.hot`` when ``hot``, else every call through the driver
    module), registered as ``Device(0)``... (the default device is left as it is); returns
    ``(devices, driver)``. Everything is undone by ``monkeypatch``."""
    import sys
    import threading

    import sharedmem as sm
    import sharedmem.backends.cuda as bc
    drv = FakeDriver()
    drv.count = count
    monkeypatch.setattr(bc, "cu", drv)
    monkeypatch.setattr(bc, "_SUCCESS", CUresult.CUDA_SUCCESS)
    monkeypatch.setattr(bc, "_hot_driver", (lambda: FakeHot(drv)) if hot else (lambda: None))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(drv))
    monkeypatch.setattr(bc, "_backends", [0])
    monkeypatch.setattr(bc, "_current", threading.local())
    import sharedmem.device as sm_device
    devs = []
    for ordinal in range(count):
        backend = bc.CudaBackend(ordinal)
        dev = object.__new__(sm.Device)
        dev._setup("cuda", ordinal, backend.name, ("fake-cuda", next(_device_keys)), backend)
        devs.append(dev)
        # Device(ordinal) is this one while the fake is installed: made anew, over the fake
        # driver, it stayed in the device table once the driver was undone, and a later
        # test's default device was a fake GPU with no driver module left
        monkeypatch.setitem(sm_device._devices, ("cuda", ordinal), dev)
    # (the default device, chosen once: one chosen while the fake is installed -- a foreign
    # stream borrowed without a device asks for it -- is forgotten with the fake)
    monkeypatch.setattr(sm_device, "_default", sm_device._default)
    return devs, drv
