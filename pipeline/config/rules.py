"""The rules every Config passes when it is built: each number's range from one table (`RANGES`, plus the
names that become paths), then the rules across keys, the schedule's verdict among them, then what replicated
layers need. One line per failure, naming the file and the key."""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline import cadence, schedule
from pipeline.config.errors import ConfigError
from pipeline.config.resume_keys import RECIPE_KEYS

if TYPE_CHECKING:
    from pipeline.config.schema import Config


@dataclass(frozen=True)
class Range:
    """Allowed values of one numeric key: [low, high] (an end left out: unbounded; *_open: excluded),
    plus sentinel values such as -1 = all."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[int, ...] = ()

    def allows(self, v: float) -> bool:
        if v in self.also:
            return True
        if not math.isfinite(v):
            return False
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return self.high is None or (v < self.high if self.high_open else v <= self.high)

    def describe(self) -> str:
        lo, hi = (None if x is None else f"{x:,.0f}" if x == int(x) else f"{x:g}" for x in (self.low, self.high))
        if lo is not None and hi is not None:
            text = f"in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"
        elif lo is not None:
            text = f"{'>' if self.low_open else '>='} {lo}"
        else:
            text = f"{'<' if self.high_open else '<='} {hi}"
        return text + "".join(f" (or {a})" for a in self.also)


AT_LEAST_1, POSITIVE, NON_NEGATIVE = Range(1), Range(0, low_open=True), Range(0)
FRACTION = Range(0, 1, high_open=True)  # [0, 1)
RANGES: dict[str, Range] = {
    "run.seed": Range(0, 2**31 - 1),  # numpy, torch and Megatron's per-rank offsets all take it
    "model.num_layers": AT_LEAST_1,
    "model.d_model": AT_LEAST_1,
    "model.h_base": AT_LEAST_1,
    "model.ffn_hidden_size": AT_LEAST_1,
    "model.seq_len": AT_LEAST_1,
    "model.vocab_size": Range(2),  # at least one token besides EOS
    "model.norm_eps": POSITIVE,
    "model.rope_base": Range(1, low_open=True),  # base <= 1 gives no rotation spectrum
    "model.dropout": FRACTION,
    "model.init_std": POSITIVE,
    "parallel.tp": AT_LEAST_1,
    "parallel.zero_stage": Range(0, 3),
    "parallel.init_timeout_s": Range(1),  # seconds; below 1 every collective would be a hang
    "parallel.timeout_s": Range(1),
    "train.batch_tokens": AT_LEAST_1,
    "train.micro_batch_size": AT_LEAST_1,
    "train.lr": POSITIVE,  # lr=0 would train nothing, silently
    "train.train_tokens": AT_LEAST_1,
    "train.min_lr": NON_NEGATIVE,
    "train.warmup_fraction": FRACTION,
    "train.decay_fraction": Range(0, 1, low_open=True),  # (0, 1]: 1 decays from the end of warmup
    "train.weight_decay": NON_NEGATIVE,
    "train.beta1": FRACTION,
    "train.beta2": FRACTION,
    "train.eps": POSITIVE,
    "train.grad_clip": NON_NEGATIVE,  # 0 = no clipping (DeepSpeed's convention)
    "train.log_every": AT_LEAST_1,
    "train.val_every": AT_LEAST_1,
    "train.val_tokens": AT_LEAST_1,
    "train.prefetch": AT_LEAST_1,
    "train.peak_flops": POSITIVE,  # FLOP/s per device, when set
    "train.z_loss": NON_NEGATIVE,
    "train.skip_window": Range(2),  # a standard deviation needs two values
    "train.skip_sigma": POSITIVE,  # when set
    "train.max_skips_in_a_row": AT_LEAST_1,
    "train.eval_every": NON_NEGATIVE,  # 0 = no downstream evals during the run
    "train.eval_limit": AT_LEAST_1,  # when set; None = whole validation sets
    "data.limit": Range(1, also=(-1,)),
    "data.val_fraction": Range(0, 1),  # 1: every document to val (a validation set's dataset, data.val_sets)
    "data.sequences_per_sample": AT_LEAST_1,
    "data.samples_per_shard": AT_LEAST_1,
    "data.val_samples_per_shard": AT_LEAST_1,
    "data.tasks": AT_LEAST_1,
    "data.workers": Range(1, also=(-1,)),
    "data.slurm.cpus_per_task": AT_LEAST_1,
    "data.slurm.mem_per_cpu_gb": POSITIVE,
    "tracking.milestones[]": POSITIVE,  # val-loss thresholds
    "checkpoint.every_steps": AT_LEAST_1,
    "checkpoint.keep_last": AT_LEAST_1,  # 0 would delete the checkpoint just written
    "checkpoint.keep_every_steps": NON_NEGATIVE,  # 0: no milestones
    "checkpoint.every_minutes": POSITIVE,
    "checkpoint.max_failed_saves": AT_LEAST_1,
    "checkpoint.end_margin_s": NON_NEGATIVE,
    "cooldown.from_step": AT_LEAST_1,  # a branch starts after at least one step of its main run
    "cooldown.decay_tokens": AT_LEAST_1,
    "data.val_sets{}.tokens": AT_LEAST_1,  # {}: in every entry of the mapping; null: train.val_tokens
}
# Strings that become a path or a file name: never empty; NAME_KEYS are one folder name inside run.output_dir
# (the run folder is <output_dir>/<arm>-<scale>-s<seed>), so no separators and no "..".
NON_EMPTY_KEYS = (
    "run.output_dir",
    "data.dataset_dir",
    "data.input",
    "data.tokenizer",
    "data.eos_token",
    "train.init_from",
    "cooldown.from_run_dir",
)
NAME_KEYS = ("run.scale", "tracking.experiment")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
VAL_SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _value(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.removesuffix("[]").split("."):
        value = getattr(value, part)
    return value


def _values(cfg: Config, key: str) -> list[tuple[str, Any]]:
    """(dotted name, value) of a RANGES key: one, each item of a list (``key[]``), or the key in each entry
    of a mapping (``section.mapping{}.key``)."""
    if "{}." in key:
        head, _, tail = key.partition("{}.")
        return [(f"{head}.{name}.{tail}", getattr(entry, tail)) for name, entry in _value(cfg, head).items()]
    value = _value(cfg, key)
    name = key.removesuffix("[]")
    return [(name, v) for v in value] if key.endswith("[]") else [(name, value)]


def check_ranges(cfg: Config) -> None:
    """Every key of RANGES, NON_EMPTY_KEYS and NAME_KEYS; one line naming the first key out of range."""
    for key, allowed in RANGES.items():
        for name, v in _values(cfg, key):
            if v is not None and not allowed.allows(v):
                raise ConfigError(f"{cfg.source}: {name}: {v!r} must be {allowed.describe()}")
    for key in NON_EMPTY_KEYS:
        if _value(cfg, key) is not None and not _value(cfg, key).strip():  # None: an optional path left unset
            raise ConfigError(f"{cfg.source}: {key}: is empty; give a path or name")
    for key in NAME_KEYS:
        value = _value(cfg, key)
        if value is not None and (not NAME.fullmatch(value) or ".." in value):
            raise ConfigError(
                f"{cfg.source}: {key}: {value!r} is not a plain name (letters, digits, . _ + -, no '..' or '/'); "
                "it names a folder or experiment inside run.output_dir"
            )


def check_combinations(cfg: Config) -> None:
    """Every rule across keys, the schedule's included (its verdict, judged once). Single values are already
    in range (check_ranges)."""
    src, m, t, p = cfg.source, cfg.model, cfg.train, cfg.parallel

    def fail(key: str, msg: str) -> None:
        raise ConfigError(f"{src}: {key}: {msg}")

    if p.zero_stage == 3 and p.tp > 1:
        fail("parallel.zero_stage", "ZeRO stage 3 is only supported with parallel.tp=1; use 1 or 2")
    if p.zero_stage == 0 and t.precision == "bf16":
        # DeepSpeed sums micro-batch gradients in fp32 under bf16 only with ZeRO (grad_accum_dtype)
        fail("parallel.zero_stage", "0 with train.precision=bf16 would sum gradients in bf16; use 1, 2 or 3")
    if t.min_lr > t.lr:
        fail("train.min_lr", f"{t.min_lr} exceeds train.lr={t.lr}")
    if t.train_tokens < t.batch_tokens:
        fail(
            "train.train_tokens",
            f"{t.train_tokens} is less than one batch (train.batch_tokens={t.batch_tokens})",
        )
    if m.d_model % m.h_base:
        fail("model.h_base", f"{m.h_base} does not divide model.d_model={m.d_model}")
    cfg.steps(1)  # batch_tokens vs seq_len x micro_batch_size
    heads = cfg.heads_per_layer
    if len(heads) != m.num_layers:
        fail("schedule.heads", f"lists {len(heads)} layers but model.num_layers={m.num_layers}")
    verdict = cfg.schedule_verdict
    if verdict.errors:
        fail("schedule.heads", verdict.error_line())
    for line in verdict.warning_lines():
        warnings.warn(line, stacklevel=2)
    if cfg.run.arm == "uniform" and len(set(heads)) != 1:
        fail("run.arm", f"'uniform' needs a constant schedule, got {schedule.compact(heads)}")
    check_eval_tasks(cfg)
    check_profile_steps(cfg)
    for key in cfg.checkpoint.allow_changes:
        if key not in RECIPE_KEYS:
            fail("checkpoint.allow_changes", f"{key!r} cannot change on resume; allowed: {', '.join(RECIPE_KEYS)}")
    if (problem := cadence.keys_problem(cfg)) is not None:  # pipeline.cadence owns the cadence keys' rule
        raise ConfigError(f"{cfg.source}: {problem}")
    check_val_sets(cfg)
    check_lr_schedule(cfg)


def check_lr_schedule(cfg: Config) -> None:
    """WSD's warmup and decay fit in the run; a cooldown branch names its main run, step and decay together,
    and decays for at least one step."""
    t, c, layout = cfg.train, cfg.cooldown, cfg.steps(1)
    if t.lr_schedule == "wsd" and layout["warmup"] + layout["decay"] > layout["main_total"]:
        raise ConfigError(
            f"{cfg.source}: train.decay_fraction: {t.decay_fraction} decays {layout['decay']} steps, which with "
            f"{layout['warmup']} warmup steps (train.warmup_fraction={t.warmup_fraction}) exceeds the "
            f"{layout['main_total']} steps of the run; lower train.decay_fraction or train.warmup_fraction"
        )
    given = [k for k in ("from_run_dir", "decay_tokens", "decay_shape") if getattr(c, k) is not None]
    if (c.from_step is None) != (c.decay_tokens is None) or (given and c.from_step is None):
        raise ConfigError(
            f"{cfg.source}: cooldown.{given[0] if c.from_step is None else 'decay_tokens'}: a cooldown branch needs "
            "cooldown.from_step and cooldown.decay_tokens together (`prism cooldown RUN_DIR --from-step N "
            "--decay-tokens T` writes them)"
        )
    if cfg.is_branch and c.decay_tokens < t.batch_tokens:
        raise ConfigError(
            f"{cfg.source}: cooldown.decay_tokens: {c.decay_tokens} is less than one step "
            f"(train.batch_tokens={t.batch_tokens}); decay over at least {t.batch_tokens} tokens"
        )


def check_val_sets(cfg: Config) -> None:
    """data.val_sets: each name becomes a metric (val/<name>/loss), so a plain name; a folder to read."""
    for name, spec in cfg.data.val_sets.items():
        key = f"data.val_sets.{name}"
        if not VAL_SET_NAME.fullmatch(name):
            raise ConfigError(
                f"{cfg.source}: {key}: {name!r} is not a plain name (letters, digits, _ . -); it names the "
                f"metric val/<name>/loss"
            )
        if not spec.dataset_dir.strip():
            raise ConfigError(f"{cfg.source}: {key}.dataset_dir: is empty; give a prepared dataset folder")


def check_eval_tasks(cfg: Config) -> None:
    """train.eval_every needs tasks, and every task must be one of the offline sets (pipeline.eval.catalog)."""
    from pipeline.eval.catalog import OFFLINE_TASKS

    t = cfg.train
    for task in t.eval_tasks:
        if task not in OFFLINE_TASKS:
            raise ConfigError(
                f"{cfg.source}: train.eval_tasks: unknown task {task!r}; choose from {', '.join(OFFLINE_TASKS)}"
            )
    if t.eval_every and not t.eval_tasks:
        raise ConfigError(
            f"{cfg.source}: train.eval_every: {t.eval_every} with no train.eval_tasks; list tasks, e.g. "
            f"train.eval_tasks=[{','.join(OFFLINE_TASKS)}], or set train.eval_every=0"
        )


def check_profile_steps(cfg: Config) -> None:
    """train.profile_steps: [] or [first, last] with 1 <= first <= last <= the run's last step."""
    steps, total = cfg.train.profile_steps, cfg.steps(1)["total"]
    if not steps:
        return
    if len(steps) != 2 or not all(isinstance(s, int) for s in steps) or not 1 <= steps[0] <= steps[1] <= total:
        raise ConfigError(
            f"{cfg.source}: train.profile_steps: {list(steps)} is not [first, last] with 1 <= first <= last <= "
            f"{total} (the run's steps); e.g. train.profile_steps=[10,11], or [] for none"
        )


def check_replication(cfg: Config) -> None:
    """What replicated layers need from the rest of the config."""
    dropout = cfg.model.dropout
    if dropout and any(layer.replicated for layer in cfg.layer_plan):
        # TP ranks draw attention dropout from different RNG streams: replicas would diverge.
        raise ConfigError(
            f"{cfg.source}: model.dropout: {dropout}: parallel.replicate_indivisible_layers needs model.dropout=0"
        )
