# megatron-branchnorm: `make help` lists the targets (each one's `## ` comment).
# `make venv` is the quick set-up; `make test` and `make demo` set up .venv themselves when it is
# missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: help test lint format venv clean gpu-check gpu-bench

help: ## list the targets, one line each
	@awk 'BEGIN {FS = ":.*## "} /^[A-Za-z][A-Za-z0-9_.-]*:.*## / {printf "  %-10s %s\n", $$1, $$2}' \
		$(MAKEFILE_LIST)

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[test]"
	touch $@

venv: $(VENV)/.installed ## quick set-up: .venv with torch (CPU wheel), this package, pytest, ruff

test: $(VENV)/.installed ## the whole suite: ~30 min on 2 CPU cores; installs slurm (root)
	$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS) tests

lint: $(VENV)/.installed ## ruff check and ruff format --check
	$(PY) -m ruff check megatron_branchnorm tools tests
	$(PY) -m ruff format --check megatron_branchnorm tools tests

# On a CUDA machine: precision, checkpointing, Apex, throughput and NCCL parity in one table
# (offline, from a wheelhouse: tools/build_wheelhouse.sh and docs/performance.md).
gpu-check: $(VENV)/.installed ## on a CUDA machine: precision, checkpoints, Apex, NCCL: one table
	$(PY) tools/gpu_check.py

# On a CUDA machine: train.py's steady state beside torch.nn.Transformer (eager, compiled) and
# torchscale at 4,096 and 16,384 tokens per side, in one process (docs/performance.md).
gpu-bench: $(VENV)/.installed ## on a CUDA machine: train.py's speed beside torch and torchscale
	$(PY) tools/gpu_bench.py

format: $(VENV)/.installed ## ruff format the sources
	$(PY) -m ruff format megatron_branchnorm tools tests

# make demo LANGS=de,fr MINUTES=15 LAYERS=24 (N or N-M; empty: the config's) OUT=runs/demo
LANGS ?= de,fr
CONFIG ?= demo_cpu
LAYERS ?=
MINUTES ?= 20
OUT ?= runs/demo
.PHONY: demo
demo: $(VENV)/.installed ## the whole chain on a built-in corpus, 2 CPU ranks (~25 min)
	$(PY) tools/run_demo.py --out $(OUT) --langs $(LANGS) --config $(CONFIG) --minutes $(MINUTES) \
		$(if $(LAYERS),--layers $(LAYERS))

clean: ## remove .venv, build/ and *.egg-info
	rm -rf $(VENV) build *.egg-info
