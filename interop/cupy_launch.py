"""CuPy on the launch path (compiled with the core): RawKernel plans and CuPy array arguments.

:class:`RawKernelPlan` is a CuPy kernel on one device, planned once: its ``CUfunction``, its
parameters (sizes from the driver, types read from the kernel's CUDA source), the device's
launch limits and ``cuLaunchKernel``. A CuPy array passed to a launch is leased without a
view of it, as its :class:`ArrayFacts` (CuPy's and cuTile's adapters coerce it so).
``interop.cupy`` is the public face (wrap, adopt, as_cupy, the adapter); this module holds
what runs on every launch. Importing it imports no GPU library.
"""

from __future__ import annotations

import ctypes
import math
import re
import struct
import sys
import weakref
from functools import partial

import numpy as np

from sharedmem.allocation import (View, _module, import_allocation, import_writable,
                                  lookup_allocation, unregistered_token)
from sharedmem.buffer import Buffer
from sharedmem.device import Device
from sharedmem.errors import BackendUnavailableError, CaptureError, CudaError, KernelError
from sharedmem.launch import ForeignArray, KernelPlan, LaunchArg, check_dims, check_shared_mem
from sharedmem.runtime.state import RUNTIME, OwnedLock, fork_safe, locked
from sharedmem.stream import Stream
from sharedmem.tensor import Tensor, extent

from interop.streams import library_handle

try:
    import cython
except ImportError:  # interpreted, without Cython installed
    from sharedmem import _cython as cython

__all__ = ["RawKernelPlan", "Param", "param_types", "plan_kernel", "array_facts",
           "export_token"]


def _cupy():
    try:
        import cupy
    except ImportError:
        raise BackendUnavailableError(
            "interop.cupy needs CuPy: pip install 'sharedmem-gpu[cuda13]' (or '[cuda12]')") from None
    return cupy


# -- CuPy arrays -----------------------------------------------------------------------------
class _ExportOwner:
    """Owner of the memory of an ``as_cupy`` array: holds the export's view
    token and releases it when CuPy drops the memory."""

    __slots__ = ("token", "__weakref__")

    def __init__(self, token):
        self.token = token

    def __del__(self):
        # (not while the interpreter shuts down: an array alive to the end dies in the last
        # collection, after the modules are torn down, where a release crashes the compiled
        # build -- as ProducerAlias and View.__del__; nothing needs giving back at exit)
        if sys is not None and not sys.is_finalizing():
            self.token.release()


def export_token(arr):
    """The view token behind an array made by as_cupy, or None."""
    owner = getattr(arr.data.mem, "_owner", None)
    return owner.token if isinstance(owner, _ExportOwner) else None


def owner_writable(arr) -> bool:
    """Whether the sharedmem view behind CuPy array ``arr``'s memory lets it write: as_cupy's
    array, its export's token; ``cupy.asarray`` of a view (its CAI), CuPy's memory names the
    view as its owner (one released or moved since: the bytes are not its any more). True
    for CuPy's own memory."""
    owner = getattr(arr.data.mem, "_owner", None)
    if isinstance(owner, _ExportOwner):
        return owner.token.writable
    tok = owner._token if isinstance(owner, View) else None
    return tok is None or tok.writable


def _allocation_of(arr, dev):
    """The allocation holding the array's bytes (ours, or foreign over CuPy's
    own memory unit), and the array's byte range in it."""
    lo, hi = extent(arr.shape, arr.strides, arr.itemsize)  # (bytes, from arr.data.ptr)
    data = arr.data
    start = data.ptr + lo
    nbytes = hi - lo
    mem = data.mem
    alloc = import_allocation(dev, start, max(nbytes, 1) if arr.size else 0, "cupy",
                              region=(mem.ptr, max(mem.size, 1)))
    return alloc, start - alloc.ptr, start - alloc.ptr + nbytes


# -- kernels -------------------------------------------------------------------------------

#: C scalar types a kernel parameter may have: name -> (kind, bytes). Kinds: "i" signed int,
#: "u" unsigned int, "f" floating point, "b" bool; "p" (pointers) and "?" (not known) below.
_C_TYPES = {}
for _names, _kind, _size in (
        (("bool",), "b", 1),
        (("char", "signed char", "int8_t"), "i", 1), (("unsigned char", "uint8_t"), "u", 1),
        (("short", "short int", "signed short", "int16_t"), "i", 2),
        (("unsigned short", "unsigned short int", "uint16_t"), "u", 2),
        (("int", "signed", "signed int", "int32_t"), "i", 4),
        (("unsigned", "unsigned int", "uint32_t"), "u", 4),
        (("long", "long int", "signed long", "long long", "long long int", "signed long long",
          "int64_t", "ssize_t", "ptrdiff_t", "intptr_t"), "i", 8),
        (("unsigned long", "unsigned long int", "unsigned long long",
          "unsigned long long int", "uint64_t", "size_t", "uintptr_t"), "u", 8),
        (("float",), "f", 4), (("double",), "f", 8), (("half", "__half"), "f", 2)):
    for _n in _names:
        _C_TYPES[_n] = (_kind, _size)
#: Types sharedmem does not convert that are certainly no integer (CUDA's vector types,
#: complex numbers): ``with_length`` refuses to put a length there.
_NOT_AN_INT = re.compile(r"\b(?:__)?(?:u?(?:char|short|int|long|longlong)|float|double|half|"
                         r"bfloat16|nv_bfloat16)[1-4]\b|[Cc]omplex")
_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__|__restrict|restrict|register|struct|"
                         r"__grid_constant__)\b")


class Param:
    """One kernel parameter: ``kind`` ("p" pointer, "i"/"u" integer, "f" float, "b" bool, "?"
    not known), ``size`` in bytes (the driver's), ``name`` and ``ctype`` (from the source, or
    None)."""

    __slots__ = ("kind", "size", "name", "ctype", "code", "offset", "kcode", "address", "lo",
                 "hi")

    def __init__(self, kind, size, name, ctype):
        self.kind, self.size, self.name, self.ctype = kind, size, name, ctype
        self.kcode = _KCODES[kind]  # the same kind, as a small int for pack()
        # whether it takes an array's address: a pointer, or 8 bytes of a type not known (no
        # source) -- not a known type sharedmem does not convert (float2, a struct by value)
        self.address = kind == "p" or (kind == "?" and size == 8 and ctype is None)
        bits = 8 * size
        # the range of an integer parameter's values: a plain char's is both signed and
        # unsigned char's (its signedness is the compiler's), packed as its byte
        self.lo, self.hi = ((0, 2) if kind == "b" else (-128, 256) if ctype == "char" else
                            (-(1 << (bits - 1)), 1 << (bits - 1)) if kind == "i" else
                            (0, 1 << bits))
        # how the compiled enqueue writes the value pack() made: an unsigned integer of
        # `size` bytes (codes 8, 4, 2, 1: ints and pointers), a float (F32) or a double (F64),
        # else the value's bytes (BYTES: half, and parameters of unknown type)
        fmt = _FORMATS.get((kind, size))
        self.code = (_BYTES if fmt is None else _F32 if fmt == "f" else
                     _F64 if fmt == "d" else size)
        self.offset = 0  # in the packing buffer (set by the plan)

    def describe(self) -> str:
        if self.ctype is None:
            return f"a {self.size}-byte parameter of unknown type"
        return f"parameter {self.name!r} ({self.ctype})"


