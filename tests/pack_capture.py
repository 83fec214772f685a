"""Helper of test_pack_differential.py, run as a script in a subprocess (one a build: the
compiled core, or the interpreted one with SHAREDMEM_PURE_PYTHON=1 -- one process imports
only one of them).

It launches every case of ``CASES`` (a CuPy RawKernel stand-in of tests/fake_cuda.py, over
the fake driver) and every case of ``TILE_CASES`` (the fake cuda.tile), and prints one JSON
object: which build ran, the addresses of the arrays it made, and per case what reached
the driver -- each kernel parameter's bytes, as hex, read at the ``cuLaunchKernel`` call
from the pointers the launch passed (or the KernelError the launch raised) -- and what
reached ``cuda.tile.launch`` (each argument, described as JSON).

The cases are plain JSON data (see ``make``), so that the test computes the expected bytes
from the same description, without sharedmem.
"""

import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# -- the cases -------------------------------------------------------------------------------
# An argument is a list:
#   ["int", v] ["bool", b] ["f64", "<16 hex digits: a double's bits>"] ["complex", re, im]
#   ["np", dtype, v]       a NumPy scalar: np.dtype(dtype).type(v) (v an int, or a double's
#                          bits as ["f64", hex], or [re_bits, im_bits] for complex dtypes)
#   ["ld", [[m, e], ...]]  an np.longdouble: the sum of m * 2**e
#   ["none"]
#   ["buf", name]                     a whole buffer of ARRAYS
#   ["bslice", name, start, stop]     a Buffer slice (buf[start:stop])
#   ["tslice", name, shape, ops]      the named 1-D Tensor ("t:" + name: another array of
#                                     the same elements), reshaped, then indexed by each op in
#                                     turn: [start, stop, step] a first-axis slice, i an index
#   ["box", dtype, v]                 a DeviceBox
#   [intent, arg, with_length]        intent "In", "Out" or "InOut" around an array argument

#: Named arrays the array arguments are views of: name -> (dtype, elements); each is made as
#: a Buffer (name) and as a 1-D Tensor ("t:" + name).
ARRAYS = {"f32": ("float32", 64), "i16": ("int16", 48), "f64": ("float64", 24),
          "u8": ("uint8", 40)}


def f64(x):
    """A double as the spec of its bits."""
    return ["f64", struct.pack("<d", x).hex()]


def bits(h):
    return ["f64", h]


