"""The metric names Prism logs, and the names runs logged before the prefix scheme used.

One prefix per kind, so MLflow's chart view files each kind in its own section:
    train/  what the optimisation does: loss, lr, grad_norm, tokens_seen, skipped_steps (pipeline.skipping)
    val/    held-out loss: val/loss on the run's own val split, val/<name>/loss on each of data.val_sets
    perf/   how fast and how big: tokens_per_sec, step_time, mfu, mfu_causal, memory_gb; rank_time_max,
            rank_time_median, slowest_rank (pipeline.stragglers)
    eval/   zero-shot scores, eval/<task>/<acc|acc_norm>
The data budget of a start (data/epochs, data/tokens_per_epoch) is constant over a run, so it is logged as params
(Tracker.log_params), not here; runs logged before kept it as metrics, which nothing reads.

Readers of old runs (`prism compare`) look a name up here: OLD_NAMES maps each renamed metric to the name it
had before, and `metric_history` falls back to it when a run has no history under the new one.
"""

from typing import Any

# new name -> the name runs logged before the prefix scheme (train/loss, val/loss and eval/* kept theirs)
OLD_NAMES = {
    "train/lr": "lr",
    "train/grad_norm": "grad_norm",
    "train/tokens_seen": "tokens_seen",
    "perf/tokens_per_sec": "tokens_per_sec",
    "perf/step_time": "step_time",
    "perf/mfu": "mfu",
    "perf/mfu_causal": "mfu_causal",
    "perf/memory_gb": "memory_gb",
}


def val_loss_metric(set_name: str | None) -> str:
    """The loss of a validation set: val/loss for the run's own val split (None), else val/<name>/loss."""
    return "val/loss" if set_name is None else f"val/{set_name}/loss"


def metric_history(client: Any, run_id: str, name: str) -> list[Any]:
    """MLflow history of metric ``name`` in a run; for a run logged with the old name, the old name's history."""
    history = client.get_metric_history(run_id, name)
    if not history and name in OLD_NAMES:
        history = client.get_metric_history(run_id, OLD_NAMES[name])
    return history


def eval_metric(task: str, metric: str) -> str:
    """eval/<task>/<acc|acc_norm>: a zero-shot score, from `prism eval` or an eval during training."""
    return f"eval/{task}/{metric}"
