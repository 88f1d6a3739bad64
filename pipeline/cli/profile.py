"""`prism profile RUN_DIR --steps N [--memory]`: ask a live run for a trace of its next N steps
(pipeline.profiling); works from a login node under Slurm, no shell on the compute node needed."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="ask a running training run for a torch-profiler trace of its next N steps (a request file)",
        description="Writes RUN_DIR/profile/request.json. The run's rank 0 reads it at the next sync step "
        "(train.log_every), every rank traces the N steps after it and writes RUN_DIR/profile/step-A-B/"
        "rank-R.json.gz (open it at ui.perfetto.dev), rank 0 logs the files to MLflow and renames the request to "
        "served.json there. docs/performance.md explains the trace.",
    )
    p.add_argument("run_dir", help="the run's folder, <run.output_dir>/<arm>-<scale>-s<seed>")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps to trace")
    p.add_argument(
        "--memory",
        action="store_true",
        help="also a CUDA memory snapshot of those steps (rank-R.memory.pickle, for pytorch.org/memory_viz); "
        "on CPU the profiler's per-op memory table",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.config import ConfigError
    from pipeline.profiling import MAX_STEPS, request_path, write_request

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a folder; pass a run's folder, e.g. runs/prism-tiny-s1234")
    if not 1 <= args.steps <= MAX_STEPS:
        raise ConfigError(f"--steps {args.steps} is not in [1, {MAX_STEPS}]; e.g. --steps 2")
    if request_path(run_dir).exists():
        raise ConfigError(
            f"{request_path(run_dir)} is already waiting for the run; it is served at the next "
            "sync step (delete it to ask for something else)"
        )
    path = write_request(run_dir, args.steps, args.memory)
    print(
        f"prism profile: asked {run_dir} for {args.steps} traced steps{' with memory' if args.memory else ''} "
        f"({path}); the traces appear in {run_dir / 'profile'}/step-A-B/ after the run's next sync step"
    )
    return 0
