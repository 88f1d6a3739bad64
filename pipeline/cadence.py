"""The cadence of a run: which steps sync, log, validate, evaluate, checkpoint and keep a milestone. One
torch-free owner that the training loop, pruning, `prism plan` (the ETA and the val + eval share) and the
config checks all ask, so a rule is written once."""

from __future__ import annotations

from dataclasses import dataclass

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
    cfg: Config, step: int, total_steps: int, stop: bool = False, minutes_due: bool = False
) -> StepActions:
    """The one rule for which steps validate, eval, log, checkpoint and therefore sync (1-based ``step``): the
    first step logs, the last does everything, a stop signal checkpoints, a milestone step checkpoints; the
    others only read back on a sync step, so their losses stay on the device until then. With
    checkpoint.every_minutes the clock replaces every_steps: ``minutes_due`` is the ranks' agreement, asked at
    sync steps (Saver.minutes_due)."""
    t, last, c = cfg.train, step == total_steps, cfg.checkpoint
    validate = step % t.val_every == 0 or last
    evaluate = t.eval_every > 0 and (step % t.eval_every == 0 or last)
    log = step == 1 or step % t.log_every == 0 or validate
    milestone = is_milestone(step, c.keep_every_steps, total_steps)
    by_steps = c.every_minutes is None and step % c.every_steps == 0
    save = by_steps or minutes_due or last or stop or milestone
    return StepActions(
        sync=log or save or evaluate, validate=validate, log=log, checkpoint=save, milestone=milestone, eval=evaluate
    )
