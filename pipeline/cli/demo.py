"""`prism demo [overrides]` (what `make demo` runs): prepare, train both tiny arms, compare; offline, on CPU."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="prepare, train both tiny arms side by side, compare (offline, on CPU)")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to both arms, e.g. run.output_dir=/tmp/x")
    p.add_argument(
        "--preset-dir",
        default=None,
        help="folder holding tiny_uniform.yaml / tiny_prism.yaml; none: ./configs if it has them, else the "
        "configs/ folder next to the installed pipeline package",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.demo import run_demo

    return run_demo(args.overrides, args.preset_dir)
