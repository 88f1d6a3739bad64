"""`prism tracking sync RUN_DIR`: deliver what a run buffered while MLflow was unreachable."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tracking", help="MLflow tracking chores (replay a run's offline buffer)")
    actions = p.add_subparsers(dest="tracking_action", required=True, metavar="ACTION")
    s = actions.add_parser("sync", help="replay the records of RUN_DIR's tracking.jsonl not yet in MLflow")
    s.add_argument("run_dir", help="the run folder (<output_dir>/<run name>) or its checkpoint folder")
    s.add_argument("--tracking-uri", help="send to this store instead of the one the run used")
    s.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.tracking.journal import JOURNAL, Journal, journal_folder, sync

    folder = journal_folder(args.run_dir)
    before = len(Journal(folder).pending()) if (folder / JOURNAL).is_file() else 0
    try:
        sent, uri, run_id = sync(folder, args.tracking_uri)
    except Exception as e:
        from pipeline.config import ConfigError
        from pipeline.redaction import redact_text

        if isinstance(e, ConfigError):
            raise
        left = len(Journal(folder).pending())
        raise ConfigError(
            f"{folder}: MLflow did not take the records ({redact_text(str(e).splitlines()[0])[:160]}); "
            f"{left} still pending; "
            "start the server (ops/mlflow_server.sh start) or pass --tracking-uri, then run sync again"
        ) from None
    print(f"prism tracking sync: {sent} of {before} pending records sent to {uri} (run {run_id})")
    return 0
