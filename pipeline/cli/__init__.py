"""`prism` — one CLI, one module per verb. Each verb module is thin: parse, call a library function, print.

A verb module exposes ``add_parser(subparsers)`` (which sets ``func``) and ``run(args)``, and imports torch,
megatron, deepspeed, mlflow and datatrove only inside ``run``, so `prism --help` stays fast. Every verb is
imported here by name: a broken verb fails loudly instead of disappearing from the help.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.cli import (
    attention_distance,
    compare,
    demo,
    eval,
    model,
    plan,
    prepare,
    schedule,
    sweep,
    tracking,
    train,
)
from pipeline.config import ConfigError
from pipeline.schedule import ScheduleError

# The order `prism --help` lists them in: the study's stages, then the tools.
VERB_MODULES = (schedule, model, plan, prepare, train, tracking, compare, eval, attention_distance, sweep, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prism", description="Prism Transformer pretraining study pipeline")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for module in VERB_MODULES:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ScheduleError) as e:  # bad input: one line, no traceback
        print(f"prism {args.verb}: error: {e}", file=sys.stderr)
        return 2
