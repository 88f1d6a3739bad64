"""`prism study` end to end on a tiny budget: both arms of one seed trained two at a time by real `prism train`
subprocesses (each console in its log), compared; a rerun that changes only how runs execute or log
(train.log_every, data.tasks) finds both runs finished and trains nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "train.batch_tokens=1024",
    "train.micro_batch_size=8",
    "train.train_tokens=3072",  # 3 steps
    "train.val_every=3",
    "train.val_tokens=1024",
    "train.log_every=1",
    "tracking.system_metrics=false",
]


def study(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline.cli", "study", "configs/tiny_uniform.yaml", "configs/tiny_prism.yaml"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"prism study exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_study_trains_compares_and_a_rerun_skips_what_finished(tiny_data, tmp_path):
    base = [*tiny_data.overrides, *SMALL, f"run.output_dir={tmp_path}"]
    first = study("--seeds", "1", "--jobs", "2", *base)
    assert "2 at a time" in first.stdout and "| tiny | prism |" in first.stdout, first.stdout
    assert {p.name for p in (tmp_path / "logs").glob("*-s1.log")} == {"uniform-tiny-s1.log", "prism-tiny-s1.log"}
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("prism-tiny").experiment_id
    runs = client.search_runs([experiment], filter_string="tags.kind = 'train'")
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]

    again = study("--seeds", "1", *base, "train.log_every=3", "data.tasks=1")
    assert again.stdout.count("already finished") == 2, again.stdout
    assert len(client.search_runs([experiment], filter_string="tags.kind = 'train'")) == 2
