"""The schema: one frozen dataclass per config section, and Config, which validates itself at construction
(pipeline.config.rules) and resolves and judges the head schedule once.

Every field carries its comment: the comments are the configuration reference `make docs` renders
(pipeline.cli.docs), so they stay beside their fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline import schedule
from pipeline.config import rules
from pipeline.config.errors import ConfigError

REQUIRED: Any = dataclasses.MISSING


@dataclass(frozen=True)
class RunConfig:
    arm: Literal["uniform", "prism"]
    scale: str  # "124m", "354m", "757m", "tiny"
    seed: int = 1234
    output_dir: str = "runs"  # run folder = output_dir / run_name


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    d_model: int
    h_base: int
    ffn_hidden_size: int  # SwiGLU hidden, ~8/3 * d_model, so the MLP holds 8 d^2 weights
    seq_len: int = 1024
    vocab_size: int = 50257  # the tokenizer's size; the model pads to a multiple of 128 * TP
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    activation: Literal["swiglu", "gelu"] = "swiglu"
    tie_embeddings: bool = True
    bias: bool = False
    dropout: float = 0.0
    init_std: float = 0.02
    # sdpa: torch picks the kernel; flash | cudnn | efficient | math pin one (pipeline.model.sdpa_backend)
    attention_backend: Literal["sdpa", "megatron", "flash", "cudnn", "efficient", "math"] = "sdpa"
    # megatron layer spec: "local" (plain torch modules) or "transformer_engine" (fused TE modules, CUDA + TE
    # installed). Their checkpoints do not load into each other, so it is chosen here, never by what imports.
    spec: Literal["local", "transformer_engine"] = "local"
    # megatron's fusion flags that run without TE (fused SwiGLU, bias-dropout-add): pipeline.model.fusions
    fusions: Literal["none", "megatron"] = "none"


@dataclass(frozen=True)
class ScheduleConfig:
    heads: str | tuple[int, ...]  # compact "3x2,6x2,8x2,12x6", an explicit list, or a preset name
    allow_guideline_violations: bool = False


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    zero_stage: int = 1
    # Opt-in: layers whose head count is not a multiple of TP run replicated on every TP rank.
    replicate_indivisible_layers: bool = False
    # Seconds a collective may wait until the first step of a start is done (start-up, resume, first compilation).
    init_timeout_s: float = 600.0
    # Seconds a collective may wait after that; then the job ends as hung (exit 5, restarted; docs/cluster.md).
    timeout_s: float = 300.0


@dataclass(frozen=True)
class TrainConfig:
    batch_tokens: int
    micro_batch_size: int
    lr: float
    train_tokens: int
    min_lr: float = 0.0
    warmup_fraction: float = 0.025
    # cosine: warmup, then cosine down to min_lr at the last step. wsd (warmup-stable-decay): warmup, constant lr,
    # then the last decay_fraction of the steps decay to min_lr (pipeline.lr_schedule; docs/training.md).
    lr_schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: float = 0.1  # wsd: the share of the steps that decay (warmup + decay <= all steps)
    # The decay's shape under wsd, and a cooldown branch's unless cooldown.decay_shape says otherwise; 1-sqrt
    # did best in arXiv 2405.18392.
    decay_shape: Literal["linear", "1-sqrt", "cosine"] = "1-sqrt"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    precision: Literal["bf16", "fp32"] = "bf16"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = 10
    val_every: int = 200
    val_tokens: int = 1_048_576  # tokens of the val split used per evaluation (same for both arms)
    prefetch: int = 2
    peak_flops: float | None = None  # per device; None: look the device up in a table
    compile: bool = False  # torch.compile the model (pipeline.model.fusions); off: it does not pay on CPU
    init_from: str | None = None  # a `prism export` folder: a fresh run starts from its weights (pipeline.export)
    z_loss: float = 0.0  # PaLM's z-loss: this coefficient times the mean squared log-sum-exp (PaLM: 1e-4); 0: off
    skip_window: int = 128  # steps a spike is measured against (pipeline.skipping: the step is skipped on the device)
    skip_sigma: float | None = 6.0  # a spike: above mean + this many std of the window; null: NaN/inf only
    max_skips_in_a_row: int = 8  # then the run stops with exit 4 and the non-finite diagnostics
    # Downstream zero-shot evals during the run: `prism eval`'s scoring on the live model (pipeline.eval.in_run),
    # logged as eval/<task>/<acc|acc_norm> every eval_every steps and at the last step; 0: none.
    eval_every: int = 0
    eval_tasks: tuple[str, ...] = ()  # offline sets: hellaswag, piqa, winogrande, arc_easy; needed by eval_every
    eval_limit: int | None = None  # the first eval_limit examples of each task; None: the whole validation sets
    # Trace steps [first, last] (1-based, inclusive) with the torch profiler: a gzipped Chrome trace per rank in
    # <run dir>/profile/step-A-B/ (pipeline.profiling; a live run also takes requests: `prism profile`). []: none.
    profile_steps: tuple[int, ...] = ()
    profile_memory: bool = False  # with profile_steps: a CUDA memory snapshot of those steps beside the traces


@dataclass(frozen=True)
class SlurmExecutorConfig:
    partition: str | None = None
    time: str = "04:00:00"
    cpus_per_task: int = 4
    mem_per_cpu_gb: float = 2.0
    max_array_launch_parallel: bool = False
    sbatch_args: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ValSetConfig:
    """One named validation set of data.val_sets, logged as val/<name>/loss at train.val_every. It must be
    tokenized with the run's tokenizer and model.seq_len (checked before step 1)."""

    dataset_dir: str  # a prepared dataset folder (manifest.json)
    split: Literal["train", "val"] = "val"  # which of its splits is read (first rows, in manifest order)
    tokens: int | None = None  # tokens scored per validation; None: train.val_tokens
    # `prism prepare` builds dataset_dir from this input (the run's tokenizer, seq_len and packing, every
    # document to the val split); an embedded input that does not exist is built from embedded text the
    # training corpus does not hold. None: dataset_dir is prepared elsewhere.
    input: str | None = None


