# README command #1 is `make demo`, command #2 is `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

# The second CI leg: Python 3.12 with what it resolves (megatron-core 0.19.x) and the registry's torch (a
# CUDA build; it runs on CPU). PYTHON312: the first python3.12 that runs, on PATH or under pyenv.
VENV312 ?= .venv312
TORCH312_VERSION ?= 2.14.1
PYTHON312 ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do $$p -V >/dev/null 2>&1 && { echo $$p; break; }; done)
STAMP312 := $(VENV312)/.installed

.PHONY: setup setup-py312 test test-unit test-py312 lint demo clean-demo bench bench-quick docs docs-demo

setup: $(STAMP)

# Re-install only when the project metadata changes; a second `make setup` is a no-op.
$(STAMP): pyproject.toml ops/setup_env.sh
	VENV=$(VENV) TORCH_CPU_VERSION=$(TORCH_CPU_VERSION) bash ops/setup_env.sh
	touch $(STAMP)

setup-py312: $(STAMP312)

$(STAMP312): pyproject.toml ops/setup_env.sh
	@[ -n "$(PYTHON312)" ] || { echo "setup-py312: no python3.12 found; set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	VENV=$(VENV312) PYTHON=$(PYTHON312) TORCH_CPU_VERSION=$(TORCH312_VERSION) bash ops/setup_env.sh
	touch $(STAMP312)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# ruff, then the unit suite, then the integration suite; `make test-unit` is the fast loop (< 60 s).
test: lint
	VENV=$(VENV) bash ops/run_tests.sh all

# The megatron_compat tests (model, TP, train, exact resume) in the Python 3.12 venv; fails unless that
# venv's megatron-core is 0.19.x. CI runs it after `make test`.
test-py312: setup-py312
	VENV=$(VENV312) EXPECT_MEGATRON=0.19 bash ops/run_tests.sh compat

test-unit: setup
	VENV=$(VENV) bash ops/run_tests.sh unit

demo: setup
	$(VENV)/bin/prism demo

# Rewrite what README.md and docs/ show from the code: the config reference (from the schema) and every
# transcript (pipeline/cli/docs.py). Seconds; `make docs-demo` also reruns `prism demo` for the README excerpt.
docs: setup
	$(PY) -m pipeline.cli.docs

docs-demo: setup
	$(PY) -m pipeline.cli.docs --demo

# Speed targets: each script prints ratios measured in one run (this machine is noisy). Each builds what it
# needs (benchmarks/_common.py), so both targets run on a fresh clone.
bench: setup
	set -e; for f in benchmarks/bench_*.py; do echo "== $$f"; $(PY) $$f; done

# Every benchmark at its --quick size (CI runs this): each must exit 0 and report its fields; no timing is judged.
bench-quick: setup
	$(PY) benchmarks/check_quick.py
