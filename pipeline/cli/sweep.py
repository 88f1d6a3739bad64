"""`prism sweep SPEC.yaml [--dry-run]`: submit a grid of training runs (pipeline.sweep) or print it."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="submit arms x scales x seeds x schedules, one submitit job per run",
        description="SPEC.yaml keys: name, arms, scales (or configs: preset paths), seeds, schedules (list | "
        "all-valid | null), overrides (mapping or list of dotted overrides), cooldown (from_steps, decay_tokens | "
        "decay_fraction, decay_shape: each point's cooldown branches at those steps, as prism cooldown), "
        "executor (slurm | local), folder, "
        "nproc_per_node, slurm (nodes, gpus_per_node, cpus_per_task, timeout_min, partition, "
        "signal_delay_s, additional_parameters).",
    )
    p.add_argument("spec", help="sweep YAML")
    p.add_argument("--dry-run", action="store_true", help="print the grid and the job count; submit nothing")
    p.add_argument("--executor", choices=["slurm", "local"], help="override the spec's executor")
    p.add_argument("--wait", action="store_true", help="block until every job finished; exit 1 if one failed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline import sweep

    spec = sweep.load_spec(args.spec)
    if args.dry_run:
        print(sweep.grid_table(sweep.grid_of_spec(spec)))
        return 0
    s = sweep.submit_spec(spec, args.executor)
    for p, job in zip(s.points, s.jobs):
        print(f"{p.label}: job {job.job_id}")
    print(f"jobs: {len(s.jobs)}; manifest {s.manifest_path}")
    if args.wait:
        failed = s.failures()
        for line in failed:
            print(line)
        return 1 if failed else 0
    return 0
