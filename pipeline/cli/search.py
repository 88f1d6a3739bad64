"""`prism search SPEC.yaml [--dry-run] [--resume]`: ASHA over schedules with real runs (pipeline.search)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "search",
        help="search schedules (and lr) with asynchronous successive halving over real `prism train` runs",
        description="SPEC.yaml keys: name, config (preset or YAML), overrides, folder, space (schedules: "
        "all-valid | {stages, min_heads} | list; lr: {low, high}), rungs (min_tokens, reduction_factor, "
        "full_tokens), trials, concurrency, sampler (grid | tpe | random), pruner (asha | hyperband), seed, "
        "executor (local | slurm), nproc_per_node, slurm (the sweep's settings), confirm (top_k, seeds). "
        "Optuna's study is <folder>/optuna-journal.log (optuna-dashboard opens it); the driver's record of "
        "its runs is <folder>/search.json.",
        epilog="example: prism search launchers/searches/example.yaml --dry-run --peak-tflops 989",
    )
    p.add_argument("spec", help="search YAML")
    p.add_argument("--dry-run", action="store_true", help="print trials, rungs, tokens and GPU hours; run nothing")
    p.add_argument("--resume", action="store_true", help="continue the search in the spec's folder after a driver died")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the dry run's GPU hours")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU (default train.peak_flops)")
    p.add_argument("--poll-s", type=float, default=2.0, help="seconds between the driver's looks at its runs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.search import dry_run, load_spec, run_search

    spec = load_spec(args.spec)
    if args.dry_run:
        peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
        print(dry_run(spec, args.mfu, peak or spec.base.train.peak_flops))
        return 0
    return run_search(spec, resume=args.resume, poll_s=args.poll_s)
