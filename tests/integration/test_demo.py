"""`prism demo` end to end on a tiny budget (4 steps per arm): a fresh `prepare` from the session's corpus and
tokenizer, both arms trained side by side by real `prism train` subprocesses (one thread each) into one SQLite
MLflow store, each with exactly the losses it has when trained alone, the comparison table; a second
invocation reuses the dataset and skips both finished arms."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[2]


def demo(overrides: list[str]) -> subprocess.CompletedProcess:
    # a user's 2 threads: the demo must still train each arm on one, so its losses do not depend on concurrency
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pipeline.cli", "demo", *overrides]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"prism demo exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_demo_trains_both_arms_compares_them_and_skips_finished_arms_on_rerun(tiny_data, tmp_path):
    out_dir, dataset_dir = tmp_path / "runs", tmp_path / "dataset"
    overrides = [
        f"run.output_dir={out_dir}",
        f"data.input={tiny_data.corpus_dir}",  # the session's corpus and tokenizer; the dataset is built here
        f"data.tokenizer={tiny_data.tokenizer}",
        f"data.dataset_dir={dataset_dir}",
        f"data.val_sets.heldout.input={tiny_data.heldout_corpus}",  # the second validation set, built here too
        f"data.val_sets.heldout.dataset_dir={tmp_path / 'heldout'}",
        "model.seq_len=128",
        "train.batch_tokens=1024",
        "train.micro_batch_size=8",
        "train.train_tokens=4096",
        "train.val_every=2",
        "train.val_tokens=1024",
        "train.log_every=1",
        "tracking.system_metrics=false",
    ]
    first = demo(overrides).stdout
    assert "4 steps x 1024 tokens per arm" in first
    assert (dataset_dir / "manifest.json").exists() and "up to date" not in first  # prepared by the demo
    for arm in ("uniform", "prism"):
        assert f"[{2 if arm == 'uniform' else 3}/4] train {arm}-tiny-s1234 (schedule" in first
        sched = "12x8" if arm == "uniform" else "3x2,6x2,12x4"
        assert f"| tiny | {arm} | {sched} | 1 |" in first  # a row of the comparison table, one run per arm
        assert re.search(rf"final val loss\s+{arm}: \d+\.\d+", first)

    assert "prism demo: estimate from the first steps: training done in about" in first
    # the demo's zero-shot evals (train.eval_every=128: here only the last step, 4) in the table and a plot
    assert re.search(r"^  prism \| prism train: eval at step 4 \(", first, re.M)
    assert "Downstream zero-shot accuracy against tokens" in first and "accuracy_vs_tokens_tiny.png" in first
    assert re.search(r"^uniform \| step +4/4 \|", first, re.M) and re.search(r"^  prism \| step +4/4 \|", first, re.M)

    client = MlflowClient(f"sqlite:///{out_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("prism-tiny")
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.kind = 'train'")
    assert sorted((r.data.tags["arm"], r.info.status) for r in runs) == [("prism", "FINISHED"), ("uniform", "FINISHED")]
    if len(os.sched_getaffinity(0)) >= 2:  # two cores: the arms trained at the same time
        a, b = (r.info for r in runs)
        assert a.start_time < b.end_time and b.start_time < a.end_time

    # The uniform arm trained alone on one thread: exactly the demo's losses, step by step.
    alone = tmp_path / "alone"
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "configs/tiny_uniform.yaml", *overrides]
    cmd += [f"run.output_dir={alone}", "tracking.enabled=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trained = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    rows = [json.loads(x) for x in (alone / "uniform-tiny-s1234" / "checkpoints" / "metrics.jsonl").open()]
    uniform = next(r.info.run_id for r in runs if r.data.tags["arm"] == "uniform")
    for key in ("train/loss", "val/loss", "val/heldout/loss", "train/grad_norm"):  # two validation curves
        demo_values = {m.step: m.value for m in client.get_metric_history(uniform, key)}
        assert demo_values and demo_values == {r["step"]: r[key] for r in rows if key in r}, key

    second = demo(overrides).stdout
    assert "up to date" in second  # the dataset is reused
    for run in runs:
        assert f"train {run.info.run_name}: already finished (MLflow run {run.info.run_id}); skipping" in second
    assert "(schedule" not in second  # no arm trained again
    assert "| tiny | uniform | 12x8 | 1 |" in second and "| tiny | prism | 3x2,6x2,12x4 | 1 |" in second
    again = client.search_runs([experiment.experiment_id], filter_string="tags.kind = 'train'")
    assert sorted(r.info.run_id for r in again) == sorted(r.info.run_id for r in runs)
