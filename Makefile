# Two commands do everything on a fresh machine with only Python:
#   make demo   -- sets itself up, runs examples/pipeline.py (GPU if present, else host backend)
#   make test   -- sets itself up, runs the test suite
SHELL  := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
JOBS   := $(shell nproc 2>/dev/null || echo 2)

.PHONY: build test demo dask-demo wheel-check stress bench speedups gpu-test gpu-demo gpu-bench gpu-all gpu-sanitize \
        gpu-wheels gpu-dask clean

# With an NVIDIA driver, the CuPy and cuda-bindings extra of its CUDA major version too (else
# the demo would find no CuPy and run on the host backend); GPU_EXTRA= leaves them out.
CUDA_MAJOR := $(shell nvidia-smi 2>/dev/null | grep -o "CUDA Version: [0-9]*" | grep -o "[0-9]*$$")
GPU_EXTRA  ?= $(if $(filter 12 13,$(CUDA_MAJOR)),$(addprefix $(comma)cuda,$(CUDA_MAJOR)))
comma := ,

# (editable_mode=compat: the install compiles the core in place, so `build` below finds it
# current -- one compile on a fresh machine, not two)
$(STAMP): pyproject.toml setup.py
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q --upgrade "Cython>=3.0" setuptools
	@echo "installing sharedmem$(if $(GPU_EXTRA), with $(GPU_EXTRA:,%=%),) and compiling its core (Cython, $(JOBS) jobs): a minute or a few"
	$(VPY) -m pip install -q -e '.[test,dask$(GPU_EXTRA)]' --config-settings editable_mode=compat
	@touch $(STAMP)

# The compiled core, rebuilt in place when a source changed (cythonize skips what is current)
build: $(STAMP)
	@$(VPY) setup.py -q build_ext --inplace -j $(JOBS) 2>&1 | grep -v "^warning: .*Strings should no longer" || true

# The suite twice: on the compiled core, then on the same sources interpreted.
test: build
	$(VPY) -m pytest -q
	SHAREDMEM_PURE_PYTHON=1 $(VPY) -m pytest -q

demo: build
	$(VPY) examples/pipeline.py
	$(VPY) examples/mixed_pipeline.py

# Tensors passed between two Dask worker processes (LocalCluster; the dask extra is part of
# the development install above).
dask-demo: build
	$(VPY) examples/dask_pipeline.py

# The long runs: the stress test at full size and the ownership model with 300 programs.
# What a user gets from the wheel: built here, installed with the dask extra into a fresh venv,
# then the README example and every example run from a directory outside the checkout (so
# `import sharedmem` finds the installed, compiled package).
WHEEL_DIR ?= /tmp/sharedmem-wheel-check
wheel-check:
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)/dist
	$(PYTHON) -m pip wheel -q --no-deps -w $(WHEEL_DIR)/dist .
	$(PYTHON) -m venv $(WHEEL_DIR)/venv
	whl=$$(ls $(WHEEL_DIR)/dist/sharedmem_gpu-*.whl) && \
	  $(WHEEL_DIR)/venv/bin/pip install -q "$$whl[dask]"
	cp -r examples $(WHEEL_DIR)/
	$(PYTHON) -c "import re,sys; print(re.search(r'\x60\x60\x60python\n(.*?)\x60\x60\x60', \
	  open('README.md').read(), re.S).group(1))" > $(WHEEL_DIR)/readme_example.py
	cd $(WHEEL_DIR) && venv/bin/python -c "import sharedmem as sm, sys; \
	  c = sm.show_config(open('/dev/null', 'w')); print('sharedmem from', sm.__file__, '-', c['core']); \
	  sys.exit('site-packages' not in sm.__file__)" && \
	  for f in readme_example.py examples/*.py; do echo "== $$f"; venv/bin/python $$f || exit 1; done
	@echo "wheel-check: the README example and every example ran from the installed wheel"

stress: build
	SHAREDMEM_STRESS_FULL=1 SHAREDMEM_MODEL=full $(VPY) -m pytest -q tests/test_stress.py \
	  tests/test_model.py -p no:randomly -s

bench: build
	$(VPY) benchmarks/run.py

# The compiled core, built in place with the machine's own Python (the GPU machine has Cython
# and gcc; no install step there). Without them sharedmem runs interpreted, and says so.
speedups:
	@$(PYTHON) setup.py -q build_ext --inplace -j 8 > /tmp/sharedmem-build.log 2>&1 || \
	  { tail -20 /tmp/sharedmem-build.log; echo "speedups: the compiled core was not built; the interpreted sources run"; }

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
	echo "== summary"; $(PYTHON) -c "import sharedmem as sm; print('core:', sm.show_config(open('/dev/null', 'w'))['core'])"; \
	tail -1 $$out/gpu_tests.log; grep -E "OK|MISMATCH|FAIL|clean" $$out/gpu_demo.log; \
	tail -1 $$out/gpu_uaf.log; sed -n '/^row /,$$p' $$out/gpu_bench.log; \
	echo "exit codes: tests=$$t demos=$$d uaf=$$u bench=$$b"; test $$t -eq 0 -a $$d -eq 0 -a $$u -eq 0

# dask + distributed for the GPU machine, which has no network: wheels for its Python
# (GPU_PYTHON) downloaded here into .gpu-wheels/ (git-ignored), carried there (the device tool's
# `carry`) and installed with `make gpu-dask`. Pure-Python wheels, plus manylinux x86_64 ones
# for the compiled dependencies (msgpack, psutil, pyyaml, tornado, markupsafe).
GPU_PYTHON ?= 3.12
GPU_WHEELS := .gpu-wheels
GPU_WHEEL_PKGS := dask distributed cloudpickle toolz partd locket fsspec msgpack sortedcontainers \
                  tblib zict tornado psutil click pyyaml jinja2 markupsafe packaging \
                  importlib_metadata zipp
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --implementation cp \
	  --python-version $(GPU_PYTHON) --platform manylinux2014_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
	  -d $(GPU_WHEELS) $(GPU_WHEEL_PKGS)
	@du -sh $(GPU_WHEELS); ls $(GPU_WHEELS)

# On the GPU machine: install the carried wheels, then the Dask tests, the Dask example and the
# transfer benchmark (a sharedmem Tensor against a CuPy array through the same cluster).
gpu-dask: speedups
	$(PYTHON) -m pip install -q --no-index --find-links $(GPU_WHEELS) dask distributed
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) -m pytest -q -rs tests/test_gpu_dask.py tests/test_dask.py \
	  tests/test_pickle.py
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) examples/dask_pipeline.py
	PYTHONPATH=.:$$PYTHONPATH $(PYTHON) benchmarks/dask_transfer.py

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
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
	find sharedmem interop -name "*.so" -o -name "*.c" -o -name "*.html" | xargs rm -f