# A comment, or a string or character literal, or a number (kept: a ``/*`` or ``//`` inside a
# literal starts no comment, and a number's digit separators -- ``1'024`` -- open no literal)
_COMMENTS = re.compile(r"""("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|(?<![\w.])\.?\d"""
                       r"""(?:[eEpP][+-]|'?[\w.])*)|//[^\n]*|/\*.*?\*/""", re.S)


def _split_params(code, i):
    """The parameter declarations of the list that opens before ``code[i]``, split at its
    top-level commas (not those inside ``<>``, ``()`` or ``[]``); None if it never closes."""
    out, depth, parens, start = [], 0, 0, i
    for j in range(i, len(code)):
        ch = code[j]
        if ch == ")" and not parens:
            return out + [code[start:j]]
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        parens += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(code[start:j])
            start = j + 1
    return None


def _literal_or_space(m) -> str:
    return m.group(1) or " "


def param_types(code, name):
    """``[(kind, ctype, pname), ...]`` of ``__global__`` function ``name`` in CUDA source
    ``code``, or None where it cannot be read (no source, a template, a mangled name)."""
    if not code or not name or not re.fullmatch(r"[A-Za-z_]\w*", name):
        return None
    # comments out first: one in a parameter list would be read as a type or a name, and a
    # kernel commented out would be found before the real one
    code = _COMMENTS.sub(_literal_or_space, code)
    found = None
    # every declaration of the kernel: a declaration and its definition agree, but two
    # definitions (#if / #else, an old one under #if 0) leave the one compiled to the
    # preprocessor -- neither is read then
    for m in re.finditer(r"__global__[^;{]*?\b" + re.escape(name) + r"\s*\(", code):
        decls = _split_params(code, m.end())
        out = None if decls is None else _read_params(decls)
        if out is None:
            return None
        if found is not None and [p[:2] for p in out] != [p[:2] for p in found]:
            return None
        found = found or out
    return found


def _read_params(decls):
    """``[(kind, ctype, pname), ...]`` of a parameter list's declarations, or None."""
    out = []
    for raw in decls:
        decl = " ".join(_QUALIFIERS.sub(" ", raw).split("=", 1)[0].split())  # (no default)
        if not decl or decl == "void":
            continue
        # an array parameter (``double y[4]``) is a pointer to its element, as C adjusts it
        arr = re.fullmatch(r"(.*?)\s*(\[[^\[\]]*\]\s*)+", decl)
        if arr is not None:
            decl = arr.group(1)
        if "*" in decl or "&" in decl or arr is not None:
            pname = re.split(r"[*&\s]", decl)[-1] if arr is None or " " in decl else ""
            ctype = decl[:len(decl) - len(pname)].replace(" *", "*").strip() if pname else decl
            out.append(("p", ctype + "*" if arr is not None else ctype, pname))
            continue
        words = decl.split()
        if len(words) < 2:
            return None
        ctype = " ".join(words[:-1])
        out.append((_C_TYPES.get(ctype, ("?", 0))[0], ctype, words[-1]))
    return out


def _signature_params(kernel, sizes):
    """The kernel's parameters: sizes from the driver, types from the source where it can be
    read and agrees with the sizes (else every parameter is of unknown type)."""
    parsed = param_types(getattr(kernel, "code", None), getattr(kernel, "name", None))
    if parsed is not None and len(parsed) == len(sizes):
        params = []
        for (kind, ctype, pname), size in zip(parsed, sizes):
            want = 8 if kind == "p" else _C_TYPES.get(ctype, (None, size))[1]
            if want != size:
                break
            params.append(Param(kind, size, pname, ctype))
        else:
            return tuple(params)
    return tuple(Param("?", size, None, None) for size in sizes)


_F32, _F64, _BYTES = 16, 17, 18  # Param.code, beside the integer sizes 1, 2, 4 and 8
_K_PTR, _K_INT, _K_FLOAT, _K_ANY = 0, 1, 2, 3  # Param.kcode
_KCODES = {"p": _K_PTR, "i": _K_INT, "u": _K_INT, "b": _K_INT, "f": _K_FLOAT, "?": _K_ANY}
#: The packing buffer the compiled enqueue writes on its stack (bytes). Larger parameter lists
#: (up to the driver's 32 KiB) take the interpreted packing.
_STACK_PARAMS = 4096

_FORMATS = {("p", 8): "Q", ("i", 1): "b", ("i", 2): "h", ("i", 4): "i", ("i", 8): "q",
            ("u", 1): "B", ("u", 2): "H", ("u", 4): "I", ("u", 8): "Q",
            ("f", 4): "f", ("f", 8): "d", ("b", 1): "?"}


def _param_sizes(func):
    """The kernel's parameter sizes, from the driver. With ``cuFuncGetParamCount`` (CUDA
    12.9+ drivers) nothing is probed; older ones are asked for parameters until they say
    there is none (an error compute-sanitizer lists, harmlessly)."""
    from sharedmem.backends.cuda import cu
    get = getattr(cu, "cuFuncGetParamInfo", None)
    if get is None:
        return None
    ok = cu.CUresult.CUDA_SUCCESS
    limit = 4097  # (probing: asked until the driver says there is no such parameter)
    count = getattr(cu, "cuFuncGetParamCount", None)
    if count is not None:
        try:
            res = count(func)
        except RuntimeError:  # in the bindings, not in this driver ("Function ... not found")
            res = (None,)
        if res[0] == ok:
            limit = int(res[1])
    sizes = []
    for i in range(limit):
        res = get(func, i)
        if res[0] != ok:
            break
        sizes.append(int(res[2]))
    return sizes


_BOOLS = (bool, np.bool_)  # (module constants: no attribute lookup on numpy per argument)
_INTS = (int, np.integer)
# NumPy's integer scalar types (np.int32(n), the usual way to pass a C int): found by identity
# the view types themselves: tested by identity before isinstance (C globals where compiled)
_BUFFER = cython.declare(object, Buffer)
_TENSOR = cython.declare(object, Tensor)
_NP_INTS = (np.int32, np.int64, np.uint32, np.uint64, np.int16, np.uint16, np.int8, np.uint8)


