"""One metric prefix scheme, and `prism compare` still reading runs logged with the names from before it."""

import pytest
from mlflow.tracking import MlflowClient

from pipeline import compare
from pipeline.metric_names import OLD_NAMES, metric_history
from pipeline.tracking.mlflow_run import MlflowTracker
from tests.unit.test_tracking import tiny_cfg

PREFIXES = {"train", "val", "perf", "data", "eval"}


def test_every_renamed_metric_has_a_known_prefix_and_its_old_name_had_none():
    assert {new.split("/")[0] for new in OLD_NAMES} <= PREFIXES
    assert all("/" not in old for old in OLD_NAMES.values())
    assert len(set(OLD_NAMES.values())) == len(OLD_NAMES)


def log_run(client, experiment_id, arm, tokens_key, seconds_per_step):
    """A finished run with val/loss and a token count at steps 1..4, `tokens_key` naming the token metric."""
    run_id = client.create_run(experiment_id, tags={"kind": "train", "arm": arm, "scale": "tiny"}).info.run_id
    client.log_param(run_id, "train.batch_tokens", "1000")  # not what the token metric says: it must be read
    for step in range(1, 5):
        t = 1_000_000 + int(step * seconds_per_step * 1000)
        client.log_metric(run_id, "val/loss", 8.0 - step, timestamp=t, step=step)
        client.log_metric(run_id, tokens_key, 1500.0 * step, timestamp=t, step=step)
    client.set_terminated(run_id)
    return run_id


def test_compare_reads_token_counts_under_the_new_and_the_old_name(tmp_path):
    cfg = tiny_cfg(tmp_path)
    tracker = MlflowTracker(cfg)
    tracker.start(cfg)
    tracker.finish()
    client = MlflowClient(tracker.uri)
    exp_id = client.get_experiment_by_name(cfg.experiment).experiment_id
    client.delete_run(tracker.run_id)  # only the two runs below
    new = log_run(client, exp_id, "prism", "train/tokens_seen", seconds_per_step=2.0)
    old = log_run(client, exp_id, "uniform", "tokens_seen", seconds_per_step=4.0)

    runs = {r.run_id: r for r in compare.load_runs(cfg.experiment, tracker.uri)}
    assert runs[new].tokens_per_sec == pytest.approx(750.0)  # 1500 tokens per 2 s, from train/tokens_seen
    assert runs[old].tokens_per_sec == pytest.approx(375.0)  # 1500 tokens per 4 s, from tokens_seen
    assert [tokens for _, tokens, _ in runs[old].val] == [1500.0, 3000.0, 4500.0, 6000.0]
    assert metric_history(client, old, "val/loss")[0].value == 7.0
    assert metric_history(client, old, "perf/mfu") == []
