"""Which build of the core runs, and the switches that choose it.

The ownership core is one source, compiled by Cython when the package was built with it
(``setup.py``), else run as the ``.py`` modules themselves. Switches (environment):

* ``SHAREDMEM_PURE_PYTHON=1``: run the ``.py`` sources even where compiled modules exist
  (the test suite runs both ways; benchmarks compare them);
* ``SHAREDMEM_REQUIRE_EXTENSION=1``: importing sharedmem fails when the core is not compiled
  (and the build fails when it cannot compile it).

:func:`show_config` says which build is active, with the versions of the GPU libraries.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

__all__ = ["COMPILED_MODULES", "compiled", "show_config", "pure_python_requested"]

#: The modules setup.py compiles (the same list, as module names).
COMPILED_MODULES = (
    "sharedmem.runtime.state", "sharedmem.access", "sharedmem.allocation", "sharedmem.stream",
    "sharedmem.runtime.submission", "sharedmem.runtime.future", "sharedmem.runtime.graph",
    "sharedmem.launch", "sharedmem.buffer", "sharedmem.tensor", "sharedmem.backends.cuda",
    "interop.cupy_launch", "interop.cutile", "interop.cai",
    "interop.dlpack", "interop.streams",
)


def _flag(name: str) -> bool:
    """Whether switch ``name`` is on: 1, true, yes or on; unset, empty, 0, false, no or off
    is off (any case); anything else is a ValueError naming it."""
    value = os.environ.get(name, "")
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r} is not a switch value: set it to 1 (true, yes, on) or "
                     f"0 (false, no, off), or unset it")


def pure_python_requested() -> bool:
    """True when ``SHAREDMEM_PURE_PYTHON`` asks for the interpreted sources."""
    return _flag("SHAREDMEM_PURE_PYTHON")


class _SourcesFirst:
    """A meta-path finder that loads the compiled modules from their ``.py`` sources."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in COMPILED_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.origin is None or spec.origin.endswith(".py"):
            return spec
        source = os.path.join(os.path.dirname(spec.origin), name.rsplit(".", 1)[1] + ".py")
        if not os.path.exists(source):
            return spec
        return importlib.util.spec_from_file_location(name, source)


def install_source_finder() -> None:
    """Make the compiled modules load from their sources (``SHAREDMEM_PURE_PYTHON``)."""
    if not any(isinstance(f, type) and f is _SourcesFirst for f in sys.meta_path):
        sys.meta_path.insert(0, _SourcesFirst)


#: The directory holding the sharedmem and interop packages (installed together)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _origin(name: str) -> str:
    """Where module ``name`` runs from: its file if imported, else where it would load from
    -- without importing it, nor its package: the CUDA backend and the adapters import
    lazily, and ``import sharedmem`` imports no ``interop`` (a user's own module of that name
    included)."""
    mod = sys.modules.get(name)
    if mod is not None:
        return getattr(mod, "__file__", None) or ""
    parent = name.rsplit(".", 1)[0]
    pkg = sys.modules.get(parent)
    path = list(pkg.__path__) if pkg is not None else [os.path.join(_ROOT, *parent.split("."))]
    finder = _SourcesFirst if _SourcesFirst in sys.meta_path else importlib.machinery.PathFinder
    spec = finder.find_spec(name, path)
    return (spec.origin or "") if spec is not None else ""


def _interpreted() -> list[str]:
    """The core modules that run (or would run) from their sources (no origin: counted so)."""
    return [m for m in COMPILED_MODULES if (_origin(m) or ".py").endswith(".py")]


def compiled() -> bool:
    """True when every core module runs (or, not yet imported, would run) compiled."""
    return not _interpreted()


#: Why the compiled core, there, does not run (see unusable_build), or None
_unusable = None


def unusable_build() -> str | None:
    """Before any core module is imported: why the compiled core that is there cannot run as
    one -- partly built (a module that failed to compile runs from source, and the compiled
    ones built against it do not load beside it: "size changed"), or, in a source checkout,
    older than its sources (an edit not rebuilt would run the old code compiled and the new
    one interpreted) -- else None. The caller then runs it all interpreted, and
    :func:`check_required` says why."""
    global _unusable
    found = [(m, _origin(m)) for m in COMPILED_MODULES]
    from_source = [m for m, origin in found if (origin or ".py").endswith(".py")]
    if from_source and len(from_source) < len(found):
        _unusable = f"it is partly built: {', '.join(from_source)} not compiled"
    elif not from_source and os.path.exists(os.path.join(_ROOT, "setup.py")):
        stale = [m for m, origin in found if _older_than_sources(m, origin)]
        if stale:
            _unusable = (f"it is older than its sources ({', '.join(stale)} changed since it "
                         f"was built): rebuild it (make build)")
    return _unusable


