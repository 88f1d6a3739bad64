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
#   PRISM_SHUTDOWN_GRACE  seconds the workers get to checkpoint after the stop signal (default 150; keep it
#                         below the --signal lead time)
#   PRISM_REQUEUE         1 = requeue after a signal-triggered checkpoint, 0 = just stop (default 1)
#   PRISM_MAX_RESTARTS    restarts of a crashed step (exit 1 or 5, or killed) in the allocation, per job across
#                         its requeues; a crash loop (the same step failing again) stops sooner (default 3,
#                         launchers/recovery.py says why)
#   PRISM_PREFLIGHT_MIN_ALLREDUCE_GBPS  the per-node pre-flight's floor on the all-reduce bus bandwidth over a
#                         node's GPUs, GB/s (default 100; PCIe-only nodes need less; launchers/nodes.py)
#   NCCL_*, TORCH_NCCL_*  any NCCL setting; the defaults below apply only where unset
# CPU-only cluster (how the tests run the tiny preset):
#   SBATCH_GPUS_PER_NODE=0 PRISM_CONFIG=configs/tiny_prism.yaml sbatch launchers/prism_757m.sbatch
#
# Exit/requeue contract (the numbers are pipeline/exit_codes.py's): `prism train` exits 0 when the token
# budget is done (no requeue), 3 after a checkpoint forced by SIGTERM/SIGUSR1/SIGUSR2 (requeue), 4 on NaN/inf
# (no requeue), 2 on bad input (no retry), 5 on an infrastructure fault and 1 on a crash (both restarted here
# from latest, launchers/recovery.py decides: up to PRISM_MAX_RESTARTS, never a crash loop).
# torchrun's own status says little (a signal sent to the step, `scancel --signal=USR1 JOB`, kills it with
# 138 after the workers checkpointed), so rank 0 also writes an exit record (PRISM_EXIT_FILE: "signal STEP",
# "finished STEP", "nonfinite STEP", "infra STEP", "crashed STEP", "bad_input 0") and that decides: signal -> requeue, finished -> done (also when a
# late signal killed torchrun after the final checkpoint), no record -> failed unless a signal reached this
# shell before the trainer could checkpoint (then requeue: it resumes from the last checkpoint).
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
# The signals torchrun forwards to its workers (USR1/USR2 would otherwise kill it, and them, without a
# checkpoint) and how long it waits for their checkpoint before SIGKILL (PRISM_SHUTDOWN_GRACE, default 150 s).
torchrun_env=$(python -m launchers.recovery --torchrun-env "${PRISM_SHUTDOWN_GRACE:-150}") || exit 2
while IFS= read -r kv; do export "$kv"; done <<<"$torchrun_env"
export PYTHONUNBUFFERED=1

read -r -a overrides <<<"${PRISM_OVERRIDES:-}"
echo "train_job: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $NNODES node(s) x $NPROC_PER_NODE proc(s)" \
  "($SLURM_JOB_NODELIST), $CPUS_PER_TASK CPUs per node task, master $MASTER_ADDR:$MASTER_PORT," \
  "config $PRISM_CONFIG ${overrides[*]}"
# Refuse a layout the config cannot use in one line, before srun starts anything on the nodes.
if ! layout=$(python -m launchers.layout "$NNODES" "$NPROC_PER_NODE" "$PRISM_CONFIG" "${overrides[@]}"); then
  echo "train_job: refusing the layout; not requeueing" >&2
  exit 2
fi
echo "train_job: $layout"

# Where rank 0 says how training ended (one file per job, requeue and restart; see the contract above), and
# the steps this job's earlier failures were at (launchers/recovery.py: the restart bound and crash loops).
state_dir=${PRISM_JOB_STATE_DIR:-$PRISM_ROOT/runs/.slurm-jobs}
mkdir -p "$state_dir"
failures="$state_dir/$SLURM_JOB_ID.failures"

# NCCL's flight recorder: the last collectives of every rank, dumped when one times out (read it with
# `torchfrtrace DIR`, docs/cluster.md), next to the per-rank Python stacks in <checkpoint_dir>/diagnostics.
if diagnostics=$(python -m launchers.recovery --diagnostics "$PRISM_CONFIG" "${overrides[@]}"); then
  mkdir -p "$diagnostics"
  export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$diagnostics/nccl_trace_rank_}
fi
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}}  # the older name too
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}

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

# The nodes this job was kept off (a node that failed its pre-flight), for the run's MLflow tags.
PRISM_EXCLUDED_NODES=$(python -m launchers.nodes excluded)
export PRISM_EXCLUDED_NODES

attempt=0
while :; do
  # --- pre-flight on every node (issue 41): a failed node is excluded and the job requeued, within bounds
  python -m launchers.nodes preflight "$state_dir" "$NNODES" "$NPROC_PER_NODE" "$PRISM_CONFIG" "${overrides[@]}"
  preflight_status=$?
  [ "$preflight_status" -eq 0 ] || exit "$preflight_status"
  # --- end pre-flight
  export PRISM_EXIT_FILE="$state_dir/$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}.$attempt.exit"
  rm -f "$PRISM_EXIT_FILE"
  srun --nodes="$NNODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=1 \
    torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID.$attempt" \
    -m pipeline.cli train "$PRISM_CONFIG" "${overrides[@]}" &
  step_pid=$!
  while :; do
    wait "$step_pid"
    rc=$?
    kill -0 "$step_pid" 2>/dev/null || break  # a trap interrupted `wait`: keep waiting for the step
  done

  exit_record=$(cat "$PRISM_EXIT_FILE" 2>/dev/null)
  rm -f "$PRISM_EXIT_FILE"
  case "$exit_record" in
    finished*)
      if [ "$rc" -ne 0 ]; then
        echo "train_job: a stop signal arrived after the final checkpoint (step exit $rc); nothing to resume"
      fi
      echo "train_job: training finished (token budget done)"
      rm -f "$failures"
      exit 0
      ;;
    signal*)
      if [ "${PRISM_REQUEUE:-1}" = 1 ]; then
        echo "train_job: checkpointed at step ${exit_record#signal } after a stop signal (step exit $rc);" \
          "requeueing job $SLURM_JOB_ID to resume from latest"
        scontrol requeue "$SLURM_JOB_ID"
        exit 3
      fi
      echo "train_job: checkpointed after a stop signal (step exit $rc); PRISM_REQUEUE=0, not requeueing"
      exit 3
      ;;
  esac
  if [ "$rc" -eq 0 ]; then  # finished, but its exit record could not be written (the trainer said so)
    echo "train_job: training finished (token budget done)"
    exit 0
  fi
  if [ "${PRISM_REQUEUE:-1}" = 1 ] && [ "$signaled" = 1 ] && [ "$rc" -ne 4 ] && [ "$rc" -ne 2 ]; then
    echo "train_job: stopped by a signal before the trainer could checkpoint (exit $rc); requeueing job" \
      "$SLURM_JOB_ID to resume from the last checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
    exit 3
  fi
  case "$exit_record" in
    nonfinite* | bad_input*)  # retrying cannot help: a person decides (the trainer said how, above)
      echo "train_job: training failed (exit $rc, trainer: $exit_record); not retrying" >&2
      exit "$rc"
      ;;
  esac
  # A crash, an infrastructure fault or a killed step: restart from latest in this allocation, within bounds.
  verdict=$(python -m launchers.recovery "$failures" "$rc" "$exit_record" "$PRISM_CONFIG" "${overrides[@]}")
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "$verdict" >&2
    exit "$status"
  fi
  echo "$verdict"
  attempt=$((attempt + 1))
done
