"""Traces of a live run (pipeline.profiling) in two real 2-rank gloo runs of 4 steps, MLflow in SQLite.

Run A finds a request for 2 steps with memory (`prism profile`, written before it starts): rank 0 reads it at
step 1's sync, both ranks trace steps 2-3. Run B traces step 4 from train.profile_steps. Each run's traced
steps are the other's untraced ones, so equal losses show tracing changes nothing. ~60 s on 2 idle cores.
"""

from __future__ import annotations

import gzip
import json
import re

import pytest
from mlflow.tracking import MlflowClient

from pipeline.cli import main
from tests.integration.test_train import overrides, run

STEPS = 4
FEWER = [f"train.train_tokens={STEPS * 1024}", "train.val_every=4"]


def names(path) -> set[str]:
    return {e.get("name", "") for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]}


def traced_steps(path) -> set[int]:
    """The prism_step#N ranges a gzipped Chrome trace holds."""
    return {int(m[1]) for n in names(path) if (m := re.fullmatch(r"prism_step#(\d+)", n))}


def train_run(tiny_data, out, *extra):
    uri = f"sqlite:///{out / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # the store's schema, once, before two ranks open it
    ov = overrides(tiny_data, out, *FEWER, "tracking.enabled=true", f"tracking.uri={uri}", *extra)
    log = run(ov, nproc=2).stdout
    client = MlflowClient(uri)
    (r,) = client.search_runs([client.get_experiment_by_name("prism-tiny").experiment_id])
    return log, client, r


def losses(client, r) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(r.info.run_id, "train/loss"), key=lambda m: m.step)]


def artifacts(client, r, folder: str) -> set[str]:
    return {a.path for a in client.list_artifacts(r.info.run_id, folder)}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    a, b = tmp_path_factory.mktemp("requested"), tmp_path_factory.mktemp("configured")
    run_dir = a / "prism-tiny-s1234"
    run_dir.mkdir()
    assert main(["profile", str(run_dir), "--steps", "2", "--memory"]) == 0
    return {
        "a": (run_dir, *train_run(tiny_data, a)),
        "b": (b / "prism-tiny-s1234", *train_run(tiny_data, b, "train.profile_steps=[4,4]")),
    }


def test_a_request_traces_exactly_the_next_steps_on_every_rank(runs):
    run_dir, log, client, r = runs["a"]
    window = run_dir / "profile" / "step-2-3"
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["step-2-3"]  # request.json consumed
    files = sorted(p.name for p in window.iterdir())
    assert files == ["rank-0.json.gz", "rank-0.memory.txt", "rank-1.json.gz", "rank-1.memory.txt", "served.json"]
    assert traced_steps(window / "rank-0.json.gz") == traced_steps(window / "rank-1.json.gz") == {2, 3}
    layers = {f"layer{i:02d}.{phase}" for i in range(1, 5) for phase in ("forward", "backward")}
    assert layers <= names(window / "rank-1.json.gz")  # each layer's ranges, for per-layer time
    assert "self_cpu_memory_usage" not in (window / "rank-0.memory.txt").read_text()  # a table, not a repr
    assert "Self CPU Mem" in (window / "rank-0.memory.txt").read_text()
    assert f"profile of steps 2-3 written to {window}" in log
    logged = artifacts(client, r, "profile/step-2-3")
    assert logged == {f"profile/step-2-3/{f}" for f in files if f.startswith("rank-")}


def test_configured_steps_are_traced_and_tracing_changes_no_loss(runs):
    run_dir, _, client, r = runs["b"]
    window = run_dir / "profile" / "step-4-4"
    assert traced_steps(window / "rank-1.json.gz") == {4}
    assert not (window / "served.json").exists()  # nothing was requested
    assert artifacts(client, r, "profile/step-4-4") == {f"profile/step-4-4/rank-{i}.json.gz" for i in (0, 1)}
    _, _, client_a, r_a = runs["a"]
    assert len(losses(client, r)) == STEPS
    assert losses(client, r) == losses(client_a, r_a)  # bit for bit: the profiler only observes


def test_the_kernel_report_is_logged_and_said_at_start(runs):
    _, log, client, r = runs["a"]
    params = client.get_run(r.info.run_id).data.params
    layers = params["attention/kernel_layers"].split(",")
    assert len(layers) == 4 and params["attention/kernel_dh32"] == layers[0]
    assert re.search(r"prism train: attention on cpu fp32 \(torch's choice\): layers 1-2 d_h 32 \w+", log)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps 0 is not in [1, 1000]"),
        (["--steps", "2"], "is not a folder"),
    ],
)
def test_a_bad_request_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    target = tmp_path if args[1] == "0" else tmp_path / "missing"
    assert main(["profile", str(target), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
