"""`prism plan CONFIG [--nodes N --gpus-per-node G] [--mfu 0.4] [--peak-tflops T] [overrides]`: what a run will be."""

from __future__ import annotations

import argparse
import dataclasses
import json

from pipeline.checkpoint.plan import FS_GBPS, MTBF_NODE_HOURS, checkpoint_plan, format_checkpoint_plan


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="print a run's layout, steps, epochs, memory per GPU and wall time before launching it",
        description="Layout (TP x DP), micro-batch and grad accumulation, steps, tokens, epochs of the dataset, "
        "per-GPU memory estimate, FLOPs per token and wall time at a given MFU. Pure arithmetic: no GPU needed.",
    )
    p.add_argument("config", help="YAML preset, e.g. configs/prism_757m.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2 train.micro_batch_size=4")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs (ranks) per node (default 1)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the wall time (default 0.4)")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU in TFLOP/s (default train.peak_flops)"
    )
    p.add_argument(
        "--gpu",
        default=None,
        help="GPU model, e.g. H200, 'h100 sxm', A100-80GB (a unique part of a table name, any case): its peak "
        "from the table",
    )
    p.add_argument(
        "--fs-gbps",
        type=float,
        default=FS_GBPS,
        help=f"GB/s the job's ranks together get from the checkpoint file system (default {FS_GBPS:g})",
    )
    p.add_argument(
        "--mtbf-node-hours",
        type=float,
        default=MTBF_NODE_HOURS,
        help=f"mean time between failures of one node, in hours (default {MTBF_NODE_HOURS:,.0f}: Llama 3's 419 "
        "unexpected interruptions in 54 days on 2,048 nodes; docs/cluster.md)",
    )
    p.add_argument("--lr-curve", action="store_true", help="draw the learning-rate schedule in the terminal")
    p.add_argument("--lr-plot", metavar="PNG", help="write the learning-rate schedule to this PNG")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline import config
    from pipeline.budget import budget_json, format_budget, make_budget, read_manifest_if_prepared
    from pipeline.eval.plan import aside_cost, format_aside_cost

    cfg = config.load(args.config, args.overrides)
    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    if peak is None and args.gpu is not None:
        from pipeline.hardware import PEAK_BF16_FLOPS, find_gpu

        try:
            peak = PEAK_BF16_FLOPS[find_gpu(args.gpu)]
        except ValueError as e:
            raise config.ConfigError(str(e)) from None
    budget = make_budget(cfg, args.nodes, args.gpus_per_node, args.mfu, peak, read_manifest_if_prepared(cfg))
    if not (args.fs_gbps > 0 and args.mtbf_node_hours > 0):
        raise config.ConfigError(
            f"--fs-gbps {args.fs_gbps} and --mtbf-node-hours {args.mtbf_node_hours} must be > 0, e.g. 2 and 6335"
        )
    ckpt = checkpoint_plan(cfg, args.nodes, budget.tp, budget.dp, args.fs_gbps, args.mtbf_node_hours)
    aside = aside_cost(cfg, budget.steps)
    if args.json:
        extra = {"checkpoint": dataclasses.asdict(ckpt), "aside": aside}
        print(json.dumps({**json.loads(budget_json(budget)), **extra}, indent=1))
        return 0
    step_seconds = budget.wall_seconds / budget.steps if budget.wall_seconds else None
    lines = [format_budget(cfg, budget), *format_aside_cost(cfg, aside, budget)]
    if args.gpu is not None:  # asks torch on this machine: imports it, so only when a GPU is named
        from pipeline.model.sdpa_backend import plan_note

        lines += plan_note(cfg, args.gpu)
    print("\n".join([*lines, *format_checkpoint_plan(cfg, ckpt, args.nodes, step_seconds)]))
    if args.lr_curve or args.lr_plot:
        from pipeline import lr_schedule

        if args.lr_curve:
            print("\n".join(["  LR curve", *lr_schedule.ascii_curve(cfg)]))
        if args.lr_plot:
            print(f"  LR plot      {lr_schedule.plot_curve(cfg, args.lr_plot)}")
    return 0
