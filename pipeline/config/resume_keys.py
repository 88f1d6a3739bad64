"""Which config keys a resume may change: the model and data keys never, the training-recipe keys only when
`checkpoint.allow_changes` names them, execution-only keys always; and `changed_keys`, which compares two
config dicts by what they build (the schedule resolved)."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from pipeline import schedule

if TYPE_CHECKING:
    from pipeline.config.schema import Config

# What a checkpoint's weights are: eval, export and generate may repoint paths, never change these.
WEIGHT_KEYS = ("model", "schedule", "parallel.tp")
# With the seed and the data-parallel size (pipeline.data deals shards to DP ranks): which batches a run sees
# in which order. `prism compare` pairs two runs' seeds only when these match.
DATA_ORDER_KEYS = ("data.dataset_dir", "train.batch_tokens", "train.micro_batch_size", "model.seq_len")
# Keys whose change makes a checkpoint or a dataset incompatible (resume refuses, naming the key).
MODEL_OR_DATA_KEYS = (
    "run.seed",
    *WEIGHT_KEYS,
    "train.batch_tokens",
    "train.micro_batch_size",
    "data",
    # a cooldown branch's starting point: its weights and data position are that checkpoint's
    "cooldown.from_run_dir",
    "cooldown.from_step",
)
# How work is executed, not what it computes (the tokens, the weights): a change never blocks a resume.
EXECUTION_ONLY_KEYS = (
    "data.executor",
    "data.tasks",
    "data.workers",
    "data.slurm",
    "data.allow_repeat",  # permission to read past one epoch: the order of the data does not change
    "data.verify_on_start",
    "parallel.init_timeout_s",  # how long a collective may wait, not what it computes
    "parallel.timeout_s",
    # how the same math runs (kernels, fusions): the weights and their names do not change
    "model.attention_backend",
    "model.fusions",
    # what is measured besides training, not what is trained: a resume may add or drop a validation set
    "data.val_sets",
    # what is recorded about the steps (traces), not what they compute
    "train.profile_steps",
    "train.profile_memory",
)
# The training recipe: keys that change the training trajectory (LR schedule, optimizer, numerics) but not
# what a checkpoint holds: a resume refuses a change unless checkpoint.allow_changes names the key.
RECIPE_KEYS = (
    "train.train_tokens",
    "train.lr",
    "train.min_lr",
    "train.warmup_fraction",
    "train.lr_schedule",
    "train.decay_fraction",
    "train.decay_shape",
    "cooldown.decay_tokens",
    "cooldown.decay_shape",
    "train.weight_decay",
    "train.beta1",
    "train.beta2",
    "train.eps",
    "train.grad_clip",
    "train.precision",
    "parallel.zero_stage",
    "parallel.replicate_indivisible_layers",
    "train.z_loss",
    "train.skip_window",
    "train.skip_sigma",
)
# The keys of a WSD schedule: a cosine main run trains the same whatever they say, so its identity (result_hash)
# leaves them out, as it does an unset cooldown section: a run's identity stays what it was before they existed.
WSD_KEYS = ("train.lr_schedule", "train.decay_fraction", "train.decay_shape")
# What a finished run measured, besides what it trained: the comparison reads these series.
MEASURED_KEYS = (
    "train.val_every",
    "train.val_tokens",
    "train.eval_every",
    "train.eval_tasks",
    "train.eval_limit",
)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and not key.endswith("sbatch_args"):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def result_hash(cfg: Config) -> str:
    """A run's identity for "already finished" (demo, study): the hash of what it trains and measures (model
    and data keys, recipe, MEASURED_KEYS; the schedule resolved), leaving out execution-only keys and what is
    only logged or kept (train.log_every, data.tasks, tracking, checkpoint cadence), so a rerun that changes
    those finds its finished runs instead of training them again."""
    inert = () if cfg.is_branch else ("cooldown.",)
    if cfg.train.lr_schedule == "cosine" and not cfg.is_branch:
        inert += WSD_KEYS
    kept = {
        k: v
        for k, v in with_compact_schedule(flatten(cfg.to_dict())).items()
        if in_scope(k, MODEL_OR_DATA_KEYS + RECIPE_KEYS + MEASURED_KEYS) and not k.startswith(inert)
    }
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def in_scope(key: str, scope: tuple[str, ...]) -> bool:
    if any(key == e or key.startswith(e + ".") for e in EXECUTION_ONLY_KEYS):
        return False
    return any(key == s or key.startswith(s + ".") for s in scope)


def with_compact_schedule(flat: dict[str, Any]) -> dict[str, Any]:
    """``schedule.heads`` in compact form where it resolves (left as written where it does not)."""
    heads = flat.get("schedule.heads")
    if isinstance(heads, str | list | tuple):
        try:
            flat = {**flat, "schedule.heads": schedule.compact(schedule.resolve(heads))}
        except (schedule.ScheduleError, TypeError, ValueError):
            pass
    return flat
