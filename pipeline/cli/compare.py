"""`prism compare --experiment NAME [--tracking-uri URI]`: the uniform-vs-Prism table and plots."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

DEFAULT_OUTPUT_DIR = "runs"  # tracking.uri: null puts runs of configs with run.output_dir=runs in runs/mlflow.db


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare the arms of an MLflow experiment (table, CSV, plots)")
    p.add_argument("--experiment", required=True, help="MLflow experiment, e.g. prism-tiny or prism-124m")
    p.add_argument(
        "--tracking-uri", help=f"MLflow store; default $MLFLOW_TRACKING_URI or sqlite:///{DEFAULT_OUTPUT_DIR}/mlflow.db"
    )
    p.add_argument("--out", help="folder for comparison.md/.csv and the PNGs (default runs/compare/EXPERIMENT)")
    p.add_argument("--no-log", action="store_true", help="do not log the report to a kind=comparison run")
    p.set_defaults(func=run)


def resolve_uri(uri: str | None) -> str:
    from pipeline.config import ConfigError
    from pipeline.tracking import store

    uri = store.resolve_uri(uri or os.environ.get("MLFLOW_TRACKING_URI"), DEFAULT_OUTPUT_DIR)
    if not store.store_exists(uri):
        raise ConfigError(f"{uri}: no MLflow database there; pass --tracking-uri sqlite:///<output_dir>/mlflow.db")
    return uri


def run(args: argparse.Namespace) -> int:
    from pipeline.compare import compare_arms

    uri = resolve_uri(args.tracking_uri)
    out = args.out or str(Path("runs") / "compare" / args.experiment)
    say_report(compare_arms(args.experiment, uri, out, log_to_mlflow=not args.no_log), uri)
    return 0


def say_report(result: dict[str, Any], uri: str) -> None:
    """The table, the files written and the comparison run: what `prism compare` and `prism scaling` print."""
    from pipeline.redaction import redact_uri

    print(result["table"])
    for p in result["paths"]:
        print(f"wrote {p}")
    if result["comparison_run_id"]:
        print(
            f"logged to run {result['comparison_run_id']} (tag kind=comparison) in experiment "
            f"{result['comparison_experiment']} of {redact_uri(uri)}"
        )
