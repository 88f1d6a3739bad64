"""Ctrl-C is a stop signal, and a crash leaves the MLflow run FAILED, not RUNNING (issue 14 item 6): real
`prism train` / tracker processes on real SQLite stores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from pipeline.tracking.journal import Journal

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_ctrl_c_writes_a_checkpoint_exits_3_and_ends_the_run_killed(tiny_data, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "train",
        "configs/tiny_prism.yaml",
        *tiny_data.overrides,
        f"run.output_dir={tmp_path}",
        "train.batch_tokens=1024",
        "train.micro_batch_size=8",
        "train.train_tokens=1024000",
        "data.allow_repeat=true",  # a long budget to interrupt: past one epoch of the tiny data
        "train.log_every=1",
        "train.val_every=1000",
        "tracking.system_metrics=false",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # the first step line: the loop is running
        lines.append(line)
        if "step" in line and "loss" in line:
            break
    proc.send_signal(signal.SIGINT)
    out = "".join(lines) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 3, out[-3000:]
    assert "stop signal received" in out and "Traceback" not in out
    run_dir = next(p.parent for p in tmp_path.rglob("latest"))
    assert (run_dir / (run_dir / "latest").read_text().strip()).is_dir()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "KILLED"


CRASHING_RUN = """
import sys
from pipeline import config
from pipeline.tracking.mlflow_run import MlflowTracker
cfg = config.load("configs/tiny_prism.yaml", [f"run.output_dir={sys.argv[1]}", "tracking.system_metrics=false"])
tracker = MlflowTracker(cfg)
tracker.start(cfg)
tracker.log_metrics({"train/loss": 5.0}, 1)
raise RuntimeError("a bug in the training loop")
"""


def test_a_crash_after_the_run_started_marks_it_failed_in_the_store_and_the_journal(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", CRASHING_RUN, str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert out.returncode == 1 and "a bug in the training loop" in out.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED"
    (journal,) = {p.parent for p in tmp_path.rglob("tracking.jsonl")}
    assert Journal(journal).records()[-1]["op"] == "finish"
    assert Journal(journal).records()[-1]["status"] == "FAILED"
    assert Journal(journal).pending() == []