def _older_than_sources(name, origin) -> bool:
    base = os.path.join(os.path.dirname(origin), name.rsplit(".", 1)[1])
    try:
        built = os.stat(origin).st_mtime
        return any(os.stat(base + ext).st_mtime > built for ext in (".py", ".pxd")
                   if os.path.exists(base + ext))
    except OSError:
        return False


def check_required() -> None:
    """ImportError when ``SHAREDMEM_REQUIRE_EXTENSION=1`` and the core is not compiled; a
    warning when it is not compiled and nobody asked for that (an install without a C compiler
    or Cython: pip hides what setup.py prints)."""
    # (read first: a value that is no switch value is refused whether the core is compiled or
    # not -- not only on the machines where it is not)
    required = _flag("SHAREDMEM_REQUIRE_EXTENSION")
    interpreted = _interpreted()
    if not interpreted:
        return
    if required:
        why = f"; {_unusable}" if _unusable and not pure_python_requested() else ""
        raise ImportError(
            f"SHAREDMEM_REQUIRE_EXTENSION=1, but the compiled core is not in use "
            f"({', '.join(interpreted)} run from source"
            f"{'; SHAREDMEM_PURE_PYTHON is set' if pure_python_requested() else why}). "
            f"Build it: with a C compiler on the machine, pip install --no-cache-dir "
            f"--force-reinstall --no-deps sharedmem-gpu (pip's cache holds the uncompiled "
            f"build; `make speedups` in a checkout).")
    if not pure_python_requested():
        import warnings

        from .errors import SharedMemWarning
        what = (f"the compiled core cannot run here ({_unusable})" if _unusable else
                "the compiled core is not built here")
        warnings.warn(f"sharedmem: {what}, so it runs interpreted "
                      "(about 3x slower per launch). With a C compiler on the machine, pip "
                      "install --no-cache-dir --force-reinstall --no-deps sharedmem-gpu "
                      "(`make speedups` in a checkout), or set SHAREDMEM_PURE_PYTHON=1 to "
                      "choose the interpreted core and silence this", SharedMemWarning,
                      stacklevel=3)


def _default_device_text() -> str:
    """The default device, and why it is not a GPU where CUDA was tried and was unusable.
    Asking does not fix the choice when nothing made it yet."""
    from . import device as _device
    chosen = _device._default
    try:
        dev = _device.default_device()
        why = _device.host_fallback_reason()
    except Exception as e:  # (SHAREDMEM_BACKEND=cuda without CUDA: said, not raised)
        return f"none ({e})"
    finally:
        if chosen is None:
            _device._default = None
    return f"{dev!r}" + (f" (CUDA unusable: {why})" if why else "")


def _version(*dists: str):
    """The version of the first of the distributions ``dists`` installed, or None."""
    from importlib.metadata import PackageNotFoundError, version
    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def show_config(file=None) -> dict:
    """Print (to ``file``, default stdout) and return which build of the core runs -- compiled
    or interpreted, and why -- with the Python, NumPy, Cython, CuPy, cuda-bindings and
    cuda.tile versions (None where not installed), and the default device (with why CUDA was
    unusable, where it fell back to the host)."""
    import platform

    from . import __version__
    info = {
        "sharedmem": __version__,
        "core": "compiled (Cython)" if compiled() else (
            "interpreted (SHAREDMEM_PURE_PYTHON=1)" if pure_python_requested()
            else f"interpreted ({_unusable or 'the compiled modules were not built'})"),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "cython": _version("Cython"),
        "cupy": _version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "cuda-bindings": _version("cuda-bindings", "cuda-python"),
        "cuda-tile": _version("cuda-tile"),
        "default device": _default_device_text(),
    }
    width = max(map(len, info))
    for k, v in info.items():  # (print's file=None is sys.stdout)
        print(f"{k:<{width}}  {v if v is not None else '(not installed)'}", file=file)
    return info
