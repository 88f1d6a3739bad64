"""Where runs are stored and how to reach them: the one tracking-URI rule and the one way to build a client.

``tracking.uri`` (or ``--tracking-uri``) may be
  - null: ``sqlite:///<run.output_dir>/mlflow.db``, one store per output folder, so both arms of a study
    (and every seed) land side by side and `prism compare` reads them together;
  - ``http(s)://host:port``: a server (ops/mlflow_server.sh), for many jobs logging at once; kept as given;
  - ``sqlite:///path.db``: kept, with a relative path made absolute (SQLite would read it from the cwd);
  - a plain path: that SQLite file, or ``mlflow.db`` inside it when it is an existing folder;
  - any other ``scheme://`` URI: kept as given for MLflow to interpret.
Every caller (trainer, sync, compare, eval, attention-distance, demo) resolves through here, so a URI
written in a journal or printed by one command names the same store for all the others.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

SQLITE = "sqlite:///"
STORE_FILE = "mlflow.db"
# A dead server must cost seconds, not MLflow's default minutes of retries, per attempt: a refused
# connection fails at once, a busy server (one worker, many jobs) gets 15 s. The environment may override.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}

log = logging.getLogger("prism.tracking")


def resolve_uri(uri: str | None, output_dir: str | Path) -> str:
    """The MLflow URI for a configured ``uri`` (see the module docstring); ``output_dir`` serves null."""
    if not uri:
        return SQLITE + str(Path(output_dir).expanduser().resolve() / STORE_FILE)
    if uri.startswith(SQLITE):
        return SQLITE + str(Path(uri[len(SQLITE) :]).expanduser().resolve())
    if "://" in uri:
        return uri
    path = Path(uri).expanduser().resolve()
    return SQLITE + str(path / STORE_FILE if path.is_dir() else path)


def run_uri(cfg: Any) -> str:
    """Where a run of this config logs."""
    return resolve_uri(cfg.tracking.uri, cfg.run.output_dir)


def sqlite_file(uri: str) -> Path | None:
    """The database file of an ``sqlite:///`` URI, None for any other store."""
    return Path(uri[len(SQLITE) :]) if uri.startswith(SQLITE) else None


def store_exists(uri: str) -> bool:
    """False only for an SQLite file that is not there (MLflow would silently create an empty store)."""
    path = sqlite_file(uri)
    return path is None or path.is_file()


def artifact_location(uri: str) -> str | None:
    """Artifacts of a new experiment in an SQLite store go beside the database, not in ./mlruns of the cwd."""
    path = sqlite_file(uri)
    return (path.parent / "mlartifacts").resolve().as_uri() if path is not None else None


def client(uri: str):
    """An MlflowClient for ``uri``, with the HTTP defaults above when it is a server."""
    if uri.startswith(("http://", "https://")):
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def log_to_run(
    cfg: Any, run_id: str | None, metrics: dict[str, float], step: int | None, artifacts: list[tuple[str, Path]]
) -> dict[str, Any]:
    """Log metrics (at ``step``) and (artifact folder, file) pairs to the existing run a checkpoint belongs to.

    Returns what happened and never raises: the files on disk are the record, and a tracking outage must
    not lose them. Used by `prism eval` and `prism attention-distance`."""
    if not cfg.tracking.enabled:
        return {"logged": False, "reason": "tracking.enabled is false in the checkpoint's config"}
    if run_id is None:
        return {"logged": False, "reason": "the checkpoint stores no tracking run id"}
    uri = run_uri(cfg)
    try:
        from mlflow.entities import Metric

        mlflow = client(uri)
        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step or 0) for key, value in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 entries per batch
            mlflow.log_batch(run_id, metrics=batch[i : i + 1000])
        for artifact_dir, file in artifacts:
            mlflow.log_artifact(run_id, str(file), artifact_path=artifact_dir)
    except Exception as e:  # noqa: BLE001 (any tracking failure is reported, not raised)
        log.warning("MLflow logging to %s failed: %s", uri, e)
        return {
            "logged": False,
            "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            "uri": uri,
            "run_id": run_id,
        }
    return {"logged": True, "uri": uri, "run_id": run_id}
