# Two commands do everything on a fresh machine with only Python:
#   make demo   -- sets itself up, runs examples/pipeline.py (GPU if present, else host backend)
#   make test   -- sets itself up, runs the test suite
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo stress bench gpu-test gpu-demo gpu-bench clean

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q

demo: $(STAMP)
	$(VPY) examples/pipeline.py
	$(VPY) examples/mixed_pipeline.py

stress: $(STAMP)
	SHAREDMEM_STRESS_FULL=1 $(VPY) -m pytest -q tests/test_stress.py -p no:randomly -s

bench: $(STAMP)
	$(VPY) benchmarks/run.py

# On the GPU machine: no install step (no network there); the image's python3 has
# cupy, cuda-bindings, torch and jax. Runs the whole suite in place, GPU tests included.
gpu-test:
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) -m pytest -q -rs

gpu-demo:
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) examples/pipeline.py
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) examples/mixed_pipeline.py

gpu-bench:
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
