#!/usr/bin/env bash
# The whole pytest suite (what `make test` runs after ruff). pytest's exit 5 (no tests collected) is a failure:
# an empty suite is not green.
set -uo pipefail
VENV=${VENV:-.venv}
# DeepSpeed JIT builds and torch extensions land in one cache that survives between runs.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
export PYTHONUNBUFFERED=1
"$VENV/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$rc"
