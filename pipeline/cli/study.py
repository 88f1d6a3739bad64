"""`prism study CONFIG... --seeds N [overrides]`: arms (and schedules) x seeds on this machine, then compare."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "study",
        help="train every CONFIG with every seed here, one run after another, then compare with statistics",
        description="Train CONFIG... x seeds locally (each run a `prism train` subprocess; finished runs are "
        "skipped, interrupted ones resume), then print `prism compare`'s table: mean ± std per arm and "
        "schedule, Prism − uniform with a 95% CI and p-value, milestones, seeds needed. For Slurm use "
        "`prism sweep` and then `prism compare`.",
        epilog="example: prism study configs/tiny_uniform.yaml configs/tiny_prism.yaml --seeds 3 "
        "run.output_dir=runs/study",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "items",
        nargs="+",
        metavar="CONFIG|KEY=VALUE",
        help="YAML presets (arms or schedules of one scale, or of several scales on one dataset: a ladder such as "
        "configs/ladder, which ends with `prism scaling`'s report) and dotted overrides applied to all of them",
    )
    p.add_argument("--seeds", default="3", help="a count N (seeds 1..N), a list 1,2,3 or a range 1-3")
    p.add_argument(
        "--jobs", type=int, default=1, help="runs trained at once (more than 1 makes their tokens/s incomparable)"
    )
    p.add_argument(
        "--out",
        default=None,
        help="report folder; None means <run.output_dir>/compare/<experiment> (a ladder: "
        "<out or run.output_dir/compare>/<experiment> per scale and .../scaling)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.config import ConfigError
    from pipeline.study import parse_seeds, run_study

    configs = [a for a in args.items if "=" not in a]
    overrides = [a for a in args.items if "=" in a]
    if not configs:
        raise ConfigError(
            "give at least one CONFIG, e.g. prism study configs/tiny_uniform.yaml configs/tiny_prism.yaml"
        )
    return run_study(configs, parse_seeds(args.seeds), overrides, args.out, args.jobs)
