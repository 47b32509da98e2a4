# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv when it is missing and install torch and dsrun into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build of torch unless an NVIDIA driver is present (then the default CUDA build).
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: install system-packages demo test test-quick gpu-check gpu-wheels bench docs clean

# Two stamps: the demo needs only what `pip install dsrun` brings; the tests,
# benchmarks and docs add the [test] extra (pytest, transformers, mkdocs, ...).
$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed-test

# The Debian packages the test suite needs (sshd, Slurm, Open MPI, ...; list
# and reasons in tests/system_packages.py), installed before the first test:
# as root, apt-get update then install of the missing ones; nothing to do and
# no root needed when all are there. Tests only check for them.
system-packages:
	$(PYTHON) tests/system_packages.py

demo: $(VENV)/.installed
	$(VENV)/bin/dsrun --num_procs 2 examples/train_gpt.py --config examples/configs/gpt_demo.json

# Two pytest-xdist workers: most tests wait on their ranks' processes more than
# they compute, so two at a time fill two cores (tests/conftest.py keeps the
# tests that share a daemon or a launched run on one worker). TEST_WORKERS=0
# runs everything in one process.
TEST_WORKERS ?= 2
PYTEST = $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test: install system-packages
	$(PYTEST) --durations=25

test-quick: install system-packages
	$(PYTEST) -m "not slow"

# On one GPU, in one run of about 8 minutes: the 1.2B GPT's stage 3 (default and
# large prefetch window) and ZeRO-Offload beside plain PyTorch, the pipeline's
# 1f1b and zb-h1, and MoE at ZeRO 0 and 2 beside the GPT, twice over, as one
# table (bench/gpu/README.md); non-zero exit on any failure. GPU_PY=python3 uses
# an existing Python that has torch with CUDA; GPU_CHECK_OUT=DIR writes the
# table (after every row) and each row's log there; GPU_CHECK_ARGS="--suite all"
# runs every configuration instead. When $(GPU_WHEELS)/ holds wheels (make
# gpu-wheels, then copy the folder beside the work tree on the GPU machine),
# dsrun's run-time packages are installed from them first (into build/gpu-site).
GPU_PY ?= $(PY)
GPU_WHEELS ?= gpu-wheels
GPU_PYTHON_VERSION ?= 3.12
GPU_CHECK_ARGS ?= --suite item5 --models 1.2b,82m --repeats 2 --budget_s 480 --no_extra
GPU_CHECK_OUT ?=
gpu-check:
	@if [ "$(GPU_PY)" = "$(PY)" ]; then $(MAKE) --no-print-directory $(VENV)/.installed; fi
	$(GPU_PY) bench/gpu/gpu_check.py $(if $(wildcard $(GPU_WHEELS)/*.whl),--wheels $(GPU_WHEELS)) \
		$(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT)/gpu_check.md --logs $(GPU_CHECK_OUT)/logs) $(GPU_CHECK_ARGS)

# The run-time packages dsrun needs beyond torch (pydantic, paramiko, ... and
# their dependencies) as binary wheels for CPython $(GPU_PYTHON_VERSION) on
# manylinux x86_64, into $(GPU_WHEELS)/ (git-ignored, about 14 MiB; fails over 64 MiB).
gpu-wheels:
	$(PYTHON) bench/gpu/wheels.py download $(GPU_WHEELS) --python-version $(GPU_PYTHON_VERSION)

# The documentation site (MkDocs + Material) into site/; strict: a warning is an error.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) build site *.egg-info