def _int_cases():
    out = []
    types = [  # (declared type, bytes, signed, values)
        ("bool", 1, None, [0, 1, True, False, ["np", "bool", 1], ["np", "bool", 0],
                           ["np", "int8", 1], ["np", "uint64", 0]]),
        ("char", 1, "char", [0, 1, -1, 127, -128, 200, 255, ["np", "int8", -1],
                             ["np", "uint8", 255], ["np", "bool", 1], True]),
        ("signed char", 1, True, [-128, 127, -1, ["np", "int8", -128]]),
        ("unsigned char", 1, False, [0, 255, 128, ["np", "uint8", 200], ["np", "uint64", 255]]),
        ("int8_t", 1, True, [-128, 127]),
        ("uint8_t", 1, False, [255]),
        ("short", 2, True, [-32768, 32767, -1, ["np", "int16", -2], ["np", "uint8", 255]]),
        ("unsigned short", 2, False, [0, 65535, 32768, ["np", "uint16", 65535]]),
        ("int", 4, True, [0, -1, 2**31 - 1, -2**31, 12345678, ["np", "int32", -7],
                          ["np", "int64", 2**31 - 1], ["np", "uint32", 5], ["np", "int16", -300],
                          ["np", "longlong", -5], ["np", "intc", -9], True, ["np", "bool", 1]]),
        ("int32_t", 4, True, [-2**31]),
        ("unsigned", 4, False, [2**32 - 1]),
        ("unsigned int", 4, False, [0, 2**32 - 1, 2**31, ["np", "uint32", 2**32 - 1],
                                    ["np", "ulonglong", 7]]),
        ("uint32_t", 4, False, [0xDEADBEEF]),
        ("long", 8, True, [-1, 2**63 - 1]),
        ("long long", 8, True, [0, -1, 2**63 - 1, -2**63, 2**40 + 3, ["np", "int64", -2**63],
                                ["np", "uint32", 2**32 - 1], ["np", "longlong", 2**63 - 1],
                                ["np", "uint64", 2**63 - 1]]),
        ("int64_t", 8, True, [-2**63 + 1]),
        ("unsigned long long", 8, False, [0, 2**64 - 1, 2**63, ["np", "uint64", 2**64 - 1],
                                          ["np", "ulonglong", 2**64 - 2], ["np", "int64", 1]]),
        ("unsigned long", 8, False, [2**64 - 1]),
        ("uint64_t", 8, False, [2**63 + 5]),
        ("size_t", 8, False, [0, 2**64 - 1, 4096, ["np", "uint64", 2**64 - 1]]),
        ("ssize_t", 8, True, [-1]),
        ("ptrdiff_t", 8, True, [-1, -2**63, 2**63 - 1, ["np", "int64", -3]]),
        ("intptr_t", 8, True, [-2]),
        ("uintptr_t", 8, False, [2**64 - 1]),
    ]
    for ctype, size, signed, values in types:
        for v in values:
            a = v if isinstance(v, list) else ["bool", v] if isinstance(v, bool) else ["int", v]
            out.append({"params": [[ctype, size]], "args": [a]})
    # refused: out of range (both builds alike, the message compared)
    for ctype, size, v in (("char", 1, 256), ("char", 1, -129), ("signed char", 1, 128),
                           ("unsigned char", 1, -1), ("bool", 1, 2), ("short", 2, 2**15),
                           ("int", 4, 2**31), ("unsigned int", 4, -1), ("long long", 8, 2**63),
                           ("size_t", 8, 2**64), ("size_t", 8, -1)):
        out.append({"params": [[ctype, size]], "args": [["int", v]]})
    out.append({"params": [["int", 4]], "args": [["np", "int64", 2**40]]})
    out.append({"params": [["int", 4]], "args": [f64(1.0)]})
    out.append({"params": [["int", 4]], "args": [["np", "float32", f64(1.0)]]})
    return out


def _float_cases():
    out = []
    dbl = [0.0, -0.0, 1.0, -1.5, 0.1, 1 / 3, 1e300, -1e-300, 5e-324, 2.2250738585072014e-308,
           1.7976931348623157e308, 3.4028234663852886e38, -3.4028234663852886e38, 1.4e-45,
           1e-46, 7e-46, 1.1754942106924411e-38, 65504.0, 65519.99, 6e-8, 2.9e-8, 3e-8, 1e-9,
           1 + 2**-24, 1 + 2**-24 + 2**-52, 1 + 3 * 2**-24, 16777217.0]
    specials = ["7ff0000000000000", "fff0000000000000", "7ff8000000000000", "fff8000000000000",
                "7ff4000000000000", "7ff8000000000123", "8000000000000000", "0000000000000001"]
    for ctype, size in (("float", 4), ("double", 8), ("half", 2), ("__half", 2)):
        for x in dbl:
            out.append({"params": [[ctype, size]], "args": [f64(x)]})
        for h in specials:
            out.append({"params": [[ctype, size]], "args": [bits(h)]})
        ints = [0, 1, -1, 7, 2**24 + 1, 2**31 - 1, 2**53 + 1, -(2**53 + 1), 2**60 + 2**36 + 1,
                -(2**60 + 2**36 + 1), 2**60 + 2**36, 2**63 - 1, 2**64 - 1, 2**64 - 2**39 - 1,
                65504, 65520]
        for v in ints:
            out.append({"params": [[ctype, size]], "args": [["int", v]]})
        for dt, v in (("float32", f64(0.1)), ("float32", bits("7fc00000" + "0" * 8)),
                      ("float64", f64(1 / 3)), ("float16", f64(0.333)), ("float64", f64(-0.0)),
                      ("float32", f64(1.4e-45)), ("float64", f64(1e-310)), ("int32", -5),
                      ("int64", 2**60 + 2**36 + 1), ("uint64", 2**64 - 1), ("int8", -128),
                      ("float16", f64(65504.0)), ("float32", f64(3.4028234663852886e38))):
            out.append({"params": [[ctype, size]], "args": [["np", dt, v]]})
        for terms in ([[1, 0], [1, -24], [1, -60]], [[-1, 0], [-1, -24], [1, -60]],
                      [[1, 0], [1, -11], [1, -60]], [[1, 0], [1, -53], [1, -70]],
                      [[3, -1]], [[1, -149]], [[1, -150], [1, -200]], [[1, -25], [1, -80]],
                      [[1, 0], [1, -52], [1, -53], [1, -63]]):
            out.append({"params": [[ctype, size]], "args": [["ld", terms]]})
    # refused: beyond the type's range (finite), not a number
    for ctype, size, a in (("float", 4, f64(1e39)), ("float", 4, f64(3.4028235677973366e38)),
                           ("float", 4, ["int", 2**128]), ("half", 2, f64(65520.0)),
                           ("half", 2, f64(1e5)), ("double", 8, ["int", 10**400]),
                           ("float", 4, ["bool", True]), ("double", 8, ["complex", 1.0, 2.0]),
                           ("double", 8, ["np", "bool", 1]), ("half", 2, ["int", 65520]),
                           ("float", 4, ["np", "float64", f64(1e39)]),
                           ("float", 4, ["ld", [[1, 200]]])):
        out.append({"params": [[ctype, size]], "args": [a]})
    return out


