"""Exit words: the exit codes of `prism`, the exit record's reasons, the MLflow status of each, and the exit
record's writer and reader (the one place they are defined; pipeline/restart.py decides what follows each)."""

from __future__ import annotations

import os
from pathlib import Path

EXIT_FINISHED = 0  # the token budget is done (prism train), or the verb did what it was asked
# prism train: an unexpected exception (Python's own status, with its traceback; exit record `crashed STEP`):
# restarted from `latest` within PRISM_MAX_RESTARTS, a crash loop stopped (pipeline/restart.py)
EXIT_CRASHED = 1
EXIT_BAD_INPUT = 2  # one line naming the cause and the fix, no traceback
EXIT_STOPPED = 3  # prism train: a stop signal (pipeline/signals.py), checkpointed: requeue to resume
EXIT_NONFINITE = 4  # prism train: NaN/inf loss, diagnostics written, the last good checkpoint kept: no requeue
# prism train: the infrastructure failed, not the input (checkpoint writes failing in a row, a lost rank, a
# collective timeout; exit record `infra STEP`): restarted within its bounds from `latest`
EXIT_INFRA = 5
# python -m pipeline.preflight: this node failed a pre-flight check (launchers.nodes excludes it and requeues)
EXIT_PREFLIGHT = 6

TRAIN_EXIT_CODES = (
    f"{EXIT_FINISHED} done, {EXIT_CRASHED} crashed (the job script restarts it), {EXIT_BAD_INPUT} bad input "
    f"(never retried), {EXIT_STOPPED} stopped by a signal after a checkpoint (requeue), {EXIT_NONFINITE} NaN/inf "
    f"loss (not retried), {EXIT_INFRA} infrastructure fault (restarted)"
)


class InfrastructureFault(RuntimeError):
    """Raised by the core when the machine, not the input, failed; `prism train` writes the exit record
    `infra STEP` and exits EXIT_INFRA. Bad input is never this: it stays EXIT_BAD_INPUT and is not retried."""


# The exit record `REASON STEP` that rank 0 of `prism train` leaves in $PRISM_EXIT_FILE: how the run ended,
# which torchrun's exit status cannot say (a stop signal after a checkpoint).
RECORD_REASONS = {
    EXIT_FINISHED: "finished",
    EXIT_CRASHED: "crashed",
    EXIT_BAD_INPUT: "bad_input",
    EXIT_STOPPED: "signal",
    EXIT_NONFINITE: "nonfinite",
    EXIT_INFRA: "infra",
}
CODE_OF_REASON = {reason: code for code, reason in RECORD_REASONS.items()}

# What each reason means, for the restart lines ('': the step ended without a record).
DESCRIBE = {
    "finished": "the token budget is done",
    "signal": "a stop signal, after a checkpoint",
    "nonfinite": "NaN/inf loss (diagnostics in the checkpoint folder)",
    "bad_input": "bad input (the trainer's line above says the fix)",
    "infra": "infrastructure fault (a lost rank, a timed-out collective or failing checkpoint writes)",
    "crashed": "crash (a Python exception; its traceback is in the job log)",
    "": "the step died without an exit record (a killed or lost process)",
}

# The MLflow status a run ends with, per exit code.
MLFLOW_STATUS = {
    EXIT_FINISHED: "FINISHED",
    EXIT_STOPPED: "KILLED",
    EXIT_CRASHED: "FAILED",
    EXIT_BAD_INPUT: "FAILED",
    EXIT_NONFINITE: "FAILED",
    EXIT_INFRA: "FAILED",
}


def reason_of_status(status: str) -> str:
    """A reason from a journal's finish status where no exit record is left: `failed` for FAILED (NaN/inf or an
    infrastructure fault, the status does not say which), `crashed` for a run that never finished."""
    return {"FINISHED": "finished", "KILLED": "signal", "FAILED": "failed"}.get(status, "crashed")


def parse_exit_record(text: str) -> tuple[str, int] | None:
    """(reason, step) of an exit record's text; None for anything else (empty, torn, another format)."""
    reason, _, step = text.strip().partition(" ")
    if reason not in CODE_OF_REASON or not step.isdigit():
        return None
    return reason, int(step)


def read_exit_record(path: str | Path) -> tuple[str, int] | None:
    """(reason, step) of the record at ``path``; None when there is none or it is torn."""
    try:
        return parse_exit_record(Path(path).read_text())
    except (OSError, UnicodeDecodeError):
        return None


def write_exit_record(reason: str, step: int) -> None:
    """`REASON STEP` into $PRISM_EXIT_FILE (set by the job script or the launcher); nothing when it is unset."""
    path = os.environ.get("PRISM_EXIT_FILE")
    if not path:
        return
    from pipeline.atomic import write_atomic

    try:
        write_atomic(path, f"{reason} {step}\n")
    except OSError as e:  # the launcher then reads the run as ended without a record; training itself is done
        print(f"prism train: could not write the exit record {path}: {e}", flush=True)
