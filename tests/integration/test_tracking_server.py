"""MLflow tracking against a real `mlflow server`: an outage mid-run is journalled and replayed, `prism
tracking sync` delivers a run logged while the server was unreachable, and four real tiny training runs log
params, tags, metrics, artifacts and milestones (one resumed into the same run)."""

from __future__ import annotations

import socket
import time

import pytest
from mlflow.tracking import MlflowClient

from pipeline import budget, config, schedule
from pipeline.cli import main
from pipeline.compare import latest_per_step
from pipeline.config import flatten
from pipeline.dataset import read_manifest
from pipeline.model import sdpa_backend
from pipeline.tracking.journal import Journal, sync
from pipeline.tracking.mlflow_run import MlflowTracker, milestone_key
from tests.fixtures.tracked_runs import TRACKED_MILESTONES, TRACKED_STEPS
from tests.unit.test_tracking import fake_val_losses, log_steps, tiny_cfg


def assert_every_step_once(client, run_id, steps, losses):
    for key in ("train/loss", "val/loss", "train/tokens_seen", "perf/train_tokens_per_sec"):
        per_step = {}
        for m in client.get_metric_history(run_id, key):
            per_step.setdefault(m.step, []).append(m.value)
        assert sorted(per_step) == steps, key
        assert all(len(v) == 1 for v in per_step.values()), key  # replayed, never duplicated
    val = {m.step: m.value for m in client.get_metric_history(run_id, "val/loss")}
    assert val == pytest.approx(dict(zip(steps, losses)))


def test_server_outage_mid_run_buffers_then_replays_every_step_once(tmp_path, mlflow_server):
    cfg = tiny_cfg(tmp_path, "uniform", [f"tracking.uri={mlflow_server.url}", "tracking.experiment=outage"])
    steps, losses = list(range(1, 13)), fake_val_losses(12)
    tracker = MlflowTracker(cfg)
    tracker.retry_after_s = 0.0  # retry at every call so the test sees the recovery at once
    run_id = tracker.start(cfg)
    log_steps(tracker, steps[:4], losses[:4], cfg.train.batch_tokens)
    try:
        mlflow_server.stop()
        t0 = time.monotonic()
        log_steps(tracker, steps[4:8], losses[4:8], cfg.train.batch_tokens)  # server down: must not stall
        assert time.monotonic() - t0 < 30
        pending = Journal(cfg.checkpoint_dir).pending()
        assert not tracker.online and sum(r["op"] == "metrics" for r in pending) == 8
    finally:
        mlflow_server.start()
    log_steps(tracker, steps[8:], losses[8:], cfg.train.batch_tokens)  # first success replays the backlog
    tracker.finish()
    assert tracker.online and Journal(cfg.checkpoint_dir).pending() == []
    client = MlflowClient(mlflow_server.url)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert_every_step_once(client, run_id, steps, losses)


def test_tracking_sync_delivers_a_run_logged_while_the_server_was_unreachable(tmp_path, mlflow_server):
    with socket.socket() as s:  # a port nobody listens on: the server is "down" for the whole run
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cfg = tiny_cfg(tmp_path, "prism", [f"tracking.uri={dead}", "tracking.experiment=sync"])
    steps, losses = list(range(1, 7)), fake_val_losses(6)
    tracker = MlflowTracker(cfg)
    assert tracker.start(cfg) is None  # no run could be created; training goes on regardless
    log_steps(tracker, steps, losses, cfg.train.batch_tokens)
    tracker.finish()
    pending = len(Journal(cfg.checkpoint_dir).pending())
    assert pending >= 2 * len(steps) + 3  # start, metrics, artifacts, milestone tags, finish
    assert main(["tracking", "sync", str(cfg.run_dir)]) == 2  # still unreachable: clear error, nothing lost
    assert len(Journal(cfg.checkpoint_dir).pending()) == pending

    assert main(["tracking", "sync", str(cfg.run_dir), "--tracking-uri", mlflow_server.url]) == 0
    assert Journal(cfg.checkpoint_dir).pending() == []
    assert sync(cfg.checkpoint_dir, mlflow_server.url)[0] == 0  # a second sync has nothing left to send
    client = MlflowClient(mlflow_server.url)
    (run,) = client.search_runs([client.get_experiment_by_name("sync").experiment_id])
    assert run.info.run_name == cfg.run_name and run.info.status == "FINISHED"
    assert run.data.tags["arm"] == "prism" and {"config.yaml", "schedule.md"} <= {
        a.path for a in client.list_artifacts(run.info.run_id)
    }
    assert_every_step_once(client, run.info.run_id, steps, losses)


