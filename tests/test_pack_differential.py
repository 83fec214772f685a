"""Kernel-argument packing, compiled build against interpreted build, value by value.

CuPy kernels: ``RawKernelPlan.pack``/``enqueue`` write each argument into the parameter
buffer -- compiled, ``_emit``/``_emit_address`` into a C buffer (``_launch_compiled``, or
copied into the plan's slots past 4096 bytes or with no ``backend.hot``); interpreted, a list
packed by ``struct.pack_into(plan.fmt, ...)``. A difference there is a silent wrong argument
on the GPU. cuTile kernels: ``TilePlan.pack`` hands ``cuda.tile.launch`` Python scalars and
CUDA Array Interface descriptors (cuTile packs the bytes itself).

tests/pack_capture.py runs a table of cases (every scalar C type the CuPy adapter converts,
parameters of types it does not, pointers of Buffers, Tensors, sliced views and DeviceBoxes,
``with_length`` pairs, NumPy scalars of each dtype, Python scalars, boundary values, NaNs,
infinities, signed zeros and subnormals, long doubles) over the fake driver of
tests/fake_cuda.py, capturing the bytes each parameter pointer of the ``cuLaunchKernel`` call
points at -- through ``backend.hot`` and through the driver module, in one subprocess per
build. This test computes the expected bytes from the same case table with struct, NumPy and
exact rational arithmetic (no sharedmem code), and checks both builds against them and
against each other -- refusals too (the same KernelError, word for word).
"""

import json
import math
import os
import struct
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

import pack_capture as pc

HERE = os.path.dirname(os.path.abspath(__file__))

# -- expected values, computed without sharedmem -------------------------------------------
#: The integer C types the adapter converts: signedness ("s", "u"; "c" plain char: -128..255
#: as its byte; "b" bool: 0 or 1).
INT_TYPES = {"bool": "b", "char": "c", "signed char": "s", "int8_t": "s",
             "unsigned char": "u", "uint8_t": "u", "short": "s", "unsigned short": "u",
             "int": "s", "int32_t": "s", "unsigned": "u", "unsigned int": "u", "uint32_t": "u",
             "long": "s", "long long": "s", "int64_t": "s", "unsigned long": "u",
             "unsigned long long": "u", "uint64_t": "u", "size_t": "u", "ssize_t": "s",
             "ptrdiff_t": "s", "intptr_t": "s", "uintptr_t": "u"}
#: Floating-point types: bytes -> (significand bits, least normal exponent, struct format).
FLOATS = {2: (11, -14, "<e"), 4: (24, -126, "<f"), 8: (53, -1022, "<d")}
FLOAT_TYPES = {"half": 2, "__half": 2, "float": 4, "double": 8}
ARRAY_KINDS = ("buf", "bslice", "tslice", "box", "In", "Out", "InOut")


class Refused(Exception):
    """The launch must raise a KernelError for this argument."""


def nearest(value, size):
    """Exact rational ``value`` rounded to the nearest ``size``-byte IEEE float (ties to
    even), as a Fraction; Refused where that is past the largest finite one."""
    p, emin, _ = FLOATS[size]
    a = abs(value)
    if a == 0:
        return a
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    ulp = Fraction(2) ** (max(e, emin) - p + 1)
    q, r = divmod(a, ulp)
    if r > ulp / 2 or (r == ulp / 2 and q % 2):
        q += 1
    out = q * ulp
    emax = -emin + 1
    if out > (2 - Fraction(2) ** (1 - p)) * Fraction(2) ** emax:
        raise Refused(f"{value} past the largest {size}-byte float")
    return out


def float_bytes(x, size):
    """The bytes of a floating-point parameter of ``size`` bytes given Python/NumPy scalar
    ``x``: its value rounded once (C's conversion), NaN and the infinities as they are."""
    if isinstance(x, (bool, np.bool_, complex, np.complexfloating)) or x is None or \
            not isinstance(x, (int, float, np.integer, np.floating)):
        raise Refused(f"{type(x).__name__} for a float parameter")
    if isinstance(x, (float, np.floating)) and not np.isfinite(x):
        if np.isnan(x):  # (a NaN of the same sign: checked by nan_bytes, bits aside)
            return ("nan", bool(np.signbit(x)))
        return struct.pack(FLOATS[size][2], float(x))
    if isinstance(x, (int, np.integer)):
        exact, negative = Fraction(int(x)), int(x) < 0
    else:
        exact, negative = Fraction(*x.as_integer_ratio()), bool(np.signbit(x))
    r = nearest(exact, size)
    return struct.pack(FLOATS[size][2], math.copysign(float(r), -1.0 if negative else 1.0))


