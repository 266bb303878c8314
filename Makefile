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
# The GPU machines' torch (a CUDA 13.0 build): its headers check our CUDA glue on CPU machines.
GPU_TORCH_SPEC ?= torch==2.11.0
GPU_TORCH_DIR := .torch-cuda
# `make test` runs pytest in TEST_WORKERS processes (pytest-xdist), each taking whole files
# (--dist loadfile: a file's tests run in order in one process, sharing its module fixtures, as
# they would alone), the files in collection order (--no-loadscope-reorder: the longest first,
# tests/conftest.py); TEST_WORKERS=0 runs them all in the calling process. A third process on the CPU
# machines' 2 cores gains nothing (2026-12-07, back to back: the suite in 670 s with 2, 672 s with 3).
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# What the TRITON_MIN_SPEC lane runs (`make test-triton-min`), with the GPU machines' Triton: the AOT
# compile check (every kernel through Triton's compiler and ptxas for sm_90: what a GPU run compiles),
# the whole model on our kernels in the interpreter, and the kernel tests of the APIs that moved most
# between 3.6 and 3.9 (tensor descriptors: attention's and the GEMM's TMA paths, raced against the
# pointer kernels; `tl.range`'s pipelined loop: add+LayerNorm's backward). The other kernel tests
# (attention's pointer kernels alone, the FFN) run in the main suite under 3.9; under 3.6 the check
# compiles their kernels and the model test runs them.
TRITON_MIN_TESTS := tests/test_triton_compile.py tests/test_attention_tma.py tests/test_add_layer_norm.py \
	tests/test_matmul_tma.py tests/test_model_triton.py
