"""One writer per run (pipeline.run_lock): a live holder in another process refuses a second trainer in one line
that names it and leaves its file as it was; a killed holder's lock is taken over with a line saying so; a
lock whose holder died while the lock lingers (a dead node's lease, a forked child) is replaced; a clean
release leaves no file. Holders are real processes; no Slurm is asked (the holders run on this host)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import run_lock
from pipeline.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import json, os, sys, time
from pathlib import Path
from pipeline import run_lock
fd, note = run_lock.acquire(Path(sys.argv[1]))
if len(sys.argv) > 2:  # write another holder's record over ours, keeping the lock
    os.ftruncate(fd, 0); os.pwrite(fd, sys.argv[2].encode(), 0)
print("locked", flush=True)
time.sleep(60)
"""


def _holder(folder: Path, record: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SLURM_JOB_ID", None)
    args = [sys.executable, "-c", HOLD, str(folder)] + ([record] if record else [])
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_live_holder_refuses_in_one_line_and_a_killed_one_is_taken_over(tmp_path):
    folder = tmp_path / "checkpoints"
    holder = _holder(folder)
    try:
        before = (folder / run_lock.LOCK_FILE).read_bytes()
        with pytest.raises(run_lock.RunLocked) as refused:
            run_lock.acquire(folder)
        line = str(refused.value)
        assert isinstance(refused.value, ConfigError) and "\n" not in line
        assert f"pid {holder.pid} on host {socket.gethostname()}" in line and "nothing was changed" in line, line
        assert (folder / run_lock.LOCK_FILE).read_bytes() == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    fd, note = run_lock.acquire(folder)
    assert note is not None and f"pid {holder.pid} no longer runs" in note and "took over" in note, note
    assert json.loads((folder / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    run_lock.release(fd, folder)
    assert not (folder / run_lock.LOCK_FILE).exists()
    fd, note = run_lock.acquire(folder)  # after a clean release: a plain start, no takeover line
    assert note is None
    run_lock.release(fd, folder)


def test_a_lingering_lock_whose_holder_is_gone_is_replaced(tmp_path):
    """The lock is still held (here by a live process standing in for a dead node's lease), but the record names
    a pid that no longer runs on this host: the file is replaced and the new trainer holds the new one."""
    folder = tmp_path / "checkpoints"
    gone = _dead_pid()
    record = json.dumps({"host": socket.gethostname(), "pid": gone, "start": "1", "job": None, "since": "then"})
    lingering = _holder(folder, record)
    try:
        fd, note = run_lock.acquire(folder)
        assert note is not None and f"pid {gone} no longer runs" in note, note
        assert json.loads((folder / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
        run_lock.release(fd, folder)
    finally:
        lingering.kill()
        lingering.wait()


def test_a_free_lock_naming_a_holder_elsewhere_that_may_run_is_refused(tmp_path):
    """Per-node flock (Lustre's localflock) lets a second node lock the file: the record still refuses, since
    without a Slurm job nothing says the other host's trainer ended."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    record = {"host": "another-node", "pid": 4242, "start": "1", "job": None, "since": "2026-01-01T00:00:00Z"}
    (folder / run_lock.LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(run_lock.RunLocked, match="pid 4242 on host another-node"):
        run_lock.acquire(folder)
    assert json.loads((folder / run_lock.LOCK_FILE).read_text()) == record