def _opaque_cases():
    """Parameters whose type sharedmem does not convert (complex, long double, vector types,
    typedefs) or whose source is unknown: a NumPy scalar of the parameter's size, as its
    bytes; None for an 8-byte one."""
    out = []
    c64, c128 = "complex<float>", "complex<double>"
    for ctype, size, a in (
            (c64, 8, ["np", "complex64", [struct.pack("<d", 1.5).hex(),
                                           struct.pack("<d", -2.25).hex()]]),
            (c64, 8, ["np", "complex64", ["7ff8000000000000", "8000000000000000"]]),
            (c128, 16, ["np", "complex128", [struct.pack("<d", 0.1).hex(),
                                              "7ff0000000000000"]]),
            ("thrust::complex<double>", 16, ["np", "complex128", [struct.pack("<d", -0.0).hex(),
                                                                  struct.pack("<d", 1e-310).hex()]]),
            ("cuFloatComplex", 8, ["np", "complex64", [struct.pack("<d", 3.0).hex(),
                                                       struct.pack("<d", 4.0).hex()]]),
            ("long double", 8, ["np", "float64", f64(1 / 3)]),
            ("float2", 8, ["np", "uint64", 0x4000000040400000]),
            ("idx_t", 4, ["np", "int32", -1]),
            ("idx_t", 8, ["np", "int64", -2**63]),
            ("idx_t", 2, ["np", "float16", f64(-0.0)]),
            ("idx_t", 1, ["np", "bool", 1]),
            ("idx_t", 8, ["none"]),
            # refused: no Python scalars, a NumPy scalar of another size
            (c64, 8, ["complex", 1.5, -2.25]), (c128, 16, ["np", "complex64", [
                struct.pack("<d", 1.0).hex(), struct.pack("<d", 0.0).hex()]]),
            ("long double", 8, ["ld", [[1, 0]]]), ("idx_t", 4, ["int", 3]),
            ("float2", 8, ["buf", "f32"])):
        out.append({"params": [[ctype, size]], "args": [a]})
    # no source: every parameter of unknown type; an 8-byte one takes an array's address
    out.append({"params": [[None, 8], [None, 4], [None, 8], [None, 2], [None, 16], [None, 8]],
                "args": [["buf", "f32"], ["np", "float32", f64(2.5)], ["bslice", "f64", 3, 9],
                         ["np", "int16", -2], ["np", "complex128", [
                             struct.pack("<d", 1.0).hex(), struct.pack("<d", -1.0).hex()]],
                         ["none"]]})
    out.append({"params": [[None, 8], [None, 8]], "args": [["In", ["buf", "i16"], True]]})
    out.append({"params": [[None, 8], [None, 4]], "args": [["In", ["bslice", "u8", 5, 17], True]]})
    out.append({"params": [[None, 4]], "args": [["int", 1]]})
    return out


