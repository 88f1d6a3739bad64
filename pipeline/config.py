"""The one config object: schema, YAML loading (with `base:` overlays), dotted overrides, validation, hash.

Every section is a frozen dataclass; a YAML preset fills it. Loading rejects unknown keys, wrong types, missing
required keys and impossible combinations with one line that names the file, the key and what is allowed.
A loaded Config is valid and immutable: the head schedule is parsed once into `heads_per_layer`, and which
layers run replicated under TP is decided once, in `layer_plan`. Derive a changed config with
`from_dict(apply_overrides(cfg.to_dict(), [...]))`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from pipeline import schedule

REQUIRED: Any = dataclasses.MISSING


class ConfigError(ValueError):
    """One-line message: where, which key, what is allowed."""


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


@dataclass(frozen=True)
class TrainConfig:
    batch_tokens: int
    micro_batch_size: int
    lr: float
    train_tokens: int
    min_lr: float = 0.0
    warmup_fraction: float = 0.025
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


@dataclass(frozen=True)
class SlurmExecutorConfig:
    partition: str | None = None
    time: str = "04:00:00"
    cpus_per_task: int = 4
    mem_per_cpu_gb: float = 2.0
    max_array_launch_parallel: bool = False
    sbatch_args: dict[str, str] = field(default_factory=dict)


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
    keep_last: int = 2
    # Plan keys (PLAN_KEYS) a resume may change, e.g. [train.lr] to continue with a lower LR after a NaN;
    # any other change of the plan, model or data is refused on resume.
    allow_changes: tuple[str, ...] = ()


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
    source: str = field(default="<dict>", compare=False, repr=False)  # where it was loaded from; not hashed
    # Derived once at construction, never dumped or hashed: the parsed schedule and the per-layer plan.
    heads_per_layer: tuple[int, ...] = field(init=False, compare=False, repr=False)
    layer_plan: tuple[schedule.LayerPlan, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_ranges(self)  # every number and name in range first: later rules divide by them
        try:
            heads = schedule.resolve(self.schedule.heads)
        except schedule.ScheduleError as e:
            raise ConfigError(f"{self.source}: schedule.heads: {e}") from None
        object.__setattr__(self, "heads_per_layer", heads)  # frozen: the one place these are set
        _check_combinations(self)  # first: the plan divides by parallel.tp and model.d_model
        object.__setattr__(
            self,
            "layer_plan",
            schedule.plan_layers(
                heads,
                self.model.d_model,
                self.parallel.tp,
                replicate_indivisible=self.parallel.replicate_indivisible_layers,
            ),
        )
        _check_plan(self)

    # --- derived names and paths (computed on read) -------------------------------------------------------------
    @property
    def run_name(self) -> str:
        return f"{self.run.arm}-{self.run.scale}-s{self.run.seed}"

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run_name

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"

    @property
    def experiment(self) -> str:
        return self.tracking.experiment or f"prism-{self.run.scale}"

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
        """Optimizer steps, warmup steps and gradient-accumulation steps for a given DP size."""
        t, m = self.train, self.model
        per_micro = m.seq_len * t.micro_batch_size * data_parallel
        if t.batch_tokens % per_micro:
            raise ConfigError(
                f"{self.source}: train.batch_tokens={t.batch_tokens} is not divisible by seq_len x "
                f"micro_batch_size x DP = {m.seq_len} x {t.micro_batch_size} x {data_parallel} = {per_micro}; "
                f"use a multiple of {per_micro}"
            )
        total = max(1, t.train_tokens // t.batch_tokens)
        return {
            "total": total,
            "warmup": int(round(t.warmup_fraction * total)),
            "grad_accum": t.batch_tokens // per_micro,
        }


# Keys whose change makes a checkpoint or a dataset incompatible (resume refuses, naming the key).
MODEL_OR_DATA_KEYS = (
    "run.seed",
    "model",
    "schedule",
    "parallel.tp",
    "train.batch_tokens",
    "train.micro_batch_size",
    "data",
)
# How work is executed, not what it computes (the tokens, the weights): a change never blocks a resume.
EXECUTION_ONLY_KEYS = (
    "data.executor",
    "data.tasks",
    "data.workers",
    "data.slurm",
    "data.allow_repeat",  # permission to read past one epoch: the order of the data does not change
    "data.verify_on_start",
    # how the same math runs (kernels, fusions): the weights and their names do not change
    "model.attention_backend",
    "model.fusions",
)
# Keys that change the training trajectory (schedule, optimizer, numerics) but not what a checkpoint holds:
# a resume refuses a change unless checkpoint.allow_changes names the key.
PLAN_KEYS = (
    "train.train_tokens",
    "train.lr",
    "train.min_lr",
    "train.warmup_fraction",
    "train.weight_decay",
    "train.beta1",
    "train.beta2",
    "train.eps",
    "train.grad_clip",
    "train.precision",
    "parallel.zero_stage",
    "parallel.replicate_indivisible_layers",
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


def changed_keys(old: dict[str, Any], new: dict[str, Any], scope: tuple[str, ...] = MODEL_OR_DATA_KEYS) -> list[str]:
    """Flattened keys under ``scope`` whose values differ between two config dicts."""
    a, b = flatten(old), flatten(new)
    keys = sorted(set(a) | set(b))

    def in_scope(k: str) -> bool:
        if any(k == e or k.startswith(e + ".") for e in EXECUTION_ONLY_KEYS):
            return False
        return any(k == s or k.startswith(s + ".") for s in scope)

    def differs(k: str) -> bool:
        if k not in a:  # saved before the key existed: that run had the default's behaviour
            return b.get(k) != schema_default(k)
        return a.get(k) != b.get(k)

    return [k for k in keys if in_scope(k) and differs(k)]


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


# --- loading -------------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:  # YAML writes it as a list
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if typing.get_origin(tp) is dict:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats (3e-4 vs 1)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping (section), got {type(value).__name__}")
        return _build(tp, value, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not allowed; choose one of {_type_name(tp)}")
        return value
    if isinstance(tp, types.UnionType) or origin is typing.Union:
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} has the wrong type; expected {_type_name(tp)}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{where}: expected null")
        return None
    if origin is tuple:  # a YAML list, kept as a tuple so the loaded config stays immutable
        item = typing.get_args(tp)[0]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list of {_type_name(item)}, got {value!r}")
        return tuple(_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" as a string
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{where}: {value!r} has the wrong type; expected {_type_name(tp)}")
    return value


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    return cls(**_section_kwargs(cls, data, where))


def _section_kwargs(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != "source"}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; allowed keys here: {', '.join(fields)}".lstrip("."))
    kwargs = {}
    for name, f in fields.items():
        key = f"{where}.{name}" if where else name
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], key)
        elif f.default is REQUIRED and f.default_factory is REQUIRED:  # type: ignore[misc]
            raise ConfigError(f"{key}: missing required key ({_type_name(hints[name])})")
    return kwargs


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: write it as section.key=value, e.g. train.lr=3e-4")
    key, _, raw = text.partition("=")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    data = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
        node[path[-1]] = value
    return data


def from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Build and validate (Config.__post_init__) a config from YAML-shaped data."""
    try:
        sections = _section_kwargs(Config, data, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return Config(**sections, source=source)


def load(path: str | Path, overrides: list[str] | None = None) -> Config:
    """A YAML preset (its `base:` chain merged under it), then the dotted overrides, validated."""
    return from_dict(expand_output_dir(apply_overrides(read_yaml(path), overrides or [])), str(path))


# Path keys that may start with {output_dir}: they follow run.output_dir (`prism demo run.output_dir=/tmp/x`
# puts the data there too), expanded once on load, after the overrides.
OUTPUT_DIR_KEYS = (("data", "dataset_dir"), ("data", "input"), ("data", "tokenizer"), ("checkpoint", "dir"))


def expand_output_dir(data: dict[str, Any]) -> dict[str, Any]:
    out_dir = str((data.get("run") or {}).get("output_dir") or RunConfig.output_dir)
    data = copy.deepcopy(data)
    for section, key in OUTPUT_DIR_KEYS:
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str) and "{output_dir}" in value:
            data[section][key] = value.replace("{output_dir}", out_dir)
    return data


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A preset as one mapping: a top-level `base: FILE` (relative to this file) is read first and this
    file's keys are deep-merged over it, so an arm overlay names only what differs from its scale's base."""
    path = Path(path)
    if not path.is_file():
        where = f"{_seen[-1]}: base {path}" if _seen else str(path)
        raise ConfigError(f"{where}: config file not found; pass a YAML preset such as configs/tiny_prism.yaml")
    if path.resolve() in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path.resolve()))
        raise ConfigError(f"{path}: base files form a cycle ({chain}); remove one base: key")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    if "base" not in data:
        return data
    base = data.pop("base")
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base: {base!r} must be a file name, e.g. base: base/124m.yaml")
    return _deep_merge(read_yaml(path.parent / base, (*_seen, path.resolve())), data)


def _deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Mappings merge key by key; anything else (a value, a list) in the overlay replaces the base's."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# --- every number's range, in one table (checked first, before any rule that combines keys) -----------
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
    "train.batch_tokens": AT_LEAST_1,
    "train.micro_batch_size": AT_LEAST_1,
    "train.lr": POSITIVE,  # lr=0 would train nothing, silently
    "train.train_tokens": AT_LEAST_1,
    "train.min_lr": NON_NEGATIVE,
    "train.warmup_fraction": FRACTION,
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
    "data.limit": Range(1, also=(-1,)),
    "data.val_fraction": FRACTION,
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
)
NAME_KEYS = ("run.scale", "tracking.experiment")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def _value(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.removesuffix("[]").split("."):
        value = getattr(value, part)
    return value


def _check_ranges(cfg: Config) -> None:
    """Every key of RANGES, NON_EMPTY_KEYS and NAME_KEYS; one line naming the first key out of range."""
    for key, allowed in RANGES.items():
        value = _value(cfg, key)
        for v in value if key.endswith("[]") else (value,):
            if v is not None and not allowed.allows(v):
                raise ConfigError(f"{cfg.source}: {key.removesuffix('[]')}: {v!r} must be {allowed.describe()}")
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


def _check_combinations(cfg: Config) -> None:
    """Every rule across keys, the schedule's included (on cfg.heads_per_layer, parsed once)."""
    src, m, t, p = cfg.source, cfg.model, cfg.train, cfg.parallel

    def fail(key: str, msg: str) -> None:
        raise ConfigError(f"{src}: {key}: {msg}")

    positive = {
        "model.num_layers": m.num_layers,
        "model.d_model": m.d_model,
        "model.h_base": m.h_base,
        "model.seq_len": m.seq_len,
        "train.micro_batch_size": t.micro_batch_size,
        "parallel.tp": p.tp,
        "train.batch_tokens": t.batch_tokens,
        "data.samples_per_shard": cfg.data.samples_per_shard,
        "data.sequences_per_sample": cfg.data.sequences_per_sample,
    }
    for key, v in positive.items():
        if v < 1:
            fail(key, f"{v} must be >= 1")
    if p.zero_stage not in (0, 1, 2, 3):
        fail("parallel.zero_stage", f"{p.zero_stage} is not a ZeRO stage; use 0, 1, 2 or 3")
    if p.zero_stage == 3 and p.tp > 1:
        fail("parallel.zero_stage", "ZeRO stage 3 is only supported with parallel.tp=1; use 1 or 2")
    if p.zero_stage == 0 and t.precision == "bf16":
        # DeepSpeed sums micro-batch gradients in fp32 under bf16 only with ZeRO (grad_accum_dtype)
        fail("parallel.zero_stage", "0 with train.precision=bf16 would sum gradients in bf16; use 1, 2 or 3")
    if not 0 <= t.warmup_fraction < 1:
        fail("train.warmup_fraction", f"{t.warmup_fraction} must be in [0, 1)")
    if t.min_lr > t.lr:
        fail("train.min_lr", f"{t.min_lr} exceeds train.lr={t.lr}")
    if not 0 <= cfg.data.val_fraction < 1:
        fail("data.val_fraction", f"{cfg.data.val_fraction} must be in [0, 1)")
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
    try:
        schedule.validate(
            heads,
            m.d_model,
            m.h_base,
            p.tp,
            allow_guideline_violations=cfg.schedule.allow_guideline_violations,
            replicate_indivisible=p.replicate_indivisible_layers,
        )
    except schedule.ScheduleError as e:
        fail("schedule.heads", str(e))
    if cfg.run.arm == "uniform" and len(set(heads)) != 1:
        fail("run.arm", f"'uniform' needs a constant schedule, got {schedule.compact(heads)}")
    for key in cfg.checkpoint.allow_changes:
        if key not in PLAN_KEYS:
            fail("checkpoint.allow_changes", f"{key!r} cannot change on resume; allowed: {', '.join(PLAN_KEYS)}")


def _check_plan(cfg: Config) -> None:
    """Rules on the per-layer plan, once it exists."""
    dropout = cfg.model.dropout
    if dropout and any(layer.replicated for layer in cfg.layer_plan):
        # TP ranks draw attention dropout from different RNG streams: replicas would diverge.
        raise ConfigError(
            f"{cfg.source}: model.dropout: {dropout}: parallel.replicate_indivisible_layers needs model.dropout=0"
        )