@dataclass(frozen=True)
class ValidationSet:
    """A set the trainer validates on, resolved: the run's own val split (name None, metric val/loss) or
    one of data.val_sets. ``key`` names it in messages."""

    name: str | None
    dataset_dir: str
    split: str
    tokens: int
    key: str

    @property
    def metric(self) -> str:
        from pipeline.metric_names import val_loss_metric

        return val_loss_metric(self.name)


@dataclass(frozen=True)
class DataConfig:
    dataset_dir: str  # prepared webdataset folder (manifest.json + train/ + val/)
    input: str = "hf://datasets/HuggingFaceFW/fineweb/sample/10BT"
    input_format: Literal["parquet", "jsonl", "embedded"] = "parquet"
    text_key: str = "text"
    id_key: str = "id"
    limit: int = -1  # documents per reader task, -1 = all
    tokenizer: str = "gpt2"  # local tokenizer.json path or a Hub name
    eos_token: str = "<|endoftext|>"
    val_fraction: float = 0.005
    sequences_per_sample: int = 16  # sequences packed into one tar member
    samples_per_shard: int = 256
    # val is tiny (val_fraction): its own shard size, or the end-of-task rule would drop all of it
    val_samples_per_shard: int = 8
    executor: Literal["local", "slurm"] = "local"
    tasks: int = 1
    workers: int = -1
    slurm: SlurmExecutorConfig = field(default_factory=SlurmExecutorConfig)
    # A train.train_tokens beyond one epoch of the prepared train split is refused unless this says repeat.
    allow_repeat: bool = False
    # Hash every shard before step 1: true, false, or "auto" = when the dataset's shards total <= 1 GiB
    # (seconds to hash); larger datasets are hashed shard by shard as the loader first reads them.
    verify_on_start: bool | Literal["auto"] = "auto"
    # More validation sets besides the val split of dataset_dir (that one stays val/loss): name -> set.
    val_sets: dict[str, ValSetConfig] = field(default_factory=dict)