def _int_value(i, p, a):
    """``a`` as an int for integer (or bool) parameter ``p``, range-checked."""
    if isinstance(a, _BOOLS):
        return int(a)
    if isinstance(a, _INTS):
        v = int(a)
        if not p.lo <= v < p.hi:
            raise KernelError(f"argument {i}: {v} does not fit {p.describe()}, which takes "
                              f"{p.lo}..{p.hi - 1}")
        return v
    raise KernelError(f"argument {i}: {p.describe()} takes an int, got {_what(a)}; "
                      f"{'convert it with int() if that is meant' if isinstance(a, (float, np.floating)) else 'pass an int'}")


#: Where a double stops rounding to a finite float32: FLT_MAX plus half its last place.
_F32_LIMIT = cython.declare(cython.double, 3.4028235677973366e38)
_INF = cython.declare(cython.double, float("inf"))


def _float_value(i, p, a):
    """``a`` as floating-point parameter ``p``'s value: a float (``float``, ``double``) or
    the two bytes of a ``half``. KernelError for what is not a number, or for a finite value
    beyond the parameter's range (which C would turn into an infinity); NaN and the
    infinities pass as they are."""
    if not isinstance(a, (float, int, np.floating, np.integer)) or isinstance(a, (bool, np.bool_)):
        raise KernelError(f"argument {i}: {p.describe()} takes a number, got {_what(a)}")
    v = a
    if p.size != 8 and isinstance(a, np.floating) and a.dtype.itemsize > 8:
        # (a longdouble, for a float or a half: float() rounds it to a double, and that
        # double would be rounded again -- a value just past a tie between two floats lands
        # on the tie and rounds to even, the wrong one. Rounded to odd instead, the double
        # keeps the side of the tie: its one rounding to 24 or 11 bits is then the nearest)
        v = float(a)
        if v - v == 0 and np.longdouble(v) != a and not struct.unpack("<Q", struct.pack(
                "<d", v))[0] & 1:
            v = math.nextafter(v, _INF if a > v else -_INF)
    if p.size == 4 and isinstance(a, _INTS) and abs(int(a)) >> 53:
        # (an int past a double's 53 bits, for a float: rounded once, to float's 24 --
        # float() then float32 round twice, which can miss the nearest float)
        v = int(a)
        shift = abs(v).bit_length() - 24
        q, r = divmod(abs(v), 1 << shift)
        if r > 1 << (shift - 1) or (r == 1 << (shift - 1) and q & 1):
            q += 1
        v = q << shift if v > 0 else -(q << shift)
    try:
        x = float(v)
    except OverflowError:
        x = None
    if x is not None and abs(x) == _INF and abs(a) != _INF:  # (a finite longdouble past it)
        x = None
    if x is not None and p.size == 2:
        try:
            return struct.pack("<e", x)
        except OverflowError:
            x = None
    if x is not None and (p.size == 8 or x != x or -_F32_LIMIT < x < _F32_LIMIT or
                          abs(x) == _INF):
        return x
    raise KernelError(f"argument {i}: {a!r} is out of range for {p.describe()}")


def _what(a) -> str:
    if isinstance(a, LaunchArg):
        return f"an array ({type(a.value).__name__})"
    if isinstance(a, View):
        return f"an array ({type(a).__name__})"
    return f"{type(a).__name__} {a!r}"


