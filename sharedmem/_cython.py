"""Stand-in for the ``cython`` module when Cython is not installed.

The ownership core is written once, in Cython's pure-Python mode: ordinary ``.py``
modules whose types are declared in ``.pxd`` files beside them. Compiled (``setup.py``
with Cython), those declarations make its classes C structs; interpreted, this module
answers the few ``cython.*`` names the sources use, and the same code runs as Python.
Each module imports it as::

    try:
        import cython
    except ImportError:
        from sharedmem import _cython as cython
"""

compiled = False


def cast(type_, value, typecheck=False):
    """``cython.cast``: interpreted, the value itself."""
    return value


def cclass(cls):
    """``cython.cclass``: interpreted, the class as it is (its .pxd makes it one compiled)."""
    return cls


def _directive(arg):
    """A decorator with an argument -- ``cython.freelist(n)``, ``cython.boundscheck(flag)``,
    ``cython.wraparound(flag)``: interpreted, the class or function as it is (indexing is
    checked)."""
    return cclass


freelist = boundscheck = wraparound = _directive


def declare(type_=None, value=None, **kwargs):
    """``cython.declare``: interpreted, the value (module constants stay Python ints)."""
    return value


# The C type names the sources name in cython.declare(...) at module level, which runs
# interpreted too: placeholders (size_t: interop.streams' _cupy_fn -- without it no interop
# module imported where Cython is not installed).
int = longlong = ulonglong = Py_ssize_t = bint = double = size_t = None  # noqa: A001
