"""Unattended recovery on the local two-node Slurm cluster (one training process per node, gloo): a crash or a
hang of one rank restarts the job step in its allocation from `latest`, and the run ends with the uninterrupted
run's losses; the same crash at every start stops after one restart with one line; a sweep job keeps
requeueing past submitit's default of three time-outs. Faults come from PRISM_FAULT_* (pipeline/faults.py)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from pipeline import config
from tests.integration.test_launchers import ROOT, _losses, _sbatch_env, _train_overrides

STEPS, SEED = 6, 61
TIMEOUT_S = 20  # parallel.timeout_s in the hang test: above a healthy step's longest wait on a busy machine
GRACE_S = 5  # PRISM_SHUTDOWN_GRACE: torchrun's wait before it SIGKILLs the hung rank
MARGIN_S = 25  # stated margin for the rest: the stack timer, the exit record, srun ending the step, one restart


def _overrides(tiny_data, tmp_path: Path, server, experiment: str) -> list[str]:
    return _train_overrides(tiny_data, tmp_path, server, experiment, STEPS, SEED) + [
        "train.micro_batch_size=4",  # DP 2 x 4 sequences of 128 = the 1024-token batch, one micro-batch each
        "checkpoint.every_steps=2",
        f"parallel.timeout_s={TIMEOUT_S}",
    ]


def _two_node_job(cluster, overrides: list[str], log: Path, **env: str) -> str:
    env = {**_sbatch_env(overrides, log), "PRISM_NPROC_PER_NODE": "1", "PRISM_SHUTDOWN_GRACE": str(GRACE_S), **env}
    return cluster.sbatch("launchers/prism_757m.sbatch", env, ROOT, ("--nodes=2",))


@pytest.fixture(scope="module")
def reference(slurm_cluster, mlflow_server, tiny_data, tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run's losses, same layout and seed."""
    tmp = tmp_path_factory.mktemp("recovery-reference")
    ov = _overrides(tiny_data, tmp, mlflow_server, "recovery-reference")
    job = _two_node_job(slurm_cluster, ov, tmp / "job.out")
    slurm_cluster.wait_gone(job, 300)
    assert slurm_cluster.sacct(job) == "COMPLETED", (tmp / "job.out").read_text()[-3000:]
    return _losses(mlflow_server, "recovery-reference", config.load(ROOT / "configs/tiny_prism.yaml", ov).run_name)


def test_a_crash_on_one_rank_restarts_from_latest_and_matches_the_uninterrupted_run(
    slurm_cluster, mlflow_server, tiny_data, tmp_path, reference
):
    ov = _overrides(tiny_data, tmp_path, mlflow_server, "recovery-crash")
    log = tmp_path / "job.out"
    job = _two_node_job(slurm_cluster, ov, log, PRISM_FAULT_CRASH="4:1", PRISM_FAULT_ONCE=str(tmp_path / "fired"))
    slurm_cluster.wait_gone(job, 420)
    text = log.read_text()
    assert slurm_cluster.sacct(job) == "COMPLETED", text[-4000:]
    assert "InjectedFault: PRISM_FAULT_CRASH: injected crash at step 4 on rank 1" in text, text[-4000:]
    assert "restart 1 of 3 (PRISM_MAX_RESTARTS) from latest, step 2" in text, text[-4000:]
    assert "resumed from step-0000002" in text and "training finished" in text, text[-4000:]
    cfg = config.load(ROOT / "configs/tiny_prism.yaml", ov)
    assert _losses(mlflow_server, "recovery-crash", cfg.run_name) == reference


def test_the_same_crash_at_every_start_stops_with_one_line(slurm_cluster, mlflow_server, tiny_data, tmp_path):
    ov = _overrides(tiny_data, tmp_path, mlflow_server, "recovery-loop")
    log = tmp_path / "job.out"
    job = _two_node_job(slurm_cluster, ov, log, PRISM_FAULT_CRASH="3:1", PRISM_MAX_RESTARTS="2")
    slurm_cluster.wait_gone(job, 420)
    text = log.read_text()
    assert slurm_cluster.sacct(job) == "FAILED", text[-4000:]
    errors = [line for line in text.splitlines() if line.startswith("train_job: error:")]
    cfg = config.load(ROOT / "configs/tiny_prism.yaml", ov)
    assert len(errors) == 1 and "not restarting" in errors[0], text[-4000:]
    assert re.search(r"step \d+", errors[0]) and str(cfg.checkpoint_dir / "diagnostics") in errors[0], errors[0]
    assert 1 <= text.count("(PRISM_MAX_RESTARTS) from latest") <= 2, text[-4000:]
    assert "training finished" not in text


def test_a_hung_rank_leaves_every_stack_ends_within_the_timeout_and_resumes(
    slurm_cluster, mlflow_server, tiny_data, tmp_path, reference
):
    ov = _overrides(tiny_data, tmp_path, mlflow_server, "recovery-hang")
    log = tmp_path / "job.out"
    job = _two_node_job(slurm_cluster, ov, log, PRISM_FAULT_HANG="4:1", PRISM_FAULT_ONCE=str(tmp_path / "fired"))
    deadline = time.monotonic() + 300
    while "PRISM_FAULT_HANG: rank 1 hangs" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and slurm_cluster.state(job), log.read_text()[-3000:]
        time.sleep(0.2)
    hung_at = time.monotonic()
    while "(PRISM_MAX_RESTARTS) from latest" not in log.read_text():
        assert slurm_cluster.state(job), log.read_text()[-3000:]
        time.sleep(0.2)
    ended_in = time.monotonic() - hung_at
    slurm_cluster.wait_gone(job, 300)
    text = log.read_text()
    print(f"hung step ended after {ended_in:.1f} s (timeout {TIMEOUT_S} s + grace {GRACE_S} s + margin {MARGIN_S} s)")
    assert ended_in < TIMEOUT_S + GRACE_S + MARGIN_S, text[-4000:]
    assert slurm_cluster.sacct(job) == "COMPLETED", text[-4000:]
    assert "infrastructure fault at step 3" in text and "training finished" in text, text[-4000:]
    cfg = config.load(ROOT / "configs/tiny_prism.yaml", ov)
    stacks = {r: (cfg.checkpoint_dir / "diagnostics" / f"stacks-rank{r}.txt").read_text() for r in (0, 1)}
    assert "faults.py" in stacks[1] and "in _inject" in stacks[1], stacks[1]  # where it hung
    assert "pipeline/train/" in stacks[0] and "(most recent call first)" in stacks[0], stacks[0]  # what it waited in
    assert _losses(mlflow_server, "recovery-hang", cfg.run_name) == reference