def _pointer_cases():
    out = []
    for ctype in ("float*", "const float*", "void*", "double*", "char*", "int*"):
        out.append({"params": [[ctype, 8]], "args": [["buf", "f32"]]})
    for a in (["bslice", "f32", 5, 20], ["bslice", "f32", 63, 64], ["bslice", "f32", 64, 64],
              ["bslice", "i16", 1, 2], ["bslice", "u8", 3, 40], ["bslice", "f64", 23, 24],
              ["tslice", "f32", [8, 8], [[2, 7, 1]]], ["tslice", "f32", [8, 8], [[1, 8, 2]]],
              ["tslice", "f32", [8, 8], [3]], ["tslice", "f32", [4, 16], [[1, 4, 2], 1]],
              ["tslice", "i16", [6, 8], [[5, 6, 1]]], ["tslice", "u8", [2, 4, 5], [1, [1, 4, 2]]],
              ["tslice", "f64", [24], [[23, None, 5]]], ["tslice", "u8", [40], [[40, 40, 1]]],
              ["box", "float64", 3.5], ["box", "int32", -7], ["box", "uint8", 255],
              ["none"], ["np", "uint64", 0xDEADBEEF000], ["np", "int64", -1],
              ["np", "uint64", 0], ["np", "longlong", 4096],
              ["In", ["buf", "f32"], False], ["Out", ["bslice", "f64", 2, 5], False],
              ["InOut", ["tslice", "f32", [8, 8], [[1, 3, 1]]], False],
              ["In", ["box", "float32", 1.0], False],
              # refused
              ["int", 0], ["np", "uint32", 5], f64(0.0), ["In", ["int", 3], False]):
        out.append({"params": [["float*", 8]], "args": [a]})
    out.append({"params": [["int", 4]], "args": [["buf", "f32"]]})
    out.append({"params": [["double y[4]", 8]], "args": [["bslice", "f64", 4, 8]]})
    return out


def _length_cases():
    """``with_length=True``: a pointer and the count of elements, into the next parameter."""
    out = []
    for lctype, lsize in (("int", 4), ("unsigned int", 4), ("long long", 8), ("size_t", 8),
                          ("short", 2), ("char", 1), ("unsigned char", 1), ("ptrdiff_t", 8),
                          ("idx_t", 4), ("idx_t", 8), ("int64_t", 8)):
        for a in (["buf", "f32"], ["bslice", "u8", 2, 40], ["bslice", "f64", 24, 24],
                  ["box", "int16", 3]):
            out.append({"params": [["float*", 8], [lctype, lsize]],
                        "args": [["In", a, True]]})
    out.append({"params": [["float*", 8], ["int", 4]],
                "args": [["InOut", ["tslice", "f32", [4, 16], [[1, 3, 1]]], True]]})
    out.append({"params": [["float*", 8], ["unsigned", 4]],
                "args": [["InOut", ["tslice", "u8", [2, 4, 5], [1, [2, 4, 1]]], True]]})
    # refused: a strided tensor, a float length, a length that does not fit
    out.append({"params": [["float*", 8], ["int", 4]],
                "args": [["In", ["tslice", "f32", [8, 8], [[0, 8, 2]]], True]]})
    out.append({"params": [["float*", 8], ["float", 4]], "args": [["In", ["buf", "f32"], True]]})
    out.append({"params": [["float*", 8], ["char", 1]], "args": [["In", ["buf", "u8"], True]]})
    out.append({"params": [["float*", 8], ["float2", 8]], "args": [["In", ["buf", "u8"], True]]})
    out.append({"params": [["float*", 8], ["int", 4]],
                "args": [["In", ["buf", "i16"], True], ["int", 1]]})
    return out