class RawKernelPlan(KernelPlan):
    """A CuPy kernel on one device, planned once: its CUfunction, its parameters (size from
    the driver, type from the source), the packing buffer (8-byte-aligned slots and the
    ``void**`` array pointing at them), the device's launch limits and ``cuLaunchKernel``.

    ``pack`` converts each argument to its parameter's type -- or refuses it, naming the
    parameter -- before any lease; ``enqueue`` (under the core lock, so launches never share
    the buffer at once) writes the values and launches."""

    __slots__ = ("func", "params", "fmt", "slots", "ptrs", "ptrs_addr", "backend", "launch_addr",
                 "ctx_addr", "context", "limits", "fn", "nbytes", "c_func", "c_ptrs")

    def __init__(self, kernel, adapter, device, fn, func, params):
        KernelPlan.__init__(self, kernel, adapter, device)
        if cython.compiled:
            self.native = True  # (its enqueue: C through, see Work.native)
        self.fn = fn  # the Function: it keeps its module, so `func`, loaded
        self.func = func
        self.params = params
        fmt = ["<"]
        off = 0
        for p in params:  # (each checked a Param once here: launches cast unchecked)
            if not isinstance(p, Param):
                raise TypeError(f"RawKernelPlan params must be Param objects, got {p!r}")
            p.offset = off
            slot = (p.size + 7) // 8 * 8
            fmt.append(_FORMATS.get((p.kind, p.size), f"{p.size}s"))
            if slot > p.size:
                fmt.append(f"{slot - p.size}x")
            off += slot
        self.fmt = "".join(fmt)
        self.nbytes = off
        self.slots = (ctypes.c_uint8 * max(off, 8))()
        base = ctypes.addressof(self.slots)
        self.ptrs = (ctypes.c_void_p * max(len(params), 1))(*[base + p.offset for p in params])
        self.ptrs_addr = ctypes.addressof(self.ptrs)
        self.c_func, self.c_ptrs = ctypes.c_void_p(int(func)), ctypes.c_void_p(self.ptrs_addr)
        backend = device.backend
        self.backend = backend
        addresses = getattr(backend.hot, "addresses", None) or {}
        self.launch_addr = addresses.get("cuLaunchKernel", 0)
        self.ctx_addr = addresses.get("cuCtxGetCurrent", 0)
        self.context = int(backend.context)
        self.limits = backend.limits

    def make_config(self, grid, block, shared_mem):
        lim = self.limits
        g = check_dims(grid, "grid", lim.grid)
        b = check_dims(block, "block", lim.block)
        threads = math.prod(b)
        if lim.threads and threads > lim.threads:
            raise KernelError(f"block {block!r} has {threads} threads, above this device's "
                              f"limit of {lim.threads} per block")
        shm = check_shared_mem(shared_mem, lim.shared_mem or None)
        g = tuple(g) + (1,) * (3 - len(g))
        b = tuple(b) + (1,) * (3 - len(b))
        return LaunchConfig(g, b, shm)

    @cython.boundscheck(False)  # (every index below its list's length by construction)
    @cython.wraparound(False)
    def pack(self, args, uses, config, stream):
        """The parameters, converted to their types, checked (KernelError names the first
        argument that does not fit, before any lease is taken) and packed: compiled, bytes
        laid out as the plan's slots; interpreted, the values in order (``enqueue`` packs them
        into the slots with ``struct.pack_into``: no bytes made in between)."""
        params = self.params
        n = len(params)
        need = len(args)  # (checked first: a wrong count is the error, whatever else is wrong)
        for a in args:
            if type(a) is LaunchArg and a.with_length:
                need += 1
        if need != n:
            raise self._count_error(args)
        if cython.compiled:
            out = PyBytes_FromStringAndSize(cython.NULL, self.nbytes)  # written at once below
        else:
            out = []
        extra = 0  # parameters filled beyond one per argument (lengths): argument i's is i + extra
        torch_dev = None  # (the device of the torch tensors among the arguments, or a list)
        cupy_dev = None  # (of the CuPy arrays)
        for i, a in enumerate(args):
            par = cython.cast(Param, params[i + extra]) if cython.compiled else \
                params[i + extra]  # (Params: see __init__)
            t = type(a)
            if t is _BUFFER or t is _TENSOR or (t is not ArrayFacts and isinstance(a, View)):
                if par.kcode == _K_PTR and not cython.compiled:  # (interpreted: as _emit_address,
                    out.append(a._ptr)                           # without the call)
                elif par.address:
                    view = cython.cast(View, a) if cython.compiled else a  # (checked above)
                    _emit_address(out, par, view._ptr)
                else:
                    raise KernelError(f"argument {i}: {par.describe()} is not a pointer, got "
                                      f"{_what(a)}")
                continue
            if t is ArrayFacts:  # a CuPy array (see coerce): its lease, as for a view
                if not par.address:
                    raise KernelError(f"argument {i}: {par.describe()} is not a pointer, got "
                                      f"a {'CuPy array' if a.layout is None else 'torch tensor'}")
                fa = cython.cast(ArrayFacts, a) if cython.compiled else a
                adev = fa.token.allocation.device
                if fa.layout is not None:  # (a torch tensor's: see torch_facts)
                    if torch_dev is None:  # (one device, the usual: no call)
                        torch_dev = adev
                    elif torch_dev is not adev:
                        torch_dev = merged_devices(torch_dev, adev)
                elif cupy_dev is None:  # (a CuPy array's: ordered after CuPy's stream)
                    cupy_dev = adev
                elif cupy_dev is not adev:
                    cupy_dev = merged_devices(cupy_dev, adev)
                if par.kcode == _K_PTR and not cython.compiled:  # (as for a view; its element 0's
                    out.append(fa.ptr)                           # address, learned with it)
                else:
                    _emit_address(out, par, fa.ptr)
                continue
            if type(a) is LaunchArg:
                la = cython.cast(LaunchArg, a) if cython.compiled else a
                if not par.address:
                    raise KernelError(f"argument {i}: {par.describe()} is not a pointer, got "
                                      f"{_what(a)}")
                v = la.value
                _emit_address(out, par, la.token.allocation.ptr + la.offset)
                lib = library_of(la)  # (a CuPy array or torch tensor with_length: ordered
                if lib == 0:          # as one without)
                    cupy_dev = merged_devices(cupy_dev, la.token.allocation.device)
                elif lib == 1:
                    torch_dev = merged_devices(torch_dev, la.token.allocation.device)
                if la.with_length:
                    if not _dense(v):  # (the kernel takes a pointer and a count of elements)
                        raise KernelError(f"argument {i}: with_length=True needs a contiguous "
                                          f"array (a pointer and a count of consecutive "
                                          f"elements), got a strided {type(v).__name__}; "
                                          f"pass a contiguous copy (tensor.contiguous())")
                    extra += 1
                    lp = cython.cast(Param, params[i + extra]) if cython.compiled else \
                        params[i + extra]
                    length = v.size  # elements (a Buffer's length; torch's: a method)
                    if callable(length):
                        length = v.numel()
                    if lp.kind in "iu":
                        _emit(out, lp, _int_value(i, lp, length))
                    elif lp.kind == "?" and lp.size in (4, 8) and \
                            _NOT_AN_INT.search(lp.ctype or "") is None:
                        # (sizes alone: no source, or a type sharedmem does not convert -- a
                        # typedef of an int, idx_t, says no more -- but never a vector or
                        # complex type, float2: its value is no count)
                        if length >= lp.hi:  # (its size's unsigned range: see Param)
                            raise KernelError(
                                f"argument {i}: with_length=True, but its length, {length} "
                                f"elements, does not fit the next parameter, "
                                f"{lp.describe()}, which takes 0..{lp.hi - 1}; launch it on "
                                f"fewer elements")
                        _emit(out, lp, int(length).to_bytes(lp.size, "little"))
                    else:
                        raise KernelError(f"argument {i}: with_length=True, but the next "
                                          f"parameter is {lp.describe()}, not an int")
                continue
            kc = par.kcode
            if kc == _K_INT:
                if t is not int and t in _NP_INTS:
                    a = int(a)  # (then checked as an int: no isinstance walks)
                    t = int
                if t is int and par.lo <= a < par.hi:  # (the bounds as ints: none made here)
                    if cython.compiled or par.ctype == "char":
                        _emit(out, par, a)
                    else:  # (interpreted: _emit's step, without the call)
                        out.append(a)
                else:
                    _emit(out, par, _int_value(i, par, a))
            elif kc == _K_FLOAT:
                fv = a if t is float else 0.0  # (compiled, a C double: no float made)
                if t is float and (par.code == _F64 or
                                   (par.code == _F32 and -_F32_LIMIT < fv < _F32_LIMIT)):
                    if cython.compiled:
                        _emit(out, par, a)
                    else:  # (interpreted: _emit's step, without the call)
                        out.append(a)
                else:
                    _emit(out, par, _float_value(i, par, a))
            elif kc == _K_PTR:
                if a is None:
                    _emit(out, par, 0)
                elif isinstance(a, np.integer) and a.dtype.itemsize == 8:  # (uint64, ulonglong...)
                    _emit(out, par, int(a) % (1 << 64))  # a raw address, stated as such
                else:
                    raise KernelError(
                        f"argument {i}: {par.describe()} is a pointer, got {_what(a)}; pass "
                        f"the array (a sharedmem view or a CuPy array) so that it is leased, or "
                        f"None for NULL")
            else:  # "?": only the size is known
                if isinstance(a, np.generic) and a.dtype.itemsize == par.size:
                    _emit(out, par, a.tobytes())
                elif a is None and par.size == 8:
                    _emit(out, par, bytes(8))
                else:
                    why = ("the kernel's source is not known, so neither is the type"
                           if par.ctype is None else "a type sharedmem does not convert")
                    raise KernelError(
                        f"argument {i}: {par.describe()} ({why}); got {_what(a)}. Pass a NumPy "
                        f"scalar of the parameter's size, e.g. np.int32(n), np.float32(x) or "
                        f"np.complex64(z)")
        if torch_dev is not None or cupy_dev is not None:  # (every argument checked first)
            order_after_libraries(stream, torch_dev, cupy_dev, uses)
        return out  # (interpreted: the values, packed into the slots by enqueue)

    def _count_error(self, args):
        n = len(self.params)
        wl = sum(1 for a in args if type(a) is LaunchArg and a.with_length)
        more = f" ({wl} with_length, each filling two)" if wl else ""
        names = ", ".join(p.name or "?" for p in self.params)
        return KernelError(f"the kernel takes {n} parameters ({names}) but was given {len(args)} "
                           f"arguments{more}; a buffer given as In/Out/InOut(x, "
                           f"with_length=True) fills a pointer and a length parameter")

    def enqueue(self, stream, config, values):
        st = stream
        impl = st._impl
        if cython.compiled:
            if self.launch_addr and self.nbytes <= _STACK_PARAMS and len(self.params) <= 512:
                err = _launch_compiled(self, impl, config, values)
                if err:
                    self._raise(err, config)
                return impl.submit_marker()
        backend = self.backend
        c = config
        if cython.compiled:
            ctypes.memmove(self.slots, values, len(values))
        else:
            struct.pack_into(self.fmt, self.slots, 0, *values)
        backend.ensure_context()
        hot = backend.hot
        if hot is not None:
            err = hot.launch(self.c_func, c.gx, c.gy, c.gz, c.bx, c.by, c.bz, c.shm,
                             impl.c_handle, self.c_ptrs, None)
        else:
            cu = backend.cu
            err = int(cu.cuLaunchKernel(self.func, c.gx, c.gy, c.gz, c.bx, c.by, c.bz, c.shm,
                                        impl.cu_stream, self.ptrs_addr, 0)[0])
        if err:
            self._raise(err, c)
        return impl.submit_marker()

    def _raise(self, err, config):
        from sharedmem.backends.cuda import _error  # (a code the bindings may not know)
        e = _error(err, "cuLaunchKernel")
        if err == 1 and config.shm:  # CUDA_ERROR_INVALID_VALUE, perhaps past the kernel's
            # own limit (sharedmem checked the device's opt-in maximum only)
            limit = self._dynamic_shared_limit()
            if config.shm > limit:
                name = getattr(self.kernel, "name", None)
                who = f"kernel {name!r}" if isinstance(name, str) else "the kernel"
                raise CudaError(
                    f"{e}: the launch asks for {config.shm} bytes of dynamic shared memory, "
                    f"more than {who} takes ({limit} bytes: 48 KiB less its static "
                    f"shared memory, until it opts in to more): set "
                    f"kernel.max_dynamic_shared_size_bytes = {config.shm} (a cupy.RawKernel; "
                    f"cuFuncSetAttribute with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES "
                    f"for a function handle) before launching", e.code) from None
        raise e

    def _dynamic_shared_limit(self) -> int:
        """The most dynamic shared memory the kernel takes now, as the driver says
        (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: 48 KiB less its static shared memory,
        or what it opted in to); 48 KiB where the driver cannot say."""
        cu = self.backend.cu
        try:
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            res = cu.cuFuncGetAttribute(attr, self.func)
            if res[0] == cu.CUresult.CUDA_SUCCESS:
                return int(res[1])
        except Exception:  # (an older binding or driver; a function handle it refuses)
            pass
        return 48 << 10


