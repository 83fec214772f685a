"""Backends: ``host`` (no GPU needed) and ``cuda`` (cuda.bindings + CuPy's pool)."""
