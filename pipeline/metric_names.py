"""The metric names Prism logs.

One prefix per kind, so MLflow's chart view files each kind in its own section:
    train/  what the optimisation does: loss, lr, grad_norm, tokens_seen, skipped_steps (pipeline.skipping)
    val/    held-out loss: val/loss on the run's own val split, val/<name>/loss on each of data.val_sets
    perf/   how fast and how big: train_tokens_per_sec (training time only, over the steps since the last
            logged one: the step line's train tok/s), step_time, mfu, mfu_causal, memory_gb; rank_time_max,
            rank_time_median, slowest_rank (pipeline.stragglers)
    eval/   zero-shot scores, eval/<task>/<acc|acc_norm|bpb> (bpb: bits per byte of the gold answers)
The data budget of a start (data/epochs, data/tokens_per_epoch) is constant over a run, so it is logged as params
(Tracker.log_params), not here.
"""


def val_loss_metric(set_name: str | None) -> str:
    """The loss of a validation set: val/loss for the run's own val split (None), else val/<name>/loss."""
    return "val/loss" if set_name is None else f"val/{set_name}/loss"


def eval_metric(task: str, metric: str) -> str:
    """eval/<task>/<acc|acc_norm|bpb>: a zero-shot score, from `prism eval` or an eval during training."""
    return f"eval/{task}/{metric}"
