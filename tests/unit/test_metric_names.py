"""`prism compare` reads a run's token count from train/tokens_seen, not from the batch size it was given."""

import pytest
from mlflow.tracking import MlflowClient

from pipeline import compare
from pipeline.tracking.mlflow_run import MlflowTracker
from tests.unit.test_tracking import tiny_cfg


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


def test_compare_reads_token_counts_from_the_runs_metric(tmp_path, sqlite_store):
    cfg = tiny_cfg(tmp_path)
    tracker = MlflowTracker(cfg)
    tracker.start(cfg)
    tracker.finish()
    client = MlflowClient(tracker.uri)
    exp_id = client.get_experiment_by_name(cfg.experiment).experiment_id
    client.delete_run(tracker.run_id)  # only the two runs below
    fast = log_run(client, exp_id, "prism", "train/tokens_seen", seconds_per_step=2.0)
    slow = log_run(client, exp_id, "uniform", "train/tokens_seen", seconds_per_step=4.0)

    runs = {r.run_id: r for r in compare.load_runs(cfg.experiment, tracker.uri)}
    assert runs[fast].run_tokens_per_sec == pytest.approx(750.0)  # 1500 tokens per 2 s
    assert runs[slow].run_tokens_per_sec == pytest.approx(375.0)  # 1500 tokens per 4 s
    assert [tokens for _, tokens, _ in runs[slow].val] == [1500.0, 3000.0, 4500.0, 6000.0]