STAMP := $(VENV)/.scratchformer-installed
EXT_SOURCES := setup.py $(wildcard csrc/*.h csrc/*.cpp csrc/cuda/*.cpp csrc/cuda/*.cu)

# What the GPU machines lack, as wheels for carrying (scripts/gpu/README.md): rouge-score (an sdist
# on PyPI, built into a pure-Python wheel here) and the dependencies they do not have (nltk needs
# defusedxml; absl-py, six, click, joblib, regex, tqdm are there). WHEELS_FROM=DIR takes them from a
# local folder instead of the registry (e.g. ../shared/gpu-wheels).
WHEEL_DIR := .whl
GPU_WHEELS ?= rouge-score==0.1.2 nltk==3.10.4 defusedxml==0.7.1
WHEELS_FROM ?=

.PHONY: install lint train test test-triton-min cuda-check compile-check bench clean wheels gpu-dry-run gpu-check gpu-ext gpu-prewarm \
	test-gpu-stack gpu-ready

$(PY):
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "keeping the installed torch: $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
	fi

$(STAMP): $(PY) $(EXT_SOURCES) constraints.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q "$(TRITON_SPEC)"
	$(PY) -m pip install -q -c constraints.txt ninja setuptools wheel numpy pytest pytest-benchmark pytest-xdist \
		hypothesis "$(RUFF_SPEC)"
	$(PY) -m pip install -q -c constraints.txt --no-build-isolation -e .
	@touch $(STAMP)

install: $(STAMP)

train: install
	$(PY) -m scratchformer.train $(ARGS)

# The CUDA sources with nvcc, and the torch glue against the headers of the GPU machines' CUDA torch
# (GPU_TORCH_SPEC: its cp312 wheel, about 530 MB, is fetched once and only torch/include kept).
# Stamped, so `make install cuda-check` then `make test` (CI) compiles them once; redone when csrc/,
# setup.py, the script or the headers change.
CUDA_CHECK_STAMP := $(GPU_TORCH_DIR)/.cuda-checked
cuda-check: $(CUDA_CHECK_STAMP)

$(CUDA_CHECK_STAMP): $(GPU_TORCH_DIR)/.installed csrc/check_cuda_compile.sh $(EXT_SOURCES)
	TORCH_CUDA_INCLUDE=$(abspath $(GPU_TORCH_DIR))/torch/include bash csrc/check_cuda_compile.sh
	@touch $@

$(GPU_TORCH_DIR)/.installed: | $(PY)
	rm -rf $(GPU_TORCH_DIR) && mkdir -p $(GPU_TORCH_DIR)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --no-cache-dir -d $(GPU_TORCH_DIR) "$(GPU_TORCH_SPEC)"
	$(PY) -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('$(GPU_TORCH_DIR)/torch-*.whl')[0]); \
		z.extractall('$(GPU_TORCH_DIR)', [n for n in z.namelist() if n.startswith('torch/include/') or n == 'torch/version.py'])"
	rm -f $(GPU_TORCH_DIR)/torch-*.whl
	@grep -q "^cuda: Optional\[str\] = '" $(GPU_TORCH_DIR)/torch/version.py || \
		{ echo "$(GPU_TORCH_SPEC) from the registry is not a CUDA build:"; cat $(GPU_TORCH_DIR)/torch/version.py; exit 1; }
	@grep "^__version__" $(GPU_TORCH_DIR)/torch/version.py
	@touch $@

# Every Triton kernel through Triton's compiler and ptxas for sm_90 and sm_80, all dtypes (slow;
# `make test` runs the sm_90 bf16 subset).
compile-check: install
	SCRATCHFORMER_COMPILE_CHECK=full $(PY) -m pytest tests/test_triton_compile.py -q -s

# Lint first (seconds), then the suite.
$(VENV)/bin/ruff: | install
	$(PY) -m pip install -q "$(RUFF_SPEC)"

lint: install $(VENV)/bin/ruff
	$(VENV)/bin/ruff check .

# On a CPU machine the TRITON_MIN_SPEC lane follows the suite and runs the compile check in its
# default mode with the GPU machines' Triton, so the suite's own (the CPU machines' Triton) is the
# quick one: every kernel and flag combination, one config each (tests/test_triton_compile.py).
# The sub-make on a line of its own: make runs a line naming $(MAKE) even under -n, so `make -n test`
# ran the whole suite when the pytest line named it too.
test: install lint cuda-check
	@if $(PY) -c "import sys, torch; sys.exit(torch.cuda.is_available())"; then \
		SCRATCHFORMER_COMPILE_CHECK=$${SCRATCHFORMER_COMPILE_CHECK:-quick} $(PY) -m pytest tests $(XDIST) $(PYTEST_ARGS); \
	else \
		$(PY) -m pytest tests $(XDIST) $(PYTEST_ARGS); \
	fi
	@if $(PY) -c "import sys, torch; sys.exit(torch.cuda.is_available())"; then \
		$(MAKE) --no-print-directory test-triton-min; \
	else \
		echo "GPU machine: its own Triton ran the kernel tests above; skipping the $(TRITON_MIN_SPEC) lane"; \
	fi

# TRITON_MIN_TESTS with TRITON_MIN_SPEC shadowing the venv's Triton (PYTHONPATH goes
# before site-packages). numpy < 2.3 because Triton < 3.7's interpreter breaks on newer numpy
# (kernels/_common.py: check_interpreter_versions).
$(TRITON_MIN_DIR)/.installed: | install
	rm -rf $(TRITON_MIN_DIR)
	$(PY) -m pip install -q --no-deps --target $(TRITON_MIN_DIR) "$(TRITON_MIN_SPEC)" "numpy<2.3"
	@touch $@

test-triton-min: install $(TRITON_MIN_DIR)/.installed
	PYTHONPATH=$(abspath $(TRITON_MIN_DIR)) $(PY) -c "import triton, numpy; print('kernel tests with triton', triton.__version__, 'numpy', numpy.__version__)"
	PYTHONPATH=$(abspath $(TRITON_MIN_DIR)) $(PY) -m pytest $(TRITON_MIN_TESTS) $(XDIST) -p no:cacheprovider \
		-W "ignore:Conversion of an array with ndim > 0:DeprecationWarning" $(PYTEST_ARGS)

wheels: $(PY)
	mkdir -p $(WHEEL_DIR)
	$(PY) -m pip wheel -q --no-deps -w $(WHEEL_DIR) $(if $(WHEELS_FROM),--no-index --find-links $(WHEELS_FROM)) $(GPU_WHEELS)
	@for w in $(WHEEL_DIR)/*.whl; do case $$w in *-py3-none-any.whl|*-py2.py3-none-any.whl) ;; \
		*) echo "not pure Python, will not install on the GPU machine's Python 3.12: $$w"; exit 1;; esac; done
	@ls -l $(WHEEL_DIR)

# The GPU machines' software on this CPU machine (Python 3.12, CUDA torch GPU_TORCH_SPEC, Triton
# TRITON_MIN_SPEC; about 4 GB, not part of `make test`). gpu-ext: the extension built with CUDA for
# sm_80 and sm_90 into .gpu_build/ (with its sources' hash), which the GPU plan carries so that the
# window skips the build (scripts/gpu/README.md). test-gpu-stack: the CPU suite with that torch.
GPU_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
GPU_VENV := .venv-gpu
GPU_CUDA_HOME ?= $(or $(CUDA_HOME),/usr/local/cuda)
$(GPU_VENV)/.installed:
	$(GPU_PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q "$(GPU_TORCH_SPEC)" "$(TRITON_MIN_SPEC)" "numpy<2.3" ninja setuptools wheel \
		tqdm tokenizers sacrebleu rouge-score matplotlib safetensors pytest pytest-benchmark pytest-xdist hypothesis
	@touch $@

gpu-ext: $(GPU_VENV)/.installed
	@[ -e "$(GPU_CUDA_HOME)/include/cuda_runtime.h" ] || { echo "no CUDA toolkit at $(GPU_CUDA_HOME): set GPU_CUDA_HOME"; exit 1; }
	CUDA_HOME=$(GPU_CUDA_HOME) TORCH_CUDA_ARCH_LIST="8.0;9.0" $(GPU_VENV)/bin/python setup.py -q build_ext --inplace
	rm -rf .gpu_build && mkdir -p .gpu_build && cp scratchformer/_C.cpython-312-*.so .gpu_build/ && strip -g .gpu_build/*.so
	bash scripts/gpu/ext_sources.sh > .gpu_build/sources.sha256
	@ls -l .gpu_build

test-gpu-stack: gpu-ext
	@[ -e scratchformer/kernels ] || ln -sfn ../kernels scratchformer/kernels
	PYTHONPATH=$(CURDIR) $(GPU_VENV)/bin/python -m pytest tests -p no:cacheprovider \
		-W "ignore:Conversion of an array with ndim > 0:DeprecationWarning" $(PYTEST_ARGS)

# Triton's cache for the next GPU window, compiled here in that stack (tools/prewarm.py: about
# 41 minutes on 2 cores; run.sh restores what .gpu_cache/ carries)
gpu-prewarm: gpu-ext
	@[ -e scratchformer/kernels ] || ln -sfn ../kernels scratchformer/kernels
	PYTHONPATH=$(CURDIR) $(GPU_VENV)/bin/python -m tools.prewarm $(PREWARM_ARGS)

# Everything a GPU window carries, from a new checkout (none of it is tracked): the wheels (from
# ../shared/gpu-wheels when it is there), the extension for the GPU stack, Triton's prewarmed cache
# (PREWARM_ARGS: all of it by default, about 41 minutes on 2 cores; a recipe-only window needs only
# "--workloads model --tiles pinned --no-tests", about 5) and the datasets GPU_DATA names
# (scripts/pack_gpu_data.sh, which also adds up what a call sends). scripts/gpu/README.md. The
# CNN/DailyMail window: GPU_DATA=cnn_dailymail PREWARM_ARGS="--workloads model --tiles pinned --no-tests
# --out .gpu_cache-pinned/prewarm.tar.xz" (about 13 minutes from a new checkout).
GPU_DATA ?= iwslt2017_en_de
gpu-ready: gpu-prewarm
	$(MAKE) wheels WHEELS_FROM=$(or $(WHEELS_FROM),$(wildcard ../shared/gpu-wheels))
	bash scripts/pack_gpu_data.sh $(GPU_DATA)
	bash scripts/gpu/ready.sh

# Before a window's first device call (free): what the calls carry, there and made from this checkout?
# Exits 1 naming each part missing or stale (scripts/gpu/ready.sh)
gpu-check:
	bash scripts/gpu/ready.sh

# The GPU plan's test and benchmark steps on this CPU machine (tests/test_gpu_plan.py does the same in
# `make test`; tests/test_gpu_train_step.py rehearses 50_train, which needs a recipe and its data, on
# a synthetic dataset).
gpu-dry-run: install
	@for s in scripts/gpu/[0-4][0-9]_*.sh; do GPU_DRY_RUN=1 OUT=gpu_out/dry PY=$(abspath $(PY)) bash $$s || exit 1; done

bench: install
	$(PY) -m pytest bench --benchmark-only $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) $(TRITON_MIN_DIR) $(GPU_TORCH_DIR) .gpu_build build *.egg-info scratchformer/_C*.so gpu_out
