"""The exit codes of `prism` (the one place they are defined; launchers/train_job.sh, the sweep and the search
decide a requeue by them, and the shell job body repeats the numbers it cannot import)."""

EXIT_FINISHED = 0  # the token budget is done (prism train), or the verb did what it was asked
# prism train: an unexpected exception (Python's own status, with its traceback; exit record `crashed STEP`): the
# job script restarts it from `latest` within PRISM_MAX_RESTARTS and stops a crash loop (launchers/recovery.py)
EXIT_CRASHED = 1
EXIT_BAD_INPUT = 2  # one line naming the cause and the fix, no traceback
EXIT_STOPPED = 3  # prism train: a stop signal (SIGTERM/SIGUSR1/SIGUSR2/SIGINT), checkpointed: requeue to resume
EXIT_NONFINITE = 4  # prism train: NaN/inf loss, diagnostics written, the last good checkpoint kept: no requeue
# prism train: the infrastructure failed, not the input (checkpoint writes failing in a row, a lost rank, a
# collective timeout; exit record `infra STEP`): the job script restarts it within its bounds from `latest`
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
# which torchrun's exit status cannot say (a stop signal after a checkpoint). train_job.sh, launchers.recovery
# and the search read it through parse_exit_record; the job body's shell `case` repeats the reason words.
RECORD_REASONS = {
    EXIT_FINISHED: "finished",
    EXIT_CRASHED: "crashed",
    EXIT_BAD_INPUT: "bad_input",
    EXIT_STOPPED: "signal",
    EXIT_NONFINITE: "nonfinite",
    EXIT_INFRA: "infra",
}


def parse_exit_record(text: str) -> tuple[str, int] | None:
    """(reason, step) of an exit record's text; None for anything else (empty, torn, another format)."""
    reason, _, step = text.strip().partition(" ")
    if reason not in RECORD_REASONS.values() or not step.isdigit():
        return None
    return reason, int(step)
