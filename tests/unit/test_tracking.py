"""MLflow tracking on SQLite stores: URI resolution, logging to an existing run, what a run logs, milestones,
resume, and the journal's refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipeline import config, schedule
from pipeline.cli import main
from pipeline.compare import latest_per_step
from pipeline.config import ConfigError, flatten
from pipeline.tracking import store
from pipeline.tracking.journal import Journal, sync
from pipeline.tracking.mlflow_run import MlflowTracker, milestone_key


def tiny_cfg(tmp_path, arm="prism", overrides=()):
    return config.load(
        f"configs/tiny_{arm}.yaml", [f"run.output_dir={tmp_path}", "tracking.system_metrics=false", *overrides]
    )


def fake_val_losses(n):
    """A decreasing but bumpy val-loss series, so milestones fall at steps the test must find itself."""
    return [7.4 - 0.25 * i + (0.3 if i % 3 == 2 else 0.0) for i in range(n)]


def log_steps(tracker, steps, losses, batch_tokens):
    for step, loss in zip(steps, losses):
        tracker.log_metrics(
            {
                "train/loss": loss + 0.1,
                "train/tokens_seen": step * batch_tokens,
                "perf/train_tokens_per_sec": 1000.0 + step,
            },
            step,
        )
        tracker.log_metrics({"val/loss": loss}, step)


def test_tracking_uri_resolution(tmp_path, monkeypatch):
    cfg, cfg_stores = tiny_cfg(tmp_path / "study"), tiny_cfg(tmp_path, overrides=["tracking.uri=stores"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stores").mkdir()
    resolve = store.resolve_uri
    # null: the output folder's SQLite store, absolute whatever the cwd was
    assert resolve(None, "runs") == f"sqlite:///{tmp_path}/runs/mlflow.db"
    assert resolve("", tmp_path / "out") == f"sqlite:///{tmp_path}/out/mlflow.db"
    # a path: that SQLite file, or mlflow.db inside an existing folder
    assert resolve("stores/a.db", "runs") == f"sqlite:///{tmp_path}/stores/a.db"
    assert resolve(str(tmp_path / "b.db"), "runs") == f"sqlite:///{tmp_path}/b.db"
    assert resolve("stores", "runs") == f"sqlite:///{tmp_path}/stores/mlflow.db"
    # an explicit sqlite URI: relative paths made absolute (four slashes), absolute ones kept
    assert resolve("sqlite:///stores/c.db", "runs") == f"sqlite:///{tmp_path}/stores/c.db"
    assert resolve(f"sqlite:///{tmp_path}/d.db", "runs") == f"sqlite:///{tmp_path}/d.db"
    # a server (or any other scheme): as given
    assert resolve("http://127.0.0.1:5000", "runs") == "http://127.0.0.1:5000"
    assert resolve("https://mlflow.example:443/", "runs") == "https://mlflow.example:443/"
    assert resolve("file:///tmp/mlruns", "runs") == "file:///tmp/mlruns"
    # the trainer's rule is the same function, on the config
    assert store.run_uri(cfg) == f"sqlite:///{tmp_path}/study/mlflow.db"
    assert store.run_uri(cfg_stores) == f"sqlite:///{tmp_path}/stores/mlflow.db"
    # an SQLite store that is not there is reported, not created; a server is taken on trust
    assert store.sqlite_file(resolve("stores/a.db", "runs")) == tmp_path / "stores" / "a.db"
    assert store.sqlite_file("http://h:1") is None
    assert not store.store_exists(resolve("stores/a.db", "runs")) and store.store_exists("http://h:1")
    (tmp_path / "stores" / "a.db").touch()
    assert store.store_exists(resolve("stores/a.db", "runs"))


def test_eval_and_analysis_log_to_an_existing_run_through_log_to_run(tmp_path, sqlite_store):
    from pipeline.analysis import checkpoints
    from pipeline.eval import zeroshot

    assert zeroshot.log_to_run is store.log_to_run and checkpoints.log_to_run is store.log_to_run

    cfg = tiny_cfg(tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment(cfg.experiment, artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    report = tmp_path / "report.json"
    report.write_text("{}")
    got = store.log_to_run(cfg, run_id, {"eval/piqa/acc": 0.5, "eval/piqa/acc_norm": 0.25}, 7, [("eval", report)])
    assert got == {"logged": True, "uri": store.run_uri(cfg), "run_id": run_id}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/piqa/acc")] == [(7, 0.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/piqa/acc_norm")] == [(7, 0.25)]
    assert [a.path for a in client.list_artifacts(run_id, "eval")] == ["eval/report.json"]

    # A failure is reported, never raised; no run id or tracking off: nothing is tried.
    missing = store.log_to_run(cfg, "0" * 32, {"x": 1.0}, 1, [])
    assert missing["logged"] is False and missing["run_id"] == "0" * 32 and missing["reason"]
    assert store.log_to_run(cfg, None, {"x": 1.0}, 1, [])["logged"] is False
    off = tiny_cfg(tmp_path, overrides=["tracking.enabled=false"])
    assert store.log_to_run(off, run_id, {"x": 1.0}, 1, [])["logged"] is False
    assert [m.value for m in client.get_metric_history(run_id, "x")] == []


def test_tracker_logs_params_tags_artifacts_milestones_and_resumes_same_run(tmp_path, sqlite_store):
    cfg = tiny_cfg(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    losses = fake_val_losses(8)
    tracker = MlflowTracker(cfg)
    run_id = tracker.start(cfg)
    assert run_id and tracker.uri == uri
    log_steps(tracker, range(1, 5), losses[:4], cfg.train.batch_tokens)
    tracker.finish("KILLED")  # a stop signal: the next job resumes the same run

    resumed = MlflowTracker(cfg)
    assert resumed.start(cfg, run_id=run_id) == run_id
    # A rollback replays step 4 with a new value: the latest one must win in analysis.
    log_steps(resumed, range(4, 9), [losses[3] - 0.01, *losses[4:]], cfg.train.batch_tokens)
    resumed.finish()

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    run = runs[0]
    assert run.info.run_name == cfg.run_name and run.info.status == "FINISHED"
    assert set(run.data.params) == set(flatten(cfg.to_dict()))
    assert run.data.params["train.batch_tokens"] == str(cfg.train.batch_tokens)
    tags = run.data.tags
    assert tags["arm"] == "prism" and tags["scale"] == "tiny" and tags["seed"] == str(cfg.run.seed)
    assert tags["schedule"] == schedule.compact(cfg.heads_per_layer) and tags["config_hash"] == cfg.hash()
    assert tags["hostname"] and tags["git_commit"] and tags["kind"] == "train"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "schedule.md"} <= artifacts
    logged_yaml = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path))).read_text()
    assert config.from_dict(yaml.safe_load(logged_yaml)).hash() == cfg.hash()

    val = latest_per_step(client.get_metric_history(run_id, "val/loss"))
    assert list(val) == list(range(1, 9)) and val[4] == pytest.approx(losses[3] - 0.01)
    for x in cfg.tracking.milestones:
        first = next((s for s, v in val.items() if v <= x), None)
        assert client.get_metric_history(run_id, milestone_key(x, "step")) == []  # tags, not chart metrics
        if first is None:
            assert milestone_key(x, "step") not in tags and tags[f"milestone.val_{x!r}"] == "not reached"
            assert repr(float(x)) in tags["milestones_not_reached"].split(",")
        else:
            assert tags[milestone_key(x, "step")] == str(first)
            assert tags[milestone_key(x, "tokens")] == str(first * cfg.train.batch_tokens)
            assert tags[f"milestone.val_{x!r}"].startswith(f"reached at step {first},")
    assert min(val.values()) > min(cfg.tracking.milestones)  # the series leaves some unreached
    assert len(Journal(cfg.checkpoint_dir).pending()) == 0


def test_sync_without_journal_is_a_one_line_error(tmp_path, capsys):
    assert main(["tracking", "sync", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("prism tracking: error:") and "tracking.jsonl" in err and "\n" not in err
    with pytest.raises(ConfigError, match="no tracking.jsonl"):
        sync(tmp_path)