def test_real_tiny_runs_log_params_tags_metrics_artifacts_milestones_and_resume(tracked_runs):
    client = MlflowClient(tracked_runs.uri)
    exp = client.get_experiment_by_name(tracked_runs.experiment)
    runs = client.search_runs([exp.experiment_id], filter_string="tags.kind = 'train'")
    names = sorted(r.info.run_name for r in runs)
    # uniform s2 was stopped and resumed: still one run for it
    assert names == ["prism-tiny-s1", "prism-tiny-s2", "uniform-tiny-s1", "uniform-tiny-s2"]
    for run in runs:
        arm, seed = run.data.tags["arm"], int(run.data.tags["seed"])
        cfg = config.load(
            f"configs/tiny_{arm}.yaml",
            [*tracked_runs.overrides, f"run.seed={seed}", f"train.train_tokens={TRACKED_STEPS * 1024}"],
        )
        rid = run.info.run_id
        assert run.info.status == "FINISHED" and run.info.run_name == cfg.run_name
        kernels = sdpa_backend.kernel_params(cfg, sdpa_backend.layer_kernels(cfg, "cpu"))  # torch's answer here
        extra = {"data/epochs", "data/tokens_per_epoch", "parallel/dp_size", *kernels}
        assert set(run.data.params) == set(flatten(cfg.to_dict())) | extra
        assert {k: run.data.params[k] for k in kernels} == kernels
        assert run.data.params["parallel/dp_size"] == "1"
        manifest = read_manifest(cfg.data.dataset_dir)
        assert run.data.params["data/tokens_per_epoch"] == str(budget.tokens_per_epoch(manifest, 1))
        assert run.data.params["schedule.heads"] == cfg.schedule.heads
        tags = run.data.tags
        assert tags["schedule"] == schedule.compact(cfg.heads_per_layer) and tags["config_hash"] == cfg.hash()
        assert tags["scale"] == "tiny" and tags["hostname"]
        assert Journal(cfg.checkpoint_dir).state()["run_id"] == rid
        assert {"config.yaml", "schedule.md"} <= {a.path for a in client.list_artifacts(rid)}
        keys = set(run.data.metrics)
        assert not any(k.startswith("data/") for k in keys)  # constants are params, not charts
        assert {
            "train/loss",
            "val/loss",
            "train/lr",
            "train/grad_norm",
            "train/tokens_seen",
            "perf/train_tokens_per_sec",
            "perf/step_time",
        } <= keys
        assert any(k.startswith("system/") for k in keys)  # MLflow system metrics are on
        train = latest_per_step(client.get_metric_history(rid, "train/loss"))
        assert list(train) == list(range(1, TRACKED_STEPS + 1))
        val = latest_per_step(client.get_metric_history(rid, "val/loss"))
        assert {2, 4, 6} <= set(val) and max(val) == TRACKED_STEPS  # (+ step 3: the end of the first job)
        tokens = latest_per_step(client.get_metric_history(rid, "train/tokens_seen"))
        for x in TRACKED_MILESTONES:
            first = next((s for s, v in val.items() if v <= x), None)
            assert client.get_metric_history(rid, milestone_key(x, "step")) == []  # tags, not chart metrics
            if first is None:
                assert milestone_key(x, "step") not in tags and tags[f"milestone.val_{x!r}"] == "not reached"
            else:
                assert int(tags[milestone_key(x, "step")]) == first
                assert float(tags[milestone_key(x, "tokens")]) == tokens[first]
        assert "2.0" in tags["milestones_not_reached"].split(",")
        if cfg.run_name == "uniform-tiny-s2":
            # the second job doubled the budget, so twice the epochs: both names, the first values kept
            assert set(tags["params_changed_on_resume"].split(",")) == {"train.train_tokens", "data/epochs"}
            assert float(run.data.params["data/epochs"]) == round(3 * 1024 / budget.tokens_per_epoch(manifest, 1), 4)
