"""Launchers on a real local two-node Slurm cluster (slurmctld, two slurmd, slurmdbd + MariaDB) and a real
MLflow server: the sbatch presets run as typed with CPU overrides, pre-timeout signals checkpoint + requeue + resume
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

import pytest

from pipeline import config, schedule
from pipeline.config import ConfigError

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
    # Steps 3..10 are the margin for the signal's way (poll, scancel, batch shell, srun, torchrun) to the trainer:
    # at ~0.5 s a step, two or three steps of margin were sometimes too few on a busy machine.
    steps, seed, experiment = 10, 12, "launchers-requeue"
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
    assert "requeueing to resume from latest (job" in text and "restart 1" in text, text[-3000:]
    assert f"resumed from step-{stopped_at:07d}" in text, text[-3000:]
    assert "training finished" in text

    cfg = config.load(ROOT / "configs/tiny_prism.yaml", overrides)
    assert (cfg.checkpoint_dir / "latest").read_text().strip() == f"step-{steps:07d}"
    client, runs = _runs_named(mlflow_server, experiment, cfg.run_name)
    assert len(runs) == 1, f"expected one MLflow run across the requeue, got {len(runs)}"
    history = client.get_metric_history(runs[0].info.run_id, "train/loss")
    assert sorted({m.step for m in history}) == list(range(1, steps + 1))
    tokens = client.get_metric_history(runs[0].info.run_id, "train/tokens_seen")
    assert max(m.value for m in tokens) == steps * BATCH_TOKENS
    assert runs[0].info.status == "FINISHED"


def test_submitit_sweep_two_arms_requeues_a_preempted_job_and_maps_jobs_to_runs(
    slurm_cluster, mlflow_server, tiny_data, tmp_path
):
    from pipeline import sweep
    from pipeline.runs import launch

    # The signal must reach the trainer before its last step: steps 2..12 are the margin for the way there (poll,
    # scancel, submitit's handler, torchrun). With 4 steps and the signal sent after step 2 it sometimes landed
    # in step 4, and the run finished instead of stopping (~0.45 s a step on one CPU).
    steps, experiment = 12, "launchers-sweep"
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
    names = [slurm_cluster.job_name(j.job_id) for j in s.jobs]
    assert names == [launch.run_job_name(p.cfg.checkpoint_dir, p.name) for p in s.points], names  # one job per run
    # Preempt the prism job the way submitit's `#SBATCH --signal=USR2@60` does; the uniform one runs through.
    preempted = s.jobs[0]
    deadline = time.monotonic() + 240
    while not re.search(r"^step +1/", preempted.stdout() or "", re.M):
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
        assert runs[0].data.tags["slurm_job_id"] == job.job_id  # MLflow run <- Slurm job <- grid point
        assert runs[0].data.tags["arm"] == entry["arm"]
        history = client.get_metric_history(runs[0].info.run_id, "train/loss")
        assert sorted({m.step for m in history}) == list(range(1, steps + 1))


# --- two nodes ------------------------------------------------------------------------------------------
TP2_NPROC = 2  # processes per node: TP=2 inside a node, DP across nodes


def _tp2_schedule() -> str:
    """A non-uniform schedule of the tiny preset's shape whose every head count TP=2 divides."""
    m = config.load(ROOT / "configs/tiny_prism.yaml").model
    return next(
        schedule.compact(h) for h in schedule.enumerate_valid(m.d_model, m.num_layers, m.h_base, 2) if len(set(h)) > 1
    )


def _tp2_overrides(tiny_data, tmp_path: Path, server, experiment: str, steps: int, seed: int) -> list[str]:
    return _train_overrides(tiny_data, tmp_path, server, experiment, steps, seed) + [
        "parallel.tp=2",
        f"schedule.heads={_tp2_schedule()}",
        "train.micro_batch_size=2",  # BATCH_TOKENS = DP 2 x micro-batch 2 x seq_len 256
    ]


