"""The search spec: read and checked field by field (one line with its YAML line and column on a bad field),
and what every run of the search is (its overrides: own folder, the shared store and data, the full budget's
LR schedule with a validation at every rung)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from pipeline import config, schedule
from pipeline.config import ConfigError
from pipeline.runs.plan import ALL_VALID, all_valid_schedules
from pipeline.runs.spec_file import SpecFile, check_slurm_section, is_int

SPEC_KEYS = (
    "name",
    "config",
    "overrides",
    "folder",
    "space",
    "rungs",
    "trials",
    "concurrency",
    "sampler",
    "pruner",
    "seed",
    "executor",
    "nproc_per_node",
    "slurm",
    "confirm",
)
SPACE_KEYS = ("schedules", "lr")
FILTER_KEYS = ("stages", "min_heads")
RUNG_KEYS = ("min_tokens", "reduction_factor", "full_tokens")
CONFIRM_KEYS = ("top_k", "seeds")
SAMPLERS = ("grid", "tpe", "random")
PRUNERS = ("asha", "hyperband")


@dataclasses.dataclass(frozen=True)
class Rungs:
    min_tokens: int
    reduction_factor: int
    full_tokens: int

    @property
    def points(self) -> list[int]:
        """Tokens at every rung, the full budget last: min, min*eta, ..., full."""
        out = [self.min_tokens]
        while out[-1] < self.full_tokens:
            out.append(out[-1] * self.reduction_factor)
        return out


@dataclasses.dataclass
class SearchSpec:
    path: Path
    name: str
    config_path: Path
    overrides: list[str]
    folder: Path
    schedules: list[str]
    schedules_from: str  # how the list was made, for the console
    lr: tuple[float, float] | None
    rungs: Rungs
    trials: int
    concurrency: int
    sampler: str
    pruner: str
    seed: int
    executor: str
    nproc_per_node: int
    slurm: dict[str, Any]
    confirm_top_k: int
    confirm_seeds: int
    base: config.Config  # the base config with the spec's overrides


# --- the spec -------------------------------------------------------------------------------------------
def load_spec(path: str | Path) -> SearchSpec:
    """Read and check a search spec, field by field: a bad one is one line with its line and column."""
    doc = SpecFile(path, "search spec", SPEC_KEYS)
    spec = doc.data
    config_path, overrides, base = _base_config(doc)
    schedules, schedules_from, lr = _space(doc, base, overrides)
    rungs = _rungs(doc, base.train.batch_tokens)
    sampler = spec.get("sampler", "grid")
    if sampler not in SAMPLERS:
        raise doc.bad("sampler", f"use one of {', '.join(SAMPLERS)}")
    trials = _positive_int(doc, "trials", default=len(schedules) if sampler == "grid" else None)
    if sampler == "grid" and trials > len(schedules):
        raise doc.bad("trials", f"the grid sampler has {len(schedules)} schedules to try; ask for at most that")
    pruner = spec.get("pruner", "asha")
    if pruner not in PRUNERS:
        raise doc.bad("pruner", f"use {' or '.join(PRUNERS)}")
    if spec.get("executor", "local") not in ("local", "slurm"):
        raise doc.bad("executor", "use local or slurm")
    if "nproc_per_node" in spec and not (is_int(spec["nproc_per_node"]) and spec["nproc_per_node"] >= 0):
        raise doc.bad("nproc_per_node", "must be an integer >= 0 (0: one per GPU, 1 without GPUs)")
    check_slurm_section(doc)
    confirm = _mapping(doc, "confirm", CONFIRM_KEYS, required=False)
    top_k = _positive_int(doc, "confirm.top_k", default=0) if confirm else 0
    seeds = _positive_int(doc, "confirm.seeds", default=3) if confirm else 0
    if top_k > trials:
        raise doc.bad("confirm.top_k", f"cannot exceed trials={trials}")
    name = spec.get("name", doc.path.stem)
    folder = Path(spec["folder"]) if "folder" in spec else Path(base.run.output_dir) / "searches" / name
    return SearchSpec(
        path=doc.path,
        name=name,
        config_path=config_path,
        overrides=overrides,
        folder=folder.expanduser().resolve(),
        schedules=schedules,
        schedules_from=schedules_from,
        lr=lr,
        rungs=rungs,
        trials=trials,
        concurrency=_positive_int(doc, "concurrency", default=1),
        sampler=sampler,
        pruner=pruner,
        seed=_positive_int(doc, "seed", default=0, minimum=0),
        executor=spec.get("executor", "local"),
        nproc_per_node=int(spec.get("nproc_per_node", 0)),
        slurm=dict(spec.get("slurm") or {}),
        confirm_top_k=top_k,
        confirm_seeds=seeds,
        base=base,
    )


def _positive_int(doc: SpecFile, key: str, default: int | None = None, minimum: int = 1) -> int:
    value = doc.value(key)
    if value is None and default is not None:
        return default
    if not (is_int(value) and value >= minimum):
        raise doc.bad(key, f"must be an integer >= {minimum}")
    return value


def _mapping(doc: SpecFile, key: str, keys: tuple[str, ...], required: bool) -> dict[str, Any]:
    value = doc.value(key)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise doc.bad(key, f"must be a mapping of {', '.join(keys)}")
    unknown = sorted(str(k) for k in value if k not in keys)
    if unknown:
        raise doc.error(f"{key}.{unknown[0]}", f"unknown key {key}.{unknown[0]}; allowed: {', '.join(keys)}", True)
    return value


def _base_config(doc: SpecFile) -> tuple[Path, list[str], config.Config]:
    """The preset, the spec's overrides as a list, and the config they load to (a prism arm, tracked)."""
    spec = doc.data
    for key in ("name", "folder", "config"):
        if key in spec and not (isinstance(spec[key], str) and spec[key]):
            raise doc.bad(key, "must be a non-empty string")
    if "config" not in spec:
        raise doc.error("config", "config is missing: a preset such as configs/tiny_prism.yaml (or prism_124m)")
    config_path = config.find_preset(spec["config"], doc.path.parent)
    if config_path is None:
        raise doc.bad("config", "no such YAML: give a path (relative to this spec or the cwd) or a preset name")
    overrides = spec.get("overrides")
    if not (overrides is None or isinstance(overrides, dict | list)):
        raise doc.bad("overrides", "use a mapping {dotted.key: value} or a list of 'dotted.key=value' strings")
    overrides = config.override_list(overrides)
    try:
        base = config.load(config_path, overrides)
    except ConfigError as e:
        raise doc.error("overrides" if overrides else "config", f"the base config does not load: {e}") from None
    if base.run.arm != "prism":
        raise doc.bad("config", "a schedule search needs a prism-arm config (the uniform arm has one schedule)")
    if not base.tracking.enabled:
        raise doc.error("overrides", "tracking.enabled is false: the search reads its trials' val loss from tracking")
    return config_path, overrides, base


