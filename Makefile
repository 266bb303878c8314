# scratchformer: `make train` (set up + main job), `make test` (set up + tests).
# The virtualenv keeps an already-installed torch (created with --system-site-packages when the
# base python has one, e.g. a CUDA build on a GPU machine); otherwise it installs TORCH_SPEC,
# which on the project's CPU machines is the local CPU build torch==2.13.0.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.9.0
RUFF_SPEC ?= ruff==0.17.6
# The oldest Triton we support: the one CUDA torch 2.11 ships with (the GPU machines' torch).
# `make test` also runs the kernel tests and the AOT compile check with it on CPU machines.
TRITON_MIN_SPEC ?= triton==3.6.0
TRITON_MIN_DIR := .triton-min
KERNEL_TESTS := tests/test_attention.py tests/test_add_layer_norm.py tests/test_ffn.py \
	tests/test_model_triton.py tests/test_triton_compile.py
STAMP := $(VENV)/.scratchformer-installed
EXT_SOURCES := setup.py $(wildcard csrc/*.h csrc/*.cpp csrc/cuda/*.cpp csrc/cuda/*.cu)

# What the GPU machines lack, as wheels for carrying (scripts/gpu/README.md): rouge-score (an sdist
# on PyPI, built into a pure-Python wheel here) and the dependencies they do not have (nltk needs
# defusedxml; absl-py, six, click, joblib, regex, tqdm are there). WHEELS_FROM=DIR takes them from a
# local folder instead of the registry (e.g. ../shared/gpu-wheels).
WHEEL_DIR := .whl
GPU_WHEELS ?= rouge-score==0.1.2 nltk==3.10.4 defusedxml==0.7.1
WHEELS_FROM ?=

.PHONY: install lint train test test-triton-min cuda-check compile-check bench clean wheels gpu-dry-run

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
	$(PY) -m pip install -q ninja setuptools wheel numpy pytest pytest-benchmark hypothesis "$(RUFF_SPEC)"
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

# Lint first (seconds), then the suite.
$(VENV)/bin/ruff: | install
	$(PY) -m pip install -q "$(RUFF_SPEC)"

lint: install $(VENV)/bin/ruff
	$(VENV)/bin/ruff check .

test: install lint cuda-check
	$(PY) -m pytest tests $(PYTEST_ARGS)
	@if $(PY) -c "import sys, torch; sys.exit(torch.cuda.is_available())"; then \
		$(MAKE) --no-print-directory test-triton-min; \
	else echo "GPU machine: its own Triton ran the kernel tests above; skipping the $(TRITON_MIN_SPEC) lane"; fi

# The kernel tests again with TRITON_MIN_SPEC shadowing the venv's Triton (PYTHONPATH goes
# before site-packages). numpy < 2.3 because Triton < 3.7's interpreter breaks on newer numpy
# (kernels/_common.py: check_interpreter_versions).
$(TRITON_MIN_DIR)/.installed: | install
	rm -rf $(TRITON_MIN_DIR)
	$(PY) -m pip install -q --no-deps --target $(TRITON_MIN_DIR) "$(TRITON_MIN_SPEC)" "numpy<2.3"
	@touch $@

test-triton-min: install $(TRITON_MIN_DIR)/.installed
	PYTHONPATH=$(abspath $(TRITON_MIN_DIR)) $(PY) -c "import triton, numpy; print('kernel tests with triton', triton.__version__, 'numpy', numpy.__version__)"
	PYTHONPATH=$(abspath $(TRITON_MIN_DIR)) $(PY) -m pytest $(KERNEL_TESTS) -p no:cacheprovider \
		-W "ignore:Conversion of an array with ndim > 0:DeprecationWarning" $(PYTEST_ARGS)

wheels: $(PY)
	mkdir -p $(WHEEL_DIR)
	$(PY) -m pip wheel -q --no-deps -w $(WHEEL_DIR) $(if $(WHEELS_FROM),--no-index --find-links $(WHEELS_FROM)) $(GPU_WHEELS)
	@for w in $(WHEEL_DIR)/*.whl; do case $$w in *-py3-none-any.whl|*-py2.py3-none-any.whl) ;; \
		*) echo "not pure Python, will not install on the GPU machine's Python 3.12: $$w"; exit 1;; esac; done
	@ls -l $(WHEEL_DIR)

# Every step of the GPU plan on this CPU machine (tests/test_gpu_plan.py does the same in `make test`).
gpu-dry-run: install
	@for s in scripts/gpu/[0-9][0-9]_*.sh; do GPU_DRY_RUN=1 OUT=gpu_out/dry PY=$(abspath $(PY)) bash $$s || exit 1; done

bench: install
	$(PY) -m pytest bench --benchmark-only $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(TRITON_MIN_DIR) build *.egg-info scratchformer/_C*.so gpu_out
