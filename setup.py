"""Builds the compiled ownership core: the same ``.py`` modules, compiled with Cython.

The core is written once, in Cython's pure-Python mode (``.py`` sources, types declared in
the ``.pxd`` files beside them). Without Cython or a C compiler the install goes on and the
very same sources run interpreted -- with a warning that says so; set
``SHAREDMEM_REQUIRE_EXTENSION=1`` to make that an error instead. Everything else is in
pyproject.toml.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext as _build_ext

#: The modules compiled: the ownership core and the per-launch paths of the interop bridges.
COMPILED = [
    "sharedmem/runtime/state.py",
    "sharedmem/access.py",
    "sharedmem/allocation.py",
    "sharedmem/stream.py",
    "sharedmem/runtime/submission.py",
    "sharedmem/runtime/future.py",
    "sharedmem/runtime/graph.py",
    "sharedmem/launch.py",
    "sharedmem/buffer.py",
    "sharedmem/tensor.py",
    "sharedmem/backends/cuda.py",
    "interop/cupy_launch.py",
    "interop/cutile.py",
    "interop/cai.py",
    "interop/dlpack.py",
    "interop/streams.py",
]


def _require() -> bool:
    """``SHAREDMEM_REQUIRE_EXTENSION`` as sharedmem.config._flag reads it: 1, true, yes or on;
    unset, empty, 0, false, no or off is off (any case); anything else stops the build (the
    import would refuse it later)."""
    value = os.environ.get("SHAREDMEM_REQUIRE_EXTENSION", "")
    v = value.strip().lower()
    if v not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        raise SystemExit(f"SHAREDMEM_REQUIRE_EXTENSION={value!r} is not a switch value: set it "
                         f"to 1 (true, yes, on) or 0 (false, no, off), or unset it")
    return v in ("1", "true", "yes", "on")


REQUIRE = _require()

#: Cython and the C compiler run one job a core: a first install compiles 16 large C files.
JOBS = os.cpu_count() or 1

#: No debug info in the compiled modules (gcc/clang) unless CFLAGS asks for it: it made them
#: 60 MB instead of 11 and the compile a quarter slower, and nothing here reads it.
NO_DEBUG_INFO = sys.platform != "win32" and not any(
    f.startswith("-g") for f in os.environ.get("CFLAGS", "").split())


def _warn(why):
    msg = (f"sharedmem: the compiled core was NOT built ({why}); the same code runs "
           f"interpreted, slower. Install Cython and a C compiler and reinstall, or set "
           f"SHAREDMEM_REQUIRE_EXTENSION=1 to make this an error.")
    if REQUIRE:
        raise SystemExit(msg)
    print("\n" + "*" * 78 + "\n" + msg + "\n" + "*" * 78 + "\n", file=sys.stderr)


def extensions():
    try:
        from Cython.Build import cythonize
    except ImportError:
        _warn("Cython is not installed")
        return []
    try:
        return cythonize(COMPILED, language_level=3, quiet=True, nthreads=JOBS,
                         compiler_directives={"binding": True, "embedsignature": True,
                                              # types come from the .pxd files only
                                              "annotation_typing": False})
    except Exception as e:  # a Cython error in a source: never half a core
        _warn(f"Cython failed: {e}")
        return []


class build_ext(_build_ext):
    """The extensions compiled in parallel, one job a core, unless ``-j`` says otherwise."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = JOBS


exts = extensions()
for e in exts:
    e.optional = not REQUIRE  # a failed C compile: interpreted (importing sharedmem warns)
    if NO_DEBUG_INFO:
        e.extra_compile_args.append("-g0")

setup(ext_modules=exts, cmdclass={"build_ext": build_ext})
