"""Whether a failed `prism train` step restarts in its allocation (launchers/train_job.sh asks, once per failure).

    python -m launchers.recovery HISTORY_FILE EXIT_STATUS EXIT_RECORD CONFIG [overrides...]
    python -m launchers.recovery --diagnostics CONFIG [overrides...]   # prints the run's diagnostics folder
    python -m launchers.recovery --torchrun-env GRACE_S                  # prints KEY=VALUE lines to export

A crash (exit record `crashed STEP`: a Python exception), an infrastructure fault (`infra STEP`: a lost rank,
a timed-out collective, checkpoint writes failing in a row) or a step that died without a record (a killed or
lost process: the step is then the one `latest` names) restarts from `latest`, up to PRISM_MAX_RESTARTS times
per job (every start of it, requeues included; default 3). A crash loop, the same step failing again after a
restart, stops at once. Prints one line; exits 0 to restart, else with the exit status the job should end
with (5 for an infrastructure fault). Bad input (2) and a non-finite loss (4) never get here: retrying cannot
help them.

Why 3: Llama 3 405B's training saw 419 interruptions in 54 days on 16k GPUs, about 5e-4 per GPU-day. The
757M run (8 GPUs for 9 hours, or 64 GPUs for a day or two) expects far below one; three failures in one job
mean a sick node or a bug, and a person should look. The history lives in the job state folder, so a job
requeued after a stop signal keeps counting.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.exit_codes import EXIT_BAD_INPUT, EXIT_CRASHED, EXIT_INFRA, parse_exit_record
from pipeline.runs.launch import torchrun_env

MAX_RESTARTS = 3  # default of PRISM_MAX_RESTARTS (the module docstring says why)

WHAT = {
    "infra": "infrastructure fault (a lost rank, a timed-out collective or failing checkpoint writes)",
    "crashed": "crash (a Python exception; its traceback is in the job log)",
    "": "the step died without an exit record (a killed or lost process)",
}


@dataclass(frozen=True)
class Verdict:
    restart: bool
    line: str
    exit_status: int  # 0 when restarting
    step: int  # the step this failure counts at


def decide(record: str, status: int, history: list[int], latest_step: int, max_restarts: int, where: str) -> Verdict:
    """``record``: the exit record ('' when none); ``history``: the steps earlier failures of this job were
    at; ``latest_step``: the step `latest` names (0 without one); ``where``: the kept diagnostics."""
    parsed = parse_exit_record(record)
    reason = parsed[0] if parsed and parsed[0] in WHAT else ""
    step = parsed[1] if reason else latest_step
    what = WHAT[reason]
    exit_status = EXIT_INFRA if reason == "infra" else (status or EXIT_CRASHED)
    if history and history[-1] == step:
        return Verdict(
            False,
            f"train_job: error: crash loop: step {step} failed again after a restart ({what}); not restarting; "
            f"diagnostics in {where} and this job's log",
            exit_status,
            step,
        )
    if len(history) >= max_restarts:
        return Verdict(
            False,
            f"train_job: error: {what} at step {step}, and all {max_restarts} restarts are used "
            f"(PRISM_MAX_RESTARTS); not restarting; diagnostics in {where} and this job's log",
            exit_status,
            step,
        )
    return Verdict(
        True,
        f"train_job: {what} at step {step} (exit {status}); restart {len(history) + 1} of {max_restarts} "
        f"(PRISM_MAX_RESTARTS) from latest, step {latest_step}",
        0,
        step,
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--torchrun-env"]:
        grace = argv[1] if len(argv) > 1 else ""
        if not grace.isdigit():
            # stderr: train_job.sh captures stdout for the KEY=VALUE lines
            print(f"train_job: error: PRISM_SHUTDOWN_GRACE={grace!r} is not a number of seconds >= 0", file=sys.stderr)
            return EXIT_BAD_INPUT
        for key, value in torchrun_env(int(grace)).items():
            print(f"{key}={value}")
        return 0
    from pipeline import checkpoint, config
    from pipeline.distributed import diagnostics_dir

    if argv[:1] == ["--diagnostics"]:  # where the job script points NCCL's flight recorder
        print(diagnostics_dir(config.load(argv[1], argv[2:])))
        return 0
    history_file, status, record, config_path, overrides = Path(argv[0]), int(argv[1]), argv[2], argv[3], argv[4:]
    cfg = config.load(config_path, overrides)
    tag = checkpoint.read_latest(cfg.checkpoint_dir) or ""
    latest_step = int(tag[5:]) if tag.startswith("step-") and tag[5:].isdigit() else 0
    history = [int(x) for x in history_file.read_text().split()] if history_file.is_file() else []
    max_restarts = os.environ.get("PRISM_MAX_RESTARTS", str(MAX_RESTARTS))
    if not max_restarts.isdigit():
        print(f"train_job: error: PRISM_MAX_RESTARTS={max_restarts!r} is not a number >= 0; not restarting", flush=True)
        return EXIT_BAD_INPUT
    where = f"{diagnostics_dir(cfg)} (per-rank stacks, NCCL flight records)"
    verdict = decide(record, status, history, latest_step, int(max_restarts), where)
    if verdict.restart:
        with history_file.open("a") as f:
            f.write(f"{verdict.step}\n")
    print(verdict.line, flush=True)
    return verdict.exit_status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
