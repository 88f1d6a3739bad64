"""Downstream evals during training (train.eval_every) score what `prism eval` scores on the same checkpoint:
a 4-step tiny run over two real torchrun processes (gloo), once at DP=2 and once at TP=2, evaluates at its
step-2 checkpoint; `prism eval` then scores that tag at the same limit and logs to the same MLflow run at the
same step, so each metric's history at step 2 holds the in-run value and prism eval's, under one name. Both
write the step's per-item file (pipeline.eval.items) to one path: the same items, answers and byte counts,
and the same gold log-likelihoods up to float32 rounding (the batches are shaped differently: DP shares,
TP vocab slices). The validations' per-sequence losses average to the logged val loss, in row order."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pipeline.eval import items as eval_items
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

    assert all(" bpb " in x for x in lines)
    run_dir = checkpoint_dir(tmp_path).parent
    in_run_items = eval_items.items_path(run_dir, EVAL_STEP).read_bytes()

    tag = checkpoint_dir(tmp_path) / f"step-{EVAL_STEP:07d}"
    out = tmp_path / "eval.json"
    assert main(["eval", str(tag), "--limit", str(LIMIT), "--batch-size", "3", "--out", str(out)]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = report["mlflow"]["run_id"]
    assert report["items"] == str(eval_items.items_path(run_dir, EVAL_STEP))
    same_items(eval_items.decode_items(in_run_items), eval_items.decode_items(Path(report["items"]).read_bytes()))
    logged = {a.path for a in client.list_artifacts(run_id, eval_items.ITEMS_ARTIFACT_DIR)}
    assert logged == {eval_items.items_artifact(EVAL_STEP), eval_items.items_artifact(4)}
    for task, s in report["tasks"].items():  # bpb: the report's, logged in-run and by prism eval at the step
        bpb = [h.value for h in client.get_metric_history(run_id, f"eval/{task}/bpb") if h.step == EVAL_STEP]
        assert bpb == [pytest.approx(s["bpb"], rel=1e-5)] * 2, task
    per_sequence_losses_match_val_loss(client, run_id, run_dir, checkpoint_dir(tmp_path) / "step-0000004")
    for task, s in report["tasks"].items():
        for metric in ("acc", "acc_norm"):
            history = [h for h in client.get_metric_history(run_id, f"eval/{task}/{metric}") if h.step == EVAL_STEP]
            if metric not in s:  # winogrande has acc only, in both
                assert history == []
                continue
            assert s["samples"] == LIMIT
            # the in-run value and prism eval's: the same number under the same name at the same step
            assert [h.value for h in history] == [s[metric]] * 2, (task, metric)


def same_items(in_run: dict, prism_eval: dict) -> None:
    assert sorted(in_run) == sorted(TASKS)
    for task, a in in_run.items():
        b = prism_eval[task]
        assert a.ids == b.ids and len(a.ids) == LIMIT, task
        assert (a.acc == b.acc).all() and (a.gold_bytes == b.gold_bytes).all(), task
        assert (a.acc_norm is None) == (b.acc_norm is None) == (task == "winogrande")
        assert a.acc_norm is None or (a.acc_norm == b.acc_norm).all(), task
        np.testing.assert_allclose(a.gold_loglik, b.gold_loglik, rtol=1e-5, err_msg=task)


def per_sequence_losses_match_val_loss(client, run_id: str, run_dir: Path, final_tag: Path) -> None:
    """The final validation's per-sequence file: one loss per val row in row order (each row scored again here
    on the final checkpoint), averaging to the logged val/loss; logged as an artifact for every set."""
    import torch

    from pipeline import data
    from pipeline.inference import load_checkpoint
    from pipeline.model import lm_loss

    cfg, model, info = load_checkpoint(final_tag, None, "cpu")
    manifests = data.checked_val_manifests(cfg, data.checked_manifest(cfg))
    for vs in cfg.validation_sets():
        losses = eval_items.decode_val(eval_items.val_path(run_dir, vs.name, info.step).read_bytes())
        rows = data.load_val_tokens(cfg, manifests[vs.metric], vs)
        assert losses.shape == (vs.tokens // cfg.model.seq_len,) == (len(rows),)
        (logged,) = [h.value for h in client.get_metric_history(run_id, vs.metric) if h.step == info.step]
        assert float(np.mean(losses, dtype=np.float64)) == pytest.approx(logged, rel=1e-6)
        with torch.no_grad():
            again = [float(lm_loss(model, torch.from_numpy(row[None].astype(np.int64)))) for row in rows]
        np.testing.assert_allclose(losses, again, rtol=1e-4)
        artifact = eval_items.val_artifact(vs.name, info.step)
        assert artifact in {a.path for a in client.list_artifacts(run_id, str(Path(artifact).parent))}
