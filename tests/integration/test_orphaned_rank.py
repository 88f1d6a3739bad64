"""A rank outlives nothing: when torchrun itself dies (Slurm's second signal can kill it inside the grace it
gives its workers), the kernel kills its workers, even one that ignores SIGTERM as a hung rank does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_dies_with_its_torchrun(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone", str(script)]
    agent = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, worker = [], None
    try:
        deadline = time.monotonic() + 120
        for line in agent.stdout:
            lines.append(line)
            if line.startswith("worker "):
                worker = int(line.split()[1])
                break
            assert time.monotonic() < deadline, "".join(lines)
        assert worker is not None, "".join(lines)
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