def _mixed_cases():
    out = [{"params": [["float", 4], ["const float*", 8], ["const float*", 8], ["float*", 8],
                       ["int", 4]],
            "args": [f64(2.0), ["In", ["buf", "f32"], False], ["In", ["bslice", "f32", 1, 9], False],
                     ["Out", ["bslice", "f32", 32, 64], False], ["int", 32]]},
           {"params": [["char", 1], ["double", 8], ["half", 2], ["bool", 1], ["short", 2],
                       ["float*", 8], ["unsigned long long", 8], ["unsigned char", 1],
                       ["int", 4], ["complex<double>", 16], ["float", 4], ["size_t", 8]],
            "args": [["int", -3], bits("fff8000000000000"), f64(-65504.0), ["bool", True],
                     ["np", "int16", -32768], ["In", ["buf", "u8"], True],
                     ["np", "uint8", 255], ["int", 1], ["np", "complex128", [
                         struct.pack("<d", 2.0).hex(), struct.pack("<d", -0.0).hex()]],
                     ["np", "float16", f64(0.5)], ["int", 2**64 - 1]]}]
    # more than the compiled enqueue's stack buffer (4096 bytes, 512 parameters): the other
    # path of each build
    n = 530
    params = [["int", 4] if k % 3 else ["double", 8] for k in range(n)]
    args = [["int", -k * 1000003 % (2**31)] if k % 3 else f64(k / 7) for k in range(n)]
    params[7] = ["float*", 8]
    args[7] = ["bslice", "f32", 3, 9]
    params[8], args[8] = ["half", 2], f64(1 / 3)
    out.append({"params": params, "args": args})
    params = [["int", 4] if k % 2 else ["double", 8] for k in range(500)]
    params[499] = ["complex<double>", 16]
    args = [["int", -k] if k % 2 else f64(-k / 3) for k in range(499)]
    args.append(["np", "complex128", ["7ff0000000000000", struct.pack("<d", 1.0).hex()]])
    out.append({"params": params, "args": args})
    return out


CASES = _int_cases() + _float_cases() + _opaque_cases() + _pointer_cases() + \
    _length_cases() + _mixed_cases()
for _i, _c in enumerate(CASES):
    _c["id"] = _i

#: cuTile launches: each case's arguments, passed to a kernel that does nothing; what
#: reaches cuda.tile.launch is compared.
TILE_CASES = [{"id": i, "args": args} for i, args in enumerate([
    [["int", 0]], [["int", -2**63]], [["int", 2**64 + 5]], [["bool", True]], [["bool", False]],
    [f64(-0.0)], [bits("fff8000000000000")], [bits("7ff0000000000000")], [f64(5e-324)],
    [["complex", 1.5, -0.0]], [["none"]],
    [["np", "int8", -128]], [["np", "uint8", 255]], [["np", "int16", -2]],
    [["np", "uint16", 65535]], [["np", "int32", -2**31]], [["np", "uint32", 2**32 - 1]],
    [["np", "int64", -2**63]], [["np", "uint64", 2**64 - 1]], [["np", "longlong", -1]],
    [["np", "ulonglong", 2**64 - 1]], [["np", "bool", 1]], [["np", "bool", 0]],
    [["np", "float16", f64(0.1)]], [["np", "float32", f64(0.1)]],
    [["np", "float32", bits("fff8000000000000")]], [["np", "float64", f64(-1e-310)]],
    [["np", "complex64", [struct.pack("<d", 0.1).hex(), struct.pack("<d", -2.0).hex()]]],
    [["np", "complex128", [struct.pack("<d", 0.1).hex(), "7ff8000000000000"]]],
    [["buf", "f32"]], [["In", ["buf", "f32"], False]], [["Out", ["bslice", "f64", 3, 9], False]],
    [["In", ["tslice", "f32", [8, 8], [[2, 7, 1]]], False]],
    [["tslice", "f32", [8, 8], [[1, 8, 2]]]],
    [["In", ["tslice", "u8", [2, 4, 5], [1, [1, 4, 2]]], False]],
    [["In", ["tslice", "i16", [6, 8], [3]], False]],
    [["In", ["box", "float64", 2.5], False]], [["box", "int32", 3]],
    [["In", ["buf", "i16"], False], ["int", 3], ["np", "float32", f64(1.25)],
     ["Out", ["bslice", "f32", 0, 16], False]],
    # refused: with_length
    [["In", ["buf", "f32"], True]],
])]


