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


def test_the_mixed_pipeline_records_a_timeline_with_trace(tmp_path):
    # docs/observability.md: `--trace run.json` records its stages; `--trace` without the file
    # raised IndexError
    env = dict(os.environ, SHAREDMEM_BACKEND="host",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    script = os.path.join(ROOT, "examples", "mixed_pipeline.py")
    out = tmp_path / "run.json"
    r = subprocess.run([sys.executable, script, "--trace", str(out)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    names = {e["name"] for e in json.loads(out.read_text())["traceEvents"]}
    assert {"host kernel host_stages.<locals>.matmul",
            "host kernel host_stages.<locals>.bias_relu"} <= names, names
    r = subprocess.run([sys.executable, script, "--trace"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 1 and r.stderr.startswith("usage: mixed_pipeline.py [--trace "
                                                     "FILE.json]"), r.stderr