def _sweep_job(tiny_data, tmp_path: Path, name: str, steps: int, seed: int, *extra: str, **executor_params):
    """The one job of a one-point sweep of a ``steps``-step tiny run, submitted to the local cluster."""
    from pipeline import sweep

    overrides = tiny_data.overrides + [
        f"run.output_dir={tmp_path / 'runs'}",
        "train.batch_tokens=1024",
        f"train.train_tokens={steps * 1024}",
        "train.val_tokens=1024",
        "tracking.enabled=false",
        *extra,
    ]
    s = sweep.submit(
        arms=["prism"],
        scales=["tiny"],
        seeds=[seed],
        overrides=overrides,
        executor="slurm",
        folder=tmp_path / "sweep",
        name=name,
        cpus_per_task=1,
        **executor_params,
    )
    return s, s.jobs[0]


def test_a_sweep_job_keeps_requeueing_after_more_than_three_time_outs(slurm_cluster, tiny_data, tmp_path):
    # submitit counts a signal as a time-out, not a preemption, in a job this short
    s, job = _sweep_job(tiny_data, tmp_path, "timeouts", 2, 51, timeout_min=1, signal_delay_s=15)
    for started in range(1, 5):  # what Slurm's `--signal=USR2@DELAY` does near the time limit, four times
        deadline = time.monotonic() + 120
        while (job.stdout() or "").count("sweep job:") < started:
            assert time.monotonic() < deadline and not job.done(), (job.stderr() or "")[-3000:]
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=30)
    [result] = s.wait(timeout_s=300)
    assert result["exit_code"] == 0
    log = job.stderr() or ""
    assert log.count("this job is timed-out") >= 4 and "timed-out too many times" not in log, log[-3000:]
    assert slurm_cluster.sacct(job.job_id) == "COMPLETED"


def _crashing_sweep_job(tiny_data, tmp_path: Path, monkeypatch, name: str, **faults: str):
    """A sweep job of a 3-step tiny run with a checkpoint every step and PRISM_FAULT_* (and PRISM_MAX_RESTARTS)
    in its environment (sbatch passes the submitting environment on); returns it once it ended."""
    for key, value in faults.items():
        monkeypatch.setenv(key, value)
    # a synchronous save: each step's checkpoint is latest before the next step starts (and can crash)
    extra = ("train.val_every=100", "checkpoint.every_steps=1", "checkpoint.async_save=false")
    _, job = _sweep_job(tiny_data, tmp_path, name, 3, 53, *extra, timeout_min=10)
    deadline = time.monotonic() + 420
    while not job.done():
        assert time.monotonic() < deadline, (job.stdout() or "")[-3000:]
        time.sleep(1)
    return job


def test_a_sweep_job_that_crashes_once_restarts_in_its_allocation_and_finishes(
    slurm_cluster, tiny_data, tmp_path, monkeypatch
):
    job = _crashing_sweep_job(
        tiny_data, tmp_path, monkeypatch, "crash-once", PRISM_FAULT_CRASH="2", PRISM_FAULT_ONCE=str(tmp_path / "fired")
    )
    out = job.stdout() or ""
    assert job.result()["exit_code"] == 0, (out + (job.stderr() or ""))[-4000:]
    # the fault fires at the start of step 2: one step is done, the record says 1
    restarted = "at step 1 (exit 1); restart 1 of 3 (PRISM_MAX_RESTARTS) from latest, step 1"
    assert "sweep job: crash (a Python exception" in out and restarted in out, out[-4000:]
    assert "resumed from step-0000001" in out and "sweep job: training finished" in out, out[-4000:]
    assert out.count("torch.distributed.run") == 2, out[-4000:]  # two starts
    assert slurm_cluster.sacct(job.job_id) == "COMPLETED"


def test_a_sweep_job_that_crashes_at_every_start_stops_after_the_bound_with_one_line(
    slurm_cluster, tiny_data, tmp_path, monkeypatch
):
    job = _crashing_sweep_job(
        tiny_data, tmp_path, monkeypatch, "crash-always", PRISM_FAULT_CRASH="1", PRISM_MAX_RESTARTS="1"
    )
    out = job.stdout() or ""
    errors = [line for line in out.splitlines() if line.startswith("sweep job: error:")]
    # the fault fires at the start of step 1, before any step is done: the record says 0
    assert len(errors) == 1 and "crash loop: step 0" in errors[0] and "not restarting" in errors[0], out[-4000:]
    assert out.count("restart 1 of 1 (PRISM_MAX_RESTARTS)") == 1 and "training finished" not in out, out[-4000:]
    with pytest.raises(Exception, match="not restarting"):
        job.result()
    assert slurm_cluster.sacct(job.job_id) == "FAILED"
