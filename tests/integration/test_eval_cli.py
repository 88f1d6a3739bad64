"""`prism eval` on a real 2-step checkpoint with the offline task sets: scores near chance, logged to the
checkpoint's own MLflow run; bad input is one line."""

from __future__ import annotations

import json

import pytest


def test_prism_eval_offline_scores_near_chance_and_logs_to_the_run(tiny_checkpoints, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pipeline.cli import main
    from pipeline.eval.zeroshot import PAPER_TASKS
    from pipeline.tracking.journal import Journal

    out = tmp_path / "eval.json"
    # The fixture's run is shared: other tests (the documented `prism eval` block) may have logged evals to it
    # already, so this checks what this call adds to each history.
    run_id = Journal(tiny_checkpoints.prism).state()["run_id"]
    client = MlflowClient(tiny_checkpoints.tracking_uri("prism"))
    names = [f"eval/{task}/{m}" for task in PAPER_TASKS for m in ("acc", "acc_norm")]
    before = {name: len(client.get_metric_history(run_id, name)) for name in names}
    args = ["eval", str(tiny_checkpoints.prism), "--limit", "20", "--batch-size", "8", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["step"] == 2 and report["arm"] == "prism" and report["num_fewshot"] == 0
    assert set(report["tasks"]) == set(PAPER_TASKS)
    for task, s in report["tasks"].items():
        assert s["split"] == "validation" and s["source"] == "offline" and s["samples"] == 20
        metrics = ["acc"] if task == "winogrande" else ["acc", "acc_norm"]
        assert set(metrics) <= set(s) and ("acc_norm" in s) == (task != "winogrande")
        for m in metrics:
            assert 0.0 < s[m] < 1.0, f"{task} {m}={s[m]}: a 2-step model is neither perfect nor always wrong"
            assert s[f"{m}_stderr"] > 0
        assert 1 / 5 <= s["chance"] <= 1 / 2
    assert "not comparable" in report["tasks"]["arc_easy"]["note"] and "note: arc_easy" in printed
    # A model trained for 2 steps knows nothing: over 80 questions its accuracy sits near chance (~2.5
    # standard errors allowed; the data and weights are fixed, so this is deterministic, not flaky).
    mean_acc = sum(s["acc"] for s in report["tasks"].values()) / 4
    mean_chance = sum(s["chance"] for s in report["tasks"].values()) / 4
    assert abs(mean_acc - mean_chance) < 0.15

    # Scores went to the checkpoint's own MLflow run, at the checkpoint's step: one new entry per score.
    assert report["mlflow"] == {"logged": True, "uri": report["mlflow"]["uri"], "run_id": run_id}
    for task, s in report["tasks"].items():
        for m in ("acc", "acc_norm"):
            history = client.get_metric_history(run_id, f"eval/{task}/{m}")
            added = sorted(history, key=lambda h: h.timestamp)[before[f"eval/{task}/{m}"] :]
            if m in s:
                assert [(h.step, h.value) for h in added] == [(2, pytest.approx(s[m]))]
            else:
                assert history == []
    assert [a.path for a in client.list_artifacts(run_id, "eval")] == ["eval/eval.json"]


def test_prism_eval_bad_input_is_one_line(tiny_checkpoints, tmp_path, capsys):
    from pipeline.cli import main

    assert main(["eval", str(tiny_checkpoints.prism), "--tasks", "hellaswag,mmlu", "--limit", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("prism eval: error: --tasks: unknown task 'mmlu'") and "\n" not in err
    assert main(["eval", str(tmp_path / "nowhere")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    assert main(["eval", str(tiny_checkpoints.prism), "model.d_model=96"]) == 2
    assert "the checkpoint's weights fix it" in capsys.readouterr().err
