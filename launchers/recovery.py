"""The job script's two Python calls (launchers/train_job.sh): everything it needs before the first step, and
the verdict after each step (pipeline/restart.py decides; the script carries the verdict out).

    python -m launchers.recovery prepare NODES PROCS_PER_NODE CONFIG [overrides...]
    python -m launchers.recovery verdict HISTORY_FILE EXIT_STATUS SIGNALED EXIT_FILE CONFIG [overrides...]

`prepare` refuses a layout the config cannot use or a bad PRISM_SHUTDOWN_GRACE / PRISM_SIGNAL_LEAD in one line
on stderr (exit 2), before srun starts anything; else it makes the diagnostics folder and prints KEY=VALUE
lines to export: the layout line, the signals the script traps and sends, the status of a step not started, torchrun's signal environment and
grace (pipeline/signals.py), NCCL's flight recorder path.

`verdict` prints `ACTION EXIT_STATUS LINE` (ACTION: done, requeue, stop or restart) and extends the job's
failure history (HISTORY_FILE) by a counted failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pipeline import config, faults, restart, signals
from pipeline.config import ConfigError
from pipeline.exit_codes import EXIT_BAD_INPUT


def describe(nodes: int, procs_per_node: int, cfg: config.Config) -> str:
    """The layout line; raises ConfigError when the world cannot run ``cfg``."""
    world = nodes * procs_per_node
    tp = cfg.parallel.tp
    if world % tp:
        raise ConfigError(
            f"{nodes} node(s) x {procs_per_node} proc(s) = world {world} is not divisible by parallel.tp={tp}; "
            f"use a number of processes per node (PRISM_NPROC_PER_NODE) or nodes whose product is a multiple of {tp}"
        )
    if procs_per_node % tp and tp % procs_per_node:
        # Megatron's TP groups are consecutive ranks: a group would straddle nodes unevenly.
        raise ConfigError(
            f"parallel.tp={tp} and {procs_per_node} proc(s) per node: tensor-parallel groups would straddle nodes; "
            f"use a multiple or a divisor of {tp} processes per node"
        )
    dp = world // tp
    steps = cfg.steps(dp)  # refuses a batch that does not split over DP
    return (
        f"layout: {nodes} node(s) x {procs_per_node} proc(s) = world {world} = TP {tp} x DP {dp}, "
        f"{steps['total']} steps, grad_accum {steps['grad_accum']}"
    )


def prepare(nodes: int, procs_per_node: int, cfg: config.Config, environ: dict[str, str]) -> dict[str, str]:
    """The KEY=VALUE pairs the job script exports; raises ConfigError (or ValueError for the grace)."""
    from pipeline.distributed import diagnostics_dir

    grace = signals.job_grace(environ)
    layout = describe(nodes, procs_per_node, cfg)
    diagnostics = diagnostics_dir(cfg)
    diagnostics.mkdir(parents=True, exist_ok=True)
    return {
        "PRISM_LAYOUT": layout,
        "PRISM_TRAP_SIGNALS": " ".join(name.removeprefix("SIG") for name in signals.STOP_SIGNALS),
        "PRISM_ASK_TO_STOP": signals.ASK_TO_STOP.removeprefix("SIG"),
        "PRISM_NOT_STARTED": str(restart.NOT_STARTED),  # the status `verdict` takes for a step not started
        **signals.torchrun_env(grace, environ),
        # NCCL's flight recorder: the last collectives of every rank, dumped when one times out (`torchfrtrace`)
        "TORCH_FR_DUMP_TEMP_FILE": environ.get("TORCH_FR_DUMP_TEMP_FILE") or f"{diagnostics}/nccl_trace_rank_",
    }


def main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    try:
        if command == "prepare" and len(args) >= 3 and args[0].isdigit() and args[1].isdigit():
            cfg = config.load(args[2], args[3:])
            for key, value in prepare(int(args[0]), int(args[1]), cfg, dict(os.environ)).items():
                print(f"{key}={value}")
            return 0
        if command == "verdict" and len(args) >= 5 and args[1].lstrip("-").isdigit():
            history, status, signaled, exit_file = Path(args[0]), int(args[1]), args[2] == "1", Path(args[3])
            record = exit_file.read_text() if exit_file.is_file() else ""
            no_requeue = "" if os.environ.get("PRISM_REQUEUE", "1") == "1" else "PRISM_REQUEUE=0"
            cfg = config.load(args[4], args[5:])
            v = restart.judge(record, status, signaled, history, cfg, os.environ, no_requeue)
            faults.pause_verdict()
            print(f"{v.action} {v.exit_status} {v.line}", flush=True)
            return 0
    except (ConfigError, ValueError) as e:
        if command == "verdict":  # the script reads a verdict on stdout
            print(f"{restart.STOP} {EXIT_BAD_INPUT} error: {e}; not restarting", flush=True)
            return 0
        print(f"train_job: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("train_job: usage:", *__doc__.strip().splitlines()[2:4], sep="\n", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
