"""The restart policy: what follows the end of a `prism train` step. One function, `decide`, for the job
script (launchers/train_job.sh, through launchers/recovery.py) and for sweep and search jobs
(runs.launch.TrainJob); they only carry its verdict out.

- done: the token budget is done (also when a stop signal lands after the final checkpoint).
- requeue: a stop signal arrived; the run resumes from `latest` in a new allocation. Also when the signal came
  between a crash and the next start (before the verdict or after it): restarting would run into the time
  limit.
- stop: retrying cannot help (NaN/inf, bad input), a crash loop, or the restart bound is used up.
- restart: a crash, an infrastructure fault or a step that died without an exit record restarts from
  `latest` in this allocation, up to PRISM_MAX_RESTARTS times per job (requeues included). A crash loop, the
  same step failing again after a restart, stops at once.

Why 3 restarts: Llama 3 405B's training saw 419 interruptions in 54 days on 16k GPUs, about 5e-4 per GPU-day.
The 757M run (8 GPUs for 9 hours, or 64 GPUs for a day or two) expects far below one; three failures in one
job mean a sick node or a bug, and a person should look. The history of failures lives next to the exit
record, so a job requeued after a stop signal keeps counting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError
from pipeline.exit_codes import (
    CODE_OF_REASON,
    DESCRIBE,
    EXIT_CRASHED,
    EXIT_INFRA,
    EXIT_STOPPED,
    parse_exit_record,
)

MAX_RESTARTS = 3  # default of PRISM_MAX_RESTARTS (the module docstring says why)
DONE, REQUEUE, STOP, RESTART = "done", "requeue", "stop", "restart"
# The step's status when it was not started: a stop signal came after the last verdict (a restart), before the
# next start. The job script checks for that right before each start.
NOT_STARTED = -1
HISTORY_FILE = "restart-history.txt"  # a submitit job's failure history, next to its exit record


@dataclass(frozen=True)
class Verdict:
    action: str  # DONE | REQUEUE | STOP | RESTART
    line: str  # what the launcher prints, after its own name; a STOP's starts with "error:"
    exit_status: int  # what the job ends with (0 for DONE and RESTART)
    failed_at: int | None = None  # the step this failure counts at in the history; None: not a failure


def decide(
    record: tuple[str, int] | None,
    status: int,
    signaled: bool,
    history: list[int],
    latest_step: int,
    *,
    max_restarts: int = MAX_RESTARTS,
    no_requeue: str = "",
    where: str = "the checkpoint folder",
) -> Verdict:
    """``record``: the parsed exit record (None when there is none); ``status``: the step's exit status;
    ``signaled``: a stop signal reached the job since the step started (also after it ended); ``history``:
    the steps earlier failures of this job were at; ``latest_step``: the step `latest` names (0 without one);
    ``no_requeue``: why this launcher does not requeue ('' when it does); ``where``: the kept diagnostics."""
    reason, step = record or ("", latest_step)
    if status == NOT_STARTED:
        return _requeue(
            f"a stop signal arrived before the restart; resuming from latest, step {latest_step}", no_requeue
        )
    if reason == "finished" or (record is None and status == 0):  # no record: the trainer said why above
        late = (
            f"a stop signal arrived after the final checkpoint (step exit {status}); nothing to resume; "
            if status
            else ""
        )
        return Verdict(DONE, f"{late}training finished (token budget done)", 0)
    if reason in ("nonfinite", "bad_input"):  # a restart meets them again, signal or not: a person decides
        return Verdict(
            STOP,
            f"error: training failed at step {step}: {DESCRIBE[reason]} (step exit {status}); not retrying",
            CODE_OF_REASON[reason],
        )
    if reason == "signal":
        return _requeue(f"checkpointed at step {step} after a stop signal (step exit {status})", no_requeue)
    what = DESCRIBE[reason]
    if signaled and record is None:  # the signal killed the step before the trainer could checkpoint
        why = f"stopped by a signal before the trainer could checkpoint (step exit {status})"
        return _requeue(f"{why}; resuming from latest, step {latest_step}", no_requeue)
    exit_status = EXIT_INFRA if reason == "infra" else (status or EXIT_CRASHED)
    if history and history[-1] == step:
        return Verdict(
            STOP,
            f"error: crash loop: step {step} failed again after a restart ({what}); not restarting; "
            f"diagnostics in {where} and this job's log",
            exit_status,
            step,
        )
    if len(history) >= max_restarts:
        return Verdict(
            STOP,
            f"error: {what} at step {step}, and all {max_restarts} restarts are used (PRISM_MAX_RESTARTS); "
            f"not restarting; diagnostics in {where} and this job's log",
            exit_status,
            step,
        )
    counted = f"restart {len(history) + 1} of {max_restarts} (PRISM_MAX_RESTARTS) from latest, step {latest_step}"
    if signaled:  # a stop signal between the crash and the next start: the time limit is near
        verdict = _requeue(f"{what} at step {step} (exit {status}), then a stop signal; {counted}", no_requeue)
        return Verdict(verdict.action, verdict.line, exit_status if no_requeue else EXIT_STOPPED, step)
    return Verdict(RESTART, f"{what} at step {step} (exit {status}); {counted}", 0, step)


def _requeue(what: str, no_requeue: str) -> Verdict:
    if no_requeue:
        return Verdict(STOP, f"{what}; not requeueing ({no_requeue})", EXIT_STOPPED)
    return Verdict(REQUEUE, f"{what}; requeueing to resume from latest", EXIT_STOPPED)


# --- the job's side: its history, `latest`, the environment --------------------------------------------
def read_history(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split() if x.isdigit()] if path.is_file() else []


def max_restarts(environ: Mapping[str, str]) -> int:
    value = environ.get("PRISM_MAX_RESTARTS", str(MAX_RESTARTS))
    if not value.isdigit():
        raise ConfigError(f"PRISM_MAX_RESTARTS={value!r} is not a number >= 0; set it to how many restarts a job gets")
    return int(value)


def judge(
    record_text: str,
    status: int,
    signaled: bool,
    history_file: Path,
    cfg: Any,
    environ: Mapping[str, str],
    no_requeue: str = "",
) -> Verdict:
    """`decide` for a step of ``cfg`` that ended, with this job's history (``history_file``, which it
    extends by a counted failure and clears when the run is done) and `latest`. Raises ConfigError on a bad
    PRISM_MAX_RESTARTS."""
    from pipeline import checkpoint
    from pipeline.distributed import diagnostics_dir

    latest = checkpoint.read_latest(cfg.checkpoint_dir)  # unchecked: the step it names is what counts
    verdict = decide(
        parse_exit_record(record_text),
        status,
        signaled,
        read_history(history_file),
        checkpoint.tag_step(latest or "") or 0,
        max_restarts=max_restarts(environ),
        no_requeue=no_requeue,
        where=f"{diagnostics_dir(cfg)} (per-rank stacks, NCCL flight records)",
    )
    if verdict.failed_at is not None:
        with history_file.open("a") as f:
            f.write(f"{verdict.failed_at}\n")
    if verdict.action == DONE:
        history_file.unlink(missing_ok=True)
    return verdict
