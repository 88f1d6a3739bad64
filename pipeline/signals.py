"""Stop signals: which signals ask a run to checkpoint and end, which one a launcher sends, and how long the
run gets before it is killed. One list and one grace rule for the trainer (distributed.StopSignal), torchrun
(`torchrun_env`), the job script (its trap, through launchers/recovery.py) and submitit jobs (runs.launch).
Torch-free: the job script's batch shell asks for these without starting a trainer."""

from __future__ import annotations

import os
import signal

# Each asks `prism train` to checkpoint at the next step boundary and exit 3 (SIGINT too: Ctrl-C then costs no
# steps). Slurm's pre-timeout `--signal` sends USR1 (the sbatch files) or USR2 (submitit), scancel TERM.
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")
# What a launcher sends to ask a run to stop: srun answers SIGTERM by killing its step at once, USR1 it forwards.
ASK_TO_STOP = "SIGUSR1"
# torchrun hands these on to its workers: the stop signals (USR1/USR2 would kill it, their default action, and
# its workers with it before they checkpoint) and its own defaults, HUP and QUIT.
TORCHRUN_SIGNALS = (*STOP_SIGNALS, "SIGHUP", "SIGQUIT")

# The lead of the pre-timeout signal: the sbatch files' `--signal=B:USR1@180` and make_executor's
# signal_delay_s. The run gets all of it but REQUEUE_MARGIN_S, which the requeue itself needs.
DEFAULT_SIGNAL_LEAD_S = 180
REQUEUE_MARGIN_S = 30


def stop_signal_numbers() -> list[signal.Signals]:
    return [signal.Signals[name] for name in STOP_SIGNALS]


def shutdown_grace(signal_lead_s: int) -> int:
    """Seconds a run gets to checkpoint after the pre-timeout signal: its lead less the requeue's margin, and
    never under 30 s (torchrun's own default)."""
    return max(30, int(signal_lead_s) - REQUEUE_MARGIN_S)


def torchrun_env(grace_s: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """What torchrun needs to stop its workers gracefully: the signals it forwards to them and how long it
    waits for their checkpoint before SIGKILL (its own default is 30 s).

    torchrun with a `--signals-to-handle` flag (2.13 here) takes the flag's default from PET_SIGNALS_TO_HANDLE
    and overwrites TORCHELASTIC_SIGNALS_TO_HANDLE with it; older ones read only the latter: set both. A list
    the user exported already wins."""
    environ = os.environ if environ is None else environ
    mine = ",".join(TORCHRUN_SIGNALS)
    signals = environ.get("PET_SIGNALS_TO_HANDLE") or environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE") or mine
    return {
        "PET_SIGNALS_TO_HANDLE": signals,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": signals,
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(grace_s),
    }


def job_grace(environ: dict[str, str]) -> int:
    """The job script's grace: PRISM_SHUTDOWN_GRACE when given, else the rule above for PRISM_SIGNAL_LEAD (the
    sbatch file's --signal lead, default 180). Raises ValueError naming the variable that is not a number."""
    for name in ("PRISM_SHUTDOWN_GRACE", "PRISM_SIGNAL_LEAD"):
        value = environ.get(name)
        if value is not None and not value.isdigit():
            raise ValueError(f"{name}={value!r} is not a number of seconds >= 0")
    if environ.get("PRISM_SHUTDOWN_GRACE") is not None:
        return int(environ["PRISM_SHUTDOWN_GRACE"])
    return shutdown_grace(int(environ.get("PRISM_SIGNAL_LEAD", DEFAULT_SIGNAL_LEAD_S)))
