"""torch.distributed's private spots Prism uses (torch 2.13): changing the timeout of process groups that
already exist, and telling a failed collective from any other exception.

- ``set_collective_timeout``: init_process_group fixes a timeout per group and torch has no public call to
  change it afterwards; ``distributed_c10d._set_pg_timeout`` (what torchtitan uses to drop from its start-up
  timeout to a shorter one after the first step) sets the gloo and NCCL backends' default timeout. Every group
  in ``_world.pg_map`` gets it: megatron's TP/DP groups and our gloo group too.
- ``collective_failed``: NCCL raises torch.distributed.DistError subclasses, gloo a plain RuntimeError whose
  message carries the gloo source path ("Timed out waiting ... for recv", "Connection closed by peer").
"""

from __future__ import annotations

import datetime


def set_collective_timeout(seconds: float) -> None:
    """Every existing process group's collectives time out after ``seconds`` from now on."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timeout, group)


def collective_failed(error: BaseException) -> bool:
    """True for a collective that timed out or lost a peer (NCCL or gloo), not for a bug in our code."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and "/gloo/" in text and ("Timed out" in text or "closed by peer" in text)
