"""One job per run and the real time limit, on the local two-node Slurm cluster. A job submitted with a short
`--time-min` and no `--signal` reads its real end, checkpoints before it and requeues itself; a second `sbatch`
of the same run, submitted while the first runs, waits (reason Dependency: the batch scripts' singleton, which
a requeued job still holds) until the first is gone, then resumes from `latest` and finishes the run. About
70 s on a quiet machine: two job starts and 12 steps."""

from __future__ import annotations

import re
import subprocess
import time

from pipeline import config
from tests.integration.test_launchers import ROOT, _runs_named, _sbatch_env, _train_overrides

STEPS, SEED = 12, 81
# checkpoint.end_margin_s: a whole two-minute job, so it stops at its first step whatever its start-up took
# (10 s on a quiet machine, a minute on a loaded one): with the time left, before the end
MARGIN_S = 120


def _wait_for(log, pattern: str, cluster, job: str, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while not (found := re.search(pattern, log.read_text() if log.exists() else "", re.M)):
        assert time.monotonic() < deadline and cluster.state(job), log.read_text()[-3000:] if log.exists() else job
        time.sleep(0.2)
    return found


def test_a_short_time_limit_checkpoints_before_its_end_and_a_second_job_of_the_run_waits_then_resumes(
    slurm_cluster, mlflow_server, tiny_data, tmp_path
):
    ov = _train_overrides(tiny_data, tmp_path, mlflow_server, "one-writer", STEPS, SEED)
    ov.append(f"checkpoint.end_margin_s={MARGIN_S}")
    # The preset's script without its `--signal` line: only the end time can stop this job in time.
    script = tmp_path / "no_signal.sbatch"
    lines = (ROOT / "launchers/prism_757m.sbatch").read_text().splitlines(keepends=True)
    script.write_text("".join(line for line in lines if not line.startswith("#SBATCH --signal")))
    first_log, second_log = tmp_path / "first.out", tmp_path / "second.out"
    first = slurm_cluster.sbatch(str(script), _sbatch_env(ov, first_log), ROOT, ("--time=2", "--time-min=1"))
    deadline = time.monotonic() + 60
    while slurm_cluster.state(first) != "RUNNING":
        assert time.monotonic() < deadline, slurm_cluster.state(first)
        time.sleep(0.2)
    second = slurm_cluster.sbatch("launchers/prism_757m.sbatch", _sbatch_env(ov, second_log), ROOT)
    try:
        deadline = time.monotonic() + 5  # the scheduler's first look at it
        while slurm_cluster.reason(second) != "Dependency":
            assert slurm_cluster.state(second) == "PENDING" and time.monotonic() < deadline, slurm_cluster.reason(
                second
            )
            time.sleep(0.2)
        assert slurm_cluster.state(first) == "RUNNING", first_log.read_text()[-3000:]

        ends = _wait_for(
            first_log,
            r"the job ends in (\d+) s \((SLURM_JOB_END_TIME|squeue's EndTime)\).*at step (\d+)",
            slurm_cluster,
            first,
            90,
        )
        assert 0 < int(ends.group(1)) <= MARGIN_S + 10, ends.group(0)
        stopped_at = int(ends.group(3))
        _wait_for(first_log, rf"requeueing to resume from latest \(job {first}\)", slurm_cluster, first, 60)
        assert stopped_at < STEPS and f"checkpoint at step {stopped_at} written" in first_log.read_text()
        assert slurm_cluster.reason(second) == "Dependency"  # the requeued first job still holds the name
        subprocess.run(["scancel", first], check=True, timeout=30)  # it would go on with two-minute lives

        slurm_cluster.wait_gone(second, 300)
        text = second_log.read_text()
        assert f"resumed from step-{stopped_at:07d}" in text and "training finished" in text, text[-3000:]
        assert slurm_cluster.sacct(second) == "COMPLETED", text[-3000:]
    finally:
        subprocess.run(["scancel", first, second], timeout=30)
        slurm_cluster.wait_gone(first, 120)
    cfg = config.load(ROOT / "configs/tiny_prism.yaml", ov)
    client, runs = _runs_named(mlflow_server, "one-writer", cfg.run_name)
    assert len(runs) == 1, [r.info.run_id for r in runs]  # both jobs logged into the one run
    steps = {m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")}
    assert steps == set(range(1, STEPS + 1))