class LaunchConfig:
    """A validated launch configuration: grid and block dimensions, dynamic shared memory."""

    __slots__ = ("gx", "gy", "gz", "bx", "by", "bz", "shm")

    def __init__(self, g, b, shm):
        self.gx, self.gy, self.gz = g
        self.bx, self.by, self.bz = b
        self.shm = shm


def _dense(v) -> bool:
    """Whether array ``v`` (a view, a CuPy array or a torch tensor) holds its elements one
    after another."""
    if isinstance(v, Buffer):
        return True
    if isinstance(v, Tensor) or callable(getattr(v, "is_contiguous", None)):  # (torch too)
        return v.is_contiguous()
    flags = getattr(v, "flags", None)
    if flags is not None:
        return bool(flags.c_contiguous)
    step = v.itemsize
    for n, st in zip(reversed(v.shape), reversed(v.strides)):
        if n != 1 and st != step:
            return False
        step *= n
    return True


def _emit(out, par, v):
    """Put parameter ``par``'s value ``v`` (converted and checked) into ``out``: compiled,
    straight into its slot of the packed bytes; interpreted, onto the list struct packs."""
    if cython.compiled:
        slot = cython.cast(cython.p_char, out) + par.offset
        code = par.code
        if code == 8:
            cython.cast(cython.p_ulonglong, slot)[0] = PyLong_AsUnsignedLongLongMask(v)
        elif code == 4:
            cython.cast(cython.p_uint, slot)[0] = PyLong_AsUnsignedLongLongMask(v)
        elif code == _F32:
            cython.cast(cython.p_float, slot)[0] = v
        elif code == _F64:
            cython.cast(cython.p_double, slot)[0] = v
        elif code == 2:
            cython.cast(cython.p_ushort, slot)[0] = PyLong_AsUnsignedLongLongMask(v)
        elif code == 1:
            cython.cast(cython.p_uchar, slot)[0] = PyLong_AsUnsignedLongLongMask(v)
        else:
            memcpy(slot, cython.cast(cython.p_char, v), par.size)
    elif par.ctype == "char" and v > 127:  # (the same byte, as struct's "b" packs it)
        out.append(v - 256)
    else:
        out.append(v)


def _emit_address(out, par, ptr):
    """Put a device address into pointer parameter ``par`` (or its 8 bytes into a parameter
    of unknown type)."""
    if cython.compiled:
        cython.cast(cython.p_ulonglong, cython.cast(cython.p_char, out) + par.offset)[0] = ptr
    elif par.kcode == _K_PTR:
        out.append(ptr)
    else:
        out.append(ptr.to_bytes(8, "little"))


def _launch_compiled(plan, impl, config, packed):
    """Compiled only: point the parameter array at the slots of ``packed``, make the
    device's context current if it is not, and call ``cuLaunchKernel`` through its address.
    Returns the driver's result."""
    ptrs = cython.declare(cython.p_void[512])
    base = cython.cast(cython.p_char, packed)
    params = plan.params
    n = len(params)
    for i in range(n):
        p = cython.cast(Param, params[i])  # (Params: see RawKernelPlan.__init__)
        ptrs[i] = base + p.offset
    ctx = cython.declare(cython.p_void, cython.NULL)
    if plan.ctx_addr:
        cython.cast(ctx_get_fn_t, plan.ctx_addr)(cython.address(ctx))
    if cython.cast(cython.size_t, ctx) != plan.context:
        plan.backend.force_context()
    c = config
    return cython.cast(launch_fn_t, plan.launch_addr)(
        cython.cast(cython.p_void, cython.cast(cython.size_t, plan.func)), c.gx, c.gy, c.gz,
        c.bx, c.by, c.bz, c.shm, cython.cast(cython.p_void, cython.cast(cython.size_t, impl.handle)),
        ptrs, cython.NULL)


