"""The cadence of a run: which steps sync, log, validate, evaluate, checkpoint (by steps or by the clock) and keep
a milestone. One torch-free owner that the training loop, the checkpoint writer's clock, pruning, `prism plan`
(the checkpoint count, the val + eval share), the console's ETA and the config checks all ask, so a rule is
written once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config package's rules ask keys_problem(): a runtime import of Config would be a circle
    from pipeline.config import Config


def is_milestone(step: int, keep_every_steps: int, total_steps: int) -> bool:
    """The milestone rule (step_actions forces a checkpoint there, prune keeps it): every keep_every_steps-th
    step and the last one; none when keep_every_steps is 0."""
    return keep_every_steps > 0 and (step % keep_every_steps == 0 or step == total_steps)


@dataclass(frozen=True)
class StepActions:
    """What the loop does after one optimizer step; every flag implies ``sync``."""

    sync: bool  # read the loss and grad norm back to the host (the step's one device sync)
    validate: bool  # every validation set (Config.validation_sets)
    log: bool
    checkpoint: bool
    milestone: bool = False  # a checkpoint prune keeps (checkpoint.keep_every_steps)
    eval: bool = False  # downstream zero-shot evals (train.eval_every), before the step's checkpoint


def step_actions(
    cfg: Config, step: int, total_steps: int, stop: bool = False, since_save: Callable[[], float] | None = None
) -> StepActions:
    """The one rule for which steps validate, eval, log, checkpoint and therefore sync (1-based ``step``): the
    first step logs, the last does everything, a stop signal checkpoints, a milestone step checkpoints; the
    others only read back on a sync step, so their losses stay on the device until then. Saves come every
    checkpoint.every_steps, or with checkpoint.every_minutes by the clock: ``since_save`` gives the seconds
    since the last save started (in the loop the ranks' agreement, a collective); it is read only where
    saves_by_clock needs it, the same steps on every rank. Without it the clock is not asked."""
    t, last, c = cfg.train, step == total_steps, cfg.checkpoint
    validate = step % t.val_every == 0 or last
    evaluate = t.eval_every > 0 and (step % t.eval_every == 0 or last)
    log = step == 1 or step % t.log_every == 0 or validate
    milestone = is_milestone(step, c.keep_every_steps, total_steps)
    by_steps = c.every_minutes is None and step % c.every_steps == 0
    save = by_steps or last or stop or milestone
    actions = StepActions(
        sync=log or save or evaluate, validate=validate, log=log, checkpoint=save, milestone=milestone, eval=evaluate
    )
    if since_save is not None and saves_by_clock(cfg, actions, since_save):
        return dataclasses.replace(actions, checkpoint=True)
    return actions


def saves_by_clock(cfg: Config, actions: StepActions, since_save: Callable[[], float]) -> bool:
    """The clock's rule (checkpoint.every_minutes): a sync step that saves for no other reason saves once
    every_minutes have passed since the last save started. ``since_save`` is called only then."""
    minutes = cfg.checkpoint.every_minutes
    return minutes is not None and actions.sync and not actions.checkpoint and since_save() >= 60 * minutes


def checkpoint_steps(
    cfg: Config, ahead: Mapping[int, StepActions], step_seconds: float | None, last_save: int
) -> list[int]:
    """The steps of ``ahead`` (step_actions' answers without the clock, in step order) that will checkpoint:
    the clock's saves estimated at ``step_seconds`` of training a step, counted from step ``last_save``
    (None: the pace is unknown, the step-based saves only). The ETA and `prism plan` count saves with it."""
    saves = []
    for step, actions in ahead.items():
        clock = step_seconds is not None and saves_by_clock(
            cfg, actions, lambda s=step, since=last_save: (s - since) * step_seconds
        )
        if actions.checkpoint or clock:
            saves.append(step)
            last_save = step
    return saves


def planned(cfg: Config, start: int, total_steps: int) -> dict[int, StepActions]:
    """step_actions' answers, without the clock, for the steps after ``start``."""
    return {step: step_actions(cfg, step, total_steps) for step in range(start + 1, total_steps + 1)}


def keys_problem(cfg: Config) -> str | None:
    """What is wrong with the cadence keys, None if nothing (config.rules refuses it on load): a milestone is a
    checkpoint that is kept, so with saves by steps checkpoint.keep_every_steps is a multiple of
    checkpoint.every_steps. With checkpoint.every_minutes, every_steps is not used and any keep_every_steps
    holds (step_actions saves at each milestone)."""
    c = cfg.checkpoint
    if c.every_minutes is not None or c.keep_every_steps % c.every_steps == 0:
        return None
    below = c.keep_every_steps // c.every_steps * c.every_steps
    suggest = ", ".join(str(v) for v in (below, below + c.every_steps) if v > 0)
    return (
        f"checkpoint.keep_every_steps: {c.keep_every_steps} is not a multiple of checkpoint.every_steps="
        f"{c.every_steps} (a milestone is a checkpoint that is kept); use e.g. {suggest}, or save by the clock "
        "(checkpoint.every_minutes)"
    )