def int_bytes(x, ctype, size):
    if isinstance(x, (bool, np.bool_)):
        v = int(x)
    elif isinstance(x, (int, np.integer)):
        v = int(x)
    else:
        raise Refused(f"{type(x).__name__} for an int parameter")
    kind = INT_TYPES[ctype]
    bits = 8 * size
    lo, hi = {"b": (0, 1), "c": (-128, 255), "s": (-(1 << (bits - 1)), (1 << (bits - 1)) - 1),
              "u": (0, (1 << bits) - 1)}[kind]
    if not lo <= v <= hi:
        raise Refused(f"{v} out of range for {ctype}")
    return (v % (1 << bits)).to_bytes(size, "little")


def array_facts(spec):
    """``(base key, byte offset of element 0 from it, elements, contiguous, shape, byte
    strides, dtype, read-only, with_length)`` of an array argument spec; base keys name the
    buffers and tensors of pack_capture.ARRAYS; "box" a DeviceBox (the case's next one)."""
    kind = spec[0]
    if kind in ("In", "Out", "InOut"):
        if spec[1][0] not in ARRAY_KINDS:
            raise Refused("an intent of no array")
        f = array_facts(spec[1])
        return f[:7] + (kind == "In", spec[2])
    if kind == "box":
        dt = np.dtype(spec[1])
        return ("box", 0, 1, True, (1,), None, dt, False, False)
    dtype, n = pc.ARRAYS[spec[1]]
    dt = np.dtype(dtype)
    if kind == "buf":
        return (spec[1], 0, n, True, (n,), None, dt, False, False)
    if kind == "bslice":
        start, stop, _ = slice(spec[2], spec[3]).indices(n)
        m = max(stop - start, 0)
        return (spec[1], start * dt.itemsize, m, True, (m,), None, dt, False, False)
    if kind == "tslice":  # (NumPy's view of a host array of the same layout)
        host = np.zeros(n, dt)
        v = host.reshape(spec[2])
        for op in spec[3]:
            v = v[slice(*op) if isinstance(op, list) else op]
        off = v.__array_interface__["data"][0] - host.__array_interface__["data"][0]
        return ("t:" + spec[1], off, v.size, bool(v.flags.c_contiguous), v.shape, v.strides,
                dt, False, False)
    raise ValueError(spec)


def expected_raw(case):
    """Per parameter, ``["bytes", hex]``, ``["nan", sign]`` or ``["ptr", base key, offset]``;
    or None where the launch must be refused."""
    params = case["params"]
    out = []
    k = 0
    try:
        for spec in case["args"]:
            if k >= len(params):
                raise Refused("more arguments than parameters")
            ctype, size = params[k]
            k += 1
            if spec[0] in ARRAY_KINDS:
                base, off, n, dense, *_, wl = array_facts(spec)
                if ctype is None and size == 8 or ctype is not None and (
                        ctype.endswith("*") or "[" in ctype):
                    out.append(["ptr", base, off])
                else:
                    raise Refused("an array for a parameter that is no pointer")
                if wl:
                    if not dense:
                        raise Refused("with_length of a strided array")
                    if k >= len(params):
                        raise Refused("no length parameter")
                    lctype, lsize = params[k]
                    k += 1
                    if lctype in INT_TYPES:
                        out.append(["bytes", int_bytes(n, lctype, lsize).hex()])
                    elif lctype in FLOAT_TYPES or lsize not in (4, 8) or lctype is not None \
                            and ("2" in lctype or "omplex" in lctype):
                        raise Refused("a length into a parameter that is no int")
                    elif n >= 1 << (8 * lsize):
                        raise Refused("length too large")
                    else:
                        out.append(["bytes", n.to_bytes(lsize, "little").hex()])
                continue
            x = pc.scalar(spec)
            if ctype in INT_TYPES:
                b = int_bytes(x, ctype, size)
            elif ctype in FLOAT_TYPES:
                b = float_bytes(x, size)
            elif ctype is not None and (ctype.endswith("*") or "[" in ctype):
                if x is None:
                    b = bytes(8)
                elif isinstance(x, np.integer) and x.dtype.itemsize == 8:
                    b = (int(x) % (1 << 64)).to_bytes(8, "little")
                else:
                    raise Refused("a scalar for a pointer")
            elif isinstance(x, np.generic) and x.dtype.itemsize == size:
                b = x.tobytes()
            elif x is None and size == 8:
                b = bytes(8)
            else:
                raise Refused("not a NumPy scalar of the parameter's size")
            out.append(list(b) if isinstance(b, tuple) else ["bytes", b.hex()])
        if k != len(params):
            raise Refused("fewer arguments than parameters")
    except Refused:
        return None
    return out