def plan_kernel(adapter, kernel, device):
    """The RawKernelPlan of ``kernel`` on ``device``: one per CUfunction (RawModule.get_function
    makes a new object on every call, and each must not be planned again)."""
    with _cupy().cuda.Device(device.ordinal):
        fn = kernel.kernel if hasattr(kernel, "kernel") else kernel  # RawKernel or Function
        func = int(fn.ptr)
    with _sig_lock:
        hit = _by_function.get((func, device.key))
    if hit is not None:
        return hit
    sizes = _param_sizes(func)
    if sizes is None:
        raise BackendUnavailableError(
            "launching CuPy kernels through sharedmem needs cuFuncGetParamInfo (CUDA 12.4+ "
            "driver and cuda-bindings)")
    plan = RawKernelPlan(kernel, adapter, device, fn, func, _signature_params(kernel, sizes))
    with _sig_lock:
        if len(_by_function) >= _SIG_CACHE_MAX:  # bounded: programs that make many kernels
            _by_function.clear()
        _by_function[(func, device.key)] = plan
    return plan


_by_function = {}  # (CUfunction, device key) -> RawKernelPlan; guarded by _sig_lock
_SIG_CACHE_MAX = 1024  # kernels remembered (each plan keeps its kernel alive)
# (a full cache is cleared under it, and dropped plans may run finalizers that launch)
_sig_lock = fork_safe(OwnedLock("the CuPy kernel plan cache"))


class ArrayFacts(ForeignArray):
    """What a launch needs of a CuPy array, which cannot change while the array lives: the
    lease token of its bytes (``token``: their range in the allocation they belong to, kept
    alive here, and whether they may be written -- not for an ``as_cupy`` export of a
    read-only view) and ``offset``, the byte offset of its element 0 in that allocation. A
    CuPy array's data pointer, memory and device are read-only; its shape may be re-set,
    but only to one of the same size over the same bytes. The token keeps the allocation,
    never the array (that would keep the array alive): a launch keeps the array itself.
    ``addr``: the array's address (its id); ``dead``: set by the weak reference's callback,
    which runs before the array's memory is freed -- so no later object at that address is
    taken for it. A torch tensor's facts (:func:`torch_facts`) also keep the data pointer and
    ``(shape, strides, dtype)`` they were learned from (``ptr``, ``layout``; None for a CuPy
    array): a torch tensor's memory and layout can change in place."""

    __slots__ = ("addr", "dead", "ptr", "layout")


# id(array) -> ArrayFacts of the live CuPy arrays passed to launches. An entry goes when its
# array dies (its weak reference's callback, which also marks it ``dead``: a later array at
# the same address is learned anew). Lock-free: single dict operations; a racing thread
# learns equal facts.
_facts = cython.declare(dict, {})
# The facts found last, by a hash of the array's address (compiled: one C list read, before
# the dict, whose key is an int made per lookup), in pairs of slots (``slot ^ 1``, the other
# of the pair: two arrays whose addresses hash alike -- objects 4 KiB apart -- both stay, not
# evicting each other on every launch). An entry is used only while it is the array's
# (``addr`` equal, not ``dead``). Lock-free: single list stores of immutable records.
_RECENT = cython.declare(cython.Py_ssize_t, 64)
_recent = cython.declare(list, [None] * 64)


def learned_facts() -> dict:
    """The table of learned facts itself, ``id(array) -> ArrayFacts`` (compiled, a C global:
    for tests and diagnostics)."""
    return _facts


def recent_facts() -> list:
    """What the recent-lookup table holds now (a copy; compiled, the table is a C global)."""
    return list(_recent)


class _FactsRef(weakref.ref):
    """The weak reference facts keep to their array, which gives its callback the array's
    address (one function for all: no closure a new array, whose function and defaults the
    collector would visit while the array lives)."""

    __slots__ = ("key",)


def _facts_gone(ref) -> None:
    """The callback of a :class:`_FactsRef`: its array died."""
    _forget(ref.key, ref)


def _forget(key, ref):
    f = _facts.get(key)
    if f is not None and f.ref is ref:
        f.dead = True
        # (pop, not del: two threads finding a torch tensor's facts stale at once both
        # forget them, and interpreted both may be past the get above)
        _facts.pop(key, None)
    slot = (key >> 6) % _RECENT  # (see _known)
    for i in range(2):
        f = _recent[slot]
        if f is not None and f.ref is ref:  # (nothing outlives the array: its allocation goes)
            f.dead = True
            _recent[slot] = None
        slot ^= 1


def array_facts(arr):
    """The :class:`ArrayFacts` of CuPy array ``arr``, learned on its first launch."""
    f = _known(arr)
    if f is not None:
        return f
    alloc, lo, hi = _allocation_of(arr, Device(arr.device.id))
    return _remember(arr, "CuPy array argument", alloc, lo, hi, owner_writable(arr),
                     arr.data.ptr, None, None)


def _known(arr):
    """The live facts learned before of foreign array ``arr``, or None. Compiled, the
    recent-lookup table first (field reads, no call), then the dict (an entry found there goes
    into the table)."""
    if cython.compiled:
        addr = cython.cast(cython.size_t, cython.cast(cython.p_void, arr))
        slot = (addr >> 6) % _RECENT  # (an array object is some 100 bytes long)
        f = _recent[slot]
        if f is not None and f.addr == addr and not f.dead:
            return f
        f = _recent[slot ^ 1]
        if f is not None and f.addr == addr and not f.dead:
            return f
        f = _facts.get(addr)  # (the key id() would give, without the builtin's call)
        if f is None or f.dead:
            return None
        _recall(f)
        return f
    f = _facts.get(id(arr))
    return f if f is not None and not f.dead else None


def _recall(f) -> None:
    """Compiled: put facts ``f`` into the recent-lookup table (into the pair's other slot
    where this one holds another live array's), and out of it any other facts of the same
    address (a torch tensor's replaced ones, which two threads learning it at once may leave
    there: they would keep its old allocation)."""
    slot = (f.addr >> 6) % _RECENT
    other = _recent[slot]
    if other is not None and not other.dead and other.addr != f.addr:
        slot ^= 1
    _recent[slot] = f
    other = _recent[slot ^ 1]
    if other is not None and other.addr == f.addr:
        _recent[slot ^ 1] = None


def _remember(arr, kind, alloc, lo, hi, writable, ptr, layout, keep):
    """New facts of ``arr`` (element 0 at ``ptr``, bytes ``[lo, hi)`` of ``alloc``), kept
    until it dies (made whole before another thread can find them)."""
    key = id(arr)
    f = ArrayFacts()
    f.token = tok = unregistered_token(alloc, kind, lo, hi, writable, alloc)
    tok.live = True  # a lease's range: never a live view (not in the allocation's views)
    tok.origin = None  # (as ViewToken(...) made it: a lease names no place it was created)
    f.offset = ptr - alloc.ptr
    f.addr = key
    f.dead = False
    f.ptr = ptr
    f.layout = layout
    f.keep = keep
    f.ref = ref = _FactsRef(arr, _facts_gone)
    ref.key = key
    _facts[key] = f
    if cython.compiled:
        _recall(f)
    return f


