"""`prism` — one CLI, one verb per stage. Thin: parse, call, print.

Each verb lives in the module that owns its work; that module exposes ``add_parser(subparsers)`` and keeps
heavy imports (torch, megatron, mlflow) inside the function the verb runs, so `prism --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# verb -> module that defines it (add_parser registers the sub-command and sets `func`)
VERBS = {
    "schedule": "pipeline.schedule_cli",
    "model": "pipeline.model.cli",
    "prepare": "data_prep.cli",
    "train": "pipeline.train_cli",
    "tracking": "pipeline.tracking_cli",
    "compare": "pipeline.compare_cli",
    "eval": "pipeline.eval.cli",
    "attention-distance": "pipeline.analysis.cli",
    "sweep": "launchers.sweep_cli",
    "demo": "pipeline.demo",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prism", description="Prism Transformer pretraining study pipeline")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for module in VERBS.values():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):  # verb not built yet in this checkout
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pipeline.config import ConfigError
    from pipeline.schedule import ScheduleError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ScheduleError) as e:
        print(f"prism {args.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
