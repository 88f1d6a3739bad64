"""What checkpoints cost a layout, and how often to take them: the checkpoint lines of `prism plan`.

Size: pipeline.budget.checkpoint_bytes (at 757M bf16 1.5 + 3.0 + 6.1 = 10.6 GB per save). The weights are
written once per TP rank (by DP rank 0), the fp32 masters and AdamW moments split over all TP x DP ranks, so
DP rank 0 holds the most.

Time: a non-blocking save (checkpoint.async_save) blocks the step while the largest rank's share is copied
to host memory (HOST_COPY_GBPS); a synchronous one blocks for the whole write at the file system's
bandwidth for the job (``--fs-gbps``) plus the sha256 of the largest rank's share (SHA256_GBPS, one core).

Cadence: Young's first-order optimum (Young 1974; Daly 2006) tau = sqrt(2 C M), with C the time a save
costs the run and M the job's mean time between failures, M = MTBF per node / nodes. The default MTBF
per node is derived from Meta's Llama 3 report (Dubey et al. 2024, sec. 3.3.4): 419 unexpected job
interruptions in 54 days on 16,384 GPUs (2,048 nodes of 8), i.e. 2,048 x 54 x 24 h / 419 = 6,335 h.
A non-blocking save cannot usefully come more often than its background write takes, so the
recommendation is max(tau, background write).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module's defaults for its --help: keep it light
    from pipeline.config import Config

FS_GBPS = 2.0  # default --fs-gbps: GB/s the job's ranks together get from the checkpoint file system
HOST_COPY_GBPS = 20.0  # device-to-pinned-host copy per GPU (PCIe 4 x16 moves ~25 GB/s)
SHA256_GBPS = 1.5  # hashlib sha256 on one core with SHA-NI (1.6 GB/s measured on this project's CPU machine)
MTBF_NODE_HOURS = 2048 * 54 * 24 / 419  # 6,335 h: Llama 3's unexpected interruptions, per node
GB = 1e9


@dataclass
class CheckpointPlan:
    bytes_total: float
    bytes_weights: float  # the model states (all TP ranks)
    bytes_optimizer: float  # fp32 masters and AdamW moments (all ranks)
    bytes_largest_rank: float  # DP rank 0: its TP shard of the weights and its optimizer partition
    blocked_async_s: float
    blocked_sync_s: float
    background_s: float  # write at --fs-gbps plus the largest rank's hashing
    fs_gbps: float
    mtbf_node_hours: float
    job_mtbf_hours: float
    young_daly_async_minutes: float
    young_daly_sync_minutes: float
    recommended_minutes: float


def checkpoint_plan(
    cfg: Config, nodes: int, tp: int, dp: int, fs_gbps: float = FS_GBPS, mtbf_node_hours: float = MTBF_NODE_HOURS
) -> CheckpointPlan:
    from pipeline.budget import checkpoint_bytes  # the one owner of what a checkpoint holds

    size = checkpoint_bytes(cfg)
    weights, optimizer = size["weights"], size["masters"] + size["moments"]
    largest = weights / tp + optimizer / (tp * dp)
    total = weights + optimizer
    write = total / (fs_gbps * GB)
    hashing = largest / (SHA256_GBPS * GB)
    blocked_async = largest / (HOST_COPY_GBPS * GB)
    blocked_sync = write + hashing
    job_mtbf_s = mtbf_node_hours * 3600 / nodes

    def young_daly(cost_s: float) -> float:
        return math.sqrt(2 * cost_s * job_mtbf_s) / 60

    background = write + hashing
    return CheckpointPlan(
        bytes_total=total,
        bytes_weights=weights,
        bytes_optimizer=optimizer,
        bytes_largest_rank=largest,
        blocked_async_s=blocked_async,
        blocked_sync_s=blocked_sync,
        background_s=background,
        fs_gbps=fs_gbps,
        mtbf_node_hours=mtbf_node_hours,
        job_mtbf_hours=job_mtbf_s / 3600,
        young_daly_async_minutes=young_daly(blocked_async),
        young_daly_sync_minutes=young_daly(blocked_sync),
        recommended_minutes=max(young_daly(blocked_async), background / 60),
    )


def format_checkpoint_plan(cfg: Config, plan: CheckpointPlan, nodes: int, step_seconds: float | None) -> list[str]:
    """The plan's checkpoint lines; ``step_seconds`` (when the wall time is known) turns the config's
    every_steps into minutes."""
    c = cfg.checkpoint
    if c.every_minutes is not None:
        now = f"every {c.every_minutes:g} min"
    elif step_seconds:
        now = f"every {c.every_steps:,} steps (~{c.every_steps * step_seconds / 60:.1f} min)"
    else:
        now = f"every {c.every_steps:,} steps"
    return [
        f"  checkpoint   {plan.bytes_total / GB:.1f} GB per save = weights {plan.bytes_weights / GB:.1f} + fp32 masters "
        f"and AdamW moments {plan.bytes_optimizer / GB:.1f}; {plan.bytes_largest_rank / GB:.2f} GB on the largest rank",
        f"  ckpt time    blocks the step {plan.blocked_async_s:.2f} s non-blocking (copy to host at {HOST_COPY_GBPS:g} "
        f"GB/s), {plan.blocked_sync_s:.1f} s synchronous; background write {plan.background_s:.1f} s at --fs-gbps "
        f"{plan.fs_gbps:g} + sha256",
        f"  ckpt every   Young-Daly sqrt(2 C MTBF) = {plan.young_daly_async_minutes:.0f} min non-blocking, "
        f"{plan.young_daly_sync_minutes:.0f} min synchronous; job MTBF {plan.job_mtbf_hours:,.0f} h = "
        f"--mtbf-node-hours {plan.mtbf_node_hours:,.0f} / {nodes} node(s)",
        f"  ckpt cadence recommended checkpoint.every_minutes={plan.recommended_minutes:.0f} "
        f"(async_save {'on' if c.async_save else 'off'}); this config: {now}",
        saves_line(cfg, plan, step_seconds),
    ]


def saves_line(cfg: Config, plan: CheckpointPlan, step_seconds: float | None) -> str:
    """How many saves the run makes (pipeline.cadence's rule: by steps, milestones, the last, and with
    checkpoint.every_minutes by the clock at ``step_seconds`` a step) and how long they block it in all."""
    from pipeline.cadence import checkpoint_steps, planned
    from pipeline.console import duration

    layout = cfg.steps(1)
    ahead = {s: a for s, a in planned(cfg, layout["start"], layout["total"]).items() if a.sync}
    if cfg.checkpoint.every_minutes is not None and not step_seconds:
        return (
            f"  ckpt saves   {sum(a.checkpoint for a in ahead.values())} by steps (milestones, the last) and the "
            "clock's, unknown without the step time: pass --peak-tflops"
        )
    saves = checkpoint_steps(cfg, ahead, step_seconds, layout["start"])
    by_clock = sum(not ahead[s].checkpoint for s in saves)
    blocked = plan.blocked_async_s if cfg.checkpoint.async_save else plan.blocked_sync_s
    return (
        f"  ckpt saves   {len(saves)} in the run ({by_clock} by the clock, {len(saves) - by_clock} by steps: "
        f"every_steps, milestones, the last), blocking it {duration(len(saves) * blocked)} in all"
    )
