"""Which rank is slow: each rank's own time per step, gathered on log steps.

Wall step times name nobody: the collectives make every rank wait for the slowest, so all ranks see the
same step time. What differs is the time a rank spends on its own work before it waits: its data fetch
(host time) and its forward passes (device time: CUDA events on a GPU, read on log steps, which sync
anyway). That is what megatron-core's StragglerDetector times too (the forward and get_batch), but it is
CUDA-only (nothing on a CPU, so no CPU test), a process-wide singleton that opens a control port on rank 0
(several runs on one node collide) and writes its report to a logger instead of returning numbers. Under
tensor parallelism the forward holds the TP all-reduces, so TP peers share their slowest member's time: the
slow data-parallel replica is named, and within it the rank with the slowest data path.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

# a rank is named on the console when its own time per step is this much above the median rank's
NOTABLY_SLOWER = 1.25


class RankClock:
    """This rank's own time (data fetch + forward) since the last log step. ``delay``: seconds a test adds to
    each data fetch of this rank (pipeline.faults, PRISM_FAULT_SLOW_RANK)."""

    def __init__(self, device: str, delay: float = 0.0) -> None:
        self.cuda, self.delay = device == "cuda", delay
        self.host_seconds, self.steps = 0.0, 0
        self.events: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        with self._host():
            if self.delay:
                time.sleep(self.delay)
            yield

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        if not self.cuda:
            with self._host():  # on a CPU the forward's time is host time
                yield
            return
        import torch

        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self.events.append((begin, end))

    @contextlib.contextmanager
    def _host(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.host_seconds += time.perf_counter() - start

    def step_done(self) -> None:
        self.steps += 1

    def seconds_per_step(self) -> float:
        """This rank's mean own time per step since the last call (on CUDA: waits for the last forward)."""
        device = 0.0
        if self.events:
            self.events[-1][1].synchronize()
            device = sum(b.elapsed_time(e) for b, e in self.events) / 1e3
        mean = (self.host_seconds + device) / max(1, self.steps)
        self.host_seconds, self.steps, self.events = 0.0, 0, []
        return mean


def gather_rank_times(clock: RankClock, device: str) -> list[float]:
    """Every rank's own seconds per step since the last log step, in global rank order (a collective)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([clock.seconds_per_step()], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return torch.cat(everyone).tolist()


def straggler_metrics(rank_times: list[float]) -> dict[str, float]:
    """perf/rank_time_max, perf/rank_time_median and perf/slowest_rank (the first of the slowest)."""
    slowest = max(range(len(rank_times)), key=rank_times.__getitem__)
    return {
        "perf/rank_time_max": rank_times[slowest],
        "perf/rank_time_median": statistics.median(rank_times),
        "perf/slowest_rank": slowest,
    }


def straggler_note(metrics: dict[str, float]) -> str:
    """The console's ` | slowest rank R +X%` when one rank is notably slower than the median rank, else ''."""
    top, median = metrics.get("perf/rank_time_max"), metrics.get("perf/rank_time_median")
    if top is None or not median or top < NOTABLY_SLOWER * median:
        return ""
    return f" | slowest rank {int(metrics['perf/slowest_rank'])} +{100 * (top / median - 1):.0f}%"
