"""The offline journal: every tracking call of a run, written down before it is sent, and its replay.

``<checkpoint_dir>/tracking.jsonl`` is append-only, one JSON record per line, with the wall-clock timestamp
MLflow will store. When delivery fails (server down, HTTP error, locked database) the records stay pending
and are replayed in order the next time a delivery succeeds, or by ``prism tracking sync RUN_DIR``. A replay
sends the same keys, steps, values and timestamps, and MLflow's SQL store drops a metric whose (key, step,
timestamp, value) it already holds, so a record delivered twice is stored once. ``tracking-state.json``
(replaced atomically) holds the run id, the store's URI and how many records have been delivered.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.atomic import write_atomic
from pipeline.redaction import redact_uri
from pipeline.tracking import store

JOURNAL = "tracking.jsonl"
STATE = "tracking-state.json"
PARAMS_PER_BATCH = 100  # MLflow takes <= 100 params (and <= 1000 entries) per log_batch
METRICS_PER_BATCH = 500
CHANGED_ON_RESUME = "params_changed_on_resume"  # the tag naming params a resume logged with another value


class Journal:
    """The append-only record of everything sent to MLflow, plus what has been delivered."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / JOURNAL
        self.state_path = self.folder / STATE
        self._records: list[dict[str, Any]] | None = None  # this process's view; only it appends

    def state(self) -> dict[str, Any]:
        if self.state_path.is_file():
            return json.loads(self.state_path.read_text())
        return {"run_id": None, "delivered": 0}

    def save_state(self, **changes: Any) -> None:
        state = {**self.state(), **changes}
        write_atomic(self.state_path, json.dumps(state, indent=1))

    def append(self, record: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        records = self.records()
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        records.append(record)

    def records(self) -> list[dict[str, Any]]:
        if self._records is None:
            self._records = self._read()
        return self._records

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        text = self.path.read_text()
        if text and not text.endswith("\n"):  # a write cut short by a kill: end that line before appending
            with self.path.open("a") as f:
                f.write("\n")
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # the cut-short line itself: skipped, the rest is whole
                continue
        return out

    def pending(self) -> list[dict[str, Any]]:
        return self.records()[self.state()["delivered"] :]


def journal_run_id(checkpoint_dir: str | Path) -> str | None:
    """The run id recorded beside a run's checkpoints (a run that started while MLflow was down gets its id
    here once a delivery succeeds, after its first checkpoints were written)."""
    return Journal(checkpoint_dir).state().get("run_id")


def journal_folder(run_dir: str | Path) -> Path:
    """The folder holding a run's journal: the run folder itself or its checkpoints/ folder."""
    run_dir = Path(run_dir)
    for folder in (run_dir, run_dir / "checkpoints"):
        if (folder / JOURNAL).is_file():
            return folder
    return run_dir


class Delivery:
    """Sends journal records to one MLflow store; shared by the tracker and `prism tracking sync`."""

    def __init__(self, uri: str, experiment: str, journal: Journal):
        self.uri, self.experiment, self.journal = uri, experiment, journal
        self._client: Any = None

    @property
    def client(self) -> Any:
        """Opened on first use, inside flush(), so a store that cannot be opened at start (locked, being
        migrated, unreachable) is a failed delivery that keeps the records pending, not a crash."""
        if self._client is None:
            self._client = store.client(self.uri)
        return self._client

    def experiment_id(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(self.experiment, artifact_location=store.artifact_location(self.uri))
        except Exception:  # another job created it between our two calls
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                raise
            return exp.experiment_id

    def ensure_run(self, run_name: str, tags: dict[str, str]) -> str:
        run_id = self.journal.state()["run_id"]
        if run_id is None:
            run = self.client.create_run(self.experiment_id(), run_name=run_name, tags=tags)
            run_id = run.info.run_id
            self.journal.save_state(run_id=run_id)
        return run_id

    def _log_params(self, run: Any, params: dict[str, str]) -> dict[str, str]:
        """Log the params ``run`` does not have yet; returns the tag that names those a resume changed
        (MLflow params are immutable), merged with the names the tag already held, or {} if none changed."""
        from mlflow.entities import Param

        have = run.data.params
        new = [Param(k, v) for k, v in params.items() if k not in have]
        for i in range(0, len(new), PARAMS_PER_BATCH):
            self.client.log_batch(run.info.run_id, params=new[i : i + PARAMS_PER_BATCH])
        changed = {k for k, v in params.items() if k in have and have[k] != v}
        if not changed:
            return {}
        before = run.data.tags.get(CHANGED_ON_RESUME, "")
        return {CHANGED_ON_RESUME: ",".join(sorted(changed | {k for k in before.split(",") if k}))}

    def flush(self) -> int:
        """Deliver every pending record in order; raises on the first failure (state keeps the rest)."""
        from mlflow.entities import Metric, RunTag

        records = self.journal.records()
        done = self.journal.state()["delivered"]
        sent = 0
        while done < len(records):
            rec = records[done]
            op = rec["op"]
            if op == "start":
                run_id = self.ensure_run(rec["run_name"], rec["tags"])
                run = self.client.get_run(run_id)
                if run.info.status != "RUNNING":
                    self.client.update_run(run_id, status="RUNNING")
                tags = {**rec["tags"], **self._log_params(run, rec["params"])}
                self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
                n = 1
            elif op == "params":
                run_id = self.journal.state()["run_id"]
                if run_id is None:
                    raise RuntimeError("journal has records before its start record")
                tags = self._log_params(self.client.get_run(run_id), rec["params"])
                if tags:
                    self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
                n = 1
            else:
                run_id = self.journal.state()["run_id"]
                if run_id is None:
                    raise RuntimeError("journal has records before its start record")
                if op == "metrics":
                    # Consecutive metric records go out together (<= METRICS_PER_BATCH entries).
                    batch: list[Metric] = []
                    n = 0
                    while done + n < len(records) and records[done + n]["op"] == "metrics":
                        r = records[done + n]
                        entries = [Metric(k, float(v), r["time"], r["step"]) for k, v in r["metrics"].items()]
                        if batch and len(batch) + len(entries) > METRICS_PER_BATCH:
                            break
                        batch += entries
                        n += 1
                    self.client.log_batch(run_id, metrics=batch)
                elif op == "tags":
                    self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in rec["tags"].items()])
                    n = 1
                elif op == "artifact":
                    self.client.log_artifact(run_id, str(self.journal.folder / rec["file"]), rec["dir"] or None)
                    n = 1
                elif op == "finish":
                    self.client.set_terminated(run_id, status=rec["status"], end_time=rec["time"])
                    n = 1
                else:
                    raise RuntimeError(f"unknown journal op {op!r} in {self.journal.path}")
            done += n
            sent += n
            self.journal.save_state(delivered=done)
        return sent


def sync(folder: str | Path, uri: str | None = None) -> tuple[int, str, str]:
    """Replay what a run's journal has not delivered yet. Returns (records sent, uri, run id)."""
    from pipeline.config import ConfigError

    journal = Journal(folder)
    if not journal.path.is_file():
        raise ConfigError(f"{folder}: no {JOURNAL} here; pass the run's checkpoint folder (or its run folder)")
    state = journal.state()
    uri = uri or state.get("uri")
    if not uri or not state.get("experiment"):
        raise ConfigError(f"{journal.state_path}: no tracking uri recorded; pass --tracking-uri URI")
    uri = store.resolve_uri(uri, journal.folder)
    sent = Delivery(uri, state["experiment"], journal).flush()
    return sent, redact_uri(uri), journal.state()["run_id"]
