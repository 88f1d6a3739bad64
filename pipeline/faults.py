"""Fault injection for tests, through ``PRISM_FAULT_*`` environment variables: with none set, every hook
here returns at once and no code path changes.

- ``PRISM_FAULT_CHECKPOINT_WRITE=enospc:3,4`` fails the background write of the checkpoints of steps 3 and 4
  with "no space left on device" after their first file is on disk (a partial tag, as a full disk leaves);
  ``stall:6`` blocks that write forever after its first file (for a kill -9 during the write); ``slow:4``
  makes it take 2 s more per file (so the next save comes due while it is in flight).
- ``PRISM_FAULT_LOSS=2:nan,5:1e3`` multiplies the loss of optimizer step 2 by NaN (a non-finite step) and of
  step 5 by 1000 (a spike), on every rank.
- ``PRISM_FAULT_SLOW_RANK=1:0.3`` makes global rank 1 sleep 0.3 s in each micro-batch's data fetch (a slow
  rank, for the straggler metrics).
"""

from __future__ import annotations

import errno
import os
import threading
import time


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
