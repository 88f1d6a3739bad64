"""launchers/train_job.sh carrying out the restart policy's verdicts, run as bash with a stand-in srun and
scontrol first on PATH (no cluster needed): each start of a step runs the test's script for it, with the job
script's PRISM_EXIT_FILE. The stop signals are real, sent to the job script's shell as Slurm's --signal would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SRUN = """#!/bin/bash
# the pre-flight before each start runs for real, on this host; its srun options are dropped
if [[ " $* " == *" -m pipeline.preflight "* ]]; then
  while [[ "$1" == --* ]]; do shift; done
  exec "$@"
fi
# each start runs the test's step-N.sh (N counts the starts)
n=$(( $(cat "$FAKE_DIR/starts" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$FAKE_DIR/starts"
exec bash "$FAKE_DIR/step-$n.sh"
"""
SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo node1 ;;
  "requeue "*) echo "requeue $2" >> "$FAKE_DIR/scontrol.log" ;;
esac
"""


def _job(tmp_path: Path, steps: list[str], **env: str) -> subprocess.Popen:
    """The job script with a stand-in srun whose start N runs ``steps[N-1]``."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:{Path(sys.executable).parent}:$PATH"\n')
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    for n, text in enumerate(steps, 1):
        (tmp_path / f"step-{n}.sh").write_text(text)
    env = {
        **os.environ,
        "FAKE_DIR": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node1",
        "PRISM_CONFIG": "configs/tiny_prism.yaml",
        "PRISM_OVERRIDES": f"run.output_dir={tmp_path / 'runs'}",
        "PRISM_ROOT": str(ROOT),
        "PRISM_VENV": str(venv),
        "PRISM_JOB_STATE_DIR": str(tmp_path / "state"),
        **env,
    }
    cmd = ["bash", str(ROOT / "launchers" / "train_job.sh")]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, job: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
        time.sleep(0.05)


def test_a_stop_signal_then_a_nonfinite_exit_is_not_requeued(tmp_path):
    # srun's status is 1 for any failed worker: the trainer's record, not the status, says NaN/inf
    step = 'trap "" USR1\necho "nonfinite 4" > "$PRISM_EXIT_FILE"\nkill -USR1 $PPID\nsleep 0.5\nexit 1\n'
    job = _job(tmp_path, [step])
    out = job.communicate(timeout=120)[0]
    assert job.returncode == 4, out
    assert "got a stop signal" in out and "not retrying" in out, out
    assert not (tmp_path / "scontrol.log").exists() and "requeueing" not in out, out
    assert (tmp_path / "starts").read_text().strip() == "1", out


def test_a_stop_signal_between_a_crash_and_the_restart_ends_in_a_checkpoint_and_a_requeue(tmp_path):
    from pipeline import config

    cfg = config.load(ROOT / "configs/tiny_prism.yaml", [f"run.output_dir={tmp_path / 'runs'}"])
    cfg.checkpoint_dir.mkdir(parents=True)
    (cfg.checkpoint_dir / "latest").write_text("step-0000002\n")  # the checkpoint before the crash
    crash = 'echo "crashed 3" > "$PRISM_EXIT_FILE"\nexit 1\n'
    # a restarted step would train on into the time limit, which the job would hit with no new checkpoint
    restarted = "sleep 60\nexit 137\n"
    pause = tmp_path / "verdict-go"
    job = _job(tmp_path, [crash, restarted], PRISM_FAULT_PAUSE_VERDICT=str(pause))
    _wait_for(tmp_path / "verdict-go.waiting", job)  # the crash's verdict is made: restart
    os.kill(job.pid, signal.SIGUSR1)  # Slurm's pre-timeout signal, after that verdict, before the next start
    pause.touch()
    out = job.communicate(timeout=120)[0]
    assert "restart 1 of 3" in out, out
    assert "a stop signal arrived before the restart; resuming from latest, step 2" in out, out
    assert job.returncode == 3 and (tmp_path / "scontrol.log").read_text() == "requeue 4242\n", out
    assert (tmp_path / "starts").read_text().strip() == "1", out  # the restart never started


def test_crashes_restart_within_the_bound_then_stop_with_one_line(tmp_path):
    crash = 'echo "crashed 2" > "$PRISM_EXIT_FILE"\nexit 1\n'
    lost = "exit 137\n"  # killed without a record: counts at latest's step
    job = _job(tmp_path, [crash, lost, crash], PRISM_MAX_RESTARTS="2")
    out = job.communicate(timeout=120)[0]
    errors = [line for line in out.splitlines() if line.startswith("train_job: error:")]
    assert job.returncode == 1 and len(errors) == 1 and "all 2 restarts are used" in errors[0], out
    assert "restart 1 of 2" in out and "restart 2 of 2" in out and "without an exit record" in out, out
    assert not (tmp_path / "scontrol.log").exists(), out
