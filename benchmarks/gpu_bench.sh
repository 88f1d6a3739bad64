#!/usr/bin/env bash
# gpu_bench.sh: the project's GPU benchmark in one prepared run (from the repo root, one H200/H100).
#
#   bash benchmarks/gpu_bench.sh                  # on the GPU box: 124M then 757M, both arms, ~8 minutes
#   bash benchmarks/gpu_bench.sh --fetch-wheels   # on a box WITH pip access, before the device call: fills
#                                                 # ./.whl (cp312 manylinux) for a GPU box that has no index
#
# The device image has Python 3.12 and torch 2.11 + CUDA 13 but no package registry: megatron-core 0.16.1,
# deepspeed 0.19.8 and their small deps are installed from ./.whl (carry it: run's `carry: [".whl"]`).
# First the SDPA kernel report (`prism model report`, bf16 on the GPU: the kernel torch picks for each layer,
# the 124M arms and the paper's d_h-384 variant, a fallback named in one warning line), two GPU-only checks
# (pinned flash refused at d_h 384, a CUDA memory snapshot), then
# benchmarks/bench_arms.py (both arms through `prism train` under torchrun + DeepSpeed, bf16, synthetic tokens;
# the last PROFILE_STEPS=1 step traced: the kernel split and each layer's forward/backward ms, both arms side by
# side). Writes $OUT/gpu_bench_summary.txt (readable in a minute: kernels, tokens/s, ratio, per-layer table)
# plus one JSON per scale.
# Knobs (env): PYTHON, SCALES="124m 757m", STEPS_124M=30, STEPS_757M=12 (STEPS_<SCALE>, default 20), NPROC=1,
#   DEADLINE=540 (seconds; a scale with under 120 s left is skipped), PROFILE_STEPS=1. Each arm also writes one
#   ZeRO checkpoint.
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
ROOT=$PWD
[ -f pipeline/train/__init__.py ] && [ -f benchmarks/bench_arms.py ] || { echo "run this from the Prism repo root" >&2; exit 2; }

if [ "${1:-}" = "--fetch-wheels" ]; then
  PY=${PYTHON:-.venv/bin/python}
  mkdir -p .whl
  P=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl)
  "$PY" -m pip download --no-deps "${P[@]}" megatron-core==0.16.1 hjson
  "$PY" -m pip download "${P[@]}" pydantic "packaging>=24.2" pyyaml numpy
  "$PY" -m pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8   # sdist on PyPI; no ops built
  du -sh .whl
  exit 0
fi

OUTDIR=${OUT:-$ROOT/runs/gpu_bench/out}
WORK=$ROOT/runs/gpu_bench
mkdir -p "$OUTDIR" "$WORK"
SUMMARY=$OUTDIR/gpu_bench_summary.txt
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
START=$SECONDS
DEADLINE=${DEADLINE:-540}
NPROC=${NPROC:-1}

PY=
for p in ${PYTHON:-} python3 python; do
  if command -v "$p" >/dev/null && "$p" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY=$(command -v "$p"); break
  fi
