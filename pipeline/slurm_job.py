"""What Slurm tells a job about itself and about others: its id, another job's state, the real end of this
job (SLURM_JOB_END_TIME, or squeue's EndTime where Slurm does not set it, as 22.05 does not; a `--time-min`
grant makes it earlier than `--time`) and how many requeues it has left before Slurm holds it
(SLURM_RESTART_COUNT against the scheduler's MaxBatchRequeue).

Nothing here needs Slurm: outside a job every answer is "nothing known", and a Slurm command that cannot be
run or answers nothing useful gives None, never an exception.
"""

from __future__ import annotations

import os
import subprocess
import time

from pipeline.config import ConfigError

# Job states in which a job's processes may still run (squeue's %T names).
ACTIVE_STATES = frozenset(
    {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"}
)
# Slurm's default for the requeues a batch job may take before it is held (MaxBatchRequeue).
SLURM_MAX_BATCH_REQUEUE = 5
MAX_BATCH_REQUEUE_ENV = "PRISM_MAX_BATCH_REQUEUE"


def job_id(environ: dict[str, str] | None = None) -> str | None:
    """This process's Slurm job as squeue names it: `ARRAYJOB_TASK` for an array task, else SLURM_JOB_ID."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def job_state(job: str) -> str | None:
    """A job's state (RUNNING, PENDING, COMPLETED, ...), '' for a job Slurm no longer knows, None when Slurm
    cannot be asked (no squeue, no controller)."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode == 0:
        return out.stdout.split()[0] if out.stdout.split() else ""
    return "" if "invalid job id" in out.stderr.lower() else None


# --- the job's real end --------------------------------------------------------------------------------
class JobEnd:
    """When this job ends (SLURM_JOB_END_TIME, a Unix time) and whether the run must stop now to write its
    final checkpoint before then: once the time left is under what a final save may take (the Saver's
    measurement), the longest step and ``margin_s``. Global rank 0 asks after every step; the stop agreement tells the others."""

    def __init__(self, end: float, margin_s: float, source: str = "SLURM_JOB_END_TIME") -> None:
        self.end, self.margin_s, self.source = end, margin_s, source
        self.last: float | None = None  # the first step (compilation, warm-up) is not a step's time
        self.longest_step = 0.0

    @classmethod
    def of_this_job(cls, margin_s: float, environ: dict[str, str] | None = None) -> JobEnd | None:
        """SLURM_JOB_END_TIME (newer Slurm sets it; 22.05 does not), else the job's EndTime from squeue. None
        outside Slurm, where the job has no end (a partition without a time limit), or where nothing would
        requeue a run that stops on its own: only train_job.sh does, and says so with PRISM_REQUEUES_A_STOP=1
        (a sweep or search job is requeued by submitit on its pre-timeout signal alone). Asked once, by global
        rank 0."""
        env = os.environ if environ is None else environ
        if env.get("PRISM_REQUEUES_A_STOP") != "1":
            return None
        if end := _unix_time(env.get("SLURM_JOB_END_TIME", "")):
            return cls(end, margin_s)
        if (job := job_id(env)) and (end := squeue_end_time(job)):
            return cls(end, margin_s, "squeue's EndTime")
        return None

    def due(self, save_s: float | None, now: float | None = None) -> str | None:
        """After a step: why the run checkpoints and stops now (one line), or None while there is time."""
        tick = time.monotonic()
        if self.last is not None:
            self.longest_step = max(self.longest_step, tick - self.last)
        self.last = tick
        left = self.end - (time.time() if now is None else now)
        needed = (save_s or 0.0) + self.longest_step + self.margin_s
        if left > needed:
            return None
        return (
            f"the job ends in {max(left, 0):.0f} s ({self.source}), under the {needed:.0f} s a final "
            f"checkpoint needs (save {save_s or 0:.1f} s + longest step {self.longest_step:.1f} s + "
            f"checkpoint.end_margin_s {self.margin_s:g} s)"
        )


def _unix_time(value: str) -> float | None:
    try:
        return float(value) if float(value) > 0 else None
    except ValueError:
        return None


def squeue_end_time(job: str) -> float | None:
    """The job's EndTime (squeue's %e, local time) as a Unix time; None when unknown or unlimited."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30)
        return time.mktime(time.strptime(out.stdout.strip(), "%Y-%m-%dT%H:%M:%S"))
    except (OSError, subprocess.TimeoutExpired, ValueError, OverflowError):
        return None


# --- requeues left --------------------------------------------------------------------------------------
def max_batch_requeue_override(environ: dict[str, str] | None = None) -> int | None:
    """PRISM_MAX_BATCH_REQUEUE, for clusters where `scontrol show config` is not allowed; None when unset.
    Every rank checks it before the process group exists, so a bad value ends them all alike."""
    env = os.environ if environ is None else environ
    value = env.get(MAX_BATCH_REQUEUE_ENV)
    if value is None:
        return None
    if not value.isdigit():
        raise ConfigError(
            f"{MAX_BATCH_REQUEUE_ENV}={value!r} is not a whole number >= 0; set it to the cluster's "
            "MaxBatchRequeue (scontrol show config) or unset it"
        )
    return int(value)


def max_batch_requeue(environ: dict[str, str] | None = None) -> tuple[int, str]:
    """The requeues Slurm allows a batch job, and where that number comes from: PRISM_MAX_BATCH_REQUEUE when
    set, else MaxBatchRequeue from `scontrol show config`, else Slurm's default 5."""
    if (override := max_batch_requeue_override(environ)) is not None:
        return override, MAX_BATCH_REQUEUE_ENV
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return SLURM_MAX_BATCH_REQUEUE, "Slurm's default"
    if (limit := config_max_batch_requeue(out.stdout)) is not None:
        return limit, "scontrol show config"
    return SLURM_MAX_BATCH_REQUEUE, "Slurm's default"


def config_max_batch_requeue(config: str) -> int | None:
    """MaxBatchRequeue in `scontrol show config`'s text: its own line, or an option of SchedulerParameters."""
    for line in config.splitlines():
        name, _, value = (part.strip() for part in line.partition("="))
        options = value.split(",") if name == "SchedulerParameters" else [f"{name}={value}"]
        for option in options:
            key, _, number = option.partition("=")
            if key.lower() in ("maxbatchrequeue", "max_batch_requeue") and number.isdigit():
                return int(number)
    return None


def requeue_warning(environ: dict[str, str] | None = None) -> str | None:
    """A warning when this job has one requeue left, or none, before Slurm holds it; None otherwise."""
    env = os.environ if environ is None else environ
    count = env.get("SLURM_RESTART_COUNT", "")
    if not count.isdigit():
        return None
    limit, source = max_batch_requeue(env)
    if int(count) < limit - 1:
        return None
    return (
        f"warning: this job has been requeued {count} times, MaxBatchRequeue is {limit} ({source}): after "
        f"{max(limit - int(count), 0)} more Slurm holds it; resubmit the run as a new job (it resumes from "
        "latest) or `scontrol release` it"
    )
