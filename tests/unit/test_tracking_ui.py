"""What the MLflow UI shows (issue 16 item 4, issue 24 item 4): standard source tags, milestones as tags, the comparison run in its own experiment, the UI links
(the run and the runs list, in the UI's Model-training mode), the data budget as params, not metrics."""

from __future__ import annotations

import getpass
import subprocess
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from pipeline import compare
from pipeline.tracking.mlflow_run import UI_MODE, MlflowTracker, ui_page
from tests.unit.test_tracking import tiny_cfg

ROOT = Path(__file__).resolve().parents[2]


def test_runs_carry_mlflows_source_tags_and_print_their_ui_url(tmp_path, sqlite_store):
    cfg = tiny_cfg(tmp_path)
    tracker = MlflowTracker(cfg)
    run_id = tracker.start(cfg)
    tracker.finish()
    tags = MlflowClient(tracker.uri).get_run(run_id).data.tags
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert tags["mlflow.source.git.commit"] == head
    assert tags["mlflow.source.name"] == f"prism train {cfg.source}"
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.user"] == getpass.getuser()
    exp_id = MlflowClient(tracker.uri).get_experiment_by_name(cfg.experiment).experiment_id
    run_page, runs_page = tracker.ui_links()
    assert run_page == f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs/{run_id}?workflowType=machine_learning"
    assert runs_page == f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs?workflowType=machine_learning"
    first, second = tracker.ui_url().splitlines()  # what `prism train` prints: the run, then the runs list
    assert first == run_page and runs_page in second and f"--backend-store-uri {tracker.uri}" in second


def test_ui_links_of_a_server_keep_its_address_and_mask_its_password():
    assert ui_page("http://u:secret@mlflow.lan:5000/", "7", "abc") == (
        "http://u:***@mlflow.lan:5000/#/experiments/7/runs/abc?workflowType=machine_learning"
    )
    assert ui_page("https://mlflow.lan", "7") == "https://mlflow.lan/#/experiments/7/runs?workflowType=machine_learning"


def test_the_installed_ui_takes_its_mode_from_the_parameter_our_links_carry():
    """MLflow 3.17/3.18 open an experiment in GenAI mode unless the URL says `workflowType=machine_learning`
    (they ignore the `mlflow.experimentKind` tag). If an upgrade changes that, the links land elsewhere."""
    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    key, value = UI_MODE.split("=")
    js = "".join(p.read_text(errors="replace") for p in bundle.glob("main.*.js"))
    assert f'get("{key}")' in js and f'MACHINE_LEARNING="{value}"' in js


def test_the_data_plan_is_params_not_metrics_and_a_resume_names_what_changed(tmp_path, sqlite_store):
    cfg = tiny_cfg(tmp_path)
    tracker = MlflowTracker(cfg)
    run_id = tracker.start(cfg)
    tracker.log_params({"data/epochs": 0.4, "data/tokens_per_epoch": 1966080})
    tracker.log_metrics({"train/loss": 7.0}, 1)
    tracker.finish("KILLED")
    resumed = MlflowTracker(cfg)  # a resume on another DP size: another epoch count
    resumed.start(cfg, run_id=run_id)
    resumed.log_params({"data/epochs": 0.8, "data/tokens_per_epoch": 1966080})
    resumed.finish()

    run = MlflowClient(tracker.uri).get_run(run_id)
    assert run.data.params["data/epochs"] == "0.4" and run.data.params["data/tokens_per_epoch"] == "1966080"
    assert not any(k.startswith("data/") for k in run.data.metrics)  # not in the chart view
    assert run.data.tags["params_changed_on_resume"] == "data/epochs"


def test_comparison_run_lives_in_its_own_experiment_and_milestones_are_read(tmp_path, sqlite_store):
    cfg = tiny_cfg(tmp_path, overrides=["tracking.milestones=[7.0]"])
    tracker = MlflowTracker(cfg)
    new_id = tracker.start(cfg)
    tracker.log_metrics({"train/loss": 7.0, "train/tokens_seen": 4096, "perf/train_tokens_per_sec": 1.0}, 2)
    tracker.log_metrics({"val/loss": 6.9}, 2)
    tracker.finish()
    runs = {r.run_id: r for r in compare.load_runs(cfg.experiment, tracker.uri)}
    assert runs[new_id].milestones[7.0] == (4096.0, 2.0)
    client = MlflowClient(tracker.uri)
    exp = client.get_experiment_by_name(cfg.experiment)

    report = tmp_path / "report.md"
    report.write_text("x")
    comparison_id = compare.log_comparison(cfg.experiment, tracker.uri, [report], list(runs.values()))
    assert {r.info.run_id for r in client.search_runs([exp.experiment_id])} == {new_id}
    comparison = client.get_run(comparison_id)
    placed = client.get_experiment(comparison.info.experiment_id)
    assert placed.name == f"{cfg.experiment}-comparison" and comparison.data.tags["kind"] == "comparison"
    assert comparison.data.tags["compared_experiment"] == cfg.experiment
    assert compare.log_comparison(cfg.experiment, tracker.uri, [report], []) == comparison_id  # reused
