"""Accuracy against tokens in the arms comparison (pipeline.eval.comparison) on hand-made runs: mean over seeds,
Student's t interval from two seeds on, one column per task (acc_norm where logged), CSV and plot."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from pipeline.compare import RunSeries, _save, compact_tokens
from pipeline.eval import comparison as compare_evals


def run(arm: str, seed: int, scores: dict[str, list[float]]) -> RunSeries:
    """Scores at steps 2 and 4 (tokens 2048 per step); seed 3 of the uniform arm was scored at step 2 only."""
    evals = {key: [(2 * (i + 1), 4096.0 * (i + 1), v) for i, v in enumerate(values)] for key, values in scores.items()}
    return RunSeries(f"id-{arm}-{seed}", f"{arm}-{seed}", arm, "tiny", str(seed), "FINISHED", [], 1.0, evals=evals)


RUNS = [
    run("uniform", 1, {"piqa/acc": [0.50, 0.55], "piqa/acc_norm": [0.52, 0.56], "winogrande/acc": [0.5, 0.5]}),
    run("uniform", 2, {"piqa/acc": [0.54, 0.57], "piqa/acc_norm": [0.50, 0.60], "winogrande/acc": [0.48, 0.52]}),
    run("uniform", 3, {"piqa/acc": [0.52], "piqa/acc_norm": [0.51], "winogrande/acc": [0.49]}),
    run("prism", 1, {"piqa/acc": [0.60, 0.65], "piqa/acc_norm": [0.61, 0.66], "winogrande/acc": [0.51, 0.53]}),
]


def test_mean_and_interval_per_arm_task_and_step():
    rows = {(r["arm"], r["task"], r["metric"], r["step"]): r for r in compare_evals.summarize(RUNS)}
    first = rows[("uniform", "piqa", "acc_norm", 2)]
    values = [0.52, 0.50, 0.51]
    want = stats.t.interval(0.95, 2, loc=sum(values) / 3, scale=stats.sem(values))
    assert (first["runs"], first["tokens"]) == (3, 4096.0)
    assert (first["mean"], first["ci95_low"], first["ci95_high"]) == pytest.approx((sum(values) / 3, *want))
    assert rows[("uniform", "piqa", "acc_norm", 4)]["runs"] == 2  # seed 3 has no score at step 4
    one_seed = rows[("prism", "winogrande", "acc", 4)]
    assert one_seed["mean"] == 0.53 and math.isnan(one_seed["ci95_low"])


def test_table_shows_acc_norm_where_logged_and_the_csv_every_metric(tmp_path):
    rows = compare_evals.summarize(RUNS)
    table = compare_evals.markdown(rows)
    assert "| step | tokens | piqa acc_norm | winogrande acc |" in table
    assert "| tiny | prism |  | 4 | 8,192 | 0.660 (n=1) | 0.530 (n=1) |" in table
    uniform_at_2 = next(line for line in table.splitlines() if line.startswith("| tiny | uniform |  | 2 |"))
    assert "0.510 [" in uniform_at_2  # mean of three seeds with its interval
    csv_text = compare_evals.to_csv(rows)
    assert csv_text.splitlines()[0] == "scale,arm,schedule,task,metric,step,tokens,runs,mean,ci95_low,ci95_high"
    assert sum(",piqa,acc," in line for line in csv_text.splitlines()) == 4  # 2 steps x 2 arms
    assert compare_evals.markdown([]) == "" and compare_evals.to_csv([]) == ""
    (path,) = compare_evals.plot(rows, tmp_path, _save, compact_tokens)
    assert path.name == "accuracy_vs_tokens_tiny.png" and path.read_bytes()[:4] == b"\x89PNG"
