# plait — set-up, demo, tests and benchmarks. `make demo` and `make test` work on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of PyTorch lies on this machine's disk; any other request downloads a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# Packages install without byte-compiling every module (torch's, transformers', pyarrow's...: ~70 s of one core);
# the modules in use compile once, at their first import, into their __pycache__ folders, so Python must be
# allowed to write those (where the host sets PYTHONDONTWRITEBYTECODE, every process would compile torch again).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test check-install bench lint clean gpu-check

$(BIN)/plait: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile "$(TORCH_PIN)"
	$(BIN)/pip install -q --no-compile -e ".[dev]"
	@touch $(BIN)/plait

install: $(BIN)/plait

demo: install
	$(BIN)/plait train

test: install
	$(BIN)/python -m pytest -q

# `pip install .` with no extras into a fresh virtualenv (only the pinned torch), then every command once
check-install:
	PY=$(PY) TORCH_PIN="$(TORCH_PIN)" bash .ci/check-install

bench: install
	$(BIN)/python bench/run_all.py

# On a machine with a GPU: the tree's sources on the path of a Python whose torch has CUDA (no install step: such
# machines often reach no package registry). Writes gpu-check/gpu_check.json and gpu_check.md; ~4 min on one H200.
# Its serve section needs plait's serving packages in that Python (fastapi, its opentelemetry-api, starlette, uvicorn,
# pydantic): where the machine lacks them, bring wheels (pip download --no-deps ...) and pip install --no-index them.
# On a CPU: make gpu-check PY=.venv/bin/python GPU_DEVICE=cpu GPU_FLAGS=--quick
GPU_DEVICE ?= cuda
GPU_FLAGS ?=
gpu-check:
	PYTHONPATH=src $(PY) bench/gpu_check.py --device $(GPU_DEVICE) $(GPU_FLAGS) --out gpu-check

lint: install
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
