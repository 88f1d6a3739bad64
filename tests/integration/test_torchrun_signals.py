"""torchrun and its workers under stop signals. torchrun hands USR1/USR2 (the pre-timeout and preemption
signals) to its workers and waits for their checkpoint; and a rank outlives nothing: when torchrun itself dies
(Slurm's second signal can kill it inside the grace it gives its workers), the kernel kills its workers, even
one that ignores SIGTERM as a hung rank does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.signals import torchrun_env

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import os, signal, time
from pipeline.distributed import init_distributed
init_distributed("cpu")
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a hung rank: nothing short of SIGKILL ends it
print("worker", os.getpid(), flush=True)
while True:
    time.sleep(1)
"""


STOPPING_WORKER = """
import os, signal, sys, time
from pathlib import Path
from pipeline.distributed import init_distributed
init_distributed("cpu")
stop = []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
print("worker", os.getpid(), flush=True)
while not stop:
    time.sleep(0.05)
time.sleep(1.0)  # the checkpoint: torchrun must wait for it
Path("checkpointed").write_text("yes")
sys.exit(3)
"""


def _start(tmp_path, worker_code, env):
    script = tmp_path / "worker.py"
    script.write_text(worker_code)
    env = {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone", str(script)]
    agent = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + 120
    for line in agent.stdout:
        lines.append(line)
        if line.startswith("worker "):
            return agent, int(line.split()[1]), lines
        assert time.monotonic() < deadline, "".join(lines)
    raise AssertionError("".join(lines))


def test_torchrun_hands_a_stop_signal_to_its_worker_and_waits_for_its_checkpoint(tmp_path):
    # The environment launchers/train_job.sh and sweep jobs give torchrun; USR1 to torchrun alone, as srun sends it.
    agent, worker, lines = _start(tmp_path, STOPPING_WORKER, {**os.environ, **torchrun_env(30)})
    try:
        agent.send_signal(signal.SIGUSR1)
        out, _ = agent.communicate(timeout=60)
        log = "".join(lines) + out
        assert agent.returncode != -signal.SIGUSR1, "torchrun died of the signal instead of handing it on\n" + log
        assert (tmp_path / "checkpointed").is_file(), "torchrun did not wait for the worker's checkpoint\n" + log
    finally:
        agent.kill()
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_dies_with_its_torchrun(tmp_path):
    agent, worker, _ = _start(tmp_path, WORKER, os.environ)
    try:
        agent.kill()  # torchrun gone at once, as when a second SIGTERM lands in its shutdown grace
        agent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its torchrun"
    finally:
        agent.kill()
        if worker and _alive(worker):
            os.kill(worker, signal.SIGKILL)
