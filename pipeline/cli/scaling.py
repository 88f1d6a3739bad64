"""`prism scaling --experiment NAME [NAME ...]`: per-arm power-law fits across sizes, the gap and the compute
multiplier with bootstrap intervals (pipeline.verdict.scaling)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pipeline.cli.compare import DEFAULT_OUTPUT_DIR

    p = sub.add_parser(
        "scaling",
        help="fit loss against model size per arm across scales: the gap and compute multiplier k with intervals",
        description="Read every finished training run of the experiments (one per scale, as the presets log them), "
        "fit L(N) = E + A·N^-α per arm (L(N, D) when cooldown branches add token counts), and report the gap "
        "Prism − uniform against N, the compute multiplier k and k adjusted by measured tokens/s, each with a "
        "bootstrap interval over seeds. Writes scaling.md, scaling.csv, scaling_points.csv and scaling.png and "
        "logs them to a kind=comparison run.",
    )
    p.add_argument(
        "--experiment",
        required=True,
        nargs="+",
        metavar="NAME",
        help="MLflow experiments, one per scale, e.g. prism-ladder-w64 prism-ladder-w128 prism-ladder-w192",
    )
    p.add_argument(
        "--tracking-uri", help=f"MLflow store; default $MLFLOW_TRACKING_URI or sqlite:///{DEFAULT_OUTPUT_DIR}/mlflow.db"
    )
    p.add_argument("--out", help="folder for the table, CSVs and plot (default runs/compare/scaling)")
    p.add_argument("--no-log", action="store_true", help="do not log the report to a kind=comparison run")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.cli.compare import resolve_uri, say_report
    from pipeline.compare import compare_scales

    uri = resolve_uri(args.tracking_uri)
    out = args.out or str(Path("runs") / "compare" / "scaling")
    say_report(compare_scales(args.experiment, uri, out, log_to_mlflow=not args.no_log), uri)
    return 0
