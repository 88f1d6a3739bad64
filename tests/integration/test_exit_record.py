"""The trainer's records for the Slurm launcher (launchers/train_job.sh): which node each rank runs on, and how
training ended (PRISM_EXIT_FILE), which decides the requeue however torchrun itself ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_stop_signal_at_the_final_step_finishes_instead_of_asking_for_a_requeue(tiny_data, tmp_path):
    record = tmp_path / "job.0.exit"
    ov = [
        *tiny_data.overrides,
        f"run.output_dir={tmp_path / 'runs'}",
        "train.batch_tokens=512",
        "train.micro_batch_size=2",
        "train.train_tokens=512",  # one step: the signal can only land in the final one
        "train.val_tokens=512",
        "tracking.enabled=false",
        "train.precision=fp32",
    ]
    cmd = [sys.executable, "-m", "pipeline.cli", "train", str(ROOT / "configs/tiny_prism.yaml"), *ov]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PRISM_EXIT_FILE": str(record)}
    env.pop("SLURMD_NODENAME", None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # the topology line comes after the stop handlers are installed
        lines.append(line)
        if "topology:" in line:
            proc.send_signal(signal.SIGUSR1)
            break
        assert time.monotonic() < deadline, "".join(lines)
    stdout, stderr = proc.communicate(timeout=240)
    text = "".join(lines) + stdout
    assert f"topology: 1 node(s): {socket.gethostname()} ranks 0 " in text, text + stderr[-3000:]
    assert proc.returncode == 0, text + stderr[-3000:]  # done: nothing to resume, so no exit 3
    assert record.read_text() == "finished 1\n"
    assert "stop signal received" not in text
