# Two commands do everything on a fresh machine with only Python:
#   make demo   -- sets itself up, runs examples/pipeline.py (GPU if present, else host backend)
#   make test   -- sets itself up, runs the test suite
SHELL  := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test demo stress bench speedups gpu-test gpu-demo gpu-bench gpu-all gpu-sanitize clean

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

# The compiled launch path, built in place (optional: without a C compiler sharedmem runs
# its Python path). setup.py when setuptools is there, else the compiler directly.
speedups:
	@$(PYTHON) setup.py -q build_ext --inplace >/dev/null 2>&1 || \
	cc -O2 -shared -fPIC $$($(PYTHON) -c "import sysconfig as s; print('-I' + s.get_paths()['include'])") \
	  sharedmem/_speedups.c -o sharedmem/_speedups$$($(PYTHON) -c "import sysconfig as s; print(s.get_config_var('EXT_SUFFIX'))") \
	  || echo "speedups: not built (no C compiler); the Python path runs"

# On the GPU machine: no install step (no network there); the image's python3 has
# cupy, cuda-bindings, torch and jax. Runs the whole suite in place, GPU tests included.
gpu-test: speedups
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) -m pytest -q -rs

gpu-demo: speedups
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) examples/pipeline.py
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) examples/mixed_pipeline.py

gpu-bench: speedups
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) benchmarks/run.py

# Everything a GPU session checks, in one device call (logs under $$OUT when set), summary last.
gpu-all: speedups
	@out=$${OUT:-/tmp}; \
	if [ -f .gpu-bundle/activate.sh ]; then . .gpu-bundle/activate.sh; fi; \
	export PYTHONPATH=.:$$PYTHONPATH PYTHONUNBUFFERED=1; \
	$(PYTHON) -m pytest -q -rs -p no:cacheprovider tests/ > $$out/gpu_tests.log 2>&1; t=$$?; \
	$(PYTHON) examples/pipeline.py > $$out/gpu_demo.log 2>&1 && \
	$(PYTHON) examples/mixed_pipeline.py >> $$out/gpu_demo.log 2>&1; d=$$?; \
	$(PYTHON) benchmarks/use_after_free.py 50 > $$out/gpu_uaf.log 2>&1; u=$$?; \
	$(PYTHON) benchmarks/run.py > $$out/gpu_bench.log 2>&1; b=$$?; \
	echo "== summary"; $(PYTHON) -c "import sharedmem._accel as a; print('compiled launch path:', a.speedups is not None)"; \
	tail -1 $$out/gpu_tests.log; grep -E "OK|MISMATCH|FAIL|clean" $$out/gpu_demo.log; \
	tail -1 $$out/gpu_uaf.log; sed -n '/^row /,$$p' $$out/gpu_bench.log; \
	echo "exit codes: tests=$$t demos=$$d uaf=$$u bench=$$b"; test $$t -eq 0 -a $$d -eq 0 -a $$u -eq 0

# The GPU tests under compute-sanitizer's memcheck (on the GPU machine; kernels that fault on
# purpose are left out). API errors are not reported: cuda.bindings and CuPy probe the driver
# (cuGetProcAddress) at import, which the tool would list. Host backtraces are off: to record
# them the tool takes a reference to the Python frame of every CUDA call and never drops it,
# so the locals of those frames (the views passed to a launch) never die -- which made tests
# that count live views or pool bytes fail under it. Summary last; log under $$OUT.
SANITIZER ?= /usr/local/cuda/bin/compute-sanitizer
gpu-sanitize: speedups
	@out=$${OUT:-/tmp}; \
	if [ -f .gpu-bundle/activate.sh ]; then . .gpu-bundle/activate.sh; fi; \
	export PYTHONPATH=.:$$PYTHONPATH PYTHONUNBUFFERED=1; \
	$(SANITIZER) --tool memcheck --report-api-errors no --show-backtrace device \
	  --print-limit 20 --error-exitcode 99 \
	  $(PYTHON) -m pytest -q -rs -p no:cacheprovider -m "gpu and not faults" tests/ \
	  > $$out/gpu_sanitize.log 2>&1; r=$$?; \
	echo "== sanitize summary"; grep -E "ERROR SUMMARY|Invalid __global__|passed|failed" \
	  $$out/gpu_sanitize.log | tail -8; echo "exit code: $$r"; test $$r -eq 0

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info sharedmem/*.so
