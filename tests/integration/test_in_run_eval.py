"""Downstream evals during training (train.eval_every) score what `prism eval` scores on the same checkpoint:
a 4-step tiny run over two real torchrun processes (gloo), once at DP=2 and once at TP=2, evaluates at its
step-2 checkpoint; `prism eval` then scores that tag at the same limit and logs to the same MLflow run at the
same step, so each metric's history at step 2 holds the in-run value and prism eval's, under one name."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration.test_train import ROOT, checkpoint_dir, command, env, overrides

EVAL_STEP, LIMIT = 2, 10
TASKS = ("hellaswag", "piqa", "winogrande", "arc_easy")
EVALS = [
    "train.train_tokens=4096",  # 4 steps: evals at 2 and 4 (the last)
    f"train.eval_every={EVAL_STEP}",
    f"train.eval_tasks=[{','.join(TASKS)}]",
    f"train.eval_limit={LIMIT}",
    f"checkpoint.every_steps={EVAL_STEP}",
    "tracking.enabled=true",
    "tracking.system_metrics=false",
]


@pytest.mark.parametrize("layout", ["parallel.zero_stage=2", "parallel.tp=2"], ids=["dp2", "tp2"])
def test_in_run_evals_equal_prism_eval_on_the_same_checkpoint(layout, tiny_data, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pipeline.cli import main

    ov = overrides(tiny_data, tmp_path, *EVALS, layout)
    trained = subprocess.run(command(ov, 2), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    lines = [x for x in trained.stdout.splitlines() if x.startswith("prism train: eval at step")]
    assert [x.split()[5] for x in lines] == ["2", "4"], trained.stdout  # once per eval step, from rank 0 only

    tag = checkpoint_dir(tmp_path) / f"step-{EVAL_STEP:07d}"
    out = tmp_path / "eval.json"
    assert main(["eval", str(tag), "--limit", str(LIMIT), "--batch-size", "3", "--out", str(out)]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = report["mlflow"]["run_id"]
    for task, s in report["tasks"].items():
        for metric in ("acc", "acc_norm"):
            history = [h for h in client.get_metric_history(run_id, f"eval/{task}/{metric}") if h.step == EVAL_STEP]
            if metric not in s:  # winogrande has acc only, in both
                assert history == []
                continue
            assert s["samples"] == LIMIT
            # the in-run value and prism eval's: the same number under the same name at the same step
            assert [h.value for h in history] == [s[metric]] * 2, (task, metric)
