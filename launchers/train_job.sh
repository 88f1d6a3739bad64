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
#   PRISM_RDZV_PORT       c10d rendezvous port on the first node (default: $MASTER_PORT if exported, else
#                         20000 + job id mod 10000, so two jobs sharing a node do not collide)
#   PRISM_CPUS_PER_TASK   CPUs of the one task per node (torchrun, its workers and their data loaders); passed
#                         to srun, which no longer inherits --cpus-per-task (Slurm >= 22.05)
#                         (default: sbatch's --cpus-per-task, else every CPU the job has on the node)
#   PRISM_JOB_STATE_DIR   where the trainer leaves its exit record for this script; must be seen by every
#                         node (default $PRISM_ROOT/runs/.slurm-jobs)
#   PRISM_SIGNAL_LEAD     the lead of the sbatch file's `--signal=B:USR1@LEAD` in seconds (default 180)
#   PRISM_SHUTDOWN_GRACE  seconds the workers get to checkpoint after the stop signal (default: the lead less
#                         30 s for the requeue, pipeline/signals.py)
#   PRISM_REQUEUE         1 = requeue after a signal-triggered checkpoint, 0 = just stop (default 1)
#   PRISM_MAX_RESTARTS    restarts of a crashed step (exit 1 or 5, or killed) in the allocation, per job across
#                         its requeues; a crash loop (the same step failing again) stops sooner (default 3,
#                         pipeline/restart.py says why)
#   PRISM_PREFLIGHT_MIN_ALLREDUCE_GBPS  the per-node pre-flight's floor on the all-reduce bus bandwidth over a
#                         node's GPUs, GB/s (default 100; PCIe-only nodes need less; launchers/nodes.py)
#   NCCL_*, TORCH_NCCL_*  any NCCL setting; the defaults below apply only where unset
# CPU-only cluster (how the tests run the tiny preset):
#   SBATCH_GPUS_PER_NODE=0 PRISM_CONFIG=configs/tiny_prism.yaml sbatch launchers/prism_757m.sbatch
#
# What follows each step is pipeline/restart.py's verdict (through launchers/recovery.py): done, requeue (a stop
# signal; the run resumes from latest), stop (NaN/inf, bad input, a crash loop, the restart bound) or restart
# (a crash, an infrastructure fault, a killed step: a new srun from latest in this allocation). torchrun's own
# status says little (1 for any failed worker), so rank 0 leaves an exit record (PRISM_EXIT_FILE, `REASON STEP`,
# pipeline/exit_codes.py) and the verdict reads it, with whether a stop signal reached this shell.
# Before each start of the step, launchers/nodes.py runs the pre-flight on every node: a node that fails it is
# excluded and the job requeued (3), within PRISM_MAX_RESTARTS exclusions; past them the job ends with 6.
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
first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The first node's address as Slurm knows it (NodeAddr; the node name itself where it resolves, as usual).
MASTER_ADDR=$(scontrol show node "$first_node" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
MASTER_ADDR=${MASTER_ADDR:-$first_node}
MASTER_PORT=${PRISM_RDZV_PORT:-${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}}
NNODES=${SLURM_JOB_NUM_NODES:-1}
gpus=${SLURM_GPUS_ON_NODE:-0}
[[ "$gpus" =~ ^[0-9]+$ ]] || gpus=0
if [ "$gpus" -gt 0 ]; then nproc_default=$gpus; else nproc_default=1; fi
NPROC_PER_NODE=${PRISM_NPROC_PER_NODE:-$nproc_default}
CPUS_PER_TASK=${PRISM_CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}}
export MASTER_ADDR MASTER_PORT
export SRUN_CPUS_PER_TASK=$CPUS_PER_TASK  # Slurm >= 22.05: srun no longer inherits --cpus-per-task

# NCCL defaults (users override by exporting before sbatch; sbatch passes the environment through).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A timed-out NCCL collective aborts the process (3: without tearing the communicators down, which can hang
# too) instead of leaving it stuck; the job script then restarts the step (docs/cluster.md).
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export PYTHONUNBUFFERED=1

read -r -a overrides <<<"${PRISM_OVERRIDES:-}"
echo "train_job: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $NNODES node(s) x $NPROC_PER_NODE proc(s)" \
  "($SLURM_JOB_NODELIST), $CPUS_PER_TASK CPUs per node task, master $MASTER_ADDR:$MASTER_PORT," \
  "config $PRISM_CONFIG ${overrides[*]}"
