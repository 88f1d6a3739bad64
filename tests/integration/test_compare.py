"""`prism compare` on real tiny runs (2 arms x 2 seeds): numbers against ones computed from the histories."""

from __future__ import annotations

import csv
import statistics

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from pipeline import statistics as prism_statistics
from pipeline.cli import main
from pipeline.compare import latest_per_step, throughput
from pipeline.eval import items as eval_items


def expected_numbers(client, experiment):
    """What the table must say, computed here straight from MLflow's metric histories."""
    exp = client.get_experiment_by_name(experiment)
    by_arm = {"uniform": [], "prism": []}
    for run in client.search_runs([exp.experiment_id], filter_string="tags.kind = 'train'"):
        rid = run.info.run_id
        val = latest_per_step(client.get_metric_history(rid, "val/loss"))
        tokens = latest_per_step(client.get_metric_history(rid, "train/tokens_seen"))
        tps = throughput(client.get_metric_history(rid, "train/tokens_seen"))[0]
        by_arm[run.data.tags["arm"]].append({"final": val[max(val)], "tps": tps, "val": val, "tokens": tokens})
    return by_arm


def first_reach(run, x):
    step = next((s for s, v in run["val"].items() if v <= x), None)
    return None if step is None else (run["tokens"][step], step)


def test_compare_table_csv_plots_and_comparison_run(tracked_runs, tmp_path, capsys):
    from tests.fixtures.tracked_runs import TRACKED_MILESTONES

    out = tmp_path / "report"
    args = [
        "compare",
        "--experiment",
        tracked_runs.experiment,
        "--tracking-uri",
        tracked_runs.uri,
        "--out",
        str(out),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| tiny | uniform | 12x8 | 2 |" in printed and "| tiny | prism | 3x2,6x2,12x4 | 2 |" in printed
    assert "(paired)" in printed  # both arms ran seeds 1 and 2 on one dataset: paired by seed
    # no run has per-item eval results yet (test_compare_pairs_items_and_sequences adds some): one line
    assert "No seed pair of this experiment has per-item eval results" in printed

    client = MlflowClient(tracked_runs.uri)
    want = expected_numbers(client, tracked_runs.experiment)
    rows = {r["arm"]: r for r in csv.DictReader((out / "comparison.csv").open())}
    for arm, runs in want.items():
        row = rows[arm]
        finals = [r["final"] for r in runs]
        assert int(row["runs"]) == 2
        assert float(row["final_val_loss_mean"]) == pytest.approx(statistics.mean(finals))
        assert float(row["final_val_loss_std"]) == pytest.approx(statistics.stdev(finals))
        assert float(row["run_tokens_per_sec_mean"]) == pytest.approx(statistics.mean(r["tps"] for r in runs))
        for x in TRACKED_MILESTONES:
            hits = [h for h in (first_reach(r, x) for r in runs) if h]
            assert int(row[f"val_{x!r}_not_reached"]) == 2 - len(hits)
            if hits:
                assert float(row[f"val_{x!r}_tokens_mean"]) == pytest.approx(statistics.mean(h[0] for h in hits))
                assert float(row[f"val_{x!r}_steps_mean"]) == pytest.approx(statistics.mean(h[1] for h in hits))
            else:
                assert row[f"val_{x!r}_tokens_mean"] == ""
    delta = statistics.mean(r["final"] for r in want["prism"]) - statistics.mean(r["final"] for r in want["uniform"])
    assert float(rows["prism"]["delta_vs_uniform"]) == pytest.approx(delta)
    assert f"{delta:+.4f} [" in printed  # followed by its 95 % CI
    ratio = statistics.mean(r["tps"] for r in want["prism"]) / statistics.mean(r["tps"] for r in want["uniform"])
    assert float(rows["prism"]["run_tokens_per_sec_ratio"]) == pytest.approx(ratio)

    pngs = ["val_loss_vs_tokens_tiny.png", "delta_val_loss_vs_tokens_tiny.png"]
    for name in pngs:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Logged as artifacts of one kind=comparison run, reused (not duplicated) by a second compare, in its
    # own experiment so it is not a line in the arms' charts.
    assert main(args) == 0
    exp = client.get_experiment_by_name(tracked_runs.experiment)
    assert client.search_runs([exp.experiment_id], filter_string="tags.kind = 'comparison'") == []
    exp = client.get_experiment_by_name(f"{tracked_runs.experiment}-comparison")
    (comparison,) = client.search_runs([exp.experiment_id], filter_string="tags.kind = 'comparison'")
    logged = {a.path for a in client.list_artifacts(comparison.info.run_id, "comparison")}
    assert {f"comparison/{n}" for n in ["comparison.md", "comparison.csv", *pngs]} <= logged


def test_compare_unknown_experiment_is_a_one_line_error(tracked_runs, capsys):
    assert main(["compare", "--experiment", "no-such-study", "--tracking-uri", tracked_runs.uri]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("prism compare: error:") and tracked_runs.experiment in err and "\n" not in err


def test_compare_pairs_items_and_sequences(tracked_runs, tmp_path, capsys):
    """Seed 1 of both arms scored by `prism eval` on its final checkpoint: the paired downstream table holds
    each task with McNemar's p on the two item files' discordant items and a bootstrap interval; the paired
    validation table holds both seed pairs, Δ from their per-sequence files, beside the seed-level interval."""
    from tests.fixtures.tracked_runs import TRACKED_STEPS

    step = TRACKED_STEPS
    run_dirs = {arm: tracked_runs.out / f"{arm}-tiny-s1" for arm in ("uniform", "prism")}
    for arm, run_dir in run_dirs.items():
        args = ["eval", str(run_dir / "checkpoints"), "--tasks", "piqa,arc_easy", "--limit", "30", "--batch-size", "8"]
        assert main([*args, "--out", str(tmp_path / f"{arm}.json")]) == 0
    out = tmp_path / "report"
    args = ["compare", "--experiment", tracked_runs.experiment, "--tracking-uri", tracked_runs.uri, "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out

    items = {arm: eval_items.decode_items(eval_items.items_path(d, step).read_bytes()) for arm, d in run_dirs.items()}
    down = {r["task"]: r for r in csv.DictReader((out / "paired_downstream.csv").open())}
    assert sorted(down) == ["arc_easy", "piqa"]
    for task, row in down.items():
        u, p = items["uniform"][task].acc_norm, items["prism"][task].acc_norm
        assert (row["metric"], row["seed_pairs"], row["items"], row["step"]) == ("acc_norm", "1", "30", str(step))
        assert float(row["delta"]) == pytest.approx(np.mean(p) - np.mean(u))
        assert float(row["mcnemar_p"]) == pytest.approx(
            prism_statistics.mcnemar(int(np.sum(u > p)), int(np.sum(p > u)))
        )
        assert float(row["delta_ci95_low"]) <= float(row["delta"]) <= float(row["delta_ci95_high"])
        bpb = items["prism"][task].bpb - items["uniform"][task].bpb
        assert float(row["delta_bpb"]) == pytest.approx(bpb)
    assert "McNemar p (exact; items)" in printed and "items (eval sample)" in printed

    val = {r["seed_pair"]: r for r in csv.DictReader((out / "paired_validation.csv").open())}
    assert sorted(val) == ["uniform-tiny-s1 vs prism-tiny-s1", "uniform-tiny-s2 vs prism-tiny-s2"]
    for seed in (1, 2):
        row = val[f"uniform-tiny-s{seed} vs prism-tiny-s{seed}"]
        losses = {
            arm: eval_items.decode_val(
                eval_items.val_path(tracked_runs.out / f"{arm}-tiny-s{seed}", None, step).read_bytes()
            )
            for arm in ("uniform", "prism")
        }
        assert len(losses["prism"]) == len(losses["uniform"]) > 1  # the same validation rows, one loss each
        assert row["step"] == str(step) and row["sequences"] == str(len(losses["prism"]))
        assert float(row["delta"]) == pytest.approx(np.mean(losses["prism"] - losses["uniform"]))
        assert float(row["delta_ci95_low"]) < float(row["delta"]) < float(row["delta_ci95_high"])
        assert "(paired)" in row["seed_level"]  # the main table's seed-level interval, beside it
    assert "sequences (val sample)" in printed and "seeds (training noise)" in printed
