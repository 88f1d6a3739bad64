"""Fault injection for tests, through ``PRISM_FAULT_*`` environment variables: with none set, every hook
here returns at once and no code path changes.

- ``PRISM_FAULT_CHECKPOINT_WRITE=enospc:3,4`` fails the background write of the checkpoints of steps 3 and 4
  with "no space left on device" after their first file is on disk (a partial tag, as a full disk leaves);
  ``stall:6`` blocks that write forever after its first file (for a kill -9 during the write); ``slow:4``
  makes it take 2 s more per file (so the next save comes due while it is in flight).
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
