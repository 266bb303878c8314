# scratchformer: `make train` (set up + main job), `make test` (set up + tests).
# The virtualenv keeps an already-installed torch (created with --system-site-packages when the
# base python has one, e.g. a CUDA build on a GPU machine); otherwise it installs TORCH_SPEC,
# which on the project's CPU machines is the local CPU build torch==2.13.0.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.9.0
STAMP := $(VENV)/.scratchformer-installed
EXT_SOURCES := setup.py $(wildcard csrc/*.cpp csrc/cuda/*.cpp csrc/cuda/*.cu)

.PHONY: install train test cuda-check compile-check bench clean

$(PY):
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "keeping the installed torch: $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi

$(STAMP): $(PY) $(EXT_SOURCES)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q "$(TRITON_SPEC)"
	$(PY) -m pip install -q ninja setuptools wheel numpy pytest pytest-benchmark hypothesis
	$(PY) -m pip install -q --no-build-isolation -e .
	@touch $(STAMP)

install: $(STAMP)

train: install
	$(PY) -m scratchformer.train $(ARGS)

cuda-check:
	bash csrc/check_cuda_compile.sh

# Every Triton kernel through Triton's compiler and ptxas for sm_90 and sm_80, all dtypes (slow;
# `make test` runs the sm_90 bf16 subset).
compile-check: install
	SCRATCHFORMER_COMPILE_CHECK=full $(PY) -m pytest tests/test_triton_compile.py -q -s

test: install cuda-check
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: install
	$(PY) -m pytest bench --benchmark-only $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info scratchformer/_C*.so