def normalized_raw(case, result, addresses):
    """A build's result for a CuPy case in the form expected_raw gives (addresses as offsets
    from the array named; NaNs of a half, whose payload bits are not C's business, by sign),
    or ``{"error": message}``."""
    if "bytes" not in result:
        return result
    got = [bytes.fromhex(h) for h in result["bytes"]]
    want = expected_raw(case) or []
    out = []
    boxes = iter(result["boxes"])
    for k, b in enumerate(got):
        w = want[k] if k < len(want) else None
        if w is not None and w[0] == "ptr":
            base = addresses[w[1]] if w[1] != "box" else next(boxes)
            out.append(["ptr", w[1], int.from_bytes(b, "little") - base])
        elif w is not None and w[0] == "nan" and len(b) in FLOATS:
            x = struct.unpack(FLOATS[len(b)][2], b)[0]
            out.append(["nan", bool(np.signbit(x))] if math.isnan(x) else ["bytes", b.hex()])
        else:
            out.append(["bytes", b.hex()])
    return out


def expected_nan_bits(case):
    """For a float or double parameter given a NaN, the bits C's conversion gives (a quiet
    NaN, its sign and top payload bits kept): NumPy's cast."""
    out = {}
    for k, (spec, (ctype, size)) in enumerate(zip(case["args"], case["params"])):
        if ctype in ("float", "double") and spec[0] in ("f64", "np"):
            try:
                x = pc.scalar(spec)
            except Exception:
                continue
            if isinstance(x, (float, np.floating)) and np.isnan(x):
                out[k] = np.asarray(x).astype(np.float32 if size == 4 else np.float64).tobytes()
    return out


def expected_tile(case):
    """What cuda.tile.launch must get for a cuTile case (as pack_capture.describe_tile_arg
    writes it; array descriptors with their address as an offset), or None (refused)."""
    out = []
    for spec in case["args"]:
        if spec[0] in ARRAY_KINDS:
            try:
                base, off, n, dense, shape, strides, dt, ro, wl = array_facts(spec)
            except Refused:
                return None
            if wl:
                return None
            c = [s * dt.itemsize for s in _c_strides(shape)]
            out.append({"cai": {"data": [base, off, ro], "shape": list(shape),
                                "strides": c if strides is None else list(strides),
                                "typestr": dt.str, "version": 3}})
            continue
        x = pc.scalar(spec)
        if isinstance(x, (bool, np.bool_)):
            out.append(["bool", int(x)])
        elif isinstance(x, (int, np.integer)):
            out.append(["int", int(x)])
        elif isinstance(x, (float, np.floating)):
            out.append(["float", struct.pack("<d", float(x)).hex()])
        elif isinstance(x, (complex, np.complexfloating)):
            z = complex(x)
            out.append(["complex", struct.pack("<d", z.real).hex(),
                        struct.pack("<d", z.imag).hex()])
        elif x is None:
            out.append(["none"])
        else:
            raise ValueError(spec)
    return out


def _c_strides(shape):
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


def normalized_tile(case, result, addresses):
    if "args" not in result:
        return result
    want = expected_tile(case) or []
    boxes = iter(result["boxes"])
    out = []
    for k, a in enumerate(result["args"]):
        if isinstance(a, dict):
            cai = dict(a["cai"])
            w = want[k]["cai"] if k < len(want) and isinstance(want[k], dict) else None
            ptr, ro = cai["data"]
            key = w["data"][0] if w is not None else "?"
            base = next(boxes) if key == "box" else addresses.get(key, 0)
            cai["data"] = [key, ptr - base, ro]
            if cai["strides"] is None:  # (C-contiguous)
                item = np.dtype(cai["typestr"]).itemsize
                cai["strides"] = [s * item for s in _c_strides(cai["shape"])]
            out.append({"cai": cai})
        else:
            out.append(a)
    return out