@dataclass(frozen=True)
class TrackingConfig:
    enabled: bool = True
    uri: str | None = None  # None: sqlite:///<run.output_dir>/mlflow.db (both arms); or http://host:port
    experiment: str | None = None  # None: prism-<scale>
    milestones: tuple[float, ...] = ()  # val-loss thresholds, first crossing logged
    system_metrics: bool = True


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None  # None: <run dir>/checkpoints
    every_steps: int = 1000
    # Save by the clock instead (minutes of training since the last save, decided at sync steps); when set,
    # every_steps is not used (milestones and the last step still save). `prism plan` prints the Young-Daly
    # interval for a layout and how many saves the run makes.
    every_minutes: float | None = None
    keep_last: int = 2  # the newest tags kept; older ones are deleted unless they are milestones
    # Milestones: the checkpoints at every keep_every_steps-th step (and the last step) are never pruned, for
    # scoring accuracy against tokens afterwards (`prism eval RUN_DIR --milestones`). 0: none. A multiple of
    # every_steps when saving by steps; any value with every_minutes.
    keep_every_steps: int = 0
    # A milestone older than the keep_last newest tags keeps only its weights (mp_rank_*_model_states.pt,
    # what eval and export read): its optimizer files are dropped; resume never picks it.
    milestone_weights_only: bool = False
    # Write in the background: the step waits only for the copy to host memory (pipeline.checkpoint.writer).
    async_save: bool = True
    # Failed saves in a row (disk full, I/O error) before the run stops with exit 5 (infrastructure fault);
    # a failed final or stop-signal save stops it at once.
    max_failed_saves: int = 3
    # Under a batch-script Slurm job with an end time (SLURM_JOB_END_TIME, which --time-min can bring forward):
    # seconds kept free before it besides the save and the longest step measured in this start; the final
    # checkpoint is taken then, whatever --signal says, and the run exits 3 (train_job.sh requeues it).
    end_margin_s: float = 60.0
    # Training-recipe keys (RECIPE_KEYS) a resume may change, e.g. [train.lr] to continue with a lower LR after
    # a NaN; any other change of the recipe, model or data is refused on resume.
    allow_changes: tuple[str, ...] = ()


@dataclass(frozen=True)
class CooldownConfig:
    """A cooldown branch (`prism cooldown`, pipeline.cooldown): a run of its own that starts from a main run's
    checkpoint at from_step (weights, optimizer state, data position) and decays the LR the main run had there
    to train.min_lr over decay_tokens more tokens of the same data order. Unset: a main run."""

    # the main run's folder (its checkpoints/ holds the tag at from_step); None: this config's main run,
    # run.output_dir/<arm>-<scale>-s<seed>, so one override list branches every arm and seed of a sweep
    from_run_dir: str | None = None
    from_step: int | None = None  # the main run's checkpoint step the branch starts from; None: not a branch
    decay_tokens: int | None = None  # tokens the branch trains (whole train.batch_tokens steps)
    decay_shape: Literal["linear", "1-sqrt", "cosine"] | None = None  # None: train.decay_shape


