"""Launchers on a real local Slurm cluster (slurmctld, slurmd, slurmdbd + MariaDB) and a real MLflow server:
the sbatch presets run as typed with CPU overrides, pre-timeout signals checkpoint + requeue + resume
into the same MLflow run, and a submitit sweep maps every grid point to its job and run."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from pipeline import config, schedule

ROOT = Path(__file__).resolve().parents[2]
BATCH_TOKENS = 1024  # 8 sequences of 128: one optimizer step per micro-batch, a few seconds per step


def _train_overrides(tiny_data, tmp_path: Path, server, experiment: str, steps: int, seed: int) -> list[str]:
    return tiny_data.overrides + [
        f"run.output_dir={tmp_path / 'runs'}",
        f"run.seed={seed}",
        f"train.batch_tokens={BATCH_TOKENS}",
        f"train.train_tokens={steps * BATCH_TOKENS}",
        "train.val_every=100",
        "train.val_tokens=2048",
        "train.log_every=1",
        "checkpoint.every_steps=100",
        f"tracking.uri={server.url}",
        f"tracking.experiment={experiment}",
        "tracking.system_metrics=false",
    ]


def _sbatch_env(overrides: list[str], log: Path, config_path: str = "configs/tiny_prism.yaml") -> dict[str, str]:
    # The CPU-only way in, environment only: no GPUs requested, one gloo process, our log path.
    return {
        **os.environ,
        "SBATCH_GPUS_PER_NODE": "0",
        "SBATCH_OUTPUT": str(log),
        "SBATCH_ERROR": str(log),
        "PRISM_CONFIG": config_path,
        "PRISM_OVERRIDES": " ".join(overrides),
        "PRISM_VENV": str(Path(sys.prefix)),
        "PRISM_SHUTDOWN_GRACE": "60",
    }


def _runs_named(server, experiment: str, run_name: str, want_status: str = "FINISHED", timeout_s: float = 30):
    """MLflow runs of ``experiment`` called ``run_name``, once the newest has ``want_status``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.url)
    deadline = time.monotonic() + timeout_s
    while True:
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id], f"attributes.run_name = '{run_name}'") if exp else []
        if (runs and runs[0].info.status == want_status) or time.monotonic() > deadline:
            return client, runs
        time.sleep(0.5)


def sweep_dry_run(spec: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline.cli", "sweep", str(spec), "--dry-run"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_sweep_dry_run_counts_the_grid(tmp_path):
    ramps = (h for h in schedule.enumerate_valid(768, 12, 12) if len(set(h)) > 1)  # non-constant 124m schedules
    heads_124m = [schedule.compact(h) for h in itertools.islice(ramps, 3)]
    valid_tiny = list(schedule.enumerate_valid(192, 8, 12))  # configs/tiny_prism.yaml: d 192, 8 layers, h_base 12
    cases = [
        ({"arms": ["prism"], "scales": ["124m"], "seeds": [1, 2, 3], "schedules": heads_124m}, 1 * 1 * 3 * 3),
        ({"arms": ["prism", "uniform"], "scales": ["124m", "354m"], "seeds": [1, 2]}, 2 * 2 * 2 * 1),
        (
            {"arms": ["prism"], "scales": ["tiny"], "seeds": [5, 6], "schedules": "all-valid"},
            2 * len(valid_tiny),
        ),
    ]
    assert len(valid_tiny) > 1
    for i, (spec, expected) in enumerate(cases):
        path = tmp_path / f"spec{i}.yaml"
        path.write_text(json.dumps(spec))  # JSON is YAML
        out = sweep_dry_run(path)
        assert out.returncode == 0, out.stderr
        assert f"jobs: {expected}" in out.stdout
        rows = [line for line in out.stdout.splitlines() if "->" in line and not line.lstrip().startswith("#")]
        assert len(rows) == expected
        if spec.get("schedules") == "all-valid":
            assert {r.split()[4] for r in rows} == {schedule.compact(h) for h in valid_tiny}

    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"arms": ["uniform"], "scales": ["124m"], "seeds": [1], "schedules": heads_124m[:1]}))
    out = sweep_dry_run(bad)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "uniform" in out.stderr, out.stderr


def test_sbatch_preset_runs_tiny_on_cpu_and_logs_to_mlflow(slurm_cluster, mlflow_server, tiny_data, tmp_path):
    steps, seed, experiment = 4, 11, "launchers-sbatch"
    overrides = _train_overrides(tiny_data, tmp_path, mlflow_server, experiment, steps, seed)
    log = tmp_path / "job.out"
    job = slurm_cluster.sbatch("launchers/prism_757m.sbatch", _sbatch_env(overrides, log), ROOT)
    slurm_cluster.wait_gone(job, 300)
    text = log.read_text()
    assert slurm_cluster.sacct(job) == "COMPLETED", text[-3000:]
    assert "training finished" in text and "requeueing" not in text, text[-3000:]

    cfg = config.load(ROOT / "configs/tiny_prism.yaml", overrides)
    assert (cfg.checkpoint_dir / "latest").read_text().strip() == f"step-{steps:07d}"
    client, runs = _runs_named(mlflow_server, experiment, cfg.run_name)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["arm"] == "prism" and tags["scale"] == "tiny" and tags["seed"] == str(seed)
    assert tags["slurm_job_id"] == job
    assert tags["schedule"] == schedule.compact(cfg.heads_per_layer)
    assert tags["config_hash"] == cfg.hash()
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == steps