def _wait_for_step(cluster, job: str, log: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not (log.exists() and re.search(rf"^step +{step}/", log.read_text(), re.M)):
        tail = log.read_text()[-2000:] if log.exists() else ""
        assert time.monotonic() < deadline, f"job {job} did not reach step {step}: {tail}"
        assert cluster.state(job), f"job {job} ended early: {tail}"
        time.sleep(0.2)


def _nodes_of(topology_line: str) -> dict[str, tuple[str, str]]:
    """{node: (its ranks, the step's SLURM_CPUS_PER_TASK)} from the trainer's topology line, in rank order."""
    found = re.findall(r"(\S+) ranks ([\d,]+) \(SLURM_CPUS_PER_TASK (\S+),", topology_line)
    return {node: (ranks, cpus) for node, ranks, cpus in found}


def _losses(server, experiment: str, run_name: str) -> dict[int, float]:
    client, runs = _runs_named(server, experiment, run_name)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", [(r.info.run_id, r.info.status) for r in runs]
    history = sorted(client.get_metric_history(runs[0].info.run_id, "train/loss"), key=lambda m: m.timestamp)
    return {m.step: m.value for m in history}  # the latest value per step


def test_two_node_sbatch_equals_one_node_and_requeues_on_a_signal_to_the_step(
    slurm_cluster, mlflow_server, tiny_data, tmp_path
):
    steps, seed = 4, 31
    env_common = {"PRISM_NPROC_PER_NODE": str(2 * TP2_NPROC)}
    # Reference: the same 4-process layout (TP 2 x DP 2) on one node.
    ref_ov = _tp2_overrides(tiny_data, tmp_path / "one", mlflow_server, "launchers-1node", steps, seed)
    ref_log = tmp_path / "one.out"
    t0 = time.monotonic()
    ref = slurm_cluster.sbatch(
        "launchers/prism_757m.sbatch", {**_sbatch_env(ref_ov, ref_log), **env_common}, ROOT, ("--nodes=1",)
    )
    slurm_cluster.wait_gone(ref, 420)
    ref_text = ref_log.read_text()
    assert slurm_cluster.sacct(ref) == "COMPLETED", ref_text[-3000:]
    assert "1 node(s) x 4 proc(s) = world 4 = TP 2 x DP 2" in ref_text, ref_text[-3000:]
    print(f"one-node reference job: {time.monotonic() - t0:.1f} s")

    # Two nodes x 2 processes; USR1 to the job step (no --batch): srun -> torchrun -> workers checkpoint.
    ov = _tp2_overrides(tiny_data, tmp_path / "two", mlflow_server, "launchers-2node", steps, seed)
    log = tmp_path / "two.out"
    t0 = time.monotonic()
    env = {**_sbatch_env(ov, log), "PRISM_NPROC_PER_NODE": str(TP2_NPROC)}
    job = slurm_cluster.sbatch("launchers/prism_757m.sbatch", env, ROOT, ("--nodes=2",))
    _wait_for_step(slurm_cluster, job, log, 2)
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    slurm_cluster.wait_gone(job, 420)
    text = log.read_text()
    print(f"two-node job with a requeue: {time.monotonic() - t0:.1f} s")
    assert slurm_cluster.sacct(job) == "COMPLETED", text[-3000:]
    assert "2 node(s) x 2 proc(s) = world 4 = TP 2 x DP 2" in text, text[-3000:]
    assert f"master 127.0.0.1:{20000 + int(job) % 10000}" in text, text[-3000:]  # the port follows the job id
    # Ranks ran on both nodes, TP pairs inside a node, and srun gave the step the node's CPUs (both starts).
    topo = re.findall(r"topology: (.*)", text)
    assert len(topo) == 2, text[-3000:]
    for line in topo:
        assert _nodes_of(line) == {
            node: ("0,1" if i == 0 else "2,3", str(slurm_cluster.cpus_per_node))
            for i, node in enumerate(_nodes_of(line))
        }, line
        assert set(_nodes_of(line)) == set(slurm_cluster.nodes), line
    stopped_at = int(re.search(r"checkpoint at step (\d+) written", text).group(1))
    assert 2 <= stopped_at < steps, text[-3000:]
    assert f"checkpointed at step {stopped_at} after a stop signal" in text and "restart 1" in text, text[-3000:]
    assert f"resumed from step-{stopped_at:07d}" in text and "training finished" in text, text[-3000:]

    cfg = config.load(ROOT / "configs/tiny_prism.yaml", ov)
    one = _losses(mlflow_server, "launchers-1node", cfg.run_name)
    two = _losses(mlflow_server, "launchers-2node", cfg.run_name)
    assert sorted(one) == sorted(two) == list(range(1, steps + 1))
    assert two == one, f"two nodes + requeue {two} != one node {one}"


def test_bad_layout_is_refused_in_one_line_before_srun(slurm_cluster, tiny_data, tmp_path):
    overrides = tiny_data.overrides + [f"run.output_dir={tmp_path / 'runs'}", "parallel.tp=2"]
    overrides.append(f"schedule.heads={_tp2_schedule()}")
    log = tmp_path / "job.out"
    env = {**_sbatch_env(overrides, log), "PRISM_NPROC_PER_NODE": "3"}  # world 3: TP 2 cannot divide it
    job = slurm_cluster.sbatch("launchers/prism_757m.sbatch", env, ROOT)
    slurm_cluster.wait_gone(job, 120)
    text = log.read_text()
    assert slurm_cluster.sacct(job) == "FAILED", text
    errors = [line for line in text.splitlines() if "error" in line]
    assert len(errors) == 1 and "world 3 is not divisible by parallel.tp=2" in errors[0], text
    assert "Traceback" not in text and "torchrun" not in text and "requeue" not in text.replace("not requeueing", "")


def test_a_bad_shutdown_grace_is_refused_in_one_line_before_srun(slurm_cluster, tiny_data, tmp_path):
    log = tmp_path / "job.out"
    env = {**_sbatch_env(tiny_data.overrides, log), "PRISM_SHUTDOWN_GRACE": "2m"}
    job = slurm_cluster.sbatch("launchers/prism_757m.sbatch", env, ROOT)
    slurm_cluster.wait_gone(job, 120)
    text = log.read_text()
    assert slurm_cluster.sacct(job) == "FAILED", text
    errors = [line for line in text.splitlines() if "error" in line]
    assert len(errors) == 1 and "PRISM_SHUTDOWN_GRACE='2m'" in errors[0], text
    assert "Traceback" not in text and "torchrun" not in text and "requeue" not in text


def test_submitit_sweep_job_spans_two_nodes(slurm_cluster, mlflow_server, tiny_data, tmp_path):
    from pipeline import sweep

    steps, experiment = 3, "launchers-sweep-2node"
    overrides = _tp2_overrides(tiny_data, tmp_path, mlflow_server, experiment, steps, seed=0)
    t0 = time.monotonic()
    s = sweep.submit(
        arms=["prism"],
        scales=["tiny"],
        seeds=[41],
        overrides=overrides,
        executor="slurm",
        folder=tmp_path / "sweep",
        name="two-node",
        nproc_per_node=TP2_NPROC,
        nodes=2,
        cpus_per_task=2,
        timeout_min=20,
        signal_delay_s=60,
    )
    results = s.wait(timeout_s=420)
    print(f"two-node sweep job: {time.monotonic() - t0:.1f} s")
    job = s.jobs[0]
    log = job.stdout()  # both tasks' (one per node); rank 0 prints the topology
    assert [r["exit_code"] for r in results] == [0], log[-3000:]
    nodes = _nodes_of(re.search(r"topology: (.*)", log).group(1))
    assert set(nodes) == set(slurm_cluster.nodes) and sorted(r for r, _ in nodes.values()) == ["0,1", "2,3"], log
    assert "world 4 = TP 2 x DP 2" in log, log[-3000:]
    assert "--cpus-per-task=2" in Path(job.paths.submission_file).read_text()  # srun gets the CPUs too
    manifest = json.loads(s.manifest_path.read_text())
    [entry] = manifest["jobs"]
    assert (entry["arm"], entry["seed"], entry["job_id"]) == ("prism", 41, job.job_id)
    assert slurm_cluster.sacct(job.job_id) == "COMPLETED"
    assert results[0]["run_name"] == entry["run_name"] == "prism-tiny-s41"
    client, runs = _runs_named(mlflow_server, experiment, entry["run_name"])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "train/loss")
    assert sorted({m.step for m in history}) == list(range(1, steps + 1))


