#!/usr/bin/env bash
# The test suites (what `make test` runs after ruff): `unit` (in-process, < 60 s), then `integration` (real
# processes, MLflow server, Slurm, DeepSpeed across processes). `all` (the default) runs both, unit first, and
# stops at the first failing suite. Extra arguments go to pytest. pytest's exit 5 (no tests collected) is a
# failure: an empty suite is not green.
set -uo pipefail
VENV=${VENV:-.venv}
# DeepSpeed JIT builds and torch extensions land in one cache that survives between runs.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
export PYTHONUNBUFFERED=1
suite=${1:-all}
[ $# -gt 0 ] && shift
case "$suite" in
  unit | integration) suites=("$suite") ;;
  all) suites=(unit integration) ;;
  *) echo "run_tests: unknown suite '$suite'; use unit, integration or all" >&2; exit 2 ;;
esac
for s in "${suites[@]}"; do
  echo "== $s tests"
  "$VENV/bin/python" -m pytest "tests/$s" "$@"
  rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "run_tests: pytest collected no $s tests; failing" >&2
    exit 1
  fi
  [ "$rc" -eq 0 ] || exit "$rc"
done