done
[ -n "$PY" ] || { say "no python with a CUDA device; this script needs a GPU (CPU: python benchmarks/bench_arms.py)"; exit 1; }
need=()
"$PY" -c 'import megatron.core as m, sys; sys.exit(m.__version__ != "0.16.1")' 2>/dev/null || need+=(megatron-core==0.16.1)
"$PY" -c 'import deepspeed' 2>/dev/null || need+=(deepspeed==0.19.8)
for m in yaml:pyyaml numpy:numpy hjson:hjson pydantic:pydantic; do
  "$PY" -c "import ${m%%:*}" 2>/dev/null || need+=("${m#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  PIPOPT=(-q --no-build-isolation --disable-pip-version-check)
  [ -d .whl ] && PIPOPT+=(--no-index --find-links "$ROOT/.whl")
  timeout 300 "$PY" -m pip install "${PIPOPT[@]}" "${need[@]}" \
    || timeout 300 "$PY" -m pip install --break-system-packages "${PIPOPT[@]}" "${need[@]}"
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
say "setup: $PY, $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())') ($(( SECONDS - START ))s)"

# The kernel each layer gets, asked of torch on this GPU (no network needed: the meta device and one probe per d_h)
for variant in "configs/prism_124m.yaml" \
  "configs/prism_124m.yaml schedule.heads=2x2,6x2,8x2,12x6 schedule.allow_guideline_violations=true" \
  "configs/prism_757m.yaml"; do
  # shellcheck disable=SC2086  # the variant is a config and its overrides
  timeout 120 "$PY" -m pipeline.cli model report $variant train.precision=bf16 train.device=cuda \
    >"$WORK/kernels.log" 2>&1 || say "[kernels] $variant: rc=$?"
  say "[kernels] $variant"
  grep -E '(attention on|warning:|error:)' "$WORK/kernels.log" | sed 's/^/  /' | tee -a "$SUMMARY"
done

# GPU-only checks (tests/unit/test_profiling.py checks their CPU side): a pinned flash kernel is refused in one
# line at the paper's d_h 384 (FlashAttention-2 stops at 256), and a CUDA memory snapshot is written whole.
rc=0
timeout 120 "$PY" -m pipeline.cli model report configs/prism_124m.yaml schedule.heads=2x2,6x2,8x2,12x6 \
  schedule.allow_guideline_violations=true model.attention_backend=flash train.precision=bf16 train.device=cuda \
  >/dev/null 2>"$WORK/flash384.err" || rc=$?
if [ "$rc" = 2 ] && [ "$(grep -c . "$WORK/flash384.err")" = 1 ] \
  && grep -q 'flash attention cannot run on cuda (bf16, head dim 384)' "$WORK/flash384.err"; then
  say "[check] pinned flash at d_h 384 refused in one line: PASS"
else
  say "[check] pinned flash at d_h 384 refused in one line: FAIL (rc=$rc)"; sed 's/^/  /' "$WORK/flash384.err" | tail -n 5 | tee -a "$SUMMARY"
fi
timeout 120 "$PY" - "$WORK/rank-0.memory.pickle" <<'PY' 2>&1 | tail -n 5 | tee -a "$SUMMARY"
import pickle
import sys
from pathlib import Path

import torch

from pipeline import profiling

torch.cuda.memory._record_memory_history(max_entries=1000)
x = torch.ones(1024, 1024, device="cuda")
snapshot = pickle.loads(profiling.dump_snapshot(Path(sys.argv[1]), stop_history=True).read_bytes())
traced = sum(len(t) for t in snapshot["device_traces"])
verdict = "PASS" if snapshot["segments"] and traced else "FAIL"
print(f"[check] CUDA memory snapshot written whole: {verdict} ({len(snapshot['segments'])} segments, {traced} events)")
PY

for scale in ${SCALES:-124m 757m}; do
  left=$(( DEADLINE - (SECONDS - START) ))
  if [ "$left" -lt 120 ]; then say "[$scale] skipped: ${left}s left of DEADLINE=$DEADLINE"; continue; fi
  steps_var=STEPS_${scale^^}
  steps=${!steps_var:-$([ "$scale" = 124m ] && echo 30 || { [ "$scale" = 757m ] && echo 12 || echo 20; })}
  rc=0
  timeout -k 10 "$left" "$PY" benchmarks/bench_arms.py --scale "$scale" --steps "$steps" --warmup 3 \
    --profile-steps "${PROFILE_STEPS:-1}" --nproc "$NPROC" --device cuda --workdir "$WORK/$scale" --json "$OUTDIR/bench_arms_$scale.json" \
    >"$WORK/bench_arms_$scale.log" 2>&1 || rc=$?
  grep -E '^(bench_arms|arm |ratio |per-layer|\|)' "$WORK/bench_arms_$scale.log" | tee -a "$SUMMARY"
  [ "$rc" = 0 ] || tail -n 30 "$WORK/bench_arms_$scale.log" | tee -a "$SUMMARY"
  say "[$scale] rc=$rc after $(( SECONDS - START ))s"
  rm -rf "$WORK/$scale"/runs/*/checkpoints/step-*   # ZeRO checkpoints are GBs; metrics.jsonl stays
done
tar czf "$OUTDIR/gpu_bench_logs.tgz" -C "$WORK" --exclude='*/runs/*/checkpoints/step-*' . 2>/dev/null
echo "== SUMMARY == ($(( SECONDS - START ))s)"
cat "$SUMMARY"
