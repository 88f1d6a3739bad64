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

import contextlib
import fcntl
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from pipeline.redaction import is_redacted, redact_text, redact_uri, without_userinfo

SQLITE = "sqlite:///"
STORE_FILE = "mlflow.db"
# A dead server must cost seconds, not MLflow's default minutes of retries, per attempt: a refused
# connection fails at once, a busy server (one worker, many jobs) gets 15 s. The environment may override.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}

log = logging.getLogger("prism.tracking")

# Slurm copies the submitting environment into each job (sbatch's default --export=ALL), and a cluster with
# AccountingStoreFlags=job_env keeps that environment in its accounting database, long after the job.
SECRET_ENV = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
CREDENTIALS_ADVICE = "put the credentials in ~/.mlflow/credentials (mode 0600; docs/tracking.md) instead"


def secret_env_name(environ: dict[str, str] | None = None) -> str | None:
    """The first MLflow secret set in ``environ`` (default: this process's), or None."""
    environ = os.environ if environ is None else environ
    return next((name for name in SECRET_ENV if environ.get(name)), None)


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
    """An MlflowClient for ``uri``, with the HTTP defaults above when it is a server.

    Building the client opens the store, and opening an SQLite store creates or migrates its schema: that
    happens under a lock beside the file, so two runs starting together into one new folder do not race in
    MLflow's migration (which crashed both and could leave the store unusable)."""
    if uri.startswith(("http://", "https://")):
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
    # MLflow prints "View run … at: <uri>" when a run ends, credentials included; `prism train` prints its
    # own (masked) link instead.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    from mlflow.tracking import MlflowClient

    if is_redacted(uri):  # a URI read back from a journal or checkpoint: credentials come from the environment
        uri = without_userinfo(uri)
    path = sqlite_file(uri)
    if path is None:
        return MlflowClient(tracking_uri=uri)
    with store_lock(path):
        repair_interrupted_migration(path)
        return MlflowClient(tracking_uri=uri)


@contextlib.contextmanager
def store_lock(db: Path):
    """Exclusive lock on ``<db>.lock`` (fcntl, released when the process dies) while a store is opened."""
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.parent / f"{db.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def repair_interrupted_migration(db: Path) -> list[str]:
    """Undo what an interrupted MLflow schema migration left in an SQLite store; returns what it did.

    Alembic migrates an SQLite table by copying it into ``_alembic_tmp_NAME``, dropping NAME and renaming the
    copy. Cut short, the copy stays and every later migration fails on "table _alembic_tmp_NAME already
    exists". If NAME is still there the copy is incomplete and is dropped; if NAME is gone, the copy holds
    the data and is renamed back. No row of history is deleted either way. Call it under ``store_lock``."""
    if not db.is_file() or db.stat().st_size == 0:
        return []
    done: list[str] = []
    names: set[str] = set()
    con = sqlite3.connect(db, timeout=60)
    try:
        names = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        for tmp in sorted(n for n in names if n.startswith("_alembic_tmp_")):
            table = tmp[len("_alembic_tmp_") :]
            if table in names:
                con.execute(f'DROP TABLE "{tmp}"')
                done.append(f"dropped the unfinished copy {tmp} ({table} is intact)")
            else:
                con.execute(f'ALTER TABLE "{tmp}" RENAME TO "{table}"')
                done.append(f"renamed {tmp} back to {table}")
        con.commit()
    except sqlite3.Error as e:
        raise RuntimeError(
            f"{db}: an interrupted MLflow migration left {sorted(n for n in names if n.startswith('_alembic'))} "
            f"and repairing it failed ({e}); copy the file aside, then drop those tables with sqlite3"
        ) from e
    finally:
        con.close()
    for what in done:
        log.warning("tracking: repaired %s: %s", db, what)
    return done


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
        log.warning("MLflow logging to %s failed: %s", redact_uri(uri), redact_text(str(e)))
        return {
            "logged": False,
            "reason": f"{type(e).__name__}: {redact_text(str(e).splitlines()[0]) if str(e) else ''}",
            "uri": redact_uri(uri),
            "run_id": run_id,
        }
    return {"logged": True, "uri": redact_uri(uri), "run_id": run_id}


def download_artifact(mlflow: Any, run_id: str, path: str, folder: str | Path) -> Path:
    """One artifact of a run into ``folder`` without MLflow's progress bar (it draws one per download)."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(name)
    os.environ[name] = "false"
    try:
        return Path(mlflow.download_artifacts(run_id, path, str(folder)))
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before