def test_pre_timeout_signal_checkpoints_requeues_and_resumes_into_one_run(
    slurm_cluster, mlflow_server, tiny_data, tmp_path
):
    steps, seed, experiment = 6, 12, "launchers-requeue"
    overrides = _train_overrides(tiny_data, tmp_path, mlflow_server, experiment, steps, seed)
    log = tmp_path / "job.out"
    job = slurm_cluster.sbatch("launchers/prism_757m.sbatch", _sbatch_env(overrides, log), ROOT)
    deadline = time.monotonic() + 240
    while not (log.exists() and re.search(r"^step +2/", log.read_text(), re.M)):
        assert time.monotonic() < deadline, (
            f"job {job} did not reach step 2: {log.read_text()[-2000:] if log.exists() else ''}"
        )
        assert slurm_cluster.state(job), f"job {job} ended early: {log.read_text()[-2000:] if log.exists() else ''}"
        time.sleep(0.2)
    # What `#SBATCH --signal=B:USR1@180` does before the time limit: USR1 to the batch shell only.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    slurm_cluster.wait_gone(job, 300)
    text = log.read_text()
    assert slurm_cluster.sacct(job) == "COMPLETED", text[-3000:]
    stopped_at = int(re.search(r"checkpoint at step (\d+) written", text).group(1))
    assert 2 <= stopped_at < steps, text[-3000:]
    assert "requeueing job" in text and "restart 1" in text, text[-3000:]
    assert f"resumed from step-{stopped_at:07d}" in text, text[-3000:]
    assert "training finished" in text

    cfg = config.load(ROOT / "configs/tiny_prism.yaml", overrides)
    assert (cfg.checkpoint_dir / "latest").read_text().strip() == f"step-{steps:07d}"
    client, runs = _runs_named(mlflow_server, experiment, cfg.run_name)
    assert len(runs) == 1, f"expected one MLflow run across the requeue, got {len(runs)}"
    history = client.get_metric_history(runs[0].info.run_id, "train/loss")
    assert sorted({m.step for m in history}) == list(range(1, steps + 1))
    tokens = client.get_metric_history(runs[0].info.run_id, "tokens_seen")
    assert max(m.value for m in tokens) == steps * BATCH_TOKENS
    assert runs[0].info.status == "FINISHED"


def test_submitit_sweep_two_arms_requeues_a_preempted_job_and_maps_jobs_to_runs(
    slurm_cluster, mlflow_server, tiny_data, tmp_path
):
    from launchers import sweep

    steps, experiment = 4, "launchers-sweep"
    overrides = _train_overrides(tiny_data, tmp_path, mlflow_server, experiment, steps, seed=0)  # seeds: below
    s = sweep.submit(
        arms=["prism", "uniform"],
        scales=["tiny"],
        seeds=[21],
        overrides=overrides,
        executor="slurm",
        folder=tmp_path / "sweep",
        name="test",
        cpus_per_task=1,
        timeout_min=20,
        signal_delay_s=60,
    )
    assert len({j.job_id.split("_")[0] for j in s.jobs}) == 1, "one job array for the whole grid"
    # Preempt the prism job the way submitit's `#SBATCH --signal=USR2@60` does; the uniform one runs through.
    preempted = s.jobs[0]
    deadline = time.monotonic() + 240
    while not re.search(r"^step +2/", preempted.stdout() or "", re.M):
        assert time.monotonic() < deadline and not preempted.done(), (preempted.stderr() or "")[-2000:]
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR2", preempted.job_id], check=True, timeout=30)
    results = s.wait(timeout_s=360)
    assert [r["exit_code"] for r in results] == [0, 0]
    log = preempted.stdout()
    stopped_at = int(re.search(r"checkpoint at step (\d+) written", log).group(1))
    assert stopped_at < steps and f"resumed from step-{stopped_at:07d}" in log, log[-3000:]
    assert "resumed from" not in s.jobs[1].stdout()

    manifest = json.loads(s.manifest_path.read_text())
    assert [(e["arm"], e["seed"], e["job_id"]) for e in manifest["jobs"]] == [
        ("prism", 21, s.jobs[0].job_id),
        ("uniform", 21, s.jobs[1].job_id),
    ]
    for entry, job in zip(manifest["jobs"], s.jobs):
        assert slurm_cluster.sacct(job.job_id) == "COMPLETED"
        assert entry["run_name"] == f"{entry['arm']}-tiny-s21"
        client, runs = _runs_named(mlflow_server, experiment, entry["run_name"])
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # one run, also across the requeue
        assert runs[0].data.tags["slurm_array"] == job.job_id  # MLflow run <- Slurm array task <- grid point
        assert runs[0].data.tags["arm"] == entry["arm"]
        history = client.get_metric_history(runs[0].info.run_id, "train/loss")
        assert sorted({m.step for m in history}) == list(range(1, steps + 1))