# One call before anything starts on the nodes: the layout (a bad one is refused in one line), the signals and
# torchrun's grace, the diagnostics folder; KEY=VALUE lines to export.
prepared=$(python -m launchers.recovery prepare "$NNODES" "$NPROC_PER_NODE" "$PRISM_CONFIG" "${overrides[@]}") || exit 2
while IFS= read -r kv; do export "${kv?}"; done <<<"$prepared"
echo "train_job: $PRISM_LAYOUT"
# NCCL's flight recorder (its dump path came with the rest, next to the per-rank Python stacks; read it with
# `torchfrtrace DIR`, docs/cluster.md).
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}}  # the older name too
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}

# Where rank 0 says how training ended (one file per job, requeue and restart), and the steps this job's
# earlier failures were at (the restart bound and crash loops count across requeues).
state_dir=${PRISM_JOB_STATE_DIR:-$PRISM_ROOT/runs/.slurm-jobs}
mkdir -p "$state_dir"
failures="$state_dir/$SLURM_JOB_ID.failures"

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
  echo "train_job: got a stop signal; asking the workers to checkpoint (SIG$PRISM_ASK_TO_STOP to srun $step_pid)"
  kill -"$PRISM_ASK_TO_STOP" "$step_pid" 2>/dev/null
}
# shellcheck disable=SC2086
trap forward_stop $PRISM_TRAP_SIGNALS

# Before each start of a step (every srun below): the pre-flight on every node. A node that fails it is
# excluded and the job requeued (launchers/nodes.py carries that out, within PRISM_MAX_RESTARTS exclusions).
before_start() {
  python -m launchers.nodes preflight "$state_dir" "$NNODES" "$NPROC_PER_NODE" "$PRISM_CONFIG" "${overrides[@]}"
  local preflight_status=$?
  [ "$preflight_status" -eq 0 ] || exit "$preflight_status"
}

# Carrying out a requeue verdict: the job goes back to the queue and resumes from latest.
requeue_job() { scontrol requeue "$SLURM_JOB_ID"; }

# The nodes this job was kept off (a node that failed its pre-flight), for the run's MLflow tags.
PRISM_EXCLUDED_NODES=$(python -m launchers.nodes excluded)
export PRISM_EXCLUDED_NODES
# The trainer may stop on its own before the job's end (pipeline/slurm_job.py) only where a stop is requeued.
export PRISM_REQUEUES_A_STOP=${PRISM_REQUEUE:-1}

attempt=0
while :; do
  export PRISM_EXIT_FILE="$state_dir/$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}.$attempt.exit"
  rm -f "$PRISM_EXIT_FILE"
  before_start
  if [ "$signaled" = 1 ]; then  # a stop signal after the last verdict (a restart): do not start
    rc=$PRISM_NOT_STARTED
  else
    srun --nodes="$NNODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=1 \
      torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
      --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID.$attempt" \
      -m pipeline.cli train "$PRISM_CONFIG" "${overrides[@]}" &
    step_pid=$!
    # a stop signal between the check above and `step_pid` being set: hand it to the step
    [ "$signaled" = 1 ] && forward_stop
    while :; do
      wait "$step_pid"
      rc=$?
      kill -0 "$step_pid" 2>/dev/null || break  # a trap interrupted `wait`: keep waiting for the step
    done
    step_pid=
  fi

  verdict=$(python -m launchers.recovery verdict "$failures" "$rc" "$signaled" "$PRISM_EXIT_FILE" \
    "$PRISM_CONFIG" "${overrides[@]}")
  rm -f "$PRISM_EXIT_FILE"
  read -r action status line <<<"$verdict"
  case "$action" in
    restart) echo "train_job: $line" ;;
    done)
      echo "train_job: $line"
      exit 0
      ;;
    requeue)
      echo "train_job: $line (job $SLURM_JOB_ID)"
      requeue_job
      exit "$status"
      ;;
    stop)
      echo "train_job: $line" >&2
      exit "$status"
      ;;
    *)
      echo "train_job: error: no restart verdict for the step (exit $rc): '$verdict'; not restarting" >&2
      exit "$rc"
      ;;
  esac
  attempt=$((attempt + 1))
done