@dataclass(frozen=True)
class Config:
    run: RunConfig
    model: ModelConfig
    schedule: ScheduleConfig
    parallel: ParallelConfig
    train: TrainConfig
    data: DataConfig
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cooldown: CooldownConfig = field(default_factory=CooldownConfig)
    source: str = field(default="<dict>", compare=False, repr=False)  # where it was loaded from; not hashed
    # Derived once at construction, never dumped or hashed: the parsed schedule, the rules' verdict on it and
    # the per-layer plan (the verdict's).
    heads_per_layer: tuple[int, ...] = field(init=False, compare=False, repr=False)
    schedule_verdict: schedule.Verdict = field(init=False, compare=False, repr=False)
    layer_plan: tuple[schedule.LayerPlan, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        rules.check_ranges(self)  # every number and name in range first: the rules below divide by them
        try:
            heads = schedule.resolve(self.schedule.heads)
        except schedule.ScheduleError as e:
            raise ConfigError(f"{self.source}: schedule.heads: {e}") from None
        verdict = schedule.judge(
            heads,
            self.model.d_model,
            self.model.h_base,
            self.parallel.tp,
            allow_guideline_violations=self.schedule.allow_guideline_violations,
            replicate_indivisible=self.parallel.replicate_indivisible_layers,
        )
        # frozen: the one place these are set. The schedule is kept as what it builds, in compact form.
        object.__setattr__(self, "schedule", dataclasses.replace(self.schedule, heads=schedule.compact(heads)))
        object.__setattr__(self, "heads_per_layer", heads)
        object.__setattr__(self, "schedule_verdict", verdict)
        object.__setattr__(self, "layer_plan", verdict.layers)
        rules.check_combinations(self)
        rules.check_replication(self)

    # --- derived names and paths (computed on read) -------------------------------------------------------------
    @property
    def run_name(self) -> str:
        main = f"{self.run.arm}-{self.run.scale}-s{self.run.seed}"
        return f"{main}-cooldown-{self.cooldown.from_step}" if self.is_branch else main

    @property
    def is_branch(self) -> bool:
        """A cooldown branch of a main run (the cooldown section)."""
        return self.cooldown.from_step is not None

    @property
    def main_run_dir(self) -> Path:
        """A branch's main run folder (cooldown.from_run_dir, or this config's main run); a main run's own."""
        c = self.cooldown
        main = Path(self.run.output_dir) / f"{self.run.arm}-{self.run.scale}-s{self.run.seed}"
        return Path(c.from_run_dir) if c.from_run_dir and self.is_branch else main

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run_name

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"

    @property
    def experiment(self) -> str:
        return self.tracking.experiment or f"prism-{self.run.scale}"

    def validation_sets(self) -> tuple[ValidationSet, ...]:
        """Every set a validation step scores: the run's own val split first, then data.val_sets by name."""
        own = ValidationSet(None, self.data.dataset_dir, "val", self.train.val_tokens, "data.dataset_dir")
        named = (
            ValidationSet(name, s.dataset_dir, s.split, s.tokens or self.train.val_tokens, f"data.val_sets.{name}")
            for name, s in sorted(self.data.val_sets.items())
        )
        return (own, *named)

    def to_dict(self) -> dict[str, Any]:
        """The sections as plain YAML-shaped data (what a preset holds): no source, no derived values."""
        return _plain(self)

    def dump(self) -> str:
        """YAML of the full resolved config (defaults included): what MLflow stores verbatim, with any
        password in tracking.uri masked (it is written to checkpoints and artifacts)."""
        from pipeline.redaction import redact_uri

        data = self.to_dict()
        data["tracking"]["uri"] = redact_uri(data["tracking"]["uri"])
        return yaml.safe_dump(data, sort_keys=False)

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def steps(self, data_parallel: int = 1) -> dict[str, int]:
        """Optimizer steps, warmup steps and gradient-accumulation steps for a given DP size; main_total and
        decay: the main LR schedule's steps and its WSD decay (pipeline.lr_schedule). A cooldown branch's
        total is its from_step plus its decay's steps; its warmup and main_total are its main run's; start: the
        steps done before this run's first (a branch's from_step, trained by its main run; 0 for a main run)."""
        from pipeline.lr_schedule import wsd_decay_steps

        t, m, c = self.train, self.model, self.cooldown
        per_micro = m.seq_len * t.micro_batch_size * data_parallel
        if t.batch_tokens % per_micro:
            raise ConfigError(
                f"{self.source}: train.batch_tokens={t.batch_tokens} is not divisible by seq_len x "
                f"micro_batch_size x DP = {m.seq_len} x {t.micro_batch_size} x {data_parallel} = {per_micro}; "
                f"use a multiple of {per_micro}"
            )
        main = max(1, t.train_tokens // t.batch_tokens)
        return {
            "total": (c.from_step or 0) + (c.decay_tokens or 0) // t.batch_tokens if self.is_branch else main,
            "warmup": int(round(t.warmup_fraction * main)),
            "grad_accum": t.batch_tokens // per_micro,
            "main_total": main,
            "decay": wsd_decay_steps(t.decay_fraction, main) if t.lr_schedule == "wsd" else 0,
            "start": c.from_step if self.is_branch else 0,
        }


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {
            f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init and f.name != "source"
        }
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def schema_default(key: str) -> Any:
    """The default of a flattened ``section.name`` key (``model.spec`` -> "local"); MISSING where none."""
    section, _, name = key.partition(".")
    cls = typing.get_type_hints(Config).get(section)
    if not dataclasses.is_dataclass(cls):
        return dataclasses.MISSING
    for f in dataclasses.fields(cls):
        if f.name == name:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            return _plain(default)
    return dataclasses.MISSING