def torch_facts(t):
    """The :class:`ArrayFacts` of torch tensor ``t`` (on a CUDA device; None otherwise), as
    for a CuPy array -- but ``set_``, ``resize_`` and ``as_strided_`` change a torch tensor's
    memory or layout in place: its facts serve while its data pointer, shape and strides are
    those they were learned from, and are learned anew otherwise. Its allocation spans its
    driver allocation (torch's caching allocator's segment: a foreign allocation, so storages
    torch makes and frees there are ranges of one allocation; ours where it is our memory, a
    tensor made by ``torch.from_dlpack`` of a view: then writable only where a writable view
    reaches it). Each launch's work keeps the storage the tensor has then (``keep``): one torch
    swaps out meanwhile (``set_``, ``.data =``) is not freed under the kernel. A ``resize_``
    that reallocates (growing; ``untyped_storage().resize_(0)``) frees the old memory of the
    same storage at once, which nothing kept prevents (docs/interop-cupy.md: finish the
    launch first). A launch is ordered after torch's current stream of the tensor's device
    (:func:`order_after_libraries`)."""
    ptr = t.data_ptr()
    shape = t.shape
    strides = t.stride()  # (in elements: the dtype too)
    dtype = t.dtype
    f = _known(t)
    if f is not None:
        if f.ptr == ptr:
            layout = f.layout  # (compared a part at a time: no tuple made)
            if layout[0] == shape and layout[1] == strides and layout[2] == dtype:
                if t.is_conj() or t.is_neg():  # (set in place, memory and layout unchanged:
                    raise _lazy_bit_error(t)   # t.data = t.conj())
                return f
        _forget(f.addr, f.ref)  # (no longer the tensor's: dead, out of the dict and the
        # table -- left in the table's other slot, they kept the old allocation registered)
    layout = (shape, strides, dtype)
    if not t.is_cuda:
        return None
    if t.is_conj() or t.is_neg():  # (lazy bits: its memory holds the values without them)
        raise _lazy_bit_error(t)
    zero = getattr(t, "_is_zerotensor", None)  # (torch 1.12 on)
    if zero is not None and zero():  # (no memory: NULL; never found above, its pointer is new)
        raise KernelError(f"a torch zero tensor (shape {tuple(shape)}, {dtype}) cannot be a "
                          f"kernel argument: it has no memory (its data pointer is NULL, its "
                          f"zeros implied); pass x.clone() (a tensor that holds them)")
    dev = Device(t.device.index)
    item = t.element_size()
    lo, hi = extent(layout[0], [st * item for st in layout[1]], item)
    start = ptr + lo
    nbytes = hi - lo  # (0 where empty: extent's (0, 0))
    alloc = lookup_allocation(dev, start, nbytes)  # (a fresh tensor in torch's segment: the
    if alloc is None:                              # driver was asked already)
        info = dev.backend.pointer_info(start) if hi > lo else None
        if info is not None and start + hi - lo <= info[0] + info[1]:
            region = (info[0], info[1])
        else:  # (memory the driver does not name: its storage)
            storage = t.untyped_storage()
            region = (storage.data_ptr(), max(storage.nbytes(), 1))
        alloc = import_allocation(dev, start, nbytes, "torch", region=region)
    lo, hi = start - alloc.ptr, start - alloc.ptr + hi - lo
    writable = import_writable(alloc, lo, hi, True)  # (torch has no read-only tensors)
    return _remember(t, "torch tensor argument", alloc, lo, hi, writable, ptr, layout,
                     type(t).untyped_storage)


def _lazy_bit_error(t):
    """The KernelError of torch tensor ``t`` with the conjugate or negative bit set."""
    bit, fix = ("conjugate", "resolve_conj") if t.is_conj() else ("negative", "resolve_neg")
    return KernelError(f"a torch tensor with the {bit} bit set (shape {tuple(t.shape)}, "
                       f"{t.dtype}) cannot be a kernel argument: its memory holds the values "
                       f"without the {bit} applied, which the kernel would read as they are; "
                       f"pass x.{fix}() (a tensor that holds them)")


def order_after_libraries(stream, torch_devs, cupy_devs, uses=None) -> None:
    """Order later work on ``stream`` after the pending work on the current streams of the
    libraries whose arrays one launch was given: torch's current stream of each device in
    ``torch_devs`` and CuPy's of each in ``cupy_devs`` (None, a Device, or a list:
    :func:`devices_of`) -- what the library's ``__dlpack__(stream=...)`` does for an import,
    so that a kernel reads what the library wrote there before the launch. Called once the
    arguments are checked. Nothing where that stream is ``stream`` itself (launch there: no
    wait); one wait where torch's and CuPy's are one stream. A capture cannot wait for
    another stream: CaptureError there, saying what to do, raised before any wait is
    enqueued. ``uses``: the launch's leases,
    given by a plan's pack -- captured (on the libraries' streams), the graph then orders each
    of its replays so, once the launch is recorded (see ``Graph.after_recorded_locked``)."""
    todo = None  # ((device, handle, torch) of each wait: the usual launch has none)
    if torch_devs is not None:
        todo = _to_wait(stream, torch_devs, True, todo)
    if cupy_devs is not None:
        todo = _to_wait(stream, cupy_devs, False, todo)
    if todo is None:
        if stream._capture is not None and uses is not None:  # (captured on the
            with locked():  # libraries' streams: each replay is ordered as this launch is)
                g = stream._capture  # (the graph's steps: guarded by core_lock while it runs)
                if g is not None:  # (once recorded: not a launch refused or failed after this)
                    g.after_recorded_locked(uses, partial(_add_replay_order, torch_devs,
                                                          cupy_devs))
        return
    if stream._capture is not None or RUNTIME.captures:
        for dev, h, torch in todo:
            _check_capture(stream, dev, h, torch)
    for dev, h, torch in todo:  # (every stream asked before any wait: a refusal waits for
        e = dev.backend.foreign_capture_error(h)  # nothing)
        if e is not None:
            raise e
    for dev, h, torch in todo:
        dev.backend.order_after_handle(stream._impl, h)


def _add_replay_order(torch_devs, cupy_devs, g) -> None:
    """A captured launch's part of graph ``g``'s :class:`_ReplayOrder` (core_lock held)."""
    g.before_replays(_ReplayOrder, _ReplayOrder).add(torch_devs, cupy_devs)


