"""Milestones and validation sets through the real verbs: `prism eval RUN_DIR --milestones` scores each milestone
once and logs it to the run's MLflow run at its step (a second call scores nothing), readers take a milestone by
its step, and `prism train` refuses a missing validation set folder in one line before step 1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from tests.integration.test_train import PRESET, ROOT


def test_eval_milestones_scores_each_milestone_once_and_logs_it_at_its_step(tiny_checkpoints, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pipeline.cli import main
    from pipeline.tracking.journal import Journal

    # a copy of the uniform run (its MLflow store too), so other tests' histories stay as they are
    copy = tmp_path / "runs"
    shutil.copytree(tiny_checkpoints.uniform.parent.parent, copy)
    run_dir = copy / "uniform-tiny-s1234"
    # the fixture run may hold evals other tests logged before the copy (test_export_cli scores it): count them
    run_id = Journal(run_dir / "checkpoints").state()["run_id"]
    client = MlflowClient(f"sqlite:///{copy / 'mlflow.db'}")
    before = len(client.get_metric_history(run_id, "eval/piqa/acc"))
    args = ["eval", str(run_dir), "--milestones", "--tasks", "piqa", "--limit", "4", f"run.output_dir={copy}"]
    assert main(args) == 0
    assert "scored 1 milestone(s) (steps 2); 0 already scored" in capsys.readouterr().out
    report = run_dir / "eval" / "step-0000002-zeroshot.json"
    written = report.stat().st_mtime_ns
    assert main(args) == 0  # idempotent: nothing new to score, nothing rewritten or logged again
    assert "scored 0 milestone(s) (steps none); 1 already scored" in capsys.readouterr().out
    assert report.stat().st_mtime_ns == written
    history = sorted(client.get_metric_history(run_id, "eval/piqa/acc"), key=lambda h: h.timestamp)[before:]
    assert [(h.step, h.value) for h in history] == [(2, json.loads(report.read_text())["tasks"]["piqa"]["acc"])]
    # more tasks than were scored: the milestone is scored again
    assert main([*args[:4], "piqa,arc_easy", *args[5:]]) == 0
    assert "scored 1 milestone(s) (steps 2)" in capsys.readouterr().out
    # a step names a milestone for the other readers too; a step with no checkpoint is one line
    assert main(["export", str(run_dir), "--step", "2", "--out", str(tmp_path / "hf"), f"run.output_dir={copy}"]) == 0
    assert "step 2" in capsys.readouterr().out
    assert main(["attention-distance", str(run_dir), "--step", "3", "--sequences", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("no checkpoint at step 3; steps kept: 2 (milestone)") and "\n" not in err


def test_train_refuses_a_missing_validation_set_folder_before_step_1(tiny_data, tmp_path):
    ov = [*tiny_data.overrides, f"run.output_dir={tmp_path}", f"data.val_sets.heldout.dataset_dir={tmp_path / 'gone'}"]
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "train", str(PRESET), *ov, "tracking.enabled=false"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("prism train: error: data.val_sets.heldout.dataset_dir: ")
    assert "no manifest" in errors[0] and "step " not in out.stdout
