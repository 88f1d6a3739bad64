"""The default SQLite store under concurrency and after an interrupted migration (issue 14 item 1), with real
processes on real stores."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from pipeline.tracking import store
from pipeline.tracking.journal import Journal

ROOT = Path(__file__).resolve().parents[2]

# One "arm": open the shared store the way the trainer does (journal + delivery), at an agreed instant.
ARM = """
import sys, time
from pipeline.tracking.journal import Delivery, Journal
uri, folder, t0 = sys.argv[1], sys.argv[2], float(sys.argv[3])
while time.time() < t0:
    time.sleep(0.001)
delivery = Delivery(uri, "study", Journal(folder))
run = delivery.client.create_run(delivery.experiment_id(), run_name=folder)
print("RUN", run.info.run_id)
"""


def start_arms(uri: str, folder: Path, n: int) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.time() + 12  # every interpreter has imported mlflow by then, so they open the store together
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ARM, uri, str(folder / f"arm{i}"), str(t0)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(n)
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=600), p.communicate()[0]) for p in procs]


def test_arms_starting_together_on_a_new_store_all_get_their_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    results = start_arms(uri, tmp_path, 3)
    for r in results:
        assert r.returncode == 0 and "RUN " in r.stdout, r.stdout[-3000:]
    runs = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("study").experiment_id])
    assert len(runs) == 3
    tables = [row[0] for row in sqlite3.connect(tmp_path / "mlflow.db").execute("SELECT name FROM sqlite_master")]
    assert not [t for t in tables if t.startswith("_alembic_tmp_")]


def break_like_an_interrupted_migration(db: Path) -> None:
    """Step the schema one revision back and leave the copies a cut-short batch migration leaves behind."""
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config

    command.downgrade(_get_alembic_config(f"sqlite:///{db}"), "-1")
    con = sqlite3.connect(db)
    tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    for t in tables:
        if t != "alembic_version":
            con.execute(f'CREATE TABLE "_alembic_tmp_{t}" AS SELECT * FROM "{t}"')
    con.commit()
    con.close()


def test_a_store_left_broken_by_an_interrupted_migration_is_repaired_without_losing_history(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = MlflowClient(uri)
    run_id = first.create_run(first.create_experiment("study")).info.run_id
    first.log_metric(run_id, "val/loss", 3.5, step=7)
    break_like_an_interrupted_migration(tmp_path / "mlflow.db")

    (result,) = start_arms(uri, tmp_path, 1)  # a fresh process, as the next `prism train` would be
    assert result.returncode == 0, result.stdout[-3000:]
    assert "repaired" in result.stdout
    client = MlflowClient(uri)
    assert [m.value for m in client.get_metric_history(run_id, "val/loss")] == [3.5]
    assert len(client.search_runs([client.get_experiment_by_name("study").experiment_id])) == 2


def test_repair_renames_back_a_copy_whose_table_was_already_dropped(tmp_path):
    db = tmp_path / "mlflow.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE _alembic_tmp_experiments (name TEXT)")
    con.execute("INSERT INTO _alembic_tmp_experiments VALUES ('kept')")
    con.commit()
    con.close()
    assert store.repair_interrupted_migration(db) == ["renamed _alembic_tmp_experiments back to experiments"]
    assert sqlite3.connect(db).execute("SELECT name FROM experiments").fetchall() == [("kept",)]


TRAINER_START = """
import sys
from pipeline import config
from pipeline.tracking.mlflow_run import MlflowTracker
cfg = config.load("configs/tiny_prism.yaml", [f"run.output_dir={sys.argv[1]}", "tracking.system_metrics=false"])
tracker = MlflowTracker(cfg)
print("RUN", tracker.start(cfg))
tracker.log_metrics({"train/loss": 5.0}, 1)
tracker.finish()
"""


def test_a_store_that_cannot_be_opened_at_start_leaves_training_running_on_the_journal(tmp_path):
    (tmp_path / "mlflow.db").write_bytes(b"not an sqlite database, e.g. a half-copied file " * 100)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", TRAINER_START, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RUN None" in out.stdout and "unavailable" in out.stderr and "buffering in" in out.stderr
    (journal,) = tmp_path.rglob("tracking.jsonl")
    ops = [r["op"] for r in Journal(journal.parent).pending()]
    assert ops[0] == "start" and "metrics" in ops and ops[-1] == "finish"  # all kept for `prism tracking sync`
