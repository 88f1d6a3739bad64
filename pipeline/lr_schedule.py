"""The learning rate as a function of the optimizer step alone: the one owner of every schedule's formula.

- cosine (train.lr_schedule=cosine, the default): linear warmup to train.lr, then cosine down to
  train.min_lr over the remaining steps (the formula, and so every float, of the runs before WSD existed);
- wsd (warmup-stable-decay): linear warmup, constant train.lr, then a decay over the last
  train.decay_fraction of the steps, shaped train.decay_shape (linear, 1-sqrt or cosine), to train.min_lr;
- a cooldown branch (the cooldown section): the main schedule up to cooldown.from_step, then a decay from
  the LR the main run would have used next down to train.min_lr over the branch's cooldown.decay_tokens.

A decay's progress p runs over (0, 1]: its first step is already below the LR it starts from and its last
step trains at exactly min_lr (warmup's convention mirrored: its first step is lr / warmup, not 0).
Pure arithmetic, no torch: `prism plan` draws the same curve the trainer steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import Config

# The fraction of (start - end) left at decay progress p in [0, 1]. 1-sqrt: arXiv 2405.18392's best shape.
DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1.0 - p,
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
}


def decayed(start: float, end: float, progress: float, shape: str) -> float:
    """The LR ``progress`` of the way through a decay from ``start`` to ``end``."""
    return end + DECAY_SHAPES[shape](min(1.0, max(0.0, progress))) * (start - end)


def lr_at(
    step: int,
    total: int,
    warmup: int,
    lr: float,
    min_lr: float,
    schedule: str = "cosine",
    decay_steps: int = 0,
    shape: str = "1-sqrt",
) -> float:
    """LR for optimizer step ``step`` (0-based) of a ``total``-step schedule: linear warmup to ``lr``, then
    cosine down to ``min_lr``, or (schedule="wsd") constant until the last ``decay_steps`` steps decay."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "wsd":
        decay_start = total - decay_steps
        return lr if step < decay_start else decayed(lr, min_lr, (step - decay_start + 1) / decay_steps, shape)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


@dataclass(frozen=True)
class LRSchedule:
    """One run's schedule, its numbers read once from the Config: ``at(step)`` is the LR of a 0-based step."""

    total: int  # the main schedule's steps (a branch keeps its main run's, so its LR at from_step is the same)
    warmup: int
    lr: float
    min_lr: float
    schedule: str
    decay_steps: int  # wsd: the main schedule's decay
    shape: str
    branch_step: int | None = None  # a cooldown branch: the step it leaves the main schedule at
    branch_decay_steps: int = 0
    branch_shape: str = "1-sqrt"

    def main_at(self, step: int) -> float:
        return lr_at(step, self.total, self.warmup, self.lr, self.min_lr, self.schedule, self.decay_steps, self.shape)

    def at(self, step: int) -> float:
        if self.branch_step is None or step < self.branch_step:
            return self.main_at(step)
        progress = (step - self.branch_step + 1) / self.branch_decay_steps
        return decayed(self.main_at(self.branch_step), self.min_lr, progress, self.branch_shape)


def wsd_decay_steps(decay_fraction: float, total: int) -> int:
    """Steps of a WSD run's decay: the fraction of its steps, at least one."""
    return max(1, int(round(decay_fraction * total)))


def schedule_of(cfg: Config) -> LRSchedule:
    """The schedule ``cfg`` trains with (the step counts are Config.steps', the one layout rule)."""
    t, c, layout = cfg.train, cfg.cooldown, cfg.steps(1)
    return LRSchedule(
        total=layout["main_total"],
        warmup=layout["warmup"],
        lr=t.lr,
        min_lr=t.min_lr,
        schedule=t.lr_schedule,
        decay_steps=layout["decay"],
        shape=t.decay_shape,
        branch_step=c.from_step,
        branch_decay_steps=layout["total"] - (c.from_step or 0) if cfg.is_branch else 0,
        branch_shape=c.decay_shape or t.decay_shape,
    )


def ends_annealed(cfg: Config, step: int) -> bool:
    """Whether a point at ``step`` (1-based, steps done) is annealed: the run's schedule ends there, its LR decayed
    to train.min_lr. One rule for every schedule: a cooldown branch's last step (its decay), a WSD main run's
    (its own decay) and a cosine main run's (cosine ends at min_lr too); any earlier step is not annealed."""
    return step >= cfg.steps(1)["total"]


def describe(cfg: Config) -> str:
    """One line naming the schedule, for `prism plan` and the trainer's start line."""
    t, s = cfg.train, schedule_of(cfg)
    text = f"warmup {s.warmup:,} steps, then "
    if t.lr_schedule == "wsd":
        text += f"WSD: constant {t.lr:g} through step {s.total - s.decay_steps:,}, {t.decay_shape} decay over the last "
        text += f"{s.decay_steps:,} steps to {t.min_lr:g}"
    else:
        text += f"cosine from {t.lr:g} to {t.min_lr:g} at step {s.total:,}"
    if s.branch_step is not None:
        text += (
            f"; cooldown branch of {cfg.main_run_dir} at step {s.branch_step:,}: {s.branch_shape} decay from "
            f"{s.main_at(s.branch_step):.4g} to {t.min_lr:g} over {s.branch_decay_steps:,} steps"
        )
    return text


def curve(cfg: Config, points: int = 400) -> tuple[list[int], list[float]]:
    """(steps, LR) sampled over the run, for drawing: the same ``at`` the trainer steps."""
    total, s = cfg.steps(1)["total"], schedule_of(cfg)
    steps = sorted({round(i * (total - 1) / max(1, points - 1)) for i in range(points)})
    return steps, [s.at(step) for step in steps]


def ascii_curve(cfg: Config, width: int = 64, height: int = 10) -> list[str]:
    """The LR curve as text: one column per sampled step, the peak LR on the top row."""
    steps, lrs = curve(cfg, points=width)
    top = max(lrs)
    rows = [[" "] * len(steps) for _ in range(height)]
    for x, lr in enumerate(lrs):
        rows[height - 1 - min(height - 1, int(lr / top * (height - 1) + 0.5))][x] = "*"
    lines = [f"{(top * (height - 1 - i) / (height - 1)):9.2e} |" + "".join(r) for i, r in enumerate(rows)]
    lines.append(" " * 10 + "+" + "-" * len(steps))
    lines.append(" " * 11 + f"step 1{' ' * max(1, len(steps) - 6 - len(str(steps[-1] + 1)))}{steps[-1] + 1}")
    return lines


def plot_curve(cfg: Config, path: str | Path) -> Path:
    """The LR curve as a PNG, written to a temporary name and renamed (never a half-written file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, lrs = curve(cfg, points=2000)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot([s + 1 for s in steps], lrs)
    ax.set(xlabel="optimizer step", ylabel="learning rate", title=f"{cfg.run_name}: {cfg.train.lr_schedule}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
