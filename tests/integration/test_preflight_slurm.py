"""Bad nodes left behind, on the local two-node Slurm cluster: a node whose pre-flight fails (PRISM_FAULT_PREFLIGHT,
pipeline/faults.py) is excluded from the job, which is requeued and finishes on the other node; and the
exclusions stay within PRISM_MAX_RESTARTS. 64 s and 44 s, measured on a shared 2-core machine under load."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from pipeline import config
from tests.integration.test_launchers import ROOT, _runs_named, _sbatch_env, _train_overrides

STEPS, SEED = 2, 71


def _hold_node(cluster, node: str, tmp_path: Path) -> str:
    """A job that takes ``node`` whole: Slurm places the next one-node job on the other node."""
    script = tmp_path / "hold.sh"
    script.write_text("#!/bin/bash\nsleep 600\n")
    job = cluster.sbatch(str(script), dict(os.environ), tmp_path, ("-w", node, "--exclusive", "-o", "/dev/null"))
    deadline = time.monotonic() + 60
    while cluster.state(job) != "RUNNING":
        assert time.monotonic() < deadline, f"the job holding {node} did not start"
        time.sleep(0.2)
    return job


def _wait_for(log: Path, text: str, cluster, job: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and cluster.state(job), (log.read_text() if log.exists() else "")[-3000:]
        time.sleep(0.2)


def _job_field(job: str, name: str) -> str:
    from launchers.nodes import job_field

    show = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    return job_field(show.stdout, name)


def test_a_node_failing_its_preflight_is_excluded_and_the_job_finishes_on_the_other(
    slurm_cluster, mlflow_server, tiny_data, tmp_path
):
    ov = _train_overrides(tiny_data, tmp_path, mlflow_server, "preflight-exclude", STEPS, SEED)
    log = tmp_path / "job.out"
    hold = _hold_node(slurm_cluster, "prism1", tmp_path)
    try:
        env = {**_sbatch_env(ov, log), "PRISM_FAULT_PREFLIGHT": "prism2"}
        job = slurm_cluster.sbatch("launchers/prism_757m.sbatch", env, ROOT)
        _wait_for(log, "failed the pre-flight", slurm_cluster, job, 120)
    finally:
        subprocess.run(["scancel", hold], timeout=30)
    slurm_cluster.wait_gone(job, 300)
    text = log.read_text()
    assert slurm_cluster.sacct(job) == "COMPLETED", text[-4000:]
    assert "preflight prism2: FAILED injected: PRISM_FAULT_PREFLIGHT names this node" in text, text[-4000:]
    assert f"job {job} requeued with ExcNodeList=prism2 (exclusion 1 of at most 3" in text, text[-4000:]
    assert "preflight prism1: ok writable" in text and "training finished" in text, text[-4000:]
    assert text.count("restart 1: 1 node(s)") == 1 and "(prism1)" in text.split("restart 1: 1 node(s)")[1]
    assert _job_field(job, "ExcNodeList") == "prism2" and _job_field(job, "NodeList") == "prism1"
    cfg = config.load(ROOT / "configs/tiny_prism.yaml", ov)
    assert (cfg.checkpoint_dir / "latest").read_text().strip() == f"step-{STEPS:07d}"
    _, runs = _runs_named(mlflow_server, "preflight-exclude", cfg.run_name)
    assert len(runs) == 1 and runs[0].data.tags.get("slurm_excluded_nodes") == "prism2", runs[0].data.tags


def test_exclusions_stop_at_the_restart_bound(slurm_cluster, tiny_data, tmp_path):
    ov = tiny_data.overrides + [f"run.output_dir={tmp_path / 'runs'}", "tracking.enabled=false"]
    log = tmp_path / "job.out"
    env = {**_sbatch_env(ov, log), "PRISM_FAULT_PREFLIGHT": "prism1,prism2", "PRISM_MAX_RESTARTS": "1"}
    job = slurm_cluster.sbatch("launchers/prism_757m.sbatch", env, ROOT)
    slurm_cluster.wait_gone(job, 180)
    text = log.read_text()
    assert slurm_cluster.sacct(job) == "FAILED", text[-4000:]
    assert text.count("failed the pre-flight; job") == 1, text[-4000:]  # one node excluded, then the bound
    errors = [x for x in text.splitlines() if x.startswith("train_job: error:")]
    assert len(errors) == 1 and "PRISM_MAX_RESTARTS=1" in errors[0] and "not requeueing" in errors[0], errors
    assert "prism train" not in text  # no training step started on a node that failed
