"""`prism scaling` end to end: the CPU ladder (configs/ladder: 3 widths x 2 arms, 1 seed, 3 steps each) trained by
`prism study`, fitted, written and logged to MLflow; its refusals; and `prism compare`'s scaling section on an
experiment that holds several scales (hand-logged runs in a SQLite store: no training needed to read them)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline import config, model_size
from pipeline.cli import main

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = (64, 128, 192)
EXPERIMENTS = [f"prism-ladder-w{w}" for w in WIDTHS]
PRESETS = [f"configs/ladder/{arm}_w{w}.yaml" for w in WIDTHS for arm in ("uniform", "prism")]
SMALL = [
    "train.batch_tokens=1024",
    "train.micro_batch_size=8",
    "train.train_tokens=3072",  # 3 steps at every width
    "train.val_every=3",
    "train.val_tokens=1024",
    "tracking.system_metrics=false",
]


@pytest.fixture(scope="module")
def ladder(tiny_data, tmp_path_factory):
    """The slimmed ladder, trained two runs at a time, with the study's own scaling report; ~1 min on 2 cores."""
    out = tmp_path_factory.mktemp("ladder")
    cmd = [sys.executable, "-m", "pipeline.cli", "study", *PRESETS, "--seeds", "1", "--jobs", "2"]
    cmd += [*tiny_data.overrides, *SMALL, f"run.output_dir={out}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"prism study exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out, done.stdout


def test_the_ladder_study_fits_writes_and_logs_the_scaling_report(ladder, tmp_path, capsys):
    out, printed = ladder
    assert "## Scaling: prism-ladder-w64, prism-ladder-w128, prism-ladder-w192" in printed, printed[-3000:]
    uri = f"sqlite:///{out / 'mlflow.db'}"
    report = tmp_path / "scaling"
    assert main(["scaling", "--experiment", *EXPERIMENTS, "--tracking-uri", uri, "--out", str(report)]) == 0
    table = capsys.readouterr().out
    sizes = [model_size.parameter_count(config.load(ROOT / f"configs/ladder/prism_w{w}.yaml")) for w in WIDTHS]
    for n in sizes:  # N from each run's logged config, one row per size
        assert f"| {n:,} | uniform | 1 |" in table and f"| {n:,} | prism | 1 |" in table
    assert "needs ≥ 2 seeds per size" in table  # one seed: no seed noise to resample, said so
    rows = list(csv.DictReader((report / "scaling.csv").open()))
    assert [int(float(r["N"])) for r in rows] == sizes and all(r["gap"] for r in rows)
    assert len(list(csv.DictReader((report / "scaling_points.csv").open()))) == 6
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("+".join(EXPERIMENTS) + "-comparison")
    (run,) = client.search_runs([exp.experiment_id], filter_string="tags.kind = 'comparison'")
    logged = {a.path for a in client.list_artifacts(run.info.run_id, "comparison")}
    want = {"scaling.md", "scaling.csv", "scaling_points.csv", "scaling.png"}
    assert {f"comparison/{name}" for name in want} <= logged


def test_bad_input_is_one_line_and_exit_2(ladder, tmp_path, capsys):
    out, _ = ladder
    uri = f"sqlite:///{out / 'mlflow.db'}"
    client = MlflowClient(uri)
    unfinished = client.create_experiment("unfinished", artifact_location=str(tmp_path / "artifacts"))
    client.create_run(unfinished, tags={"kind": "train", "arm": "uniform", "scale": "w1", "seed": "1"})  # RUNNING
    # an experiment whose run finished without a validation loss (validation and evals off): no point to fit
    unscored = client.create_experiment("unscored", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(unscored, tags={"kind": "train", "arm": "prism", "scale": "w2", "seed": "1"})
    client.log_metric(run.info.run_id, "train/loss", 6.0, step=1)
    client.set_terminated(run.info.run_id)
    cases = {
        "uniform 2 size(s)": EXPERIMENTS[:2],
        "'prism-ladder-w999' not found": [*EXPERIMENTS, "prism-ladder-w999"],
        "no FINISHED training run": [*EXPERIMENTS, "unfinished"],
        "'unscored' holds no FINISHED training run with a validation loss": [*EXPERIMENTS, "unscored"],
    }
    for expected, experiments in cases.items():
        args = ["scaling", "--experiment", *experiments, "--tracking-uri", uri, "--out", str(tmp_path / "x")]
        assert main(args) == 2, experiments
        err = capsys.readouterr().err.strip()
        assert expected in err and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "x").exists()  # refused before writing anything


def log_run(client, experiment_id: str, cfg: config.Config, loss: float, tags: dict | None = None) -> None:
    """A finished training run as `prism train` logs it, reduced to what compare and scaling read."""
    from mlflow.entities import Metric

    run = client.create_run(
        experiment_id,
        run_name=cfg.run_name,
        tags={"kind": "train", "arm": cfg.run.arm, "scale": cfg.run.scale, "seed": str(cfg.run.seed), **(tags or {})},
    )
    rid, batch, last = run.info.run_id, cfg.train.batch_tokens, cfg.steps(1)["total"]
    # validated at its schedule's last step, as a finished run is: its final loss is an annealed point
    metrics = [Metric("train/tokens_seen", s * batch, 1_000 * s, s) for s in (1, 2, last)]
    metrics += [Metric("val/loss", loss + 1.0 / s, 1_000 * s, s) for s in (1, last)]
    client.log_batch(rid, metrics=metrics)
    client.log_text(rid, cfg.dump(), "config.yaml")
    client.set_terminated(rid)


def test_compare_on_an_experiment_of_several_scales_shows_the_scaling_section(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    mixed = client.create_experiment("ladder-in-one", artifact_location=str(tmp_path / "artifacts"))
    for w, excess in zip(WIDTHS, (1.0, 0.7, 0.5), strict=True):
        for arm, gain in (("uniform", 1.0), ("prism", 0.95)):
            log_run(client, mixed, config.load(ROOT / f"configs/ladder/{arm}_w{w}.yaml"), 4.0 + gain * excess)
    assert main(["compare", "--experiment", "ladder-in-one", "--tracking-uri", uri, "--out", str(tmp_path / "c")]) == 0
    printed = capsys.readouterr().out
    assert "## Arms comparison: ladder-in-one" in printed and "## Scaling: the scales of this experiment" in printed
    assert (tmp_path / "c" / "scaling.png").is_file()

    other = client.create_experiment("other-tokenizer", artifact_location=str(tmp_path / "artifacts"))
    cfg = config.load(ROOT / "configs/ladder/uniform_w64.yaml", ["data.tokenizer=/elsewhere/bpe.json"])
    log_run(client, other, cfg, 5.0)
    args = ["scaling", "--experiment", "ladder-in-one", "other-tokenizer", "--tracking-uri", uri]
    assert main([*args, "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert "mixed tokenizer" in err and "/elsewhere/bpe.json" in err and "\n" not in err, err