def _space(
    doc: SpecFile, base: config.Config, overrides: list[str]
) -> tuple[list[str], str, tuple[float, float] | None]:
    """space: the schedules to try (and how the list was made), and the lr range when the search has one."""
    space = _mapping(doc, "space", SPACE_KEYS, required=True)
    schedules, schedules_from = expand_schedules(doc, base, space.get("schedules", ALL_VALID), overrides)
    if space.get("lr") is None:
        return schedules, schedules_from, None
    bounds = _mapping(doc, "space.lr", ("low", "high"), required=True)
    low, high = bounds.get("low"), bounds.get("high")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in (low, high)):
        raise doc.bad("space.lr", "give positive numbers low and high, e.g. {low: 3.0e-4, high: 3.0e-3}")
    if not low < high:
        raise doc.bad("space.lr", "low must be below high")
    return schedules, schedules_from, (float(low), float(high))


def _rungs(doc: SpecFile, batch: int) -> Rungs:
    """rungs: whole steps of the batch, the full budget min_tokens x reduction_factor^k (k >= 1)."""
    _mapping(doc, "rungs", RUNG_KEYS, required=True)
    for key in RUNG_KEYS:
        if key not in doc.data["rungs"]:
            raise doc.error("rungs", f"rungs.{key} is missing; rungs need {', '.join(RUNG_KEYS)}")
    rungs = Rungs(
        _positive_int(doc, "rungs.min_tokens"),
        _positive_int(doc, "rungs.reduction_factor", minimum=2),
        _positive_int(doc, "rungs.full_tokens"),
    )
    if rungs.min_tokens % batch:
        raise doc.bad("rungs.min_tokens", f"must be a whole number of steps of train.batch_tokens={batch}")
    if rungs.points[-1] != rungs.full_tokens or len(rungs.points) < 2:
        below = rungs.points[-2] if len(rungs.points) > 1 else rungs.min_tokens
        raise doc.bad(
            "rungs.full_tokens",
            f"must be min_tokens x reduction_factor^k with k >= 1 (e.g. {below:,} or {rungs.points[-1]:,})",
        )
    return rungs