class _ReplayOrder:
    """A graph's replay step (``Graph.before_replays``): a replay is ordered after the
    current streams of the libraries whose arrays its captured launches were given, of
    their devices, as a launch of them is (:func:`order_after_libraries`, with its
    refusals: a replay that would be drawn into another library's capture)."""

    __slots__ = ("torch", "cupy")

    def __init__(self):
        self.torch = None  # (devices: None, a Device, or a list -- see devices_of)
        self.cupy = None

    def add(self, torch_devs, cupy_devs) -> None:
        self.torch = merged_devices(self.torch, torch_devs)
        self.cupy = merged_devices(self.cupy, cupy_devs)

    def __call__(self, stream) -> None:
        try:
            order_after_libraries(stream, self.torch, self.cupy)
        except CaptureError as e:  # (said of a launch: what it means for a replay, which no
            raise CaptureError(    # capture of sharedmem's takes)
                f"a replay on {stream} of a graph that captured launches of CuPy arrays or "
                f"torch tensors is ordered after those libraries' current streams, as the "
                f"launches were, and cannot be now: {e} -- replay once that capture has "
                f"ended") from None


def _to_wait(stream, devs, torch, todo):
    """``todo`` (None, or a list) with the wait of ``stream`` for torch's (``torch`` true) or
    CuPy's current stream of each device in ``devs`` (a Device, or a list of them) -- none
    where that stream is ``stream`` itself, or a wait listed already."""
    if type(devs) is list:
        for dev in devs:
            todo = _to_wait(stream, dev, torch, todo)
        return todo
    h = library_handle(devs, torch)
    if devs is stream.device and h == stream._impl.handle:
        return todo  # (handles name streams per device: 0 is every device's legacy stream)
    if todo is None:
        return [(devs, h, torch)]
    for d, x, _ in todo:
        if d is devs and x == h:  # (torch's and CuPy's current stream: one stream)
            return todo
    todo.append((devs, h, torch))
    return todo


def _check_capture(stream, device, h, torch) -> None:
    """CaptureError where :func:`order_after_libraries` cannot wait: ``stream`` capturing (a
    capture cannot wait for another stream), or the library's current stream (handle ``h``
    on ``device``) capturing (the wait would draw ``stream`` into that capture)."""
    lib, arrays = ("torch", "torch tensors") if torch else ("CuPy", "CuPy arrays")
    if stream._capture is not None:
        how = ("with torch.cuda.stream(...) of the stream captured" if torch else
               "with cupy.cuda.Stream.from_external(stream) around the capture -- CuPy 13: "
               "cupy.cuda.ExternalStream(stream.handle, device_id) -- and pass that stream to "
               "sm.graph(op, stream)")
        raise CaptureError(
            f"{stream} is capturing a graph, and a launch with {arrays} among its arguments "
            f"is ordered after {lib}'s current stream of {device} (handle {h:#x}), which a "
            f"capture cannot wait for; capture on {lib}'s current stream ({how}), or pass "
            f"views of the arrays (sm.from_dlpack before the capture)")
    theirs = Stream._find(device, h)
    if theirs is not None and theirs._capture is not None:  # (a wait on work recorded into
        raise CaptureError(                                 # a capture joins the capture)
            f"{lib}'s current stream of {device} is {theirs}, which is capturing graph "
            f"#{theirs._capture.id}, and a launch with {arrays} among its arguments on "
            f"{stream} is ordered after it -- which would draw {stream} into the capture; "
            f"launch on {theirs} (stream=...) to capture the launch, or outside the capture")


def library_of(a) -> int:
    """Whose current stream a launch with resolved argument ``a``, a LaunchArg, is ordered
    after: 1 torch's (a torch tensor's), 0 CuPy's (a CuPy array's), -1 none (a view's,
    another foreign array's). (pack() orders an ArrayFacts argument itself.)"""
    if type(a) is not LaunchArg or a.view is not None:
        return -1
    v = a.value  # (a foreign array with_length: its facts' token, the array itself)
    nd = _ndarray[1]
    if nd is not None and isinstance(v, nd):
        return 0
    tt = torch_tensor_type()
    return 1 if tt is not None and isinstance(v, tt) else -1


def merged_devices(seen, devs):
    """``seen`` with the devices of ``devs`` (each None, a Device, or a list of them; a list
    ``seen`` is extended)."""
    if devs is None or seen is devs:
        return seen
    if type(devs) is list:
        for dev in devs:
            seen = merged_devices(seen, dev)
        return seen
    if seen is None:
        return devs
    if type(seen) is list:
        if devs not in seen:
            seen.append(devs)
        return seen
    return [seen, devs]


def torch_tensor_type():
    """torch's ``Tensor`` class where torch is imported, else None."""
    torch = _modules.get("torch")
    if torch is None:
        return None
    if torch is not _torch[0]:  # (first use, or a module replaced since: tests do)
        _torch[1] = torch.Tensor
        _torch[0] = torch
    return _torch[1]


# [the cupy module, its ndarray] once CuPy is imported, [the torch module, its Tensor] once
# torch is; sys.modules (C globals where compiled: no dict lookups)
_ndarray = cython.declare(list, [None, None])
_torch = cython.declare(list, [None, None])
_modules = cython.declare(dict, sys.modules)


def coerce(obj, device):
    """``KernelAdapter.coerce`` of CuPy and cuTile kernels: a CuPy array argument as its
    :class:`ArrayFacts` (a :class:`~sharedmem.launch.ForeignArray`: a lease of its bytes
    with no view token, made on its first launch; the launch keeps the array alive until its
    work is done); a CUDA torch tensor as its facts too (:func:`torch_facts`: the launch is
    ordered after torch's current stream, as an import would be); any other DLPack producer on
    a CUDA device (a JAX array) imported for the launch -- ordered after the producer's pending
    work on its current stream, as every import is (``interop.dlpack.from_dlpack``); None for
    anything else (a NumPy array: refused as a pointer argument, by name)."""
    nd = _ndarray[1]
    if nd is not None and type(obj) is nd:  # (the common case: no module lookup)
        if not cython.compiled:  # (interpreted: array_facts' lookup, without the call)
            f = _facts.get(id(obj))
            if f is not None and not f.dead:
                return f
        return array_facts(obj)
    tt = torch_tensor_type()
    if tt is not None and isinstance(obj, tt):
        return torch_facts(obj)
    cp = _modules.get("cupy")
    if cp is not None:
        if cp is not _ndarray[0]:  # (first use, or a module replaced since: tests do)
            _ndarray[1] = cp.ndarray
            _ndarray[0] = cp
        if isinstance(obj, _ndarray[1]):
            return array_facts(obj)
    where = getattr(obj, "__dlpack_device__", None)
    if where is not None and hasattr(obj, "__dlpack__") and where()[0] in (2, 13):
        return _module("interop.dlpack").from_dlpack(obj)  # (kDLCUDA, kDLCUDAManaged)
    return None


def _c_coerce(obj, device):
    """Compiled: :func:`coerce` as a C function (cupy_launch.pxd), whose address CuPy's
    adapter gives the launch path (``KernelAdapter._coerce_addr``)."""
    return coerce(obj, device)


#: The address of :func:`_c_coerce` (0 interpreted)
COERCE_ADDR = cython.cast(cython.size_t, cython.cast(cython.p_void, _c_coerce)) \
    if cython.compiled else 0
