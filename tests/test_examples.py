"""Every example runs (on the host backend in CI; tests marked gpu run them on a GPU)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_on_the_host_backend(name):
    if name == "dask_pipeline.py":
        pytest.importorskip("distributed")  # the dask extra (make dask-demo installs it)
    env = dict(os.environ, SHAREDMEM_BACKEND="host",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MISMATCH" not in r.stdout and "NOT CLEAN" not in r.stdout