def expand_schedules(doc: SpecFile, base: config.Config, value: Any, overrides: list[str]) -> tuple[list[str], str]:
    """all-valid | {stages: N, min_heads: H} (all-valid, filtered) | an explicit list. A listed schedule is
    read by config.load on the base config and its overrides, as `prism train` and `prism sweep` read it:
    preset names (paper-124m), either spelling, and schedule.allow_guideline_violations all hold."""
    m, p = base.model, base.parallel
    shape = f"d_model {m.d_model}, {m.num_layers} layers, h_base {m.h_base}, TP {p.tp}"
    if value == ALL_VALID or isinstance(value, dict):
        found = all_valid_schedules(base)
        how = f"all-valid for {shape}"
        if isinstance(value, dict):
            unknown = sorted(str(k) for k in value if k not in FILTER_KEYS)
            if unknown:
                raise doc.error(
                    f"space.schedules.{unknown[0]}",
                    f"unknown filter {unknown[0]!r}; allowed: {', '.join(FILTER_KEYS)}",
                    True,
                )
            for key in FILTER_KEYS:
                if key not in value:
                    continue
                wanted = value[key] if isinstance(value[key], list) else [value[key]]
                if not wanted or not all(is_int(w) and w >= 1 for w in wanted):
                    raise doc.bad(f"space.schedules.{key}", "must be a positive integer or a list of them")

                def measure(s: str, key: str = key) -> int:
                    heads = schedule.parse(s)
                    return len(schedule.stages(heads)) if key == "stages" else min(heads)

                found = [s for s in found if measure(s) in wanted]
            how += ", " + ", ".join(f"{k} in {value[k]}" for k in FILTER_KEYS if k in value)
        if not found:
            raise doc.bad("space.schedules", f"no valid schedule of {shape} passes; loosen the filter")
        return found, how
    if not (isinstance(value, list) and value and all(isinstance(s, str) for s in value)):
        raise doc.bad("space.schedules", f"use {ALL_VALID!r}, a filter {{stages: 3}} or a list of quoted schedules")
    out = []
    for text in value:
        try:
            out.append(config.load(base.source, [*overrides, f"schedule.heads={text}"]).schedule.heads)
        except ConfigError as e:
            raise doc.error("space.schedules", f"space.schedules: {text!r} does not fit the base config: {e}") from None
    if len(set(out)) != len(out):
        raise doc.bad("space.schedules", "lists a schedule twice")
    return out, "listed"


# --- what every run of the search is --------------------------------------------------------------------
def tracking_uri(spec: SearchSpec) -> str:
    """All trials log to one store: the base config's, or ``<folder>/mlflow.db`` when it names none."""
    from pipeline.tracking.store import resolve_uri

    return resolve_uri(spec.base.tracking.uri, spec.folder)


def run_overrides(spec: SearchSpec, folder: Path, experiment: str, extra: list[str]) -> list[str]:
    """The overrides of one run of the search: the spec's, its own folder (the data staying where it is), the
    shared store."""
    return [
        *spec.overrides,
        *config.relocate(spec.base, folder),
        f"tracking.uri={tracking_uri(spec)}",
        f"tracking.experiment={experiment}",
        f"train.train_tokens={spec.rungs.full_tokens}",
        *extra,
    ]


def val_every(spec: SearchSpec) -> int:
    """Validate at every rung: a step count dividing the first rung's (and so every rung's)."""
    return math.gcd(spec.base.train.val_every, spec.rungs.min_tokens // spec.base.train.batch_tokens)


def trial_overrides(spec: SearchSpec, number: int, sched: str, lr: float | None) -> list[str]:
    extra = [f"schedule.heads={sched}", f"train.val_every={val_every(spec)}"]
    if lr is not None:
        extra.append(f"train.lr={lr!r}")
    return run_overrides(spec, spec.folder / "trials" / trial_key(number), spec.name, extra)


def trial_key(number: int) -> str:
    return f"t{number:03d}"