# -- building the arguments ------------------------------------------------------------------
_SCALARS = ("int", "bool", "f64", "complex", "none", "np", "ld")


def scalar(spec):
    """The Python or NumPy scalar an argument spec describes (a kind in ``_SCALARS``): what
    the launch is given, and what the test computes the expected bytes of."""
    import numpy as np
    kind = spec[0]
    if kind == "int":
        return spec[1]
    if kind == "bool":
        return bool(spec[1])
    if kind == "f64":
        return struct.unpack("<d", bytes.fromhex(spec[1]))[0]
    if kind == "complex":
        return complex(spec[1], spec[2])
    if kind == "none":
        return None
    if kind == "np":
        dt = np.dtype(spec[1])
        if dt.kind == "c":
            re, im = (struct.unpack("<d", bytes.fromhex(h))[0] for h in spec[2])
            return dt.type(complex(re, im))
        return dt.type(scalar(spec[2]) if isinstance(spec[2], list) else spec[2])
    if kind == "ld":
        return sum((np.longdouble(m) * np.longdouble(2) ** e for m, e in spec[1]),
                   np.longdouble(0))
    raise ValueError(spec)


def _arrays(dev, stream):
    """The named Buffers (and ``"t:"``-named Tensors) of ``ARRAYS`` on ``dev``, values 0, 1, ..."""
    import numpy as np

    import sharedmem as sm
    arrays = {}
    for name, (dt, n) in ARRAYS.items():
        arrays[name] = sm.Buffer.from_host(np.arange(n).astype(dt), device=dev, stream=stream)
        arrays["t:" + name] = sm.Tensor.from_host(np.arange(n).astype(dt), device=dev,
                                                  stream=stream)
    return arrays


def make(spec, dev, arrays, made):
    """The launch argument ``spec`` describes (``arrays``: the named buffers; ``made``: the
    launch's stream, then what was made, kept alive until the launch is done)."""
    import sharedmem as sm
    kind = spec[0]
    if kind in _SCALARS:
        return scalar(spec)
    if kind == "buf":
        return arrays[spec[1]]
    if kind == "bslice":
        return arrays[spec[1]][spec[2]:spec[3]]
    if kind == "tslice":
        t = arrays["t:" + spec[1]].reshape(tuple(spec[2]))
        for op in spec[3]:
            t = t[slice(*op) if isinstance(op, list) else op]
        return t
    if kind == "box":
        box = sm.DeviceBox(spec[2], spec[1], device=dev)
        made.append(box)
        return box
    if kind in ("In", "Out", "InOut"):
        return getattr(sm, kind)(make(spec[1], dev, arrays, made), with_length=spec[2])
    raise ValueError(spec)


def _source(case, name):
    """The CUDA source of a case's kernel (None where a parameter's type is not known)."""
    decls = []
    for k, (ctype, _) in enumerate(case["params"]):
        if ctype is None:
            return None
        if "[" in ctype:  # (an array parameter: "double y[4]")
            decls.append(ctype)
        elif ctype.endswith("*"):
            decls.append(f"{ctype} p{k}")
        else:
            decls.append(f"{ctype} p{k}")
    return f'extern "C" __global__ void {name}({", ".join(decls)}) {{ }}'


def describe_tile_arg(x):
    """An argument that reached cuda.tile.launch, as JSON."""
    import numpy as np
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        return {"cai": {"data": [int(cai["data"][0]), bool(cai["data"][1])],
                        "shape": list(cai["shape"]),
                        "strides": None if cai["strides"] is None else list(cai["strides"]),
                        "typestr": cai["typestr"], "version": cai["version"]}}
    t = type(x)
    if t is float:
        return ["float", struct.pack("<d", x).hex()]
    if t is complex:
        return ["complex", struct.pack("<d", x.real).hex(), struct.pack("<d", x.imag).hex()]
    if t is int or t is bool:
        return [t.__name__, int(x)]
    if x is None:
        return ["none"]
    if isinstance(x, np.generic):
        return ["np." + t.__name__, x.tobytes().hex()]
    if t is tuple or t is list:
        return [t.__name__, [describe_tile_arg(e) for e in x]]
    return ["other", t.__name__, repr(x)]


