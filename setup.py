"""Builds the optional compiled launch path (sharedmem/_speedups.c).

Everything else is in pyproject.toml. ``optional=True``: without a C compiler
the install goes on and sharedmem runs its Python path (sharedmem/_accel.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("sharedmem._speedups", ["sharedmem/_speedups.c"], optional=True)])
