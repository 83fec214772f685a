"""Every complete Python example in README.md and docs/ runs as written.

A block fenced as ```python whose first statement is an import is a complete program: it runs
in its own interpreter, on the host backend when it needs no GPU library, else (marked gpu) on
a GPU with the libraries it imports. Blocks that start otherwise are fragments of the text
around them (``t = sm.from_dlpack(torch_tensor)``) and are not run."""

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from conftest import cuda_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Modules an example may import that are not always installed, by the import name's root.
_OPTIONAL = {"cupy": "cupy", "cuda": "cuda.tile", "torch": "torch", "jax": "jax",
             "distributed": "distributed"}


def _programs():
    out = []
    for path in ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        name = os.path.relpath(os.path.join(ROOT, path), ROOT)
        with open(os.path.join(ROOT, name)) as f:
            text = f.read()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            code = m.group(1)
            first = next((ln for ln in code.splitlines() if ln.strip()
                          and not ln.lstrip().startswith("#")), "")
            if not first.startswith(("import ", "from ")):
                continue  # a fragment of the text around it
            roots = set(re.findall(r"^\s*from\s+(\w+)", code, re.M))
            for names in re.findall(r"^\s*import\s+(.+)$", code, re.M):
                roots |= {n.split()[0].split(".")[0] for n in names.split(",")}
            needs = sorted(_OPTIONAL[r] for r in roots if r in _OPTIONAL)
            line = text.count("\n", 0, m.start()) + 1
            marks = [pytest.mark.gpu] if needs else []
            out.append(pytest.param(code, needs, id=f"{name}:{line}", marks=marks))
    return out


PROGRAMS = _programs()


def test_the_docs_have_programs_for_both_backends():
    # (a change in the fences or the rule above must not turn this file into no test at all)
    ids = [p.id for p in PROGRAMS]
    assert any(not p.values[1] for p in PROGRAMS), ids
    assert any(p.values[1] for p in PROGRAMS), ids


@pytest.mark.parametrize("code,needs", PROGRAMS)
def test_doc_program_runs(code, needs, tmp_path):
    for mod in needs:
        if importlib.util.find_spec(mod.split(".")[0]) is None or (
                "." in mod and importlib.util.find_spec(mod) is None):
            pytest.skip(f"needs {mod}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if needs:
        if cuda_device() is None:
            pytest.skip("no usable CUDA GPU")
    else:
        env["SHAREDMEM_BACKEND"] = "host"
    program = tmp_path / "program.py"  # (a file: cuTile compiles a kernel from its source)
    program.write_text(code)
    r = subprocess.run([sys.executable, str(program)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
