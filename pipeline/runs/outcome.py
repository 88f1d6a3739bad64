"""Outcome: reading a run from what it wrote: its val losses (MLflow, with its offline journal beyond that, or
the journal alone when the store is down), how it ended (exit record, else its journal), the tokens it
trained, its checkpoints. A run here is a launch record ({folder, checkpoint_dir, ...}, pipeline.runs.launch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.exit_codes import read_exit_record, reason_of_status

EXIT_FILE = "exit-record.txt"  # a run's exit record in its launch folder (pipeline/exit_codes.py)


def read_journal(rec: dict[str, Any]) -> list[dict[str, Any]]:
    from pipeline.tracking.journal import Journal

    return Journal(rec["checkpoint_dir"]).records()


def run_id_of(rec: dict[str, Any]) -> str | None:
    from pipeline.tracking.journal import journal_run_id

    return journal_run_id(rec["checkpoint_dir"])


_CLIENTS: dict[str, Any] = {}  # one MLflow client per store for the driver's polls


def val_losses(rec: dict[str, Any], uri: str) -> tuple[dict[int, float], str]:
    """{step: val loss} of a run and where it came from: MLflow, with what its journal holds beyond that
    (records not delivered yet); the journal alone when the store cannot be read."""
    from pipeline.compare import latest_per_step
    from pipeline.tracking import store

    from_journal: dict[int, float] = {}
    for r in read_journal(rec):
        if r.get("op") == "metrics" and "val/loss" in r["metrics"]:
            from_journal[int(r["step"])] = float(r["metrics"]["val/loss"])
    run_id = run_id_of(rec)
    if run_id is None:
        return from_journal, "journal"
    try:
        if uri not in _CLIENTS:
            _CLIENTS[uri] = store.client(uri)
        values = latest_per_step(_CLIENTS[uri].get_metric_history(run_id, "val/loss"))
    except Exception:  # noqa: BLE001 - the store is down or locked: the journal is the record
        return from_journal, "journal"
    return {**from_journal, **values}, "mlflow"


def exit_record(rec: dict[str, Any]) -> tuple[str, int] | None:
    """(reason, step) from the run's exit record, None without a readable one."""
    return read_exit_record(Path(rec["folder"]) / EXIT_FILE)


def outcome(rec: dict[str, Any]) -> tuple[str, int]:
    """How an ended run ended: (finished | signal | nonfinite | infra | crashed | bad_input, last step), from its
    exit record, else from its journal's last finish record: `failed` for FAILED (a NaN/inf or an infrastructure
    fault, the journal does not say which), `crashed` when there is none."""
    if (record := exit_record(rec)) is not None:
        return record
    steps = [int(r["step"]) for r in read_journal(rec) if r.get("op") == "metrics"]
    finish = [r for r in read_journal(rec) if r.get("op") == "finish"]
    status = finish[-1]["status"] if finish else "CRASHED"
    return reason_of_status(status), max(steps, default=0)


def tokens_trained(rec: dict[str, Any], batch_tokens: int) -> int:
    """Tokens a run trained: its last logged count, or its last step (a stop signal's checkpoint, the exit
    record) when that is later: a pruned run trains on to the next step boundary before it stops."""
    seen = [
        r["metrics"]["train/tokens_seen"]
        for r in read_journal(rec)
        if r.get("op") == "metrics" and "train/tokens_seen" in r.get("metrics", {})
    ]
    from pipeline.checkpoint import tag_step

    steps = [tag_step(name) or 0 for name in checkpoints_of(rec)]
    if (record := exit_record(rec)) is not None:
        steps.append(record[1])
    return int(max(max(seen, default=0), max(steps, default=0) * batch_tokens))


def checkpoints_of(rec: dict[str, Any]) -> list[str]:
    from pipeline.checkpoint import tag_names

    return tag_names(rec["checkpoint_dir"])