def run_raw(hot):
    import pytest

    import numpy as np

    import sharedmem as sm
    from fake_cuda import RawKernel, install_fake_devices
    mp = pytest.MonkeyPatch()
    try:
        (dev,), drv = install_fake_devices(mp, hot)
        stream = dev.create_stream("pack")
        arrays = _arrays(dev, stream)
        addresses = {name: b.ptr for name, b in arrays.items()}
        results = {}
        for case in CASES:
            got = []
            name = f"k{case['id']}"
            sizes = [size for _, size in case["params"]]
            kern = RawKernel(drv, name, [f"{s}s" for s in sizes], lambda *v: got.append(v),
                             _source(case, name))
            made = [stream]
            try:
                args = [make(a, dev, arrays, made) for a in case["args"]]
                # each DeviceBox's allocation starts at its one element (asked of the box's
                # allocation, not of the view)
                boxes = [m.buffer.allocation.ptr for m in made if isinstance(m, sm.DeviceBox)]
                sm.launch(kern, 1, 1, *args, stream=stream).result()
            except sm.KernelError as e:
                results[str(case["id"])] = {"error": str(e)}
                continue
            except Exception as e:  # (a crash of the packing itself: reported as such)
                results[str(case["id"])] = {"crash": f"{type(e).__name__}: {e}"}
                continue
            assert len(got) == 1, got
            results[str(case["id"])] = {"bytes": [b.hex() for b in got[0]], "boxes": boxes}
        sm.synchronize()
        return addresses, results
    finally:
        mp.undo()


def run_tile():
    import types

    import pytest

    import numpy as np

    import sharedmem as sm
    from fake_cuda import TileKernel, fake_cutile, install_fake_devices
    mp = pytest.MonkeyPatch()
    try:
        (dev,), drv = install_fake_devices(mp, True)
        mod = fake_cutile(drv)
        if "cuda" in sys.modules:
            mp.setattr(sys.modules["cuda"], "tile", mod, raising=False)
        else:
            mp.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
            sys.modules["cuda"].tile = mod
        mp.setitem(sys.modules, "cuda.tile", mod)
        seen = []
        orig = mod.launch

        def launch(stream, grid, kernel, args):
            if grid[0]:  # (not the warm-up's empty grid)
                seen.append([describe_tile_arg(a) for a in args])
            return orig(stream, grid, kernel, args)
        mod.launch = launch
        stream = dev.create_stream("tile")
        arrays = _arrays(dev, stream)
        addresses = {name: b.ptr for name, b in arrays.items()}
        results = {}
        for case in TILE_CASES:
            del seen[:]
            made = [stream]
            try:
                args = [make(a, dev, arrays, made) for a in case["args"]]
                boxes = [m.buffer.allocation.ptr for m in made if isinstance(m, sm.DeviceBox)]
                sm.launch(TileKernel(lambda *a: None), (1,), None, *args, stream=stream).result()
            except sm.KernelError as e:
                results[str(case["id"])] = {"error": str(e)}
                continue
            except Exception as e:
                results[str(case["id"])] = {"crash": f"{type(e).__name__}: {e}"}
                continue
            assert len(seen) == 1, seen
            results[str(case["id"])] = {"args": seen[0], "boxes": boxes}
        sm.synchronize()
        return addresses, results
    finally:
        mp.undo()


def main():
    sys.path.insert(0, HERE)  # (fake_cuda)
    import warnings
    warnings.simplefilter("ignore")  # (an unbuilt core's warning: the build is reported below)
    import interop.cupy_launch as icl
    import interop.cutile as icu
    out = {"compiled": not (icl.__file__.endswith(".py") or icu.__file__.endswith(".py")),
           "files": [icl.__file__, icu.__file__]}
    for mode, hot in (("hot", True), ("bindings", False)):
        out[mode] = run_raw(hot)
    out["tile"] = run_tile()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