def test_sweep_spec_errors_are_one_line_and_the_example_spec_dry_runs(tmp_path):
    out = sweep_dry_run(ROOT / "launchers/sweeps/example.yaml")
    assert out.returncode == 0, out.stderr
    assert "jobs: 6" in out.stdout and "prism-124m-s3" in out.stdout and "uniform-124m-s1" in out.stdout

    good = "arms: [prism]\nscales: [tiny]\nseeds: [1]\n"
    cases = {
        "arms: [prism\nscales: [tiny]\nseeds: [1]\n": "not valid YAML at line 2",
        "arms: [prism]\nscales: [tiny]\nseeds: [1, two]\n": "seeds: 'two' is not a non-negative integer",
        "arms: [prism]\nscales: [tiny]\nseeds: [1.5]\n": "seeds: 1.5 is not a non-negative integer",
        "arms: [prism]\nscales: [tiny]\nseeds: 3\n": "seeds must be a non-empty list",
        "arms: prism\nscales: [tiny]\nseeds: [1]\n": "arms must be a non-empty list",
        good + "schedules: 4x8\n": "schedules='4x8'",
        good + "schedules: [4x8, 5]\n": "quoted string",
        good + "executor: pbs\n": "executor='pbs'",
        good + "overrides: train.lr=1\n": "overrides=",
        good + "nproc_per_node: two\n": "nproc_per_node='two'",
        good + "slurm: {nodes: 0}\n": "slurm.nodes=0",
        good + "slurm: {cpus: 2}\n": "unknown key slurm.cpus",
        good + "seedz: [1]\n": "unknown key 'seedz'",
        "- arms\n": "is a mapping",
    }
    from pipeline import sweep

    for i, (text, want) in enumerate(cases.items()):
        spec = tmp_path / f"bad{i}.yaml"
        spec.write_text(text)
        with pytest.raises(ConfigError) as err:
            sweep.grid_of_spec(sweep.load_spec(spec))
        assert want in str(err.value) and "\n" not in str(err.value), (text, str(err.value))
    for i in (0, 1):  # through the CLI: one line on stderr, exit 2, no traceback
        out = sweep_dry_run(tmp_path / f"bad{i}.yaml")
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert list(cases.values())[i] in out.stderr, out.stderr


def test_a_signal_after_the_final_checkpoint_does_not_requeue(slurm_cluster, tmp_path):
    # A stand-in torchrun (first on PATH through PRISM_VENV's activate) does what the real step does when
    # USR1 lands after the last checkpoint: the trainer has recorded "finished", then torchrun dies of the
    # signal (138). The job must end COMPLETED, not requeue into a finished run, not FAILED.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:{Path(sys.executable).parent}:$PATH"\n')
    torchrun = venv / "bin" / "torchrun"
    torchrun.write_text('#!/bin/bash\necho "finished 4" > "$PRISM_EXIT_FILE"\nkill -USR1 $$\n')
    torchrun.chmod(0o755)
    log = tmp_path / "job.out"
    env = {**_sbatch_env([f"run.output_dir={tmp_path / 'runs'}"], log), "PRISM_VENV": str(venv)}
    job = slurm_cluster.sbatch("launchers/prism_757m.sbatch", env, ROOT)
    slurm_cluster.wait_gone(job, 120)
    text = log.read_text()
    assert slurm_cluster.sacct(job) == "COMPLETED", text
    assert "a stop signal arrived after the final checkpoint (step exit 138)" in text, text
    assert "requeueing" not in text and "restart 1" not in text, text
