#!/usr/bin/env bash
# The test suites (what `make test` runs after ruff): `unit` (in-process, < 60 s), then `integration` (real
# processes, MLflow server, Slurm, DeepSpeed across processes). `all` (the default) runs both, unit first, and
# stops at the first failing suite. `compat` runs the tests marked megatron_compat (model, TP, train, exact
# resume) from both suites: the second CI leg (Python 3.12, megatron-core 0.19), after printing the versions
# and checking megatron-core starts with $EXPECT_MEGATRON when that is set. What differs between megatron-core
# 0.16 and 0.19 is handled in pipeline/compat/megatron.py only; DeepSpeed is the same pinned release in both
# legs (pipeline/compat/deepspeed.py copies its private code). Extra arguments go to pytest.
# pytest's exit 5 (no tests collected) is a failure: an empty suite is not green. Each suite ends with its 15
# slowest tests (--durations), so every run shows where the time goes.
set -uo pipefail
VENV=${VENV:-.venv}
# DeepSpeed JIT builds and torch extensions land in one cache per venv (each has its own torch and Python)
# that survives between runs.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(cd "$VENV" && pwd)/torch_extensions}
export PYTHONUNBUFFERED=1
suite=${1:-all}
[ $# -gt 0 ] && shift
case "$suite" in
  unit | integration) suites=("$suite") ;;
  all) suites=(unit integration) ;;
  compat) suites=(compat) ;;
  *) echo "run_tests: unknown suite '$suite'; use unit, integration, all or compat" >&2; exit 2 ;;
esac
if [ "$suite" = compat ]; then
  "$VENV/bin/python" - "${EXPECT_MEGATRON:-}" <<'PY' || exit 1
import sys

from importlib.metadata import version

import megatron.core
import torch

print(
    f"== compat leg: Python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core "
    f"{megatron.core.__version__}, deepspeed {version('deepspeed')}"
)
want = sys.argv[1]
if want and not megatron.core.__version__.startswith(want + "."):
    sys.exit(f"run_tests: this leg must test megatron-core {want}.x, found {megatron.core.__version__}")
PY
fi
for s in "${suites[@]}"; do
  echo "== $s tests"
  if [ "$s" = compat ]; then
    "$VENV/bin/python" -m pytest tests/unit tests/integration -m megatron_compat --durations=15 "$@"
  else
    "$VENV/bin/python" -m pytest "tests/$s" --durations=15 "$@"
  fi
  rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "run_tests: pytest collected no $s tests; failing" >&2
    exit 1
  fi
  [ "$rc" -eq 0 ] || exit "$rc"
done
