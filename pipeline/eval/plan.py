"""What validation and downstream evals cost a run: the "val + eval" lines of `prism plan`.

The steps that validate and evaluate are pipeline.cadence's answer (planned). Pure arithmetic, no torch.
"""

from __future__ import annotations

from typing import Any

from pipeline.budget import Budget
from pipeline.config import Config
from pipeline.console import duration


def aside_cost(cfg: Config, total_steps: int) -> dict[str, Any]:
    """What the run spends besides training steps on validation and downstream evals, FLOPs-based: each is a
    forward pass, a third of a training step's FLOPs per token (pipeline.model_size), so at one MFU
        share = (N_val x T_val + N_eval x T_eval) / 3 / (T_train + (N_val x T_val + N_eval x T_eval) / 3)
    of the run's wall time. N: how many the loop runs (step_actions); T_val: the tokens of every validation set
    (Config.validation_sets()) in whole rows (pipeline.data.load_val_tokens); T_eval: the input tokens of eval_tasks at eval_limit (pipeline.eval.catalog,
    GPT-NeoX BPE counts); T_train: the tokens trained."""
    from pipeline.cadence import planned
    from pipeline.eval.catalog import eval_tokens

    t = cfg.train
    actions = planned(cfg, 0, total_steps).values()
    validations, evals = sum(a.validate for a in actions), sum(a.eval for a in actions)
    seq = cfg.model.seq_len
    per_validation = sum(max(1, v.tokens // seq) * seq for v in cfg.validation_sets())
    per_eval = eval_tokens(t.eval_tasks, t.eval_limit) if evals else 0
    forward = validations * per_validation + evals * per_eval
    trained = total_steps * t.batch_tokens
    return {
        "validations": validations,
        "validation_tokens": per_validation,
        "evals": evals,
        "eval_tokens": per_eval,
        "share": forward / 3 / (trained + forward / 3),
        "validation_share": validations * per_validation / 3 / (trained + forward / 3),
        "eval_share": evals * per_eval / 3 / (trained + forward / 3),
    }


def format_aside_cost(cfg: Config, a: dict[str, Any], budget: Budget) -> list[str]:
    """`prism plan`'s lines on validation and eval time (``a``: aside_cost's), with the formula."""
    t = cfg.train
    evals = (
        f"{a['evals']} evals x {a['eval_tokens']:,} tokens ({', '.join(t.eval_tasks)}, "
        f"{'whole sets' if t.eval_limit is None else f'{t.eval_limit} examples each'})"
        if a["evals"]
        else "no downstream evals (train.eval_every=0)"
    )
    lines = [
        f"  val + eval   {a['share']:.2%} of the run's wall time (validation {a['validation_share']:.2%}, evals "
        f"{a['eval_share']:.2%}; FLOPs-based, at the same MFU)",
        f"               {a['validations']} validations x {a['validation_tokens']:,} tokens, {evals}",
        "               share = (N_val x T_val + N_eval x T_eval) / 3 / (T_train + (N_val x T_val + N_eval x T_eval) / 3)"
        f", T_train = {budget.tokens:,}: a forward pass is a third of a training step's FLOPs",
    ]
    if budget.wall_seconds is not None:
        aside = budget.wall_seconds * a["share"] / (1 - a["share"])
        lines[0] += f": {duration(aside)} on top of the training's {duration(budget.wall_seconds)}"
    return lines
