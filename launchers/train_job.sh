#!/usr/bin/env bash
# The body of every launchers/*.sbatch: `srun torchrun ... prism train CONFIG` on each node, pre-timeout
# checkpointing and self-requeue. The thin per-preset files hold the #SBATCH lines, set PRISM_CONFIG and
# `exec` this script (same pid, so Slurm's batch signal lands here).
#
# Environment (all optional unless said):
#   PRISM_CONFIG          preset YAML, relative to PRISM_ROOT (set by the .sbatch file)
#   PRISM_OVERRIDES       extra dotted overrides, space separated: "train.lr=3e-4 tracking.uri=http://h:5000"
#   PRISM_ROOT            the repo checkout                          (default: $SLURM_SUBMIT_DIR)
#   PRISM_VENV            virtualenv to activate                     (default: $PRISM_ROOT/.venv if present)
#   PRISM_MODULES         environment modules to `module load` first, space separated (e.g. "cuda/12.4")
#   PRISM_NPROC_PER_NODE  training processes per node (default: GPUs on the node, 1 without GPUs -> CPU/gloo)
#   PRISM_RDZV_PORT       c10d rendezvous port on the first node      (default 29500)
#   PRISM_SHUTDOWN_GRACE  seconds the workers get to checkpoint after the stop signal (default 150; keep it
#                         below the --signal lead time)
#   PRISM_REQUEUE         1 = requeue after a signal-triggered checkpoint, 0 = just stop (default 1)
#   NCCL_*, TORCH_NCCL_*  any NCCL setting; the defaults below apply only where unset
# CPU-only cluster (how the tests run the tiny preset):
#   SBATCH_GPUS_PER_NODE=0 PRISM_CONFIG=configs/tiny_prism.yaml sbatch launchers/prism_757m.sbatch
#
# Exit/requeue contract: `prism train` exits 0 when the token budget is done (no requeue), 3 after a
# checkpoint forced by SIGTERM/SIGUSR1/SIGUSR2 (requeue), 4 on NaN/inf (no requeue), 2 on bad input.
# torchrun turns any worker failure into its own exit 1, so after a signal we requeue on any non-zero
# status; without a signal only 3 requeues.
set -uo pipefail

: "${PRISM_CONFIG:?set PRISM_CONFIG to a preset YAML (the launchers/*.sbatch files do)}"
: "${SLURM_JOB_ID:?run this through sbatch (SLURM_JOB_ID is unset)}"
PRISM_ROOT=${PRISM_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$PRISM_ROOT" || { echo "train_job: error: PRISM_ROOT=$PRISM_ROOT does not exist" >&2; exit 2; }
[ -f "$PRISM_CONFIG" ] || { echo "train_job: error: PRISM_CONFIG=$PRISM_CONFIG not found under $PRISM_ROOT; set PRISM_CONFIG or PRISM_ROOT" >&2; exit 2; }

if [ -n "${PRISM_MODULES:-}" ]; then
  # shellcheck disable=SC2086
  module load $PRISM_MODULES
fi
PRISM_VENV=${PRISM_VENV:-$PRISM_ROOT/.venv}
# shellcheck disable=SC1091
[ -f "$PRISM_VENV/bin/activate" ] && source "$PRISM_VENV/bin/activate"

# --- distributed layout: one srun task per node, torchrun starts the per-GPU workers ------------------
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${PRISM_RDZV_PORT:-29500}
NNODES=${SLURM_JOB_NUM_NODES:-1}
gpus=${SLURM_GPUS_ON_NODE:-0}
[[ "$gpus" =~ ^[0-9]+$ ]] || gpus=0
if [ "$gpus" -gt 0 ]; then nproc_default=$gpus; else nproc_default=1; fi
NPROC_PER_NODE=${PRISM_NPROC_PER_NODE:-$nproc_default}
export MASTER_ADDR MASTER_PORT

# NCCL defaults (users override by exporting before sbatch; sbatch passes the environment through).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# torchrun forwards only the signals it handles; USR1/USR2 would otherwise kill it without a checkpoint.
export TORCHELASTIC_SIGNALS_TO_HANDLE=${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2}
# How long torchrun waits for workers to finish their checkpoint before SIGKILL (its default is 30 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${PRISM_SHUTDOWN_GRACE:-150}
export PYTHONUNBUFFERED=1

read -r -a overrides <<<"${PRISM_OVERRIDES:-}"
echo "train_job: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $NNODES node(s) x $NPROC_PER_NODE proc(s)," \
  "master $MASTER_ADDR:$MASTER_PORT, config $PRISM_CONFIG ${overrides[*]}"

# --- the pre-timeout signal path ------------------------------------------------------------------------
# `#SBATCH --signal=B:USR1@LEAD` signals only this shell. bash runs traps only between commands, so the
# step runs in the background and we `wait` on it; the trap sends SIGUSR1 to srun, which forwards it to
# torchrun, which hands it to every worker; the trainer checkpoints and exits 3. (Not SIGTERM: srun
# answers SIGTERM by killing the step, so the workers would die before checkpointing.)
signaled=0
step_pid=
forward_stop() {
  signaled=1
  [ -n "$step_pid" ] || return 0
  echo "train_job: got a stop signal; asking the workers to checkpoint (SIGUSR1 to srun $step_pid)"
  kill -USR1 "$step_pid" 2>/dev/null
}
trap forward_stop USR1 USR2 TERM

srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
  torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
  -m pipeline.cli train "$PRISM_CONFIG" "${overrides[@]}" &
step_pid=$!
while :; do
  wait "$step_pid"
  rc=$?
  kill -0 "$step_pid" 2>/dev/null || break  # a trap interrupted `wait`: keep waiting for the step
done

if [ "$rc" -eq 0 ]; then
  echo "train_job: training finished (token budget done)"
  exit 0
fi
if [ "${PRISM_REQUEUE:-1}" = 1 ] && { [ "$rc" -eq 3 ] || { [ "$signaled" = 1 ] && [ "$rc" -ne 4 ] && [ "$rc" -ne 2 ]; }; }; then
  echo "train_job: checkpointed after a stop signal (exit $rc); requeueing job $SLURM_JOB_ID to resume from latest"
  scontrol requeue "$SLURM_JOB_ID"
  exit 3
fi
echo "train_job: training failed (exit $rc); not requeueing" >&2
exit "$rc"
