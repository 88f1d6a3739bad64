# README command #1 is `make demo`, command #2 is `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup test test-unit lint demo clean-demo bench

setup: $(STAMP)

# Re-install only when the project metadata changes; a second `make setup` is a no-op.
$(STAMP): pyproject.toml ops/setup_env.sh
	VENV=$(VENV) TORCH_CPU_VERSION=$(TORCH_CPU_VERSION) bash ops/setup_env.sh
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# ruff, then the unit suite, then the integration suite; `make test-unit` is the fast loop (< 60 s).
test: lint
	VENV=$(VENV) bash ops/run_tests.sh all

test-unit: setup
	VENV=$(VENV) bash ops/run_tests.sh unit

demo: setup
	$(VENV)/bin/prism demo

# Speed targets: each script prints ratios measured in one run (this machine is noisy).
bench: setup
	set -e; for f in benchmarks/bench_*.py; do echo "== $$f"; $(PY) $$f; done
