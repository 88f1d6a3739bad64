"""Fault injection for tests, through ``PRISM_FAULT_*`` environment variables: with none set, every hook
here returns at once (``before_step`` is a function that does nothing, chosen at import) and no code path
changes.

- ``PRISM_FAULT_CHECKPOINT_WRITE=enospc:3,4`` fails the background write of the checkpoints of steps 3 and 4
  with "no space left on device" after their first file is on disk (a partial tag, as a full disk leaves);
  ``stall:6`` blocks that write forever after its first file (for a kill -9 during the write); ``slow:4``
  makes it take 2 s more per file (so the next save comes due while it is in flight).
- ``PRISM_FAULT_LOSS=2:nan,5:1e3`` multiplies the loss of optimizer step 2 by NaN (a non-finite step) and of
  step 5 by 1000 (a spike), on every rank.
- ``PRISM_FAULT_SLOW_RANK=1:0.3`` makes global rank 1 sleep 0.3 s in each micro-batch's data fetch (a slow
  rank, for the straggler metrics).
- ``PRISM_FAULT_CRASH=STEP[:RANK]``: rank RANK (default: the last) raises at the start of step STEP (1-based).
- ``PRISM_FAULT_HANG=STEP[:RANK]``: that rank hangs there instead, in a sleep no handled signal ends (a peer
  lost to a collective).
- ``PRISM_FAULT_ONCE=PATH``: crash or hang only while PATH does not exist, and create it on firing, so the
  run restarted after the fault passes the step (unset: every start fires).
- ``PRISM_FAULT_PAUSE_VERDICT=PATH``: the job script's restart verdict (launchers/recovery.py), once made,
  creates PATH.waiting and waits until PATH exists: a stop signal sent meanwhile lands after the verdict and
  before the next start, the window a restart must not lose it in.
- ``PRISM_FAULT_PREFLIGHT=NODE[,NODE]``: the pre-flight (pipeline.preflight) of those Slurm nodes fails (a
  sick node, for the exclusion of bad nodes).
- ``PRISM_FAULT_BATCH_LOG=DIR``: not a fault but the same kind of hook: each rank appends a line
  ``STEP SHA256`` per micro-batch it trained to ``DIR/batches-rank<RANK>.txt`` (which tokens each step read).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any


def log_batches(step: int, batches: list[Any]) -> None:
    """PRISM_FAULT_BATCH_LOG: this rank's micro-batches of optimizer step ``step`` (1-based), hashed."""
    folder = os.environ.get("PRISM_FAULT_BATCH_LOG")
    if not folder:
        return
    import hashlib

    lines = "".join(f"{step} {hashlib.sha256(b.tobytes()).hexdigest()}\n" for b in batches)
    with open(Path(folder) / f"batches-rank{os.environ.get('RANK', '0')}.txt", "a") as f:
        f.write(lines)


def pause_verdict() -> None:
    """PRISM_FAULT_PAUSE_VERDICT: wait for the test's file (see above)."""
    path = os.environ.get("PRISM_FAULT_PAUSE_VERDICT")
    if not path:
        return
    Path(path + ".waiting").touch()
    while not Path(path).exists():
        time.sleep(0.05)


def _steps(spec: str) -> set[int]:
    return {int(s) for s in spec.split(",") if s.strip()}


def checkpoint_file_written(step: int) -> None:
    """Called by the background writer after each file of step ``step``'s checkpoint."""
    spec = os.environ.get("PRISM_FAULT_CHECKPOINT_WRITE")
    if not spec:
        return
    kind, _, steps = spec.partition(":")
    if step not in _steps(steps):
        return
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + " (PRISM_FAULT_CHECKPOINT_WRITE)")
    if kind == "stall":
        threading.Event().wait()
    if kind == "slow":
        time.sleep(2.0)


def _pairs(name: str) -> dict[str, str]:
    text = os.environ.get(name, "")
    return dict(item.split(":", 1) for item in text.split(",") if item.strip())


def loss_factor(step: int) -> float | None:
    """PRISM_FAULT_LOSS's factor for optimizer step ``step``; None for every other step or when unset."""
    factor = _pairs("PRISM_FAULT_LOSS").get(str(step))
    return None if factor is None else float(factor)


def slow_rank_seconds(rank: int) -> float:
    """PRISM_FAULT_SLOW_RANK's delay for global rank ``rank``; 0 for the others or when unset."""
    return float(_pairs("PRISM_FAULT_SLOW_RANK").get(str(rank), 0.0))


def preflight_fails(node: str) -> bool:
    """PRISM_FAULT_PREFLIGHT: whether ``node``'s pre-flight is to fail."""
    return node in os.environ.get("PRISM_FAULT_PREFLIGHT", "").split(",")


class InjectedFault(RuntimeError):
    """The crash PRISM_FAULT_CRASH asked for."""


def _fires(step: int, spec: str) -> bool:
    at, _, rank = spec.partition(":")
    me = int(os.environ.get("RANK", 0))
    wanted = int(rank) if rank else int(os.environ.get("WORLD_SIZE", 1)) - 1
    if step != int(at) or me != wanted:
        return False
    once = os.environ.get("PRISM_FAULT_ONCE")
    if once:
        if Path(once).exists():
            return False
        Path(once).touch()
    return True


def _inject(step: int) -> None:
    if (crash := os.environ.get("PRISM_FAULT_CRASH")) and _fires(step, crash):
        raise InjectedFault(f"PRISM_FAULT_CRASH: injected crash at step {step} on rank {os.environ.get('RANK', 0)}")
    if (hang := os.environ.get("PRISM_FAULT_HANG")) and _fires(step, hang):
        print(f"PRISM_FAULT_HANG: rank {os.environ.get('RANK', 0)} hangs at step {step}", flush=True)
        while True:  # a handled stop signal (SIGTERM/USR1) returns into the loop: only SIGKILL ends it
            time.sleep(3600)


def _nothing(step: int) -> None:
    pass


# Called by the training loop at the start of every step (1-based), on every rank.
before_step = _inject if os.environ.get("PRISM_FAULT_CRASH") or os.environ.get("PRISM_FAULT_HANG") else _nothing