# -- the runs ----------------------------------------------------------------------------------
def _capture(pure):
    """pack_capture's JSON, run with the interpreted (``pure``) or the compiled build of the
    sharedmem this process imports."""
    import sharedmem
    root = os.path.dirname(os.path.dirname(os.path.abspath(sharedmem.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, HERE,
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("SHAREDMEM_PURE_PYTHON", None)
    env.pop("SHAREDMEM_REQUIRE_EXTENSION", None)
    if pure:
        env["SHAREDMEM_PURE_PYTHON"] = "1"
    r = subprocess.run([sys.executable, os.path.join(HERE, "pack_capture.py")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def captures():
    return {"interpreted": _capture(True), "compiled": _capture(False)}


def _check_build(run, errors, label):
    """Compare one build's results with the expected ones; append differences to
    ``errors``."""
    for mode in ("hot", "bindings"):
        addresses, results = run[mode]
        for case in pc.CASES:
            res = results[str(case["id"])]
            want = expected_raw(case)
            got = normalized_raw(case, res, addresses)
            if want is None:
                if "error" not in res:
                    errors.append(f"{label}/{mode} case {case['id']} {case['args'][:3]} "
                                  f"{case['params'][:3]}: expected a KernelError, got {got}")
                continue
            if got != want:
                errors.append(f"{label}/{mode} case {case['id']} {case['args'][:3]} "
                              f"{case['params'][:3]}: got {got if 'error' in res else got[:4]}"
                              f", expected {want[:4]}")
                continue
            for k, bits in expected_nan_bits(case).items():
                if bytes.fromhex(res["bytes"][k]) != bits:
                    errors.append(f"{label}/{mode} case {case['id']}: NaN bits "
                                  f"{res['bytes'][k]}, C's conversion gives {bits.hex()}")
    addresses, results = run["tile"]
    for case in pc.TILE_CASES:
        res = results[str(case["id"])]
        want = expected_tile(case)
        got = normalized_tile(case, res, addresses)
        if want is None:
            if "error" not in res:
                errors.append(f"{label}/tile case {case['id']}: expected a KernelError, got {got}")
        elif got != want:
            errors.append(f"{label}/tile case {case['id']} {case['args']}: got {got}, "
                          f"expected {want}")


def test_the_case_table_is_broad():
    """(The table itself: every converted C type, refusals among them.)"""
    ctypes = {c for case in pc.CASES for c, _ in case["params"]}
    assert set(INT_TYPES) | set(FLOAT_TYPES) <= ctypes
    refused = sum(expected_raw(c) is None for c in pc.CASES)
    assert 50 < refused < len(pc.CASES) - 300


def test_interpreted_build_packs_the_expected_bytes(captures):
    run = captures["interpreted"]
    assert not run["compiled"], run["files"]
    errors = []
    _check_build(run, errors, "interpreted")
    assert not errors, "\n".join(errors[:40]) + f"\n({len(errors)} differences)"


def test_compiled_build_packs_the_expected_bytes(captures):
    run = captures["compiled"]
    if not run["compiled"]:
        pytest.skip(f"the compiled extension is not built, or not usable here (stale: "
                    f"older than its sources); interop.cupy_launch and interop.cutile load "
                    f"from {run['files']}; build it with `python setup.py build_ext --inplace`")
    errors = []
    _check_build(run, errors, "compiled")
    assert not errors, "\n".join(errors[:40]) + f"\n({len(errors)} differences)"


def test_both_builds_pack_the_same(captures):
    """Value by value, refusals word for word: the compiled and the interpreted build, each
    launch path (through ``backend.hot`` -- compiled, ``_launch_compiled`` -- and through the
    driver module), and what reaches cuTile."""
    comp, interp = captures["compiled"], captures["interpreted"]
    if not comp["compiled"]:
        pytest.skip(f"the compiled extension is not built, or not usable here (stale: "
                    f"older than its sources); interop.cupy_launch and interop.cutile load "
                    f"from {comp['files']}; only the interpreted build is checked (against "
                    f"the expected bytes)")
    errors = []
    for mode in ("hot", "bindings", "tile"):
        norm = normalized_tile if mode == "tile" else normalized_raw
        cases = pc.TILE_CASES if mode == "tile" else pc.CASES
        (a_addr, a_res), (b_addr, b_res) = comp[mode], interp[mode]
        for case in cases:
            a = a_res[str(case["id"])]
            b = b_res[str(case["id"])]
            if "bytes" in a and "bytes" in b:  # (exact bytes, NaN payloads included)
                a = {"bytes": [h for h, w in zip(a["bytes"], expected_raw(case) or [[0]] * 999)
                               if w[0] != "ptr"], "ptrs": norm(case, a, a_addr)}
                b = {"bytes": [h for h, w in zip(b["bytes"], expected_raw(case) or [[0]] * 999)
                               if w[0] != "ptr"], "ptrs": norm(case, b, b_addr)}
            else:
                a, b = norm(case, a, a_addr), norm(case, b, b_addr)
            if a != b:
                errors.append(f"{mode} case {case['id']} {case['args'][:3]}: compiled {a}, "
                              f"interpreted {b}")
    assert not errors, "\n".join(errors[:40]) + f"\n({len(errors)} differences)"
